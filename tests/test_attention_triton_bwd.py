"""The Triton backward kernels (run in Triton's CPU interpreter) against the PyTorch reference.

Tolerance rule. The reference sums GEMMs and row sums in float64 and rounds once to FP32; the kernels
accumulate in FP32 in their own order. With ``m`` per gradient the larger of max|ref| and the size of one
term of its sum (dV: max|dO|, P ≤ 1; dQ: scale·max|dO|·max|V|·max|K|; dK the same with Q), so that a gradient
that cancels to ~0 (T = 1: dS = P·(dP − δ) with dP = δ exactly) is held to the rounding of its terms, not to 0:

* ``policy.backward == "fp32"`` with every forward rounding point FP32 (the ``fp32`` preset): close at
  rtol = 1e-4, atol = 1e-5·m (seen: |diff| <= 3e-7·m);
* ``policy.backward == "fp32"`` after a BF16 rounding point (``fa2``-like presets: BF16 P̄ or scores, FP32
  outputs and accumulators): >= 99% of the elements as close as that, and every element within 2**-7·m. An FP32
  ulp of S can flip a BF16 rounding of P by one ulp (2**-8 relative), which moves the elements that term feeds by
  about that much of the term: seen once with fresh inputs, dv off by 4.7e-5 where 1e-5·m allowed 3.8e-5;
* ``policy.backward == "bf16"``: at least 98% of each gradient's elements bit-identical to the
  reference and every element within |diff| <= 2**-6·|ref| + 2**-6·m (an FP32 ulp can flip one BF16
  rounding by an ulp, which then propagates through the BF16 accumulators). Seen: 100% identical at
  T <= 45 with small blocks, >= 99.9% at T = 130;
* ``delta = "o_fp32"`` / ``"o_exact"``: the reference recomputes O with its own forward (float64 for
  ``o_exact``), the kernels with the Triton forward, both under ``delta_o_policy``, so δ differs by FP32
  noise: the same rules, with the BF16 bound doubled (>= 95% identical, |diff| <= 2**-5·|ref| + 2**-5·m).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: no GPU here

import math
import zlib

import pytest
import torch

pytest.importorskip("triton")

from lpfa.attention import PRESETS  # noqa: E402
from lpfa.attention.policy import BF16  # noqa: E402
from lpfa.attention.reference import backward as ref_backward  # noqa: E402
from lpfa.attention.reference import forward as ref_forward  # noqa: E402
from lpfa.attention.triton_bwd import flash_backward  # noqa: E402

# padded rows/keys compute exp/log of garbage in the interpreter; they are masked and never stored
pytestmark = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    # the interpreter converts 1-element arrays with int(), which NumPy deprecates
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

BLOCKS = [(16, 16), (16, 32), (20, 20)]
SHAPES = [(1, 16, 1), (17, 16, 2), (40, 64, 1)]  # (T, D, B)


def _cases():
    for name in sorted(PRESETS):
        for T, D, B in SHAPES:
            if PRESETS[name].block_q is None:  # paper_untiled: one block over T
                yield name, None, T, D, B
            else:
                for blocks in BLOCKS:
                    yield name, blocks, T, D, B


def _inputs(B, H, T, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, T, D, generator=g).to(dtype) for _ in range(4))


def _term_sizes(q, k, v, do, scale):
    """The size of one term of dq, dk, dv's sums (see the module docstring)."""
    mx = [t.float().abs().max().item() for t in (q, k, v, do)]
    return scale * mx[3] * mx[2] * mx[1], scale * mx[3] * mx[2] * mx[0], mx[3]


def _rounds_to_bf16(policy) -> bool:
    """Whether any rounding point of the policy's forward is BF16 (what the backward recomputes from)."""
    return BF16 in (policy.scores, policy.p_bar, policy.o_block, policy.accumulator, policy.o_store)


