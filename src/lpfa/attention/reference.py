"""The PyTorch reference: a precision policy performed block by block, exactly (CPU or GPU).

This is the semantic ground truth for every other implementation. Values live in FP32 tensors; each
rounding point of the policy is an explicit round-to-nearest-even to BF16 (:func:`_r`). GEMMs and row
sums are computed in float64 and rounded once to FP32, i.e. an FP32 accumulation without order
effects: a kernel's FP32 accumulation differs from it only by FP32 rounding noise (which can flip a
later BF16 rounding by one ulp, rarely).

Masked scores are ``−inf`` (the paper's code uses ``−max_bf16``; both give P̄ = 0 exactly). Key blocks
entirely above the diagonal are skipped, and a row with no visible key in a block leaves the running
state untouched: with T = 1024 and 512 × 512 blocks (the paper's setting) this changes nothing.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lpfa.attention.policy import BF16, FP32, PrecisionPolicy, delta_o_policy, fp32_twin


def _r(x: torch.Tensor, prec: str) -> torch.Tensor:
    """Round an FP32 tensor to BF16 (RNE) and back when ``prec == "bf16"``."""
    return x.to(torch.bfloat16).to(torch.float32) if prec == BF16 else x


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with FP32 accumulation modelled exactly: float64 product, one rounding to FP32."""
    return torch.matmul(a.double(), b.double()).float()


@dataclass
class AttentionStats:
    """Instrumentation of one forward call (paper Fig. 13), aggregated per (batch, head).

    * ``tied_rows[b, h]``: rows whose count ``rs`` of scores within ``eps`` of the row max is > 1;
    * ``rs_sum[b, h]``: the sum of ``rs`` over rows (``rs_sum / rows`` is the mean tie count);
    * ``p_bar_ones[b, h]``: P̄ entries exactly 1 as fed to the P̄V product (after its rounding);
    * ``rows``: rows per (batch, head), i.e. T.

    Pass ``AttentionStats(eps=...)`` as ``stats=`` to fill it; ``eps`` defaults to the policy's SFA
    eps, else 1e-3. The row max and the ε test are taken in the scores' precision, over the whole row.
    """

    eps: float | None = None
    tied_rows: torch.Tensor | None = None
    rs_sum: torch.Tensor | None = None
    p_bar_ones: torch.Tensor | None = None
    rows: int = 0

    def tie_fraction(self) -> torch.Tensor:
        """Fraction of rows with more than one (near-)maximal score, per (batch, head)."""
        return self.tied_rows.double() / max(self.rows, 1)


def _blocks(n: int, size: int | None):
    size = n if size is None else size
    return [(s, min(s + size, n)) for s in range(0, n, size)]


def _scores(q_b, k_b, scale, policy: PrecisionPolicy):
    """S = Q_b K_bᵀ · scale at the policy's precision: ``bf16(bf16(QKᵀ)·scale)`` or FP32."""
    s = _mm(q_b, k_b.transpose(-1, -2))
    return _r(_r(s, policy.scores) * scale, policy.scores)


def _mask(qs, qe, ks, ke, causal, device):
    """Visible (query, key) pairs of a block: key ≤ query when causal."""
    if not causal:
        return None
    qi = torch.arange(qs, qe, device=device)[:, None]
    ki = torch.arange(ks, ke, device=device)[None, :]
    return ki <= qi


def _sfa_row_max(s, visible, policy: PrecisionPolicy):
    """rm = rowmax(S), replaced by β·rm (rm > 0) or 0 (rm < 0) where rs > 1 (Eq. 6)."""
    rm = s.amax(dim=-1)
    if policy.sfa is None:
        return rm
    thr = _r(rm - policy.sfa.eps, policy.scores)
    near = s >= thr[..., None]
    if visible is not None:
        near = near & visible
    tied = near.sum(dim=-1) > 1
    beta_rm = _r(rm * policy.sfa.beta, policy.scores)
    m = torch.where(tied & (rm > 0), beta_rm, rm)
    return torch.where(tied & (rm < 0), torch.zeros_like(rm), m)


