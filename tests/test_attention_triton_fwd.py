"""The Triton forward kernel (run in Triton's CPU interpreter) against the PyTorch reference.

Tolerance rule. The reference sums GEMMs and row sums in float64 and rounds once to FP32; the kernel
accumulates in FP32 in its own order. An FP32 difference of an ulp can flip a later BF16 rounding by
one BF16 ulp, so:

* lse: close at rtol = atol = 1e-5 where the scores and accumulators are FP32; with BF16 scores or
  accumulators a flipped rounding of a row's score, max or row sum moves that row's lse by up to a few 1e-2
  (seen: 6.6e-3 in 1 of 80 rows, paper_untiled at T = 40), so at most 2% of the rows (at least two) may be
  off by more than 1e-5, none by 0.05 or more;
* O of a policy that stores O in FP32 (``o_store == "fp32"``): close at rtol = atol = 1e-5;
* O of a policy that stores O in BF16: at least 99% of the elements bit-identical to the reference (or every
  difference inside as few rows as above: a flipped P̄ or row-max rounding moves one row of O; seen: 2 of 80
  rows, 98.9% of the elements),
  and every element within 2 BF16 ulps of itself plus 2**-8 of the largest |O| (|diff| <= 2**-6·|ref| +
  2**-8·max|ref|). The second term is for elements near 0 by cancellation: a flipped BF16 rounding of
  one P̄ entry moves Ō[T, i] by up to 2**-8·P̄·|V[t, i]|, which is small against the row's scale but not
  against such an element (seen with fa2_sfa at T = 40: |diff| = 8.5e-4 at |ref| = 4.8e-3, i.e. 6.4e-4 of
  max|ref|, in 2 of 60 seeds).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: no GPU here

import math

import pytest
import torch

pytest.importorskip("triton")

from lpfa.attention import PRESETS, SFA, AttentionStats  # noqa: E402
from lpfa.attention.policy import BF16  # noqa: E402
from lpfa.attention.reference import forward as ref_forward  # noqa: E402
from lpfa.attention.triton_common import _max_nan, _row_max, _row_top2, _top2, tl, triton  # noqa: E402
from lpfa.attention.triton_fwd import flash_forward  # noqa: E402

# padded rows (query >= T) divide 0/0 and take log(0) in the interpreter; they are never stored
pytestmark = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    # the interpreter converts 1-element arrays with int(), which NumPy deprecates
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


def _tiled(name):
    pol = PRESETS[name]
    return pol if pol.block_q is None else pol.with_(block_q=16, block_k=16)


def _check(o, lse, ro, rlse, policy):
    assert o.shape == ro.shape and o.dtype == (torch.bfloat16 if policy.o_store == BF16 else torch.float32)
    o = o.float()
    assert lse.shape == rlse.shape and lse.dtype == torch.float32
    rows = lse.numel()
    few = max(2, rows // 50)  # rare rows: 2%, and at least two in a small test
    if BF16 in (policy.scores, policy.accumulator):
        # an FP32-order difference can flip one BF16 rounding of a row's score, max or l (one BF16 ulp: 0.03 at
        # |S| ≈ 4, 2⁻⁸ of l): that row's lse moves by up to a few 1e-2 (seen: 6.6e-3 in 1 of 80 rows)
        off = (lse - rlse).abs()
        assert int((off > 1e-5).sum()) <= few and off.max() < 0.05, (int((off > 1e-5).sum()), off.max().item())
    else:
        torch.testing.assert_close(lse, rlse, rtol=1e-5, atol=1e-5)
    if policy.o_store != BF16:
        torch.testing.assert_close(o, ro, rtol=1e-5, atol=1e-5)
        return
    same = (o == ro).double().mean().item()
    rows_off = int((o != ro).flatten(0, -2).any(-1).sum())  # such a flip moves one whole row of O
    assert same >= 0.99 or rows_off <= few, \
        f"only {same:.4%} of O bit-identical to the reference ({rows_off} rows differ)"
    bad = (o - ro).abs() > 2.0**-6 * ro.abs() + 2.0**-8 * ro.abs().max()
    assert not bad.any(), f"{int(bad.sum())} elements of O beyond 2 BF16 ulps + 2**-8·max|O| from the reference"


def _inputs(B, H, T, D, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(B, H, T, D, generator=g).to(dtype) for _ in range(3))


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("T,D,B", [(1, 16, 1), (17, 16, 2), (40, 64, 1)])
def test_matches_reference(name, T, D, B):
    pol = _tiled(name)
    seed = hash((name, T, D)) % 2**31  # fresh inputs per process (str hashes are salted); named on failure
    q, k, v = _inputs(B, 2, T, D, torch.bfloat16, seed=seed)
    scale = 1.0 / math.sqrt(D)
    o, lse = flash_forward(q, k, v, pol, scale)
    ro, rlse = ref_forward(q.float(), k.float(), v.float(), pol, scale)
    try:
        _check(o, lse, ro, rlse, pol)
    except AssertionError as e:
        raise AssertionError(f"{e} (inputs: _inputs({B}, 2, {T}, {D}, torch.bfloat16, seed={seed}))") from e


@pytest.mark.parametrize("name", ["fp32", "fp32_split", "fa2", "paper"])
def test_fp32_inputs_and_odd_blocks(name):
    """FP32 inputs (not BF16-representable), non-power-of-two blocks, block_q != block_k, name lookup."""
    pol = PRESETS[name].with_(block_q=12, block_k=20)
    q, k, v = _inputs(1, 2, 45, 32, torch.float32, seed=7)
    o, lse = flash_forward(q, k, v, pol, 0.2)
    ro, rlse = ref_forward(q, k, v, pol, 0.2)
    _check(o, lse, ro, rlse, pol)
    if name == "fp32":  # a preset name works too (its own 128 blocks: one block here)
        o2, lse2 = flash_forward(q, k, v, "fp32", 0.2)
        ro2, rlse2 = ref_forward(q, k, v, PRESETS["fp32"], 0.2)
        _check(o2, lse2, ro2, rlse2, PRESETS["fp32"])


@pytest.mark.parametrize("name", ["paper_sfa", "fa2_sfa"])
def test_sfa_on_constructed_ties(name):
    """Keys repeated so that every row has exact ties at its max, with positive and negative maxima."""
    pol = _tiled(name).with_(sfa=SFA(beta=2.0, eps=1e-2))
    T, D = 33, 16
    g = torch.Generator().manual_seed(3)
    base = torch.randn(2, D, generator=g)
    k = base[torch.arange(T) % 2].reshape(1, 1, T, D).repeat(1, 2, 1, 1)  # keys alternate between two vectors
    q = torch.randn(1, 2, T, D, generator=g)
    q[:, 1] = -q[:, 1].abs()  # head 1: mostly other signs of the max
    v = torch.randn(1, 2, T, D, generator=g)
    q, k, v = (t.bfloat16() for t in (q, k, v))
    stats = AttentionStats()
    ro, rlse = ref_forward(q.float(), k.float(), v.float(), pol, 0.25, stats=stats)
    assert stats.tied_rows.sum() > T  # the SFA branch really is exercised
    o, lse = flash_forward(q, k, v, pol, 0.25)
    _check(o, lse, ro, rlse, pol)
    # the kernel followed the SFA branch: its running max is β·rm or 0, not rm, so its l changes
    # (l = exp(lse - m)) while lse stays the same function of the scores
    plain = pol.with_(sfa=None)
    o_plain, lse_plain = flash_forward(q, k, v, plain, 0.25)
    ro_plain, rlse_plain = ref_forward(q.float(), k.float(), v.float(), plain, 0.25)
    _check(o_plain, lse_plain, ro_plain, rlse_plain, plain)
    assert not torch.equal(o, o_plain)


@pytest.mark.parametrize("name", ["paper", "paper_sfa", "fa2_sfa", "fp32"])
@pytest.mark.parametrize("block, tile", [(32, 16), (64, 16)])
def test_policy_blocks_split_into_tiles(name, block, tile):
    """A policy block of several compute tiles: the block's row max (and SFA's count) come from a
    first pass over all its tiles, then P̄ and P̄V accumulate over them: same result as one tile."""
    pol = PRESETS[name].with_(block_q=block, block_k=block)
    if pol.sfa is not None:
        pol = pol.with_(sfa=SFA(beta=2.0, eps=1e-2))
    T, D = 70, 16
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    base = torch.randn(3, D, generator=g)
    k = base[torch.arange(T) % 3].reshape(1, 1, T, D).repeat(1, 2, 1, 1)  # ties in every row
    k[:, 0] = torch.randn(T, D, generator=g)  # head 0: generic scores
    q, v = torch.randn(1, 2, T, D, generator=g), torch.randn(1, 2, T, D, generator=g)
    q, k, v = (t.bfloat16() for t in (q, k, v))
    o, lse = flash_forward(q, k, v, pol, 0.3, block_m=16, block_n=tile)
    ro, rlse = ref_forward(q.float(), k.float(), v.float(), pol, 0.3)
    _check(o, lse, ro, rlse, pol)


def test_bad_inputs_raise():
    q = torch.randn(1, 2, 8, 16)
    with pytest.raises(ValueError, match="shape"):
        flash_forward(q[0], q[0], q[0], "fa2", 0.25)
    q48 = torch.randn(1, 1, 8, 48)
    with pytest.raises(ValueError, match="head_dim 48"):
        flash_forward(q48, q48, q48, "fa2", 0.25)
    with pytest.raises(ValueError, match="causal"):
        flash_forward(q, q, q, "fa2", 0.25, causal=False)
    with pytest.raises(ValueError, match="fp32_heads"):
        flash_forward(q, q, q, PRESETS["paper"].with_(fp32_heads=frozenset({0})), 0.25)
    with pytest.raises(ValueError, match="same shape"):
        flash_forward(q, q[:, :1], q, "fa2", 0.25)
    with pytest.raises(ValueError, match="unknown precision policy"):
        flash_forward(q, q, q, "nope", 0.25)


@pytest.mark.parametrize("block,T,preferred,want", [
    (512, 1024, 64, (512, 64, 8)),  # the paper's blocks: whole tiles
    (None, 1000, 64, (1000, 64, 16)),  # paper_untiled at T = 1000: 15 tiles of 64 and one of 40 keys
    (None, 100_000, 64, (100_000, 64, 1563)),  # any length: the tile stays 64 (no 2^17-key tile)
    (20, 45, 16, (20, 16, 2)),  # a block cut short: 16 + 4
    (20, 45, 32, (20, 32, 1)),  # a block shorter than the tile: one padded tile
    (5, 9, 64, (5, 16, 1)),  # at least MIN_TILE
    (128, 512, 128, (128, 128, 1)),
])
def test_policy_tiles_never_exceed_the_preferred_tile(block, T, preferred, want):
    """Policy blocks are cut into compute tiles of at most ``preferred`` keys whatever their length, so a long
    untiled block compiles as the tiled ones do (one 1024-key tile took minutes to compile and spilled)."""
    from lpfa.attention.triton_common import policy_tiles

    assert policy_tiles(block, T, preferred) == want


# ---- causal split: key tiles every row sees whole run without masks ---------------------------------------------


def _bits(t):
    """The FP32 bit patterns (NaN payloads included), for bit-identity checks."""
    return t.float().contiguous().view(torch.int32)


@pytest.fixture
def tile_paths(monkeypatch):
    """Counts the forward's key tiles by path: ``{True: masked, False: unmasked}`` (calls of ``_scores_tile``,
    which every pass over a tile makes; wrapped in the interpreter, where jit helpers are plain Python)."""
    from collections import Counter

    from lpfa.attention import triton_fwd

    counts = Counter()
    orig = triton_fwd._scores_tile

    def counting(*args, **kwargs):
        counts[bool(kwargs["MASKED"])] += 1
        return orig(*args, **kwargs)

    monkeypatch.setattr(triton_fwd, "_scores_tile", counting)
    return counts


# (preset, policy block, T, block_m, block_n): tile-aligned and ragged T, T below one tile, several query tiles,
# policy blocks of one tile, of several (N_SUB > 1: multi-pass row max), and a padded tile (block 20: tile 32)
SPLIT_CASES = [
    ("fa2", 16, 64, 16, 16),  # every tile aligned: T, query tiles, key tiles
    ("paper", 16, 17, 16, 16),  # one key past the last whole tile
    ("fa2", 32, 129, 32, 32),  # T = 4·32 + 1
    ("paper", 64, 200, 64, 16),  # four tiles per policy block, T ragged in the last block
    ("paper_sfa", 32, 129, 32, 16),  # SFA's tie count over unmasked and masked tiles of one block
    ("fa2_sfa", 16, 100, 32, 16),  # SFA, query tile of 32 over 16-key blocks: two diagonal blocks per tile
    ("paper", 16, 1, 16, 16),  # T = 1: no unmasked tile
    ("fa2", 20, 45, 16, 16),  # policy block 20 cut into 16 + 4 keys: the first tile unmasked below the diagonal
    ("fa2", 20, 45, 32, 32),  # policy block 20 in one padded 32-key tile: masked always
    ("paper_untiled", None, 40, 16, 16),  # one block over T, cut into tiles of 16, 16 and 8
]


@pytest.mark.parametrize("name,block,T,block_m,block_n", SPLIT_CASES)
def test_causal_split_bit_identical(name, block, T, block_m, block_n, tile_paths):
    """The split kernel (unmasked tiles below the diagonal, masked ones at it and at the ends) gives the same bits
    as the kernel with every tile masked, and matches the reference; the unmasked path runs wherever a whole
    tile lies below a query tile's first row."""
    pol = PRESETS[name] if block is None else PRESETS[name].with_(block_q=block, block_k=block)
    if pol.sfa is not None:
        pol = pol.with_(sfa=SFA(beta=2.0, eps=1e-2))
    seed = torch.seed() % 2**31  # fresh inputs per run; named on failure
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, T, 16, generator=g) for _ in range(3))
    k[:, 1] = torch.randn(3, 16, generator=g)[torch.arange(T) % 3]  # head 1: ties in every row (SFA's branch)
    q, k, v = (t.bfloat16() for t in (q, k, v))
    launch = dict(block_m=block_m, block_n=block_n)
    try:
        o, lse = flash_forward(q, k, v, pol, 0.3, **launch)
        unmasked = tile_paths[False]
        o_all, lse_all = flash_forward(q, k, v, pol, 0.3, causal_split=False, **launch)
        assert tile_paths[False] == unmasked, "causal_split=False took the unmasked path"
        assert torch.equal(_bits(o), _bits(o_all)) and torch.equal(_bits(lse), _bits(lse_all))
        ro, rlse = ref_forward(q.float(), k.float(), v.float(), pol, 0.3)
        _check(o, lse, ro, rlse, pol)
        # a tile is unmasked when it is whole inside one policy block (not padded, not cut short by the block's end)
        # and ends at or before the first row of a query tile, e.g. of the last one
        whole = (T if block is None else block) >= block_n and (T - 1) // block_m * block_m >= block_n - 1
        assert (unmasked > 0) == whole, (unmasked, tile_paths[True])
    except AssertionError as e:
        raise AssertionError(f"{e} (seed={seed})") from e


