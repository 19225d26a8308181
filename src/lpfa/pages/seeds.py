"""Page 11, seeds: the spread of the loss explosion and the logit runaway over seeds of data order and initialisation.

The runs are the BF16 and FP32 twins of :data:`lpfa.experiments.SEEDS` and, for seed 1337, the eager twins of the
loss-explosion page and the compiled ``bf16``/``fp32`` rows of the isolation table. Each is judged against the run its
experiment defines for it (:attr:`lpfa.experiments.Row.reference`: the FP32 run of the same seed and settings) by the
outcomes of :func:`lpfa.compare.experiment_table` (the loss exploded, the logits ran away, or neither), with the step
from which layer 1's largest logit stays above 10× the FP32 twin's ("logit apart") measured beside them.
"""

from __future__ import annotations

import pandas as pd

from lpfa.compare import LOGIT_APART, OUTCOMES
from lpfa.experiments import SEEDS
from lpfa.experiments import rows as design_rows
from lpfa.pages import RERUN_PAGE, plural
from lpfa.pages.loss_explosion import fate_counts, recipe_fates
from lpfa.params import integer, optional, real, text
from lpfa.results import experiment_rows, run_dir
from lpfa.results import runs as launches
from lpfa.scaling import committed_speed, wall_minutes
from lpfa.train import PRESETS

# the notebook's papermill parameters, checked right after its parameters cell (lpfa.params.check_params)
PARAMS = {
    "experiment": text(nonempty=True), "run": optional(text(nonempty=True)), "reference": text(nonempty=True),
    "compiled_reference": text(nonempty=True), "layer": integer(0), "logit_ratio": real(0, lo_open=True),
    "planned_steps": integer(1), "gpus": integer(1),
}

SEED_COLUMNS = ["attention", "seed", "compiled", "outcome", LOGIT_APART, "steps", "explosion step", "runaway step",
                "runaway layer", "final eval loss"]  # page 11's table: the columns of experiment_table it shows
SEED_1337 = {"eager": ("twins", "_s1337"), "compiled": ("isolation", "_s1337_compiled")}  # (experiment, label suffix)


def seeds_committed(experiment: str = "seeds", root=None) -> bool:
    """Whether ``results/<experiment>`` holds at least one run folder."""
    try:
        return bool(launches(experiment, root))
    except FileNotFoundError:
        return False


def seed_runs(experiment: str = "seeds", run=None, reference: str = "repro_pair",
              compiled_reference: str = "isolation", root=None) -> tuple[dict, dict]:
    """Page 11's runs and what each is judged against. Returns ``(runs, references)``, both ``{label: run folder}``:
    the ``bf16``/``fp32`` runs of the latest ``reference`` launch (the twins experiment, eager; labels ``_s1337``), the
    committed ``bf16``/``fp32`` rows of ``compiled_reference`` (the isolation experiment; ``_s1337_compiled``) and the
    :data:`lpfa.experiments.SEEDS` rows of ``run`` of ``experiment`` (default the latest, if any), each with its
    :attr:`lpfa.experiments.Row.reference` under the same suffix (a reference row is its own)."""
    pair = run_dir(reference, root=root)
    sources = [(*SEED_1337["eager"], {m: pair / m for m in ("bf16", "fp32")}),
               (*SEED_1337["compiled"], experiment_rows(compiled_reference, ["bf16", "fp32"], root=root))]
    if seeds_committed(experiment, root):
        folder = run_dir(experiment, run, root)
        sources.append(("seeds", "", {label: folder / label for label in SEEDS if (folder / label).is_dir()}))
    runs, twin = {}, {}
    for design, suffix, folders in sources:
        rows = design_rows(design)
        for label, d in folders.items():
            runs[label + suffix] = d
            twin[label + suffix] = (rows[label].reference or label) + suffix
    missing = sorted(f"{ref} (for {label})" for label, ref in twin.items() if ref not in runs)
    if missing:
        raise FileNotFoundError(f"reference runs {', '.join(missing)} are not committed: expected each row's "
                                "lpfa.experiments reference next to it")
    return runs, {label: runs[ref] for label, ref in twin.items()}


def seeds_summary(table, mode=lambda label: label.split("_s")[0]):
    """Per mode (``mode(label)``, default the part before ``_s<seed>``): runs, how many exploded and how many
    ran away (:class:`lpfa.explosion.RunawayCriterion`), the spread of their runaway steps, and the steps run;
    when the table has a :data:`~lpfa.compare.LOGIT_APART` column (:func:`experiment_table` with a reference), also
    how many runs' logits parted from their reference's or ran away, or whose loss exploded (``logit apart or
    worse``), and the spread of the steps where the logits parted."""
    rows = {}
    for m, g in table.groupby([mode(label) for label in table.index]):
        ra = pd.to_numeric(g["runaway step"], errors="coerce").dropna()
        row = {"runs": len(g), "seeds": ", ".join(str(s) for s in g["seed"]), "exploded": int(g["exploded"].sum()),
               "ran away": len(ra), "first runaway": ra.min() if len(ra) else None,
               "median runaway": ra.median() if len(ra) else None, "last runaway": ra.max() if len(ra) else None}
        if LOGIT_APART in g:
            apart = pd.to_numeric(g[LOGIT_APART], errors="coerce")
            worse = apart.notna() | (g["outcome"] != OUTCOMES[2])  # parted, or the logits ran away, or worse
            apart = apart.dropna()
            row.update({"logit apart or worse": int(worse.sum()),
                        "first logit apart": apart.min() if len(apart) else None,
                        "last logit apart": apart.max() if len(apart) else None})
        rows[m] = {**row, "fewest steps run": int(g["steps"].min())}
    return pd.DataFrame(rows).T


