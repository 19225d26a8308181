"""Precision-policy flash attention (paper Sec. 2–4).

``attention(q, k, v, is_causal=True, scale=None, policy="fa2")`` takes SDPA's q, k, v and keywords plus a
:class:`PrecisionPolicy` (or a preset name from :data:`PRESETS`) that fixes every rounding point of the
tiled forward and backward. Swap it into a model in place of
``torch.nn.functional.scaled_dot_product_attention`` (arguments after v by keyword; ``is_causal`` defaults
to True; a mask or dropout is refused with a clear message)::

    from lpfa.attention import attention
    y = attention(q, k, v, is_causal=True, policy="paper")   # the authors' BF16 semantics

Implementations (``backend=``): ``"reference"`` — :mod:`lpfa.attention.reference`, PyTorch block by
block, exact, CPU and GPU, slow; ``"triton"`` — :mod:`lpfa.attention.kernels`, Triton forward and
backward kernels with the same rounding points (causal, head dims 16–128), registered as the
``torch.library`` op ``lpfa::flash_attention_fwd`` so it works inside ``torch.compile``; ``"auto"``
(default) — Triton for CUDA tensors when Triton is installed, else the reference (always the reference for
the FP8 policies of :data:`EMULATED`, which only it emulates).

:func:`attention` takes everything after v by keyword: ``is_causal`` (default True, unlike SDPA: GPT attention is
causal, and the Triton kernels are causal only), ``scale`` (default 1/√D). SDPA's ``attn_mask``, ``dropout_p`` and
``enable_gqa`` are accepted by name only to be refused clearly unless they are None, 0 and False. ``stats``: an
:class:`AttentionStats` to fill (tie counts of Fig. 13, P̄ = 1 entries, SFA-shifted, attenuated and zeroed rows); it
costs an extra pass of the reference forward, so leave it None in training unless you want the numbers.
Non-finite inputs propagate as :mod:`lpfa.attention.reference` describes (only to rows that see them).
``assume_finite=True`` (Triton backend): the caller vouches that q, k, v and the gradient dO hold no inf or NaN, as
a trainer that stops at a non-finite loss can. The kernels then skip their second launches, which recompute on the
exact non-finite path the tiles whose outputs hold an inf or NaN (:func:`lpfa.attention.triton_common.redo_launches`):
four launches per forward and backward instead of seven, the same bits on finite inputs; a non-finite value that does
arrive spreads as in a plain GEMM, to rows that cannot see it. The reference backend is exact either way and ignores
it.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from lpfa.attention.policy import (
    EMULATED,
    FA2,
    FP32_POLICY,
    PAPER,
    PRESETS,
    SFA,
    PrecisionPolicy,
    _is_number,
    get_policy,
)
from lpfa.attention.reference import AttentionStats, ReferenceAttention, fill_stats

__all__ = [
    "attention",
    "PrecisionPolicy",
    "SFA",
    "PRESETS",
    "EMULATED",
    "PAPER",
    "FA2",
    "FP32_POLICY",
    "AttentionStats",
    "get_policy",
    "check_inputs",
    "GPT2_SHAPE",
]

_DTYPES = (torch.bfloat16, torch.float32)

GPT2_SHAPE = (16, 12, 1024, 64)
"""B, H, T, D of GPT-2 S's attention at batch 16: the benchmarks' default shape ("GPT-2 shapes" in the book)."""


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, head_dims: tuple[int, ...] | None = None) -> None:
    """Raise a clear error unless q, k, v are (B, H, T, D) tensors of one shape, dtype and device."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have shape (batch, heads, seq_len, head_dim), got {tuple(t.shape)} "
                             f"({t.dim()}-D)")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; expected torch.bfloat16 or torch.float32")
    if not (q.shape == k.shape == v.shape):
        raise ValueError(f"q, k, v must have the same shape (B, H, T, D), got {tuple(q.shape)}, {tuple(k.shape)}, "
                         f"{tuple(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if q.shape[2] < 1 or q.shape[3] < 1:
        raise ValueError(f"seq_len and head_dim must be >= 1, got shape {tuple(q.shape)}")
    if head_dims is not None and q.shape[3] not in head_dims:
        raise ValueError(f"head_dim {q.shape[3]} is not supported here; supported: {head_dims}")


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *sdpa_positional,
    is_causal: bool = True,
    scale: float | None = None,
    policy: str | PrecisionPolicy = "fa2",
    stats: AttentionStats | None = None,
    backend: str = "auto",
    assume_finite: bool = False,
    attn_mask: None = None,
    dropout_p: float = 0.0,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """Softmax attention ``softmax(q kᵀ · scale) v`` computed with the rounding points of ``policy`` (a preset name
    or a :class:`PrecisionPolicy`) on q, k, v (B, H, T, D), bfloat16 (the paper's setting) or float32; everything
    after v by keyword (the module docstring lists them). Returns O in BF16, or FP32 when ``policy.o_store ==
    "fp32"``; gradients follow the policy's backward. ``backend``: ``"auto"``, ``"reference"`` or ``"triton"``. Bad
    arguments raise a TypeError or ValueError naming the value and what is expected."""
    if sdpa_positional:
        kinds = ", ".join(type(a).__name__ for a in sdpa_positional)
        raise TypeError(f"attention() takes q, k, v positionally and the rest by keyword; got {len(sdpa_positional)} "
                        f"more positional argument(s) ({kinds}): pass is_causal=, scale=, policy= by name (SDPA's "
                        "positional attn_mask and dropout_p are not supported)")
    if attn_mask is not None:
        raise ValueError(f"attn_mask of type {type(attn_mask).__name__}: expected None (lpfa attention masks only "
                         "causally, through is_causal)")
    if not (_is_number(dropout_p) and dropout_p == 0):
        raise ValueError(f"dropout_p={dropout_p!r}: expected 0.0 (lpfa attention has no dropout)")
    if enable_gqa is not False:
        raise ValueError(f"enable_gqa={enable_gqa!r}: expected False (q, k, v must have the same number of heads)")
    if not isinstance(is_causal, (bool, np.bool_)):
        raise TypeError(f"is_causal={is_causal!r}: expected True or False")
    if stats is not None and not isinstance(stats, AttentionStats):
        raise TypeError(f"stats of type {type(stats).__name__}: expected an lpfa.attention.AttentionStats or None")
    if not (isinstance(backend, str) and backend in ("auto", "reference", "triton")):
        raise ValueError(f"backend={backend!r}: expected 'auto', 'reference' or 'triton'")
    if not isinstance(assume_finite, (bool, np.bool_)):
        raise TypeError(f"assume_finite={assume_finite!r}: expected True or False")
    check_inputs(q, k, v)
    pol = get_policy(policy)
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    if not (_is_number(scale) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale={scale!r}: expected a positive finite number (or None for 1/sqrt(head_dim))")
    scale, is_causal = float(scale), bool(is_causal)
    if backend == "auto":
        backend = "triton" if (q.is_cuda and _triton_available() and is_causal and not pol.fp8) else "reference"
    if backend == "triton":
        # the kernels' module imports torch._dynamo (about 1 s) and triton (optional): loaded when used
        from lpfa.attention.kernels import triton_attention
        from lpfa.attention.triton_common import check_triton_support

        # q, k, v passed check_inputs above: the kernels' own limits, once (their launches skip the checks)
        check_triton_support(q.shape[-1], pol, scale, is_causal, heads_split=True)
        if stats is not None:  # the counts as the reference computes them, from a pass without V
            with torch.no_grad():
                fill_stats(stats, q.detach().float(), k.detach().float(), scale, pol, True)
        return triton_attention(q, k, v, pol, scale, bool(assume_finite))
    return ReferenceAttention.apply(q, k, v, pol, scale, is_causal, stats)


def _triton_available() -> bool:
    try:  # triton is optional: a probe
        import triton  # noqa: F401
    except ImportError:
        return False
    return True
