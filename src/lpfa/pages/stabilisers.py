"""Page 17, stabilisers: what QK-norm, gated attention, QK-clip, the soft-cap and stochastic rounding break in the
chain, whether the loss explodes or the logits run away, what each costs, and the paper's Discussion judged on them.

**The rows.** Each stabiliser of :data:`lpfa.experiments.STABILISERS` is held, with the paper's own cuts of the chain
(SFA, the isolation rows of :data:`lpfa.experiments.RECIPE_ISOLATION`), against the run whose loss explodes:
the BF16 run of the paper's GPT-2 S recipe (``bf16_paper_recipe``). A row is compared with its own FP32 twin (the
design's ``reference``) where the stabiliser changes the model, else with the FP32 attention twin
``fp32_paper_recipe``; the logged links (ties, largest logit, W_Q) are read at the last diagnostics step before the BF16
run's loss explodes, and also given as ratios to the BF16 run's of the row's seed (:func:`stabiliser_table`: a row at
a second seed, :data:`lpfa.experiments.STABILISER_SEEDS`, has that seed's recipe runs as its bases).

**The paper's Discussion** (:func:`paper_claims`) says why QK-norm, gated attention and QK-clipping work, without an
experiment: each breaks one link (:data:`PAPER_CLAIMS`). A claim is judged on its BF16 row against the unstabilised
BF16 run: the doctor's rank-1 similarity of (PK)[T]ᵀX[T] (Fig. 9) against ``bf16_rerun``'s, which has the checkpoint,
with the FP32 run's (``fp32_rerun``) beside it as what the link is without BF16 attention; the ties against
``bf16_paper_recipe``'s. The similarity counts as broken at or below the row's own FP32 twin's where its report is
committed, else the FP32 run's (BF16 attention no longer adds structure that FP32 attention lacks), the ties when they
fall to :data:`TIES_KEPT` of the BF16 run's or fewer. A claim fits its run only when its row both breaks the link and
meets the criterion: neither its loss exploded nor its logits ran away, and its eval loss ended within
:data:`LOSS_MATCH` of its FP32 twin's (:func:`_failure`). Over seeds, a claim stands when it stands at every seed that
decides it (a row that fails decides it, measured link or not), and is seed-dependent when the seeds disagree.
"""

from __future__ import annotations

import json
import math
import re

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd

from lpfa.attention.policy import get_policy
from lpfa.audit import load_captured
from lpfa.compare import PRECURSORS, experiment_table, layer_max, outcome, precursor_panels
from lpfa.experiments import (
    BASES,
    FP32_RERUN,
    RECIPE_ISOLATION,
    RERUN_STOP,
    RERUNS,
    STABILISER_RERUN,
    STABILISER_SEEDS,
    STABILISERS,
    stabiliser_seed,
)
from lpfa.experiments import rows as rows_of
from lpfa.mechanism import error_persistence
from lpfa.pages import RERUN_PAGE, and_join, gpu_name, plural
from lpfa.pages.loss_explosion import recipe_fates
from lpfa.params import integer
from lpfa.plotting import COLORS, use_style
from lpfa.replay import bias_test
from lpfa.results import experiment_rows
from lpfa.results import runs as launches
from lpfa.run import Run, attention_precision, layer_precision, load_metrics, run_verdict
from lpfa.scaling import run_price

# the notebook's papermill parameters, checked right after its parameters cell (lpfa.params.check_params)
PARAMS = {"layer": integer(0), "persistence_sequences": integer(1), "persistence_steps": integer(2)}

STABILISER_COLORS = ("#E69F00", "#56B4E9", "#CC79A7", "#000000", "#7F7F7F", "#009E73")  # Okabe-Ito, after the modes'


def seed_base_of(label: str) -> int | None:
    """The seed of a recipe run that is a second seed's base (``bf16_paper_recipe_s1`` → 1), else None."""
    m = re.fullmatch(r"(?:bf16|fp32)_paper_recipe_s(\d+)", label)
    return int(m.group(1)) if m else None


def stabiliser_styles(labels, fp32=()) -> dict:
    """``{label: (colour, dash)}`` for page 17's figure: the base runs in their modes' colours (BF16 solid, FP32
    dashed, SFA dash-dot; their reruns dotted), a second seed's base runs as the base runs; every other row a colour of
    its own name (the label without its ``bf16_``/``fp32_`` prefix, ``_paper_recipe`` and seed suffix), solid, or
    dashed where the run is in ``fp32`` (FP32-level attention), so a stabiliser and its FP32 twin share a colour and
    differ in dash, and a row at a second seed looks as at seed 1337 (it is drawn in a column of its own). No two labels
    of one seed share both."""
    base = {"bf16_paper_recipe": (COLORS["bf16"], "-"), "fp32_paper_recipe": (COLORS["fp32"], "--"),
            "sfa_paper_recipe": (COLORS["sfa"], "-."), STABILISER_RERUN: (COLORS["bf16"], ":"),
            FP32_RERUN: (COLORS["fp32"], ":")}
    base.update({label: base[label.rsplit("_s", 1)[0]] for label in labels if seed_base_of(label) is not None})

    def name(label):
        return stabiliser_seed(label)[0].removesuffix("_paper_recipe").removeprefix("bf16_").removeprefix("fp32_")

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
    :func:`stabiliser_styles` (FP32 twins dashed: every layer "fp32" in :func:`lpfa.run.layer_precision`): the first
    column's own, every later column's one map over them all, so that a row at a second seed looks as at seed 1337;
    a legend under each column."""
    use_style()
    columns = list(groups.values())
    everyone = list(dict.fromkeys(label for labels in columns for label in labels))
    fp32 = {label for label in everyone if all(p == "fp32" for p in layer_precision(Run(runs[label])))}
    first = stabiliser_styles(columns[0], fp32) if columns else {}
    later = stabiliser_styles(list(dict.fromkeys(label for labels in columns[1:] for label in labels)), fp32)
    width = 4.2 if len(groups) <= 2 else 3.3  # three columns still fit the page with 9-pt text
    fig, axes = plt.subplots(3, len(groups), figsize=(width * len(groups), 8.0), sharex=True, sharey="row",
                             squeeze=False)
    for col, (title, labels) in enumerate(groups.items()):
        style = first if col == 0 else later
        precursor_panels(axes[:, col], {label: runs[label] for label in labels}, layer,
                         {label: style[label] for label in labels})
        axes[0, col].set_title(title, fontsize=10)
        axes[-1, col].set_xlabel("step")
        axes[-1, col].legend(fontsize=9, ncol=1, loc="upper center", bbox_to_anchor=(0.5, -0.3))
    for row, name in enumerate(PRECURSORS.values()):
        axes[row, 0].set_ylabel(f"layer {layer}:\n{name}", fontsize=9)
    axes[0, 0].set_yscale("log")
    return fig


def stabiliser_groups(labels) -> dict:
    """Page 17's figure columns, :func:`plot_stabilisers`' ``groups``, from the committed rows ``labels`` (in their
    order): the BF16 and FP32 runs of the recipe head the first two; the first holds the paper's own cuts of the chain
    (every other ``*_paper_recipe`` row: SFA, the isolation rows) and the base runs again
    (:data:`lpfa.experiments.RERUNS`), the second the stabilisers and their FP32 twins. Each second seed of a
    stabiliser row (:data:`lpfa.experiments.STABILISER_SEEDS`) gets a column of its own, headed by that seed's recipe
    runs; the recipe runs of a seed without stabiliser rows are not drawn."""
    base = [label for label in ("bf16_paper_recipe", "fp32_paper_recipe") if label in labels]
    seeds = sorted({s for label in labels if (s := stabiliser_seed(label)[1]) is not None})
    cuts = [label for label in labels if label.endswith("_paper_recipe") and label not in base or label in RERUNS]
    stabilisers = [label for label in labels if label not in base and label not in cuts
                   and stabiliser_seed(label)[1] is None and seed_base_of(label) is None]
    groups = {"the paper's cuts and reruns": [*base, *cuts], "stabilisers and their FP32 twins": [*base, *stabilisers]}
    for s in seeds:
        groups[f"the same at seed {s}"] = (
            [label for label in (f"bf16_paper_recipe_s{s}", f"fp32_paper_recipe_s{s}") if label in labels]
            + [label for label in labels if stabiliser_seed(label)[1] == s])
    return groups


def stabiliser_figure(table, layer: int = 1, root=None):
    """Page 17's figure for the rows of :func:`stabiliser_table`: their run folders (``results/paper_recipe`` first,
    then ``results/stabilisers``) drawn by :func:`plot_stabilisers` in :func:`stabiliser_groups`' columns; None when
    no row is committed."""
    labels = list(table.index)
    runs = {**experiment_rows("paper_recipe", labels, root=root), **experiment_rows("stabilisers", labels, root=root)}
    return plot_stabilisers(runs, layer, stabiliser_groups(list(runs))) if runs else None


# paper_recipe's rows the page holds the stabilisers against
STABILISER_BASE = ("bf16_paper_recipe", "sfa_paper_recipe", "fp32_paper_recipe")


STABILISER_LINKS = {"ties": "largest per-head tie fraction", "logit": "largest attention logit",
                    "W_Q": "largest per-head ‖W_Q[h]‖₂"}


# the links a checkpoint gives (lpfa doctor): per row, on layer `layer` of its last doctor report
DOCTOR_LINKS = {"doctor step": "the checkpoint's step",
                "δ |t| paper": "largest |t| of δ_lp − δ_hp over the heads, paper policy",
                "δ |t| own": "the same with the run's own BF16 policy (when it is not paper or fa2)",
                "rank-1 similarity": "median over the heads of the median similarity of (PK)[T]ᵀX[T] (Fig. 9)"}


# the δ bias as Fig. 5 measures it (lpfa.replay): the row's training replayed from the doctor's checkpoint, layer
# `layer` instrumented, the per-step Σ δ error of each replayed head put to lpfa.replay.bias_test
REPLAY_LINKS = {"replay step": "the checkpoint the replay starts from",
                "replay steps": "training steps replayed",
                "δ |t| replay": "largest |t| over the replayed heads of the per-step Σ δ_lp − δ_hp (Fig. 5's test)",
                "δ replay sign": "the sign of that head's mean δ error (+: the paper's)",
                "δ replay mean": "that head's mean per-step Σ δ_lp − δ_hp",
                "δ replay tied share": "the share of that head's cumulative δ error from rows with a tied maximum "
                                       "(≥ 2 P̄ = 1 entries)"}

RERUN_OF = {"bf16": STABILISER_RERUN, "fp32": FP32_RERUN}  # per mode, seed 1337's recipe run again (with a doctor)

T_RESOLVED = 3.0  # |t| of the δ error from which page 17 counts a probe or a replay as resolving a bias

NOTHING_YET = ("**Nothing to compare yet:** the BF16 run at the paper's recipe is not committed "
               "(`results/paper_recipe`).")


def _ticked(labels) -> str:
    """Row labels as code, comma-separated: ```a`, `b```."""
    return ", ".join(f"`{label}`" for label in labels)


def eval_loss_gap(val, twin_val) -> tuple[int | None, float]:
    """The cost of a stabiliser in loss: a run's eval loss minus its FP32 twin's at the last eval step
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
    reports = (run if isinstance(run, Run) else Run(run)).doctor_reports
    if not reports:
        return {}
    step, rep = max(reports.items())
    heads = [r for r in rep["table"] if r["layer"] == layer]

    def largest_abs(col):
        vals = [abs(r[col]) for r in heads if r.get(col) is not None]
        return max(vals) if vals else None

    sims = sorted(r["rank1_median"] for r in heads if r.get("rank1_median") is not None)
    return {"doctor step": step, "δ |t| paper": largest_abs("delta_t_paper"),
            "δ |t| own": largest_abs("delta_t_trained"), "rank-1 similarity": float(np.median(sims)) if sims else None,
            "doctor source": rep["source"], "doctor probe": " × ".join(str(n) for n in rep["probe"]["shape"])}


