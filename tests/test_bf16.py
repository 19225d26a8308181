"""lpfa.bf16: exact bits of the explainer against an independent exact reference, and the bias statistic."""

import math
import random
import struct
from fractions import Fraction

import numpy as np
import pytest
import torch

from lpfa.bf16 import PAPER_OPERANDS, accumulation_bias, bf16_fields, binade, every_bf16, explain_add, fp32_fields
from lpfa.pages.bf16_rounding import operands_text


# ---- an independent reference: round an exact rational to BF16 by brute definition ------------
def ref_round_bf16(x: Fraction) -> float:
    """Nearest BF16 value to x (ties to even), ±inf beyond the largest finite BF16 + half an ulp."""
    if x == 0:
        return 0.0
    sign = -1 if x < 0 else 1
    m = abs(x)
    e = math.floor(math.log2(m.numerator) - math.log2(m.denominator))
    while Fraction(2) ** e > m:
        e -= 1
    while Fraction(2) ** (e + 1) <= m:
        e += 1
    ulp = Fraction(2) ** max(e - 7, -133)
    q, r = divmod(m, ulp)
    q = int(q)
    if r > ulp / 2 or (r == ulp / 2 and q % 2 == 1):
        q += 1
    val = q * ulp
    if val >= Fraction(2) ** 128:
        return sign * math.inf
    return sign * float(val)


def f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def random_fp32(rng: random.Random, exp_lo=-140, exp_hi=127) -> float:
    """A random finite FP32 number with a random exponent in [exp_lo, exp_hi] (subnormals included)."""
    e = rng.randint(exp_lo, exp_hi)
    biased = max(e + 127, 0)
    bits = (rng.getrandbits(1) << 31) | (biased << 23) | rng.getrandbits(23)
    return f32(bits)


# ---- the paper's example ---------------------------------------------------------------------
def test_paper_example_exact():
    r = explain_add(-2.4071154594421387, -2.296875)
    assert r.exact == Fraction(-2.4071154594421387) + Fraction(-2.296875)
    assert float(r.exact) == -4.703990459442139
    assert r.result == -4.71875
    assert float(r.error) == -0.014759540557861328
    assert r.error == Fraction(-4.71875) - r.exact  # error is exact, not a float difference
    # the bit-level story of Sec. 3.3.2
    assert r.a.bits == "1 10000000 00110100000111000101110"
    assert r.b.bits == "1 10000000 00100110000000000000000"
    assert r.alignment_shift == 0 and r.normalisation_shift == 1  # significand overflow, right shift
    assert (r.guard, r.round_bit, r.sticky, r.rounded_up) == (1, 0, 1, True)
    assert r.result_fields.bits == "1 10000001 0010111" and r.result_fields.hex == "0xC097"
    text = r.report()
    for phrase in ("significand overflow", "guard 1 | round 0 | sticky 1", "-4.71875", "-0.014759540557861328"):
        assert phrase in text


# ---- edge cases --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "a, b, expected, up",
    [
        (1.0, 2.0**-8, 1.0, False),  # exact tie, kept LSB even -> down
        (1.0 + 2.0**-7, 2.0**-8, 1.0 + 2.0**-6, True),  # exact tie, kept LSB odd -> up
        (1.0, 2.0**-8 + 2.0**-30, 1.0 + 2.0**-7, True),  # just above the tie -> up
        (-2.3125, -2.296875, -4.625, True),  # two BF16 values: overflow makes a tie, odd -> up
        (-2.3125, -2.265625, -4.5625, False),  # tie, even -> down
    ],
)
def test_ties_to_even(a, b, expected, up):
    r = explain_add(a, b)
    assert r.result == expected and r.rounded_up == up
    assert r.result == ref_round_bf16(Fraction(a) + Fraction(b))


def test_sign_change_and_cancellation():
    r = explain_add(1.0, -3.0)
    assert r.result == -2.0 and r.result_fields.sign == 1
    r = explain_add(1.0, -0.99999994)  # catastrophic cancellation: exact 2**-24
    assert r.result == 2.0**-24 and r.normalisation_shift == -24 and r.error == 0
    r = explain_add(1.5, -1.5)
    assert r.result == 0.0 and math.copysign(1, r.result) == 1.0  # RNE: x + (-x) = +0
    assert math.copysign(1, explain_add(-0.0, -0.0).result) == -1.0
    assert math.copysign(1, explain_add(0.0, -0.0).result) == 1.0