def _check(grads, refs, policy, loose=False, terms=(0.0, 0.0, 0.0)):
    for gname, a, b, term in zip(("dq", "dk", "dv"), grads, refs, terms):
        assert a.shape == b.shape and a.dtype == torch.float32, gname
        m = max(b.abs().max().item(), term)
        if policy.backward != BF16:
            if not _rounds_to_bf16(policy):  # FP32 throughout: every element within FP32 summation-order noise
                torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * m, msg=lambda s: f"{gname}: {s}")
                continue
            # a BF16 rounding point upstream (scores, P̄, Ō, ...) can flip by one BF16 ulp where the kernel's FP32
            # sums and the reference's float64 ones round differently: rare elements, each off by about one ulp of a
            # term (2⁻⁸ relative); the rest within FP32 noise
            close = (a - b).abs() <= 1e-4 * b.abs() + 1e-5 * m
            assert close.double().mean() >= 0.99, f"{gname}: only {close.double().mean():.4%} within FP32 noise"
            assert ((a - b).abs() <= 2.0**-7 * m).all(), f"{gname}: an element beyond 2⁻⁷·max|ref|"
            continue
        same = (a == b).double().mean().item()
        frac, tol = (0.95, 2.0**-5) if loose else (0.98, 2.0**-6)
        assert same >= frac, f"{gname}: only {same:.4%} bit-identical to the reference"
        bad = (a - b).abs() > tol * b.abs() + tol * m
        assert not bad.any(), f"{gname}: {int(bad.sum())} elements beyond {tol}·|ref| + {tol}·max|ref|"


def _run(pol, B, T, D, seed, dtype=torch.bfloat16, scale=None, **launch):
    q, k, v, do = _inputs(B, 2, T, D, dtype, seed)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    o, lse = ref_forward(q.float(), k.float(), v.float(), pol, scale)
    grads = flash_backward(do, q, k, v, o, lse, pol, scale, **launch)
    refs = ref_backward(do.float(), q.float(), k.float(), v.float(), o, lse, pol, scale)
    return grads, refs, _term_sizes(q, k, v, do, scale)


@pytest.mark.parametrize("name,blocks,T,D,B", list(_cases()))
def test_matches_reference(name, blocks, T, D, B):
    pol = PRESETS[name]
    if blocks is not None:
        pol = pol.with_(block_q=blocks[0], block_k=blocks[1])
    grads, refs, terms = _run(pol, B, T, D, seed=zlib.crc32(repr((name, blocks, T, D)).encode()))
    _check(grads, refs, pol, terms=terms)


@pytest.mark.parametrize("formula", ["o_fp32", "o_exact"])
@pytest.mark.parametrize("name,blocks,T,D", [
    ("paper", (16, 16), 40, 16),
    ("paper", None, 40, 64),  # the preset's own 512 blocks: one block, compute tiles of 64 inside it
    ("fa2", None, 40, 64),
    ("paper_sfa", (16, 16), 40, 16),  # o_fp32 keeps SFA's row max in the recomputed O
])
def test_delta_o_fp32(formula, name, blocks, T, D):
    """δ = rowsum(dO∘O_hp), O_hp recomputed by the Triton forward under ``delta_o_policy`` (the forward's
    scores with FP32 P̄V and O, or all FP32)."""
    pol = PRESETS[name].with_(delta=formula)
    if blocks is not None:
        pol = pol.with_(block_q=blocks[0], block_k=blocks[1])
    grads, refs, terms = _run(pol, 1, T, D, seed=11)
    _check(grads, refs, pol, loose=True, terms=terms)


@pytest.mark.parametrize("name,bq,bk,T,D", [
    ("paper", 512, 512, 70, 16),  # one policy block, two 64-row/key compute tiles (and six empty ones)
    ("paper", 128, 64, 130, 16),  # two compute tiles per policy query block, policy blocks of each size
    ("fa2", 64, 128, 130, 16),
    ("delta_dp", 64, 128, 130, 16),
    ("paper", 64, 64, 256, 64),  # longer: BF16 one-ulp flips do occur here (~0.02% of elements)
    ("paper", 512, 512, 256, 64),
])
def test_compute_tiles_inside_policy_blocks(name, bq, bk, T, D):
    """Policy blocks that are multiples of 64 are split into 64-wide compute tiles: the rounded BF16
    accumulation must still happen once per policy block pair."""
    pol = PRESETS[name].with_(block_q=bq, block_k=bk)
    grads, refs, terms = _run(pol, 1, T, D, seed=5)
    _check(grads, refs, pol, terms=terms)


