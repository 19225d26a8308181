"""BF16 arithmetic made visible (paper Sec. 3.3.2).

Two tools:

* :func:`explain_add` adds two FP32 numbers exactly and rounds the sum to BF16 with
  round-to-nearest-even, recording every step the hardware takes: the sign/exponent/fraction
  fields, exponent alignment, the significand addition, a significand overflow and its right
  shift (or the left shift after cancellation), the guard, round and sticky bits, the rounding
  decision, the BF16 result and its error. The paper's example comes out exactly::

      >>> r = explain_add(-2.4071154594421387, -2.296875)
      >>> float(r.exact), r.result, float(r.error)
      (-4.703990459442139, -4.71875, -0.014759540557861328)

* :func:`accumulation_bias` measures, over many random rows, the mean signed error of a
  BF16-rounded sum ``sum_t p_bar[t] * v[t]`` when several terms enter with weight exactly 1
  (``p_bar == 1``, the tied row maxima of Sec. 3.3.1), with values that share a sign or not,
  against the same rows with every weight below 1 (what SFA produces, Sec. 4).

The rows of :func:`accumulation_bias`: scores relative to the row max, ``n`` keys tied at the max
(``p_bar = exp(s − row_max)`` exactly 1), the others ``gap + |N(0, score_std)|`` below it (a gap of 0
gives rows where many keys come close to the max, a large gap rows the tied keys dominate), keys in
random order. ``weights="below_one"`` multiplies the whole row by ``c ~ U(0.3, 0.95)``, as SFA does
(``m = β·row_max`` scales every ``p_bar`` by ``exp((1 − β)·row_max) < 1``): no weight is exactly 1.
Values are BF16: ``−|N(0,1)|`` ("negative"), ``+|N(0,1)|`` ("positive") or ``N(0,1)`` ("mixed").
``p_bar`` is rounded to BF16 before the product, as in FlashAttention-2 and the paper's code, so each
product is exact in FP32. "fp32" accumulation sums the products in FP32 in key order and rounds once
to BF16 (a tensor-core ``P̄V`` GEMM with a BF16 output); "bf16" rounds every partial sum (a BF16
accumulator). The error unit is the BF16 ulp of ``Σ_t |p_bar[t]·v[t]|`` (the ulp of the exact sum when
the values share a sign); unbiased rounding rounds half of the inexact results up in magnitude.

BF16 has FP32's 8 exponent bits and 7 stored fraction bits: a significand of 8 bits.
"""

from __future__ import annotations

import html
import math
import struct
from dataclasses import dataclass, field
from fractions import Fraction

import numpy as np
import pandas as pd
import torch

__all__ = [
    "FloatFields",
    "BF16Addition",
    "fp32_fields",
    "bf16_fields",
    "to_fp32",
    "explain_add",
    "bf16_add",
    "round_to_bf16",
    "accumulation_bias",
    "PAPER_OPERANDS",
    "binade",
]

EXP_BITS = 8
EXP_BIAS = 127
FP32_FRAC_BITS = 23
BF16_FRAC_BITS = 7
MIN_NORMAL_EXP = 1 - EXP_BIAS  # -126, shared by FP32 and BF16
BF16_MIN_LSB_EXP = MIN_NORMAL_EXP - BF16_FRAC_BITS  # -133: spacing of BF16 subnormals
OVERFLOW_EXP = EXP_BIAS + 1  # magnitudes >= 2**128 are not finite in FP32/BF16


