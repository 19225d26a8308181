"""Page 08, tie frequency (Fig. 13): when the share of rows with tied maxima rises before the loss explodes, when the
logits and W_Q norms part from the FP32 twin, and V's sign dominance.

The paper's chain starts with ties: rows of S with several scores at the row max give several P̄ = 1 (Sec. 3.3), whose
BF16 sums bias δ (Eq. 3); the biased δ grows W_Q, and the logits grow with it. ``lpfa.train`` logs, every
``diag_interval`` steps, per layer and head, the tie fraction (rows with more than one score within ε = 1e-3 of the row
max, at the run's own score precision) and the share of V's columns with a dominant sign, the other ingredient of a
biased Ō = P̄V (Fig. 6). A rise is :func:`lpfa.explosion.rise_step` (3× the early level for three records).
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd

from lpfa.compare import divergence_step, head_metric_frame, layer_max
from lpfa.diagnostics import DOMINANT_SIGN
from lpfa.explosion import ExplosionCriterion, explosion_step, rise_step
from lpfa.pages import and_join, plural, provenance_line
from lpfa.params import dict_of, integer, optional, text
from lpfa.plotting import format_table, line_styles, use_style
from lpfa.results import run_dir
from lpfa.run import load_metrics, run_verdict

# the notebook's papermill parameters, checked right after its parameters cell (lpfa.params.check_params)
PARAMS = {
    "experiment": text(nonempty=True), "run": optional(text(nonempty=True)),
    "twins": dict_of(text(), text(nonempty=True), nonempty=True), "reference": text(), "layer": integer(0),
    "v_sign_experiment": text(), "v_sign_twins": dict_of(text(), text(nonempty=True)),
}


def _layer_ties(run) -> pd.DataFrame:
    """Tie fraction of ``run``, mean over heads: one column per layer, indexed by step."""
    return head_metric_frame(run, "tie_fraction").groupby(["step", "layer"]).value.mean().unstack()


def plot_ties(runs: dict):
    """Fig. 13: per run (``{label: run folder}``), each layer's tie fraction (mean over heads) against the step, one
    line per layer, with the training loss (50-step rolling mean) on a second axis."""
    use_style()
    fig, axes = plt.subplots(1, len(runs), figsize=(4.4 * len(runs), 4.6), squeeze=False)
    for ax, (label, d) in zip(axes[0], runs.items()):
        train, _, _ = load_metrics(d)
        f = _layer_ties(d)
        for lay, style in zip(f.columns, line_styles(len(f.columns))):
            ax.plot(f.index, f[lay], lw=1.2, label=f"layer {lay}", **style)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("rows with tied maxima\n(mean over heads)")
        ax2 = ax.twinx()
        ax2.grid(False)
        loss = ax2.plot(train.index, train["loss"].rolling(50, min_periods=1).mean(), color="black", lw=1.0, ls=":",
                        label="training loss (right axis)")[0]  # black dotted: no layer's colour or style
        ax2.set_ylabel("training loss", fontsize=9)
    handles, labels = axes[0, -1].get_legend_handles_labels()
    fig.legend(handles + [loss], labels + [loss.get_label()], fontsize=9, ncol=5, loc="outside lower center")
    return fig


def tie_table(runs: dict) -> pd.DataFrame:
    """Per (run, layer) of ``runs`` (``{label: run folder}``): the tie fraction (mean over heads) over its first five
    records (``early tie fraction``) and at its last (``last``), the step at which it rises (``rise step``,
    :func:`lpfa.explosion.rise_step`; None if it does not) and the run's loss explosion (``explosion step``,
    :class:`lpfa.explosion.ExplosionCriterion`; None if it did not explode)."""
    rows = []
    for label, d in runs.items():
        train, _, _ = load_metrics(d)
        f = _layer_ties(d)
        boom = explosion_step(train["loss"], ExplosionCriterion())
        for lay in f.columns:
            rows.append({"run": label, "layer": lay, "early tie fraction": f[lay].iloc[:5].mean(),
                         "last": f[lay].iloc[-1], "rise step": rise_step(f[lay]), "explosion step": boom})
    return pd.DataFrame(rows).set_index(["run", "layer"])


def tie_display(table: pd.DataFrame):
    """:func:`tie_table` as the page shows it (:func:`lpfa.plotting.format_table`): one row per layer, per run its
    early and last tie fraction and rise step, each run's loss explosion in the caption."""
    runs = list(dict.fromkeys(table.index.get_level_values("run")))
    wide = pd.concat({run: table.loc[run, ["early tie fraction", "last", "rise step"]] for run in runs}, axis=1)
    wide.columns = [f"{run}: {c}" for run, c in wide.columns]
    booms = {run: table.loc[run, "explosion step"].iloc[0] for run in runs}
    caption = "Loss explosion: " + "; ".join(f"{run} at step {int(b):,}" if pd.notna(b) else f"{run} none"
                                             for run, b in booms.items())
    return format_table(wide).set_caption(caption)


