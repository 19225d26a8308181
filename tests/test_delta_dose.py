"""The δ dose (the dose-response experiment): δ = δ_ref + k·s·(δ − δ_ref), forward untouched; both backends, against
float64 arithmetic."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: no GPU here

import math

import pytest
import torch

from lpfa.attention import PRESETS, attention
from lpfa.attention.policy import delta_dose_active
from lpfa.attention.reference import backward_delta, forward

pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

B, H, T, D = 2, 2, 37, 16
PAPER = PRESETS["paper"].with_(block_q=16, block_k=16, name="paper16")


def inputs(seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(B, H, T, D, generator=g).bfloat16() for _ in range(4))
    q = q * 3  # larger logits: more BF16 ties, a larger δ error
    return q.bfloat16(), k, v, do


def deltas(pol, seed=0):
    q, k, v, do = inputs(seed)
    scale = 1 / math.sqrt(D)
    o, lse = forward(q.float(), k.float(), v.float(), pol, scale)
    args = (do.float(), q.float(), k.float(), v.float(), o, lse)
    return backward_delta(*args, pol, scale), backward_delta(*args, pol.with_(dose=1.0, dose_sign="bias"), scale), \
        backward_delta(*args, pol.with_(delta="o_fp32", dose=1.0, dose_sign="bias"), scale)


def grads(pol, backend, seed=0):
    q, k, v, do = inputs(seed)
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    o = attention(q, k, v, policy=pol, backend=backend)
    o.backward(do)
    return o.detach(), q.grad, k.grad, v.grad


def test_dose_one_with_bias_is_the_policy_bit_for_bit():
    assert not delta_dose_active(PAPER) and delta_dose_active(PAPER.with_(dose=2.0))
    assert delta_dose_active(PAPER.with_(dose_sign="control"))
    for backend in ("reference", "triton"):
        a = grads(PAPER, backend)
        b = grads(PAPER.with_(dose=1.0, dose_sign="bias", name="dosed"), backend)
        for x, y in zip(a, b):
            assert torch.equal(x, y)


@pytest.mark.parametrize("k", [0.0, 4.0, 128.0])
def test_biased_dose_scales_the_delta_error(k):
    got, d_pol, d_ref = deltas(PAPER.with_(dose=k))
    want = (d_ref.double() + k * (d_pol.double() - d_ref.double())).float()
    assert torch.equal(got, want)
    assert (d_pol != d_ref).any()  # paper's δ has an error to dose
    if k == 0.0:
        assert torch.equal(got, d_ref)  # dose 0 is delta="o_fp32"


def test_control_dose_has_the_magnitude_without_the_sign():
    torch.manual_seed(0)
    k = 64.0
    got, d_pol, d_ref = deltas(PAPER.with_(dose=k, dose_sign="control"))
    err, dose_err = (d_pol.double() - d_ref.double()), (got.double() - d_ref.double())
    nz = err != 0
    # δ = fp32(δ_ref ± k·err) is one FP32 rounding of a float64 value: off by at most half an ulp of δ itself
    assert ((dose_err.abs() - k * err.abs()).abs()[nz] <= 2.0**-24 * got.double().abs()[nz] * 1.0001).all()
    flipped = (torch.sign(dose_err[nz]) != torch.sign(err[nz])).double().mean().item()
    assert 0.3 < flipped < 0.7, flipped  # a fair ±1 per row: about half the signs flip


def test_dose_does_nothing_where_delta_has_no_error():
    """The FP32 twin's δ equals δ_ref bit for bit, so any dose leaves it (and the gradients) unchanged."""
    fp32 = PRESETS["fp32"].with_(block_q=16, block_k=16, name="fp32_16")
    got, d_pol, d_ref = deltas(fp32.with_(dose=256.0))
    assert torch.equal(d_pol, d_ref) and torch.equal(got, d_pol)


def test_forward_is_untouched_and_backends_agree():
    dosed = PAPER.with_(dose=32.0, name="paper16x32")
    ref = grads(dosed, "reference")
    tri = grads(dosed, "triton")
    base, base_tri = grads(PAPER, "reference"), grads(PAPER, "triton")
    assert torch.equal(ref[0], base[0]) and torch.equal(tri[0], base_tri[0])  # O does not see the dose (each backend)
    assert not torch.equal(ref[1], base[1])  # dq does
    for name, a, b in zip(("dq", "dk", "dv"), tri[1:], ref[1:]):
        a, b = a.float(), b.float()
        m = b.abs().max().item()
        same = (a == b).double().mean().item()
        assert same > 0.9, (name, same)  # BF16 gradients: rare one-ulp flips from FP32 summation order
        assert ((a - b).abs() <= 2**-5 * b.abs() + 2**-5 * m).all(), name


def test_bad_dose():
    with pytest.raises(ValueError, match=r"PrecisionPolicy.dose=-1.0: expected a finite number >= 0"):
        PAPER.with_(dose=-1.0)
    with pytest.raises(ValueError, match=r"PrecisionPolicy.dose_sign='random': expected 'bias' or 'control'"):
        PAPER.with_(dose_sign="random")
