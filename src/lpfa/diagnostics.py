"""Training diagnostics cheap enough to leave on (paper Figs. 3, 11, 13).

* :func:`wq_spectral_norms` — the spectral norm of every head's W_Q in every layer (Figs. 3, 11);
* :func:`attention_probe` — for one batch, per layer and head: the fraction of rows whose pre-softmax
  scores have more than one value within ε of the row max (the tie frequency of Fig. 13), and the
  largest attention logit; :func:`probe_record` adds the fraction of rows whose output the policy silences
  (SFA's shift meeting the row-sum clamp or FP32 underflow, :class:`lpfa.attention.AttentionStats`);
* :func:`v_sign_dominance` — per head, the share of V's feature columns with one sign on nearly all keys
  (the other ingredient of a biased Ō = P̄V, Sec. 3.3).

They return plain tensors; :func:`probe_record` turns them into the JSON the training log stores.

**Spectral norms without an eigensolver on the GPU** (:func:`spectral_norms`, :func:`top_eigenvalue`). ‖w‖₂² is
the largest eigenvalue of the Gram matrix w wᵀ (or wᵀw, the smaller side), formed in float64 where ``w`` lies (one
batched matmul), so the norm's relative error is about float64's epsilon. On the CPU its eigenvalues come from one
batched ``eigvalsh``; on a GPU the largest comes from :func:`top_eigenvalue` there, and only the norms cross to the
CPU (a batched SVD on the GPU, ``torch.linalg.matrix_norm(ord=2)``, was once the bulk of the monitor's capture cost,
then the CPU ``eigvalsh``; see ``results/monitor_overhead``; on a GPU ``eigvalsh`` of small matrices is a loop of
solver calls). :func:`top_eigenvalue` squares repeatedly with the trace taken out, A ← A² / tr(A²), which gives
A ∝ G^(2^k) = Σᵢ λᵢ^(2^k) uᵢuᵢᵀ: after k squarings every eigenvalue λᵢ = rᵢλ₁ is weighted rᵢ^(2^k) against the top
one. The column j of A with the largest diagonal entry is then the top eigenvector u₁ up to components
rᵢ^(2^k)·uᵢ[j]/u₁[j] (u₁[j]² ≥ 1/n), and its Rayleigh quotient vᵀGv / vᵀv misses λ₁ by Σᵢ (λ₁ − λᵢ)·(those
components)², at most about n²/(2e·2^k)·λ₁ whatever the gap between the eigenvalues (the worst case,
(1 − r)·r^(2^(k+1)), peaks at r = 1 − 2^-(k+1)). With k = 40 that is 2·10⁻⁹ λ₁ at n = 64: far below an FP32 ulp of
the norm.
"""

from __future__ import annotations

import contextlib
import math
import warnings

import numpy as np
import torch

from lpfa.attention import FP32_POLICY, AttentionStats
from lpfa.attention.reference import fill_stats, fill_tie_stats

SQUARINGS = 40  # repeated squarings of the Gram matrix in top_eigenvalue: the top eigenvalue's weight becomes r^(2^40)


@torch.no_grad()
def top_eigenvalue(gram: torch.Tensor, squarings: int = SQUARINGS) -> torch.Tensor:
    """Largest eigenvalue of each of the (..., n, n) symmetric positive semi-definite float64 ``gram`` matrices, where
    they lie, with a few batched matmuls and no eigensolver: ``squarings`` repeated squarings, then the Rayleigh
    quotient of the dominant column (error bound in the module docstring: 2·10⁻⁹ λ₁ at n = 64 with the default 40).
    A zero matrix gives 0."""
    tr = gram.diagonal(dim1=-2, dim2=-1).sum(-1)
    a = gram / tr.clamp_min(torch.finfo(gram.dtype).tiny)[..., None, None]
    for _ in range(squarings):
        a = a @ a
        a = a / a.diagonal(dim1=-2, dim2=-1).sum(-1).clamp_min(torch.finfo(gram.dtype).tiny)[..., None, None]
    j = a.diagonal(dim1=-2, dim2=-1).argmax(-1)
    v = torch.take_along_dim(a, j[..., None, None], dim=-1)  # (..., n, 1): column j
    rq = (v.mT @ gram @ v)[..., 0, 0] / (v.mT @ v)[..., 0, 0].clamp_min(torch.finfo(gram.dtype).tiny)
    return torch.where(tr > 0, rq, torch.zeros_like(rq))