def tie_rise_text(runs: dict, table: pd.DataFrame) -> str:
    """Page 08's findings on Fig. 13, a Markdown item per run of ``runs`` (``{label: run folder}``): whether it
    explodes, in which layers the tie fraction rises and first when (``table``: :func:`tie_table`), and the lead time
    from the first rise to the explosion, or how many steps after the rise the run has still not exploded."""
    have = list(dict.fromkeys(table.index.get_level_values("run")))
    missing = [label for label in runs if label not in have]
    if missing:
        raise ValueError(f"runs {missing}: expected runs of the table, {have}")
    lines = []
    for label in runs:
        t = table.loc[label]
        risen = t[t["rise step"].notna()]
        boom = t["explosion step"].iloc[0]
        first = int(risen["rise step"].min()) if len(risen) else None
        if not len(risen):
            after = ""
        elif pd.notna(boom):
            after = f"; lead time {int(boom) - first:,} steps"
        else:
            after = (f"; {int(load_metrics(runs[label])[0].index.max()) - first:,} steps after the rise the run "
                     "has still not exploded")
        lines.append(f"* **{label}**: " + (f"the loss explodes at step {int(boom):,}; " if pd.notna(boom)
                                           else "the loss did not explode; ")
                     + (f"tie fraction rises in {plural(len(risen), 'layer')} "
                        f"{and_join([str(lay) for lay in risen.index])} (first at step {first})" if len(risen)
                        else "no layer's tie fraction rises")
                     + after)
    return "\n".join(lines)


def precursor_events(runs: dict, layer: int, reference: str | None = None, logit_ratio: float = 10.0,
                     wq_ratio: float = 1.25):
    """When did each precursor start, per run (``{label: run_dir}``)? Columns: the rise of the layer's worst-head
    and mean-over-heads tie fraction (:func:`lpfa.explosion.rise_step`), the logit runaway and the explosion
    (:func:`lpfa.run.run_verdict`) and, against the ``reference`` run (e.g. the FP32 twin), the step from
    which the layer's largest logit stays above ``logit_ratio`` × and its largest W_Q norm above ``wq_ratio`` ×
    the reference's for good, and when the W_Q norm first did so for a while (:func:`divergence_step`).
    Steps are None where the event did not happen."""
    rows = {}
    for label, d in runs.items():
        v = run_verdict(d)
        ties = head_metric_frame(d, "tie_fraction")
        ties = ties[ties.layer == layer].groupby("step").value
        row = {"worst-head ties rise": rise_step(ties.max()), "mean ties rise": rise_step(ties.mean()),
               "logit runaway": v["runaway_step"] if v["runaway_layer"] in (None, layer) else None,
               "explosion": v["explosion_step"]}
        if reference is not None and label != reference:
            row[f"logit > {logit_ratio:g}× {reference}"] = divergence_step(
                layer_max(d, "max_logit", layer), layer_max(runs[reference], "max_logit", layer), logit_ratio)
            wa, wb = layer_max(d, "wq_spectral_norm", layer), layer_max(runs[reference], "wq_spectral_norm", layer)
            row[f"W_Q > {wq_ratio:g}× {reference}"] = divergence_step(wa, wb, wq_ratio)
            row[f"W_Q first > {wq_ratio:g}× {reference}"] = divergence_step(wa, wb, wq_ratio, permanent=False)
        rows[label] = row
    cols = list(dict.fromkeys(k for r in rows.values() for k in r))
    return pd.DataFrame([[r.get(c) for c in cols] for r in rows.values()], index=list(rows), columns=cols, dtype=object)