def replay_links(run, layer: int = 1) -> dict:
    """:data:`REPLAY_LINKS` from the last of :attr:`lpfa.run.Run.replays` of ``run`` (a run folder or Run) that
    instruments ``layer``, plus ``"replay policy"`` (the policy whose δ error it measured) and ``"replay source"``; an
    empty dict for a run without such a replay."""
    replays = [(step, r) for step, r in (run if isinstance(run, Run) else Run(run)).replays.items()
               if r["layer"] == layer and r.get("per_step")]
    if not replays:
        return {}
    step, rep = replays[-1]
    tests = bias_test(rep)
    head = max(tests, key=lambda h: abs(tests[h]["t"]) if tests[h]["t"] == tests[h]["t"] else -1.0)
    t = tests[head]["t"]
    share = tests[head]["share_tied"]
    return {"replay step": step, "replay steps": len(rep["per_step"]), "δ |t| replay": abs(t) if t == t else None,
            "δ replay sign": "+" if tests[head]["mean"] > 0 else "−", "δ replay mean": tests[head]["mean"],
            "δ replay tied share": share if share == share else None, "replay policy": rep["policy"],
            "replay source": rep["source"]}


def stabiliser_table(layer: int = 1, root=None):
    """Which link of the chain each stabiliser breaks: :func:`lpfa.compare.experiment_table` of the base runs, the
    cuts and every committed stabiliser row, each against its FP32 twin (module docstring), at the last diagnostics
    step of ``layer`` before the BF16 run's explosion, plus ``ties/logit/W_Q ÷ bf16``, ``FP32 twin``, ``eval loss −
    twin`` and ``gap step`` (:func:`eval_loss_gap`), ``speed ÷ base`` (:func:`stabiliser_costs`), the
    :data:`DOCTOR_LINKS`, the :data:`REPLAY_LINKS` and ``stabiliser`` (the row's switch). Returns ``(table, step,
    pending)``, ``pending`` the stabiliser rows not committed; an empty table and step None without the BF16 run."""
    cuts = [f"{row}_paper_recipe" for row in RECIPE_ISOLATION]
    found = experiment_rows("stabilisers", list(STABILISERS), root=root)
    seeds = sorted({s for label in found if (s := stabiliser_seed(label)[1]) is not None})
    seed_bases = [f"{mode}_paper_recipe_s{s}" for s in seeds for mode in ("bf16", "fp32")]  # a seeded row's base runs
    base = experiment_rows("paper_recipe", [*STABILISER_BASE, *cuts, *seed_bases], root=root)
    pending = [label for label in STABILISERS if label not in found]
    if "bf16_paper_recipe" not in base:
        return pd.DataFrame(), None, pending
    design = rows_of("stabilisers")
    runs = {**base, **found}

    def seed_base(label, mode):  # the recipe run of the row's seed: bf16_paper_recipe(_s<s>), fp32_paper_recipe(_s<s>)
        s = seed_base_of(label) if label in seed_bases else stabiliser_seed(label)[1]
        name = f"{mode}_paper_recipe" + (f"_s{s}" if s is not None else "")
        return name if name in base else f"{mode}_paper_recipe"

    def twin(label):  # the label of the row's FP32 reference
        ref = design[label].reference if label in design else None
        return ref if ref in found else seed_base(label, "fp32") if "fp32_paper_recipe" in base else label

    def reference(label):
        return runs[twin(label)]

    boom = run_verdict(base["bf16_paper_recipe"])["explosion_step"]  # compare before the BF16 loss explodes
    logged = layer_max(base["bf16_paper_recipe"], "max_logit", layer).index
    step = int(max(s for s in logged if boom is None or s < boom))
    table, step = experiment_table(runs, layer=layer, step=step, reference=reference)
    for short, col in STABILISER_LINKS.items():  # against the BF16 recipe run of the row's own seed
        name = f"{col} @ {step}"
        table[f"{short} ÷ bf16"] = [float(table.loc[label, name]) / float(table.loc[seed_base(label, "bf16"), name])
                                    for label in table.index]
    table["FP32 twin"] = [twin(label) for label in table.index]
    vals = {label: load_metrics(d)[1] for label, d in runs.items()}  # each run's evals read once, twins shared
    gaps = {label: eval_loss_gap(vals[label], vals[twin(label)]) for label in table.index}
    table["eval loss − twin"] = [gaps[label][1] for label in table.index]
    table["gap step"] = pd.Series([gaps[label][0] for label in table.index], index=table.index, dtype=object)
    costs = stabiliser_costs(root)  # the speed alone on one GPU (benchmarks/stabiliser_cost.py); cuts not timed
    same = {STABILISER_RERUN: "bf16_paper_recipe", FP32_RERUN: "fp32_paper_recipe"}  # a rerun is its base again
    table["speed ÷ base"] = pd.Series(  # a row's other seed costs what the row costs
        {label: costs["÷ base"].get(same.get(label, stabiliser_seed(label)[0])) for label in table.index}, dtype=object)
    doctor = {label: {**doctor_links(runs[label], layer), **replay_links(runs[label], layer)} for label in table.index}
    for col in [*DOCTOR_LINKS, "doctor source", "doctor probe", *REPLAY_LINKS, "replay policy", "replay source"]:
        table[col] = pd.Series([doctor[label].get(col) for label in table.index], index=table.index, dtype=object)
    switch = {label: " ".join(o.split("=", 1)[1] if o.startswith("attn_") else o for o in design[label].overrides)
              for label in found if label not in RERUNS}
    named = {"bf16_paper_recipe": "none", "sfa_paper_recipe": "paper_sfa", "fp32_paper_recipe": "none (FP32)",
             **{b: f"none{' (FP32)' if b.startswith('fp32') else ''}, seed {seed_base_of(b)}" for b in seed_bases},
             STABILISER_RERUN: "none (run again)", FP32_RERUN: "none (FP32, run again)",
             **{c: f"isolation: {c.removesuffix('_paper_recipe')}" for c in cuts}}
    table.insert(0, "stabiliser", [switch.get(label, named.get(label, "")) for label in table.index])
    return table, step, pending