def forward(q, k, v, policy: PrecisionPolicy, scale: float, causal: bool = True, stats: AttentionStats | None = None):
    """Tiled forward. ``q, k, v``: FP32 tensors (B, H, T, D) holding the input values.

    Returns ``(o_store, lse)``: the output at ``policy.o_store`` precision (FP32 tensor) and the
    log-sum-exp ``m + log(l)`` (FP32, the m actually used, SFA included) for the backward.
    """
    B, H, T, D = q.shape
    dev = q.device
    o_out = torch.empty(B, H, T, D, device=dev)
    lse = torch.empty(B, H, T, device=dev)
    ones = torch.zeros(B, H, device=dev, dtype=torch.int64)
    acc = policy.accumulator
    for qs, qe in _blocks(T, policy.block_q):
        q_b = q[:, :, qs:qe]
        n = qe - qs
        m = torch.full((B, H, n), -math.inf, device=dev)
        l = torch.zeros(B, H, n, device=dev)
        o = torch.zeros(B, H, n, D, device=dev)
        for ks, ke in _blocks(T, policy.block_k):
            if causal and ks > qe - 1:
                break  # every key of this block lies above the diagonal
            vis = _mask(qs, qe, ks, ke, causal, dev)
            s = _scores(q_b, k[:, :, ks:ke], scale, policy)
            if vis is not None:
                s = s.masked_fill(~vis, -math.inf)
            row_live = torch.isfinite(s.amax(dim=-1))  # rows with a visible key in this block
            rm = _sfa_row_max(s, vis, policy)
            m_new = _r(torch.maximum(m, rm), acc)
            m_new = torch.where(row_live, m_new, m)
            # P̄ = exp(S − m_new); the subtraction is a BF16 op when S is BF16 (autocast), exp is FP32
            diff = _r(s - m_new[..., None], policy.scores)
            p_bar = torch.exp(diff).masked_fill(~row_live[..., None], 0.0)
            block_sum = p_bar.double().sum(dim=-1).float()
            if policy.row_sum_clamp is not None:
                block_sum = torch.where(row_live, block_sum.clamp_min(policy.row_sum_clamp), block_sum)
            p_pv = _r(p_bar, policy.p_bar)
            if stats is not None:
                ones += (p_pv == 1.0).sum(dim=(-1, -2))
            o_bar = _r(_mm(p_pv, v[:, :, ks:ke]), policy.o_block)
            c = torch.exp(_r(m - m_new, acc))  # m − m_new is an op on the m tensors; 0 on the first block
            c = torch.where(row_live, c, torch.ones_like(c))
            l = _r(c * l + block_sum, acc)
            o = _r(o * c[..., None], acc)
            o = _r(o + o_bar, acc)
            m = m_new
        o_out[:, :, qs:qe] = _r(_r(o / l[..., None], acc), policy.o_store)
        lse[:, :, qs:qe] = torch.log(l) + m
    if stats is not None:
        fill_tie_stats(stats, q, k, scale, policy, causal)
        stats.p_bar_ones = ones
    return o_out, lse


def fill_tie_stats(stats: AttentionStats, q, k, scale, policy: PrecisionPolicy, causal: bool):
    """Fill ``stats``' tie counts from the full score matrix at the policy's score precision (one batch at a time)."""
    eps = stats.eps if stats.eps is not None else (policy.sfa.eps if policy.sfa else 1e-3)
    stats.eps = eps
    B, H, T, _ = q.shape
    tied, rs_sum = [], []
    for b in range(B):  # one batch element at a time bounds the T × T memory
        s = _scores(q[b : b + 1], k[b : b + 1], scale, policy)
        if causal:
            s = s.masked_fill(~_mask(0, T, 0, T, True, q.device), -math.inf)
        rm = s.amax(dim=-1)
        rs = (s >= _r(rm - eps, policy.scores)[..., None]).sum(dim=-1)
        tied.append((rs > 1).sum(dim=-1))
        rs_sum.append(rs.sum(dim=-1))
    stats.tied_rows = torch.cat(tied)
    stats.rs_sum = torch.cat(rs_sum)
    stats.rows = T


