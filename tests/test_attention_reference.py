"""lpfa.attention reference: FP32 vs float64, `paper` vs an independent BF16 implementation, SFA, tie counters,
errors."""

import math

import pytest
import torch

from lpfa.attention import PRESETS, SFA, AttentionStats, attention, get_policy

F = torch.float32


def sdpa64(q, k, v, causal=True, scale=None):
    """float64 softmax attention with autograd: the mathematical truth."""
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, scale=scale)


def rand_qkv(B, H, T, D, dtype=torch.float32, scale=1.0):
    g = torch.Generator().manual_seed(torch.seed() % 2**31)  # fresh inputs each run
    return [(torch.randn(B, H, T, D, generator=g) * scale).to(dtype) for _ in range(3)]


# ---- fp32 policy vs float64 --------------------------------------------------------------------
@pytest.mark.parametrize(
    "shape, blocks, causal",
    [((2, 3, 37, 16), (8, 16), True), ((1, 2, 1, 64), (128, 128), True), ((1, 1, 64, 32), (64, 16), True),
     ((2, 2, 50, 8), (None, None), True), ((1, 2, 29, 16), (7, 5), False)],
)
def test_fp32_policy_matches_float64(shape, blocks, causal):
    pol = get_policy("fp32").with_(block_q=blocks[0], block_k=blocks[1])
    q, k, v = (t.requires_grad_() for t in rand_qkv(*shape))
    o = attention(q, k, v, is_causal=causal, policy=pol)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o64 = sdpa64(q64, k64, v64, causal)
    assert o.dtype == torch.float32
    torch.testing.assert_close(o.double(), o64, rtol=1e-5, atol=2e-6)
    do = torch.randn_like(o64)
    o.backward(do.float())
    o64.backward(do)
    for a, b in ((q, q64), (k, k64), (v, v64)):
        torch.testing.assert_close(a.grad.double(), b.grad, rtol=1e-4, atol=1e-5)


# ---- `paper` vs an independent, literal BF16 implementation --------------------------------------
def mm_bf16(a, b):
    """A BF16 GEMM: BF16 operands, FP32 accumulation (modelled exactly), BF16 output."""
    return (a.double() @ b.double()).float().bfloat16()


def paper_literal(q, k, v, do, scale, block=512):
    """The paper's pure-PyTorch FlashAttention-2 as it runs under CUDA BF16 autocast (issue text), with
    native bfloat16 tensors for everything the autocast code keeps in BF16. Returns O, lse, dq, dk, dv."""
    B, H, T, D = q.shape
    neg = -torch.finfo(torch.bfloat16).max
    o_all = torch.zeros(B, H, T, D, dtype=torch.bfloat16)
    lse_all = torch.zeros(B, H, T)
    nb = math.ceil(T / block)
    for i in range(nb):
        qs, qe = i * block, min((i + 1) * block, T)
        o = torch.zeros(B, H, qe - qs, D, dtype=torch.bfloat16)
        l = torch.zeros(B, H, qe - qs, dtype=torch.bfloat16)  # noqa: E741
        m = torch.full((B, H, qe - qs), neg, dtype=torch.bfloat16)
        for j in range(i + 1):
            ks, ke = j * block, min((j + 1) * block, T)
            s = mm_bf16(q[:, :, qs:qe], k[:, :, ks:ke].transpose(-1, -2)) * scale  # bf16 * float -> bf16
            qi = torch.arange(qs, qe)[:, None]
            ki = torch.arange(ks, ke)[None, :]
            s = s.masked_fill(ki > qi, neg)
            block_max = s.max(dim=-1).values
            m_new = torch.maximum(block_max, m)
            p_bar = torch.exp((s - m_new[..., None]).float())  # bf16 subtraction, FP32 exp
            block_sum = p_bar.double().sum(dim=-1).float().clamp_min(1e-10)  # FP32 sum, modelled exactly
            o_bar = mm_bf16(p_bar.bfloat16(), v[:, :, ks:ke])
            c = torch.exp((m - m_new).float())
            l.copy_(c * l.float() + block_sum)  # FP32 math stored into the BF16 l
            o.mul_(c[..., None])  # in place on BF16 o
            o.add_(o_bar)
            m = m_new
        o = o / l[..., None]
        o_all[:, :, qs:qe] = o
        lse_all[:, :, qs:qe] = torch.log(l.float()) + m.float()
    # backward
    dq = torch.zeros(B, H, T, D, dtype=torch.bfloat16)
    dk = torch.zeros_like(dq)
    dv = torch.zeros_like(dq)
    delta = (do * o_all).double().sum(dim=-1).float()  # BF16 product, FP32 sum (modelled exactly)
    for i in range(nb):
        qs, qe = i * block, min((i + 1) * block, T)
        for j in range(i + 1):
            ks, ke = j * block, min((j + 1) * block, T)
            s = mm_bf16(q[:, :, qs:qe], k[:, :, ks:ke].transpose(-1, -2)) * scale
            qi = torch.arange(qs, qe)[:, None]
            ki = torch.arange(ks, ke)[None, :]
            p = torch.exp(s.float() - lse_all[:, :, qs:qe, None]).masked_fill(ki > qi, 0.0)
            dv[:, :, ks:ke] += mm_bf16(p.bfloat16().transpose(-1, -2), do[:, :, qs:qe])
            dp = mm_bf16(do[:, :, qs:qe], v[:, :, ks:ke].transpose(-1, -2))
            ds = p * scale * (dp.float() - delta[:, :, qs:qe, None])
            dq[:, :, qs:qe] += mm_bf16(ds.bfloat16(), k[:, :, ks:ke])
            dk[:, :, ks:ke] += mm_bf16(ds.bfloat16().transpose(-1, -2), q[:, :, qs:qe])
    return o_all, lse_all, dq, dk, dv


