"""Page 14, running at scale: one GPU against two (DDP), and the plan of Fig. 2 at the paper's scale.

A committed pair of runs of one configuration and seed, one on one GPU (``one``) and one under ``torchrun`` on two
(``two``), is lined up step by step by :func:`lpfa.scaling.compare_runs`: how closely the losses and gradient norms
agree (rounding noise at first, then the chaotic drift of any two runs whose rounding differs), whether the two train
equally well in the end, and the speedup and scaling efficiency. The paper-scale plan prices the paper's BF16 GPT-2 S
run to its explosion near step :data:`lpfa.scaling.PAPER_EXPLOSION_STEP` (Fig. 2) on several GPUs from one GPU's
committed speed (:func:`lpfa.scaling.paper_scale_plan`).
"""

from __future__ import annotations

import json
import re

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
import torch

from lpfa.data import GPU_CORPUS_TRAIN_TOKENS
from lpfa.params import integer, optional, text
from lpfa.plotting import COLORS, format_table, use_style
from lpfa.results import experiment_rows, load, run_dir
from lpfa.results import what as results_what
from lpfa.scaling import (
    AUTHORS_TOKENS_PER_STEP,
    PAPER_EXPLOSION_STEP,
    PAPER_TOKENS_PER_STEP,
    compare_runs,
    compare_throughput,
    paper_scale_plan,
)

# the notebook's papermill parameters, checked right after its parameters cell (lpfa.params.check_params)
PARAMS = {"experiment": text(nonempty=True), "run": optional(text(nonempty=True)), "skip": integer(0),
    "gpus_at_scale": integer(1), "budget_min": integer(1)}

TIGHT = 1e-5  # a relative loss difference this small is rounding noise
LATE_STEPS = 50  # the last steps over which the two runs' mean losses are compared
PROBE_RUN = ("paper_recipe", "h200x2-2026-11-30")  # the committed one-GPU speed probes of the paper's recipe
PROBE_SKIP = 100  # their median tokens/s over logged steps >= this (after compilation and warm-up)


def ddp_comparison(experiment: str = "ddp", run: str | None = None, skip: int = 50) -> dict:
    """:func:`lpfa.scaling.compare_runs` of the committed pair ``results/<experiment>/<run>/{one,two}`` (``run`` None:
    the latest), the throughput over steps >= ``skip``."""
    folder = run_dir(experiment, run)
    return compare_runs(folder / "one", folder / "two", skip=skip)


def run_labels(cmp: dict) -> dict[str, str]:
    """``{"a": "1 GPU", "b": "2 GPUs"}``: each run of :func:`ddp_comparison` named by its processes."""
    tp = cmp["throughput"]
    return {"a": f"{tp['world_a']} GPU", "b": f"{tp['world_b']} GPUs"}


def provenance_notes(experiment: str = "ddp", run: str | None = None) -> dict[str, str]:
    """The pair's provenance for the page's text: ``ddp_run`` (the run's name) and ``ddp_what`` (what it is, device,
    torch, commit and date)."""
    prov = load(experiment, "provenance.json", run)
    what = results_what(prov)
    return {"ddp_run": f"`{run_dir(experiment, run).name}`",
            "ddp_what": f"{what}. {prov['device']}, torch {prov['torch']}, commit `{prov['git_commit']}`, "
                        f"{prov['date_utc']}"}


def throughput_table(cmp: dict):
    """One row per run of :func:`ddp_comparison` (named by :func:`run_labels`): processes, sequences per step (global
    and per GPU), median tokens/s over steps >= the comparison's ``skip``, speedup and scaling efficiency (1 for the
    first run)."""
    tp, labels = cmp["throughput"], run_labels(cmp)
    return pd.DataFrame([{"processes (GPUs)": tp[f"world_{k}"], "sequences per step (global)": tp[f"batch_{k}"],
                          "sequences per GPU": tp[f"per_gpu_batch_{k}"],
                          f"median tokens/s, steps ≥ {tp['skip']}": round(tp[f"tokens_per_s_{k}"]),
                          "speedup": 1.0 if k == "a" else round(tp["speedup"], 2),
                          "scaling efficiency": 1.0 if k == "a" else round(tp["efficiency"], 2)} for k in "ab"],
                        index=[labels[k] for k in "ab"])