# --------------------------------------------------------------------------------------------
# Fields of a floating-point value
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class FloatFields:
    """Sign, biased exponent and fraction of an FP32 or BF16 value (IEEE 754 layout)."""

    value: float
    fmt: str  # "FP32" or "BF16"
    sign: int
    exponent_bits: int
    fraction_bits: int

    @property
    def frac_width(self) -> int:
        return FP32_FRAC_BITS if self.fmt == "FP32" else BF16_FRAC_BITS

    @property
    def is_finite(self) -> bool:
        return self.exponent_bits != (1 << EXP_BITS) - 1

    @property
    def is_subnormal(self) -> bool:
        return self.exponent_bits == 0 and self.fraction_bits != 0

    @property
    def exponent(self) -> int:
        """Unbiased exponent E with value = ±significand · 2**E (E = −126 for subnormals)."""
        return MIN_NORMAL_EXP if self.exponent_bits == 0 else self.exponent_bits - EXP_BIAS

    @property
    def significand(self) -> int:
        """Significand as an integer with the hidden bit: value = ±significand · 2**(E − frac_width)."""
        hidden = 0 if self.exponent_bits == 0 else 1
        return (hidden << self.frac_width) | self.fraction_bits

    @property
    def bits(self) -> str:
        """The bit pattern as ``s eeeeeeee ffff…``."""
        return f"{self.sign} {self.exponent_bits:08b} {self.fraction_bits:0{self.frac_width}b}"

    @property
    def hex(self) -> str:
        width = 8 if self.fmt == "FP32" else 4
        word = ((self.sign << (EXP_BITS + self.frac_width)) | (self.exponent_bits << self.frac_width)
                | self.fraction_bits)
        return f"0x{word:0{width}X}"

    def describe(self) -> str:
        if not self.is_finite:
            kind = "NaN" if self.fraction_bits else "infinity"
            return f"{self.fmt} {self.bits}  {kind}"
        if self.exponent_bits == 0 and self.fraction_bits == 0:
            return f"{self.fmt} {self.bits}  {'−' if self.sign else '+'}zero"
        lead = "0" if self.is_subnormal else "1"
        kind = "subnormal, " if self.is_subnormal else ""
        exp = (
            f"exponent field 0 → E = {MIN_NORMAL_EXP}"
            if self.exponent_bits == 0
            else f"exponent {self.exponent_bits} − {EXP_BIAS} = {self.exponent}"
        )
        frac = f"{self.fraction_bits:0{self.frac_width}b}"
        return (
            f"{self.fmt} {self.bits}  sign {'−' if self.sign else '+'}, {kind}{exp}, "
            f"significand {lead}.{frac}"
        )


def to_fp32(x: float) -> float:
    """Round a Python float to the nearest FP32 value (overflow gives ±inf)."""
    with np.errstate(over="ignore"):
        return float(np.float32(x))


def _fp32_word(x: float) -> int:
    return struct.unpack("<I", struct.pack("<f", np.float32(x)))[0]


def fp32_fields(x: float) -> FloatFields:
    """Fields of ``x`` rounded to FP32."""
    w = _fp32_word(x)
    return FloatFields(to_fp32(x), "FP32", w >> 31, (w >> 23) & 0xFF, w & 0x7FFFFF)


def bf16_fields(x: float) -> FloatFields:
    """Fields of a BF16-representable value ``x`` (raises if ``x`` is not one)."""
    w = _fp32_word(x)
    if (w & 0xFFFF) and not math.isnan(x):
        raise ValueError(f"{x!r} is not representable in BF16: its FP32 pattern {w:#010x} has low bits set")
    return FloatFields(to_fp32(x), "BF16", w >> 31, (w >> 23) & 0xFF, (w >> 16) & 0x7F)


def _bf16_from_parts(sign: int, kept: int, lsb_exp: int) -> float:
    """The BF16 value ±kept · 2**lsb_exp (kept < 2**8 after rounding-carry renormalisation)."""
    return (-1.0 if sign else 1.0) * math.ldexp(kept, lsb_exp)


def _bin_point(sig: int, lead_bits: int, total_frac: int) -> str:
    """Write integer ``sig`` scaled by 2**-total_frac as binary with ``lead_bits`` integer digits."""
    s = f"{sig:0{lead_bits + total_frac}b}"
    return s[:-total_frac] + "." + s[-total_frac:] if total_frac > 0 else s


def _strip_lead(s: str) -> str:
    """Drop leading zeros of a binary string but keep one digit before the point."""
    t = s.lstrip("0")
    return "0" + t if t.startswith(".") or not t else t