@pytest.mark.parametrize("name", ["fa2", "paper_sfa"])
def test_causal_split_nonfinite_v_in_unmasked_tile(name, tile_paths):
    """NaN / ±inf in V at keys that later query tiles see through unmasked tiles (and one in the ragged last tile):
    they reach exactly the rows that see them, as in the reference, and the bits match the all-masked kernel."""
    pol = PRESETS[name].with_(block_q=16, block_k=16)
    T = 70
    seed = torch.seed() % 2**31
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 3, T, 16, generator=g).bfloat16() for _ in range(3))
    for h, value in enumerate((math.nan, math.inf, -math.inf)):
        v[0, h, 5, h] = value  # key tile 0: unmasked for query tiles 1 .. 4
        v[0, h, 40, 3 + h] = value  # key tile 2: unmasked for query tiles 3, 4
        v[0, h, 65, 7] = value  # the ragged last tile: masked
    launch = dict(block_m=16, block_n=16)
    try:
        o, lse = flash_forward(q, k, v, pol, 0.3, **launch)
        assert tile_paths[False] > 0
        o_all, lse_all = flash_forward(q, k, v, pol, 0.3, causal_split=False, **launch)
        assert torch.equal(_bits(o), _bits(o_all)) and torch.equal(_bits(lse), _bits(lse_all))
        ro, _ = ref_forward(q.float(), k.float(), v.float(), pol, 0.3)
        assert torch.equal(torch.isfinite(o.float()), torch.isfinite(ro))
        assert torch.isfinite(o[:, :, :5]).all() and not torch.isfinite(o[:, :, 5:]).all(dim=-1).any()
    except AssertionError as e:
        raise AssertionError(f"{e} (seed={seed})") from e


