"""When has a run exploded? One criterion, stated and computed by code (paper Fig. 2).

A run explodes at the first step where its training loss, smoothed over ``window`` steps, stays more
than ``margin`` above the lowest smoothed loss seen so far for ``patience`` consecutive steps — or
where the loss is not finite. The explosion step is the first step of that excursion.

Runs of the book's smaller ``repro`` config did not explode within 30k steps (the paper-recipe GPT-2 S run did:
``results/paper_recipe``), but one layer's attention logits ran away in BF16 only. :class:`RunawayCriterion` states
that precursor as a verdict too, so shorter runs (the isolation table, the seeds) can be compared by it: the first
diagnostics record from which some layer's largest attention logit stays above ``logit`` for ``patience`` records.
With the default 1000 it separates the committed runs (``tests/test_explosion.py`` checks this): the BF16
runs' layer 1 stays above it from step 6,400, while no layer of the FP32, SFA or FA2 runs ever exceeded 400.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class ExplosionCriterion:
    window: int = 50
    margin: float = 1.0
    patience: int = 50

    def __post_init__(self):
        if self.window < 1 or self.patience < 1 or not (self.margin > 0 and math.isfinite(self.margin)):
            raise ValueError(f"need window >= 1, patience >= 1 and a finite margin > 0, got {self}")

    def describe(self) -> str:
        return (f"training loss, smoothed over {self.window} steps, more than {self.margin:g} above its running "
                f"minimum for {self.patience} consecutive steps, or a non-finite loss")

    def to_dict(self) -> dict:
        return {**asdict(self), "description": self.describe()}


def first_sustained(above, patience: int) -> int | None:
    """Position where the first run of at least ``patience`` consecutive True values in ``above`` starts, or
    None: the "for N records in a row" rule shared by every verdict here. NumPy only."""
    streak = 0
    for i, a in enumerate(np.asarray(above, dtype=bool)):
        streak = streak + 1 if a else 0
        if streak >= patience:
            return i - patience + 1
    return None


def explosion_step(loss, criterion: ExplosionCriterion = ExplosionCriterion(), steps=None) -> int | None:
    """The step at which ``loss`` explodes, or None. ``loss``: a pandas Series indexed by step, or an
    array of losses with their ``steps`` (NumPy only, so a GPU machine without pandas can call it)."""
    if steps is None:
        vals, steps = loss.to_numpy(dtype=float), loss.index.to_numpy()
    else:
        vals, steps = np.asarray(loss, dtype=float), np.asarray(steps)
    bad = ~np.isfinite(vals)
    first_bad = int(steps[bad.argmax()]) if bad.any() else None
    keep = ~bad if first_bad is None else steps < first_bad
    vals, idx = vals[keep], steps[keep]
    w = criterion.window
    c = np.concatenate([[0.0], np.cumsum(vals)])
    n = np.arange(1, len(vals) + 1)
    lo = np.maximum(n - w, 0)
    smooth = (c[n] - c[lo]) / (n - lo)  # rolling mean over the last `window` steps (fewer at the start)
    start = first_sustained(smooth - np.minimum.accumulate(smooth) > criterion.margin, criterion.patience)
    return int(idx[start]) if start is not None else first_bad


@dataclass(frozen=True)
class RunawayCriterion:
    logit: float = 1000.0
    patience: int = 5

    def __post_init__(self):
        if self.patience < 1 or not (self.logit > 0 and math.isfinite(self.logit)):
            raise ValueError(f"need patience >= 1 and a finite logit > 0, got {self}")

    def describe(self) -> str:
        return (f"largest attention logit of a layer (over its heads, on the diagnostics batch) above {self.logit:g} "
                f"for {self.patience} consecutive diagnostics records")

    def to_dict(self) -> dict:
        return {**asdict(self), "description": self.describe()}


def logit_runaway(max_logit, steps, criterion: RunawayCriterion = RunawayCriterion()) -> tuple[int, int] | None:
    """``(step, layer)`` of the first logit runaway, or None. ``max_logit``: (records, layers, heads) or
    (records, layers) largest attention logits, one record per entry of ``steps``. NumPy only."""
    m = np.asarray(max_logit, dtype=float)
    if m.ndim == 3:
        m = m.max(axis=2)
    if m.ndim != 2 or len(m) != len(steps):
        raise ValueError(f"max_logit must be (records, layers[, heads]) with one record per step, got shape "
                         f"{np.asarray(max_logit).shape} for {len(steps)} steps")
    above = m > criterion.logit  # non-finite logits (NaN) never count as above
    starts = {layer: first_sustained(above[:, layer], criterion.patience) for layer in range(m.shape[1])}
    starts = {layer: s for layer, s in starts.items() if s is not None}
    if not starts:
        return None
    first = min(starts.values())
    tied = [layer for layer, s in starts.items() if s == first]
    return int(steps[first]), max(tied, key=lambda layer: m[first, layer])  # several at once: the largest logit


def runaway_heads(max_logit, steps, layer: int, criterion: RunawayCriterion = RunawayCriterion()) -> dict[int, int]:
    """``{head: step}``: the heads of ``layer`` whose own largest logit ran away (above ``criterion.logit`` for
    ``criterion.patience`` consecutive records), with the step each one's runaway starts, earliest first.
    ``max_logit``: (records, layers, heads), one record per entry of ``steps``. NumPy only."""
    m = np.asarray(max_logit, dtype=float)
    if m.ndim != 3 or len(m) != len(steps):
        raise ValueError(f"max_logit must be (records, layers, heads) with one record per step, got shape {m.shape} "
                         f"for {len(steps)} steps")
    if not 0 <= layer < m.shape[1]:
        raise ValueError(f"layer {layer} is not one of the run's {m.shape[1]} layers")
    starts = {h: first_sustained(m[:, layer, h] > criterion.logit, criterion.patience) for h in range(m.shape[2])}
    ran = ((h, int(steps[s])) for h, s in starts.items() if s is not None)
    return dict(sorted(ran, key=lambda kv: (kv[1], kv[0])))


def heads_text(heads) -> str:
    """``head 5`` or ``heads 2, 5``: head indices in words, sorted."""
    heads = sorted(int(h) for h in heads)
    return f"head{'s' if len(heads) > 1 else ''} {', '.join(map(str, heads))}"


def attention_label(train_conf: dict) -> str:
    """What a run's attention was: the lpfa policy preset, or the backend (``sdpa_fp32``, ...) otherwise, then
    any per-layer policies and FP32 heads, e.g. ``sdpa_fp32; layer 1: paper_untiled`` or
    ``paper_untiled; FP32 heads 2, 5 of layer 1``."""
    backend = train_conf.get("attn_backend", "lpfa")
    parts = [train_conf["attn_policy"] if backend == "lpfa" else backend]
    layer_policies = sorted((train_conf.get("layer_policies") or {}).items(), key=lambda kv: int(kv[0]))
    fp32_heads = sorted((train_conf.get("fp32_heads") or {}).items(), key=lambda kv: int(kv[0]))
    parts += [f"layer {layer}: {pol}" for layer, pol in layer_policies]
    parts += [f"FP32 {heads_text(heads)} of layer {layer}" for layer, heads in fp32_heads if heads]
    return "; ".join(parts)


def rise_step(series, baseline_records: int = 5, factor: float = 3.0, patience: int = 3) -> int | None:
    """First step where a diagnostic (a pandas Series indexed by step, e.g. a layer's tie fraction) stays
    above ``factor`` × its mean over the first ``baseline_records`` records for ``patience`` records."""
    base = float(series.iloc[:baseline_records].mean())
    above = (series > factor * max(base, 1e-12)).to_numpy(copy=True)
    above[:baseline_records] = False  # the baseline itself cannot rise above itself
    start = first_sustained(above, patience)
    return int(series.index[start]) if start is not None else None
