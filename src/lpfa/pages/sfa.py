"""Page 09, SFA (Fig. 7): whether shifting the tied row max keeps the run, at the paper's recipe, with AdamW and with
Muon, at a second model size and against an amplified δ bias; and what SFA does to the rows it touches.

SFA (Sec. 4, Eq. 6) replaces a tied row's max ``row_max`` > 0 by β·``row_max``, so that no P̄ = exp(S − m) equals 1
and the biased rounding of Ō = P̄V cannot start. The authors' code clamps each row sum at l ≥ 1e-10: once
(β − 1)·``row_max`` exceeds about 23 the row's output shrinks by l / 1e-10, and far beyond every P̄ underflows.
:mod:`lpfa.sfa_sweep` measures, per checkpoint, layer and β, the share of rows SFA touches, that the clamp attenuates,
silences (factor < 1e-3) and zeroes; this page reads those sweeps (:func:`lpfa.sfa_sweep.sweep_frame`) next to the
runs' verdicts (:func:`lpfa.run.run_verdict`, :func:`lpfa.compare.experiment_table`).
"""

from __future__ import annotations

import json

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
import torch

from lpfa.compare import LOGIT_APART, experiment_table, head_metric_frame, layer_max, plot_losses
from lpfa.data import GPU_CORPUS_TRAIN_TOKENS
from lpfa.dose import committed_runs, dose_findings, dose_table
from lpfa.experiments import MUON_LONG, MUON_LR2, SFA_MUON, SIZES
from lpfa.model import GPT, GPTConfig
from lpfa.pages import RERUN_PAGE, and_join, provenance_line
from lpfa.pages.loss_explosion import recipe_fates
from lpfa.params import dict_of, integer, optional, text
from lpfa.plotting import color_of, format_table, use_style
from lpfa.results import experiment_rows, run_dir
from lpfa.run import Run, load_metrics, run_verdict
from lpfa.scaling import committed_speed, minutes_for, run_price, tokens_per_step, wall_minutes
from lpfa.sfa_sweep import sweep_frame
from lpfa.train import PRESETS

# the notebook's papermill parameters, checked right after its parameters cell (lpfa.params.check_params)
PARAMS = {
    "experiment": text(nonempty=True), "run": optional(text(nonempty=True)),
    "twins": dict_of(text(), text(nonempty=True), required=("bf16", "sfa", "fp32")),
    "layer": integer(0), "long_experiment": text(), "planned_steps": integer(1), "gpus": integer(1),
    "gpt2m_steps": integer(1), "recipe_experiment": text(),
    "recipe_twins": dict_of(text(), text(nonempty=True), required=("bf16", "sfa", "fp32")),
}

# steps of one GPT-2 M run in Fig. 7c's price: past every GPT-2 S explosion at the recipe (4,883 to 5,818); the
# scorecard's row and page 09's default (its gpt2m_steps parameter)
GPT2M_STEPS = 6_000
VERDICT_COLUMNS = ["policy", "optimizer", "steps", "exploded", "explosion_step"]  # of :func:`twin_verdicts`, shown

SWEPT = ("sfa", "attenuated", "silenced", "zeroed")  # the shares of rows a β sweep measures (lpfa.sfa_sweep)

# Fig. 7 again with Muon and at GPT-2 S's size: experiment -> (its rows, the FP32 row each is held against, preset)
SECOND_LOOKS = {"sfa_muon": (SFA_MUON, "fp32_muon", "repro"), "sizes": (SIZES, "fp32_gpt2s", "gpt2-s")}


def recipe_runs(experiment: str, twins: dict) -> dict:
    """``{label: run folder}`` of Fig. 7's twins at the paper's recipe: those of ``twins`` (``{label: twin folder
    name}``) committed in any run folder of ``experiment`` (:func:`lpfa.results.experiment_rows`, each from the latest
    that has it); empty when ``experiment`` is "" (no such section) or not committed (the page says it is not run)."""
    rows = experiment_rows(experiment) if experiment else {}  # {} where it is not committed: the page says so
    return {label: rows[name] for label, name in twins.items() if name in rows}


def recipe_text(recipe: dict, twins: dict, experiment: str, found: dict | None) -> str:
    """Page 09's opening finding: :func:`sfa_text` of the recipe twins' :func:`sfa_findings` (``found``) when all three
    of ``twins`` are in ``recipe`` (:func:`recipe_runs`), else which of them ``results/<experiment>`` has so far."""
    if len(recipe) == 3:
        return sfa_text(found, Run(recipe["sfa"]).model_config().n_layer)
    return (f"**Fig. 7 is not run at the paper's recipe yet:** of {sorted(twins.values())}, "
            f"`results/{experiment or '-'}` has {sorted(twins[k] for k in recipe)}. "
            "The sections below validate SFA on the `repro` preset's logit runaway.")


def recipe_provenance(recipe: dict, experiment: str) -> str:
    """Where each of the three recipe twins (:func:`recipe_runs`) ran: run folder, device, commit and date, from its
    own config's provenance; "" unless all three are committed."""
    if len(recipe) != 3:
        return ""
    prov = {label: Run(d).config["provenance"] for label, d in recipe.items()}  # each run's own record
    return ("Runs (`results/" + experiment + "/`): " + "; ".join(
        f"`{d.parent.name}/{d.name}` ({prov[label]['device']}, commit `{prov[label]['git_commit'][:7]}`, "
        f"{prov[label]['date_utc'][:10]})" for label, d in recipe.items())
        + ". The run folders' `provenance.json` give the commands.")