@pytest.mark.parametrize("T, block", [(37, 16), (64, 64), (1, 512), (50, 20)])
def test_paper_preset_bit_exact_against_literal_bf16(T, block):
    q, k, v = (t.requires_grad_() for t in rand_qkv(2, 2, T, 16, torch.bfloat16, scale=2.0))
    scale = 0.25
    pol = get_policy("paper").with_(block_q=block, block_k=block)
    o = attention(q, k, v, scale=scale, policy=pol)
    do = torch.randn(o.shape).bfloat16()
    o.backward(do)
    o_ref, _, dq, dk, dv = paper_literal(q.detach(), k.detach(), v.detach(), do, scale, block)
    assert o.dtype == torch.bfloat16
    assert torch.equal(o, o_ref)
    assert torch.equal(q.grad, dq) and torch.equal(k.grad, dk) and torch.equal(v.grad, dv)


def test_presets_are_close_to_float64():
    q, k, v = rand_qkv(1, 2, 40, 16, torch.bfloat16)
    o64 = sdpa64(q.double(), k.double(), v.double())
    for name in PRESETS:
        o = attention(q, k, v, policy=name)
        err = (o.double() - o64).abs().max().item()
        assert err < 0.05, (name, err)


# ---- SFA ---------------------------------------------------------------------------------------
def tied_inputs(T=24, D=16, tied_rows=(10, 15, 20), dtype=torch.bfloat16):
    """Queries in `tied_rows` score keys 3 and 5 identically and highest (≈ 4); other rows are random."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    k = torch.randn(1, 1, T, D, generator=g) * 0.3
    u = torch.zeros(D)
    u[0] = 2.0
    k[0, 0, 3] = u
    k[0, 0, 5] = u
    q = torch.randn(1, 1, T, D, generator=g) * 0.3
    for r in tied_rows:
        q[0, 0, r] = u + torch.randn(D, generator=g) * 0.01 * torch.tensor([0.0] + [1.0] * (D - 1))
    v = torch.randn(1, 1, T, D, generator=g)
    return q.to(dtype), k.to(dtype), v.to(dtype), tied_rows


def test_sfa_removes_p_bar_of_one_and_keeps_other_rows_bit_identical():
    q, k, v, rows = tied_inputs()
    base, sfa = get_policy("paper").with_(block_q=8, block_k=8), get_policy("paper_sfa").with_(block_q=8, block_k=8)
    st_base, st_sfa = AttentionStats(), AttentionStats()
    o_base = attention(q, k, v, scale=1.0, policy=base, stats=st_base)
    o_sfa = attention(q, k, v, scale=1.0, policy=sfa, stats=st_sfa)
    assert st_base.tied_rows.item() >= len(rows)
    # SFA: rows with a tie get no P̄ == 1; every other row still has exactly one
    assert st_base.p_bar_ones.item() - st_sfa.p_bar_ones.item() >= 2 * len(rows)
    # rows with no tie in any 8-key block (SFA acts per block) must be bit-identical
    S = (q.double() @ k.double().transpose(-1, -2)).float().bfloat16().float()[0, 0]
    T = S.shape[0]
    untied = []
    for t in range(T):
        blocks = [S[t, b : min(b + 8, t + 1)] for b in range(0, t + 1, 8)]
        if all((blk >= (blk.max() - 1e-3).bfloat16().float()).sum() == 1 for blk in blocks):
            untied.append(t)
    assert len(untied) >= T // 3 and not set(untied) & set(rows)
    assert torch.equal(o_base[0, 0, untied], o_sfa[0, 0, untied])
    assert not torch.equal(o_base[0, 0, list(rows)], o_sfa[0, 0, list(rows)])


def test_sfa_is_exact_softmax_in_high_precision():
    q, k, v, _ = tied_inputs(dtype=torch.float32)
    pol = get_policy("fp32").with_(sfa=SFA(beta=2.0, eps=1e-3), block_q=8, block_k=8)
    o = attention(q, k, v, scale=1.0, policy=pol)
    o64 = sdpa64(q.double(), k.double(), v.double(), scale=1.0)
    torch.testing.assert_close(o.double(), o64, rtol=1e-5, atol=2e-6)


# ---- tie counters --------------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["paper", "fa2"])
def test_tie_counters_exact(policy):
    """Small-integer q, k and scale 1 make every score an exact integer: count ties by brute force."""
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    B, H, T, D = 2, 3, 33, 8
    q = torch.randint(-2, 3, (B, H, T, D), generator=g).float()
    k = torch.randint(-2, 3, (B, H, T, D), generator=g).float()
    v = torch.randn(B, H, T, D, generator=g)
    st = AttentionStats(eps=0.5)
    attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), scale=1.0, policy=policy, stats=st)
    s = q.double() @ k.double().transpose(-1, -2)
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
    rs = (s >= s.amax(-1, keepdim=True) - 0.5).sum(-1)
    assert torch.equal(st.tied_rows, (rs > 1).sum(-1))
    assert torch.equal(st.rs_sum, rs.sum(-1))
    assert st.rows == T
    assert torch.allclose(st.tie_fraction(), (rs > 1).double().mean(-1))
    assert (st.p_bar_ones >= T).all()  # at least the max of every row


# ---- FP32 heads ----------------------------------------------------------------------------------
def test_fp32_heads_are_computed_in_fp32():
    q, k, v = (t.requires_grad_() for t in rand_qkv(2, 4, 30, 16, torch.bfloat16))
    base = get_policy("paper").with_(block_q=16, block_k=16)
    mixed = base.with_(fp32_heads={1, 3})
    fp32 = get_policy("fp32").with_(block_q=16, block_k=16)
    o_mix = attention(q, k, v, policy=mixed)
    o_base = attention(q, k, v, policy=base)
    o_fp32 = attention(q, k, v, policy=fp32)
    assert torch.equal(o_mix[:, [0, 2]], o_base[:, [0, 2]])
    assert torch.equal(o_mix[:, [1, 3]], o_fp32[:, [1, 3]].bfloat16())
    do = torch.randn(o_mix.shape).bfloat16()
    (g_mix,) = torch.autograd.grad(o_mix, q, do)
    (g_fp32,) = torch.autograd.grad(o_fp32, q, do.float())
    (g_base,) = torch.autograd.grad(o_base, q, do)
    assert torch.equal(g_mix[:, [0, 2]], g_base[:, [0, 2]])
    assert torch.equal(g_mix[:, [1, 3]], g_fp32[:, [1, 3]])

# bad input: tests/test_bad_input.py


# ---- exp="exp2": FlashAttention-2's exp2 of one FMA ---------------------------------------------


def _fma_is_correctly_rounded(a: float, b: float, c: float, r: float) -> bool:
    """r is a·b + c rounded to nearest FP32, ties to even, judged in exact rational arithmetic."""
    from fractions import Fraction

    exact = Fraction(a) * Fraction(b) + Fraction(c)
    rt = torch.tensor(r, dtype=F)
    lo, hi = (float(torch.nextafter(rt, torch.tensor(x, dtype=F))) for x in (-math.inf, math.inf))
    d = exact - Fraction(r)
    half = (Fraction(hi) - Fraction(r)) / 2 if d > 0 else (Fraction(r) - Fraction(lo)) / 2
    even = int(rt.view(torch.int32)) % 2 == 0
    return abs(d) < half or (abs(d) == half and even)


def test_fma_f32_rounds_once_where_float64_would_round_twice():
    from lpfa.attention.reference import LOG2E, fma_f32

    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    n = 2000
    a = torch.randn(n, generator=g)
    c = torch.randn(n, generator=g) * torch.exp2(torch.randint(-40, 8, (n,), generator=g).float())
    r = fma_f32(a, LOG2E, c)
    assert all(_fma_is_correctly_rounded(float(x), LOG2E, float(z), float(y)) for x, y, z in zip(a, r, c))
    # (1 + 2⁻¹²)² = 1 + 2⁻¹¹ + 2⁻²⁴ lies halfway between two FP32 values; ±2⁻⁸⁰ decides the side, which float64
    # loses (it rounds to the midpoint, then ties go to even)
    b = 1 + 2.0**-12
    a = torch.tensor([b, b, -b, -b])
    c = torch.tensor([2.0**-80, -(2.0**-80), 2.0**-80, -(2.0**-80)])
    r = fma_f32(a, b, c)
    naive = (a.double() * b + c.double()).float()
    assert all(_fma_is_correctly_rounded(float(x), b, float(z), float(y)) for x, y, z in zip(a, r, c))
    assert (r != naive).sum() == 2  # one per sign: the case the second rounding gets wrong
    out = fma_f32(torch.tensor([-math.inf, math.inf, math.nan, 1.0]), LOG2E, torch.tensor([1.0, -1.0, 0.0, math.inf]))
    assert out[0] == -math.inf and out[1] == math.inf and out[2].isnan() and out[3] == math.inf


def test_exp2_policy_is_exp_of_the_shift_and_keeps_ties_at_one():
    """P̄ = exp2(fma(S, log₂e, −fl(m·log₂e))) is exp(S − m) to the rounding of its argument; at a tied maximum it
    is exp2 of the rounding error of fl(m·log₂e), within about |m|·2⁻²⁴ of 1, and exactly 1 in BF16."""
    from lpfa.attention.reference import LOG2E, exp_shifted

    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    s = torch.randn(64, 48, generator=g) * 4
    m = s.amax(dim=-1, keepdim=True)
    pol = get_policy("fa2")
    assert pol.exp == "exp2" and get_policy("paper").exp == "exp"
    p = exp_shifted(s, m, pol, "fp32")
    truth = torch.exp(s.double() - m.double())
    # the roundings of m·log₂e and of the FMA move exp2's argument by about (|m| + |S − m|)·2⁻²⁴·log₂e, and exp2
    # by that times ln 2, relative; exp2 itself adds an ulp or two
    bound = 2.0**-22 * (1 + m.double().abs() + (s - m).double().abs()) * truth
    assert ((p.double() - truth).abs() <= bound).all()
    at_max = p[s == m]
    residual = m.double() * LOG2E - (m * LOG2E).double()  # what the FMA leaves at S = m
    assert torch.equal(at_max.double(), torch.exp2(residual.float()).double().flatten())
    assert ((at_max - 1).abs() <= 2.0**-23 * (1 + m.abs().flatten())).all() and (at_max.bfloat16() == 1).all()
    assert (at_max != 1).any()  # the residual is not 0 for most maxima: exp2 is not exp(0) = 1
    assert torch.equal(exp_shifted(torch.tensor([[-math.inf]]), torch.tensor([[2.0]]), pol, "fp32"),
                       torch.zeros(1, 1))
