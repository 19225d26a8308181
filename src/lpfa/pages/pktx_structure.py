"""Page 03, the rank-1 matrices (PK)[T]ᵀX[T] (Fig. 4, Sec. 3.3): how alike they are among the tokens with the largest
|δ error| of an instrumented replay (:func:`lpfa.replay.rank1_stats`), and how much of the W_Q gradient error
G = α·Σ_T (δ_lp − δ_hp)[T]·(PK)[T]ᵀX[T] lies in one direction that recurs from step to step."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.ticker import MaxNLocator

from lpfa.pages import and_join, plural
from lpfa.pages.delta_bias import REPLAY_PARAMS, STRONG_T
from lpfa.params import text
from lpfa.plotting import fixed, use_style
from lpfa.replay import bias_test, rank1_stats

# the notebook's papermill parameters, checked right after its parameters cell (lpfa.params.check_params)
PARAMS = {**REPLAY_PARAMS, "control": text()}

# the per-token rank-1 matrices of a step count as parallel (Fig. 4) when their median similarity is above this; the
# scorecard's Fig. 4 row asks it of every detail step of every measured head
PARALLEL = 0.9

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


def within_range(arrays: dict, head: int) -> tuple[float, float, int, int]:
    """``(smallest, largest, step of the smallest, detail steps)`` of ``head``'s median within-step similarity of the
    rank-1 matrices (:func:`lpfa.replay.rank1_stats`) over the replay's detail steps."""
    within = {int(k.split()[-1]): v for k, v in rank1_stats(arrays, head)["medians"].items() if k.startswith("within")}
    low = min(within, key=within.get)
    return within[low], max(within.values()), low, len(within)


def similarity_text(result: dict, arrays: dict, table: pd.DataFrame, control: tuple[dict, dict] | None = None) -> str:
    """Page 03's finding (Markdown) from :func:`similarity_table`: per head the range of the median similarity within
    a step over the detail steps and across the replay against random vectors, G's top-direction energy and its
    overlaps; whether every head's rank-1 matrices are parallel (:data:`PARALLEL`) at every detail step; the heads
    whose first replayed step points elsewhere than every later one while the later steps agree (:data:`RECURRING`);
    and with ``control`` (``(result, arrays)`` of the FP32 twin's replay with the BF16 policy measured) the same
    similarity on the FP32 trajectory."""
    lines, ranges = [], {}
    for h in result["heads"]:
        c = table[f"head {h}"]
        low, high, at, n = ranges[h] = within_range(arrays, h)
        across = [k for k in c.index if k.startswith("median similarity, across")]
        lines.append(f"* **head {h}**: median similarity within a step {low:.3f} to {high:.3f} over the {n} detail "
                     f"steps (the lowest at step {at:,})"
                     + (f" and {c[across[0]]:.3f} across the {result['steps']:,} replayed steps" if across else "")
                     + f", against {fixed(c['median similarity, random vectors'], 3)} for random vectors; "
                     f"G keeps {c['median top-direction energy of G']:.4%} of its energy in one direction, which "
                     f"overlaps {c[PREV]:.2f} with the previous step's and {c[FIRST]:.2f} with the first step's "
                     f"(random: {c['overlap of random directions']:.1e}).")
    parallel = [h for h, r in ranges.items() if r[0] > PARALLEL]
    loose = [h for h in ranges if h not in parallel]
    heads = f"{len(result['heads'])} heads of layer {result['layer']}"
    if not loose:
        lead = (f"In this replayed run ({heads}) the paper's qualitative picture holds: at every detail step the "
                f"rank-1 matrices are nearly parallel (median similarity above {PARALLEL}), so the per-step error is "
                "essentially rank one")
    else:
        lead = (f"In this replayed run ({heads}) the paper's qualitative picture holds "
                + (f"in head{'s' * (len(parallel) > 1)} {and_join(list(map(str, parallel)))}, whose rank-1 matrices "
                   f"are nearly parallel (median similarity above {PARALLEL}) at every detail step, and "
                   if parallel else "")
                + f"{'only ' if parallel else ''}in part in head{'s' * (len(loose) > 1)} "
                + and_join([f"{h} (down to {ranges[h][0]:.3f} at step {ranges[h][2]:,})" for h in loose])
                + "; the matrices stay far more alike than random vectors")
    odd = [h for h in result["heads"]
           if arrays[f"h{h}_overlap_first"][1:].max() < RECURRING < np.nanmedian(arrays[f"h{h}_overlap_prev"])]
    text = ("**Measured.**\n\n" + "\n".join(lines) + "\n\n" + lead
            + ", and each step's direction overlaps the previous step's by the amounts above, far more than random "
            "directions do."
            + (f" For {plural(len(odd), 'head')} {and_join([str(h) for h in odd])} the first replayed step is "
               "the exception: its direction "
               f"overlaps at most {max(arrays[f'h{h}_overlap_first'][1:].max() for h in odd):.2f} with any later "
               "step's, while the later steps agree with each other." if odd else ""))
    if control is not None:
        c_result, c_arrays = control
        c_ranges = {h: within_range(c_arrays, h) for h in result["heads"] if h in c_result["heads"]}
        if c_ranges:
            end = c_result["checkpoint_step"] + c_result["steps"] - 1
            higher = all(ranges[h][0] > c_ranges[h][0] for h in c_ranges)
            biased = [h for h, r in bias_test(result).items() if r["t"] > STRONG_T]
            text += ("\n\n**The control.** On the FP32 twin's trajectory (its replay from step "
                     f"{c_result['checkpoint_step']:,} to {end:,}, the same heads), the median similarity within a "
                     "step is "
                     + and_join([f"{lo:.3f} to {hi:.3f} (head {h})" for h, (lo, hi, _, _) in c_ranges.items()])
                     + (": lower than on the BF16 run in every head at its lowest, but far above random vectors. "
                        if higher else ": far above random vectors, and not lower than on the BF16 run in every head. ")
                     + (f"The tokens' rank-1 matrices are alike on both trajectories; what the BF16 run adds in "
                        f"head{'s' * (len(biased) > 1)} {and_join(list(map(str, biased)))} is a δ error that keeps "
                        f"one sign (t above {STRONG_T}, page 02), so that G adds up along their shared direction."
                        if biased else ""))
    return text


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
