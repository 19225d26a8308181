"""``lpfa doctor``: one checkpoint, one probe batch, every link of the paper's failure chain, per layer and head.

The paper's chain (Sec. 3.3): rows of the BF16-rounded scores S with tied maxima give P̄ = exp(S − rowmax)
entries exactly 1 (Fig. 13) → the BF16 rounding of Ō = P̄V is biased where V's values at those keys share a
sign (Fig. 6) → δ = rowsum(dO ∘ O) is biased against its FP32 value (Eq. 4, Fig. 5) → the W_Q gradient error
Σ_T (δ_lp − δ_hp)[T] (PK)[T]ᵀ X[T] adds up along one direction because the rank-1 matrices point the same
way (Figs. 4, 9) → a few heads' W_Q norms grow (Figs. 3, 11), their logits run away and the loss explodes.

:func:`measure_heads` measures each link on the same batch and returns a DataFrame, one row per (layer, head):

* ``max_logit`` — the largest causal attention logit max S, in float64 from the probe's q and k;
* ``tie_fraction_bf16``, ``tie_fraction_fp32`` — causal rows with more than one score within ``eps`` of the row
  max, S rounded to BF16 as the ``paper`` policy rounds it, and in FP32 for contrast (Fig. 13,
  :func:`lpfa.diagnostics.tie_fraction`);
* ``p_bar_ones`` — P̄ entries exactly 1 per row, mean over rows, ``paper`` policy (:func:`lpfa.mechanism.p_bar_ones`;
  with the whole-row max, exact for sequences up to its 512-key block);
* ``wq_spectral_norm``, ``wk_spectral_norm`` — ‖W_Q[h]‖₂ and ‖W_K[h]‖₂ (Figs. 3, 11); ``wq_outlier`` — ‖W_Q[h]‖₂ over
  the median of its layer's heads (Fig. 3's "a few heads" stand out);
* ``delta_err_{paper,fa2}``, ``delta_t_{paper,fa2}`` — δ_lp − δ_hp (:func:`lpfa.mechanism.delta_error`): its mean
  over all rows of the batch and the one-sample t-statistic of that mean (mean / (sd/√rows)); the BF16 side as
  the ``paper`` and ``fa2`` policies compute it, the FP32 side in float64, on the same q, k, v and dO. dO is real:
  the gradient of the batch's mean next-token loss reaching each attention output, as :mod:`lpfa.replay` captures
  it in a training step, so the units of ``delta_err_*`` are those of that loss's gradient (the t-statistic has none);
  ``delta_err_trained``, ``delta_t_trained`` — the same for the BF16 policy an lpfa checkpoint trained with, when it
  is neither of those two (``paper_sr``, ``paper_sfa``, an isolation row's: does the run's own kernel still carry the
  bias? :func:`trained_policy`, named in the report's ``trained_policy``);
* ``rank1_median`` — the median cosine similarity between the rank-1 matrices (PK)[T]ᵀ X[T] of different tokens T
  (:func:`lpfa.mechanism.rank1_similarity`, P the exact softmax), over ``rank1_tokens`` evenly spaced tokens of the
  first sequence (Fig. 9: near 0 for random vectors, large when the errors add up);
* ``v_sign_dominance`` — V's feature columns with one sign on nearly all keys
  (:func:`lpfa.diagnostics.v_sign_dominance`).

:func:`diagnose` adds a ``verdict`` per head: ``runaway`` when ``max_logit`` ≥ the runaway threshold, else
``precursor`` when any measure crosses its precursor threshold, else ``no alarm``. Thresholds come from
:func:`lpfa.alarms.current_thresholds`: the committed ``warning_thresholds.json``, which ``python -m lpfa.alarms
--write`` learns from the committed runs' diagnostics, with their measured false-positive and false-negative rates
(on ``max_logit``, ``tie_fraction_bf16`` and ``wq_outlier``). ``no alarm`` is not safe: next to it the
doctor says how many of the layers that ran away soon after raised no alarm either in those runs
(:func:`no_alarm_text`, from the thresholds' miss rate, :func:`lpfa.alarms.miss_rate`). A threshold on a measure the
table lacks (``wq_growth`` needs two checkpoints) is reported and not used.

**Input** (:func:`detect_format`, from the path alone): a folder whose ``config.json`` holds ``"format":
"lpfa-checkpoint"`` (or ``"model"`` and ``"step"``) is an lpfa checkpoint (:func:`lpfa.checkpoints.load_checkpoint`);
a folder whose ``config.json`` holds ``"model_type"`` or ``"n_positions"`` is a Hugging Face GPT-2 folder
(:func:`~lpfa.checkpoints.load_hf_gpt2`); a file (``ckpt.pt``), or a folder holding ``ckpt.pt`` (nanoGPT's
``out_dir``), is a nanoGPT checkpoint (:func:`~lpfa.checkpoints.load_nanogpt`, ``weights_only=True``); an lpfa run
folder (``config.json`` with ``"train"``, or ``ckpt/`` or ``ckpt_history/``) means its latest checkpoint
(:func:`run_checkpoint`), and one that keeps none is a one-line error. The model runs in FP32 (PyTorch SDPA
attention, whatever backend or policy it trained with), so q, k, v, X and dO are the high-precision values each BF16
policy is then applied to.

A checkpoint trained with logit soft-capping (``paper_softcap``, one of the stabilisers) keeps its cap in the probe
(FP32-level lpfa attention with the same cap, :func:`probe_overrides`) and in every measure but ``max_logit``, which
stays the raw q·k/√D: the growth of W_Q that the cap hides from the softmax.

**Probe batch** (:func:`probe_batch`): ``batches`` non-overlapping sequences of ``seq_len`` tokens (default the
model's block size, at most 256) drawn with ``seed`` from a nanoGPT token folder (``val.bin``, else ``train.bin``),
or without one from the project's embedded corpus (:func:`lpfa.data.embedded_token_dir`: GPT-2 BPE when the model's
vocabulary holds it and tiktoken's cache has it, else bytes).

**Cost**, measured once on this project's shared 2-core CPU for a GPT-2 S sized model (124M parameters, random
weights, lpfa checkpoint) at 4 × 256 tokens: 51 s from the path to the table (loading the checkpoint and the
forward/backward pass ≈ 32 s, the measures ≈ 1.6 s per layer, 19 s for 12 layers, most of it the two BF16
policies' reference forward passes), plus 6 s for the report's figures; 2.2 GB resident.

    lpfa doctor runs/twins/bf16/ckpt --data data/owt --batches 4 --out results/doctor

prints the worst heads, a table and the verdict counts; ``--out`` writes ``report.md`` (heatmaps layer × head per
measure, bars per head for the worst layer) and ``report.json`` (the table, thresholds, checkpoint, probe, provenance).
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from lpfa import data as lpfa_data
from lpfa.alarms import current_thresholds, fixed_thresholds
from lpfa.attention import FP32_POLICY, get_policy
from lpfa.attention.policy import PRESETS, is_fp32_level
from lpfa.checkpoints import load_checkpoint, load_hf_gpt2, load_nanogpt
from lpfa.cli import _OneLineErrors
from lpfa.diagnostics import spectral_norms, tie_fraction, v_sign_dominance, wq_outlier, wq_spectral_norms
from lpfa.mechanism import delta_error, p_bar_ones
from lpfa.monitor import NO_ALARM, read_thresholds
from lpfa.plotting import use_style
from lpfa.provenance import provenance, write_json
from lpfa.run import Run, resolve_device

FORMATS = ("lpfa", "nanogpt", "hf")
# GPTConfig fields set on loading: the probe runs every layer in FP32 with PyTorch's SDPA, no dropout
PROBE_OVERRIDES = {"attn_backend": "sdpa", "layer_policies": {}, "fp32_heads": {}, "dropout": 0.0}
MAX_DEFAULT_SEQ_LEN = 256  # the default sequence length is the model's block size, at most this
RANK1_TOKENS = 64  # tokens of the first sequence whose rank-1 matrices are compared (Fig. 9)
DELTA_POLICIES = ("paper", "fa2")  # the BF16 policies whose δ is compared with FP32
VERDICTS = ("runaway", "precursor", "no alarm")  # worst first

# (column, title, colourbar label, colour map, centred at 0) — the report's heatmaps, in the chain's order
MEASURES = [
    ("max_logit", "largest attention logit max S", "max S", "viridis", False),
    ("tie_fraction_bf16", "rows with tied maxima, BF16 S (Fig. 13)", "fraction of rows", "viridis", False),
    ("tie_fraction_fp32", "rows with tied maxima, FP32 S", "fraction of rows", "viridis", False),
    ("p_bar_ones", "P̄ = 1 entries per row, paper policy", "entries per row", "viridis", False),
    ("v_sign_dominance", "V columns with one dominant sign", "fraction of columns", "viridis", False),
    ("delta_err_paper", "mean δ_lp − δ_hp, paper policy (Eq. 4)", "mean δ error", "RdBu_r", True),
    ("delta_t_paper", "t-statistic of δ_lp − δ_hp, paper policy", "t", "RdBu_r", True),
    ("delta_err_fa2", "mean δ_lp − δ_hp, fa2 policy", "mean δ error", "RdBu_r", True),
    ("delta_t_fa2", "t-statistic of δ_lp − δ_hp, fa2 policy", "t", "RdBu_r", True),
    ("delta_t_trained", "t-statistic of δ_lp − δ_hp, the policy it trained with", "t", "RdBu_r", True),
    ("rank1_median", "median similarity of (PK)[T]ᵀX[T] (Fig. 9)", "cosine similarity", "RdBu_r", True),
    ("wq_spectral_norm", "‖W_Q‖₂ per head (Figs. 3, 11)", "‖W_Q‖₂", "viridis", False),
    ("wq_outlier", "‖W_Q[h]‖₂ over its layer's median (Fig. 3)", "ratio to the layer's median", "viridis", False),
    ("wk_spectral_norm", "‖W_K‖₂ per head", "‖W_K‖₂", "viridis", False),
]
VERDICT_COLORS = {"no alarm": "#56B4E9", "precursor": "#E69F00", "runaway": "#D55E00"}  # Okabe–Ito


class DoctorError(ValueError):
    """Bad input to the doctor: one line naming the value and what is expected."""


def _trained(path):
    """(attn_backend, policy name) an lpfa checkpoint folder's model trained with."""
    cfg = json.loads((Path(path) / "config.json").read_text()).get("model", {})
    return cfg.get("attn_backend", "lpfa"), cfg.get("attn_policy", "fa2")