def loss_figure(runs: dict, smooth: int, top: float, title: str = ""):
    """:func:`lpfa.compare.plot_losses` of ``runs`` (``{label: run folder}``, ``smooth``-step rolling mean) with the
    loss axis cut at ``top`` (an exploded run would flatten the others), titled ``title``."""
    fig = plot_losses(runs, smooth=smooth)
    ax = fig.axes[0]
    ax.set_ylim(top=min(ax.get_ylim()[1], top))
    if title:
        ax.set_title(title, fontsize=9)
    return fig


def plot_recipe_losses(recipe: dict, found: dict):
    """Fig. 7 at the paper's recipe: the three twins' losses (:func:`loss_figure`, 200-step mean, cut at 7), with the
    BF16 twin's loss explosion (``found``: :func:`sfa_findings`) as a dotted line where it exploded."""
    fig = loss_figure(recipe, smooth=200, top=7)
    ax = fig.axes[0]
    if found["explosion step"]["bf16"] is not None:
        ax.axvline(found["explosion step"]["bf16"], ls=":", color="0.3", label="bf16 explodes")
        ax.legend(fontsize=9)
    return fig


def layer_peaks(runs: dict, metric: str = "max_logit", verdicts: dict | None = None):
    """Long DataFrame (run, layer, value): each layer's largest ``metric`` over its heads and over the diagnostics steps
    before the run's loss explosion (every step if it did not explode), as :func:`sfa_findings` counts runaway layers.
    ``verdicts``: ``{label: run_verdict(run)}`` where the caller has them already."""
    rows = []
    for label, d in runs.items():
        f = head_metric_frame(d, metric)
        boom = ((verdicts or {}).get(label) or run_verdict(d))["explosion_step"]
        if boom is not None:
            f = f[f.step < boom]
        rows.append(f.groupby("layer").value.max().rename("value").reset_index().assign(run=label))
    return pd.concat(rows, ignore_index=True)


def plot_layer_peaks(runs: dict, metric: str = "max_logit", threshold: float | None = 1000.0, ax=None):
    """:func:`layer_peaks` as bars, one per (layer, run) on a log axis, in each run's mode colour with hatching for the
    low-precision runs; ``threshold`` (the runaway criterion's logit) as a dotted line."""
    use_style()
    frame = layer_peaks(runs, metric)
    if ax is None:
        _, ax = plt.subplots(figsize=(7.5, 3.4))
    sns.barplot(frame, x="layer", y="value", hue="run", palette={label: color_of(label) for label in runs}, ax=ax,
                edgecolor="black", linewidth=0.4, saturation=1)
    for bars, label in zip(ax.containers, runs):
        if not label.startswith("fp32"):
            for bar in bars:
                bar.set_hatch("//")
    ax.set_yscale("log")
    if threshold is not None:
        ax.axhline(threshold, ls=":", color="0.3", lw=1)
        ax.text(ax.get_xlim()[1], threshold, f" {threshold:,.0f}", va="center", ha="left", fontsize=9, color="0.3")
    ax.set_ylabel("largest attention logit" if metric == "max_logit" else metric.replace("_", " "))
    ax.set_title("each layer's peak before the run's explosion (whole run if none)", fontsize=10)
    ax.legend(handles=[c.patches[0] for c in ax.containers], labels=list(runs), title=None, fontsize=9)
    return ax.figure


def sfa_findings(runs: dict, smooth: int = 200, logit: float = 1000.0) -> dict:
    """SFA against its twins (``{"bf16": dir, "fp32": dir, "sfa": dir}``, same seed and data order), the Fig. 7 check:
    ``steps``, ``explosion step`` and ``runaway`` ((step, layer), or None) of each run (:func:`lpfa.run.run_verdict`);
    ``loss step``, the last step the SFA and FP32 runs both trained, and each one's training loss there (``loss``, mean
    over ``smooth`` steps); ``val step``, their last evaluation by then, and each one's validation loss there
    (``val loss``), with the times the corpus had been seen by then (``epochs``, of ``corpus tokens``); per run,
    ``runaway layers``: the layers whose largest attention logit exceeded ``logit`` at a diagnostics step before the
    run's explosion (:func:`layer_peaks`)."""
    out = {"steps": {}, "explosion step": {}, "runaway": {}, "loss": {}, "runaway layers": {}}
    verdicts = {label: run_verdict(d) for label, d in runs.items()}
    peaks = layer_peaks(runs, verdicts=verdicts)
    for label, v in verdicts.items():
        out["steps"][label], out["explosion step"][label] = v["steps"], v["explosion_step"]
        out["runaway"][label] = None if v["runaway_step"] is None else (v["runaway_step"], v["runaway_layer"])
        p = peaks[peaks.run == label]
        out["runaway layers"][label] = sorted(int(layer) for layer in p.layer[p.value > logit])
    both = [label for label in ("sfa", "fp32") if label in runs]
    out["loss step"] = min(out["steps"][label] for label in both) - 1
    out["val loss"], evals = {}, {}
    for label in both:
        train, val, _ = load_metrics(runs[label])
        loss = train.loss  # indexed by step
        out["loss"][label] = float(loss[loss.index <= out["loss step"]].iloc[-smooth:].mean())
        evals[label] = val.val_loss[val.index <= out["loss step"]] if len(val) else pd.Series(dtype=float)
    # the last evaluation both runs reached: a training loss can also fall by memorising the corpus
    common = sorted(set.intersection(*(set(e.index) for e in evals.values()))) if evals else []
    if common:
        out["val step"] = int(common[-1])
        out["val loss"] = {label: float(e.loc[common[-1]]) for label, e in evals.items()}
        out["corpus tokens"] = GPU_CORPUS_TRAIN_TOKENS
        out["epochs"] = out["val step"] * tokens_per_step(Run(runs["fp32"]).train) / GPU_CORPUS_TRAIN_TOKENS
    out["logit"], out["smooth"] = logit, smooth
    return out


