"""Train GPT-2 the way the paper does, on one CPU, one GPU or several (``torchrun``).

The recipe (Sec. 3.1): BF16 autocast with FP32 master weights, AdamW (β = 0.9, 0.95, no weight
decay) or Muon, linear warmup then cosine decay (or a constant rate), gradient clipping, gradient
accumulation. Every run sees the same batches for the same ``seed`` (:func:`lpfa.data.batch_starts`),
whatever its attention precision, and records them in ``replay.jsonl`` so another run can replay them.

Command line (a preset, a YAML config file, then ``key=value`` overrides, later ones winning)::

    python -m lpfa.train --preset cpu-smoke out_dir=runs/smoke max_steps=300
    python -m lpfa.train --config my.yaml attn_policy=paper
    torchrun --nproc_per_node=2 -m lpfa.train --preset repro data=/path/to/nanogpt/data

Outputs in ``out_dir``: ``config.json``, ``metrics.jsonl`` (every step; evals and diagnostics too),
``log.txt``, ``replay.jsonl``, ``ckpt/`` (the last good checkpoint, written atomically) and
``summary.json``. A non-finite loss stops the run and keeps the last good checkpoint and all logs; a
wall-clock budget (``time_budget_s``) or a file named ``STOP`` in ``out_dir`` ends it cleanly with a
checkpoint; ``resume=true`` continues exactly where the checkpoint left off (``config.json`` keeps the first
start's record and lists each resume, with what it changed, under ``resumes``). ``on_warning`` (with
``diag_interval``) feeds each diagnostics record to the early-warning thresholds (:class:`lpfa.monitor.Alarm`) and
logs, stops, or switches the flagged layer to SFA or FP32 attention; a switch is kept in the checkpoints.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import inspect
import json
import math
import os
import re
import shutil
import sys
import time
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import yaml
from torch.nn.parallel import DistributedDataParallel as DDP
from tqdm.auto import tqdm

from lpfa import data as lpfa_data
from lpfa.attention import PRESETS as ATTN_PRESETS
from lpfa.attention.policy import reseeded
from lpfa.checkpoints import ARCHITECTURE_FIELDS, load_checkpoint, save_checkpoint
from lpfa.data import drop_partial_line
from lpfa.diagnostics import probe_record
from lpfa.explosion import explosion_step
from lpfa.model import ATTN_BACKENDS, GPT, SIZES, GPTConfig, unwrap
from lpfa.monitor import Alarm, read_thresholds, record_frame
from lpfa.params import Param, boolean, dict_of, integer, list_of, real, text
from lpfa.provenance import provenance, write_json
from lpfa.run import autocast as amp_context
from lpfa.run import layer_precision, read_run_config, run_verdict


@dataclass
class TrainConfig:
    """Every setting of a run. The comment after each field (continued on lines of ``#`` and two spaces) is its
    meaning, which ``--help`` shows; :data:`FIELD_CHECKS` says what each field accepts, and ``__post_init__`` checks
    every field against it."""

    # data
    data: str = "embedded"  # "embedded" (the corpus shipped with lpfa) or a folder with train.bin/val.bin
    tokenizer: str = "auto"  # for "embedded": auto, gpt2 or bytes
    # model
    model: str = "tiny"  # a size from lpfa.model.SIZES
    block_size: int = 128  # tokens per sequence (T)
    attn_backend: str = "lpfa"  # lpfa (attn_policy decides; the FP32 twin is attn_policy=fp32_split), sdpa,
    #  sdpa_fp32 or math
    attn_policy: str = "fa2"  # a preset of lpfa.attention.PRESETS
    layer_policies: dict = field(default_factory=dict)  # {layer: preset or backend} for single layers, e.g. {1: paper}
    fp32_heads: dict = field(default_factory=dict)  # {layer: [heads]} computed entirely in FP32
    delta_dose: float = 1.0  # dose k of δ's error in the backward: δ_ref + k·s·(δ − δ_ref) (the dose-response
    #  experiments); 1 = off
    delta_dose_sign: str = "bias"  # s: bias (+1, the policy's own error) or control (a random ±1 per row)
    delta_dose_layers: list = field(default_factory=list)  # layers whose δ is dosed; [] = every lpfa layer
    qk_norm: bool = False  # LayerNorm on q and k per head
    gated_attn: bool = False  # a sigmoid output gate per head and channel
    qk_clip: float = 0.0  # QK-clip's tau (Kimi K2's MuonClip): after each step, heads whose largest logit in it
    #  exceeded tau get W_Q and W_K scaled by sqrt(tau / logit); 0 = off
    bias: bool = False  # biases in the Linear and LayerNorm layers (the paper has none)
    dropout: float = 0.0  # dropout probability; 0 = off
    # optimisation
    optimizer: str = "adamw"  # adamw or muon (Muon for 2-D weights, AdamW for the rest)
    lr: float = 1e-3  # peak learning rate (AdamW's; Muon's is muon_lr)
    min_lr: float = 1e-4  # learning rate at max_steps with the cosine schedule
    lr_schedule: str = "cosine"  # cosine (to min_lr at max_steps) or constant, both after linear warmup
    warmup_steps: int = 100  # steps of linear warmup from 0 to lr
    weight_decay: float = 0.0  # decoupled weight decay (AdamW and Muon)
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.95  # AdamW's second-moment decay
    grad_clip: float = 1.0  # clip the gradient norm to this; 0 = off
    muon_lr: float = 0.02  # Muon's peak learning rate (on lr's schedule)
    muon_momentum: float = 0.95  # Muon's momentum
    batch_size: int = 16  # sequences per micro-step, summed over all processes
    grad_accum: int = 1  # micro-steps per optimizer step
    max_steps: int = 300  # optimizer steps to train
    # precision and device
    device: str = "auto"  # auto, cpu, cuda, cuda:N
    dtype: str = "auto"  # autocast dtype: auto (bfloat16 on CUDA, float32 on CPU), bfloat16, float32; float64:
    #  weights too
    compile: bool = False  # torch.compile the model
    compile_mode: str = "default"  # torch.compile's mode: default, reduce-overhead (CUDA graphs), max-autotune or
    #  max-autotune-no-cudagraphs; needs compile=true
    deterministic: bool = False  # the same bits in every process: torch.compile tunes no reduction by timing it
    #  (torch._inductor.config.deterministic), scatters with atomics fall back to deterministic kernels and an op
    #  without one raises (torch.use_deterministic_algorithms), so a compiled run can be replayed from its checkpoints
    #  (lpfa.replay); slower. Eager runs with lpfa attention are deterministic without it
    attn_assume_finite: bool = True  # lpfa attention skips the test of its kernels' results for inf or NaN (the
    #  same bits on finite inputs); a non-finite loss stops the run either way (checked every step)
    sr_reseed: bool = False  # stochastic rounding drawn afresh each step: each SR policy's sr_seed becomes (its
    #  seed + step) mod 2**32 (the stabiliser experiments; else one seed for the run, so a stable value at a stable
    #  position rounds the same way every step); eager only (compile=false)
    # bookkeeping
    out_dir: str = "runs/default"  # the run folder; one that holds a run is refused unless resume=true
    seed: int = 1337  # seed of the data order
    init_seed: int = 1337  # seed of the initial weights
    eval_interval: int = 100  # evaluate every N steps; 0 = only at the end
    eval_batches: int = 10  # validation batches per evaluation
    log_interval: int = 10  # log to the console every N steps (metrics.jsonl gets every step); 0 = off
    ckpt_interval: int = 500  # checkpoint every N steps; 0 = only at the end
    ckpt_history: bool = False  # also keep every interval's checkpoint in ckpt_history/step_NNNNNN (for replays)
    diag_interval: int = 0  # W_Q norms, tie fractions, max logits every N steps; 0 = off
    diag_batch: int = 4  # sequences in the diagnostics batch
    tie_eps: float = 1e-3  # scores within tie_eps of their row's max count as tied (diagnostics)
    time_budget_s: float = 0.0  # wall-clock budget; 0 = none
    stop_at_step: int = 0  # stop cleanly (with a checkpoint) after this many steps, as if killed; 0 = off
    explosion_stop: int = 0  # stop this many steps after the loss explodes (lpfa.explosion's criterion); 0 = never
    on_warning: str = "off"  # when a diagnostics record crosses the early-warning thresholds (lpfa.monitor.Alarm):
    #  off, log, stop, sfa (the flagged layer's policy with SFA from then on) or fp32 (the flagged layer in FP32,
    #  sdpa_fp32); needs diag_interval
    warning_thresholds: str = ""  # a JSON file of thresholds as lpfa.alarms.thresholds() returns them; "" = the
    #  committed ones (lpfa.monitor.THRESHOLDS_FILE, which python -m lpfa.alarms --write learns)
    replay: str = ""  # a replay.jsonl to follow instead of the seeded batch order
    resume: bool = False  # continue the run in out_dir from its checkpoint (ckpt/)
    progress: bool = True  # show a progress bar

    def __post_init__(self):
        for name in ("layer_policies", "fp32_heads"):  # config.json (JSON) keeps int keys as strings
            d = getattr(self, name)
            if isinstance(d, dict):
                setattr(self, name, {int(k) if isinstance(k, str) and k.isdigit() else k: v for k, v in d.items()})
        for f in fields(self):
            setattr(self, f.name, FIELD_CHECKS[f.name].check(f.name, getattr(self, f.name)))
        # what depends on another field
        n_layer, n_head, _ = SIZES[self.model]
        if any(layer >= n_layer for layer in self.layer_policies):
            raise ValueError(f"layer_policies={self.layer_policies!r}: expected layers 0..{n_layer - 1} "
                             f"(model={self.model!r} has {n_layer})")
        for layer, heads in self.fp32_heads.items():
            if layer >= n_layer or any(h >= n_head for h in heads):
                raise ValueError(f"fp32_heads={self.fp32_heads!r}: expected layers 0..{n_layer - 1} and heads "
                                 f"0..{n_head - 1} (model={self.model!r} has {n_layer} layers of {n_head} heads)")
        if any(layer >= n_layer for layer in self.delta_dose_layers):
            raise ValueError(f"delta_dose_layers={self.delta_dose_layers!r}: expected layers 0..{n_layer - 1} "
                             f"(model={self.model!r} has {n_layer})")
        # a layer_policies value is a backend name or an lpfa preset (lpfa.model.GPTConfig.layer_backend)
        backends = {self.attn_backend, *(p if p in ATTN_BACKENDS else "lpfa" for p in self.layer_policies.values())}
        if self.dtype == "float64" and "lpfa" in backends:
            raise ValueError(f"dtype='float64': expected attn_backend sdpa or math in every layer (attn_backend="
                             f"{self.attn_backend!r}, layer_policies={self.layer_policies!r}): lpfa policies take "
                             "bfloat16 or float32")
        if self.on_warning != "off" and not self.diag_interval:
            raise ValueError(f"on_warning={self.on_warning!r}: expected diag_interval > 0 (the warnings are decided on "
                             "the diagnostics records), got diag_interval=0")
        if self.on_warning == "sfa":
            for layer in range(n_layer):  # (a layer on another backend has no policy to add SFA to: it stays as it is)
                name = self.layer_policies.get(layer)
                lpfa_layer = name not in ATTN_BACKENDS if name is not None else self.attn_backend == "lpfa"
                name = name if name is not None else self.attn_policy
                if lpfa_layer and sfa_switch(name, self.block_size) is None:
                    raise ValueError(f"on_warning='sfa': layer {layer}'s policy {name!r} has no SFA preset to switch "
                                     f"to (expected one of {', '.join(repr(b) for b in SFA_SWITCH)}; paper_untiled at "
                                     "block_size <= 512)")
        if self.qk_clip and self.qk_norm:
            raise ValueError(f"qk_clip={self.qk_clip!r}: expected 0 with qk_norm=true (QK-norm's LayerNorm undoes a "
                             "rescale of W_Q and W_K, so QK-clip would do nothing)")
        if self.compile_mode != "default" and not self.compile:
            raise ValueError(f"compile_mode={self.compile_mode!r}: expected compile=true (the mode is torch.compile's)")
        if self.sr_reseed:
            if self.compile:
                raise ValueError("sr_reseed=true: expected compile=false (a new seed is a new policy, which "
                                 "torch.compile would recompile every step)")
            named = (self.attn_policy if self.attn_backend == "lpfa" else None, *self.layer_policies.values())
            lpfa_pols = [n for n in named if n is not None and n not in ATTN_BACKENDS]
            if not any(getattr(ATTN_PRESETS.get(n), "stochastic", None) for n in lpfa_pols):
                raise ValueError("sr_reseed=true: expected a policy with stochastic rounding (e.g. "
                                 f"attn_policy=paper_sr), got attn_backend={self.attn_backend!r}, "
                                 f"attn_policy={self.attn_policy!r}, layer_policies={self.layer_policies!r}")
        if self.lr_schedule == "cosine" and self.min_lr > self.lr:
            raise ValueError(f"min_lr={self.min_lr!r}: expected a number <= lr ({self.lr!r}): the cosine schedule "
                             "decays from lr to min_lr")


ON_WARNING = ("off", "log", "stop", "sfa", "fp32")
SFA_SWITCH = {"paper": "paper_sfa", "fa2": "fa2_sfa", "paper_sfa": "paper_sfa", "fa2_sfa": "fa2_sfa"}


def reseed_stochastic_rounding(model: GPT, step: int) -> None:
    """``sr_reseed``: each layer whose policy rounds stochastically gets its configured policy with ``sr_seed`` =
    (that seed + ``step``) mod 2³², so that step's rounding is drawn afresh (reproducibly: a function of the step)."""
    for i, block in enumerate(model.transformer.h):
        base = model.config.policy(i)
        if base is not None and base.stochastic:
            block.attn.policy = reseeded(base, step)


def sfa_switch(name: str, block_size: int) -> str | None:
    """The preset ``on_warning="sfa"`` switches a layer running preset ``name`` to: the same rounding with SFA (Eq. 6).
    ``paper_untiled`` takes ``paper_sfa`` while the sequence fits one of the paper's 512-key blocks (the same blocks
    then). None where there is no such preset."""
    if name == "paper_untiled":
        return "paper_sfa" if block_size <= 512 else None
    return SFA_SWITCH.get(name)


def recorded_config(run) -> TrainConfig:
    """The TrainConfig a run folder recorded (an :class:`lpfa.run.Run`); fields a newer lpfa added take their
    defaults, and a recorded value no longer accepted is a one-line error naming the file."""
    known = {f.name for f in fields(TrainConfig)}
    try:
        return TrainConfig(**{k: v for k, v in run.train.items() if k in known})
    except ValueError as e:
        raise ValueError(f"{run.path / 'config.json'}: {e}") from e


COMPILE_MODES = ("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs")  # torch.compile's modes

# What each TrainConfig field accepts (its declared type, and the range or choices that make sense)
FIELD_CHECKS: dict[str, Param] = {
    "data": text(nonempty=True),
    "tokenizer": text(*lpfa_data.TOKENIZERS),
    "model": text(*SIZES),
    "block_size": integer(1),
    "attn_backend": text(*ATTN_BACKENDS),
    "attn_policy": text(*ATTN_PRESETS),
    "layer_policies": dict_of(integer(0), text(*ATTN_PRESETS, *(b for b in ATTN_BACKENDS if b != "lpfa"))),
    "fp32_heads": dict_of(integer(0), list_of(integer(0), nonempty=False)),
    "delta_dose": real(0),
    "delta_dose_sign": text("bias", "control"),
    "delta_dose_layers": list_of(integer(0), nonempty=False),
    "qk_norm": boolean(),
    "gated_attn": boolean(),
    "qk_clip": real(0),
    "bias": boolean(),
    "dropout": real(0, 1, hi_open=True),
    "optimizer": text("adamw", "muon"),
    "lr": real(0, lo_open=True),
    "min_lr": real(0),
    "lr_schedule": text("cosine", "constant"),
    "warmup_steps": integer(0),
    "weight_decay": real(0),
    "beta1": real(0, 1, hi_open=True),
    "beta2": real(0, 1, hi_open=True),
    "grad_clip": real(0),
    "muon_lr": real(0, lo_open=True),
    "muon_momentum": real(0, 1, hi_open=True),
    "batch_size": integer(1),
    "grad_accum": integer(1),
    "max_steps": integer(1),
    "device": Param("auto, cpu, cuda or cuda:N",
                    lambda v: isinstance(v, str) and re.fullmatch(r"auto|cpu|cuda(:\d+)?", v) is not None),
    "dtype": text("auto", "bfloat16", "float32", "float64"),
    "compile": boolean(),
    "compile_mode": text(*COMPILE_MODES),
    "deterministic": boolean(),
    "attn_assume_finite": boolean(),
    "sr_reseed": boolean(),
    "out_dir": text(nonempty=True),
    "seed": integer(0),
    "init_seed": integer(0),
    "eval_interval": integer(0),
    "eval_batches": integer(1),
    "log_interval": integer(0),
    "ckpt_interval": integer(0),
    "ckpt_history": boolean(),
    "diag_interval": integer(0),
    "diag_batch": integer(1),
    "tie_eps": real(0),
    "time_budget_s": real(0),
    "stop_at_step": integer(0),
    "explosion_stop": integer(0),
    "on_warning": text(*ON_WARNING),
    "warning_thresholds": text(),
    "replay": text(),
    "resume": boolean(),
    "progress": boolean(),
}

PRESET_HELP = {
    "cpu-smoke": "the book's CPU default: a tiny model on the embedded corpus, a few minutes on 2 cores",
    "repro": "a smaller model whose BF16 logits run away within a GPU run: 8 layers, d = 512, T = 512, "
             "16k tokens/step, flat lr 2e-3 after 200 warmup steps, AdamW (0.9, 0.95), no weight decay, clip 1.0, "
             "paper semantics untiled",
    "gpt2-s": "GPT-2 small at the paper's sequence length",
    "gpt2-s-paper": "the paper's own recipe (Sec. 3.1): GPT-2 small, T = 1024, 524,288 tokens/step, AdamW (0.9, 0.95), "
                    "no weight decay, clip 1.0, peak lr 1e-3 after 2,000 warmup steps, cosine to 1e-5 over 600k steps",
}
PRESETS: dict[str, dict] = {  # what each one is: PRESET_HELP
    "cpu-smoke": dict(model="tiny", block_size=128, batch_size=16, max_steps=300, lr=2e-3, min_lr=2e-4,
                      warmup_steps=30, eval_interval=100, eval_batches=8, ckpt_interval=0, attn_policy="fa2"),
    "repro": dict(model="repro", block_size=512, batch_size=32, lr=2e-3, min_lr=2e-3, lr_schedule="constant",
                  warmup_steps=200, max_steps=20000, attn_policy="paper_untiled", eval_interval=500,
                  diag_interval=100, ckpt_interval=2000, log_interval=100),
    "gpt2-s": dict(model="gpt2-s", block_size=1024, batch_size=16, grad_accum=4, lr=6e-4, min_lr=6e-5,
                   warmup_steps=700, max_steps=20000, attn_policy="paper", eval_interval=500, diag_interval=200,
                   ckpt_interval=2000, log_interval=50),
    "gpt2-s-paper": dict(model="gpt2-s", block_size=1024, batch_size=16, grad_accum=32, lr=1e-3, min_lr=1e-5,
                         lr_schedule="cosine", warmup_steps=2000, max_steps=600_000, weight_decay=0.0, grad_clip=1.0,
                         attn_policy="paper", eval_interval=500, diag_interval=200, ckpt_interval=2000,
                         log_interval=50),
}
# the fields most runs change: the short --help lists these (--help-all every field)
COMMON_FIELDS = ("data", "model", "attn_policy", "max_steps", "batch_size", "lr", "device", "out_dir", "diag_interval",
                 "on_warning", "resume")
# nanoGPT's names for TrainConfig fields, for the hint after an unknown one
NANOGPT_NAMES = {"learning_rate": "lr", "max_iters": "max_steps", "lr_decay_iters": "max_steps",
                 "warmup_iters": "warmup_steps", "gradient_accumulation_steps": "grad_accum",
                 "eval_iters": "eval_batches", "dataset": "data", "decay_lr": "lr_schedule", "init_from": "resume",
                 "n_layer": "model", "n_head": "model", "n_embd": "model"}


# --------------------------------------------------------------------------------------------
# Configuration from presets, files and key=value overrides
# --------------------------------------------------------------------------------------------
def field_help() -> dict[str, str]:
    """``{field: meaning}``: the comment after each field in TrainConfig's source (what ``--help`` shows), with the
    comment lines under it that begin with ``#`` and two spaces (its continuation) joined to it."""
    try:
        src = inspect.getsource(TrainConfig)
    except (OSError, TypeError):  # no source (a frozen install): no meanings
        return {}
    out, last = {}, None
    for line in src.splitlines():
        m = re.match(r"^\s+(\w+): [\w\[\], ]+ = .*?  # (.*)$", line)
        more = re.match(r"^\s+#  +(.*)$", line)
        if m:
            last = m[1]
            out[last] = m[2]
        elif more and last is not None:
            out[last] += " " + more[1]
        else:
            last = None
    return out


def _number(v):
    """A string that reads as a number, as that number (YAML 1.1 reads "3e-4" as a string); anything else as it is."""
    if isinstance(v, str):
        for cast in (int, float):
            try:
                return cast(v)
            except ValueError:
                pass
    return v


def parse_overrides(items: list[str]) -> dict:
    """``["lr=3e-4", "layer_policies={1: paper}"]`` → typed dict. Values are read as YAML, except that a
    string field takes the text as written (``out_dir=123`` is the folder "123"), a bool field only ``true`` or
    ``false``, and a number field a string that reads as a number."""
    types = {f.name: f.type for f in fields(TrainConfig)}
    out = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"{item!r}: expected key=value (a TrainConfig field and its value, e.g. lr=3e-4)")
        key, val = item.split("=", 1)
        key = key.strip()
        if types.get(key) == "str":
            v = val
        elif types.get(key) == "bool":
            v = {"true": True, "false": False}.get(val.strip().lower(), val)  # YAML 1.1 would take yes, on, ... too
        else:
            try:
                v = _number(yaml.safe_load(val))
            except yaml.YAMLError as e:
                why = getattr(e, "problem", None) or e
                raise ValueError(f"{key}={val!r}: expected a YAML value, but it does not parse ({why}); quote the "
                                 "whole item in the shell if it has spaces, e.g. 'layer_policies={1: paper}'") from e
        out[key] = v
    return out


