"""Triton forward kernel for causal flash attention under a :class:`PrecisionPolicy`.

The kernel performs the same block-by-block algorithm as :func:`lpfa.attention.reference.forward`
(the specification), with each rounding point of the policy at the same place:

    S      = bf16(bf16(Q_b K_jᵀ)·scale)   or  Q_b K_jᵀ·scale           (policy.scores)
    rm     = rowmax(S)  (SFA: β·rm or 0 where ≥ 2 scores lie within ε of rm)
    m_new  = acc(max(m, rm))                                          (policy.accumulator)
    P̄      = exp(scores(S − m_new))  or  exp2(fma(S, log₂e, −fl(m_new·log₂e)))   (policy.exp)
    l      = acc(exp(acc(m − m_new))·l + clamp(rowsum(P̄)))
    Ō      = o_block(p_bar(P̄) V_j)                                   (policy.p_bar, policy.o_block)
    o      = acc(acc(o·c) + Ō)
    O      = o_store(acc(o / l)),  lse = log(l) + m                   (policy.o_store)

Causal split
------------
A query tile [q_start, q_start + BLOCK_M) sees every key of the policy blocks that end at or before key
q_start whole, so those blocks (the first ``n_full``) run in a first loop whose tiles build no mask (plain
loads, no ``tl.where``); the blocks touching the diagonal or the end of the sequence follow in a second loop,
masked. Inside such a block of several compute tiles (``N_SUB > 1``, the paper's 512-key blocks with a
multi-pass row max) each pass again runs the tiles that end at or before q_start unmasked, then the rest
masked, in ascending order, so every FP32 sum keeps its order and the results are bit-identical to masking
every tile (``causal_split=False``).

SFA's tie test in the row-max pass
----------------------------------
SFA (Eq. 6) shifts a row's max where rs = #{visible S ≥ thr} > 1, thr = scores(rm − ε). With the block's max rm
known only after its last tile, counting needs a second pass over the tiles, which in a block of several tiles
(the paper's 512 keys) recomputes every QKᵀ GEMM once more. The kernel instead keeps, next to rm, the second largest
visible score r2 (a tied max counts twice) during the row-max pass, both from one reduction per tile over (value,
−inf) pairs (:func:`~lpfa.attention.triton_common._row_top2`): thr ≤ rm, so rs > 1 exactly when r2 ≥ thr, and where
r2 = −inf (thr = −inf counts every visible key) when the row sees more than one key of the block. The decisions,
and so the bits, equal the counting pass's (``sfa_count_pass=True``, tested under the interpreter); SFA then costs
the base policy's GEMMs and the top-two reduction, in blocks of one tile as of several.

The soft-cap's row max
----------------------
Under a soft-cap (``policy.softcap``, S' = scores(c·scores(tanh(scores(S·fl(1/c)))))) the row-max pass would compute
tanh for every score of a policy block once more than the P̄ pass does. With BF16 scores it need not: S·fl(1/c) and
the roundings are non-decreasing, and the kernels' FP32 tanh (:func:`~lpfa.attention.triton_common._tanh`, within a
few FP32 ulps of :func:`lpfa.attention.reference.tanh_f32`) is non-decreasing on every one of the 2¹⁶ BF16 values it
can be given (checked on all of them: the reference's in ``tests/test_softcap.py``, the interpreter's in
``tests/test_attention_triton_fwd.py``, libdevice's on the GPU in ``tests/test_attention_gpu.py``), so the capped
scores of a row's largest raw Q Kᵀ values are its largest capped scores, and the pass caps only those
(:func:`raw_row_max`). One value needs care: the cap maps a score of −inf to −c, so SFA's
second largest r2 = −inf of a row that sees one key of the block, which is no score, stays −inf.

Non-finite V: two launches
--------------------------
A non-finite V entry must reach exactly the rows that see its key (:func:`~lpfa.attention.triton_common._dot_visible`),
which takes a second GEMM and masks; compiled into the hot loop, that path alone pushed the kernel into register
spills (``benchmarks/compile_check.py`` counts them), and compiled in after the fast path it still slowed it. So
:func:`flash_forward` launches the kernel twice: with ``REDO=False`` for every tile (plain P̄V GEMMs), then with
``REDO=True``. The first also stores one flag per tile, set where the tile of O it stored holds an inf or NaN; the
second's programs each read ``REDO_TILES`` flags and compute again the tiles flagged. An inf or NaN of V that a P̄V
GEMM meets, even as 0·inf, leaves its rows of O not finite, so a finite tile is the non-finite path's bit for bit,
and only the others are computed again, on that path (:func:`~lpfa.attention.triton_common.redo_launches`). Nothing
syncs with the host.

Interpreter-safe rounding design
--------------------------------
Triton's CPU interpreter (``TRITON_INTERPRET=1``) does not do BF16 arithmetic faithfully: a BF16
``tl.dot`` multiplies raw bit patterns, and a float → bf16 cast truncates instead of rounding to
nearest even. So the kernel never holds a BF16 value in a BF16 register:

* every value lives in an FP32 register;
* each BF16 rounding point is :func:`_round_bf16`, a round-to-nearest-even: on a GPU the hardware
  conversion to BF16 and back, under the interpreter integer arithmetic on the FP32 bit pattern (add
  ``0x7FFF + lsb``, clear the low 16 bits; inf/nan kept), the same value either way; it is switched on
  or off by one ``tl.constexpr`` flag per rounding point, so an FP32 policy compiles to no extra instruction;
* GEMMs are ``tl.dot`` on FP32 operands with ``input_precision="ieee"`` (no TF32): the operands
  already hold BF16-representable values where the policy rounds them, so an FP32 GEMM computes
  the same products as a BF16 tensor-core GEMM with FP32 accumulation. On a GPU the constexprs
  ``QK_DOT``/``PV_DOT`` (one MODE each, :func:`lpfa.attention.triton_common.gemm_mode`) may instead cast
  those (already exact) operands to ``tl.bfloat16`` for tensor-core speed; it is applied only where the
  operands are BF16-representable by construction (Q, K, V given as bf16; P̄ rounded by ``policy.p_bar``).
  It defaults to ``not interpreter``.
* ``policy.gemm == "bf16x6"``: an operand not BF16 by construction (FP32 inputs; P̄ under ``p_bar="fp32"``)
  is split in three BF16 parts and the GEMM is six BF16 GEMMs (three when the other operand is BF16), summed in
  FP32 (:data:`lpfa.attention.policy.GEMM_SPLIT_DOC`); the parts are exact BF16 values, cast to ``tl.bfloat16``
  on a GPU and kept in FP32 registers (exact products) under the interpreter.

Under the interpreter the wrapper hands the kernel FP32 copies of q, k, v (values unchanged); on a GPU
the kernel loads the native dtype and keeps BF16 operands for the tensor cores where they are exact.

Layouts: q, k, v arrive in any layout they share with unit stride along D (``triton_common.shared_layout``), and the
kernel addresses row t of batch·head (b, h) at ``b·stride_b + h·stride_h + t·stride_t``. GPT's attention passes
transposed views of its (B, T, 3·C) projection, which therefore need no copies. O is written dense in q's order of
dimensions (``triton_common.empty_like_layout``): (B, T, H, D) in memory for the model's views, as FlashAttention and
SDPA store it, so the model's ``y.transpose(1, 2).contiguous()`` copies nothing; lse is (B, H, T) contiguous.

Differences from the reference that remain: the reference sums GEMMs and row sums in float64 and
rounds once to FP32; the kernel accumulates in FP32 in its own order, so an FP32 difference of an
ulp can occasionally flip a later BF16 rounding by one BF16 ulp. On a GPU, ``tl.exp``/``tl.log``
lower to fast approximations; ``PRECISE_MATH`` (default on for GPUs) uses libdevice ``expf``/``logf``
instead, as PyTorch's CUDA kernels do, and FP contraction (FMA) is disabled at launch so that
``c·l + rowsum`` is two roundings, as in the reference. The interpreter path is tested on every machine; the GPU path
against the reference on the same GPU by ``tests/test_attention_gpu.py`` (``results/attention_gpu_tests``).

Options of :func:`flash_forward`
--------------------------------
``dot_bf16`` (default: not under the interpreter) feeds tensor cores BF16 operands where they are exactly BF16
values; ``precise_math`` (default: not under the interpreter) uses libdevice exp/log. ``block_m``/``block_n``
(compute tiles), ``num_warps``, ``num_stages``: launch tuning only, since the policy's blocks fix the rounding (None:
the entry of :data:`lpfa.attention.triton_common.LAUNCHES` for the policy and head dim).
``causal_split=False`` runs every key tile through the masked path (the kernel before the causal split;
bit-identical results, for tests and benchmarks). ``sfa_count_pass=True`` decides SFA's ties by a pass of their
own that counts the scores within ε of the row max, as the reference does, instead of from the top two scores of
the row-max pass (bit-identical; for tests and benchmarks). ``raw_max=False`` rounds (and caps) every score of the
row-max pass over a policy block of several tiles, instead of taking the raw Q Kᵀ and rounding the row's largest (and,
for SFA, second largest) value (:func:`_scores_of`: the rounding and the cap are monotone, so the two are
bit-identical; for tests and benchmarks; the raw pass is used where S is rounded to nearest, under a soft-cap only
where S is BF16: :func:`raw_row_max`). ``fold_scale=False`` multiplies every score by the scale, instead of holding
S/scale and folding the scale into exp's argument where it is a power of two (1/8 at D = 64;
:func:`~lpfa.attention.triton_common.scale_folds` and ``_exp_scaled``: the product is exact, so the two are
bit-identical; for tests and benchmarks). ``validate=False`` skips the input checks
(:func:`~lpfa.attention.triton_common.check_triton_inputs`) for a caller that has made them once, as
:func:`lpfa.attention.attention` does. ``assume_finite=True``: the caller vouches that q, k, v hold no inf or NaN (a
trainer that stops at a non-finite loss can), so the second launch is skipped; a non-finite V then reaches rows that
cannot see its key (through 0·inf = NaN in the P̄V product), as in a plain GEMM.
"""

