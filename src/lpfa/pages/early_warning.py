"""Page 15, early warning: the thresholds, the monitor replayed over the committed runs, what the monitor costs, and
the doctor's verdicts on the paper recipe's checkpoints.

**The replay** (:func:`replay_logged`, :func:`warning_table`) feeds each committed run's logged diagnostics through
the monitor's one decision rule (:func:`lpfa.monitor.crossings`), giving its first warning and that warning's lead over
the runaway or the explosion, and the false alarms of the runs where neither happened. The logged tie fraction is of the
scores as the run computed them: it stands for ``tie_fraction_bf16`` only in layers whose scores are BF16
(:func:`lpfa.run.layer_precision`). On the page the thresholds are learnt again from the same runs at the page's
parameters (:func:`replay_committed`), so its numbers are in-sample.

**What the replay finds** (:func:`warning_summary`): runs that neither ran away nor exploded are of two kinds,
FP32-attention runs (true negatives: a warning is a false alarm) and low-precision runs that did not fail within their
steps (many show the precursor on the isolation page, so a warning there may be right).

**The cost** (:func:`monitor_overhead_table`, :func:`overhead_text`): each committed run of
``benchmarks/monitor_overhead.py`` against :data:`lpfa.monitor.OVERHEAD_GOAL`, judged by the amortised capture
(:func:`lpfa.monitor.amortised_overhead`).
"""

from __future__ import annotations

from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns

from lpfa import alarms, doctor
from lpfa.checkpoints import read_json
from lpfa.compare import head_metric_frame
from lpfa.compare import outcome as compare_outcome
from lpfa.dose import rescue_headline
from lpfa.experiments import FP32_RERUN, RESCUE_DOSE, STABILISER_RERUN
from lpfa.monitor import OVERHEAD_GOAL, add_derived, amortised_overhead, crossings, default_thresholds
from lpfa.params import integer, real
from lpfa.plotting import COLORS, format_table, use_style
from lpfa.results import experiment_rows
from lpfa.results import runs as launches
from lpfa.run import Run, layer_precision, run_verdict

# the notebook's papermill parameters, checked right after its parameters cell (lpfa.params.check_params)
PARAMS = {"max_fpr": real(0, 1, hi_open=True), "lead_steps": integer(1)}

DOCTOR_LABELS = (STABILISER_RERUN, FP32_RERUN, "bf16_qknorm")  # the paper recipe's runs with doctor reports
REPLAY_COLUMNS = ["attention", "policy", "runaway step", "explosion step", "first warning step", "lead", "warning"]


# --------------------------------------------------------------------------------------------------
# the replay of logged runs


def logged_frame(run_dir) -> pd.DataFrame:
    """A run's logged diagnostics (:func:`lpfa.compare.head_metric_frame`) as the monitor's measures: a DataFrame
    (step, layer, head, :data:`lpfa.monitor.MEASURE_COLUMNS`); ``tie_fraction_bf16`` is the logged tie fraction in
    layers whose scores are BF16 (:func:`lpfa.run.layer_precision`), NaN elsewhere (the run logged ties of FP32
    scores)."""
    key = ["step", "layer", "head"]
    cols = {}
    for name, metric in (("max_logit", "max_logit"), ("tie_fraction_bf16", "tie_fraction"),
                         ("wq_spectral_norm", "wq_spectral_norm")):
        cols[name] = head_metric_frame(run_dir, metric).drop_duplicates(key, keep="last").set_index(key)["value"]
    frame = pd.DataFrame(cols).reset_index()
    precision = dict(enumerate(layer_precision(Run(run_dir))))
    frame.loc[frame["layer"].map(precision) != "bf16", "tie_fraction_bf16"] = np.nan
    return add_derived(frame)


def first_warning(run_dir, thresholds: dict | None = None):
    """The first crossing of a run's logged diagnostics (a row of :func:`lpfa.monitor.crossings` as a dict: step,
    layer, head, measure, level, value, threshold), or None. ``thresholds`` default to the committed ones."""
    hits = crossings(logged_frame(run_dir), default_thresholds() if thresholds is None else thresholds)
    if hits.empty:
        return None
    r = hits.iloc[0]
    return {"step": int(r["step"]), "layer": int(r["layer"]), "head": int(r["head"]), "measure": r["measure"],
            "level": r["level"], "value": float(r["value"]), "threshold": float(r["threshold"])}


