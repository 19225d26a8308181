"""The PyTorch reference: a precision policy performed block by block, exactly (CPU or GPU).

This is the semantic ground truth for every other implementation. Values live in FP32 tensors; each
rounding point of the policy is an explicit round-to-nearest-even to BF16 (:func:`_r`). GEMMs and row
sums are computed in float64 and rounded once to FP32, i.e. an FP32 accumulation without order
effects: a kernel's FP32 accumulation differs from it only by FP32 rounding noise (which can flip a
later BF16 rounding by one ulp, rarely). With ``policy.gemm == "bf16x6"`` a GEMM's value is the exact sum of
the six BF16 products of its split operands (:func:`split3`, :func:`_mm`), rounded once to FP32: the products
the kernels compute on tensor cores, the three smallest dropped, without order effects.

Masked scores are ``−inf`` (the paper's code uses ``−max_bf16``; both give P̄ = 0 exactly). Key blocks
entirely above the diagonal are skipped, and a row with no visible key in a block leaves the running
state untouched: with T = 1024 and 512 × 512 blocks (the paper's setting) this changes nothing.

Non-finite inputs (the same rules in the Triton kernels, :mod:`lpfa.attention.triton_common`): a row sees only
its visible keys (key ≤ query when causal), and nothing it cannot see reaches it.

* A NaN or +inf score among a row's visible keys makes the whole row NaN (as softmax does); a −inf score is a
  masked key (P̄ = 0). A row whose visible scores are all −inf so far subtracts 0 instead of its −inf max
  (FlashAttention-2's ``Check_inf``), and a row with only −inf scores ends as 0/0 = NaN, as SDPA's math does.
* A NaN or ±inf in V[j, d] makes O[i, d] NaN for every row i that sees key j, and no other (a plain P̄V
  product would spread it, through 0·NaN, to rows that cannot see key j). The backward treats its GEMM
  operands alike (K in dQ = dS K, Q in dK = dSᵀ Q, dO in dV = Pᵀ dO) and gives invisible pairs exact zeros.

**Stochastic rounding** (:attr:`PrecisionPolicy.stochastic`, :func:`stochastic_round_bf16`): with u the FP32 bits
of x, the threshold r = hash(seed, point, batch·head, position, u >> 16) >> 16 (position: row·D + column, or the
row for a per-row value) is added to u and the low 16 bits cleared, so x rounds away from zero with probability
(low 16 bits of u)/2¹⁶: unbiased, and an FP32 ulp of difference in x (the kernel's FP32 sums against the
reference's) moves the result only where it crosses r. hash = mix32(mix32(salt ^ position) ^ (u >> 16)),
salt = mix32(mix32(mix32(mix32(seed) ^ point) ^ batch·head) ^ j), j the key block; :func:`mix32` is lowbias32.

**The counts of** :class:`AttentionStats` (paper Fig. 13), each per (batch, head):

* ``tied_rows``: rows whose count ``rs`` of scores within ``eps`` of the row max is > 1;
* ``rs_sum``: the sum of ``rs`` over rows (``rs_sum / rows`` is the mean tie count);
* ``p_bar_ones``: P̄ entries exactly 1 as fed to the P̄V product (after its rounding);
* ``sfa_rows``: rows in which SFA raised m in at least one key block;
* ``attenuated_rows``: rows whose row sum the clamp raised (``row_sum_clamp``): O is scaled down by
  l_true / l_clamped < 1, silently (SFA with a large |rm| does this, Sec. 4);
* ``zeroed_rows``: rows with a visible key whose unclamped row sum underflowed to 0 (every P̄ = 0);
* ``rows``: rows per (batch, head), i.e. T.

``eps`` defaults to the policy's SFA eps, else 1e-3. ``tied_rows`` and ``rs_sum`` describe S: the row max and the
ε test are taken in the scores' precision over the whole row (Fig. 13's statistic), while SFA looks for ties inside
each key block, so a tie split across a block boundary counts in ``tied_rows`` but not in ``sfa_rows``;
``p_bar_ones`` shows what is left. The other counts follow the policy's blocks exactly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lpfa.attention.policy import (
    BF16,
    E4M3_MAX,
    FP32,
    IEEE,
    PrecisionPolicy,
    delta_dose_active,
    delta_o_policy,
    dose_delta,
    fp32_twin,
)


def _r(x: torch.Tensor, prec: str) -> torch.Tensor:
    """Round an FP32 tensor to BF16 (RNE) and back when ``prec == "bf16"``."""
    return x.to(torch.bfloat16).to(torch.float32) if prec == BF16 else x


# ---- stochastic rounding (PrecisionPolicy.stochastic): a counter-based hash, the same bits as the kernels' ----
_MASK32 = 0xFFFFFFFF
# a hash stream each: O's path, and the scores (their two roundings told apart by j: 0 the QKᵀ GEMM output, 1 ·scale)
SR_POINT_IDS = {"o_block": 1, "o_scale": 2, "o_add": 3, "o_div": 4, "o_store": 5, "l_add": 6, "scores": 7}


def _mul32(a, c: int):
    """a·c mod 2³² for 0 <= a < 2³² (an int or an int64 tensor), in 16-bit halves so no int64 product overflows."""
    return ((a & 0xFFFF) * c + ((((a >> 16) * (c & 0xFFFF)) & 0xFFFF) << 16)) & _MASK32


def mix32(x):
    """lowbias32 (C. Wellons' 32-bit integer hash) on values in [0, 2³²): an int or an int64 tensor. The kernels' twin,
    :func:`lpfa.attention.triton_common._mix32`, runs on uint32 with wrapping multiplies."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def stochastic_round_bf16(x: torch.Tensor, seed: int, point: str, j: int, row0: int, col0: int = 0,
                          row_stride: int | None = None, bh0: int = 0) -> torch.Tensor:
    """Round the FP32 tensor ``x`` (B, H, n, D), or (B, H, n) for a per-row value (the row sum l), rows
    ``row0 .. row0 + n − 1`` of key block ``j``, to BF16 stochastically (:attr:`PrecisionPolicy.stochastic`):
    returned as FP32 holding BF16 values, rounded away from zero with probability (low 16 bits of x's FP32
    bits)/2¹⁶ against a hash of ``seed``, ``point``, the position and x (the module docstring gives the hash).
    The position of element (r, c) is (row0 + r)·``row_stride`` + col0 + c mod 2³² (row_stride defaults to x's last
    dimension; the scores use T and their key index), its batch·head index ``bh0`` onwards. ±inf stay; NaN stays NaN."""
    B, H, n = x.shape[:3]
    dev = x.device
    rows = torch.arange(row0, row0 + n, device=dev, dtype=torch.int64)
    per_row = x.dim() == 3
    bh = torch.arange(bh0, bh0 + B * H, device=dev, dtype=torch.int64).view(B, H, 1) if per_row else \
        torch.arange(bh0, bh0 + B * H, device=dev, dtype=torch.int64).view(B, H, 1, 1)
    salt = mix32(mix32(mix32(mix32(seed) ^ SR_POINT_IDS[point]) ^ bh) ^ j)
    stride = x.shape[-1] if row_stride is None else row_stride
    pos = rows if per_row else \
        (rows[:, None] * stride + col0 + torch.arange(x.shape[3], device=dev)[None, :]) & _MASK32
    bits = x.float().contiguous().view(torch.int32).to(torch.int64) & _MASK32
    h = mix32(mix32(salt ^ pos) ^ (bits >> 16))
    out = (bits + (h >> 16)) & 0xFFFF0000
    out = torch.where(out >= 2**31, out - 2**32, out).to(torch.int32).view(torch.float32)
    return torch.where(torch.isnan(x), x, out)


