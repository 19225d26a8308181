"""``gemm="bf16x6"`` (the ``fp32_split`` preset, the fast FP32 twin): the 3-way BF16 split, its GEMM, the
kernels (Triton's CPU interpreter) against the reference, and the error study against float64.

The split and the GEMM are checked bit for bit where the arithmetic is exact (the split itself; GEMMs of constructed
inputs whose FP32 sums are exact), the kernels against the reference by the FP32 tolerance rules of
``tests/test_attention_triton_fwd.py`` / ``_bwd.py`` (FP32 accumulation order), and the causal split of the kernels
bit for bit. The error study measures O, lse, dq, dk, dv against float64 on fresh seeded inputs for ``fp32``
(IEEE FP32 GEMMs), ``fp32_split`` and ``fa2`` (BF16 P̄ and O): the split stays within 4× of true FP32 and far
below BF16 (measured on the interpreter: the split's errors are 0.3–1.3× FP32's, 1e-7-ish, fa2's 1e-3-ish).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: no GPU here

import math

import pytest
import torch

pytest.importorskip("triton")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from lpfa.attention import PRESETS, PrecisionPolicy  # noqa: E402
from lpfa.attention.accuracy import errors_vs_float64  # noqa: E402
from lpfa.attention.policy import FP32_POLICY  # noqa: E402
from lpfa.attention.reference import _mm, split3  # noqa: E402
from lpfa.attention.reference import backward as ref_backward  # noqa: E402
from lpfa.attention.reference import forward as ref_forward  # noqa: E402
from lpfa.attention.triton_bwd import flash_backward  # noqa: E402
from lpfa.attention.triton_common import _dot, _split3, gemm_mode  # noqa: E402
from lpfa.attention.triton_fwd import flash_forward  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]

SPLIT = PRESETS["fp32_split"]


def _bits(t):
    return t.float().contiguous().view(torch.int32)


def _is_bf16(t):
    return torch.equal(_bits(t.to(torch.bfloat16).float()), _bits(t))


# ---- the policy field ---------------------------------------------------------------------------------------------


def test_preset_and_validation():
    assert SPLIT == FP32_POLICY.with_(gemm="bf16x6", name="fp32_split")
    assert FP32_POLICY.gemm == "ieee"
    assert all(p.gemm == "ieee" for n, p in PRESETS.items() if n not in ("fp32_split", "fp32_softcap"))
    for bad in ("tf32", "BF16X6", None, 6):
        with pytest.raises(ValueError, match=r"^PrecisionPolicy\.gemm=.*: expected 'ieee' "
                                             r"\(exact FP32 products\) or 'bf16x6'") as e:
            PrecisionPolicy(gemm=bad)
        assert "\n" not in str(e.value)
    assert gemm_mode("ieee", True, True, True) == 1 and gemm_mode("ieee", True, False, True) == 0
    assert gemm_mode("bf16x6", True, False, True) == 3 and gemm_mode("bf16x6", False, False, False) == 6
    assert gemm_mode("bf16x6", True, True, True) == 1  # both BF16: the plain BF16 GEMM


# ---- the split and the GEMM, element by element -------------------------------------------------------------------


if triton is not None:

    @triton.jit
    def _split_kernel(X, X0, H, X1, X2, N: tl.constexpr):
        offs = tl.arange(0, N)
        x0, h, x1, x2 = _split3(tl.load(X + offs))
        tl.store(X0 + offs, x0)
        tl.store(H + offs, h)
        tl.store(X1 + offs, x1)
        tl.store(X2 + offs, x2)

    @triton.jit
    def _gemm_kernel(A, B, C, M: tl.constexpr, K: tl.constexpr, N: tl.constexpr, MODE: tl.constexpr):
        a = tl.load(A + tl.arange(0, M)[:, None] * K + tl.arange(0, K)[None, :])
        b = tl.load(B + tl.arange(0, K)[:, None] * N + tl.arange(0, N)[None, :])
        tl.store(C + tl.arange(0, M)[:, None] * N + tl.arange(0, N)[None, :], _dot(a, b, MODE))


def _wide_values(n, seed):
    """FP32 values over a wide exponent range (2⁻¹⁰⁰ … 2¹⁰⁰, times N(0, 1), so now and then below 2⁻¹¹⁰), both signs,
    plus the special values and the edge of the split's exact range: 2⁻¹¹⁰ (exact), a value of CI's that is not
    (1.723e-34 ≈ 2⁻¹¹²·¹⁶: its x2 falls below BF16's subnormals) and FP32 subnormals."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp2(torch.randint(-100, 100, (n,), generator=g).float())
    x[:8] = torch.tensor([0.0, -0.0, 1.0, 1 + 2**-23, -(2 - 2**-23), math.inf, -math.inf, math.nan])
    x[8:14] = torch.tensor([2.0**-110 * (1 + 2**-23), -(2.0**-110), 1.7230066734510623e-34, 2.0**-126, 1e-40,
                            -(2.0**-149)])
    return x


# x = x0 + x1 + x2 exactly from here up (GEMM_SPLIT_DOC): x's last bit is then ≥ 2⁻¹³³, BF16's least
EXACT_FROM = 2.0**-110


def test_split3_exact_and_kernel_bit_identical():
    """x = x0 + x1 + x2 exactly for |x| ≥ 2⁻¹¹⁰ (below, x2 would need bits under BF16's smallest subnormal 2⁻¹³³, so the
    sum is off by at most 2⁻¹³⁴), each part BF16, |x1| ≤ 2⁻⁸|x|, |x2| ≤ 2⁻¹⁶|x|; non-finite x: (x, 0, 0, 0); the
    kernel's split has the reference's bits."""
    seed = torch.seed() % 2**31
    x = _wide_values(1024, seed)
    x0, h, x1, x2 = split3(x)
    fin = torch.isfinite(x)
    for part in (x0, h, x1, x2):
        assert _is_bf16(part[fin]), seed
    total = x0.double() + x1.double() + x2.double()
    exact = fin & ((x.abs() >= EXACT_FROM) | (x == 0))
    assert torch.equal(total[exact], x[exact].double()), seed
    assert ((total[fin & ~exact] - x[fin & ~exact].double()).abs() <= 2.0**-134).all(), seed
    assert not torch.equal(total[10], x[10].double())  # the value CI met: its split is not exact, and need not be
    assert (x1[fin].abs() <= 2.0**-8 * x[fin].abs()).all() and (x2[fin].abs() <= 2.0**-16 * x[fin].abs()).all(), seed
    assert torch.equal(x0[~fin].nan_to_num(0.5), x[~fin].nan_to_num(0.5)) and not (h[~fin] != 0).any()
    assert not (x1[~fin] != 0).any() and not (x2[~fin] != 0).any()
    outs = [torch.empty_like(x) for _ in range(4)]
    _split_kernel[(1,)](x, *outs, N=1024)
    for name, a, b in zip(("x0", "h", "x1", "x2"), outs, (x0, h, x1, x2)):  # NaN payloads aside
        assert torch.equal(torch.isnan(a), torch.isnan(b)), (name, seed)
        assert torch.equal(_bits(a.nan_to_num(0.5)), _bits(b.nan_to_num(0.5))), (name, seed)


def _three_part(n, g):
    """FP32 values x = ±(x0 + x1 + x2), |x| in [1, 2), whose split parts are large and of one sign: x1 in [2⁻⁹, 2⁻⁸),
    x2 in [2⁻¹⁸, 2⁻¹⁷) (the dropped terms of a product of two such values are then ≥ 2⁻²⁸ of it, the bound's order)."""
    def part(scale, bits):  # [1, 2)·scale with `bits` fraction bits
        return (1.0 + torch.randint(0, 2**bits, (n,), generator=g).double() / 2**bits) * scale

    # parts of one sign, so that a1·b2 and a2·b1 add up instead of cancelling
    x = part(1.0, 7) + part(2.0**-9, 7) + part(2.0**-18, 5)
    x = x * torch.where(torch.rand(n, generator=g) < 0.5, -1.0, 1.0).double()
    assert torch.equal(x.float().double(), x)  # an FP32 value
    return x.float()


def _cancelling(M, K, N, g):
    """a (M, K), b (K, N) whose row 0 of the product cancels to FP32's rounding residual: a[0] = (x, −1, 0, …) and
    column j of b = (y_j, fl32(x·y_j), 0, …), so (a b)[0, j] = x·y_j − fl32(x·y_j), a few 2⁻²⁴·|x·y_j|. With
    :func:`_three_part` values the split's dropped terms a1·b2 + a2·b1 + a2·b2 are of that size: visible, not noise."""
    a = torch.randn(M, K, generator=g)
    b = torch.randn(K, N, generator=g)
    x = _three_part(1, g)
    y = _three_part(N, g)
    a[0, 0], a[0, 1], a[0, 2:] = x[0], -1.0, 0.0
    b[0, :] = y
    b[1, :] = (x.double() * y.double()).float()
    return a, b


def test_gemm_split_kernel_matches_reference():
    """The kernel's GEMM (every MODE) against the reference's :func:`_mm` on random FP32 operands (FP32-noise
    close) and on cancelling ones (the split's dropped terms are visible: kernel = reference split, ≠ IEEE)."""
    seed = torch.seed() % 2**31
    g = torch.Generator().manual_seed(seed)
    M = K = N = 16
    a, b = torch.randn(M, K, generator=g), torch.randn(K, N, generator=g) * 1e3
    ab, bb = a.bfloat16().float(), b.bfloat16().float()
    for (x, y, x_bf, y_bf) in ((a, b, False, False), (ab, b, True, False), (a, bb, False, True), (ab, bb, True, True)):
        for gemm in ("ieee", "bf16x6"):
            c = torch.empty(M, N)
            _gemm_kernel[(1,)](x, y, c, M=M, K=K, N=N, MODE=gemm_mode(gemm, False, x_bf, y_bf))
            ref = _mm(x, y, gemm)
            scale = (x.double().abs() @ y.double().abs()).float()
            assert ((c - ref).abs() <= 2.0**-21 * scale).all(), (gemm, x_bf, y_bf, seed)
    # one-sided split (the other operand BF16) is exact: the reference's split equals its IEEE product
    assert torch.equal(_mm(ab, b, "bf16x6"), _mm(ab, b, "ieee"))
    assert torch.equal(_mm(a, bb, "bf16x6"), _mm(a, bb, "ieee"))
    # cancellation: row 0 of (a b) is x·y − fl32(x·y) exactly in the reference; the split drops a1·b2 + a2·b1 + a2·b2
    a, b = _cancelling(16, 16, 16, g)
    exact = _mm(a, b, "ieee")[0]
    split = _mm(a, b, "bf16x6")[0]
    _, _, x1, x2 = split3(a[0, 0:1])  # the dropped terms take the low parts only
    _, _, y1, y2 = split3(b[0])
    dropped = x1.double() * y2.double() + x2.double() * y1.double() + x2.double() * y2.double()
    torch.testing.assert_close(split.double(), exact.double() - dropped, rtol=0, atol=2.0**-40)
    c = torch.empty(16, 16)
    _gemm_kernel[(1,)](a, b, c, M=16, K=16, N=16, MODE=gemm_mode("bf16x6", False, False, False))
    # the kernel's FP32 sums of the six terms round at ~2⁻³²·|x·y| (partial sums near 2⁻⁸·|x·y|): far below the
    # dropped terms (≥ 2⁻²⁸·|x·y| here), so the kernel is seen to drop the same three terms as the reference
    size = (a[0, 0].abs() * b[0].abs()).double()
    noise = (c[0].double() - split.double()).abs() / size
    gap = (exact.double() - split.double()).abs() / size
    assert noise.max() <= 2.0**-30 and gap.min() >= 2.0**-28, (noise.max().item(), gap.min().item(), seed)


def test_gemm_split_nonfinite_like_ieee():
    """An inf or NaN operand reaches the product as an IEEE product's would (only a0·b0 carries it)."""
    a = torch.randn(16, 16)
    b = torch.randn(16, 16)
    a[3, 5], a[7, 2], b[5, 9] = math.inf, math.nan, -math.inf
    b[2, :] = 0.0
    b[2, 4] = 1.5
    for mode_args in ((False, False), (True, False), (False, True)):
        x = a.bfloat16().float() if mode_args[0] else a
        y = b.bfloat16().float() if mode_args[1] else b
        c = torch.empty(16, 16)
        _gemm_kernel[(1,)](x, y, c, M=16, K=16, N=16, MODE=gemm_mode("bf16x6", False, *mode_args))
        want = _mm(x, y, "ieee")
        assert torch.equal(torch.isfinite(c), torch.isfinite(want)) and torch.equal(torch.isnan(c), torch.isnan(want))
        assert torch.equal(torch.isfinite(_mm(x, y, "bf16x6")), torch.isfinite(want))


# ---- the kernels against the reference ----------------------------------------------------------------------------


def _check_fp32(got, want, term=0.0, rtol=1e-5, atol=1e-5):
    m = max(want.abs().max().item(), term)
    torch.testing.assert_close(got.float(), want, rtol=rtol, atol=atol * max(m, 1.0))


@pytest.mark.parametrize("T,D,blocks,dtypes", [
    (37, 16, (16, 16), ("fp32", "fp32")),  # every operand FP32: every GEMM six-term
    (45, 32, (12, 20), ("bf16", "fp32")),  # BF16 q, k, v with FP32 dO (the twin in a BF16 model): one-sided splits
    (70, 16, (32, 64), ("fp32", "bf16")),  # FP32 q, k, v, BF16 dO: dP = dO Vᵀ split on V's side only
])
def test_kernels_match_reference(T, D, blocks, dtypes):
    seed = torch.seed() % 2**31
    g = torch.Generator().manual_seed(seed)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}
    q, k, v = (torch.randn(1, 2, T, D, generator=g).to(dt[dtypes[0]]) for _ in range(3))
    do = torch.randn(1, 2, T, D, generator=g).to(dt[dtypes[1]])
    pol = SPLIT.with_(block_q=blocks[0], block_k=blocks[1])
    scale = 1 / math.sqrt(D)
    try:
        o, lse = flash_forward(q, k, v, pol, scale)
        ro, rlse = ref_forward(q.float(), k.float(), v.float(), pol, scale)
        assert o.dtype == torch.float32
        _check_fp32(o, ro)
        _check_fp32(lse, rlse)
        grads = flash_backward(do, q, k, v, o, lse, pol, scale)
        refs = ref_backward(do.float(), q.float(), k.float(), v.float(), ro, rlse, pol, scale)
        mx = [t.float().abs().max().item() for t in (q, k, v, do)]
        terms = (scale * mx[3] * mx[2] * mx[1], scale * mx[3] * mx[2] * mx[0], mx[3])
        for gname, a, b, term in zip(("dq", "dk", "dv"), grads, refs, terms):
            _check_fp32(a, b, term, rtol=1e-4)
    except AssertionError as e:
        raise AssertionError(f"{e} (seed={seed})") from e


