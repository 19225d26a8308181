"""Early-warning thresholds for the failure: learnt from the committed runs by a maintainer command, read from a
committed file at run time.

A head is judged by three of the chain's links that one probe batch and the weights show: its largest attention
logit (the runaway, Fig. 2's precursor), the share of its rows with tied maxima in BF16 scores (Fig. 13) and how far
its ‖W_Q[h]‖₂ stands out from the other heads of its layer (Fig. 3: ``wq_outlier`` = the norm over the layer's median).

**At run time** (:class:`lpfa.monitor.AttentionMonitor`, ``lpfa.train``'s ``on_warning``, ``lpfa doctor``) the
thresholds are those of the committed file :data:`lpfa.monitor.THRESHOLDS_FILE` (``src/lpfa/warning_thresholds.json``,
shipped with the package): nothing under ``results/`` is read, and the monitor and the trainer do not import this
module, which reads run folders. ``python -m lpfa.alarms --write`` learns the thresholds again from the committed runs
and writes that file; ``python -m lpfa.alarms`` says whether it is current, and the tests check that it is.

**The learning** (:func:`thresholds`) uses the diagnostics that every committed training run logged at its
diagnostics interval (``results/*/*/<run>/metrics.jsonl.gz``), one sample per (run, step, layer), a layer's value being
its largest over heads (a layer is flagged when any of its heads is):

* **positives**: the layer that ran away (:class:`lpfa.explosion.RunawayCriterion`) in a run with low-precision
  attention there, at the diagnostics steps of the ``lead`` steps before the runaway (what a warning should catch);
* **negatives**: every layer and step of the runs that neither ran away nor exploded, in layers whose scores are
  FP32 (``max_logit``, ``wq_outlier``; FP32 runs log ties of FP32 scores, a different quantity) or BF16
  (``tie_fraction_bf16``: the BF16 runs where neither happened).

Each precursor threshold is the smallest value that flags at most :data:`MAX_FPR` of the negative samples, reported with
its false-positive rate (share of negatives at or above it), false-negative rate (share of positives below it) and the
sample counts; ``max_logit`` also has the ``runaway`` level, the runaway criterion's own. The entry
:data:`lpfa.monitor.NO_ALARM` says what no alarm is worth (:func:`miss_rate`): the share of positives that no threshold
flags, all measures together, which ``lpfa doctor`` prints next to a ``no alarm`` verdict. The cap is strict because a
run is checked hundreds of times: a threshold chosen per sample for the best balance (Youden's J) flagged 12–31 % of
the negative samples, and so every run where neither happened (the early-warning page,
``notebooks/15_early_warning.ipynb``).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

import numpy as np
import pandas as pd

from lpfa import monitor
from lpfa.diagnostics import wq_outlier
from lpfa.explosion import RunawayCriterion
from lpfa.paths import results_dir
from lpfa.run import Run, diag_frame, layer_precision, run_verdict

LEAD_STEPS = 1000  # how long before the runaway a sample counts as a positive
MAX_FPR = 0.001  # the largest share of negative samples a precursor threshold may flag
MEASURES = ("max_logit", "tie_fraction_bf16", "wq_outlier")


def current_thresholds() -> dict:
    """The thresholds ``lpfa doctor``, :class:`lpfa.monitor.AttentionMonitor` and ``lpfa.train`` use when none are
    given: the committed file's (:func:`lpfa.monitor.default_thresholds`), in :func:`thresholds`' format; a missing or
    damaged file is a one-line error."""
    return monitor.default_thresholds()


def fixed_thresholds() -> dict:
    """Fixed round thresholds (for tests and for a project without committed runs): a max logit of 100 is where
    QK-clip starts (:meth:`lpfa.model.GPT.qk_clip_`), 1000 is the runaway criterion's; 20 % of rows tied in BF16."""
    return {"max_logit": {"precursor": 100.0, "runaway": RunawayCriterion().logit},
            "tie_fraction_bf16": {"precursor": 0.2}}


# --------------------------------------------------------------------------------------------------
# learning from the committed runs (the maintainer's path: it reads run folders)


def training_runs(root=None) -> list[Path]:
    """Every committed training run folder: ``<results>/<experiment>/<run>/<label>/`` with a config and metrics."""
    base = Path(root) if root else results_dir()
    return sorted(c.parent for c in base.glob("*/*/*/config.json")
                  if any((c.parent / f).is_file() for f in ("metrics.jsonl", "metrics.jsonl.gz")))


