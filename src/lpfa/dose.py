"""Dose-response: does the BF16 *bias* of δ drive the failure?

The paper's chain (Sec. 3.3, Figs. 4–6): where a row of scores ties at its maximum, P̄ rounds to exactly 1 in
BF16 and the rounding of P̄V makes O, and so δ = rowsum(dO∘O), err with a consistent sign (Fig. 6, Fig. 5);
that biased δ error adds up along a low-rank direction of the W_Q gradient (Fig. 4), whose spectral norm grows
until the attention logits run away and the loss explodes (Fig. 2).

No run of the reproduction config exploded within one affordable GPU run at dose 1. So a training run
(``python -m lpfa.train``) may multiply one layer's δ error in the attention backward by k, the forward untouched:

    δ = δ_ref + k·s·(δ_policy − δ_ref)

with s = +1 for the **biased** dose (``delta_dose_sign=bias``: the BF16 bias, amplified) and a fresh random ±1
per row for the **control** (``delta_dose_sign=control``: the same magnitude, no bias). If the bias is the cause,
biased runs fail sooner the larger k is, and controls at the same k do not fail. The runs are the table
:data:`lpfa.experiments.DOSE`.

This module turns the run folders into the evidence:

* :func:`committed_runs`, :func:`dose_table`: one row per run, its dose and the verdicts of
  :func:`lpfa.run.run_verdict`;
* :func:`fit_dose_response`: a power law, log10(step) = a + b·log10(k), over the runs that failed, and its
  extrapolation to k = 1 with a prediction interval (:func:`predict` at any k, :func:`t_quantile`);
* :func:`dose_findings`: what the ladder shows, as plain values (the doses where the bias decides);
* :func:`rescue_table`, :func:`rescue_headline`: the rescue experiment, the dose that derails the BF16 run with
  ``lpfa.train``'s ``on_warning`` switching the flagged layer, held against the unrescued run.

A run that did not fail is *censored*: its failure step is only known to lie beyond its length. The fit leaves
such runs out (they are counted in the fit's ``n_censored``), so it describes the runs that failed.
Runs are read only through :mod:`lpfa.run`, :mod:`lpfa.compare` and :mod:`lpfa.explosion`.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd

from lpfa.attention import get_policy
from lpfa.compare import layer_max
from lpfa.experiments import RESCUE, RESCUE_DOSE
from lpfa.results import experiment_rows
from lpfa.run import Run, load_metrics, read_run_config, run_verdict

COLUMNS = ["k", "sign", "base", "seed", "steps", "exploded", "explosion step", "runaway step", "runaway layer",
           "failure step", "censored", "final eval loss", "max logit"]


# ----------------------------------------------------------------------------------------------------------------
# the table


def committed_runs(root: str | Path | None = None) -> dict[str, Path]:
    """``{label: run folder}`` of the committed dose experiment (``results/dose``, :data:`lpfa.experiments.DOSE`),
    with its dose-1 point ``bias_x1`` and FP32 reference ``fp32`` taken from the isolation table's ``bf16`` and
    ``fp32`` rows (same preset, seed and compile; dose 1 with the bias sign is the undosed policy). Empty without
    results."""
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
    """One row per run of ``runs`` (``{label: run_dir}``), indexed by label: the dose ``k`` (``delta_dose``, 1
    without it), ``sign`` (``bias`` or ``control``), the ``base`` attention of ``layer`` (:func:`_base`), ``seed``,
    ``steps``; ``exploded``, ``explosion step``, ``runaway step``, ``runaway layer`` (:func:`lpfa.run.run_verdict`);
    ``failure step`` (the explosion, else the runaway) and ``censored`` (no failure: the run's length only bounds
    it); ``final eval loss`` and ``max logit`` (``layer``'s largest attention logit over the run), NaN where not
    logged. Steps are nullable integers (``<NA>``: the event did not happen); ``table.attrs["layer"]`` = ``layer``."""
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
    """A fit of NaNs with ``note`` saying why (:func:`fit_dose_response`)."""
    nan = math.nan
    return {"what": what, "sign": sign, "base": base, "n": n, "n_censored": n_censored, "labels": [],
            "k_min": nan, "k_max": nan, "slope": nan, "slope_se": nan, "intercept": nan, "intercept_se": nan,
            "residual_sd": nan, "df": 0, "x_mean": nan, "sxx": nan, "predicted_at_1": nan,
            "log10_prediction_se": nan,
            "interval_68": (nan, nan), "interval_95": (nan, nan), "note": note}


def fit_dose_response(table: pd.DataFrame, what: str = "failure step", sign: str = "bias",
                      base: str | None = None) -> dict:
    """Least-squares fit of log10(step) = a + b·log10(k) over the rows of ``table`` (:func:`dose_table`) with this
    ``sign`` (and ``base``, when given) whose ``what`` (``failure step``, ``explosion step`` or ``runaway step``)
    happened, one point per run. Returns plain numbers: ``n``, ``n_censored`` (rows left out: ``what`` did not
    happen), ``labels``, ``k_min``/``k_max``, ``slope``/``intercept`` with ``slope_se``/``intercept_se``,
    ``residual_sd`` (log10 steps), ``df`` (n − 2), ``x_mean``/``sxx`` (for :func:`predict`), and at k = 1
    ``predicted_at_1``, ``log10_prediction_se``, ``interval_68``/``interval_95`` (Student's t). ``note`` says why
    the numbers are NaN (under 3 points, one dose); never raises for a lack of points."""
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
    fit = {"what": what, "sign": sign, "base": base, "n": n, "n_censored": n_censored,
           "labels": list(rows.index[ok]),
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
# the findings


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

    def by_k(sign, k):
        return ladder[(ladder["sign"] == sign) & (ladder["k"] == k)]

    out["bias_decides_ks"] = [k for k in both
                              if by_k("bias", k)["exploded"].all() and not by_k("control", k)["exploded"].any()]
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


# ----------------------------------------------------------------------------------------------------------------
# the rescue


def rescue_table(root=None):
    """The rescue experiment: one row per committed run of :data:`lpfa.experiments.RESCUE`, beside the run it
    rescues (the dose table's ``bias_x<RESCUE_DOSE>``, same seed and data order, no ``on_warning``) and its FP32
    twin (the dose table's ``fp32``): ``on warning``, ``first warning`` (step, layer, head, measure), ``switches``
    (each layer switched, and when), ``warnings`` (how many), the verdict (``steps``, ``runaway step``, ``explosion
    step``) and ``eval loss @ N``, the last evaluation at or before the rescued runs' last step N (NaN where a run
    stopped earlier). Indexed by label; empty without committed rescue runs."""
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


def rescue_headline(table, dose: pd.DataFrame | None = None) -> str:
    """The rescue in sentences, from :func:`rescue_table`: whether each rescued run exploded where the unrescued
    run did, its first switch, its runaway and its eval loss against the FP32 twin's; then the evidence: one seed per
    row, against the explosion steps of every unrescued biased run at the same dose (``dose``: :func:`dose_table` of
    the committed runs when None), so a rescued run that did not explode by its end is not shown to be safe."""
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
    dose = dose_table(committed_runs()) if dose is None else dose
    same = dose[(dose["k"] == RESCUE_DOSE) & (dose["sign"] == "bias") & (dose["base"] == "paper_untiled")]
    boom = sorted(int(s) for s in same["explosion step"].dropna())
    rescued = table.drop(index=[x for x in (base, "fp32") if x in table.index])
    if boom and len(rescued):
        out.append(f"Each row is one seed: without a switch, the {len(same)} seeds at this dose exploded at steps "
                   f"{', '.join(f'{s:,}' for s in boom)}, so a rescued run that did not explode in "
                   f"{int(rescued['steps'].max()):,} steps may still explode later.")
    return " ".join(out)
