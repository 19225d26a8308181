"""Running at scale: does a DDP run train the same model as one GPU, how much faster is it, and what does a run cost?

:func:`compare_runs` lines up two training runs of the same configuration and seed (typically one GPU against
``torchrun`` over several) step by step, reading only each run folder's ``metrics.jsonl`` (through
:func:`lpfa.run.load_metrics`) and ``config.json``. Relative differences are ``|b - a| / |a|`` at every step both runs
logged. It returns a dict:

* ``steps``: DataFrame indexed by step, columns loss_a, loss_b, rel_loss_diff, grad_norm_a, grad_norm_b,
  rel_grad_diff;
* ``agreement``: ``n_steps``; ``loss`` and ``grad_norm``, each ``{"first N": {"max", "median"}, ..., "all": {...}}``
  for N in ``windows`` (the first N common steps); ``threshold``; ``first_step_above``, the first step whose relative
  loss difference exceeds it (None if none does), and ``first_grad_step_above``, the same for the gradient norm;
* ``throughput``: ``skip``; tokens_per_s_a / _b, the median tokens/s of each run over steps >= ``skip`` (the first
  steps include start-up and warm-up); world_a / _b from each config.json's ``world_size``; batch_a / _b (sequences
  per optimizer step, all processes together) and per_gpu_batch_a / _b where the config records them, else None;
  ``speedup`` = b / a and ``efficiency`` = speedup / (world_b / world_a);
* ``val_loss``: ``{"step", "a", "b"}`` at the last evaluation both runs made, or None;
* ``run_a``, ``run_b``: the two folders.

The rest prices runs: tokens per step, wall-clock minutes at a measured speed, the batch that fits a number of steps
in a time budget, and the plan of the paper-scale run (Fig. 2 at the paper's batch, :func:`paper_scale_plan`).
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import pandas as pd
import torch

from lpfa.model import GPT, SIZES, GPTConfig
from lpfa.results import run_dir
from lpfa.run import load_metrics, read_run_config
from lpfa.train import PRESETS


def _run_folder(run_dir: str | Path) -> tuple[Path, dict]:
    """The folder of a training run and its parsed ``config.json``; clear errors if either is missing."""
    d = Path(run_dir)
    if not d.is_dir():
        raise FileNotFoundError(f"run folder {d} does not exist")
    conf = d / "config.json"
    if not conf.is_file():
        raise FileNotFoundError(f"{conf} does not exist: {d} is not a training run folder "
                                f"(has {sorted(p.name for p in d.iterdir())})")
    return d, read_run_config(d, require=())


def _world_size(conf: dict, d: Path) -> int:
    if "world_size" not in conf:
        raise ValueError(f"{d / 'config.json'} has no 'world_size' (written by lpfa.train): "
                         "cannot compute a scaling efficiency")
    return int(conf["world_size"])


def _window_stats(rel, windows) -> dict:
    """``{"first N": {"max", "median"}, ..., "all": {...}}`` of a Series of relative differences."""
    out = {}
    for n in windows:
        head = rel.iloc[:n]
        out[f"first {n}"] = {"max": float(head.max()), "median": float(head.median())}
    out["all"] = {"max": float(rel.max()), "median": float(rel.median())}
    return out


def compare_runs(run_a: str | Path, run_b: str | Path, skip: int = 50, windows=(10, 50),
                 threshold: float = 1e-3) -> dict:
    """Step-by-step agreement and throughput of two runs of one configuration (``run_b`` against ``run_a``): the
    dict ``steps``, ``agreement``, ``throughput``, ``val_loss``, ``run_a``, ``run_b`` of the module docstring, with
    ``windows`` the step windows of the agreement, ``threshold`` its relative loss difference and ``skip`` the first
    step of the throughput. Raises FileNotFoundError or ValueError naming the folder or value that is wrong."""
    (da, ca), (db, cb) = _run_folder(run_a), _run_folder(run_b)
    (ta, va, _), (tb, vb, _) = load_metrics(da), load_metrics(db)
    for d, t in ((da, ta), (db, tb)):
        missing = {"loss", "grad_norm", "tokens_per_s"} - set(t.columns)
        if missing:
            raise ValueError(f"{d / 'metrics.jsonl'} has no per-step {sorted(missing)}")
    common = ta.index.intersection(tb.index).sort_values()
    if not len(common):
        raise ValueError(f"{da} and {db} have no step in common")
    ta, tb = ta.loc[common], tb.loc[common]
    steps = pd.DataFrame({"loss_a": ta["loss"], "loss_b": tb["loss"]})
    steps["rel_loss_diff"] = (steps.loss_b - steps.loss_a).abs() / steps.loss_a.abs()
    steps["grad_norm_a"], steps["grad_norm_b"] = ta["grad_norm"], tb["grad_norm"]
    steps["rel_grad_diff"] = (steps.grad_norm_b - steps.grad_norm_a).abs() / steps.grad_norm_a.abs()
    steps.index.name = "step"

    def first_above(rel):
        above = steps.index[rel > threshold]
        return int(above[0]) if len(above) else None

    agreement = {"n_steps": len(steps), "loss": _window_stats(steps.rel_loss_diff, windows),
                 "grad_norm": _window_stats(steps.rel_grad_diff, windows), "threshold": threshold,
                 "first_step_above": first_above(steps.rel_loss_diff),
                 "first_grad_step_above": first_above(steps.rel_grad_diff)}

    late = common[common >= skip]
    if not len(late):
        raise ValueError(f"no common step >= skip={skip} (the runs end at step {int(common[-1])}): lower skip")
    wa, wb = _world_size(ca, da), _world_size(cb, db)
    tok_a, tok_b = float(ta.loc[late, "tokens_per_s"].median()), float(tb.loc[late, "tokens_per_s"].median())
    speedup = tok_b / tok_a

    def batch(conf, world):
        t = conf.get("train", {})
        if "batch_size" not in t:
            return None, None
        return t["batch_size"] * t.get("grad_accum", 1), t["batch_size"] // world

    (ba, pa), (bb, pb) = batch(ca, wa), batch(cb, wb)
    throughput = {"skip": skip, "tokens_per_s_a": tok_a, "tokens_per_s_b": tok_b, "world_a": wa, "world_b": wb,
                  "batch_a": ba, "batch_b": bb, "per_gpu_batch_a": pa, "per_gpu_batch_b": pb,
                  "speedup": speedup, "efficiency": speedup / (wb / wa)}

    val_loss = None
    if len(va) and len(vb) and "val_loss" in va and "val_loss" in vb:
        both = va.index.intersection(vb.index)
        if len(both):
            s = both.max()
            val_loss = {"step": int(s), "a": float(va.loc[s, "val_loss"]), "b": float(vb.loc[s, "val_loss"])}
    return {"steps": steps, "agreement": agreement, "throughput": throughput, "val_loss": val_loss,
            "run_a": da, "run_b": db}


_LOG_STEP = r"step (\d+): loss ([-+\d.eEnaif]+), lr [^,]+, grad norm [^,]+, ([\d,]+) tok/s"


def log_throughput(log: str | Path):
    """Per logged step of an ``lpfa.train`` log (``log.txt``): DataFrame indexed by step with the loss and the
    tokens/s of that step, for runs whose ``metrics.jsonl`` holds no per-step tokens/s (e.g. short speed trials)."""
    path = Path(log)
    if not path.is_file():
        raise FileNotFoundError(f"log file {path} does not exist")
    rows = [(int(m[1]), float(m[2]), float(m[3].replace(",", ""))) for m in re.finditer(_LOG_STEP, path.read_text())]
    if not rows:
        raise ValueError(f"{path} has no 'step N: loss ..., N tok/s' lines: not an lpfa.train log")
    frame = pd.DataFrame(rows, columns=["step", "loss", "tokens_per_s"])
    return frame.drop_duplicates("step", keep="last").set_index("step")


def compare_throughput(logs: dict, skip: int = 200):
    """One row per named log: steps logged, median tokens/s over logged steps >= ``skip`` (after compilation
    and warm-up) and the ratio to the first log's median."""
    rows = []
    for name, log in logs.items():
        t = log_throughput(log)
        late = t[t.index >= skip]
        if not len(late):
            raise ValueError(f"{log} logs no step >= skip={skip}")
        rows.append({"run": name, "last logged step": int(t.index.max()),
                     "median tokens/s": float(late.tokens_per_s.median())})
    f = pd.DataFrame(rows).set_index("run")
    f["ratio"] = f["median tokens/s"] / f["median tokens/s"].iloc[0]
    return f


