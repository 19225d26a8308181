"""The Triton kernels as a PyTorch op: autograd, ``torch.library`` registration, FP32-head split.

Two doors to the same kernels, with the same bits: eagerly, :class:`_FlashAttention` (a plain
``torch.autograd.Function``) calls :func:`lpfa.attention.triton_fwd.flash_forward` and
:func:`lpfa.attention.triton_bwd.flash_backward`; under ``torch.compile``, the custom op ``lpfa::flash_attention_fwd``
(one opaque node to Dynamo and Inductor, with a fake kernel and its own autograd) calls the same two functions. The
custom op's Python dispatch and autograd made one forward and backward at GPT-2 shapes take the host 5.9× SDPA-flash's
time to issue, the plain ``autograd.Function`` 3.6× (``benchmarks/host_overhead.py`` on two H200 machines,
results/host_overhead), and at these shapes the host, not the GPU, sets the pace; so eager calls skip it. A policy
travels as a :class:`PrecisionPolicy` on the eager path and as the name of a registered policy (presets, plus any
custom policy registered on first use) through the custom op, because custom ops take plain arguments.
"""

from __future__ import annotations

import torch

from lpfa.attention.policy import BF16, PRESETS, PrecisionPolicy, fp32_twin

_BY_KEY: dict[str, PrecisionPolicy] = dict(PRESETS)


def _split(policy: PrecisionPolicy) -> tuple[PrecisionPolicy, PrecisionPolicy]:
    """The two policies a policy with ``fp32_heads`` runs: itself without them, and the FP32 twin."""
    return policy.with_(fp32_heads=frozenset(), name=policy.name), fp32_twin(policy)


def _lookup(policy: PrecisionPolicy) -> str | None:
    for key, p in _BY_KEY.items():
        if p == policy:
            return key
    return None


def register(policy: PrecisionPolicy) -> str:
    """Give ``policy`` (and the two policies its FP32 heads split into) a key for the custom op; returns its key. Call
    it before ``torch.compile`` traces attention with a custom policy (:class:`lpfa.model.GPT` does for every layer):
    while Dynamo traces, a new key would reach the op's fake kernel before Dynamo applies the registration.
    :func:`policy_key` registers on first use eagerly, and from compiled code through a graph break."""
    for p in (policy, *(_split(policy) if policy.fp32_heads else ())):
        if _lookup(p) is None:
            _BY_KEY[f"custom{len(_BY_KEY)}:{p.name}"] = p
    return _lookup(policy)


def policy_key(policy: PrecisionPolicy) -> str:
    """A string naming ``policy`` for the custom op (a registered policy; see :func:`register`)."""
    key = _lookup(policy)
    return key if key is not None else _register_eagerly(policy)


@torch.compiler.disable
def _register_eagerly(policy: PrecisionPolicy) -> str:  # runs outside the traced graph (a graph break)
    return register(policy)


def _policy(key: str) -> PrecisionPolicy:
    try:
        return _BY_KEY[key]
    except KeyError:
        raise KeyError(f"no precision policy is registered under {key!r}: the op takes keys from "
                       "lpfa.attention.kernels.policy_key(policy) or register(policy)") from None


def _forward(q, k, v, pol: PrecisionPolicy, scale: float, assume_finite: bool = False):
    """(O, lse). attention() checked the inputs, so the launches skip the checks."""
    # the kernels import triton (optional), which fixes their interpreter mode on import: loaded at the first launch
    from lpfa.attention.triton_fwd import flash_forward

    return flash_forward(q, k, v, pol, scale, validate=False, assume_finite=assume_finite)


def _backward(do, q, k, v, o, lse, pol: PrecisionPolicy, scale: float, assume_finite: bool = False):
    """(dQ, dK, dV) in the inputs' dtype (q, k, v share one, checked), stored so by the kernels (no FP32 copies to
    convert); dO, q, k, v in any layout (the kernels take their strides: no copies of the model's transposed views)."""
    from lpfa.attention.triton_bwd import flash_backward  # triton: as in _forward

    return flash_backward(do, q, k, v, o, lse, pol, scale, validate=False, grad_dtype=q.dtype,
                          assume_finite=assume_finite)


