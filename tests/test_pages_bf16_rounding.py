"""Page 01 (BF16 rounding): the sentences, tables and figure of lpfa.pages.bf16_rounding, checked against additions
worked out by hand on BF16's grid and against tables of known numbers."""

import math

import pandas as pd
import pytest

from lpfa.bf16 import PAPER_OPERANDS, accumulation_bias, explain_add
from lpfa.pages.bf16_rounding import (
    ROUNDING_CASES,
    SIGNIFICANT,
    addition_text,
    bias_table,
    bias_text,
    operands_text,
    plot_accumulation_bias,
    rounding_cases,
)

ULP_4_8 = 2.0**-5  # BF16's spacing in [4, 8): 8 significant bits


def test_addition_text_carries_the_papers_numbers():
    """Sec. 3.3.2: -2.4071154594421387 + -2.296875 = -4.703990459442139, stored as -4.71875 (the error in ulps of
    [4, 8))."""
    text = addition_text(explain_add(*PAPER_OPERANDS))
    error = -4.71875 - (-4.703990459442139)
    assert text.startswith("The exact sum is `-4.703990459442139`; BF16 stores `-4.71875`, an error of "
                           "`-0.014759540557861328`")
    assert f"({error / ULP_4_8:+.3f} ulp)" in text
    assert f"The significand overflowed ({operands_text(*PAPER_OPERANDS)}), so the sum was shifted right" in text
    assert text.endswith("the dropped bits had guard 1, round 0, sticky 1, so the magnitude was rounded **up**.")


@pytest.mark.parametrize("a, b, words", [
    (-1.5, -1.25, "the bits beyond BF16's precision are all zero: the sum is exact in BF16."),  # -2.75, on the grid
    (1.5, -1.5, "Here |a| and |b| both lie in [1, 2); a is positive and b negative: the operands cancel exactly"),
    (3.0e38, 3.0e38, "the rounded sum exceeds BF16's range and is stored as `inf`."),
    (math.nan, 1.0, "Here a is NaN and b in [1, 2): the sum is `nan`."),
    (2.3125, -2.296875, "The leading bits cancelled (|a| and |b| both lie in [2, 4); a is positive and b negative), so "
                        "the sum was shifted left by 7 bits;"),  # 2^-6 = 0.015625: seven places below 2
    (1.5, 0.0078125, "The sum needed no shift"),
])
def test_addition_text_says_what_happened(a, b, words):
    assert words in addition_text(explain_add(a, b))


def test_rounding_cases_round_exact_ties_to_even():
    """The two exact ties, by hand: -4.609375 is 147.5 ulps of [4, 8) (147 odd: up to -4.625), -4.578125 is 146.5 ulps
    (146 even: down to -4.5625)."""
    t = rounding_cases(*PAPER_OPERANDS)
    assert list(t.index) == ["paper's example", *ROUNDING_CASES]
    odd, even = t.loc["two BF16 values, exact tie, odd → up"], t.loc["two BF16 values, exact tie, even → down"]
    assert odd["exact"] == -4.609375 and odd["BF16"] == -4.625 and odd["magnitude up"]
    assert (odd["guard"], odd["round"], odd["sticky"]) == (1, 0, 0) and odd["error [ulp]"] == -0.5
    assert even["exact"] == -4.578125 and even["BF16"] == -4.5625 and not even["magnitude up"]
    assert even["error [ulp]"] == 0.5
    nudged = t.loc["same, plus a same-sign 2⁻¹⁴"]  # the tie broken by a small same-sign term: always up
    assert nudged["sticky"] == 1 and nudged["magnitude up"] and nudged["BF16"] == -4.59375
    assert t.loc["paper's example", "BF16"] == -4.71875
    assert list(rounding_cases(-1.5, -1.25).index)[0] == "your operands"


def _frame():
    """A table shaped like accumulation_bias's, with chosen numbers."""
    rows = []
    for gap in (0.0, 12.0):
        for n in (0, 2, 3):
            for w in ("one", "below_one"):
                for vs in ("negative", "mixed"):
                    for acc in ("fp32", "bf16"):
                        mean = -0.1 * n if (gap, w, vs, acc) == (12.0, "one", "negative", "fp32") else 0.001 * n
                        rows.append({"gap": gap, "n_ones": n, "weights": w, "values": vs, "accumulate": acc,
                                     "mean_err_ulp": mean + (0.5 if (acc, n) == ("bf16", 0) else 0),
                                     "sem_err_ulp": 0.002})
    return pd.DataFrame(rows)


def test_bias_text_reports_each_condition_with_its_significance():
    text = bias_text(_frame())
    assert text.startswith("**FP32 accumulation, one BF16 rounding (the GEMM):**\n\n* 2 tied keys, gap 12: ")
    # -0.2 is 100 standard errors from zero; 0.002 (2 × 0.001) is one, below SIGNIFICANT
    assert ("* 2 tied keys, gap 12: negative values -0.2000 ± 0.0020 ulp (significant); all p̄ < 1 +0.0020 ± 0.0020 "
            "ulp (not significant); mixed signs +0.0020 ± 0.0020 ulp (not significant).") in text
    assert "* 3 tied keys, gap 12: negative values -0.3000 ± 0.0020 ulp (significant)" in text
    assert "* The same with gap 0 (many keys close to the max): +0.0030 ± 0.0020 ulp (not significant)." in text
    assert text.endswith("* BF16 accumulator, no ties, negative values: +0.5000 ± 0.0020 ulp (significant) — positive, "
                         "i.e. the magnitude *shrinks*.")
    assert SIGNIFICANT * 0.002 < 0.2


def test_bias_table_and_figure_from_a_measurement():
    df = accumulation_bias(n_keys=8, n_ones=(0, 2), gaps=(0.0, 12.0), trials=200, seed=1)
    t = bias_table(df)
    row = df[(df.accumulate == "fp32") & (df.gap == 12.0) & (df.weights == "one") & (df["values"] == "negative")
             & (df.n_ones == 2)].iloc[0]
    assert t.loc[("fp32", 12.0, "one", "negative"), 2] == round(row.mean_err_ulp, 4)
    assert t.shape == (2 * 2 * 2 * 2, 2)
    words = f"* 2 tied keys, gap 12: negative values {row.mean_err_ulp:+.4f} ± {row.sem_err_ulp:.4f} ulp"
    assert words in bias_text(df)
    fig = plot_accumulation_bias(df)
    assert len(fig.axes) == 2 * 2  # accumulation modes × gaps
    assert len(plot_accumulation_bias(df, accumulate=("fp32",)).axes) == 2


def test_bias_text_refuses_an_empty_table():
    with pytest.raises(ValueError, match="df has no rows: expected the table of lpfa.bf16.accumulation_bias"):
        bias_text(_frame().iloc[:0])