def run_price(run_dir: str | Path) -> dict:
    """What one training run of ``run_dir`` costs per step, from its ``metrics.jsonl``: ``compile_s`` (step 0's
    ``step_s``, which holds ``torch.compile``'s compilation), ``step_s`` and ``tokens_per_s`` (medians over steps >= 1),
    ``steps_per_s``, ``steps`` trained, the ``model`` size name and its ``params``; each run alone on its GPU."""
    d, conf = _run_folder(run_dir)
    t = load_metrics(d)[0]
    if "step_s" not in t.columns or len(t.index[t.index >= 1]) == 0:
        raise ValueError(f"{d} logs no per-step 'step_s' after step 0: expected a training run's metrics.jsonl")
    late = t.loc[t.index >= 1]
    model = GPTConfig.from_dict(conf["model"])
    shape = (model.n_layer, model.n_head, model.n_embd)
    step_s = float(late["step_s"].median())
    with torch.device("meta"):  # the parameter count only
        params = GPT(model).num_params()
    return {"model": next((name for name, s in SIZES.items() if s == shape), "x".join(map(str, shape))),
            "params": params, "steps": int(t.index.max()) + 1,
            "compile_s": float(t.loc[0, "step_s"]) if 0 in t.index else float("nan"),
            "step_s": step_s, "steps_per_s": 1.0 / step_s, "tokens_per_s": float(late["tokens_per_s"].median())}