# --------------------------------------------------------------------------------------------
# The explainer
# --------------------------------------------------------------------------------------------
@dataclass(frozen=True, repr=False)
class BF16Addition:
    """Every step of ``bf16(a + b)`` for FP32 inputs ``a`` and ``b`` (see :func:`explain_add`): ``guard``,
    ``round_bit`` and ``sticky`` are the first dropped bit, the second, and the OR of all further dropped bits;
    ``rounded_up`` tells whether the magnitude was incremented; ``error`` is ``result − exact`` as an exact fraction
    (None when the result is not finite)."""

    a: FloatFields
    b: FloatFields
    exact: Fraction | None
    result: float
    result_fields: FloatFields
    error: Fraction | None
    alignment_shift: int = 0
    normalisation_shift: int = 0  # +1: significand overflow, shifted right; −k: left shift by k
    guard: int = 0
    round_bit: int = 0
    sticky: int = 0
    rounded_up: bool = False
    overflow: bool = False
    subnormal_result: bool = False
    steps: tuple[tuple[str, str], ...] = field(default=(), repr=False)

    @property
    def ulp(self) -> float | None:
        """Spacing of BF16 numbers at the exact sum (None for non-finite or zero sums)."""
        return _ulp_at(self.exact)

    @property
    def error_ulps(self) -> float | None:
        """Signed error in units of the BF16 ulp at the exact sum."""
        ulp = self.ulp
        return None if ulp is None or self.error is None else float(self.error / Fraction(ulp))

    def report(self) -> str:
        """A plain-text, step-by-step account, one section per step."""
        lines = []
        for i, (title, body) in enumerate(self.steps, 1):
            lines.append(f"{i}. {title}")
            lines.extend("   " + ln for ln in body.splitlines())
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.report()

    def __repr__(self) -> str:
        err = "n/a" if self.error is None else repr(float(self.error))
        return f"BF16Addition({self.a.value!r} + {self.b.value!r} → {self.result!r}, error {err})"

    def _repr_html_(self) -> str:
        return f"<pre style='line-height:1.25'>{html.escape(self.report())}</pre>"


def _ulp_at(x: Fraction | None) -> float | None:
    """Spacing of BF16 numbers at the real ``x`` (None for None, zero, or beyond the finite range)."""
    if x is None or x == 0:
        return None
    e = _floor_log2(abs(x))
    return None if e >= OVERFLOW_EXP else math.ldexp(1.0, max(e - BF16_FRAC_BITS, BF16_MIN_LSB_EXP))


def _floor_log2(x: Fraction) -> int:
    """floor(log2(x)) for a positive fraction, exactly."""
    e = x.numerator.bit_length() - x.denominator.bit_length()
    # now 2**(e-1) < x < 2**(e+1); fix up
    if x < Fraction(2) ** e:
        e -= 1
    return e