def replay_logged(run_dir, thresholds: dict | None = None) -> int | None:
    """The step at which :class:`lpfa.monitor.AttentionMonitor` would first have warned on a run, its logged
    diagnostics fed through the monitor's decision (:func:`lpfa.monitor.crossings`); None if it never would."""
    hit = first_warning(run_dir, thresholds)
    return None if hit is None else int(hit["step"])


def warning_table(root=None, thresholds: dict | None = None) -> pd.DataFrame:
    """One row per training run with diagnostics under ``root`` (:func:`lpfa.alarms.training_runs`), indexed by
    experiment/run/label: ``runaway step``, ``explosion step`` (:func:`lpfa.run.run_verdict`), ``first warning step``
    and what warned, ``lead`` (steps from it to the runaway, else the explosion; negative: after it), ``warned
    before`` (lead > 0), ``false alarm`` (neither failure, but a warning), ``attention`` ("fp32" where every layer's
    is FP32, else "low precision") and ``policy``."""
    thr = default_thresholds() if thresholds is None else thresholds
    rows = {}
    for d in alarms.training_runs(root):
        try:
            hit = first_warning(d, thr)
        except (ValueError, KeyError, FileNotFoundError):  # a run without per-head diagnostics
            continue
        v = run_verdict(d)
        ra, ex = v["runaway_step"], v["explosion_step"]
        fail = ra if ra is not None else ex
        warn = None if hit is None else int(hit["step"])
        lead = fail - warn if fail is not None and warn is not None else None
        fp32 = all(p == "fp32" for p in layer_precision(Run(d)))
        rows["/".join(Path(d).parts[-3:])] = {
            "policy": v["policy"], "attention": "fp32" if fp32 else "low precision", "runaway step": ra,
            "explosion step": ex, "first warning step": warn,
            "warning": None if hit is None else
            f"layer {hit['layer']} head {hit['head']} {hit['measure']} ({hit['level']})",
            "lead": lead, "warned before": lead is not None and lead > 0,
            "false alarm": fail is None and warn is not None}
    out = pd.DataFrame.from_dict(rows, orient="index")
    for c in ("runaway step", "explosion step", "first warning step", "lead"):
        if c in out:
            out[c] = out[c].astype("Int64")
    return out


def warning_summary(table: pd.DataFrame) -> dict:
    """The headline of :func:`warning_table`: failed runs (ran away or exploded), how many were warned before,
    the median lead; the runs where neither happened and their warnings, split into FP32-attention runs (``fp32 false
    alarms`` of ``fp32 neither``) and low-precision runs (``low-precision neither warned``)."""
    failed = table["runaway step"].notna() | table["explosion step"].notna()
    warned = table["warned before"] & failed
    lead = table.loc[warned, "lead"].astype(float)
    neither_fp32 = ~failed & (table["attention"] == "fp32")
    neither_lp = ~failed & (table["attention"] != "fp32")
    return {"runs": int(len(table)), "failed": int(failed.sum()), "ran away": int(table["runaway step"].notna().sum()),
            "exploded": int(table["explosion step"].notna().sum()), "warned before": int(warned.sum()),
            "median lead": float(lead.median()) if len(lead) else None, "neither": int((~failed).sum()),
            "false alarms": int(table["false alarm"].sum()),
            "fp32 neither": int(neither_fp32.sum()),
            "fp32 false alarms": int((table["false alarm"] & neither_fp32).sum()),
            "low-precision neither": int(neither_lp.sum()),
            "low-precision neither warned": int((table["false alarm"] & neither_lp).sum())}