@pytest.mark.parametrize("name,T", [("fa2", 200), ("paper", 130)])
def test_launch_defaults_at_head_dim_128(name, T):
    """The D = 128 entries of ``triton_common.LAUNCHES``: fa2's 32-row query tiles against one 128-key tile, with the
    dQ kernel's own 128 × 32 tiles; paper's 32 × 64 tiles inside its 512-key blocks. The gradients keep the reference's
    values, with the BF16 accumulation once per policy block."""
    from lpfa.attention.triton_common import default_launch

    pol = PRESETS[name]
    d = default_launch("backward", pol, 128)
    assert (d.block_m, d.block_n, d.dq_block_m, d.dq_block_n) == ((32, 128, 128, 32) if name == "fa2" else
                                                                  (32, 64, None, None))
    grads, refs, terms = _run(pol, 1, T, 128, seed=17)
    _check(grads, refs, pol, terms=terms)


@pytest.mark.parametrize("name,bq,bk,T,dq_tiles", [
    ("paper", 64, 64, 100, (64, 16)),  # the dQ kernel's own tiles: many rows, few keys per step, inside 64-blocks
    ("fa2", 32, 32, 77, (32, 16)),
    ("paper_sfa", 48, 48, 100, (16, 32)),  # policy blocks not a multiple of the tiles: the last tile cut short
])
def test_dq_kernel_tiles_of_its_own(name, bq, bk, T, dq_tiles):
    """dq_block_m/dq_block_n give the dQ kernel other compute tiles than the dK/dV kernel's (launch tuning only): the
    gradients keep the reference's values under the same rule, with the BF16 accumulation once per policy block.
    (dq_mode="kernel": the launch table may order an FP32 backward's dQ inside the dK/dV kernel instead.)"""
    pol = PRESETS[name].with_(block_q=bq, block_k=bk)
    grads, refs, terms = _run(pol, 1, T, 32, seed=11, block_m=16, block_n=32, dq_block_m=dq_tiles[0],
                              dq_block_n=dq_tiles[1], dq_mode="kernel")
    _check(grads, refs, pol, terms=terms)
    same_tiles, _, _ = _run(pol, 1, T, 32, seed=11, block_m=dq_tiles[0], block_n=dq_tiles[1], dq_mode="kernel")
    assert torch.equal(grads[0], same_tiles[0])  # dQ is the dQ kernel's alone: its tiles, whatever dK/dV's


@pytest.mark.parametrize("name", ["fp32", "fp32_split", "fa2", "paper", "delta_dp"])
def test_fp32_inputs_and_odd_blocks(name):
    """FP32 inputs (not BF16-representable), non-power-of-two blocks, block_q != block_k."""
    pol = PRESETS[name].with_(block_q=12, block_k=20)
    grads, refs, terms = _run(pol, 1, 45, 32, seed=7, dtype=torch.float32, scale=0.2)
    _check(grads, refs, pol, terms=terms)


def test_after_triton_forward_and_preset_name():
    """o_store and lse from the Triton forward; the policy given by preset name."""
    from lpfa.attention.triton_fwd import flash_forward

    pol = PRESETS["paper"]
    q, k, v, do = _inputs(1, 2, 33, 16, torch.bfloat16, seed=9)
    o, lse = flash_forward(q, k, v, pol, 0.25)
    grads = flash_backward(do, q, k, v, o, lse, "paper", 0.25)
    refs = ref_backward(do.float(), q.float(), k.float(), v.float(), o, lse, pol, 0.25)
    _check(grads, refs, pol, terms=_term_sizes(q, k, v, do, 0.25))