def shown_table(table, step: int):
    """:func:`stabiliser_table` as page 17 shows it: the row's switch, outcome and steps, the links at ``step`` (named
    by their :data:`STABILISER_LINKS` keys) and as ratios to the BF16 run's, the loss against the FP32 twin, the speed
    and the :data:`DOCTOR_LINKS`."""
    col = {k: f"{v} @ {step}" for k, v in STABILISER_LINKS.items()}
    if any(c not in table.columns for c in col.values()):
        steps = sorted({c.rsplit(" @ ", 1)[1] for c in table.columns if " @ " in c})
        raise ValueError(f"step={step!r}: expected the step the table compares its rows at ({', '.join(steps)})")
    shown = table[["stabiliser", "outcome", "steps", "explosion step", "runaway step", *col.values(),
                   *(f"{k} ÷ bf16" for k in STABILISER_LINKS), "final eval loss", "FP32 twin", "eval loss − twin",
                   "gap step", "speed ÷ base", *DOCTOR_LINKS, *REPLAY_LINKS]]
    return shown.rename(columns={v: f"{k} @ {step}" for k, v in col.items()})


def page_rows(table) -> list[str]:
    """The rows of :func:`stabiliser_table` that page 17's table shows: the BF16 runs, stabilised or not, at every seed.
    The FP32 twins, SFA (page 09) and the paper's cuts of the chain (page 10) are in the full table
    (:func:`full_stabiliser_table`), as the page's table must fit :data:`lpfa.plotting.MAX_ROWS` rows."""
    return [label for label in table.index if not label.startswith("fp32_")
            and not str(table.loc[label, "stabiliser"]).startswith(("isolation", "paper_sfa"))]


def full_stabiliser_table():
    """Page 17's full table for :mod:`lpfa.pages.tables`: :func:`shown_table` of every row of
    :func:`stabiliser_table` (the base runs, their FP32 twins, SFA, the paper's cuts and every stabiliser row), what
    it is, and the experiments it read."""
    table, step, _ = stabiliser_table()
    what = ("Page 17's full table: every committed run of the stabiliser comparison at the paper's GPT-2 S recipe (the "
            "base runs, the FP32 twins, SFA, the paper's cuts of the chain and every stabiliser row), its links at "
            f"step {step:,} and as ratios to the BF16 run's of its seed, its loss against its FP32 twin, its speed, "
            "and the doctor's and the replay's links (lpfa.pages.stabilisers.shown_table)")
    return shown_table(table, step), what, ["results/paper_recipe", "results/stabilisers", "results/stabiliser_cost"]


def full_table_text(table) -> str:
    """What page 17's table shows (:func:`page_rows`: how many of the rows), with a link to the full table."""
    from lpfa.pages.tables import link

    return (f"The table shows the {len(page_rows(table))} BF16 runs; all {len(table)} rows, with the FP32 twins, SFA "
            f"and the paper's cuts of the chain, are in {link('stabiliser_links')}.")


def stabiliser_costs(root=None):
    """What each stabiliser costs in speed, from the committed ``results/stabiliser_cost`` runs
    (``benchmarks/stabiliser_cost.py``: every row built as ``lpfa.train`` builds it, timed alone on one idle GPU), each
    row from the latest run that timed it (a run may time only some rows; a row's ratio is always to its base of the
    same run): a DataFrame indexed by row label with ``tokens/s``, ``speed base`` (the row it is divided by),
    ``÷ base``, ``heads clipped`` (QK-clip's rescales; None without QK-clip), ``run`` (the run folder), ``backend``
    and ``base backend`` (the ``attn_backend`` of the row and of its base in that run: ``lpfa`` unless it names
    another), ``cap row max raw`` (under a soft-cap, whether the timed forward took its row max from the raw
    Q Kᵀ; None where the run did not record it), rows in the order first timed (the reruns, their base runs again,
    are not timed). Empty without a committed run; a row that no run timed but one tried has no tokens/s."""
    columns = ["tokens/s", "speed base", "÷ base", "heads clipped", "run", "backend", "base backend",
               "cap row max raw"]

    def backend(r):
        return next((o.split("=", 1)[1] for o in (r or {}).get("overrides", []) if o.startswith("attn_backend=")),
                    "lpfa")

    try:
        folders = [f for f in launches("stabiliser_cost", root)
                   if (f / "summary.json").is_file() and (f / "provenance.json").is_file()]
    except FileNotFoundError:
        folders = []
    rows = {}
    for folder in folders:  # oldest first: a later timing of a row replaces an earlier one
        summary = json.loads((folder / "summary.json").read_text())
        for label, r in summary.items():
            if r.get("tokens_per_s") is not None or label not in rows:
                base = summary.get(r.get("speed_base")) if r.get("speed_base") else None
                rows[label] = [r.get("tokens_per_s"), r.get("speed_base"), r.get("ratio_to_base"),
                               r.get("qk_clipped"), folder.name, backend(r), backend(base) if base else None,
                               r.get("softcap_row_max_raw")]
    return pd.DataFrame(list(rows.values()), index=list(rows), columns=columns)


def stabiliser_cost_text(costs) -> str:
    """:func:`stabiliser_costs` in sentences: the speed of the BF16 stabiliser rows (and SFA) as a fraction of their
    base's, slowest first, then their FP32 twins'; for scale, what FP32 attention, Muon and eager mode cost the BF16
    run (a row whose attention ran on another backend than its base's is said to be a ratio of two backends); whether
    QK-clip rescaled any head while it was timed; what bounds the soft-cap's cost where it exceeds
    :data:`SOFTCAP_GOAL`; how far any row measured above a base of its own backend (the timing's noise: a stabiliser
    only adds work); which run each row comes from, where they come from several; and the rows not timed."""
    if costs.empty:
        return "No speed benchmark of the stabilisers is committed yet (`benchmarks/stabiliser_cost.py`)."
    timed = costs.dropna(subset=["÷ base"])
    rows = timed.loc[[label for label in timed.index if label in STABILISERS and label not in BASES
                      or label == "sfa_paper_recipe"]].sort_values("÷ base")

    def other_backend(label) -> bool:  # its attention ran on other kernels than its base's: a ratio of two backends
        base = costs.loc[label, "base backend"]
        return not pd.isna(base) and base != costs.loc[label, "backend"]

    def listed(labels):
        return ", ".join(f"`{label}` ×{rows.loc[label, '÷ base']:.2f}"
                         + ("" if rows.loc[label, "speed base"].endswith("_paper_recipe")
                            else f" (of `{rows.loc[label, 'speed base']}`)")
                         + (f" (its attention on {costs.loc[label, 'backend']}'s kernels, its base's on "
                            f"{costs.loc[label, 'base backend']}'s)" if other_backend(label) else "")
                         for label in labels)

    bf16 = [label for label in rows.index if not label.startswith("fp32")]
    fp32 = [label for label in rows.index if label.startswith("fp32")]
    text = (f"Alone on one idle GPU, at the recipe's batch and compiled unless the row runs eager, the BF16 "
            f"stabilisers train at {listed(bf16)} of the BF16 run's tokens/s"
            + (f", their FP32 twins at {listed(fp32)} of the FP32 run's" if fp32 else "") + ".")
    scale = [f"{what} at ×{timed.loc[label, '÷ base']:.2f}" for label, what in (
        ("fp32_paper_recipe", "FP32 attention runs"), ("bf16_muon_recipe", "Muon in place of AdamW"),
        ("bf16_eager", "the BF16 run eager")) if label in timed.index]
    if scale:
        text += " For scale: " + and_join(scale) + " of the BF16 run's speed."
    clipped = costs["heads clipped"].dropna()
    if len(clipped) and not clipped.astype(float).any():
        text += (" QK-clip rescaled no head in the timed steps (random tokens, from initialisation), so its "
                 "cost here is the tracking of the largest logits and the check.")
    cap = "bf16_softcap"
    if cap in timed.index and float(timed.loc[cap, "÷ base"]) < 1 - SOFTCAP_GOAL:
        flag = timed.loc[cap, "cap row max raw"]
        raw = isinstance(flag, (bool, np.bool_)) and bool(flag)
        text += (f" The soft-cap costs {1 - float(timed.loc[cap, '÷ base']):.0%} of the BF16 run's speed, above "
                 f"its goal of {SOFTCAP_GOAL:.0%}. What bounds it is arithmetic per score: c·tanh(S/c) takes an "
                 "exp2, an FP32 division and three more roundings, "
                 + ("in the forward's P̄ pass (its row-max pass over a 512-key block takes the raw Q Kᵀ and caps "
                    "only each row's largest value, as the cap never decreases on BF16 scores)" if raw else
                    "in both passes of the forward over a 512-key block (the timing predates the row-max pass that "
                    "takes the raw Q Kᵀ under the cap and caps only each row's largest value: "
                    "`lpfa.attention.triton_fwd.raw_row_max`)")
                 + " and again in both backward kernels; and the cap keeps a power-of-two scale from folding into "
                 "exp's argument, since its tanh takes every score scaled.")
    same = [label for label in timed.index if not other_backend(label)]  # a stabiliser only adds work to its base
    over = float(timed.loc[same, "÷ base"].max()) - 1 if same else 0.0
    if over > 0:
        text += (f" One timing per row: `{timed.loc[same, '÷ base'].astype(float).idxmax()}` measured "
                 f"×{1 + over:.3f} of its base, so differences of about {100 * over:.0f} % or less are within the "
                 "noise.")
    runs = costs.dropna(subset=["tokens/s"]).groupby("run", sort=False).groups
    if len(runs) > 1:  # rows of several benchmark runs, each ratio within its own run (and GPU)
        text += " The rows come from " + and_join(
            [f"`{run}` ({_ticked(list(labels))})" for run, labels in runs.items()]) + ", each divided by its base of " \
            "the same run."
    untimed = untimed_stabilisers(costs)
    if untimed:
        text += f" Not timed: {_ticked(untimed)}."
    return text