def explain_add(a: float, b: float) -> BF16Addition:
    """Add two FP32 numbers exactly and round the sum to BF16 (Sec. 3.3.2), recording each step. The inputs are first
    rounded to FP32 (a step says so if that changed them); the result is the correctly rounded BF16 value of the exact
    sum (round to nearest, ties to even), what a single BF16-rounded addition produces. Handles signed zeros,
    subnormals, cancellation, overflow to infinity, inf and NaN."""
    steps: list[tuple[str, str]] = []
    fa, fb = fp32_fields(a), fp32_fields(b)
    note = []
    for name, raw, f in (("a", a, fa), ("b", b, fb)):
        if not (math.isnan(raw) and math.isnan(f.value)) and raw != f.value:
            note.append(f"{name} = {raw!r} is not an FP32 number; it was rounded to {f.value!r}.")
    steps.append(
        (
            "Operands as FP32 fields (sign | exponent | fraction)",
            "\n".join(
                [f"a = {fa.value!r}", f"    {fa.describe()}", f"b = {fb.value!r}", f"    {fb.describe()}", *note]
            ),
        )
    )

    def finish(result: float, exact: Fraction | None, **kw) -> BF16Addition:
        rf = bf16_fields(result) if not math.isnan(result) else FloatFields(result, "BF16", 0, 0xFF, 0x40)
        err = None if exact is None or not math.isfinite(result) else Fraction(result) - exact
        return BF16Addition(fa, fb, exact, result, rf, err, steps=tuple(steps), **kw)

    # ---- special operands -------------------------------------------------------------------
    if not (fa.is_finite and fb.is_finite):
        if math.isnan(fa.value) or math.isnan(fb.value):
            res, why = math.nan, "an operand is NaN, so the sum is NaN"
        elif math.isinf(fa.value) and math.isinf(fb.value) and fa.sign != fb.sign:
            res, why = math.nan, "(+inf) + (−inf) is undefined: NaN"
        else:
            res = fa.value if math.isinf(fa.value) else fb.value
            why = f"an infinite operand dominates: the sum is {res}"
        steps.append(("Special values", why))
        return finish(res, None)

    exact = Fraction(fa.value) + Fraction(fb.value)
    if fa.value == 0 and fb.value == 0:
        sign = fa.sign & fb.sign  # IEEE 754: (−0) + (−0) = −0, otherwise +0 under round-to-nearest
        res = -0.0 if sign else 0.0
        steps.append(("Zeros", f"both operands are zero; the sum is {'−' if sign else '+'}0"))
        return finish(res, exact)

    # ---- 2. alignment: bring the smaller-magnitude operand to the larger one's exponent --------
    big, small, big_name, small_name = (fa, fb, "a", "b") if abs(fa.value) >= abs(fb.value) else (fb, fa, "b", "a")
    shift = big.exponent - small.exponent
    F = FP32_FRAC_BITS
    m_big, m_small = big.significand << shift, small.significand  # common scale 2**(small.E − 23)
    frac_total = F + shift  # binary digits after the point at the big operand's exponent
    lead_big = _bin_point(m_big, 1, frac_total)
    lead_small = _bin_point(m_small, 1, frac_total)
    if shift == 0:
        align = f"Both exponents are {big.exponent}: no shift is needed."
    else:
        align = (
            f"{small_name} has the smaller exponent ({small.exponent} < {big.exponent}): its significand "
            f"moves right by {shift} bit{'s' if shift != 1 else ''}, kept exactly (no bits are lost yet)."
        )
    steps.append(
        (
            "Align exponents",
            f"{align}\n{big_name}: {lead_big} × 2^{big.exponent}\n{small_name}: {lead_small} × 2^{big.exponent}",
        )
    )

    # ---- 3. add or subtract the significands -----------------------------------------------
    same = big.sign == small.sign
    r = m_big + m_small if same else m_big - m_small
    sign = big.sign
    op = "+" if same else "−"
    width = max(len(lead_big), len(_bin_point(r, 2, frac_total))) + 2
    body = (
        f"{'signs agree: magnitudes add' if same else 'signs differ: the smaller magnitude is subtracted'};"
        f" the result takes {big_name}'s sign ({'−' if sign else '+'})\n"
        f"{lead_big.rjust(width)}\n{op} {lead_small.rjust(width - 2)}\n"
        f"= {_strip_lead(_bin_point(r, 2, frac_total)).rjust(width - 2)}"
    )
    steps.append(("Add the significands", body))
    if r == 0:
        steps.append(("Exact cancellation", "the operands cancel exactly; round-to-nearest gives +0"))
        return finish(0.0, exact)

    # ---- 4. normalise -------------------------------------------------------------------------
    base_exp = small.exponent - F  # value of r's last bit is 2**base_exp
    e = base_exp + r.bit_length() - 1  # exponent of the leading bit
    norm_shift = e - big.exponent
    if norm_shift > 0:
        norm = (
            f"significand overflow: the sum is ≥ 2, so it shifts right by 1 and the exponent goes "
            f"{big.exponent} → {e}. The bit shifted out stays in the exact sum for now."
        )
    elif norm_shift < 0:
        why = "cancellation" if not same else "subnormal operands"
        norm = (f"{why}: the leading 1 lies {-norm_shift} place(s) right of the point; shift left by {-norm_shift}, "
                f"exponent {big.exponent} → {e}")
    else:
        norm = "the sum is already in [1, 2): no shift"
    sub = e < MIN_NORMAL_EXP
    lsb = max(e - BF16_FRAC_BITS, BF16_MIN_LSB_EXP)  # exponent of the last kept BF16 bit
    frac_digits = e - base_exp
    norm += f"\nexact sum = {'−' if sign else '+'}{_bin_point(r, 1, frac_digits)} × 2^{e} = {float(exact)!r}"
    if sub:
        norm += (
            f"\n{e} < {MIN_NORMAL_EXP}: the result is subnormal in BF16 (exponent field 0, E = {MIN_NORMAL_EXP}); "
            f"bits are kept down to 2^{BF16_MIN_LSB_EXP}, so fewer than 8 are significant"
        )
    steps.append(("Normalise", norm))

    # ---- 5. round to BF16: keep the bits down to 2**lsb, RNE on guard/round/sticky -------------
    k = lsb - base_exp  # number of bits to drop
    if k <= 0:
        kept, g, rb, st = r << (-k), 0, 0, 0
        decision = "no bits beyond BF16's precision: the sum is exact in BF16"
        up = False
    else:
        kept, rem = r >> k, r & ((1 << k) - 1)
        g = (rem >> (k - 1)) & 1
        rb = (rem >> (k - 2)) & 1 if k >= 2 else 0
        st = int(rem & ((1 << max(k - 2, 0)) - 1) != 0) if k >= 3 else 0
        up = bool(g and (rb or st or (kept & 1)))
        shown = f"{kept:b}"
        kept_str = f"0.{kept:0{BF16_FRAC_BITS}b} × 2^{MIN_NORMAL_EXP}" if sub else shown[0] + "." + shown[1:]
        rest = f"{rem:0{k}b}"
        tail = rest[2:] if k > 2 else ""
        if not g:
            decision = "guard bit 0: below halfway → round down (truncate)"
        elif rb or st:
            decision = "guard 1 and round/sticky not both 0: above halfway → round up (magnitude grows)"
        elif kept & 1:
            decision = ("exactly halfway (guard 1, round 0, sticky 0) and the kept last bit is odd → ties-to-even "
                        "rounds up")
        else:
            decision = ("exactly halfway (guard 1, round 0, sticky 0) and the kept last bit is even → ties-to-even "
                        "rounds down")
        decision = (
            f"kept {kept_str} | guard {g} | round {rb} | sticky {st} (OR of {len(tail)} more bits: {tail or '—'})\n"
            f"{decision}"
        )
    if up:
        kept += 1
    steps.append(("Round to BF16 (8 significant bits, round to nearest, ties to even)", decision))

    # ---- 6. result -----------------------------------------------------------------------------
    overflow = False
    if kept == 0:
        result = -0.0 if sign else 0.0
    elif kept.bit_length() + lsb - 1 >= OVERFLOW_EXP:
        overflow = True
        result = -math.inf if sign else math.inf
    else:
        result = _bf16_from_parts(sign, kept, lsb)
    err = None if overflow else Fraction(result) - exact
    if overflow:
        res_text = f"the rounded magnitude reaches 2^{OVERFLOW_EXP}: overflow to {result}"
    else:
        ulp = _ulp_at(exact)
        ulps = f" ({float(err / Fraction(ulp)):+.4f} ulp)" if ulp else ""
        rf = bf16_fields(result)
        res_text = (
            f"BF16 {rf.bits} ({rf.hex}) = {result!r}\n"
            f"exact {float(exact)!r}; error = result − exact = {float(err)!r}{ulps}"
        )
        if up and kept == 1 << (BF16_FRAC_BITS + 1):
            res_text += "\nrounding carried out of the significand: the exponent grew by one"
    steps.append(("Result", res_text))
    return BF16Addition(
        fa, fb, exact, result, bf16_fields(result), err,
        alignment_shift=shift, normalisation_shift=norm_shift, guard=g, round_bit=rb, sticky=st,
        rounded_up=up, overflow=overflow, subnormal_result=sub, steps=tuple(steps),
    )