def throughput_display(cmp: dict):
    """:func:`throughput_table` as the page shows it (:func:`lpfa.plotting.format_table`)."""
    return format_table(throughput_table(cmp))


def agreement_table(cmp: dict):
    """The agreement of :func:`lpfa.scaling.compare_runs` as a DataFrame: one row per window of steps, the max and
    median relative difference of the loss and of the gradient norm."""
    ag = cmp["agreement"]
    rows = {}
    for window in ag["loss"]:
        label = f"{window} steps" if window != "all" else f"all {ag['n_steps']} steps"
        rows[label] = {"loss: max": ag["loss"][window]["max"], "loss: median": ag["loss"][window]["median"],
                       "grad norm: max": ag["grad_norm"][window]["max"],
                       "grad norm: median": ag["grad_norm"][window]["median"]}
    return pd.DataFrame(rows).T.rename_axis("relative difference over")


def agreement_display(cmp: dict):
    """:func:`agreement_table` as the page shows it: every relative difference to two significant digits
    (:func:`lpfa.plotting.format_table`)."""
    return format_table(agreement_table(cmp), digits=2)


def plot_compare(cmp: dict, labels=("1 GPU", "2 GPUs"), threshold: float | None = None):
    """Two panels of a :func:`lpfa.scaling.compare_runs` result: the training loss of both runs (``labels``), and the
    relative difference |b - a| / |a| of loss and gradient norm per step on a log axis (steps where the two agree
    exactly have no point there). ``threshold`` (default: the comparison's) is drawn as a dotted line. Both runs have
    one precision, so they take neutral colours, not the precision colours of :data:`lpfa.plotting.COLORS`."""
    use_style()
    s = cmp["steps"]
    threshold = cmp["agreement"]["threshold"] if threshold is None else threshold
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(9.0, 3.6))
    ax1.plot(s.index, s.loss_a, color=COLORS["neutral"], lw=1.8, label=labels[0])
    ax1.plot(s.index, s.loss_b, color=COLORS["other"], lw=1.0, ls="--", label=labels[1])
    ax1.set_xlabel("step")
    ax1.set_ylabel("training loss")
    ax1.legend()
    for col, color, name in (("rel_loss_diff", COLORS["other"], "loss"), ("rel_grad_diff", COLORS["sky"], "grad norm")):
        v = s[col].to_numpy(dtype=float)
        ax2.plot(s.index, np.where(v > 0, v, np.nan), color=color, lw=1, label=name)
    ax2.axhline(threshold, color=COLORS["neutral"], ls=":", lw=1, label=f"threshold {threshold:g}")
    ax2.set_yscale("log")
    ax2.set_xlabel("step")
    ax2.set_ylabel(f"|{labels[1]} − {labels[0]}| / |{labels[0]}|")
    ax2.legend()
    return fig