def trained_policy(path) -> str | None:
    """The lpfa attention policy an lpfa checkpoint at ``path`` (a checkpoint folder) trained with, when its
    δ is worth measuring besides :data:`DELTA_POLICIES`: a policy of the ``lpfa`` backend with BF16 rounding
    (not FP32-level) that is not one of them; else None. A per-layer policy (``layer_policies``) or FP32 heads do not
    count: the doctor measures every layer alike."""
    backend, name = _trained(path)
    if backend != "lpfa":
        return None
    return None if name in DELTA_POLICIES or is_fp32_level(get_policy(name).with_(softcap=None)) else name


def trained_softcap(path) -> float | None:
    """The logit soft-cap an lpfa checkpoint at ``path`` trained with (its policy's ``softcap``), else None. The cap is
    part of the model: the probe keeps it (:func:`probe_overrides`) and every measure applies it."""
    backend, name = _trained(path)
    return get_policy(name).softcap if backend == "lpfa" else None


def probe_overrides(softcap: float | None = None) -> dict:
    """The GPTConfig changes for the probe: :data:`PROBE_OVERRIDES`, or with a soft-cap the FP32-level preset with
    the same cap on the lpfa backend (PyTorch SDPA has no cap). Raises :class:`DoctorError` when no preset has it."""
    if softcap is None:
        return dict(PROBE_OVERRIDES)
    capped = {n: p.softcap for n, p in sorted(PRESETS.items())
              if p.softcap is not None and is_fp32_level(p.with_(softcap=None))}
    same = [n for n, cap in capped.items() if cap == softcap]
    if not same:
        raise DoctorError(f"soft-cap {softcap:g}: expected a cap that an FP32-level preset has "
                          f"({sorted(set(capped.values()))}) for the probe")
    return {**PROBE_OVERRIDES, "attn_backend": "lpfa", "attn_policy": same[0]}