def test_bad_inputs_raise():
    q = torch.randn(1, 2, 8, 16)
    lse = torch.zeros(1, 2, 8)
    with pytest.raises(ValueError, match=r"do must have shape \(1, 2, 8, 16\)"):
        flash_backward(q[0], q, q, q, q, lse, "fa2", 0.25)
    with pytest.raises(ValueError, match=r"lse must have shape \(1, 2, 8\)"):
        flash_backward(q, q, q, q, q, lse[0], "fa2", 0.25)
    with pytest.raises(ValueError, match="causal"):
        flash_backward(q, q, q, q, q, lse, "fa2", 0.25, causal=False)
    with pytest.raises(ValueError, match="fp32_heads"):
        flash_backward(q, q, q, q, q, lse, PRESETS["paper"].with_(fp32_heads=frozenset({0})), 0.25)
    with pytest.raises(ValueError, match="same shape"):
        flash_backward(q, q, q[:, :1], q, q, lse, "fa2", 0.25)
    with pytest.raises(ValueError, match="lse must have shape"):
        flash_backward(q, q, q, q, q, lse[:, :, :4], "fa2", 0.25)
    q48 = torch.randn(1, 1, 8, 48)
    with pytest.raises(ValueError, match="head_dim 48"):
        flash_backward(q48, q48, q48, q48, q48, torch.zeros(1, 1, 8), "fa2", 0.25)
    with pytest.raises(TypeError, match="dtype"):
        flash_backward(q.half(), q, q, q, q, lse, "fa2", 0.25)
    with pytest.raises(TypeError, match="lse has dtype"):
        flash_backward(q, q, q, q, q, lse.double(), "fa2", 0.25)
    with pytest.raises(TypeError, match="torch.Tensor"):
        flash_backward(q.numpy(), q, q, q, q, lse, "fa2", 0.25)
    with pytest.raises(ValueError, match="unknown precision policy"):
        flash_backward(q, q, q, q, q, lse, "nope", 0.25)
    with pytest.raises(ValueError, match="scale"):
        flash_backward(q, q, q, q, q, lse, "fa2", -1.0)
    with pytest.raises(ValueError, match="one device"):  # "meta": a second device without a GPU
        flash_backward(q, q, q, q, q.to("meta"), lse, "fa2", 0.25)


# ---- causal split: sub-tiles every pair of which is visible run without masks ------------------------------------


def _bits(t):
    """The FP32 bit patterns (NaN payloads included), for bit-identity checks."""
    return t.float().contiguous().view(torch.int32)


@pytest.fixture
def tile_paths(monkeypatch):
    """Counts the backward's (query, key) sub-tiles by path, dK/dV and dQ kernels together: ``{True: masked,
    False: unmasked}`` (calls of ``_p_and_ds``, whose ``visible`` is None on the unmasked path; wrapped in the
    interpreter, where jit helpers are plain Python)."""
    from collections import Counter

    from lpfa.attention import triton_bwd

    counts = Counter()
    orig = triton_bwd._p_and_ds

    def counting(*args, **kwargs):
        counts[args[6] is not None] += 1
        return orig(*args, **kwargs)

    monkeypatch.setattr(triton_bwd, "_p_and_ds", counting)
    return counts


# (preset, (block_q, block_k), T, block_m, block_n, unmasked sub-tiles expected)
BWD_SPLIT_CASES = [
    ("paper", (16, 16), 64, 16, 16, True),  # every tile aligned
    ("fp32", (32, 32), 17, 16, 16, True),  # one query row past a whole tile: dQ's only unmasked sub-tile
    ("fa2", (32, 32), 129, 32, 32, True),  # T = 4·32 + 1
    ("paper", (64, 32), 200, 32, 16, True),  # several tiles per policy block both ways, ragged T
    ("delta_dp", (32, 64), 90, 16, 32, True),  # block_q != block_k, δ = rowsum(dP∘P)
    ("paper_sfa", (16, 16), 50, 16, 16, True),
    ("paper", (16, 16), 1, 16, 16, False),  # T = 1
    ("fa2", (20, 20), 45, 16, 16, True),  # blocks of 20 cut into 16 + 4: the whole tiles unmasked below the diagonal
    ("fa2", (20, 20), 45, 32, 32, False),  # padded 32-wide tiles: masked always
    ("paper_untiled", (None, None), 40, 16, 16, True),  # one block over T, cut into 16 + 16 + 8 both ways
]


