"""The FP8 rounding point of the reference (PrecisionPolicy.fp8, FlashAttention-3's FP8 forward, emulated).

Checked against values computed here from their definition: the e4m3 grid itself (all 256 bit patterns), rows that
see one key (O is then the dequantized V exactly), a constant V (O is then 0.875·Σ e4m3(P̄) / Σ P̄ exactly), and an error
bound against float64 on random inputs of awkward shapes.
"""

import math

import numpy as np
import pytest
import torch

from lpfa.attention import EMULATED, PRESETS, PrecisionPolicy, attention, get_policy
from lpfa.attention.policy import E4M3_MAX, FA2, delta_o_policy
from lpfa.attention.reference import quantize_v_e4m3, round_e4m3


def _e4m3_magnitudes() -> np.ndarray:
    """The non-negative finite float8_e4m3fn values by bit pattern 0..126 (4 exponent bits with bias 7, 3 mantissa bits;
    exponent 0 is subnormal; 0.1111.111 is NaN): increasing, so a value's index is its code and the code's last bit
    its mantissa's last bit."""
    return np.array([(m / 8) * 2.0**-6 if e == 0 else (1 + m / 8) * 2.0 ** (e - 7)
                     for code in range(127) for e, m in [(code >> 3, code & 7)]])


def _nearest_even(x: np.ndarray) -> np.ndarray:
    """x rounded to the nearest e4m3 value, ties to the even code, saturating at ±448, from the table above."""
    grid = _e4m3_magnitudes()
    a = np.minimum(np.abs(x), grid[-1])
    hi = np.clip(np.searchsorted(grid, a), 1, len(grid) - 1)
    lo, up = grid[hi - 1], grid[hi]
    r = np.where(a - lo < up - a, lo, np.where(up - a < a - lo, up, np.where(hi % 2 == 0, up, lo)))
    return np.sign(x) * r


def test_round_e4m3_is_nearest_even_on_the_grid():
    mags = _e4m3_magnitudes()
    assert np.all(np.diff(mags) > 0) and mags[-1] == E4M3_MAX and mags[1] == 2.0**-9
    grid = np.concatenate([-mags[::-1], mags])
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    x = torch.cat([torch.randn(20000, generator=g) * 2.0 ** torch.randint(-12, 10, (20000,), generator=g),
                   torch.tensor(grid, dtype=torch.float32),  # every grid value maps to itself
                   torch.tensor((grid[1:] + grid[:-1]) / 2, dtype=torch.float32),  # every midpoint: ties to even
                   torch.tensor([500.0, -1e30, 2.0**-10, 2.0**-11])]).float()
    want = _nearest_even(x.double().numpy())
    np.testing.assert_array_equal(round_e4m3(x).double().numpy(), want)
    assert torch.isnan(round_e4m3(torch.tensor([math.nan]))).all()


@pytest.mark.parametrize("shape", [(2, 3, 37, 24), (1, 2, 5, 8)])
def test_quantize_v_block_scale(shape):
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    v = (torch.randn(shape, generator=g) * 3).bfloat16().float()
    v[0, 0] = 0.0  # a block of zeros keeps scale 1
    v8, s = quantize_v_e4m3(v)
    amax = v.abs().amax(dim=(-1, -2))
    torch.testing.assert_close(s[0, 0], torch.tensor(1.0), rtol=0, atol=0)
    assert torch.equal(s[amax > 0], (amax / E4M3_MAX)[amax > 0])
    assert torch.equal(v8, round_e4m3(v / s[..., None, None]))
    assert v8.abs().amax() <= E4M3_MAX and torch.equal(round_e4m3(v8), v8)
    # relative error of the dequantized value: ≤ 2⁻⁴ for normal e4m3 values, ≤ 2⁻¹⁰·s absolute in the subnormal range
    err = (v8 * s[..., None, None] - v).abs()
    assert bool((err <= 2.0**-4 * v.abs() + 2.0**-10 * s[..., None, None] * 1.0001).all())