@pytest.mark.parametrize("delta", ["dp_p", "o_fp32"])
def test_kernels_match_reference_other_deltas(delta):
    """δ = rowsum(dP∘P) (its own dP GEMM in a preprocessing kernel) and δ from O recomputed with the split GEMMs."""
    seed = torch.seed() % 2**31
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(1, 2, 40, 16, generator=g) for _ in range(4))
    pol = SPLIT.with_(block_q=16, block_k=16, delta=delta)
    o, lse = ref_forward(q, k, v, pol, 0.25)
    grads = flash_backward(do, q, k, v, o, lse, pol, 0.25)
    refs = ref_backward(do, q, k, v, o, lse, pol, 0.25)
    for gname, a, b in zip(("dq", "dk", "dv"), grads, refs):
        _check_fp32(a, b, 1.0, rtol=1e-4)


def test_causal_split_bit_identical_fp32_inputs():
    """FP32 inputs (every GEMM six-term): unmasked and all-masked tiles give the same bits, forward and backward."""
    seed = torch.seed() % 2**31
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(1, 1, 50, 16, generator=g) for _ in range(4))
    pol = SPLIT.with_(block_q=16, block_k=32)
    launch = dict(block_m=16, block_n=16)
    outs = {}
    for split in (True, False):
        o, lse = flash_forward(q, k, v, pol, 0.3, causal_split=split, **launch)
        outs[split] = (o, lse, *flash_backward(do, q, k, v, o, lse, pol, 0.3, causal_split=split, **launch))
    for what, a, b in zip(("o", "lse", "dq", "dk", "dv"), outs[True], outs[False]):
        assert torch.equal(_bits(a), _bits(b)), (what, seed)