# --------------------------------------------------------------------------------------------------
# thresholds


_default_thresholds = fixed_thresholds  # the round levels the tests pin (lpfa.alarms.fixed_thresholds)


def _level(thr: dict, measure: str, level: str) -> float | None:
    """``thr[measure][level]`` as a float (a number, or a dict with ``"value"``), None when it has none."""
    x = thr.get(measure, {})
    x = x.get(level) if isinstance(x, dict) else None
    if isinstance(x, dict):
        x = x.get("value")
    return float(x) if isinstance(x, (int, float)) and not isinstance(x, bool) else None


def diagnose(table, thresholds: dict | None = None):
    """``table`` (from :func:`measure_heads`) with a ``verdict`` column: ``runaway`` where ``max_logit`` ≥
    ``thresholds["max_logit"]["runaway"]`` or is not finite (an exploded checkpoint), ``precursor`` where any measure
    of the table reaches its ``"precursor"`` threshold, else ``no alarm``; sorted worst first (verdict, then max
    logit)."""
    thr = current_thresholds() if thresholds is None else thresholds
    precursor = np.zeros(len(table), dtype=bool)
    for measure in thr:
        x = _level(thr, measure, "precursor")
        if x is not None and measure in table:
            precursor |= table[measure].to_numpy() >= x
    runaway = _level(thr, "max_logit", "runaway")
    logit = table["max_logit"].to_numpy()
    runaway = ~np.isfinite(logit) | (logit >= runaway if runaway is not None else False)  # NaN/inf logits ran away
    out = table.assign(verdict=np.where(runaway, "runaway", np.where(precursor, "precursor", "no alarm")))
    rank = out["verdict"].map({v: i for i, v in enumerate(VERDICTS)})
    key = out["max_logit"].fillna(np.inf)  # NaN logits sort first among the runaways
    return (out.assign(_rank=rank, _key=key).sort_values(["_rank", "_key"], ascending=[True, False])
            .drop(columns=["_rank", "_key"]).reset_index(drop=True))


def unused_thresholds(table, thr: dict) -> list[str]:
    """The measures ``thr`` names that the table lacks (e.g. ``wq_growth``, which needs two checkpoints)."""
    return [m for m in thr if m not in table and m != NO_ALARM]


def no_alarm_text(thr: dict) -> str:
    """What a ``no alarm`` verdict can and cannot rule out, in words: no threshold is reached now, but the thresholds
    stay silent on a share of the layers that ran away soon after, measured on the committed runs they were learnt
    from (``thr[NO_ALARM]``, :func:`lpfa.alarms.miss_rate`); thresholds without that entry carry no such rate."""
    m = thr.get(NO_ALARM)
    if not (isinstance(m, dict) and {"fnr", "missed", "positives", "lead_steps"} <= set(m)):
        return ("no alarm is not safe: these thresholds carry no measured miss rate, so a head without an alarm may "
                "still run away; it only rules out a head already past a threshold")
    return (f"no alarm is not safe: at these thresholds the detector stayed silent on {m['fnr']:.0%} of the "
            f"layers that ran away within the next {m['lead_steps']:,} steps ({m['missed']} of {m['positives']} "
            "diagnostics samples of the committed runs); it only rules out a head already past a threshold")


# --------------------------------------------------------------------------------------------------
# the checkpoint