def _attention_fp32(q, k, v, scale, causal):
    """Plain softmax attention in float64, rounded to FP32 (the high-precision O of ``delta="o_exact"``)."""
    s = torch.matmul(q.double(), k.double().transpose(-1, -2)) * scale
    if causal:
        T = q.shape[-2]
        s = s.masked_fill(~_mask(0, T, 0, T, True, q.device), -math.inf)
    return torch.matmul(torch.softmax(s, dim=-1), v.double()).float()


def _block_pairs(T: int, policy: PrecisionPolicy, causal: bool):
    """(qs, qe, ks, ke) of every policy block pair with a visible key, query blocks outer."""
    for qs, qe in _blocks(T, policy.block_q):
        for ks, ke in _blocks(T, policy.block_k):
            if causal and ks > qe - 1:
                break
            yield qs, qe, ks, ke


def _p_block(q, k, lse, qs, qe, ks, ke, scale, policy: PrecisionPolicy, causal: bool):
    """P = exp(S − lse) of one block pair, as the backward recomputes it; 0 where the key is invisible."""
    vis = _mask(qs, qe, ks, ke, causal, q.device)
    p = torch.exp(_scores(q[:, :, qs:qe], k[:, :, ks:ke], scale, policy) - lse[:, :, qs:qe, None])
    return p if vis is None else p.masked_fill(~vis, 0.0)


def backward_delta(do, q, k, v, o_store, lse, policy: PrecisionPolicy, scale: float, causal: bool = True):
    """δ per row (B, H, T), FP32, by ``policy.delta``: rowsum(dO ∘ O) (Eq. 4) or an isolation variant (Sec. 3.2).
    Arguments as :func:`backward`."""
    bw = policy.backward
    if policy.delta == "o_stored":
        prod_prec = BF16 if (bw == BF16 and policy.o_store == BF16) else FP32
        return _r(do * o_store, prod_prec).double().sum(dim=-1).float()
    if policy.delta == "o_fp32":  # O recomputed from the forward's S, everything after S in FP32
        o_hp, _ = forward(q, k, v, delta_o_policy(policy), scale, causal)
        return (do.double() * o_hp.double()).sum(dim=-1).float()
    if policy.delta == "o_exact":
        return (do.double() * _attention_fp32(q, k, v, scale, causal).double()).sum(dim=-1).float()
    # "dp_p": rowsum(dP ∘ P) over all key blocks, dP and P as the backward computes them
    B, H, T, _ = q.shape
    delta64 = torch.zeros(B, H, T, dtype=torch.float64, device=q.device)
    for qs, qe, ks, ke in _block_pairs(T, policy, causal):
        p = _p_block(q, k, lse, qs, qe, ks, ke, scale, policy, causal)
        dp = _r(_mm(do[:, :, qs:qe], v[:, :, ks:ke].transpose(-1, -2)), bw)
        delta64[:, :, qs:qe] += (dp.double() * p.double()).sum(dim=-1)
    return delta64.float()


def backward(do, q, k, v, o_store, lse, policy: PrecisionPolicy, scale: float, causal: bool = True):
    """Tiled backward recomputing ``P = exp(S − lse)`` per block pair. All arguments FP32 tensors.

    GEMM operands are rounded to BF16 when ``policy.backward == "bf16"`` or ``policy.p_bar == "bf16"``
    (FlashAttention-2 feeds P and dS to tensor cores in BF16); GEMM outputs and the dq/dk/dv
    accumulators are rounded to ``policy.backward``.
    """
    T = q.shape[2]
    bw = policy.backward
    op = BF16 if (bw == BF16 or policy.p_bar == BF16) else FP32
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)

    delta = backward_delta(do, q, k, v, o_store, lse, policy, scale, causal)

    for qs, qe, ks, ke in _block_pairs(T, policy, causal):
        p = _p_block(q, k, lse, qs, qe, ks, ke, scale, policy, causal)
        do_b = do[:, :, qs:qe]
        # dV_j += Pᵀ dO
        dv[:, :, ks:ke] = _r(dv[:, :, ks:ke] + _r(_mm(_r(p, op).transpose(-1, -2), _r(do_b, op)), bw), bw)
        # dP = dO V_jᵀ ;  dS = P ∘ (dP − δ) · scale
        dp = _r(_mm(do_b, v[:, :, ks:ke].transpose(-1, -2)), bw)
        ds = p * scale * (dp - delta[:, :, qs:qe, None])
        ds_op = _r(ds, op)
        # dQ_i += dS K_j ;  dK_j += dSᵀ Q_i
        dq[:, :, qs:qe] = _r(dq[:, :, qs:qe] + _r(_mm(ds_op, k[:, :, ks:ke]), bw), bw)
        dk[:, :, ks:ke] = _r(dk[:, :, ks:ke] + _r(_mm(ds_op.transpose(-1, -2), q[:, :, qs:qe]), bw), bw)
    return dq, dk, dv