@pytest.mark.parametrize("name,blocks,T,block_m,block_n,split", BWD_SPLIT_CASES)
def test_causal_split_bit_identical(name, blocks, T, block_m, block_n, split, tile_paths):
    """The split kernels give the same bits as with every sub-tile masked, and match the reference (the dQ kernel's
    tiles among them: dq_mode="kernel", whatever the launch table orders)."""
    pol = PRESETS[name].with_(block_q=blocks[0], block_k=blocks[1])
    seed = torch.seed() % 2**31  # fresh inputs per run; named on failure
    q, k, v, do = _inputs(1, 2, T, 16, torch.bfloat16, seed)
    o, lse = ref_forward(q.float(), k.float(), v.float(), pol, 0.3)
    launch = dict(block_m=block_m, block_n=block_n, dq_mode="kernel")
    try:
        grads = flash_backward(do, q, k, v, o, lse, pol, 0.3, **launch)
        unmasked = tile_paths[False]
        assert (unmasked > 0) == split, (unmasked, tile_paths[True])
        grads_all = flash_backward(do, q, k, v, o, lse, pol, 0.3, causal_split=False, **launch)
        assert tile_paths[False] == unmasked, "causal_split=False took the unmasked path"
        for gname, a, b in zip(("dq", "dk", "dv"), grads, grads_all):
            assert torch.equal(_bits(a), _bits(b)), gname
        refs = ref_backward(do.float(), q.float(), k.float(), v.float(), o, lse, pol, 0.3)
        _check(grads, refs, pol, terms=_term_sizes(q, k, v, do, 0.3))
    except AssertionError as e:
        raise AssertionError(f"{e} (inputs: _inputs(1, 2, {T}, 16, torch.bfloat16, seed={seed}))") from e


@pytest.mark.parametrize("which", ["q", "k", "v", "do"])
def test_causal_split_nonfinite_in_unmasked_tiles(which, tile_paths):
    """NaN / ±inf in Q, K, V or dO where unmasked sub-tiles read them (and one in the ragged end): the same
    non-finite entries of dq, dk, dv as the reference, and the same bits as the all-masked kernels."""
    pol = PRESETS["paper"].with_(block_q=16, block_k=16)
    T = 56
    seed = torch.seed() % 2**31
    q, k, v, do = _inputs(1, 3, T, 16, torch.bfloat16, seed)
    t = {"q": q, "k": k, "v": v, "do": do}[which]
    for h, value in enumerate((math.nan, math.inf, -math.inf)):
        t[0, h, 3, h] = value  # tile 0: unmasked against tiles 1 .. 3
        t[0, h, 37, 4 + h] = value  # tile 2
        t[0, h, 54, 9] = value  # the ragged last tile
    o, lse = ref_forward(q.float(), k.float(), v.float(), pol, 0.3)
    launch = dict(block_m=16, block_n=16)
    try:
        grads = flash_backward(do, q, k, v, o, lse, pol, 0.3, **launch)
        assert tile_paths[False] > 0
        grads_all = flash_backward(do, q, k, v, o, lse, pol, 0.3, causal_split=False, **launch)
        refs = ref_backward(do.float(), q.float(), k.float(), v.float(), o, lse, pol, 0.3)
        for gname, a, b, r in zip(("dq", "dk", "dv"), grads, grads_all, refs):
            assert torch.equal(_bits(a), _bits(b)), gname
            assert torch.equal(torch.isfinite(a), torch.isfinite(r)), gname
    except AssertionError as e:
        raise AssertionError(f"{e} (inputs: _inputs(1, 3, {T}, 16, torch.bfloat16, seed={seed}))") from e


def test_grad_dtype_bf16_is_the_fp32_gradients_rounded():
    """``grad_dtype=torch.bfloat16`` (what the autograd op asks for with BF16 inputs) gives the FP32 gradients rounded
    to nearest even, bit for bit; anything but FP32 or BF16 is refused in one line."""
    pol = PRESETS["paper"].with_(block_q=16, block_k=16)
    seed = torch.seed() % 2**31
    q, k, v, do = _inputs(1, 2, 37, 16, torch.bfloat16, seed)
    o, lse = ref_forward(q.float(), k.float(), v.float(), pol, 0.3)
    want = flash_backward(do, q, k, v, o, lse, pol, 0.3)
    got = flash_backward(do, q, k, v, o, lse, pol, 0.3, grad_dtype=torch.bfloat16)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert a.dtype == torch.bfloat16, (name, seed)
        assert torch.equal(a.view(torch.int16), b.to(torch.bfloat16).view(torch.int16)), (name, seed)
    with pytest.raises(ValueError, match=r"grad_dtype=torch.float16: expected torch.float32 or torch.bfloat16"):
        flash_backward(do, q, k, v, o, lse, pol, 0.3, grad_dtype=torch.float16)


# each preset at one power of two (the fold does not depend on which): 1/8 is D = 64's scale, 1/4 D = 16's
@pytest.mark.parametrize("name,blocks,scale", [("fa2", 16, 0.125), ("paper", 32, 0.25), ("fa2_sfa", 16, 0.25),
                                               ("paper_sfa", 32, 0.125)])
