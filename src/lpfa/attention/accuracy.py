"""Error of a policy's attention against float64: how close the ``fp32_split`` twin is to true FP32.

:func:`attention64` is causal softmax attention and its gradients in float64 (autograd of the plain formula, no
tiling) from the given input values; :func:`errors_vs_float64` runs a policy (Triton kernels or the reference) on
the same inputs and reports, per tensor, the largest and the mean absolute error relative to the float64 tensor's
largest and mean magnitude (``max_rel`` = max|x − x64| / max|x64|, ``mean_rel`` = mean|x − x64| / mean|x64|;
elementwise relative errors are ill-conditioned where a gradient cancels to ~0). ``tests/test_attention_split.py``
and ``benchmarks/attention.py --parts error`` use it.

:func:`agreement_with_flash` compares two implementations of FlashAttention-2's rounding points, lpfa's ``fa2`` and
SDPA's flash backend (the real FA2 kernel), elementwise against a bound derived from that arithmetic
(:func:`flash_agreement_bound`). Both compute O = bf16((Σ_j bf16(P̄_j) V_j) / l) with P̄_j = exp(S_j − m) ≤ 1 of
FP32 scores, l = Σ_j P̄_j in FP32, and differ in the order of their FP32 sums, their exp (libdevice ``expf`` here,
``ex2.approx`` of a fused S·log2(e)·scale − m·log2(e)·scale there: a relative error ~2^-21) and their key blocks
(which max P̄ is taken against; the rounding of P̄ below is relative, so that does not matter). So:

* each side's BF16 P̄_j is within 2^-8 of the exact p_j (relative), so the two differ by at most 2^-7·p_j, and the
  FP32 values of O by at most 2^-7·Σ_j P_j|V_j| = 2^-7·a with a = P|V| (P the exact softmax, float64 here);
* each side's output rounding adds at most 2^-8·|O| (relative to its own output, to within a factor 1 + 2^-8).

The bound is (2^-8·(|O_a| + |O_b|) + 2^-7·a)·slack + 1e-6, ``slack`` covering the FP32-level terms (exp, l and the
sums: ~1e-6 relative).
"""

from __future__ import annotations

import math

import torch

from lpfa.attention import reference as ref
from lpfa.attention.policy import get_policy

PARTS = ("o", "lse", "dq", "dk", "dv")


def attention64(q, k, v, do, scale: float) -> dict[str, torch.Tensor]:
    """Causal attention in float64 from ``q, k, v, do`` (B, H, T, D): ``{"o", "lse", "dq", "dk", "dv"}``."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    T = q.shape[-2]
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=q.device).tril(), -math.inf)
    lse = torch.logsumexp(s, dim=-1)
    o = torch.softmax(s, dim=-1) @ v
    dq, dk, dv = torch.autograd.grad(o, (q, k, v), do.double())
    return {"o": o.detach(), "lse": lse.detach(), "dq": dq, "dk": dk, "dv": dv}


def rel_errors(x: torch.Tensor, x64: torch.Tensor) -> dict[str, float]:
    """``max_rel`` and ``mean_rel`` of ``x`` against ``x64`` (see the module docstring)."""
    d = (x.double() - x64).abs()
    a = x64.abs()
    return {"max_rel": (d.max() / a.max().clamp_min(1e-300)).item(),
            "mean_rel": (d.mean() / a.mean().clamp_min(1e-300)).item()}


def run_policy(q, k, v, do, policy, scale: float, backend: str = "triton") -> dict[str, torch.Tensor]:
    """O, lse, dq, dk, dv of ``policy`` on the given inputs: ``backend="triton"`` (the kernels; the interpreter
    without a GPU) or ``"reference"``."""
    if backend == "triton":
        # the kernels import triton (optional), which fixes their interpreter mode on import: loaded when used
        from lpfa.attention.triton_bwd import flash_backward
        from lpfa.attention.triton_fwd import flash_forward

        o, lse = flash_forward(q, k, v, policy, scale)
        dq, dk, dv = flash_backward(do, q, k, v, o.float(), lse, policy, scale)
    elif backend == "reference":
        pol = get_policy(policy)
        o, lse = ref.forward(q.float(), k.float(), v.float(), pol, scale)
        dq, dk, dv = ref.backward(do.float(), q.float(), k.float(), v.float(), o, lse, pol, scale)
    else:
        raise ValueError(f"backend={backend!r}: expected 'triton' or 'reference'")
    return {"o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def errors_vs_float64(q, k, v, do, policies, scale: float,
                      backend: str = "triton") -> dict[str, dict[str, dict[str, float]]]:
    """``{policy name: {part: {"max_rel", "mean_rel"}}}`` for each policy (a preset name or a PrecisionPolicy)."""
    truth = attention64(q, k, v, do, scale)
    out = {}
    for p in policies:
        got = run_policy(q, k, v, do, p, scale, backend)
        out[get_policy(p).name] = {n: rel_errors(got[n], truth[n]) for n in PARTS}
    return out


# One BF16 rounding to nearest moves a value by at most half an ulp: 2^-8 of its magnitude (8 significant bits).
BF16_HALF_ULP = 2.0 ** -8


def flash_agreement_bound(o_a, o_b, q, k, v, scale: float, slack: float = 1.01) -> torch.Tensor:
    """The largest |O_a − O_b| two FlashAttention-2 implementations may give, elementwise, from their shared
    arithmetic (derived in the module docstring): (2^-8·(|O_a| + |O_b|) + 2^-7·a)·slack + 1e-6 with a = P|V| (P the
    exact softmax of ``q``, ``k``), in float64 (B, H, T, D); ``slack`` covers the FP32-level terms."""
    T = q.shape[-2]
    s = (q.double() @ k.double().transpose(-1, -2)) * scale
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=q.device).tril(), -math.inf)
    a = torch.softmax(s, dim=-1) @ v.double().abs()
    out = BF16_HALF_ULP * (o_a.double().abs() + o_b.double().abs()) + 2 * BF16_HALF_ULP * a
    return out * slack + 1e-6


def agreement_with_flash(o_a, o_b, q, k, v, scale: float) -> dict[str, float]:
    """How closely two FA2 implementations' O agree: the share of bit-identical elements, the largest |O_a − O_b| over
    its row's max|O_b|, and the largest |O_a − O_b| over :func:`flash_agreement_bound` (≤ 1 where the bound holds)."""
    d = (o_a.double() - o_b.double()).abs()
    row_max = o_b.double().abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    bound = flash_agreement_bound(o_a, o_b, q, k, v, scale)
    return {"bit_identical": (o_a.float() == o_b.float()).double().mean().item(),
            "max_rel_to_row_max": (d / row_max).max().item(),
            "max_over_bound": (d / bound).max().item()}
