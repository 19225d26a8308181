"""Tables and figures over training runs (loss, W_Q norms, ties, the precursors, the experiment tables).

A run folder is read through :mod:`lpfa.run`; its readers are imported here for the callers that know them by
this module (``lpfa.runs.read_records``, ``load_metrics``, ...).
"""

from __future__ import annotations

import math
from pathlib import Path

from lpfa.run import (  # noqa: F401  (re-exported: the readers live in lpfa.run)
    Run,
    drop_partial_line,
    heads_running_away,
    load_metrics,
    metrics_path,
    read_records,
    read_run_config,
    run_verdict,
)


def plot_losses(runs: dict, smooth: int = 20, ax=None):
    """Training loss (rolling mean over ``smooth`` steps) and evaluation loss of one or more runs
    (``{label: run_dir}``), colours from :data:`lpfa.plotting.COLORS` where a label names a mode."""
    import matplotlib.pyplot as plt

    from lpfa.plotting import COLORS, use_style

    use_style()
    if ax is None:
        _, ax = plt.subplots()
    for i, (label, d) in enumerate(runs.items()):
        train, val, _ = load_metrics(d)
        color = COLORS.get(label, list(COLORS.values())[i % len(COLORS)])
        ax.plot(train.index, train["loss"].rolling(smooth, min_periods=1).mean(), color=color, label=f"{label} (train)")
        if len(val):
            ax.plot(val.index, val["val_loss"], "o--", color=color, ms=4, label=f"{label} (eval)")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss")
    ax.legend()
    return ax.figure


def plot_head_metric(run_dir: str | Path, metric: str = "wq_spectral_norm", layers=None):
    """One panel per layer: ``metric`` (wq_spectral_norm, tie_fraction or max_logit) of every head over training."""
    import matplotlib.pyplot as plt
    import numpy as np

    from lpfa.plotting import use_style

    use_style()
    _, _, diag = load_metrics(run_dir)
    if diag.empty or metric not in diag:
        raise ValueError(f"{run_dir} has no {metric!r} diagnostics (was diag_interval 0?)")
    values = np.array(diag[metric].tolist())  # (records, layers, heads)
    layers = list(range(values.shape[1])) if layers is None else list(layers)
    fig, axes = plt.subplots(1, len(layers), figsize=(2.6 * len(layers), 2.6), sharey=True, squeeze=False)
    for ax, layer in zip(axes[0], layers):
        ax.plot(diag["step"], values[:, layer, :], lw=1)
        ax.set_title(f"layer {layer}", fontsize=9)
        ax.set_xlabel("step")
    axes[0, 0].set_ylabel(metric.replace("_", " "))
    return fig


def head_metric_frame(run_dir: str | Path, metric: str):
    """Long DataFrame (step, layer, head, value) of a per-head diagnostic of a run."""
    import numpy as np
    import pandas as pd

    _, _, diag = load_metrics(run_dir)
    if diag.empty or metric not in diag:
        raise ValueError(f"{run_dir} has no {metric!r} diagnostics (was diag_interval 0?)")
    values = np.array(diag[metric].tolist())  # (records, layers, heads)
    r, L, H = values.shape
    return pd.DataFrame({"step": np.repeat(diag["step"].to_numpy(), L * H), "layer": np.tile(np.repeat(np.arange(L), H), r),
                         "head": np.tile(np.arange(H), r * L), "value": values.reshape(-1)})


def step_before_failure(runs: dict, metric: str = "wq_spectral_norm", failing: str = "bf16",
                        frames: dict | None = None, verdicts: dict | None = None) -> int:
    """The diagnostics step at which to compare heads (Fig. 3's "before the explosion"): the last step that every run
    logged ``metric`` at and that lies before the ``failing`` run's loss explosion (its last step if it did not explode).
    ``frames`` (``{label: head_metric_frame(run, metric)}``) and ``verdicts`` (``{label: run_verdict(run)}``): what the
    caller has already read, so that it is not read again."""
    frames = frames if frames is not None else {k: head_metric_frame(d, metric) for k, d in runs.items()}
    steps = [set(frames[k].step) for k in runs]
    common = sorted(set.intersection(*steps))
    if not common:
        raise ValueError(f"the runs {sorted(runs)} share no diagnostics step of {metric!r}")
    boom = None
    if failing in runs:
        boom = (verdicts[failing] if verdicts and failing in verdicts else run_verdict(runs[failing]))["explosion_step"]
    before = [s for s in common if boom is None or s < boom]
    return int((before or common)[-1])


def plot_head_bars(runs: dict, layer: int, step: int, metric: str = "wq_spectral_norm", ax=None):
    """Fig. 3 as the paper draws it: ``metric`` of every head of ``layer`` at ``step``, one bar per (head, run), each run
    in its mode's colour (:data:`lpfa.plotting.COLORS`), with hatching for the low-precision runs so that BF16 and FP32
    differ by more than colour."""
    import matplotlib.pyplot as plt
    import pandas as pd
    import seaborn as sns

    from lpfa.plotting import color_of

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
    sns.barplot(frame, x="head", y="value", hue="run", palette=palette, ax=ax, edgecolor="black", linewidth=0.4, saturation=1)
    for bars, label in zip(ax.containers, runs):
        if not label.startswith("fp32"):
            for bar in bars:
                bar.set_hatch("//")
    ax.set_ylabel("‖W_Q[h]‖₂" if metric == "wq_spectral_norm" else metric.replace("_", " "))
    ax.set_xlabel(f"head of layer {layer}")
    ax.set_title(f"layer {layer}, step {step:,}: every head", fontsize=10)
    ax.legend(handles=[c.patches[0] for c in ax.containers], labels=list(runs), title=None)  # hatched as the bars
    return ax.figure


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


def growth_table(runs: dict, metric: str = "wq_spectral_norm"):
    """Per run: the (layer, head) whose ``metric`` grew most between the first and last diagnostics record."""
    import pandas as pd

    rows = []
    for label, d in runs.items():
        f = head_metric_frame(d, metric)
        first, last = f[f.step == f.step.min()].set_index(["layer", "head"]).value, f[f.step == f.step.max()].set_index(["layer", "head"]).value
        g = (last / first).sort_values(ascending=False)
        (layer, head), ratio = g.index[0], g.iloc[0]
        rows.append({"run": label, "steps": int(f.step.max()), "layer": int(layer), "head": int(head),
                     f"{metric} first": float(first[(layer, head)]), f"{metric} last": float(last[(layer, head)]),
                     "growth": float(ratio), "largest last value": float(last.max())})
    return pd.DataFrame(rows).set_index("run")