from __future__ import annotations

import torch

from lpfa.attention.policy import BF16, PrecisionPolicy, get_policy
from lpfa.attention.triton_common import (
    REDO_TILES,
    _any_nonfinite,
    _at,
    _dot,
    _dot_visible,
    _exp_scaled,
    _exp_shifted,
    _interpreter,
    _keep_visible,
    _load_tile,
    _log,
    _max_nan,
    _out_rows,
    _redo_flags,
    _rescale,
    _rnd,
    _rnd_l,
    _rnd_o,
    _rnd_s,
    _row_max,
    _row_top2,
    _score_pos,
    _shift_arg,
    _softcap,
    _sr_pre,
    _store_flag,
    _top2,
    check_triton_inputs,
    default_launch,
    empty_like_layout,
    gemm_mode,
    launch,
    libdevice,
    policy_tiles,
    redo_launches,
    scale_folds,
    shared_layout,
    tl,
    triton,
)

if triton is not None:

    @triton.jit
    def _n_visible(offs_m, kb_lo, BK: tl.constexpr, T):
        """How many keys of the policy block [kb_lo, kb_lo + BK) each row sees: min(row + 1, block end, T) − start."""
        return tl.minimum(tl.minimum(offs_m + 1, kb_lo + BK), T) - kb_lo

    @triton.jit
    def _visible(k_lo, k_hi, offs_m, loc_n, T):
        """(BLOCK_M, BLOCK_N) mask of the key tile [k_lo, k_lo + BLOCK_N): key < k_hi (its policy block's end),
        key < T, key <= query."""
        offs_n = k_lo + loc_n
        key_ok = (offs_n < k_hi) & (offs_n < T)
        return key_ok[None, :] & (offs_n[None, :] <= offs_m[:, None])

    @triton.jit
    def _scores_tile(q, K, stride_t, k_lo, k_hi, offs_m, loc_n, T, scale, s_pre, HEAD_DIM: tl.constexpr,
                     SCORES_BF16: tl.constexpr, QK_DOT: tl.constexpr, MASKED: tl.constexpr,
                     PRECISE_MATH: tl.constexpr, SOFTCAP: tl.constexpr, SR_SCORES: tl.constexpr,
                     RAW: tl.constexpr = False, FOLD: tl.constexpr = False):
        """S = Q Kᵀ · scale for one key tile [k_lo, k_lo + BLOCK_N) ∩ [.., k_hi): bf16(bf16(QKᵀ)·scale) or
        FP32, the two BF16 roundings stochastic with SR_SCORES (``s_pre``: _sr_pre of the seed and batch·head).
        MASKED: −inf where the key is masked (key > query, key ≥ k_hi, key ≥ T); else the tile lies inside
        [0, T) and its block, at or below the diagonal for every row: a plain load, no mask. RAW: Q Kᵀ as the GEMM
        returns it, masked alike, before any rounding (:func:`_scores_of` rounds it). FOLD: S/scale = scores(Q Kᵀ),
        masked alike (the scale a power of two, folded into exp's argument by
        :func:`~lpfa.attention.triton_common._exp_scaled`; exact)."""
        offs_n = k_lo + loc_n
        offs_d = tl.arange(0, HEAD_DIM)
        key_ok = ((offs_n < k_hi) & (offs_n < T))[None, :] if MASKED else None
        kt = _load_tile(K + offs_n[None, :] * stride_t + offs_d[:, None], key_ok)
        s = _dot(q, kt, QK_DOT)  # BF16 operands (exact), IEEE FP32 or BF16 split (policy.gemm), FP32 accumulation
        if not RAW:
            pos = _score_pos(offs_m, offs_n, T, TRANSPOSED=False) if SR_SCORES else None
            s = _rnd_s(s, SCORES_BF16, SR_SCORES, s_pre, 0, pos)  # the QKᵀ GEMM output
            if not FOLD:  # (FOLD: S/scale, the scale left to exp's argument, _exp_scaled)
                s = _rnd_s(s * scale, SCORES_BF16, SR_SCORES, s_pre, 1, pos)  # ·scale (a BF16 op in the paper's code)
                s, _ = _softcap(s, SCORES_BF16, PRECISE_MATH, SOFTCAP)  # c·tanh(S / c) where policy.softcap is set
        visible = _visible(k_lo, k_hi, offs_m, loc_n, T) if MASKED else None
        return _keep_visible(s, visible, float("-inf"))

    @triton.jit
    def _scores_of(x, scale, SCORES_BF16: tl.constexpr, PRECISE_MATH: tl.constexpr, SOFTCAP: tl.constexpr):
        """bf16(bf16(x)·scale) or x·scale (FP32), then soft-capped where SOFTCAP is set: the scores of raw Q Kᵀ
        values x, rounded to nearest as :func:`_scores_tile` rounds them. Each step is non-decreasing in x (scale > 0;
        the cap's tanh on BF16 scores: "The soft-cap's row max" in the module docstring), so the scores of a row's
        largest x are its largest scores, and of its two largest x its two largest scores (ties kept): the row-max
        pass takes them from the raw GEMM output and rounds two values per row, not every score (RAW_MAX)."""
        s = _rnd(_rnd(x, SCORES_BF16) * scale, SCORES_BF16)
        s, _ = _softcap(s, SCORES_BF16, PRECISE_MATH, SOFTCAP)
        return s

    @triton.jit
    def _block_tiles(rm, r2, rs, block_sum, o_blk, s_block, thr, m_use, t_lo, t_hi,
                     q, K, V, stride_t, kb_lo, offs_m, loc_n, T, scale, v_nonfinite, s_pre,
                     HEAD_DIM: tl.constexpr, BK: tl.constexpr, BLOCK_N: tl.constexpr, N_SUB: tl.constexpr,
                     SCORES_BF16: tl.constexpr, PBAR_BF16: tl.constexpr, QK_DOT: tl.constexpr,
                     PV_DOT: tl.constexpr, PRECISE_MATH: tl.constexpr, PASS: tl.constexpr,
                     MASKED: tl.constexpr, SOFTCAP: tl.constexpr, TOP2: tl.constexpr, EXP2: tl.constexpr,
                     SR_SCORES: tl.constexpr, RAW_MAX: tl.constexpr, FOLD: tl.constexpr = False):
        """One pass over the key tiles t_lo .. t_hi − 1 of the policy block at kb_lo, each tile's S recomputed
        (N_SUB > 1) or the block's one tile S = s_block (N_SUB == 1). PASS 0: rm = rowmax(S), and with TOP2 (SFA)
        also r2 = the second largest S (a tied maximum counts twice, masked keys are −inf), of the raw Q Kᵀ instead
        of S with RAW_MAX (the caller rounds them, :func:`_scores_of`); 1 (SFA with sfa_count_pass): rs = #{S ≥ thr};
        2: rowsum(P̄) and Ō = p_bar(P̄) V with P̄ = exp(scores(S − m_use)), or with EXP2 exp2(fma(S, log₂e, −m_use))
        (m_use then holds fl(m·log₂e), _shift_arg). MASKED: see _scores_tile."""
        kb_hi = kb_lo + BK
        offs_d = tl.arange(0, HEAD_DIM)
        for t in range(t_lo, t_hi):
            k_lo = kb_lo + t * BLOCK_N
            s = s_block if N_SUB == 1 else _scores_tile(q, K, stride_t, k_lo, kb_hi, offs_m, loc_n, T, scale, s_pre,
                                                        HEAD_DIM, SCORES_BF16, QK_DOT, MASKED=MASKED,
                                                        PRECISE_MATH=PRECISE_MATH, SOFTCAP=SOFTCAP,
                                                        SR_SCORES=SR_SCORES, RAW=RAW_MAX and PASS == 0, FOLD=FOLD)
            visible = _visible(k_lo, kb_hi, offs_m, loc_n, T) if MASKED else None
            if PASS == 0:  # rm = max(rm, rowmax(S)), NaN-propagating
                if TOP2:  # and r2: the tile's top two (t1 ≥ t2, a tied max counting twice) merged into (rm, r2)
                    t1, t2 = _row_top2(s)
                    rm, r2 = _top2(rm, r2, t1, t2)
                else:
                    rm = _max_nan(rm, _row_max(s))
            elif PASS == 1:  # rs += #{visible S ≥ thr} (a masked −inf would count where thr is −inf)
                rs += tl.sum(_keep_visible(s >= thr[:, None], visible, False).to(tl.int32), axis=1)
            else:
                # P̄ = exp(scores(S − m_new)) (a BF16 subtraction when S is BF16), or exp2(fma(S, log₂e, −m·log₂e));
                # 0 where masked; rowsum(P̄) in FP32
                if FOLD:  # S/scale held: the scale joins exp's argument (the same bits, one multiply fewer)
                    p = _exp_scaled(s, scale, m_use[:, None], SCORES_BF16, PRECISE_MATH, EXP2)
                else:
                    p = _exp_shifted(s, m_use[:, None], SCORES_BF16, PRECISE_MATH, EXP2)
                p = _keep_visible(p, visible, 0.0)
                block_sum += tl.sum(p, axis=1)
                p_pv = _rnd(p, PBAR_BF16)  # P̄ as fed to the P̄V product
                offs_n = k_lo + loc_n
                key_ok = ((offs_n < kb_hi) & (offs_n < T))[:, None] if MASKED else None
                v = _load_tile(V + offs_n[:, None] * stride_t + offs_d[None, :], key_ok)
                # Ō += P̄ V_j over visible keys only (a non-finite V reaches just the rows that see it)
                o_blk += _dot_visible(p_pv, v, visible, v_nonfinite, PV_DOT)
        return rm, r2, rs, block_sum, o_blk

    @triton.jit
    def _block_pass(rm, r2, rs, block_sum, o_blk, s_block, thr, m_use, n_sub, t_full,
                    q, K, V, stride_t, kb_lo, offs_m, loc_n, T, scale, v_nonfinite, s_pre,
                    HEAD_DIM: tl.constexpr, BK: tl.constexpr, BLOCK_N: tl.constexpr, N_SUB: tl.constexpr,
                    SCORES_BF16: tl.constexpr, PBAR_BF16: tl.constexpr, QK_DOT: tl.constexpr,
                    PV_DOT: tl.constexpr, PRECISE_MATH: tl.constexpr, PASS: tl.constexpr,
                    MASKED: tl.constexpr, SOFTCAP: tl.constexpr, TOP2: tl.constexpr, EXP2: tl.constexpr,
                    SR_SCORES: tl.constexpr, RAW_MAX: tl.constexpr, FOLD: tl.constexpr = False):
        """Pass PASS over the block's n_sub tiles in ascending order (the FP32 sums keep their order): the first
        t_full without masks, the rest (only in a MASKED block: one touching the diagonal or the end) with."""
        if N_SUB > 1 or not MASKED:  # (a MASKED block of one tile has t_full = 0)
            rm, r2, rs, block_sum, o_blk = _block_tiles(
                rm, r2, rs, block_sum, o_blk, s_block, thr, m_use, 0, t_full, q, K, V, stride_t, kb_lo, offs_m, loc_n,
                T, scale, v_nonfinite, s_pre, HEAD_DIM, BK, BLOCK_N, N_SUB, SCORES_BF16, PBAR_BF16, QK_DOT, PV_DOT,
                PRECISE_MATH, PASS, MASKED=False, SOFTCAP=SOFTCAP, TOP2=TOP2, EXP2=EXP2, SR_SCORES=SR_SCORES,
                RAW_MAX=RAW_MAX, FOLD=FOLD)
        if MASKED:
            rm, r2, rs, block_sum, o_blk = _block_tiles(
                rm, r2, rs, block_sum, o_blk, s_block, thr, m_use, t_full, n_sub, q, K, V, stride_t, kb_lo, offs_m,
                loc_n, T, scale, v_nonfinite, s_pre, HEAD_DIM, BK, BLOCK_N, N_SUB, SCORES_BF16, PBAR_BF16, QK_DOT,
                PV_DOT, PRECISE_MATH, PASS, MASKED=True, SOFTCAP=SOFTCAP, TOP2=TOP2, EXP2=EXP2, SR_SCORES=SR_SCORES,
                RAW_MAX=RAW_MAX, FOLD=FOLD)
        return rm, r2, rs, block_sum, o_blk

    @triton.jit
    def _fwd_block(acc, l_i, m_i, q, K, V, stride_t, kb_lo, n_sub, t_full, offs_m, loc_n, T, v_nonfinite,
                   scale, clamp_val, sfa_beta, sfa_eps, sfa_min_shift, pid_bh, sr_seed,
                   HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BK: tl.constexpr, BLOCK_N: tl.constexpr,
                   N_SUB: tl.constexpr, SCORES_BF16: tl.constexpr, PBAR_BF16: tl.constexpr,
                   OBLOCK_BF16: tl.constexpr, ACC_BF16: tl.constexpr, USE_CLAMP: tl.constexpr,
                   USE_SFA: tl.constexpr, QK_DOT: tl.constexpr, PV_DOT: tl.constexpr,
                   PRECISE_MATH: tl.constexpr, SR_OBLOCK: tl.constexpr, SR_ACC: tl.constexpr, MASKED: tl.constexpr,
                   SOFTCAP: tl.constexpr, SFA_COUNT_PASS: tl.constexpr, EXP2: tl.constexpr, SR_SCORES: tl.constexpr,
                   RAW_MAX: tl.constexpr, FOLD: tl.constexpr = False):
        """The policy key block [kb_lo, kb_lo + BK) against the query tile: its first n_sub compute tiles (those
        holding a key <= the tile's last row), of which the first t_full need no mask. MASKED = False: the whole
        block is visible to every row (t_full = n_sub = N_SUB). Returns the running state (o, l, m) updated."""
        rm = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        r2 = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        rs = tl.zeros([BLOCK_M], dtype=tl.int32)
        block_sum = tl.zeros([BLOCK_M], dtype=tl.float32)
        o_blk = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)
        # the scores' stochastic rounding hashes from this (policy.stochastic with "scores"; unused otherwise)
        s_pre = _sr_pre(sr_seed, 7, pid_bh) if SR_SCORES else 0
        # a block of one tile: S once, kept for every pass; else each pass recomputes its tiles' S
        s = _scores_tile(q, K, stride_t, kb_lo, kb_lo + BK, offs_m, loc_n, T, scale, s_pre, HEAD_DIM, SCORES_BF16,
                         QK_DOT, MASKED=MASKED, PRECISE_MATH=PRECISE_MATH, SOFTCAP=SOFTCAP,
                         SR_SCORES=SR_SCORES, FOLD=FOLD) if N_SUB == 1 else None

        # ---- rm = rowmax(S) over the policy block's visible keys (pass 1 over a block of several tiles); with SFA
        # also r2, the second largest visible score (blocks of one tile too), so the tie test needs no count pass ----
        rm, r2, rs, block_sum, o_blk = _block_pass(
            rm, r2, rs, block_sum, o_blk, s, rm, rm, n_sub, t_full, q, K, V, stride_t, kb_lo, offs_m, loc_n, T, scale,
            v_nonfinite, s_pre, HEAD_DIM, BK, BLOCK_N, N_SUB, SCORES_BF16, PBAR_BF16, QK_DOT, PV_DOT,
            PRECISE_MATH, PASS=0, MASKED=MASKED, SOFTCAP=SOFTCAP, TOP2=USE_SFA and not SFA_COUNT_PASS, EXP2=EXP2,
            SR_SCORES=SR_SCORES, RAW_MAX=RAW_MAX, FOLD=FOLD)
        if RAW_MAX or FOLD:  # that pass took the raw Q Kᵀ (or S/scale): the scores of its top one (and two) are the
            # block's
            rm = _scores_of(rm, scale, SCORES_BF16, PRECISE_MATH, SOFTCAP)
            if USE_SFA:
                r2_raw = r2
                r2 = _scores_of(r2, scale, SCORES_BF16, PRECISE_MATH, SOFTCAP)
                if SOFTCAP > 0 and MASKED:  # the cap maps a −inf score to −c, but r2 = −inf from a row's one
                    # visible key is no score: it stays −inf (the tie test below reads it so)
                    one_key = _n_visible(offs_m, kb_lo, BK, T) < 2
                    r2 = tl.where((r2_raw == float("-inf")) & one_key, float("-inf"), r2)
        row_live = offs_m >= kb_lo  # rows with a visible key in this block (whatever the scores hold)

        if USE_SFA:
            # SFA (Eq. 6): thr = scores(rm − ε); tied where rs = #{visible S ≥ thr} > 1;
            # there:  m = scores(β·rm) if rm > 0,  0 if rm < 0;  then at least scores(rm + min_shift)
            thr = _rnd(rm - sfa_eps, SCORES_BF16)
            if not SFA_COUNT_PASS:
                # thr ≤ rm, so rs > 1 ⇔ r2 ≥ thr, except where r2 = −inf (no second score, or a visible −inf): there
                # thr = −inf counts every visible key, #visible = min(row + 1, block end, T) − block start
                if MASKED:
                    tied = (r2 >= thr) & ((r2 > float("-inf")) | (_n_visible(offs_m, kb_lo, BK, T) > 1))
                else:  # every row sees all BK > 1 keys of the block
                    tied = r2 >= thr
            else:  # count against the block's final max in a pass of its own (over the S held, or the tiles again)
                rm, r2, rs, block_sum, o_blk = _block_pass(
                    rm, r2, rs, block_sum, o_blk, s, thr, rm, n_sub, t_full, q, K, V, stride_t, kb_lo, offs_m, loc_n, T,
                    scale, v_nonfinite, s_pre, HEAD_DIM, BK, BLOCK_N, N_SUB, SCORES_BF16, PBAR_BF16, QK_DOT, PV_DOT,
                    PRECISE_MATH, PASS=1, MASKED=MASKED, SOFTCAP=SOFTCAP, TOP2=False, EXP2=EXP2, SR_SCORES=SR_SCORES,
                    RAW_MAX=False)
                tied = rs > 1
            m_sfa = tl.where(tied & (rm > 0), _rnd(rm * sfa_beta, SCORES_BF16), rm)
            m_sfa = tl.where(tied & (rm < 0), 0.0, m_sfa)
            rm = tl.where(tied, _max_nan(m_sfa, _rnd(rm + sfa_min_shift, SCORES_BF16)), m_sfa)

        # m_new = acc(max(m, rm)); rows without a visible key keep m
        m_new = _rnd(_max_nan(m_i, rm), ACC_BF16)
        m_new = tl.where(row_live, m_new, m_i)
        # subtract 0 where every visible score so far is −inf (FA2's Check_inf): exp gives 0 there, not NaN
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)

        # ---- P̄ = exp(scores(S − m_new)); rowsum(P̄) and Ō = P̄ V_j accumulate in FP32 over the tiles ------
        rm, r2, rs, block_sum, o_blk = _block_pass(
            rm, r2, rs, block_sum, o_blk, s, rm, _shift_arg(m_use, EXP2), n_sub, t_full, q, K, V, stride_t, kb_lo,
            offs_m, loc_n, T, scale, v_nonfinite, s_pre, HEAD_DIM, BK, BLOCK_N, N_SUB, SCORES_BF16, PBAR_BF16, QK_DOT,
            PV_DOT, PRECISE_MATH, PASS=2, MASKED=MASKED, SOFTCAP=SOFTCAP, TOP2=False, EXP2=EXP2, SR_SCORES=SR_SCORES,
            RAW_MAX=False, FOLD=FOLD)
        if USE_CLAMP:  # the paper clamps each block's row sum at 1e-10
            # a NaN sum stays NaN (torch.clamp_min)
            block_sum = tl.where(row_live, _max_nan(block_sum, clamp_val), block_sum)
        # the block's Ō = P̄V output (to nearest, or stochastically: policy.stochastic, hashed by position and block)
        offs_d = tl.arange(0, HEAD_DIM)
        j = kb_lo // BK
        o_bar = _rnd_o(o_blk, OBLOCK_BF16, SR_OBLOCK, sr_seed, 1, pid_bh, j, offs_m, offs_d, HEAD_DIM)

        # c = exp(acc(m − m_new)) (or exp2 of it times log₂e): 0 on the first block (m = −inf); 1 in rows without a
        # visible key here
        c = _rescale(_rnd(m_i - m_use, ACC_BF16), PRECISE_MATH, EXP2)
        c = tl.where(row_live, c, 1.0)
        # l = acc(c·l + rowsum(P̄));  o = acc(o·c);  o = acc(o + Ō);  m = m_new
        l_i = _rnd_l(c * l_i + block_sum, ACC_BF16, SR_ACC, sr_seed, 6, pid_bh, j, offs_m)
        acc = _rnd_o(acc * c[:, None], ACC_BF16, SR_ACC, sr_seed, 2, pid_bh, j, offs_m, offs_d, HEAD_DIM)
        acc = _rnd_o(acc + o_bar, ACC_BF16, SR_ACC, sr_seed, 3, pid_bh, j, offs_m, offs_d, HEAD_DIM)
        return acc, l_i, m_new

    @triton.jit
    def _fwd_program(Q, K, V, O, LSE, FLAGS, n_tiles, pid_m, pid_bh, H, stride_b, stride_h, stride_t,  # noqa: E741
                     o_stride_b, o_stride_h, O_STRIDE_T: tl.constexpr, T, scale, clamp_val, sfa_beta, sfa_eps,
                     sfa_min_shift, sr_seed, v_nonfinite, FLAG: tl.constexpr,
                     HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BK: tl.constexpr, BLOCK_N: tl.constexpr,
                     N_SUB: tl.constexpr, SCORES_BF16: tl.constexpr, PBAR_BF16: tl.constexpr,
                     OBLOCK_BF16: tl.constexpr, ACC_BF16: tl.constexpr, OSTORE_BF16: tl.constexpr,
                     USE_CLAMP: tl.constexpr, USE_SFA: tl.constexpr, QK_DOT: tl.constexpr, PV_DOT: tl.constexpr,
                     PRECISE_MATH: tl.constexpr, SR_OBLOCK: tl.constexpr, SR_ACC: tl.constexpr,
                     SR_OSTORE: tl.constexpr, SOFTCAP: tl.constexpr, CAUSAL_SPLIT: tl.constexpr,
                     SFA_COUNT_PASS: tl.constexpr, EXP2: tl.constexpr, SR_SCORES: tl.constexpr,
                     RAW_MAX: tl.constexpr, FOLD: tl.constexpr = False):
        """Query tile ``pid_m`` of batch·head ``pid_bh``: load its Q, run every policy key block up to the diagonal,
        then store O = o_store(acc(o / l)) and lse = log(l) + m. ``v_nonfinite`` = 0 (a constant): plain P̄V GEMMs;
        1: the non-finite path, where an inf or NaN of V reaches exactly the rows that see its key. FLAG: also store
        the tile's flag for the redo launch (triton_common._store_flag)."""
        q_start = pid_m * BLOCK_M
        offs_m = q_start + tl.arange(0, BLOCK_M)
        row_ok = offs_m < T
        offs_d = tl.arange(0, HEAD_DIM)
        # this batch·head's row 0 of Q, K, V, whatever their layout (the model passes transposed views)
        in_base = (pid_bh // H).to(tl.int64) * stride_b + (pid_bh % H).to(tl.int64) * stride_h
        Q, K, V = Q + in_base, K + in_base, V + in_base
        O = O + _out_rows(pid_bh, T, H, o_stride_b, o_stride_h, O_STRIDE_T, HEAD_DIM)  # noqa: E741  and O's, own layout
        loc_n = tl.arange(0, BLOCK_N)

        # Q tile: (BLOCK_M, D); padded rows are 0
        q = tl.load(Q + offs_m[:, None] * stride_t + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        q = q.to(tl.bfloat16) if QK_DOT == 1 else q.to(tl.float32)  # converted once, not per key tile

        # running state: m = −inf, l = 0, o = 0
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32)

        # policy key blocks 0 .. the one holding this tile's last row (later ones are above the diagonal).
        # Blocks 0 .. n_full − 1 end at or before key q_start (so inside [0, T)): every row sees all their keys,
        # no mask (a padded tile, BLOCK_N > BK, always needs one); the rest touch the diagonal or the end of T.
        q_last = tl.minimum(q_start + BLOCK_M, T) - 1
        n_kblocks = q_last // BK + 1
        n_full = (q_start + 1) // BK if (CAUSAL_SPLIT and BLOCK_N * N_SUB == BK) else 0
        for j in range(0, n_full):
            acc, l_i, m_i = _fwd_block(
                acc, l_i, m_i, q, K, V, stride_t, j * BK, N_SUB, N_SUB, offs_m, loc_n, T, v_nonfinite,
                scale, clamp_val, sfa_beta, sfa_eps, sfa_min_shift, pid_bh, sr_seed, HEAD_DIM, BLOCK_M, BK, BLOCK_N,
                N_SUB, SCORES_BF16, PBAR_BF16, OBLOCK_BF16, ACC_BF16, USE_CLAMP, USE_SFA, QK_DOT, PV_DOT,
                PRECISE_MATH, SR_OBLOCK, SR_ACC, MASKED=False, SOFTCAP=SOFTCAP, SFA_COUNT_PASS=SFA_COUNT_PASS,
                EXP2=EXP2, SR_SCORES=SR_SCORES, RAW_MAX=RAW_MAX, FOLD=FOLD)
        for j in range(n_full, n_kblocks):
            kb_lo = j * BK
            # tiles of this policy block that hold a key <= q_last (the rest are invisible to every row), the
            # first t_full of them ending at or before key q_start (a block of one tile is masked whole here)
            n_sub = tl.minimum((q_last - kb_lo) // BLOCK_N + 1, N_SUB) if N_SUB > 1 else 1
            # (never a block's last tile when it is cut short by the block's end: BK // BLOCK_N whole tiles)
            t_full = tl.minimum(tl.maximum(q_start + 1 - kb_lo, 0) // BLOCK_N,
                                tl.minimum(n_sub, BK // BLOCK_N)) if (CAUSAL_SPLIT and N_SUB > 1) else 0
            acc, l_i, m_i = _fwd_block(
                acc, l_i, m_i, q, K, V, stride_t, kb_lo, n_sub, t_full, offs_m, loc_n, T, v_nonfinite,
                scale, clamp_val, sfa_beta, sfa_eps, sfa_min_shift, pid_bh, sr_seed, HEAD_DIM, BLOCK_M, BK, BLOCK_N,
                N_SUB, SCORES_BF16, PBAR_BF16, OBLOCK_BF16, ACC_BF16, USE_CLAMP, USE_SFA, QK_DOT, PV_DOT,
                PRECISE_MATH, SR_OBLOCK, SR_ACC, MASKED=True, SOFTCAP=SOFTCAP, SFA_COUNT_PASS=SFA_COUNT_PASS, EXP2=EXP2,
                SR_SCORES=SR_SCORES, RAW_MAX=RAW_MAX, FOLD=FOLD)

        # O = o_store(acc(o / l));  lse = log(l) + m
        out = _rnd_o(acc / l_i[:, None], ACC_BF16, SR_ACC, sr_seed, 4, pid_bh, 0, offs_m, offs_d, HEAD_DIM)
        out = _rnd_o(out, OSTORE_BF16, SR_OSTORE, sr_seed, 5, pid_bh, 0, offs_m, offs_d, HEAD_DIM)
        lse = _log(l_i, PRECISE_MATH) + m_i

        # the store casts to O's dtype: exact, since `out` already holds o_store-representable values
        tl.store(O + offs_m[:, None] * O_STRIDE_T + offs_d[None, :], out.to(O.dtype.element_ty),
                 mask=row_ok[:, None])
        tl.store(LSE + pid_bh.to(tl.int64) * T + offs_m, lse, mask=row_ok)
        if FLAG:  # 1 where this tile of O holds an inf or NaN: the redo launch computes it again
            _store_flag(FLAGS, pid_bh, pid_m, n_tiles, _any_nonfinite(out, row_ok))

    @triton.jit
    def _flash_fwd_kernel(
        Q, K, V, O, LSE,  # noqa: E741  Q, K, V, O (B, H, T, D), strides below; LSE FP32 (B*H, T) contiguous
        FLAGS, n_tiles,  # int32 (B*H, n_tiles): 1 per query tile whose O the fast launch left not finite
        H, stride_b, stride_h, stride_t,  # Q, K, V's strides (shared; unit stride along D): any layout, no copies
        o_stride_b, o_stride_h,  # O's (triton_common.empty_like_layout: Q's order of dimensions)
        O_STRIDE_T: tl.constexpr,  # and its row stride, a constant: D (contiguous) or H·D (the model's views)
        T, scale, clamp_val, sfa_beta, sfa_eps, sfa_min_shift,
        sr_seed,  # policy.sr_seed (stochastic rounding)
        HEAD_DIM: tl.constexpr,
        BLOCK_M: tl.constexpr,  # query rows per program (rows are independent in the forward)
        BK: tl.constexpr, BLOCK_N: tl.constexpr, N_SUB: tl.constexpr,  # policy key block = N_SUB tiles
        SCORES_BF16: tl.constexpr, PBAR_BF16: tl.constexpr, OBLOCK_BF16: tl.constexpr,
        ACC_BF16: tl.constexpr, OSTORE_BF16: tl.constexpr,
        USE_CLAMP: tl.constexpr, USE_SFA: tl.constexpr,
        QK_DOT: tl.constexpr, PV_DOT: tl.constexpr, PRECISE_MATH: tl.constexpr,
        SR_OBLOCK: tl.constexpr, SR_ACC: tl.constexpr, SR_OSTORE: tl.constexpr,  # policy.stochastic
        SOFTCAP: tl.constexpr,  # policy.softcap, 0.0 = off
        CAUSAL_SPLIT: tl.constexpr,  # False: every tile through the masked path (for comparison)
        SFA_COUNT_PASS: tl.constexpr,  # True: SFA's tie count in a pass of its own over the tiles (for comparison)
        EXP2: tl.constexpr,  # policy.exp == "exp2": FlashAttention-2's exp2 of one FMA
        SR_SCORES: tl.constexpr,  # policy.stochastic names "scores"
        RAW_MAX: tl.constexpr,  # the row-max pass over several tiles takes the raw Q Kᵀ (_scores_of)
        FOLD: tl.constexpr,  # scale a power of two: S/scale held, the scale folded into exp's argument (_exp_scaled)
        REDO: tl.constexpr,  # the second launch: redo the tiles the first flagged (module docstring); one program
        # per REDO_TILES query tiles
        REDO_TILES: tl.constexpr,
        FLAG: tl.constexpr,  # the first launch stores its flags (False: assume_finite, no second launch)
    ):
        pid_bh = tl.program_id(1)  # (batch, head)
        if not REDO:  # query tile program_id(0), plain P̄V GEMMs
            _fwd_program(
                Q, K, V, O, LSE, FLAGS, n_tiles, tl.program_id(0), pid_bh, H, stride_b, stride_h, stride_t,
                o_stride_b, o_stride_h, O_STRIDE_T, T, scale, clamp_val, sfa_beta, sfa_eps, sfa_min_shift, sr_seed, 0,
                FLAG, HEAD_DIM, BLOCK_M, BK, BLOCK_N, N_SUB, SCORES_BF16, PBAR_BF16, OBLOCK_BF16, ACC_BF16,
                OSTORE_BF16, USE_CLAMP, USE_SFA, QK_DOT, PV_DOT, PRECISE_MATH, SR_OBLOCK, SR_ACC, SR_OSTORE, SOFTCAP,
                CAUSAL_SPLIT, SFA_COUNT_PASS, EXP2, SR_SCORES, RAW_MAX, FOLD=FOLD)
        else:  # REDO_TILES query tiles: redo on the non-finite path those the first launch flagged
            first = tl.program_id(0) * REDO_TILES
            bad = _redo_flags(FLAGS, pid_bh, first, n_tiles, REDO_TILES)
            if tl.max(bad, axis=0) != 0:  # (usually none: the program ends here)
                for i in range(REDO_TILES):
                    if _at(bad, i) != 0:  # a non-finite V met in the fast path's P̄V GEMMs
                        _fwd_program(
                            Q, K, V, O, LSE, FLAGS, n_tiles, first + i, pid_bh, H, stride_b, stride_h, stride_t,
                            o_stride_b, o_stride_h, O_STRIDE_T, T, scale, clamp_val, sfa_beta, sfa_eps, sfa_min_shift,
                            sr_seed, 1, False, HEAD_DIM, BLOCK_M, BK, BLOCK_N, N_SUB, SCORES_BF16, PBAR_BF16,
                            OBLOCK_BF16, ACC_BF16, OSTORE_BF16, USE_CLAMP, USE_SFA, QK_DOT, PV_DOT, PRECISE_MATH,
                            SR_OBLOCK, SR_ACC, SR_OSTORE, SOFTCAP, CAUSAL_SPLIT, SFA_COUNT_PASS, EXP2, SR_SCORES,
                            RAW_MAX, FOLD=FOLD)



def flash_forward(q, k, v, policy, scale, causal=True, *, dot_bf16: bool | None = None,
                  precise_math: bool | None = None, block_m: int | None = None,
                  block_n: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None, causal_split: bool = True, sfa_count_pass: bool = False,
                  raw_max: bool = True, fold_scale: bool = True, validate: bool = True,
                  assume_finite: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal flash-attention forward with the rounding points of ``policy`` (a :class:`PrecisionPolicy` or a preset
    name) on q, k, v, (B, H, T, D) bf16 or fp32 tensors, D in {16, 32, 64, 128}. Returns ``(o, lse)``: O in
    ``policy.o_store``'s dtype (bf16 or fp32) with the same values as :func:`lpfa.attention.reference.forward`, and
    the FP32 (B, H, T) log-sum-exp ``log(l) + m`` (the m actually used, SFA included). The keyword options (tuning,
    test switches, ``validate``, ``assume_finite``) are in the module docstring."""
    pol: PrecisionPolicy = get_policy(policy)
    if validate:
        check_triton_inputs(q, k, v, pol, scale, causal)
    B, H, T, D = q.shape
    # the launch: the caller's choices, the table's (triton_common.LAUNCHES, timed per head dim) where None
    run = default_launch("forward", pol, D, fp32_inputs=q.dtype == torch.float32, block_m=block_m,
                         block_n=block_n, num_warps=num_warps, num_stages=num_stages)
    block_m, num_warps, num_stages = run.block_m, run.num_warps, run.num_stages
    BK, BLOCK_N, N_SUB = policy_tiles(pol.block_k, T, run.block_n)

    interp = _interpreter()
    if dot_bf16 is None:
        dot_bf16 = not interp
    if precise_math is None:
        precise_math = (not interp) and libdevice is not None
    inputs_bf16 = q.dtype == torch.bfloat16
    q_in = q  # O's layout follows q as given
    if interp:  # the interpreter's BF16 is not faithful: hand it FP32 copies (same values, same layout where dense)
        q, k, v = (t.float() for t in (q, k, v))
    (q, k, v), strides = shared_layout(q, k, v)  # in place when q, k, v share a layout (the model's views): no copies
    o_dtype = torch.bfloat16 if pol.o_store == BF16 and not interp else torch.float32
    o, o_strides = empty_like_layout(q_in, o_dtype)  # in q's order of dimensions, as FlashAttention stores O
    lse = torch.empty(B, H, T, device=q.device, dtype=torch.float32)
    grid = (triton.cdiv(T, block_m), B * H)
    # one flag per query tile, stored by the fast launch for the second (none when the caller vouches for finite
    # inputs: lse stands in for the pointer, never read)
    flags = lse if assume_finite else torch.empty(B * H * grid[0], device=q.device, dtype=torch.int32)
    for redo in redo_launches(assume_finite):  # the fast path, then the tiles whose O it left not finite
        g = (triton.cdiv(grid[0], REDO_TILES), grid[1]) if redo else grid
        _forward_launch(g, q, k, v, o, lse, flags, grid[0], strides, o_strides, T, scale, pol, D, block_m, BK,
                        BLOCK_N, N_SUB, inputs_bf16, dot_bf16, precise_math, causal_split, sfa_count_pass, raw_max,
                        fold_scale, redo, not assume_finite, num_warps, num_stages)
    if pol.o_store == BF16 and o.dtype != torch.bfloat16:
        o = o.to(torch.bfloat16)  # exact: the values are BF16 already
    return o, lse


def raw_row_max(raw_max: bool, policy: PrecisionPolicy, n_sub: int, precise_math: bool) -> bool:
    """Whether the row-max pass over a policy block of ``n_sub`` compute tiles takes the raw Q Kᵀ and rounds (and caps)
    only each row's top one or two values (RAW_MAX, :func:`_scores_of`): ``raw_max`` asked for, several tiles (a block
    of one tile computes S once for all passes), scores rounded to nearest, and, under a soft-cap, BF16 scores and
    the tanh whose order on them is verified ("The soft-cap's row max" in the module docstring: libdevice's on a GPU,
    the interpreter's on the CPU)."""
    capped_ok = not policy.softcap or (policy.scores == BF16 and (bool(precise_math) or _interpreter()))
    return bool(raw_max) and n_sub > 1 and "scores" not in policy.stochastic and capped_ok


def _forward_launch(grid, q, k, v, o, lse, flags, n_tiles, strides, o_strides, T, scale, pol, D, block_m, BK,
                    BLOCK_N, N_SUB, inputs_bf16, dot_bf16, precise_math, causal_split, sfa_count_pass, raw_max,
                    fold_scale, redo, flag, num_warps, num_stages):
    """One launch of :func:`_flash_fwd_kernel` (``redo``: its REDO, ``flag``: its FLAG); ``strides``: q, k, v's
    (B, H, T) strides, ``o_strides`` O's; ``flags``: the (B·H, n_tiles) tile flags."""
    launch(
        _flash_fwd_kernel, grid,
        q, k, v, o, lse, flags, n_tiles,
        q.shape[1], *strides, *o_strides,
        T, float(scale),
        float(pol.row_sum_clamp) if pol.row_sum_clamp is not None else 0.0,
        float(pol.sfa.beta) if pol.sfa is not None else 1.0,
        float(pol.sfa.eps) if pol.sfa is not None else 0.0,
        float(pol.sfa.min_shift) if pol.sfa is not None else 0.0,
        pol.sr_seed,
        HEAD_DIM=D, BLOCK_M=block_m, BK=BK, BLOCK_N=BLOCK_N, N_SUB=N_SUB,
        SCORES_BF16=pol.scores == BF16, PBAR_BF16=pol.p_bar == BF16, OBLOCK_BF16=pol.o_block == BF16,
        ACC_BF16=pol.accumulator == BF16, OSTORE_BF16=pol.o_store == BF16,
        USE_CLAMP=pol.row_sum_clamp is not None, USE_SFA=pol.sfa is not None,
        QK_DOT=gemm_mode(pol.gemm, dot_bf16, inputs_bf16, inputs_bf16),
        PV_DOT=gemm_mode(pol.gemm, dot_bf16, pol.p_bar == BF16, inputs_bf16),
        PRECISE_MATH=bool(precise_math),
        SR_OBLOCK="o_block" in pol.stochastic, SR_ACC="accumulator" in pol.stochastic,
        SR_OSTORE="o_store" in pol.stochastic,
        SOFTCAP=float(pol.softcap or 0.0),
        CAUSAL_SPLIT=bool(causal_split),
        SFA_COUNT_PASS=bool(sfa_count_pass),
        EXP2=pol.exp == "exp2",
        SR_SCORES="scores" in pol.stochastic,
        RAW_MAX=raw_row_max(raw_max, pol, N_SUB, precise_math),
        # S/scale in every pass where the scale is a power of two (_exp_scaled; not with the count pass's S ≥ thr)
        FOLD=bool(fold_scale) and scale_folds(scale, pol) and not sfa_count_pass,
        REDO=bool(redo),
        REDO_TILES=REDO_TILES,
        FLAG=bool(flag),
        enable_fp_fusion=False,  # no FMA: c·l + rowsum rounds twice, as in the reference
        num_warps=num_warps,
        num_stages=num_stages,
    )