class _FlashAttention(torch.autograd.Function):
    """The eager door: forward and backward straight to the kernels' wrappers (no custom-op dispatch)."""

    @staticmethod
    def forward(ctx, q, k, v, pol, scale, assume_finite):
        o, lse = _forward(q, k, v, pol, scale, assume_finite)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.pol, ctx.scale, ctx.assume_finite = pol, scale, assume_finite
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse = ctx.saved_tensors
        return (*_backward(do, q, k, v, o, lse, ctx.pol, ctx.scale, ctx.assume_finite), None, None, None)


@torch.library.custom_op("lpfa::flash_attention_fwd", mutates_args=())
def _fwd_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, key: str, scale: float,
            assume_finite: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The compiled door: :func:`_forward` for the registered policy ``key``."""
    return _forward(q, k, v, _policy(key), scale, assume_finite)


@_fwd_op.register_fake
def _(q, k, v, key, scale, assume_finite):
    pol = _policy(key)
    from lpfa.attention.triton_common import empty_like_layout  # triton: as in _forward

    o, _ = empty_like_layout(q, torch.bfloat16 if pol.o_store == BF16 else torch.float32)  # as flash_forward's O
    return o, q.new_empty(q.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("lpfa::flash_attention_bwd", mutates_args=())
def _bwd_op(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
    key: str, scale: float, assume_finite: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return _backward(do, q, k, v, o, lse, _policy(key), scale, assume_finite)


@_bwd_op.register_fake
def _(do, q, k, v, o, lse, key, scale, assume_finite):
    from lpfa.attention.triton_common import empty_like_layout  # triton: as in _forward

    # the kernels' gradients: dense, in q's order of dimensions (as the wrapper allocates them)
    return tuple(empty_like_layout(q, q.dtype)[0] for _ in range(3))


def _setup_context(ctx, inputs, output):
    q, k, v, key, scale, assume_finite = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.key, ctx.scale, ctx.assume_finite = key, scale, assume_finite


def _op_backward(ctx, do, dlse):
    q, k, v, o, lse = ctx.saved_tensors
    dq, dk, dv = _bwd_op(do, q, k, v, o, lse, ctx.key, ctx.scale, ctx.assume_finite)
    return dq, dk, dv, None, None, None


_fwd_op.register_autograd(_op_backward, setup_context=_setup_context)


def _flash(q, k, v, pol: PrecisionPolicy, scale: float, assume_finite: bool = False) -> torch.Tensor:
    """O of one launch policy: through the custom op while ``torch.compile`` traces, else eagerly; the forward alone
    (no autograd node) when autograd will not run this call's backward."""
    if torch.compiler.is_compiling():
        return _fwd_op(q, k, v, policy_key(pol), scale, assume_finite)[0]
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _FlashAttention.apply(q, k, v, pol, scale, assume_finite)
    return _forward(q, k, v, pol, scale, assume_finite)[0]


def triton_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, policy: PrecisionPolicy,
                     scale: float, assume_finite: bool = False) -> torch.Tensor:
    """Causal attention through the Triton kernels; heads in ``policy.fp32_heads`` run the ``fp32`` policy.
    ``assume_finite``: the caller vouches for finite q, k, v and dO (:func:`lpfa.attention.attention`)."""
    if not policy.fp32_heads:
        return _flash(q, k, v, policy, scale, assume_finite)
    H = q.shape[1]
    bad = [h for h in policy.fp32_heads if h >= H]
    if bad:
        raise ValueError(f"fp32_heads {sorted(policy.fp32_heads)} name heads >= H = {H}")
    hp = sorted(policy.fp32_heads)
    lp = [h for h in range(H) if h not in policy.fp32_heads]
    base, twin = _split(policy)
    out_dtype = torch.bfloat16 if policy.o_store == BF16 else torch.float32
    parts = {}
    for heads, pol in ((lp, base), (hp, twin)):
        if heads:
            idx = torch.tensor(heads, device=q.device)
            sel = [t.index_select(1, idx) for t in (q, k, v)]
            parts[tuple(heads)] = _flash(*sel, pol, scale, assume_finite).to(out_dtype)
    # put the head groups back in order (index_select / cat keep autograd intact)
    order = [h for heads in parts for h in heads]
    out = torch.cat(list(parts.values()), dim=1)
    inv = torch.empty(H, dtype=torch.long, device=q.device)
    inv[torch.tensor(order, device=q.device)] = torch.arange(H, device=q.device)
    return out.index_select(1, inv)