def test_scale_fold_bit_identical(name, blocks, scale):
    """With a scale that is a power of two, the kernels keep S/scale and fold the scale into exp's argument
    (``triton_common._exp_scaled``); ``fold_scale=False`` scales every score first. Both must give the same bits,
    forward and backward: on ordinary scores, a peaked head (scores of ±100s: P̄ and P underflow), exact ties (SFA's
    branch), a head of scores so small that S·scale is subnormal, and ±inf in Q. T = 45 with 16-row compute tiles
    crosses whole and ragged blocks; blocks of 32 keys take two tiles (the row-max pass over raw Q Kᵀ)."""
    from lpfa.attention.triton_common import scale_folds
    from lpfa.attention.triton_fwd import flash_forward

    seed = torch.seed() % 2**31
    q, k, v, do = _inputs(1, 5, 45, 16, torch.float32, seed)
    q[:, 1] *= 40.0  # peaked: P̄, P underflow to subnormals and 0
    k[:, 2, 3:9] = k[:, 2, 2:3]  # keys 2..8 equal: exact ties in every row that sees them
    q[:, 3] *= 1e-20  # |Q Kᵀ| ~ 1e-39: S·scale subnormal
    k[:, 3] *= 1e-19
    q[:, 4, 7, 0] = math.inf
    q, k, v, do = (t.bfloat16() for t in (q, k, v, do))
    pol = PRESETS[name].with_(block_q=blocks, block_k=blocks)
    launch = dict(block_m=16, block_n=16)
    assert scale_folds(scale, pol)
    try:
        o, lse = flash_forward(q, k, v, pol, scale, **launch)
        o2, lse2 = flash_forward(q, k, v, pol, scale, fold_scale=False, **launch)
        assert torch.equal(_bits(o), _bits(o2)) and torch.equal(_bits(lse), _bits(lse2)), "forward"
        grads = flash_backward(do, q, k, v, o, lse, pol, scale, **launch)
        grads2 = flash_backward(do, q, k, v, o, lse, pol, scale, fold_scale=False, **launch)
        for gname, a, b in zip(("dq", "dk", "dv"), grads, grads2):
            assert torch.equal(_bits(a), _bits(b)), gname
    except AssertionError as e:
        raise AssertionError(f"{e} differs (scale={scale}, _inputs(1, 5, 45, 16, float32, seed={seed}))") from e


def test_scale_folds_only_where_exact():
    """The fold needs S·scale exact and the scores' rounding a function of S/scale: a power-of-two scale, rounding to
    nearest, no soft cap."""
    from lpfa.attention.triton_common import scale_folds

    fa2 = PRESETS["fa2"]
    assert scale_folds(0.125, fa2) and scale_folds(2.0**-5, PRESETS["paper"]) and scale_folds(1.0, fa2)
    assert not scale_folds(1 / math.sqrt(128), fa2) and not scale_folds(0.3, fa2)
    assert not scale_folds(0.125, fa2.with_(softcap=30.0))
    assert not scale_folds(0.125, PRESETS["paper"].with_(stochastic=frozenset({"scores"})))


# ---- dq_mode="ordered": dQ added by the dK/dV kernel in key-tile order ---------------------------------------------

# (preset, (block_q, block_k), T, B, block_m, block_n, input dtype): FP32 backwards only, tiles that divide the blocks
ORDERED_CASES = [
    ("fa2", (32, 32), 77, 2, 16, 32, torch.bfloat16),  # two sub-tiles per key tile, ragged T
    ("fa2", (32, 32), 1, 1, 16, 16, torch.bfloat16),  # T = 1: one sub-tile, its only key tile the last
    ("fa2_sfa", (32, 64), 90, 1, 16, 32, torch.bfloat16),  # block_q != block_k, two key tiles per policy block
    ("fp32_split", (16, 16), 45, 1, 16, 16, torch.float32),  # FP32 inputs, bf16x6 GEMMs (dS K split)
    ("fp32", (32, 32), 50, 1, 16, 32, torch.bfloat16),  # FP32 throughout: the tight rule
]