SOFTCAP_GOAL = 0.10  # the speed the soft-cap may cost: at most 10 % of its base's tokens/s


def untimed_stabilisers(costs) -> list[str]:
    """The stabiliser rows (seed 1337, no base) that the committed speed benchmark has no timing of."""
    return [label for label in STABILISERS
            if label not in BASES and stabiliser_seed(label)[1] is None and label not in costs.index]


# steps per row: the survival count's horizon (lpfa.pages.loss_explosion.HORIZON), past most committed BF16 explosions
STABILISER_STEPS = 6000


def _speed_key(attn_policy: str, compile_: bool, optimizer: str = "adamw") -> str:
    """What sets a stabiliser row's speed on a shared H200: FP32-level attention or not
    (:func:`lpfa.run.attention_precision` of the policy, which sets a soft-cap aside), compiled or eager, and the
    optimizer where it is not AdamW (Muon's orthogonalisation costs time)."""
    fp32 = attention_precision("lpfa", get_policy(attn_policy)) == "fp32"
    return (f"{'FP32' if fp32 else 'BF16'}, {'compiled' if compile_ else 'eager'}"
            + ("" if optimizer == "adamw" else f", {optimizer}"))


def stabiliser_speeds(root=None):
    """Tokens/s of each committed stabiliser run while it shared one H200 with others: its steps × tokens per step over
    its wall time (compilation, evaluations and checkpoints included), from the launches on one H200 (their
    ``provenance.json``'s ``device``; an H100's runs would mix two GPUs' speeds) with the most runs. Returns
    ``(speeds, sharing)``:
    ``{key: (tokens/s, run label)}`` per :func:`_speed_key` (the latest run of that key) and the number of runs those
    launches shared the GPU between. ``({}, 0)`` without such a launch."""
    try:
        folders = [f for f in launches("stabilisers", root)
                   if gpu_name(json.loads((f / "provenance.json").read_text()).get("device", "")) == "H200"]
    except FileNotFoundError:
        return {}, 0
    by_launch = {f: [Run(d) for d in sorted(f.iterdir()) if (d / "summary.json").is_file()] for f in folders}
    sharing = max((len(r) for r in by_launch.values()), default=0)
    speeds = {}
    for runs in by_launch.values():  # oldest first: a later run of the same key replaces an earlier one
        if len(runs) == sharing:
            for r in runs:
                key = _speed_key(r.train["attn_policy"], r.train["compile"], r.train.get("optimizer", "adamw"))
                tokens = r.summary["steps"] * r.train["batch_size"] * r.train["block_size"]
                speeds[key] = (tokens / r.summary["wall_s"], r.path.name)
    return speeds, sharing


def alone_overhead(root=None) -> tuple[float, str] | None:
    """Seconds that a compiled run of the recipe with the GPU to itself spends outside its steps (compilation,
    evaluations, the final stop): its ``wall_s`` less its steps at their median ``step_s``
    (:func:`lpfa.scaling.run_price`), from the latest committed ``paper_recipe`` launch of a single run. Returns
    ``(seconds, "<launch>/<run>")``, or None without such a launch."""
    try:
        folders = launches("paper_recipe", root)
    except FileNotFoundError:
        return None
    for folder in reversed(folders):  # newest first
        runs = [d for d in sorted(folder.iterdir()) if (d / "summary.json").is_file()]
        run = Run(runs[0]) if len(runs) == 1 else None
        if run is None or not run.train.get("compile"):
            continue
        price, summary = run_price(runs[0]), run.summary
        return summary["wall_s"] - summary["steps"] * price["step_s"], f"{folder.name}/{runs[0].name}"
    return None


def finish_overhead(root=None) -> tuple[float, int, int] | None:
    """Seconds that a row's finish takes after its training: ``lpfa doctor`` on its checkpoint, then
    ``python -m lpfa.replay`` from it (scripts/gpu/paper_recipe.sh's ``DOCTOR_STEP`` and ``REPLAY_STEPS``), from the
    run's clock stopping (its launch's ``started`` plus its ``wall_s``) to the replay writing its ``replay.json`` (its
    provenance's ``date_utc``), in the committed ``stabilisers`` and ``paper_recipe`` runs and their ``rerun_*/``
    folders that carry both, each with its launch's ``launch.json`` beside it or one folder up. Returns
    ``(median seconds, runs, replay steps of the latest)``, or None without such a run."""
    found = []  # (replay date, seconds, replay steps)
    for experiment in ("stabilisers", "paper_recipe"):
        try:
            folders = launches(experiment, root)
        except FileNotFoundError:
            continue
        for folder in folders:
            for run_dir in sorted(d for d in folder.iterdir() if d.is_dir()):
                for d in (run_dir, *sorted(run_dir.glob("rerun_*"))):
                    launch = next((f for f in (d / "launch.json", d.parent / "launch.json") if f.is_file()), None)
                    if launch is None or not (d / "summary.json").is_file():
                        continue
                    run = Run(d)
                    replays = {step: r for step, r in run.replays.items() if r["source"].startswith("replay_step_")}
                    started = json.loads(launch.read_text())["runs"].get(run_dir.name, {}).get("started")
                    if not replays or started is None or not run.doctor_reports:
                        continue
                    rep = replays[max(replays)]
                    done = pd.Timestamp(rep["provenance"]["date_utc"]).timestamp()
                    found.append((done, done - started - run.summary["wall_s"], len(rep["per_step"])))
    if not found:
        return None
    return float(np.median([x[1] for x in found])), len(found), max(found)[2]


