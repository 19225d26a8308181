"""Page 07, W_Q spectral norms (Figs. 3, 11): per-head ‖W_Q[h]‖₂ of the paper's recipe twins before the BF16 run's loss
explosion, their growth over training, and how far the BF16 run's layer parts from its FP32 twin's.

The paper finds the norm growing in a few heads of one early layer of the run whose loss explodes, and only there (Fig.
3, and Fig. 11 over training): the biased δ of the tied rows (Eq. 3) pushes W_Q along one direction step after step.
Here every head's norm is read from the diagnostics ``lpfa.train`` logs every ``diag_interval`` steps
(:func:`head_metric_frame`), and the BF16 run is held against its FP32 twin of the same seed and data.
"""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from lpfa.compare import divergence_step, growth_table, head_metric_frame, heads_at, layer_max
from lpfa.pages import provenance_line
from lpfa.pages.loss_explosion import recipe_rows
from lpfa.params import dict_of, integer, optional, text
from lpfa.plotting import color_of, facet_lines, use_style
from lpfa.results import run_dir
from lpfa.run import check_layer
from lpfa.scaling import first_difference

# the notebook's papermill parameters, checked right after its parameters cell (lpfa.params.check_params)
PARAMS = {
    "experiment": text(nonempty=True), "run": optional(text(nonempty=True)),
    "twins": dict_of(text(), text(nonempty=True), required=("bf16", "fp32")),
    "short_experiment": text(), "layer": integer(0),
}


def recipe_twins(experiment: str, run: str | None, twins: dict) -> dict:
    """``{label: run folder}`` of ``twins`` (``{label: twin folder name}``) among the committed runs of ``experiment``
    (:func:`lpfa.pages.loss_explosion.recipe_rows`: each twin from the latest run folder that has it, or from run folder
    ``run``). Raises ValueError naming the twins that are missing and the runs there are."""
    rows = recipe_rows(experiment, run)
    missing = sorted(set(twins.values()) - set(rows))
    if missing:
        raise ValueError(f"twins={twins!r}: {missing} not among the committed runs of {experiment!r}: {sorted(rows)}")
    return {label: rows[name] for label, name in twins.items()}


def short_twins(short_experiment: str, twins: dict, runs: dict) -> tuple[dict | None, dict | None]:
    """The same twins in a shorter experiment of the same preset, seed and labels, for :func:`wq_comparison_text`:
    ``(short, same)``, ``short`` the ``{"bf16": folder, "fp32": folder}`` of its latest run folder (named as in
    ``twins``), ``same`` each pair's :func:`lpfa.scaling.first_difference` against ``runs`` (how many of their losses
    are bit-identical); ``(None, None)`` when ``short_experiment`` is "" (no such comparison)."""
    if not short_experiment:
        return None, None
    folder = run_dir(short_experiment, None)
    short = {label: folder / twins[label] for label in ("bf16", "fp32")}
    return short, {label: first_difference(runs[label], short[label]) for label in ("bf16", "fp32")}

def plot_head_bars(runs: dict, layer: int, step: int, metric: str = "wq_spectral_norm", ax=None):
    """Fig. 3 as the paper draws it: ``metric`` of every head of ``layer`` at ``step``, one bar per (head, run), each
    run in its mode's colour (:data:`lpfa.plotting.COLORS`), with hatching for the low-precision runs so that BF16 and
    FP32 differ by more than colour. A layer the runs lack is a one-line error (:func:`lpfa.run.check_layer`)."""
    check_layer(layer, runs)
    use_style()
    rows = []
    for label, d in runs.items():
        f = head_metric_frame(d, metric)
        at = f[(f.layer == layer) & (f.step == step)]
        if at.empty:
            raise ValueError(f"run {label!r} ({d}) logged no {metric!r} at step {step} (diagnostics steps: "
                             f"{int(f.step.min())}..{int(f.step.max())})")
        rows.append(at.assign(run=label))
    frame = pd.concat(rows)
    if ax is None:
        _, ax = plt.subplots(figsize=(7.5, 3.4))
    palette = {label: color_of(label) for label in runs}
    sns.barplot(frame, x="head", y="value", hue="run", palette=palette, ax=ax, edgecolor="black", linewidth=0.4,
                saturation=1)
    for bars, label in zip(ax.containers, runs):
        if not label.startswith("fp32"):
            for bar in bars:
                bar.set_hatch("//")
    ax.set_ylabel("‖W_Q[h]‖₂" if metric == "wq_spectral_norm" else metric.replace("_", " "))
    ax.set_xlabel(f"head of layer {layer}")
    ax.set_title(f"layer {layer}, step {step:,}: every head", fontsize=10)
    ax.legend(handles=[c.patches[0] for c in ax.containers], labels=list(runs), title=None)  # hatched as the bars
    return ax.figure


