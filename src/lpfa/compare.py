"""Tables and figures across training runs that more than one page reads: a run's per-head diagnostics as a long frame,
each layer's largest precursor (logit, ties, W_Q norm), the step where two runs part, the experiment tables with their
verdicts, the loss curves. Runs are read through :mod:`lpfa.run`; nothing here knows the book (:mod:`lpfa.pages` does).
"""

from __future__ import annotations

from dataclasses import MISSING, fields
from pathlib import Path

import numpy as np
import pandas as pd

from lpfa.experiments import DESCRIPTIONS
from lpfa.explosion import ExplosionCriterion, RunawayCriterion, attention_label, first_sustained, heads_text
from lpfa.model import GPTConfig
from lpfa.paths import results_dir
from lpfa.run import diag_frame, load_metrics, read_run_config, run_verdict
from lpfa.train import TrainConfig


def plot_losses(runs: dict, smooth: int = 20, ax=None):
    """Training loss (rolling mean over ``smooth`` steps) and evaluation loss of one or more runs
    (``{label: run_dir}``), colours from :data:`lpfa.plotting.COLORS` where a label names a mode."""
    import matplotlib.pyplot as plt  # heavy, and only for figures: loaded when one is drawn
    from matplotlib.ticker import MaxNLocator

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
    # steps are whole numbers: the default locator's ticks, less fractions ("2.5") on a run of a few steps
    ax.xaxis.set_major_locator(MaxNLocator("auto", steps=[1, 2, 2.5, 5, 10], integer=True))
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy loss")
    ax.legend()
    return ax.figure


def head_metric_frame(run_dir: str | Path, metric: str):
    """Long DataFrame (step, layer, head, value) of a per-head diagnostic of a run."""

    diag = diag_frame(run_dir)
    if diag.empty or metric not in diag:
        raise ValueError(f"{run_dir} has no {metric!r} diagnostics (was diag_interval 0?)")
    values = np.array(diag[metric].tolist())  # (records, layers, heads)
    r, L, H = values.shape
    return pd.DataFrame(
        {
            "step": np.repeat(diag["step"].to_numpy(), L * H),
            "layer": np.tile(np.repeat(np.arange(L), H), r),
            "head": np.tile(np.arange(H), r * L),
            "value": values.reshape(-1),
        }
    )


def heads_at(frame: pd.DataFrame, layer: int, step: int) -> pd.Series:
    """One layer's per-head values at one diagnostics step of a :func:`head_metric_frame`, indexed by head."""
    return frame[(frame.layer == layer) & (frame.step == step)].set_index("head").value


def step_before_failure(
    runs: dict,
    metric: str = "wq_spectral_norm",
    failing: str = "bf16",
    frames: dict | None = None,
    verdicts: dict | None = None,
) -> int:
    """The diagnostics step at which to compare heads (Fig. 3's "before the explosion"): the last step that every
    run logged ``metric`` at and that lies before the ``failing`` run's loss explosion (its last step if it did not
    explode). ``frames`` (``{label: head_metric_frame(run, metric)}``) and ``verdicts``
    (``{label: run_verdict(run)}``): what the caller has already read, so that it is not read again."""
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


def growth_table(runs: dict, metric: str = "wq_spectral_norm"):
    """Per run: the (layer, head) whose ``metric`` grew most between the first and last diagnostics record."""

    rows = []
    for label, d in runs.items():
        f = head_metric_frame(d, metric)
        first, last = (
            f[f.step == f.step.min()].set_index(["layer", "head"]).value,
            f[f.step == f.step.max()].set_index(["layer", "head"]).value,
        )
        g = (last / first).sort_values(ascending=False)
        (layer, head), ratio = g.index[0], g.iloc[0]
        rows.append(
            {
                "run": label,
                "steps": int(f.step.max()),
                "layer": int(layer),
                "head": int(head),
                f"{metric} first": float(first[(layer, head)]),
                f"{metric} last": float(last[(layer, head)]),
                "growth": float(ratio),
                "largest last value": float(last.max()),
            }
        )
    return pd.DataFrame(rows).set_index("run")