@torch.no_grad()
def spectral_norms(w: torch.Tensor) -> torch.Tensor:
    """(...) ‖w[...]‖₂ of (..., rows, cols) matrices (e.g. (H, rows, cols) or (layers, H, rows, cols)), in FP32 on the
    CPU; NaN for a matrix with a non-finite entry: the per-head norms of a checkpoint that blew up (:mod:`lpfa.doctor`,
    :mod:`lpfa.monitor`, the training diagnostics). The largest eigenvalue of the float64 Gram matrix, with
    ``eigvalsh`` on the CPU and :func:`top_eigenvalue` on a GPU (module docstring)."""
    w = w.detach().double()
    ok = torch.isfinite(w).flatten(-2).all(-1)
    w = torch.where(ok[..., None, None], w, torch.zeros_like(w))
    gram = w @ w.mT if w.shape[-2] <= w.shape[-1] else w.mT @ w
    if gram.is_cuda:
        top = top_eigenvalue(gram).clamp_min(0)
    else:
        top = torch.linalg.eigvalsh(gram)[..., -1].clamp_min(0)  # ascending: the last is the largest
    return torch.where(ok, top.sqrt(), torch.full_like(top, math.nan)).float().cpu()


@torch.no_grad()
def wq_spectral_norms(model) -> torch.Tensor:
    """(n_layer, n_head) spectral norms ‖W_Q[h]‖₂ of each head's query projection (:func:`spectral_norms`, all layers
    in one batched call)."""
    return spectral_norms(torch.stack([model.w_q(i).detach() for i in range(model.config.n_layer)]))


def wq_outlier(norms):
    """‖W_Q[h]‖₂ over the median of its layer's heads (Fig. 3: a few heads' norms stand out), NaN-aware: ``norms``
    (..., n_head), one layer per last-axis row. The one definition the doctor, the monitor and the alarms use."""
    norms = np.asarray(norms, dtype=float)
    with warnings.catch_warnings():  # a layer without norms (a model whose W_Q is out of reach) stays NaN, silently
        warnings.simplefilter("ignore", RuntimeWarning)
        return norms / np.nanmedian(norms, axis=-1, keepdims=True)


DOMINANT_SIGN = 0.9  # a V column has a dominant sign when at least this share of its keys' values share one sign


@torch.no_grad()
def capture_qkv(model, x: torch.Tensor, autocast: contextlib.AbstractContextManager | None = None) -> list[dict]:
    """Run ``model`` on token ids ``x``; returns, per layer, ``{"q", "k", "v"}`` (B, H, T, D) as its attention saw
    them."""
    attns = [b.attn for b in model.transformer.h]
    for a in attns:
        a.capture = {}
    try:
        with autocast or contextlib.nullcontext():
            model(x)
        return [a.capture for a in attns]
    finally:
        for a in attns:
            a.capture = None


@torch.no_grad()
def v_sign_dominance(v: torch.Tensor, threshold: float = DOMINANT_SIGN) -> torch.Tensor:
    """(H,) for values ``v`` (B, H, T, D): the fraction of feature columns V[:, i] (of each sequence) in which at
    least ``threshold`` of the T keys' values have one sign (zeros count for neither). Where such a column meets
    a row with several P̄ = 1 entries, the summed V values share a sign, the condition for the biased BF16 sum
    of Ō = P̄V (Sec. 3.3, Fig. 6)."""
    if v.ndim != 4:
        raise ValueError(f"v must be (batch, heads, keys, features), got shape {tuple(v.shape)}")
    if not 0.5 < threshold <= 1.0:
        raise ValueError(f"threshold must be in (0.5, 1] (a share of keys with one sign), got {threshold}")
    pos, neg = (v > 0).float().mean(2), (v < 0).float().mean(2)  # (B, H, D): each sign's share of the keys
    return (torch.maximum(pos, neg) >= threshold).float().mean(dim=(0, 2))


@torch.no_grad()
def tie_fraction(cap: dict, policy, eps: float = 1e-3) -> torch.Tensor:
    """(H,) for one layer's captured ``{"q", "k"}`` (:func:`capture_qkv`): the fraction of causal rows with more
    than one score within ``eps`` of the row max, the scores rounded as ``policy`` rounds them, batch-averaged."""
    q, k = cap["q"].float(), cap["k"].float()
    st = AttentionStats(eps=eps)
    fill_tie_stats(st, q, k, 1.0 / math.sqrt(q.shape[-1]), policy, True)
    return st.tie_fraction().mean(0)