def sfa_text(f: dict, n_layers: int) -> str:
    """:func:`sfa_findings` in sentences."""
    st, boom, layers = f["steps"], f["explosion step"], f["runaway layers"]
    if boom["sfa"] is not None:
        return (f"**SFA did not prevent the explosion:** its loss exploded at step {boom['sfa']:,}"
                + (f", the BF16 twin's at {boom['bf16']:,}." if boom.get("bf16") is not None else "."))
    head = (f"**With SFA the loss did not explode in {st['sfa']:,} steps**"
            + (f", {st['sfa'] / boom['bf16']:.1f}× the step at which its BF16 twin exploded ({boom['bf16']:,})"
               if boom.get("bf16") is not None else ""))
    gap = f["loss"]["sfa"] - f["loss"]["fp32"]
    text = [head + f". At step {f['loss step']:,} its training loss ({f['smooth']}-step mean) was "
            f"{f['loss']['sfa']:.2f}, {abs(gap):.2f} {'above' if gap > 0 else 'below'} the FP32 twin's "
            f"{f['loss']['fp32']:.2f}."]
    val = f.get("val loss", {})
    if {"sfa", "fp32"} <= set(val):  # held-out loss: the runs see the corpus several times over
        vgap = val["sfa"] - val["fp32"]
        text.append(f"On held-out text the gap is {abs(vgap):.2f} (validation loss at step {f['val step']:,}: "
                    f"{val['sfa']:.2f} with SFA, {val['fp32']:.2f} with FP32); the FP32 twin's validation loss is "
                    f"{val['fp32'] - f['loss']['fp32']:.2f} above its training loss, since by step {f['val step']:,} "
                    f"the runs had seen the {f['corpus tokens'] / 1e6:.0f}M-token corpus {f['epochs']:.1f} times.")
    if layers["sfa"]:
        ra = f["runaway"]
        text.append(f"**But SFA did not stop the logit runaway:** the largest attention logit exceeded "
                    f"{f['logit']:,.0f} in {len(layers['sfa'])} of its {n_layers} layers, against "
                    f"{len(layers.get('bf16', []))} for BF16 before its explosion and {len(layers.get('fp32', []))} "
                    "for FP32"
                    + (f"; it ran away from step {ra['sfa'][0]:,} (layer {ra['sfa'][1]})" if ra.get("sfa") else "")
                    + (f", BF16's from step {ra['bf16'][0]:,} (layer {ra['bf16'][1]})" if ra.get("bf16") else "") + ".")
    return " ".join(text)


def twin_runs(experiment: str, run: str | None, twins: dict) -> dict:
    """``{label: run folder}`` of ``twins`` (``{label: twin folder name}``) in run folder ``run`` of ``experiment``
    (the latest where ``run`` is None), committed or not."""
    folder = run_dir(experiment, run)
    return {label: folder / name for label, name in twins.items()}


def twin_verdicts(runs: dict) -> pd.DataFrame:
    """One row per run of ``runs`` (``{label: run folder}``): its :func:`lpfa.run.run_verdict`."""
    return pd.DataFrame({label: run_verdict(d) for label, d in runs.items()}).T


def twins_note(experiment: str, runs: dict) -> str:
    """The run folder of ``runs`` (:func:`twin_runs`), what it is, where and from which commit it ran
    (:func:`lpfa.pages.provenance_line`), and how to train its twins again."""
    folder = next(iter(runs.values())).parent
    return (f"Run `{folder.name}`: {provenance_line(experiment, folder)}. To regenerate: `scripts/gpu/twins.sh` (its "
            "header gives the three commands), or `rerun=True` on the loss-explosion page.")


def sweeps_of(runs: dict) -> dict:
    """``{label: sfa_sweep.json}`` of the runs of ``runs`` (``{label: run folder}``) that hold a β sweep
    (:mod:`lpfa.sfa_sweep`)."""
    return {label: d / "sfa_sweep.json" for label, d in runs.items() if (d / "sfa_sweep.json").exists()}


def plot_sweep(sweeps: dict, layer: int, what: str = "silenced"):
    """``what`` (sfa, attenuated, silenced or zeroed) of ``layer`` over checkpoints, one line per β, one
    panel per run (``{label: sweep dict or file}``, :func:`lpfa.sfa_sweep.sweep_frame`)."""
    if what not in SWEPT:
        raise ValueError(f"what={what!r}: expected one of {', '.join(SWEPT)}")
    frames = {label: _in_layer(sweep_frame(sw), layer) for label, sw in sweeps.items()}
    use_style()
    # at least 7.5 in wide: a single panel still fills the page width, its text legible
    fig, axes = plt.subplots(1, len(sweeps), figsize=(max(4.2 * len(sweeps), 7.5), 3.0), squeeze=False, sharey=True)
    for ax, (label, f) in zip(axes[0], frames.items()):
        for beta, g in f.groupby("beta"):
            ax.plot(g.step, g[what], marker="o", ms=3, label=f"β = {beta:g}")
        ax.set_title(f"{label}: layer {layer}", fontsize=9)
        ax.set_xlabel("checkpoint step")
    axes[0, 0].set_ylabel(f"fraction of rows {what}")
    axes[0, -1].legend(fontsize=9)
    return fig


def sweep_frames(sweeps: dict) -> dict:
    """``{label: sweep frame}`` (:func:`lpfa.sfa_sweep.sweep_frame`) of each sweep file of ``sweeps``."""
    return {label: sweep_frame(path) for label, path in sweeps.items()}


