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