def sequence_text(events: pd.DataFrame, layer: int, reference: str) -> str:
    """:func:`precursor_events` in words, a Markdown item per run: its events in ``layer`` in the order they happened
    (the transient W_Q lead left out), and a note where the W_Q norm led the ``reference`` twin's for a while before
    the worst head's ties rose but parted for good only after them, as in the paper's chain (ties, then W_Q)."""
    lines = []
    for label, r in events.iterrows():
        steps = {k: v for k, v in r.items() if v is not None and not k.startswith("W_Q first")}
        if not steps:
            lines.append(f"* **{label}**: none of these events happens in layer {layer}.")
            continue
        in_order = sorted(steps.items(), key=lambda kv: kv[1])
        lines.append(f"* **{label}**: " + " → ".join(f"{k} ({v:,})" for k, v in in_order) + ".")
        first = next((v for k, v in r.items() if k.startswith("W_Q first") and v is not None), None)
        for_good = next((v for k, v in steps.items() if k.startswith("W_Q")), None)
        tie = steps.get("worst-head ties rise")
        if first is not None and tie is not None and first < tie and (for_good is None or for_good > tie):
            lines.append(f"  Before that, its W_Q norm led the {reference} twin's by the same margin for a while from "
                         f"step {first:,}, and the lead closed again; the lasting gap opens after the ties, as in the "
                         "paper's chain. The twin is a single, not bit-reproducible trajectory (the spectral-norm "
                         "page); the seeds page shows how far runs of other seeds scatter, so such a transient is weak "
                         "evidence.")
    return "\n".join(lines)


def v_sign_frames(experiment: str, twins: dict) -> tuple:
    """``(folder, {label: frame})``: the latest run folder of ``experiment`` and, per twin of ``twins`` (``{label:
    twin folder name}``) that logged it, its :func:`head_metric_frame` of ``v_sign_dominance``; twins made before
    ``lpfa.train`` logged it, or missing, are left out. ``(None, {})`` when ``experiment`` is "" (no such section)."""
    if not experiment:
        return None, {}
    folder = run_dir(experiment, None)
    frames = {}
    for label, name in twins.items():
        try:
            frames[label] = head_metric_frame(folder / name, "v_sign_dominance")
        except (ValueError, FileNotFoundError):  # a run made before lpfa.train logged it, or no such twin
            pass
    return folder, frames


def plot_v_sign(frames: dict):
    """Page 08's figure: per run (label → :func:`head_metric_frame` of ``v_sign_dominance``), the share of V's columns
    with a dominant sign, mean over heads, one line per layer against the step."""
    use_style()
    fig, axes = plt.subplots(1, len(frames), figsize=(4.4 * len(frames), 4.0), squeeze=False, sharey=True)
    for ax, (label, f) in zip(axes[0], frames.items()):
        per_layer = f.groupby(["step", "layer"]).value.mean().unstack()
        for lay, style in zip(per_layer.columns, line_styles(len(per_layer.columns))):
            ax.plot(per_layer.index, per_layer[lay], lw=1.2, label=f"layer {lay}", **style)
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("step")
    axes[0, 0].set_ylabel("V columns with a dominant sign\n(mean over heads)")  # (the panels share it)
    handles, labels = axes[0, -1].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=9, ncol=6, loc="outside lower center")
    return fig