def every_bf16() -> torch.Tensor:
    """Every BF16 value except the NaNs, ascending, as FP32 (−inf first, +inf last, −0 and +0 side by side): for a
    property that must hold on all 2¹⁶ bit patterns, such as the order of the soft-cap's tanh on the BF16 scores
    (:func:`lpfa.attention.triton_fwd.raw_row_max`)."""
    x = torch.arange(-2**15, 2**15, dtype=torch.int32).to(torch.int16).view(torch.bfloat16).float()
    return x[~torch.isnan(x)].sort().values


def round_to_bf16(x: float) -> float:
    """The BF16 value nearest to the double ``x`` (ties to even; ±inf beyond the finite range). Exact:
    scaling by powers of two and Python's round-half-even on a double introduce no error."""
    if x == 0 or not math.isfinite(x):
        return x
    m, e = math.frexp(x)  # x = m·2^e, 0.5 <= |m| < 1
    lsb = max(e - 1 - BF16_FRAC_BITS, BF16_MIN_LSB_EXP)  # exponent of the last kept bit
    q = round(math.ldexp(x, -lsb))  # exact scaling, then round half to even
    if abs(q).bit_length() + lsb - 1 >= OVERFLOW_EXP:  # the rounded magnitude reaches 2^128
        return math.copysign(math.inf, x)
    return math.ldexp(q, lsb) if q else math.copysign(0.0, x)