def stabiliser_plan(pending: list[str], root=None) -> str:
    """What the ``pending`` stabiliser rows cost to run, one at a time: :data:`STABILISER_STEPS` steps at the recipe's
    batch, each at its speed alone on one GPU (:func:`stabiliser_costs`; a second seed at its row's) plus the time a
    run alone spends outside its steps (:func:`alone_overhead`) and its doctor and replay (:func:`finish_overhead`).
    The lead says whether the runs sharing one H200 (:func:`stabiliser_speeds`: how many, and their speeds) trained
    faster together than one alone, both sides counted with the first overhead over the same steps ("no faster" below
    5%). Empty without the recipe's BF16 run or a speed benchmark."""
    if not pending:
        return "Every stabiliser row is committed."
    base = experiment_rows("paper_recipe", ["bf16_paper_recipe"], root=root)
    alone = stabiliser_costs(root)["tokens/s"].dropna().to_dict()
    if not base or not alone:
        return ""
    bf16 = Run(base["bf16_paper_recipe"]).train
    tokens = STABILISER_STEPS * bf16["batch_size"] * bf16["block_size"]
    extra = alone_overhead(root)
    overhead = extra[0] if extra else 0.0
    finish = finish_overhead(root)

    def minutes(label) -> float | None:
        tps = alone.get(stabiliser_seed(label)[0])
        return None if tps is None else (tokens / tps + overhead + (finish[0] if finish else 0.0)) / 60

    timed = {label: m for label in pending if (m := minutes(label)) is not None}
    untimed = [label for label in pending if label not in timed]
    speeds, sharing = stabiliser_speeds(root)
    compared, gains = [], []
    for key, (tps, name) in sorted(speeds.items()):  # like with like: both with compilation and evaluations
        ref = "bf16_paper_recipe" if key.startswith("BF16") else "fp32_paper_recipe"
        if ref in alone and key.endswith("compiled"):
            solo = tokens / (tokens / alone[ref] + overhead)
            gains.append(sharing * tps / solo - 1)
            compared.append(f"{key}: {sharing} × {tps:,.0f} tokens/s (`{name}`) against {solo:,.0f} for "
                            f"`{ref}` alone")
    gain = max(gains, default=None)
    lead = ("" if gain is None else
            f"Runs sharing an H200 ({sharing} at a time) trained "
            f"{'no faster' if gain < 0.05 else f'up to {gain:.0%} faster'} together than one alone, each counted over "
            f"{STABILISER_STEPS:,} steps with compilation and evaluations ("
            + "; ".join(compared) + "). ")
    return (lead + "Alone on one GPU, at each row's speed there (`benchmarks/stabiliser_cost.py`)"
            + (f", the {overhead:.0f} s that a run alone spends outside its steps (compilation, evaluations, the "
               f"stop: `{extra[1]}`)" if extra else "")
            + (f" and the {finish[0]:.0f} s that its finish takes (the median of {finish[1]} committed "
               f"{plural(finish[1], 'run')}: `lpfa doctor` and a {finish[2]:,}-step replay)" if finish else "")
            + f", {STABILISER_STEPS:,} steps at batch {bf16['batch_size']} take "
            + ", ".join(f"`{label}` {m:.1f} min" for label, m in timed.items())
            + (f": {sum(timed.values()):.0f} GPU-minutes in all" if timed else "")
            + (f"; {_ticked(untimed)} not timed alone" if untimed else "")
            + ". `lpfa doctor` examines each run's last checkpoint at or before step 5,000 and before its "
            "explosion, for the δ-bias and similarity links, and the replay continues the training from it with one "
            f"layer instrumented, for Fig. 5's test of the δ bias ({RERUN_PAGE} gives the commands).")


def pending_text(pending: list[str], root=None) -> str:
    """The stabiliser rows not committed yet, named in bold, then :func:`stabiliser_plan` for them."""
    return (f"**Not run yet:** {_ticked(pending)}. " if pending else "") + stabiliser_plan(pending, root)


KEPT = 0.8  # an accumulation of at least this × √steps: the error kept its value over the steps (at most 1)


SR_POLICIES = {"paper": "paper", "paper_sr": "paper_sr", "paper_sr reseeded": "paper_sr", "o_fp32": "o_fp32",
               "scores_fp32": "scores_fp32", "paper_sr_scores": "paper_sr_scores"}
"""error_persistence's rows on page 17: stochastic rounding on O's path (one seed, reseeded), O's path or the scores in
FP32, and stochastic rounding of the scores alone (the ``sr_scores`` stabiliser row's policy)."""


def sr_persistence(sequences: int = 1, steps: int = 8, rel: float = 1e-3, root=None):
    """Page 17's look at why stochastic rounding did not help: :func:`lpfa.mechanism.error_persistence` of
    :data:`SR_POLICIES` (``paper_sr reseeded``: a new seed each step) on the first ``sequences`` of the layer's q, k, v,
    dO that the latest kernel-bias audit captured (``results/kernel_bias/<run>/<name>/qkv.npz``, a BF16 run before or
    in its logit runaway). Returns ``(table, text, meta)``: per policy the worst head's mean g (the head with the
    largest |mean g| under ``paper``), it over ``paper``'s, and its accumulation; ``text`` the finding in words;
    ``meta`` the capture's. ``(None, reason, None)`` without a capture."""
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
            f"({meta['policy']}; {sequences} {plural(sequences, 'sequence')}), drifted over {steps} steps by "
            f"{rel:g} per step, head {worst[1]} carries the largest δ error (Σ_T δ_lp − δ_hp = {ref:.2e} under "
            f"`paper`). Stochastic rounding leaves {r['paper_sr']:.2f}× of it with one seed and "
            f"{r['paper_sr reseeded']:.2f}× reseeded each step, with accumulations "
            f"{table.loc['paper_sr', 'its accumulation']:.2f} and "
            f"{table.loc['paper_sr reseeded', 'its accumulation']:.2f} of at most √{steps} = {math.sqrt(steps):.2f}: "
            + ("it keeps its sign either way" if kept else "it does not keep its value from step to step") + ". "
            f"O's path in FP32 (`o_fp32`) leaves {r['o_fp32']:.2f}×, FP32 scores (`scores_fp32`) "
            f"{r['scores_fp32']:.3f}×: here the error comes from rounding S to BF16, a rounding point that SR at O's "
            "path does not touch." if abs(r["scores_fp32"]) < 0.1 and abs(r["paper_sr"]) > 0.5 else
            f"Stochastic rounding leaves {r['paper_sr']:.2f}× of the worst head's δ error with one seed and "
            f"{r['paper_sr reseeded']:.2f}× reseeded; FP32 scores leave {r['scores_fp32']:.3f}×.")
    acc = table["its accumulation"]
    med = table["median accumulation over heads"]
    text += (f" Rounding the scores stochastically instead (`paper_sr_scores`, the `sr_scores` row's policy) leaves "
             f"{r['paper_sr_scores']:.2f}× of that head's error, with accumulation {acc['paper_sr_scores']:.2f}: "
             + ("it still keeps its sign" if acc["paper_sr_scores"] >= KEPT * math.sqrt(steps) else
                "in that head the error no longer keeps its value from step to step")
             + f"; over all heads the median accumulation is {med['paper_sr_scores']:.2f}, against `paper`'s "
             f"{med['paper']:.2f}.")
    return table, text, meta


def _link_ratios(row) -> str:
    """A :func:`stabiliser_table` row's logged links as ratios to the BF16 run's, as page 17's sentences give them."""
    return f"ties ×{row['ties ÷ bf16']:.2f}, largest logit ×{row['logit ÷ bf16']:.2g}, W_Q ×{row['W_Q ÷ bf16']:.2f}"


# nats: an eval loss within LOSS_MATCH of the FP32 twin's matches it; ten times the spread of two FP32 runs of one seed,
# the `eval loss − twin` of `fp32_rerun` (the FP32 run again, against `fp32_paper_recipe`) in page 17's table
LOSS_MATCH = 0.05


def _loss_fate(row) -> str:
    """A :func:`stabiliser_table` row's loss in words: where it exploded, or that it did not explode and its eval loss
    against its FP32 twin's (a row can end far above its twin without exploding)."""
    if row["exploded"]:
        return f"its loss exploded at step {row['explosion step']:,}"
    gap = row["eval loss − twin"]
    if row["FP32 twin"] == row.name or gap != gap:
        return f"its loss did not explode in {row['steps']:,} steps"
    return (f"its loss did not explode in {row['steps']:,} steps, its eval loss {gap:+.2f} against "
            f"`{row['FP32 twin']}`'s at step {row['gap step']:,}")


# A row keeps the ties when its largest per-head tie fraction is above half the BF16 run's (ratio ``ties ÷ bf16``)
TIES_KEPT = 0.5


def _failure(row) -> str:
    """Why a :func:`stabiliser_table` row does not meet the page's criterion, in the book's vocabulary: its loss
    exploded, or its logits ran away, or neither but its eval loss ended more than :data:`LOSS_MATCH` from its FP32
    twin's; ``""`` when it meets it (neither, and within :data:`LOSS_MATCH`)."""
    if row["exploded"]:
        return f"its loss exploded (step {row['explosion step']:,})"
    what = []
    if row["runaway step"] is not None:
        what.append(f"its logits ran away (layer {row['runaway layer']}, from step {row['runaway step']:,})")
    gap = row["eval loss − twin"]
    if gap == gap and abs(gap) > LOSS_MATCH:
        what.append(f"its eval loss ended {abs(gap):.2f} {'above' if gap > 0 else 'below'} its FP32 twin's")
    return " and ".join(what)