def _check_preset(name, where: str = "") -> dict:
    if not isinstance(name, str) or name not in PRESETS:
        raise ValueError(f"preset={name!r}{where}: expected one of {', '.join(PRESETS)}")
    return PRESETS[name]


def make_config(preset: str | None = None, config_file: str | None = None,
                overrides: dict | None = None) -> TrainConfig:
    """TrainConfig from a preset, then a YAML/JSON file, then overrides (later ones win). Every mistake is a
    ValueError or FileNotFoundError of one line naming the field, the value and what is expected."""
    d: dict = {}
    source: dict = {}  # field -> the file that set it, for the message
    if preset is not None:
        d.update(_check_preset(preset))
    if config_file is not None:
        path = Path(config_file)
        if not path.is_file():
            raise FileNotFoundError(f"config={config_file!r}: expected a YAML file of TrainConfig fields; "
                                    f"{'it is a folder' if path.is_dir() else 'no such file'}")
        try:
            loaded = yaml.safe_load(path.read_text())
        except (yaml.YAMLError, UnicodeDecodeError) as e:
            mark = getattr(e, "problem_mark", None)
            why = f"{getattr(e, 'problem', None)} at line {mark.line + 1}" if mark else " ".join(str(e).split())
            raise ValueError(f"config={config_file!r}: expected a YAML file of TrainConfig fields, but it does not "
                             f"parse ({why})") from e
        loaded = {} if loaded is None else loaded
        if not isinstance(loaded, dict):
            raise ValueError(f"config={config_file!r}: expected a mapping of TrainConfig fields (field: value), "
                             f"got a {type(loaded).__name__}")
        loaded = {str(k): v for k, v in loaded.items()}
        if "preset" in loaded:
            d.update(_check_preset(loaded.pop("preset"), f" (in {config_file})"))
        types = {f.name: f.type for f in fields(TrainConfig)}
        loaded = {k: _number(v) if types.get(k) in ("int", "float") else v for k, v in loaded.items()}
        d.update(loaded)
        source = {k: config_file for k in loaded}
    overrides = overrides or {}
    d.update(overrides)
    for k in overrides:
        source.pop(k, None)
    names = [f.name for f in fields(TrainConfig)]
    for key in d:
        if key not in names:
            where = f" (in {source[key]})" if key in source else ""
            close = NANOGPT_NAMES.get(key) or next(iter(difflib.get_close_matches(key, names, n=1)), None)
            raise ValueError(f"{key}={d[key]!r}{where}: unknown TrainConfig field; expected one of the fields "
                             "`python -m lpfa.train --help-all` lists" + (f" (did you mean {close}?)" if close else ""))
    try:
        return TrainConfig(**d)
    except ValueError as e:
        name = str(e).split("=", 1)[0]
        if name in source:
            raise ValueError(f"{e} (set in {source[name]})") from e
        raise