PAPER_OPERANDS = (-2.4071154594421387, -2.296875)  # the paper's example addition (Sec. 3.3.2)


def binade(x: float) -> str:
    """The binade that ``|x|`` lies in, as FP32 stores ``x``: ``"[2, 4)"``, ``"[2^-20, 2^-19)"``, or
    ``"[0, 2^-126) (subnormal)"``; ``"zero"``, ``"infinite"`` or ``"NaN"`` for those."""
    f = fp32_fields(x)
    if not f.is_finite:
        return "NaN" if f.fraction_bits else "infinite"
    if f.value == 0:
        return "zero"
    if f.is_subnormal:
        return f"[0, 2^{MIN_NORMAL_EXP}) (subnormal)"
    e = f.exponent
    if -4 <= e <= 10:
        return f"[{math.ldexp(1.0, e):g}, {math.ldexp(1.0, e + 1):g})"
    return f"[2^{e}, 2^{e + 1})"


def bf16_add(a: float, b: float) -> float:
    """``bf16(a + b)`` for FP32 ``a``, ``b``, rounded once from the exact sum (RNE)."""
    return explain_add(a, b).result


# --------------------------------------------------------------------------------------------
# The measured statistic: bias of BF16-rounded accumulation with p_bar == 1 terms
# --------------------------------------------------------------------------------------------
def _bf16(x):
    """Round an FP32 torch tensor to BF16 (RNE) and back to FP32."""
    return x.to(torch.bfloat16).to(torch.float32)