def _rs(x: torch.Tensor, prec: str, policy: PrecisionPolicy, point: str, j: int, row0: int) -> torch.Tensor:
    """A rounding point of O's path: stochastic where ``policy.stochastic`` names its field (``point``'s), else
    :func:`_r`."""
    field = {"o_block": "o_block", "o_store": "o_store"}.get(point, "accumulator")
    if prec == BF16 and field in policy.stochastic:
        return stochastic_round_bf16(x, policy.sr_seed, point, j, row0)
    return _r(x, prec)


def round_e4m3(x: torch.Tensor) -> torch.Tensor:
    """Round an FP32 tensor to float8_e4m3fn (nearest even) and back, saturating at ±448 (:data:`E4M3_MAX`): 4
    significant bits (unit roundoff 2⁻⁴), subnormals down to 2⁻⁹, so |x| ≤ 2⁻¹⁰ becomes 0. NaN stays NaN."""
    return x.clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).to(torch.float32)


def quantize_v_e4m3(v_b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Block quantization of one key block of V (B, H, n, D) to e4m3 (:attr:`PrecisionPolicy.fp8`): ``(v8, s)`` with
    s = max|V| / 448 per (batch, head) in FP32 (1 for a block of zeros) and v8 = e4m3(V / s), so V ≈ s·v8. Only
    finite entries enter the max and are quantized; ±inf and NaN pass through unchanged."""
    fin = torch.isfinite(v_b)
    amax = torch.where(fin, v_b.abs(), torch.zeros((), device=v_b.device)).amax(dim=(-1, -2))
    s = torch.where(amax > 0, amax / E4M3_MAX, torch.ones((), device=v_b.device))
    return torch.where(fin, round_e4m3(v_b / s[..., None, None]), v_b), s


def _p_bar_v(p_bar, v_b, vis, policy: PrecisionPolicy) -> tuple[torch.Tensor, torch.Tensor]:
    """``(p_pv, P̄V)`` of one block: P̄ as fed to the product (BF16 by ``policy.p_bar``, or e4m3 by ``policy.fp8``) and
    the product, FP32-accumulated, with V in e4m3 and its block scale applied in FP32 when ``policy.fp8`` names it."""
    p_pv = round_e4m3(p_bar) if "p_bar" in policy.fp8 else _r(p_bar, policy.p_bar)
    if "v" not in policy.fp8:
        return p_pv, _mm_visible(p_pv, v_b, vis, policy.gemm)
    v8, s = quantize_v_e4m3(v_b)
    return p_pv, _mm_visible(p_pv, v8, vis, policy.gemm) * s[..., None, None]


def split3(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The 3-way BF16 split of an FP32 tensor (:data:`lpfa.attention.policy.GEMM_SPLIT_DOC`): ``(x0, h, x1, x2)``
    with x0 = bf16(x), x1 = bf16(x − x0), x2 = bf16(x − x0 − x1) (FP32 tensors holding BF16 values; x = x0 + x1 + x2
    exactly for finite x in BF16's range) and h = x0 with 0 where x0 is ±inf or NaN (where x1 = x2 = 0 too): the head
    that the cross terms use, so that only x0·y0 carries a non-finite value."""
    x = x.float()
    x0 = x.to(torch.bfloat16).float()
    fin = torch.isfinite(x0)
    r = torch.where(fin, x - x0, torch.zeros((), device=x.device))
    x1 = r.to(torch.bfloat16).float()
    x2 = (r - x1).to(torch.bfloat16).float()
    return x0, torch.where(fin, x0, torch.zeros((), device=x.device)), x1, x2


def _mm(a: torch.Tensor, b: torch.Tensor, gemm: str = IEEE) -> torch.Tensor:
    """``a @ b`` with FP32 accumulation modelled exactly: float64 product, one rounding to FP32. With
    ``gemm="bf16x6"``: the six BF16 products of the split operands (:func:`split3`), a0·b0 + h_a·b1 + a1·h_b +
    h_a·b2 + a1·b1 + a2·h_b, each exact, summed in float64 and rounded once to FP32. A BF16 operand splits into
    (x, x, 0, 0) (x finite), so its remainder terms are exact zeros: what the kernels skip."""
    if gemm == IEEE:
        return torch.matmul(a.double(), b.double()).float()
    a0, ha, a1, a2 = (t.double() for t in split3(a))
    b0, hb, b1, b2 = (t.double() for t in split3(b))
    mm = torch.matmul
    return (mm(a1, b1) + mm(ha, b2) + mm(a2, hb) + mm(ha, b1) + mm(a1, hb) + mm(a0, b0)).float()


def _mm_visible(a: torch.Tensor, b: torch.Tensor, visible: torch.Tensor | None, gemm: str = IEEE) -> torch.Tensor:
    """``a @ b`` summed over visible pairs only: ``a`` (…, M, K) is 0 where ``visible`` (M, K) is False (None: all
    visible), ``b`` (…, K, N) may hold inf or NaN. A non-finite b[k, n] makes out[m, n] NaN exactly where (m, k)
    is visible; 0·NaN would otherwise carry it to rows that cannot see key k."""
    bad = ~torch.isfinite(b)
    if not bool(bad.any()):
        return _mm(a, b, gemm)
    vis = torch.ones(a.shape[-2:], dtype=torch.bool, device=a.device) if visible is None else visible
    reach = torch.matmul(vis.double(), bad.double()) > 0  # (…, M, N): a visible key holds a non-finite b
    return _mm(a, b.masked_fill(bad, 0.0), gemm).masked_fill(reach, math.nan)


@dataclass
class AttentionStats:
    """Instrumentation of one forward call (paper Fig. 13): tie counts, P̄ = 1 entries, SFA-shifted, attenuated and
    zeroed rows, each a (B, H) int64 tensor, and ``rows`` = T (the module docstring defines each count). Pass
    ``AttentionStats(eps=...)`` as ``stats=`` to fill it; ``eps`` (the tie test's ε) defaults to the policy's SFA
    eps, else 1e-3."""

    eps: float | None = None
    tied_rows: torch.Tensor | None = None
    rs_sum: torch.Tensor | None = None
    p_bar_ones: torch.Tensor | None = None
    sfa_rows: torch.Tensor | None = None
    attenuated_rows: torch.Tensor | None = None
    zeroed_rows: torch.Tensor | None = None
    rows: int = 0

    def tie_fraction(self) -> torch.Tensor:
        """Fraction of rows with more than one (near-)maximal score, per (batch, head)."""
        return self.tied_rows.double() / max(self.rows, 1)

    def silenced_fraction(self) -> torch.Tensor:
        """Fraction of rows whose output the clamp attenuated or whose P̄ all underflowed, per (batch, head)."""
        return (self.attenuated_rows + self.zeroed_rows).double() / max(self.rows, 1)


# AttentionStats' (B, H) counts
_COUNTS = ("tied_rows", "rs_sum", "p_bar_ones", "sfa_rows", "attenuated_rows", "zeroed_rows")


def _blocks(n: int, size: int | None):
    size = n if size is None else size
    return [(s, min(s + size, n)) for s in range(0, n, size)]


def f32(x: float) -> float:
    """``x`` rounded to FP32 (as a Python float): the constants a kernel multiplies by."""
    return float(torch.tensor(x, dtype=torch.float32))


LOG2E = f32(math.log2(math.e))
"""log₂e rounded to FP32 (1.44269502162933349609375), the constant of ``exp="exp2"`` (:attr:`PrecisionPolicy.exp`)."""


def fma_f32(a: torch.Tensor, b, c: torch.Tensor) -> torch.Tensor:
    """fl32(a·b + c) with one rounding (a fused multiply-add, as the GPU's ``fma.rn.f32``), for FP32 tensors (b may be
    a Python float holding an FP32 value), broadcast. a·b is exact in float64 (24 + 24 significant bits); a·b + c is
    rounded to float64 with its error e from TwoSum, then to FP32. That second rounding can only go wrong where the
    float64 sum lies exactly halfway between two FP32 values while e ≠ 0: there the exact sum lies on e's side of the
    midpoint, and that neighbour is taken. Non-finite operands give what a·b + c gives."""
    p = a.double() * b
    cd = c.double()
    s = p + cd
    bp = s - p
    e = (p - (s - bp)) + (cd - bp)  # TwoSum: s + e = p + c exactly
    r = s.float()
    rd = r.double()
    toward = torch.where(s > rd, math.inf, -math.inf).float()
    other = torch.nextafter(r, toward).double()  # r's FP32 neighbour on s's side
    off_mid = (s == (rd + other) / 2) & (e != 0) & torch.isfinite(s) & torch.isfinite(e)
    return torch.where(off_mid & ((e > 0) == (other > rd)), other.float(), r)


def exp_shifted(s: torch.Tensor, m: torch.Tensor, policy: PrecisionPolicy, prec: str) -> torch.Tensor:
    """exp(S − m) as ``policy.exp`` evaluates it (FP32 tensors, m broadcast against S): ``"exp"``: exp of S − m rounded
    to ``prec`` (the scores' precision in the forward, FP32 in the backward); ``"exp2"``: FlashAttention-2's
    exp2(fma(S, log₂e, −fl(m·log₂e))), whatever ``prec``. −inf scores give 0 either way."""
    if policy.exp == "exp2":
        return torch.exp2(fma_f32(s, LOG2E, -(m * LOG2E)))
    return torch.exp(_r(s - m, prec))


def rescale(m_diff: torch.Tensor, policy: PrecisionPolicy) -> torch.Tensor:
    """The running state's factor c = exp(m − m_new) from the rounded difference ``m_diff``: exp, or exp2 of
    fl(m_diff·log₂e) for ``exp="exp2"`` (FlashAttention-2's ``exp2f((m − m_new)·scale·log₂e)``)."""
    return torch.exp2(m_diff * LOG2E) if policy.exp == "exp2" else torch.exp(m_diff)


TANH_LOG2 = f32(-2 * math.log2(math.e))
"""−2·log₂e rounded to FP32: :func:`tanh_f32`'s e = exp2(|x|·TANH_LOG2) = exp(−2|x|)."""


def tanh_f32(x: torch.Tensor) -> torch.Tensor:
    """tanh as the soft-cap takes it (:attr:`PrecisionPolicy.softcap`), in FP32: sign(x)·(1 − e)/(1 + e) with
    e = exp2(fl(|x|·fl(−2·log₂e))) = exp(−2|x|) (one multiply and the hardware exp2, as FlashAttention-2 takes its
    exponentials), no cancellation for large |x| and within a few FP32 ulps of tanh (the kernels' formula)."""
    e = torch.exp2(x.abs() * TANH_LOG2)
    t = (1.0 - e) / (1.0 + e)
    return torch.where(x < 0, -t, t)


def _rs_scores(x, policy: PrecisionPolicy, j: int, row0: int, col0: int, T: int | None, bh0: int):
    """A rounding of the scores (j = 0: the QKᵀ GEMM output, 1: its product with the scale): stochastic where
    ``policy.stochastic`` names "scores", hashed by the (query, key) position query·T + key, else :func:`_r`."""
    if policy.scores == BF16 and "scores" in policy.stochastic:
        return stochastic_round_bf16(x, policy.sr_seed, "scores", j, row0, col0, x.shape[-1] if T is None else T, bh0)
    return _r(x, policy.scores)


def _capped_scores(q_b, k_b, scale, policy: PrecisionPolicy, row0: int = 0, col0: int = 0, T: int | None = None,
                   bh0: int = 0):
    """``(S, t)``: S = Q_b K_bᵀ · scale at the policy's precision (``bf16(bf16(QKᵀ)·scale)`` or FP32), soft-capped
    when ``policy.softcap`` is set (S' = c·tanh(S·fl(1/c)), each operation rounded as the scores are; t the rounded
    tanh, for the backward's 1 − t²); t is None without a cap. ``row0``, ``col0``: the block's first query and key,
    ``T`` the sequence length (default: the block is the whole matrix) and ``bh0`` the first batch·head: the position
    the stochastic rounding of the scores hashes (``policy.stochastic`` with "scores"; the soft-cap rounds to
    nearest)."""
    sc = policy.scores
    s = _rs_scores(_mm(q_b, k_b.transpose(-1, -2), policy.gemm), policy, 0, row0, col0, T, bh0)
    s = _rs_scores(s * scale, policy, 1, row0, col0, T, bh0)
    if policy.softcap is None:
        return s, None
    t = _r(tanh_f32(_r(s * f32(1 / policy.softcap), sc)), sc)  # S·fl(1/c): a multiply, as FlashAttention-2 caps
    return _r(t * policy.softcap, sc), t


def _scores(q_b, k_b, scale, policy: PrecisionPolicy, row0: int = 0, col0: int = 0, T: int | None = None,
            bh0: int = 0):
    """S as the forward computes it (:func:`_capped_scores`, soft-cap included)."""
    return _capped_scores(q_b, k_b, scale, policy, row0, col0, T, bh0)[0]


def _mask(qs, qe, ks, ke, causal, device):
    """Visible (query, key) pairs of a block: key ≤ query when causal."""
    if not causal:
        return None
    qi = torch.arange(qs, qe, device=device)[:, None]
    ki = torch.arange(ks, ke, device=device)[None, :]
    return ki <= qi


def _sfa_shift(s, visible, policy: PrecisionPolicy):
    """SFA (Sec. 4, Eq. 6) on one key block's scores ``s``: returns ``(m, tied)``, the row max to subtract and the
    rows where SFA raised it. rm = rowmax(S); where more than one visible score lies within ε of rm (``tied``),
    m = β·rm (rm > 0) or 0 (rm < 0), then at least rm + ``min_shift`` (rm = 0 and |rm| < min_shift, which Eq. 6
    leaves with P̄ = 1). Without SFA, m = rm and no row is tied."""
    rm = s.amax(dim=-1)
    if policy.sfa is None:
        return rm, torch.zeros_like(rm, dtype=torch.bool)
    sfa = policy.sfa
    thr = _r(rm - sfa.eps, policy.scores)
    near = s >= thr[..., None]
    if visible is not None:
        near = near & visible
    tied = near.sum(dim=-1) > 1
    m = torch.where(tied & (rm > 0), _r(rm * sfa.beta, policy.scores), rm)
    m = torch.where(tied & (rm < 0), torch.zeros_like(rm), m)
    if sfa.min_shift > 0:
        m = torch.where(tied, torch.maximum(m, _r(rm + sfa.min_shift, policy.scores)), m)
    return m, tied


def _sfa_row_max(s, visible, policy: PrecisionPolicy):
    """The m that SFA subtracts from one key block's scores (:func:`_sfa_shift`); rowmax(S) without SFA."""
    return _sfa_shift(s, visible, policy)[0]


def forward(q, k, v, policy: PrecisionPolicy, scale: float, causal: bool = True, stats: AttentionStats | None = None):
    """Tiled forward of ``q, k, v``, FP32 tensors (B, H, T, D) holding the input values. Returns ``(o_store, lse)``:
    the output at ``policy.o_store`` precision (FP32 tensor) and the log-sum-exp ``m + log(l)`` (FP32, the m
    actually used, SFA included) for the backward; ``stats`` (an :class:`AttentionStats`) is filled when given."""
    B, H, T, _ = q.shape
    D = v.shape[-1]
    dev = q.device
    o_out = torch.empty(B, H, T, D, device=dev)
    lse = torch.empty(B, H, T, device=dev)
    counts = {n: torch.zeros(B, H, device=dev, dtype=torch.int64) for n in ("ones", "sfa", "attenuated", "zeroed")}
    acc = policy.accumulator
    for qs, qe in _blocks(T, policy.block_q):
        q_b = q[:, :, qs:qe]
        n = qe - qs
        m = torch.full((B, H, n), -math.inf, device=dev)
        l = torch.zeros(B, H, n, device=dev)  # noqa: E741  (the paper's row sums l)
        l_raw = torch.zeros(B, H, n, device=dev)  # l without the clamp (for stats)
        o = torch.zeros(B, H, n, D, device=dev)
        shifted = torch.zeros(B, H, n, dtype=torch.bool, device=dev)
        live_any = torch.zeros(n, dtype=torch.bool, device=dev)
        for j, (ks, ke) in enumerate(_blocks(T, policy.block_k)):
            if causal and ks > qe - 1:
                break  # every key of this block lies above the diagonal
            vis = _mask(qs, qe, ks, ke, causal, dev)
            row_live = vis.any(dim=-1) if vis is not None else torch.ones(n, dtype=torch.bool, device=dev)
            s = _scores(q_b, k[:, :, ks:ke], scale, policy, qs, ks, T)
            if vis is not None:
                s = s.masked_fill(~vis, -math.inf)
            rm, tied = _sfa_shift(s, vis, policy)
            shifted |= tied & row_live
            live_any |= row_live
            m_new = torch.where(row_live, _r(torch.maximum(m, rm), acc), m)
            # subtract 0 where every visible score so far is −inf (FA2's Check_inf): exp then gives 0, not NaN
            m_use = torch.where(m_new == -math.inf, torch.zeros_like(m_new), m_new)
            # P̄ = exp(S − m); the subtraction is a BF16 op when S is BF16 (autocast), exp is FP32 (or FA2's exp2 of one
            # FMA: policy.exp); 0 where masked
            p_bar = exp_shifted(s, m_use[..., None], policy, policy.scores)
            block_raw = p_bar.double().sum(dim=-1).float()
            block_sum = block_raw
            if policy.row_sum_clamp is not None:
                block_sum = torch.where(row_live, block_raw.clamp_min(policy.row_sum_clamp), block_raw)
            p_pv, pv = _p_bar_v(p_bar, v[:, :, ks:ke], vis, policy)
            if stats is not None:
                counts["ones"] += (p_pv == 1.0).sum(dim=(-1, -2))
            o_bar = _rs(pv, policy.o_block, policy, "o_block", j, qs)
            c = rescale(_r(m - m_use, acc), policy)  # m − m_new is an op on the m tensors; 0 on the first block
            c = torch.where(row_live, c, torch.ones_like(c))  # rows without a visible key here keep o and l
            l = _rs(c * l + block_sum, acc, policy, "l_add", j, qs)  # noqa: E741
            l_raw = _rs(c * l_raw + block_raw, acc, policy, "l_add", j, qs)  # the same rounding as l where unclamped
            o = _rs(o * c[..., None], acc, policy, "o_scale", j, qs)
            o = _rs(o + o_bar, acc, policy, "o_add", j, qs)
            m = m_new
        o_out[:, :, qs:qe] = _rs(_rs(o / l[..., None], acc, policy, "o_div", 0, qs), policy.o_store, policy, "o_store",
                                 0, qs)
        lse[:, :, qs:qe] = torch.log(l) + m
        if stats is not None:
            counts["sfa"] += shifted.sum(dim=-1)
            counts["attenuated"] += (l_raw < l).sum(dim=-1)
            counts["zeroed"] += ((l_raw == 0) & live_any).sum(dim=-1)
    if stats is not None:
        fill_tie_stats(stats, q, k, scale, policy, causal)
        stats.p_bar_ones, stats.sfa_rows = counts["ones"], counts["sfa"]
        stats.attenuated_rows, stats.zeroed_rows = counts["attenuated"], counts["zeroed"]
    return o_out, lse


def near_max_counts(s: torch.Tensor, eps: float, prec: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rs, live)`` for scores ``s`` (…, rows, keys; −inf where a key is not visible): rs = #{S ≥ prec(rowmax − eps)}
    per row (Fig. 13's tie count; a row is tied when rs > 1) and ``live``, the rows with a visible key (a row of only
    −inf would count every key). The one definition behind :func:`fill_tie_stats` and the monitor's tie fraction."""
    rm = s.amax(dim=-1)
    return (s >= _r(rm - eps, prec)[..., None]).sum(dim=-1), rm != -math.inf


def fill_tie_stats(stats: AttentionStats, q, k, scale, policy: PrecisionPolicy, causal: bool):
    """Fill ``stats``' tie counts from the full score matrix at the policy's score precision (one batch at a time)."""
    eps = stats.eps if stats.eps is not None else (policy.sfa.eps if policy.sfa else 1e-3)
    stats.eps = eps
    B, H, T, _ = q.shape
    tied, rs_sum = [], []
    for b in range(B):  # one batch element at a time bounds the T × T memory
        s = _scores(q[b : b + 1], k[b : b + 1], scale, policy, bh0=b * H)
        if causal:
            s = s.masked_fill(~_mask(0, T, 0, T, True, q.device), -math.inf)
        rs, live = near_max_counts(s, eps, policy.scores)
        tied.append(((rs > 1) & live).sum(dim=-1))
        rs_sum.append(rs.sum(dim=-1))
    stats.tied_rows = torch.cat(tied)
    stats.rs_sum = torch.cat(rs_sum)
    stats.rows = T


def _attention_fp32(q, k, v, scale, causal, softcap: float | None = None):
    """Plain softmax attention in float64, rounded to FP32 (the high-precision O of ``delta="o_exact"``), the logits
    soft-capped (exact tanh) when ``softcap`` is set."""
    T = q.shape[-2]
    vis = _mask(0, T, 0, T, causal, q.device)
    s = torch.matmul(q.double(), k.double().transpose(-1, -2)) * scale
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    if vis is not None:
        s = s.masked_fill(~vis, -math.inf)
    return _mm_visible(torch.softmax(s, dim=-1), v.double(), vis)


def _block_pairs(T: int, policy: PrecisionPolicy, causal: bool):
    """(qs, qe, ks, ke) of every policy block pair with a visible key, query blocks outer."""
    for qs, qe in _blocks(T, policy.block_q):
        for ks, ke in _blocks(T, policy.block_k):
            if causal and ks > qe - 1:
                break
            yield qs, qe, ks, ke


def _p_block(q, k, lse, qs, qe, ks, ke, scale, policy: PrecisionPolicy, causal: bool):
    """``(P, visible, t)`` of one block pair: P = exp(S − lse) as the backward recomputes it, exactly 0 where the
    key is invisible (whatever S or lse hold there); ``visible`` as :func:`_mask` (None: all visible); t the soft-cap's
    tanh (:func:`_capped_scores`, None without a cap)."""
    vis = _mask(qs, qe, ks, ke, causal, q.device)
    s, t = _capped_scores(q[:, :, qs:qe], k[:, :, ks:ke], scale, policy, qs, ks, q.shape[2])
    p = exp_shifted(s, lse[:, :, qs:qe, None], policy, FP32)
    return (p if vis is None else p.masked_fill(~vis, 0.0)), vis, t


def _masked(x, vis):
    """``x`` with exact zeros where ``vis`` is False (``vis`` None: unchanged); unlike P·x, no 0·NaN."""
    return x if vis is None else x.masked_fill(~vis, 0.0)


def backward_delta(do, q, k, v, o_store, lse, policy: PrecisionPolicy, scale: float, causal: bool = True):
    """δ per row (B, H, T), FP32, by ``policy.delta``: rowsum(dO ∘ O) (Eq. 4) or an isolation variant (Sec. 3.2),
    with its error against ``delta="o_fp32"`` dosed as ``policy.dose`` says. Arguments as :func:`backward`."""
    delta = _delta_formula(do, q, k, v, o_store, lse, policy, scale, causal)
    if not delta_dose_active(policy):
        return delta
    ref = _delta_formula(do, q, k, v, o_store, lse, policy.with_(delta="o_fp32"), scale, causal)
    return dose_delta(delta, ref, policy)


def _delta_formula(do, q, k, v, o_store, lse, policy: PrecisionPolicy, scale: float, causal: bool):
    """δ by ``policy.delta`` alone (no dose)."""
    bw = policy.backward
    if policy.delta == "o_stored":
        prod_prec = BF16 if (bw == BF16 and policy.o_store == BF16) else FP32
        return _r(do * o_store, prod_prec).double().sum(dim=-1).float()
    # O recomputed from the forward's S, everything after S in FP32 ("o_fp32"), or all in float64 ("o_exact");
    # the products dO∘O in FP32 (as the kernels and the FP32 twin's o_stored take them), summed exactly
    if policy.delta == "o_fp32":
        o_hp, _ = forward(q, k, v, delta_o_policy(policy), scale, causal)
        return (do * o_hp).double().sum(dim=-1).float()
    if policy.delta == "o_exact":
        return (do * _attention_fp32(q, k, v, scale, causal, policy.softcap)).double().sum(dim=-1).float()
    # "dp_p": rowsum(dP ∘ P) over all key blocks, dP and P as the backward computes them
    B, H, T, _ = q.shape
    delta64 = torch.zeros(B, H, T, dtype=torch.float64, device=q.device)
    for qs, qe, ks, ke in _block_pairs(T, policy, causal):
        p, vis, _ = _p_block(q, k, lse, qs, qe, ks, ke, scale, policy, causal)
        dp = _r(_mm(do[:, :, qs:qe], v[:, :, ks:ke].transpose(-1, -2), policy.gemm), bw)
        delta64[:, :, qs:qe] += _masked(dp.double() * p.double(), vis).sum(dim=-1)
    return delta64.float()


def backward(do, q, k, v, o_store, lse, policy: PrecisionPolicy, scale: float, causal: bool = True):
    """Tiled backward recomputing ``P = exp(S − lse)`` per block pair; all arguments FP32 tensors. GEMM operands
    are rounded to BF16 when ``policy.backward == "bf16"`` or ``policy.p_bar == "bf16"`` (FlashAttention-2 feeds P
    and dS to tensor cores in BF16); GEMM outputs and the dq/dk/dv accumulators are rounded to ``policy.backward``.
    Every GEMM multiplies as ``policy.gemm`` says (:func:`_mm`). Returns ``(dq, dk, dv)``."""
    T = q.shape[2]
    bw = policy.backward
    op = BF16 if (bw == BF16 or policy.p_bar == BF16) else FP32
    g = policy.gemm
    dq = torch.zeros_like(q)
    dk = torch.zeros_like(k)
    dv = torch.zeros_like(v)

    delta = backward_delta(do, q, k, v, o_store, lse, policy, scale, causal)

    for qs, qe, ks, ke in _block_pairs(T, policy, causal):
        p, vis, t = _p_block(q, k, lse, qs, qe, ks, ke, scale, policy, causal)
        vis_t = None if vis is None else vis.transpose(-1, -2)
        do_b = do[:, :, qs:qe]
        # dV_j += Pᵀ dO
        dv_j = _mm_visible(_r(p, op).transpose(-1, -2), _r(do_b, op), vis_t, g)
        dv[:, :, ks:ke] = _r(dv[:, :, ks:ke] + _r(dv_j, bw), bw)
        # dP = dO V_jᵀ ;  dS = P ∘ (dP − δ) · scale (· (1 − t²) through a soft-cap), exactly 0 where the key is
        # invisible
        dp = _r(_mm(do_b, v[:, :, ks:ke].transpose(-1, -2), g), bw)
        ds = p * scale * (dp - delta[:, :, qs:qe, None])
        ds = _masked(ds if t is None else ds * (1.0 - t * t), vis)
        ds_op = _r(ds, op)
        # dQ_i += dS K_j ;  dK_j += dSᵀ Q_i
        dq[:, :, qs:qe] = _r(dq[:, :, qs:qe] + _r(_mm_visible(ds_op, k[:, :, ks:ke], vis, g), bw), bw)
        dk_j = _mm_visible(ds_op.transpose(-1, -2), q[:, :, qs:qe], vis_t, g)
        dk[:, :, ks:ke] = _r(dk[:, :, ks:ke] + _r(dk_j, bw), bw)
    return dq, dk, dv


def _split_heads(policy: PrecisionPolicy, H: int):
    """(low-precision head indices, FP32 head indices) for ``policy.fp32_heads``."""
    bad = [h for h in policy.fp32_heads if h >= H]
    if bad:
        raise ValueError(f"fp32_heads {sorted(policy.fp32_heads)} name heads >= H = {H}")
    hp = sorted(policy.fp32_heads)
    lp = [h for h in range(H) if h not in policy.fp32_heads]
    return lp, hp


def forward_heads(q, k, v, policy: PrecisionPolicy, scale: float, causal: bool = True,
                  stats: AttentionStats | None = None):
    """:func:`forward` with ``policy.fp32_heads`` run by the FP32 twin; ``stats`` (all heads) filled from both
    groups."""
    lp, hp = _split_heads(policy, q.shape[1])
    o = torch.empty(q.shape[:-1] + v.shape[-1:], device=q.device)
    lse = torch.empty(q.shape[:-1], device=q.device)
    sub_stats = []
    if stats is not None and stats.eps is None:
        stats.eps = policy.sfa.eps if policy.sfa else 1e-3  # one eps for both head groups
    for heads, pol in ((lp, policy), (hp, fp32_twin(policy))):
        if not heads:
            continue
        st = AttentionStats(eps=stats.eps) if stats is not None else None
        o[:, heads], lse[:, heads] = forward(q[:, heads], k[:, heads], v[:, heads], pol, scale, causal, st)
        sub_stats.append((heads, st))
    if stats is not None:
        B, H = q.shape[:2]
        stats.rows = q.shape[2]
        for name in _COUNTS:
            setattr(stats, name, torch.zeros(B, H, dtype=torch.int64, device=q.device))
            for heads, st in sub_stats:
                getattr(stats, name)[:, heads] = getattr(st, name)
    return o, lse


def fill_stats(stats: AttentionStats, q, k, scale: float, policy: PrecisionPolicy, causal: bool = True) -> None:
    """Fill every count of ``stats`` as the forward would, from FP32 ``q``, ``k`` alone (V is not needed: the
    counts depend on S, P̄ and the row sums; a zero V of one feature stands in for it)."""
    forward_heads(q, k, q.new_zeros(q.shape[:-1] + (1,)), policy, scale, causal, stats)


class ReferenceAttention(torch.autograd.Function):
    """Autograd wrapper: forward and backward both follow the policy (not autograd of the forward)."""

    @staticmethod
    def forward(ctx, q, k, v, policy: PrecisionPolicy, scale: float, causal: bool, stats):
        qf, kf, vf = (t.float() for t in (q, k, v))
        o, lse = forward_heads(qf, kf, vf, policy, scale, causal, stats)
        ctx.save_for_backward(qf, kf, vf, o, lse)
        ctx.policy, ctx.scale, ctx.causal, ctx.heads = policy, scale, causal, _split_heads(policy, q.shape[1])
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
                    dof[:, heads], qf[:, heads], kf[:, heads], vf[:, heads], o[:, heads], lse[:, heads], pol, ctx.scale,
                    ctx.causal,
                )
        tq, tk, tv = ctx.dtypes
        return dq.to(tq), dk.to(tk), dv.to(tv), None, None, None, None