def _split_heads(policy: PrecisionPolicy, H: int):
    """(low-precision head indices, FP32 head indices) for ``policy.fp32_heads``."""
    bad = [h for h in policy.fp32_heads if h >= H]
    if bad:
        raise ValueError(f"fp32_heads {sorted(policy.fp32_heads)} name heads >= H = {H}")
    hp = sorted(policy.fp32_heads)
    lp = [h for h in range(H) if h not in policy.fp32_heads]
    return lp, hp


class ReferenceAttention(torch.autograd.Function):
    """Autograd wrapper: forward and backward both follow the policy (not autograd of the forward)."""

    @staticmethod
    def forward(ctx, q, k, v, policy: PrecisionPolicy, scale: float, causal: bool, stats):
        qf, kf, vf = (t.float() for t in (q, k, v))
        lp, hp = _split_heads(policy, q.shape[1])
        o = torch.empty_like(qf)
        lse = torch.empty(qf.shape[:-1], device=q.device)
        sub_stats = []
        if stats is not None and stats.eps is None:
            stats.eps = policy.sfa.eps if policy.sfa else 1e-3  # one eps for both head groups
        for heads, pol in ((lp, policy), (hp, fp32_twin(policy))):
            if not heads:
                continue
            st = AttentionStats(eps=stats.eps) if stats is not None else None
            o[:, heads], lse[:, heads] = forward(qf[:, heads], kf[:, heads], vf[:, heads], pol, scale, causal, st)
            sub_stats.append((heads, st))
        if stats is not None:
            B, H = q.shape[:2]
            stats.rows = q.shape[2]
            stats.tied_rows = torch.zeros(B, H, dtype=torch.int64, device=q.device)
            stats.rs_sum = torch.zeros_like(stats.tied_rows)
            stats.p_bar_ones = torch.zeros_like(stats.tied_rows)
            for heads, st in sub_stats:
                stats.tied_rows[:, heads] = st.tied_rows
                stats.rs_sum[:, heads] = st.rs_sum
                stats.p_bar_ones[:, heads] = st.p_bar_ones
        ctx.save_for_backward(qf, kf, vf, o, lse)
        ctx.policy, ctx.scale, ctx.causal, ctx.heads = policy, scale, causal, (lp, hp)
        ctx.dtypes = (q.dtype, k.dtype, v.dtype)
        out_dtype = torch.bfloat16 if policy.o_store == BF16 else torch.float32
        return o.to(out_dtype)

    @staticmethod
    def backward(ctx, do):
        qf, kf, vf, o, lse = ctx.saved_tensors
        dof = do.float()
        dq, dk, dv = torch.empty_like(qf), torch.empty_like(kf), torch.empty_like(vf)
        lp, hp = ctx.heads
        for heads, pol in ((lp, ctx.policy), (hp, fp32_twin(ctx.policy))):
            if heads:
                dq[:, heads], dk[:, heads], dv[:, heads] = backward(
                    dof[:, heads], qf[:, heads], kf[:, heads], vf[:, heads], o[:, heads], lse[:, heads], pol, ctx.scale, ctx.causal
                )
        tq, tk, tv = ctx.dtypes
        return dq.to(tq), dk.to(tk), dv.to(tv), None, None, None, None