def accumulation_bias(
    *,
    n_keys: int = 64,
    n_ones: tuple[int, ...] = (0, 1, 2, 4, 8),
    gaps: tuple[float, ...] = (0.0, 12.0),
    value_signs: tuple[str, ...] = ("negative", "mixed"),
    weights: tuple[str, ...] = ("one", "below_one"),
    accumulate: tuple[str, ...] = ("fp32", "bf16"),
    score_std: float = 2.0,
    trials: int = 20_000,
    seed: int = 0,
):
    """Mean signed error of a BF16-rounded row sum ``o_bar = Σ_t p_bar[t]·v[t]`` (Sec. 3.3), over ``trials`` random
    rows of ``n_keys`` keys per condition: ``n`` of ``n_ones`` keys tied at the row max (``p_bar = 1``), the others
    ``gap`` of ``gaps`` plus ``|N(0, score_std)|`` below it; ``weights`` "one" or SFA-like "below_one"; values of
    ``value_signs``; ``accumulate`` "fp32" (one rounding, a GEMM) or "bf16" (every partial sum rounded), against the
    float64 sum (the module docstring gives the model). Returns a DataFrame, one row per condition: the mean error,
    its standard error (in BF16 ulps of ``Σ_t |p_bar[t]·v[t]|``) and the share of inexact results rounded up."""
    bad = [s for s in value_signs if s not in ("negative", "positive", "mixed")]
    bad += [w for w in weights if w not in ("one", "below_one")]
    bad += [a for a in accumulate if a not in ("fp32", "bf16")]
    if bad:
        raise ValueError(
            f"unknown option(s) {bad}: value_signs take 'negative'/'positive'/'mixed', "
            "weights 'one'/'below_one', accumulate 'fp32'/'bf16'"
        )
    if any(not 0 <= n <= n_keys for n in n_ones):
        raise ValueError(f"n_ones {n_ones} must lie in [0, n_keys={n_keys}]")
    if trials < 2 or n_keys < 1:
        raise ValueError(f"need trials >= 2 and n_keys >= 1, got trials={trials}, n_keys={n_keys}")
    if any(not (math.isfinite(g) and g >= 0) for g in gaps) or not score_std >= 0:
        raise ValueError(f"gaps {gaps} and score_std {score_std} must be finite and >= 0")

    gen = torch.Generator().manual_seed(seed)
    rows = []
    for gap0 in gaps:
        for n in n_ones:
            gap = gap0 + torch.randn(trials, n_keys, generator=gen, dtype=torch.float64).abs() * score_std
            gap = gap.clamp_min(1e-3)  # strictly below the max, so p_bar < 1 off the ties
            gap[:, :n] = 0.0
            perm = torch.argsort(torch.rand(trials, n_keys, generator=gen), dim=1)
            p_row = torch.exp(-torch.gather(gap, 1, perm)).to(torch.float32)  # exactly 1 at the ties
            scale = (0.3 + 0.65 * torch.rand(trials, 1, generator=gen)).to(torch.float32)
            z = torch.randn(trials, n_keys, generator=gen)
            for w in weights:
                p = _bf16(p_row * scale if w == "below_one" else p_row)
                for vs in value_signs:
                    v = _bf16(-z.abs() if vs == "negative" else z.abs() if vs == "positive" else z)
                    prod = p * v  # exact in FP32: 8-bit × 8-bit significands
                    exact = prod.double().sum(dim=1)
                    size = prod.double().abs().sum(dim=1)
                    ulp = torch.exp2(torch.clamp(torch.floor(torch.log2(size)) - BF16_FRAC_BITS, min=BF16_MIN_LSB_EXP))
                    for acc in accumulate:
                        s = torch.zeros(trials, dtype=torch.float32)
                        for t in range(n_keys):
                            s = s + prod[:, t]
                            if acc == "bf16":
                                s = _bf16(s)
                        out = _bf16(s).double()
                        err_ulp = (out - exact) / ulp
                        changed = out != exact
                        grew = (out.abs() > exact.abs()) & changed
                        rows.append(
                            {
                                "gap": gap0,
                                "n_ones": n,
                                "weights": w,
                                "values": vs,
                                "accumulate": acc,
                                "mean_err_ulp": err_ulp.mean().item(),
                                "sem_err_ulp": (err_ulp.std() / math.sqrt(trials)).item(),
                                "frac_magnitude_up": (grew.sum() / changed.sum().clamp_min(1)).item(),
                                "frac_exact": 1.0 - changed.double().mean().item(),
                                "trials": trials,
                            }
                        )
    return pd.DataFrame(rows)

