"""How often does a run fail, and by when: survival over training steps with runs that stopped before failing.

A run either *failed* at a step (its loss exploded, :mod:`lpfa.explosion`) or was *censored*: it stopped at a step
without failing, so all we know is that it had not failed by then. The Kaplan–Meier estimate treats both honestly:
at each failure step t it multiplies the survival by 1 − d/n, where d runs failed at t and n were still running
(not failed, not stopped before t). A run censored at step c counts as at risk for every failure step ≤ c.

The fraction that failed within a horizon is a binomial proportion over the runs that either failed before it or
ran past it; its 95% interval is Clopper–Pearson's (exact: the binomial tail probabilities, no normal approximation),
which is what a handful of seeds needs.
"""

from __future__ import annotations

import math

import numpy as np
import pandas as pd


def kaplan_meier(steps, failed) -> pd.DataFrame:
    """The Kaplan–Meier survival curve of runs that ended at ``steps`` (failure or censoring step) with ``failed``
    (True: failed there; False: stopped there without failing). One row per distinct step at which a run failed, with
    ``at_risk``, ``failed`` and ``survival`` (the fraction not yet failed just after that step), starting from a row
    at step 0 with survival 1."""
    steps = np.asarray(steps, dtype=np.int64)
    failed = np.asarray(failed, dtype=bool)
    if steps.ndim != 1 or steps.shape != failed.shape:
        raise ValueError(f"steps and failed must be 1-d of one length, got shapes {steps.shape} and {failed.shape}")
    if (steps < 0).any():
        raise ValueError(f"steps must be >= 0, got {steps.min()}")
    rows, s = [{"step": 0, "at_risk": len(steps), "failed": 0, "survival": 1.0}], 1.0
    for t in np.unique(steps[failed]):
        n = int((steps >= t).sum())
        d = int(((steps == t) & failed).sum())
        s *= 1.0 - d / n
        rows.append({"step": int(t), "at_risk": n, "failed": d, "survival": s})
    return pd.DataFrame(rows)


def _binom_cdf(k: int, n: int, p: float) -> float:
    return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(k + 1))


def clopper_pearson(k: int, n: int, level: float = 0.95) -> tuple[float, float]:
    """The exact (Clopper–Pearson) ``level`` interval of a proportion with ``k`` successes in ``n`` trials:
    the p at which P(X ≥ k) and P(X ≤ k) each reach (1 − level)/2, found by bisection."""
    if not (isinstance(k, (int, np.integer)) and isinstance(n, (int, np.integer))) or n < 1 or not 0 <= k <= n:
        raise ValueError(f"k={k!r}, n={n!r}: expected integers with 0 <= k <= n and n >= 1")
    if not 0 < level < 1:
        raise ValueError(f"level={level!r}: expected a probability strictly between 0 and 1")
    alpha = (1 - level) / 2

    def solve(f) -> float:  # the p in [0, 1] where the decreasing f(p) crosses alpha
        lo, hi = 0.0, 1.0
        for _ in range(60):
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if f(mid) > alpha else (lo, mid)
        return (lo + hi) / 2

    lower = 0.0 if k == 0 else 1.0 - solve(lambda p: 1.0 - _binom_cdf(k - 1, n, 1.0 - p))
    upper = 1.0 if k == n else solve(lambda p: _binom_cdf(k, n, p))
    return lower, upper


def failed_within(steps, failed, horizon: int) -> tuple[int, int]:
    """``(k, n)``: of the runs that failed at or before ``horizon`` or ran to it without failing (``n``), how many
    failed (``k``). A run censored before ``horizon`` is left out: it cannot say what happened by then."""
    steps = np.asarray(steps, dtype=np.int64)
    failed = np.asarray(failed, dtype=bool)
    k = int((failed & (steps <= horizon)).sum())
    n = k + int((steps >= horizon)[~(failed & (steps <= horizon))].sum())
    return k, n