# ---- SFA's tie test from the row-max pass: the second largest score instead of a counting pass ---------------------


SFA_P = 32  # the period of _sfa_tie_inputs' structure: two 16-key compute tiles per 32-key policy block


def _sfa_tie_inputs(T, D, g):
    """Heads built to stress SFA's test "more than one visible score within ε of the block's row max" in 32-key
    blocks of 16-key tiles (period ``SFA_P``): 0 generic; 1 exact ties in one tile and across tiles (keys repeat every
    11: a row that sees 22 keys of a block has its maximum twice); 2 near-ties either side of ε: the row max at key 4
    of each block and a second key in the block's other tile (key 20) one or three BF16 steps below it, i.e. 0.47·ε or
    1.4·ε below in score; 3 one dominant key at the start of each block, unique there (rows at a block's start see
    only it); 4 all-equal keys in each block (every score tied), block 0's 0.75 times the others', scores so large
    that SFA's shift silences a tied block (each block's own tie decision shows in O, also under an earlier block's
    larger shifted max); 5 ±inf in q (visible −inf scores, rows of −inf scores only, NaN rows); 6 a block whose
    visible scores are all −inf. Returns q, k (FP32, BF16-representable) and ε."""
    eps, P = 1e-2, SFA_P
    q = torch.randn(1, 7, T, D, generator=g)
    k = torch.randn(1, 7, T, D, generator=g)
    k[:, 1] = torch.randn(11, D, generator=g)[torch.arange(T) % 11]
    e0 = torch.zeros(D)
    e0[0] = 4.0
    q[:, 2] = e0  # S = 0.3·4·k[..., 0]: exact in BF16 steps of k
    k[:, 2] = 0.1 * torch.randn(T, D, generator=g)
    k[:, 2, 4::P, 0] = 0.75
    steps = torch.tensor([1.0, 3.0])[torch.arange(len(range(20, T, P))) % 2]  # BF16 spacing at 0.75 is 2^-8
    k[:, 2, 20::P, 0] = 0.75 - steps * 2.0**-8
    base = torch.randn(D, generator=g)
    q[:, 3] = 2 * base
    k[:, 3, ::P] = base
    k[:, 4] = base
    # block 0's tie at S ≈ 30, the later blocks' at S ≈ 40: below block 0's shifted max (β·30), above its own; with
    # (β − 1)·S > 23 a tied block's l is clamped, so each block's own tie decision shows in O
    k[:, 4, :P] = 0.75 * base
    q[:, 4] = base * (40.0 / (0.3 * float(base @ base)))
    q[:, 5, 3::7, 0] = -math.inf
    q[:, 5, 5::11, 1] = math.inf
    # head 6: distinct negative scores −0.3·(1 + (j mod P)/16) (no ties), but keys P and P + 1 score −inf: row P + 1
    # sees two visible keys of block 1, both −inf (the reference counts both as within ε of the max −inf: tied)
    q[:, 6], k[:, 6] = 0.0, 0.0
    q[:, 6, :, 0] = -1.0
    k[:, 6, :, 0] = 1.0 + (torch.arange(T) % P) / 16
    k[:, 6, P:P + 2, 0] = math.inf
    return q, k, eps