def run_checkpoint(path) -> Path:
    """The latest checkpoint folder of the :mod:`lpfa.train` run folder ``path`` (:attr:`lpfa.run.Run.checkpoints`:
    ``ckpt/`` and ``ckpt_history/step_NNNNNN/``); :class:`DoctorError` naming the folder when it keeps none."""
    run = Run(path)
    try:
        kept = run.checkpoints
    except ValueError as e:  # a damaged ckpt/config.json
        raise DoctorError(f"run folder {run.path}: " + " ".join(str(e).split())) from e
    if not kept:
        raise DoctorError(f"run folder {run.path} has no checkpoint; expected ckpt/ or ckpt_history/step_NNNNNN/ in "
                          "it (lpfa train writes ckpt/ every ckpt_interval steps and at the end; the runs committed "
                          "under results/ keep none)")
    return kept[max(kept)]


def detect_format(path) -> tuple[str, Path]:
    """``(format, path to load)`` for ``path``, one of :data:`FORMATS` (rules in the module docstring); a run
    folder of :mod:`lpfa.train` (``config.json`` with ``"train"``) gives its latest checkpoint
    (:func:`run_checkpoint`)."""
    p = Path(path)
    expected = ("expected an lpfa checkpoint folder (config.json with 'format': 'lpfa-checkpoint'), an lpfa run folder "
                "(config.json with 'train'), a nanoGPT ckpt.pt (or a folder holding one) or a Hugging Face GPT-2 "
                "folder (config.json with 'model_type': 'gpt2')")
    if not p.exists():
        raise DoctorError(f"checkpoint {p} does not exist; {expected}")
    if p.is_file():
        if p.suffix in (".pt", ".pth", ".ckpt"):
            return "nanogpt", p
        raise DoctorError(f"checkpoint {p} is a file but not a .pt file; {expected}")
    config = p / "config.json"
    if config.is_file():
        try:
            cfg = json.loads(config.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise DoctorError(f"{config} is not valid JSON; {expected}") from None
        if isinstance(cfg, dict) and (cfg.get("format") == "lpfa-checkpoint" or ("model" in cfg and "step" in cfg)):
            return "lpfa", p
        if isinstance(cfg, dict) and ("model_type" in cfg or "n_positions" in cfg):
            return "hf", p
        if isinstance(cfg, dict) and "train" in cfg:  # an lpfa.train run folder: its latest checkpoint
            return "lpfa", run_checkpoint(p)
        raise DoctorError(f"cannot tell the format of checkpoint {p} from its config.json; {expected}")
    if (p / "ckpt.pt").is_file():
        return "nanogpt", p / "ckpt.pt"
    if (p / "ckpt").is_dir() or (p / "ckpt_history").is_dir():  # a run folder without its config.json
        return "lpfa", run_checkpoint(p)
    raise DoctorError(f"cannot tell the format of checkpoint {p} (no config.json, no ckpt.pt); {expected}")


def load_model(path, device: str = "cpu"):
    """``(model, format, path loaded)``: the checkpoint at ``path`` as an FP32 :class:`lpfa.model.GPT` in eval mode
    on ``device``, every layer's attention on PyTorch SDPA (:data:`PROBE_OVERRIDES`), or FP32-level lpfa attention
    with the checkpoint's logit soft-cap (:func:`probe_overrides`)."""
    fmt, p = detect_format(path)
    try:
        if fmt == "lpfa":
            model = load_checkpoint(p, map_location="cpu", model_overrides=probe_overrides(trained_softcap(p))).model
        elif fmt == "nanogpt":
            model = load_nanogpt(p, map_location="cpu", **PROBE_OVERRIDES)
        else:
            model = load_hf_gpt2(p, map_location="cpu", **PROBE_OVERRIDES)
    except (OSError, ValueError) as e:
        raise DoctorError(f"{fmt} checkpoint {p}: " + " ".join(str(e).split())) from e
    return model.float().to(device).eval(), fmt, p


# --------------------------------------------------------------------------------------------------
# the probe batch


def _embedded_data(vocab_size: int) -> Path:
    if vocab_size < 257:
        raise DoctorError(f"the model's vocab_size is {vocab_size}, smaller than the embedded corpus's smallest "
                          "vocabulary (bytes: 257 ids); pass --data with a token folder made for this model")
    return lpfa_data.embedded_token_dir("auto" if vocab_size >= 50257 else "bytes")


def probe_batch(data, vocab_size: int, block_size: int, batches: int = 4, seq_len: int | None = None, seed: int = 0,
                device: str = "cpu"):
    """``(x, y, info)``: ``batches`` sequences of ``seq_len`` token ids and their next-token targets, each (batches,
    seq_len) int64 on ``device``, from the nanoGPT token folder ``data`` (``val.bin``, else ``train.bin``; None: the
    embedded corpus). The sequences are distinct non-overlapping windows of the file, chosen with ``seed``.
    ``info``: the data folder, split, token count, starts, shape and seed. Raises :class:`DoctorError` for a
    missing folder, too few tokens or token ids outside the model's vocabulary."""
    seq_len = min(block_size, MAX_DEFAULT_SEQ_LEN) if seq_len is None else int(seq_len)
    if batches < 1:
        raise DoctorError(f"--batches {batches}: expected at least 1 sequence")
    if not 2 <= seq_len <= block_size:
        raise DoctorError(f"--seq-len {seq_len}: expected 2 to the model's block_size {block_size}")
    folder = _embedded_data(vocab_size) if data is None else Path(data)
    split = "val" if (folder / "val.bin").is_file() else "train"
    if not (folder / f"{split}.bin").is_file():
        raise DoctorError(f"--data {folder} has neither val.bin nor train.bin; expected a nanoGPT token folder")
    try:
        tokens, meta = lpfa_data.load_tokens(folder, split)
    except ValueError as e:
        raise DoctorError(f"--data {folder}: {e}") from e
    file = folder / f"{split}.bin"
    if meta.get("vocab_size", 0) > vocab_size:
        raise DoctorError(f"--data {folder} was tokenized with {meta.get('tokenizer', '?')} "
                          f"(vocab_size {meta['vocab_size']}), more ids than the model's vocab_size {vocab_size}; "
                          "expected data tokenized for this model")
    windows = (len(tokens) - 1) // seq_len
    if windows < batches:
        raise DoctorError(f"--data {file} has {len(tokens):,} tokens, too few for --batches {batches} × "
                          f"--seq-len {seq_len} (needs at least {batches * seq_len + 1:,}); lower --batches or "
                          "--seq-len")
    rng = np.random.default_rng(seed)
    starts = np.sort(rng.choice(windows, size=batches, replace=False)) * seq_len
    x, y = lpfa_data.get_batch(tokens, starts, seq_len, "cpu")
    top = int(torch.maximum(x.max(), y.max()))
    if top >= vocab_size:
        raise DoctorError(f"--data {file} holds token id {top}, outside the model's vocabulary "
                          f"(vocab_size {vocab_size}); expected data tokenized for this model")
    info = {"data": str(folder), "split": split, "tokens": int(len(tokens)), "tokenizer": meta.get("tokenizer"),
            "shape": [batches, seq_len], "seed": seed, "starts": starts.tolist()}
    return x.to(device), y.to(device), info


# --------------------------------------------------------------------------------------------------
# the measures


def capture_all(model, x: torch.Tensor, y: torch.Tensor) -> list[dict]:
    """One forward and backward pass of the mean next-token loss on ``(x, y)``; per layer ``{"x", "q", "k", "v", "o",
    "do"}``: the attention input X (after ln_1), q, k, v and O (B, H, T, D) and the gradient dO reaching O, as
    :mod:`lpfa.replay` captures them. Only the position embedding's gradient is asked for, so no weight gradient
    is stored and the model is left as it was."""
    attns = [b.attn for b in model.transformer.h]
    wpe = model.transformer.wpe.weight
    flags = [p.requires_grad for p in model.parameters()]
    for a in attns:
        a.capture = {"all": True}
    try:
        model.requires_grad_(False)
        wpe.requires_grad_(True)
        with torch.enable_grad():
            _, loss = model(x, y)
            torch.autograd.grad(loss, wpe)  # fills every layer's capture["do"] through its hook
        return [a.capture for a in attns]
    finally:
        for a in attns:
            a.capture = None
        for p, f in zip(model.parameters(), flags):
            p.requires_grad_(f)


@torch.no_grad()
def head_weight_norms(model) -> tuple[torch.Tensor, torch.Tensor]:
    """(n_layer, n_head) spectral norms of W_Q[h] and W_K[h] (each (head_dim, n_embd)), in FP32, as
    :func:`lpfa.diagnostics.wq_spectral_norms` (NaN for a head with a non-finite weight)."""
    C, H = model.config.n_embd, model.config.n_head
    w_k = [b.attn.c_attn.weight[C : 2 * C].view(H, C // H, C) for b in model.transformer.h]
    return wq_spectral_norms(model), spectral_norms(torch.stack(w_k))


def _cos(a: torch.Tensor) -> torch.Tensor:
    n = a / a.norm(dim=-1, keepdim=True).clamp_min(1e-300)
    return n @ n.transpose(-1, -2)


@torch.no_grad()
def layer_measures(cap: dict, eps: float = 1e-3, rank1_tokens: int = RANK1_TOKENS,
                   trained: str | None = None, softcap: float | None = None) -> dict[str, np.ndarray]:
    """Every measure of one layer from its capture (:func:`capture_all`), each an (n_head,) array; with ``trained``
    (a policy name, :func:`trained_policy`) also its δ error as ``delta_err_trained``, ``delta_t_trained``. With
    ``softcap`` (:func:`trained_softcap`) every policy caps the logits as the model does, and so does the exact P of the
    rank-1 similarity; ``max_logit`` stays the raw q·k/√D, the measure of W_Q's growth that the cap hides."""
    def capped(name):
        pol = get_policy(name)
        return pol if softcap is None or pol.softcap == softcap else pol.with_(softcap=softcap, name=f"{pol.name}+cap")

    q, k, v, do = (cap[n].float() for n in ("q", "k", "v", "do"))
    B, H, T, D = q.shape
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(D)  # S in float64
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=s.device).triu(1), -math.inf)
    out = {"max_logit": s.amax(dim=(0, 2, 3)),
           "tie_fraction_bf16": tie_fraction(cap, capped("paper"), eps),
           "tie_fraction_fp32": tie_fraction(cap, capped(FP32_POLICY), eps),
           "p_bar_ones": p_bar_ones(q, k, capped("paper")).double().mean(dim=(0, 2)),
           "v_sign_dominance": v_sign_dominance(v)}
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)  # -inf stays -inf
    for col, pol in [(p, p) for p in DELTA_POLICIES] + ([("trained", trained)] if trained else []):
        err = delta_error(q, k, v, do, capped(pol))["delta_err"]  # (B, H, T), float64
        mean, sd = err.mean(dim=(0, 2)), err.std(dim=(0, 2))
        out[f"delta_err_{col}"] = mean
        out[f"delta_t_{col}"] = mean / (sd / math.sqrt(B * T))  # nan where every row's error is 0
    # Fig. 9: cos⟨(PK)[T]ᵀX[T], (PK)[T']ᵀX[T']⟩ = cos(PK_T, PK_T')·cos(X_T, X_T'), first sequence
    tok = torch.linspace(0, T - 1, min(rank1_tokens, T), device=q.device).round().long().unique()
    p = torch.softmax(s[0][:, tok], dim=-1)  # (H, n, T): the exact P of the chosen tokens
    sim = _cos(p @ k[0].double()) * _cos(cap["x"][0, tok].double())  # (H, n, n)
    off = ~torch.eye(len(tok), dtype=torch.bool, device=q.device)
    out["rank1_median"] = (torch.stack([sim[h][off].quantile(0.5) for h in range(H)]) if len(tok) > 1
                           else torch.full((H,), math.nan))
    return {name: val.double().cpu().numpy() for name, val in out.items()}