@pytest.mark.parametrize("name,blocks,T,B,block_m,block_n,dtype", ORDERED_CASES)
def test_ordered_dq_matches_the_reference_and_leaves_dk_dv_alone(name, blocks, T, B, block_m, block_n, dtype):
    """dq_mode="ordered": the dK/dV kernel adds each key tile's op(dS) K to dQ, tile after tile. dQ keeps the
    reference's values under the rule of the module docstring (the dK/dV kernel's S is Q Kᵀ summed in another order
    than the dQ kernel's, so a BF16 rounding of dS may flip: no tighter bound against that kernel holds everywhere);
    dK and dV are the default mode's bits; and with assume_finite (no redo launches) the bits are the same."""
    pol = PRESETS[name].with_(block_q=blocks[0], block_k=blocks[1])
    seed = torch.seed() % 2**31
    q, k, v, do = _inputs(B, 2, T, 16, dtype, seed)
    o, lse = ref_forward(q.float(), k.float(), v.float(), pol, 0.3)
    launch = dict(block_m=block_m, block_n=block_n)
    try:
        grads = flash_backward(do, q, k, v, o, lse, pol, 0.3, dq_mode="ordered", **launch)
        plain = flash_backward(do, q, k, v, o, lse, pol, 0.3, **launch)
        finite = flash_backward(do, q, k, v, o, lse, pol, 0.3, dq_mode="ordered", assume_finite=True, **launch)
        refs = ref_backward(do.float(), q.float(), k.float(), v.float(), o, lse, pol, 0.3)
        _check(grads, refs, pol, terms=_term_sizes(q, k, v, do, 0.3))
        for gname, a, b, c in zip(("dq", "dk", "dv"), grads, plain, finite):
            assert torch.equal(_bits(a), _bits(c)), f"{gname}: assume_finite changed bits"
            if gname != "dq":
                assert torch.equal(_bits(a), _bits(b)), f"{gname}: not the default mode's bits"
    except AssertionError as e:
        raise AssertionError(f"{e} (inputs: _inputs({B}, 2, {T}, 16, {dtype}, seed={seed}))") from e


@pytest.mark.parametrize("which", ["q", "k", "do"])
def test_ordered_dq_nonfinite_reaches_the_reference_rows(which):
    """An inf or NaN in Q, K or dO: dQ's non-finite entries are the reference's. A non-finite K, which the dK/dV
    kernel's plain dS K GEMM spreads to rows that cannot see its key, flags those sub-tiles, and the dQ kernel's redo
    launch computes them again on its exact path."""
    pol = PRESETS["fa2"].with_(block_q=32, block_k=32)
    seed = torch.seed() % 2**31
    q, k, v, do = _inputs(1, 3, 70, 16, torch.bfloat16, seed)
    t = {"q": q, "k": k, "do": do}[which]
    for h, value in enumerate((math.nan, math.inf, -math.inf)):
        t[0, h, 5, h] = value  # key tile 0, seen by every later row
        t[0, h, 40, 3 + h] = value
    o, lse = ref_forward(q.float(), k.float(), v.float(), pol, 0.3)
    grads = flash_backward(do, q, k, v, o, lse, pol, 0.3, dq_mode="ordered", block_m=16, block_n=32)
    refs = ref_backward(do.float(), q.float(), k.float(), v.float(), o, lse, pol, 0.3)
    for gname, a, r in zip(("dq", "dk", "dv"), grads, refs):
        assert torch.equal(torch.isfinite(a), torch.isfinite(r)), (gname, seed)


def test_ordered_dq_refuses_what_it_cannot_order():
    """dq_mode="ordered" names what it needs, in one line: an FP32 backward, and tiles that divide the policy blocks;
    an unknown mode is refused alike."""
    q = torch.randn(1, 1, 40, 16)
    lse = torch.zeros(1, 1, 40)
    with pytest.raises(ValueError, match=r"dq_mode='ordered' needs an FP32 backward .*got 'bf16'"):
        flash_backward(q, q, q, q, q, lse, "paper", 0.25, dq_mode="ordered")
    with pytest.raises(ValueError, match=r"block_k 20, block_n 16, block_q 20, block_m 16"):
        flash_backward(q, q, q, q, q, lse, PRESETS["fa2"].with_(block_q=20, block_k=20), 0.25, dq_mode="ordered",
                       block_m=16, block_n=16)
    with pytest.raises(ValueError, match=r"block_k 32, block_n 16, block_q 32, block_m 32"):  # sub-tile > key tile
        flash_backward(q, q, q, q, q, lse, PRESETS["fa2"].with_(block_q=32, block_k=32), 0.25, dq_mode="ordered",
                       block_m=32, block_n=16)
    with pytest.raises(ValueError, match=r"dq_mode='atomic': expected one of 'kernel', 'ordered'"):
        flash_backward(q, q, q, q, q, lse, "fa2", 0.25, dq_mode="atomic")


