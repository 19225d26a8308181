"""Page 16, kernel bias: is an attention kernel biased? The signed mean errors of O, δ and dQ along the low-rank
direction u of each kernel against float64 (:mod:`lpfa.audit`), read from the committed GPU audit or computed on this
CPU, as the page shows them: its opening finding, the figure and the table of intervals, how many intervals exclude 0
against chance, flash-attention PR #2721's radial error, stochastic rounding, lpfa's Triton kernels, a trained layer's
own activations and what SFA (Sec. 4) does to them, FlashAttention-3's FP8 forward, and the kernels that could not run.

Every sentence builder takes an audit frame at one T per family (:func:`lpfa.audit.at_largest_T`) and reads only the
kernels that ran; a kernel a sentence names must have run (:func:`lpfa.audit.result` raises otherwise).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns
from matplotlib.ticker import NullLocator

from lpfa.audit import (
    FAMILIES,
    KERNELS,
    PRESET_KERNELS,
    PRODUCTION,
    at_largest_T,
    audit,
    chance_exclusions,
    ci_text,
    excludes_zero,
    load_audit,
    load_captured,
    result,
    silenced_rows,
)
from lpfa.params import integer, text
from lpfa.paths import results_dir
from lpfa.plotting import COLORS, format_table, use_style
from lpfa.results import run_dir

# the notebook's papermill parameters, checked right after its parameters cell (lpfa.params.check_params)
PARAMS = {"gpu_run": text(), "seq_len": integer(1), "batch": integer(1), "heads": integer(1), "head_dim": integer(1),
    "seed": integer(0)}

QUANTITY_LABELS = {"o": "O − O₆₄ (row mean)", "delta": "δ − δ₆₄", "dq_u": "(dQ − dQ₆₄)·u"}  # the figure's panels
CAPTURED_DEFAULT = "layer1_step6000"  # the captured layer scripts/gpu/kernel_bias.sh writes (captured:layer1_step6000)


@dataclass
class PageAudit:
    """The audit page 16 shows: ``full`` (every T), ``df`` (its largest T per family), ``where`` it was measured ("on
    one H200", "on the CPU"), ``source`` (that in a clause, with its provenance), the committed run's ``config`` and
    ``folder`` (None on the CPU path without committed results)."""

    full: pd.DataFrame
    df: pd.DataFrame
    where: str
    source: str
    config: dict | None
    folder: Path | None

    @property
    def families(self) -> list[str]:
        """The families of the audit, in its order (the captured ones, ``captured:NAME``, included)."""
        return list(dict.fromkeys(self.df.family))

    @property
    def captured(self) -> list[str]:
        """The captured families (a trained layer's own q, k, v, dO), ``captured:NAME``."""
        return [f for f in self.families if f not in FAMILIES]


def load_page(gpu_run: str = "latest", T: int = 128, B: int = 2, H: int = 4, D: int = 32, seed: int = 0,
              root=None) -> PageAudit:
    """Page 16's audit: the committed GPU audit ``results/kernel_bias/<gpu_run>`` ("latest": the newest), or with
    ``gpu_run`` empty every kernel of :data:`lpfa.audit.KERNELS` audited on this CPU at (B, H, T, D) and ``seed`` (the
    GPU kernels then listed as unavailable), with its folder the latest committed audit's where there is one (for
    its captured layer)."""
    if not isinstance(gpu_run, str):
        raise ValueError(f"gpu_run={gpu_run!r}: expected a committed run's name, 'latest' or ''")
    if gpu_run:
        full, config, folder = load_audit(None if gpu_run == "latest" else gpu_run, root)
        prov = json.loads((folder / "provenance.json").read_text())
        source = (f"measured on one H200 (`results/kernel_bias/{folder.name}`, commit `{prov['git_commit'][:7]}`, "
                  f"{prov['date_utc'][:10]}; `benchmarks/kernel_bias.py`): B = {config['B']}, H = {config['H']}, "
                  f"D = {config['D']} and T = {' and '.join(map(str, config['T']))} for the random and tied families, "
                  "of which the figures show the largest T")
        where = "on one H200"
    else:
        full = audit(FAMILIES, KERNELS, "cpu", B=B, H=H, T=T, D=D, seed=seed)
        config = None
        base = Path(root) if root else results_dir()
        folder = run_dir("kernel_bias", root=root) if (base / "kernel_bias").is_dir() else None
        source = f"computed on this CPU while the book builds, at T = {T}, D = {D}: the GPU kernels are left out"
        where = "on the CPU"
    return PageAudit(full, at_largest_T(full), where, source, config, folder)


def _ran(df):
    return df[df.unavailable.isna()]


def _r(df, kernel: str, family: str, quantity: str):
    """The row of a kernel that ran (:func:`lpfa.audit.result`)."""
    return result(_ran(df), kernel, family, quantity)


def _ci(df, kernel: str, family: str, quantity: str) -> str:
    return ci_text(_r(df, kernel, family, quantity))


def _biased(df, kernel: str, family: str, quantity: str) -> bool:
    return excludes_zero(_r(df, kernel, family, quantity))


def _families(df) -> list[str]:
    return list(dict.fromkeys(df.family))


def _ticked(kernels) -> str:
    return ", ".join(f"`{k}`" for k in kernels)


def headline(df, where: str, T: int | None = None) -> str:
    """Page 16's opening finding, measured ``where`` (``T``: the sequence length of a frame without a ``T`` column):
    ``paper``'s signed errors of O, δ and dQ·u on the tied family (Fig. 6's setting), whether each interval excludes 0
    and whether it is biased on random inputs; then the production kernels' largest tied-row δ error, how many times
    smaller than ``paper``'s, its sign and how many of their intervals exclude 0, or else which unbiased kernels show
    none."""
    ran = _ran(df)
    quantities = ("o", "delta", "dq_u")
    tied = _r(df, "ref:paper", "ties", "o")
    paper_chain = all(_biased(df, "ref:paper", "ties", q) for q in quantities)
    production = [k for k in PRODUCTION if k in set(ran.kernel)]
    prod_ties = [k for k in production if _biased(df, k, "ties", "delta")]
    clean = [k for k in ("ref:fa2", "ref:fp32", "sdpa:math") if k in set(ran.kernel)
             and not any(_biased(df, k, f, q) for f in FAMILIES for q in quantities)]
    head = (f"**{where[0].upper() + where[1:]}, lpfa's `paper` rounding is biased exactly where the paper says: on "
            f"rows with tied BF16 maxima and negative V its O error averages {_ci(df, 'ref:paper', 'ties', 'o')}, δ's "
            f"{_ci(df, 'ref:paper', 'ties', 'delta')} and dQ's along the low-rank direction "
            f"{_ci(df, 'ref:paper', 'ties', 'dq_u')}"
            + (", every interval excluding 0" if paper_chain else " (not every interval excludes 0)")
            + f" ({int(tied.n):,} rows, T = {int(tied['T']) if 'T' in ran.columns else T}), while on random inputs "
            + ("it shows no bias whose interval excludes 0"
               if not any(_biased(df, "ref:paper", "random", q) for q in quantities) else "it is biased too"))
    if production:
        worst = max(production, key=lambda k: abs(_r(df, k, "ties", "delta")["mean"]))
        paper_delta = _r(df, "ref:paper", "ties", "delta")["mean"]
        ratio = abs(paper_delta) / abs(_r(df, worst, "ties", "delta")["mean"])
        same_sign = _r(df, worst, "ties", "delta")["mean"] * paper_delta > 0
        head += (f". PyTorch's production kernels ({_ticked(production)}) err far less on the tied rows: their largest "
                 f"δ error, `{worst}`'s {_ci(df, worst, 'ties', 'delta')}, is {ratio:.0f}× smaller than `paper`'s, "
                 + ("of the same sign" if same_sign else "of the opposite sign")
                 + f", and {len(prod_ties)} of their {len(production)} intervals "
                 + ("excludes" if len(prod_ties) == 1 else "exclude") + " 0")
    elif clean:
        head += f"; {_ticked(clean)} shows none on either family"
    return head + "**."


def captured_text(page: PageAudit) -> str:
    """The captured family in a clause: the trained layer, run, policy and step its q, k, v, dO come from
    (``benchmarks/kernel_bias.py``'s config), its rows and T, and its file; or that the audit has none."""
    if not page.captured:
        return "not in this audit (the CPU path; the committed GPU audit has it)"
    fam = page.captured[0]
    meta = page.config["captured"][fam]
    first = page.full[page.full.family == fam].iloc[0]
    return (f"layer {meta['layer']} of the eager `repro` BF16 twin (`{meta['policy']}`) at step {meta['step']:,}, "
            f"before its logit runaway, replayed one step with `python -m lpfa.replay --save-qkv` ({int(first.n):,} "
            f"rows of T = {int(first['T'])}; `{page.folder.name}/{fam.split(':', 1)[1]}/qkv.npz`)")


def plot_bias(df, where: str):
    """Page 16's figure: per kernel that ran (rows, in :data:`lpfa.audit.KERNELS`' order) the signed mean error of
    O, δ and dQ·u (columns, :data:`QUANTITY_LABELS`) on each family, with its 95% interval, on a symmetric-log axis
    (linear within 10⁻¹¹) so that FP32 and BF16 kernels share it. Returns the figure."""
    use_style()
    ran = _ran(df)
    fams = _families(df)
    styles = [(COLORS["fp32"], "o"), (COLORS["bf16"], "s"), (COLORS["sfa"], "D")]
    fam = {f: (*styles[i % 3], (i - (len(fams) - 1) / 2) * 0.22) for i, f in enumerate(fams)}  # colour, marker, dodge
    order = [k for k in KERNELS if k in set(ran.kernel)]
    fig, axes = plt.subplots(1, 3, figsize=(7, 0.3 * len(order) + 2.2), sharey=True)
    for ax, q in zip(axes, QUANTITY_LABELS):
        d = ran[ran.quantity == q].dropna(subset=["mean"])
        d = d.assign(y=d.kernel.map(order.index) + d.family.map(lambda f: fam[f][2]))
        sns.scatterplot(data=d, x="mean", y="y", hue="family", style="family",
                        palette={f: c for f, (c, _, _) in fam.items()}, markers={f: m for f, (_, m, _) in fam.items()},
                        s=40, ax=ax, legend=(q == "o"), zorder=3)
        for _, row in d.iterrows():
            ax.plot([row.ci_low, row.ci_high], [row.y, row.y], color=fam[row.family][0], lw=1.6, zorder=2)
        ax.axvline(0, color=COLORS["neutral"], lw=1)
        ax.set_xscale("symlog", linthresh=1e-11)
        lim = 3 * max(d.ci_low.abs().max(), d.ci_high.abs().max(), 1e-6)
        ax.set_xlim(-lim, lim)
        e = math.floor(math.log10(lim / 3))  # three ticks, -10^e, 0, 10^e: a panel is 2 inches wide
        ax.set_xticks([-(10.0 ** e), 0, 10.0 ** e], [f"−1e{e}", "0", f"1e{e}"])
        ax.xaxis.set_minor_locator(NullLocator())
        ax.set_title(QUANTITY_LABELS[q])
        ax.set_xlabel("signed mean error")
        ax.set_ylabel("")
    axes[0].set_yticks(range(len(order)), order)
    axes[0].invert_yaxis()
    handles, labels = axes[0].get_legend_handles_labels()
    axes[0].get_legend().remove()
    fig.legend(handles, labels, loc="outside lower center", ncol=len(fams), title="inputs")
    fig.suptitle(f"Signed bias against float64, 95% CI over the rows ({where})")
    return fig


def bias_table(df) -> pd.DataFrame:
    """Page 16's table: every kernel that ran but float64, indexed by (kernel, family, quantity), with ``T`` (when the
    frame has it), ``mean``, ``ci_low``, ``ci_high``, ``n`` and ``CI excludes 0``."""
    ran = _ran(df)
    cols = ["T", "mean", "ci_low", "ci_high", "n"] if "T" in ran.columns else ["mean", "ci_low", "ci_high", "n"]
    shown = ran[ran.kernel != "float64"].set_index(["kernel", "family", "quantity"])[cols]
    return shown.assign(**{"CI excludes 0": (shown.ci_low > 0) | (shown.ci_high < 0)})


QUANTITY_SHORT = {"o": "O", "o_radial": "O radial", "delta": "δ", "dq_u": "dQ·u"}  # the summary table's words


def bias_summary(df) -> pd.DataFrame:
    """Page 16's table, :func:`bias_table` in one row per kernel that ran (but float64) and one column per family
    (``captured:NAME`` as "captured"): the quantities whose 95% interval excludes 0, each with the sign of its mean
    ("δ +, O radial −"), "none" where no interval does, "–" where the kernel did not run on the family."""
    t = bias_table(df).reset_index()
    fams = _families(t)
    rows = {}
    for kernel, g in t.groupby("kernel", sort=False):
        rows[kernel] = {}
        for fam in fams:
            f = g[g.family == fam]
            biased = [f"{QUANTITY_SHORT.get(q, q)} {'+' if m > 0 else '−'}"
                      for q, m, x in zip(f.quantity, f["mean"], f["CI excludes 0"]) if x]
            rows[kernel][fam.split(":")[0]] = None if f.empty else (", ".join(biased) or "none")
    out = pd.DataFrame.from_dict(rows, orient="index")
    out.index.name = "kernel"
    return out


def bias_display(df):
    """:func:`bias_summary` as the page shows it (:func:`lpfa.plotting.format_table`), with its caption."""
    return format_table(bias_summary(df)).set_caption(
        "Quantities whose 95% interval of the signed mean error excludes 0, with the sign of the mean")


def full_bias_table():
    """The full table behind :func:`bias_summary` for :mod:`lpfa.pages.tables`: :func:`bias_table` of the latest
    committed GPU audit, what it is, and the folder it was read from."""
    page = load_page("latest")
    what = (f"Page 16's full table: the signed mean error against float64 of every kernel, family and quantity of the "
            f"GPU audit results/kernel_bias/{page.folder.name} at its largest T, with its 95% interval")
    return bias_table(page.df), what, [f"results/kernel_bias/{page.folder.name}"]


def exclusion_texts(df) -> tuple[str, str, str]:
    """How many intervals exclude 0 against chance (:func:`lpfa.audit.chance_exclusions`), as page 16 glues them:
    ``(intervals, excluding, random)``, ``random`` the random family's count against chance, its binomial tail and
    the kernels (with their quantities) whose interval excludes 0 there."""
    ran = _ran(df)
    every, rnd = chance_exclusions(df), chance_exclusions(df, "random")
    rand_excl = ran[(ran.family == "random") & (ran.kernel != "float64") & ((ran.ci_low > 0) | (ran.ci_high < 0))]
    rand = (f"{rnd['excluding']} of its {rnd['n']}, against {rnd['expected']:.1f} expected by chance"
            + f" (at least that many in {rnd['p_chance']:.2g} of such tables if the intervals were independent and no "
            "kernel biased)"
            + (": " + ", ".join(f"`{k}` ({', '.join(sorted(set(rand_excl[rand_excl.kernel == k].quantity)))})"
                                for k in dict.fromkeys(rand_excl.kernel)) if len(rand_excl) else ""))
    return f"{every['n']}", f"{every['excluding']}", rand


def _verdict(df, kernel: str, family: str, quantity: str) -> str:
    return "biased, the interval excluding 0" if _biased(df, kernel, family, quantity) else "the interval includes 0"


def pr2721_text(df) -> str:
    """Flash-attention PR #2721's claim (a BF16 P̄ in the numerator P̄V over an FP32 row sum shrinks |O|) tested on
    ``fa2``'s rounding (``ref:fa2``, ``triton:fa2``) and ``sdpa:flash``, those that ran: each one's radial O error
    per family, whether it shrinks |O| with an interval excluding 0, and the largest of them against ``paper``'s on
    the tied rows."""
    ran, fams = _ran(df), _families(df)
    kernels = [k for k in ("ref:fa2", "triton:fa2", "sdpa:flash") if k in set(ran.kernel)]
    shrinks = {k: [f for f in fams if _biased(df, k, f, "o_radial") and _r(df, k, f, "o_radial")["mean"] < 0]
               for k in kernels}
    largest = max(abs(_r(df, k, f, "o_radial")["mean"]) for k in kernels for f in fams)
    return ("**the radial O error, negative where a kernel shrinks |O|, is " + "; ".join(
        f"for `{k}` " + ", ".join(f"{_ci(df, k, f, 'o_radial')} on {f}" for f in fams) for k in kernels) + "**. "
        + " ".join(f"`{k}` " + (f"shrinks |O| on {', '.join(shrinks[k])} inputs (interval excluding 0), as PR #2721 "
                                "says" if shrinks[k] else "shows no shrinking of |O| whose interval excludes 0") + "."
                   for k in kernels)
        + f" The largest of these radial errors, {largest:.1e}, is "
        + f"{abs(_r(df, 'ref:paper', 'ties', 'o_radial')['mean']) / largest:.0f}× "
        + "smaller than `paper`'s on the tied rows.")


def sr_text(df) -> str:
    """Stochastic rounding of O's path (``paper_sr``) against ``paper``: the δ error of each on every family with
    its verdict, whether it removes ``paper``'s tied-row δ bias, and, on a captured layer where both stay biased,
    which roundings that bias must come from."""
    fams = _families(df)
    return ("**" + "; ".join(
        f"on {f} inputs `paper_sr`'s δ error averages {_ci(df, 'ref:paper_sr', f, 'delta')} "
        f"({_verdict(df, 'ref:paper_sr', f, 'delta')}), against {_ci(df, 'ref:paper', f, 'delta')} for `paper`"
        for f in fams) + "**. "
        + ("Stochastic rounding removes the δ bias that `paper` shows on the tied rows."
           if _biased(df, "ref:paper", "ties", "delta") and not _biased(df, "ref:paper_sr", "ties", "delta") else
           "Stochastic rounding does not remove every δ bias that `paper` shows on the tied rows.")
        + "".join(f" On the captured layer ({f}) it leaves `paper`'s δ bias in place: that bias does not come from the "
                  "rounding of Ō, o, l or O, which `paper_sr` makes unbiased, but from a rounding it keeps: the BF16 "
                  "scores S (and the ties they make), P̄, m, or the BF16 products dO∘O of `paper`'s BF16 backward."
                  for f in fams if f not in FAMILIES
                  and _biased(df, "ref:paper", f, "delta") and _biased(df, "ref:paper_sr", f, "delta")))


def triton_text(df) -> str:
    """lpfa's Triton kernels against its exact reference on the tied rows: ``triton:paper``'s δ error beside the
    reference's, then each preset whose Triton δ error excludes 0 while the reference's does not, their intervals
    disjoint, with its size against ``paper``'s; without Triton kernels, that they need a GPU."""
    ran = _ran(df)
    pairs = [p for p in PRESET_KERNELS if f"triton:{p}" in set(ran.kernel)]
    if not pairs:
        return "The Triton kernels need a GPU; this audit has none of them."

    def apart(x, y):  # two disjoint intervals
        return x.ci_low > y.ci_high or y.ci_low > x.ci_high

    far = [p for p in pairs if _biased(df, f"triton:{p}", "ties", "delta")
           and not _biased(df, f"ref:{p}", "ties", "delta")
           and apart(_r(df, f"triton:{p}", "ties", "delta"), _r(df, f"ref:{p}", "ties", "delta"))]
    paper_delta = abs(_r(df, "ref:paper", "ties", "delta")["mean"])
    return ("**The Triton kernels carry their reference's bias:** on the tied rows `triton:paper`'s δ error is "
            f"{_ci(df, 'triton:paper', 'ties', 'delta')}, the reference's {_ci(df, 'ref:paper', 'ties', 'delta')}. "
            + " ".join(f"`triton:{p}` is the exception: its δ error on the tied rows, "
                       f"{_ci(df, f'triton:{p}', 'ties', 'delta')}, excludes 0 while the exact reference's, "
                       f"{_ci(df, f'ref:{p}', 'ties', 'delta')}, does not: the kernel's FP32 arithmetic on the GPU is "
                       "not the reference's exact sums, and leaves a small bias "
                       f"{paper_delta / abs(_r(df, f'triton:{p}', 'ties', 'delta')['mean']):.0f}× below `paper`'s."
                       for p in far))


def captured_silenced(page: PageAudit):
    """:func:`lpfa.audit.silenced_rows` of the audit's captured layer (``<folder>/<NAME>/qkv.npz`` of the family
    ``captured:NAME``, else :data:`CAPTURED_DEFAULT` of the latest committed audit), or None when no such file is
    committed."""
    name = page.captured[0].split(":", 1)[1] if page.captured else CAPTURED_DEFAULT
    path = page.folder / name / "qkv.npz" if page.folder is not None else None
    return silenced_rows(load_captured(path)[0]) if path is not None and path.is_file() else None


def captured_bias_text(df, sil=None) -> str:
    """The δ bias on the first captured family: the kernels whose interval excludes 0 against those with FP32 scores
    (``ref:fa2``, ``sdpa:flash``, ``sdpa:cudnn``) that ran; with ``sil`` (:func:`captured_silenced`) and only
    BF16-score presets biased, the tied rows in BF16 and FP32 scores; and whether ``fa2_sfa`` returned NaN rows."""
    captured = [f for f in _families(df) if f not in FAMILIES]
    if not captured:
        return "The CPU path has no captured family; the committed GPU audit has it."
    f = captured[0]
    ran = _ran(df)
    order = [k for k in KERNELS if k in set(ran.kernel)]
    biased = [k for k in order if k != "float64" and _biased(df, k, f, "delta")]
    fp32_scores = [k for k in ("ref:fa2", "sdpa:flash", "sdpa:cudnn") if k in set(ran.kernel)]
    return (f"**On the captured layer, {len(biased)} kernels show a δ bias whose interval excludes 0: "
            + (", ".join(f"`{k}` ({_ci(df, k, f, 'delta')})" for k in biased) if biased else "none")
            + "**, while " + ", ".join(f"`{k}` {_ci(df, k, f, 'delta')}" for k in fp32_scores) + " do not. "
            + (f"The biased ones are the kernels with BF16 scores: in BF16, {int(sil.loc['paper', 'tied']):,} of this "
               f"layer's {int(sil.loc['paper', 'rows']):,} rows have a tied maximum, in FP32 "
               f"{int(sil.loc['fa2', 'tied']):,}. "
               if sil is not None and all(k.endswith(("paper", "paper_sr", "paper_sfa")) for k in biased) else "")
            + ("`fa2_sfa` returns NaN rows here, so it has no mean."
               if math.isnan(_r(df, "ref:fa2_sfa", f, "o")["mean"]) else ""))


def top_logit_text(sil) -> str:
    """The captured layer's largest logit, rounded (``sil``: :func:`captured_silenced`), or "not available"."""
    return f"{sil['largest logit'].iloc[0]:.0f}" if sil is not None else "not available"


def sfa_text(sil) -> str:
    """What SFA as published (Sec. 4) does to the captured layer's rows (``sil``: :func:`captured_silenced`): rows
    zeroed and attenuated by the row-sum clamp under ``paper_sfa``, rows made NaN under ``fa2_sfa``, of those shifted;
    or that no captured layer is committed."""
    if sil is None:
        return "No captured layer is committed."
    ps, fs = sil.loc["paper_sfa"].astype(int), sil.loc["fa2_sfa"].astype(int)
    return (f"**SFA as published silences rows of this layer: under `paper_sfa` {ps['zeroed']:,} of {ps['rows']:,} "
            f"rows ({ps['zeroed'] / ps['rows']:.1%}) have their row sum underflow to 0 and output 0 after the clamp, "
            f"and {ps['attenuated']:,} are scaled down by the clamp, of the {ps['sfa shifted']:,} rows it shifted; "
            f"under `fa2_sfa` (no clamp) {fs['NaN rows']:,} rows become NaN (0/0), of {fs['sfa shifted']:,} "
            "shifted.** Without SFA no row is lost. These are the large-|rm| cases that `lpfa.attention.SFA` "
            "documents, met on real activations of the run SFA is meant to fix, before its runaway.")


def silenced_table(sil) -> pd.DataFrame:
    """``sil`` (:func:`captured_silenced`) as page 16 shows it: the row counts per policy, the largest logit left
    to the text."""
    return sil.drop(columns="largest logit")


def fp8_text(df) -> str:
    """FlashAttention-3's FP8 forward, emulated (``ref:fa3_fp8``, ``ref:fa3_fp8_p``, those that ran): each one's
    radial O error per family and tied-row δ error against ``fa2``'s, then whether rounding P̄ to e4m3 shrinks |O| on
    every synthetic family, with the first one's tied-row δ error against ``paper``'s in size."""
    ran, fams = _ran(df), _families(df)
    fp8 = [k for k in ("ref:fa3_fp8", "ref:fa3_fp8_p") if k in set(ran.kernel)]
    shrinks = fp8 and all(_biased(df, k, f, "o_radial") and _r(df, k, f, "o_radial")["mean"] < 0
                          for k in fp8 for f in FAMILIES)
    return ("**" + "; ".join(
        f"`{k}`: radial O error " + ", ".join(f"{_ci(df, k, f, 'o_radial')} on {f}" for f in fams)
        + f", δ error on the tied rows {_ci(df, k, 'ties', 'delta')}" for k in fp8) + "**, against `fa2`'s δ error on "
        f"the tied rows {_ci(df, 'ref:fa2', 'ties', 'delta')}. "
        + ("Rounding P̄ to e4m3 shrinks |O| on every family: e4m3 has 4 significant bits and flushes every P̄ below "
           "2⁻¹⁰ to 0, so the numerator loses the small probabilities that the FP32 row sum keeps (PR #2721's pattern, "
           "amplified); on the tied rows the δ error is "
           f"{abs(_r(df, fp8[0], 'ties', 'delta')['mean']) / abs(_r(df, 'ref:paper', 'ties', 'delta')['mean']):.0f}× "
           "`paper`'s in size, of the opposite sign." if shrinks else "Not every FP8 interval excludes 0 here."))


def unavailable_text(df, where: str) -> str:
    """The kernels that could not run ``where``, each with its reason, or that every kernel ran."""
    gpu = df[df.unavailable.notna()].drop_duplicates("kernel")
    if not len(gpu):
        return f"Every kernel ran {where}."
    return f"{len(gpu)} kernels could not run {where}: " + "; ".join(
        f"`{k}` ({why})" for k, why in zip(gpu.kernel, gpu.unavailable)) + "."


def page_texts(page, silenced, T: int) -> dict:
    """Every sentence and number page 16 glues into its prose, by name: from the audit ``page``
    (:func:`load_page`), what each policy does to the captured rows (``silenced``: :func:`captured_silenced`) and
    the CPU audit's ``T``."""
    df, where = page.df, page.where
    n, excl, rand = exclusion_texts(df)
    return {"kb_source": page.source, "kb_headline": headline(df, where, T=T), "kb_captured": captured_text(page),
            "kb_n": n, "kb_excl": excl, "kb_rand": rand, "kb_pr2721": pr2721_text(df), "kb_sr": sr_text(df),
            "kb_triton": triton_text(df), "kb_cap": captured_bias_text(df, silenced),
            "kb_toplogit": top_logit_text(silenced), "kb_sfa": sfa_text(silenced), "kb_fp8": fp8_text(df),
            "kb_gpu": unavailable_text(df, where), "kb_table": table_text()}


def table_text() -> str:
    """What page 16's table (:func:`bias_display`) shows, with a link to every interval (:mod:`lpfa.pages.tables`)."""
    from lpfa.pages.tables import link

    return ("Per kernel and input family, the quantities whose 95% interval excludes 0, with the sign of the mean; "
            "`O radial` is (O − O₆₄)·sign(O₆₄), negative where the kernel shrinks |O| towards 0. Every interval, with "
            f"its bounds, is in {link('kernel_bias_audit', 'the committed H200 audit')}.")