def measure_heads(model, x: torch.Tensor, y: torch.Tensor, eps: float = 1e-3, rank1_tokens: int = RANK1_TOKENS,
                  progress: bool = True, trained: str | None = None, softcap: float | None = None):
    """The table of the module docstring for ``model`` on token ids ``x`` with targets ``y`` (B, T): a DataFrame
    with columns ``layer``, ``head`` and one per measure, one row per (layer, head) in layer-major order
    (``trained``, ``softcap``: see :func:`layer_measures`)."""
    caps = capture_all(model, x, y)
    wq, wk = head_weight_norms(model)
    rows = []
    for layer, cap in enumerate(tqdm(caps, desc="doctor: layers", unit="layer", disable=not progress, file=sys.stderr)):
        m = layer_measures(cap, eps, rank1_tokens, trained, softcap)
        H = len(m["max_logit"])
        wq_l = wq[layer].double().cpu().numpy()
        rows.append(pd.DataFrame({"layer": layer, "head": np.arange(H), **m, "wq_spectral_norm": wq_l,
                                  "wq_outlier": wq_outlier(wq_l),
                                  "wk_spectral_norm": wk[layer].double().cpu().numpy()}))
        for key in cap:  # free this layer's tensors as we go
            cap[key] = None
    return pd.concat(rows, ignore_index=True)


