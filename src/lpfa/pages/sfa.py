"""Page 09, SFA (Fig. 7): whether shifting the tied row max keeps the run, with AdamW and with Muon."""

from __future__ import annotations

from lpfa.compare import head_metric_frame
from lpfa.pages import and_join
from lpfa.run import (
    Run,
    load_metrics,
    run_verdict,
)


def layer_peaks(runs: dict, metric: str = "max_logit", verdicts: dict | None = None):
    """Long DataFrame (run, layer, value): each layer's largest ``metric`` over its heads and over the diagnostics steps
    before the run's loss explosion (every step if it did not explode), as :func:`sfa_findings` counts runaway layers.
    ``verdicts``: ``{label: run_verdict(run)}`` where the caller has them already."""
    import pandas as pd

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
    import matplotlib.pyplot as plt
    import seaborn as sns

    from lpfa.plotting import color_of, use_style

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


def outcome_text(table, label: str) -> str:
    """One row of :func:`experiment_table` in words, e.g. "did not explode, but its layer-1 logits ran away from
    step 1,600" (the verdicts strongest first, as in the table's ``outcome``)."""
    r = table.loc[label]
    if r["outcome"] == "exploded":
        return (f"exploded at step {r['explosion step']:,}" + (f" (its logits ran away in layer {r['runaway layer']} from step "
                f"{r['runaway step']:,})" if r["runaway step"] is not None else ""))
    if r["outcome"] == "ran away":
        return f"did not explode, but its layer-{r['runaway layer']} logits ran away from step {r['runaway step']:,}"
    if r["outcome"] == "precursor":
        return f"showed the precursor from step {r['precursor from']:,}"
    return "stayed clean" if r["outcome"] == "clean" else "stayed stable"


def _verdict_words(v: dict) -> str:
    """One run's :func:`lpfa.run.run_verdict` in words: exploded (where), else ran away (where), else clean."""
    if v["exploded"]:
        return f"exploded at step {v['explosion_step']:,}"
    if v["runaway_step"] is not None:
        return f"did not explode, but its layer-{v['runaway_layer']} logits ran away from step {v['runaway_step']:,}"
    return "stayed clean"


def muon_text(runs: dict) -> str:
    """The Muon twins (:data:`lpfa.experiments.MUON_LONG`, ``{label: run dir}``) in sentences, one per Muon learning
    rate: how long the runs trained, each one's verdict, and whether an explosion was BF16's alone or both precisions'
    (then it is the generic instability of too high a learning rate, not the paper's failure)."""
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
                + "; ".join(f"the {m.upper()} run {_verdict_words(v[m])}" for m in ("bf16", "fp32", "sfa") if m in v) + ".")
        if "bf16" in v and "fp32" in v and v["bf16"]["exploded"]:
            line += (" Both precisions exploded: at this learning rate the failure is generic, not BF16's." if v["fp32"]["exploded"]
                     else f" A BF16-only loss explosion (Fig. 2 with Muon): the FP32 twin ran {v['fp32']['steps']:,} steps clean.")
        stopped = [m.upper() for m, r in g.items() if r.summary and r.summary.get("status") == "stopped"]
        if stopped:
            line += f" ({and_join(stopped)} stopped by hand after {'it' if len(stopped) == 1 else 'they'} had exploded.)"
        text.append(line)
    return " ".join(text) if text else "No Muon run is committed."


def sfa_findings(runs: dict, smooth: int = 200, logit: float = 1000.0) -> dict:
    """SFA against its twins (``{"bf16": dir, "fp32": dir, "sfa": dir}``, same seed and data order): the Fig. 7 check.

    Returns ``steps``, ``explosion step`` and ``runaway`` ((step, layer) of the logit runaway, or None) of each run
    (:func:`lpfa.run.run_verdict`); ``loss step``, the last step the
    SFA and FP32 runs both trained, with each one's training loss there (``loss``, mean over the ``smooth`` steps up to
    it); and, per run, ``runaway layers``: the layers whose largest attention logit (over heads, on the diagnostics batch)
    exceeded ``logit`` at some diagnostics step before the run's explosion (all its steps if it did not explode)."""
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
    for label in both:
        train, _, _ = load_metrics(runs[label])
        loss = train.loss  # indexed by step
        out["loss"][label] = float(loss[loss.index <= out["loss step"]].iloc[-smooth:].mean())
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
    text = [head + f". At step {f['loss step']:,} its training loss ({f['smooth']}-step mean) was {f['loss']['sfa']:.2f}, "
            f"{abs(gap):.2f} {'above' if gap > 0 else 'below'} the FP32 twin's {f['loss']['fp32']:.2f}."]
    if layers["sfa"]:
        ra = f["runaway"]
        text.append(f"**But SFA did not stop the logit runaway:** the largest attention logit exceeded {f['logit']:,.0f} in "
                    f"{len(layers['sfa'])} of its {n_layers} layers, against {len(layers.get('bf16', []))} for BF16 before its "
                    f"explosion and {len(layers.get('fp32', []))} for FP32"
                    + (f"; it ran away from step {ra['sfa'][0]:,} (layer {ra['sfa'][1]})" if ra.get("sfa") else "")
                    + (f", BF16's from step {ra['bf16'][0]:,} (layer {ra['bf16'][1]})" if ra.get("bf16") else "") + ".")
    return " ".join(text)