def test_one_visible_key_gives_the_dequantized_v():
    """Row 0 sees key 0 alone: P̄ = 1, l = 1, so O[0] = bf16(e4m3(V[0]/s)·s) with s the first key block's scale."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    q, k, v = (torch.randn(2, 3, 40, 16, generator=g).bfloat16() for _ in range(3))
    # exp(S − m), so that P̄ = 1 exactly (the preset's exp2 of one FMA leaves P̄ within about |m|·2⁻²⁴ of 1)
    pol = EMULATED["fa3_fp8"].with_(block_q=16, block_k=16, exp="exp")
    o = attention(q, k, v, policy=pol, backend="reference")
    vf = v.float()
    s = vf[:, :, :16].abs().amax(dim=(-1, -2)) / E4M3_MAX
    want = (round_e4m3(vf[:, :, 0] / s[..., None]) * s[..., None]).bfloat16()
    assert torch.equal(o[:, :, 0], want)
    assert not torch.equal(o[:, :, 0], v[:, :, 0])  # the quantization did act


def test_constant_v_gives_fp8_numerator_over_fp32_row_sum():
    """With V = 7/8 everywhere the block scale is s = 0.875 / 448 = 2⁻⁹ and e4m3(V / s) = 448, so dequantizing is exact
    and, in one block, O = bf16(fp32(0.875·Σ e4m3(P̄)) / fp32(Σ P̄)), P̄ = exp(S − m) from FP32 scores: the numerator and
    the denominator see different P̄ (flash-attention PR #2721's pattern). Every step is exact or one FP32 rounding,
    the same on any machine."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    B, H, T, D = 2, 2, 29, 32
    q, k = (torch.randn(B, H, T, D, generator=g).bfloat16() for _ in range(2))
    v = torch.full((B, H, T, D), 0.875, dtype=torch.bfloat16)
    assert float(quantize_v_e4m3(v.float())[1].unique()) == 2.0**-9
    scale = 1 / math.sqrt(D)
    s = (torch.matmul(q.double(), k.double().transpose(-1, -2)).float() * scale).masked_fill(
        ~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf)
    p_bar = torch.exp(s - s.amax(dim=-1, keepdim=True))
    num = round_e4m3(p_bar).double().sum(dim=-1).float()
    den = p_bar.double().sum(dim=-1).float()
    want = ((0.875 * num) / den).bfloat16()
    for name in ("fa3_fp8_p", "fa3_fp8"):  # V exact in e4m3 after its scale: both give the same
        o = attention(q, k, v, policy=EMULATED[name].with_(block_q=None, block_k=None), scale=scale,
                      backend="reference")
        assert torch.equal(o, want[..., None].expand_as(o)), name


@pytest.mark.parametrize("name", sorted(EMULATED))
@pytest.mark.parametrize("shape,blocks", [((2, 3, 53, 24), 16), ((1, 2, 130, 64), 64), ((1, 1, 7, 8), None)])
def test_fp8_error_within_its_bound(name, shape, blocks):
    """|O − O₆₄| per element within the bound of one e4m3 rounding of each P̄V operand plus the BF16 store:
    |Ō err| ≤ Σ_j (2⁻⁴·P̄_j + 2⁻¹⁰)|V_j| + Σ_j P̄8_j·(2⁻⁴|V_j| + 2⁻¹⁰·s) (first-order, from the e4m3 grid), divided
    by l, plus 2⁻⁸|O| for BF16 O and a margin for the FP32 arithmetic."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    q, k, v = (torch.randn(shape, generator=g).bfloat16() for _ in range(3))
    pol = EMULATED[name].with_(block_q=blocks, block_k=blocks)
    o = attention(q, k, v, policy=pol, backend="reference").double()
    T, D = shape[2], shape[3]
    s = torch.matmul(q.double(), k.double().transpose(-1, -2)) / math.sqrt(D)
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf)
    p = torch.softmax(s, dim=-1)
    o64 = p @ v.double()
    vmax = v.double().abs().amax()  # ≥ every block's max|V|, so 2⁻¹⁰·s ≤ 2⁻¹⁰·vmax/448
    with_v = "v" in pol.fp8
    # P̄ is relative to the row max, P = P̄ / l: e4m3's absolute 2⁻¹⁰ on P̄ is at most 2⁻¹⁰ on P (l ≥ 1)
    bound = (2.0**-4 * p + 2.0**-10) @ v.double().abs() * 1.07
    if with_v:
        bound = bound + (p * 1.07 + 2.0**-10) @ (2.0**-4 * v.double().abs() + 2.0**-10 * vmax / E4M3_MAX)
    bound = bound + 2.0**-8 * o64.abs() + 1e-6
    err = (o - o64).abs()
    assert bool((err <= bound).all()), float((err - bound).max())
    # and the FP8 error is real: larger than FA2's BF16 P̄ on the same inputs
    o_fa2 = attention(q, k, v, policy=FA2.with_(block_q=blocks, block_k=blocks), backend="reference").double()
    assert float((o - o64).abs().mean()) > float((o_fa2 - o64).abs().mean())


def test_fp8_policy_validation_and_dispatch():
    with pytest.raises(ValueError, match=r"PrecisionPolicy.fp8=\{'k'\}: expected a set of P̄V operands"):
        PrecisionPolicy(fp8={"k"})
    with pytest.raises(ValueError, match=r"PrecisionPolicy.fp8=.*expected a set"):
        PrecisionPolicy(fp8="v")
    with pytest.raises(ValueError, match="p_bar must be 'bf16'"):
        PrecisionPolicy(p_bar="fp32", fp8={"p_bar"})
    assert PrecisionPolicy(p_bar="fp32", fp8={"v"}).fp8 == frozenset({"v"})
    assert get_policy("fa3_fp8") is EMULATED["fa3_fp8"] and not set(EMULATED) & set(PRESETS)
    assert all(not p.fp8 for p in PRESETS.values())
    assert delta_o_policy(EMULATED["fa3_fp8"].with_(delta="o_fp32")).fp8 == frozenset()
    q = torch.randn(1, 1, 8, 16).bfloat16()
    with pytest.raises(ValueError, match="only the PyTorch reference emulates: use backend='reference'"):
        from lpfa.attention.triton_common import check_triton_support

        check_triton_support(16, EMULATED["fa3_fp8"], 0.25, True)
    # the reference runs it, forward and backward (the backward is FA2's on the BF16 inputs)
    qq, kk, vv = (q.clone().requires_grad_() for _ in range(3))
    attention(qq, kk, vv, policy="fa3_fp8", backend="reference").float().sum().backward()
    assert all(torch.isfinite(t.grad).all() for t in (qq, kk, vv))


def test_nonfinite_v_reaches_only_rows_that_see_it():
    """An inf in V[j] makes O[i] NaN/inf only for rows i ≥ j (causal), as without FP8: it enters neither the
    block's scale nor the other keys' values."""
    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, (1,))))
    q, k, v = (torch.randn(1, 2, 20, 8, generator=g) for _ in range(3))
    v[0, 0, 11, 3] = math.inf
    pol = EMULATED["fa3_fp8"].with_(block_q=8, block_k=8)
    o = attention(q, k, v, policy=pol, backend="reference")
    clean = attention(q, k, torch.where(torch.isfinite(v), v, 0.0), policy=pol, backend="reference")
    assert not torch.isfinite(o[0, 0, 11:, 3]).any()
    mask = torch.ones_like(o, dtype=torch.bool)
    mask[0, 0, 11:, 3] = False
    # every other entry equals the run with a 0 there: the finite-only block max is the same in both
    assert torch.equal(o[mask], clean[mask])
