"""The paper's mechanism, measured on tensors (Sec. 3.3, Figs. 4–6).

* :func:`delta_error` — δ_lp − δ_hp per token and O_lp − O_hp per feature for one attention call,
  the low-precision side computed exactly as a policy's forward and backward do (Fig. 5);
* :func:`rank1_similarity` — cosine similarity between the rank-1 matrices (PK)[T]ᵀ X[T] of
  different tokens, whose sum weighted by δ_lp − δ_hp is the W_Q gradient error (Fig. 4), and
  :func:`subspace_overlap` for comparing such matrices across steps;
* :func:`pv_running_error` — the error of Ō[T, i] = Σ_t P̄[T, t] V[t, i] accumulated key by key with
  every partial sum rounded to BF16, with the P̄ = 1 positions marked (Fig. 6);
* :func:`p_bar` and :func:`p_bar_ones` — P̄ as fed to P̄V, and per row how many entries are exactly 1
  (the rows the paper blames);
* :func:`delta_accounting` — the δ error split between rows with several P̄ = 1 entries and the rest, and
  how often the V values at those positions share a sign (Sec. 3.3, what the paper shows by example);
* :func:`delta_formulas` — each δ formula of the isolation table against the δ that matches the P the
  backward differentiates (why "O recomputed from FP32 scores" is not a clean isolation);
* :func:`error_persistence` — whether a policy's δ error keeps its sign from one training step to the next (so that
  the W_Q gradient error adds up like a bias) or is drawn afresh: rounding to nearest, stochastic rounding under one
  seed, stochastic rounding reseeded each step (a stabiliser);
* :func:`sfa_attenuation` — for each SFA β, the fraction of rows whose output the authors' row-sum
  clamp attenuates or silences (the SFA β sweep).

**δ formulas** (:func:`delta_formulas`). δ* = rowsum(dP∘P) in float64, with dP = dO Vᵀ and P = exp(S − lse) exactly
as the policy's backward recomputes it (its scores S, its forward's lse), is the δ for which dS = P∘(dP − δ)
differentiates that P. Each formula's δ is compared with it: ``o_stored`` (the policy's own δ), ``dp_p``, ``o_fp32``
(O from the same S, the rest FP32) and ``o_exact`` (O from FP32 scores). With BF16 scores ``o_exact`` is the odd one
out: its O is not built from the P the backward uses.

**Rank-1 similarity** (:func:`rank1_similarity`). Because ⟨uᵀx, u'ᵀx'⟩_F = ⟨u, u'⟩⟨x, x'⟩, the cosine similarity of
M_T = (PK)[T]ᵀ X[T] and M_T' is cos(PK_T, PK_T')·cos(X_T, X_T').

**SFA's attenuation** (:func:`sfa_attenuation`). The row sum is exact for one key block (untiled, or T ≤ the block
size), as in the paper's code with m = β·rm (rm > 0) or 0 (rm < 0): every P̄ = exp(S − m) < 1, so a large rm drives
l towards 0, and the clamp l ≥ 1e-10 scales the row's output by l / max(l, clamp).

**Error persistence** (:func:`error_persistence`). The inputs drift as over ``steps`` training steps: step s
multiplies each of q, k, v, dO by Π (1 + rel·ξ), ξ standard normal per element and step, a random walk of relative
size ``rel`` per step. Per step, g_s = Σ_T (δ_lp − δ_hp)[T] per (batch, head) (:func:`delta_error`): the W_Q
gradient error's factor where the rank-1 matrices (PK)[T]ᵀX[T] share one direction (Fig. 9). The accumulation
|Σ_s g_s| / √(Σ_s g_s²) is √steps for an error that keeps its value from step to step and about 1 (|N(0, 1)|,
median 0.67) for one drawn afresh with mean 0.
"""

from __future__ import annotations

import math

import pandas as pd
import torch

from lpfa.attention import get_policy
from lpfa.attention.policy import BF16, DELTA_FORMULAS, SFA, reseeded
from lpfa.attention.reference import (
    _attention_fp32,
    _r,
    _scores,
    _sfa_row_max,
    backward_delta,
    exp_shifted,
    forward,
)
from lpfa.bf16 import round_to_bf16
from lpfa.diagnostics import capture_qkv, tie_fraction