# --------------------------------------------------------------------------------------------
# Pieces of the loop
# --------------------------------------------------------------------------------------------
def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warmup over ``warmup_steps``, then cosine to ``min_lr`` at ``max_steps`` (or constant)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    frac = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * frac)) * (cfg.lr - cfg.min_lr)


def build_optimizers(model: GPT, cfg: TrainConfig) -> list[torch.optim.Optimizer]:
    """AdamW for everything, or Muon for the 2-D weights of the blocks and AdamW for the rest."""
    params = [p for p in model.parameters() if p.requires_grad]
    adam = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return [torch.optim.AdamW(params, **adam)]
    if not hasattr(torch.optim, "Muon"):
        raise RuntimeError("optimizer=muon needs torch.optim.Muon (PyTorch >= 2.9)")
    hidden = [p for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("transformer.h.")]
    ids = {id(p) for p in hidden}
    rest = [p for p in params if id(p) not in ids]
    muon = torch.optim.Muon(hidden, lr=cfg.muon_lr, momentum=cfg.muon_momentum, weight_decay=cfg.weight_decay)
    return [muon, torch.optim.AdamW(rest, **adam)]


def model_config(cfg: TrainConfig, vocab_size: int) -> GPTConfig:
    """The model ``cfg`` trains, for a vocabulary of ``vocab_size`` (padded to a multiple of 64 by :func:`train`)."""
    return GPTConfig.from_size(
        cfg.model, vocab_size=vocab_size, block_size=cfg.block_size, dropout=cfg.dropout, bias=cfg.bias,
        attn_backend=cfg.attn_backend, attn_policy=cfg.attn_policy, layer_policies=cfg.layer_policies,
        fp32_heads=cfg.fp32_heads, qk_norm=cfg.qk_norm, gated_attn=cfg.gated_attn, delta_dose=cfg.delta_dose,
        delta_dose_sign=cfg.delta_dose_sign, delta_dose_layers=cfg.delta_dose_layers,
        attn_assume_finite=cfg.attn_assume_finite,
    )


