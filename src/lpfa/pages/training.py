"""Page 13, training: a run's per-head diagnostics over training, one panel per layer."""

from __future__ import annotations

from pathlib import Path

from lpfa.run import (
    load_metrics,
)


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