def minutes_for(price: dict, steps: int) -> float:
    """Wall-clock minutes of a run of ``steps`` steps at :func:`run_price` ``price``: compilation, then steps."""
    return (price["compile_s"] + steps * price["step_s"]) / 60


def first_difference(run_a: str | Path, run_b: str | Path, column: str = "loss") -> dict:
    """Are two runs of one configuration and seed bit-identical? ``common_steps`` (steps both logged),
    ``identical_steps`` (how many of them have exactly equal ``column``) and ``first_differing_step``
    (None when every common step agrees): run-to-run determinism, e.g. the same run on another GPU."""
    (da, _), (db, _) = _run_folder(run_a), _run_folder(run_b)
    ta, tb = load_metrics(da)[0], load_metrics(db)[0]
    for d, t in ((da, ta), (db, tb)):
        if column not in t.columns:
            raise ValueError(f"{d} logs no per-step {column!r}")
    common = ta.index.intersection(tb.index).sort_values()
    same = ta.loc[common, column].to_numpy() == tb.loc[common, column].to_numpy()
    return {"common_steps": int(len(common)), "identical_steps": int(same.sum()),
            "first_differing_step": int(common[~same][0]) if (~same).any() else None}


def committed_speed(experiment: str = "compile_throughput", run: str | None = None):
    """:func:`compare_throughput` of the committed eager and compiled logs of ``results/<experiment>/<run>``."""
    d = run_dir(experiment, run)
    return compare_throughput({"eager": d / "compile_false.log", "compiled": d / "compile_true.log"})


PAPER_EXPLOSION_STEP = 6_600
"""About where the paper's BF16 GPT-2 S run explodes (Fig. 2), at the recipe of
``lpfa.train.PRESETS["gpt2-s-paper"]``."""


def paper_explosion_tokens() -> int:
    """Tokens the paper's BF16 run trains before it explodes: :data:`PAPER_EXPLOSION_STEP` steps of its recipe."""
    return PAPER_EXPLOSION_STEP * tokens_per_step(PRESETS["gpt2-s-paper"])


def tokens_per_step(train_conf: dict) -> int:
    """Tokens per optimizer step of a training config (a ``config.json`` "train" dict or a preset)."""
    return int(train_conf["batch_size"] * train_conf["block_size"] * train_conf.get("grad_accum", 1))