def test_subnormals():
    tiny = 2.0**-133  # smallest BF16 subnormal
    assert explain_add(tiny, tiny).result == 2.0**-132
    r = explain_add(2.0**-130, 3 * 2.0**-140)
    assert r.subnormal_result and r.result == ref_round_bf16(Fraction(2.0**-130) + Fraction(3 * 2.0**-140))
    assert r.result_fields.exponent_bits == 0
    # half the smallest subnormal is a tie with 0 (even) -> 0; just above it rounds up to 2**-133
    assert explain_add(2.0**-134, 0.0).result == 0.0
    assert explain_add(2.0**-134, 2.0**-149).result == 2.0**-133


def test_overflow_to_inf():
    r = explain_add(3.3e38, 3.3e38)
    assert r.overflow and r.result == math.inf and r.error is None
    fp32_max = f32(0x7F7FFFFF)
    assert explain_add(fp32_max, 0.0).result == math.inf  # above BF16 max + half ulp
    assert explain_add(-fp32_max, -0.0).result == -math.inf
    bf16_max = f32(0x7F7F0000)
    assert explain_add(bf16_max, 0.0).result == bf16_max  # the largest finite BF16 stays finite


def test_special_operands():
    assert math.isnan(explain_add(math.inf, -math.inf).result)
    assert math.isnan(explain_add(math.nan, 1.0).result)
    assert explain_add(-math.inf, 5.0).result == -math.inf


def test_non_fp32_input_is_rounded_and_said():
    r = explain_add(0.1, 0.2)
    assert r.a.value == float(np.float32(0.1))
    assert "is not an FP32 number" in r.report()


def test_random_pairs_match_exact_reference():
    rng = random.Random()  # fresh inputs each run
    for _ in range(3000):
        a = random_fp32(rng)
        # mostly nearby exponents (interesting alignment), sometimes anything
        b = random_fp32(rng) if rng.random() < 0.2 else a * (rng.random() * 4 - 2)
        with np.errstate(over="ignore"):
            b = float(np.float32(b))
        if not math.isfinite(b):
            continue
        r = explain_add(a, b)
        want = ref_round_bf16(Fraction(a) + Fraction(b))
        assert r.result == want or (r.result == 0 and want == 0), (a, b, r.result, want)
        if math.isfinite(r.result):
            assert r.error == Fraction(r.result) - (Fraction(a) + Fraction(b))


def test_matches_torch_rounding_when_the_sum_is_fp32_exact():
    """torch's FP32 -> BF16 cast is RNE; when a + b is exact in FP32 both must agree bit for bit."""
    rng = random.Random()
    checked = 0
    while checked < 2000:
        a = random_fp32(rng, -20, 20)
        b = float(np.float32(a * rng.uniform(-3, 3)))
        s = Fraction(a) + Fraction(b)
        s32 = np.float32(float(s))
        if not np.isfinite(s32) or Fraction(float(s32)) != s:
            continue
        t = torch.tensor(float(s32), dtype=torch.float32).to(torch.bfloat16).float().item()
        assert explain_add(a, b).result == t
        checked += 1


def test_every_bf16_is_each_value_once_in_order():
    """lpfa.bf16.every_bf16: the 2¹⁶ bit patterns less the 254 NaNs, each exactly a BF16 value, ascending, from −inf
    to +inf, both zeros kept, and no two patterns alike."""
    x = every_bf16()
    assert x.dtype == torch.float32 and len(x) == 2**16 - 254
    assert torch.equal(x, x.bfloat16().float()) and (x[1:] >= x[:-1]).all()
    assert x[0] == -math.inf and x[-1] == math.inf and int((x == 0).sum()) == 2
    assert len(torch.unique(x.view(torch.int32))) == len(x)


def test_fields_roundtrip_bits():
    rng = random.Random()
    for _ in range(500):
        x = random_fp32(rng)
        f = fp32_fields(x)
        word = int(f.hex, 16)
        assert f32(word) == x or (x == 0 and f32(word) == 0)
    with pytest.raises(ValueError, match="not representable in BF16"):
        bf16_fields(1.0 + 2.0**-10)