def test_the_launch_tables_ordered_dq_applies_where_it_can(monkeypatch):
    """A launch table entry with dq_mode="ordered" (Launch.dq_mode) orders dQ for an FP32 backward (no fast launch of
    the dQ kernel) and leaves a BF16 backward, which it cannot order, to the dQ kernel, without an error: the same bits
    as asking for each mode explicitly."""
    from lpfa.attention import triton_bwd, triton_common

    seed = torch.seed() % 2**31
    q, k, v, do = _inputs(1, 1, 40, 16, torch.bfloat16, seed)
    cases = {"fa2": "ordered", "paper": "kernel"}
    want = {}
    for name, mode in cases.items():
        pol = PRESETS[name].with_(block_q=16, block_k=16)
        o, lse = ref_forward(q.float(), k.float(), v.float(), pol, 0.25)
        want[name] = flash_backward(do, q, k, v, o, lse, pol, 0.25, block_m=16, block_n=16, dq_mode=mode)
    with triton_common.launches_changed("backward.dq_mode=ordered"):
        launched = []

        def recording(kernel, grid, *args, **meta):
            launched.append((kernel, meta.get("REDO")))
            return triton_common.launch(kernel, grid, *args, **meta)

        monkeypatch.setattr(triton_bwd, "launch", recording)
        for name, mode in cases.items():
            pol = PRESETS[name].with_(block_q=16, block_k=16)
            o, lse = ref_forward(q.float(), k.float(), v.float(), pol, 0.25)
            launched.clear()
            got = flash_backward(do, q, k, v, o, lse, pol, 0.25, block_m=16, block_n=16)
            assert ((triton_bwd._bwd_dq_kernel, False) in launched) == (mode == "kernel"), (name, launched)
            for gname, a, b in zip(("dq", "dk", "dv"), got, want[name]):
                assert torch.equal(_bits(a), _bits(b)), (name, gname, seed)


def test_a_changed_launch_table_applies_where_named_and_is_restored():
    """``launches_changed("PASS[@D].FIELD=VALUE", ...)``: the named pass's entries (at the named head dim, else both)
    take the value inside the block and the committed table is back after it, an exception included; the special D =
    128 launches are not the table's and stay. A malformed change is a one-line ValueError naming it."""
    from lpfa.attention import triton_common as tc

    committed = dict(tc.LAUNCHES)
    with pytest.raises(RuntimeError):
        with tc.launches_changed("backward.dq_mode=ordered", "forward@128.num_stages=3") as table:
            assert tc.LAUNCHES is table
            for key, entry in committed.items():
                kernel, _, dim = key
                want = (entry.dq_mode if kernel == "forward" else "ordered",
                        3 if key[0] == "forward" and dim == 128 else entry.num_stages)
                assert (table[key].dq_mode, table[key].num_stages) == want, key
                assert table[key].block_m == entry.block_m
            pol = PRESETS["fa2"]
            assert tc.default_launch("backward", pol, 64).dq_mode == "ordered"
            assert tc.default_launch("backward", pol, 128, fp32_inputs=True) == tc.FP32_INPUTS_128["backward"]
            raise RuntimeError
    assert tc.LAUNCHES == committed and tc.default_launch("backward", PRESETS["fa2"], 64).dq_mode == "kernel"
    for change, what in [("backward.dq_mode", "expected PASS"), ("sideways.num_warps=4", "expected PASS"),
                         ("forward@96.num_warps=4", "expected PASS"), ("forward.warps=4", "expected PASS"),
                         ("forward.num_warps=four", "expected an integer for num_warps"),
                         ("forward.num_warps=3", "num_warps=3: expected a power of two"),
                         ("backward.dq_mode=atomic", "dq_mode='atomic': expected one of 'kernel', 'ordered'")]:
        with pytest.raises(ValueError, match="^[^\n]+$") as e:
            tc.changed_launches([change])
        assert what in str(e.value), (change, str(e.value))
    assert tc.LAUNCHES == committed