def _device(name: str, local_rank: int) -> str:
    """The torch device of ``device=name`` for this process, or a one-line error when there is no such GPU."""
    if name == "auto":
        return f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            why = ("this torch build has no CUDA" if torch.version.cuda is None else "no CUDA GPU is visible")
            raise ValueError(f"device={name!r}: expected a CUDA GPU, but {why} (torch {torch.__version__}); "
                             "use device=auto or device=cpu")
        index = local_rank if name == "cuda" else int(name.split(":")[1])
        if index >= torch.cuda.device_count():
            raise ValueError(f"device={name!r}: expected a GPU index below {torch.cuda.device_count()}, "
                             f"the number of GPUs this process sees")
        return f"cuda:{index}"
    return name


def _resume_checkpoint(cfg: TrainConfig, mcfg: GPTConfig, ckpt_dir: Path, device: str):
    """The checkpoint that ``resume=true`` continues from, once it is known to fit this config: otherwise a
    one-line error naming the field whose change would not fit its weights or optimizer state."""
    try:
        ck = load_checkpoint(ckpt_dir, map_location=device)
    except (OSError, ValueError) as e:
        raise ValueError(f"resume=true: {e}") from e
    saved = ck.train_config
    for name in ("model", "block_size", "optimizer", "bias", "qk_norm", "gated_attn"):
        if name in saved and saved[name] != getattr(cfg, name):
            raise ValueError(f"{name}={getattr(cfg, name)!r}: expected {saved[name]!r}, the value the checkpoint "
                             f"{ckpt_dir} was trained with (resume=true continues a run as it was; another out_dir "
                             "starts a new one)")
    for name in ARCHITECTURE_FIELDS:  # what the fields above do not cover: the vocabulary, which comes with the data
        if ck.config["model"].get(name) != getattr(mcfg, name):
            field_name = "data" if name == "vocab_size" else "model"
            raise ValueError(f"{field_name}={getattr(cfg, field_name)!r}: gives {name} {getattr(mcfg, name)!r}, "
                             f"but the checkpoint {ckpt_dir} has {ck.config['model'].get(name)!r} (resume with the "
                             "data and tokenizer the run started with)")
    n_opt = 2 if cfg.optimizer == "muon" else 1
    if not isinstance(ck.extra_state, dict) or len(ck.extra_state.get("optimizers") or []) != n_opt:
        raise ValueError(f"resume=true: the checkpoint {ckpt_dir} holds no optimizer state for "
                         f"optimizer={cfg.optimizer!r} (state.pt, written by lpfa.train): it cannot be resumed")
    return ck


