"""Training diagnostics cheap enough to leave on (paper Figs. 3, 11, 13).

* :func:`wq_spectral_norms` — the spectral norm of every head's W_Q in every layer (Figs. 3, 11);
* :func:`attention_probe` — for one batch, per layer and head: the fraction of rows whose pre-softmax
  scores have more than one value within ε of the row max (the tie frequency of Fig. 13), and the
  largest attention logit.

Both return plain tensors; :func:`probe_record` turns them into the JSON the training log stores.
"""

from __future__ import annotations

import contextlib
import math

import torch

from lpfa.attention import FP32_POLICY, AttentionStats
from lpfa.attention.reference import fill_tie_stats


@torch.no_grad()
def wq_spectral_norms(model) -> torch.Tensor:
    """(n_layer, n_head) spectral norms ‖W_Q[h]‖₂ of each head's query projection, in FP32."""
    return torch.stack([torch.linalg.matrix_norm(model.w_q(i).float(), ord=2) for i in range(model.config.n_layer)])


@torch.no_grad()
def capture_qk(model, x: torch.Tensor, autocast: contextlib.AbstractContextManager | None = None) -> list[dict]:
    """Run ``model`` on token ids ``x``; returns, per layer, ``{"q", "k"}`` (B, H, T, D) as its attention saw them."""
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
def attention_probe(model, x: torch.Tensor, eps: float = 1e-3, autocast: contextlib.AbstractContextManager | None = None):
    """Run ``model`` on ``x`` and measure each layer's scores: returns ``(tie_fraction, max_logit)``, each
    (n_layer, n_head), averaged over the batch. Scores are rounded as the layer's policy rounds them
    (BF16 S for ``paper``), FP32 for SDPA/math layers; ties are counted over whole causal rows."""
    attns = [b.attn for b in model.transformer.h]
    caps = capture_qk(model, x, autocast)
    ties, maxes = [], []
    for a, cap in zip(attns, caps):
        q, k = cap["q"].float(), cap["k"].float()
        pol = a.policy if a.policy is not None else FP32_POLICY
        st = AttentionStats(eps=eps)
        fill_tie_stats(st, q, k, 1.0 / math.sqrt(a.head_dim), pol, True)
        ties.append(st.tie_fraction().mean(0))
        T = q.shape[2]
        s = (q @ k.transpose(-1, -2)) / math.sqrt(a.head_dim)
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=s.device).triu(1), float("-inf"))
        maxes.append(s.amax(dim=(-1, -2)).amax(0))
    return torch.stack(ties).cpu(), torch.stack(maxes).cpu()


def probe_record(model, x=None, eps: float = 1e-3, autocast=None) -> dict:
    """JSON-ready diagnostics: W_Q spectral norms, and (when ``x`` is given) tie fractions and max logits."""
    rec = {"wq_spectral_norm": wq_spectral_norms(model).cpu().tolist()}
    if x is not None:
        ties, maxes = attention_probe(model, x, eps, autocast)
        rec["tie_fraction"] = ties.tolist()
        rec["max_logit"] = maxes.tolist()
    return rec