def v_sign_text(frames: dict, layer: int) -> str:
    """Page 08's findings on V's sign structure: per run (label → :func:`head_metric_frame` of ``v_sign_dominance``), a
    Markdown item with the share of one-signed V columns at its last record (mean over layers and heads, in ``layer``,
    over the run's second half in ``layer``, the most one-signed head) and at its first; with both "bf16" and "fp32",
    the ratio of their second-half shares in ``layer`` and what it says (above 1.5: BF16 training builds the structure;
    below 1/1.5: the FP32 twin has more; else too close to tell apart in one pair)."""
    lines, at_layer = [], {}
    for label, f in frames.items():
        first, last = f[f.step == f.step.min()], f[f.step == f.step.max()]
        top = last.loc[last.value.idxmax()]
        late = f[(f.layer == layer) & (f.step > f.step.max() / 2)]  # one record is noisy: the second half of the run
        at_layer[label] = float(late.value.mean())
        at = last[last.layer == layer].value
        lines.append(f"* **{label}** at step {int(last.step.iloc[0]):,}: {last.value.mean():.1%} of V's columns "
                     f"one-signed on average over layers and heads, {at.mean():.1%} in layer {layer} (at most "
                     f"{at.max():.1%}; {at_layer[label]:.1%} over the run's second half), the most in layer "
                     f"{int(top['layer'])}, head {int(top['head'])} ({top['value']:.1%}); at step "
                     f"{int(first.step.iloc[0]):,}: {first.value.mean():.1%} on average.")
    text = ("\n".join(lines) + "\n\nThese shares are of the probe batch each run logged as it trained "
            "(`lpfa.diagnostics.probe_record`); the structure page measures sequences of its own, so its shares at the "
            "same step differ.")
    if {"bf16", "fp32"} <= set(at_layer):
        ratio = at_layer["bf16"] / max(at_layer["fp32"], 1e-12)
        verdict = ("V's sign structure is part of what BF16 training builds there." if ratio > 1.5 else
                   "the FP32 twin has more of them, so they are not what sets the BF16 run apart." if ratio < 1 / 1.5
                   else "within 1.5× of each other, too close in one run pair to say that one-signed V columns set "
                        "the BF16 run apart.")
        text += (f"\n\nIn layer {layer}, over the second half of the runs, the BF16 run has {ratio:.1f} times the FP32 "
                 f"twin's share of one-signed V columns: {verdict}")
    return text


def v_sign_note(experiment: str, folder, frames: dict, layer: int) -> str:
    """Page 08's text on V's sign structure (:func:`v_sign_frames`' ``folder`` and ``frames`` of ``experiment``):
    the run it is read from and the dominance threshold (:data:`lpfa.diagnostics.DOMINANT_SIGN`) before
    :func:`v_sign_text`, or a note that the runs did not log it; "" when ``experiment`` is "" (no such section)."""
    if not experiment:
        return ""
    if frames:
        return (f"Run `{folder.name}` of `results/{experiment}` (a share of keys of at least {DOMINANT_SIGN:.0%} "
                "with one sign, on the same validation batch as the ties).\n\n" + v_sign_text(frames, layer))
    return (f"**Not logged** by the runs of `results/{experiment}/{folder.name}`: `lpfa.train` logs "
            "`v_sign_dominance` with its other diagnostics, and runs made before it did lack it; rerun the twins "
            "(`scripts/gpu/twins.sh`) to fill it.")


def page_texts(experiment: str, runs: dict, table: pd.DataFrame, events: pd.DataFrame, layer: int, reference: str,
               v_sign: tuple, v_sign_experiment: str) -> dict:
    """Every sentence page 08 glues into its prose, by name: the twins' run (``runs`` of ``experiment``), the rise of
    their ties (``table``: :func:`tie_table`), the sequence of precursor events (``events``:
    :func:`precursor_events`) and V's sign dominance (``v_sign``: :func:`v_sign_frames` of ``v_sign_experiment``)."""
    folder = runs["bf16"].parent
    vfolder, vframes = v_sign
    return {"tie_run": f"`{folder.name}`", "tie_what": provenance_line(experiment, folder),
            "tie_frequency_text1_6": tie_rise_text(runs, table),
            "tie_frequency_text1_9": sequence_text(events, layer, reference),
            "p08_note1": v_sign_note(v_sign_experiment, vfolder, vframes, layer)}