def _in_layer(frame: pd.DataFrame, layer: int) -> pd.DataFrame:
    """The rows of a :func:`lpfa.sfa_sweep.sweep_frame` in ``layer``; a ValueError naming the layers it has if none."""
    if layer not in set(frame.layer):
        raise ValueError(f"layer={layer!r}: expected a layer of the sweep, 0 to {int(frame.layer.max())}")
    return frame[frame.layer == layer]


def last_sweep_table(frames: dict, layer: int) -> pd.DataFrame:
    """Per run of ``frames`` (``{label: sweep_frame}``) and β: the share of ``layer``'s rows SFA touches, that the
    clamp attenuates, silences and zeroes at the run's last checkpoint, indexed by (run, beta)."""
    for f in frames.values():
        _in_layer(f, layer)
    last = pd.concat({label: f[f.step == f.step.max()].set_index(["layer", "beta"])[
        ["sfa", "attenuated", "silenced", "zeroed"]] for label, f in frames.items()}, names=["run"])
    return last.xs(layer, level="layer")


def last_sweep_display(frames: dict, layer: int):
    """:func:`last_sweep_table` as the page shows it: its shares as percentages (:func:`lpfa.plotting.format_table`)."""
    table = last_sweep_table(frames, layer)
    return format_table(table, percent=tuple(table.columns), digits=4)


def sweep_text(frames: dict, verdicts: pd.DataFrame, runs: dict, layer: int) -> str:
    """Page 09's findings on the ``repro`` twins (``runs``, their :func:`twin_verdicts` and the ``sweep_frame`` of the
    SFA and BF16 runs' sweeps, ``frames``): whether SFA and BF16 exploded, ``layer``'s largest logit of each run
    (:func:`lpfa.compare.layer_max`) at a common step, and at the last checkpoint the shares of ``layer``'s rows SFA
    touches, attenuates, silences and zeroes per β, on its own weights and on the BF16 run's."""
    worst = {label: f[f.step == f.step.max()].groupby("beta").silenced.max() for label, f in frames.items()}
    s = frames["sfa"]
    s_last = s[(s.step == s.step.max()) & (s.layer == layer)].set_index("beta")
    b = frames["bf16"]
    b_last = b[(b.step == b.step.max()) & (b.layer == layer)].set_index("beta")
    v = verdicts
    common = int(min(v["steps"])) // 100 * 100

    def logit(label):
        m = layer_max(runs[label], "max_logit", layer)
        return m[m.index <= common].iloc[-1]

    zeroed = ", ".join(f"β = {beta:g} ({s_last.loc[beta, 'zeroed']:.1%})" for beta in s_last.index
                       if s_last.loc[beta, "zeroed"] > 0) or "no β"
    return (f"* **The loss.** SFA (β = 2) {'exploded' if v.loc['sfa', 'exploded'] else 'did not explode'} in "
            f"{v.loc['sfa', 'steps']:,} steps — but neither did the BF16 run ({v.loc['bf16', 'steps']:,} steps), so "
            "these runs cannot show that SFA prevents an explosion; they show what it does on the way. At step "
            f"{common:,}, layer {layer}'s largest attention logit is {logit('sfa'):.0f} with SFA, {logit('fp32'):.0f} "
            f"with FP32 and {logit('bf16'):.0f} with BF16 attention.\n"
            f"* **What SFA did during training.** At its last checkpoint (step {int(s.step.max()):,}), SFA touches "
            f"{s_last.loc[2.0, 'sfa']:.1%} of layer {layer}'s rows; with β = 2 the row-sum clamp attenuates "
            f"{s_last.loc[2.0, 'attenuated']:.1%} and silences {s_last.loc[2.0, 'silenced']:.1%} (output below 1/1000 "
            "of its value), as fractions of all the layer's rows. Across layers the largest silenced fraction at β = 2 "
            f"is {worst['sfa'][2.0]:.1%}.\n"
            f"* **β.** On the same weights, β = 1.5 silences {s_last.loc[1.5, 'silenced']:.1%} of layer {layer}'s "
            f"rows, β = 4 {s_last.loc[4.0, 'silenced']:.1%}, β = 8 {s_last.loc[8.0, 'silenced']:.1%}; rows are zeroed "
            f"outright at {zeroed}.\n"
            f"* **Applied to the BF16 run's weights** (its last checkpoint, step {int(b.step.max()):,}), β = 2 would "
            f"silence {b_last.loc[2.0, 'silenced']:.1%} of layer {layer}'s rows and zero "
            f"{b_last.loc[2.0, 'zeroed']:.1%}.")


def long_sweep(experiment: str) -> dict:
    """``{"bf16, 30k steps": sfa_sweep.json}``: the β sweep over the kept checkpoints of the BF16 run of
    ``experiment``'s latest run folder (the 30k-step ``repro`` twins); empty when ``experiment`` is ""."""
    return {"bf16, 30k steps": run_dir(experiment, None) / "bf16" / "sfa_sweep.json"} if experiment else {}