def explorer(runs: dict, metric: str = "wq_spectral_norm"):
    """An ipywidgets explorer (run, layer, heads, step range) of a per-head diagnostic, for JupyterLab.
    Returns the widget; in a static page it shows nothing, so notebooks draw static figures as well."""
    import ipywidgets as w
    import matplotlib.pyplot as plt

    from lpfa.plotting import use_style

    frames = {label: head_metric_frame(d, metric) for label, d in runs.items()}
    first = next(iter(frames.values()))
    n_layer, n_head = int(first.layer.max()) + 1, int(first["head"].max()) + 1
    lo, hi = int(first.step.min()), int(max(f.step.max() for f in frames.values()))

    def show(run, layer, heads, steps):
        use_style()
        f = frames[run]
        f = f[(f.layer == layer) & f["head"].isin(heads) & f.step.between(*steps)]
        fig, ax = plt.subplots(figsize=(6, 3.2))
        for h, g in f.groupby("head"):
            ax.plot(g.step, g.value, label=f"head {h}")
        ax.set_xlabel("step")
        ax.set_ylabel(metric.replace("_", " "))
        ax.set_title(f"{run}, layer {layer}", fontsize=9)
        ax.legend(ncol=4, fontsize=9)
        plt.show()

    return w.interactive(
        show,
        run=w.Dropdown(options=list(frames)),
        layer=w.IntSlider(min=0, max=n_layer - 1, value=min(1, n_layer - 1)),
        heads=w.SelectMultiple(options=list(range(n_head)), value=tuple(range(n_head)), description="heads"),
        steps=w.IntRangeSlider(min=lo, max=hi, value=(lo, hi), step=max(1, (hi - lo) // 100), description="steps"),
    )


PRECURSORS = {"max_logit": "largest attention logit", "tie_fraction": "largest per-head tie fraction",
              "wq_spectral_norm": "largest per-head ‖W_Q[h]‖₂"}


def layer_max(run_dir: str | Path, metric: str, layer: int):
    """Series indexed by step: the largest value over heads of a per-head diagnostic in one layer."""
    f = head_metric_frame(run_dir, metric)
    if layer not in set(f.layer):
        raise ValueError(f"{run_dir} has no layer {layer} (layers {sorted(set(f.layer))})")
    return f[f.layer == layer].groupby("step").value.max()


def precursor_table(runs: dict, layer: int, step: int | None = None, criterion=None, verdicts: dict | None = None):
    """One row per run (``{label: run_dir}``): steps, explosion verdict (:func:`lpfa.run.run_verdict`),
    final eval loss, and in ``layer`` the largest attention logit, tie fraction and W_Q norm at ``step``
    (default: the last diagnostics step that every run reached; each run's last record at or before it).
    ``verdicts``: ``{label: run_verdict(run, criterion)}`` where the caller has them already (else computed here).
    Returns ``(table, step)``."""
    import pandas as pd

    from lpfa.explosion import ExplosionCriterion

    criterion = criterion or ExplosionCriterion()
    verdicts = {label: (verdicts or {}).get(label) or run_verdict(d, criterion) for label, d in runs.items()}
    series = {label: {m: layer_max(d, m, layer) for m in PRECURSORS} for label, d in runs.items()}
    if step is None:
        step = min(int(s["max_logit"].index.max()) for s in series.values())
    rows = {}
    for label, d in runs.items():
        _, val, _ = load_metrics(d)
        row = {"steps": verdicts[label]["steps"], "exploded": verdicts[label]["exploded"],
               "explosion step": verdicts[label]["explosion_step"], "runaway step": verdicts[label]["runaway_step"],
               "runaway layer": verdicts[label]["runaway_layer"],
               "final eval loss": float(val["val_loss"].iloc[-1]) if len(val) else float("nan")}
        for m, name in PRECURSORS.items():
            s = series[label][m]
            before = s[s.index <= step]
            row[f"{name} @ {step}"] = float(before.iloc[-1]) if len(before) else float("nan")
        rows[label] = row
    return pd.DataFrame(rows).T, step


def _plot_precursor_panels(axes, runs: dict, layer: int, style: dict):
    """Draw each run of ``runs`` (``{label: run_dir}``, in order) on ``axes``, one panel per :data:`PRECURSORS`
    (its :func:`layer_max` in ``layer`` over training), in ``style[label]`` = (colour, dash)."""
    for label, d in runs.items():
        for ax, metric in zip(axes, PRECURSORS):
            s = layer_max(d, metric, layer)
            ax.plot(s.index, s.values, color=style[label][0], ls=style[label][1], label=label, lw=1.4)


def plot_precursors(runs: dict, layer: int):
    """The three precursors of one layer over training, one panel per row (legible at page width), every run in its
    mode's colour and line style (:func:`lpfa.plotting.color_of`, :func:`lpfa.plotting.dash_of`)."""
    import matplotlib.pyplot as plt

    from lpfa.plotting import color_of, dash_of, use_style

    use_style()
    fig, axes = plt.subplots(3, 1, figsize=(7.5, 7.2), sharex=True)
    _plot_precursor_panels(axes, runs, layer, {label: (color_of(label), dash_of(label)) for label in runs})
    for ax, name in zip(axes, PRECURSORS.values()):
        ax.set_title(f"layer {layer}: {name}", fontsize=10)
    axes[-1].set_xlabel("step")
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=9)
    return fig


STABILISER_COLORS = ("#E69F00", "#56B4E9", "#CC79A7", "#000000", "#7F7F7F", "#009E73")  # Okabe-Ito, after the modes'


def stabiliser_styles(labels, fp32=()) -> dict:
    """``{label: (colour, dash)}`` for one column of page 17's figure: the base runs in their modes' colours (BF16
    solid, FP32 dashed, SFA dash-dot; their reruns dotted); every other row a colour of its own name (the label without
    its ``bf16_``/``fp32_`` prefix and ``_paper_recipe``), solid, or dashed where the run is in ``fp32`` (FP32-level
    attention), so a stabiliser and its FP32 twin share a colour and differ in dash. No two labels share both."""
    from lpfa.experiments import FP32_RERUN, STABILISER_RERUN
    from lpfa.plotting import COLORS

    base = {"bf16_paper_recipe": (COLORS["bf16"], "-"), "fp32_paper_recipe": (COLORS["fp32"], "--"),
            "sfa_paper_recipe": (COLORS["sfa"], "-."), STABILISER_RERUN: (COLORS["bf16"], ":"),
            FP32_RERUN: (COLORS["fp32"], ":")}

    def name(label):
        return label.removesuffix("_paper_recipe").removeprefix("bf16_").removeprefix("fp32_")

    names = list(dict.fromkeys(name(label) for label in labels if label not in base))
    # beyond the palette the next round of colours gets other dashes: (BF16, FP32) per round
    dashes = [("-", "--"), ((0, (5, 1.5)), (0, (1, 1))), ((0, (3, 1, 1, 1)), (0, (6, 2, 1, 2)))]
    out = {}
    for label in labels:
        if label in base:
            out[label] = base[label]
            continue
        i = names.index(name(label))
        out[label] = (STABILISER_COLORS[i % len(STABILISER_COLORS)],
                      dashes[(i // len(STABILISER_COLORS)) % len(dashes)][label in fp32])
    return out


def plot_stabilisers(runs: dict, layer: int, groups: dict):
    """Page 17's figure: the three logged links of ``layer`` (rows: largest logit, log scale; tie fraction; W_Q) over
    training, one column per group of ``groups`` (``{title: [labels]}``, each label a key of ``runs``), each line in
    its column's :func:`stabiliser_styles` (FP32 twins dashed: every layer "fp32" in
    :func:`lpfa.run.layer_precision`), a legend under each column."""
    import matplotlib.pyplot as plt

    from lpfa.run import layer_precision
    from lpfa.plotting import use_style

    use_style()
    fp32 = {label for labels in groups.values() for label in labels
            if all(p == "fp32" for p in layer_precision(Run(runs[label])))}
    fig, axes = plt.subplots(3, len(groups), figsize=(4.2 * len(groups), 8.0), sharex=True, sharey="row", squeeze=False)
    for col, (title, labels) in enumerate(groups.items()):
        _plot_precursor_panels(axes[:, col], {label: runs[label] for label in labels}, layer,
                               stabiliser_styles(labels, fp32))
        axes[0, col].set_title(title, fontsize=10)
        axes[-1, col].set_xlabel("step")
        axes[-1, col].legend(fontsize=9, ncol=1, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    for row, name in enumerate(PRECURSORS.values()):
        axes[row, 0].set_ylabel(f"layer {layer}:\n{name}", fontsize=9)
    axes[0, 0].set_yscale("log")
    return fig


def stabiliser_groups(labels) -> dict:
    """Page 17's figure columns, :func:`plot_stabilisers`' ``groups``, from the committed rows ``labels`` (in their
    order): the BF16 and FP32 runs of the recipe head both columns; the first holds the paper's own cuts of the chain
    (every other ``*_paper_recipe`` row: SFA, the isolation rows) and the base runs again
    (:data:`lpfa.experiments.RERUNS`), the second every remaining row: the stabilisers and their FP32 twins."""
    from lpfa.experiments import RERUNS

    base = [label for label in ("bf16_paper_recipe", "fp32_paper_recipe") if label in labels]
    cuts = [label for label in labels if label.endswith("_paper_recipe") and label not in base or label in RERUNS]
    stabilisers = [label for label in labels if label not in base and label not in cuts]
    return {"the paper's cuts and reruns": [*base, *cuts], "stabilisers and their FP32 twins": [*base, *stabilisers]}


def divergence_step(a, b, ratio: float, patience: int = 3, permanent: bool = True) -> int | None:
    """When does one run's precursor leave its twin's behind? ``a`` and ``b``: Series indexed by step.

    ``permanent`` (default): the first step from which ``a > ratio × b`` at every later common record, provided
    that stretch holds at least ``patience`` records (None if ``a`` is not above at the end). Otherwise: the
    first step where ``a > ratio × b`` for ``patience`` consecutive common records, even if it falls back later."""
    common = a.index.intersection(b.index).sort_values()
    above = (a.loc[common] > ratio * b.loc[common]).to_numpy()
    if permanent:
        below = [i for i, x in enumerate(above) if not x]
        start = below[-1] + 1 if below else 0
        return int(common[start]) if len(common) - start >= patience else None
    from lpfa.explosion import first_sustained

    start = first_sustained(above, patience)
    return int(common[start]) if start is not None else None


def score_precision(model_conf: dict, layer: int) -> str:
    """How a run's attention scores S = QKᵀ·scale of ``layer`` are rounded (``model_conf``: the ``model`` part of a
    run's config.json): ``bf16`` or ``fp32``, and the heads that differ, e.g. ``bf16; fp32 in heads 2, 5``.
    SDPA's kernels and ``sdpa_fp32`` keep S in FP32; the ``math`` backend under BF16 autocast rounds it to BF16."""
    from lpfa.explosion import heads_text
    from lpfa.model import GPTConfig

    cfg = GPTConfig.from_dict(model_conf)
    backend = cfg.layer_backend(layer)
    if backend != "lpfa":
        return "bf16" if backend == "math" else "fp32"
    pol = cfg.policy(layer)
    if pol.fp32_heads and pol.scores != "fp32":
        return f"{pol.scores}; fp32 in {heads_text(pol.fp32_heads)}"
    return pol.scores


def delta_source(model_conf: dict, layer: int) -> str:
    """What the backward's δ of ``layer`` is computed from (``model_conf``: the ``model`` part of a run's
    config.json), the step of the paper's chain that the isolation rows change (Sec. 3.1, Eq. 3):
    ``bf16 O`` (rowsum(dO∘O) with O rounded to BF16, the paper's failing δ), ``fp32 O`` (with an O kept or
    recomputed in FP32 from the forward's scores), ``exact O`` (O recomputed from FP32 scores, inconsistent with
    the backward's P when the scores are BF16) or ``dP∘P`` (rowsum(dP∘P), which needs no O; also autograd's
    softmax backward, the ``math`` backend); and the heads that differ, e.g. ``bf16 O; fp32 O in head 5``.
    SDPA's flash kernels store a BF16 O under autocast and take δ from it; ``sdpa_fp32`` an FP32 O."""
    from lpfa.explosion import heads_text
    from lpfa.model import GPTConfig

    cfg = GPTConfig.from_dict(model_conf)
    backend = cfg.layer_backend(layer)
    if backend != "lpfa":
        return {"sdpa": "bf16 O", "sdpa_fp32": "fp32 O", "math": "dP∘P"}[backend]
    pol = cfg.policy(layer)
    src = {"dp_p": "dP∘P", "o_fp32": "fp32 O", "o_exact": "exact O"}.get(pol.delta, f"{pol.o_store} O")
    if pol.fp32_heads and src != "fp32 O":
        return f"{src}; fp32 O in {heads_text(pol.fp32_heads)}"
    return src


def experiment_table(folder, labels=None, layer: int = 1, step: int | None = None, reference=None,
                     logit_ratio: float = 10.0):
    """:func:`precursor_table` of the runs of an experiment, with what each run changes
    (:data:`lpfa.experiments.DESCRIPTIONS`), its attention label, seed, whether it was compiled, how ``layer``'s
    scores were rounded (:func:`score_precision`), what its δ is computed from (:func:`delta_source`) and its
    outcome in front. Returns ``(table, step)``: the isolation table, the seeds table.

    ``folder``: an experiment folder (runs in ``folder/<label>/``; default: every subfolder with a
    ``config.json``) or a dict ``{label: run_dir}``. ``reference``: the stable run each row is held against,
    a run folder or a function ``label -> run folder`` (e.g. the FP32 run of the same seed); then the column
    ``precursor from`` is the step from which the layer's largest logit stays above ``logit_ratio`` × the
    reference's (:func:`divergence_step`). Outcome: ``exploded`` (:class:`lpfa.explosion.ExplosionCriterion`),
    else ``ran away`` (:class:`lpfa.explosion.RunawayCriterion`), else ``precursor`` (when a reference is
    given and the logit left it behind for good), else ``clean`` (``stable`` without a reference)."""
    import pandas as pd

    from lpfa.explosion import attention_label
    from lpfa.experiments import DESCRIPTIONS

    if isinstance(folder, dict):
        runs = {label: Path(d) for label, d in folder.items() if labels is None or label in labels}
    else:
        folder = Path(folder)
        if labels is None:
            labels = sorted(p.name for p in folder.iterdir() if (p / "config.json").is_file()) if folder.is_dir() else []
        runs = {label: folder / label for label in labels}
    if not runs:
        raise FileNotFoundError(f"{folder} holds no run folders (subfolders with config.json)")
    table, step = precursor_table(runs, layer, step)
    full = {label: read_run_config(d) for label, d in runs.items()}
    confs, models = {label: c["train"] for label, c in full.items()}, {label: c.get("model") for label, c in full.items()}
    table.insert(0, "change", [DESCRIPTIONS.get(label, "") for label in table.index])
    table.insert(1, "attention", [attention_label(confs[label]) for label in table.index])
    table.insert(2, "seed", [confs[label]["seed"] for label in table.index])
    table.insert(3, "compiled", [bool(confs[label].get("compile", False)) for label in table.index])
    table.insert(4, f"layer {layer} scores", pd.Series([score_precision(models[label], layer) if models[label] else None
                                                         for label in table.index], index=table.index, dtype=object))
    table.insert(5, f"layer {layer} δ from", pd.Series([delta_source(models[label], layer) if models[label] else None
                                                       for label in table.index], index=table.index, dtype=object))
    if reference is not None:
        ref_of = reference if callable(reference) else (lambda label: reference)
        table.insert(6, "precursor from", pd.Series([
            divergence_step(layer_max(runs[label], "max_logit", layer), layer_max(ref_of(label), "max_logit", layer), logit_ratio)
            for label in table.index], index=table.index, dtype=object))
    quiet = "stable" if reference is None else "clean"
    table.insert(6, "outcome", [
        "exploded" if r["exploded"] else "ran away" if r["runaway step"] is not None
        else "precursor" if reference is not None and r["precursor from"] is not None else quiet
        for _, r in table.iterrows()])
    return table, step


def isolation_table(experiment: str = "isolation", layer: int = 1, reference_row: str = "fp32", logit_ratio: float = 10.0,
                    root=None):
    """The isolation table (Sec. 3.2) from the committed runs of ``experiment``: :func:`experiment_table` of every row
    of :data:`lpfa.experiments.ISOLATION` (each from the latest run that has it), each held against ``reference_row`` of its
    own launch (else the latest one), with the paper's verdict in column ``paper``. Returns ``(table, step, rows,
    reference)``: ``rows`` ``{label: run folder}``, ``reference`` the function ``label -> reference run folder``."""
    from lpfa.experiments import ISOLATION, PAPER_ISOLATION
    from lpfa.results import experiment_rows

    rows = experiment_rows(experiment, list(ISOLATION), root=root)
    if reference_row not in rows:
        raise FileNotFoundError(f"reference_row={reference_row!r}: experiment {experiment!r} has no such committed row "
                                f"(rows: {sorted(rows)})")

    def reference(label):  # the reference row of the row's own launch, else the latest one
        own = rows[label].parent / reference_row
        return own if (own / "summary.json").exists() else rows[reference_row]

    table, step = experiment_table(rows, layer=layer, reference=reference, logit_ratio=logit_ratio)
    table.insert(7, "paper", [PAPER_ISOLATION[label] for label in table.index])
    return table, step, rows, reference


def recipe_isolation_table(experiment: str = "paper_recipe", root=None):
    """The isolation rows at the paper's recipe (:data:`lpfa.experiments.RECIPE_ISOLATION`), judged by the loss itself:
    one row per run of ``experiment``'s BF16 twin, FP32 twin and isolation rows, with ``change``, ``paper`` (the paper's
    outcome), ``steps``, ``explosion step``, ``verdict``: "exploded", "clean" (did not explode in at least as many
    steps as the BF16 twin needed to explode) or "too short" (stopped before that step), or "not run yet", and the
    precursor the loss does not show: ``runaway step`` and ``runaway layer`` (:class:`lpfa.explosion.RunawayCriterion`
    on the logged largest logits; None without a runaway), and ``runaway heads``, the heads of that layer whose own
    logits ran away, earliest first (:func:`lpfa.run.heads_running_away`; a tuple, empty without a runaway)."""
    import pandas as pd

    from lpfa.experiments import RECIPE_ISOLATION, rows as experiment_rows_of
    from lpfa.results import experiment_rows

    design = experiment_rows_of(experiment)
    labels = ["bf16_paper_recipe", "fp32_paper_recipe", *(f"{row}_paper_recipe" for row in RECIPE_ISOLATION)]
    found = experiment_rows(experiment, labels, root=root)
    bf16 = run_verdict(found["bf16_paper_recipe"]) if "bf16_paper_recipe" in found else None
    boom = bf16["explosion_step"] if bf16 is not None else None
    out = {}
    for label in labels:
        r = design[label]
        row = {"change": r.description, "paper": r.paper or ("fails" if label.startswith("bf16") else "stable"),
               "steps": None, "explosion step": None, "verdict": "not run yet", "runaway step": None, "runaway layer": None,
               "runaway heads": ()}
        if label in found:
            v = run_verdict(found[label])
            row.update(steps=v["steps"], **{"explosion step": v["explosion_step"], "runaway step": v["runaway_step"],
                                            "runaway layer": v["runaway_layer"]})
            if v["runaway_layer"] is not None:
                row["runaway heads"] = tuple(heads_running_away(found[label], int(v["runaway_layer"])))
            row["verdict"] = ("exploded" if v["exploded"] else
                              "clean" if boom is not None and v["steps"] > boom else "too short")
        out[label] = row
    return pd.DataFrame.from_dict(out, orient="index")


def recipe_runaway_text(recipe, root=None) -> str:
    """Page 10's sentence on the precursor the loss does not show: for each row of :func:`recipe_isolation_table`
    (``recipe``) that stayed clean by the loss although one layer's logits ran away, from which step, in which heads
    (all of them, or named), and for a row with FP32 heads in that layer whether those stayed below the threshold;
    next to the BF16 twin's runaway and explosion steps."""
    from lpfa.explosion import heads_text
    from lpfa.results import experiment_rows

    done = recipe[~recipe.index.isin(["bf16_paper_recipe", "fp32_paper_recipe"]) & (recipe.verdict == "clean")]
    ran_away = [label for label in done.index if done.loc[label, "runaway step"] is not None
                and done.loc[label, "runaway step"] == done.loc[label, "runaway step"]]  # not None, not NaN
    if not ran_away:
        return "No row that stayed clean by the loss showed a logit runaway either."
    found = experiment_rows("paper_recipe", ran_away, root=root)

    def where(label):
        run = Run(found[label])
        heads, n_heads, layer = done.loc[label, "runaway heads"], run.model_config().n_head, int(done.loc[label, "runaway layer"])
        text = f"all {n_heads} heads" if len(heads) == n_heads else heads_text(heads)
        kept = sorted(set((run.train.get("fp32_heads") or {}).get(str(layer), [])) - set(heads))
        return text + (f", while its FP32 {heads_text(kept)} stayed below the runaway threshold" if kept else "")

    bf16 = recipe.loc["bf16_paper_recipe"]
    rows = "; ".join(
        f"`{label}` stayed clean by the loss for {done.loc[label, 'steps']:,.0f} steps, yet its layer-"
        f"{done.loc[label, 'runaway layer']:.0f} logits ran away from step {done.loc[label, 'runaway step']:,.0f} in {where(label)}"
        for label in ran_away)
    return (f"The loss is not the whole story. The BF16 twin's layer-1 logits ran away from step {bf16['runaway step']:,.0f} "
            f"and its loss exploded at {bf16['explosion step']:,.0f}; {rows}. "
            + ("Such a change" if len(ran_away) == 1 else "Each such change")
            + " delays the failure or leaves its precursor in place; whether its loss would explode later is not measured "
              "within one GPU run.")


def against_paper(table) -> dict:
    """How an :func:`isolation_table` compares with the paper: ``sick`` (rows with a precursor or worse), ``by_outcome``
    ``{outcome: [rows]}``, ``paper_stable_but`` (reported stable, sick here), ``paper_fails_but`` (reported failing, clean
    here), ``reported`` (rows the paper reports) and ``agree`` (those that behave as reported)."""
    by = {o: [label for label in table.index if table.loc[label, "outcome"] == o]
          for o in ("exploded", "ran away", "precursor", "clean")}
    sick = set(by["precursor"] + by["ran away"] + by["exploded"])
    reported = [label for label in table.index if table.loc[label, "paper"] in ("fails", "stable")]
    agree = [label for label in reported if (table.loc[label, "paper"] == "fails") == (label in sick)]
    return {"sick": sick, "by_outcome": by, "reported": reported, "agree": agree,
            "paper_stable_but": [label for label in reported if table.loc[label, "paper"] == "stable" and label in sick],
            "paper_fails_but": [label for label in reported if table.loc[label, "paper"] == "fails" and label not in sick]}


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


def seeds_summary(table, mode=lambda label: label.split("_s")[0]):
    """Per mode (``mode(label)``, default the part before ``_s<seed>``): runs, how many exploded and how many
    ran away (:class:`lpfa.explosion.RunawayCriterion`), the spread of their runaway steps, and the steps run;
    when the table has a ``precursor from`` column (:func:`experiment_table` with a reference), also how many
    showed the precursor or worse and the spread of the precursor steps."""
    import pandas as pd

    rows = {}
    for m, g in table.groupby([mode(label) for label in table.index]):
        ra = pd.to_numeric(g["runaway step"], errors="coerce").dropna()
        row = {"runs": len(g), "seeds": ", ".join(str(s) for s in g["seed"]), "exploded": int(g["exploded"].sum()),
               "ran away": len(ra), "first runaway": ra.min() if len(ra) else None,
               "median runaway": ra.median() if len(ra) else None, "last runaway": ra.max() if len(ra) else None}
        if "precursor from" in g:
            pre = pd.to_numeric(g["precursor from"], errors="coerce").dropna()
            row.update({"precursor or worse": int(g["outcome"].isin(["precursor", "ran away", "exploded"]).sum()),
                        "first precursor": pre.min() if len(pre) else None, "last precursor": pre.max() if len(pre) else None})
        rows[m] = {**row, "fewest steps run": int(g["steps"].min())}
    return pd.DataFrame(rows).T


def seed_spread_text(summary, table) -> str:
    """Page 11's "Measured" findings: per mode of :func:`seeds_summary` (``summary``) how many runs exploded, ran away
    and showed the precursor or worse, with the spread of those steps; and, where every BF16 run shows the precursor
    and no FP32 run does, how many BF16 runs ran away within the steps all of them reached and how far apart the
    precursor starts (``table``: the :func:`experiment_table` the summary came from)."""
    import pandas as pd

    lines = []
    for m, r in summary.iterrows():
        line = f"* **{m}**: of {int(r['runs'])} runs, {int(r['exploded'])} exploded and {int(r['ran away'])} ran away"
        if r["ran away"]:
            line += f" (steps {int(r['first runaway']):,} to {int(r['last runaway']):,})"
        line += f"; {int(r['precursor or worse'])} showed the precursor or worse"
        if r["precursor or worse"]:
            line += f", the precursor starting between steps {int(r['first precursor']):,} and {int(r['last precursor']):,}"
        lines.append(line + f". Every run trained at least {int(r['fewest steps run']):,} steps.")
    text = "**Measured.**\n\n" + "\n".join(lines)
    bf16, fp32 = summary.loc["bf16"], summary.loc["fp32"]
    if bf16["precursor or worse"] == bf16["runs"] and fp32["precursor or worse"] == 0:
        horizon = int(bf16["fewest steps run"])  # the steps every BF16 run reached
        early = table[pd.to_numeric(table["runaway step"], errors="coerce") < horizon]
        s1337 = ", ".join(f"step {table.loc[label, 'precursor from']:,} {'compiled' if table.loc[label, 'compiled'] else 'eager'}"
                          for label in table.index if label.startswith("bf16_s1337"))
        text += (f"\n\nWithin the first {horizon:,} steps, {len(early)} of the {int(table.index.str.startswith('bf16').sum())} "
                 "BF16 runs ran away; the others showed the precursor and may run away later. The precursor starts over a span "
                 f"of {int(bf16['last precursor'] - bf16['first precursor']):,} steps across these runs (seed 1337: {s1337}), so "
                 "a single trajectory (the paper's) says little about when; that every BF16 run shows it and no FP32 run does is "
                 "the robust part.")
    return text


def precursor_events(runs: dict, layer: int, reference: str | None = None, logit_ratio: float = 10.0,
                     wq_ratio: float = 1.25):
    """When did each precursor start, per run (``{label: run_dir}``)? Columns: the rise of the layer's worst-head
    and mean-over-heads tie fraction (:func:`lpfa.explosion.rise_step`), the logit runaway and the explosion
    (:func:`lpfa.run.run_verdict`) and, against the ``reference`` run (e.g. the FP32 twin), the step from
    which the layer's largest logit stays above ``logit_ratio`` × and its largest W_Q norm above ``wq_ratio`` ×
    the reference's for good, and when the W_Q norm first did so for a while (:func:`divergence_step`).
    Steps are None where the event did not happen."""
    import pandas as pd

    from lpfa.explosion import rise_step

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


def plot_logit_runaway(runs: dict, layer: int, criterion=None, title: str = ""):
    """The largest attention logit of ``layer`` over training for every run (``{label: run_dir}``), with the
    runaway threshold of :class:`lpfa.explosion.RunawayCriterion`. A label's colour is its mode's
    (``bf16_s2`` → ``bf16``) where :data:`lpfa.plotting.COLORS` has one, else a cycle colour."""
    import matplotlib.pyplot as plt

    from lpfa.explosion import RunawayCriterion
    from lpfa.plotting import COLORS, use_style

    use_style()
    criterion = criterion or RunawayCriterion()
    fig, ax = plt.subplots(figsize=(7, 3.4))
    for i, (label, d) in enumerate(runs.items()):
        s = layer_max(d, "max_logit", layer)
        color = COLORS.get(label, COLORS.get(label.split("_s")[0], plt.cm.tab10(i % 10)))
        ax.plot(s.index, s.values, lw=1.1, label=label, color=color)
    ax.axhline(criterion.logit, color="black", ls=":", lw=0.8, label=f"runaway threshold {criterion.logit:g}")
    ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(f"layer {layer}: largest attention logit")
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=9, ncol=2)
    return fig


def committed_explosions(experiments=("paper_recipe", "isolation", "seeds", "sfa_muon", "muon_long", "sizes"), root=None):
    """Every committed run of ``experiments`` (:func:`lpfa.results.experiment_rows`) with its verdict: a DataFrame
    indexed by (experiment, label) with ``change`` (:data:`lpfa.experiments.DESCRIPTIONS`), ``attention``, ``steps``,
    ``exploded``, ``explosion step``, and ``fp32 twin exploded``: for a ``bf16...`` row, whether the row of the same
    experiment named ``fp32...`` exploded too (None without one). A BF16-only loss explosion, Fig. 2, is a row with
    ``exploded`` and not ``fp32 twin exploded``."""
    import pandas as pd

    from lpfa.experiments import DESCRIPTIONS
    from lpfa.results import experiment_rows

    rows = {}
    for exp in experiments:
        runs = experiment_rows(exp, root=root)
        verdicts = {label: run_verdict(d) for label, d in runs.items()}
        for label, v in verdicts.items():
            twin = verdicts.get("fp32" + label[4:]) if label.startswith("bf16") else None
            rows[exp, label] = {"change": DESCRIPTIONS.get(label, ""), "attention": v["policy"], "steps": v["steps"],
                                "exploded": v["exploded"], "explosion step": v["explosion_step"],
                                "fp32 twin exploded": None if twin is None else twin["exploded"]}
    return pd.DataFrame.from_dict(rows, orient="index")


def bf16_only_explosions(table):
    """The rows of :func:`committed_explosions` that are Fig. 2: a BF16 run that exploded while its FP32 twin (same
    experiment, same data order) did not."""
    return table[table["exploded"].astype(bool) & table["fp32 twin exploded"].eq(False)]  # None (no twin) is not False


def _and(items: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return " and ".join([", ".join(items[:-1]), items[-1]] if len(items) > 1 else items)


def seed_table(rows: dict, prefix: str = "bf16"):
    """Fig. 2 over seeds: one row per run of ``rows`` (``{label: run folder}``, :func:`lpfa.results.experiment_rows`)
    whose label starts with ``prefix``, with its ``seed``, ``steps``, ``explosion step`` (None: did not explode) and its
    FP32 twin's (the row named ``fp32`` + the rest of the label): ``fp32 steps`` and ``fp32 explosion step``, both None
    where the twin is not run yet, and ``fp32 exploded`` (None without a twin)."""
    import pandas as pd

    out = {}
    for label, d in rows.items():
        if not label.startswith(prefix):
            continue
        v = run_verdict(d)
        twin = rows.get("fp32" + label[len(prefix):])
        t = run_verdict(twin) if twin is not None else None
        out[label] = {"seed": v["seed"], "steps": v["steps"], "explosion step": v["explosion_step"],
                      "fp32 steps": None if t is None else t["steps"],
                      "fp32 explosion step": None if t is None else t["explosion_step"],
                      "fp32 exploded": None if t is None else bool(t["exploded"])}
    return pd.DataFrame.from_dict(out, orient="index")


def seeds_text(table) -> str:
    """:func:`seed_table` in one sentence: in how many seeds the BF16 run exploded (at which steps), and how many of
    their FP32 twins have run and exploded."""
    if table.empty:
        return "No BF16 run at this recipe is committed."
    boom = table["explosion step"].dropna().astype(int)
    ran = table[table["fp32 exploded"].notna()]
    text = (f"The BF16 run exploded in {len(boom)} of {len(table)} seed{'s' if len(table) > 1 else ''}"
            + (f" (at step{'s' if len(boom) > 1 else ''} {_and([f'{s:,}' for s in sorted(boom)])})" if len(boom) else "")
            + f"; {len(ran)} FP32 twin{'s' if len(ran) != 1 else ''} ran"
            + (f" ({_and([f'{int(s):,}' for s in ran['fp32 steps']])} steps)" if len(ran) else "")
            + f" and {int(ran['fp32 exploded'].astype(bool).sum())} exploded")
    missing = [f"`fp32{label[4:]}`" for label in table.index[table["fp32 exploded"].isna()]]
    return text + (f"; still to run: {', '.join(missing)}." if missing else ".")


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
            line += f" ({_and(stopped)} stopped by hand after {'it' if len(stopped) == 1 else 'they'} had exploded.)"
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


def twins_text(runs: dict, layer: int, criterion=None, bf16: str = "bf16", fp32: str = "fp32",
               verdicts: dict | None = None) -> str:
    """Fig. 2's verdict for one BF16/FP32 pair in sentences: whether each exploded (``lpfa.explosion``), where the BF16
    run's layer ``layer`` ran away, the precursors of both at the last diagnostics step both reached
    (:func:`precursor_table`), and from when the BF16 logit and W_Q norm stay apart (:func:`divergence_step`).
    ``verdicts``: ``{label: run_verdict(run, criterion)}`` where the caller has them already; each run is judged once."""
    v = {label: (verdicts or {}).get(label) or (run_verdict(d, criterion) if criterion else run_verdict(d)) for label, d in runs.items()}
    table, common = precursor_table(runs, layer, criterion=criterion, verdicts=v)
    name = {m: f"{n} @ {common}" for m, n in PRECURSORS.items()}
    b, f = table.loc[bf16], table.loc[fp32]
    if v[bf16]["exploded"] and not v[fp32]["exploded"]:
        text = [f"**The BF16 run's loss exploded at step {v[bf16]['explosion_step']:,}; its FP32 twin trained "
                f"{v[fp32]['steps']:,} steps on the same batches without exploding** (final eval loss {f['final eval loss']:.2f})."]
    elif v[bf16]["exploded"]:
        text = [f"Both runs exploded (BF16 at step {v[bf16]['explosion_step']:,}, FP32 at {v[fp32]['explosion_step']:,}): "
                "a generic instability, not Fig. 2."]
    else:
        text = [f"The BF16 run did not explode in its {v[bf16]['steps']:,} steps"
                + (f" (its FP32 twin did, at step {v[fp32]['explosion_step']:,})" if v[fp32]["exploded"] else
                   f" (nor its FP32 twin in {v[fp32]['steps']:,})") + ", so these runs do not reproduce Fig. 2's explosion."]
    ra = v[bf16]["runaway_step"]
    if ra is not None:
        text.append(f"By the runaway criterion the BF16 run's layer {v[bf16]['runaway_layer']} ran away at step {ra:,}"
                    + (f", {v[bf16]['explosion_step'] - ra:,} steps before its loss exploded; " if v[bf16]["exploded"] else
                       f", {v[bf16]['steps'] - ra:,} steps before the run ended; ")
                    + ("the FP32 twin's never did." if v[fp32]["runaway_step"] is None else
                       f"the FP32 twin's at step {v[fp32]['runaway_step']:,}."))
    text.append(f"At step {common:,}, layer {layer}'s largest attention logit is {b[name['max_logit']]:,.0f} with BF16 attention "
                f"against {f[name['max_logit']]:,.0f} with FP32, its most tied head has tied maxima in "
                f"{b[name['tie_fraction']]:.0%} of its rows (BF16 scores) against {f[name['tie_fraction']]:.1%} (FP32 scores), "
                f"and its largest ‖W_Q[h]‖₂ is {b[name['wq_spectral_norm']]:.1f} against {f[name['wq_spectral_norm']]:.1f}.")
    div = {m: divergence_step(layer_max(runs[bf16], m, layer), layer_max(runs[fp32], m, layer), r)
           for m, r in (("max_logit", 10.0), ("wq_spectral_norm", 1.25))}
    when = lambda s: "never for good" if s is None else f"from step {s:,} on"  # noqa: E731
    text.append(f"The BF16 logit stays above 10× the FP32 twin's {when(div['max_logit'])}, and the BF16 W_Q norm above "
                f"1.25× {when(div['wq_spectral_norm'])} (`lpfa.runs.divergence_step`).")
    return " ".join(text)


def explosions_text(table) -> str:
    """:func:`committed_explosions` in one sentence: how many runs, which exploded (and whether the FP32 twin of a
    BF16 row did too)."""
    boom = table[table["exploded"]]
    text = f"Of the {len(table)} committed runs of the {', '.join(dict.fromkeys(e for e, _ in table.index))} experiments, "
    if boom.empty:
        return text + "none exploded."
    parts = []
    for (exp, label), r in boom.iterrows():
        twin = "" if r["fp32 twin exploded"] is None else (", its FP32 twin too" if r["fp32 twin exploded"] else
                                                           ", its FP32 twin not")
        parts.append(f"`{label}` ({exp}: {r['change'] or r['attention']}; step {int(r['explosion step']):,}{twin})")
    return text + f"{len(boom)} exploded: " + "; ".join(parts) + "."


STABILISER_BASE = ("bf16_paper_recipe", "sfa_paper_recipe", "fp32_paper_recipe")  # paper_recipe's rows the page holds them against
STABILISER_LINKS = {"ties": "largest per-head tie fraction", "logit": "largest attention logit", "W_Q": "largest per-head ‖W_Q[h]‖₂"}


# the links a checkpoint gives (lpfa doctor, issue 19): per row, on layer `layer` of its last doctor report
DOCTOR_LINKS = {"doctor step": "the checkpoint's step", "δ |t| paper": "largest |t| of δ_lp − δ_hp over the heads, paper policy",
                "δ |t| own": "the same with the run's own BF16 policy (when it is not paper or fa2)",
                "rank-1 similarity": "median over the heads of the median similarity of (PK)[T]ᵀX[T] (Fig. 9)"}


T_RESOLVED = 3.0  # |t| of the δ error from which page 17 counts the doctor's probe as resolving a bias


def eval_loss_gap(val, twin_val) -> tuple[int | None, float]:
    """The cost of a stabiliser in loss (issue 19 §1): a run's eval loss minus its FP32 twin's at the last eval step
    both logged (runs stop at different steps, and the loss falls throughout), as ``(step, gap)``; ``(None, nan)`` when
    they share no eval step. ``val``, ``twin_val``: the runs' eval frames (:func:`load_metrics`' second), loaded once
    by the caller however many rows share a twin."""
    if len(val) == 0 or len(twin_val) == 0:
        return None, float("nan")
    common = val.index.intersection(twin_val.index)
    if not len(common):
        return None, float("nan")
    step = int(common.max())
    return step, float(val.loc[step, "val_loss"] - twin_val.loc[step, "val_loss"])


def doctor_links(run, layer: int = 1) -> dict:
    """:data:`DOCTOR_LINKS` of ``layer`` from the last of :attr:`lpfa.run.Run.doctor_reports` of ``run`` (a run
    folder or Run), plus ``"doctor source"`` (its folder) and ``"doctor probe"`` (sequences × tokens); an empty dict
    for a run without a doctor report."""
    import numpy as np

    reports = (run if isinstance(run, Run) else Run(run)).doctor_reports
    if not reports:
        return {}
    step, rep = max(reports.items())
    heads = [r for r in rep["table"] if r["layer"] == layer]

    def largest_abs(col):
        vals = [abs(r[col]) for r in heads if r.get(col) is not None]
        return max(vals) if vals else None

    sims = sorted(r["rank1_median"] for r in heads if r.get("rank1_median") is not None)
    return {"doctor step": step, "δ |t| paper": largest_abs("delta_t_paper"), "δ |t| own": largest_abs("delta_t_trained"),
            "rank-1 similarity": float(np.median(sims)) if sims else None, "doctor source": rep["source"],
            "doctor probe": " × ".join(str(n) for n in rep["probe"]["shape"])}


def stabiliser_table(layer: int = 1, root=None):
    """Issue 19 §1, which link of the chain each stabiliser breaks: :func:`experiment_table` of the unstabilised BF16 run
    at the paper's recipe (``bf16_paper_recipe``), SFA (``sfa_paper_recipe``), the isolation rows committed at the recipe
    (:data:`lpfa.experiments.RECIPE_ISOLATION`: the paper's own cuts of the chain), every committed row of
    :data:`lpfa.experiments.STABILISERS` and the FP32 twins, each held against its own FP32 twin (the row's
    ``reference``; the FP32 policy twin ``fp32_paper_recipe`` where the stabiliser changes only the attention's rounding),
    with the logged links of ``layer`` at the last diagnostics step before the BF16 run's explosion (every run reached it,
    or its last record before it counts) also as ratios to the BF16 run's (``ties ÷ bf16``,
    ``logit ÷ bf16``, ``W_Q ÷ bf16``), ``stabiliser`` naming the row's switch and ``speed ÷ base`` its tokens/s alone
    on one GPU over its speed base's (:func:`stabiliser_costs`; None where it was not timed). Returns ``(table, step, pending)``:
    ``pending`` the stabiliser rows not committed yet. Empty table (and step None) without the BF16 run."""
    import pandas as pd

    from lpfa.experiments import FP32_RERUN, RECIPE_ISOLATION, RERUNS, STABILISER_RERUN, STABILISERS, rows as rows_of
    from lpfa.results import experiment_rows

    cuts = [f"{row}_paper_recipe" for row in RECIPE_ISOLATION]
    base = experiment_rows("paper_recipe", [*STABILISER_BASE, *cuts], root=root)
    found = experiment_rows("stabilisers", list(STABILISERS), root=root)
    pending = [label for label in STABILISERS if label not in found]
    if "bf16_paper_recipe" not in base:
        return pd.DataFrame(), None, pending
    design = rows_of("stabilisers")
    runs = {**base, **found}

    def twin(label):  # the label of the row's FP32 reference
        ref = design[label].reference if label in design else None
        return ref if ref in found else "fp32_paper_recipe" if "fp32_paper_recipe" in base else label

    def reference(label):
        return runs[twin(label)]

    boom = run_verdict(base["bf16_paper_recipe"])["explosion_step"]  # compare before the BF16 loss explodes
    logged = layer_max(base["bf16_paper_recipe"], "max_logit", layer).index
    step = int(max(s for s in logged if boom is None or s < boom))
    table, step = experiment_table(runs, layer=layer, step=step, reference=reference)
    for short, col in STABILISER_LINKS.items():
        name = f"{col} @ {step}"
        table[f"{short} ÷ bf16"] = table[name].astype(float) / float(table.loc["bf16_paper_recipe", name])
    table["FP32 twin"] = [twin(label) for label in table.index]
    vals = {label: load_metrics(d)[1] for label, d in runs.items()}  # each run's evals once, twins shared by rows
    gaps = {label: eval_loss_gap(vals[label], vals[twin(label)]) for label in table.index}
    table["eval loss − twin"] = [gaps[label][1] for label in table.index]
    table["gap step"] = pd.Series([gaps[label][0] for label in table.index], index=table.index, dtype=object)
    costs = stabiliser_costs(root)  # the speed alone on one GPU (benchmarks/stabiliser_cost.py); the cuts were not timed
    same = {STABILISER_RERUN: "bf16_paper_recipe", FP32_RERUN: "fp32_paper_recipe"}  # a rerun is its base again
    table["speed ÷ base"] = pd.Series({label: costs["÷ base"].get(same.get(label, label)) for label in table.index},
                                      dtype=object)
    doctor = {label: doctor_links(runs[label], layer) for label in table.index}
    for col in [*DOCTOR_LINKS, "doctor source", "doctor probe"]:
        table[col] = pd.Series([doctor[label].get(col) for label in table.index], index=table.index, dtype=object)
    switch = {label: " ".join(o.split("=", 1)[1] if o.startswith("attn_") else o for o in design[label].overrides)
              for label in found if label not in RERUNS}
    named = {"bf16_paper_recipe": "none", "sfa_paper_recipe": "paper_sfa", "fp32_paper_recipe": "none (FP32)",
             STABILISER_RERUN: "none (run again)", FP32_RERUN: "none (FP32, run again)",
             **{c: f"isolation: {c.removesuffix('_paper_recipe')}" for c in cuts}}
    table.insert(0, "stabiliser", [switch.get(label, named.get(label, "")) for label in table.index])
    return table, step, pending


def stabiliser_costs(root=None):
    """What each stabiliser costs in speed (issue 19 §1), from the latest ``results/stabiliser_cost`` run
    (``benchmarks/stabiliser_cost.py``: every row built as ``lpfa.train`` builds it, timed alone on one idle GPU): a
    DataFrame indexed by row label with ``tokens/s``, ``speed base`` (the row it is divided by), ``÷ base`` and
    ``heads clipped`` (QK-clip's rescales over the row's steps; None without QK-clip), in the benchmark's order (the reruns are not timed: they are their base runs again). Empty without a committed run;
    a row that failed there has no tokens/s."""
    import pandas as pd

    from lpfa.results import load

    columns = ["tokens/s", "speed base", "÷ base", "heads clipped"]
    try:
        rows = load("stabiliser_cost", "summary.json", root=root)
    except FileNotFoundError:
        return pd.DataFrame(columns=columns)
    return pd.DataFrame([[r.get("tokens_per_s"), r.get("speed_base"), r.get("ratio_to_base"), r.get("qk_clipped")]
                         for r in rows.values()], index=list(rows), columns=columns)


def stabiliser_cost_text(costs) -> str:
    """:func:`stabiliser_costs` in sentences: the speed of the BF16 stabiliser rows (and SFA) as a fraction of their
    base's, slowest first, then their FP32 twins'; for scale, what FP32 attention, Muon and eager mode cost the BF16
    run; whether QK-clip rescaled any head while it was timed; and how far any row measured above its base (the
    timing's noise: a stabiliser only adds work)."""
    from lpfa.experiments import BASES, STABILISERS

    if costs.empty:
        return "No speed benchmark of the stabilisers is committed yet (`benchmarks/stabiliser_cost.py`)."
    timed = costs.dropna(subset=["÷ base"])
    rows = timed.loc[[label for label in timed.index if label in STABILISERS and label not in BASES
                      or label == "sfa_paper_recipe"]].sort_values("÷ base")

    def listed(labels):
        return ", ".join(f"`{label}` ×{rows.loc[label, '÷ base']:.2f}" + ("" if rows.loc[label, "speed base"].endswith(
            "_paper_recipe") else f" (of `{rows.loc[label, 'speed base']}`)") for label in labels)

    bf16 = [label for label in rows.index if not label.startswith("fp32")]
    fp32 = [label for label in rows.index if label.startswith("fp32")]
    text = (f"Alone on one idle GPU, at the recipe's batch and compiled unless the row runs eager, the BF16 stabilisers "
            f"train at {listed(bf16)} of the BF16 run's tokens/s" + (f", their FP32 twins at {listed(fp32)} of the FP32 "
                                                                     "run's" if fp32 else "") + ".")
    scale = [f"{what} at ×{timed.loc[label, '÷ base']:.2f}" for label, what in (
        ("fp32_paper_recipe", "FP32 attention runs"), ("bf16_muon_recipe", "Muon in place of AdamW"),
        ("bf16_eager", "the BF16 run eager")) if label in timed.index]
    if scale:
        text += " For scale: " + _and(scale) + " of the BF16 run's speed."
    clipped = costs["heads clipped"].dropna()
    if len(clipped) and not clipped.astype(float).any():
        text += (" QK-clip rescaled no head in the timed steps (random tokens, from initialisation), so its "
                 "cost here is the tracking of the largest logits and the check.")
    over = float(timed["÷ base"].max()) - 1
    if over > 0:
        text += (f" One timing per row: `{timed['÷ base'].astype(float).idxmax()}` measured ×{1 + over:.3f} of its base, "
                 f"so differences of about {100 * over:.0f} % or less are within the noise.")
    return text


# steps per row; seconds of one GPU call's runs (time_budget_s): what fits with the machine's start, the polls and two
# doctor reports in a session's 1,800 device seconds (results/stabilisers/h200-2026-12-03c ran with BUDGET=1150, its runs
# took 955 and 1,041 s and the lease was held 1,140 s in all: about 100 s beside the runs, 1,300 leaves room for one
# failed machine start)
STABILISER_STEPS, STABILISER_BUDGET_S = 6000, 1300


def _speed_key(attn_policy: str, compile_: bool, optimizer: str = "adamw") -> str:
    """What sets a stabiliser row's speed on a shared H200: FP32-level attention or not
    (:func:`lpfa.run.attention_precision` of the policy, which sets a soft-cap aside), compiled or eager, and the
    optimizer where it is not AdamW (Muon's orthogonalisation costs time)."""
    from lpfa.run import attention_precision
    from lpfa.attention.policy import get_policy

    fp32 = attention_precision("lpfa", get_policy(attn_policy)) == "fp32"
    return f"{'FP32' if fp32 else 'BF16'}, {'compiled' if compile_ else 'eager'}" + ("" if optimizer == "adamw" else f", {optimizer}")


def stabiliser_speeds(root=None):
    """Tokens/s of each committed stabiliser run while it shared one H200 with others: its steps × tokens per step over
    its wall time (compilation, evaluations and checkpoints included), from the launches with the most runs. Returns
    ``(speeds, sharing)``: ``{key: (tokens/s, run label)}`` per :func:`_speed_key` (the latest run of that key) and the
    number of runs those launches shared the GPU between. ``({}, 0)`` without a committed stabiliser run."""
    from lpfa.results import runs as launches

    try:
        folders = launches("stabilisers", root)
    except FileNotFoundError:
        return {}, 0
    by_launch = {f: [Run(d) for d in sorted(f.iterdir()) if (d / "summary.json").is_file()] for f in folders}
    sharing = max((len(r) for r in by_launch.values()), default=0)
    speeds = {}
    for runs in by_launch.values():  # oldest first: a later run of the same key replaces an earlier one
        if len(runs) == sharing:
            for r in runs:
                key = _speed_key(r.train["attn_policy"], r.train["compile"], r.train.get("optimizer", "adamw"))
                speeds[key] = (r.summary["steps"] * r.train["batch_size"] * r.train["block_size"] / r.summary["wall_s"], r.path.name)
    return speeds, sharing


def stabiliser_plan(pending: list[str], root=None) -> str:
    """Page 17's next step for the ``pending`` stabiliser rows: the rows grouped, in order, into GPU calls of as many
    rows as the committed launches shared one H200 between (:func:`stabiliser_speeds`), each row timed at the measured
    speed of a committed run of its precision and compilation, scaled by the two rows' speeds alone on one GPU
    (:func:`stabiliser_costs`) where both were timed (a soft-cap or a clip costs what the precision does not say), and
    the first call's command with :data:`STABILISER_BUDGET_S`. A row timed alone but of a kind no committed run has is
    scaled from a committed run of another kind; a row with no speed at all gets a call of its own. Empty without the
    BF16 run of the recipe or a committed stabiliser run."""
    from lpfa.experiments import rows as rows_of
    from lpfa.results import experiment_rows

    if not pending:
        return "Every stabiliser row is committed."
    base = experiment_rows("paper_recipe", ["bf16_paper_recipe"], root=root)
    speeds, sharing = stabiliser_speeds(root)
    if not base or not speeds:
        return ""
    bf16 = Run(base["bf16_paper_recipe"]).train
    batch, tokens = bf16["batch_size"], STABILISER_STEPS * bf16["batch_size"] * bf16["block_size"]
    design = rows_of("stabilisers")
    alone = stabiliser_costs(root)["tokens/s"].dropna().to_dict()

    def key(label):
        o = dict(x.split("=", 1) for x in design[label].overrides)
        return _speed_key(o.get("attn_policy", bf16["attn_policy"]), o.get("compile", "true").lower() == "true",
                          o.get("optimizer", bf16.get("optimizer", "adamw")))

    def speed(label) -> float | None:  # tokens/s sharing the H200
        own = [speeds[key(label)]] if key(label) in speeds else []
        if label in alone:  # from a run of its kind, else of any kind, that was timed alone too
            for tps, ref in own + sorted(speeds.values(), key=lambda v: v[1]):
                if ref in alone:
                    return tps * alone[label] / alone[ref]
        return own[0][0] if own else None

    calls, call = [], []
    for label in pending:
        if speed(label) is None:
            calls += [call, [label]] if call else [[label]]
            call = []
            continue
        call.append(label)
        if len(call) == sharing:
            calls.append(call)
            call = []
    calls += [call] if call else []

    def minutes(label):
        return f"{tokens / speed(label) / 60:.1f} min" if speed(label) is not None else "speed not measured"

    measured = "; ".join(f"{k}: {tps:,.0f} tokens/s (`{name}`)" for k, (tps, name) in sorted(speeds.items()))
    scaled = (", each scaled by the row's tokens/s alone on one GPU over that run's (`benchmarks/stabiliser_cost.py`)"
              if any(label in alone for label in pending) else "")
    over = [label for label in calls[0] if speed(label) is not None and tokens / speed(label) > STABILISER_BUDGET_S]
    first = " ".join(calls[0])
    later = " then ".join("`" + " ".join(c) + "`" for c in calls[1:])
    return (f"Sharing one H200 {sharing} ways, a committed run trained ({measured}; compilation, evaluations and "
            f"checkpoints included){scaled}, so {STABILISER_STEPS:,} steps at batch {batch} take "
            + ", ".join(f"`{label}` {minutes(label)}" for label in pending)
            + f". The next GPU call: `ONLY=\"{first}\" EXPERIMENT=stabilisers BATCH={batch} DOCTOR_STEP=5000 "
            f"DOCTOR_EVERY=1000 PHASE=start BUDGET={STABILISER_BUDGET_S} WAIT=20 EXTRA=\"stop_at_step={STABILISER_STEPS}\" "
            "bash scripts/gpu/paper_recipe.sh`, then the same with `PHASE=finish WAIT=300`, which runs `lpfa doctor` on "
            "each run's last checkpoint at or before step 5,000 and before its explosion, for the δ-bias and similarity links"
            + (f" ({', '.join(f'`{x}`' for x in over)} would stop before step {STABILISER_STEPS:,} at "
               f"{STABILISER_BUDGET_S:,} s)" if over else "")
            + (f"; after it, {later}." if later else "."))


KEPT = 0.8  # an accumulation of at least this × √steps: the error kept its value over the steps (at most 1)
SR_POLICIES = {"paper": "paper", "paper_sr": "paper_sr", "paper_sr reseeded": "paper_sr", "o_fp32": "o_fp32",
               "scores_fp32": "scores_fp32"}  # error_persistence's rows on page 17: rounding points on or off O's path


def sr_persistence(sequences: int = 1, steps: int = 8, rel: float = 1e-3, root=None):
    """Page 17's look at why stochastic rounding did not help: :func:`lpfa.mechanism.error_persistence` of
    :data:`SR_POLICIES` (``paper_sr reseeded``: a new seed each step) on the first ``sequences`` of the layer's q, k, v,
    dO that the latest kernel-bias audit captured (``results/kernel_bias/<run>/<name>/qkv.npz``, a BF16 run before or
    in its logit runaway). Returns ``(table, text, meta)``: per policy the worst head's mean g (the head with the
    largest |mean g| under ``paper``), it over ``paper``'s, and its accumulation; ``text`` the finding in words;
    ``meta`` the capture's. ``(None, reason, None)`` without a capture."""
    import pandas as pd

    from lpfa.audit import load_captured
    from lpfa.mechanism import error_persistence
    from lpfa.results import runs as launches

    try:
        caps = sorted(launches("kernel_bias", root)[-1].glob("*/qkv.npz"))
    except FileNotFoundError:
        caps = []
    if not caps:
        return None, "No captured q, k, v, dO is committed (`results/kernel_bias/<run>/<name>/qkv.npz`).", None
    x, meta = load_captured(caps[0])
    q, k, v, do = (x[n][:sequences] for n in ("q", "k", "v", "do"))
    t = error_persistence(q, k, v, do, SR_POLICIES, steps=steps, rel=rel, reseed=("paper_sr reseeded",)).sort_index()
    worst = t.loc["paper", "mean g"].abs().idxmax()  # (batch, head)
    ref = t.loc[("paper", *worst), "mean g"]
    table = pd.DataFrame({name: {"worst head's mean g": t.loc[(name, *worst), "mean g"],
                                 "÷ paper": t.loc[(name, *worst), "mean g"] / ref,
                                 "its accumulation": t.loc[(name, *worst), "accumulation"],
                                 "median accumulation over heads": float(t.loc[name, "accumulation"].median())}
                          for name in SR_POLICIES}).T
    r = table["÷ paper"]
    kept = bool((table.loc[["paper_sr", "paper_sr reseeded"], "its accumulation"] >= KEPT * math.sqrt(steps)).all())
    text = (f"On the layer-{meta['layer']} q, k, v and dO captured at step {meta['step']:,} of a BF16 run "
            f"({meta['policy']}; {sequences} sequence{'s' if sequences > 1 else ''}), drifted over {steps} steps by "
            f"{rel:g} per step, head {worst[1]} carries the largest δ error (Σ_T δ_lp − δ_hp = {ref:.2e} under `paper`). "
            f"Stochastic rounding leaves {r['paper_sr']:.2f}× of it with one seed and {r['paper_sr reseeded']:.2f}× reseeded "
            f"each step, with accumulations {table.loc['paper_sr', 'its accumulation']:.2f} and "
            f"{table.loc['paper_sr reseeded', 'its accumulation']:.2f} of at most √{steps} = {math.sqrt(steps):.2f}: "
            + ("it keeps its sign either way" if kept else "it does not keep its value from step to step") + ". "
            f"O's path in FP32 (`o_fp32`) leaves {r['o_fp32']:.2f}×, FP32 scores (`scores_fp32`) "
            f"{r['scores_fp32']:.3f}×: here the error comes from rounding S to BF16, a rounding point that SR at O's path "
            "does not touch." if abs(r["scores_fp32"]) < 0.1 and abs(r["paper_sr"]) > 0.5 else
            f"Stochastic rounding leaves {r['paper_sr']:.2f}× of the worst head's δ error with one seed and "
            f"{r['paper_sr reseeded']:.2f}× reseeded; FP32 scores leave {r['scores_fp32']:.3f}×.")
    return table, text, meta


def _link_ratios(row) -> str:
    """A :func:`stabiliser_table` row's logged links as ratios to the BF16 run's, as page 17's sentences give them."""
    return f"ties ×{row['ties ÷ bf16']:.2f}, largest logit ×{row['logit ÷ bf16']:.2g}, W_Q ×{row['W_Q ÷ bf16']:.2f}"


# nats: an eval loss within 0.05 of the FP32 twin's matches it; ten times the spread of two FP32 runs of one seed
# (fp32_rerun ended 0.005 below fp32_paper_recipe at step 5,000)
LOSS_MATCH = 0.05


def _loss_fate(row) -> str:
    """A :func:`stabiliser_table` row's loss in words: where it exploded, or that the explosion criterion never fired and
    its eval loss against its FP32 twin's (not "clean": a row can end far above its twin without exploding)."""
    if row["exploded"]:
        return f"its loss exploded at step {row['explosion step']:,}"
    gap = row["eval loss − twin"]
    if row["FP32 twin"] == row.name or gap != gap:
        return f"no loss explosion in {row['steps']:,} steps"
    return (f"no loss explosion in {row['steps']:,} steps, its eval loss {gap:+.2f} against `{row['FP32 twin']}`'s at step "
            f"{row['gap step']:,}")


# A row keeps the ties when its largest per-head tie fraction is above half the BF16 run's (ratio ``ties ÷ bf16``)
TIES_KEPT = 0.5


def _failure(row) -> str:
    """How a :func:`stabiliser_table` row fails to hold, in words: it explodes, or keeps a logit runaway, or ends more than
    :data:`LOSS_MATCH` from its FP32 twin's eval loss; ``""`` when it holds."""
    if row["exploded"]:
        return f"explodes (step {row['explosion step']:,})"
    what = []
    if row["runaway step"] is not None:
        what.append(f"keeps the logit runaway (layer {row['runaway layer']}, from step {row['runaway step']:,})")
    gap = row["eval loss − twin"]
    if gap == gap and abs(gap) > LOSS_MATCH:
        what.append(f"ends {abs(gap):.2f} {'above' if gap > 0 else 'below'} its FP32 twin's eval loss")
    return " and ".join(what)


# The paper's Discussion on why stabilisers work (no experiment there): the link each one is said to break
PAPER_CLAIMS = {"qknorm": ("rank-1 similarity", "QK-norm works because it disrupts the structural similarity of (PK)[T]ᵀX[T]"),
                "gated": ("rank-1 similarity", "gated attention works because it disrupts that structural similarity"),
                "qkclip": ("ties", "QK-clipping works by making P̄ = 1 rarer")}


def _claim_verdict(broken, failure: str) -> str:
    """One :data:`PAPER_CLAIMS` claim judged on one BF16 row: whether the row breaks the claimed link (``broken``:
    True, False or None when unmeasured) and whether it holds (``failure`` is ``""``, from :func:`_failure`). The claim
    is "this stabiliser works because it breaks this link", so it stands only when the row does both."""
    if broken is None:
        return "not judged: the link is not measured on this row"
    if broken and not failure:
        return "consistent with the claim: the row breaks the link and holds"
    if not failure:
        return "**against the claim**: the row holds with the link intact, so the link is not why it works here"
    if broken:
        return f"**against the claim**: the row breaks the link, yet it {failure}, so breaking the link is not enough here"
    return f"**against the claim**: the row leaves the link intact and {failure}; the stabiliser does not work here"


def paper_claims(table) -> list[dict]:
    """The paper's Discussion (:data:`PAPER_CLAIMS`) judged on each committed BF16 stabiliser row of
    :func:`stabiliser_table`: per claim ``who`` (the stabiliser), ``label``, ``broken`` (whether the row breaks the
    link it is said to break; None when unmeasured), ``holds`` (no :func:`_failure`), ``short`` (the link's number in a
    few words) and ``item`` (the claim, the row's links and fate, its FP32 twin and the verdict, as a MyST list item).

    The link is measured against the unstabilised BF16 run (the doctor's rank-1 similarity against ``bf16_rerun``'s,
    which has the checkpoint; ties against ``bf16_paper_recipe``'s), with the FP32 run's similarity beside it
    (``fp32_rerun``: what the link is without BF16 attention). It counts as broken when the row's rank-1 similarity is
    below the FP32 run's (BF16 attention no longer adds structure that FP32 attention lacks), or when its ties fall to
    :data:`TIES_KEPT` of the BF16 run's or fewer; the verdict is :func:`_claim_verdict`'s."""
    from lpfa.experiments import FP32_RERUN, STABILISER_RERUN

    if table.empty:
        return []
    base = table.loc[STABILISER_RERUN, "rank-1 similarity"] if STABILISER_RERUN in table.index else None
    healthy = table.loc[FP32_RERUN, "rank-1 similarity"] if FP32_RERUN in table.index else None
    claims = []
    for name, (link, claim) in PAPER_CLAIMS.items():
        label = f"bf16_{name}"
        if label not in table.index:
            continue
        r = table.loc[label]
        fate = _loss_fate(r).removeprefix("its loss ") + (f", its layer-{r['runaway layer']} logits running away from "
                                                           f"step {r['runaway step']:,}" if r["runaway step"] is not None else "")
        ratios = _link_ratios(r)
        sim = r.get("rank-1 similarity")
        if sim is not None and base is not None:
            similarity = (f"rank-1 similarity {sim:.3f} against the BF16 run's {base:.3f} (×{sim / base:.2f})"
                          + (f" and the FP32 run's {healthy:.3f} (`{FP32_RERUN}` at step {table.loc[FP32_RERUN, 'doctor step']:,})"
                             if healthy is not None else ""))
        else:
            similarity = "rank-1 similarity not measured (no doctor report)"
        if link == "rank-1 similarity":
            said = similarity + "; " + ratios
            broken = None if sim is None or healthy is None else bool(sim < healthy)
            short = (f"{sim:.3f} against the FP32 run's {healthy:.3f}" if broken is not None else "similarity not measured")
        else:
            said = ratios + "; " + similarity
            broken = bool(r["ties ÷ bf16"] <= TIES_KEPT)
            short = f"{r['ties ÷ bf16']:.2f}× the BF16 run's ties"
        twin = f"fp32_{name}"
        if twin in table.index and table.loc[twin].get("rank-1 similarity") is not None:
            twin_text = f" Its FP32 twin `{twin}`: rank-1 similarity {table.loc[twin, 'rank-1 similarity']:.3f}."
        else:  # the stabiliser changes the model: its own FP32 twin says what it does to the similarity without BF16
            twin_text = f" Its FP32 twin `{twin}` has no doctor report yet."
        failure = _failure(r)
        claims.append({"who": claim.split(" works")[0], "label": label, "broken": broken, "holds": not failure,
                       "short": short, "item": f"- The paper says {claim}. `{label}` ({fate}): {said}.{twin_text} "
                                               f"Verdict: {_claim_verdict(broken, failure)}."})
    return claims


def paper_claims_lead(claims: list[dict]) -> str:
    """:func:`paper_claims` in one sentence (plain text): how many of the judged explanations stand (the row breaks
    the link and holds), then each one's link and fate."""
    judged = [c for c in claims if c["broken"] is not None]
    stand = [c for c in judged if c["broken"] and c["holds"]]
    return (f"{len(stand)} of the paper's {len(judged)} explanations measured here {'stands' if len(stand) == 1 else 'stand'}"
            + "".join(f"; {c['who']}: {'breaks' if c['broken'] else 'keeps'} the link ({c['short']}) and "
                      f"{'holds' if c['holds'] else 'fails'}" for c in judged) + ".")


def paper_claims_text(table) -> str:
    """Page 17's test of the paper's Discussion: :func:`paper_claims_lead` in bold, then each claim's item from
    :func:`paper_claims` (block MyST: a list)."""
    claims = paper_claims(table)
    if not claims:
        return "None of QK-norm, gated attention and QK-clip is committed yet."
    return f"**{paper_claims_lead(claims)}**\n\n" + "\n".join(c["item"] for c in claims)


def stabiliser_finding(table, layer: int = 1) -> str:
    """Page 17's finding in one bold sentence, from :func:`stabiliser_table`: which committed BF16 stabiliser rows hold
    (no logit runaway, loss not exploded and within :data:`LOSS_MATCH` of the FP32 twin's) and how each other one fails.
    Without the BF16 run of the recipe, says so."""
    from lpfa.experiments import BASES, STABILISERS

    if table.empty:
        return "**Nothing to compare yet:** the BF16 run at the paper's recipe is not committed (`results/paper_recipe`)."
    bf16 = [label for label in STABILISERS if label in table.index and label not in BASES
            and table.loc[label, f"layer {layer} scores"] != "fp32"]
    if not bf16:
        return "**No BF16 stabiliser row is committed yet.**"

    fails = {label: f"`{label}` {f}" if (f := _failure(table.loc[label])) else "" for label in bf16}
    held = [label for label, f in fails.items() if not f]
    twinless = [label for label in held if table.loc[label, "FP32 twin"] == "fp32_paper_recipe"
                and label.startswith("bf16_")]  # its own FP32 twin not committed: held against the plain FP32 run
    return (f"**At the paper's recipe, {len(held)} of the {len(bf16)} committed BF16 stabiliser rows "
            + (f"({', '.join(f'`{l}`' for l in held)}) " if held else "")
            + f"{'holds' if len(held) == 1 else 'hold'}: no logit runaway and an eval loss within {LOSS_MATCH:g} of the FP32 "
            + "twin's" + (f" (for {', '.join(f'`{l}`' for l in twinless)} the plain FP32 run's: its own twin is not committed)"
                          if twinless else "")
            + "".join(f"; {f}" for f in fails.values() if f) + ".**")


def stabiliser_summary(table, step: int, layer: int = 1) -> str:
    """Page 17's rows in words, after its finding (:func:`stabiliser_finding`), from :func:`stabiliser_table`
    (``table``, compared at ``step``): how many of the
    :data:`lpfa.experiments.STABILISERS` runs are committed; each committed cut's links (ties, largest logit and W_Q as
    ratios to the BF16 run's, the loss and the runaway); which rows keep at least half of the BF16 run's ties without
    exploding; and whether the rows without any runaway are exactly those whose layer-``layer`` δ does not come from
    the BF16 O."""
    from lpfa.experiments import BASES, STABILISER_RERUN, STABILISERS

    if table.empty:
        return "**Nothing to compare yet:** the BF16 run at the paper's recipe is not committed (`results/paper_recipe`)."
    rows = [label for label in STABILISERS if label not in BASES]
    done = [label for label in rows if label in table.index]
    b = table.loc["bf16_paper_recipe"]

    def links(label):
        r = table.loc[label]
        return (f"{_link_ratios(r)}, " + _loss_fate(r)
                + (f", its layer-{r['runaway layer']} logits running away from step {r['runaway step']:,}"
                   if r["runaway step"] is not None else ", no runaway"))

    cuts = [label for label in table.index if str(table.loc[label, "stabiliser"]).startswith("isolation")]
    bf16 = [label for label in ("bf16_paper_recipe", STABILISER_RERUN) if label in table.index]
    booms = [table.loc[label, "explosion step"] for label in bf16 if table.loc[label, "exploded"]]

    def row(label):
        r = table.loc[label]
        early = (f"; it exploded {min(booms) - r['explosion step']:,} steps before the earliest BF16 run of this seed"
                 if r["exploded"] and booms and r["explosion step"] < min(booms) else "")
        at = f" (stopped at step {r['steps']:,}: its last diagnostics record counts)" if r["steps"] <= step else ""
        return f"`{label}` (`{r['stabiliser']}`){at}: {links(label)}{early}."

    rerun = ""
    if STABILISER_RERUN in table.index and table.loc[STABILISER_RERUN, "exploded"] and b["exploded"]:
        d = int(table.loc[STABILISER_RERUN, "explosion step"]) - int(b["explosion step"])
        rerun = (f" The BF16 run again, same seed and data order (`{STABILISER_RERUN}`), exploded at step "
                 f"{table.loc[STABILISER_RERUN, 'explosion step']:,}: the GPU's nondeterminism alone moves the explosion by "
                 f"{abs(d):,} steps.")
    doc = table[table["doctor step"].notna()]
    doctor = ""
    if not doc.empty:
        def fmt(label, col):
            v = doc.loc[label, col]
            return "–" if v is None or v != v else f"{v:.2f}"
        resolved = [label for label in doc.index for col in ("δ |t| paper", "δ |t| own")
                    if doc.loc[label, col] is not None and doc.loc[label, col] >= T_RESOLVED]
        doctor = (f"\n\n**lpfa doctor on layer {layer}**, one checkpoint per row before its explosion:\n\n"
                  + "\n".join(f"- `{label}` at step {int(doc.loc[label, 'doctor step']):,}: rank-1 similarity "
                              f"{doc.loc[label, 'rank-1 similarity']:.3f}, largest |t| of the δ error {fmt(label, 'δ |t| paper')} "
                              f"(paper)" + (f", {fmt(label, 'δ |t| own')} (its own policy)"
                                            if doc.loc[label, "δ |t| own"] is not None else "") for label in doc.index)
                  + (f"\n\nWith one probe batch of {' or '.join(sorted(set(doc['doctor probe'])))} tokens no |t| reaches "
                     f"{T_RESOLVED:g}: the δ bias is not resolved there." if not resolved else ""))
    tie_keepers = [label for label in ["sfa_paper_recipe", *cuts, *done] if label in table.index
                   and table.loc[label, "ties ÷ bf16"] > TIES_KEPT and not table.loc[label, "exploded"]]
    calm = [label for label in table.index if table.loc[label, "runaway step"] is None]
    not_bf16_o = {label for label in table.index if table.loc[label, f"layer {layer} δ from"] != "bf16 O"}
    items = ([f"SFA: {links('sfa_paper_recipe')}."] if "sfa_paper_recipe" in table.index else []) + [
        f"`{c.removesuffix('_paper_recipe')}`: {links(c)}." for c in cuts] + [row(label) for label in done]
    return (f"**{len(done)} of the {len(rows)} stabiliser runs are committed"
            + (f" ({', '.join(f'`{l}`' for l in done)})" if done else "") + ".** "
            + f"At step {step:,}, the last record before the BF16 run's loss explodes (step {b['explosion step']:,}), each "
            "row's links as ratios to the BF16 run's:\n\n" + "\n".join(f"- {item}" for item in items)
            + (f"\n\n{rerun.strip()}" if rerun else "") + doctor
            + (f"\n\n**Ties are not what must go:** {', '.join(f'`{l}`' for l in tie_keepers)} keep at least half of the "
               "BF16 run's tie fraction and do not explode." if tie_keepers else "")
            + (f" The rows without any runaway ({', '.join(f'`{l}`' for l in calm)}) are exactly those whose layer-{layer} δ "
               "does not come from the BF16 O (the `δ from` column: the link after the ties)."
               if calm and set(calm) == not_bf16_o else ""))


def wq_ratio_text(runs: dict, layer: int, step: int, bf16: str = "bf16", fp32: str = "fp32", grown: float = 1.25) -> str:
    """Page 07's sentence on Fig. 3: at ``step``, the three heads of ``layer`` with the largest ‖W_Q[h]‖₂ ratio of the
    BF16 run to its FP32 twin, how many heads exceed ``grown``× their twin's, the median ratio, and whether the growth
    is layer-wide (more than half the heads) or carried by a few heads, as in the paper."""
    at = {}
    for label in (bf16, fp32):
        f = head_metric_frame(runs[label], "wq_spectral_norm")
        at[label] = f[(f.layer == layer) & (f.step == step)].set_index("head").value
    top = (at[bf16] / at[fp32]).sort_values(ascending=False)
    n = int((top > grown).sum())
    return (f"At step {step:,}, layer {layer}'s heads {', '.join(str(h) for h in top.index[:3])} have the largest BF16/FP32 "
            f"ratios of ‖W_Q[h]‖₂ ({', '.join(f'{r:.1f}×' for r in top.iloc[:3])}); {n} of {len(top)} heads are more than "
            f"{grown}× their FP32 twin's, and the median ratio is {top.median():.2f}"
            + (": the growth is layer-wide here, not confined to a few heads as in the paper." if n > len(top) / 2
               else ": as in the paper, a few heads carry it."))


def _layer_wq_at_common_step(runs: dict, layer: int):
    """The last diagnostics step every run reached, and per run the per-head ‖W_Q‖₂ rows of ``layer`` there (a frame of
    :func:`head_metric_frame`)."""
    frames = {label: head_metric_frame(d, "wq_spectral_norm") for label, d in runs.items()}
    common = min(int(f.step.max()) for f in frames.values())
    return common, {label: f[(f.layer == layer) & (f.step == f.step[f.step <= common].max())] for label, f in frames.items()}


def growth_text(runs: dict, layer: int) -> tuple[str, str]:
    """Page 07's two findings on W_Q growth: a Markdown list, one item per run, of its fastest-growing head
    (:func:`growth_table`) and its largest norm; and a sentence on the largest ‖W_Q‖₂ in ``layer`` of each run at the
    last diagnostics step that every run reached."""
    g = growth_table(runs)
    items = "\n".join(
        f"* **{r}**: after {int(row['steps'])} steps the fastest-growing head is layer {int(row['layer'])}, head "
        f"{int(row['head'])} (×{row['growth']:.2f}, {row['wq_spectral_norm first']:.2f} → {row['wq_spectral_norm last']:.2f}); "
        f"the largest norm anywhere is {row['largest last value']:.2f}." for r, row in g.iterrows())
    common, at = _layer_wq_at_common_step(runs, layer)
    sentence = (f"At step {common}, the last step all runs reached, the largest W_Q norm in layer {layer} is "
                + ", ".join(f"{a.value.max():.2f} in {label} (head {int(a.loc[a.value.idxmax(), 'head'])})" for label, a in at.items())
                + ".")
    return items, sentence


def wq_comparison_text(runs: dict, layer: int, short: dict | None = None, short_name: str = "",
                       same: dict | None = None) -> str:
    """Page 07's comparison with the paper: whether ``layer`` holds each run's fastest-growing head (:func:`growth_table`),
    the BF16 run's largest layer-``layer`` ‖W_Q‖₂ over the other runs' at the last step all reached, and from which step
    it stays 1.25× above the first FP32-side run's (:func:`divergence_step`). ``short``: the same twins, label → folder,
    of a shorter experiment (``short_name``) with the same seed and data: their W_Q ratio at the last step both reached;
    ``same``: for "bf16" and "fp32", :func:`lpfa.scaling.first_difference` of this run and the short one's (how many of
    their losses are bit-identical)."""
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
    text = [f"**Compared with the paper.** The paper reports W_Q norms growing in a few heads of one early layer of the failing "
            f"run only. Here layer {layer} is the layer of the fastest-growing head in {where}; at step {common:,} the BF16 run's "
            f"largest layer-{layer} norm is {ratio:.2f}× the largest among {', '.join(hp)}",
            f", and it stays above 1.25× the {hp[0]} run's from step {div:,} on." if div is not None else
            ", and it never stays 1.25× above it: within these steps W_Q is not a BF16-specific precursor."]
    if short:
        s_wq = {label: layer_max(short[label], "wq_spectral_norm", layer) for label in ("bf16", "fp32")}
        s_step = min(int(s.index.max()) for s in s_wq.values())

        def pick(s):
            return float(s[s.index <= s_step].iloc[-1])

        sb, sf, pb, pf = pick(s_wq["bf16"]), pick(s_wq["fp32"]), pick(wq["bf16"]), pick(wq["fp32"])
        text.append(f" For scale: at step {s_step:,} the shorter experiment (`{short_name}`, same seed and data, four runs sharing "
                    f"one GPU) has {sb:.1f} (bf16) against {sf:.1f} (fp32), ×{sb / sf:.2f}, while this experiment has {pb:.1f} "
                    f"against {pf:.1f}, ×{pb / pf:.2f}. ")
    if short and same:
        for label, s in same.items():
            text.append(f"The two {label} runs have bit-identical losses at {s['identical_steps']:,} of their "
                        f"{s['common_steps']:,} common steps"
                        + (f" (they first differ at step {s['first_differing_step']:,}). " if s["first_differing_step"] is not None
                           else ". "))
        if same["bf16"]["first_differing_step"] is None and same["fp32"]["first_differing_step"] is not None:
            text.append("lpfa's BF16 kernels are deterministic from run to run, on another machine and with the GPU shared or not; "
                        "the FP32 twin (PyTorch SDPA on FP32 inputs) is not, so FP32 runs of one seed already scatter, "
                        "and a BF16/FP32 ratio at one step is only meaningful well beyond that scatter (the seeds page "
                        "measures it).")
    return "".join(text)


def plot_v_sign(frames: dict):
    """Page 08's figure: per run (label → :func:`head_metric_frame` of ``v_sign_dominance``), the share of V's columns
    with a dominant sign, mean over heads, one line per layer against the step."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(frames), figsize=(4.4 * len(frames), 3.2), squeeze=False, sharey=True)
    for ax, (label, f) in zip(axes[0], frames.items()):
        per_layer = f.groupby(["step", "layer"]).value.mean().unstack()
        for lay in per_layer.columns:
            ax.plot(per_layer.index, per_layer[lay], lw=1.2, label=f"layer {lay}")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("V columns with a dominant sign (mean over heads)")
    axes[0, -1].legend(fontsize=9, ncol=2)
    return fig


def v_sign_text(frames: dict, layer: int) -> str:
    """Page 08's findings on V's sign structure: per run (label → :func:`head_metric_frame` of ``v_sign_dominance``), a
    Markdown item with the share of one-signed V columns at its last record (mean over layers and heads, in ``layer``,
    over the run's second half in ``layer``, the most one-signed head) and at its first; with both "bf16" and "fp32", the
    ratio of their second-half shares in ``layer`` and what it says (above 1.5: BF16 training builds the structure;
    below 1/1.5: the FP32 twin has more; else about the same)."""
    lines, at_layer = [], {}
    for label, f in frames.items():
        first, last = f[f.step == f.step.min()], f[f.step == f.step.max()]
        top = last.loc[last.value.idxmax()]
        late = f[(f.layer == layer) & (f.step > f.step.max() / 2)]  # one record is noisy: the second half of the run
        at_layer[label] = float(late.value.mean())
        lines.append(f"* **{label}** at step {int(last.step.iloc[0]):,}: {last.value.mean():.1%} of V's columns one-signed on average "
                     f"over layers and heads, {last[last.layer == layer].value.mean():.1%} in layer {layer} (at most "
                     f"{last[last.layer == layer].value.max():.1%}; {at_layer[label]:.1%} over the run's second half), "
                     f"the most in layer {int(top['layer'])}, head {int(top['head'])} ({top['value']:.1%}); at step "
                     f"{int(first.step.iloc[0]):,}: {first.value.mean():.1%} on average.")
    text = "\n".join(lines)
    if {"bf16", "fp32"} <= set(at_layer):
        ratio = at_layer["bf16"] / max(at_layer["fp32"], 1e-12)
        verdict = ("V's sign structure is part of what BF16 training builds there." if ratio > 1.5 else
                   "the FP32 twin has more of them, so they are not what sets the BF16 run apart." if ratio < 1 / 1.5 else
                   "about the same, so one-signed V columns are not what sets the BF16 run apart; the ties are.")
        text += (f"\n\nIn layer {layer}, over the second half of the runs, the BF16 run has {ratio:.1f} times the FP32 twin's "
                 f"share of one-signed V columns: {verdict}")
    return text


def tie_grids(runs: dict, early: int = 1000):
    """Page 05's logged ties: per run (label → folder) its ``tie_fraction`` as a layer × head grid at two steps both runs
    logged, the first at or after ``early`` (or the last) and the last; returns ({(label, step): grid}, [the two steps])."""
    frames = {label: head_metric_frame(d, "tie_fraction") for label, d in runs.items()}
    common = sorted(set.intersection(*(set(f.step) for f in frames.values())))
    at = [next(s for s in common if s >= min(early, common[-1])), common[-1]]
    grids = {(label, s): f[f.step == s].pivot_table(index="layer", columns="head", values="value")
             for label, f in frames.items() for s in at}
    return grids, at


def plot_tie_grids(grids: dict):
    """The grids of :func:`tie_grids` side by side on one colour scale, with its colourbar."""
    import matplotlib.pyplot as plt

    top = max(float(g.values.max()) for g in grids.values())
    fig, axes = plt.subplots(1, len(grids), figsize=(3.2 * len(grids), 3.0), squeeze=False)
    for ax, ((label, s), g) in zip(axes[0], grids.items()):
        im = ax.imshow(g.values, cmap="viridis", vmin=0, vmax=max(top, 1e-3), aspect="auto")
        ax.set_title(f"{label}, step {s:,}", fontsize=9)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
    fig.colorbar(im, ax=axes[0].tolist(), label="rows with tied maxima")
    return fig


def tie_grids_text(grids: dict, at: list[int]) -> str:
    """Per run of :func:`tie_grids`: its mean and largest tie fraction at the last step (with the most tied head) and at
    the early one."""
    import numpy as np

    lines = []
    for label in dict.fromkeys(label for label, _ in grids):
        g = grids[(label, at[-1])]
        L, H = np.unravel_index(np.nanargmax(g.values), g.shape)
        e = grids[(label, at[0])]
        lines.append(f"`{label}` at step {at[-1]:,}: {g.values.mean():.1%} of rows tied on average over layers and heads, "
                     f"{g.values.max():.1%} in its most tied head (layer {g.index[L]}, head {g.columns[H]}); at step {at[0]:,}: "
                     f"{e.values.mean():.1%} on average, {e.values.max():.1%} at most")
    return "; ".join(lines)


def isolation_ties(rows: dict, table, layer: int):
    """Page 10's ties per isolation row: its outcome (from ``table``), the largest tie fraction and the largest logit of
    any head of ``layer`` over the run (:func:`layer_max`)."""
    import pandas as pd

    return pd.DataFrame({label: {"outcome": table.loc[label, "outcome"],
                                 "largest tie fraction": layer_max(rows[label], "tie_fraction", layer).max(),
                                 "largest logit": layer_max(rows[label], "max_logit", layer).max()}
                         for label in table.index}).T


def isolation_ties_text(ties, reference_row: str, sick) -> str:
    """Page 10's finding from :func:`isolation_ties`: the stable ``reference_row``'s largest tie fraction, the failing
    rows (``sick``) with ties above twice that, and those failing without them (not the paper's chain start)."""
    tie, top = ties["largest tie fraction"].astype(float), ties["largest logit"].astype(float)
    base = tie[reference_row]
    untied = [label for label in sorted(sick) if tie[label] <= 2 * base]
    tied = [label for label in sorted(sick) if label not in untied]
    text = f"The `{reference_row}` row's worst head never exceeds a tie fraction of {base:.3f}. "
    if tied:
        text += "Failing rows with ties well above that: " + ", ".join(f"`{label}` ({tie[label]:.2f})" for label in tied) + ". "
    if untied:
        text += ("**Failing without ties**: " + ", ".join(f"`{label}` (at most {tie[label]:.3f}, largest logit {top[label]:,.0f})"
                                                         for label in untied)
                 + ": in these rows the logits grow without the tied maxima the paper's chain starts from, so ties are not "
                 "necessary for the failure here; what they share with the tied rows is the BF16-rounded O that δ is computed from.")
    else:
        text += "Every failing row has ties well above the stable row's."
    return text