@pytest.mark.parametrize("dtypes,want", [
    (("fp32", "fp32"), {(True, True)}),  # every GEMM: both operands split
    # BF16 q, k, v, FP32 dO: QKᵀ plain BF16; P̄V, dS K, dSᵀ Q split P̄ / dS; V dOᵀ (dK/dV kernel) splits dO, dO Vᵀ
    # (dQ kernel) the mirror image; Pᵀ dO both
    (("bf16", "fp32"), {(True, False), (False, True), (True, True)}),
])
def test_split_reaches_every_gemm(dtypes, want, monkeypatch):
    """Which operands the kernels split, recorded at :func:`_dot_split3` (the interpreter runs jit helpers as Python):
    the policy's gemm reaches every GEMM, and an operand that is BF16 by construction is never split."""
    from collections import Counter

    from lpfa.attention import triton_common

    calls = Counter()
    orig = triton_common._dot_split3

    def recording(a, b, split_a, split_b, as_bf16):
        calls[(bool(split_a), bool(split_b))] += 1
        return orig(a, b, split_a, split_b, as_bf16)

    monkeypatch.setattr(triton_common, "_dot_split3", recording)
    dt = {"fp32": torch.float32, "bf16": torch.bfloat16}
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, 20, 16, generator=g).to(dt[dtypes[0]]) for _ in range(3))
    do = torch.randn(1, 1, 20, 16, generator=g).to(dt[dtypes[1]])
    for pol, expect in ((PRESETS["fp32"], set()), (SPLIT, want)):
        calls.clear()
        o, lse = flash_forward(q, k, v, pol, 0.25)
        flash_backward(do, q, k, v, o, lse, pol, 0.25)
        assert set(calls) == expect, (pol.name, dict(calls))
    # one 20-row tile: forward QKᵀ, P̄V; dK/dV kernel QKᵀ, dP, dV, dK; dQ kernel QKᵀ, dP, dQ (QKᵀ plain with BF16 q, k)
    assert sum(calls.values()) == (9 if dtypes[0] == "fp32" else 6), dict(calls)