def long_sweep_text(sweeps: dict, layer: int) -> str:
    """The sweep of :func:`long_sweep` in words: the share of ``layer``'s rows β = 2 would silence from the first
    checkpoint to its peak and the last, the share zeroed there, every β's share at the last checkpoint (and whether β
    still matters), and the share of the rows SFA touches that it silences; "" without a sweep."""
    if not sweeps:
        return ""
    lf = sweep_frame(next(iter(sweeps.values())))
    sil = _in_layer(lf, layer).pivot_table(index="step", columns="beta", values="silenced")
    zer = _in_layer(lf, layer).pivot_table(index="step", columns="beta", values="zeroed")
    end = sil.index.max()
    spread = float(sil.loc[end].max() - sil.loc[end].min())
    touched = float(lf[(lf.layer == layer) & (lf.step == end) & (lf.beta == 2.0)].sfa.iloc[0])
    return (f"With β = 2, the share of layer {layer}'s rows that SFA would silence goes from {sil[2.0].iloc[0]:.1%} at "
            f"step {int(sil.index[0]):,} to a peak of {sil[2.0].max():.1%} at step {int(sil[2.0].idxmax()):,} and "
            f"{sil.loc[end, 2.0]:.1%} at step {int(end):,}, where {zer.loc[end, 2.0]:.1%} would be zeroed outright. "
            "At that step β = " + ", ".join(f"{b:g}" for b in sil.columns) + " silence "
            + ", ".join(f"{sil.loc[end, b]:.1%}" for b in sil.columns)
            + (": once the logits reach the thousands the choice of β no longer matters" if spread < 0.01
               else f" (spread {spread:.1%})")
            + f"; SFA touches {touched:.1%} of the rows, so it silences {sil.loc[end, 2.0] / touched:.0%} of the rows "
            "it touches.")


def outcome_text(table, label: str) -> str:
    """One row of :func:`experiment_table` in words, e.g. "did not explode, but its layer-1 logits ran away from
    step 1,600" (the outcomes strongest first, as in the table's ``outcome``; for neither, the step its logit parted
    from the reference's, where it did)."""
    r = table.loc[label]
    if r["outcome"] == "loss exploded":
        return (f"exploded at step {r['explosion step']:,}"
                + (f" (its logits ran away in layer {r['runaway layer']} from step {r['runaway step']:,})"
                   if r["runaway step"] is not None else ""))
    if r["outcome"] == "logits ran away":
        return f"did not explode, but its layer-{r['runaway layer']} logits ran away from step {r['runaway step']:,}"
    apart = r.get(LOGIT_APART)
    return "neither exploded nor had its logits run away" + (
        f" (its logit apart from the FP32 run's from step {apart:,})" if apart is not None and pd.notna(apart) else "")


def _verdict_words(v: dict) -> str:
    """One run's :func:`lpfa.run.run_verdict` in words: exploded (where), else ran away (where), else neither."""
    if v["exploded"]:
        return f"exploded at step {v['explosion_step']:,}"
    if v["runaway_step"] is not None:
        return f"did not explode, but its layer-{v['runaway_layer']} logits ran away from step {v['runaway_step']:,}"
    return "neither exploded nor had its logits run away"


def muon_text(runs: dict) -> str:
    """The Muon twins (:data:`lpfa.experiments.MUON_LONG`, ``{label: run dir}``) in sentences, one per Muon learning
    rate: how long the runs trained, each one's verdict, and whether an explosion was BF16's alone or both precisions'
    (then it is not the BF16-only explosion of the paper)."""
    groups: dict[float, dict[str, Run]] = {}
    for label, d in runs.items():
        r = Run(d)
        groups.setdefault(float(r.train["muon_lr"]), {})[label.split("_")[0]] = r
    text = []
    for lr, g in sorted(groups.items()):
        v = {mode: r.verdict() for mode, r in g.items()}
        steps = sorted(x["steps"] for x in v.values())
        span = f"{steps[0]:,}" if steps[0] == steps[-1] else f"{steps[0]:,}–{steps[-1]:,}"
        line = (f"At Muon lr {lr:g} ({span} steps), "
                + "; ".join(f"the {m.upper()} run {_verdict_words(v[m])}" for m in ("bf16", "fp32", "sfa") if m in v)
                + ".")
        if "bf16" in v and "fp32" in v and v["bf16"]["exploded"]:
            line += (" The loss exploded at both precisions in this one seed: at this learning rate the explosion is "
                     "not BF16's alone."
                     if v["fp32"]["exploded"] else
                     f" A BF16-only loss explosion (Fig. 2 with Muon): the FP32 twin ran {v['fp32']['steps']:,} steps "
                     "without exploding.")
        stopped = [m.upper() for m, r in g.items() if r.summary and r.summary.get("status") == "stopped"]
        if stopped:
            line += (f" ({and_join(stopped)} stopped by hand after {'it' if len(stopped) == 1 else 'they'} had "
                     "exploded.)")
        text.append(line)
    return " ".join(text) if text else "No Muon run is committed."


def second_looks(layer: int) -> dict:
    """``{experiment: (rows, table, step)}`` for each experiment of :data:`SECOND_LOOKS` with committed rows:
    ``{label: run folder}`` and its :func:`lpfa.compare.experiment_table` in ``layer``, held against the FP32 row."""
    out = {}
    for experiment, (labels, ref, _) in SECOND_LOOKS.items():
        rows = experiment_rows(experiment, list(labels))
        if rows:
            table, step = experiment_table(rows, layer=layer, reference=rows[ref] if ref in rows else None)
            out[experiment] = rows, table, step
    return out


def second_look_table(experiment: str, rows: dict, table: pd.DataFrame, step: int):
    """One of :func:`second_looks` as the page shows it: the table without its ``change`` column, captioned with its
    run folder and the step of its precursor values."""
    return format_table(table.drop(columns=["change"])).set_caption(
        f"results/{experiment}/{rows[next(iter(rows))].parent.name}: precursor values at step {step:,}")