# The paper's Discussion on why stabilisers work (no experiment there): the link each one is said to break
PAPER_CLAIMS = {"qknorm": ("rank-1 similarity",
                           "QK-norm works because it disrupts the structural similarity of (PK)[T]ᵀX[T]"),
                "gated": ("rank-1 similarity", "gated attention works because it disrupts that structural similarity"),
                "qkclip": ("ties", "QK-clipping works by making P̄ = 1 rarer")}


def _claim_verdict(broken, failure: str) -> str:
    """One :data:`PAPER_CLAIMS` claim judged on one BF16 row: whether the row breaks the claimed link (``broken``:
    True, False or None when unmeasured) and whether it holds (``failure`` is ``""``, from :func:`_failure`). The claim
    is "this stabiliser works because it breaks this link", so it stands only when the row does both; a row that fails
    is against it whether or not its link is measured."""
    if broken is None and not failure:
        return "not judged: the link is not measured on this row"
    if broken is None:
        return (f"**against the claim**: {failure}, so the stabiliser did not work here (the link is not measured on "
                "this row)")
    if broken and not failure:
        return ("consistent with the claim: the row breaks the link, and neither its loss exploded nor its logits "
                "ran away")
    if not failure:
        return ("**against the claim**: the row keeps the link, yet neither its loss exploded nor its logits ran "
                "away, so the link is not what decides here")
    if broken:
        return (f"**against the claim**: the row breaks the link, yet {failure}, so breaking the link is not enough "
                "here")
    return (f"**against the claim**: the row leaves the link intact and {failure}: in this run the stabiliser "
            "neither broke the link nor met the page's criterion")


def _stands(broken, holds: bool) -> bool | None:
    """Whether a :data:`PAPER_CLAIMS` claim stands on one row (:func:`_claim_verdict`): True when the row breaks the
    link and holds, False when it keeps the link or fails, None when it holds and its link is not measured."""
    if not holds:
        return False
    return None if broken is None else bool(broken)


def paper_claims(table) -> list[dict]:
    """The paper's Discussion (:data:`PAPER_CLAIMS`) judged on each committed BF16 stabiliser row of
    :func:`stabiliser_table` at every committed seed (how a link is measured and counts as broken: the module
    docstring). Per claim: ``who`` (the stabiliser), ``label`` and ``labels`` (its rows), ``per`` (each row's
    :func:`_claim_on`), ``judged`` (some seed decides it: :func:`_stands` is not None there), ``stands`` (it stands at
    every seed that decides it; None when none does), ``seed_dependent`` (it stands at one seed and not at another),
    ``holds`` (no row fails), ``short`` (the link at each seed in a few words), ``outcome`` and ``item`` (the claim,
    each row's links and fate, its FP32 twin and the verdict, as a MyST list item)."""
    if table.empty:
        return []
    claims = []
    for name, (link, claim) in PAPER_CLAIMS.items():
        labels = [label for label in (f"bf16_{name}", *(f"bf16_{name}_s{s}" for s in STABILISER_SEEDS))
                  if label in table.index]  # the row at each committed seed
        per = [_claim_on(table, label, name, link) for label in labels]
        if not per:
            continue
        one = len(per) == 1
        decided = {c["stands"] for c in per if c["stands"] is not None}
        dependent = len(decided) > 1
        each = "; ".join(f"at seed {c['seed']}, {c['verdict']}" for c in per)
        if one or len({c["verdict"] for c in per}) == 1:  # one verdict, at every seed
            verdict = per[0]["verdict"] + ("" if one else f" (at {len(per)} seeds)")
        else:
            verdict = f"**seed-dependent**: {each}" if dependent else each
        claims.append({"who": claim.split(" works")[0], "label": per[0]["label"], "labels": labels,
                       "per": per, "judged": bool(decided), "stands": decided == {True} if decided else None,
                       "holds": all(c["holds"] for c in per), "seed_dependent": dependent,
                       "short": per[0]["short"] if one else "; ".join(f"seed {c['seed']}: {c['short']}" for c in per),
                       "outcome": per[0]["outcome"] if one else "; ".join(f"seed {c['seed']}: {c['outcome']}"
                                                                          for c in per),
                       "item": f"- The paper says {claim}. " + " ".join(c["said"] for c in per)
                               + f" Verdict: {verdict}."})
    return claims


def similarity_reference(table, mode: str, seed: int | None) -> str | None:
    """The run whose doctor's rank-1 similarity a BF16 stabiliser row at ``seed`` (None: the default seed) is held
    against on page 17: the ``mode`` (``"bf16"`` or ``"fp32"``) recipe run of that seed,
    ``<mode>_paper_recipe_s<seed>``, when :func:`stabiliser_table` has its similarity, else the default seed's run
    again (:data:`STABILISER_RERUN`, :data:`FP32_RERUN`); None when neither is measured."""
    own = f"{mode}_paper_recipe_s{seed}" if seed is not None else None
    for label in (own, RERUN_OF[mode]):
        if label in table.index and table.loc[label].get("rank-1 similarity") is not None:
            return label
    return None


def _claim_on(table, label: str, name: str, link: str) -> dict:
    """One :data:`PAPER_CLAIMS` claim measured on one BF16 row ``label`` of :func:`stabiliser_table` (see
    :func:`paper_claims`): its seed, ``broken``, ``holds``, ``short``, ``said`` (the row's links and fate, its FP32
    twin) and ``verdict`` (:func:`_claim_verdict`). The similarity is held against the BF16 and FP32 runs of the
    row's seed where they were measured (:func:`similarity_reference`); a run of another seed says its seed."""
    r = table.loc[label]
    fate = _loss_fate(r) + (
        f", its layer-{r['runaway layer']} logits running away from step {r['runaway step']:,}"
        if r["runaway step"] is not None else "")
    ratios = _link_ratios(r)
    sim = r.get("rank-1 similarity")
    seed = stabiliser_seed(label)[1]
    bf16_ref, fp32_ref = (similarity_reference(table, mode, seed) for mode in ("bf16", "fp32"))

    def other_seed(ref) -> str:  # ", seed S" when the reference run's seed is not the row's
        return f", seed {int(table.loc[ref, 'seed'])}" if int(table.loc[ref, "seed"]) != int(r["seed"]) else ""

    def named(ref):  # a reference run by name, its doctor's step, and its seed when it is not the row's
        return f"`{ref}` at step {table.loc[ref, 'doctor step']:,}{other_seed(ref)}"

    fp32_sim = table.loc[fp32_ref, "rank-1 similarity"] if fp32_ref else None
    if sim is not None and bf16_ref is not None:
        base = table.loc[bf16_ref, "rank-1 similarity"]
        similarity = (f"rank-1 similarity {sim:.3f} against the BF16 run's {base:.3f} ({named(bf16_ref)}; "
                      f"×{sim / base:.2f})"
                      + (f" and the FP32 run's {fp32_sim:.3f} ({named(fp32_ref)})" if fp32_sim is not None else ""))
    else:
        similarity = "rank-1 similarity not measured (no doctor report)"
    twin = f"fp32_{name}" + (f"_s{seed}" if seed is not None else "")
    twin_sim = table.loc[twin].get("rank-1 similarity") if twin in table.index else None
    if twin_sim is not None:
        twin_text = f" Its FP32 twin `{twin}`: rank-1 similarity {twin_sim:.3f}."
    else:  # the stabiliser changes the model: its own FP32 twin says what it does to the similarity without BF16
        twin_text = f" Its FP32 twin `{twin}` has no committed doctor report."
    if link == "rank-1 similarity":
        said = similarity + "; " + ratios
        # the reference without BF16 attention: the row's own FP32 twin where measured, else the plain FP32 run
        if twin_sim is not None:
            ref, ref_name = twin_sim, "its FP32 twin's"
        else:
            ref = fp32_sim
            ref_name = (f"the seed-{int(table.loc[fp32_ref, 'seed'])} FP32 run's" if fp32_ref and other_seed(fp32_ref)
                        else "the FP32 run's")
        broken = None if sim is None or ref is None else bool(sim <= ref)
        margin = None if broken is None else abs(float(sim) - float(ref))
        short = (f"{'breaks' if broken else 'keeps'} the link ({sim:.3f} against {ref_name} {ref:.3f})"
                 if broken is not None else "the link not measured")
    else:
        said = ratios + "; " + similarity
        margin, ref_name = None, None
        broken = bool(r["ties ÷ bf16"] <= TIES_KEPT)
        short = f"{'breaks' if broken else 'keeps'} the link ({r['ties ÷ bf16']:.2f}× the BF16 run's ties)"
    failure = _failure(r)
    return {"label": label, "seed": int(r["seed"]), "broken": broken, "margin": margin, "reference": ref_name,
            "holds": not failure,
            "stands": _stands(broken, not failure), "short": short,
            "outcome": outcome(r["exploded"], r["runaway step"])
            + (f", {failure}" if failure and not r["exploded"] and r["runaway step"] is None else ""),
            "said": f"`{label}` ({fate}): {said}.{twin_text}", "verdict": _claim_verdict(broken, failure)}