def seed_spread_text(summary, table) -> str:
    """Page 11's "Measured" findings: per mode of :func:`seeds_summary` (``summary``) how many runs' losses exploded,
    how many runs' logits ran away and how many runs' logits parted from the FP32 twin's (or worse), with the spread of
    those steps; and, where every BF16 run's logits parted and no FP32 run's did, how many BF16 runs' logits ran away
    within the steps all of them reached and how far apart the partings are (``table``: the :func:`experiment_table`
    the summary came from)."""
    lines = []
    for m, r in summary.iterrows():
        n = int(r["runs"])
        line = (f"* **{m}**: of {n} {plural(n, 'run')}, the loss exploded in {int(r['exploded'])} and the "
                f"logits ran away in {int(r['ran away'])}")
        if r["ran away"]:
            line += f" (steps {int(r['first runaway']):,} to {int(r['last runaway']):,})"
        line += f"; the logit parted from the FP32 twin's, or worse, in {int(r['logit apart or worse'])}"
        if pd.notna(r["first logit apart"]):
            line += (f", parting between steps {int(r['first logit apart']):,} and "
                     f"{int(r['last logit apart']):,}")
        lines.append(line + f". Every run trained at least {int(r['fewest steps run']):,} steps.")
    text = "**Measured.**\n\n" + "\n".join(lines)
    bf16, fp32 = summary.loc["bf16"], summary.loc["fp32"]
    if (bf16["logit apart or worse"] == bf16["runs"] and fp32["logit apart or worse"] == 0
            and pd.notna(bf16["first logit apart"])):
        horizon = int(bf16["fewest steps run"])  # the steps every BF16 run reached
        early = table[pd.to_numeric(table["runaway step"], errors="coerce") < horizon]
        s1337 = ", ".join(f"step {table.loc[label, LOGIT_APART]:,} "
                          f"{'compiled' if table.loc[label, 'compiled'] else 'eager'}"
                          for label in table.index if label.startswith("bf16_s1337"))
        text += (f"\n\nWithin the first {horizon:,} steps, {len(early)} of the "
                 f"{int(table.index.str.startswith('bf16').sum())} BF16 runs' logits ran away; in the others the "
                 "logit had parted from the FP32 twin's, and they may run away later. The logits part over a span of "
                 f"{int(bf16['last logit apart'] - bf16['first logit apart']):,} steps across these runs (seed 1337: "
                 f"{s1337}), so a single trajectory (the paper's) says little about when; that every BF16 run's logit "
                 "parts and no FP32 run's does is the robust part.")
    return text


def seeds_plan(experiment: str = "seeds", planned_steps: int = 8_000, gpus: int = 4, root=None) -> str:
    """Page 11's next step while ``results/<experiment>`` holds no run: the runs of :data:`lpfa.experiments.SEEDS`, the
    minutes of ``planned_steps`` steps each on ``gpus`` GPUs at the committed compiled speed
    (:func:`lpfa.scaling.committed_speed`); "" once a run is committed."""
    if planned_steps < 1 or gpus < 1:
        raise ValueError(f"planned_steps={planned_steps}, gpus={gpus}: expected both >= 1")
    if seeds_committed(experiment, root):
        return ""
    tps = committed_speed().loc["compiled", "median tokens/s"]
    minutes = wall_minutes(planned_steps, tps, PRESETS["repro"], runs=len(SEEDS), gpus=gpus)
    return (f"**Not run yet**: only seed 1337 is in the table. The {len(SEEDS)} runs of `lpfa.experiments.SEEDS` "
            f"({', '.join(SEEDS)}) at {planned_steps:,} steps each take about {minutes:.0f} minutes on {gpus} H200s "
            f"with `compile=true` ({RERUN_PAGE} gives the commands).")


def recipe_text(root=None) -> str:
    """The page's lead: how often the loss exploded at the paper's GPT-2 S recipe (:func:`lpfa.pages.loss_explosion
    .fate_counts`, where the survival curve is drawn), before the seeds of the smaller `repro` preset below."""
    fates = recipe_fates(root)
    if fates.empty:
        return "No run of the paper's GPT-2 S recipe is committed yet; the seeds below are of the `repro` preset."
    return (f"**At the paper's GPT-2 S recipe, {fate_counts(fates)}** (the loss-explosion page draws them as a "
            "survival curve). The seeds below are of the smaller `repro` preset: they measure how the logit runaway "
            "(and the weaker logit growth before it) move with the seed there.")