def plans_text(measured: dict, planned_steps: int, gpus: int) -> str:
    """For each experiment of :data:`SECOND_LOOKS` not in ``measured`` (:func:`second_looks`): its rows, what they
    would cost at ``planned_steps`` steps on ``gpus`` H200s (the committed compiled ``repro`` throughput,
    :func:`lpfa.scaling.committed_speed`, scaled by parameter count for another size); "" if none."""
    text = []
    for exp, (labels, _, size) in SECOND_LOOKS.items():
        if exp in measured:
            continue
        tps = committed_speed().loc["compiled", "median tokens/s"]
        with torch.device("meta"):  # parameter counts only
            n = {s: GPT(GPTConfig.from_size(s, block_size=512)).num_params() for s in ("repro", size)}
        est = tps * n["repro"] / n[size]  # tokens/s scale as 1 / N: 6·N FLOPs per token
        minutes = wall_minutes(planned_steps, est, PRESETS["repro"], runs=len(labels), gpus=gpus)
        text.append(
            f"**Not run yet** (`{exp}`: {', '.join(f'`{label}`' for label in labels)}). At {planned_steps:,} steps, "
            f"{len(labels)} runs take about {minutes:.0f} minutes on {gpus} H200s with `compile=true`"
            + (f" (estimated: the measured `repro` throughput, {tps:,.0f} tokens/s, scaled by its "
               f"{n['repro'] / 1e6:.0f}M against {n[size] / 1e6:.0f}M parameters)" if size != "repro"
               else f" ({tps:,.0f} tokens/s per GPU, `results/compile_throughput`)")
            + f" ({RERUN_PAGE} gives the commands).")
    return "\n\n".join(text)


def adamw_table(layer: int):
    """The :func:`lpfa.compare.experiment_table` in ``layer`` of the isolation table's ``bf16`` and ``fp32`` rows (the
    AdamW twins of the Muon and size rows' seed and settings), held against ``fp32``; None when not committed."""
    try:
        rows = experiment_rows("isolation", ["bf16", "fp32"])
        return experiment_table(rows, layer=layer, reference=rows["fp32"])[0]
    except (FileNotFoundError, KeyError):
        return None


def sfa_muon_text(measured: dict, t_adam, layer: int) -> str:
    """Fig. 7 with Muon in words (``measured``: :func:`second_looks`): each twin's outcome (:func:`outcome_text`) and
    final eval loss, whether Muon brings forward the step where the BF16 logit parts from the FP32 one against AdamW
    (``t_adam``: :func:`adamw_table`), and the share of ``layer``'s rows SFA silenced with β = 2 over its checkpoints;
    "" without the Muon rows."""
    if "sfa_muon" not in measured:
        return ""
    mrows, mt, _ = measured["sfa_muon"]
    sweep_m = mrows["sfa_muon"] / "sfa_sweep.json"
    text = [f"* **With Muon** ({int(mt['steps'].min()):,} steps): the BF16 run {outcome_text(mt, 'bf16_muon')}; the "
            f"FP32 run {outcome_text(mt, 'fp32_muon')}; the SFA run {outcome_text(mt, 'sfa_muon')}. Final eval losses: "
            + ", ".join(f"{label} {mt.loc[label, 'final eval loss']:.3f}" for label in mt.index) + "."]
    adam_pre = t_adam.loc["bf16", LOGIT_APART] if t_adam is not None else None
    pre_m = mt.loc["bf16_muon", LOGIT_APART]
    if adam_pre is not None and pre_m is not None:
        forward = ("brings the BF16 logits' departure forward" if pre_m < adam_pre
                   else "does not bring the BF16 logits' departure forward")
        text.append(f"* Muon {forward}: layer {layer}'s logits leave the FP32 run's behind (10×) from step {pre_m:,} "
                    f"with Muon against {adam_pre:,} with AdamW (`results/isolation`, same seed and data). That is a "
                    "measure of the logits, not an outcome"
                    + (": in neither run did the loss explode." if not (mt.loc["bf16_muon", "exploded"]
                                                                      or t_adam.loc["bf16", "exploded"]) else "."))
    if sweep_m.exists():
        fm = sweep_frame(sweep_m)
        l2 = fm[(fm.layer == layer) & (fm.beta == 2.0)].set_index("step")
        text.append(f"* **What SFA did with Muon.** At β = 2 it silenced between {l2.silenced.min():.1%} and "
                    f"{l2.silenced.max():.1%} of layer {layer}'s rows (output below 1/1000 of its value) at every "
                    f"checkpoint from step {int(l2.index.min()):,} to {int(l2.index.max()):,}, and zeroed up to "
                    f"{l2.zeroed.max():.1%}: the run's loss did not explode with that share of the layer's rows "
                    "switched off; the same sweep on the BF16 run's weights is below.")
    return "\n".join(text)


def muon_sweeps(measured: dict) -> dict:
    """The β sweeps (:func:`sweeps_of`) of the SFA and BF16 runs with Muon (``measured``: :func:`second_looks`)."""
    if "sfa_muon" not in measured:
        return {}
    mrows = measured["sfa_muon"][0]
    return sweeps_of({label: mrows[label] for label in ("sfa_muon", "bf16_muon")})


def muon_long_runs() -> dict:
    """``{label: run folder}`` of the committed Muon twins of :data:`lpfa.experiments.MUON_LONG` (empty if none)."""
    return experiment_rows("muon_long", list(MUON_LONG))


def plot_muon_long(long: dict):
    """The losses of the Muon twins of :func:`muon_long_runs` (:func:`loss_figure`), titled with their run folder."""
    return loss_figure(long, smooth=50, top=7, title=f"results/muon_long/{next(iter(long.values())).parent.name}")


