import math

import numpy as np
import pytest

from lpfa.survival import clopper_pearson, failed_within, kaplan_meier


def test_kaplan_meier_without_censoring_is_the_empirical_survival():
    rng = np.random.default_rng()
    steps = rng.integers(1, 50, size=int(rng.integers(1, 30)))
    km = kaplan_meier(steps, np.ones(len(steps), bool))
    for _, row in km.iterrows():
        assert row.survival == pytest.approx((steps > row.step).mean(), abs=1e-12)


def test_kaplan_meier_with_censoring_by_hand():
    # failures at 3, 5 (two), 9; censored at 4, 5 and 10: at 3 all 7 at risk; at 5 five (4 left); at 9 one left
    km = kaplan_meier([3, 4, 5, 5, 5, 9, 10], [True, False, True, True, False, True, False])
    assert km.step.tolist() == [0, 3, 5, 9]
    assert km.at_risk.tolist() == [7, 7, 5, 2]
    want = [1.0, 6 / 7, 6 / 7 * 3 / 5, 6 / 7 * 3 / 5 * 1 / 2]
    assert km.survival.tolist() == pytest.approx(want, abs=1e-15)


def test_kaplan_meier_bad_input():
    with pytest.raises(ValueError, match="one length"):
        kaplan_meier([1, 2], [True])
    with pytest.raises(ValueError, match="steps must be >= 0"):
        kaplan_meier([-1], [True])


@pytest.mark.parametrize("k,n,lo,hi", [(0, 3, 0.0, 1 - 0.025 ** (1 / 3)), (3, 3, 0.025 ** (1 / 3), 1.0),
                                       (5, 10, 0.187086, 0.812914), (3, 8, 0.085232, 0.755136)])
def test_clopper_pearson_known_values(k, n, lo, hi):
    assert clopper_pearson(k, n) == pytest.approx((lo, hi), abs=2e-6)


def test_clopper_pearson_bounds_put_alpha_in_each_tail():
    rng = np.random.default_rng()
    n = int(rng.integers(2, 40))
    k = int(rng.integers(1, n))
    lo, hi = clopper_pearson(k, n, 0.9)

    def cdf(j, p):
        return sum(math.comb(n, i) * p**i * (1 - p) ** (n - i) for i in range(j + 1))

    assert 1 - cdf(k - 1, lo) == pytest.approx(0.05, abs=1e-9)  # P(X >= k | lo)
    assert cdf(k, hi) == pytest.approx(0.05, abs=1e-9)  # P(X <= k | hi)


def test_clopper_pearson_bad_input():
    for k, n in ((4, 3), (-1, 3), (1, 0), (1.5, 3)):
        with pytest.raises(ValueError, match=r"k=.*n=.*expected integers"):
            clopper_pearson(k, n)
    with pytest.raises(ValueError, match="level=1"):
        clopper_pearson(1, 3, 1)


def test_failed_within_leaves_out_runs_censored_before_the_horizon():
    steps = [5000, 5800, 4900, 6300, 2000, 9900]
    failed = [True, True, True, False, False, False]
    assert failed_within(steps, failed, 6000) == (3, 5)  # 2,000 stopped too soon to say; 6,300, 9,900 ran past
    assert failed_within(steps, failed, 5000) == (2, 5)  # 5,800 had not failed by 5,000
