"""When has a run exploded? One criterion, stated and computed by code (paper Fig. 2).

A run explodes at the first step where its training loss, smoothed over ``window`` steps, stays more
than ``margin`` above the lowest smoothed loss seen so far for ``patience`` consecutive steps — or
where the loss is not finite. The explosion step is the first step of that excursion.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass


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


def explosion_step(loss, criterion: ExplosionCriterion = ExplosionCriterion(), steps=None) -> int | None:
    """The step at which ``loss`` explodes, or None. ``loss``: a pandas Series indexed by step, or an
    array of losses with their ``steps`` (NumPy only, so a GPU machine without pandas can call it)."""
    import numpy as np

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
    above = smooth - np.minimum.accumulate(smooth) > criterion.margin
    streak = 0
    for i, a in enumerate(above):
        streak = streak + 1 if a else 0
        if streak >= criterion.patience:
            return int(idx[i - criterion.patience + 1])
    return first_bad


def attention_label(train_conf: dict) -> str:
    """What a run's attention was: the lpfa policy preset, or the backend (``sdpa_fp32``, ...) otherwise."""
    backend = train_conf.get("attn_backend", "lpfa")
    return train_conf["attn_policy"] if backend == "lpfa" else backend


def run_verdict(run_dir, criterion: ExplosionCriterion = ExplosionCriterion()) -> dict:
    """``summary.json``-style verdict of a training run folder: policy, seed, steps, exploded, explosion_step."""
    import json
    from pathlib import Path

    from lpfa.runs import read_records

    recs = {}
    for r in read_records(run_dir):
        if "loss" in r:
            recs[int(r["step"])] = float(r["loss"])  # a resumed run may repeat steps: the last record wins
    conf = json.loads((Path(run_dir) / "config.json").read_text())["train"]
    steps = sorted(recs)
    step = explosion_step([recs[s] for s in steps], criterion, steps=steps)
    return {"policy": attention_label(conf), "attn_backend": conf.get("attn_backend", "lpfa"), "layer_policies": conf.get("layer_policies", {}), "optimizer": conf["optimizer"],
            "seed": conf["seed"], "init_seed": conf["init_seed"], "steps": (steps[-1] + 1) if steps else 0,
            "exploded": step is not None, "explosion_step": step, "criterion": criterion.to_dict()}


def rise_step(series, baseline_records: int = 5, factor: float = 3.0, patience: int = 3) -> int | None:
    """First step where a diagnostic (a pandas Series indexed by step, e.g. a layer's tie fraction) stays
    above ``factor`` × its mean over the first ``baseline_records`` records for ``patience`` records."""
    base = float(series.iloc[:baseline_records].mean())
    above = (series > factor * max(base, 1e-12)).to_numpy()
    streak = 0
    for i, a in enumerate(above):
        if i < baseline_records:
            continue
        streak = streak + 1 if a else 0
        if streak >= patience:
            return int(series.index[i - patience + 1])
    return None