# both SFA presets at one block; at T = 75 each preset with one block size: the top-two code is the presets' one
# inner loop (they differ in rounding points, which every other test here covers), so a block size per preset is
# enough to cross one and two compute tiles per policy block
@pytest.mark.parametrize("name,T,block", [("paper_sfa", SFA_P, SFA_P), ("fa2_sfa", SFA_P, SFA_P),
                                          ("paper_sfa", 75, SFA_P), ("fa2_sfa", 75, 16)])
def test_sfa_top_two_matches_the_counting_pass(name, T, block):
    """The forward decides SFA's ties from the top two scores of its row-max pass (one reduction per tile); the
    reference (and ``sfa_count_pass=True``) count the scores within ε of the max in a pass of their own. Policy
    blocks of 32 keys span two 16-key compute tiles, blocks of 16 one. The two kernels must give the same bits on exact
    ties inside and across tiles, near-ties either side of ε, rows that see one key of a block, all-tied rows and ±inf
    scores, and match the reference on the finite rows; so must the row-max pass that rounds every score against the
    default one, which rounds only the raw top two (``raw_max``). T = 75 is the smallest shape with whole blocks, a
    ragged last block (11 keys), several query tiles and causal rows that see one, two and three blocks; T = 32 is one
    block."""
    seed = torch.seed() % 2**31
    g = torch.Generator().manual_seed(seed)
    D = 16
    q, k, eps = _sfa_tie_inputs(T, D, g)
    v = torch.randn(1, 7, T, D, generator=g)
    for beta, e in ((2.0, eps), (1.5, 0.0)):  # ε = 0: exact ties only
        pol = PRESETS[name].with_(block_q=block, block_k=block, sfa=SFA(beta=beta, eps=e))
        qb, kb, vb = (t.bfloat16() for t in (q, k, v))
        try:
            o, lse = flash_forward(qb, kb, vb, pol, 0.3, block_m=16, block_n=16)
            o2, lse2 = flash_forward(qb, kb, vb, pol, 0.3, block_m=16, block_n=16, sfa_count_pass=True)
            assert torch.equal(_bits(o), _bits(o2)) and torch.equal(_bits(lse), _bits(lse2)), \
                f"top-2 and counting pass differ in {int((_bits(o) != _bits(o2)).any(-1).sum())} rows"
            # the top two from the raw Q Kᵀ, rounded after the pass, against every score rounded first
            o3, lse3 = flash_forward(qb, kb, vb, pol, 0.3, block_m=16, block_n=16, raw_max=False)
            assert torch.equal(_bits(o), _bits(o3)) and torch.equal(_bits(lse), _bits(lse3)), \
                f"raw and rounded row-max pass differ in {int((_bits(o) != _bits(o3)).any(-1).sum())} rows"
            stats = AttentionStats()
            ro, rlse = ref_forward(qb.float(), kb.float(), vb.float(), pol, 0.3, stats=stats)
            tied = stats.sfa_rows[0]
            # exact ties take SFA's branch (head 1: keys repeat every 11)
            assert tied[4] > 0 and tied[1] > 0
            assert e == 0 or block < SFA_P or 0 < tied[2] < T  # near-ties: some rows within ε, some not
            _check(o[:, :5], lse[:, :5], ro[:, :5], rlse[:, :5], pol)  # head 5: nonfinite, by the bits above
            assert torch.equal(torch.isnan(o[:, 5:].float()), torch.isnan(ro[:, 5:]))
        except AssertionError as err:
            raise AssertionError(f"{err} (seed={seed}, beta={beta}, eps={e})") from err