def muon_long_text(long: dict, measured: dict) -> str:
    """The Muon twins of :func:`muon_long_runs` in words (:func:`muon_text`), with a note where they trained no more
    steps than the Muon rows of :func:`second_looks` (``measured``) they were to extend; or that they are not run."""
    if not long:
        return f"The Muon twins at lr {MUON_LR2:g} (`lpfa.experiments.MUON_LONG`) are not run yet."
    n = {label: Run(d).steps for label, d in long.items()}
    before = max(Run(d).steps for d in measured["sfa_muon"][0].values()) if "sfa_muon" in measured else None
    short = before is not None and max(n[label] for label in ("bf16_muon", "fp32_muon", "sfa_muon")
                                       if label in n) <= before
    return (f"**Muon again, and at lr {MUON_LR2:g}** (`results/muon_long`). " + muon_text(long)
            + (f" They trained no more than the {before:,} steps above (five runs shared one H200), so they are a "
               "second realisation of the same twins (compiled Muon steps are not bit-reproducible), not a longer "
               "test." if short else ""))


def sizes_text(measured: dict, t_adam) -> str:
    """Fig. 7 at GPT-2 S's size in words (``measured``: :func:`second_looks`): each twin's outcome, SFA's final eval
    loss, and where both precisions explode, why these runs cannot test SFA at this size (against the smaller model's
    FP32 eval loss, ``t_adam``: :func:`adamw_table`); the rows stopped by hand. "" without the rows."""
    if "sizes" not in measured:
        return ""
    srows, stab, _ = measured["sizes"]
    both = stab.loc["bf16_gpt2s", "exploded"] and stab.loc["fp32_gpt2s", "exploded"]
    text = [f"* **At GPT-2 S size**: the BF16 run {outcome_text(stab, 'bf16_gpt2s')}; the FP32 run "
            f"{outcome_text(stab, 'fp32_gpt2s')}; the SFA run {outcome_text(stab, 'sfa_gpt2s')}, with a final eval "
            f"loss of {stab.loc['sfa_gpt2s', 'final eval loss']:.2f}."]
    if both:
        paper = PRESETS["gpt2-s-paper"]
        text.append("* Both precisions explode (one seed each), so this is not the BF16-only explosion of Fig. 2; "
                    "the likeliest reading, untested here by a lower learning rate at this size, is the growth of "
                    f"attention logits at too high a learning rate for this width (the `repro` lr, "
                    f"{PRESETS['repro']['lr']:g}, is kept here). SFA's run "
                    "did not explode in the loss, but its logits ran away too"
                    + (f", and its eval loss ended at {stab.loc['sfa_gpt2s', 'final eval loss']:.2f} against "
                       f"{t_adam.loc['fp32', 'final eval loss']:.2f} for the smaller `repro` model's FP32 run on the "
                       "same data (`results/isolation`): not exploding is not the same as training well"
                       if t_adam is not None else "")
                    + ". These runs therefore cannot test SFA at this size; the paper's own recipe at this size (the "
                    f"`gpt2-s-paper` preset: peak lr {paper['lr']:g} after {paper['warmup_steps']:,} warmup steps) "
                    "does, with the smaller batch of the loss-explosion page: that is the recipe test at the top of "
                    "this page.")
    stopped = [label for label in srows
               if json.loads((srows[label] / "summary.json").read_text())["status"] == "stopped"]
    if stopped:
        text.append(f"* {', '.join(f'`{label}`' for label in stopped)} were stopped by hand after they had exploded "
                    f"(`provenance.json`), which is why they end early.")
    return "\n".join(text)


def dose_text() -> str:
    """SFA against an amplified δ bias: whether the dose experiment's SFA row (:func:`lpfa.dose.dose_findings`, SFA
    with layer 1's δ error × k) exploded, and when against the same dose without SFA; or that it is not committed."""
    runs = committed_runs()
    f = dose_findings(dose_table(runs)) if runs else None
    if f is None or f["sfa"] is None:
        return "The dose experiment has no committed SFA row (`results/dose`)."
    s = f["sfa"]
    return (f"With SFA (β = {s['beta']:g}) and layer 1's δ error × {s['k']:g}, the loss "
            + (f"exploded at step {s['explosion step']:,}, against step "
               f"{', '.join(f'{x:,}' for x in s['without_sfa'])} for the same dose without SFA: in this one pair, SFA "
               "delayed the amplified explosion but did not prevent it. At dose 1, where the only δ error is the one "
               "the ties create, none of the SFA runs above exploded."
               if s["exploded"] else "did not explode."))


def gpt2m_price(experiment: str = "gpt2m_price", run: str | None = None, root=None) -> pd.DataFrame:
    """Fig. 7c's price: :func:`lpfa.scaling.run_price` of each run folder of ``results/<experiment>/<run>`` (the
    latest when None), one row per label (``bf16_paper_recipe``, ``fp32_paper_recipe``); empty when not committed."""
    try:
        folder = run_dir(experiment, run, root)
    except FileNotFoundError:
        return pd.DataFrame()
    rows = {p.name: run_price(p) for p in sorted(folder.iterdir()) if (p / "metrics.jsonl.gz").is_file()
            or (p / "metrics.jsonl").is_file()}
    return pd.DataFrame(rows).T.rename_axis(folder.name)


def gpt2m_minutes(price: pd.DataFrame, steps: int) -> float:
    """Minutes of one H200 for the three rows of Fig. 7c at ``steps`` steps each, one seed: BF16 and SFA (priced as
    BF16: the same kernel with a shifted max) and FP32, from :func:`gpt2m_price`."""
    return (2 * minutes_for(price.loc["bf16_paper_recipe"], steps)
            + minutes_for(price.loc["fp32_paper_recipe"], steps))