def replay_committed(lead: int = alarms.LEAD_STEPS, max_fpr: float = alarms.MAX_FPR, root=None):
    """The page's replay: ``(samples, thresholds, table)``, the labelled samples of the runs under ``root``
    (:func:`lpfa.alarms.labelled_samples` with ``lead``), the thresholds learnt from them at ``max_fpr``
    (:func:`lpfa.alarms.derive`) and those runs replayed with them (:func:`warning_table`). A one-line error for a
    ``lead`` that is not an int >= 1 or a ``max_fpr`` outside [0, 1)."""
    lead = integer(1).check("lead", lead)
    max_fpr = real(0, 1, hi_open=True).check("max_fpr", max_fpr)
    samples = alarms.labelled_samples(root, lead=lead)
    thr = alarms.derive(samples, max_fpr, lead)
    return samples, thr, warning_table(root, thresholds=thr)


def headline(s: dict) -> str:
    """The page's headline from :func:`warning_summary` ``s``: the failed runs warned before they failed, the median
    lead, and the warnings of the FP32-attention and low-precision runs where neither happened."""
    return (f"**Replayed through the monitor, the committed runs' diagnostics warn {s['warned before']} of the "
            f"{s['failed']} runs that ran away or exploded before they did** (median {s['median lead']:,.0f} steps "
            f"ahead), {s['fp32 false alarms']} of the {s['fp32 neither']} FP32-attention runs where neither "
            f"happened (false alarms), and {s['low-precision neither warned']} of the {s['low-precision neither']} "
            "low-precision runs where neither happened within their steps. The thresholds are strict by design, so "
            "most precursor samples go unflagged (the false-negative rates below).")


def threshold_table(thr: dict) -> pd.DataFrame:
    """One row per measure of ``thr`` (:func:`lpfa.alarms.thresholds`' format) with a learnt precursor level: the
    threshold, its false-positive and false-negative rates and the sample counts."""
    rows = {m: {"threshold": v["precursor"]["value"], "false-positive rate": v["precursor"]["fpr"],
                "false-negative rate": v["precursor"]["fnr"], "positives": v["precursor"]["positives"],
                "negatives": v["precursor"]["negatives"]} for m, v in thr.items() if "precursor" in v}
    return pd.DataFrame.from_dict(rows, orient="index")


def replay_table(table: pd.DataFrame) -> pd.DataFrame:
    """:func:`warning_table` as the page shows it: :data:`REPLAY_COLUMNS`, sorted by attention, then runaway step."""
    return table[REPLAY_COLUMNS].sort_values(["attention", "runaway step"])


def replay_summary(table: pd.DataFrame) -> pd.DataFrame:
    """:func:`warning_table` in a few rows, per attention precision and outcome (:func:`lpfa.compare.outcome`,
    strongest first: the loss exploded; the logits ran away; neither): the runs, how many the monitor warned, how many
    of those ahead of the runaway, else the explosion, and the median lead (steps) of those."""
    outcome = [compare_outcome(pd.notna(e), r if pd.notna(r) else None)
               for e, r in zip(table["explosion step"], table["runaway step"])]
    rows = {}
    for (att, out), g in table.groupby([table["attention"], pd.Series(outcome, index=table.index)], sort=True):
        warned = g["first warning step"].notna()
        ahead = g["warned before"] & warned
        lead = g.loc[ahead, "lead"].astype(float)
        rows[(att, out)] = {"runs": len(g), "warned": int(warned.sum()),
                            "warned ahead": None if out == "neither" else int(ahead.sum()),
                            "median lead (steps)": lead.median() if len(lead) else None}
    out = pd.DataFrame.from_dict(rows, orient="index")
    out.index.names = ["attention", "outcome"]
    return out


def replay_display(table: pd.DataFrame):
    """:func:`replay_summary` as the page shows it (:func:`lpfa.plotting.format_table`)."""
    return format_table(replay_summary(table))


def full_replay_table():
    """The full table behind :func:`replay_summary` for :mod:`lpfa.pages.tables`: :func:`replay_table` of every
    committed run replayed at the default lead and false-positive rate, what it is, and the experiments it read."""
    _, _, table = replay_committed()
    what = (f"Page 15's full table: every committed run with per-head diagnostics replayed through the monitor with "
            f"thresholds learnt at lead {alarms.LEAD_STEPS:,} steps and at most {alarms.MAX_FPR:.1%} false positives")
    return replay_table(table), what, [f"results/{e}" for e in sorted({k.split("/")[0] for k in table.index})]