def test_softcap_row_max_from_the_raw_scores_equals_capping_every_score():
    """Under a soft-cap the row-max pass over a policy block of two compute tiles takes the raw Q Kᵀ and caps only
    each row's top two values (``raw_row_max``; SFA's top two hold the row max's path too): the bits must equal capping
    every score first (``raw_max=False``), on four of _sfa_tie_inputs' heads with a cap of 4: exact ties (head 1),
    blocks that saturate into ties at the cap (head 4's scores lie far above it), ±inf scores (5) and blocks whose
    visible scores are all −inf (6: the cap maps them to −4, rows that see one key of a block keep r2 = −inf); and the
    finite heads must match the reference."""
    from lpfa.attention.triton_fwd import raw_row_max

    seed = torch.seed() % 2**31
    g = torch.Generator().manual_seed(seed)
    T, D = 75, 16
    q, k, eps = _sfa_tie_inputs(T, D, g)
    heads = [1, 4, 5, 6]  # the first two finite
    q, k = q[:, heads], k[:, heads]
    v = torch.randn(1, len(heads), T, D, generator=g)
    pol = PRESETS["paper_softcap"].with_(block_q=SFA_P, block_k=SFA_P, softcap=4.0, sfa=SFA(beta=2.0, eps=eps))
    assert raw_row_max(True, pol, 2, precise_math=False)  # the interpreter's tanh: the raw pass is the one tested
    qb, kb, vb = (t.bfloat16() for t in (q, k, v))
    o, lse = flash_forward(qb, kb, vb, pol, 0.3, block_m=16, block_n=16)
    o2, lse2 = flash_forward(qb, kb, vb, pol, 0.3, block_m=16, block_n=16, raw_max=False)
    assert torch.equal(_bits(o), _bits(o2)) and torch.equal(_bits(lse), _bits(lse2)), \
        f"raw and capped row-max pass differ in {int((_bits(o) != _bits(o2)).any(-1).sum())} rows (seed={seed})"
    ro, rlse = ref_forward(qb.float(), kb.float(), vb.float(), pol, 0.3)
    _check(o[:, :2], lse[:, :2], ro[:, :2], rlse[:, :2], pol)
    assert torch.equal(torch.isnan(o[:, 2:].float()), torch.isnan(ro[:, 2:]))