def paper_claims_lead(claims: list[dict], evidence: str = "") -> str:
    """:func:`paper_claims` in one sentence (plain text): how many of the judged explanations stand (at every seed that
    decides them, the row breaks the link and holds), on what ``evidence`` (:func:`seed_evidence`), then each one's
    link and fate."""
    judged = [c for c in claims if c["judged"]]
    stand = [c for c in judged if c["stands"]]
    return (f"{len(stand)} of the paper's {len(judged)} explanations measured here "
            + ("fits its run" if len(stand) == 1 else "fit their runs")
            + (f" ({evidence})" if evidence else "")
            + "".join(f"; {c['who']}: seed-dependent ({c['short']})" if c["seed_dependent"] else
                      f"; {c['who']}: {c['short']}; outcome: {c['outcome']}" for c in judged) + ".")


def unmeasured_text(table) -> str:
    """The committed BF16 rows on which a claim of the paper's Discussion stays unjudged (:func:`paper_claims`: the row
    holds, and the link the claim names, the doctor's rank-1 similarity, is not measured on it), and how to measure
    it: the row again to the doctor's step with a checkpoint, kept in its ``rerun_*/`` folder
    (:attr:`lpfa.run.Run.doctor_reports` reads it there). ``""`` when every committed row decides its claim."""
    rows = [c["label"] for claim in paper_claims(table) for c in claim["per"] if c["stands"] is None]
    if not rows:
        return ""
    return (f"**Committed without the link their claim needs:** {_ticked(rows)} held but "
            + ("carries" if len(rows) == 1 else "carry") + " no doctor report, so the paper's explanation is not "
            f"judged on {'it' if len(rows) == 1 else 'them'}; the same row again to step {RERUN_STOP:,} with "
            f"`DOCTOR_STEP`, kept in the row's `rerun_*/` folder, measures it ({RERUN_PAGE} gives the commands).")


def paper_claims_text(table) -> str:
    """Page 17's test of the paper's Discussion: :func:`paper_claims_lead` in bold, then each claim's item from
    :func:`paper_claims` (block MyST: a list), then :func:`similarity_spread_text`."""
    claims = paper_claims(table)
    if not claims:
        return "None of QK-norm, gated attention and QK-clip is committed yet."
    evidence = seed_evidence(table, [label for c in claims if c["judged"] for label in c["labels"]])
    spread = similarity_spread_text(table, claims)
    return (f"**{paper_claims_lead(claims, evidence)}**\n\n" + "\n".join(c["item"] for c in claims)
            + (f"\n\n{spread}" if spread else ""))


def similarity_spread(table) -> list[tuple[str, str, float]]:
    """How far the doctor's rank-1 similarity moves with the seed alone: ``(label, other, |difference|)`` for each pair
    of rows of :func:`stabiliser_table` that both carry it at the same doctor step and differ only in data order and
    init, a seeded row and its seed-1337 row (``bf16_qknorm_s1``, ``bf16_qknorm``), or a seed's recipe run and seed
    1337's run again (``bf16_paper_recipe_s1``, :data:`STABILISER_RERUN`; FP32 likewise)."""
    def sim(label):
        return table.loc[label].get("rank-1 similarity") if label in table.index else None

    pairs = []
    for label in table.index:
        if (seed := seed_base_of(label)) is not None:
            other = RERUN_OF[label.split("_")[0]]
        else:
            other, seed = stabiliser_seed(label)
        if seed is not None and sim(label) is not None and sim(other) is not None \
                and table.loc[label, "doctor step"] == table.loc[other, "doctor step"]:
            pairs.append((label, other, abs(float(sim(label)) - float(sim(other)))))
    return pairs


def similarity_spread_text(table, claims: list[dict]) -> str:
    """The seed spread of the similarity (:func:`similarity_spread`) against the margins by which the judged
    similarity claims (:func:`paper_claims`) fell on either side of their reference: which margins are smaller than the
    spread, so that a second seed could turn them. ``""`` without a pair of seeds."""
    pairs = similarity_spread(table)
    if not pairs:
        return ""
    spread = max(d for _, _, d in pairs)
    close = []
    for c in claims:
        for p in c["per"]:  # (a margin only where the claim's link is the similarity)
            if p["margin"] is not None and p["margin"] < spread:
                close.append(f"`{p['label']}` ({p['margin']:.3f} from {p['reference']})")
    return ("The rank-1 similarity moves with the seed alone: at the same step, "
            + "; ".join(f"`{a}` and `{b}` differ by {d:.3f}" for a, b, d in pairs)
            + (f". A row within {spread:.3f} of its reference is within that spread, so its link verdict could turn "
               f"with the seed: {and_join(close)}." if close else
               f". Every similarity verdict above clears its reference by more than {spread:.3f}."))


def seed_evidence(table, labels) -> str:
    """What a verdict on the rows ``labels`` of :func:`stabiliser_table` rests on: "one run each, at seed 1337". A row
    is one run, and the plain BF16 recipe run's fate changes with the seed (page 06's survival curve), so a verdict
    from one seed is one observation, not a property of the stabiliser."""
    seeds = sorted({int(table.loc[label, "seed"]) for label in labels if label in table.index})
    if not seeds:
        return ""
    return f"one run each, at {plural(len(seeds), 'seed')} {', '.join(map(str, seeds))}"


def stabiliser_finding(table, layer: int = 1) -> str:
    """Page 17's finding in one bold sentence, from :func:`stabiliser_table`: which committed BF16 stabiliser rows
    hold (no logit runaway, loss not exploded and within :data:`LOSS_MATCH` of the FP32 twin's) and how each other one
    fails. Without the BF16 run of the recipe, says so."""
    if table.empty:
        return NOTHING_YET
    bf16 = [label for label in STABILISERS if label in table.index and label not in BASES
            and table.loc[label, f"layer {layer} scores"] != "fp32"]
    if not bf16:
        return "**No BF16 stabiliser row is committed yet.**"

    fails = {label: f"`{label}`: {f}" if (f := _failure(table.loc[label])) else "" for label in bf16}
    held = [label for label, f in fails.items() if not f]
    twinless = [label for label in held if table.loc[label, "FP32 twin"].startswith("fp32_paper_recipe")
                and label.startswith("bf16_")]  # its own FP32 twin not committed: the plain FP32 run of its seed
    by_row: dict[str, list[str]] = {}  # a stabiliser's runs at each seed
    for label in bf16:
        by_row.setdefault(stabiliser_seed(label)[0], []).append(label)

    def seeds(labels):
        return ", ".join(str(int(table.loc[label, "seed"])) for label in labels)

    dependent = [f"; seed-dependent: `{row}` meets it at seed {seeds([x for x in runs if x in held])} and not at "
                 f"seed {seeds([x for x in runs if x not in held])}"
                 for row, runs in by_row.items() if 0 < sum(x in held for x in runs) < len(runs)]
    return (f"**At the paper's recipe, {len(held)} of the {len(bf16)} committed BF16 stabiliser rows "
            + f"({'; '.join(x for x in (seed_evidence(table, bf16), _ticked(held)) if x)}) "
            + ("meets" if len(held) == 1 else "meet")
            + f" the criterion: neither the loss exploded nor the logits ran away, and the eval loss ended within "
            f"{LOSS_MATCH:g} of the FP32 twin's"
            + (f" (for {_ticked(twinless)} the plain FP32 run's of the same seed: "
               + ("its own twin is" if len(twinless) == 1 else "their own twins are") + " not committed)"
               if twinless else "")
            + "".join(f"; {f}" for f in fails.values() if f) + "".join(dependent) + ".**")


def _rerun_of(table, label: str) -> str:
    """`` (the run again, `<rerun folder>/`)`` when the doctor's checkpoint of ``label`` came from a rerun of the run
    (its ``doctor source`` in a ``rerun_*/`` folder: :attr:`lpfa.run.Run.doctor_reports`), else ``""``."""
    source = table.loc[label].get("doctor source") or ""
    return f" (the run again, `{source.split('/')[0]}/`)" if source.startswith("rerun_") else ""


