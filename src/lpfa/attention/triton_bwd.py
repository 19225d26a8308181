"""Triton backward kernels for causal flash attention under a :class:`PrecisionPolicy`.

The kernels perform the same block-by-block algorithm as :func:`lpfa.attention.reference.backward`
(the specification). With ``bw = policy.backward`` and ``op`` (GEMM operand precision) = BF16 when
``bw == "bf16"`` or ``policy.p_bar == "bf16"``, else FP32, for each policy query block i and each
policy key block j up to the diagonal::

    S    = bf16(bf16(Q_i K_jᵀ)·scale)   or  Q_i K_jᵀ·scale                (policy.scores, as the forward)
    P    = exp(S − lse)                  FP32, 0 where key > query
           (policy.exp "exp2": exp2(fma(S, log₂e, −fl(lse·log₂e))))
    dV_j = bw(dV_j + bw(op(P)ᵀ op(dO_i)))
    dP   = bw(dO_i V_jᵀ)
    dS   = P·scale·(dP − δ)
    dQ_i = bw(dQ_i + bw(op(dS) K_j))
    dK_j = bw(dK_j + bw(op(dS)ᵀ Q_i))

with δ per row from ``policy.delta``: ``"o_stored"`` = rowsum(prod(dO∘O)) (prod = BF16 iff
bw == o_store == BF16), ``"o_fp32"`` / ``"o_exact"`` = rowsum(dO∘O_hp) with O_hp recomputed by the Triton
forward under :func:`lpfa.attention.policy.delta_o_policy` (the forward's S, the rest FP32 / all FP32),
``"dp_p"`` = rowsum(dP∘P) over every visible key.

Kernels
-------
* ``_bwd_delta_kernel``: δ = rowsum(prod(dO∘O)) for ``o_stored`` / ``o_fp32`` / ``o_exact``.
* ``_bwd_delta_dpp_kernel``: δ = rowsum(dP∘P) for ``dp_p`` (a preprocessing pass: it needs every key).
* ``_bwd_dkdv_kernel``: one program per (key compute tile, batch·head). It loops over the policy query
  blocks i that can see the tile's keys, in ascending order; inside a block it loops over sub-tiles
  of queries accumulating FP32 partials of ``op(P)ᵀ op(dO)`` and ``op(dS)ᵀ Q``; at the end of the
  policy block it applies the rounded accumulate ``dV = bw(dV + bw(partial))`` (same for dK). So a
  BF16 accumulator sees exactly the reference's sequence of additions, whatever the compute tile.
* ``_bwd_dq_kernel``: one program per (query compute tile, batch·head), the mirror image: loops over
  policy key blocks j up to the diagonal, sub-tiles of keys, rounded accumulate per policy block.

Why dQ has a kernel of its own, which recomputes P and dP: FlashAttention-2 adds each key tile's dS K into dQ with
FP32 atomics, in an order that changes from run to run; the deterministic alternative without recomputation writes each
key tile's partial to a workspace and sums the partials in a fixed order. For 64-key tiles and causal attention the
workspace holds Σ_j (T − 64j) rows of D FP32 values per batch·head: 8.5× Q in FP32 at T = 1,024 (428 MB at B 16, H 12,
D 64), 32× at T = 4,096 and 128× at T = 16,384 (6.5 GB at B 1, H 12). Writing and reading it back at the H200's peak
4.8 TB/s takes at least 178 µs at the first shape, about what this whole dQ kernel measured there (184 µs, Nsight
Compute, results/attention_ncu/h200-2026-12-02), before the dK/dV kernel's extra dS K GEMM; and the traffic grows
as T², so the partials win at no shape here and lose by far at long T.

``dq_mode="ordered"`` is the third way: FlashAttention-2's, in a fixed order. The dK/dV kernel adds each key tile's
op(dS) K into FP32 running sums of dQ, one (BLOCK_M, D) sub-tile at a time, the way FlashAttention-2 adds it with
atomics, but each sub-tile waits for the key tiles before it to have added theirs (a count per sub-tile, acquired
and released: :func:`_dq_add_in_order`), so dQ = ((c₀ + c₁) + c₂) + … in ascending key order on every run. The wait
is one inline-PTX loop per thread and the release one atomic add per thread, with no barrier of the block: a spin
loop of Triton's or a ``bar.sync`` in the loop over query sub-tiles would leave that loop unpipelined (no
``cp.async`` prefetch of Q and dO in the compiled kernel; :func:`~lpfa.attention.triton_common._publish`). That is
five GEMMs per (query, key) tile instead of seven, with FlashAttention-2's traffic (the sums stay T × D per
batch·head, read and written once per key tile that sees them) and no T² workspace. The grid runs batch·heads
fastest, so a key tile's program starts after the programs of the tiles before it, which it may wait for; the last
key tile that sees a sub-tile stores its dQ. dK and dV keep their bits; dQ is an FP32 reordering of the dQ kernel's.
It needs an FP32 backward, since a BF16 one rounds dQ once per policy key block (:func:`ordered_dq_unsupported`). It
is slower, so the default stays ``"kernel"``: on one H100, ``fa2``'s backward took 1.56, 1.57 and 1.67 times the
dQ kernel's time at B × T = 16 × 1,024, 4 × 4,096 and 1 × 16,384, and 2.5-2.9 times with 8 warps, with the same
bits (``benchmarks/kernel_options.py``, results/kernel_options/h100-2026-12-08-backward-ordered). What bounds it
(the waits, or the FP32 read-modify-write of dQ per key tile, which FlashAttention-2's atomics do in L2) is not yet
measured by Nsight Compute.

Causal split: sub-tiles whose every (key, query) pair is visible (keys at or below the sub-tile's first query,
queries inside their policy block and T, keys inside theirs) run without masks (plain loads, no ``tl.where``,
``visible = None``). Inside a policy block the sub-tiles stay in ascending order, so the FP32 partials keep
their order: ``_bwd_dkdv_kernel`` runs the query sub-tiles masked while they touch the diagonal, unmasked,
then masked again for one running past the block's end or T; ``_bwd_dq_kernel`` the key sub-tiles unmasked
up to the diagonal, then masked. The results are bit-identical to masking everything (``causal_split=False``).

Registers: K, V (dK/dV kernel) and Q, dO (dQ kernel) stay in their input dtype for the whole loop (a BF16 tile
feeds the tensor cores as it is); with an FP32 backward the block partials are the accumulators themselves (there is
no rounding point at a block's end, so only the FP32 order changes); and the non-finite path, which keeps an inf or NaN
of Q or dO (dK/dV) or K (dQ) from the keys or rows that cannot see it, is not compiled into the fast kernels: each
kernel launches a second time (``REDO``, as the forward's) and recomputes on that path only the tiles whose stored
gradients hold an inf or NaN (:func:`~lpfa.attention.triton_common.redo_launches`).

Compute tiles are separate from policy blocks (the ``paper`` preset uses 512 × 512 blocks): a tile is
64 rows/keys when the policy block is a multiple of 64, else one tile of next_pow2(block) (>= 16) per
policy block, masked. A tile never straddles two policy blocks. Sub-tiles (and whole policy blocks)
whose pairs are all masked contribute exact zeros, and ``bw(x + bw(0)) = x`` for an accumulator that
already holds a ``bw`` value, so skipping them is exact.

Interpreter-safe rounding (as in :mod:`lpfa.attention.triton_fwd`): every value lives in an FP32
register, each BF16 rounding point is ``_rnd`` (round to nearest even: the hardware conversion on a GPU, integer
arithmetic on the FP32 bit pattern under the interpreter), GEMMs
are ``tl.dot`` on FP32 operands with ``input_precision="ieee"``. On a GPU the ``*_DOT`` constexprs (one MODE per
GEMM, :func:`lpfa.attention.triton_common.gemm_mode`) cast GEMM operands to ``tl.bfloat16`` only where they are
BF16-representable by construction (inputs given as bf16, or operands rounded to ``op`` = BF16); with
``policy.gemm == "bf16x6"`` every other operand is split in three exact BF16 parts first (six BF16 GEMMs, or three
when one operand is BF16: :data:`lpfa.attention.policy.GEMM_SPLIT_DOC`), in every GEMM (dP, dV, dQ, dK, the
recomputed S, and δ's dP for ``dp_p``); FP contraction is disabled at launch
(``dS = P·scale·(dP − δ)`` rounds each product as in the reference) and ``PRECISE_MATH`` uses
libdevice ``expf``. Under the interpreter the wrapper converts all inputs to FP32 copies;
on a GPU the kernels load the native dtype (bf16 or fp32) and convert in registers. q, k, v are read in the layout
they share, dO and O each in its own (their strides, as the forward's: no copies of the model's transposed views);
the gradients are written dense in q's order of dimensions, as the forward's O (``triton_common.empty_like_layout``).

Remaining differences from the reference: the reference sums GEMMs and row sums in float64 and
rounds once to FP32; the kernels accumulate in FP32 in their own order, so an FP32 difference of an
ulp can occasionally flip a later BF16 rounding by one BF16 ulp (and that ulp propagates through the
BF16 accumulators). The interpreter path is tested on every machine; the GPU path (native-dtype loads,
``*_DOT``, ``PRECISE_MATH``, hardware BF16 rounding) against the reference on the same GPU by
``tests/test_attention_gpu.py``.

Options of :func:`flash_backward`
---------------------------------
``dot_bf16`` (default: not under the interpreter) feeds tensor cores BF16 operands where they are exactly BF16 values;
``precise_math`` (default: not under the interpreter) uses libdevice exp. ``block_m``/``block_n`` (query/key compute
tiles), ``num_warps``, ``num_stages``: launch tuning only, since the policy's blocks fix the rounding (None: the entry
of :data:`lpfa.attention.triton_common.LAUNCHES` for the policy and head dim). ``dq_block_m``/``dq_block_n`` (default:
``block_m``/``block_n`` where given, else the table's): the dQ kernel's own query tile and key sub-tile, which
favours the opposite shape to the dK/dV kernel's (many rows, few keys per step: Triton's fused-attention tutorial uses
128 × 32 there and 32 × 128 for dK/dV). ``causal_split=False`` runs every sub-tile through the masked path (the kernels
before the causal split; bit-identical results, for tests and benchmarks). ``fold_scale=False``: every score multiplied
by the scale before exp, as in :func:`lpfa.attention.triton_fwd.flash_forward` (bit-identical; for tests and
benchmarks). ``validate=False`` skips the input checks for
a caller that has made them once (the autograd op of :func:`lpfa.attention.attention`, whose saved tensors the forward
checked and whose dO autograd shapes). ``assume_finite=True``: the caller vouches that dO, q, k, v hold no inf or
NaN, so each kernel launches once (no redo); a non-finite operand then spreads as it would in a plain GEMM.
``dq_mode`` (:data:`DQ_MODES`; None: the launch table's, ``"kernel"`` today): ``"kernel"``, dQ by a kernel of its own;
``"ordered"``, by the dK/dV kernel in key-tile order (above; asked for where it cannot run, a one-line ValueError).
Where the dK/dV kernel's plain dS K GEMM carries a non-finite K to rows that cannot see its key, the sub-tile is
flagged and the dQ kernel's redo launch computes it again on the exact path, as in the default.
"""