def train_step(model, optimizers: list, cfg: TrainConfig, step: int, batches: list, autocast, world: int = 1,
               before_micro=None, info: dict | None = None) -> tuple[float, float, float]:
    """One optimizer step, the only one written (:mod:`lpfa.replay` replays runs with it, bit for bit): the learning
    rate of ``step`` (:func:`lr_at`; Muon's scaled by muon_lr / lr), forward and backward on each micro-batch of
    ``batches`` (this process's ``(x, y)`` pairs; loss divided by their number; DDP all-reduces on the last), the loss
    averaged over processes, the gradient norm clipped, the optimizers stepped and zeroed unless either is non-finite.
    ``before_micro(i)`` runs before micro-batch i. With ``cfg.qk_clip`` τ, heads whose largest logit exceeded τ get W_Q,
    W_K scaled by √(τ / logit) after the update (:meth:`lpfa.model.GPT.qk_clip_`; ``info["qk_clipped"]`` counts
    them). Returns ``(loss, grad_norm, lr)``."""
    lr = lr_at(cfg, step)
    gpt = unwrap(model)
    if cfg.qk_clip:
        gpt.track_max_logits(True)
        gpt.max_logits(reset=True)
    for opt in optimizers:
        for g in opt.param_groups:
            g["lr"] = cfg.muon_lr * lr / cfg.lr if isinstance(opt, getattr(torch.optim, "Muon", ())) else lr
    loss_sum = None  # the logged loss, summed in float64: no FP32 rounding of its parts
    for micro, (x, y) in enumerate(batches):
        if before_micro is not None:
            before_micro(micro)
        sync = micro == len(batches) - 1
        ctx = model.no_sync() if (world > 1 and not sync) else contextlib.nullcontext()
        with ctx, autocast:
            _, loss = model(x, y)
            (loss / len(batches)).backward()
        loss_sum = loss.detach().double() if loss_sum is None else loss_sum + loss.detach().double()
    loss_mean = loss_sum / len(batches)
    if world > 1:
        dist.all_reduce(loss_mean, op=dist.ReduceOp.AVG)
    gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
    loss_v, gnorm_v = float(loss_mean), float(gnorm)
    if math.isfinite(loss_v) and math.isfinite(gnorm_v):
        for opt in optimizers:
            opt.step()
            opt.zero_grad(set_to_none=True)
        if cfg.qk_clip:  # MuonClip: the logits of the forward just done, applied to the updated weights
            clipped = gpt.qk_clip_(gpt.max_logits(), cfg.qk_clip)
            if info is not None:
                info["qk_clipped"] = clipped
    return loss_v, gnorm_v, lr


