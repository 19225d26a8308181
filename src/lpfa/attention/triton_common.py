"""Shared pieces of the Triton kernels: interpreter-safe BF16 rounding and precise exp/log.

Every value lives in an FP32 register; a BF16 rounding point is :func:`_round_bf16` (round to nearest
even by integer arithmetic on the FP32 bit pattern), which is exact under Triton's CPU interpreter,
where BF16 casts and BF16 ``tl.dot`` are not faithful.

Causal split (as in Triton's fused-attention tutorial and FlashAttention-2): a tile whose every (row, key)
pair is visible (key <= query, key < T, inside its policy block) needs no mask. The kernels run such tiles
through the same helpers with ``visible = None`` / ``ok = None`` (:func:`_load_tile`, :func:`_keep_visible`,
:func:`_dot_visible`), which then compile to plain loads and no ``tl.where``; only the tiles touching the
diagonal or the end of the sequence or of a policy block build masks. The mask is all-true on the other tiles,
so the results are bit-identical either way (``causal_split=False`` at launch masks every tile, for comparison).
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from lpfa.attention.policy import PrecisionPolicy

try:  # Triton is optional for the package as a whole
    import triton
    import triton.language as tl

    try:
        from triton.language.extra import libdevice
    except Exception:  # pragma: no cover - depends on the Triton build
        libdevice = None
except ImportError:  # pragma: no cover
    triton = None
    tl = None
    libdevice = None

HEAD_DIMS = (16, 32, 64, 128)
MAX_TILE = 1024  # largest BLOCK_M / BLOCK_N tile (and untiled sequence length) the kernel accepts
MIN_TILE = 16  # tl.dot needs every dimension >= 16


def _interpreter() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


if triton is not None:
    # BF16 rounding by the hardware conversion (GPU) or by integer arithmetic (interpreter), fixed at import as the
    # kernels' mode is (triton.jit reads TRITON_INTERPRET when the module is imported)
    _HW_ROUND = tl.constexpr(not _interpreter())

    @triton.jit
    def _round_bf16(x):
        """Round FP32 values to the nearest BF16 (ties to even), returned as FP32; ±inf unchanged, NaN stays NaN.

        On a GPU this is one hardware conversion there and back (``cvt.rn.bf16.f32``: round to nearest even,
        subnormals kept; a NaN comes back as the canonical NaN). The interpreter's float → bf16 cast truncates, so
        there the rounding is done on the FP32 bit pattern instead, with the same result for every non-NaN value."""
        if _HW_ROUND:
            return x.to(tl.bfloat16, fp_downcast_rounding="rtne").to(tl.float32)
        bits = x.to(tl.uint32, bitcast=True)
        # bits + 0x7FFF + lsb(bits >> 16), then clear the low 16 bits: round half to even
        lsb = (bits >> 16) & 1
        rounded = ((bits + 0x7FFF + lsb) >> 16) << 16
        y = rounded.to(tl.float32, bitcast=True)
        # exponent all ones = inf or nan: leave as is (the carry would corrupt a nan payload)
        finite = (bits & 0x7F800000) != 0x7F800000
        return tl.where(finite, y, x)

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
        """rowmax over axis 1, NaN-propagating (a NaN score makes the row's max NaN, as torch.amax does)."""
        return tl.reduce(x, 1, _max_nan)

    @triton.jit
    def _dot(a, b, AS_BF16: tl.constexpr):
        """a @ b with FP32 accumulation; BF16 tensor-core operands when AS_BF16 (exact values only), else IEEE FP32."""
        if AS_BF16:
            return tl.dot(a.to(tl.bfloat16), b.to(tl.bfloat16), out_dtype=tl.float32)
        else:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee", out_dtype=tl.float32)

    @triton.jit
    def _dot_visible(a, b, visible, b_nonfinite, AS_BF16: tl.constexpr):
        """a @ b summed over visible pairs only (:func:`lpfa.attention.reference._mm_visible`): ``a`` (M, K) is 0
        where ``visible`` (M, K) is False (``None``: every pair is visible, an unmasked tile), ``b`` (K, N) may
        hold inf/NaN when the runtime flag ``b_nonfinite`` is set (one flag per batch·head, from the wrapper). A
        non-finite b[k, n] then makes out[m, n] NaN exactly where (m, k) is visible: b's finite part goes through
        the GEMM, and a second GEMM of 0/1 indicators (exact counts) finds where a non-finite entry is reached
        (with every pair visible: every row, so a column test does). Without the flag this is one plain GEMM."""
        if b_nonfinite != 0:
            bad = (b != b) | (b == float("inf")) | (b == float("-inf"))
            out = _dot(a, tl.where(bad, 0.0, b), AS_BF16)
            if visible is None:  # reach[m, n] = any_k bad[k, n], the same for every row m
                reach = tl.max(bad.to(tl.int32), axis=0)[None, :]
            else:  # reach[m, n] = #{k: visible[m, k] and bad[k, n]}
                reach = _dot(visible.to(tl.float32), bad.to(tl.float32), AS_BF16)
            out = tl.where(reach > 0, float("nan"), out)
        else:
            out = _dot(a, b, AS_BF16)
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

    @triton.jit
    def _log(x, PRECISE_MATH: tl.constexpr):
        if PRECISE_MATH:
            return libdevice.log(x)
        else:
            return tl.log(x)



def nonfinite_flags(x):
    """(B·H,) int32: 1 where the (batch, head) slice of ``x`` (B, H, T, D) holds an inf or NaN (for :func:`_dot_visible`)."""
    return (~torch.isfinite(x)).flatten(2).any(dim=-1).flatten().to(torch.int32)


def _next_pow2(n: int) -> int:
    return 1 << (max(int(n), 1) - 1).bit_length()


def policy_tiles(block: int | None, T: int, name: str, preferred: int) -> tuple[int, int, int]:
    """Split a policy block into compute tiles: ``(block size, tile, tiles per block)``.

    The policy block (``None`` = the whole sequence) fixes where the algorithm rounds; the tile is what
    one ``tl.dot`` handles. A block that is a multiple of ``preferred`` is cut into ``preferred``-sized
    tiles; any other block is one tile of the next power of two (masked at the block's edge).
    """
    size = T if block is None else int(block)
    if size % preferred == 0:
        return size, preferred, size // preferred
    tile = max(_next_pow2(size), MIN_TILE)
    if tile > MAX_TILE:
        what = "None (one block over the sequence)" if block is None else str(block)
        raise ValueError(
            f"policy.{name}={what} at T={T} needs a tile of {tile} keys or queries: expected blocks that are "
            f"multiples of {preferred} or at most {MAX_TILE} long (the Triton kernels' limit; backend='reference' has none)"
        )
    return size, tile, 1


def check_triton_inputs(q, k, v, policy: PrecisionPolicy, scale, causal) -> None:
    """Clear errors for what the Triton kernels do not take (besides :func:`lpfa.attention.check_inputs`)."""
    from lpfa.attention import check_inputs

    if triton is None:
        raise ImportError("the Triton attention kernels need the `triton` package")
    if not causal:
        raise ValueError("the Triton attention kernels are causal only (is_causal=False is not supported)")
    if policy.fp32_heads:
        raise ValueError(
            f"policy.fp32_heads = {sorted(policy.fp32_heads)}: a Triton kernel runs one policy for all heads; "
            "split the FP32 heads off in the caller and run them with the fp32 policy"
        )
    check_inputs(q, k, v, head_dims=HEAD_DIMS)
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
