"""Page 01, BF16 rounding (Sec. 3.3.2): one addition rounded to BF16 bit by bit, and how much a row with tied maxima
(``p_bar == 1``) biases a BF16-rounded sum ``o_bar = Σ_t p_bar[t]·v[t]`` (:func:`lpfa.bf16.accumulation_bias`)."""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import pandas as pd

from lpfa.bf16 import PAPER_OPERANDS, BF16Addition, binade, explain_add, fp32_fields
from lpfa.params import integer, list_of, real
from lpfa.plotting import COLORS, format_table, use_style

FP32_MAX = 3.4028234663852886e38
# the notebook's papermill parameters, checked right after its parameters cell (lpfa.params.check_params)
PARAMS = {
    "a": real(-FP32_MAX, FP32_MAX), "b": real(-FP32_MAX, FP32_MAX),
    "trials": integer(2), "n_keys": integer(1),
    "n_ones": list_of(integer(0)), "gaps": list_of(real(0)), "seed": integer(0),
}

SIGNIFICANT = 4  # a mean error further than this many standard errors from zero is "significant"

ROUNDING_CASES = {  # page 01's table beside the reader's operands: what decides the rounding of a sum of two values
    "two BF16 values, exact tie, odd → up": (-2.3125, -2.296875),
    "two BF16 values, exact tie, even → down": (-2.3125, -2.265625),
    "same, plus a same-sign 2⁻¹⁴": (-2.3125 - 2**-14, -2.265625),
    "mixed signs (cancellation)": (2.3125, -2.296875),
}


def operands_text(a: float, b: float) -> str:
    """The binades (:func:`lpfa.bf16.binade`) and signs of two FP32 operands in words, what decides how their sum
    normalises, e.g. ``"|a| and |b| both lie in [2, 4), and both are negative"`` or ``"|a| lies in [4, 8) and |b| in
    [1, 2); a is positive and b negative"``."""
    fa, fb = fp32_fields(a), fp32_fields(b)
    ba, bb = binade(a), binade(b)
    special = ("zero", "infinite", "NaN")
    if ba in special or bb in special:
        where = f"a is {ba if ba in special else f'in {ba}'} and b {bb if bb in special else f'in {bb}'}"
    elif ba == bb:
        where = f"|a| and |b| both lie in {ba}"
    else:
        where = f"|a| lies in {ba} and |b| in {bb}"
    if math.isnan(fa.value) or math.isnan(fb.value):
        return where
    sign = {0: "positive", 1: "negative"}
    if fa.sign == fb.sign:
        return f"{where}, and both are {sign[fa.sign]}"
    return f"{where}; a is {sign[fa.sign]} and b {sign[fb.sign]}"


def addition_text(r: BF16Addition) -> str:
    """Page 01's sentence on one addition (:func:`lpfa.bf16.explain_add`): the exact sum, what BF16 stores and the error
    in ulps, the normalisation shift with the operands' binades and signs (:func:`operands_text`) and the guard, round
    and sticky bits that decided the rounding; or what happened instead (overflow, a non-finite operand,
    cancellation)."""
    ops = operands_text(r.a.value, r.b.value)
    if r.overflow:
        return f"Here {ops}: the rounded sum exceeds BF16's range and is stored as `{r.result!r}`."
    if r.error is None:  # an infinite or NaN operand
        return f"Here {ops}: the sum is `{r.result!r}`."
    if r.exact == 0:
        return f"Here {ops}: the operands cancel exactly and the sum is `{r.result!r}`."
    text = (f"The exact sum is `{float(r.exact)!r}`; BF16 stores `{r.result!r}`, an error of `{float(r.error)!r}` "
            f"({r.error_ulps:+.3f} ulp). ")
    if r.normalisation_shift > 0:
        text += f"The significand overflowed ({ops}), so the sum was shifted right by one bit and the exponent grew; "
    elif r.normalisation_shift < 0:
        text += (f"The leading bits cancelled ({ops}), so the sum was shifted left by {-r.normalisation_shift} "
                 f"bit{'s' if r.normalisation_shift < -1 else ''}; ")
    else:
        text += f"The sum needed no shift ({ops}); "
    if r.error == 0:
        return text + "the bits beyond BF16's precision are all zero: the sum is exact in BF16."
    return text + (f"the dropped bits had guard {r.guard}, round {r.round_bit}, sticky {r.sticky}, so the magnitude "
                   "was " + ("rounded **up**." if r.rounded_up else "rounded down."))