def replay_text() -> str:
    """What page 15's replay table (:func:`replay_display`) shows, with a link to every run's row."""
    from lpfa.pages.tables import link

    return ("Per attention precision and outcome: the runs, how many the monitor warned, how many of those ahead of "
            "the runaway, else the explosion (a warning in a run where neither happened is a false alarm), and the "
            "median lead of the "
            "warnings ahead. Every run's row, with its steps and the head that warned, is in "
            f"{link('early_warning_replay')} (at the default lead and false-positive rate).")


def plot_first_warnings(table: pd.DataFrame):
    """The failed runs of :func:`warning_table`: the monitor's first warning step against the failure step (the
    runaway, else the explosion), by attention precision, with the diagonal where the warning meets the failure."""
    use_style()
    failed = table[table["runaway step"].notna() | table["explosion step"].notna()].copy()
    failed["failure step"] = failed["runaway step"].fillna(failed["explosion step"]).astype(float)
    failed["first warning"] = failed["first warning step"].astype(float)
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    sns.scatterplot(failed, x="failure step", y="first warning", hue="attention", style="attention", s=60, ax=ax,
                    palette={"low precision": COLORS["bf16"], "fp32": COLORS["fp32"]})
    top = float(failed[["failure step", "first warning"]].max().max()) * 1.05
    ax.plot([0, top], [0, top], ls=":", color="0.3", lw=1, label="warning = runaway (or explosion)")
    ax.set_xlabel("runaway step (else explosion step)")
    ax.set_ylabel("first warning step")
    ax.legend(fontsize=9)
    ax.set_title("runs whose logits ran away or loss exploded: the monitor's first warning", fontsize=10)
    return fig


# --------------------------------------------------------------------------------------------------
# the cost


ONE_OFF = "one-off costs (lazy imports, loading the measures' CUDA kernels) that a training run pays once"


def monitor_overhead_table(root=None) -> pd.DataFrame:
    """One row per committed ``benchmarks/monitor_overhead.py`` run (``results/monitor_overhead``), oldest first:
    commit, device, setting, step times without and with the monitor, ``overhead`` (ratio of means), ``amortised
    capture`` (:func:`lpfa.monitor.amortised_overhead`), ``goal met`` (both within
    :data:`lpfa.monitor.OVERHEAD_GOAL`), ``capture extra ms`` and ``first capture ms`` (NaN where not timed apart).
    Empty without committed runs."""
    try:
        folders = launches("monitor_overhead", root)
    except FileNotFoundError:
        return pd.DataFrame()
    rows = {}
    for d in folders:
        b = read_json(d / "monitor_overhead.json", ": expected what benchmarks/monitor_overhead.py writes")
        amortised = amortised_overhead(b)
        rows[d.name] = {"commit": b["provenance"]["git_commit"][:7], "device": b["device"],
                        "setting": f"{b['model']}, B = {b['batch']}, T = {b['seq']}", "every": b["every"],
                        "plain ms": b["plain_ms"], "monitored ms": b["monitored_ms"], "overhead": b["overhead"],
                        "amortised capture": amortised, "capture extra ms": b["capture_extra_ms"],
                        "goal met": max(b["overhead"], amortised) <= OVERHEAD_GOAL,
                        "first capture ms": b.get("first_capture_step_ms", float("nan"))}
    return pd.DataFrame(rows).T