def explorer(runs: dict, metric: str = "wq_spectral_norm"):
    """An explorer (run, layer, heads, step range) of a per-head diagnostic through
    :func:`lpfa.widgets.interactive_or_static`: in JupyterLab an ipywidgets explorer, returned; on a static page (the
    book build) the first run's layer 1 (or 0), every head and step, drawn once with a line saying where the controls
    live. It draws when its button is pressed (``manual``): a drawing takes a moment."""
    import matplotlib.pyplot as plt  # heavy, and only for figures: loaded when one is drawn

    from lpfa.plotting import line_styles, use_style
    from lpfa.widgets import interactive_or_static

    frames = {label: head_metric_frame(d, metric) for label, d in runs.items()}
    first = next(iter(frames.values()))
    n_layer, n_head = int(first.layer.max()) + 1, int(first["head"].max()) + 1
    lo, hi = int(first.step.min()), int(max(f.step.max() for f in frames.values()))
    start = {"run": next(iter(frames)), "layer": min(1, n_layer - 1), "heads": tuple(range(n_head)), "steps": (lo, hi)}

    def draw(run, layer, heads, steps):
        use_style()
        f = frames[run]
        f = f[(f.layer == layer) & f["head"].isin(heads) & f.step.between(*steps)]
        fig, ax = plt.subplots(figsize=(6, 4.0))
        for (h, g), style in zip(f.groupby("head"), line_styles(n_head)):
            ax.plot(g.step, g.value, label=f"head {h}", **style)
        ax.set_xlabel("step")
        ax.set_ylabel(metric.replace("_", " "))
        ax.set_title(f"{run}, layer {layer}", fontsize=9)
        fig.legend(ncol=6, fontsize=9, loc="outside lower center")  # below the panel: the lines keep it all
        return fig

    def controls():
        import ipywidgets as w

        return {"run": w.Dropdown(options=list(frames), value=start["run"], description="run"),
                "layer": w.IntSlider(min=0, max=n_layer - 1, value=start["layer"], description="layer"),
                "heads": w.SelectMultiple(options=list(range(n_head)), value=start["heads"], description="heads"),
                "steps": w.IntRangeSlider(min=lo, max=hi, value=start["steps"], step=max(1, (hi - lo) // 100),
                                          description="steps")}

    return interactive_or_static(draw, controls, start, manual=True)


PRECURSORS = {
    "max_logit": "largest attention logit",
    "tie_fraction": "largest per-head tie fraction",
    "wq_spectral_norm": "largest per-head ‖W_Q[h]‖₂",
}


def layer_max(run_dir: str | Path, metric: str, layer: int):
    """Series indexed by step: the largest value over heads of a per-head diagnostic in one layer; a layer the run
    did not log is a one-line error naming it and the layers it logged."""
    f = head_metric_frame(run_dir, metric)
    if layer not in set(f.layer):
        logged = sorted(set(f.layer))
        raise ValueError(f"layer={layer!r}: expected a layer in [{logged[0]}, {logged[-1]}] of the runs ({run_dir} has "
                         f"no layer {layer})" if logged else f"layer={layer!r}: {run_dir} logged no {metric!r}")
    return f[f.layer == layer].groupby("step").value.max()


def precursor_table(runs: dict, layer: int, step: int | None = None, criterion=None, verdicts: dict | None = None):
    """One row per run (``{label: run_dir}``): steps, explosion verdict (:func:`lpfa.run.run_verdict`),
    final eval loss, and in ``layer`` the largest attention logit, tie fraction and W_Q norm at ``step``
    (default: the last diagnostics step that every run reached; each run's last record at or before it).
    ``verdicts``: ``{label: run_verdict(run, criterion)}`` where the caller has them already (else computed here).
    Returns ``(table, step)``."""

    criterion = criterion or ExplosionCriterion()
    verdicts = {label: (verdicts or {}).get(label) or run_verdict(d, criterion) for label, d in runs.items()}
    series = {label: {m: layer_max(d, m, layer) for m in PRECURSORS} for label, d in runs.items()}
    if step is None:
        step = min(int(s["max_logit"].index.max()) for s in series.values())
    rows = {}
    for label, d in runs.items():
        _, val, _ = load_metrics(d)
        row = {
            "steps": verdicts[label]["steps"],
            "exploded": verdicts[label]["exploded"],
            "explosion step": verdicts[label]["explosion_step"],
            "runaway step": verdicts[label]["runaway_step"],
            "runaway layer": verdicts[label]["runaway_layer"],
            "final eval loss": float(val["val_loss"].iloc[-1]) if len(val) else float("nan"),
        }
        for m, name in PRECURSORS.items():
            s = series[label][m]
            before = s[s.index <= step]
            row[f"{name} @ {step}"] = float(before.iloc[-1]) if len(before) else float("nan")
        rows[label] = row
    return pd.DataFrame(rows).T, step


def precursor_panels(axes, runs: dict, layer: int, style: dict):
    """Draw each run of ``runs`` (``{label: run_dir}``, in order) on ``axes``, one panel per :data:`PRECURSORS`
    (its :func:`layer_max` in ``layer`` over training), in ``style[label]`` = (colour, dash)."""
    for label, d in runs.items():
        for ax, metric in zip(axes, PRECURSORS):
            s = layer_max(d, metric, layer)
            ax.plot(s.index, s.values, color=style[label][0], ls=style[label][1], label=label, lw=1.4)


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

    start = first_sustained(above, patience)
    return int(common[start]) if start is not None else None


def score_precision(model_conf: dict, layer: int) -> str:
    """How a run's attention scores S = QKᵀ·scale of ``layer`` are rounded (``model_conf``: the ``model`` part of a
    run's config.json): ``bf16`` or ``fp32``, and the heads that differ, e.g. ``bf16; fp32 in heads 2, 5``.
    SDPA's kernels and ``sdpa_fp32`` keep S in FP32; the ``math`` backend under BF16 autocast rounds it to BF16."""

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

    cfg = GPTConfig.from_dict(model_conf)
    backend = cfg.layer_backend(layer)
    if backend != "lpfa":
        return {"sdpa": "bf16 O", "sdpa_fp32": "fp32 O", "math": "dP∘P"}[backend]
    pol = cfg.policy(layer)
    src = {"dp_p": "dP∘P", "o_fp32": "fp32 O", "o_exact": "exact O"}.get(pol.delta, f"{pol.o_store} O")
    if pol.fp32_heads and src != "fp32 O":
        return f"{src}; fp32 O in {heads_text(pol.fp32_heads)}"
    return src


# a run's outcome, strongest first: the loss exploded (lpfa.explosion.ExplosionCriterion), else the logits ran away
# (lpfa.explosion.RunawayCriterion), else neither
OUTCOMES = ("loss exploded", "logits ran away", "neither")
# experiment_table's column: the step from which a layer's largest logit stays above logit_ratio × the reference's
LOGIT_APART = "logit apart from"


def outcome(exploded: bool, runaway_step) -> str:
    """A run's outcome, one of :data:`OUTCOMES`, from its verdict: whether its loss exploded and its runaway step."""
    return OUTCOMES[0] if exploded else OUTCOMES[1] if runaway_step is not None else OUTCOMES[2]


def experiment_table(
    folder, labels=None, layer: int = 1, step: int | None = None, reference=None, logit_ratio: float = 10.0
):
    """:func:`precursor_table` of the runs of an experiment, with what each run changes
    (:data:`lpfa.experiments.DESCRIPTIONS`), its attention label, seed, whether it was compiled, how ``layer``'s
    scores were rounded (:func:`score_precision`), what its δ is computed from (:func:`delta_source`) and its
    outcome in front. Returns ``(table, step)``: the isolation table, the seeds table.

    ``folder``: an experiment folder (runs in ``folder/<label>/``; default: every subfolder with a
    ``config.json``) or a dict ``{label: run_dir}``. ``reference``: the stable run each row is held against,
    a run folder or a function ``label -> run folder`` (e.g. the FP32 run of the same seed); then the column
    :data:`LOGIT_APART` is the step from which the layer's largest logit stays above ``logit_ratio`` × the
    reference's (:func:`divergence_step`), a measurement beside the outcome, not an outcome. Outcome, one of
    :data:`OUTCOMES`: ``loss exploded`` (:class:`lpfa.explosion.ExplosionCriterion`), else ``logits ran away``
    (:class:`lpfa.explosion.RunawayCriterion`), else ``neither``."""

    if isinstance(folder, dict):
        runs = {label: Path(d) for label, d in folder.items() if labels is None or label in labels}
    else:
        folder = Path(folder)
        if labels is None:
            labels = (
                sorted(p.name for p in folder.iterdir() if (p / "config.json").is_file()) if folder.is_dir() else []
            )
        runs = {label: folder / label for label in labels}
    if not runs:
        raise FileNotFoundError(f"{folder} holds no run folders (subfolders with config.json)")
    table, step = precursor_table(runs, layer, step)
    full = {label: read_run_config(d) for label, d in runs.items()}
    confs, models = (
        {label: c["train"] for label, c in full.items()},
        {label: c.get("model") for label, c in full.items()},
    )
    table.insert(0, "change", [DESCRIPTIONS.get(label, "") for label in table.index])
    table.insert(1, "attention", [attention_label(confs[label]) for label in table.index])
    table.insert(2, "seed", [confs[label]["seed"] for label in table.index])
    table.insert(3, "compiled", [bool(confs[label].get("compile", False)) for label in table.index])
    for at, column, of in ((4, "scores", score_precision), (5, "δ from", delta_source)):
        values = [of(models[label], layer) if models[label] else None for label in table.index]
        table.insert(at, f"layer {layer} {column}", pd.Series(values, index=table.index, dtype=object))
    if reference is not None:
        ref_of = reference if callable(reference) else (lambda label: reference)
        table.insert(
            6,
            LOGIT_APART,
            pd.Series(
                [
                    divergence_step(
                        layer_max(runs[label], "max_logit", layer),
                        layer_max(ref_of(label), "max_logit", layer),
                        logit_ratio,
                    )
                    for label in table.index
                ],
                index=table.index,
                dtype=object,
            ),
        )
    table.insert(
        6,
        "outcome",
        [outcome(r["exploded"], r["runaway step"]) for _, r in table.iterrows()],
    )
    return table, step


MODES = ("bf16", "fp32", "sfa", "fa2")  # a run label's mode is its prefix (lpfa.plotting.COLORS has their colours)


def _mode_and_twin(label: str) -> tuple[str | None, str]:
    """``("bf16", "s2")`` for ``bf16_s2``: a label's mode and what it shares with its twins; ``(None, label)``."""
    mode = next((m for m in MODES if label == m or label.startswith(m + "_")), None)
    return (mode, label[len(mode):].lstrip("_") or "–") if mode else (None, label)


def plot_logit_runaway(runs: dict, layer: int, criterion=None, title: str = "", by_twin: bool = False):
    """The largest attention logit of ``layer`` over training for every run (``{label: run_dir}``), with the
    runaway threshold of :class:`lpfa.explosion.RunawayCriterion`. A label's colour is its mode's
    (``bf16_s2`` → ``bf16``) where :data:`lpfa.plotting.COLORS` has one, else a cycle colour. ``by_twin`` (seeds: a mode
    has several runs): each run in a panel of its own with its twins (``bf16_s2`` with ``fp32_s2``, titled "s2"), so
    that no colour repeats within a panel."""
    import matplotlib.pyplot as plt  # heavy, and only for figures: loaded when one is drawn

    from lpfa.plotting import COLORS, line_styles, use_style

    use_style()
    criterion = criterion or RunawayCriterion()
    panels: dict[str, dict] = {}
    for label, d in runs.items():
        mode, twin = _mode_and_twin(label)
        panels.setdefault(twin if by_twin else "", {})[mode if by_twin and mode else label] = d
    n = len(panels)
    cols = min(3, n)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(7 if n == 1 else 2.6 * cols, 3.4 if n == 1 else 2.4 * rows + 0.8),
                             squeeze=False, sharex=True, sharey=True)
    # a mode's own colour where a label names one (bf16, bf16_s2, ...); the others colours unlike those
    fixed = {label: COLORS.get(label, COLORS.get(label.split("_s")[0])) for m in panels.values() for label in m}
    free = iter(line_styles(sum(c is None for c in fixed.values()), avoid=[c for c in fixed.values() if c]))
    styles = {label: {"color": c, "ls": "-"} if c else next(free) for label, c in fixed.items()}
    for ax, (name, members) in zip(axes.flat, panels.items()):
        for label, d in members.items():
            s = layer_max(d, "max_logit", layer)
            ax.plot(s.index, s.values, lw=1.1, label=label, **styles[label])
        ax.axhline(criterion.logit, color="black", ls=":", lw=0.8, label=f"runaway threshold {criterion.logit:g}")
        ax.set_yscale("log")
        if by_twin:
            ax.set_title(name, fontsize=10)
    for ax in axes.flat[n:]:
        ax.axis("off")
    if by_twin:
        axes[0, 0].xaxis.set_major_formatter(lambda x, _: f"{x / 1000:g}k" if x else "0")  # (shared by all panels)
        for c in range(cols):  # each column's lowest panel carries the step axis
            low = axes[(n - 1 - c) // cols, c]
            low.xaxis.set_tick_params(labelbottom=True)
            low.set_xlabel("step")
        fig.supylabel(f"layer {layer}: largest attention logit", fontsize=10)
        handles = {h.get_label(): h for ax in axes.flat[:n] for h in ax.get_lines()}
        if n < rows * cols:  # in the first empty slot
            axes.flat[n].legend(handles.values(), handles.keys(), loc="center", fontsize=9)
        else:
            fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncol=min(4, len(handles)),
                       fontsize=9)
        if title:
            fig.suptitle(title, fontsize=10)
    else:
        ax = axes[0, 0]
        ax.set_xlabel("step")
        ax.set_ylabel(f"layer {layer}: largest attention logit")
        ax.set_title(title, fontsize=9)
        if len(runs) > 4:  # below the panel, which grows by the legend's rows: many lines leave no corner free
            fig.set_size_inches(7, 3.4 + 0.3 * -(-(len(runs) + 1) // 4))
            fig.legend(fontsize=9, ncol=4, loc="outside lower center")
        else:
            ax.legend(fontsize=9, ncol=2)
    return fig


# TrainConfig fields that change neither the data, the model, the optimizer nor the numerics' recipe of a run: what
# is logged and kept, where it runs and when it stops. Runs equal in every other field are the same recipe and seed,
# and differ only where compilation or the kernels round differently.
DEFAULTS = {f.name: f.default if f.default is not MISSING else f.default_factory() for f in fields(TrainConfig)}
BOOKKEEPING = (
    "data",
    "device",
    "compile",
    "deterministic",
    "out_dir",
    "eval_interval",
    "eval_batches",
    "log_interval",
    "ckpt_interval",
    "ckpt_history",
    "diag_interval",
    "diag_batch",
    "tie_eps",
    "time_budget_s",
    "stop_at_step",
    "explosion_stop",
    "warning_thresholds",
    "replay",
    "resume",
    "progress",
)


def same_recipe_runs(run_dir, root=None) -> dict[str, Path]:
    """Every committed run (``results/<experiment>/<run>/<label>/``) with the same TrainConfig as ``run_dir`` except in
    :data:`BOOKKEEPING`: the same recipe, seed and attention, trained again (``run_dir`` itself left out), keyed by
    ``experiment/run/label``."""

    def recipe(train: dict) -> dict:  # fields added after a run was made hold their default there
        return {k: train.get(k, default) for k, default in DEFAULTS.items() if k not in BOOKKEEPING}

    want = recipe(read_run_config(run_dir)["train"])
    base = Path(root) if root else results_dir()
    out = {}
    for conf in sorted(base.glob("*/*/*/config.json")):
        d = conf.parent
        if d.resolve() == Path(run_dir).resolve():
            continue
        if recipe(read_run_config(d)["train"]) == want:
            out[f"{d.parent.parent.name}/{d.parent.name}/{d.name}"] = d
    return out
