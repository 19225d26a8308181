"""An early warning of the failure inside any PyTorch training loop: :class:`AttentionMonitor`.

Every ``every`` steps the monitor looks at that step's forward pass, measures the links of the paper's chain that
one batch and the weights show, per layer and head, and warns when one crosses its threshold::

    monitor = AttentionMonitor(model, every=100)           # the committed thresholds (THRESHOLDS_FILE)
    for step, (x, y) in enumerate(loader):
        with monitor.step(step):                           # captures q, k on steps 0, 100, 200, ... only
            _, loss = model(x, y)
        loss.backward(); opt.step(); opt.zero_grad()
    monitor.history                                        # DataFrame: step, layer, head, every measure

**Capture.** On a capture step the monitor sees each attention's q and k (detached; no copy) as the forward makes
them: for :class:`lpfa.model.GPT` through its attention modules' ``capture`` hook, for any other model (Hugging Face
GPT-2, a user's module) through a :class:`torch.overrides.TorchFunctionMode` that records every
``torch.nn.functional.scaled_dot_product_attention`` call of the forward (call index = layer) with its causal flag,
mask and scale. On other steps :meth:`AttentionMonitor.step` returns a no-op context: no hook, no mode, no cost.
Wrap one forward pass (one micro-batch). A model compiled with ``torch.compile`` is monitored as it runs eagerly,
through both paths (``tests/test_monitor.py``, with Inductor on the CPU: the same history up to the compiled kernels'
FP32 rounding of q and k); a backend that hid the SDPA calls from the mode would fail the capture step with an error
saying so. On a GPU it runs in ``benchmarks/monitor_overhead.py`` (GPT-2 S, eager, BF16 autocast;
``results/monitor_overhead``); not checked under CUDA graphs.

**Measures** (per layer and head, on the first ``sequences`` sequences of the batch, :data:`MEASURE_COLUMNS`):

* ``max_logit`` — the largest attention logit q·k·scale (plus the call's additive mask; causal/masked keys
  excluded), in float64 from the captured q and k (the runaway of Fig. 2);
* ``tie_fraction_bf16`` — the share of rows whose scores, rounded to BF16 as the ``paper`` policy rounds them
  (:func:`lpfa.attention.reference._scores`), have more than one value within ``eps`` of the row max (Fig. 13), as
  :func:`lpfa.diagnostics.tie_fraction` counts them — whatever precision the model itself computes in;
* ``wq_spectral_norm`` ‖W_Q[h]‖₂, ``wq_outlier`` (that over its layer's median, as :mod:`lpfa.alarms`) and
  ``wq_growth`` (its relative growth per 1000 steps since the previous capture), where W_Q is reachable: our GPT's
  :meth:`~lpfa.model.GPT.w_q`, or a user's ``w_q=lambda layer: tensor`` ((n_head, head_dim, n_embd), or
  (n_head·head_dim, n_embd) split by the captured head count; for Hugging Face GPT-2:
  ``lambda i: m.transformer.h[i].attn.c_attn.weight[:, :768].T``).

**Decision** (:func:`crossings`, shared with replays of logged diagnostics, e.g. of the committed runs): a (layer,
head) crosses a measure's level (``"precursor"``, ``"runaway"``) where its value is at or above it (a NaN or infinite
``max_logit``: the top level); the monitor reports a head's measure when it crosses upwards (not again while it stays
above), through ``on_warning(event)`` (an :class:`AttentionEvent`) or else :func:`warnings.warn` with an
:class:`AttentionWarning`.

**Thresholds** default to the committed file :data:`THRESHOLDS_FILE` (:func:`default_thresholds`), which
``python -m lpfa.alarms --write`` learns from the committed runs (:func:`lpfa.alarms.thresholds`, with their error
rates); this module reads no run folder. A dict in the same format replaces them, or a JSON file of one
(:func:`read_thresholds`, which ``lpfa.train``'s ``warning_thresholds`` and ``lpfa doctor --thresholds`` use).
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from lpfa.attention import get_policy
from lpfa.attention.reference import IEEE, _r, _scores, near_max_counts
from lpfa.checkpoints import read_json
from lpfa.diagnostics import spectral_norms, wq_outlier
from lpfa.model import unwrap

MEASURE_COLUMNS = ("max_logit", "tie_fraction_bf16", "wq_spectral_norm", "wq_outlier", "wq_growth")
LEVELS = ("precursor", "runaway")  # a measure's thresholds, lowest first
GROWTH_STEPS = 1000  # wq_growth is the relative growth of ‖W_Q[h]‖₂ per this many steps
SEQUENCES = 4  # sequences of the batch measured (the training runs' diag_batch)
OVERHEAD_GOAL = 0.02  # the monitor's cost goal: at most 2 % of the step time at every=100 (monitor_overhead.py)
EPS = 1e-3  # scores within EPS of their row's max count as tied (lpfa.train's tie_eps)
# the thresholds used when none are given: written by `python -m lpfa.alarms --write`, shipped with the package
THRESHOLDS_FILE = Path(__file__).with_name("warning_thresholds.json")
# not a measure: the thresholds' entry saying how many runaways they miss, all levels together (lpfa.alarms.miss_rate)
NO_ALARM = "no_alarm"


class MonitorError(ValueError):
    """Bad input to the monitor: one line naming the value and what is expected."""


class AttentionWarning(UserWarning):
    """A head of the monitored model crossed a threshold (:class:`AttentionMonitor`)."""


@dataclass(frozen=True)
class AttentionEvent:
    """One head crossing one threshold at one step."""

    step: int
    layer: int
    head: int
    measure: str
    level: str  # "precursor" or "runaway"
    value: float
    threshold: float

    def __str__(self) -> str:
        return (f"step {self.step}: layer {self.layer} head {self.head} {self.measure} = {self.value:.4g} "
                f"reached the {self.level} threshold {self.threshold:.4g}")


# --------------------------------------------------------------------------------------------------
# thresholds and the decision (shared by the live monitor and replays of logged diagnostics)


def normalise_thresholds(thresholds: dict) -> dict[str, dict[str, float]]:
    """``{measure: {level: value}}`` from :func:`lpfa.alarms.thresholds`' format (a level a number, or a dict with
    ``"value"``); a one-line error for a measure the monitor does not compute, an unknown level or a missing value.
    The :data:`NO_ALARM` entry (a miss rate, not a level) is left out."""
    if not isinstance(thresholds, dict):
        raise MonitorError(f"thresholds must be a dict like lpfa.alarms.thresholds() returns, "
                           f"got {type(thresholds).__name__}")
    out = {}
    for measure, levels in thresholds.items():
        if measure == NO_ALARM:
            continue
        if measure not in MEASURE_COLUMNS:
            raise MonitorError(f"thresholds name measure {measure!r}; the monitor computes "
                               f"{', '.join(MEASURE_COLUMNS)}")
        if not isinstance(levels, dict):
            raise MonitorError(f"thresholds[{measure!r}] must be a dict of levels ({', '.join(LEVELS)}), "
                               f"got {levels!r}")
        out[measure] = {}
        for level, x in levels.items():
            if level not in LEVELS:
                raise MonitorError(f"thresholds[{measure!r}] has level {level!r}; expected {' and/or '.join(LEVELS)}")
            v = x.get("value") if isinstance(x, dict) else x
            if isinstance(v, bool) or not isinstance(v, (int, float)) or math.isnan(v):
                raise MonitorError(f"thresholds[{measure!r}][{level!r}] must be a number or a dict with a numeric "
                                   f"'value', got {x!r}")
            out[measure][level] = float(v)
    return out


def read_thresholds(path, what: str = "thresholds") -> dict:
    """Thresholds from a JSON file as :func:`lpfa.alarms.thresholds` returns them (:data:`THRESHOLDS_FILE` is one;
    a copy fixes them for a run or a doctor call): ``lpfa.train``'s ``warning_thresholds``, ``lpfa doctor
    --thresholds``. Each measure must be one the monitor computes, with numeric levels; a one-line error that names
    ``what`` (the option that gave the path) otherwise."""
    expected = "a JSON file of thresholds as lpfa.alarms.thresholds() returns them"
    thr = read_json(path, f" ({what}: expected {expected})",
                    missing=f"{what}={str(path)!r}: expected {expected}, but there is no such file")
    try:
        normalise_thresholds(thr)
    except ValueError as e:
        raise ValueError(f"{what}={str(path)!r}: {e}") from e
    return thr


def default_thresholds() -> dict:
    """The committed thresholds, :data:`THRESHOLDS_FILE` read by :func:`read_thresholds` (the doctor's and
    ``lpfa.train``'s too): learnt from the committed runs by ``python -m lpfa.alarms --write``. A missing or damaged
    file is a one-line error saying that command writes it."""
    try:
        return read_thresholds(THRESHOLDS_FILE, "lpfa.monitor.THRESHOLDS_FILE")
    except (FileNotFoundError, ValueError) as e:
        raise type(e)(f"{e}; `python -m lpfa.alarms --write` writes it from the committed runs") from e


def wq_growth(norm, before, steps):
    """Relative growth of ‖W_Q[h]‖₂ per :data:`GROWTH_STEPS` steps, from ``before`` to ``norm`` over ``steps`` steps."""
    return (np.asarray(norm, float) / np.asarray(before, float) - 1.0) * GROWTH_STEPS / np.asarray(steps, float)


def add_derived(frame, previous=None):
    """``frame`` (step, layer, head, max_logit, tie_fraction_bf16, wq_spectral_norm) with ``wq_outlier`` (‖W_Q[h]‖₂
    over its layer's median at that step, :func:`lpfa.diagnostics.wq_outlier`) and ``wq_growth`` (:func:`wq_growth`
    since the same head's previous step, in ``frame`` or else in ``previous``, an earlier frame; NaN for a head's first
    step). In NumPy: the monitor calls it at every capture, where pandas' grouping cost milliseconds."""
    step, layer, head = (frame[c].to_numpy() for c in ("step", "layer", "head"))
    wq = frame["wq_spectral_norm"].to_numpy(dtype=float)
    # wq_outlier per (step, layer): one call on a (groups, heads) array when every group has the same heads' count
    order = np.lexsort((head, layer, step))
    _, first, counts = np.unique(np.stack([step[order], layer[order]]), axis=1, return_index=True, return_counts=True)
    outlier = np.empty(len(wq))
    if len(counts) and (counts == counts[0]).all():
        outlier[order] = wq_outlier(wq[order].reshape(len(counts), counts[0])).ravel()
    else:
        for a, n in zip(first, counts):
            outlier[order[a:a + n]] = wq_outlier(wq[order[a:a + n]])
    # wq_growth: the same head's previous step, the previous frame's rows first (a stable sort by layer, head, step)
    rows = np.arange(len(wq))
    if previous is not None and not previous.empty:
        cols = [np.concatenate([previous[c].to_numpy(), frame[c].to_numpy()]) for c in ("step", "layer", "head")]
        norm = np.concatenate([previous["wq_spectral_norm"].to_numpy(dtype=float), wq])
        rows = np.concatenate([np.full(len(previous), -1), rows])
    else:
        cols, norm = [step, layer, head], wq
    s_, l_, h_ = cols
    o = np.lexsort((s_, h_, l_))
    same = np.r_[False, (l_[o][1:] == l_[o][:-1]) & (h_[o][1:] == h_[o][:-1])]
    with np.errstate(divide="ignore", invalid="ignore"):
        growth = np.where(same, wq_growth(norm[o], np.r_[np.nan, norm[o][:-1]],
                                          np.r_[np.nan, np.diff(s_[o].astype(float))]), np.nan)
    mine = rows[o] >= 0
    out = np.empty(len(wq))
    out[rows[o][mine]] = growth[mine]
    return frame.assign(wq_outlier=outlier, wq_growth=out)


def crossings(frame, thresholds: dict):
    """Every (row of ``frame``, measure) at or above one of the measure's levels, with the highest level it reaches:
    a DataFrame (step, layer, head, measure, level, value, threshold) sorted by step, then the worst level first.
    A NaN or infinite ``max_logit`` (a model that blew up) reaches its top level; other NaN measures reach none
    (not measured). ``thresholds`` as :func:`normalise_thresholds` accepts. The one decision rule of the monitor
    and of replays of logged diagnostics."""
    thr = normalise_thresholds(thresholds)
    parts = []
    for measure, levels in thr.items():
        if measure not in frame or not levels:
            continue
        v = frame[measure].to_numpy(dtype=float)
        level = np.full(len(v), None, dtype=object)
        at = np.full(len(v), np.nan)
        for name, x in sorted(levels.items(), key=lambda kv: kv[1]):  # the higher level wins
            hit = v >= x
            level[hit], at[hit] = name, x
        if measure == "max_logit":
            top, x = max(levels.items(), key=lambda kv: kv[1])
            blown = np.isnan(v) | np.isposinf(v)
            level[blown], at[blown] = top, x
        hit = level != None  # noqa: E711 (elementwise)
        if hit.any():
            parts.append(pd.DataFrame({"step": frame["step"].to_numpy()[hit], "layer": frame["layer"].to_numpy()[hit],
                                       "head": frame["head"].to_numpy()[hit], "measure": measure,
                                       "level": level[hit].astype(str), "value": v[hit], "threshold": at[hit]}))
    cols = ["step", "layer", "head", "measure", "level", "value", "threshold"]
    if not parts:
        return pd.DataFrame({c: pd.Series(dtype=float if c in ("value", "threshold") else object) for c in cols})
    out = pd.concat(parts, ignore_index=True)
    out["_rank"] = out["level"].map({lv: -i for i, lv in enumerate(LEVELS)})
    return (out.sort_values(["step", "_rank", "layer", "head"], kind="stable").drop(columns="_rank")
            .reset_index(drop=True)[cols])


class Alarm:
    """The monitor's decision over successive measurements of one model: each frame through :func:`add_derived` (W_Q
    growth since the previous frame) and :func:`crossings`, a (layer, head, measure, level) reported once when it
    crosses upwards (not again while it stays above). Used by :class:`AttentionMonitor` and by ``lpfa.train``'s
    ``on_warning``."""

    def __init__(self, thresholds: dict | None = None):
        self.thresholds = normalise_thresholds(default_thresholds() if thresholds is None else thresholds)
        self.previous = None
        self._above: set = set()

    def feed(self, frame):
        """``frame`` (step, layer, head, max_logit, tie_fraction_bf16, wq_spectral_norm) of one step: returns it with
        the derived measures, and an :class:`AttentionEvent` for each new crossing, worst level first."""
        frame = add_derived(frame, self.previous)
        self.previous = frame
        events, above = [], set()
        for r in crossings(frame, self.thresholds).itertuples(index=False):
            key = (r.layer, r.head, r.measure, r.level)
            above.add(key)
            if key not in self._above:  # (still above since the last frame: reported then)
                events.append(AttentionEvent(int(r.step), int(r.layer), int(r.head), r.measure, r.level,
                                             float(r.value), float(r.threshold)))
        self._above = above
        return frame, events


def record_frame(step: int, record: dict, precision):
    """One diagnostics record of ``lpfa.train`` (:func:`lpfa.diagnostics.probe_record`: per layer, per head) as the
    frame :meth:`Alarm.feed` takes; ``tie_fraction_bf16`` is NaN in layers whose scores are not BF16 (``precision``:
    per layer, as :func:`lpfa.run.layer_precision` gives it), where the logged ties are not BF16 ties."""
    logit = np.asarray(record["max_logit"], dtype=float)
    L, H = logit.shape
    ties = np.asarray(record["tie_fraction"], dtype=float).copy()
    ties[np.asarray([p != "bf16" for p in precision])] = np.nan
    return pd.DataFrame({"step": int(step), "layer": np.repeat(np.arange(L), H), "head": np.tile(np.arange(H), L),
                         "max_logit": logit.ravel(), "tie_fraction_bf16": ties.ravel(),
                         "wq_spectral_norm": np.asarray(record["wq_spectral_norm"], dtype=float).ravel()})


# --------------------------------------------------------------------------------------------------
# measuring captured q and k


def _normalise_qk(q, k):
    """q, k as (B, H, L, D) and (B, H, S, D), k's heads repeated for grouped-query attention as SDPA does."""
    if q.ndim < 3 or k.ndim != q.ndim:
        raise MonitorError(f"scaled_dot_product_attention got q {tuple(q.shape)} and k {tuple(k.shape)}; the monitor "
                           "expects (..., heads, tokens, head_dim) for both")
    if q.ndim == 3:
        q, k = q.unsqueeze(0), k.unsqueeze(0)
    q, k = q.reshape(-1, *q.shape[-3:]), k.reshape(-1, *k.shape[-3:])
    if k.shape[1] != q.shape[1] and k.shape[1] and q.shape[1] % k.shape[1] == 0:
        k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    return q, k


@torch.no_grad()
def call_measures(q, k, causal: bool = True, mask=None, scale: float | None = None, eps: float = EPS) -> dict:
    """``{"max_logit", "tie_fraction_bf16"}``, each an (H,) float64 array, for one attention call's q (B, H, L, D) and
    k (B, H, S, D) (as :func:`torch.nn.functional.scaled_dot_product_attention` takes them: ``causal`` is its
    top-left ``is_causal``, a boolean ``mask`` marks visible keys, a float one is added to the logits), over all
    of the batch it is given (the max over sequences; the tie fraction is each sequence's, averaged)."""
    max_logit, ties = _call_measures(q, k, causal, mask, scale, eps)
    return {"max_logit": max_logit.cpu().numpy(), "tie_fraction_bf16": ties.cpu().numpy()}


CHUNK_BYTES = 1 << 28  # the float64 logits of at most this many bytes at a time (256 MiB: 2 sequences of GPT-2 S)


def _call_measures(q, k, causal, mask, scale, eps) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`call_measures` as two (H,) float64 tensors on q's device, without a synchronisation (the monitor
    gathers all layers' before one transfer). Sequences go in chunks whose float64 logits fit :data:`CHUNK_BYTES`."""
    q, k = _normalise_qk(q, k)
    B, H, L, D = q.shape
    S = k.shape[2]
    scale = 1.0 / math.sqrt(D) if scale is None else float(scale)
    pol = get_policy("paper")
    vis = torch.ones(L, S, dtype=torch.bool, device=q.device).tril() if causal else None
    if mask is not None and mask.ndim < 4:  # one mask for every sequence
        mask = mask.reshape(1, *([1] * (3 - mask.ndim)), *mask.shape)
    n = max(1, CHUNK_BYTES // max(1, H * L * S * 8))
    maxes, ties = [], []
    for b in range(0, B, n):
        qb, kb = q[b : b + n], k[b : b + n]
        v_b, add = vis, None
        if mask is not None:
            m = mask[b : b + n] if mask.shape[0] > 1 else mask
            if m.dtype == torch.bool:
                v_b = m if v_b is None else v_b & m
            else:
                add = m
        qk = qb.double() @ kb.double().transpose(-1, -2)  # QKᵀ in float64
        s = qk * scale  # S = q·k·scale in float64 (Fig. 2's logits)
        # S as the paper policy rounds it, bf16(bf16(QKᵀ)·scale): from the same product where the policy's GEMM is
        # IEEE FP32 (:func:`~lpfa.attention.reference._mm`: the float64 product rounded once), else recomputed
        sb = (_r(_r(qk.float(), pol.scores) * scale, pol.scores) if pol.gemm == IEEE and pol.softcap is None
              else _scores(qb, kb, scale, pol))
        if add is not None:
            s, sb = s + add.double(), _r(sb + add.float(), pol.scores)
        if v_b is not None:
            s, sb = s.masked_fill(~v_b, -math.inf), sb.masked_fill(~v_b, -math.inf)
        maxes.append(s.amax(dim=(-1, -2)))  # (n, H): the largest visible logit
        rs, rows = near_max_counts(sb, eps, pol.scores)  # (n, H, L): Fig. 13's count, as fill_tie_stats takes it
        ties.append(((rs > 1) & rows).sum(-1).double() / rows.sum(-1).clamp_min(1).double())
    return torch.cat(maxes).amax(0), torch.cat(ties).mean(0)


# --------------------------------------------------------------------------------------------------
# capture


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class _SDPARecorder(torch.overrides.TorchFunctionMode):
    """Records q, k (detached, first ``sequences``), mask, causal flag and scale of every SDPA call, in order."""

    def __init__(self, layers, sequences: int):
        super().__init__()
        self.layers, self.sequences, self.calls, self.count = layers, sequences, {}, 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            a = dict(zip(_SDPA_ARGS, args), **kwargs)
            if self.layers is None or self.count in self.layers:
                mask = a.get("attn_mask")
                self.calls[self.count] = {"q": a["query"].detach()[: self.sequences],
                                          "k": a["key"].detach()[: self.sequences],
                                          "mask": mask.detach() if isinstance(mask, torch.Tensor) else None,
                                          "causal": bool(a.get("is_causal", False)), "scale": a.get("scale")}
            self.count += 1
        return func(*args, **kwargs)


def _lpfa_attentions(model):
    """Our GPT's attention modules (with the ``capture`` hook), or None for any other model."""
    h = getattr(getattr(model, "transformer", None), "h", None)
    if h is None or not hasattr(model, "w_q") or not all(hasattr(getattr(b, "attn", None), "capture") for b in h):
        return None
    return [b.attn for b in h]


class _Capture:
    """The context of one capture step (:meth:`AttentionMonitor.step`)."""

    def __init__(self, monitor: "AttentionMonitor", step: int):
        self.monitor, self.step, self.mode = monitor, step, None

    def __enter__(self):
        mon = self.monitor
        if mon._attns is not None:
            for i, a in enumerate(mon._attns):
                a.capture = {} if mon.layers is None or i in mon.layers else None
        else:
            self.mode = _SDPARecorder(mon.layers, mon.sequences)
            self.mode.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb):
        mon = self.monitor
        if self.mode is not None:
            self.mode.__exit__(exc_type, exc, tb)
            calls, n_calls = self.mode.calls, self.mode.count
        else:
            calls = {i: {"q": a.capture["q"][: mon.sequences], "k": a.capture["k"][: mon.sequences], "mask": None,
                         "causal": True, "scale": None}
                     for i, a in enumerate(mon._attns) if a.capture and "q" in a.capture}
            n_calls = len(mon._attns) if calls else 0
            for a in mon._attns:
                a.capture = None
        if exc_type is None:
            mon._measure(self.step, calls, n_calls)
        return False


# --------------------------------------------------------------------------------------------------
# the monitor


class AttentionMonitor:
    """Per-head early warning of attention-logit runaway for any PyTorch model (see the module docstring).
    ``model``: :class:`lpfa.model.GPT` (through its capture hook; W_Q reachable) or any module whose attention calls
    ``torch.nn.functional.scaled_dot_product_attention``. ``every``: capture on steps divisible by it. ``layers``:
    the layer indices (SDPA call indices) to measure, None for all. ``thresholds``: as :func:`lpfa.alarms.thresholds`
    returns (default: the committed ones, :func:`default_thresholds`). ``on_warning``: called with each
    :class:`AttentionEvent`, instead of :func:`warnings.warn`. ``tensorboard``: a ``SummaryWriter`` (anything with
    ``add_scalar``) or a log folder (needs the ``tensorboard`` package). ``w_q``: ``layer -> tensor`` for models other
    than ours. ``sequences``: how many sequences of the batch to measure."""

    def __init__(self, model, every: int = 100, layers=None, thresholds: dict | None = None, on_warning=None,
                 tensorboard=None, w_q=None, sequences: int = SEQUENCES, eps: float = EPS):
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise MonitorError(f"every must be an integer >= 1 (capture every that many steps), got {every!r}")
        if not isinstance(model, torch.nn.Module):
            raise MonitorError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if isinstance(sequences, bool) or not isinstance(sequences, int) or sequences < 1:
            raise MonitorError(f"sequences must be an integer >= 1 (sequences of the batch measured), "
                               f"got {sequences!r}")
        if on_warning is not None and not callable(on_warning):
            raise MonitorError(f"on_warning must be callable with an AttentionEvent, got {on_warning!r}")
        if w_q is not None and not callable(w_q):
            raise MonitorError(f"w_q must be callable as w_q(layer) -> tensor, got {w_q!r}")
        self.model, self.every, self.sequences, self.eps = model, every, sequences, eps
        self._attns = _lpfa_attentions(unwrap(model))
        if layers is not None:
            layers = [layers] if isinstance(layers, int) else list(layers)
            bad = [x for x in layers if isinstance(x, bool) or not isinstance(x, int) or x < 0
                   or (self._attns is not None and x >= len(self._attns))]
            if bad:
                have = f"0..{len(self._attns) - 1}" if self._attns is not None else "non-negative indices"
                raise MonitorError(f"layers {bad} are not layers of the model: expected {have}")
            layers = sorted(set(layers))
        self.layers = layers
        self._alarm = Alarm(thresholds)
        self.thresholds = self._alarm.thresholds
        self.on_warning = on_warning
        if isinstance(tensorboard, (str, Path)):
            from torch.utils.tensorboard import SummaryWriter  # optional dependency: only when asked for

            tensorboard = SummaryWriter(str(tensorboard))
        if tensorboard is not None and not callable(getattr(tensorboard, "add_scalar", None)):
            raise MonitorError(f"tensorboard must be a SummaryWriter (with add_scalar) or a log folder, "
                               f"got {tensorboard!r}")
        self.writer = tensorboard
        if w_q is None and self._attns is not None:
            inner = unwrap(model)
            w_q = inner.w_q
        self.w_q = w_q
        self._count = 0  # the next step when step() is called without one
        self._frames = []
        self.events: list[AttentionEvent] = []

    def due(self, step: int) -> bool:
        """Whether ``step`` is a capture step."""
        return step % self.every == 0

    def step(self, step: int | None = None):
        """The context to run one step's forward in: a capture on steps divisible by ``every``, else a no-op.
        ``step`` defaults to a counter of calls (0, 1, 2, ...)."""
        if step is None:
            step = self._count
        elif isinstance(step, bool) or not isinstance(step, (int, np.integer)) or step < 0:
            raise MonitorError(f"step must be an integer >= 0, got {step!r}")
        step = int(step)
        self._count = step + 1
        return _Capture(self, step) if step % self.every == 0 else contextlib.nullcontext()

    @property
    def history(self):
        """Every measure of every capture: a DataFrame (step, layer, head, then :data:`MEASURE_COLUMNS`)."""
        if not self._frames:
            return pd.DataFrame(columns=["step", "layer", "head", *MEASURE_COLUMNS])
        return pd.concat(self._frames, ignore_index=True)

    # ----------------------------------------------------------------------------------------------
    def _w_q(self, layer: int, heads: int) -> torch.Tensor | None:
        """W_Q of ``layer`` as (heads, head_dim, n_embd), or None where W_Q is out of reach."""
        if self.w_q is None:
            return None
        w = self.w_q(layer)
        if not isinstance(w, torch.Tensor) or w.ndim not in (2, 3):
            shape = tuple(w.shape) if isinstance(w, torch.Tensor) else ""
            raise MonitorError(f"w_q({layer}) must return a tensor (n_head, head_dim, n_embd) or "
                               f"(n_head*head_dim, n_embd), got {type(w).__name__}{shape}")
        if w.ndim == 2:
            if w.shape[0] % heads:
                raise MonitorError(f"w_q({layer}) has {w.shape[0]} rows, not a multiple of the {heads} heads its "
                                   "attention call had")
            w = w.reshape(heads, w.shape[0] // heads, w.shape[1])
        if w.shape[0] != heads:
            raise MonitorError(f"w_q({layer}) has {w.shape[0]} heads; its attention call had {heads}")
        return w.detach()

    def _weight_norms(self, layers, heads) -> list[np.ndarray]:
        """‖W_Q[h]‖₂ per layer (NaN where W_Q is out of reach): one batched :func:`spectral_norms` where the layers'
        W_Q share a shape (one transfer for the model), else one call per layer."""
        if self.w_q is None:
            return [np.full(h, np.nan) for h in heads]
        ws = [self._w_q(layer, h) for layer, h in zip(layers, heads)]
        if len({(tuple(w.shape), w.device) for w in ws}) == 1:
            return list(spectral_norms(torch.stack(ws)).double().numpy())
        return [spectral_norms(w).double().numpy() for w in ws]

    @torch.no_grad()
    def _measure(self, step: int, calls: dict, n_calls: int):
        if not n_calls:
            raise MonitorError(f"step {step}: the forward run inside monitor.step() made no "
                               "scaled_dot_product_attention call; expected an lpfa.model.GPT or a model whose "
                               "attention calls torch.nn.functional.scaled_dot_product_attention (not compiled with "
                               "torch.compile)")
        if self.layers is not None and self.layers[-1] >= n_calls:
            raise MonitorError(f"layers {[x for x in self.layers if x >= n_calls]} are not layers of the model: its "
                               f"forward made {n_calls} attention calls (layers 0..{n_calls - 1})")
        layers = sorted(calls)
        # queued on the device; no synchronisation yet
        measured = [_call_measures(calls[x]["q"], calls[x]["k"], calls[x]["causal"], calls[x]["mask"],
                                   calls[x]["scale"], self.eps) for x in layers]
        heads = [len(mx) for mx, _ in measured]
        norms = self._weight_norms(layers, heads)
        # the one transfer of the measures
        flat = torch.cat([torch.cat([mx, tie]) for mx, tie in measured]).cpu().numpy()
        rows, at = [], 0
        for layer, H, wq in zip(layers, heads, norms):
            rows.append(pd.DataFrame({"step": step, "layer": layer, "head": np.arange(H),
                                      "max_logit": flat[at : at + H], "tie_fraction_bf16": flat[at + H : at + 2 * H],
                                      "wq_spectral_norm": wq}))
            at += 2 * H
        frame, events = self._alarm.feed(pd.concat(rows, ignore_index=True))
        self._frames.append(frame)
        if self.writer is not None:
            for r in frame.itertuples(index=False):
                for measure in MEASURE_COLUMNS:
                    v = float(getattr(r, measure))
                    if math.isfinite(v):
                        self.writer.add_scalar(f"attention/{measure}/layer{r.layer}/head{r.head}", v, step)
        for ev in events:
            self.events.append(ev)
            if self.on_warning is not None:
                self.on_warning(ev)
            else:
                warnings.warn(str(ev), AttentionWarning, stacklevel=3)


# --------------------------------------------------------------------------------------------------
# the cost


def amortised_overhead(b: dict) -> float:
    """The monitor's overhead as one capture's extra time spread over ``every`` steps, from a
    ``benchmarks/monitor_overhead.py`` result: capture extra / (every · plain median). Steps between captures run no
    monitor code (:meth:`AttentionMonitor.step` returns a null context), so any difference of theirs from plain steps
    is the GPU clock drifting between the benchmark's segments, which moves the ratio of means either way;
    this estimate leaves that drift out."""
    return b["capture_extra_ms"] / (b["every"] * b["plain_median_ms"])