@torch.no_grad()
def row_stats(cap: dict, policy, eps: float = 1e-3) -> AttentionStats:
    """Every count of :class:`AttentionStats` for one layer's captured ``{"q", "k"}``, as ``policy``'s forward
    (with its blocks, SFA and clamp) produces them on causal rows."""
    q, k = cap["q"].float(), cap["k"].float()
    st = AttentionStats(eps=eps)
    fill_stats(st, q, k, 1.0 / math.sqrt(q.shape[-1]), policy, True)
    return st


@torch.no_grad()
def head_max_logits(q: torch.Tensor, k: torch.Tensor, chunk: int = 256) -> torch.Tensor:
    """(H,) the largest causal attention logit q_t·k_s/√D (s ≤ t) of each head over the batch, for (B, H, T, D) q, k,
    in FP32 from products in q's dtype (BF16 scores under BF16 autocast, as the paper's kernel rounds them). Query rows
    go ``chunk`` at a time, so memory is B·H·chunk·T scores, not B·H·T². The one definition behind the diagnostics'
    ``max_logit`` and QK-clip (:meth:`lpfa.model.GPT.qk_clip_`)."""
    B, H, T, D = q.shape
    best = torch.full((H,), float("-inf"), device=q.device)
    keys = torch.arange(T, device=q.device)
    for t0 in range(0, T, chunk):
        t1 = min(T, t0 + chunk)
        s = (q[:, :, t0:t1] @ k[:, :, :t1].transpose(-1, -2)).float() / math.sqrt(D)
        s = s.masked_fill(keys[None, :t1] > keys[t0:t1, None], float("-inf"))
        best = torch.maximum(best, s.amax(dim=(0, 2, 3)))
    return best


def _scores_probe(model, caps: list[dict], eps: float):
    """``(tie_fraction, max_logit, silenced_fraction)``, each (n_layer, n_head), from captured q, k of every layer."""
    attns = [b.attn for b in model.transformer.h]
    ties, maxes, silenced = [], [], []
    for a, cap in zip(attns, caps):
        st = row_stats(cap, a.policy if a.policy is not None else FP32_POLICY, eps)
        ties.append(st.tie_fraction().mean(0))
        silenced.append(st.silenced_fraction().mean(0))
        maxes.append(head_max_logits(cap["q"].float(), cap["k"].float()))
    return torch.stack(ties).cpu(), torch.stack(maxes).cpu(), torch.stack(silenced).cpu()


@torch.no_grad()
def attention_probe(model, x: torch.Tensor, eps: float = 1e-3,
                    autocast: contextlib.AbstractContextManager | None = None):
    """Run ``model`` on ``x`` and measure each layer's scores: returns ``(tie_fraction, max_logit)``, each
    (n_layer, n_head), averaged over the batch. Scores are rounded as the layer's policy rounds them
    (BF16 S for ``paper``), FP32 for SDPA/math layers; ties are counted over whole causal rows."""
    return _scores_probe(model, capture_qkv(model, x, autocast), eps)[:2]


def probe_record(model, x=None, eps: float = 1e-3, autocast=None) -> dict:
    """JSON-ready diagnostics: W_Q spectral norms, and (when ``x`` is given, from one forward pass) tie fractions,
    max logits, the fraction of rows the policy silences (``silenced_fraction``: attenuated by the row-sum clamp
    or zeroed by underflow, as SFA does at large |rm|; 0 without SFA) and the V sign dominance
    (:func:`v_sign_dominance`), each (n_layer, n_head)."""
    rec = {"wq_spectral_norm": wq_spectral_norms(model).cpu().tolist()}
    if x is not None:
        caps = capture_qkv(model, x, autocast)
        ties, maxes, silenced = _scores_probe(model, caps, eps)
        rec["tie_fraction"] = ties.tolist()
        rec["max_logit"] = maxes.tolist()
        rec["silenced_fraction"] = silenced.tolist()
        rec["v_sign_dominance"] = torch.stack([v_sign_dominance(c["v"]) for c in caps]).cpu().tolist()
    return rec