def overhead_text(cost: pd.DataFrame) -> str:
    """The page's finding on the monitor's cost, from :func:`monitor_overhead_table` ``cost``: the latest run's
    capture cost, amortised and as the ratio of means, against :data:`lpfa.monitor.OVERHEAD_GOAL`; the spread over
    the runs of its commit; the process's first capture."""
    if cost.empty:
        return "No run of `benchmarks/monitor_overhead.py` is committed yet."
    last = cost.iloc[-1]
    same = cost[cost["commit"] == last["commit"]]
    text = (f"**At every {last['every']} steps one capture costs {last['capture extra ms']:,.0f} ms over a plain "
            f"{last['plain ms']:.1f} ms step on {last['device']} ({last['setting']}): "
            f"{last['amortised capture']:.1%} of the step time spread over {last['every']} steps "
            f"({last['overhead']:.1%} as the ratio of the segments' means), "
            f"{'within' if last['goal met'] else 'above'} the {OVERHEAD_GOAL:.0%} goal.**")
    if len(same) > 1:
        met = int(same["goal met"].sum())
        text += (f" The {len(same)} runs of {last['commit']} measured the amortised capture between "
                 f"{same['amortised capture'].min():.2%} and {same['amortised capture'].max():.2%}, and the ratio of "
                 f"means between {same['overhead'].min():.2%} and {same['overhead'].max():.2%}: the ratio carries the "
                 f"drift between segments; {met} of the {len(same)} {'meets' if met == 1 else 'meet'} the goal on "
                 "both.")
    ms = last["first capture ms"]
    text += (f" The process's first capture step, timed apart, took {ms:,.0f} ms: {ONE_OFF}." if ms == ms else
             f" That mean includes the process's first capture, with its {ONE_OFF}.")
    return text


# --------------------------------------------------------------------------------------------------
# the doctor's reports


def doctor_reports(labels=DOCTOR_LABELS, root=None) -> dict:
    """``{label: (step, report)}``: the latest ``lpfa doctor`` report (:attr:`lpfa.run.Run.doctor_reports`) of each
    of ``labels`` among the stabiliser experiment's runs under ``root`` that has one."""
    reports = {label: Run(d).doctor_reports for label, d in experiment_rows("stabilisers", list(labels), root).items()}
    return {label: (max(reps), reps[max(reps)]) for label, reps in reports.items() if reps}


def doctor_text(reports: dict, thr: dict) -> str:
    """The page's sentence on :func:`doctor_reports` ``reports``: per run, its step and how many heads
    :func:`lpfa.doctor.report_table` judges runaway, precursor and no alarm with thresholds ``thr``; says so where
    no report, or not the FP32 twin's, is committed."""
    said = []
    for label, (step, rep) in reports.items():
        c = doctor.verdict_counts(doctor.report_table(rep, thr))
        said.append(f"`{label}` at step {step:,}: {c['runaway']} runaway, {c['precursor']} precursor and "
                    f"{c['no alarm']} no-alarm heads of {sum(c.values())}")
    missing = [] if FP32_RERUN in reports else [f"The FP32 twin's report (`{FP32_RERUN}`) is not committed yet."]
    return (("With the paper's GPT-2 S recipe (the stabilisers page): " + "; ".join(said) + ". " if said else
             "No doctor report is committed yet. ") + " ".join(missing))


def doctor_figures(reports: dict, thr: dict) -> list:
    """One closed figure per report of :func:`doctor_reports` ``reports``: its heads' verdicts with thresholds
    ``thr`` (:func:`lpfa.doctor.plot_verdicts`), titled with the run and the step; show each with ``display``."""
    figs = []
    for label, (step, rep) in reports.items():
        fig = doctor.plot_verdicts(doctor.report_table(rep, thr))
        fig.axes[0].set_title(f"{label}, step {step:,}: verdict per head", fontsize=10)
        plt.close(fig)
        figs.append(fig)
    return figs


def page_texts(samples, thr: dict, table: pd.DataFrame, rescue: pd.DataFrame, cost: pd.DataFrame, reports: dict,
               lead_steps: int, max_fpr: float) -> dict:
    """Every sentence and number page 15 glues into its prose, by name: the replay (``samples``, ``thr``, ``table``:
    :func:`replay_committed`), the rescue runs (:func:`lpfa.dose.rescue_table`), the monitor's cost
    (:func:`monitor_overhead_table`) and the doctor's reports (:func:`doctor_reports`)."""
    s = warning_summary(table)
    return {"ew_headline": headline(s), "ew_runs": s["runs"], "ew_fpr": f"{max_fpr:.1%}", "ew_lead": f"{lead_steps:,}",
            "ew_samples": f"{len(samples):,}", "ew_rescue": rescue_headline(rescue), "ew_dose": f"{RESCUE_DOSE}",
            "ew_overhead": overhead_text(cost), "ew_doctor": doctor_text(reports, thr), "ew_table": replay_text()}