@torch.no_grad()
def delta_error(q, k, v, do, policy="paper", scale: float | None = None) -> dict:
    """δ = rowsum(dO ∘ O) with the policy's stored O (rounded as its backward rounds the product) against the same with
    O in float64 (the logits soft-capped as the policy caps them, exactly). Inputs (B, H, T, D); returns FP32/float64
    tensors: ``delta_lp``, ``delta_hp``, ``delta_err`` (B, H, T) and ``o_err`` = O_lp − O_hp (B, H, T, D)."""
    pol = get_policy(policy)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    qf, kf, vf, dof = (t.float() for t in (q, k, v, do))
    o_lp, _ = forward(qf, kf, vf, pol, scale, True)
    o_hp = _attention_fp32(qf, kf, vf, scale, True, pol.softcap).double()  # the same soft-cap, exact
    prod = BF16 if (pol.backward == BF16 and pol.o_store == BF16) else "fp32"
    delta_lp = _r(dof * o_lp, prod).double().sum(-1)
    delta_hp = (dof.double() * o_hp).sum(-1)
    return {"delta_lp": delta_lp, "delta_hp": delta_hp, "delta_err": delta_lp - delta_hp,
            "o_err": o_lp.double() - o_hp}


@torch.no_grad()
def delta_formulas(q, k, v, do, policy="paper_untiled", scale: float | None = None) -> dict:
    """How far each δ formula of Sec. 3.2 (:data:`lpfa.attention.policy.DELTA_FORMULAS`) lies from δ* =
    rowsum(dP∘P) in float64, P as ``policy``'s backward recomputes it (module docstring), on inputs (B, H, T, D).
    Returns ``{formula: {"bias": mean(δ − δ*) / mean|δ*|, "rms": rms(δ − δ*) / mean|δ*|}}`` plus ``"max_logit"``."""
    pol = get_policy(policy).with_(fp32_heads=frozenset(), name="probe")
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    qf, kf, vf, dof = (t.float() for t in (q, k, v, do))
    o, lse = forward(qf, kf, vf, pol, scale, True)
    s = _causal_scores(qf, kf, pol, scale)[0].double()
    p = torch.exp(s - lse.double()[..., None])  # -inf above the diagonal gives 0
    exact = (torch.matmul(dof.double(), vf.double().transpose(-1, -2)) * p).sum(-1)
    ref = float(exact.abs().mean())
    out: dict = {"max_logit": float(s.amax())}
    for f in DELTA_FORMULAS:
        err = backward_delta(dof, qf, kf, vf, o, lse, pol.with_(delta=f, name="probe"), scale, True).double() - exact
        out[f] = {"bias": float(err.mean()) / ref, "rms": float(err.pow(2).mean().sqrt()) / ref}
    return out


def _cos(a: torch.Tensor) -> torch.Tensor:
    a = a.double()
    n = a / a.norm(dim=-1, keepdim=True).clamp_min(1e-300)
    return n @ n.transpose(-1, -2)