# --------------------------------------------------------------------------------------------------
# output


def verdict_counts(table) -> dict[str, int]:
    return {v: int((table["verdict"] == v).sum()) for v in VERDICTS}


def _rates(level) -> str:
    """" (false positives 12%, false negatives 34%)" for a learnt level (:func:`lpfa.alarms.thresholds`), else ""."""
    if isinstance(level, dict) and "fpr" in level and "fnr" in level:
        return f" (false positives {level['fpr']:.0%}, false negatives {level['fnr']:.0%})"
    return ""


def _thresholds_text(thr: dict, table) -> str:
    parts = []
    for m in thr:
        levels = [f"{lv} ≥ {_level(thr, m, lv):.3g}" + _rates(thr[m][lv]) for lv in ("precursor", "runaway")
                  if _level(thr, m, lv) is not None]
        if levels:
            parts.append(f"{m}: {', '.join(levels)}" + (" (not measured)" if m not in table else ""))
    return "; ".join(parts)


SHOWN = {"layer": "layer", "head": "head", "verdict": "verdict", "max_logit": "max S",
         "tie_fraction_bf16": "ties bf16", "tie_fraction_fp32": "ties fp32", "p_bar_ones": "P̄=1/row",
         "delta_t_paper": "δ t paper", "delta_t_fa2": "δ t fa2", "rank1_median": "rank-1 med",
         "v_sign_dominance": "V sign", "wq_spectral_norm": "‖W_Q‖₂"}


def summary_text(table, thr: dict, top: int = 10) -> str:
    """The terminal summary: the ``top`` worst heads as a compact table and one line of verdict counts."""
    shown = table[list(SHOWN)].head(top).rename(columns=SHOWN)
    text = shown.to_string(index=False, float_format=lambda v: f"{v:.3g}")
    c = verdict_counts(table)
    line = (f"verdicts: {c['runaway']} runaway, {c['precursor']} precursor, {c['no alarm']} no alarm of {len(table)} "
            f"heads (thresholds: {_thresholds_text(thr, table)})")
    if c["no alarm"]:
        line += "\n" + no_alarm_text(thr)
    return f"worst {min(top, len(table))} heads of {len(table)}:\n{text}\n{line}"