# ---- error study: fp32 vs fp32_split vs fa2 against float64 ---------------------------------------------------------


@pytest.mark.parametrize("T,D,dtype", [(37, 64, torch.float32), (100, 64, torch.float32), (100, 32, torch.bfloat16)])
def test_split_error_is_fp32_level(T, D, dtype):
    """On fresh seeded inputs, the split's O, lse, dq, dk, dv errors against float64 (max and mean, relative to the
    float64 tensor's max and mean magnitude) are within 4× of true FP32's, and O, dq, dk, dv more than 1000× below
    fa2's (whose lse is FP32: not compared). The seed and every number are printed (pytest -s)."""
    seed = torch.seed() % 2**31
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, T, D, generator=g).to(dtype) for _ in range(3))
    do = torch.randn(1, 2, T, D, generator=g)  # the FP32 policies' O is FP32, and so is its gradient
    err = errors_vs_float64(q, k, v, do, ["fp32", "fp32_split", "fa2"], 1 / math.sqrt(D))
    print(f"\nerror vs float64, T={T}, D={D}, {dtype}, seed={seed}  (max_rel / mean_rel)")
    for name, parts in err.items():
        print(f"  {name:11s}" + "  ".join(f"{p}: {e['max_rel']:.2e} / {e['mean_rel']:.2e}" for p, e in parts.items()))
    for part in ("o", "lse", "dq", "dk", "dv"):
        for stat in ("max_rel", "mean_rel"):
            s, f = err["fp32_split"][part][stat], err["fp32"][part][stat]
            assert s <= 4 * f, f"{part} {stat}: split {s:.3e} > 4 × fp32 {f:.3e} (seed={seed})"
            if part != "lse":
                b = err["fa2"][part][stat]
                assert 1000 * s <= b, f"{part} {stat}: split {s:.3e} not 1000× below fa2 {b:.3e} (seed={seed})"