def batch_for_steps(tokens_per_s: float, seconds: float, min_steps: int, block_size: int, multiple: int = 8,
                    overhead: float = 0.1) -> int:
    """The largest batch (a multiple of ``multiple`` sequences of ``block_size`` tokens) whose ``min_steps`` steps fit
    in ``seconds`` at ``tokens_per_s``, leaving the fraction ``overhead`` for evaluations and diagnostics: the
    paper-recipe runs' rule, the largest tokens per step that still gives at least 8k steps in one run."""
    for name, v in (("tokens_per_s", tokens_per_s), ("seconds", seconds), ("min_steps", min_steps),
                    ("block_size", block_size), ("multiple", multiple)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"{name}={v!r}: expected a finite number > 0")
    if not 0 <= overhead < 1:
        raise ValueError(f"overhead={overhead!r}: expected a fraction in [0, 1)")
    seqs = tokens_per_s * seconds * (1 - overhead) / min_steps / block_size
    batch = int(seqs // multiple) * multiple
    if batch < multiple:
        raise ValueError(f"{min_steps} steps of {multiple} x {block_size} tokens do not fit in {seconds:.0f} s at "
                         f"{tokens_per_s:,.0f} tokens/s (room for {seqs:.1f} sequences per step)")
    return batch


def wall_minutes(steps: int, tokens_per_s: float, train_conf: dict, runs: int = 1, gpus: int = 1) -> float:
    """Minutes for ``runs`` runs of ``steps`` steps at ``tokens_per_s`` per GPU, placed round-robin on ``gpus``
    GPUs: the busiest GPU holds ceil(runs / gpus) of them, and runs sharing a GPU gain no total throughput."""
    return math.ceil(runs / gpus) * steps * tokens_per_step(train_conf) / tokens_per_s / 60


PAPER_TOKENS_PER_STEP = 524_288
"""The paper's Fig. 2 batch: 512 sequences of 1,024 tokens per optimizer step."""
AUTHORS_TOKENS_PER_STEP = 327_680
"""The batch of the authors' released code: 320 sequences of 1,024 tokens."""


def micro_batches(tokens_per_step: int, gpus: int, block_size: int = 1024, micro_max: int = 16) -> tuple[int, int]:
    """``(micro_batch, grad_accum)`` per GPU with ``gpus · micro_batch · grad_accum · block_size == tokens_per_step``:
    the largest micro-batch up to ``micro_max`` sequences (fewest accumulation steps, so fewest gradient syncs)."""
    for name, v in (("tokens_per_step", tokens_per_step), ("gpus", gpus), ("block_size", block_size),
                    ("micro_max", micro_max)):
        if not (isinstance(v, int) and not isinstance(v, bool) and v > 0):
            raise ValueError(f"{name}={v!r}: expected a positive integer")
    if tokens_per_step % (gpus * block_size):
        raise ValueError(f"tokens_per_step={tokens_per_step:,} is not a whole number of {block_size}-token sequences "
                         f"on each of {gpus} GPUs")
    per_gpu = tokens_per_step // (gpus * block_size)
    micro = max(m for m in range(1, min(micro_max, per_gpu) + 1) if per_gpu % m == 0)
    return micro, per_gpu // micro


def paper_scale_plan(tokens_per_s_per_gpu: float, gpus: int = 8, efficiency: float = 1.0,
                     steps: int = PAPER_EXPLOSION_STEP, budget_s: float = 25 * 60, overhead_s: float = 120.0,
                     block_size: int = 1024, micro_max: int = 16):
    """The paper-scale run (Fig. 2 at the paper's batch) on ``gpus`` GPUs, for the paper's and the authors' tokens per
    step: the micro-batch and accumulation per GPU (:func:`micro_batches`), the seconds per step at
    ``tokens_per_s_per_gpu`` (one GPU's measured speed) × ``gpus`` × ``efficiency`` (DDP scaling, 1 = perfect), the
    minutes to reach ``steps`` (plus ``overhead_s`` for start-up and compilation) and whether that fits ``budget_s``.
    One row per batch; ``chosen`` marks the largest batch that fits (none if neither does)."""
    for name, v in (("tokens_per_s_per_gpu", tokens_per_s_per_gpu), ("budget_s", budget_s)):
        if not (isinstance(v, (int, float)) and math.isfinite(v) and v > 0):
            raise ValueError(f"{name}={v!r}: expected a finite number > 0")
    if not (isinstance(efficiency, (int, float)) and 0 < efficiency <= 1):
        raise ValueError(f"efficiency={efficiency!r}: expected a fraction in (0, 1]")
    rows = []
    for label, tps in (("paper", PAPER_TOKENS_PER_STEP), ("authors' code", AUTHORS_TOKENS_PER_STEP)):
        micro, accum = micro_batches(tps, gpus, block_size, micro_max)
        step_s = tps / (tokens_per_s_per_gpu * gpus * efficiency)
        minutes = (steps * step_s + overhead_s) / 60
        rows.append({"batch": label, "tokens/step": tps, "GPUs": gpus, "micro-batch": micro, "grad_accum": accum,
                     "s/step": step_s, f"minutes to step {steps:,}": minutes, "fits": minutes * 60 <= budget_s})
    plan = pd.DataFrame(rows).set_index("batch")
    fits = plan.index[plan["fits"]]
    plan["chosen"] = plan.index == (fits[0] if len(fits) else None)
    return plan
