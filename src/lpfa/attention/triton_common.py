"""Shared pieces of the Triton kernels: interpreter-safe BF16 rounding, GEMMs, precise exp/log.

GEMMs go through :func:`_dot` with one MODE constexpr each (:func:`gemm_mode`): IEEE FP32 products, one BF16
tensor-core GEMM (operands exactly BF16), or the policy's ``gemm="bf16x6"``: each FP32 operand split in three
BF16 parts (:func:`_split3`) and six BF16 GEMMs (:func:`_dot_split3`; :data:`lpfa.attention.policy.GEMM_SPLIT_DOC`).

Every value lives in an FP32 register; a BF16 rounding point is :func:`_round_bf16` (round to nearest
even by integer arithmetic on the FP32 bit pattern), which is exact under Triton's CPU interpreter,
where BF16 casts and BF16 ``tl.dot`` are not faithful.

Causal split (as in Triton's fused-attention tutorial and FlashAttention-2): a tile whose every (row, key)
pair is visible (key <= query, key < T, inside its policy block) needs no mask. The kernels run such tiles
through the same helpers with ``visible = None`` / ``ok = None`` (:func:`_load_tile`, :func:`_keep_visible`,
:func:`_dot_visible`), which then compile to plain loads and no ``tl.where``; only the tiles touching the
diagonal or the end of the sequence or of a policy block build masks. The mask is all-true on the other tiles,
so the results are bit-identical either way (``causal_split=False`` at launch masks every tile, for comparison).

Launches (:func:`launch`): Triton's ``JITFunction.run`` binds and specializes every argument, builds a cache key and
checks the kernel's globals on each call, and a forward and backward launches seven kernels. :func:`launch` sends
the first call of a specialization (the key of :func:`_arg_key` over the positional arguments, with every keyword
argument: constexprs and launch options) through ``run``, which compiles or finds the kernel; later calls hand the
same compiled kernel straight to its launcher. Positional arguments are the kernel's runtime arguments, keyword
arguments its constexprs and options, as at every launch site here. Under the interpreter, with a launch hook set
(Triton's profilers), or for a kernel whose parameters could not be lined up, every call goes through ``run``.
What that saves has not been separated from the spread between the device machines' hosts
(``benchmarks/host_overhead.py``, results/host_overhead).
"""

from __future__ import annotations

import contextlib
import math
import os
from dataclasses import dataclass, fields, replace

import torch

import lpfa.attention as lpfa_attention
from lpfa.attention.policy import BF16X6, FP32, GEMMS, PrecisionPolicy
from lpfa.attention.reference import LOG2E as _LOG2E
from lpfa.attention.reference import TANH_LOG2 as _TANH_LOG2

try:  # Triton is optional for the package as a whole
    import triton
    import triton.language as tl

    try:
        from triton.language.extra import libdevice
        from triton.language.extra.cuda import num_threads as _num_threads  # a block's threads, a constexpr
    except Exception:  # pragma: no cover - depends on the Triton build
        libdevice = _num_threads = None
except ImportError:  # pragma: no cover
    triton = None
    tl = None
    libdevice = _num_threads = None

HEAD_DIMS = (16, 32, 64, 128)
MIN_TILE = 16  # tl.dot needs every dimension >= 16


