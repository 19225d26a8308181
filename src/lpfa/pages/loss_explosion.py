"""Page 06, the loss explosion (Fig. 2): the BF16/FP32 twins at the paper's recipe and whether only the BF16 one
exploded, the precursors in one early layer (its largest attention logit, its tied rows, its W_Q norms), the twins
of the smaller `repro` preset, the dose-response test of the δ bias, and what a longer run costs.

The dose-response test (:mod:`lpfa.dose`) multiplies layer 1's δ error in the backward by k, with its BF16 sign kept
(the bias) or a random sign per row (the control): δ = δ_ref + k·s·(δ − δ_ref). This module draws it
(:func:`plot_dose_response`: failure step against k on log-log axes, the power law of
:func:`lpfa.dose.fit_dose_response` extrapolated to k = 1) and says it (:func:`dose_text`,
:func:`extrapolation_text`). A run that did not fail is censored: drawn at its length as an upward triangle.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import seaborn as sns
import torch
from matplotlib.lines import Line2D
from matplotlib.ticker import FixedLocator, NullLocator

from lpfa.compare import PRECURSORS, divergence_step, layer_max, plot_losses, precursor_panels, precursor_table
from lpfa.data import GPU_CORPUS_TRAIN_TOKENS
from lpfa.dose import committed_runs, dose_findings, dose_table, fit_dose_response, predict
from lpfa.experiments import DESCRIPTIONS, EXPERIMENTS
from lpfa.explosion import ExplosionCriterion, RunawayCriterion
from lpfa.launch import run_experiment
from lpfa.pages import RERUN_PAGE, VERDICT_WORDS, and_join, capital, gpu_name, plural, setting_of
from lpfa.pages.training import throughput_runs
from lpfa.params import boolean, dict_of, integer, optional, real, text
from lpfa.paths import results_dir
from lpfa.plotting import color_of, dash_of, use_style
from lpfa.results import experiment_rows, load, run_dir
from lpfa.results import runs as experiment_runs
from lpfa.results import what as results_what
from lpfa.run import Run, run_verdict
from lpfa.scaling import PAPER_EXPLOSION_STEP, committed_speed, paper_explosion_tokens, tokens_per_step, wall_minutes
from lpfa.survival import clopper_pearson, failed_within, kaplan_meier
from lpfa.train import PRESETS

# the notebook's papermill parameters, checked right after its parameters cell (lpfa.params.check_params)
PARAMS = {
    "experiment": text(nonempty=True), "run": optional(text(nonempty=True)),
    "twins": dict_of(text(), text(nonempty=True), required=("bf16", "fp32")),
    "repro_experiment": text(), "repro_twins": dict_of(text(), text(nonempty=True), required=("bf16", "fp32")),
    "short_experiment": text(), "short_twins": dict_of(text(), text(nonempty=True), required=("bf16", "fp32")),
    "window": integer(1), "margin": real(0, lo_open=True), "patience": integer(1), "layer": integer(0),
    "rerun": boolean(), "rerun_experiment": text(nonempty=True), "rerun_data": text(nonempty=True),
    "rerun_budget_s": real(0, lo_open=True),
    "target_steps": integer(1), "compile_throughput": text(nonempty=True), "throughput": text(nonempty=True),
    "dose_experiment": text(), "one_run_steps": integer(1),
}

CENSORED_LABEL = "no failure by the end of the run"
# x offsets (factors of k) in the dose figure, so runs at one dose do not hide each other
DODGE = {"control": 1.1, "other": 1 / 1.1}
# the step by which a run of the recipe counts as having exploded or not (the survival text, Fig. 2's verdict): past
# most committed BF16 explosions (a later one counts as not by then), within what one GPU run reaches
HORIZON = 6000
# how far past its seed's BF16 explosion an FP32 run must train to say that FP32 attention did not explode there
TWIN_MARGIN = 1000
EXPLOSION_EXPERIMENTS = ("paper_recipe", "mechanism", "stabilisers", "isolation", "seeds", "sfa_muon", "muon_long",
                         "sizes")


# ----------------------------------------------------------------------------------------------------------------
# Fig. 2's twins


def recipe_rows(experiment: str = "paper_recipe", run: str | None = None, root=None) -> dict:
    """``{label: run folder}`` of ``experiment``: over all its run folders (``run`` None,
    :func:`lpfa.results.experiment_rows`) or in run folder ``run``. An experiment that is not committed is a one-line
    error naming the ones that are (:func:`lpfa.results.runs`)."""
    if run is None:
        experiment_runs(experiment, root)  # an experiment not in the store: one line naming those that are
        return experiment_rows(experiment, root=root)
    folder = run_dir(experiment, run, root)
    return {p.name: p for p in sorted(folder.iterdir()) if (p / "config.json").is_file()}


def fig2_twins(experiment: str = "paper_recipe", run: str | None = None, root=None) -> dict:
    """The committed BF16/FP32 pairs of ``experiment`` by their BF16 label, e.g. ``{"bf16_paper_recipe": {"bf16": dir,
    "fp32": dir}, "bf16_paper_recipe_s1": ...}`` (a label ``bf16<x>`` pairs with ``fp32<x>``). ``run`` None: every run
    folder of the experiment, each label from the latest that has it (twins may run in different GPU runs,
    :func:`lpfa.results.experiment_rows`); else that run folder alone."""
    rows = recipe_rows(experiment, run, root)
    return {label: {"bf16": rows[label], "fp32": rows["fp32" + label[4:]]}
            for label in rows if label.startswith("bf16") and "fp32" + label[4:] in rows}


def fig2_runs(experiment: str, run: str | None, twins: dict, rerun: bool = False,
              rerun_experiment: str = "paper_recipe", rerun_data: str = "data/corpus", rerun_budget_s: float = 1080,
              root=None) -> tuple[dict, dict]:
    """Fig. 2's twins as ``({label: run folder}, provenance)``: ``twins`` (``{label: folder name}``) among the
    committed runs of ``experiment`` (:func:`recipe_rows`), or, with ``rerun``, trained first on this machine's GPUs
    (each for ``rerun_budget_s`` on ``rerun_data``, at the committed twins' batch, as ``rerun_experiment`` defines
    them). Raises ValueError naming the twins that are missing."""
    if rerun:
        if rerun_experiment not in EXPERIMENTS or not set(twins.values()) <= set(EXPERIMENTS[rerun_experiment]):
            raise ValueError(f"rerun_experiment={rerun_experiment!r}: expected an lpfa.experiments experiment that "
                             f"defines the twins {sorted(twins.values())}")
        committed = Run(recipe_rows(experiment, run, root)[twins["bf16"]]).train
        folder = run_experiment(f"{rerun_experiment}-rerun", rerun_experiment, rerun_data, rerun_budget_s,
                                only=list(twins.values()),
                                extra=[f"batch_size={committed['batch_size']}", f"grad_accum={committed['grad_accum']}",
                                       "compile=true", "explosion_stop=300"],
                                gpus=[str(i) for i in range(torch.cuda.device_count())] or None)
        return {label: folder / name for label, name in twins.items()}, {"what": "a rerun on this machine"}
    rows = recipe_rows(experiment, run, root)  # each twin from the latest run folder that has it
    missing = sorted(set(twins.values()) - set(rows))
    if missing:
        raise ValueError(f"twins={twins!r}: {missing} not among the committed runs of {experiment!r}: {sorted(rows)}")
    runs = {label: rows[name] for label, name in twins.items()}
    return runs, load(experiment, "provenance.json", runs["bf16"].parent.name, root)


def twin_runs(experiment: str, twins: dict, run: str | None = None, root=None) -> dict:
    """``{label: run folder}`` of ``twins`` (``{label: folder name}``) in run folder ``run`` of ``experiment``
    (None: the latest)."""
    folder = run_dir(experiment, run, root)
    return {label: folder / name for label, name in twins.items()}


def fig2_headline(verdicts: dict, conf: dict, n_pairs: int, seeds=None, sfa: dict | None = None,
                  fates: pd.DataFrame | None = None) -> str:
    """The page's opening sentence on Fig. 2: ``verdicts`` (``{"bf16": ..., "fp32": ...}``,
    :func:`lpfa.run.run_verdict`) of the twins trained with ``conf`` (the BF16 twin's train config), set against the
    paper's recipe and explosion step; with ``n_pairs`` committed BF16/FP32 pairs (:func:`fig2_twins`), their
    ``seeds`` (:func:`seed_table`, when there are at least two) and the SFA twin's verdict ``sfa`` where one is
    committed. With ``fates`` (:func:`recipe_fates`) the verdict is over every committed run of the recipe instead
    (:func:`fig2_verdict`; their counts are the scorecard's note, :func:`fate_counts`, just above the lead)."""
    b, f = verdicts["bf16"], verdicts["fp32"]
    paper = PRESETS["gpt2-s-paper"]
    recipe = (f"the paper's own recipe at GPT-2 S size (`{conf['model']}`, T = {conf['block_size']}, peak lr "
              f"{conf['lr']:g} after {conf['warmup_steps']:,} warmup steps, AdamW ({conf['beta1']}, {conf['beta2']}), "
              f"weight decay {conf['weight_decay']:g}, clip {conf['grad_clip']:g}) but **{tokens_per_step(conf):,} "
              f"tokens per step**, {tokens_per_step(paper) / tokens_per_step(conf):.0f}× fewer than the paper's "
              f"{tokens_per_step(paper):,}, so that 8,000 steps fit in one GPU run")
    if not (b["exploded"] and not f["exploded"]):
        return (f"**Fig. 2 is not reproduced.** With {recipe}, the BF16 twin "
                + ("exploded" if b["exploded"] else f"trained {b['steps']:,} steps without exploding")
                + (" and so did its FP32 twin" if f["exploded"] else
                   f"; its FP32 twin did not explode in {f['steps']:,} steps")
                + ". ")
    sfa_line = ("" if sfa is None else "The SFA twin at this recipe "
                + (f"exploded too, at step {sfa['explosion_step']:,}" if sfa["exploded"] else
                   f"did not explode in {sfa['steps']:,} steps")
                + " (the SFA page). ")
    if fates is not None and not fates.empty:
        # the counts themselves are in the scorecard's note right above the lead, and under the survival curve
        lead = (f"**Fig. 2 is {VERDICT_WORDS[fig2_verdict(fates)]}** by every committed run of the recipe (counted in "
                "the note above and drawn as a survival curve below). ")
    else:
        lead = f"**Fig. 2 is reproduced, with {n_pairs if n_pairs > 1 else 'one'} {plural(n_pairs, 'seed')}.** "
    return (lead + f"With {recipe}, the BF16 twin's loss exploded at step {b['explosion_step']:,} "
            f"({b['explosion_step'] * tokens_per_step(conf) / 1e6:.0f}M tokens), while its FP32 twin trained "
            f"{f['steps']:,} steps on the same batches without exploding. The paper's run exploded at about step "
            f"{PAPER_EXPLOSION_STEP:,} ({paper_explosion_tokens() / 1e9:.1f}B tokens at its batch). "
            + ("" if fates is not None and not fates.empty or seeds is None or len(seeds) < 2
               else seeds_text(seeds) + " ")
            + ("" if n_pairs >= 3 or fates is not None else
               f"{'One pair does' if n_pairs == 1 else f'{n_pairs} pairs do'} not measure the spread of the explosion "
               "step: more seeds at this recipe are still to run. ")
            + (sfa_line or "The SFA twin at this recipe is still to run, so the SFA page validates the fix on the "
                           "`repro` preset's logit runaway. "))


def opening_text(experiment: str, run: str | None, twins: dict, verdicts: dict, conf: dict,
                 criterion: ExplosionCriterion = ExplosionCriterion(), dose: pd.DataFrame | None = None,
                 rerun: bool = False, root=None) -> str:
    """The page's opening paragraphs (Markdown): :func:`fig2_headline` of the twins (with the committed seeds and SFA
    twin of ``experiment`` unless ``rerun``), every committed explosion (:func:`explosions_text`) and the BF16-only
    ones, and the dose experiment's findings (:func:`dose_text`) when ``dose`` (:func:`lpfa.dose.dose_table`)."""
    rows = recipe_rows(experiment, run, root)
    sfa = "sfa" + twins["bf16"][4:]
    head = fig2_headline(verdicts, conf, n_pairs=len(fig2_twins(experiment, run, root)),
                         seeds=None if rerun else seed_table(rows),
                         sfa=run_verdict(rows[sfa], criterion) if not rerun and sfa in rows else None,
                         fates=None if rerun else recipe_fates(root))
    others = committed_explosions(root=root)
    fig2 = bf16_only_explosions(others)
    return (head + ("\n\n" + batch_text(conf, verdicts["bf16"]["explosion_step"]) if not rerun else "")
            + f"\n\n{explosions_text(others)} BF16-only explosions (Fig. 2): "
            + (", ".join(f"`{label}`" for _, label in fig2.index) if len(fig2) else "none") + "."
            + ("\n\nThe dose experiment below tests the cause on the smaller `repro` preset. " + dose_text(dose)
               if dose is not None else ""))


def provenance_text(runs: dict, prov: dict, criterion: ExplosionCriterion) -> str:
    """Where the twins ``runs`` come from (their run folder and ``prov``, its ``provenance.json``) and the explosion
    ``criterion`` and logit-runaway criterion (:class:`lpfa.explosion.RunawayCriterion`) that judge them."""
    return (f"Run `{runs['bf16'].parent.name}`: {results_what(prov)} Data: {prov.get('data', '?')}. "
            f"{prov.get('device', '')}, commit `{prov.get('git_commit', '?')}`, {prov.get('date_utc', '')}.\n\n"
            f"Explosion criterion: {criterion.describe()}. Logit runaway (the precursor, "
            f"`lpfa.explosion.RunawayCriterion`): {RunawayCriterion().describe()}.")


def judged_twins(experiment: str, run: str | None, twins: dict, criterion: ExplosionCriterion, rerun: bool = False,
                 rerun_experiment: str = "paper_recipe", rerun_data: str = "data/corpus",
                 rerun_budget_s: float = 1080) -> tuple[dict, dict, dict, dict]:
    """Fig. 2's twins as page 06 reads them: ``(runs, provenance, verdicts, conf)``, :func:`fig2_runs`, each run's
    :func:`lpfa.run.run_verdict` under ``criterion``, and the BF16 twin's train config."""
    runs, prov = fig2_runs(experiment, run, twins, rerun, rerun_experiment, rerun_data, rerun_budget_s)
    return runs, prov, {label: run_verdict(d, criterion) for label, d in runs.items()}, Run(runs["bf16"]).train


def settings_notes(conf: dict) -> dict:
    """The BF16 twin's wall-clock budget and explosion stop (``conf``: its train config), for the page's prose."""
    return {"budget_s": f"{conf['time_budget_s']:,.0f}", "explosion_stop": f"{conf['explosion_stop']:,}"}


def verdict_table(verdicts: dict) -> pd.DataFrame:
    """One row per run of ``verdicts`` (``{label: run_verdict}``): its policy, optimizer, seed, steps, and whether
    and when its loss exploded and its logits ran away (in which layer)."""
    return pd.DataFrame(verdicts).T[["policy", "optimizer", "seed", "steps", "exploded", "explosion_step",
                                     "runaway_step", "runaway_layer"]]


def plot_twin_losses(runs: dict, verdicts: dict | None = None, smooth: int = 50, top: float = 8.0,
                     title: str | None = None):
    """:func:`lpfa.compare.plot_losses` of ``runs`` (Fig. 2), the loss axis cut at ``top`` (an exploded loss would
    flatten the rest), a dotted line where each run of ``verdicts`` (``{label: run_verdict}``) exploded."""
    fig = plot_losses(runs, smooth=smooth)
    ax = fig.axes[0]
    ax.set_ylim(top=min(ax.get_ylim()[1], top))
    for label, v in (verdicts or {}).items():
        if v["exploded"]:
            ax.axvline(v["explosion_step"], ls=":", color="0.3", label=f"{label} explodes")
    if title:
        ax.set_title(title, fontsize=10)
    ax.legend(fontsize=9)
    return fig


def plot_precursors(runs: dict, layer: int):
    """The three precursors of one layer over training, one panel per row (legible at page width), every run in its
    mode's colour and line style (:func:`lpfa.plotting.color_of`, :func:`lpfa.plotting.dash_of`)."""
    use_style()
    fig, axes = plt.subplots(3, 1, figsize=(7.5, 7.2), sharex=True)
    precursor_panels(axes, runs, layer, {label: (color_of(label), dash_of(label)) for label in runs})
    for ax, name in zip(axes, PRECURSORS.values()):
        ax.set_title(f"layer {layer}: {name}", fontsize=10)
    axes[-1].set_xlabel("step")
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=9)
    return fig


# ----------------------------------------------------------------------------------------------------------------
# every committed explosion, the seeds


def committed_explosions(experiments=EXPLOSION_EXPERIMENTS, root=None):
    """Every committed run of ``experiments`` (:func:`lpfa.results.experiment_rows`) with its verdict: a DataFrame
    indexed by (experiment, label) with ``change`` (:data:`lpfa.experiments.DESCRIPTIONS`), ``attention``, ``steps``,
    ``exploded``, ``explosion step``, ``fp32 twin exploded`` and ``fp32 twin steps``: for a ``bf16...`` row, whether
    the row of the same experiment named ``fp32...`` exploded too and how far it trained (None without one). A
    BF16-only loss explosion, Fig. 2, is a row with ``exploded`` whose FP32 twin trained past that step without
    exploding (:func:`bf16_only_explosions`)."""
    rows = {}
    for exp in experiments:
        runs = experiment_rows(exp, root=root)
        verdicts = {label: run_verdict(d) for label, d in runs.items()}
        for label, v in verdicts.items():
            twin = verdicts.get("fp32" + label[4:]) if label.startswith("bf16") else None
            rows[exp, label] = {"change": DESCRIPTIONS.get(label, ""), "attention": v["policy"], "steps": v["steps"],
                                "exploded": v["exploded"], "explosion step": v["explosion_step"],
                                "fp32 twin exploded": None if twin is None else twin["exploded"],
                                "fp32 twin steps": None if twin is None else twin["steps"]}
    return pd.DataFrame.from_dict(rows, orient="index")


def bf16_only_explosions(table):
    """The rows of :func:`committed_explosions` that are Fig. 2: a BF16 run that exploded while its FP32 twin (same
    experiment, same data order) trained past that step without exploding."""
    past = pd.to_numeric(table["fp32 twin steps"], errors="coerce") > pd.to_numeric(table["explosion step"],
                                                                                   errors="coerce")
    return table[table["exploded"].astype(bool) & table["fp32 twin exploded"].eq(False) & past]  # None is not False


def explosions_text(table) -> str:
    """:func:`committed_explosions` in one sentence: how many runs, which exploded (and whether the FP32 twin of a
    BF16 row did too)."""
    boom = table[table["exploded"]]
    text = (f"Of the {len(table)} committed runs of the {', '.join(dict.fromkeys(e for e, _ in table.index))} "
            "experiments (the latest of each name), ")
    if boom.empty:
        return text + "none exploded."
    parts = []
    for (exp, label), r in boom.iterrows():
        twin = ((", no FP32 twin of the same name" if label.startswith("bf16") else "")
                if r["fp32 twin exploded"] is None else ", its FP32 twin too" if r["fp32 twin exploded"] else
                f", its FP32 twin not, in {int(r['fp32 twin steps'] - r['explosion step']):,} more steps"
                if r["fp32 twin steps"] > r["explosion step"] else
                f", its FP32 twin stopped sooner, at step {int(r['fp32 twin steps']):,}")
        parts.append(f"`{label}` ({exp}: {r['change'] or r['attention']}; step {int(r['explosion step']):,}{twin})")
    return text + f"{len(boom)} exploded: " + "; ".join(parts) + "."


def seed_table(rows: dict, prefix: str = "bf16"):
    """Fig. 2 over seeds: one row per run of ``rows`` (``{label: run folder}``, :func:`lpfa.results.experiment_rows`)
    whose label starts with ``prefix``, with its ``seed``, ``steps``, ``explosion step`` (None: did not explode) and
    its FP32 twin's (the row named ``fp32`` + the rest of the label): ``fp32 steps`` and ``fp32 explosion step``, both
    None where the twin is not run yet, and ``fp32 exploded`` (None without a twin)."""
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
    """:func:`seed_table` in one sentence: in how many seeds the BF16 run's loss exploded (at which steps), the last
    step of each run that did not explode (censored there: it may still explode later), and how many of their FP32
    twins have run and exploded."""
    if table.empty:
        return "No BF16 run at this recipe is committed."
    boom = table["explosion step"].dropna().astype(int)
    alive = table.loc[table["explosion step"].isna(), "steps"].astype(int)
    ran = table[table["fp32 exploded"].notna()]
    censored = ("" if not len(alive) else
                f"; the other had not exploded when its run ended, at step {alive.iloc[0]:,}" if len(alive) == 1 else
                f"; the other {len(alive)} had not exploded when their runs ended, at steps "
                f"{and_join([f'{s:,}' for s in sorted(alive)])}")
    text = (f"The BF16 run's loss exploded in {len(boom)} of {len(table)} {plural(len(table), 'seed')}"
            + (f" (at {plural(len(boom), 'step')} {and_join([f'{s:,}' for s in sorted(boom)])})"
               if len(boom) else "")
            + censored
            + f"; {len(ran)} FP32 {plural(len(ran), 'twin')} ran"
            + (f" ({and_join([f'{int(s):,}' for s in ran['fp32 steps']])} steps)" if len(ran) else "")
            + f" and {int(ran['fp32 exploded'].astype(bool).sum())} exploded")
    missing = [str(int(table.loc[label, "seed"])) for label in table.index[table["fp32 exploded"].isna()]]
    return text + (f"; seed{'s' if len(missing) > 1 else ''} {and_join(missing)} ha{'ve' if len(missing) > 1 else 's'} "
                   "no FP32 twin." if missing else ".")


# ----------------------------------------------------------------------------------------------------------------
# the twins in words


def twins_text(runs: dict, layer: int, criterion=None, bf16: str = "bf16", fp32: str = "fp32",
               verdicts: dict | None = None) -> str:
    """Fig. 2's verdict for one BF16/FP32 pair in sentences: whether each exploded (``lpfa.explosion``), where the
    BF16 run's layer ``layer`` ran away, the precursors of both at the last diagnostics step both reached
    (:func:`lpfa.compare.precursor_table`), and from when the BF16 logit and W_Q norm stay apart
    (:func:`lpfa.compare.divergence_step`). ``verdicts``: ``{label: run_verdict(run, criterion)}`` where the caller
    has them already; each run is judged once."""
    v = {label: (verdicts or {}).get(label) or (run_verdict(d, criterion) if criterion else run_verdict(d))
         for label, d in runs.items()}
    table, common = precursor_table(runs, layer, criterion=criterion, verdicts=v)
    name = {m: f"{n} @ {common}" for m, n in PRECURSORS.items()}
    b, f = table.loc[bf16], table.loc[fp32]
    if v[bf16]["exploded"] and not v[fp32]["exploded"]:
        text = [f"**The BF16 run's loss exploded at step {v[bf16]['explosion_step']:,}; its FP32 twin trained "
                f"{v[fp32]['steps']:,} steps on the same batches without exploding** (final eval loss "
                f"{f['final eval loss']:.2f})."]
    elif v[bf16]["exploded"]:
        text = [f"Both runs exploded (BF16 at step {v[bf16]['explosion_step']:,}, FP32 at "
                f"{v[fp32]['explosion_step']:,}): a generic instability, not Fig. 2."]
    else:
        text = [f"The BF16 run did not explode in its {v[bf16]['steps']:,} steps"
                + (f" (its FP32 twin did, at step {v[fp32]['explosion_step']:,})" if v[fp32]["exploded"] else
                   f" (nor its FP32 twin in {v[fp32]['steps']:,})")
                + ", so these runs do not reproduce Fig. 2's explosion."]
    ra = v[bf16]["runaway_step"]
    if ra is not None:
        text.append(f"By the runaway criterion the BF16 run's layer {v[bf16]['runaway_layer']} ran away at step {ra:,}"
                    + (f", {v[bf16]['explosion_step'] - ra:,} steps before its loss exploded; " if v[bf16]["exploded"]
                       else f", {v[bf16]['steps'] - ra:,} steps before the run ended; ")
                    + ("the FP32 twin's never did." if v[fp32]["runaway_step"] is None else
                       f"the FP32 twin's at step {v[fp32]['runaway_step']:,}."))
    text.append(f"At step {common:,}, layer {layer}'s largest attention logit is {b[name['max_logit']]:,.0f} with BF16 "
                f"attention against {f[name['max_logit']]:,.0f} with FP32, its most tied head has tied maxima in "
                f"{b[name['tie_fraction']]:.0%} of its rows (BF16 scores) against {f[name['tie_fraction']]:.1%} "
                f"(FP32 scores), and its largest ‖W_Q[h]‖₂ is {b[name['wq_spectral_norm']]:.1f} against "
                f"{f[name['wq_spectral_norm']]:.1f}.")
    div = {m: divergence_step(layer_max(runs[bf16], m, layer), layer_max(runs[fp32], m, layer), r)
           for m, r in (("max_logit", 10.0), ("wq_spectral_norm", 1.25))}

    def when(s):
        return "never for good" if s is None else f"from step {s:,} on"

    text.append(f"The BF16 logit stays above 10× the FP32 twin's {when(div['max_logit'])}, and the BF16 W_Q norm "
                f"above 1.25× {when(div['wq_spectral_norm'])} (`lpfa.compare.divergence_step`).")
    return " ".join(text)


def repro_numbers(runs: dict) -> dict:
    """The `repro` twins' setup for the page's text: ``{"repro_setup": model and recipe, "repro_steps": the BF16
    twin's steps}`` (Markdown strings)."""
    bf16 = Run(runs["bf16"])
    rc, rm = bf16.train, bf16.config["model"]
    return {"repro_setup": f"{rm['n_layer']} layers, d = {rm['n_embd']}, T = {rm['block_size']}, "
                           f"{tokens_per_step(rc):,} tokens/step, lr {rc['lr']:g} {rc['lr_schedule']}",
            "repro_steps": f"{bf16.steps:,}"}


def four_modes_text(table: pd.DataFrame, step: int, layer: int) -> str:
    """The four attention modes' runs in one sentence, from their :func:`lpfa.compare.precursor_table` at ``step``
    (rows ``bf16``, ``fp32`` and others): how many exploded, and ``layer``'s largest attention logit against the FP32
    run's; where only ``bf16`` ran away (above 10× FP32, the others below 3×), that P̄ = 1 is not required."""
    col = f"largest attention logit @ {step}"
    ref = table.loc["fp32", col]
    others = [label for label in table.index if label not in ("bf16", "fp32")]
    if table.loc["bf16", col] > 10 * ref > 0 and all(table.loc[label, col] < 3 * ref for label in others):
        return (f"{int(table['exploded'].sum())} of {len(table)} runs exploded. At step {step:,}, layer {layer}'s "
                "largest attention logit relative to the FP32 run's "
                f"{ref:.0f}: " + ", ".join(f"{label} ×{table.loc[label, col] / ref:.1f}" for label in table.index
                                           if label != "fp32")
                + ". Of these four only `bf16` lets it run away; P̄ = 1 is not required, though: the isolation row "
                "with FP32 scores (`scores_fp32`, on the isolation page) ran away with almost no ties.")
    return (f"{int(table['exploded'].sum())} of {len(table)} runs exploded; layer {layer}'s largest attention logit "
            f"at step {step:,}: " + ", ".join(f"{label} {table.loc[label, col]:.0f}" for label in table.index) + ".")


# ----------------------------------------------------------------------------------------------------------------
# the dose-response test


def dose_ladder(base: str = "paper_untiled", root=None) -> tuple[dict, pd.DataFrame | None, dict]:
    """The committed dose experiment as ``(runs, table, fits)``: :func:`lpfa.dose.committed_runs`, their
    :func:`lpfa.dose.dose_table` (None without runs) and ``{what: fit}`` of
    :func:`lpfa.dose.fit_dose_response` over the biased runs on ``base`` for the explosion and the runaway step."""
    runs = committed_runs(root)
    if not runs:
        return {}, None, {}
    table = dose_table(runs)
    return runs, table, {what: fit_dose_response(table, what=what, base=base)
                         for what in ("explosion step", "runaway step")}


def dose_runs_table(table: pd.DataFrame) -> pd.DataFrame:
    """The dose table as the page shows it: sorted by sign, base, dose and seed, without the runaway layer."""
    return table.drop(columns=["runaway layer"]).sort_values(["sign", "base", "k", "seed"])


def _si(x: float) -> str:
    """3 significant digits with a k/M/B/T suffix: 1.57B."""
    for div, suffix in ((1e12, "T"), (1e9, "B"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.3g}{suffix}"
    return f"{x:.3g}"


def _ks(values) -> str:
    ks = sorted({float(k) for k in values})
    return ", ".join(f"{k:g}" for k in ks) if ks else "none"


def extrapolation_text(fit: dict, tokens_per_step: int, steps_per_minute: float | None = None) -> str:
    """The fit's extrapolation to dose 1 in one sentence: the step of failure with its 95% prediction interval,
    the tokens at ``tokens_per_step`` (:func:`lpfa.scaling.tokens_per_step` of the run's config) and, given
    ``steps_per_minute`` (e.g. a measured tokens/s × 60 / tokens per step), the GPU-minutes; or why there is none."""
    what = fit.get("what", "failure step").replace(" step", "")
    if not math.isfinite(fit.get("predicted_at_1", math.nan)):
        return f"There is no extrapolation of the {what} to dose 1: {fit.get('note') or 'the fit has no estimate'}."
    p, (lo, hi) = fit["predicted_at_1"], fit["interval_95"]
    tok = tokens_per_step
    text = (f"Extrapolated to dose k = 1, the power law fitted to {fit['n']} {fit['sign']} runs "
            f"(slope {fit['slope']:.2f} ± {fit['slope_se']:.2f}, k = {fit['k_min']:g}–{fit['k_max']:g}) "
            f"puts the {what} at step {p:,.0f} (95% prediction interval {lo:,.0f}–{hi:,.0f}), "
            f"that is {_si(p * tok)} tokens ({_si(lo * tok)}–{_si(hi * tok)}) at {tok:,} tokens per step")
    if steps_per_minute:
        m = steps_per_minute
        text += (f" and {p / m:,.0f} GPU-minutes ({lo / m:,.0f}–{hi / m:,.0f}) at {m:,.3g} steps per minute")
    if fit["slope"] >= 0:
        text += (f"; but the {what} does not come sooner at larger doses, "
                 "so this is no evidence that the δ bias drives it")
    return text + "."


def _n_control(table: pd.DataFrame, ks) -> str:
    """How many control runs (random sign) each dose of ``ks`` has, in words: "one control run", "2–3 control runs"."""
    counts = [int(((table["sign"] == "control") & (table["k"] == k)).sum()) for k in ks]
    lo, hi = min(counts), max(counts)
    n = f"{lo}" if lo == hi else f"{lo}–{hi}"
    return ("one control run" if hi == 1 else f"{n} control runs")


def dose_text(table: pd.DataFrame, base: str = "paper_untiled") -> str:
    """:func:`lpfa.dose.dose_findings` in three sentences (Markdown): how many biased and control runs on ``base``
    exploded (at which doses and steps), where the bias rather than the magnitude decides, and the SFA row."""
    f = dose_findings(table, base)
    b, c = f["bias"], f["control"]

    def steps(d):
        return "; ".join(f"k = {k:g}: {plural(len(v), 'step')} {', '.join(f'{s:,}' for s in v)}"
                         for k, v in d["explosion_steps"].items() if v)

    text = [f"With its BF16 sign kept, the dosed δ error made the loss explode in **{b['exploded_runs']} of "
            f"{b['runs']} runs**, at k = {_ks(b['exploded_ks'])} ({steps(b)}); at k = {_ks(b['runaway_only_ks'])} "
            "the layer-1 logits ran away but the loss had not exploded by the end of the run."]
    text.append(f"The control, the same magnitude with a random sign per row, made the loss explode in "
                f"**{c['exploded_runs']} of {c['runs']} runs** "
                + (f"({steps(c)})" if c["exploded_runs"] else f"(k = {_ks(c['ks'])})")
                + (f", and its logits ran away without an explosion at k = {_ks(c['runaway_only_ks'])}"
                   if c["runaway_only_ks"] else "")
                + (f"; at k = {_ks(f['bias_decides_ks'])} the loss exploded in every biased run and in no control "
                   "run, so there, "
                   f"with {_n_control(table, f['bias_decides_ks'])} at each dose and on the `repro` preset only, the "
                   "*bias*, not the size of the δ error, decides whether the loss explodes" if f["bias_decides_ks"]
                   else "")
                + (f"; at k = {_ks(f['magnitude_suffices_ks'])}, with "
                   f"{_n_control(table, f['magnitude_suffices_ks'])} at each dose, the magnitude alone sufficed"
                   if f["magnitude_suffices_ks"] else "")
                + ".")
    if f["sfa"] is not None:
        s = f["sfa"]
        text.append(f"With SFA (β = {s['beta']:g}) as the base at the biased k = {s['k']:g}, the loss "
                    + (f"still exploded, at step {s['explosion step']:,} against "
                       f"{', '.join(f'{x:,}' for x in s['without_sfa'])} without SFA: SFA removes the P̄ = 1 "
                       "entries of tied rows, not a δ error injected by hand" if s["exploded"] else "did not explode")
                    + ".")
    return " ".join(text)


def dose_note(table: pd.DataFrame | None, fits: dict, runs: dict, verdicts: dict, repro_runs: dict | None = None,
              criterion: ExplosionCriterion = ExplosionCriterion(),
              compile_throughput: str = "compile_throughput") -> str:
    """The dose ladder's extrapolation to k = 1 in words (Markdown): :func:`extrapolation_text` of the explosion and
    runaway ``fits`` (:func:`dose_ladder`) in steps, tokens and GPU-minutes at the committed compiled speed, the
    undosed `repro` BF16 twin's runaway (``repro_runs``), the spread of the seeds, and the Fig. 2 twins' ``verdicts``
    (the paper-recipe BF16 run exploded at dose 1). Empty without a dose ``table``."""
    if table is None:
        return ""
    rv = ({label: run_verdict(d, criterion) for label, d in repro_runs.items()} if repro_runs
          else {"bf16": {"runaway_step": None}})
    dconf = Run(runs["bias_x64"]).train
    tps = committed_speed(compile_throughput).loc["compiled", "median tokens/s"]
    per_min = tps * 60 / tokens_per_step(dconf)
    ladder = table[(table["sign"] == "bias") & (table["base"] == "paper_untiled")]
    spread = ladder.groupby("k")["explosion step"].agg(
        lambda s: s.max() / s.min() if s.notna().sum() > 1 else None).dropna()
    return (f"**Extrapolating to k = 1.** "
            f"{extrapolation_text(fits['explosion step'], tokens_per_step(dconf), per_min)} "
            "The logit runaway, the precursor, comes earlier and lines up better: "
            f"{extrapolation_text(fits['runaway step'], tokens_per_step(dconf), per_min)} "
            + (f"The undosed `repro` BF16 twin ran away at step {rv['bf16']['runaway_step']:,} in its "
               f"{rv['bf16']['steps']:,}-step run (above). " if rv["bf16"]["runaway_step"] else "")
            + f"(GPU-minutes for one `{dconf['model']}` run alone on an H200, compiled, "
            f"`results/{compile_throughput}`.) "
            f"The seeds at k = {', '.join(f'{k:g}' for k in spread.index)} spread by up to {spread.max():.1f}× in the "
            "explosion step, so single runs at small doses say little; "
            + (f"the paper-recipe BF16 twin needs no extrapolation: it exploded at dose 1, at step "
               f"{verdicts['bf16']['explosion_step']:,}."
               if verdicts["bf16"]["exploded"] and not verdicts["fp32"]["exploded"] else
               "the paper-recipe twins did not give a BF16-only explosion either."))


def dose_summary(table: pd.DataFrame, fit: dict) -> dict:
    """The dose ladder's numbers as plain values (None where no run qualifies, NaN where the fit has none), over the
    rows on the fit's ``base`` (else the table's commonest): ``base``; ``biased_runs``, ``biased_exploded``,
    ``biased_failed``; ``smallest_biased_k_exploded``, ``smallest_biased_k_failed``; ``control_runs``,
    ``control_failed``, ``control_exploded``, ``any_control_failed``; ``largest_control_k`` and its mean
    ``largest_control_k_final_eval_loss``; and from ``fit``: ``slope``, ``slope_se``, ``n_fit``, ``predicted_at_1``
    with its 95% and 68% bounds (``predicted_at_1_low_95``, ``..._high_95``, ``..._low_68``, ``..._high_68``)."""
    base = fit.get("base") or _main_base(table)
    ladder = table[table["base"] == base]
    bias, control = ladder[ladder["sign"] == "bias"], ladder[ladder["sign"] == "control"]
    bias_failed, control_failed = bias[~bias["censored"]], control[~control["censored"]]
    largest = float(control["k"].max()) if len(control) else None
    return {
        "base": base,
        "biased_runs": len(bias), "biased_exploded": int(bias["exploded"].sum()), "biased_failed": len(bias_failed),
        "smallest_biased_k_exploded": float(bias.loc[bias["exploded"], "k"].min()) if bias["exploded"].any() else None,
        "smallest_biased_k_failed": float(bias_failed["k"].min()) if len(bias_failed) else None,
        "control_runs": len(control), "control_failed": len(control_failed),
        "control_exploded": int(control["exploded"].sum()), "any_control_failed": bool(len(control_failed)),
        "largest_control_k": largest,
        "largest_control_k_final_eval_loss": (float(control.loc[control["k"] == largest, "final eval loss"].mean())
                                              if largest is not None else None),
        "slope": float(fit["slope"]), "slope_se": float(fit["slope_se"]), "n_fit": int(fit["n"]),
        "predicted_at_1": float(fit["predicted_at_1"]),
        "predicted_at_1_low_95": float(fit["interval_95"][0]), "predicted_at_1_high_95": float(fit["interval_95"][1]),
        "predicted_at_1_low_68": float(fit["interval_68"][0]), "predicted_at_1_high_68": float(fit["interval_68"][1]),
    }


def _main_base(table: pd.DataFrame) -> str | None:
    """The ladder's base: the commonest ``base`` of the table (the first of them on a tie)."""
    return str(table["base"].mode().iloc[0]) if len(table) else None


def _groups(table: pd.DataFrame) -> dict:
    """``{(sign, base): (label, colour, marker, filled, dodge)}``: biased runs on the ladder's base (the commonest
    base) filled vermillion circles (the book's BF16 colour), controls hollow reddish-purple squares, other bases
    filled diamonds in their own colour (SFA green, FP32 blue, as elsewhere in the book), "undosed" where k = 1."""
    pal = sns.color_palette("colorblind").as_hex()
    main = _main_base(table)
    by_base = {"sfa": pal[2], "fp32": pal[0]}
    spare = iter([pal[1], pal[5], pal[7], pal[9], pal[8]])
    out = {}
    for sign, base in dict.fromkeys(zip(table["sign"], table["base"])):
        if base == main:
            out[sign, base] = (("biased δ error (its BF16 sign kept)", pal[3], "o", True, 1.0) if sign == "bias"
                               else ("control (a random sign per row)", pal[4], "s", False, DODGE["control"]))
            continue
        colour = next((c for key, c in by_base.items() if key in base), None) or next(spare, pal[7])
        undosed = sign == "bias" and (table.loc[(table["sign"] == sign) & (table["base"] == base), "k"] == 1).all()
        label = f"{base}, " + ("undosed" if undosed else "biased δ error" if sign == "bias" else "control")
        out[sign, base] = (label, colour, "D", sign == "bias", DODGE["other"])
    return out


def plot_dose_response(table: pd.DataFrame, fit: dict | None = None, ax=None, what: str = "failure step",
                       affordable_steps: float | None = None):
    """Step of failure (``what``) against dose k on log-log axes, one point per run of ``table``
    (:func:`lpfa.dose.dose_table`): biased runs filled, controls hollow, a run where ``what`` did not happen at its
    length as an upward triangle, seeds at one dose joined over their min–max, controls and other bases dodged
    (:data:`DODGE`). With ``fit`` (:func:`lpfa.dose.fit_dose_response`): the fitted line, dashed on to k = 1, and its
    95% prediction band; ``affordable_steps``: a dotted "one GPU run". Returns the Figure (6.4 × 4.6 in)."""
    use_style()
    if ax is None:
        _, ax = plt.subplots(figsize=(6.4, 4.6))
    groups = _groups(table)
    y = pd.to_numeric(table[what], errors="coerce").astype(float)
    censored = y.isna()
    shown = y.where(~censored, table["steps"].astype(float))  # a censored run at its length: a lower bound
    handles, any_censored, any_spread = [], False, False
    for (sign, base), (label, colour, marker, filled, dodge) in groups.items():
        g = table.index[(table["sign"] == sign) & (table["base"] == base)]
        face = colour if filled else "none"
        for k, at_k in table.loc[g].groupby("k").groups.items():
            if len(at_k) > 1:
                ax.vlines(k * dodge, shown[at_k].min(), shown[at_k].max(), color=colour, lw=1.2, alpha=0.7, zorder=2)
                any_spread = True
        ok, cens = g[~censored[g]], g[censored[g]]
        style = dict(ls="none", mec=colour, mfc=face, mew=1.5, zorder=3)
        ax.plot(table.loc[ok, "k"] * dodge, shown[ok], marker=marker, ms=7, **style)
        ax.plot(table.loc[cens, "k"] * dodge, shown[cens], marker="^", ms=8, **style)
        any_censored |= len(cens) > 0
        handles.append(Line2D([], [], ls="none", marker=marker, ms=7, mec=colour, mfc=face, mew=1.5, label=label))
    if any_censored:
        event = what.replace(" step", "")
        handles.append(Line2D([], [], ls="none", marker="^", ms=8, mec="0.3", mfc="none", mew=1.5,
                              label=CENSORED_LABEL if event == "failure" else f"no {event} by the end of the run"))
    if any_spread:
        handles.append(Line2D([], [], color="0.3", lw=1.2, label="several seeds: min–max"))

    k_lo = 1.0
    if fit is not None and fit["n"] and math.isfinite(fit["slope"]):
        colour = groups.get((fit["sign"], fit["base"] or _main_base(table)), (None, "0.2"))[1]
        k_lo = min(k_lo, fit["k_min"])
        band = np.geomspace(k_lo, fit["k_max"], 100)
        lo, hi = np.array([predict(fit, k)[1:] for k in band]).T
        ax.fill_between(band, lo, hi, color=colour, alpha=0.15, lw=0, zorder=1)
        fitted, extrapolated = np.geomspace(fit["k_min"], fit["k_max"], 50), np.geomspace(k_lo, fit["k_min"], 50)
        for ks, ls in ((fitted, "-"), (extrapolated, "--")):
            ax.plot(ks, [predict(fit, k)[0] for k in ks], color=colour, lw=1.5, ls=ls, zorder=2)
        exponent = f"{fit['slope']:.2f}".replace("-", "−")
        handles.append(Line2D([], [], color=colour, lw=1.5,
                              label=f"fit: step ∝ k$^{{{exponent}}}$ (n = {fit['n']}); dashed: extrapolated"))
        handles.append(plt.Rectangle((0, 0), 1, 1, color=colour, alpha=0.15, lw=0, label="95% prediction interval"))
    if affordable_steps:
        ax.axhline(affordable_steps, color="black", ls=":", lw=1.2, zorder=1)
        handles.append(Line2D([], [], color="black", ls=":", lw=1.2, label="one GPU run"))

    ax.set_xscale("log")
    ax.set_yscale("log")
    doses = sorted({*table["k"][table["k"] > 0].tolist(), 1.0})
    ax.set_xlim(min(doses + [k_lo]) / 1.5, max(doses) * 1.5)
    ax.xaxis.set_major_locator(FixedLocator(doses))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xticklabels([f"{k:g}" for k in doses])
    ax.tick_params(labelsize=9)
    ax.set_xlabel(f"dose k (× layer-{table.attrs.get('layer', 1)} δ error)")
    ax.set_ylabel("step of " + what.replace(" step", ""))
    ax.legend(handles=handles, fontsize=9, loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2)
    return ax.figure


def dose_view(table: pd.DataFrame, fit: dict | None, k: float, what: str = "explosion step",
              affordable_steps: float | None = None) -> tuple:
    """The dose figure (:func:`plot_dose_response`) with dose ``k`` picked out: its runs ringed, the fit's prediction
    there with its 95% interval as a black bar, and a sentence (Markdown) naming the runs at ``k`` with their
    ``what`` step and the prediction. ``k`` must be positive; a bad one is a one-line ValueError naming it."""
    if isinstance(k, bool) or not isinstance(k, (int, float, np.integer, np.floating)) or not (
            math.isfinite(k) and k > 0):
        raise ValueError(f"k={k!r}: expected a positive dose (the ladder's: {_ks(table['k'][table['k'] > 0])})")
    k = float(k)
    fig = plot_dose_response(table, fit, what=what, affordable_steps=affordable_steps)
    ax = fig.axes[0]
    y = pd.to_numeric(table[what], errors="coerce").astype(float)
    at_k = table.index[np.isclose(table["k"].astype(float), k)]
    shown = y.where(y.notna(), table["steps"].astype(float))
    groups = _groups(table)
    dodge = [groups[table.at[label, "sign"], table.at[label, "base"]][4] for label in at_k]  # as the points are
    ax.plot(table.loc[at_k, "k"].astype(float) * dodge, shown[at_k], ls="none", marker="o", ms=15, mfc="none",
            mec="black", mew=1.2, zorder=4)
    event = what.replace(" step", "")
    quiet = {"explosion": "its loss did not explode",
             "runaway": "its logits did not run away"}.get(event, f"no {event}")
    runs = ", ".join(f"{label} ({quiet} by step {int(table.at[label, 'steps']):,})" if pd.isna(y[label])
                     else f"{label} (step {int(y[label]):,})" for label in at_k)
    text = f"At dose k = {k:g}: " + (f"{len(at_k)} {plural(len(at_k), 'run')}: {runs}." if len(at_k) else
                                     "no committed run.")
    pred, lo, hi = predict(fit, k) if fit is not None else (math.nan,) * 3
    if math.isfinite(pred):
        ax.errorbar([k], [pred], yerr=[[pred - lo], [hi - pred]], fmt="D", color="black", ms=6, capsize=4, zorder=5)
        inside = "within" if fit["k_min"] <= k <= fit["k_max"] else "extrapolated beyond"
        text += (f" The fit ({inside} its doses {fit['k_min']:g} to {fit['k_max']:g}) predicts the {event} at step "
                 f"{pred:,.0f}, 95% prediction interval {lo:,.0f} to {hi:,.0f} (black diamond and bar).")
    ax.set_title(f"dose k = {k:g}", fontsize=10)
    return fig, text


def dose_explorer(table: pd.DataFrame | None, fit: dict | None, k: float = 1.0, what: str = "explosion step",
                  affordable_steps: float | None = None):
    """The dose figure with a dose slider (:func:`dose_view`, the ladder's doses and 1) through
    :func:`lpfa.widgets.interactive_or_static`; a static page shows it at ``k``. None (nothing shown) without a dose
    table."""
    from lpfa.widgets import interactive_or_static

    if table is None:
        return None

    doses = sorted({*(float(x) for x in table["k"] if x > 0), 1.0, float(k)})

    def view(k):
        return dose_view(table, fit, k, what, affordable_steps)

    def controls():
        import ipywidgets as w

        return {"k": w.SelectionSlider(options=[(f"{d:g}", d) for d in doses], value=float(k), description="dose k",
                                       continuous_update=False)}

    return interactive_or_static(view, controls, {"k": k})


# ----------------------------------------------------------------------------------------------------------------
# what a longer run costs


def cost_text(speeds: pd.DataFrame, runs: dict, repro_runs: dict | None = None, target_steps: int = 30_000,
              compile_throughput: str = "compile_throughput", throughput: str = "train_throughput",
              root=None) -> str:
    """What a longer reproduction costs (Markdown): ``target_steps`` of the `repro` BF16 twin (``repro_runs``; the
    ``repro`` preset without) at the eager and compiled ``speeds`` (:func:`lpfa.scaling.committed_speed`), and the
    paper's explosion (:data:`lpfa.scaling.PAPER_EXPLOSION_STEP`) in GPU-hours at the `paper` policy's committed
    GPT-2 S speed (``results/<throughput>``), against the wall time of the Fig. 2 BF16 twin (``runs``)."""
    t = Run(repro_runs["bf16"]).train if repro_runs else PRESETS["repro"]
    minutes = {k: wall_minutes(target_steps, v, t) for k, v in speeds["median tokens/s"].items()}
    g_run = throughput_runs(throughput, root)[0]  # a run of every backend: the eager `paper` row
    g_tps = json.loads((g_run / "summary.json").read_text())["backends"]["lpfa_paper"]["tokens_per_s"]
    g_gpu = gpu_name(json.loads((g_run / "provenance.json").read_text())["device"])
    gp, pp = PRESETS["gpt2-s"], PRESETS["gpt2-s-paper"]
    conf = Run(runs["bf16"]).train
    return (
        f"**What a longer reproduction costs.** One `{t['model']}` run alone on an H200 trains at "
        f"{speeds.loc['eager', 'median tokens/s']:,.0f} tokens/s eager and "
        f"{speeds.loc['compiled', 'median tokens/s']:,.0f} with `compile=true` "
        f"(×{speeds.loc['compiled', 'ratio']:.2f}, "
        f"`results/{compile_throughput}`), i.e. {target_steps:,} steps in about {minutes['eager']:.0f} or "
        f"{minutes['compiled']:.0f} minutes. Runs sharing a GPU gain no total throughput, so give each run its own "
        f"GPU: `lpfa.launch` places them round-robin on the machine's GPUs (`--gpus`; {RERUN_PAGE} gives the "
        "commands), or `rerun=True` on this page.\n\n"
        f"**The paper's scale.** The paper's recipe (`gpt2-s-paper`: GPT-2 small, T = {pp['block_size']}, "
        f"{tokens_per_step(pp):,} tokens/step, peak lr {pp['lr']:g}, {pp['warmup_steps']:,} warmup steps) explodes "
        f"after about {PAPER_EXPLOSION_STEP:,} steps, {paper_explosion_tokens() / 1e9:.1f}B tokens. With the `paper` "
        f"policy at {g_tps:,.0f} tokens/s on one {g_gpu} (GPT-2 S, eager, `results/{throughput}/{g_run.name}`), one "
        f"such run takes "
        f"{paper_explosion_tokens() / g_tps / 3600:.1f} GPU-hours, and a BF16/FP32/SFA set of three takes "
        f"{3 * paper_explosion_tokens() / g_tps / 3600:.0f} GPU-hours, on OpenWebText prepared as nanoGPT prepares it "
        f"(`data=` a folder with train.bin and val.bin). Our paper-recipe BF16 twin reached its explosion in "
        f"{Run(runs['bf16']).summary['wall_s'] / 60:.0f} minutes at {tokens_per_step(conf):,} tokens/step. The "
        f"`gpt2-s` preset is a cheaper proxy, not the paper's setting: {tokens_per_step(gp):,} tokens/step and "
        f"nanoGPT's lr {gp['lr']:g}.")


# ----------------------------------------------------------------------------------------------------------------
# How often: every committed run of the recipe, BF16 against FP32, as a survival curve

RECIPE = "gpt2-s-paper"
# a run of the recipe carries no change of the model, the optimizer or the attention's rounding but its precision
UNCHANGED = {"optimizer": "adamw", "qk_norm": False, "gated_attn": False, "qk_clip": 0.0, "delta_dose": 1.0,
             "layer_policies": {}, "fp32_heads": {}, "sr_reseed": False}
PRECISION_OF = {("lpfa", "paper"): "bf16", ("sdpa_fp32", None): "fp32", ("lpfa", "fp32_split"): "fp32"}


def recipe_fates(root=None) -> pd.DataFrame:
    """Every committed run of the paper's GPT-2 S recipe with the paper's BF16 attention or FP32 attention and nothing
    else changed (:data:`UNCHANGED`), one row each (``experiment/run/label``): ``precision``, ``seed``, ``compiled``,
    ``steps``, ``exploded``, ``explosion step``, ``runaway step`` (:meth:`lpfa.run.Run.verdict`), and ``end``: the
    explosion step, or the last step of a run that did not explode (its censoring step)."""
    base = Path(root) if root else results_dir()
    rows = []
    for conf in sorted(base.glob("*/*/*/config.json")):
        run = Run(conf.parent)
        t = run.train
        if any(t.get(k, v) != v for k, v in UNCHANGED.items()) or setting_of(t) != setting_of(PRESETS[RECIPE]):
            continue
        precision = (PRECISION_OF.get((t.get("attn_backend"), t.get("attn_policy")))
                     or PRECISION_OF.get((t.get("attn_backend"), None)))
        if precision is None:
            continue
        v = run.verdict()
        rows.append({"run": f"{conf.parent.parent.parent.name}/{conf.parent.parent.name}/{conf.parent.name}",
                     "precision": precision, "seed": t["seed"], "compiled": bool(t.get("compile")), "steps": v["steps"],
                     "exploded": bool(v["exploded"]), "explosion step": v["explosion_step"],
                     "runaway step": v.get("runaway_step"),
                     "end": v["explosion_step"] if v["exploded"] else v["steps"]})
    return pd.DataFrame(rows).set_index("run") if rows else pd.DataFrame()


def fates_summary(fates: pd.DataFrame) -> pd.DataFrame:
    """:func:`recipe_fates` per attention precision and seed, as page 06 shows it (every run's row is a CSV:
    :func:`full_fates_table`): the runs, how many of them exploded and at which steps, the longest run that stopped
    without exploding, and the earliest logit runaway. Empty when no run is committed."""
    if fates.empty:
        return pd.DataFrame()
    rows = []
    for (precision, seed), g in fates.groupby(["precision", "seed"]):
        quiet, runaway = g.loc[~g.exploded, "steps"], g["runaway step"].dropna()
        rows.append({"precision": precision, "seed": int(seed), "runs": len(g), "exploded": int(g.exploded.sum()),
                     "explosion steps": ", ".join(f"{int(x):,}" for x in sorted(g.loc[g.exploded, "explosion step"])),
                     "longest run without exploding": int(quiet.max()) if len(quiet) else None,
                     "first runaway step": int(runaway.min()) if len(runaway) else None})
    return pd.DataFrame(rows).set_index(["precision", "seed"])


def full_fates_table():
    """The full table behind :func:`fates_summary` for :mod:`lpfa.pages.tables`: :func:`recipe_fates`, one row per
    run, what it is, and the experiments it read."""
    fates = recipe_fates()
    what = ("Page 06's full table: every committed run of the paper's GPT-2 S recipe with the paper's BF16 attention "
            "or FP32 attention and nothing else changed, with whether and when its loss exploded and its logits ran "
            "away (lpfa.pages.loss_explosion.recipe_fates)")
    return fates.drop(columns="end"), what, [f"results/{e}" for e in sorted({r.split("/")[0] for r in fates.index})]


def fates_table_text() -> str:
    """What page 06's table of :func:`fates_summary` shows, with a link to every run's row."""
    from lpfa.pages.tables import link

    return ("The table counts the runs per attention precision and seed; every run's row, with its folder, steps and "
            f"whether it was compiled, is in {link('recipe_fates')}.")


def fate_counts(fates: pd.DataFrame) -> str:
    """:func:`recipe_fates` in one clause: in how many runs, and on how many seeds, the loss exploded with BF16 and
    with FP32 attention, at which steps, and where the other runs stopped without exploding; the page's lead and the
    scorecard's Fig. 2 row both say it so. A seed counts as exploded when one of its runs did."""
    def count(precision: str) -> str:
        g = fates[fates.precision == precision]
        seeds = g.groupby("seed").exploded.any()
        boom = sorted(int(x) for x in g["explosion step"].dropna())
        quiet = g.loc[~g.exploded, "steps"]
        stops = (f"{quiet.min():,}" if quiet.min() == quiet.max() else f"{quiet.min():,} to {quiet.max():,}")
        return (f"in {len(boom)} of {len(g)} {precision.upper()} runs, on {int(seeds.sum())} of {len(seeds)} seeds ("
                + (f"at steps {and_join([f'{x:,}' for x in boom])}; " if boom else "")
                + (f"the other {len(quiet)} stopped without exploding at {stops} steps" if boom and len(quiet) else
                   f"they stopped without exploding at {stops} steps" if len(quiet) else "every one")
                + ")")

    return f"the loss exploded {count('bf16')} and {count('fp32')}"


def horizon_text(fates: pd.DataFrame, horizon: int = HORIZON) -> str:
    """The share of :func:`recipe_fates`' runs whose loss exploded by step ``horizon``, per precision, with the exact
    95% interval (:func:`lpfa.survival.clopper_pearson`), counting only the runs that exploded by then or ran past it
    (:func:`lpfa.survival.failed_within`): a run stopped sooner cannot say. :func:`fig2_verdict` judges by the same
    count; the page's lead and the scorecard's Fig. 2 row both print it."""
    parts = []
    for precision in ("bf16", "fp32"):
        g = fates[fates.precision == precision]
        k, n = failed_within(g["end"], g["exploded"], horizon)
        if n:
            lo, hi = clopper_pearson(k, n)
            parts.append(f"{k} of {n} {precision.upper()} runs (95% interval {lo:.0%}–{hi:.0%})")
        elif len(g):
            parts.append(f"no {precision.upper()} run (none ran that far)")
    short = int(sum((~(fates["exploded"] & (fates["end"] <= horizon)) & (fates["end"] < horizon))))
    return (f"Counting only the runs that exploded by step {horizon:,} or trained past it, the loss exploded by then "
            f"in {and_join(parts)}" + (f"; the other {short} stopped too soon to say" if short else "") + ".")


def fig2_verdict(fates: pd.DataFrame, horizon: int = HORIZON) -> str:
    """Fig. 2's verdict (:data:`lpfa.pages.intro.VERDICTS`) over every committed run of the recipe
    (:func:`recipe_fates`), counting the runs that exploded within ``horizon`` steps or ran that far
    (:func:`lpfa.survival.failed_within`; a run stopped sooner cannot say): "reproduced" when every such BF16 run
    exploded and no FP32 run did, "partly" when some BF16 runs did and no FP32 run, else "not reproduced". The page's
    lead and the scorecard's Fig. 2 row both use it."""
    if fates.empty:
        return "not run"
    bf16, fp32 = fates[fates.precision == "bf16"], fates[fates.precision == "fp32"]
    k, n = failed_within(bf16["end"], bf16["exploded"], horizon)
    if k == 0 or fp32.exploded.any():
        return "not reproduced"
    return "reproduced" if k == n else "partly"


def survival_table(fates: pd.DataFrame) -> pd.DataFrame:
    """The Kaplan–Meier curve of :func:`recipe_fates` per precision (:func:`lpfa.survival.kaplan_meier`), with a last
    row at the longest run's end so that a curve without failures is drawn to where the runs stopped."""
    out = []
    for precision, g in fates.groupby("precision"):
        km = kaplan_meier(g["end"].to_numpy(), g["exploded"].to_numpy())
        end = {"step": int(g["end"].max()), "at_risk": int((g["end"] >= g["end"].max()).sum()), "failed": 0,
               "survival": float(km["survival"].iloc[-1])}
        out.append(pd.concat([km, pd.DataFrame([end])], ignore_index=True).assign(precision=precision))
    return pd.concat(out, ignore_index=True) if out else pd.DataFrame(columns=["step", "survival", "precision"])


def plot_survival(fates: pd.DataFrame):
    """The fraction of runs whose loss has not exploded against the training step, BF16 and FP32 on one plot
    (Kaplan–Meier; a tick marks where a run stopped without exploding)."""
    use_style()
    fig, ax = plt.subplots(figsize=(7, 3.4))
    km = survival_table(fates)
    for precision, g in km.groupby("precision"):
        color = color_of(precision)
        n = int((fates.precision == precision).sum())
        ax.step(g["step"], g["survival"], where="post", color=color, ls=dash_of(precision),
                label=f"{precision.upper()} attention ({n} runs)")
        stops = fates[(fates.precision == precision) & ~fates.exploded]
        for end in stops["end"]:
            s = g[g["step"] <= end]["survival"].iloc[-1]
            ax.plot([end], [s], marker="|", ms=12, mew=2, color=color)
    ax.set_ylim(-0.03, 1.05)
    ax.set_xlabel("training step")
    ax.set_ylabel("fraction of runs\nnot yet exploded")
    ax.set_title("the paper's GPT-2 S recipe, every committed run (| : stopped without exploding)", fontsize=10)
    ax.legend(loc="lower left", fontsize=9)
    return fig


def same_seed_text(fates: pd.DataFrame, precision: str = "bf16") -> str:
    """How far the :func:`recipe_fates` runs of one seed part: for each seed with several ``precision`` runs, where
    each exploded or stopped. Such runs share the data order and the initial weights and differ in how their
    kernels round (eager or compiled, deterministic algorithms or not, and the code's commit). Empty when no seed has
    two runs."""
    if fates.empty:
        return ""
    g = fates[fates.precision == precision]
    parts = []
    for seed, runs in g.groupby("seed"):
        if len(runs) < 2:
            continue
        boom = sorted(int(x) for x in runs["explosion step"].dropna())
        quiet = sorted(int(x) for x in runs.loc[~runs.exploded, "steps"])
        both = bool(boom) and bool(quiet)  # then each group is counted: "4 exploded at ..., and 1 stopped ..."
        fates_of = ([f"{f'{len(boom)} ' if both else ''}exploded at {plural(len(boom), 'step')} "
                     f"{and_join([f'{x:,}' for x in boom])}"] if boom else [])
        if quiet:
            fates_of.append(f"{f'{len(quiet)} ' if both else ''}stopped without exploding at "
                            f"{and_join([f'{x:,}' for x in quiet])} steps")
        parts.append(f"the {len(runs)} {precision.upper()} runs of seed {seed}{':' if both else ''} "
                     + ", and ".join(fates_of))
    if not parts:
        return ""
    return (f"A seed does not fix the step: {'; '.join(parts)}. Runs of one seed see the same batches from the same "
            "initial weights and differ in how their kernels round (eager or compiled, deterministic algorithms or "
            "not, and the code's commit): each "
            "counts as a run here, though not as an independent seed.")


def seed_twins(fates: pd.DataFrame, margin: int = TWIN_MARGIN) -> pd.DataFrame:
    """Per seed with both a BF16 and an FP32 run in :func:`recipe_fates`, whether its FP32 attention trained far
    enough to be a twin: the BF16 step it must pass (the first explosion of the seed's BF16 runs, else the furthest
    one stopped: its censoring step), the FP32 runs' furthest step and whether any exploded, how many steps past the
    BF16 step that is, and ``twin``: true when the FP32 runs went ``margin`` steps past a BF16 explosion, or as far
    as a BF16 run that did not explode, without exploding."""
    rows = []
    for seed, g in fates.groupby("seed"):
        bf16, fp32 = g[g.precision == "bf16"], g[g.precision == "fp32"]
        if bf16.empty or fp32.empty:
            continue
        exploded = bool(bf16.exploded.any())
        target = int(bf16["explosion step"].min()) if exploded else int(bf16["steps"].max())
        furthest = int(fp32["end"].max())
        need = margin if exploded else 0
        rows.append({"seed": seed, "BF16 exploded": exploded, "BF16 step": target,
                     "FP32 runs": len(fp32), "FP32 exploded": bool(fp32.exploded.any()), "FP32 furthest step": furthest,
                     "steps past": furthest - target,
                     "twin": not fp32.exploded.any() and furthest - target >= need})
    return pd.DataFrame(rows).set_index("seed") if rows else pd.DataFrame()


def seed_twins_text(twins: pd.DataFrame, margin: int = TWIN_MARGIN) -> str:
    """:func:`seed_twins` in sentences: on how many seeds the FP32 attention trained ``margin`` steps past the
    seed's BF16 explosion (or as far as its BF16 run that did not explode) without exploding, and how far short each
    other seed stopped."""
    if twins.empty:
        return "No seed of the recipe has both a BF16 and an FP32 run."

    def past(seed, row):
        ref = f"its BF16 explosion at step {row['BF16 step']:,}" if row["BF16 exploded"] else \
            f"its BF16 run's last step, {row['BF16 step']:,}"
        d = row["steps past"]
        return f"seed {seed}, {abs(d):,} {plural(abs(d), 'step')} {'past' if d >= 0 else 'short of'} {ref}"

    good, short = twins[twins.twin], twins[~twins.twin]
    text = (f"An FP32 run is a twin when it trains {margin:,} steps past its seed's first BF16 explosion, or as far as "
            f"a BF16 run that did not explode, without exploding itself. {len(good)} of {len(twins)} seeds have one"
            + (f" ({'; '.join(past(s, r) for s, r in good.iterrows())})" if len(good) else "") + ".")
    if len(short):
        text += (" On the other seeds the FP32 runs stopped too soon to count (" + "; ".join(
            past(s, r) + (", and its FP32 attention exploded" if r["FP32 exploded"] else "")
            for s, r in short.iterrows()) + ").")
    return text


def survival_text(fates: pd.DataFrame, horizon: int = HORIZON) -> str:
    """How often the recipe's loss exploded, per precision: every committed run (:func:`fate_counts`), then the share
    by step ``horizon`` among the runs that can say (:func:`horizon_text`), and how far the runs of one seed part
    (:func:`same_seed_text`). Each run's own row is in the table under it (:func:`fates_summary`, and its CSV)."""
    if fates.empty:
        return "No run of the paper's GPT-2 S recipe is committed."
    same = same_seed_text(fates)
    return capital(fate_counts(fates)) + ". " + horizon_text(fates, horizon) + (" " + same if same else "")


def batch_text(conf: dict, explosion_step: int | None, horizon: int = HORIZON) -> str:
    """What the smaller batch changes (Markdown), from the BF16 run's config ``conf`` against the paper's recipe:
    optimizer steps per token, the tokens the warmup spans, the gradient noise per step (its variance goes as one
    over the batch), and how many times the corpus has been seen by the explosion and by step ``horizon``."""
    paper, ours = tokens_per_step(PRESETS[RECIPE]), tokens_per_step(conf)
    ratio = paper / ours
    warm = conf["warmup_steps"]
    epochs = {s: s * ours / GPU_CORPUS_TRAIN_TOKENS for s in (explosion_step, horizon) if s}
    return (f"The smaller batch is not a free change. At {ours:,} tokens per step the run takes {ratio:.0f}× more "
            f"optimizer steps per token than the paper's {paper:,}; its {warm:,} warmup steps span "
            f"{warm * ours / 1e6:.0f}M tokens instead of {warm * paper / 1e9:.2f}B, so the peak learning rate arrives "
            f"after {ratio:.0f}× less data; each step's gradient is an average over {ratio:.0f}× fewer tokens, so its "
            f"noise variance is about {ratio:.0f}× larger; and the {GPU_CORPUS_TRAIN_TOKENS / 1e6:.1f}M-token corpus "
            "is seen "
            + (f"{epochs[explosion_step]:.1f} times by the explosion at step {explosion_step:,} and " if explosion_step
               else "")
            + f"{epochs[horizon]:.1f} times by step {horizon:,}. A run that "
            "repeats its corpus can memorise it: wherever FP32 and BF16 runs are compared by loss, the evaluation loss "
            "on held-out text is the one to read.")