@torch.no_grad()
def rank1_similarity(p: torch.Tensor, k: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Cosine similarity of the rank-1 matrices M_T = (PK)[T]ᵀ X[T] between all token pairs (Fig. 9), (T, T) in
    float64: ``p`` (T, T) attention probabilities of one head, ``k`` (T, D) its keys, ``x`` (T, C) the layer input;
    computed as cos(PK_T, PK_T')·cos(X_T, X_T') (module docstring)."""
    pk = p.double() @ k.double()
    return _cos(pk) * _cos(x)


@torch.no_grad()
def subspace_overlap(a: torch.Tensor, b: torch.Tensor, r: int = 1) -> float:
    """Overlap in [0, 1] of the top-``r`` left singular subspaces of matrices ``a`` and ``b`` (‖U_aᵀU_b‖²_F / r)."""
    ua = torch.linalg.svd(a.double(), full_matrices=False)[0][:, :r]
    ub = torch.linalg.svd(b.double(), full_matrices=False)[0][:, :r]
    return float((ua.T @ ub).pow(2).sum() / r)


@torch.no_grad()
def pv_running_error(p_bar: torch.Tensor, v: torch.Tensor) -> dict:
    """Accumulate Ō = Σ_t p_bar[t]·v[t] key by key with every partial sum rounded to BF16 (Fig. 6). ``p_bar`` (T,)
    the row's P̄ as fed to P̄V (BF16 values), ``v`` (T,) one feature's values. Returns
    float64 tensors ``exact`` (running exact sums), ``bf16`` (running BF16 sums), ``error`` (their
    difference), ``step_error`` (error added at each key) and the bool mask ``p_bar_one``."""
    prod = (p_bar.double() * v.double()).tolist()  # exact: BF16 × BF16 has 16 significant bits
    exact = torch.tensor(prod, dtype=torch.float64).cumsum(0)
    s, run = 0.0, []
    for x in prod:
        # the double sum is exact whenever it can matter for the rounding (a BF16 value plus a 16-bit one)
        s = round_to_bf16(s + x)
        run.append(s)
    bf = torch.tensor(run, dtype=torch.float64)
    err = bf - exact
    step = torch.diff(err, prepend=torch.zeros(1, dtype=torch.float64))
    return {"exact": exact, "bf16": bf, "error": err, "step_error": step, "p_bar_one": p_bar == 1}


@torch.no_grad()
def layer_tensors(model, idx: torch.Tensor, layer: int) -> dict:
    """One forward pass of ``model`` on token ids ``idx``; returns float64 tensors of ``layer``: the block
    input after LayerNorm ``x`` (B, T, C), ``q``, ``k``, ``v`` (B, H, T, D), the causal attention
    probabilities ``p`` (B, H, T, T) and the scores ``s`` (B, H, T, T), both in float64."""
    block = model.transformer.h[layer]
    got = {}
    h1 = block.ln_1.register_forward_hook(lambda m, i, o: got.__setitem__("x", o.detach()))
    h2 = block.attn.c_attn.register_forward_hook(lambda m, i, o: got.__setitem__("qkv", o.detach()))
    try:
        model(idx)
    finally:
        h1.remove()
        h2.remove()
    B, T, C = got["x"].shape
    H = model.config.n_head
    q, k, v = (t.reshape(B, T, H, C // H).transpose(1, 2).double() for t in got["qkv"].split(C, dim=2))
    attn = block.attn
    if attn.q_norm is not None:
        q, k = attn.q_norm(q.float()).double(), attn.k_norm(k.float()).double()
    s = (q @ k.transpose(-1, -2)) / math.sqrt(C // H)
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=s.device).triu(1), -math.inf)
    return {"x": got["x"].double(), "q": q, "k": k, "v": v, "s": s, "p": torch.softmax(s, dim=-1)}


@torch.no_grad()
def tie_fractions(model, idx: torch.Tensor, policy="paper", eps: float = 1e-3,
                  caps: list[dict] | None = None) -> torch.Tensor:
    """(n_layer, n_head) fraction of causal rows with more than one score within ``eps`` of the row max,
    the scores rounded as ``policy`` rounds them (``"paper"``: BF16; ``"fp32"``: FP32), batch-averaged.
    ``caps``: q and k of every layer already captured on ``idx`` (:func:`lpfa.diagnostics.capture_qkv`), to
    reuse one forward pass."""
    pol = get_policy(policy)
    return torch.stack([tie_fraction(cap, pol, eps) for cap in (caps if caps is not None else capture_qkv(model, idx))])


def _causal_scores(q, k, policy, scale):
    T = q.shape[-2]
    s = _scores(q.float(), k.float(), scale, policy)
    vis = torch.ones(T, T, dtype=torch.bool, device=q.device).tril()
    return s.masked_fill(~vis, -math.inf), vis


@torch.no_grad()
def p_bar(q, k, policy="paper_untiled", scale: float | None = None) -> torch.Tensor:
    """(B, H, T, T) P̄ = exp(S − m) as the policy feeds it to the P̄V product (0 above the diagonal). Exact for untiled
    policies (one key block: m is the row max, or SFA's m); for tiled policies it uses the whole-row max, which is what
    the last key block sees."""
    pol = get_policy(policy)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    s, vis = _causal_scores(q, k, pol, scale)
    m = _sfa_row_max(s, vis, pol)
    return _r(exp_shifted(s, m[..., None], pol, pol.scores), pol.p_bar)


@torch.no_grad()
def p_bar_ones(q, k, policy="paper_untiled", scale: float | None = None) -> torch.Tensor:
    """(B, H, T) number of P̄ entries exactly 1 per causal row (:func:`p_bar`)."""
    return (p_bar(q, k, policy, scale) == 1.0).sum(dim=-1)


@torch.no_grad()
def delta_accounting(q, k, v, do, policy="paper_untiled", scale: float | None = None) -> dict:
    """Where does δ_lp − δ_hp come from (Sec. 3.3)? Inputs (B, H, T, D). Returns ``delta_err`` (B, H, T), ``o_err``
    (:func:`delta_error`) and ``ones`` (B, H, T), the P̄ = 1 entries per row; Σ δ error over all rows, over rows with
    ≥ 2 P̄ = 1 entries ("tied") and over the others (``sum_all``, ``sum_tied``, ``sum_untied``), ``share_tied``,
    ``tied_rows``, ``rows``, ``mean_tied``, ``mean_untied`` per row; and ``same_sign``, over tied rows and features the
    fraction where every V[t, i] at the row's P̄ = 1 positions has one sign (the condition for a biased BF16 sum)."""
    out = delta_error(q, k, v, do, policy, scale)
    is_one = p_bar(q, k, policy, scale) == 1.0  # (B, H, T, T)
    ones = is_one.sum(dim=-1)
    err = out["delta_err"]
    tied = ones >= 2
    sum_all, sum_tied = float(err.sum()), float(err[tied].sum())
    # same-sign test: for each tied row, the V rows at its P̄ = 1 keys
    vf = v.double()
    pos = torch.einsum("bhts,bhsd->bhtd", is_one.double(), (vf > 0).double())
    neg = torch.einsum("bhts,bhsd->bhtd", is_one.double(), (vf < 0).double())
    n = ones[..., None].double()
    same = ((pos == n) | (neg == n))[tied]
    n_t, n_u = int(tied.sum()), int((~tied).sum())
    return {"delta_err": err, "o_err": out["o_err"], "ones": ones, "sum_all": sum_all, "sum_tied": sum_tied,
            "sum_untied": sum_all - sum_tied,
            "share_tied": sum_tied / sum_all if sum_all != 0 else float("nan"), "tied_rows": n_t, "rows": n_t + n_u,
            "mean_tied": sum_tied / n_t if n_t else float("nan"),
            "mean_untied": (sum_all - sum_tied) / n_u if n_u else float("nan"),
            "same_sign": float(same.double().mean()) if same.numel() else float("nan")}


@torch.no_grad()
def sfa_attenuation(q, k, betas=(1.5, 2.0, 4.0, 8.0), eps: float = 1e-3, clamp: float = 1e-10,
                    scores: str = "bf16", scale: float | None = None) -> dict:
    """For each SFA β (Sec. 4, Eq. 6): the fraction of causal rows that SFA touches (``sfa``: more than one score
    within ``eps`` of the max), whose output the row-sum clamp ``l ≥ clamp`` attenuates (``attenuated``: factor
    l / max(l, clamp) < 1), silences (``silenced``: factor < 1e-3) or whose P̄ all underflow (``zeroed``: l = 0), and
    ``rows``; exact for one key block (module docstring)."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    base = get_policy("paper_untiled").with_(scores=scores)
    out = {}
    for beta in betas:
        pol = base.with_(sfa=SFA(beta=float(beta), eps=eps))
        s, vis = _causal_scores(q, k, pol, scale)
        m = _sfa_row_max(s, vis, pol)
        rm = s.amax(dim=-1)
        l = exp_shifted(s, m[..., None], pol, pol.scores).double().sum(dim=-1).float()  # noqa: E741  (the paper's l)
        factor = l / l.clamp_min(clamp)
        touched = m != rm
        out[float(beta)] = {"sfa": float(touched.double().mean()), "attenuated": float((factor < 1).double().mean()),
                            "silenced": float((factor < 1e-3).double().mean()),
                            "zeroed": float((l == 0).double().mean()), "rows": int(l.numel())}
    return out


@torch.no_grad()
def error_persistence(q, k, v, do, policies: dict, steps: int = 8, rel: float = 1e-3, seed: int = 0,
                      reseed: tuple[str, ...] = ()):
    """Does a policy's δ error add up over training steps like a bias? Inputs (B, H, T, D) drifting as over ``steps``
    training steps (relative size ``rel`` per step, drawn with ``seed``; module docstring); ``policies`` ``{name:
    policy}``, the names in ``reseed`` with ``sr_seed`` + s at step s (lpfa.train's ``sr_reseed``). Returns a
    DataFrame indexed by (policy, batch, head): ``mean g`` (g_s = Σ_T (δ_lp − δ_hp)[T], over the steps) and
    ``accumulation`` |Σ_s g_s| / √(Σ_s g_s²): √steps for a persistent error, about 1 for one drawn afresh."""
    gen = torch.Generator().manual_seed(seed)
    base = [t.double().cpu() for t in (q, k, v, do)]
    drift = [torch.ones_like(t) for t in base]
    g = {name: [] for name in policies}
    for s in range(steps):
        if s:
            drift = [d * (1 + rel * torch.randn(d.shape, generator=gen, dtype=torch.float64)) for d in drift]
        x = [(b * d).float().to(q.device) for b, d in zip(base, drift)]
        for name, pol in policies.items():
            pol = reseeded(get_policy(pol), s) if name in reseed else get_policy(pol)
            g[name].append(delta_error(*x, pol)["delta_err"].sum(-1).cpu())  # (B, H)
    rows = []
    for name, gs in g.items():
        gs = torch.stack(gs)  # (steps, B, H)
        acc = gs.sum(0).abs() / gs.pow(2).sum(0).sqrt().clamp_min(1e-300)
        B, H = gs.shape[1:]
        rows += [{"policy": name, "batch": b, "head": h, "mean g": float(gs[:, b, h].mean()),
                  "accumulation": float(acc[b, h])} for b in range(B) for h in range(H)]
    return pd.DataFrame(rows).set_index(["policy", "batch", "head"])
