"""Logit soft-capping (``PrecisionPolicy.softcap``, Gemma 2; one of the stabilisers): the reference against float64
autograd of c·tanh(S / c), its tanh against float64's, and the policy's checks. The Triton kernels are held against
the reference by the preset-wide tests (``paper_softcap``, ``fp32_softcap``)."""

import math

import pytest
import torch

from lpfa.attention import PRESETS, PrecisionPolicy
from lpfa.attention.policy import fp32_twin
from lpfa.attention.reference import backward as ref_backward
from lpfa.attention.reference import forward as ref_forward
from lpfa.attention.reference import tanh_f32
from lpfa.bf16 import every_bf16


def test_tanh_f32_is_tanh_to_a_few_ulps():
    seed = torch.seed() % 2**31
    g = torch.Generator().manual_seed(seed)
    x = torch.cat([torch.randn(20_000, generator=g) * s for s in (1e-6, 1e-2, 1.0, 10.0)]
                  + [torch.tensor([0.0, -0.0, 20.0, -20.0, 1e30, -1e30, math.inf, -math.inf])])
    got, want = tanh_f32(x).double(), torch.tanh(x.double())
    assert ((got - want).abs() <= 2.0**-22 * want.abs().clamp_min(2.0**-24) + 2.0**-24 * 4).all(), f"seed={seed}"
    assert torch.isnan(tanh_f32(torch.tensor([math.nan]))).all()


def test_tanh_f32_is_non_decreasing_on_every_bf16_value():
    """The Triton forward caps only the largest raw scores of a row (``lpfa.attention.triton_fwd.raw_row_max``),
    which holds because tanh_f32, and with it the whole soft-cap, never decreases between consecutive BF16 values:
    checked on all 2¹⁶ of them (NaNs aside), the caps of the committed rows and a small one included."""
    x = every_bf16()
    t = tanh_f32(x)
    assert (t[1:] >= t[:-1]).all(), f"tanh_f32 decreases after x = {x[:-1][t[1:] < t[:-1]][:5].tolist()}"
    assert t[0] == -1 and t[-1] == 1
    for cap in (50.0, 30.0, 0.7):  # S' = bf16(c·bf16(tanh(bf16(S·fl(1/c))))), as the reference's _capped_scores
        u = (x * torch.tensor(1 / cap, dtype=torch.float32)).bfloat16().float()
        s = (tanh_f32(u).bfloat16().float() * cap).bfloat16().float()
        assert (s[1:] >= s[:-1]).all(), cap


@pytest.mark.parametrize("cap", [1.0, 5.0])
@pytest.mark.parametrize("T,block", [(37, 16), (20, None)])
def test_fp32_softcap_matches_float64_autograd(cap, T, block):
    """The FP32 policy with a cap against float64 attention on c·tanh(S / c) differentiated by autograd: O, dq, dk,
    dv within 1e-5 of the float64 tensor's largest magnitude (FP32 level), on logits far beyond the cap."""
    seed = torch.seed() % 2**31
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(2, 3, T, 16, generator=g, dtype=torch.float64) for _ in range(4))
    q = q * 8.0  # logits of tens: the cap matters
    scale = 0.3
    pol = PRESETS["fp32"].with_(block_q=block, block_k=block, softcap=cap)
    x = [t.clone().requires_grad_() for t in (q, k, v)]
    s = cap * torch.tanh((x[0] @ x[1].transpose(-1, -2)) * scale / cap)
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
    o64 = torch.softmax(s, dim=-1) @ x[2]
    g64 = torch.autograd.grad(o64, x, do)
    o, lse = ref_forward(q.float(), k.float(), v.float(), pol, scale)
    grads = ref_backward(do.float(), q.float(), k.float(), v.float(), o, lse, pol, scale)
    for name, a, b in zip(("O", "dq", "dk", "dv"), (o, *grads), (o64, *g64)):
        err = (a.double() - b).abs().max().item() / b.abs().max().item()
        assert err <= 1e-5, (name, err, f"seed={seed}")
    assert (lse.double() <= cap + math.log(T) + 1e-4).all()  # every logit is at most the cap


def test_softcap_bounds_the_bf16_scores():
    """With ``paper_softcap`` no score exceeds the cap, however large the logits (BF16 scores: rounded at each op)."""
    from lpfa.attention.reference import _scores

    g = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 40, 16, generator=g) * 30 for _ in range(2))
    s = _scores(q, k, 1.0, PRESETS["paper_softcap"])
    assert s.abs().max().item() <= PRESETS["paper_softcap"].softcap
    assert torch.equal(s, s.bfloat16().float())


@pytest.mark.parametrize("cap", [0, -1.0, math.inf, math.nan, "50", True])
def test_policy_refuses_a_bad_softcap(cap):
    with pytest.raises(ValueError, match=r"PrecisionPolicy.softcap=.*: expected a positive finite number, or None"):
        PrecisionPolicy(softcap=cap)


def test_fp32_twin_keeps_the_cap():
    """A cap is part of the model, not of the precision: FP32 heads and delta="o_exact" keep it."""
    assert fp32_twin(PRESETS["paper_softcap"]).softcap == 50.0
    assert PRESETS["fp32_softcap"].softcap == 50.0 and PRESETS["fp32_softcap"].p_bar == "fp32"


def test_delta_error_compares_with_the_exactly_capped_attention():
    """lpfa.mechanism.delta_error of a soft-capped policy: δ_hp is rowsum(dO ∘ O) with O from softmax(c·tanh(S/c)) V
    in float64 (it compared with uncapped attention before), on logits well past the cap."""
    import math

    import torch

    from lpfa.attention import get_policy
    from lpfa.mechanism import delta_error

    g = torch.Generator().manual_seed(int(torch.randint(0, 2**31, ())))
    B, H, T, D = 2, 3, 37, 16
    q, k, v, do = (torch.randn(B, H, T, D, generator=g) for _ in range(4))
    q = q * 30  # logits up to a few hundred: the cap of 50 changes P
    out = delta_error(q, k, v, do, get_policy("paper_softcap"))
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(D)
    s = 50.0 * torch.tanh(s / 50.0)
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
    o = torch.softmax(s, -1) @ v.double()
    torch.testing.assert_close(out["delta_hp"], (do.double() * o.float().double()).sum(-1), rtol=1e-6, atol=1e-6)
    uncapped = torch.softmax((q.double() @ k.double().transpose(-1, -2) / math.sqrt(D)).masked_fill(
        torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf), -1) @ v.double()
    assert not torch.allclose(o, uncapped, atol=1e-3)  # the cap matters on these inputs