def test_kernel_tanh_is_non_decreasing_on_every_bf16_value():
    """The soft-cap's row max from the raw scores needs the kernels' own tanh non-decreasing on the BF16 scores, not
    only the reference's (tests/test_softcap.py): the interpreter's exp2 is not the reference's (it rounds exp2 of
    −3.4e-8 down to 1 − 2⁻²⁴, torch to 1), so its order is checked on all 2¹⁶ BF16 values here, libdevice's on the GPU
    by tests/test_attention_gpu.py."""
    from lpfa.attention.triton_common import kernel_tanh
    from lpfa.bf16 import every_bf16

    x = every_bf16()
    t = kernel_tanh(x)
    assert (t[1:] >= t[:-1]).all(), f"the kernels' tanh decreases after x = {x[:-1][t[1:] < t[:-1]][:5].tolist()}"
    assert t[0] == -1 and t[-1] == 1 and ((t - x.tanh()).abs() <= 2.0**-22).all()


def test_exp2_policy_takes_the_fma_at_the_row_max():
    """``exp="exp2"`` (FlashAttention-2's exp2(fma(S, log₂e, −fl(m·log₂e)))): in row 0, whose one visible score is its
    max m, P̄ = exp2 of the rounding error of fl(m·log₂e), not exp(0) = 1, so lse = m + log P̄ moves m by an ulp. The
    four m are chosen where that error is largest (P̄ = 1 − 2⁻²⁴ three times, 1 + 2⁻²³ once); the kernel must give
    the reference's lse bit for bit there, and exp(S − m) must leave lse = m."""
    ms = torch.tensor([2916 / 4096, 2977 / 4096, 3038 / 4096, 90 / 64])  # exact in FP32; S = (2m)·2·scale = m
    H, T, D = len(ms), 16, 16
    q, k, v = _inputs(1, H, T, D, torch.float32, seed=torch.seed() % 2**31)
    q[0, :, 0], k[0, :, 0] = 0.0, 0.0
    q[0, :, 0, 0], k[0, :, 0, 0] = 2 * ms, 2.0
    pol = PRESETS["fp32"].with_(exp="exp2", block_q=16, block_k=16)
    _, lse = flash_forward(q, k, v, pol, 0.25)
    _, rlse = ref_forward(q, k, v, pol, 0.25)
    _, rlse_exp = ref_forward(q, k, v, pol.with_(exp="exp"), 0.25)
    assert torch.equal(rlse_exp[0, :, 0], ms)
    assert (rlse[0, :, 0] != ms).all()
    assert torch.equal(lse[0, :, 0], rlse[0, :, 0])
    torch.testing.assert_close(lse, rlse, rtol=1e-5, atol=1e-5)