def rounding_cases(a: float, b: float) -> pd.DataFrame:
    """Page 01's table: the operands ``a``, ``b`` (named the paper's example when they are :data:`PAPER_OPERANDS`) and
    :data:`ROUNDING_CASES`, each added by :func:`lpfa.bf16.explain_add`: exact sum, BF16 result, guard, round and
    sticky bits, whether the magnitude was rounded up, and the error in ulps (4 decimals)."""
    pairs = {("paper's example" if (a, b) == PAPER_OPERANDS else "your operands"): (a, b), **ROUNDING_CASES}
    rows = []
    for name, (x, y) in pairs.items():
        e = explain_add(x, y)
        rows.append({"case": name, "a": x, "b": y, "exact": float(e.exact), "BF16": e.result,
                     "guard": e.guard, "round": e.round_bit, "sticky": e.sticky, "magnitude up": e.rounded_up,
                     "error [ulp]": None if e.error_ulps is None else round(e.error_ulps, 4)})
    return pd.DataFrame(rows).set_index("case")


EXACT_COLUMNS = ("a", "b", "exact", "BF16")  # of rounding_cases: exact binary values, shown to the last digit


def cases_display(a: float, b: float):
    """:func:`rounding_cases` as the page shows it (:func:`lpfa.plotting.format_table`; the operands, exact sum and
    BF16 result to their last digit)."""
    return format_table(rounding_cases(a, b), raw=EXACT_COLUMNS, max_columns=len(ROUNDING_CASES) + 1)


def plot_accumulation_bias(df: pd.DataFrame, accumulate: tuple[str, ...] | None = None):
    """Figure of :func:`lpfa.bf16.accumulation_bias`: mean signed error (± 2 standard errors) against the number of
    ``p_bar == 1`` terms; one column per score gap, one row per accumulation mode (``accumulate``, default every mode
    in ``df``). Returns the figure."""
    use_style()
    accs = list(accumulate or dict.fromkeys(df["accumulate"]))
    gaps = list(dict.fromkeys(df["gap"]))
    fig, axes = plt.subplots(len(accs), len(gaps), figsize=(3.4 * len(gaps), 2.9 * len(accs)), squeeze=False,
                             sharex=True)
    styles = {
        ("one", "negative"): dict(color=COLORS["bf16"], ls="-", marker="o", label="p̄ = 1 terms, values < 0"),
        ("one", "positive"): dict(color=COLORS["accent"], ls="-", marker="^", label="p̄ = 1 terms, values > 0"),
        ("below_one", "negative"): dict(color=COLORS["sfa"], ls="-", marker="s",
                                        label="all p̄ < 1 (SFA-like), values < 0"),
        ("below_one", "positive"): dict(color=COLORS["sky"], ls="-", marker="v",
                                        label="all p̄ < 1 (SFA-like), values > 0"),
        ("one", "mixed"): dict(color=COLORS["neutral"], ls="--", marker=".", label="p̄ = 1 terms, mixed signs"),
        ("below_one", "mixed"): dict(color=COLORS["neutral"], ls=":", marker=".", label="all p̄ < 1, mixed signs"),
    }
    titles = {"fp32": "FP32 accumulate, one BF16 rounding (GEMM)", "bf16": "BF16 accumulator (every add rounded)"}
    for i, acc in enumerate(accs):
        for j, gap in enumerate(gaps):
            ax = axes[i, j]
            sub = df[(df["accumulate"] == acc) & (df["gap"] == gap)]
            for (w, vs), g in sub.groupby(["weights", "values"], sort=False):
                g = g.sort_values("n_ones")
                ax.errorbar(g["n_ones"], g["mean_err_ulp"], yerr=2 * g["sem_err_ulp"], capsize=2, ms=4, lw=1.2,
                            **styles[(w, vs)])
            ax.axhline(0, color="black", lw=0.6)
            ax.set_title(f"{titles[acc]}\nother keys ≥ {gap:g} below the max", fontsize=9)
            if j == 0:
                ax.set_ylabel("mean signed error [BF16 ulp]")
            if i == len(accs) - 1:
                ax.set_xlabel("keys tied at the row max (p̄ = 1)")
    handles, labels = axes[0, 0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=min(3, len(labels)))
    return fig