# ---- the accumulation-bias statistic -------------------------------------------------------------
def test_accumulation_bias_reproduces_the_mechanism():
    df = accumulation_bias(n_ones=(0, 2), gaps=(12.0,), value_signs=("negative", "mixed"), trials=4000, seed=1)

    def row(n, w, vs, acc="fp32"):
        q = df[(df.n_ones == n) & (df.weights == w) & (df["values"] == vs) & (df.accumulate == acc)]
        assert len(q) == 1
        return q.iloc[0]

    biased = row(2, "one", "negative")
    assert biased.mean_err_ulp < -8 * biased.sem_err_ulp  # two p_bar == 1 keys, same sign: magnitude up
    for r in (row(2, "below_one", "negative"), row(2, "one", "mixed"), row(0, "one", "negative")):
        assert abs(r.mean_err_ulp) < 5 * r.sem_err_ulp + 1e-3
    stag = row(0, "one", "negative", "bf16")  # a BF16 accumulator loses small same-sign terms
    assert stag.mean_err_ulp > 8 * stag.sem_err_ulp


def test_accumulation_bias_single_key_rows():
    """A one-key row with p_bar == 1 is a BF16 value itself: every result must be exact."""
    df = accumulation_bias(n_keys=1, n_ones=(1,), gaps=(0.0,), weights=("one",), trials=50, seed=3)
    assert (df.frac_exact == 1.0).all() and (df.mean_err_ulp == 0).all()
    # with weights below one the product has up to 16 significant bits and is rounded
    df = accumulation_bias(n_keys=1, n_ones=(1,), gaps=(0.0,), weights=("below_one",), trials=2000, seed=3)
    assert (df.frac_exact < 0.2).all()


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(value_signs=("up",)), "unknown option"),
        (dict(weights=("heavy",)), "unknown option"),
        (dict(accumulate=("fp8",)), "unknown option"),
        (dict(n_ones=(70,)), "must lie in"),
        (dict(trials=1), "trials >= 2"),
        (dict(gaps=(-1.0,)), "must be finite"),
    ],
)
def test_accumulation_bias_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        accumulation_bias(**kwargs)


def test_round_to_bf16_matches_the_exact_reference():
    rng = random.Random()
    from lpfa.bf16 import round_to_bf16

    for _ in range(5000):
        x = rng.uniform(-1, 1) * 2.0 ** rng.randint(-140, 130)
        assert round_to_bf16(x) == ref_round_bf16(Fraction(x)) or (x == 0)
    for x in (1 + 2**-8, 1 + 3 * 2**-8, -(2.0**-134), 2.0**-134 + 2**-160, float(f32(0x7F7FFFFF))):
        assert round_to_bf16(x) == ref_round_bf16(Fraction(x))


def test_binade_and_operands_text():
    assert [binade(x) for x in (2.4, -2.296875, 1.0, 0.75, 3e-20, 1e20, 1e-40, 0.0, math.inf, math.nan)] == [
        "[2, 4)", "[2, 4)", "[1, 2)", "[0.5, 1)", "[2^-65, 2^-64)", "[2^66, 2^67)", "[0, 2^-126) (subnormal)", "zero",
        "infinite", "NaN"]
    assert operands_text(*PAPER_OPERANDS) == "|a| and |b| both lie in [2, 4), and both are negative"
    assert operands_text(-1.5, -1.25) == "|a| and |b| both lie in [1, 2), and both are negative"
    assert operands_text(3.5, 1.0) == "|a| lies in [2, 4) and |b| in [1, 2), and both are positive"
    assert operands_text(2.3125, -2.296875) == "|a| and |b| both lie in [2, 4); a is positive and b negative"
    assert operands_text(0.0, -1.0) == "a is zero and b in [1, 2); a is positive and b negative"
    # the binade is FP32's: 4 - 2^-30 rounds to 4.0 in FP32
    assert operands_text(4 - 2**-30, 2.0) == "|a| lies in [4, 8) and |b| in [2, 4), and both are positive"
    r = explain_add(*PAPER_OPERANDS)
    assert r.normalisation_shift == 1 and r.result == -4.71875
