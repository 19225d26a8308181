"""Page 05, structure (Figs. 8, 9): where the ties sit in the trained heads."""

from __future__ import annotations

from lpfa.compare import head_metric_frame


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