if triton is not None:

    @triton.jit
    def _reductions_kernel(X, OUT, N: tl.constexpr):
        """Row max and top two of an (N, N) tile, as the GPU computes them (reductions with the combine functions
        of triton_common) and as the kernels do here (the interpreter's built-in reductions)."""
        offs = tl.arange(0, N)
        x = tl.load(X + offs[:, None] * N + offs[None, :])
        gpu_max = tl.reduce(x, 1, _max_nan)
        gpu_1, gpu_2 = tl.reduce((x, tl.full(x.shape, float("-inf"), tl.float32)), 1, _top2)
        here_max = _row_max(x)
        here_1, here_2 = _row_top2(x)
        for i, r in enumerate((gpu_max, gpu_1, gpu_2, here_max, here_1, here_2)):
            tl.store(OUT + i * N + offs, r)


def test_row_reductions_equal_the_gpus_combine_functions():
    """Under the interpreter the kernels take the row max and the top two from built-in reductions (a reduction
    with a combine function of its own runs element by element in Python there). Both must give the combine
    functions' values, which the GPU uses, on rows with exact ties (the max held twice, thrice, everywhere), ±inf,
    all −inf, NaN and random values: bit for bit, except the second value of a row holding NaN (the tie test ignores
    it, since the max is NaN)."""
    N = 16
    x = torch.randn(N, N, generator=torch.Generator().manual_seed(torch.seed() % 2**31))
    x[1, 3] = x[1, 9] = x[1].max() + 1  # the max held twice
    x[2, :3] = x[2].max() + 1  # three times
    x[3] = 0.5  # everywhere
    x[4, 5] = math.inf
    x[5, 2] = x[5, 7] = math.inf
    x[6] = -math.inf
    x[7, 4:] = -math.inf  # the max among a few finite values
    x[8, 6] = math.nan
    x[9] = math.nan
    x[10, 0], x[10, 1] = math.inf, math.nan
    x[11, 11] = -math.inf  # one −inf in a finite row
    x[12, 0] = x[12].max() + 1  # the max once, the second largest in a later column
    x[12, 15] = x[12, 0] - 2**-20
    out = torch.empty(6, N)
    _reductions_kernel[(1,)](x, out, N=N)
    gpu_max, gpu_1, gpu_2, here_max, here_1, here_2 = (_bits(r) for r in out)
    nan_rows = x.isnan().any(1)
    assert torch.equal(gpu_max, here_max) and torch.equal(gpu_1, here_1) and torch.equal(gpu_max, gpu_1)
    assert out[0][nan_rows].isnan().all() and not out[0][~nan_rows].isnan().any()
    assert torch.equal(gpu_2[~nan_rows], here_2[~nan_rows])
    top2 = x[~nan_rows].sort(1, descending=True).values[:, :2]  # the max and the second largest, ties counted
    assert torch.equal(out[1][~nan_rows], top2[:, 0]) and torch.equal(out[2][~nan_rows], top2[:, 1])