from __future__ import annotations

import torch

from lpfa.attention.policy import BF16, PrecisionPolicy, delta_dose_active, delta_o_policy, dose_delta, get_policy
from lpfa.attention.triton_common import (
    DQ_MODES,
    MIN_TILE,
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
    _next_pow2,
    _out_rows,
    _publish,
    _redo_flags,
    _rnd,
    _rnd_s,
    _score_pos,
    _shift_arg,
    _softcap,
    _sr_pre,
    _store_flag,
    _tile_rows,
    _wait_published,
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
from lpfa.attention.triton_fwd import flash_forward

COMPUTE_TILE = 64  # preferred compute tile (rows or keys) when the policy block is a multiple of it
DELTA_ROWS = 64  # rows per program of the δ kernels (no policy-block structure there)

if triton is not None:

    @triton.jit
    def _bh_rows(Q, K, V, DO, pid_bh, H, stride_b, stride_h, do_stride_b, do_stride_h):
        """Row 0 of batch·head ``pid_bh`` (b = pid_bh // H, h = pid_bh % H) in Q, K, V, through their shared strides,
        and in DO, through its own: the backward kernels' loads add ``t·stride_t`` to these."""
        b, h = (pid_bh // H).to(tl.int64), (pid_bh % H).to(tl.int64)
        return (Q + b * stride_b + h * stride_h, K + b * stride_b + h * stride_h, V + b * stride_b + h * stride_h,
                DO + b * do_stride_b + h * do_stride_h)

    @triton.jit
    def _bwd_delta_kernel(
        DO, O, DELTA,  # noqa: E741  DO, O (B, H, T, D), strides below; DELTA (B*H, T)
        T, H, do_stride_b, do_stride_h, do_stride_t,
        o_stride_b, o_stride_h, o_stride_t,
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, PROD_BF16: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        b, h = (pid_bh // H).to(tl.int64), (pid_bh % H).to(tl.int64)
        do_base = b * do_stride_b + h * do_stride_h
        o_base = b * o_stride_b + h * o_stride_h
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        row_ok = offs_m < T
        do = tl.load(DO + do_base + offs_m[:, None] * do_stride_t + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        do = do.to(tl.float32)
        o = tl.load(O + o_base + offs_m[:, None] * o_stride_t + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        o = o.to(tl.float32)
        # δ = rowsum(prod(dO ∘ O)), the sum in FP32
        delta = tl.sum(_rnd(do * o, PROD_BF16), axis=1)
        tl.store(DELTA + pid_bh.to(tl.int64) * T + offs_m, delta, mask=row_ok)

    @triton.jit
    def _bwd_delta_dpp_kernel(
        Q, K, V, DO, LSE, DELTA,
        T, scale, sr_seed,
        H, stride_b, stride_h, stride_t,  # Q, K, V's strides (shared)
        do_stride_b, do_stride_h, do_stride_t,  # DO's
        HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        SCORES_BF16: tl.constexpr, BW_BF16: tl.constexpr,
        QK_DOT: tl.constexpr, DOV_DOT: tl.constexpr, PRECISE_MATH: tl.constexpr, SOFTCAP: tl.constexpr,
        EXP2: tl.constexpr,  # policy.exp == "exp2"
        SR_SCORES: tl.constexpr,  # policy.stochastic names "scores"
    ):
        pid_m = tl.program_id(0)
        pid_bh = tl.program_id(1)
        s_pre = _sr_pre(sr_seed, 7, pid_bh) if SR_SCORES else 0
        Q, K, V, DO = _bh_rows(Q, K, V, DO, pid_bh, H, stride_b, stride_h, do_stride_b, do_stride_h)
        q_start = pid_m * BLOCK_M
        offs_m = q_start + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        loc_n = tl.arange(0, BLOCK_N)
        row_ok = offs_m < T
        q = tl.load(Q + offs_m[:, None] * stride_t + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        q = q.to(tl.float32)
        do = tl.load(DO + offs_m[:, None] * do_stride_t + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        do = do.to(tl.float32)
        lse = tl.load(LSE + pid_bh.to(tl.int64) * T + offs_m, mask=row_ok, other=0.0)
        lse = _shift_arg(lse, EXP2)  # fl(lse·log₂e) for exp2
        acc = tl.zeros([BLOCK_M], dtype=tl.float32)
        # keys 0 .. the last query of this tile (later keys are invisible to every row here); dP and P
        # are elementwise functions of (query, key), so the key sub-tiles need no policy alignment
        k_end = tl.minimum(q_start + BLOCK_M, T)
        for k0 in range(0, k_end, BLOCK_N):
            offs_n = k0 + loc_n
            key_ok = offs_n < T
            kt = tl.load(K + offs_n[None, :] * stride_t + offs_d[:, None], mask=key_ok[None, :], other=0.0)
            vt = tl.load(V + offs_n[None, :] * stride_t + offs_d[:, None], mask=key_ok[None, :], other=0.0)
            kt = kt.to(tl.float32)
            vt = vt.to(tl.float32)
            # S = scores(scores(Q Kᵀ)·scale), exactly as the forward
            pos = _score_pos(offs_m, offs_n, T, TRANSPOSED=False) if SR_SCORES else None
            s = _rnd_s(_dot(q, kt, QK_DOT), SCORES_BF16, SR_SCORES, s_pre, 0, pos)
            s = _rnd_s(s * scale, SCORES_BF16, SR_SCORES, s_pre, 1, pos)
            s, _ = _softcap(s, SCORES_BF16, PRECISE_MATH, SOFTCAP)
            # P = exp(S − lse) (or exp2(fma(S, log₂e, −lse·log₂e))), 0 where key > query or out of range
            visible = row_ok[:, None] & key_ok[None, :] & (offs_n[None, :] <= offs_m[:, None])
            p = tl.where(visible, _exp_shifted(s, lse[:, None], False, PRECISE_MATH, EXP2), 0.0)
            # dP = bw(dO Vᵀ);  δ += rowsum(dP ∘ P) over visible keys (no 0·NaN from an invisible V)
            dp = _rnd(_dot(do, vt, DOV_DOT), BW_BF16)
            acc += tl.sum(tl.where(visible, dp * p, 0.0), axis=1)
        tl.store(DELTA + pid_bh.to(tl.int64) * T + offs_m, acc, mask=row_ok)

    @triton.jit
    def _acc_bf16(acc, part):
        """A BF16 backward's accumulator at the end of a policy block: bf16(acc + bf16(part)), ``acc`` held as BF16
        (exact: the rounded values are BF16, so the casts around _rnd change no bit)."""
        return _rnd(acc.to(tl.float32) + _rnd(part, True), True).to(tl.bfloat16)

    @triton.jit
    def _p_and_ds(x, yt, u, wt, lse, delta, visible, scale, s_pre, pos, SCORES_BF16: tl.constexpr,
                  BW_BF16: tl.constexpr, QK_DOT: tl.constexpr, DOV_DOT: tl.constexpr, PRECISE_MATH: tl.constexpr,
                  SOFTCAP: tl.constexpr, EXP2: tl.constexpr, SR_SCORES: tl.constexpr, FOLD: tl.constexpr = False):
        """For one tile, S = scores(scores(x yᵀ)·scale) (as the forward's S), P = exp(S − lse) (with EXP2
        exp2(fma(S, log₂e, −lse)), ``lse`` then fl(lse·log₂e): _shift_arg), dP = bw(u wᵀ) and
        dS = P·scale·(dP − δ); P and dS exactly 0 where not ``visible`` (None: every pair visible). ``lse``, ``δ``
        come broadcast along the tile's query axis; the dK/dV kernel passes the transposed tile (x = K, u = V). FOLD
        (:func:`~lpfa.attention.triton_common.scale_folds`): P through :func:`_exp_scaled`, one multiply fewer."""
        s = _rnd_s(_dot(x, yt, QK_DOT), SCORES_BF16, SR_SCORES, s_pre, 0, pos)  # stochastic: hashed by ``pos``
        if FOLD:  # scale a power of two: S/scale = s, the scale folded into exp's argument (the same bits)
            t = s
            p = _exp_scaled(s, scale, lse, False, PRECISE_MATH, EXP2)
        else:
            s = _rnd_s(s * scale, SCORES_BF16, SR_SCORES, s_pre, 1, pos)
            s, t = _softcap(s, SCORES_BF16, PRECISE_MATH, SOFTCAP)  # S' = c·tanh(S / c) where policy.softcap is set
            p = _exp_shifted(s, lse, False, PRECISE_MATH, EXP2)
        p = _keep_visible(p, visible, 0.0)
        dp = _rnd(_dot(u, wt, DOV_DOT), BW_BF16)
        ds = p * scale * (dp - delta)
        if SOFTCAP > 0:  # through the cap: dS = dS'·(1 − t²)
            ds = ds * (1.0 - t * t)
        ds = _keep_visible(ds, visible, 0.0)
        return p, ds

    @triton.jit
    def _dq_add_in_order(ds, k, q0, j, DQACC, LOCK, DQ, QFLAGS, n_qsub, pid_bh, T, G_STRIDE_T: tl.constexpr,
                         HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DSK_DOT: tl.constexpr,
                         FLAG: tl.constexpr):
        """dQ rows [q0, q0 + BLOCK_M) += c_j = ``ds`` @ ``k``, key tile j's op(dS) K, once key tiles 0 .. j − 1 have
        added theirs (``dq_mode="ordered"``): dQ = ((c_0 + c_1) + c_2) + … in FP32, in ascending key order whatever the
        order the programs run in, so the gradient is deterministic without a dQ kernel that recomputes P and dP.
        DQACC (this batch·head's rows, FP32, zeros at first) holds the running sum, LOCK (per query sub-tile) the
        count of key tiles that have added (in :func:`_publish`'s units: a block's threads on a GPU). Key tile j
        sees every row from its first key on, so tiles 0 .. q0 // BLOCK_N add to these rows, each once; the last
        stores dQ in its dtype (and the sub-tile's flag for the redo launch) instead."""
        sub = q0 // BLOCK_M
        seen = _wait_published(LOCK + sub, j)  # spin until tiles 0 .. j − 1 have added
        offs_m = q0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        row_ok = offs_m < T
        # the running sum's address depends on the count read (+ seen − seen), so that no pipelining of the loop can
        # issue this load before the wait; .cg: from L2, where the previous tile's program stored it, not a stale L1
        acc_ptrs = DQACC + (seen - seen) + offs_m[:, None] * HEAD_DIM + offs_d[None, :]
        dq = tl.load(acc_ptrs, mask=row_ok[:, None], other=0.0, cache_modifier=".cg") + _dot(ds, k, DSK_DOT)
        # the last key tile these rows see (dQ complete) stores dQ in its dtype, the others the running sum (masked
        # stores, not a branch: the software pipeliner takes no branch with stores in this loop)
        last = j == q0 // BLOCK_N
        tl.store(DQ + offs_m[:, None] * G_STRIDE_T + offs_d[None, :], dq.to(DQ.dtype.element_ty),
                 mask=row_ok[:, None] & last)
        tl.store(acc_ptrs, dq, mask=row_ok[:, None] & (not last))
        if FLAG:  # 1 where this sub-tile of dQ holds an inf or NaN: the dQ kernel's redo launch computes it again
            tl.store(QFLAGS + pid_bh.to(tl.int64) * n_qsub + sub, _any_nonfinite(dq, row_ok), mask=last)
        _publish(LOCK + sub)  # each thread's stores, then its share of the count

    @triton.jit
    def _dkdv_tiles(dv_part, dk_part, q_from, q_to, q_hi, k, v, offs_n, key_ok, Q, DO, LSE, DELTA, stride_t,
                    do_stride_t, row_base, scale, q_nonfinite, do_nonfinite, T, s_pre,
                    HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, SCORES_BF16: tl.constexpr, BW_BF16: tl.constexpr,
                    OP_BF16: tl.constexpr, QK_DOT: tl.constexpr, DOV_DOT: tl.constexpr,
                    PDO_DOT: tl.constexpr, DSQ_DOT: tl.constexpr, PRECISE_MATH: tl.constexpr,
                    MASKED: tl.constexpr, SOFTCAP: tl.constexpr, EXP2: tl.constexpr, SR_SCORES: tl.constexpr,
                    FOLD: tl.constexpr, pid_n, DQACC, LOCK, DQ, QFLAGS, n_qsub, pid_bh, G_STRIDE_T: tl.constexpr,
                    BLOCK_N: tl.constexpr, DSK_DOT: tl.constexpr, ORDERED: tl.constexpr, FLAG: tl.constexpr):
        """Query sub-tiles q0 = q_from, q_from + BLOCK_M, … < q_to of a policy query block (rows < q_hi) against
        the key tile: FP32 partials Σ op(P)ᵀ op(dO) and Σ op(dS)ᵀ Q. Without MASKED every row of each sub-tile
        lies below q_hi and sees every key of the tile (the caller guarantees it): plain loads, no mask. ORDERED
        (``dq_mode="ordered"``): also each sub-tile's op(dS) K, added to dQ in key-tile order (:func:`_dq_add_in_order`;
        the rest of the arguments after FOLD are for it)."""
        loc_m = tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)
        for q0 in range(q_from, q_to, BLOCK_M):
            offs_m = q0 + loc_m
            row_ok = offs_m < q_hi if MASKED else None
            # Qᵀ: (D, BLOCK_M);  dO: (BLOCK_M, D);  lse, δ: (BLOCK_M,)
            # in their own dtype: a BF16 tile goes to the tensor cores as it is (_dot converts where a GEMM needs FP32)
            qt = _load_tile(Q + offs_m[None, :] * stride_t + offs_d[:, None], row_ok[None, :] if MASKED else None)
            do = _load_tile(DO + offs_m[:, None] * do_stride_t + offs_d[None, :], row_ok[:, None] if MASKED else None)
            lse = _shift_arg(_load_tile(LSE + row_base + offs_m, row_ok), EXP2)
            delta = _load_tile(DELTA + row_base + offs_m, row_ok)
            # visible: key <= query, both in range
            visible = key_ok[:, None] & row_ok[None, :] & (offs_n[:, None] <= offs_m[None, :]) if MASKED else None

            # Sᵀ = scores(scores(K Qᵀ)·scale), Pᵀ = exp(Sᵀ − lse);  dPᵀ = bw(V dOᵀ), dSᵀ = Pᵀ·scale·(dPᵀ − δ)
            pos = _score_pos(offs_m, offs_n, T, TRANSPOSED=True) if SR_SCORES else None
            pt, dst = _p_and_ds(k, qt, v, tl.trans(do), lse[None, :], delta[None, :], visible, scale, s_pre, pos,
                                SCORES_BF16, BW_BF16, QK_DOT, DOV_DOT, PRECISE_MATH, SOFTCAP, EXP2, SR_SCORES,
                                FOLD=FOLD)
            # dV partial += op(P)ᵀ op(dO), dK partial += op(dS)ᵀ Q, over visible pairs
            ds_op = _rnd(dst, OP_BF16)
            dv_part += _dot_visible(_rnd(pt, OP_BF16), _rnd(do, OP_BF16), visible, do_nonfinite, PDO_DOT)
            dk_part += _dot_visible(ds_op, tl.trans(qt), visible, q_nonfinite, DSQ_DOT)
            if ORDERED:  # dQ[q0 : q0 + BLOCK_M] += op(dS) K, in key-tile order (a non-finite K: flagged, redone)
                _dq_add_in_order(tl.trans(ds_op), k, q0, pid_n, DQACC, LOCK, DQ, QFLAGS, n_qsub, pid_bh, T,
                                 G_STRIDE_T, HEAD_DIM, BLOCK_M, BLOCK_N, DSK_DOT, FLAG)
        return dv_part, dk_part

    @triton.jit
    def _dkdv_program(Q, K, V, DO, LSE, DELTA, DK, DV, FLAGS, n_tiles, pid_n, pid_bh, T, scale, sr_seed, H,
                      stride_b, stride_h, stride_t, do_stride_b, do_stride_h, do_stride_t, g_stride_b, g_stride_h,
                      G_STRIDE_T: tl.constexpr, nonfinite, FLAG: tl.constexpr,
                      HEAD_DIM: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, TILES_PER_BK: tl.constexpr, SCORES_BF16: tl.constexpr,
                      BW_BF16: tl.constexpr, OP_BF16: tl.constexpr, QK_DOT: tl.constexpr, DOV_DOT: tl.constexpr,
                      PDO_DOT: tl.constexpr, DSQ_DOT: tl.constexpr, PRECISE_MATH: tl.constexpr,
                      CAUSAL_SPLIT: tl.constexpr, SOFTCAP: tl.constexpr, EXP2: tl.constexpr,
                      SR_SCORES: tl.constexpr, FOLD: tl.constexpr, DQ, DQACC, LOCKS, QFLAGS, n_qsub,
                      DSK_DOT: tl.constexpr, ORDERED: tl.constexpr):
        """Key tile ``pid_n`` of batch·head ``pid_bh``: load its K, V, compute its dK, dV over every policy query
        block that sees it, store them. ``nonfinite`` = 0 (a constant): plain GEMMs; 1: the non-finite path, where an
        inf or NaN of Q or dO reaches exactly the keys its row sees. FLAG: also store the tile's flag for the redo
        launch (triton_common._store_flag). ORDERED: also add the tile's share of dQ, in key-tile order
        (:func:`_dq_add_in_order`: DQACC the FP32 running sums, LOCKS the counts, n_qsub query sub-tiles per
        batch·head, QFLAGS their flags)."""
        s_pre = _sr_pre(sr_seed, 7, pid_bh) if SR_SCORES else 0
        row_base = pid_bh.to(tl.int64) * T
        base = _out_rows(pid_bh, T, H, g_stride_b, g_stride_h, G_STRIDE_T, HEAD_DIM)  # DK's and DV's row 0
        # (ORDERED) this batch·head's dQ rows: its running sums, its counts and its row 0 of DQ (DK's layout)
        DQACC = DQACC + row_base * HEAD_DIM
        LOCK = LOCKS + pid_bh.to(tl.int64) * n_qsub
        DQ = DQ + base
        Q, K, V, DO = _bh_rows(Q, K, V, DO, pid_bh, H, stride_b, stride_h, do_stride_b, do_stride_h)

        # this tile's keys: inside policy key block pid_n // TILES_PER_BK, never straddling it (NK of them inside)
        k_start, NK, key_ok = _tile_rows(pid_n, T, BK, BLOCK_N, TILES_PER_BK)
        offs_n = k_start + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)

        # K_j, V_j tile: (BLOCK_N, D), padded keys 0 (their dK, dV rows are never stored)
        kv_ptrs = base + offs_n[:, None] * G_STRIDE_T + offs_d[None, :]  # DK, DV
        in_ptrs = offs_n[:, None] * stride_t + offs_d[None, :]  # K, V
        # held for the whole loop in their own dtype (BF16 inputs: half the registers of FP32 copies)
        k = tl.load(K + in_ptrs, mask=key_ok[:, None], other=0.0)
        v = tl.load(V + in_ptrs, mask=key_ok[:, None], other=0.0)

        # dK_j, dV_j accumulators (bw precision), across policy query blocks: held as BF16 when the backward is BF16
        # (their values are BF16 after every block: half the registers, the same bits)
        dk = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.bfloat16 if BW_BF16 else tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.bfloat16 if BW_BF16 else tl.float32)

        # causal: the first policy query block that can see any key of this tile holds query k_start;
        # earlier blocks contribute exact zeros. Ascending i, as the reference accumulates.
        for i in range(k_start // BQ, (T + BQ - 1) // BQ):
            q_blk = i * BQ
            q_hi = tl.minimum(q_blk + BQ, T)  # exclusive end of policy query block i
            # FP32 partials over ALL queries of block i: Σ op(P)ᵀ op(dO) and Σ op(dS)ᵀ Q
            # (an FP32 backward has no rounding point at the block's end: the partials are dV_j, dK_j themselves,
            # an FP32 reordering of the same sum, and two tiles' fewer registers)
            if BW_BF16:
                dv_part = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
                dk_part = tl.zeros([BLOCK_N, HEAD_DIM], dtype=tl.float32)
            else:
                dv_part = dv
                dk_part = dk
            # query sub-tiles q0 = q_lo, q_lo + BLOCK_M, … < q_hi from max(block start, first key): queries before
            # it see none of the keys. In ascending order (the FP32 partials keep their order): masked while a key
            # of the tile lies above row q0 (q0 < k_start + NK − 1), unmasked from q_mid, masked again from q_tail
            # where a sub-tile runs past q_hi
            q_lo = tl.maximum(q_blk, k_start)
            if CAUSAL_SPLIT:
                q_mid = q_lo + (tl.maximum(k_start + NK - 1 - q_lo, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
                q_tail = q_lo + tl.maximum(q_hi - q_lo, 0) // BLOCK_M * BLOCK_M
            else:
                q_mid = q_hi
                q_tail = q_hi
            dv_part, dk_part = _dkdv_tiles(
                dv_part, dk_part, q_lo, tl.minimum(q_mid, q_hi), q_hi, k, v, offs_n, key_ok, Q, DO, LSE, DELTA,
                stride_t, do_stride_t, row_base, scale, nonfinite, nonfinite, T, s_pre, HEAD_DIM, BLOCK_M,
                SCORES_BF16, BW_BF16, OP_BF16, QK_DOT, DOV_DOT, PDO_DOT, DSQ_DOT, PRECISE_MATH, MASKED=True,
                SOFTCAP=SOFTCAP, EXP2=EXP2, SR_SCORES=SR_SCORES, FOLD=FOLD, pid_n=pid_n, DQACC=DQACC, LOCK=LOCK,
                DQ=DQ, QFLAGS=QFLAGS, n_qsub=n_qsub, pid_bh=pid_bh, G_STRIDE_T=G_STRIDE_T, BLOCK_N=BLOCK_N,
                DSK_DOT=DSK_DOT, ORDERED=ORDERED, FLAG=FLAG)
            dv_part, dk_part = _dkdv_tiles(
                dv_part, dk_part, q_mid, q_tail, q_hi, k, v, offs_n, key_ok, Q, DO, LSE, DELTA,
                stride_t, do_stride_t, row_base, scale, nonfinite, nonfinite, T, s_pre, HEAD_DIM, BLOCK_M,
                SCORES_BF16, BW_BF16, OP_BF16, QK_DOT, DOV_DOT, PDO_DOT, DSQ_DOT, PRECISE_MATH, MASKED=False,
                SOFTCAP=SOFTCAP, EXP2=EXP2, SR_SCORES=SR_SCORES, FOLD=FOLD, pid_n=pid_n, DQACC=DQACC, LOCK=LOCK,
                DQ=DQ, QFLAGS=QFLAGS, n_qsub=n_qsub, pid_bh=pid_bh, G_STRIDE_T=G_STRIDE_T, BLOCK_N=BLOCK_N,
                DSK_DOT=DSK_DOT, ORDERED=ORDERED, FLAG=FLAG)
            dv_part, dk_part = _dkdv_tiles(
                dv_part, dk_part, tl.maximum(q_mid, q_tail), q_hi, q_hi, k, v, offs_n, key_ok, Q, DO, LSE, DELTA,
                stride_t, do_stride_t, row_base, scale, nonfinite, nonfinite, T, s_pre, HEAD_DIM, BLOCK_M,
                SCORES_BF16, BW_BF16, OP_BF16, QK_DOT, DOV_DOT, PDO_DOT, DSQ_DOT, PRECISE_MATH, MASKED=True,
                SOFTCAP=SOFTCAP, EXP2=EXP2, SR_SCORES=SR_SCORES, FOLD=FOLD, pid_n=pid_n, DQACC=DQACC, LOCK=LOCK,
                DQ=DQ, QFLAGS=QFLAGS, n_qsub=n_qsub, pid_bh=pid_bh, G_STRIDE_T=G_STRIDE_T, BLOCK_N=BLOCK_N,
                DSK_DOT=DSK_DOT, ORDERED=ORDERED, FLAG=FLAG)

            # end of policy query block i: dV_j = bw(dV_j + bw(partial)), dK_j likewise
            if BW_BF16:
                dv = _acc_bf16(dv, dv_part)
                dk = _acc_bf16(dk, dk_part)
            else:
                dv = dv_part
                dk = dk_part

        # stored in the gradients' dtype (FP32, or the inputs' BF16: one round to nearest even, as a later .to() would)
        dk, dv = dk.to(DK.dtype.element_ty), dv.to(DV.dtype.element_ty)
        tl.store(DK + kv_ptrs, dk, mask=key_ok[:, None])
        tl.store(DV + kv_ptrs, dv, mask=key_ok[:, None])
        if FLAG:  # 1 where this tile of dK or dV holds an inf or NaN: the redo launch computes it again
            _store_flag(FLAGS, pid_bh, pid_n, n_tiles,
                        _any_nonfinite(dk.to(tl.float32), key_ok) | _any_nonfinite(dv.to(tl.float32), key_ok))

    @triton.jit
    def _bwd_dkdv_kernel(
        Q, K, V, DO, LSE, DELTA, DK, DV,  # (B, H, T, D) with the strides below; LSE, DELTA (B*H, T) contiguous
        FLAGS, n_tiles,  # int32 (B*H, n_tiles): 1 per key tile whose dK or dV the fast launch left not finite
        DQ, DQACC, LOCKS, QFLAGS, n_qsub,  # ORDERED: dQ, its FP32 running sums, counts and flags (_dq_add_in_order)
        T, scale, sr_seed,
        H, stride_b, stride_h, stride_t,  # Q, K, V's strides (shared): any layout, no copies
        do_stride_b, do_stride_h, do_stride_t,  # DO's
        g_stride_b, g_stride_h,  # DK's and DV's (triton_common.empty_like_layout: q's order of dimensions)
        G_STRIDE_T: tl.constexpr,  # and their row stride, a constant: D (contiguous) or H·D (the model's views)
        HEAD_DIM: tl.constexpr,
        BQ: tl.constexpr, BK: tl.constexpr,  # policy block sizes
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,  # compute tiles (query sub-tile, key tile)
        TILES_PER_BK: tl.constexpr,  # key tiles per policy key block (ceil(BK / BLOCK_N); the last may be cut short)
        SCORES_BF16: tl.constexpr, BW_BF16: tl.constexpr, OP_BF16: tl.constexpr,
        QK_DOT: tl.constexpr, DOV_DOT: tl.constexpr, PDO_DOT: tl.constexpr,
        DSQ_DOT: tl.constexpr, PRECISE_MATH: tl.constexpr,
        CAUSAL_SPLIT: tl.constexpr,  # False: every sub-tile through the masked path (for comparison)
        SOFTCAP: tl.constexpr,  # policy.softcap, 0.0 = off
        EXP2: tl.constexpr,  # policy.exp == "exp2"
        SR_SCORES: tl.constexpr,  # policy.stochastic names "scores"
        FOLD: tl.constexpr,  # scale a power of two, folded into exp's argument (triton_common.scale_folds)
        REDO: tl.constexpr,  # the second launch: redo the tiles the first flagged; one program per REDO_TILES key
        # tiles
        REDO_TILES: tl.constexpr,
        FLAG: tl.constexpr,  # the first launch stores its flags (False: assume_finite, no second launch)
        DSK_DOT: tl.constexpr,
        ORDERED: tl.constexpr,  # dq_mode="ordered": the grid is (batch·head, key tile), batch·heads fastest, so a
        # key tile's program starts after those of the tiles before it (whose dQ shares it waits for)
    ):
        if ORDERED:
            pid_bh, pid_n = tl.program_id(0), tl.program_id(1)
        else:
            pid_bh, pid_n = tl.program_id(1), tl.program_id(0)  # (batch, head), key tile
        if not REDO:  # key tile pid_n, plain GEMMs
            _dkdv_program(Q, K, V, DO, LSE, DELTA, DK, DV, FLAGS, n_tiles, pid_n, pid_bh, T, scale, sr_seed,
                          H, stride_b, stride_h, stride_t, do_stride_b, do_stride_h, do_stride_t, g_stride_b,
                          g_stride_h, G_STRIDE_T, 0, FLAG, HEAD_DIM, BQ, BK, BLOCK_M, BLOCK_N, TILES_PER_BK,
                          SCORES_BF16, BW_BF16, OP_BF16, QK_DOT, DOV_DOT, PDO_DOT, DSQ_DOT, PRECISE_MATH, CAUSAL_SPLIT,
                          SOFTCAP, EXP2, SR_SCORES, FOLD, DQ, DQACC, LOCKS, QFLAGS, n_qsub, DSK_DOT, ORDERED)
        else:  # REDO_TILES key tiles: redo on the non-finite path those the first launch flagged
            first = tl.program_id(0) * REDO_TILES
            bad = _redo_flags(FLAGS, pid_bh, first, n_tiles, REDO_TILES)
            if tl.max(bad, axis=0) != 0:  # (usually none: the program ends here)
                for i in range(REDO_TILES):
                    if _at(bad, i) != 0:  # a non-finite Q or dO met in the fast path's GEMMs
                        _dkdv_program(Q, K, V, DO, LSE, DELTA, DK, DV, FLAGS, n_tiles, first + i, pid_bh, T, scale,
                                      sr_seed, H, stride_b, stride_h, stride_t, do_stride_b, do_stride_h, do_stride_t,
                                      g_stride_b, g_stride_h, G_STRIDE_T, 1, False, HEAD_DIM, BQ, BK, BLOCK_M, BLOCK_N,
                                      TILES_PER_BK, SCORES_BF16, BW_BF16, OP_BF16, QK_DOT, DOV_DOT, PDO_DOT, DSQ_DOT,
                                      PRECISE_MATH, CAUSAL_SPLIT, SOFTCAP, EXP2, SR_SCORES, FOLD, DQ, DQACC, LOCKS,
                                      QFLAGS, n_qsub, DSK_DOT, False)

    @triton.jit
    def _dq_tiles(dq_part, k_from, k_to, q, do, lse, delta, offs_m, row_ok, K, V, stride_t, scale, k_nonfinite, T,
                  s_pre,
                  HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr, SCORES_BF16: tl.constexpr, BW_BF16: tl.constexpr,
                  OP_BF16: tl.constexpr, QK_DOT: tl.constexpr, DOV_DOT: tl.constexpr,
                  DSK_DOT: tl.constexpr, PRECISE_MATH: tl.constexpr, MASKED: tl.constexpr, SOFTCAP: tl.constexpr,
                  EXP2: tl.constexpr, SR_SCORES: tl.constexpr, FOLD: tl.constexpr = False):
        """Key sub-tiles k0 = k_from, k_from + BLOCK_N, … < k_to of a policy key block against the query tile:
        the FP32 partial Σ op(dS) K. MASKED: keys < k_to only; else every key of each sub-tile is below k_to and
        at or below the tile's first row (the caller guarantees it): plain loads, no mask."""
        loc_n = tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, HEAD_DIM)
        for k0 in range(k_from, k_to, BLOCK_N):
            offs_n = k0 + loc_n
            key_ok = offs_n < k_to if MASKED else None
            # Kᵀ, Vᵀ: (D, BLOCK_N)
            kt = _load_tile(K + offs_n[None, :] * stride_t + offs_d[:, None], key_ok[None, :] if MASKED else None)
            vt = _load_tile(V + offs_n[None, :] * stride_t + offs_d[:, None], key_ok[None, :] if MASKED else None)
            # visible: key <= query, both in range
            visible = row_ok[:, None] & key_ok[None, :] & (offs_n[None, :] <= offs_m[:, None]) if MASKED else None
            # S = scores(scores(Q Kᵀ)·scale), P = exp(S − lse);  dP = bw(dO Vᵀ), dS = P·scale·(dP − δ)
            pos = _score_pos(offs_m, offs_n, T, TRANSPOSED=False) if SR_SCORES else None
            p, ds = _p_and_ds(q, kt, do, vt, lse[:, None], delta[:, None], visible, scale, s_pre, pos, SCORES_BF16,
                              BW_BF16, QK_DOT, DOV_DOT, PRECISE_MATH, SOFTCAP, EXP2, SR_SCORES, FOLD=FOLD)
            # dQ partial += op(dS) K, over visible pairs
            dq_part += _dot_visible(_rnd(ds, OP_BF16), tl.trans(kt), visible, k_nonfinite, DSK_DOT)
        return dq_part

    @triton.jit
    def _dq_program(Q, K, V, DO, LSE, DELTA, DQ, FLAGS, n_tiles, pid_m, pid_bh, T, scale, sr_seed, H, stride_b,
                    stride_h, stride_t, do_stride_b, do_stride_h, do_stride_t, g_stride_b, g_stride_h,
                    G_STRIDE_T: tl.constexpr, nonfinite, FLAG: tl.constexpr,
                    HEAD_DIM: tl.constexpr, BQ: tl.constexpr, BK: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, TILES_PER_BQ: tl.constexpr, SCORES_BF16: tl.constexpr,
                    BW_BF16: tl.constexpr, OP_BF16: tl.constexpr, QK_DOT: tl.constexpr, DOV_DOT: tl.constexpr,
                    DSK_DOT: tl.constexpr, PRECISE_MATH: tl.constexpr, CAUSAL_SPLIT: tl.constexpr,
                    SOFTCAP: tl.constexpr, EXP2: tl.constexpr, SR_SCORES: tl.constexpr, FOLD: tl.constexpr = False):
        """Query tile ``pid_m`` of batch·head ``pid_bh``: load its Q, dO, lse, δ, compute its dQ over every policy key
        block it sees, store it. ``nonfinite`` = 0 (a constant): plain GEMMs; 1: the non-finite path, where an inf or
        NaN of K reaches exactly the rows that see its key. FLAG: also store the tile's flag for the redo launch
        (triton_common._store_flag)."""
        s_pre = _sr_pre(sr_seed, 7, pid_bh) if SR_SCORES else 0
        row_base = pid_bh.to(tl.int64) * T
        base = _out_rows(pid_bh, T, H, g_stride_b, g_stride_h, G_STRIDE_T, HEAD_DIM)  # DQ's row 0
        Q, K, V, DO = _bh_rows(Q, K, V, DO, pid_bh, H, stride_b, stride_h, do_stride_b, do_stride_h)

        # this tile's queries: inside policy query block pid_m // TILES_PER_BQ (NQ of them inside)
        q_start, NQ, row_ok = _tile_rows(pid_m, T, BQ, BLOCK_M, TILES_PER_BQ)
        offs_m = q_start + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, HEAD_DIM)

        # Q_i tile, dO_i tile: (BLOCK_M, D);  lse, δ: (BLOCK_M,);  padded rows 0 (their dQ rows are never stored)
        q_ptrs = base + offs_m[:, None] * G_STRIDE_T + offs_d[None, :]  # DQ
        q = tl.load(Q + offs_m[:, None] * stride_t + offs_d[None, :], mask=row_ok[:, None], other=0.0)  # own dtype
        do = tl.load(DO + offs_m[:, None] * do_stride_t + offs_d[None, :], mask=row_ok[:, None], other=0.0)
        lse = _shift_arg(tl.load(LSE + row_base + offs_m, mask=row_ok, other=0.0), EXP2)  # fl(lse·log₂e) for exp2
        delta = tl.load(DELTA + row_base + offs_m, mask=row_ok, other=0.0)

        dq = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.bfloat16 if BW_BF16 else tl.float32)  # as dK, dV

        # keys < k_end can be visible to some row of this tile (causal); none if the tile is past T
        k_end = tl.minimum(q_start + NQ, T)
        k_end = tl.where(q_start < T, k_end, 0)
        # policy key blocks j = 0, 1, ... up to the diagonal, ascending as in the reference
        for j in range(0, (k_end + BK - 1) // BK):
            k_blk = j * BK
            k_hi = tl.minimum(k_blk + BK, k_end)
            dq_part = tl.zeros([BLOCK_M, HEAD_DIM], dtype=tl.float32) if BW_BF16 else dq  # FP32: dQ_i itself
            # key sub-tiles k0 = k_blk, k_blk + BLOCK_N, … < k_hi, ascending: those up to k_mid lie inside the
            # block and end at or before key q_start, so every row sees them whole (no mask); the rest touch
            # the diagonal, the block's end or T (a padded sub-tile, BLOCK_N > BK, always does)
            if CAUSAL_SPLIT:
                k_mid = k_blk + tl.minimum(tl.maximum(q_start + 1 - k_blk, 0) // BLOCK_N, BK // BLOCK_N) * BLOCK_N
            else:
                k_mid = k_blk
            dq_part = _dq_tiles(dq_part, k_blk, k_mid, q, do, lse, delta, offs_m, row_ok, K, V, stride_t, scale,
                                nonfinite, T, s_pre, HEAD_DIM, BLOCK_N, SCORES_BF16, BW_BF16, OP_BF16, QK_DOT,
                                DOV_DOT, DSK_DOT, PRECISE_MATH, MASKED=False, SOFTCAP=SOFTCAP, EXP2=EXP2,
                                SR_SCORES=SR_SCORES, FOLD=FOLD)
            dq_part = _dq_tiles(dq_part, k_mid, k_hi, q, do, lse, delta, offs_m, row_ok, K, V, stride_t, scale,
                                nonfinite, T, s_pre, HEAD_DIM, BLOCK_N, SCORES_BF16, BW_BF16, OP_BF16, QK_DOT,
                                DOV_DOT, DSK_DOT, PRECISE_MATH, MASKED=True, SOFTCAP=SOFTCAP, EXP2=EXP2,
                                SR_SCORES=SR_SCORES, FOLD=FOLD)
            # end of policy key block j: dQ_i = bw(dQ_i + bw(partial))
            if BW_BF16:
                dq = _acc_bf16(dq, dq_part)
            else:
                dq = dq_part

        dq = dq.to(DQ.dtype.element_ty)
        tl.store(DQ + q_ptrs, dq, mask=row_ok[:, None])
        if FLAG:  # 1 where this tile of dQ holds an inf or NaN: the redo launch computes it again
            _store_flag(FLAGS, pid_bh, pid_m, n_tiles, _any_nonfinite(dq.to(tl.float32), row_ok))

    @triton.jit
    def _bwd_dq_kernel(
        Q, K, V, DO, LSE, DELTA, DQ,
        FLAGS, n_tiles,  # int32 (B*H, n_tiles): 1 per query tile whose dQ the fast launch left not finite
        T, scale, sr_seed,
        H, stride_b, stride_h, stride_t,  # Q, K, V's strides (shared): any layout, no copies
        do_stride_b, do_stride_h, do_stride_t,  # DO's
        g_stride_b, g_stride_h,  # DQ's (triton_common.empty_like_layout: q's order of dimensions)
        G_STRIDE_T: tl.constexpr,  # and its row stride, a constant: D (contiguous) or H·D (the model's views)
        HEAD_DIM: tl.constexpr,
        BQ: tl.constexpr, BK: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,  # compute tiles (query tile, key sub-tile)
        TILES_PER_BQ: tl.constexpr,  # query tiles per policy query block (ceil(BQ / BLOCK_M); the last may be short)
        SCORES_BF16: tl.constexpr, BW_BF16: tl.constexpr, OP_BF16: tl.constexpr,
        QK_DOT: tl.constexpr, DOV_DOT: tl.constexpr, DSK_DOT: tl.constexpr,
        PRECISE_MATH: tl.constexpr,
        CAUSAL_SPLIT: tl.constexpr,  # False: every sub-tile through the masked path (for comparison)
        SOFTCAP: tl.constexpr,  # policy.softcap, 0.0 = off
        EXP2: tl.constexpr,  # policy.exp == "exp2"
        SR_SCORES: tl.constexpr,  # policy.stochastic names "scores"
        FOLD: tl.constexpr,  # scale a power of two, folded into exp's argument (triton_common.scale_folds)
        REDO: tl.constexpr,  # the second launch: redo the tiles the first flagged; one program per REDO_TILES
        # query tiles
        REDO_TILES: tl.constexpr,
        FLAG: tl.constexpr,  # the first launch stores its flags (False: assume_finite, no second launch)
    ):
        pid_bh = tl.program_id(1)
        if not REDO:  # query tile program_id(0), plain GEMMs
            _dq_program(Q, K, V, DO, LSE, DELTA, DQ, FLAGS, n_tiles, tl.program_id(0), pid_bh, T, scale, sr_seed, H,
                        stride_b, stride_h, stride_t, do_stride_b, do_stride_h, do_stride_t, g_stride_b, g_stride_h,
                        G_STRIDE_T, 0, FLAG, HEAD_DIM, BQ, BK, BLOCK_M, BLOCK_N, TILES_PER_BQ, SCORES_BF16, BW_BF16,
                        OP_BF16, QK_DOT, DOV_DOT, DSK_DOT, PRECISE_MATH, CAUSAL_SPLIT, SOFTCAP, EXP2, SR_SCORES,
                        FOLD=FOLD)
        else:  # REDO_TILES query tiles: redo on the non-finite path those the first launch flagged
            first = tl.program_id(0) * REDO_TILES
            bad = _redo_flags(FLAGS, pid_bh, first, n_tiles, REDO_TILES)
            if tl.max(bad, axis=0) != 0:  # (usually none: the program ends here)
                for i in range(REDO_TILES):
                    if _at(bad, i) != 0:  # a non-finite K met in the fast path's dS K GEMMs
                        _dq_program(Q, K, V, DO, LSE, DELTA, DQ, FLAGS, n_tiles, first + i, pid_bh, T, scale, sr_seed,
                                    H, stride_b, stride_h, stride_t, do_stride_b, do_stride_h, do_stride_t, g_stride_b,
                                    g_stride_h, G_STRIDE_T, 1, False, HEAD_DIM, BQ, BK, BLOCK_M, BLOCK_N, TILES_PER_BQ,
                                    SCORES_BF16, BW_BF16, OP_BF16, QK_DOT, DOV_DOT, DSK_DOT, PRECISE_MATH, CAUSAL_SPLIT,
                                    SOFTCAP, EXP2, SR_SCORES, FOLD=FOLD)


def _delta(q, k, v, q_, k_, v_, do_, o_, lse_, pol: PrecisionPolicy, scale, dot_bf16, precise_math, flags, strides,
           assume_finite: bool = False):
    """δ per row (B, H, T) by ``pol.delta`` alone (no dose). ``q, k, v``: the inputs as given (for the recomputing
    forward of ``o_fp32``/``o_exact``); the underscored tensors: as the kernels load them, ``strides`` their layouts
    (H, then q, k, v's and dO's (B, H, T) strides)."""
    B, H, T, D = q.shape
    delta = torch.empty(B, H, T, device=q.device, dtype=torch.float32)
    if pol.delta == "dp_p":
        t_m = min(max(_next_pow2(T), MIN_TILE), COMPUTE_TILE)
        launch(
            _bwd_delta_dpp_kernel, (triton.cdiv(T, t_m), B * H),
            q_, k_, v_, do_, lse_, delta, T, float(scale), pol.sr_seed, *strides,
            HEAD_DIM=D, BLOCK_M=t_m, BLOCK_N=t_m,
            SCORES_BF16=pol.scores == BF16, BW_BF16=pol.backward == BF16, **flags, SOFTCAP=float(pol.softcap or 0.0),
            enable_fp_fusion=False,
        )
        return delta
    if pol.delta in ("o_fp32", "o_exact"):
        # O recomputed: S as the forward (o_fp32) or FP32
        o_src, _ = flash_forward(q, k, v, delta_o_policy(pol), scale, dot_bf16=dot_bf16, precise_math=precise_math,
                                 assume_finite=assume_finite)
        prod_bf16 = False
    else:  # "o_stored"
        o_src = o_
        prod_bf16 = pol.backward == BF16 and pol.o_store == BF16
    (o_src,), o_strides = shared_layout(o_src)  # in its own layout (unit stride along D, else a copy)
    t_m = min(max(_next_pow2(T), MIN_TILE), DELTA_ROWS)
    launch(
        _bwd_delta_kernel, (triton.cdiv(T, t_m), B * H),
        do_, o_src, delta, T, strides[0], *strides[4:], *o_strides,
        HEAD_DIM=D, BLOCK_M=t_m, PROD_BF16=prod_bf16,
        enable_fp_fusion=False,
    )
    return delta


def _check_backward_inputs(do, q, k, v, o_store, lse, pol: PrecisionPolicy, scale, causal) -> None:
    """:func:`flash_backward`'s input checks: q, k, v as the forward's, then do, o_store and lse against q."""
    check_triton_inputs(q, k, v, pol, scale, causal)
    for name, t, shape, dtypes in (("do", do, q.shape, (torch.bfloat16, torch.float32)),
                                   ("o_store", o_store, q.shape, (torch.bfloat16, torch.float32)),
                                   ("lse", lse, q.shape[:-1], (torch.float32,))):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.shape != shape:
            raise ValueError(f"{name} must have shape {tuple(shape)} (from q), got {tuple(t.shape)}")
        if t.dtype not in dtypes:
            raise TypeError(f"{name} has dtype {t.dtype}; expected {' or '.join(str(d) for d in dtypes)}")
    devs = {t.device for t in (do, q, o_store, lse)}
    if len(devs) != 1:
        raise ValueError(f"do, q, k, v, o_store, lse must be on one device, got {sorted(str(d) for d in devs)}")


def ordered_dq_unsupported(pol: PrecisionPolicy, BQ: int, BK: int, BLOCK_M: int, BLOCK_N: int) -> str | None:
    """Why ``dq_mode="ordered"`` cannot run this policy with these tiles (None: it can). It needs an FP32 backward (a
    BF16 one rounds each policy key block's share of dQ, which the dQ kernel keeps), key tiles that divide the policy
    key block, and query sub-tiles that divide both the policy query block and the key tile (so that every key tile
    adds to whole sub-tiles)."""
    if pol.backward == BF16:
        return ("needs an FP32 backward (policy.backward='fp32'): a BF16 one rounds dQ once per policy key block, "
                "which the dQ kernel keeps; got 'bf16'")
    if BK % BLOCK_N or BQ % BLOCK_M or BLOCK_N % BLOCK_M:
        return (f"needs key tiles that divide the policy key block and query sub-tiles that divide it and the policy "
                f"query block: got block_k {BK}, block_n {BLOCK_N}, block_q {BQ}, block_m {BLOCK_M}")
    return None


def flash_backward(do, q, k, v, o_store, lse, policy, scale, causal=True, *, dot_bf16: bool | None = None,
                   precise_math: bool | None = None, block_m: int | None = None, block_n: int | None = None,
                   num_warps: int | None = None, num_stages: int | None = None, causal_split: bool = True,
                   validate: bool = True, grad_dtype: torch.dtype = torch.float32,
                   dq_block_m: int | None = None, dq_block_n: int | None = None,
                   assume_finite: bool = False, fold_scale: bool = True,
                   dq_mode: str | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Causal flash-attention backward with the rounding points of ``policy``: ``do, q, k, v`` (B, H, T, D) bf16 or
    fp32, D in {16, 32, 64, 128}; ``o_store`` the forward's stored O (B, H, T, D), ``lse`` its (B, H, T) FP32
    log-sum-exp, as :func:`lpfa.attention.triton_fwd.flash_forward` or :func:`lpfa.attention.reference.forward`
    return them. Returns ``(dq, dk, dv)`` with the values of :func:`lpfa.attention.reference.backward`, as FP32
    tensors or in ``grad_dtype`` (``torch.bfloat16`` for BF16 inputs, as the autograd op does; the same bits as
    ``.to(torch.bfloat16)``). The keyword options (tuning, test switches, ``validate``, ``assume_finite``) are in the
    module docstring."""
    pol: PrecisionPolicy = get_policy(policy)
    if validate:
        _check_backward_inputs(do, q, k, v, o_store, lse, pol, scale, causal)
    B, H, T, D = q.shape
    # the launch: the caller's choices, the table's (triton_common.LAUNCHES, timed per head dim) where None; the dQ
    # kernel's tiles follow block_m/block_n where the caller sets those, else the table's
    run = default_launch("backward", pol, D, fp32_inputs=q.dtype == torch.float32, block_m=block_m, block_n=block_n,
                         num_warps=num_warps, num_stages=num_stages,
                         dq_block_m=dq_block_m if dq_block_m is not None else block_m,
                         dq_block_n=dq_block_n if dq_block_n is not None else block_n)
    num_warps, num_stages = run.num_warps, run.num_stages
    BQ, BLOCK_M, TPB_Q = policy_tiles(pol.block_q, T, run.block_m)
    BK, BLOCK_N, TPB_K = policy_tiles(pol.block_k, T, run.block_n)
    _, DQ_BLOCK_M, DQ_TPB_Q = policy_tiles(pol.block_q, T, run.dq_block_m or run.block_m)
    _, DQ_BLOCK_N, _ = policy_tiles(pol.block_k, T, run.dq_block_n or run.block_n)
    mode = run.dq_mode if dq_mode is None else dq_mode  # the caller's, else the launch table's
    if mode not in DQ_MODES:
        raise ValueError(f"dq_mode={mode!r}: expected one of {', '.join(map(repr, DQ_MODES))}")
    why = ordered_dq_unsupported(pol, BQ, BK, BLOCK_M, BLOCK_N) if mode == "ordered" else None
    if why and dq_mode is not None:
        raise ValueError(f"dq_mode='ordered' {why}")
    ordered = mode == "ordered" and not why  # (the table's "ordered" is "kernel" where it cannot run)
    if ordered:  # dQ by the dK/dV kernel's query sub-tiles: the redo launch's tiles and flags are those
        DQ_BLOCK_M, DQ_TPB_Q = BLOCK_M, TPB_Q

    interp = _interpreter()
    if dot_bf16 is None:
        dot_bf16 = not interp
    if precise_math is None:
        precise_math = (not interp) and libdevice is not None
    bw_bf16 = pol.backward == BF16
    op_bf16 = bw_bf16 or pol.p_bar == BF16
    is_bf = {n: t.dtype == torch.bfloat16 for n, t in (("do", do), ("q", q), ("k", k), ("v", v))}
    # the interpreter's BF16 is not faithful: FP32 copies there (values unchanged, the layout kept where dense)
    do_, q_, k_, v_, o_ = (t.float() if interp else t for t in (do, q, k, v, o_store))
    # q, k, v in their shared layout, dO and O each in its own (the model's transposed views: no copies)
    (q_, k_, v_), qkv_strides = shared_layout(q_, k_, v_)
    (do_,), do_strides = shared_layout(do_)
    strides = (H, *qkv_strides, *do_strides)
    lse_ = lse.contiguous()
    # one MODE per GEMM (triton_common.gemm_mode): BF16 tensor cores where both operands are BF16 by construction,
    # with gemm="bf16x6" every other operand split in three BF16 parts. q, k share a dtype, so QKᵀ and KQᵀ share one;
    # dP = dO Vᵀ (dQ and δ kernels) and dPᵀ = V dOᵀ (dK/dV kernel) are each other's mirror image
    g = pol.gemm
    flags = dict(
        QK_DOT=gemm_mode(g, dot_bf16, is_bf["q"], is_bf["k"]),
        DOV_DOT=gemm_mode(g, dot_bf16, is_bf["do"], is_bf["v"]),
        PRECISE_MATH=bool(precise_math),
        EXP2=pol.exp == "exp2",
        SR_SCORES="scores" in pol.stochastic,
    )

    # ---- δ per row: the policy's formula, its error against delta="o_fp32" dosed by policy.dose ----
    delta = _delta(q, k, v, q_, k_, v_, do_, o_, lse_, pol, scale, dot_bf16, precise_math, flags, strides,
                   assume_finite)
    if delta_dose_active(pol):
        ref = _delta(q, k, v, q_, k_, v_, do_, o_, lse_, pol.with_(delta="o_fp32"), scale, dot_bf16, precise_math,
                     flags, strides, assume_finite)
        delta = dose_delta(delta, ref, pol)

    # ---- dK, dV: one program per key tile ----
    if grad_dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"grad_dtype={grad_dtype}: expected torch.float32 or torch.bfloat16")
    # the interpreter's float → bf16 cast truncates: there the kernels store FP32 and the rounding happens below
    store_dtype = torch.float32 if interp else grad_dtype
    # in q's order of dimensions, as FlashAttention stores them (triton_common.empty_like_layout)
    (dq, g_strides), (dk, _), (dv, _) = (empty_like_layout(q, store_dtype) for _ in range(3))
    common = dict(
        HEAD_DIM=D, BQ=BQ, BK=BK, BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N,
        SCORES_BF16=pol.scores == BF16, BW_BF16=bw_bf16, OP_BF16=op_bf16, **flags,
        CAUSAL_SPLIT=bool(causal_split),
        SOFTCAP=float(pol.softcap or 0.0),
        FOLD=bool(fold_scale) and scale_folds(scale, pol),  # S/scale, the scale in exp's argument (_exp_scaled)
        enable_fp_fusion=False,  # no FMA: P·scale·(dP − δ) rounds each product, as in the reference
        num_warps=num_warps,
        num_stages=num_stages,
    )
    # each kernel twice: the fast path, then the tiles it left not finite (triton_common.redo_launches)
    n_ktiles = triton.cdiv(T, BK) * TPB_K
    n_qtiles = triton.cdiv(T, BQ) * DQ_TPB_Q
    # one flag per key tile, then per query tile, stored by each fast launch for its second (none when the caller
    # vouches for finite inputs: delta stands in for the pointer, never read)
    # (ordered: zeros, since the query sub-tiles past T are never flagged)
    tile_flags = delta if assume_finite else (torch.zeros if ordered else torch.empty)(
        B * H * (n_ktiles + n_qtiles), device=q.device, dtype=torch.int32)
    q_flags = tile_flags if assume_finite else tile_flags[B * H * n_ktiles:]
    dsk_dot = gemm_mode(g, dot_bf16, op_bf16, is_bf["k"])
    # ordered: dQ's FP32 running sums and, per query sub-tile, the count of key tiles that have added to them
    dq_acc = torch.zeros(B * H * T * D, device=q.device, dtype=torch.float32) if ordered else delta
    counts = torch.zeros(B * H * n_qtiles, device=q.device, dtype=torch.int32) if ordered else q_flags
    for redo in redo_launches(assume_finite):
        in_order = ordered and not redo  # (the redo launch recomputes dK, dV only: dQ's redo is the dQ kernel's)
        launch(
            _bwd_dkdv_kernel,
            (B * H, n_ktiles) if in_order else (triton.cdiv(n_ktiles, REDO_TILES) if redo else n_ktiles, B * H),
            q_, k_, v_, do_, lse_, delta, dk, dv, tile_flags, n_ktiles, dq, dq_acc, counts, q_flags, n_qtiles, T,
            float(scale), pol.sr_seed, *strides, *g_strides,
            TILES_PER_BK=TPB_K,
            PDO_DOT=gemm_mode(g, dot_bf16, op_bf16, op_bf16 or is_bf["do"]),
            DSQ_DOT=gemm_mode(g, dot_bf16, op_bf16, is_bf["q"]),
            REDO=redo, REDO_TILES=REDO_TILES, FLAG=not assume_finite, DSK_DOT=dsk_dot, ORDERED=in_order,
            **{**common, "DOV_DOT": gemm_mode(g, dot_bf16, is_bf["v"], is_bf["do"])},
        )
    # ---- dQ: one program per query tile (ordered: only the redo launch, for the sub-tiles flagged) ----
    for redo in redo_launches(assume_finite):
        if ordered and not redo:
            continue
        launch(
            _bwd_dq_kernel, (triton.cdiv(n_qtiles, REDO_TILES) if redo else n_qtiles, B * H),
            q_, k_, v_, do_, lse_, delta, dq, q_flags, n_qtiles, T, float(scale), pol.sr_seed, *strides, *g_strides,
            TILES_PER_BQ=DQ_TPB_Q,
            DSK_DOT=dsk_dot,
            REDO=redo, REDO_TILES=REDO_TILES, FLAG=not assume_finite,
            **{**common, "BLOCK_M": DQ_BLOCK_M, "BLOCK_N": DQ_BLOCK_N},
        )
    if store_dtype != grad_dtype:
        dq, dk, dv = (t.to(grad_dtype) for t in (dq, dk, dv))
    return dq, dk, dv