def agreement_notes(cmp: dict) -> dict[str, str]:
    """How closely the two runs agree, for the page's text: step 0's loss and gradient-norm difference
    (``ag_step0_*``), the windows' median and max (``ag_first10_*``, ``ag_first50_max``, ``ag_all_*``), the last step
    below :data:`TIGHT` (``ag_tight_until``), the first above the threshold, and whether the last
    :data:`LATE_STEPS` steps' mean losses differ by more than two standard errors (``ag_train``, ``ag_n_se``)."""
    ag, s, labels = cmp["agreement"], cmp["steps"], run_labels(cmp)
    s0, late = s.iloc[0], s.iloc[-LATE_STEPS:]
    below = s.index[s.rel_loss_diff >= TIGHT]
    val = cmp["val_loss"]
    n_se = abs(late.loss_a.mean() - late.loss_b.mean()) / (late.loss_a.std() / np.sqrt(len(late)))

    def f(x):
        return f"{x:.1e}"

    return {
        "ag_step0_loss": "agree exactly" if s0.rel_loss_diff == 0 else f"differ by {f(s0.rel_loss_diff)} relative",
        "ag_step0_grad": f(s0.rel_grad_diff),
        "ag_first10_median": f(ag["loss"]["first 10"]["median"]),
        "ag_first10_max": f(ag["loss"]["first 10"]["max"]),
        "ag_first10_in_eps": f"{ag['loss']['first 10']['median'] / np.finfo(np.float32).eps:.0f}",
        "fp32_eps": f(np.finfo(np.float32).eps),
        "bf16_eps": f(torch.finfo(torch.bfloat16).eps),
        "ag_tight": f"{TIGHT:.0e}".replace("e-0", "e-"),
        "ag_tight_until": f"{int(below[0]) - 1 if len(below) else int(s.index[-1])}",
        "ag_first50_max": f(ag["loss"]["first 50"]["max"]),
        "ag_threshold": f"{ag['threshold']:g}",
        "ag_first_above": f"{ag['first_step_above']}",
        "ag_n_steps": f"{ag['n_steps']}",
        "ag_all_max": f(ag["loss"]["all"]["max"]),
        "ag_all_median": f(ag["loss"]["all"]["median"]),
        "ag_grad_first10_median": f(ag["grad_norm"]["first 10"]["median"]),
        "ag_grad_first_above": f"{ag['first_grad_step_above']}",
        "ag_grad_all_max": f(ag["grad_norm"]["all"]["max"]),
        "ag_train": "equally well" if n_se < 2 else "measurably differently (more than two standard errors apart)",
        "ag_late_n": f"{len(late)}",
        "ag_late_loss_a": f"{late.loss_a.mean():.3f} on {labels['a']}",
        "ag_late_loss_b": f"{late.loss_b.mean():.3f} on {labels['b']}",
        "ag_late_std": f"{late.loss_a.std():.3f}",
        "ag_n_se": f"{n_se:.1f}",
        "ag_val": (f"; the final evaluation loss (step {val['step']}) is {val['a']:.3f} and {val['b']:.3f}"
                   if val else ""),
    }


def speed_notes(cmp: dict) -> dict[str, str]:
    """The two runs' throughput for the page's text: ``sp_skip``, per run (``_a``, ``_b``) its label, median tokens/s
    and milliseconds per step (``sp_label_*``, ``sp_tps_*``, ``sp_ms_*``), ``sp_speedup``, ``sp_efficiency``,
    ``sp_gpu_ratio``, ``sp_batch`` (global batch × block), ``sp_per_gpu`` and ``sp_params`` (the model's size, from
    the first run's ``log.txt``)."""
    tp, labels, one = cmp["throughput"], run_labels(cmp), cmp["run_a"]
    params = re.search(r"([\d.]+)M parameters", (one / "log.txt").read_text())
    block = json.loads((one / "config.json").read_text())["train"]["block_size"]
    out = {"sp_skip": f"{tp['skip']}"}
    for k in "ab":
        out[f"sp_label_{k}"] = labels[k]
        out[f"sp_tps_{k}"] = f"{tp[f'tokens_per_s_{k}']:,.0f}"
        out[f"sp_ms_{k}"] = f"{1e3 * tp['batch_a'] * block / tp[f'tokens_per_s_{k}']:.0f}"  # median step time
    return {**out, "sp_speedup": f"{tp['speedup']:.2f}", "sp_efficiency": f"{tp['efficiency']:.0%}",
            "sp_gpu_ratio": f"{tp['world_b'] // tp['world_a']}", "sp_batch": f"{tp['batch_a']} × {block}",
            "sp_per_gpu": f"{tp['per_gpu_batch_b']}", "sp_params": params.group(1) + "M" if params else "all"}


