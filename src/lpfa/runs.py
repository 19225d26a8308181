"""Reading a training run's ``metrics.jsonl`` and drawing its standard figures (loss, W_Q norms, ties)."""

from __future__ import annotations

import json
from pathlib import Path


def load_metrics(run_dir: str | Path):
    """``(train, val, diag)``: DataFrames of the per-step records and the evaluations, and a DataFrame with
    one row per diagnostics record (columns step, wq_spectral_norm, tie_fraction, max_logit as lists)."""
    import pandas as pd

    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist: not a training run folder")
    recs = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    train = pd.DataFrame([r for r in recs if "loss" in r]).drop_duplicates("step", keep="last").set_index("step")
    val = pd.DataFrame([r for r in recs if "val_loss" in r]).drop_duplicates("step", keep="last")
    diag = pd.DataFrame([{"step": r["step"], **r["diag"]} for r in recs if "diag" in r])
    return train, (val.set_index("step") if len(val) else val), diag


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