def stabiliser_summary(table, step: int, layer: int = 1) -> str:
    """Page 17's rows in words, after its finding (:func:`stabiliser_finding`), from :func:`stabiliser_table`
    (``table``, compared at ``step``): how many of the :data:`lpfa.experiments.STABILISERS` runs are committed; each
    row's links (ties, largest logit and W_Q as ratios to the BF16 run's, the loss and the runaway); the doctor's
    links; which rows keep at least half of the BF16 run's ties without exploding; and whether the rows without any
    runaway are exactly those whose layer-``layer`` δ does not come from the BF16 O."""
    if table.empty:
        return NOTHING_YET
    rows = [label for label in STABILISERS if label not in RERUNS]  # the Muon bases are runs to make too
    done = [label for label in rows if label in table.index]
    b = table.loc["bf16_paper_recipe"]

    def links(label):
        r = table.loc[label]
        return (f"{_link_ratios(r)}, " + _loss_fate(r)
                + (f", its layer-{r['runaway layer']} logits running away from step {r['runaway step']:,}"
                   if r["runaway step"] is not None else ", no runaway"))

    cuts = [label for label in table.index if str(table.loc[label, "stabiliser"]).startswith("isolation")]
    fates = recipe_fates()
    bf16_fates = fates[fates.precision == "bf16"] if not fates.empty else fates

    def booms(seed) -> list[int]:  # every committed BF16 explosion of the recipe at this seed (page 06's runs)
        return [] if bf16_fates.empty else sorted(
            int(x) for x in bf16_fates.loc[bf16_fates.seed == seed, "explosion step"].dropna())

    def row(label):
        r = table.loc[label]
        first = booms(r["seed"])[:1]
        early = (f"; it exploded {first[0] - r['explosion step']:,} steps before the earliest BF16 run of this seed "
                 f"(step {first[0]:,})" if r["exploded"] and first and r["explosion step"] < first[0] else "")
        at = f" (stopped at step {r['steps']:,}: its last diagnostics record counts)" if r["steps"] <= step else ""
        return f"`{label}` (`{r['stabiliser']}`){at}: {links(label)}{early}."

    rerun = ""
    if STABILISER_RERUN in table.index and table.loc[STABILISER_RERUN, "exploded"] and b["exploded"]:
        seed = table.loc[STABILISER_RERUN, "seed"]
        steps = booms(seed)
        quiet = 0 if bf16_fates.empty else int(((bf16_fates.seed == seed) & ~bf16_fates.exploded).sum())
        rerun = (f" The BF16 run again, same seed and data order (`{STABILISER_RERUN}`), exploded at step "
                 f"{table.loc[STABILISER_RERUN, 'explosion step']:,}. The committed BF16 runs of seed {seed}, which "
                 f"differ only in how their kernels round, exploded at steps {steps[0]:,} to {steps[-1]:,} ("
                 f"{len(steps)} runs" + (f"; {quiet} more had not exploded when they stopped" if quiet else "")
                 + f"): rounding alone moves the explosion by up to {steps[-1] - steps[0]:,} steps, so a stabiliser "
                 "row's step, from one run, is read against that spread.")
    doc = table[table["doctor step"].notna()]
    doctor = ""
    if not doc.empty:
        def fmt(label, col):
            v = doc.loc[label, col]
            return "–" if v is None or v != v else f"{v:.2f}"
        resolved = [label for label in doc.index for col in ("δ |t| paper", "δ |t| own")
                    if doc.loc[label, col] is not None and doc.loc[label, col] >= T_RESOLVED]
        doctor = (f"\n\n**lpfa doctor on layer {layer}**, one checkpoint per row before its explosion:\n\n"
                  + "\n".join(f"- `{label}` at step {int(doc.loc[label, 'doctor step']):,}{_rerun_of(doc, label)}: "
                              "rank-1 similarity "
                              f"{doc.loc[label, 'rank-1 similarity']:.3f}, largest |t| of the δ error "
                              f"{fmt(label, 'δ |t| paper')} (paper)"
                              + (f", {fmt(label, 'δ |t| own')} (its own policy)"
                                 if doc.loc[label, "δ |t| own"] is not None else "") for label in doc.index)
                  + (f"\n\nWith one probe batch of {' or '.join(sorted(set(doc['doctor probe'])))} tokens no |t| "
                     f"reaches {T_RESOLVED:g}: the δ bias is not resolved there." if not resolved else ""))
    doctor += replay_text(table, layer)
    tie_keepers = [label for label in ["sfa_paper_recipe", *cuts, *done] if label in table.index
                   and table.loc[label, "ties ÷ bf16"] > TIES_KEPT and not table.loc[label, "exploded"]]
    keeper_seeds = {int(table.loc[label, "seed"]) for label in tie_keepers}
    calm = [label for label in table.index if table.loc[label, "runaway step"] is None]
    not_bf16_o = {label for label in table.index if table.loc[label, f"layer {layer} δ from"] != "bf16 O"}
    items = ([f"SFA: {links('sfa_paper_recipe')}."] if "sfa_paper_recipe" in table.index else []) + [
        f"`{c.removesuffix('_paper_recipe')}`: {links(c)}." for c in cuts] + [row(label) for label in done]
    return (f"**{len(done)} of the {len(rows)} stabiliser runs are committed"
            + (f" ({_ticked(done)})" if done else "") + ".** "
            + f"At step {step:,}, the last record before the BF16 run's loss explodes (step {b['explosion step']:,}), "
            "each row's links as ratios to the BF16 run's"
            + (" of the row's seed" if table["seed"].nunique() > 1 else "") + ":\n\n"
            + "\n".join(f"- {item}" for item in items)
            + (f"\n\n{rerun.strip()}" if rerun else "") + doctor
            + (f"\n\n**Ties need not go{', in one seed' if len(keeper_seeds) == 1 else ''}:** "
               f"{_ticked(tie_keepers)} keep at least half of the BF16 run's tie fraction and their loss did not "
               f"explode ({seed_evidence(table, tie_keepers)}; how often the BF16 run of this recipe explodes: the "
               "loss-explosion page)." if tie_keepers else "")
            + (f" The rows without any runaway ({_ticked(calm)}) are exactly those whose layer-{layer} δ does not come "
               "from the BF16 O (the `δ from` column: the link after the ties)."
               if calm and set(calm) == not_bf16_o else ""))


def replay_text(table, layer: int = 1) -> str:
    """The δ bias of the rows that carry a replay (:func:`replay_links`), as Fig. 5 tests it: per row the steps
    replayed from which checkpoint, the policy measured, the largest |t| over the replayed heads with that head's sign,
    mean and share from tied rows, and whether it reaches :data:`T_RESOLVED`; ``""`` when no row has one. Block MyST
    (a paragraph and a list), led by two blank lines."""
    rep = table[table["replay steps"].notna()] if "replay steps" in table.columns else table.iloc[:0]
    if rep.empty:
        return ""

    def item(label):
        r = rep.loc[label]
        t = r["δ |t| replay"]
        sign = "positive (the paper's sign)" if r["δ replay sign"] == "+" else "negative"
        share = r["δ replay tied share"]
        size = ("|t| not defined (fewer than two steps or no spread)" if t is None else
                f"largest |t| {t:.1f}, mean δ error {sign}, {r['δ replay mean']:.2g} per step"
                + ("" if share is None else f", {share:.0%} of it from rows with a tied maximum")
                + f", {'resolved' if t >= T_RESOLVED else 'not resolved'}")
        return (f"- `{label}`: {int(r['replay steps']):,} steps from step {int(r['replay step']):,}, the δ error of "
                f"`{r['replay policy']}`: {size}")

    return (f"\n\n**The δ bias by replay** (Fig. 5's test, `lpfa.replay.bias_test`: the row's training replayed "
            f"from its checkpoint with layer {layer} instrumented, the per-step Σ δ_lp − δ_hp of each replayed head; "
            f"resolved at |t| ≥ {T_RESOLVED:g}):\n\n" + "\n".join(item(label) for label in rep.index))


def page_texts(table: pd.DataFrame, step, pending, costs: pd.DataFrame, sr_text: str, layer: int) -> dict:
    """Every sentence and number page 17 glues into its prose, by name: from the stabiliser rows (``table``, ``step``,
    ``pending``: :func:`stabiliser_table`), their costs (:func:`stabiliser_costs`) and the stochastic-rounding check's
    sentence (``sr_text``: :func:`sr_persistence`)."""
    return {"st_finding": stabiliser_finding(table, layer), "st_summary": stabiliser_summary(table, step, layer),
            "st_step": f"{step:,}" if not table.empty else "–", "st_layer": layer,
            "st_full": full_table_text(table) if not table.empty else "",
            "st_cost": stabiliser_cost_text(costs),
            "st_claims": paper_claims_text(table) if not table.empty else "Nothing to compare yet.",
            "st_sr": sr_text,
            "st_pending": " ".join(x for x in (pending_text(pending), unmeasured_text(table) if not table.empty else "")
                                   if x)}