def one_gpu_speed() -> float:
    """One H200's tokens/s for the paper's recipe: the slower of the committed probes of :data:`PROBE_RUN` (median
    over logged steps >= :data:`PROBE_SKIP`, :func:`lpfa.scaling.compare_throughput`)."""
    probe = run_dir(*PROBE_RUN) / "probe"
    logs = {d.name: d / "log.txt" for d in sorted(probe.iterdir()) if (d / "log.txt").is_file()}
    return compare_throughput(logs, skip=PROBE_SKIP)["median tokens/s"].min()


def paper_scale(cmp: dict, gpus: int = 8, budget_min: int = 24):
    """The paper-scale plan (:func:`lpfa.scaling.paper_scale_plan`) on ``gpus`` GPUs at :func:`one_gpu_speed` with
    perfect scaling and at the scaling efficiency measured in ``cmp``, within ``budget_min`` minutes: ``(plan with
    perfect scaling, notes)``, the notes the page's ``ps_*`` text (batches, split per GPU, minutes to the explosion
    step, the verdict, the corpus's epochs and the committed paper-scale runs)."""
    one_gpu, eff = one_gpu_speed(), cmp["throughput"]["efficiency"]
    ideal = paper_scale_plan(one_gpu, gpus=gpus, efficiency=1.0, budget_s=budget_min * 60)
    real = paper_scale_plan(one_gpu, gpus=gpus, efficiency=eff, budget_s=budget_min * 60)
    col = f"minutes to step {PAPER_EXPLOSION_STEP:,}"
    auth = "authors' code"  # the plan's row names
    fits = list(ideal.index[ideal["fits"]])
    verdict = ("both batches fit" if len(fits) == 2 else f"only the {fits[0]} batch fits" if fits
               else "neither batch fits")
    scale_runs = experiment_rows("paper_scale")
    epochs = (f"{PAPER_EXPLOSION_STEP * AUTHORS_TOKENS_PER_STEP / GPU_CORPUS_TRAIN_TOKENS:.0f}–"
              f"{PAPER_EXPLOSION_STEP * PAPER_TOKENS_PER_STEP / GPU_CORPUS_TRAIN_TOKENS:.0f}")
    notes = {
        "ps_paper_tokens": f"{PAPER_TOKENS_PER_STEP:,}", "ps_authors_tokens": f"{AUTHORS_TOKENS_PER_STEP:,}",
        "ps_steps": f"{PAPER_EXPLOSION_STEP:,}", "ps_gpus": f"{gpus}",
        "ps_split": (f"{ideal.loc['paper', 'micro-batch']} sequences per micro-batch × "
                     f"{ideal.loc['paper', 'grad_accum']} accumulation steps with the paper's batch, "
                     f"{ideal.loc[auth, 'micro-batch']} × {ideal.loc[auth, 'grad_accum']} with the authors'"),
        "ps_tps": f"{one_gpu:,.0f}",
        "ps_paper_min": f"{ideal.loc['paper', col]:.0f}", "ps_authors_min": f"{ideal.loc[auth, col]:.0f}",
        "ps_eff": f"{eff:.0%}",
        "ps_paper_min_eff": f"{real.loc['paper', col]:.0f}", "ps_authors_min_eff": f"{real.loc[auth, col]:.0f}",
        "ps_verdict": (f"With perfect scaling {verdict} a {budget_min}-minute run; the scaling above is measured on "
                       f"two GPUs, not on {gpus}."),
        "ps_corpus": f"{GPU_CORPUS_TRAIN_TOKENS / 1e6:.0f}M", "ps_epochs": epochs,
        "ps_status": (f"Committed paper-scale runs: {', '.join(f'`{label}`' for label in scale_runs)}." if scale_runs
                      else "No paper-scale run (8 GPUs at the paper's batch) is committed."),
    }
    return ideal, notes
