"""Error of a policy's attention against float64 (issue 17: how close the ``fp32_split`` twin is to true FP32).

:func:`attention64` is causal softmax attention and its gradients in float64 (autograd of the plain formula, no
tiling) from the given input values; :func:`errors_vs_float64` runs a policy (Triton kernels or the reference) on
the same inputs and reports, per tensor, the largest and the mean absolute error relative to the float64 tensor's
largest and mean magnitude (``max_rel`` = max|x − x64| / max|x64|, ``mean_rel`` = mean|x − x64| / mean|x64|;
elementwise relative errors are ill-conditioned where a gradient cancels to ~0). ``tests/test_attention_split.py``
and ``benchmarks/attention.py --parts error`` use it.
"""

from __future__ import annotations

import math

import torch

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
        from lpfa.attention.triton_bwd import flash_backward
        from lpfa.attention.triton_fwd import flash_forward

        o, lse = flash_forward(q, k, v, policy, scale)
        dq, dk, dv = flash_backward(do, q, k, v, o.float(), lse, policy, scale)
    elif backend == "reference":
        from lpfa.attention import reference as ref
        from lpfa.attention.policy import get_policy

        pol = get_policy(policy)
        o, lse = ref.forward(q.float(), k.float(), v.float(), pol, scale)
        dq, dk, dv = ref.backward(do.float(), q.float(), k.float(), v.float(), o, lse, pol, scale)
    else:
        raise ValueError(f"backend={backend!r}: expected 'triton' or 'reference'")
    return {"o": o, "lse": lse, "dq": dq, "dk": dk, "dv": dv}


def errors_vs_float64(q, k, v, do, policies, scale: float, backend: str = "triton") -> dict[str, dict[str, dict[str, float]]]:
    """``{policy name: {part: {"max_rel", "mean_rel"}}}`` for each policy (a preset name or a PrecisionPolicy)."""
    from lpfa.attention.policy import get_policy

    truth = attention64(q, k, v, do, scale)
    out = {}
    for p in policies:
        got = run_policy(q, k, v, do, p, scale, backend)
        out[get_policy(p).name] = {n: rel_errors(got[n], truth[n]) for n in PARTS}
    return out