def layer_samples(run_dir) -> pd.DataFrame:
    """One row per (step, layer) of a run's diagnostics: ``max_logit`` and ``tie_fraction`` (largest over heads),
    ``wq_outlier`` (largest ‖W_Q[h]‖₂ over the layer's median, Fig. 3) and the layer's score ``precision``; a step
    logged twice (a resumed run) is one group of both records' heads. ValueError for a run without per-head
    diagnostics."""
    diag = diag_frame(run_dir)
    heads = {}
    for m in ("max_logit", "tie_fraction", "wq_spectral_norm"):
        if diag.empty or m not in diag:
            raise ValueError(f"{run_dir} has no {m!r} diagnostics (was diag_interval 0?)")
        heads[m] = np.array(diag[m].tolist(), dtype=float)  # (records, layers, heads)
        if heads[m].ndim != 3:
            raise ValueError(f"{run_dir}: its {m!r} diagnostics are not per head (records, layers, heads)")
    steps = diag["step"].to_numpy()
    order = np.argsort(steps, kind="stable")
    uniq, first = np.unique(steps[order], return_index=True)
    groups = np.split(order, first[1:])  # the records of each step, in record order
    with warnings.catch_warnings():  # a layer without any value (all NaN) stays NaN, silently
        warnings.simplefilter("ignore", RuntimeWarning)
        cols = {m: np.stack([np.nanmax(np.concatenate(list(heads[m][g]), axis=-1), axis=-1) for g in groups])
                for m in ("max_logit", "tie_fraction")}
        cols["wq_outlier"] = np.stack([np.nanmax(wq_outlier(np.concatenate(list(heads["wq_spectral_norm"][g]),
                                                                         axis=-1)), axis=-1) for g in groups])
    n_layer = cols["max_logit"].shape[1]
    out = pd.DataFrame({"step": np.repeat(uniq, n_layer), "layer": np.tile(np.arange(n_layer), len(uniq)),
                        **{m: v.reshape(-1) for m, v in cols.items()}})
    return out.assign(precision=out.layer.map(dict(enumerate(layer_precision(Run(run_dir))))))


def labelled_samples(root=None, lead: int = LEAD_STEPS) -> pd.DataFrame:
    """:func:`layer_samples` of every committed run (:func:`training_runs`) with ``run`` (experiment/run/label),
    ``class`` ("positive", "negative" or None, as the module docstring defines) and the run's ``runaway step``."""
    out = []
    for d in training_runs(root):
        try:
            s = layer_samples(d)
        except (ValueError, KeyError, FileNotFoundError):  # a run without per-head diagnostics
            continue
        v = run_verdict(d)
        ra, layer = v["runaway_step"], v["runaway_layer"]
        cls = pd.Series(None, index=s.index, dtype=object)
        if ra is not None:
            pos = (s.layer == layer) & (s.step < ra) & (s.step >= ra - lead) & (s.precision != "fp32")
            cls[pos] = "positive"
        elif not v["exploded"]:
            cls[:] = "negative"
        out.append(s.assign(run="/".join(d.parts[-3:]), **{"class": cls, "runaway step": ra}))
    return pd.concat(out, ignore_index=True) if out else pd.DataFrame()


def threshold_at_fpr(pos, neg, max_fpr: float = MAX_FPR) -> dict:
    """The smallest threshold t (a sample is flagged when its value ≥ t; candidates: the samples' values, and just
    above the largest negative) whose false-positive rate on ``neg`` is at most ``max_fpr``:
    ``{"value", "fpr", "fnr", "positives", "negatives"}`` with the rates measured on these samples."""
    pos, neg = np.asarray(pos, float), np.asarray(neg, float)
    pos, neg = pos[np.isfinite(pos)], neg[np.isfinite(neg)]
    if not len(pos) or not len(neg):
        raise ValueError(f"need positive and negative samples, got {len(pos)} and {len(neg)}")
    if not 0 <= max_fpr < 1:
        raise ValueError(f"max_fpr={max_fpr!r}: expected a fraction in [0, 1)")
    cands = np.unique(np.concatenate([pos, neg, [np.nextafter(neg.max(), np.inf)]]))
    fpr = (neg[None, :] >= cands[:, None]).mean(1)
    i = int(np.argmax(fpr <= max_fpr))  # fpr falls with t: the first candidate within the cap
    return {"value": float(cands[i]), "fpr": float(fpr[i]), "fnr": float((pos < cands[i]).mean()),
            "positives": int(len(pos)), "negatives": int(len(neg))}


def miss_rate(positives: pd.DataFrame, thr: dict) -> dict:
    """What no alarm is worth: of the ``positives`` (samples of class "positive", :func:`labelled_samples`), those
    that no level of ``thr`` flags, all measures together (``tie_fraction_bf16`` only in BF16 layers, as :func:`derive`
    learns it; ``max_logit`` below its runaway level too). ``{"fnr", "missed", "positives"}``."""
    flagged = np.zeros(len(positives), dtype=bool)
    for measure, column in (("max_logit", "max_logit"), ("wq_outlier", "wq_outlier"),
                            ("tie_fraction_bf16", "tie_fraction")):
        judged = (positives.precision == "bf16").to_numpy() if measure == "tie_fraction_bf16" else True
        for level in thr.get(measure, {}).values():
            flagged |= judged & (positives[column].to_numpy() >= level["value"])  # NaN flags nothing
    missed = int((~flagged).sum())
    return {"fnr": missed / len(positives), "missed": missed, "positives": int(len(positives))}