@pytest.mark.parametrize("name,T", [("fa2", 200), ("paper", 130)])
def test_launch_defaults_at_head_dim_128(name, T):
    """The D = 128 entries of ``triton_common.LAUNCHES`` (fa2: one 128 × 128 tile with 8 warps; paper: 64 × 64 inside
    its 512-key blocks) keep the reference's O and lse: launch tuning moves no rounding point."""
    from lpfa.attention.triton_common import default_launch

    pol = PRESETS[name]
    d = default_launch("forward", pol, 128)
    assert (d.block_m, d.block_n) == ((128, 128) if name == "fa2" else (64, 64))
    q, k, v = _inputs(1, 2, T, 128, torch.bfloat16, seed=13)
    o, lse = flash_forward(q, k, v, pol, 128 ** -0.5)
    ro, rlse = ref_forward(q.float(), k.float(), v.float(), pol, 128 ** -0.5)
    _check(o, lse, ro, rlse, pol)


@pytest.mark.parametrize("option,value", [("block_m", 48), ("block_n", 8), ("num_warps", 3), ("num_stages", 0),
                                          ("block_m", 64.0)])
def test_launch_options_outside_what_triton_compiles_raise_one_line(option, value):
    """A compute tile that is no power of two of at least 16, warps that are no power of two, or no pipeline stage:
    a one-line ValueError naming the option, from the forward and from the backward (and its dQ tiles)."""
    from lpfa.attention.triton_bwd import flash_backward

    q, k, v = _inputs(1, 1, 8, 16, torch.float32, seed=0)
    with pytest.raises(ValueError, match=f"^{option}={value!r}: expected [^\n]+$"):
        flash_forward(q, k, v, "fa2", 0.25, **{option: value})
    o, lse = flash_forward(q, k, v, "fa2", 0.25)
    with pytest.raises(ValueError, match=f"^{option}={value!r}: expected [^\n]+$"):
        flash_backward(q, q, k, v, o, lse, "fa2", 0.25, **{option: value})
    if option.startswith("block"):
        with pytest.raises(ValueError, match=f"^dq_{option}={value!r}: expected"):
            flash_backward(q, q, k, v, o, lse, "fa2", 0.25, **{f"dq_{option}": value})