class RunWriter:
    """Files of one run: metrics, log, summary; only rank 0 writes."""

    def __init__(self, out_dir: Path, rank: int):
        self.out_dir, self.rank = out_dir, rank
        self.tb = None
        if rank == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
            try:  # TensorBoard when installed (an optional dependency: imported here), next to metrics.jsonl
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(out_dir / "tensorboard"))
            except Exception:
                self.tb = None
        self.t0 = time.time()

    def metric(self, rec: dict) -> None:
        if self.rank == 0:
            with open(self.out_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")
            if self.tb is not None:
                for k, v in rec.items():
                    if k != "step" and isinstance(v, (int, float)):
                        self.tb.add_scalar(k, v, rec["step"])

    def log(self, msg: str) -> None:
        if self.rank == 0:
            line = f"[{time.strftime('%H:%M:%S')} +{time.time() - self.t0:7.1f}s] {msg}"
            with open(self.out_dir / "log.txt", "a") as f:
                f.write(line + "\n")
            tqdm.write(line, file=sys.stderr)

    def summary(self, rec: dict) -> None:
        if self.rank == 0:
            write_json(self.out_dir / "summary.json", rec)


def _dist_setup():
    """(rank, world_size, local_rank) from torchrun's environment; initialises the process group."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, 0
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    return dist.get_rank(), world, int(os.environ.get("LOCAL_RANK", "0"))


def _stop_requested(out_dir: Path, world: int, device: str) -> bool:
    """Whether ``out_dir/STOP`` exists; under DDP every rank gets the same answer (one tiny all-reduce)."""
    stop = (out_dir / "STOP").exists()
    if world > 1:
        t = torch.tensor(float(stop), device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        stop = bool(t.item())
    return stop


# --------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------
def _alarm(cfg: TrainConfig):
    """The :class:`lpfa.monitor.Alarm` of ``on_warning`` (None when it is off), with ``warning_thresholds``'
    thresholds, else the committed ones."""
    if cfg.on_warning == "off":
        return None
    thresholds = read_thresholds(cfg.warning_thresholds, "warning_thresholds") if cfg.warning_thresholds else None
    return Alarm(thresholds)


def _act_on_warnings(alarm, step: int, record: dict, model: GPT, cfg: TrainConfig, switched: dict, run) -> bool:
    """``on_warning``: feed one diagnostics record to ``alarm`` and act on each new crossing: log it (always, to the
    log and to metrics.jsonl as ``{"step", "warning": {event, "action"}}``), and with ``stop`` return True; with ``sfa``
    or ``fp32`` switch the flagged layer (once; ``switched`` records it for the checkpoints) to
    :func:`sfa_switch`'s preset or to ``sdpa_fp32``."""
    _, events = alarm.feed(record_frame(step, record, layer_precision(model.config)))
    stop = False
    for ev in events:
        action = "logged"
        if cfg.on_warning == "stop":
            action, stop = "stop", True
        elif cfg.on_warning in ("sfa", "fp32") and ev.layer not in switched:
            mc = model.config
            now = mc.layer_policies.get(ev.layer, mc.attn_policy if mc.attn_backend == "lpfa" else mc.attn_backend)
            if cfg.on_warning == "fp32":
                target = "sdpa_fp32"
            else:  # a layer on another backend has no policy to add SFA to
                target = sfa_switch(now, cfg.block_size) if mc.layer_backend(ev.layer) == "lpfa" else None
            if target is not None and target != now:
                model.set_layer_policy(ev.layer, target)
                switched[ev.layer] = target
                action = f"layer {ev.layer} switched to {target}"
                if cfg.compile:
                    torch._dynamo.reset()  # the compiled graph holds the old policy: trace again
        run.log(f"warning: {ev} ({action})")
        run.metric({"step": step, "warning": {**asdict(ev), "action": action}})
    return stop


def set_deterministic(on: bool) -> None:
    """``deterministic=true`` (:class:`TrainConfig`): no choice between kernels by timing, no atomic scatters and an
    error for an op that has no deterministic algorithm, so that two processes given the same checkpoint and batches
    compute the same bits. Call it before the first CUDA matmul (cuBLAS reads ``CUBLAS_WORKSPACE_CONFIG`` when it
    starts). ``on=False`` leaves everything as it is."""
    if not on:
        return
    # imported here, not at the top: importing Inductor into every run left DDP's gloo process group deadlocked at
    # exit (its worker thread waiting for the GIL that the main thread held while joining it)
    import torch._inductor.config

    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    # an op with no deterministic algorithm raises, naming itself, instead of warning: under warn_only, PyTorch's
    # memory-efficient SDPA (the FP32 twins' sdpa_fp32) keeps its non-deterministic backward, and only warns
    # (results/mechanism/h100-2026-12-06/fp32_mechanism_deterministic/stdout.txt)
    torch.use_deterministic_algorithms(True)
    # which would also fill every new tensor with NaN (a kernel per allocation): not needed for the same bits, since
    # every kernel writes what it later reads (the tests compare the kernels' bits with the reference's)
    torch.utils.deterministic.fill_uninitialized_memory = False
    torch._inductor.config.deterministic = True


def train(cfg: TrainConfig) -> dict:
    """Run training; returns the summary (also written to ``out_dir/summary.json``)."""
    rank, world, local_rank = _dist_setup()
    if world > 1 and cfg.qk_clip:
        raise ValueError(f"qk_clip={cfg.qk_clip!r}: expected 0 with {world} processes (each process records its own "
                         "batches' logits, and DDP would overwrite them with rank 0's: not supported yet)")
    if world > 1 and cfg.on_warning in ("stop", "sfa", "fp32"):
        raise ValueError(f"on_warning={cfg.on_warning!r}: expected 'off' or 'log' with {world} processes (the "
                         "diagnostics run on rank 0 only, so the other ranks would not follow its stop or switch)")
    alarm = _alarm(cfg) if rank == 0 else None  # a bad thresholds file fails here, before anything is written
    out_dir = Path(cfg.out_dir)
    ckpt_dir = out_dir / "ckpt"
    # everything that can be wrong with the config, the data or the run folder is checked before anything is written
    if rank == 0 and not cfg.resume and (ckpt_dir.exists() or (out_dir / "metrics.jsonl").exists()):
        raise FileExistsError(f"out_dir={cfg.out_dir!r}: expected a new run folder, but it already holds a run; pass "
                              "resume=true to continue it, or choose another out_dir")

    # device and precision
    set_deterministic(cfg.deterministic)
    device = _device(cfg.device, local_rank)
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False  # FP32 means FP32 (the paper's FP32 twin)
        torch.backends.cudnn.allow_tf32 = False
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    autocast = amp_context(device, dtype)

    # data
    if cfg.data == "embedded":
        try:
            data_dir = lpfa_data.embedded_token_dir(cfg.tokenizer)
        except RuntimeError as e:  # tokenizer=gpt2 without the GPT-2 BPE files
            raise ValueError(f"tokenizer={cfg.tokenizer!r}: {e}") from e
    else:
        data_dir = Path(cfg.data)
        missing = [name for name in ("train.bin", "val.bin") if not (data_dir / name).is_file()]
        if missing:
            why = f"it has no {' and no '.join(missing)}" if data_dir.is_dir() else "there is no such folder"
            raise FileNotFoundError(f"data={cfg.data!r}: expected a folder with train.bin and val.bin (nanoGPT's "
                                    f"format), but {why}")
    train_tokens, meta = lpfa_data.load_tokens(data_dir, "train")
    val_tokens, _ = lpfa_data.load_tokens(data_dir, "val")
    vocab = meta.get("vocab_size", 50257)
    vocab_padded = ((vocab + 63) // 64) * 64
    if cfg.batch_size % world:
        raise ValueError(f"batch_size={cfg.batch_size!r}: expected a multiple of the number of processes ({world})")
    per_rank = cfg.batch_size // world
    try:  # replay: follow a recorded order (ours is always recorded)
        replay_in = lpfa_data.ReplayLog.open(cfg.replay, data_dir / "train.bin") if cfg.replay else None
    except (OSError, ValueError) as e:
        raise ValueError(f"replay={cfg.replay!r}: {e}") from e

    # model and optimizers
    mcfg = model_config(cfg, vocab_padded)
    ck = _resume_checkpoint(cfg, mcfg, ckpt_dir, device) if cfg.resume else None
    first_conf = None  # on resume: the run's config.json, which keeps its first start's record
    if ck is not None and rank == 0 and (out_dir / "config.json").exists():
        try:
            first_conf = read_run_config(out_dir)
        except ValueError as e:
            raise ValueError(f"resume=true: {e}; move it aside to resume (this start then writes a new one)") from e

    run = RunWriter(out_dir, rank)
    if ck is not None and rank == 0:
        dropped = drop_partial_line(out_dir / "metrics.jsonl")
        if dropped:
            run.log(f"metrics.jsonl ended in a line cut short ({dropped} bytes, when the last start was killed): "
                    "dropped it")
    torch.manual_seed(cfg.init_seed)
    model = GPT(mcfg).to(device, dtype=torch.float64 if dtype == "float64" else torch.float32)
    optimizers = build_optimizers(model, cfg)
    start_step = 0
    if ck is not None:
        model.load_state_dict(ck.model.state_dict())
        for opt, st in zip(optimizers, ck.extra_state["optimizers"]):
            opt.load_state_dict(st)
        start_step = ck.step
        if "torch_rng" in ck.extra_state:
            torch.set_rng_state(ck.extra_state["torch_rng"].cpu())
        run.log(f"resumed from {ckpt_dir} at step {start_step}")
    # layers switched by on_warning before the checkpoint (sfa / fp32) keep their switch
    kept = ((ck.extra_state or {}).get("switched_layers") or {}) if ck else {}
    switched: dict[int, str] = {int(k): v for k, v in kept.items()}
    for layer, name in switched.items():
        model.set_layer_policy(layer, name)
    raw_model = model
    if cfg.compile:
        model = torch.compile(model, mode=None if cfg.compile_mode == "default" else cfg.compile_mode)
    if world > 1:
        model = DDP(model, device_ids=[local_rank] if device.startswith("cuda") else None)

    replay_out = None
    if rank == 0:
        replay_out = lpfa_data.ReplayLog.create(
            out_dir / "replay.jsonl", data_dir / "train.bin",
            {"seed": cfg.seed, "batch_size": cfg.batch_size, "grad_accum": cfg.grad_accum,
             "block_size": cfg.block_size},
        )
        conf = {"train": asdict(cfg), "model": mcfg.to_dict(), "data_dir": str(data_dir), "data_meta": meta,
                "world_size": world, "device": device, "dtype": dtype, "provenance": provenance()}
        if first_conf is not None:  # keep the run's first start; add this one to its resumes
            now = json.loads(json.dumps(conf["train"]))  # as config.json holds it (int keys become strings)
            changed = {k: v for k, v in now.items() if first_conf["train"].get(k) != v}
            first_conf.setdefault("resumes", []).append({"step": start_step, "changed": changed,
                                                         "provenance": conf["provenance"]})
            conf = first_conf
        write_json(out_dir / "config.json", conf)
        run.log(f"model {cfg.model}: {raw_model.num_params() / 1e6:.2f}M parameters, attention {cfg.attn_backend}/"
                f"{cfg.attn_policy}, device {device} × {world}, autocast {dtype}, data {data_dir} "
                f"({meta.get('tokenizer', '?')})")

    def starts_for(step: int) -> list[np.ndarray]:
        if replay_in is not None:
            return replay_in.starts(step)
        return [lpfa_data.batch_starts(cfg.seed, step, m, cfg.batch_size, len(train_tokens), cfg.block_size)
                for m in range(cfg.grad_accum)]

    @torch.no_grad()
    def evaluate() -> float:
        model.eval()
        losses = []
        for i in range(cfg.eval_batches):
            st = lpfa_data.batch_starts(cfg.seed + 1, i, 0, cfg.batch_size, len(val_tokens), cfg.block_size)
            x, y = lpfa_data.get_batch(val_tokens, st[rank * per_rank : (rank + 1) * per_rank], cfg.block_size, device)
            with autocast:
                _, loss = model(x, y)
            losses.append(loss.float())
        val = torch.stack(losses).mean()
        if world > 1:
                dist.all_reduce(val, op=dist.ReduceOp.AVG)
        model.train()
        return float(val)

    def checkpoint(step: int) -> None:
        if rank == 0:
            save_checkpoint(ckpt_dir, raw_model, None, step=step, train_config=asdict(cfg),
                            extra_state={"torch_rng": torch.get_rng_state(),
                                         "optimizers": [o.state_dict() for o in optimizers],
                                         "switched_layers": dict(switched)})
        if world > 1:
                dist.barrier()

    status, step, last = "completed", start_step, {}
    seen: list[tuple[int, float]] = []  # (step, loss) of this start, for explosion_stop
    tokens_per_step = cfg.batch_size * cfg.grad_accum * cfg.block_size
    t_start = time.time()
    bar = tqdm(total=cfg.max_steps, initial=start_step, disable=(rank != 0 or not cfg.progress), unit="step",
               dynamic_ncols=True)
    try:
        for step in range(start_step, cfg.max_steps):
            t0 = time.time()
            starts = starts_for(step)
            if replay_out is not None:
                replay_out.append(step, starts)
            batches = [lpfa_data.get_batch(train_tokens, st[rank * per_rank : (rank + 1) * per_rank], cfg.block_size,
                                           device) for st in starts]
            info: dict = {}
            if cfg.sr_reseed:
                reseed_stochastic_rounding(raw_model, step)
            loss_v, gnorm_v, lr = train_step(model, optimizers, cfg, step, batches, autocast, world, info=info)
            if not (math.isfinite(loss_v) and math.isfinite(gnorm_v)):
                status = "nonfinite"
                run.metric({"step": step, "loss": loss_v, "grad_norm": gnorm_v, "lr": lr})
                run.log(f"step {step}: non-finite loss {loss_v} / grad norm {gnorm_v}: stopping; the last good "
                        f"checkpoint ({ckpt_dir}) and all logs are kept")
                break
            dt = time.time() - t0
            last = {"step": step, "loss": loss_v, "lr": lr, "grad_norm": gnorm_v, "step_s": dt,
                    "tokens_per_s": tokens_per_step / dt, **info}
            run.metric(last)
            bar.update(1)
            bar.set_postfix(loss=f"{loss_v:.3f}")
            if cfg.log_interval and step % cfg.log_interval == 0:
                run.log(f"step {step}: loss {loss_v:.4f}, lr {lr:.2e}, grad norm {gnorm_v:.3f}, "
                        f"{tokens_per_step / dt:,.0f} tok/s")
            done = step + 1
            if cfg.diag_interval and done % cfg.diag_interval == 0 and rank == 0:
                st = lpfa_data.batch_starts(cfg.seed + 2, done, 0, cfg.diag_batch, len(val_tokens), cfg.block_size)
                x, _ = lpfa_data.get_batch(val_tokens, st, cfg.block_size, device)
                raw_model.eval()
                rec = probe_record(raw_model, x, cfg.tie_eps, autocast)
                run.metric({"step": done, "diag": rec})
                raw_model.train()
                if alarm is not None and _act_on_warnings(alarm, done, rec, raw_model, cfg, switched, run):
                    status = "warned"
                    run.log(f"stopped after step {step} on an early warning (on_warning='stop'); resume=true continues")
                    break
            if cfg.eval_interval and done % cfg.eval_interval == 0 and done < cfg.max_steps:
                val = evaluate()
                run.metric({"step": done, "val_loss": val})
                run.log(f"step {done}: val loss {val:.4f}")
            if cfg.ckpt_interval and done % cfg.ckpt_interval == 0 and done < cfg.max_steps:
                checkpoint(done)
                if cfg.ckpt_history and rank == 0:
                    shutil.copytree(ckpt_dir, out_dir / "ckpt_history" / f"step_{done:06d}", dirs_exist_ok=True)
            if cfg.time_budget_s and time.time() - t_start > cfg.time_budget_s:
                status = "time_budget"
                run.log(f"wall-clock budget of {cfg.time_budget_s:.0f} s reached after step {step}")
                break
            if _stop_requested(out_dir, world, device):  # `touch out_dir/STOP` ends a run cleanly, with a checkpoint
                status = "stopped"
                run.log(f"STOP file found after step {step}; resume=true continues (delete the file first)")
                break
            if cfg.stop_at_step and done >= cfg.stop_at_step:
                status = "stopped"
                run.log(f"stopped after step {step} (stop_at_step={cfg.stop_at_step}); resume=true continues")
                break
            if cfg.explosion_stop:  # the verdict is in: free the GPU for the runs still deciding
                seen.append((step, loss_v))
                if done % 50 == 0:
                    exploded_at = explosion_step(np.array([v for _, v in seen]), steps=np.array([s for s, _ in seen]))
                    if exploded_at is not None and done >= exploded_at + cfg.explosion_stop:
                        status = "exploded"
                        run.log(f"the loss exploded at step {exploded_at}; stopping {done - exploded_at} steps later "
                                f"(explosion_stop={cfg.explosion_stop})")
                        break
    except KeyboardInterrupt:
        status = "interrupted"
        run.log("interrupted: writing a checkpoint of the last completed step")
    finally:
        bar.close()
    if status != "nonfinite":
        step = last["step"] + 1 if last else start_step
        checkpoint(step)
    final_val = evaluate() if status != "nonfinite" else None
    if final_val is not None:
        run.metric({"step": step, "val_loss": final_val})
    summary = {"status": status, "steps": step, "last": last, "final_val_loss": final_val,
               "wall_s": time.time() - t_start, "out_dir": str(out_dir)}
    if switched:
        summary["switched_layers"] = switched  # on_warning's switches (each also a "warning" record in metrics.jsonl)
    if rank == 0:
        verdict = run_verdict(out_dir)  # policy, seed, exploded, explosion_step, criterion
        verdict.pop("steps")  # "steps" stays the number of completed steps
        summary.update(verdict)
    run.summary(summary)
    val_text = f"{final_val:.4f}" if final_val is not None else "not measured (the loss went non-finite)"
    run.log(f"{status} at step {step}; final val loss {val_text}")
    if world > 1:
        dist.destroy_process_group()
    return summary


def field_sections() -> dict[str, list[str]]:
    """``{section: [field, ...]}``: TrainConfig's fields under the section comments of its source (``# data``,
    ``# model``, ...), in order; one section "fields" when the source is not there (a frozen install)."""
    try:
        src = inspect.getsource(TrainConfig)
    except (OSError, TypeError):
        return {"fields": [f.name for f in fields(TrainConfig)]}
    out, section = {}, "fields"
    for line in src.splitlines():
        head = re.match(r"^    # (\w[^#]*)$", line)  # a section comment (a continuation is "#" and two spaces)
        name = re.match(r"^    (\w+): [\w\[\], ]+ = ", line)
        if head:
            section = head[1].strip()
        elif name:
            out.setdefault(section, []).append(name[1])
    return out


def _field_lines(names) -> list[str]:
    """Each named field's two lines of help: type, default and meaning, then what it accepts."""
    meaning, by_name = field_help(), {f.name: f for f in fields(TrainConfig)}
    lines = []
    for name in names:
        f = by_name[name]
        default = f.default_factory() if f.default is MISSING else f.default
        lines.append(f"  {f.name} ({f.type}, default {json.dumps(default)}): {meaning.get(f.name, '')}")
        lines.append(f"      expected: {FIELD_CHECKS[f.name].expected}")
    return lines


def help_epilog(full: bool = False) -> str:
    """The end of ``--help``: the presets and the fields people change most (:data:`COMMON_FIELDS`); with ``full``
    (``--help-all``) every TrainConfig field by section (type, default, meaning, what it accepts)."""
    lines = ["presets (--preset NAME):"]
    lines += [f"  {name:<10} {PRESET_HELP[name]}" for name in PRESETS]
    where = "key=value on the command line, field: value in a --config file"
    if full:
        for section, names in field_sections().items():
            lines += ["", f"{section} fields ({where}):", *_field_lines(names)]
        return "\n".join(lines)
    n = len(fields(TrainConfig))
    lines += ["", f"the fields most runs change ({where}):", *_field_lines(COMMON_FIELDS), "",
              f"--help-all lists all {n} fields, by section ({', '.join(field_sections())})."]
    return "\n".join(lines)


def _short_doc() -> str:
    """The module docstring up to its command-line examples: the description of the short ``--help``."""
    parts = __doc__.split("\n\n")
    return "\n\n".join(parts[:4])


class _HelpAll(argparse.Action):
    """``--help-all``: the whole module docstring and every field, by section; then exit."""

    def __init__(self, option_strings, dest, **kw):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="list every TrainConfig field, by section, and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        parser.description, parser.epilog = __doc__, help_epilog(full=True)
        parser.print_help()
        parser.exit()


class _ArgumentParser(argparse.ArgumentParser):
    def error(self, message):  # one line, without the usage block
        self.exit(2, f"error: {message} (python -m lpfa.train --help lists the options, --help-all every field)\n")


def main(argv: list[str] | None = None) -> int:
    """``python -m lpfa.train``. A mistake in the command line, the config, the data or the run folder prints one
    line on stderr and exits with status 2; ``--debug`` raises it with its traceback instead."""
    p = _ArgumentParser(prog="python -m lpfa.train", description=_short_doc(), epilog=help_epilog(),
                        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--help-all", action=_HelpAll)
    p.add_argument("--preset", help="start from a preset (listed below)")
    p.add_argument("--config", help="a YAML file of TrainConfig fields (it may name a preset)")
    p.add_argument("--debug", action="store_true", help="on an error, show its traceback instead of one line")
    p.add_argument("overrides", nargs="*", metavar="key=value",
                   help="TrainConfig fields (listed below); later ones win")
    a, unknown = p.parse_known_args(argv)
    if unknown:
        key = unknown[0].lstrip("-").split("=")[0]
        p.error(f"{unknown[0]}: not an option; TrainConfig fields are set as key=value, e.g. {key}=...")
    try:
        cfg = make_config(a.preset, a.config, parse_overrides(a.overrides))
        summary = train(cfg)
    except (ValueError, OSError) as e:
        if a.debug:
            raise
        print("error: " + " ".join(str(e).split()), file=sys.stderr)
        return 2
    return 0 if summary["status"] in ("completed", "time_budget", "stopped", "exploded") else 1


if __name__ == "__main__":
    raise SystemExit(main())
