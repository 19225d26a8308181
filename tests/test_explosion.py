"""The explosion criterion on synthetic loss curves with known answers."""

import numpy as np
import pandas as pd
import pytest

from lpfa.explosion import ExplosionCriterion, explosion_step

C = ExplosionCriterion(window=10, margin=1.0, patience=20)


def curve(n=600, seed=None):
    rng = np.random.default_rng(seed)
    return pd.Series(4.0 * np.exp(-np.arange(n) / 150) + 3.0 + 0.05 * rng.standard_normal(n), index=np.arange(n))


def test_stable_run_does_not_explode():
    assert explosion_step(curve(), C) is None


def test_sustained_jump_is_found_at_its_start():
    loss = curve()
    loss.iloc[400:] += 3.0
    s = explosion_step(loss, C)
    assert s is not None and 400 <= s <= 410  # the smoothing window delays it by less than a window


def test_short_spike_is_not_an_explosion():
    loss = curve()
    loss.iloc[300:310] += 5.0  # 10 steps: the smoothed excursion lasts < patience
    assert explosion_step(loss, C) is None


def test_non_finite_loss_is_an_explosion():
    loss = curve()
    loss.iloc[250] = np.nan
    assert explosion_step(loss, C) == 250
    loss = curve()
    loss.iloc[123:] = np.inf
    assert explosion_step(loss, C) == 123


def test_bad_criterion():
    with pytest.raises(ValueError, match="margin"):
        ExplosionCriterion(margin=0)


def test_rise_step():
    from lpfa.explosion import rise_step

    s = pd.Series([0.03] * 20 + [0.2] * 10, index=np.arange(30) * 100)
    assert rise_step(s) == 2000
    assert rise_step(pd.Series([0.03] * 30, index=np.arange(30))) is None
    spike = pd.Series([0.03] * 10 + [0.5, 0.03] * 10, index=np.arange(30))
    assert rise_step(spike) is None  # never three records in a row


def test_logit_runaway():
    import numpy as np

    from lpfa.explosion import RunawayCriterion, logit_runaway

    rng = np.random.default_rng()
    n, L, H = 40, 4, 3
    m = rng.uniform(10, 400, size=(n, L, H))
    steps = np.arange(n) * 100
    assert logit_runaway(m, steps) is None
    m[20:23, 1, 0] = 5000  # a spike of three records is not a runaway
    assert logit_runaway(m, steps) is None
    m[30:, 2, 1] = 2000  # layer 2 from record 30 on
    assert logit_runaway(m, steps) == (3000, 2)
    assert logit_runaway(m.max(axis=2), steps) == (3000, 2)
    assert logit_runaway(m, steps, RunawayCriterion(logit=3000, patience=3)) == (2000, 1)
    m[25:, 3, :] = np.nan  # a non-finite logit is not "above"
    assert logit_runaway(m, steps) == (3000, 2)
    with pytest.raises(ValueError, match="one record per step"):
        logit_runaway(m, steps[:-1])
    with pytest.raises(ValueError, match="patience"):
        RunawayCriterion(patience=0)


def test_committed_runs_runaway_verdicts():
    """The criterion's stated separation holds on the committed runs (results/repro_pair, repro_twins)."""
    from conftest import ROOT

    from lpfa.run import run_verdict

    pair, twins = ROOT / "results/repro_pair/h200x2-2026-11-29", ROOT / "results/repro_twins/h200-2026-11-29"
    from lpfa.run import read_records

    for d in (pair / "bf16", twins / "bf16"):  # the two BF16 runs are bit-identical up to step 7,338
        v = run_verdict(d)
        assert (v["runaway_step"], v["runaway_layer"]) == (6400, 1) and not v["exploded"], d
    for d in (pair / "fp32", twins / "fp32", twins / "sfa", twins / "fa2"):
        assert run_verdict(d)["runaway_step"] is None, d
        assert max(np.max(r["diag"]["max_logit"]) for r in read_records(d) if "diag" in r) < 400, d


def test_first_sustained():
    from lpfa.explosion import first_sustained

    a = [False, True, True, False, True, True, True, False]
    assert first_sustained(a, 3) == 4 and first_sustained(a, 2) == 1 and first_sustained(a, 4) is None
    assert first_sustained([], 1) is None


def test_runaway_heads_lists_each_sustained_head_with_its_start():
    from lpfa.explosion import RunawayCriterion, runaway_heads

    steps = [0, 100, 200, 300, 400, 500]
    m = np.zeros((6, 2, 4))
    m[1:, 1, 2] = 5000  # head 2 from step 100, sustained
    m[3:, 1, 0] = 2000  # head 0 from step 300
    m[[1, 3, 5], 1, 3] = 9000  # head 3: above, never twice in a row
    m[:, 0, 1] = 1e5  # another layer
    crit = RunawayCriterion(logit=1000, patience=2)
    assert runaway_heads(m, steps, layer=1, criterion=crit) == {2: 100, 0: 300}
    assert list(runaway_heads(m, steps, layer=1, criterion=crit)) == [2, 0]  # earliest first
    assert runaway_heads(m, steps, layer=0, criterion=crit) == {1: 0}
    m[:, 1, 1] = np.nan  # a NaN logit never counts as above
    assert 1 not in runaway_heads(m, steps, layer=1, criterion=crit)
    with pytest.raises(ValueError, match="layer 2 is not one of the run's 2 layers"):
        runaway_heads(m, steps, layer=2)
    with pytest.raises(ValueError, match=r"must be \(records, layers, heads\)"):
        runaway_heads(m[:, :, 0], steps, layer=0)