def plot_layer_max(runs: dict):
    """Fig. 11 per layer: each run's (``{label: run folder}``) largest ‖W_Q[h]‖₂ over the heads of each layer against
    the step, one panel per layer with every run in its colour (:func:`lpfa.plotting.facet_lines`)."""
    frames = {label: head_metric_frame(d, "wq_spectral_norm").groupby(["step", "layer"]).value.max().reset_index()
              for label, d in runs.items()}
    return facet_lines(frames, "layer", "max over heads of ‖W_Q[h]‖₂", "Largest head norm per layer")


def plot_layer_heads(runs: dict, layer: int):
    """Fig. 11 per head: ‖W_Q[h]‖₂ of every head of ``layer`` against the step, one panel per head with every run
    (``{label: run folder}``) in its colour (:func:`lpfa.plotting.facet_lines`); a one-line error for a layer the runs
    lack (:func:`lpfa.run.check_layer`)."""
    check_layer(layer, runs)
    frames = {label: head_metric_frame(d, "wq_spectral_norm") for label, d in runs.items()}
    return facet_lines({label: f[f.layer == layer] for label, f in frames.items()}, "head", "‖W_Q[h]‖₂",
                       f"Layer {layer}, every head")


def wq_ratio_text(runs: dict, layer: int, step: int, bf16: str = "bf16", fp32: str = "fp32",
                  grown: float = 1.25) -> str:
    """Page 07's sentence on Fig. 3: at ``step``, the three heads of ``layer`` with the largest ‖W_Q[h]‖₂ ratio of the
    BF16 run to its FP32 twin, how many heads exceed ``grown``× their twin's, the median ratio, and whether the growth
    is layer-wide (more than half the heads) or carried by a few heads, as in the paper."""
    at = {}
    for label in (bf16, fp32):
        at[label] = heads_at(head_metric_frame(runs[label], "wq_spectral_norm"), layer, step)
    top = (at[bf16] / at[fp32]).sort_values(ascending=False)
    n = int((top > grown).sum())
    return (f"At step {step:,}, layer {layer}'s heads {', '.join(str(h) for h in top.index[:3])} have the largest "
            f"BF16/FP32 ratios of ‖W_Q[h]‖₂ ({', '.join(f'{r:.1f}×' for r in top.iloc[:3])}); {n} of {len(top)} heads "
            f"are more than {grown}× their FP32 twin's, and the median ratio is {top.median():.2f}"
            + (": the growth is layer-wide here, not confined to a few heads as in the paper." if n > len(top) / 2
               else ": as in the paper, a few heads carry it."))


def _layer_wq_at_common_step(runs: dict, layer: int):
    """The last diagnostics step every run reached, and per run the per-head ‖W_Q‖₂ rows of ``layer`` there (a frame of
    :func:`head_metric_frame`)."""
    frames = {label: head_metric_frame(d, "wq_spectral_norm") for label, d in runs.items()}
    common = min(int(f.step.max()) for f in frames.values())
    return common, {label: f[(f.layer == layer) & (f.step == f.step[f.step <= common].max())]
                    for label, f in frames.items()}


def growth_text(runs: dict, layer: int) -> tuple[str, str]:
    """Page 07's two findings on W_Q growth: a Markdown list, one item per run, of its fastest-growing head
    (:func:`growth_table`) and its largest norm; and a sentence on the largest ‖W_Q‖₂ in ``layer`` of each run at the
    last diagnostics step that every run reached."""
    g = growth_table(runs)
    items = "\n".join(
        f"* **{r}**: after {int(row['steps'])} steps the fastest-growing head is layer {int(row['layer'])}, head "
        f"{int(row['head'])} (×{row['growth']:.2f}, {row['wq_spectral_norm first']:.2f} → "
        f"{row['wq_spectral_norm last']:.2f}); the largest norm anywhere is {row['largest last value']:.2f}."
        for r, row in g.iterrows())
    common, at = _layer_wq_at_common_step(runs, layer)
    sentence = (f"At step {common}, the last step all runs reached, the largest W_Q norm in layer {layer} is "
                + ", ".join(f"{a.value.max():.2f} in {label} (head {int(a.loc[a.value.idxmax(), 'head'])})"
                            for label, a in at.items())
                + ".")
    return items, sentence