def gpt2m_text(price: pd.DataFrame, steps: int, fates=None) -> str:
    """GPT-2 M (Fig. 7c) priced in words: each run's measured throughput (``price``: :func:`gpt2m_price`), the minutes
    of a ``steps``-step run and of the three rows of Fig. 7c (SFA priced as BF16: the same kernel with a shifted
    max), held against every step at which a BF16 run of GPT-2 S's recipe exploded (``fates``:
    :func:`lpfa.pages.loss_explosion.recipe_fates`, every committed run of the recipe)."""
    if price.empty or not {"bf16_paper_recipe", "fp32_paper_recipe"} <= set(price.index):
        return "GPT-2 M (Fig. 7c) is not run here, and its price is not measured (`results/gpt2m_price`)."
    fates = recipe_fates() if fates is None else fates
    b, f = price.loc["bf16_paper_recipe"], price.loc["fp32_paper_recipe"]
    minutes = {label: minutes_for(price.loc[label], steps) for label in price.index}
    total = gpt2m_minutes(price, steps)
    boom = (sorted(int(s) for s in fates.loc[fates.precision == "bf16", "explosion step"].dropna()) if len(fates)
            else [])
    return (f"**GPT-2 M (Fig. 7c) is priced here, not run.** GPT-2 M ({b['params'] / 1e6:.0f}M parameters) at the "
            f"GPT-2 S runs' recipe and batch, compiled, alone on one H200, trains at {b['tokens_per_s']:,.0f} tokens/s "
            f"with BF16 flash attention ({b['steps_per_s']:.1f} steps/s) and {f['tokens_per_s']:,.0f} tokens/s with "
            f"FP32 attention ({f['steps_per_s']:.1f} steps/s), after {b['compile_s']:.0f}–{f['compile_s']:.0f} s of "
            f"compilation (`results/gpt2m_price/{price.index.name}`, {int(b['steps']):,} and {int(f['steps']):,} "
            f"steps). A {steps:,}-step run"
            + ((", past every step at which GPT-2 S's loss exploded at this recipe " if steps > boom[-1] else
                f", past {sum(s < steps for s in boom)} of the {len(boom)} steps at which GPT-2 S's loss exploded at "
                "this recipe ") + f"({and_join([f'{s:,}' for s in boom])})," if boom else "")
            + f" takes about {minutes['bf16_paper_recipe']:.0f} minutes in BF16 and "
            f"{minutes['fp32_paper_recipe']:.0f} in FP32, so the three rows of Fig. 7c (BF16, FP32 and SFA, priced as "
            f"BF16) take about {total:.0f} minutes of one H200 for one seed. They are not among the committed runs: "
            "whether the BF16 loss explosion and SFA's fix carry over to GPT-2 M is not tested in this book.")


def beta_view(frames: dict, layer: int, beta: float) -> tuple:
    """SFA's β picked out of the committed sweeps (``frames``, ``{label: sweep_frame}``): per run, the shares of
    ``layer``'s rows SFA touches, that the clamp attenuates, silences and zeroes over the checkpoints at ``beta``
    (one panel per run), and their values at each run's last checkpoint (:func:`last_sweep_table`'s rows at ``beta``).
    A β the sweeps did not measure is a one-line ValueError naming the ones they did."""
    import math

    import numpy as np

    from lpfa.plotting import COLORS

    betas = sorted({float(b) for f in frames.values() for b in f.beta})
    if isinstance(beta, bool) or not isinstance(beta, (int, float, np.integer, np.floating)) or not any(
            math.isclose(beta, b) for b in betas):
        raise ValueError(f"beta={beta!r}: expected a β of the sweeps, one of {', '.join(f'{b:g}' for b in betas)}")
    beta = next(b for b in betas if math.isclose(beta, b))
    shares = {label: _in_layer(f, layer) for label, f in frames.items()}
    use_style()
    fig, axes = plt.subplots(1, len(frames), figsize=(max(4.2 * len(frames), 7.5), 3.0), squeeze=False, sharey=True)
    colours = dict(zip(SWEPT, (COLORS["sfa"], COLORS["accent"], COLORS["bf16"], COLORS["fp32"])))
    for ax, (label, f) in zip(axes[0], shares.items()):
        g = f[np.isclose(f.beta, beta)]
        for what in SWEPT:
            ax.plot(g.step, g[what], marker="o", ms=3, color=colours[what], label=what)
        ax.set_title(f"{label}: layer {layer}, β = {beta:g}", fontsize=9)
        ax.set_xlabel("checkpoint step")
    axes[0, 0].set_ylabel("fraction of rows")
    axes[0, -1].legend(fontsize=9)
    last = last_sweep_table(frames, layer).xs(beta, level="beta")
    return fig, format_table(last, percent=tuple(last.columns))


def beta_explorer(frames: dict, layer: int, beta: float | None = None):
    """:func:`beta_view` with a β slider over the sweeps' βs through :func:`lpfa.widgets.interactive_or_static`; a
    static page shows ``beta`` (default: the largest β swept, the least aggressive clamp). None (nothing shown) without
    sweeps."""
    from lpfa.widgets import interactive_or_static

    if not frames:
        return None

    betas = sorted({float(b) for f in frames.values() for b in f.beta})
    beta = betas[-1] if beta is None else beta

    def view(beta):
        return beta_view(frames, layer, beta)

    def controls():
        import ipywidgets as w

        return {"beta": w.SelectionSlider(options=[(f"{b:g}", b) for b in betas], value=beta, description="β")}

    return interactive_or_static(view, controls, {"beta": beta})
