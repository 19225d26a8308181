"""Dose-response: does the BF16 *bias* of δ drive the failure? (issue 16, section 1)

The paper's chain (Sec. 3.3, Figs. 4–6): where a row of scores ties at its maximum, P̄ rounds to exactly 1 in
BF16 and the rounding of P̄V makes O, and so δ = rowsum(dO∘O), err with a consistent sign (Fig. 6, Fig. 5);
that biased δ error adds up along a low-rank direction of the W_Q gradient (Fig. 4), whose spectral norm grows
until the attention logits run away and the loss explodes (Fig. 2).

No run of the book's reproduction config exploded within one affordable GPU run at dose 1. So a training run
(``python -m lpfa.train``) may multiply one layer's δ error in the attention backward by k, the forward untouched:

    δ = δ_ref + k·s·(δ_policy − δ_ref)

with s = +1 for the **biased** dose (``delta_dose_sign=bias``: the BF16 bias, amplified) and a fresh random ±1
per row for the **control** (``delta_dose_sign=control``: the same magnitude, no bias). If the bias is the cause,
biased runs fail sooner the larger k is, and controls at the same k do not fail. The runs are the table
:data:`lpfa.experiments.DOSE`.

This module turns the run folders into the evidence:

* :func:`dose_table`: one row per run, its dose and the verdicts of :func:`lpfa.run.run_verdict`;
* :func:`fit_dose_response`: a power law, log10(step) = a + b·log10(k), over the runs that failed, and its
  extrapolation to k = 1 with a prediction interval (:func:`predict` at any k);
* :func:`extrapolation_text`: that extrapolation in one sentence, in steps, tokens and GPU-minutes;
* :func:`plot_dose_response`: the figure (log-log, the control alongside, seeds as a spread, censored runs);
* :func:`dose_summary`: the numbers the book quotes.
* :func:`rescue_table`, :func:`rescue_headline`: issue 20's rescue, the dose that derails the BF16 run with
  ``lpfa.train``'s ``on_warning`` switching the flagged layer, held against the unrescued run.

A run that did not fail is *censored*: its failure step is only known to lie beyond its length. The fit leaves
such runs out (they are drawn, and counted in the fit's ``n_censored``), so it describes the runs that failed.
Runs are read only through :mod:`lpfa.run`, :mod:`lpfa.compare` and :mod:`lpfa.explosion`.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from lpfa.attention import get_policy
from lpfa.run import Run, load_metrics, read_run_config, run_verdict
from lpfa.compare import layer_max

COLUMNS = ["k", "sign", "base", "seed", "steps", "exploded", "explosion step", "runaway step", "runaway layer",
           "failure step", "censored", "final eval loss", "max logit"]
CENSORED_LABEL = "no failure by the end of the run"
# x offsets (factors of k) in the figure, so runs at one dose do not hide each other
DODGE = {"control": 1.1, "other": 1 / 1.1}


# ----------------------------------------------------------------------------------------------------------------
# the table


def committed_runs(root: str | Path | None = None) -> dict[str, Path]:
    """``{label: run folder}`` of the committed dose experiment (``results/dose``, :data:`lpfa.experiments.DOSE`), with its
    dose-1 point and FP32 reference taken from the isolation table's ``bf16`` and ``fp32`` rows (the same preset,
    seed and compile; dose 1 with the bias sign is the undosed policy): ``bias_x1`` and ``fp32``. Empty without
    results."""
    from lpfa.results import experiment_rows

    runs = dict(experiment_rows("dose", root=root))
    refs = experiment_rows("isolation", ["bf16", "fp32"], root=root)
    if runs and "bias_x1" not in runs and "bf16" in refs:
        runs["bias_x1"] = refs["bf16"]
    if runs and "fp32" not in runs and "fp32" in refs:
        runs["fp32"] = refs["fp32"]
    return runs


def _base(train: dict, layer: int) -> str:
    """The attention the dose is applied on in ``layer``: its entry in ``layer_policies`` if it has one, else the
    lpfa policy preset (``attn_policy``), or the backend (``sdpa_fp32``, ...) when it is not ``lpfa``."""
    per_layer = train.get("layer_policies") or {}
    for key in (layer, str(layer)):  # config.json keeps int keys as strings
        if key in per_layer:
            return str(per_layer[key])
    backend = train.get("attn_backend", "lpfa")
    return str(train["attn_policy"]) if backend == "lpfa" else str(backend)


def dose_table(runs: dict[str, str | Path], layer: int = 1) -> pd.DataFrame:
    """One row per run (``{label: run_dir}``), indexed by label. Columns:

    * ``k`` (float, ``delta_dose`` of the run's config; 1 without the field: the undosed policy), ``sign``
      (``bias`` or ``control``; ``bias`` without the field), ``base`` (see :func:`_base`), ``seed``;
    * ``steps`` (steps run), ``exploded``, ``explosion step``, ``runaway step`` and ``runaway layer`` from
      :func:`lpfa.run.run_verdict` (the runaway is the first in any layer; its layer says which);
    * ``failure step``: the explosion step if the run exploded, else the runaway step, else missing;
      ``censored``: True when there is no failure (the run length is then a lower bound on it);
    * ``final eval loss`` (NaN without evaluations) and ``max logit``: the largest attention logit of ``layer``
      over the run (NaN without diagnostics).

    Steps are nullable integers (``<NA>`` where the event did not happen). ``table.attrs["layer"]`` = ``layer``."""
    rows = {}
    for label, d in runs.items():
        train = read_run_config(d)["train"]
        verdict = run_verdict(d)
        _, val, diag = load_metrics(d)
        failure = verdict["explosion_step"] if verdict["exploded"] else verdict["runaway_step"]
        has_logits = not diag.empty and "max_logit" in diag
        rows[label] = {
            "k": float(train.get("delta_dose", 1.0)),
            "sign": str(train.get("delta_dose_sign", "bias")),
            "base": _base(train, layer),
            "seed": train.get("seed"),
            "steps": verdict["steps"],
            "exploded": bool(verdict["exploded"]),
            "explosion step": verdict["explosion_step"],
            "runaway step": verdict["runaway_step"],
            "runaway layer": verdict["runaway_layer"],
            "failure step": failure,
            "censored": failure is None,
            "final eval loss": float(val["val_loss"].iloc[-1]) if len(val) else math.nan,
            "max logit": float(layer_max(d, "max_logit", layer).max()) if has_logits else math.nan,
        }
    table = pd.DataFrame.from_dict(rows, orient="index", columns=COLUMNS)
    for col in ("seed", "steps", "explosion step", "runaway step", "runaway layer", "failure step"):
        table[col] = table[col].astype("Int64")
    table["k"] = table["k"].astype(float)
    for col in ("exploded", "censored"):
        table[col] = table[col].astype(bool)
    for col in ("final eval loss", "max logit"):
        table[col] = table[col].astype(float)
    table.attrs["layer"] = layer
    return table


# ----------------------------------------------------------------------------------------------------------------
# the fit


def t_quantile(level: float, df: int) -> float:
    """The two-sided quantile of Student's t with ``df`` (a positive integer) degrees of freedom: the t with
    P(|T| ≤ t) = ``level``. Exact to float precision, without SciPy: the closed form of P(|T| ≤ t) for integer
    ``df`` (Abramowitz & Stegun 26.7.3-4, in θ = atan(t/√df)), inverted by bisection on θ."""
    if not 0 < level < 1 or int(df) != df or df < 1:
        raise ValueError(f"need 0 < level < 1 and an integer df >= 1, got level={level}, df={df}")
    df = int(df)

    def within(theta):  # P(|T| <= sqrt(df)·tan θ)
        s, c2 = math.sin(theta), math.cos(theta) ** 2
        if df % 2 == 0:
            term, total = 1.0, 1.0
            for j in range(1, df // 2):
                term *= c2 * (2 * j - 1) / (2 * j)
                total += term
            return s * total
        term, total = 0.0, 0.0
        if df > 1:
            term = total = math.cos(theta)
            for j in range(1, (df - 1) // 2):
                term *= c2 * (2 * j) / (2 * j + 1)
                total += term
        return 2 / math.pi * (theta + s * total)

    lo, hi = 0.0, math.pi / 2
    for _ in range(200):
        mid = (lo + hi) / 2
        if mid in (lo, hi):
            break
        lo, hi = (mid, hi) if within(mid) < level else (lo, mid)
    return math.sqrt(df) * math.tan((lo + hi) / 2)


def _empty_fit(what, sign, base, n, n_censored, note) -> dict:
    nan = math.nan
    return {"what": what, "sign": sign, "base": base, "n": n, "n_censored": n_censored, "labels": [],
            "k_min": nan, "k_max": nan, "slope": nan, "slope_se": nan, "intercept": nan, "intercept_se": nan,
            "residual_sd": nan, "df": 0, "x_mean": nan, "sxx": nan, "predicted_at_1": nan, "log10_prediction_se": nan,
            "interval_68": (nan, nan), "interval_95": (nan, nan), "note": note}


def fit_dose_response(table: pd.DataFrame, what: str = "failure step", sign: str = "bias",
                      base: str | None = None) -> dict:
    """Least-squares fit of log10(step) = a + b·log10(k) over the rows of ``table`` (:func:`dose_table`) with
    this ``sign`` (and ``base``, when given: pass it, e.g. ``paper_untiled``, to keep the SFA and FP32 rows out)
    whose ``what`` (``failure step``, ``explosion step`` or ``runaway step``) happened; every seed is a point.

    Returns a dict of plain numbers: ``n`` (points fitted), ``n_censored`` (rows of the sign and base left out
    because ``what`` did not happen), ``labels``, ``k_min``/``k_max`` (the fitted range), ``slope`` (b) and
    ``intercept`` (a) with their standard errors ``slope_se``/``intercept_se``, ``residual_sd`` (in log10 steps),
    ``df`` (n − 2), ``x_mean``/``sxx`` (for :func:`predict`), and the extrapolation to k = 1: ``predicted_at_1``
    (steps), ``log10_prediction_se`` and the 68% and 95% prediction intervals ``interval_68``/``interval_95``
    (low, high steps; Student's t with n − 2 degrees of freedom). ``note`` is None, or says why the numbers are
    NaN: fewer than 3 points, or a single dose. Never raises for a lack of points."""
    if what not in table:
        raise ValueError(f"the table has no column {what!r} (columns {list(table.columns)})")
    rows = table[table["sign"] == sign]
    if base is not None:
        rows = rows[rows["base"] == base]
    steps = pd.to_numeric(rows[what], errors="coerce").astype(float)
    ok = steps.notna() & (steps > 0) & (rows["k"] > 0)  # k = 0 (δ_ref itself) has no place on a log axis
    n, n_censored = int(ok.sum()), int(steps.isna().sum())
    which = f"{sign} runs" + (f" on {base}" if base is not None else "")
    if n < 3:
        return _empty_fit(what, sign, base, n, n_censored,
                          f"only {n} {which} with a {what} (a fit with an uncertainty needs at least 3)")
    x, y = np.log10(rows.loc[ok, "k"].to_numpy(float)), np.log10(steps[ok].to_numpy())
    if np.ptp(x) == 0:
        return _empty_fit(what, sign, base, n, n_censored,
                          f"all {n} {which} with a {what} have one dose (k = {10 ** x[0]:g})")
    x_mean, sxx = float(x.mean()), float(((x - x.mean()) ** 2).sum())
    slope = float(((x - x_mean) * (y - y.mean())).sum() / sxx)
    intercept = float(y.mean() - slope * x_mean)
    resid = y - (intercept + slope * x)
    sd = float(math.sqrt((resid ** 2).sum() / (n - 2)))
    fit = {"what": what, "sign": sign, "base": base, "n": n, "n_censored": n_censored, "labels": list(rows.index[ok]),
           "k_min": float(rows.loc[ok, "k"].min()), "k_max": float(rows.loc[ok, "k"].max()),
           "slope": slope, "slope_se": sd / math.sqrt(sxx),
           "intercept": intercept, "intercept_se": sd * math.sqrt(1 / n + x_mean ** 2 / sxx),
           "residual_sd": sd, "df": n - 2, "x_mean": x_mean, "sxx": sxx, "note": None}
    fit["predicted_at_1"], lo68, hi68 = predict(fit, 1.0, 0.68)
    _, lo95, hi95 = predict(fit, 1.0, 0.95)
    fit["log10_prediction_se"] = _prediction_se(fit, 0.0)
    fit["interval_68"], fit["interval_95"] = (lo68, hi68), (lo95, hi95)
    return fit


def _prediction_se(fit: dict, x: float) -> float:
    """Standard error (log10 steps) of one new run's log10 step at log10 k = ``x``."""
    return fit["residual_sd"] * math.sqrt(1 + 1 / fit["n"] + (x - fit["x_mean"]) ** 2 / fit["sxx"])


def predict(fit: dict, k: float, level: float = 0.95) -> tuple[float, float, float]:
    """``(steps, low, high)``: the fitted step at dose ``k`` and the ``level`` prediction interval of one new run
    there (NaNs when the fit has none)."""
    if not fit["n"] or not math.isfinite(fit["slope"]):
        return math.nan, math.nan, math.nan
    x = math.log10(k)
    y = fit["intercept"] + fit["slope"] * x
    half = t_quantile(level, fit["df"]) * _prediction_se(fit, x)
    return 10 ** y, 10 ** (y - half), 10 ** (y + half)


# ----------------------------------------------------------------------------------------------------------------
# words


def _si(x: float) -> str:
    """3 significant digits with a k/M/B/T suffix: 1.57B."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suffix}"
    return f"{x:.3g}"


def extrapolation_text(fit: dict, tokens_per_step: int, steps_per_minute: float | None = None) -> str:
    """The fit's extrapolation to dose 1 in one sentence: the step of failure with its 95% prediction interval,
    the tokens at ``tokens_per_step`` (:func:`lpfa.scaling.tokens_per_step` of the run's config) and, given
    ``steps_per_minute`` (e.g. a measured tokens/s × 60 / tokens per step), the GPU-minutes; or why there is none."""
    what = fit.get("what", "failure step").replace(" step", "")
    if not math.isfinite(fit.get("predicted_at_1", math.nan)):
        return f"There is no extrapolation of the {what} to dose 1: {fit.get('note') or 'the fit has no estimate'}."
    p, (lo, hi) = fit["predicted_at_1"], fit["interval_95"]
    tok = tokens_per_step
    text = (f"Extrapolated to dose k = 1, the power law fitted to {fit['n']} {fit['sign']} runs "
            f"(slope {fit['slope']:.2f} ± {fit['slope_se']:.2f}, k = {fit['k_min']:g}–{fit['k_max']:g}) "
            f"puts the {what} at step {p:,.0f} (95% prediction interval {lo:,.0f}–{hi:,.0f}), "
            f"that is {_si(p * tok)} tokens ({_si(lo * tok)}–{_si(hi * tok)}) at {tok:,} tokens per step")
    if steps_per_minute:
        m = steps_per_minute
        text += (f" and {p / m:,.0f} GPU-minutes ({lo / m:,.0f}–{hi / m:,.0f}) at {m:,.3g} steps per minute")
    if fit["slope"] >= 0:
        text += (f"; but the {what} does not come sooner at larger doses, "
                 "so this is no evidence that the δ bias drives it")
    return text + "."


def dose_summary(table: pd.DataFrame, fit: dict) -> dict:
    """The numbers the book quotes, as plain Python values (None where no run qualifies, NaN where the fit has none).
    The run counts are over the ladder: the rows on ``base``, the fit's base, or the table's commonest base when
    the fit has none (so the SFA and FP32 rows are left out of them):

    * ``base``; ``biased_runs``, ``biased_exploded``, ``biased_failed`` (explosion or runaway): counts of ``bias`` rows;
    * ``smallest_biased_k_exploded``, ``smallest_biased_k_failed``;
    * ``control_runs``, ``control_failed``, ``control_exploded`` (counts), ``any_control_failed`` (bool);
    * ``largest_control_k`` and ``largest_control_k_final_eval_loss`` (the mean over its runs, if several seeds);
    * from ``fit``: ``slope``, ``slope_se``, ``n_fit``, ``predicted_at_1``, ``predicted_at_1_low_95`` / ``_high_95``
      and ``predicted_at_1_low_68`` / ``_high_68``."""
    base = fit.get("base") or _main_base(table)
    ladder = table[table["base"] == base]
    bias, control = ladder[ladder["sign"] == "bias"], ladder[ladder["sign"] == "control"]
    bias_failed, control_failed = bias[~bias["censored"]], control[~control["censored"]]
    largest = float(control["k"].max()) if len(control) else None
    return {
        "base": base,
        "biased_runs": len(bias), "biased_exploded": int(bias["exploded"].sum()), "biased_failed": len(bias_failed),
        "smallest_biased_k_exploded": float(bias.loc[bias["exploded"], "k"].min()) if bias["exploded"].any() else None,
        "smallest_biased_k_failed": float(bias_failed["k"].min()) if len(bias_failed) else None,
        "control_runs": len(control), "control_failed": len(control_failed),
        "control_exploded": int(control["exploded"].sum()), "any_control_failed": bool(len(control_failed)),
        "largest_control_k": largest,
        "largest_control_k_final_eval_loss": (float(control.loc[control["k"] == largest, "final eval loss"].mean())
                                              if largest is not None else None),
        "slope": float(fit["slope"]), "slope_se": float(fit["slope_se"]), "n_fit": int(fit["n"]),
        "predicted_at_1": float(fit["predicted_at_1"]),
        "predicted_at_1_low_95": float(fit["interval_95"][0]), "predicted_at_1_high_95": float(fit["interval_95"][1]),
        "predicted_at_1_low_68": float(fit["interval_68"][0]), "predicted_at_1_high_68": float(fit["interval_68"][1]),
    }


# ----------------------------------------------------------------------------------------------------------------
# the figure


def _main_base(table: pd.DataFrame) -> str | None:
    """The ladder's base: the commonest ``base`` of the table (the first of them on a tie)."""
    return str(table["base"].mode().iloc[0]) if len(table) else None


def _groups(table: pd.DataFrame) -> dict:
    """``{(sign, base): (label, colour, marker, filled, dodge)}``: biased runs on the ladder's base (the commonest base)
    filled vermillion circles (the book's BF16 colour), controls hollow reddish-purple squares, other bases
    filled diamonds in their own colour (SFA green, FP32 blue, as elsewhere in the book), "undosed" where k = 1."""
    import seaborn as sns

    pal = sns.color_palette("colorblind").as_hex()
    main = _main_base(table)
    by_base = {"sfa": pal[2], "fp32": pal[0]}
    spare = iter([pal[1], pal[5], pal[7], pal[9], pal[8]])
    out = {}
    for sign, base in dict.fromkeys(zip(table["sign"], table["base"])):
        if base == main:
            out[sign, base] = (("biased δ error (its BF16 sign kept)", pal[3], "o", True, 1.0) if sign == "bias"
                               else ("control (a random sign per row)", pal[4], "s", False, DODGE["control"]))
            continue
        colour = next((c for key, c in by_base.items() if key in base), None) or next(spare, pal[7])
        undosed = sign == "bias" and (table.loc[(table["sign"] == sign) & (table["base"] == base), "k"] == 1).all()
        label = f"{base}, " + ("undosed" if undosed else "biased δ error" if sign == "bias" else "control")
        out[sign, base] = (label, colour, "D", sign == "bias", DODGE["other"])
    return out


def plot_dose_response(table: pd.DataFrame, fit: dict | None = None, ax=None, what: str = "failure step",
                       affordable_steps: float | None = None):
    """Step of failure (``what``) against dose k on log-log axes, one point per run of ``table``
    (:func:`dose_table`). Biased runs filled, controls hollow with another colour and marker; a run where
    ``what`` did not happen is drawn at its length as an upward triangle ("no failure by the end of the run");
    several runs at one dose (seeds) as points joined by a vertical line over their min–max. Controls are drawn
    slightly right of their dose and other bases slightly left (:data:`DODGE`), so coinciding runs stay visible.
    With ``fit`` (:func:`fit_dose_response`): the fitted line over the fitted doses, dashed on to k = 1, and the
    95% prediction band; ``affordable_steps``: a dotted line "one GPU run". Colours: seaborn's "colorblind"
    palette. Returns the Figure (6.4 × 4.6 inches when it makes one; text at 9 pt or more)."""
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D
    from matplotlib.ticker import FixedLocator, NullLocator

    from lpfa.plotting import use_style

    use_style()
    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 4.6))
    groups = _groups(table)
    y = pd.to_numeric(table[what], errors="coerce").astype(float)
    censored = y.isna()
    shown = y.where(~censored, table["steps"].astype(float))  # a censored run at its length: a lower bound
    handles, any_censored, any_spread = [], False, False
    for (sign, base), (label, colour, marker, filled, dodge) in groups.items():
        g = table.index[(table["sign"] == sign) & (table["base"] == base)]
        face = colour if filled else "none"
        for k, at_k in table.loc[g].groupby("k").groups.items():
            if len(at_k) > 1:
                ax.vlines(k * dodge, shown[at_k].min(), shown[at_k].max(), color=colour, lw=1.2, alpha=0.7, zorder=2)
                any_spread = True
        ok, cens = g[~censored[g]], g[censored[g]]
        style = dict(ls="none", mec=colour, mfc=face, mew=1.5, zorder=3)
        ax.plot(table.loc[ok, "k"] * dodge, shown[ok], marker=marker, ms=7, **style)
        ax.plot(table.loc[cens, "k"] * dodge, shown[cens], marker="^", ms=8, **style)
        any_censored |= len(cens) > 0
        handles.append(Line2D([], [], ls="none", marker=marker, ms=7, mec=colour, mfc=face, mew=1.5, label=label))
    if any_censored:
        event = what.replace(" step", "")
        handles.append(Line2D([], [], ls="none", marker="^", ms=8, mec="0.3", mfc="none", mew=1.5,
                              label=CENSORED_LABEL if event == "failure" else f"no {event} by the end of the run"))
    if any_spread:
        handles.append(Line2D([], [], color="0.3", lw=1.2, label="several seeds: min–max"))

    k_lo = 1.0
    if fit is not None and fit["n"] and math.isfinite(fit["slope"]):
        colour = groups.get((fit["sign"], fit["base"] or _main_base(table)), (None, "0.2"))[1]
        k_lo = min(k_lo, fit["k_min"])
        band = np.geomspace(k_lo, fit["k_max"], 100)
        lo, hi = np.array([predict(fit, k)[1:] for k in band]).T
        ax.fill_between(band, lo, hi, color=colour, alpha=0.15, lw=0, zorder=1)
        fitted, extrapolated = np.geomspace(fit["k_min"], fit["k_max"], 50), np.geomspace(k_lo, fit["k_min"], 50)
        for ks, ls in ((fitted, "-"), (extrapolated, "--")):
            ax.plot(ks, [predict(fit, k)[0] for k in ks], color=colour, lw=1.5, ls=ls, zorder=2)
        exponent = f"{fit['slope']:.2f}".replace("-", "−")
        handles.append(Line2D([], [], color=colour, lw=1.5,
                              label=f"fit: step ∝ k$^{{{exponent}}}$ (n = {fit['n']}); dashed: extrapolated"))
        handles.append(plt.Rectangle((0, 0), 1, 1, color=colour, alpha=0.15, lw=0, label="95% prediction interval"))
    if affordable_steps:
        ax.axhline(affordable_steps, color="black", ls=":", lw=1.2, zorder=1)
        handles.append(Line2D([], [], color="black", ls=":", lw=1.2, label="one GPU run"))

    ax.set_xscale("log")
    ax.set_yscale("log")
    doses = sorted({*table["k"][table["k"] > 0].tolist(), 1.0})
    ax.set_xlim(min(doses + [k_lo]) / 1.5, max(doses) * 1.5)
    ax.xaxis.set_major_locator(FixedLocator(doses))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([f"{k:g}" for k in doses])
    ax.tick_params(labelsize=9)
    ax.set_xlabel(f"dose k (× layer-{table.attrs.get('layer', 1)} δ error)")
    ax.set_ylabel("step of " + what.replace(" step", ""))
    ax.legend(handles=handles, fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    return ax.figure


# ----------------------------------------------------------------------------------------------------------------
# the findings in words (the loss-explosion and SFA pages)


def _ks(values) -> str:
    ks = sorted({float(k) for k in values})
    return ", ".join(f"{k:g}" for k in ks) if ks else "none"


def dose_findings(table: pd.DataFrame, base: str = "paper_untiled") -> dict:
    """What the dose experiment shows, as plain values: for the biased and control runs on ``base``, the doses run,
    those whose loss exploded and those that ran away only; the doses where the bias decides (every biased run
    exploded and no control did); the SFA row (``sfa`` columns, None without one) and the undosed BF16 run."""
    ladder = table[table["base"] == base]
    out = {}
    for sign in ("bias", "control"):
        rows = ladder[ladder["sign"] == sign]
        dosed = rows[rows["k"] != 1] if sign == "bias" else rows
        out[sign] = {
            "ks": sorted({float(k) for k in dosed["k"]}), "runs": len(dosed),
            "exploded_ks": sorted({float(k) for k in dosed.loc[dosed["exploded"], "k"]}),
            "exploded_runs": int(dosed["exploded"].sum()),
            "runaway_only_ks": sorted({float(k) for k in dosed.loc[~dosed["exploded"] & ~dosed["censored"], "k"]}),
            "explosion_steps": {float(k): sorted(int(s) for s in g["explosion step"].dropna())
                                for k, g in dosed.groupby("k")},
        }
    both = sorted(set(out["bias"]["ks"]) & set(out["control"]["ks"]))
    by_k = lambda sign, k: ladder[(ladder["sign"] == sign) & (ladder["k"] == k)]
    out["bias_decides_ks"] = [k for k in both if by_k("bias", k)["exploded"].all() and not by_k("control", k)["exploded"].any()]
    out["magnitude_suffices_ks"] = [k for k in both if by_k("control", k)["exploded"].any()]
    undosed = ladder[(ladder["sign"] == "bias") & (ladder["k"] == 1)]
    out["undosed"] = None if undosed.empty else {
        "steps": int(undosed["steps"].iloc[0]), "exploded": bool(undosed["exploded"].iloc[0]),
        "runaway step": None if pd.isna(undosed["runaway step"].iloc[0]) else int(undosed["runaway step"].iloc[0])}
    sfa = table[table["base"].str.contains("sfa") & (table["sign"] == "bias")]
    out["sfa"] = None
    if not sfa.empty:
        k = float(sfa["k"].max())
        row, plain = sfa[sfa["k"] == k].iloc[0], ladder[(ladder["sign"] == "bias") & (ladder["k"] == k)]
        out["sfa"] = {"k": k, "base": str(row["base"]), "beta": get_policy(str(row["base"])).sfa.beta,
                      "exploded": bool(row["exploded"]),
                      "explosion step": None if pd.isna(row["explosion step"]) else int(row["explosion step"]),
                      "without_sfa": sorted(int(s) for s in plain["explosion step"].dropna())}
    return out


def dose_text(table: pd.DataFrame, base: str = "paper_untiled") -> str:
    """:func:`dose_findings` in three sentences (Markdown) for the loss-explosion page."""
    f = dose_findings(table, base)
    b, c = f["bias"], f["control"]
    steps = lambda d: "; ".join(f"k = {k:g}: step{'s' if len(v) > 1 else ''} {', '.join(f'{s:,}' for s in v)}"
                                for k, v in d["explosion_steps"].items() if v)
    text = [f"With its BF16 sign kept, the dosed δ error made the loss explode in **{b['exploded_runs']} of {b['runs']} runs**, "
            f"at k = {_ks(b['exploded_ks'])} ({steps(b)}); at k = {_ks(b['runaway_only_ks'])} the layer-1 logits ran away "
            "but the loss had not exploded by the end of the run."]
    text.append(f"The control, the same magnitude with a random sign per row, exploded in **{c['exploded_runs']} of {c['runs']} runs** "
                + (f"({steps(c)})" if c["exploded_runs"] else f"(k = {_ks(c['ks'])})")
                + (f", and its logits ran away without an explosion at k = {_ks(c['runaway_only_ks'])}" if c["runaway_only_ks"] else "")
                + (f"; at k = {_ks(f['bias_decides_ks'])} every biased run exploded and no control did, so there the *bias*, "
                   "not the size of the δ error, drives the failure" if f["bias_decides_ks"] else "")
                + (f"; at k = {_ks(f['magnitude_suffices_ks'])} the magnitude alone suffices" if f["magnitude_suffices_ks"] else "")
                + ".")
    if f["sfa"] is not None:
        s = f["sfa"]
        text.append(f"With SFA (β = {s['beta']:g}) as the base at the biased k = {s['k']:g}, the loss "
                    + (f"still exploded, at step {s['explosion step']:,} against {', '.join(f'{x:,}' for x in s['without_sfa'])} "
                       "without SFA: SFA removes the ties, not a δ error injected by hand" if s["exploded"] else "did not explode")
                    + ".")
    return " ".join(text)


def rescue_table(root=None):
    """Issue 20's rescue: one row per committed run of :data:`lpfa.experiments.RESCUE`, beside the run it rescues (the
    dose table's ``bias_x128``, same seed and data order, no ``on_warning``) and the FP32 twin of that preset (the
    isolation table's ``fp32``, the dose table's reference): ``on warning`` (what the flagged layer switches to),
    ``first warning`` (step, layer, head and measure of the first), ``switches`` (each layer switched and the step),
    ``warnings`` (how many were logged), the run's verdict (``steps``, ``runaway step``, ``explosion step``) and
    ``eval loss @ N``, the last evaluation at or before the rescued runs' last step N (NaN where a run stopped
    earlier). Indexed by label; empty without committed rescue runs."""
    from lpfa.experiments import RESCUE, RESCUE_DOSE
    from lpfa.results import experiment_rows

    found = experiment_rows("rescue", list(RESCUE), root=root)
    if not found:
        return pd.DataFrame()
    dose = committed_runs(root)
    runs = {**{k: dose[k] for k in (f"bias_x{RESCUE_DOSE}", "fp32") if k in dose}, **found}
    last = max(Run(d).steps for d in found.values())
    rows = {}
    for label, d in runs.items():
        r = Run(d)
        v, warns = r.verdict(), r.warnings
        switched = [(w["layer"], w["step"], w["action"].rsplit(" ", 1)[-1]) for w in warns if "switched" in w["action"]]
        first = warns[0] if warns else None
        _, val, _ = load_metrics(d)
        val = val[val.index <= last]["val_loss"] if len(val) else val
        rows[label] = {
            "on warning": r.train.get("on_warning", "off"),
            "first warning": (f"step {first['step']:,}: layer {first['layer']} head {first['head']} {first['measure']} "
                              f"{first['value']:,.0f} ≥ {first['level']} {first['threshold']:,.4g}") if first else "",
            "switches": "; ".join(f"layer {layer} at {step:,} → {to}" for layer, step, to in switched),
            "warnings": len(warns), "steps": v["steps"], "runaway step": v["runaway_step"],
            "explosion step": v["explosion_step"],
            f"eval loss @ {last:,}": float(val.iloc[-1]) if len(val) and v["steps"] >= last else float("nan")}
    return pd.DataFrame(rows).T


def rescue_headline(table) -> str:
    """Page 15's sentence on the rescue, from :func:`rescue_table`: whether each rescued run exploded where the
    unrescued run did, its first switch, its runaway and its eval loss against the FP32 twin's."""
    from lpfa.experiments import RESCUE_DOSE

    if table.empty:
        return "The rescue runs (`lpfa.experiments.RESCUE`) are not committed yet."
    base = f"bias_x{RESCUE_DOSE}"
    loss = next(c for c in table.columns if c.startswith("eval loss @"))
    out = []
    if base in table.index:
        b = table.loc[base]
        out.append(f"Without a switch, BF16 attention with layer 1's δ error × {RESCUE_DOSE} (`{base}`) "
                   + (f"exploded at step {b['explosion step']:,}" if b["explosion step"] is not None else
                      f"did not explode in {b['steps']:,} steps") + ".")
    for label, r in table.iterrows():
        if label in (base, "fp32"):
            continue
        first_switch = r["switches"].split(";")[0] if r["switches"] else "no switch"
        fate = (f"exploded at step {r['explosion step']:,}" if r["explosion step"] is not None
                else f"did not explode in {r['steps']:,} steps")
        runaway = (f"its logits ran away from step {r['runaway step']:,} all the same" if r["runaway step"] is not None
                   else "its logits never ran away")
        ref = (f" (FP32 twin {table.loc['fp32', loss]:.2f})" if "fp32" in table.index and r[loss] == r[loss] else "")
        out.append(f"With `on_warning={r['on warning']}` (`{label}`: {first_switch}) it {fate}; {runaway}; eval loss "
                   f"{r[loss]:.2f} at step {loss.split('@ ')[1]}{ref}.")
    return " ".join(out)