def _md_table(df) -> str:
    def cell(v):
        return f"{v:.3g}" if isinstance(v, (float, np.floating)) else str(v)

    lines = ["| " + " | ".join(map(str, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join(lines)


def _plt():
    """``matplotlib.pyplot``, imported with the first figure."""
    import matplotlib.pyplot as plt  # heavy (about 0.4 s): the doctor's table and summary need no figure

    return plt


def _sns():
    """``seaborn``, imported with the first heatmap."""
    import seaborn as sns  # heavy (about 0.7 s, matplotlib included): only the report's heatmaps use it

    return sns


def _grid_figure(n_layer: int, n_head: int):
    return _plt().subplots(figsize=(min(max(5.0, 2.5 + 0.4 * n_head), 9.0), min(max(3.2, 1.8 + 0.3 * n_layer), 9.0)))


def plot_heatmap(table, column: str, title: str, label: str = "", cmap: str = "viridis", centered: bool = False):
    """One measure as a layer × head heatmap with a colourbar (seaborn; viridis, or ColorBrewer's RdBu centred
    at 0 for signed measures: both colour-blind-safe)."""
    use_style()
    grid = table.pivot(index="layer", columns="head", values=column).sort_index()
    fig, ax = _grid_figure(*grid.shape)
    vals = grid.to_numpy(dtype=float)
    finite = vals[np.isfinite(vals)]
    lim = float(np.abs(finite).max()) if finite.size else 1.0
    kw = dict(center=0.0, vmin=-lim or -1.0, vmax=lim or 1.0) if centered else {}
    _sns().heatmap(grid, ax=ax, cmap=cmap, cbar_kws={"label": label or column}, linewidths=0.3, linecolor="white", **kw)
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.tick_params(labelsize=9)
    ax.set_title(title, fontsize=10)
    return fig


def plot_verdicts(table):
    """The verdict of every head, layer × head, three colours with a labelled colourbar."""
    use_style()
    order = ("no alarm", "precursor", "runaway")
    grid = table.assign(code=table["verdict"].map({v: i for i, v in enumerate(order)})).pivot(
        index="layer", columns="head", values="code").sort_index()
    fig, ax = _grid_figure(*grid.shape)
    # a list of colours: seaborn makes it a ListedColormap
    _sns().heatmap(grid, ax=ax, cmap=[VERDICT_COLORS[v] for v in order], vmin=-0.5, vmax=2.5,
                   linewidths=0.3, linecolor="white", cbar_kws={"ticks": [0, 1, 2], "label": "verdict"})
    ax.collections[0].colorbar.set_ticklabels(list(order))
    ax.set_xlabel("head")
    ax.set_ylabel("layer")
    ax.tick_params(labelsize=9)
    ax.set_title("verdict per head", fontsize=10)
    return fig


def plot_layer_bars(table, layer: int, thr: dict):
    """Per-head bars of one layer for the chain's key measures, coloured by verdict, thresholds as dashed lines."""
    use_style()
    t = table[table["layer"] == layer].sort_values("head")
    panels = [("max_logit", "largest logit max S"), ("tie_fraction_bf16", "rows tied, BF16 S"),
              ("delta_t_paper", "t of δ_lp − δ_hp (paper)"), ("wq_spectral_norm", "‖W_Q‖₂")]
    fig, axes = _plt().subplots(2, 2, figsize=(8, 5))
    colors = [VERDICT_COLORS[v] for v in t["verdict"]]
    for ax, (col, label) in zip(axes.flat, panels):
        ax.bar(t["head"], t[col].fillna(0.0), color=colors)
        for lv, style in (("precursor", "--"), ("runaway", ":")):
            x = _level(thr, col, lv)
            if x is not None and x <= max(float(t[col].max()), 0) * 1.5:
                ax.axhline(x, color="black", linestyle=style, linewidth=1, label=f"{lv} threshold")
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("head")
        ax.set_xticks(t["head"])
        ax.tick_params(labelsize=9)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=9)
    fig.suptitle(f"layer {layer}: bars coloured by verdict (blue no alarm, orange precursor, vermillion runaway)",
                 fontsize=10)
    return fig


def _json_table(table) -> list[dict]:
    recs = table.to_dict(orient="records")
    return [{k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in r.items()} for r in recs]


def report_table(report: dict, thresholds: dict | None = None):
    """The per-head table of a ``report.json`` (as :func:`write_report` writes it; null measures back to NaN) with
    its verdicts given again by ``thresholds`` (default: the report's own), worst first: how the book shows a report
    whose checkpoint stayed on the GPU machine."""
    table = pd.DataFrame(report["table"]).drop(columns="verdict", errors="ignore")
    num = [c for c in table.columns if c not in ("layer", "head")]
    table[num] = table[num].apply(pd.to_numeric, errors="coerce").astype(float)
    return diagnose(table, report["thresholds"] if thresholds is None else thresholds)


def write_report(out, table, thr: dict, info: dict) -> tuple[Path, Path]:
    """Write ``out/report.md`` (verdicts, the worst heads, a heatmap per measure, bars for the worst layer) and
    ``out/report.json`` (``info`` plus the table and thresholds). Returns both paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    figs = [("verdict.png", "verdict per head", plot_verdicts(table))]
    figs += [(f"heatmap_{col}.png", title, plot_heatmap(table, col, title, label, cmap, centered))
             for col, title, label, cmap, centered in MEASURES if col in table]
    worst_layer = int(table["layer"].iloc[0])
    figs.append((f"bars_layer{worst_layer}.png", f"layer {worst_layer} (the worst head's), per head",
                 plot_layer_bars(table, worst_layer, thr)))
    for name, _, fig in figs:
        fig.savefig(out / name)
        _plt().close(fig)
    c = verdict_counts(table)
    probe = info["probe"]
    md = [f"# lpfa doctor: {info['checkpoint']}", "",
          f"Format **{info['format']}**; probe: {probe['shape'][0]} × {probe['shape'][1]} tokens of {probe['data']} "
          f"({probe['split']}.bin, seed {probe['seed']}); {info['runtime_s']:.1f} s on {info['device']}.", "",
          f"**Verdicts:** {c['runaway']} runaway, {c['precursor']} precursor, {c['no alarm']} no alarm of "
          f"{len(table)} heads." + (f" {no_alarm_text(thr)}." if c["no alarm"] else ""),
          f"Thresholds ({info['thresholds_source']}): {_thresholds_text(thr, table)}.", "",
          "## The worst heads", "", _md_table(table[list(SHOWN)].head(10).rename(columns=SHOWN)), "",
          "## Per measure, layer × head", ""]
    md += [f"### {label}\n\n![{label}]({name})\n" for name, label, _ in figs]
    (out / "report.md").write_text("\n".join(md) + "\n")
    js = write_json(out / "report.json", {**info, "thresholds": thr, "verdicts": c,
                                          "unused_thresholds": unused_thresholds(table, thr),
                                          "table": _json_table(table)})
    return out / "report.md", js


# --------------------------------------------------------------------------------------------------
# the whole examination and the command line


def doctor(checkpoint, data=None, batches: int = 4, seq_len: int | None = None, seed: int = 0, device: str = "auto",
           out=None, thresholds: dict | None = None, eps: float = 1e-3, rank1_tokens: int = RANK1_TOKENS,
           progress: bool = True, command: str | None = None) -> dict:
    """Load ``checkpoint``, draw the probe batch, measure every head, give verdicts (``thresholds``, default
    :func:`lpfa.alarms.current_thresholds`) and, with ``out``, write the report. Returns ``{"table": DataFrame,
    "thresholds", "info"}``."""
    t0 = time.time()
    if device not in ("auto", "cpu") and not device.startswith("cuda"):
        raise DoctorError(f"--device {device!r}: expected auto, cpu or cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise DoctorError(f"--device {device}: no CUDA device is visible; use cpu or auto")
    device = resolve_device(device)
    source = "given" if thresholds is not None else "lpfa.alarms.current_thresholds()"
    thr = current_thresholds() if thresholds is None else thresholds
    model, fmt, path = load_model(checkpoint, device)
    trained, softcap = (trained_policy(path), trained_softcap(path)) if fmt == "lpfa" else (None, None)
    cfg = model.config
    x, y, probe = probe_batch(data, cfg.vocab_size, cfg.block_size, batches, seq_len, seed, device)
    table = diagnose(measure_heads(model, x, y, eps, rank1_tokens, progress, trained, softcap), thr)
    info = {"checkpoint": str(checkpoint), "loaded": str(path), "format": fmt, "device": device,
            "trained_policy": trained, "softcap": softcap,
            "model": {k: getattr(cfg, k) for k in ("n_layer", "n_head", "n_embd", "vocab_size", "block_size")},
            "probe": probe, "eps": eps, "rank1_tokens": rank1_tokens, "thresholds_source": source,
            "runtime_s": time.time() - t0}
    info["provenance"] = provenance(command=command)
    if out is not None:
        write_report(out, table, thr, info)
    return {"table": table, "thresholds": thr, "info": info}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    p = _OneLineErrors(prog="lpfa doctor", description=__doc__.split("\n\n")[0] + " (see lpfa.doctor's docstring)")
    p.add_argument("checkpoint", help="an lpfa checkpoint folder, an lpfa run folder (its latest checkpoint, ckpt/ or "
                                      "ckpt_history/step_N/), a nanoGPT ckpt.pt (or its folder), or a Hugging Face "
                                      "GPT-2 folder")
    p.add_argument("--data", default=None,
                   help="a nanoGPT token folder (val.bin, else train.bin); default: the embedded corpus")
    p.add_argument("--batches", type=int, default=4, help="sequences in the probe batch (default 4)")
    p.add_argument("--seq-len", type=int, default=None,
                   help=f"tokens per sequence (default: block size, at most {MAX_DEFAULT_SEQ_LEN})")
    p.add_argument("--seed", type=int, default=0, help="seed of the sequences' choice (default 0)")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--out", default=None, help="a folder for report.md, report.json and the figures")
    p.add_argument("--top", type=int, default=10, help="worst heads shown in the terminal (default 10)")
    p.add_argument("--thresholds", default=None,
                   help="a JSON file of thresholds as lpfa.alarms.thresholds() returns them "
                        "(default: the committed thresholds, learnt from the committed runs)")
    a = p.parse_args(argv)
    try:
        thr = read_thresholds(a.thresholds, "--thresholds") if a.thresholds else None
    except (FileNotFoundError, ValueError) as e:  # a missing, unreadable or malformed file: one line
        print(f"lpfa doctor: error: {e}", file=sys.stderr)
        return 2
    try:
        r = doctor(a.checkpoint, a.data, a.batches, a.seq_len, a.seed, a.device, a.out, thresholds=thr,
                   command=" ".join(["lpfa doctor", *argv]))
    except DoctorError as e:
        print(f"lpfa doctor: error: {e}", file=sys.stderr)
        return 2
    info = r["info"]
    shape = info["probe"]["shape"]
    loaded = "" if Path(info["loaded"]) == Path(info["checkpoint"]) else f": {info['loaded']}"
    print(f"{info['checkpoint']} ({info['format']}{loaded}), probe {shape[0]} × {shape[1]} tokens, "
          f"{info['runtime_s']:.1f} s on {info['device']}")
    print(summary_text(r["table"], r["thresholds"], a.top))
    if a.out:
        print(f"report: {Path(a.out) / 'report.md'}, {Path(a.out) / 'report.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