def derive(samples: pd.DataFrame, max_fpr: float = MAX_FPR, lead: int = LEAD_STEPS) -> dict:
    """Thresholds from :func:`labelled_samples` (see the module docstring) at a per-sample false-positive rate of at
    most ``max_fpr``; a measure without both classes is absent (all of them without samples: no committed run).
    With a precursor level, :data:`lpfa.monitor.NO_ALARM` gives their :func:`miss_rate` and the ``lead`` the
    samples were labelled with (``lead_steps``)."""
    out = {}
    if samples.empty:
        return {"max_logit": {"runaway": {"value": RunawayCriterion().logit}}}
    pos, neg = samples[samples["class"] == "positive"], samples[samples["class"] == "negative"]
    for measure, column, neg_precision in (("max_logit", "max_logit", "fp32"), ("wq_outlier", "wq_outlier", "fp32"),
                                           ("tie_fraction_bf16", "tie_fraction", "bf16")):
        p = pos[pos.precision == "bf16"] if measure == "tie_fraction_bf16" else pos
        n = neg[neg.precision == neg_precision]
        try:
            out[measure] = {"precursor": threshold_at_fpr(p[column], n[column], max_fpr)}
        except ValueError:
            continue
    out.setdefault("max_logit", {})["runaway"] = {"value": RunawayCriterion().logit}
    if len(pos) and any("precursor" in v for v in out.values()):
        out[monitor.NO_ALARM] = {**miss_rate(pos, out), "lead_steps": int(lead)}
    return out


def thresholds(root=None, lead: int = LEAD_STEPS, max_fpr: float = MAX_FPR) -> dict:
    """``{measure: {"precursor": {"value", "fpr", "fnr", "positives", "negatives"}}}`` for :data:`MEASURES`, plus
    ``max_logit["runaway"]`` and the miss rate of them all (:data:`lpfa.monitor.NO_ALARM`), learnt from the committed
    runs under ``root`` (default: the project's results)."""
    return derive(labelled_samples(root, lead), max_fpr, lead)


def learnt_thresholds(root=None) -> dict:
    """What ``python -m lpfa.alarms --write`` commits: :func:`thresholds` at the defaults, or :func:`fixed_thresholds`
    where no run under ``root`` has the diagnostics to learn a precursor level from."""
    learnt = thresholds(root)
    return learnt if any("precursor" in v for v in learnt.values()) else fixed_thresholds()


def write_thresholds(path=None, root=None) -> dict:
    """Learn :func:`learnt_thresholds` from the runs under ``root`` and write them to ``path`` (JSON; default the
    committed file, :data:`lpfa.monitor.THRESHOLDS_FILE`); returns them."""
    thr = learnt_thresholds(root)
    Path(path or monitor.THRESHOLDS_FILE).write_text(json.dumps(thr, indent=1) + "\n")
    return thr


def lead_times(samples: pd.DataFrame, thr: dict) -> pd.DataFrame:
    """Per run that ran away: the first diagnostics step at which its runaway layer crossed each precursor threshold
    (before the runaway), and how many steps earlier that was (``lead``); NaN where it never warned in time."""
    rows = {}
    for run, s in samples[samples["runaway step"].notna()].groupby("run"):
        ra = int(s["runaway step"].iloc[0])
        layer = s[s["class"] == "positive"].layer
        if layer.empty:
            continue
        s = s[(s.layer == layer.iloc[0]) & (s.step < ra)]
        row = {"runaway step": ra}
        for measure, column in (("max_logit", "max_logit"), ("wq_outlier", "wq_outlier"),
                                ("tie_fraction_bf16", "tie_fraction")):
            if measure in thr and "precursor" in thr[measure]:
                hit = s[s[column] >= thr[measure]["precursor"]["value"]].step
                row[f"{measure} lead"] = float(ra - hit.min()) if len(hit) else np.nan
        rows[run] = row
    return pd.DataFrame.from_dict(rows, orient="index")


def main(argv: list[str] | None = None) -> int:
    """``python -m lpfa.alarms [--write]``: learn the thresholds from the committed runs; with ``--write`` write them
    to :data:`lpfa.monitor.THRESHOLDS_FILE`, else say whether that file holds them (status 1 if not)."""
    p = argparse.ArgumentParser(prog="python -m lpfa.alarms", description=main.__doc__)
    p.add_argument("--write", action="store_true", help=f"write the learnt thresholds to {monitor.THRESHOLDS_FILE}")
    p.add_argument("--results", default=None, help="the results folder to learn from (default: the project's)")
    a = p.parse_args(argv)
    if a.write:
        thr = write_thresholds(root=a.results)
        print(f"wrote {monitor.THRESHOLDS_FILE}:\n{json.dumps(thr, indent=1)}")
        return 0
    thr = learnt_thresholds(a.results)
    try:
        committed = current_thresholds()
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if committed == thr:
        print(f"{monitor.THRESHOLDS_FILE} holds the thresholds the runs give")
        return 0
    print(f"{monitor.THRESHOLDS_FILE} is stale: `python -m lpfa.alarms --write` writes the thresholds the runs "
          f"give:\n{json.dumps(thr, indent=1)}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    raise SystemExit(main())