def bias_table(df: pd.DataFrame) -> pd.DataFrame:
    """The mean signed error in ulps of :func:`lpfa.bf16.accumulation_bias` (4 decimals): one row per accumulation,
    gap, weights and values, one column per number of ``p_bar == 1`` terms."""
    return df.pivot_table(index=["accumulate", "gap", "weights", "values"], columns="n_ones",
                          values="mean_err_ulp").round(4)


def bias_display(df: pd.DataFrame):
    """:func:`bias_table` as the page shows it (:func:`lpfa.plotting.format_table`), its unit in the caption."""
    return format_table(bias_table(df)).set_caption("Mean signed error [BF16 ulp]; columns: keys tied at the row max")


def _error_text(row) -> str:
    sig = abs(row.mean_err_ulp) > SIGNIFICANT * row.sem_err_ulp
    return f"{row.mean_err_ulp:+.4f} ± {row.sem_err_ulp:.4f} ulp ({'significant' if sig else 'not significant'})"


def bias_text(df: pd.DataFrame) -> str:
    """Page 01's summary of :func:`lpfa.bf16.accumulation_bias` (FP32 accumulation, one rounding): per number of tied
    keys ≥ 2 at the largest gap, the mean error ± its standard error for negative values, all ``p_bar < 1`` and mixed
    signs; the most ties at the smallest gap; and the BF16 accumulator without ties, each marked significant beyond
    :data:`SIGNIFICANT` standard errors."""

    def cell(acc, gap, w, vs, n):
        q = df[(df.accumulate == acc) & (df.gap == gap) & (df.weights == w) & (df["values"] == vs) & (df.n_ones == n)]
        return q.iloc[0] if len(q) else None

    if df.empty:
        raise ValueError("df has no rows: expected the table of lpfa.bf16.accumulation_bias")
    gaps, n_ones = list(dict.fromkeys(df.gap)), list(dict.fromkeys(df.n_ones))
    big_gap, few = max(gaps), [n for n in n_ones if n >= 2]
    lines = []
    for n in few:
        one, below = cell("fp32", big_gap, "one", "negative", n), cell("fp32", big_gap, "below_one", "negative", n)
        mixed = cell("fp32", big_gap, "one", "mixed", n)
        lines.append(f"* {n} tied keys, gap {big_gap:g}: negative values {_error_text(one)}; all p̄ < 1 "
                     f"{_error_text(below)}; mixed signs {_error_text(mixed)}.")
    small = cell("fp32", min(gaps), "one", "negative", max(few)) if few else None
    if small is not None:
        lines.append(f"* The same with gap {min(gaps):g} (many keys close to the max): {_error_text(small)}.")
    bf = cell("bf16", min(gaps), "one", "negative", 0)
    if bf is not None:
        lines.append(f"* BF16 accumulator, no ties, negative values: {_error_text(bf)} — positive, i.e. the magnitude "
                     "*shrinks*.")
    return "**FP32 accumulation, one BF16 rounding (the GEMM):**\n\n" + "\n".join(lines)


def addition_view(a: float, b: float) -> tuple:
    """Page 01's explorer drawing: the addition ``a + b`` rounded to BF16 bit by bit (:func:`lpfa.bf16.explain_add`)
    and its sentence (:func:`addition_text`); an operand outside FP32's range a one-line ValueError naming it."""
    a, b = PARAMS["a"].check("a", a), PARAMS["b"].check("b", b)
    r = explain_add(a, b)
    return r, addition_text(r)


def addition_explorer(a: float, b: float):
    """The reader's own operands for the addition (:func:`addition_view`, two number boxes starting at ``a``, ``b``)
    through :func:`lpfa.widgets.interactive_or_static`. The page above already shows ``a + b``: a static page gets
    only the line saying where the boxes live."""
    from lpfa.widgets import interactive_or_static

    def controls():
        import ipywidgets as w

        return {"a": w.FloatText(value=a, description="a"), "b": w.FloatText(value=b, description="b")}

    return interactive_or_static(addition_view, controls, None)
