"""Page 03, the rank-1 matrices (PK)[T]ᵀX[T] (Fig. 4, Sec. 3.3): how alike they are among the tokens with the largest
|δ error| of an instrumented replay (:func:`lpfa.replay.rank1_stats`), and how much of the W_Q gradient error
G = α·Σ_T (δ_lp − δ_hp)[T]·(PK)[T]ᵀX[T] lies in one direction that recurs from step to step."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.ticker import MaxNLocator

from lpfa.pages.delta_bias import REPLAY_PARAMS
from lpfa.plotting import fixed, use_style
from lpfa.replay import rank1_stats

# the notebook's papermill parameters, checked right after its parameters cell (lpfa.params.check_params)
PARAMS = REPLAY_PARAMS

RECURRING = 0.5  # G's direction overlaps more than this with the previous step's: it recurs
PREV, FIRST = "median overlap of G's direction, step to step", "median overlap with the first step's"  # table rows


def plot_rank1(arrays: dict, head: int, n_show: int = 16, title: str = ""):
    """Fig. 4: PK and X of the ``n_show`` tokens with the largest |δ error| at the first detail step (rows = tokens),
    and the distributions of the rank-1 similarities (:func:`lpfa.replay.rank1_stats`); ``title`` over the figure."""
    use_style()
    st = rank1_stats(arrays, head)
    s0 = st["steps"][0]
    # two heatmaps on top, the similarity distributions below: legible at page width
    fig = plt.figure(figsize=(7.5, 6.4))
    grid = fig.add_gridspec(2, 2, width_ratios=[1, 2])
    axes = [fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1]), fig.add_subplot(grid[1, :])]
    for ax, name, label in ((axes[0], "top_pk", "(PK)[T]"), (axes[1], "top_x", "X[T]")):
        m = arrays[f"h{head}_s{s0}_{name}"][:n_show]
        # colour limit at the 99th percentile of |m|: a few outlier features would otherwise wash out the rest
        v = float(np.quantile(np.abs(m), 0.99)) or float(np.abs(m).max()) or 1.0
        im = ax.imshow(m, aspect="auto", cmap="RdBu_r", vmin=-v, vmax=v, interpolation="nearest")
        ax.grid(False)
        for axis in (ax.xaxis, ax.yaxis):  # tokens and features are whole numbers
            axis.set_major_locator(MaxNLocator(integer=True))
        fig.colorbar(im, ax=ax, shrink=0.9, label="value (clipped at the 99th pct of |·|)" if name == "top_x" else None)
        ax.set_title(f"{label} (rows: tokens)", fontsize=10)
        ax.set_xlabel("feature")
    axes[0].set_ylabel(f"token (top {n_show} by |δ error|)")
    for k, v in st.items():
        if isinstance(v, np.ndarray):
            axes[2].hist(v, bins=40, range=(-1, 1), histtype="step", density=True,
                         label=f"{k} (median {np.median(v):.2f})")
    axes[2].set_xlabel("cosine similarity of (PK)[T]ᵀX[T]")
    axes[2].legend(fontsize=9)
    if title:
        fig.suptitle(title, fontsize=9)
    return fig


def similarity_table(result: dict, arrays: dict) -> pd.DataFrame:
    """One column per replayed head: the median rank-1 similarities (:func:`lpfa.replay.rank1_stats`: within each detail
    step, across them, random vectors), and from the replay's summary G's median top-direction energy, the median
    overlap of its direction with the previous step's and the first step's, and that of random directions."""
    rows = {}
    for h in result["heads"]:
        st = rank1_stats(arrays, h)
        s = result["summary"][str(h)]
        rows[f"head {h}"] = {**{f"median similarity, {k}": v for k, v in st["medians"].items()},
                             "median top-direction energy of G": s["g_top_energy_median"],
                             PREV: s["overlap_prev_median"], FIRST: s["overlap_first_median"],
                             "overlap of random directions": s["overlap_chance"]}
    return pd.DataFrame(rows)


def similarity_text(result: dict, arrays: dict, table: pd.DataFrame) -> str:
    """Page 03's finding (Markdown) from :func:`similarity_table`: per head the median similarity within a step and
    across the replay against random vectors, G's top-direction energy and its overlaps; and the heads whose first
    replayed step points elsewhere than every later one while the later steps agree (:data:`RECURRING`)."""
    lines = []
    for h in result["heads"]:
        c = table[f"head {h}"]
        within = [k for k in c.index if k.startswith("median similarity, within")]
        across = [k for k in c.index if k.startswith("median similarity, across")]
        lines.append(f"* **head {h}**: median similarity {c[within[0]]:.3f} within a step"
                     + (f" and {c[across[0]]:.3f} across the {result['steps']} replayed steps" if across else "")
                     + f", against {fixed(c['median similarity, random vectors'], 3)} for random vectors; "
                     f"G keeps {c['median top-direction energy of G']:.4%} of its energy in one direction, which "
                     f"overlaps {c[PREV]:.2f} with the previous step's and {c[FIRST]:.2f} with the first step's "
                     f"(random: {c['overlap of random directions']:.1e}).")
    odd = [h for h in result["heads"]
           if arrays[f"h{h}_overlap_first"][1:].max() < RECURRING < np.nanmedian(arrays[f"h{h}_overlap_prev"])]
    return ("**Measured.**\n\n" + "\n".join(lines) + f"\n\nIn this one replayed run ({len(result['heads'])} heads "
            f"of layer {result['layer']}) the paper's qualitative picture holds: the rank-1 matrices are nearly "
            "identical, so the per-step error is essentially rank one, and each step's direction overlaps the "
            "previous step's by the amounts above, far more than random directions do."
            + (f" For head(s) {', '.join(map(str, odd))} the first replayed step is the exception: its direction "
               f"overlaps at most {max(arrays[f'h{h}_overlap_first'][1:].max() for h in odd):.2f} with any later "
               "step's, while the later steps agree with each other." if odd else ""))


def rank1_view(result: dict, arrays: dict, head: int, step: int, n_show: int = 16):
    """Fig. 4 at one detail step: PK and X of ``head``'s ``n_show`` tokens with the largest |δ error| at ``step``
    (rows = tokens), and the rank-1 similarities within that step against random vectors
    (:func:`lpfa.replay.rank1_stats`). A head or step the replay did not measure is a one-line ValueError naming the
    ones it did."""
    from lpfa.pages.delta_bias import _replay_head, detail_step

    head = _replay_head(result, head)
    step = detail_step(arrays, head, step)
    st = rank1_stats(arrays, head)
    use_style()
    fig = plt.figure(figsize=(7.5, 6.0))
    grid = fig.add_gridspec(2, 2, width_ratios=[1, 2])
    axes = [fig.add_subplot(grid[0, 0]), fig.add_subplot(grid[0, 1]), fig.add_subplot(grid[1, :])]
    for ax, name, label in ((axes[0], "top_pk", "(PK)[T]"), (axes[1], "top_x", "X[T]")):
        m = arrays[f"h{head}_s{step}_{name}"][:n_show]
        v = float(np.quantile(np.abs(m), 0.99)) or float(np.abs(m).max()) or 1.0  # as plot_rank1
        im = ax.imshow(m, aspect="auto", cmap="RdBu_r", vmin=-v, vmax=v, interpolation="nearest")
        ax.grid(False)
        for axis in (ax.xaxis, ax.yaxis):
            axis.set_major_locator(MaxNLocator(integer=True))
        fig.colorbar(im, ax=ax, shrink=0.9)
        ax.set_title(f"{label} (rows: tokens)", fontsize=10)
        ax.set_xlabel("feature")
    axes[0].set_ylabel(f"token (top {n_show} by |δ error|)")
    for k in (f"within {step}", "random vectors"):
        axes[2].hist(st[k], bins=40, range=(-1, 1), histtype="step", density=True,
                     label=f"{k} (median {np.median(st[k]):.2f})")
    axes[2].set_xlabel("cosine similarity of (PK)[T]ᵀX[T]")
    axes[2].legend(fontsize=9)
    fig.suptitle(f"layer {result['layer']}, head {head}, step {step}", fontsize=9)
    return fig