def _interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:
    # compiled for a GPU, or run by the CPU interpreter: fixed at import as the kernels' mode is (triton.jit reads
    # TRITON_INTERPRET when the module is imported). It picks BF16 rounding by the hardware conversion or by integer
    # arithmetic, one fused FMA or a float64 emulation, and custom reductions or the interpreter's built-in ones.
    _COMPILED = tl.constexpr(not _interpreter())

    @triton.jit
    def _round_bf16(x):
        """Round FP32 values to the nearest BF16 (ties to even), returned as FP32; ±inf unchanged, NaN stays NaN.
        On a GPU this is one hardware conversion there and back (``cvt.rn.bf16.f32``: round to nearest even,
        subnormals kept; a NaN comes back as the canonical NaN). The interpreter's float → bf16 cast truncates, so
        there the rounding is done on the FP32 bit pattern instead, with the same result for every non-NaN value."""
        if x.dtype == tl.bfloat16:  # a BF16 input tile: exactly BF16 already
            y = x.to(tl.float32)
        elif _COMPILED:
            y = x.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32)
        else:
            bits = x.to(tl.uint32, bitcast=True)
            # bits + 0x7FFF + lsb(bits >> 16), then clear the low 16 bits: round half to even
            lsb = (bits >> 16) & 1
            rounded = ((bits + 0x7FFF + lsb) >> 16) << 16
            # exponent all ones = inf or nan: leave as is (the carry would corrupt a nan payload)
            finite = (bits & 0x7F800000) != 0x7F800000
            y = tl.where(finite, rounded.to(tl.float32, bitcast=True), x)
        return y

    @triton.jit
    def _publish(count_ptr):
        """Publish this program's writes so far to a program that :func:`_wait_published` on ``count_ptr``: on a GPU
        every thread adds 1 to the int32 count with release semantics at GPU scope, each after its own writes, so
        the count grows by the block's thread count once all have (no barrier of the block: a ``bar.sync`` in a loop
        turns Triton's software pipelining of that loop off); the interpreter adds 1 once."""
        if _COMPILED:
            tl.atomic_add(count_ptr + tl.zeros([_num_threads()], tl.int32), 1, sem="release")
        else:
            tl.atomic_add(count_ptr, 1, sem="release")

    @triton.jit
    def _wait_published(count_ptr, n):
        """Spin until ``n`` programs have :func:`_publish`-ed to ``count_ptr`` (acquire at GPU scope: their writes
        are then visible to this thread); returns the count read, so that a load meant to follow the wait can depend
        on it (its address plus ``count − count``). On a GPU each thread runs one inline-PTX loop: a spin of Triton's
        own (``while``) would nest a loop in the caller's, and Triton's software pipeliner leaves such a loop
        unpipelined (no ``cp.async`` prefetch of its tiles at all). The interpreter spins on an atomic
        compare-and-swap."""
        if _COMPILED:
            return tl.inline_asm_elementwise(
                """{
                .reg .pred %p<1>;
                .reg .b32 %c<1>;
                wait_published:
                ld.acquire.gpu.global.b32 %c0, [$1];
                setp.ne.s32 %p0, %c0, $2;
                @%p0 bra wait_published;
                mov.b32 $0, %c0;
                }""",
                "=r,l,r", [count_ptr, n * _num_threads()], dtype=tl.int32, is_pure=False, pack=1)
        else:
            while tl.atomic_cas(count_ptr, n, n, sem="acquire") != n:
                pass
            return n

    @triton.jit
    def _mix32(x):
        """lowbias32 on uint32 (wrapping multiplies): :func:`lpfa.attention.reference.mix32`, bit for bit."""
        x = x ^ (x >> 16)
        x = x * 0x7FEB352D
        x = x ^ (x >> 15)
        x = x * 0x846CA68B
        return x ^ (x >> 16)

    @triton.jit
    def _sr_pre(seed, point: tl.constexpr, bh):
        """The hash's start for one (seed, rounding point, batch·head): :func:`_sr_salt` before its key block."""
        zero = bh * 0  # seed may arrive as a Python int (a seed of 1 specialised by Triton)
        return _mix32(_mix32(_mix32((seed + zero).to(tl.uint32)) ^ point) ^ bh.to(tl.uint32))

    @triton.jit
    def _sr_salt(seed, point: tl.constexpr, bh, j):
        """The hash's start for one (seed, rounding point, batch·head, key block): reference.stochastic_round_bf16."""
        zero = bh * 0  # j may arrive as a Python int (a literal j)
        return _mix32(_sr_pre(seed, point, bh) ^ (j + zero).to(tl.uint32))

    @triton.jit
    def _rnd_s(x, TO_BF16: tl.constexpr, SR: tl.constexpr, s_pre, j: tl.constexpr, pos):
        """A rounding of the scores (j = 0: the QKᵀ GEMM output, 1: ·scale): stochastic when SR (policy.stochastic
        names "scores"), with ``s_pre`` = _sr_pre(seed, 7, batch·head) and ``pos`` the uint32 positions query·T + key,
        else _rnd (``s_pre`` and ``pos`` unused)."""
        if TO_BF16 and SR:
            x = _round_bf16_sr(x, _mix32(s_pre ^ j), pos)
        else:
            x = _rnd(x, TO_BF16)
        return x

    @triton.jit
    def _score_pos(offs_q, offs_k, T, TRANSPOSED: tl.constexpr):
        """The uint32 positions query·T + key of a score tile (rows = queries, or keys when TRANSPOSED), which the
        stochastic rounding of the scores hashes (call it only then: ``pos = _score_pos(…) if SR else None``)."""
        t = (offs_q * 0 + T).to(tl.uint32)  # T may arrive as a Python int (T = 1 is specialised)
        if TRANSPOSED:
            return offs_q.to(tl.uint32)[None, :] * t[None, :] + offs_k.to(tl.uint32)[:, None]
        else:
            return offs_q.to(tl.uint32)[:, None] * t[:, None] + offs_k.to(tl.uint32)[None, :]

    @triton.jit
    def _round_bf16_sr(x, salt, pos):
        """Stochastic rounding of x to BF16 (returned as FP32), ``pos`` the uint32 position of each element (row·D +
        column, or the row for a per-row value): u + (hash >> 16) with the low 16 bits cleared, hash =
        mix32(mix32(salt ^ pos) ^ (u >> 16)), :func:`lpfa.attention.reference.stochastic_round_bf16`'s bits. ±inf
        stay, NaN stays NaN."""
        bits = x.to(tl.uint32, bitcast=True)
        h = _mix32(_mix32(salt ^ pos) ^ (bits >> 16))
        rounded = ((bits + (h >> 16)) >> 16) << 16
        return tl.where(x != x, x, rounded.to(tl.float32, bitcast=True))

    @triton.jit
    def _rnd_l(x, TO_BF16: tl.constexpr, SR: tl.constexpr, seed, point: tl.constexpr, bh, j, offs_m):
        """The rounding of a per-row value on O's path (the row sum l): as :func:`_rnd_o`, hashed by row."""
        if TO_BF16 and SR:
            x = _round_bf16_sr(x, _sr_salt(seed, point, bh, j), offs_m.to(tl.uint32))
        else:
            x = _rnd(x, TO_BF16)
        return x

    @triton.jit
    def _rnd_o(x, TO_BF16: tl.constexpr, SR: tl.constexpr, seed, point: tl.constexpr, bh, j, offs_m, offs_d,
               HEAD_DIM: tl.constexpr):
        """A rounding point on O's path (Ō, the running o, O): stochastic when SR (policy.stochastic), else _rnd."""
        if TO_BF16 and SR:
            pos = (offs_m[:, None] * HEAD_DIM + offs_d[None, :]).to(tl.uint32)
            x = _round_bf16_sr(x, _sr_salt(seed, point, bh, j), pos)
        else:
            x = _rnd(x, TO_BF16)
        return x

    @triton.jit
    def _rnd(x, TO_BF16: tl.constexpr):
        """One rounding point: BF16 round-trip when TO_BF16, else identity (FP32)."""
        if TO_BF16:
            x = _round_bf16(x)
        return x

    @triton.jit
    def _max_nan(a, b):
        """max(a, b) with NaN winning, on the GPU as in the interpreter (plain tl.max ignores NaN on the GPU)."""
        return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)

    @triton.jit
    def _row_max(x):
        """rowmax over axis 1, NaN-propagating (a NaN score makes the row's max NaN, as torch.amax does). On a GPU one
        reduction with :func:`_max_nan`. The interpreter runs a reduction with a combine function of its own element
        by element in Python (most of a forward's time there), so under it the same values come from its built-in
        max (NumPy's, which skips NaN) and a NaN test."""
        if _COMPILED:
            m = tl.reduce(x, 1, _max_nan)
        else:
            m = tl.where(tl.max((x != x).to(tl.int32), 1) > 0, float("nan"), tl.max(x, 1))
        return m

    @triton.jit
    def _top2(a1, a2, b1, b2):
        """The two largest of two pairs (a1 ≥ a2, b1 ≥ b2): the first NaN-propagating, the second max(min(a1, b1),
        a2, b2), so a maximum held twice is also the second. a2 and b2 meet in the NaN-propagating max, which the
        compiler drops against a leaf's −inf (a row whose first is NaN never uses its second)."""
        return _max_nan(a1, b1), tl.maximum(tl.minimum(a1, b1), _max_nan(a2, b2))

    @triton.jit
    def _row_top2(x):
        """(rowmax, the second largest value) over axis 1 in one reduction: SFA's tie test (two values within ε of
        the max) needs no more than these two. Under the interpreter (see :func:`_row_max`) from built-in reductions
        instead: the max again where it is held twice, else the max of the rest; the same values wherever the row
        holds no NaN (a NaN row's max is NaN, and the tie test then ignores the second value)."""
        if _COMPILED:
            m1, m2 = tl.reduce((x, tl.full(x.shape, float("-inf"), tl.float32)), 1, _top2)
        else:
            m1 = _row_max(x)
            at_max = x == m1[:, None]
            rest = tl.max(tl.where(at_max, float("-inf"), x), 1)
            m2 = tl.where(tl.sum(at_max.to(tl.int32), 1) > 1, m1, rest)
        return m1, m2

    @triton.jit
    def _dot_part(a, b, acc, AS_BF16: tl.constexpr):
        """acc + a @ b (acc None: a @ b) with FP32 accumulation: BF16 tensor-core operands when AS_BF16 (exact values
        only), else IEEE FP32 (the interpreter: products of BF16 values are exact there too)."""
        if AS_BF16:
            return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), acc, out_dtype=tl.float32)
        else:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee", out_dtype=tl.float32)

    @triton.jit
    def _split3(x):
        """The 3-way BF16 split of FP32 values (:func:`lpfa.attention.reference.split3`): ``(x0, h, x1, x2)`` with
        x0 = bf16(x), x1 = bf16(x − x0), x2 = bf16(x − x0 − x1), all FP32 registers holding BF16 values, and h = x0
        with 0 where x0 is ±inf or NaN (x1 = x2 = 0 there): the head the cross terms use."""
        x = x.to(tl.float32)
        x0 = _round_bf16(x)
        fin = tl.abs(x0) < float("inf")  # False for ±inf and NaN
        r = tl.where(fin, x - x0, 0.0)  # exact in FP32
        x1 = _round_bf16(r)
        x2 = _round_bf16(r - x1)  # r − x1 is exact and BF16 already (but for subnormals): a no-op rounding
        return x0, tl.where(fin, x0, 0.0), x1, x2

    @triton.jit
    def _dot_split3(a, b, SPLIT_A: tl.constexpr, SPLIT_B: tl.constexpr, AS_BF16: tl.constexpr):
        """a @ b through BF16 products of split operands (``gemm="bf16x6"``,
        :data:`lpfa.attention.policy.GEMM_SPLIT_DOC`), FP32 accumulation, small terms first. Both split: a1·b1 + h_a·b2
        + a2·h_b + h_a·b1 + a1·h_b + a0·b0 (the six terms with i + j ≤ 2). Only a split (b is BF16): a2·b' + a1·b' +
        a0·b (b' = b with 0 where non-finite): the exact product; only b split, the mirror image. Every part is exactly
        BF16, so AS_BF16 (GPU) casts losslessly."""
        if SPLIT_A and SPLIT_B:
            a0, ha, a1, a2 = _split3(a)
            b0, hb, b1, b2 = _split3(b)
            acc = _dot_part(a1, b1, None, AS_BF16)
            acc = _dot_part(ha, b2, acc, AS_BF16)
            acc = _dot_part(a2, hb, acc, AS_BF16)
            acc = _dot_part(ha, b1, acc, AS_BF16)
            acc = _dot_part(a1, hb, acc, AS_BF16)
            acc = _dot_part(a0, b0, acc, AS_BF16)
        elif SPLIT_A:
            a0, ha, a1, a2 = _split3(a)
            b = b.to(tl.float32)
            hb = tl.where(tl.abs(b) < float("inf"), b, 0.0)
            acc = _dot_part(a2, hb, None, AS_BF16)
            acc = _dot_part(a1, hb, acc, AS_BF16)
            acc = _dot_part(a0, b, acc, AS_BF16)
        else:
            b0, hb, b1, b2 = _split3(b)
            a = a.to(tl.float32)
            ha = tl.where(tl.abs(a) < float("inf"), a, 0.0)
            acc = _dot_part(ha, b2, None, AS_BF16)
            acc = _dot_part(ha, b1, acc, AS_BF16)
            acc = _dot_part(a, b0, acc, AS_BF16)
        return acc

    @triton.jit
    def _dot(a, b, MODE: tl.constexpr):
        """a @ b with FP32 accumulation, as the GEMM's MODE (:func:`gemm_mode`) says: 0 = IEEE FP32 products; 1 = BF16
        tensor-core operands (exact values only); bits 2 / 4 = split a / b in three BF16 parts (:func:`_dot_split3`),
        bit 1 then = cast the parts to BF16 for the tensor cores. A bool works as MODE 0 / 1."""
        if (MODE & 6) != 0:
            return _dot_split3(a, b, (MODE & 2) != 0, (MODE & 4) != 0, (MODE & 1) != 0)
        elif (MODE & 1) != 0:
            return _dot_part(a, b, None, True)
        else:
            return _dot_part(a, b, None, False)

    @triton.jit
    def _dot_visible(a, b, visible, b_nonfinite, MODE: tl.constexpr):
        """a @ b summed over visible pairs only (:func:`lpfa.attention.reference._mm_visible`): ``a`` (M, K) is 0
        where ``visible`` (M, K) is False (``None``: every pair is visible, an unmasked tile), ``b`` (K, N) may
        hold inf/NaN when ``b_nonfinite`` is 1 (a constant: the kernels' non-finite path, :func:`redo_launches`). A
        non-finite b[k, n] then makes out[m, n] NaN exactly where (m, k) is visible (a second GEMM, of 0/1
        indicators, finds where one is reached; with every pair visible, a column test). Without the flag this is
        one plain GEMM. MODE: as :func:`_dot`."""
        if b_nonfinite != 0:
            bad = (b != b) | (b == float("inf")) | (b == float("-inf"))
            out = _dot(a, tl.where(bad, 0.0, b), MODE)
            if visible is None:  # reach[m, n] = any_k bad[k, n], the same for every row m
                reach = tl.max(bad.to(tl.int32), axis=0)[None, :]
            else:  # reach[m, n] = #{k: visible[m, k] and bad[k, n]} (0/1 operands: exact in BF16, never split)
                reach = _dot(visible.to(tl.float32), bad.to(tl.float32), MODE & 1)
            out = tl.where(reach > 0, float("nan"), out)
        else:
            out = _dot(a, b, MODE)
        return out

    @triton.jit
    def _load_tile(ptrs, ok):
        """tl.load of a tile whose entries outside ``ok`` (broadcast to ``ptrs``) read as 0; ``ok = None``: every
        entry is in range (a tile of the unmasked causal range), a plain load."""
        if ok is None:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=ok, other=0.0)
        return x

    @triton.jit
    def _keep_visible(x, visible, other):
        """x where ``visible``, ``other`` elsewhere; ``visible = None`` (every pair visible): x unchanged."""
        if visible is not None:
            x = tl.where(visible, x, other)
        return x

    @triton.jit
    def _exp(x, PRECISE_MATH: tl.constexpr):
        if PRECISE_MATH:
            return libdevice.exp(x)
        else:
            return tl.exp(x)

    LOG2E = tl.constexpr(_LOG2E)  # log₂e rounded to FP32 (lpfa.attention.reference.LOG2E)

    @triton.jit
    def _fma(a, b, c):
        """fl32(a·b + c) rounded once, for a tensor a, a scalar b holding an FP32 value (a constant, a kernel argument
        or a product of one) and c broadcast to a's shape: ``tl.fma`` on a GPU. The interpreter's fma rounds twice, so
        there the product (exact) and the sum are taken in float64 and then rounded to FP32: that differs from one
        rounding only where the float64 sum lies exactly halfway between two FP32 values
        (:func:`lpfa.attention.reference.fma_f32` handles that case too), far below the FP32 exp's own error at the
        exp2 that follows."""
        if _COMPILED:
            return tl.fma(a, tl.full(a.shape, b, tl.float32), tl.broadcast_to(c, a.shape))
        else:
            return (a.to(tl.float64) * b + c.to(tl.float64)).to(tl.float32)

    @triton.jit
    def _exp2(x, PRECISE_MATH: tl.constexpr):
        if PRECISE_MATH:
            return libdevice.exp2(x)
        else:
            return tl.exp2(x)

    @triton.jit
    def _exp_shifted(s, m_arg, DIFF_BF16: tl.constexpr, PRECISE_MATH: tl.constexpr, EXP2: tl.constexpr):
        """exp(S − m) as the policy evaluates it (:func:`lpfa.attention.reference.exp_shifted`), ``m_arg`` from
        :func:`_shift_arg`, broadcast against S (a row's m or lse along its keys): exp(S − m) with the difference
        rounded to BF16 where DIFF_BF16 (the forward's BF16 scores), or with EXP2 FlashAttention-2's
        exp2(fma(S, log₂e, −fl(m·log₂e))), the product m·log₂e taken once per row."""
        if EXP2:
            return _exp2(_fma(s, LOG2E, -m_arg), PRECISE_MATH)
        else:
            return _exp(_rnd(s - m_arg, DIFF_BF16), PRECISE_MATH)

    @triton.jit
    def _exp_scaled(x, scale, m_arg, DIFF_BF16: tl.constexpr, PRECISE_MATH: tl.constexpr, EXP2: tl.constexpr):
        """:func:`_exp_shifted` of S = x·scale for a scale that is a power of two (:func:`scale_folds`), the scale
        folded into the argument's one rounding: exp(fma(x, scale, −m)) (rounded to BF16 where DIFF_BF16), or
        exp2(fma(x, scale·log₂e, −fl(m·log₂e))). x·scale and scale·log₂e are exact, so each FMA rounds the same
        real number as the unfolded form does, and the bits are the same (where x·scale would be subnormal, the
        argument differs by under 2⁻¹⁴⁹ and its exp does not). One multiply per score fewer."""
        if EXP2:
            return _exp2(_fma(x, scale * LOG2E, -m_arg), PRECISE_MATH)
        else:
            return _exp(_rnd(_fma(x, scale, -m_arg), DIFF_BF16), PRECISE_MATH)

    @triton.jit
    def _shift_arg(m, EXP2: tl.constexpr):
        """The row vector :func:`_exp_shifted` subtracts: m, or fl(m·log₂e) with EXP2."""
        if EXP2:
            return m * LOG2E
        else:
            return m

    @triton.jit
    def _rescale(m_diff, PRECISE_MATH: tl.constexpr, EXP2: tl.constexpr):
        """c = exp(m − m_new) from the rounded difference: exp, or exp2(fl(m_diff·log₂e)) with EXP2."""
        if EXP2:
            return _exp2(m_diff * LOG2E, PRECISE_MATH)
        else:
            return _exp(m_diff, PRECISE_MATH)

    TANH_LOG2 = tl.constexpr(_TANH_LOG2)  # −2·log₂e rounded to FP32 (lpfa.attention.reference.TANH_LOG2)

    @triton.jit
    def _tanh(x, PRECISE_MATH: tl.constexpr):
        """tanh(x) = sign(x)·(1 − e)/(1 + e), e = exp2(|x|·fl(−2·log₂e)), in FP32:
        :func:`lpfa.attention.reference.tanh_f32`."""
        e = _exp2(tl.abs(x) * TANH_LOG2, PRECISE_MATH)
        t = (1.0 - e) / (1.0 + e)
        return tl.where(x < 0, -t, t)

    @triton.jit
    def _softcap(s, SCORES_BF16: tl.constexpr, PRECISE_MATH: tl.constexpr, SOFTCAP: tl.constexpr):
        """``(S', t)``: S' = scores(c·scores(tanh(scores(S·fl(1/c))))) with c = SOFTCAP (policy.softcap, Gemma 2's
        logit soft-capping) and t the rounded tanh, for the backward's 1 − t²; ``(S, S)`` when SOFTCAP is 0 (off)."""
        if SOFTCAP > 0:  # S·fl(1/c): a multiply by a constant (1/c folded at compile time, FP32), not a division
            t = _rnd(_tanh(_rnd(s * (1.0 / SOFTCAP), SCORES_BF16), PRECISE_MATH), SCORES_BF16)
            s = _rnd(t * SOFTCAP, SCORES_BF16)
        else:
            t = s
        return s, t

    @triton.jit
    def _tanh_kernel(X, Y, N, BLOCK: tl.constexpr, PRECISE_MATH: tl.constexpr):
        """Y = _tanh(X) elementwise over N FP32 values (:func:`kernel_tanh`)."""
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        ok = offs < N
        tl.store(Y + offs, _tanh(tl.load(X + offs, mask=ok, other=0.0), PRECISE_MATH), mask=ok)

    @triton.jit
    def _log(x, PRECISE_MATH: tl.constexpr):
        if PRECISE_MATH:
            return libdevice.log(x)
        else:
            return tl.log(x)

    @triton.jit
    def _out_rows(pid_bh, T, H, stride_b, stride_h, STRIDE_T: tl.constexpr, HEAD_DIM: tl.constexpr):
        """Offset of batch·head ``pid_bh``'s row 0 in a kernel output laid out by :func:`empty_like_layout`, whose
        row stride ``STRIDE_T`` is a constant: HEAD_DIM where the output is contiguous (or has one head), and there
        pid_bh·T·HEAD_DIM, the arithmetic of a contiguous output; else (the model's views: (B, T, H, D) in memory)
        b·stride_b + h·stride_h."""
        if STRIDE_T == HEAD_DIM:
            return pid_bh.to(tl.int64) * T * HEAD_DIM
        else:
            return (pid_bh // H).to(tl.int64) * stride_b + (pid_bh % H).to(tl.int64) * stride_h

    @triton.jit
    def _store_flag(FLAGS, pid_bh, tile, n_tiles, bad):
        """The fast launch's verdict on one tile of its output: FLAGS[pid_bh, tile] = ``bad``, 1 where the tile it
        stored holds an inf or NaN (:func:`_any_nonfinite`), else 0 (:func:`redo_launches`)."""
        tl.store(FLAGS + pid_bh.to(tl.int64) * n_tiles + tile, bad)

    @triton.jit
    def _redo_flags(FLAGS, pid_bh, first, n_tiles, REDO_TILES: tl.constexpr):
        """The (REDO_TILES,) flags of tiles first .. first + REDO_TILES − 1 of batch·head ``pid_bh``, as the fast launch
        stored them (:func:`_store_flag`); 0 past the last tile."""
        offs = first + tl.arange(0, REDO_TILES)
        return tl.load(FLAGS + pid_bh.to(tl.int64) * n_tiles + offs, mask=offs < n_tiles, other=0)

    @triton.jit
    def _tile_rows(t, T, BLOCK: tl.constexpr, TILE: tl.constexpr, TILES_PER_BLOCK: tl.constexpr):
        """Compute tile ``t`` of a sequence of T rows cut into policy blocks of BLOCK rows, each into TILES_PER_BLOCK
        tiles of TILE rows (the last one cut short at the block's end): its first row, its rows inside the block,
        and the (TILE,) mask of those rows that lie before T (all False for a tile past the last)."""
        start = (t // TILES_PER_BLOCK) * BLOCK + (t % TILES_PER_BLOCK) * TILE
        n = tl.minimum(TILE, BLOCK - (t % TILES_PER_BLOCK) * TILE)
        loc = tl.arange(0, TILE)
        return start, n, (loc < n) & (start + loc < T)

    @triton.jit
    def _at(v, i):
        """Element i of the vector v, as a scalar."""
        return tl.sum(tl.where(tl.arange(0, v.shape[0]) == i, v, 0))

    @triton.jit
    def _any_nonfinite(x, ok):
        """1 (int32) if the tile x (M, N) holds an inf or NaN in a row where ``ok`` (M,) is True, else 0."""
        bad = ((x != x) | (tl.abs(x) == float("inf"))) & ok[:, None]
        return tl.max(tl.max(bad.to(tl.int32), axis=1), axis=0)


def kernel_tanh(x: torch.Tensor, precise_math: bool | None = None) -> torch.Tensor:
    """The kernels' FP32 tanh (:func:`_tanh`, the soft-cap's) of each value of ``x``, computed as a kernel computes it
    on x's device: compiled on a GPU (``precise_math`` None: libdevice's exp2, as the kernels default to), by the
    interpreter on the CPU. The forward's soft-capped row max from the raw Q Kᵀ rests on it being non-decreasing on
    the BF16 values (:func:`lpfa.attention.triton_fwd.raw_row_max`)."""
    if triton is None:
        raise ImportError("kernel_tanh needs the `triton` package")
    if precise_math is None:
        precise_math = (not _interpreter()) and libdevice is not None
    flat = x.detach().float().contiguous().reshape(-1)
    y = torch.empty_like(flat)
    block = 1024
    launch(_tanh_kernel, (triton.cdiv(flat.numel(), block),), flat, y, flat.numel(), BLOCK=block,
           PRECISE_MATH=bool(precise_math), enable_fp_fusion=False)
    return y.reshape(x.shape)


def gemm_mode(gemm: str, dot_bf16: bool, a_bf16: bool, b_bf16: bool) -> int:
    """The MODE constexpr of one GEMM for :func:`_dot`. ``gemm``: the policy's ``gemm`` field; ``dot_bf16``: the
    launch's tensor-core switch (off under the interpreter); ``a_bf16``/``b_bf16``: the operand holds BF16 values by
    construction (a BF16 input, or rounded to BF16 by the policy). With ``gemm="bf16x6"`` every other operand is
    split (bits 2, 4), and all the parts are BF16, so the tensor cores take them (bit 1 = ``dot_bf16``); with
    ``"ieee"`` the tensor cores take the GEMM only when both operands are BF16 (as before ``gemm`` existed)."""
    if gemm not in GEMMS:
        raise ValueError(f"gemm={gemm!r}: expected one of {', '.join(map(repr, GEMMS))}")
    split_a = gemm == BF16X6 and not a_bf16
    split_b = gemm == BF16X6 and not b_bf16
    exact = (a_bf16 or split_a) and (b_bf16 or split_b)
    return int(bool(dot_bf16) and exact) | (2 if split_a else 0) | (4 if split_b else 0)


_LAUNCHES: dict = {}  # launch key -> (CompiledKernel, the constexpr values after the positional arguments)


def _arg_key(a):
    """What Triton specializes a compiled kernel on, for one argument: a tensor's dtype and 16-byte alignment; an int's
    value (Triton specializes ints on = 1, divisibility by 16 and 32/64 bits: the value fixes all three); a float's
    type only (Triton does not specialize floats)."""
    if isinstance(a, torch.Tensor):
        return a.dtype, a.data_ptr() % 16 == 0
    if isinstance(a, float):
        return float
    return type(a), a


def _hooked(hook) -> bool:
    """Whether a Triton launch hook is set: None, or a HookChain (Triton 3.5+) with no calls, is none."""
    return hook is not None and bool(getattr(hook, "calls", True))


def launch(kernel, grid, *args, **meta):
    """``kernel[grid](*args, **meta)``, with the host work of Triton's ``JITFunction.run`` done once per
    specialization: the first call of a specialization goes through ``run``, later ones hand the compiled kernel
    straight to its launcher (the module docstring says when it falls back to ``run``). Positional arguments are the
    kernel's runtime arguments, keyword arguments its constexprs and launch options."""
    try:
        key = (kernel, args[0].device.index, *map(_arg_key, args), *meta.items())
        hit = _LAUNCHES.get(key)
    except TypeError:  # an unhashable argument: no fast path
        key, hit = None, None
    hooks = _hooked(triton.knobs.runtime.launch_enter_hook) or _hooked(triton.knobs.runtime.launch_exit_hook)
    if hit is None or hooks:
        compiled = kernel[grid](*args, **meta)
        if key is not None and not hooks and type(compiled).__name__ == "CompiledKernel":
            try:  # constexprs (and a specialization's own) are passed to the launcher by position, which ignores them
                tail = tuple(meta[name] for name in kernel.arg_names[len(args):])
            except KeyError:
                return
            _LAUNCHES[key] = (compiled, tail)
        return
    compiled, tail = hit
    g = (*grid, 1, 1)
    stream = torch._C._cuda_getCurrentRawStream(key[1])  # what Triton's driver asks for the current stream
    compiled.run(g[0], g[1], g[2], stream, compiled.function, compiled.packed_metadata, None, None, None, *args, *tail)


def shared_layout(*xs):
    """``(xs, (stride_b, stride_h, stride_t))``: (B, H, T, D) tensors of one shape that share their strides, with unit
    stride along D and non-negative strides, as they are (a transposed view of a (B, T, H, D) tensor, or slices of a
    (B, T, 3, H, D) one, as GPT's attention passes q, k and v); any other layout as contiguous copies. The kernels
    address row t of batch·head (b, h) at ``b·stride_b + h·stride_h + t·stride_t``, so no layout needs a copy first."""
    st = xs[0].stride()
    if st[3] != 1 or min(st) < 0 or any(x.stride() != st for x in xs[1:]):
        xs = tuple(x.contiguous() for x in xs)
        st = xs[0].stride()
    return xs, st[:3]


def empty_like_layout(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """``(out, (stride_b, stride_h, stride_t))``: an uninitialised dense (B, H, T, D) tensor of ``dtype`` on x's device,
    laid out in x's order of dimensions, and its strides. Where x's T stride exceeds its H stride (a transposed view of
    a (B, T, H, D) or (B, T, 3, H, D) tensor, as GPT's attention passes q, k, v), that is (B, T, H, D) in memory, as
    FlashAttention and SDPA store O and the gradients: the model's ``y.transpose(1, 2).contiguous()`` is then free,
    and autograd's concatenation of dQ, dK, dV into the QKV projection's gradient copies whole rows. Else contiguous.
    The order depends on x's strides alone, so the custom op's fake kernels (:mod:`lpfa.attention.kernels`) give the
    same layout as the kernels' wrappers."""
    order = (0, 2, 1, 3) if x.stride(2) > x.stride(1) else (0, 1, 2, 3)
    out = torch.empty_permuted(x.shape, order, dtype=dtype, device=x.device)
    return out, out.stride()[:3]


# How each kernel keeps an inf or NaN operand from reaching the outputs that cannot see it. A masked pair is 0 in
# the fast path's GEMMs (P̄ V, Pᵀ dO, dSᵀ Q, dS K), and 0·inf = NaN would carry a non-finite operand into rows that do
# not see it; the non-finite path (_dot_visible with its flag set) masks it exactly, but compiled into the hot loop it
# costs registers, and compiled in after it, as a second pass for a program whose result is not finite, it cut fa2's
# forward+backward from 174 to 118 TFLOP/s on an H100 (results/attention_screening/h100-2026-12-06-e307f53). Every
# value a non-finite operand touches in a GEMM turns inf or NaN and stays so to the stored output, so a tile whose
# stored output is finite has met none, and that output is the non-finite path's bit for bit (the path equals the
# plain GEMM where every operand is finite). So each kernel launches twice: the fast path (REDO=False) for every
# tile, which also stores one flag per tile, 1 where the output it stored holds an inf or NaN (_store_flag); then
# REDO=True, whose programs each read the flags of REDO_TILES tiles and compute again, on the non-finite path, those
# flagged. Nothing syncs with the host.


REDO_TILES = 64  # tiles whose flags one redo program reads: one program per batch·head up to T = 4,096 at 64-row
# tiles. Reading back the output instead, one tile per program, took 12% of fa2's forward+backward GPU time at GPT-2
# shapes (results/attention_ncu/h100-2026-12-06).


def redo_launches(assume_finite: bool) -> tuple[bool, ...]:
    """The REDO constexpr of each launch of one kernel (the comment above): the fast path, then the fix-up; the fast
    path alone when the caller vouches for finite inputs (``assume_finite``)."""
    return (False,) if assume_finite else (False, True)


def _next_pow2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


def policy_tiles(block: int | None, T: int, preferred: int) -> tuple[int, int, int]:
    """Split a policy block into compute tiles: ``(block size, tile, tiles per block)``. The policy block (``None`` =
    the whole sequence) fixes where the algorithm rounds; the tile is what one ``tl.dot`` handles. A block longer than
    ``preferred`` is cut into ``preferred``-sized tiles, the last one masked at the block's edge when the block is not a
    multiple of ``preferred`` (``paper_untiled`` at T = 1000: 16 tiles of 64, the last holding 40 keys); a shorter block
    is one tile of the next power of two (at least :data:`MIN_TILE`), masked likewise. So a tile never exceeds
    ``preferred``, whatever T."""
    size = T if block is None else int(block)
    if size >= preferred:
        return size, preferred, -(-size // preferred)
    return size, max(_next_pow2(size), MIN_TILE), 1


DQ_MODES = ("kernel", "ordered")
"""How :func:`lpfa.attention.triton_bwd.flash_backward` computes dQ: ``"kernel"``, a kernel of its own that recomputes
P and dP per query tile; ``"ordered"``, the dK/dV kernel adds each key tile's op(dS) K to FP32 running sums in
ascending key-tile order (``triton_bwd._dq_add_in_order``), as FlashAttention-2 adds them with atomics but in a fixed
order, so deterministic."""


@dataclass(frozen=True)
class Launch:
    """One kernel's compute tiles and launch options: launch tuning only, since the policy's blocks fix the rounding
    (:func:`policy_tiles` cuts them into these tiles). ``dq_block_m``/``dq_block_n``: the backward's dQ kernel's own
    query tile and key sub-tile (None: ``block_m``/``block_n``); ``dq_mode``: how the backward computes dQ
    (:data:`DQ_MODES`; ``"ordered"`` where the policy and the tiles allow it, else
    ``"kernel"``)."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    dq_block_m: int | None = None
    dq_block_n: int | None = None
    dq_mode: str = "kernel"


# The launch defaults, by (pass, policy key block of at most one 128-key tile, head dim up to 64 or 128), each the
# fastest configuration of a launch sweep (benchmarks/tune_attention.py) on one GPU:
# * D <= 64: an H200 at GPT-2 shapes, B 16, H 12, T 1,024 (results/attention_tuning/h200-2026-12-01);
# * D = 128: an H100 at B 16, H 6, T 1,024 (results/attention_tuning/h100-2026-12-06-d128): 213 TFLOP/s for fa2's
#   forward at 128 x 128 against 142 at 64 x 64; the backward's 32-row query tiles as in Triton's fused-attention
#   tutorial (fa2: 136 against 99-117 at 64 x 64; paper: 108 against 87-102). On the GPU they pass the D = 128 cases of
#   tests/test_attention_gpu.py (results/attention_gpu_tests/h100-2026-12-07-d128).
LAUNCHES = {
    ("forward", True, 64): Launch(64, 128, 4, 3),
    ("forward", False, 64): Launch(64, 64, 4, 3),
    ("forward", True, 128): Launch(128, 128, 8, 2),
    ("forward", False, 128): Launch(64, 64, 4, 3),
    ("backward", True, 64): Launch(64, 64, 4, 3),
    ("backward", False, 64): Launch(64, 64, 4, 3),
    ("backward", True, 128): Launch(32, 128, 8, 2, dq_block_m=128, dq_block_n=32),
    ("backward", False, 128): Launch(32, 64, 4, 3),
}


# Launches at D = 128 whose FP32 operands would not fit LAUNCHES' tiles: an sm_90 block may have 227 KiB of shared
# memory, and Triton refuses a kernel that asks for more at launch (benchmarks/compile_check.py, which compiles for
# sm_90 on a CPU, found each; tests/test_attention_launch.py compiles them). Not timed: FP32 operands are the
# numerical baselines, not speed goals.
# * The forward whose P̄V GEMM takes FP32 operands exactly (p_bar "fp32", gemm "ieee": the fp32 preset), in blocks of
#   one tile, with BF16 inputs: 128 x 128 tiles stage FP32 P̄ and V in 257 KiB; 128 x 64 in 144 KiB, without spills.
FP32_PV_FORWARD_128 = Launch(128, 64, 8, 2)
# * FP32 inputs, every policy: 128 x 128 forward tiles take 256-352 KiB and the bf16x6 backward's 64 x 64 tiles
#   240 KiB; these take at most 184 KiB.
FP32_INPUTS_128 = {"forward": Launch(64, 64, 4, 2), "backward": Launch(32, 64, 4, 2)}


def _check_launch_value(name: str, value) -> None:
    """A one-line ValueError unless ``value`` may stand in :class:`Launch`'s field ``name``: a tile a power of two of
    at least :data:`MIN_TILE`, the warps a power of two, the stages at least 1 (``tl.arange`` and ``tl.dot`` take no
    other), ``dq_mode`` one of :data:`DQ_MODES`."""
    if name == "dq_mode":
        if value not in DQ_MODES:
            raise ValueError(f"dq_mode={value!r}: expected one of {', '.join(map(repr, DQ_MODES))}")
        return
    least = MIN_TILE if "block" in name else 1
    if isinstance(value, bool) or not isinstance(value, int) or value < least or (
            name != "num_stages" and value & (value - 1)):
        raise ValueError(f"{name}={value!r}: expected " + (f"a power of two >= {least}" if name != "num_stages"
                                                           else "an integer >= 1"))


def changed_launches(changes) -> dict:
    """:data:`LAUNCHES` with ``changes`` applied, each ``"PASS[@HEAD_DIM].FIELD=VALUE"``: PASS ``forward`` or
    ``backward``, HEAD_DIM 64 or 128 (none: both), FIELD one of :class:`Launch`'s, VALUE an integer or, for
    ``dq_mode``, a name; e.g. ``"backward.dq_mode=ordered"``, ``"forward@128.num_stages=3"``. Each applies to the
    pass's entries for blocks of one tile and of several. The D = 128 launches for FP32 inputs and the fp32 preset's
    forward (:data:`FP32_INPUTS_128`, :data:`FP32_PV_FORWARD_128`) stay as they are. For timing a candidate table
    against the committed one without editing it (:func:`launches_changed`); a malformed change is a one-line
    ValueError."""
    table = dict(LAUNCHES)
    names = [f.name for f in fields(Launch)]
    for change in changes:
        where, _, value = change.partition("=")
        pass_dim, _, field = where.partition(".")
        kernel, _, dim = pass_dim.partition("@")
        if (not value or kernel not in ("forward", "backward") or dim not in ("", "64", "128")
                or field not in names):
            raise ValueError(f"launch change {change!r}: expected PASS[@HEAD_DIM].FIELD=VALUE with PASS forward or "
                             f"backward, HEAD_DIM 64 or 128, FIELD one of {', '.join(names)}")
        if field != "dq_mode":
            try:
                value = int(value)
            except ValueError:
                raise ValueError(f"launch change {change!r}: expected an integer for {field}") from None
        _check_launch_value(field, value)
        for key, entry in table.items():
            if key[0] == kernel and (not dim or key[2] == int(dim)):
                table[key] = replace(entry, **{field: value})
    return table


@contextlib.contextmanager
def launches_changed(*changes: str):
    """:data:`LAUNCHES` changed by ``changes`` (:func:`changed_launches`) inside the ``with`` block, restored after
    it: ``with launches_changed("backward.dq_mode=ordered"): ...`` times the ordered dQ as the table's default
    wherever a launch takes the table's values (the autograd op, training, compiled or not)."""
    global LAUNCHES
    saved, LAUNCHES = LAUNCHES, changed_launches(changes)
    try:
        yield LAUNCHES
    finally:
        LAUNCHES = saved


def default_launch(kernel: str, policy: PrecisionPolicy, head_dim: int, *, fp32_inputs: bool = False,
                   **given: int | None) -> Launch:
    """:data:`LAUNCHES`' entry for ``kernel`` ("forward" or "backward") under ``policy`` at ``head_dim`` (16 and 32
    take D = 64's), with the caller's ``given`` choices (:class:`Launch`'s fields; None: the table's) in place of its
    own. A tile must be a power of two of at least :data:`MIN_TILE` and the warps a power of two (``tl.arange`` and
    ``tl.dot`` take no other), the stages at least 1: anything else is a one-line ValueError. At D = 128, FP32 inputs
    (``fp32_inputs``) take :data:`FP32_INPUTS_128` and the fp32 preset's forward :data:`FP32_PV_FORWARD_128` instead,
    whose shared memory fits an sm_90 block."""
    for name, value in given.items():
        if value is not None:
            _check_launch_value(name, value)
    one_tile = policy.block_k is not None and policy.block_k <= 128
    table = LAUNCHES[(kernel, one_tile, 64 if head_dim <= 64 else 128)]
    if head_dim > 64 and fp32_inputs:
        table = FP32_INPUTS_128[kernel]
    elif head_dim > 64 and (kernel, one_tile, policy.p_bar, policy.gemm) == ("forward", True, FP32, "ieee"):
        table = FP32_PV_FORWARD_128
    return replace(table, **{name: value for name, value in given.items() if value is not None})


def scale_folds(scale: float, policy: PrecisionPolicy) -> bool:
    """Whether the kernels may leave the scores unscaled and fold ``scale`` into exp's argument
    (:func:`_exp_scaled`): ``scale`` is a power of two (1/8 at D = 64, 1/4 at D = 16), so S·scale is exact for
    every score that stays normal, and the scores are rounded to nearest and not soft-capped (a stochastic rounding
    or the cap of the scaled scores is not a function of the unscaled ones)."""
    return (math.frexp(scale)[0] == 0.5 and -120 < math.frexp(scale)[1] < 120 and not policy.softcap
            and "scores" not in policy.stochastic)


def check_triton_support(head_dim: int, policy: PrecisionPolicy, scale, causal, heads_split: bool = False) -> None:
    """Clear errors for what the Triton kernels do not take, for inputs that :func:`lpfa.attention.check_inputs`
    has already accepted: no Triton, a non-causal call, an FP8 policy (reference only), FP32 heads inside one launch
    (``heads_split``: the caller splits them off, as :func:`lpfa.attention.kernels.triton_attention` does), an
    unsupported head dim, a bad scale."""
    if triton is None:
        raise ImportError("the Triton attention kernels need the `triton` package")
    if not causal:
        raise ValueError("the Triton attention kernels are causal only (is_causal=False is not supported)")
    if policy.fp8:
        raise ValueError(f"policy {policy.name!r} rounds {', '.join(sorted(policy.fp8))} to FP8 (PrecisionPolicy.fp8), "
                         "which only the PyTorch reference emulates: use backend='reference'")
    if policy.fp32_heads and not heads_split:
        raise ValueError(
            f"policy.fp32_heads = {sorted(policy.fp32_heads)}: a Triton kernel runs one policy for all heads; "
            "split the FP32 heads off in the caller and run them with the fp32 policy"
        )
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim {head_dim} is not supported here; supported: {HEAD_DIMS}")
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")


def check_triton_inputs(q, k, v, policy: PrecisionPolicy, scale, causal) -> None:
    """Every check of a direct call of the kernels' wrappers: :func:`lpfa.attention.check_inputs` on q, k, v, then
    :func:`check_triton_support`. :func:`lpfa.attention.attention` runs them once per call and launches the kernels
    with ``validate=False``."""
    lpfa_attention.check_inputs(q, k, v)
    check_triton_support(q.shape[-1], policy, scale, causal)