def wq_comparison_text(runs: dict, layer: int, short: dict | None = None, short_name: str = "",
                       same: dict | None = None) -> str:
    """Page 07's comparison with the paper: whether ``layer`` holds each run's fastest-growing head
    (:func:`growth_table`), the BF16 run's largest layer-``layer`` ‖W_Q‖₂ over the other runs' at the last step all
    reached, and from which step it stays 1.25× above the first FP32-side run's (:func:`divergence_step`). ``short``
    and ``same`` (:func:`short_twins`): the same twins in a shorter experiment (``short_name``) of the same seed and
    data, their W_Q ratio at the last step both reached, and how many of the two pairs' losses are bit-identical."""
    g = growth_table(runs)
    common, at = _layer_wq_at_common_step(runs, layer)
    vals = {label: a.value.max() for label, a in at.items()}
    hp = [label for label in vals if label != "bf16"]
    ratio = vals["bf16"] / max(vals[label] for label in hp)
    wq = {label: layer_max(d, "wq_spectral_norm", layer) for label, d in runs.items()}
    div = divergence_step(wq["bf16"], wq[hp[0]], 1.25)
    where = ("every run" if (g["layer"] == layer).all() else
             f"{', '.join(g.index[g['layer'] == layer]) or 'no run'} (elsewhere: "
             + ", ".join(f"{r} layer {int(row['layer'])}" for r, row in g[g["layer"] != layer].iterrows()) + ")")
    text = [f"**Compared with the paper.** The paper reports W_Q norms growing in a few heads of one early layer of "
            f"the run whose loss explodes, and only there. Here layer {layer} is the layer of the fastest-growing head "
            f"in {where}; at step "
            f"{common:,} the BF16 run's largest layer-{layer} norm is {ratio:.2f}× the largest layer-{layer} norm of "
            f"{', '.join(hp)}",
            f", and it stays above 1.25× the {hp[0]} run's from step {div:,} on." if div is not None else
            ", and it never stays 1.25× above it: within these steps W_Q is not a BF16-specific precursor."]
    if short:
        s_wq = {label: layer_max(short[label], "wq_spectral_norm", layer) for label in ("bf16", "fp32")}
        s_step = min(int(s.index.max()) for s in s_wq.values())

        def pick(s):
            return float(s[s.index <= s_step].iloc[-1])

        sb, sf, pb, pf = pick(s_wq["bf16"]), pick(s_wq["fp32"]), pick(wq["bf16"]), pick(wq["fp32"])
        text.append(f" For scale: at step {s_step:,} the shorter experiment (`{short_name}`, same seed and data, four "
                    f"runs sharing one GPU) has {sb:.1f} (bf16) against {sf:.1f} (fp32), ×{sb / sf:.2f}, while this "
                    f"experiment has {pb:.1f} against {pf:.1f}, ×{pb / pf:.2f}. ")
    if short and same:
        for label, s in same.items():
            differ = s["first_differing_step"]
            text.append(f"The two {label} runs have bit-identical losses at {s['identical_steps']:,} of their "
                        f"{s['common_steps']:,} common steps"
                        + (f" (they first differ at step {differ:,}). " if differ is not None else ". "))
        if same["bf16"]["first_differing_step"] is None and same["fp32"]["first_differing_step"] is not None:
            text.append("These eager BF16 runs are deterministic from run to run, on another machine and with the "
                        "GPU shared or not (lpfa's kernels fix their reduction order); the FP32 twin (PyTorch SDPA on "
                        "FP32 inputs) is not, so FP32 runs of one seed already scatter, and a BF16/FP32 ratio at one "
                        "step is only meaningful well beyond that scatter (the seeds page measures it). Compiled runs, "
                        "as at the paper's recipe, are not deterministic in either precision: the stabiliser page "
                        "shows one seed's compiled BF16 run exploding at different steps from run to run.")
    return "".join(text)


def page_texts(experiment: str, runs: dict, twins: dict, layer: int, step: int, short_experiment: str) -> dict:
    """Every sentence page 07 glues into its prose, by name: the twins' run (``runs`` of ``experiment``), the W_Q
    ratio at ``step`` (:func:`wq_ratio_text`), its growth (:func:`growth_text`) and the comparison with the same
    twins in ``short_experiment`` (:func:`short_twins`, :func:`wq_comparison_text`). A ``layer`` the runs lack is a
    one-line error (:func:`lpfa.run.check_layer`)."""
    check_layer(layer, runs)
    folder = runs["bf16"].parent
    items, at = growth_text(runs, layer)
    short, same = short_twins(short_experiment, twins, runs)
    return {"spectral_norms_text1_3": f"Run `{folder.name}`: {provenance_line(experiment, folder)}.",
            "spectral_norms_text1_6": wq_ratio_text(runs, layer, step), "spectral_norms_text1_9": items,
            "spectral_norms_text2_9": at,
            "spectral_norms_text1_10": wq_comparison_text(runs, layer, short, short_experiment, same)}
