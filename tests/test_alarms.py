"""lpfa.alarms: thresholds learnt from run folders whose classes are known by construction."""


import numpy as np
import pytest
from conftest import write_diag_run

from lpfa import alarms, run


def test_thresholds_separate_known_classes(tmp_path):
    rng = np.random.default_rng()
    lo = list(rng.uniform(5, 20, size=20))  # FP32 runs: logits 5..20, W_Q 1..1.2x the median, ties of FP32 scores
    for i in range(3):
        write_diag_run(tmp_path, f"fp32_{i}", lo, [0.5] * 20, list(rng.uniform(1.0, 1.2, size=20)), backend="sdpa_fp32")
    write_diag_run(tmp_path, "bf16_clean", lo, list(rng.uniform(0.0, 0.05, size=20)), [1.0] * 20)  # BF16, never ran away
    # BF16 runs that run away at step 1000 (5 records > 1000 from there): logit 300, ties 0.3, W_Q 3x before it
    up = [10.0] * 5 + [300.0] * 5 + [5000.0] * 10
    for i in range(2):
        write_diag_run(tmp_path, f"bf16_{i}", up, [0.01] * 5 + [0.3] * 15, [1.0] * 5 + [3.0] * 15)
    s = alarms.labelled_samples(tmp_path, lead=500)
    pos = s[s["class"] == "positive"]
    assert set(pos.run) == {"exp/r1/bf16_0", "exp/r1/bf16_1"} and set(pos.step) == {500, 600, 700, 800, 900}
    assert (pos.layer == 1).all() and (s[s.run == "exp/r1/fp32_0"]["class"] == "negative").all()
    assert (s[s.run == "exp/r1/fp32_0"].precision == "fp32").all() and (pos.precision == "bf16").all()
    thr = alarms.derive(s)
    # perfect separation: the threshold lies above every negative (the 0.1% cap allows none of 120) and at or below
    # every positive
    assert max(lo) < thr["max_logit"]["precursor"]["value"] <= 300 and thr["max_logit"]["runaway"]["value"] == 1000.0
    assert thr["max_logit"]["precursor"]["fpr"] == 0 and thr["max_logit"]["precursor"]["fnr"] == 0
    assert thr["max_logit"]["precursor"]["positives"] == 10 and thr["max_logit"]["precursor"]["negatives"] == 3 * 20 * 2
    assert 1.0 < thr["wq_outlier"]["precursor"]["value"] <= 3.0 and thr["wq_outlier"]["precursor"]["fnr"] == 0
    tie = thr["tie_fraction_bf16"]["precursor"]  # negatives: the clean BF16 run only (FP32 runs log FP32 ties)
    assert tie["negatives"] == 40 and 0.0 < tie["value"] <= 0.3 and tie["fpr"] == 0
    lead = alarms.lead_times(s, thr)
    assert list(lead.index) == ["exp/r1/bf16_0", "exp/r1/bf16_1"] and (lead["max_logit lead"] == 500).all()
    assert alarms.thresholds(tmp_path, lead=500) == thr


def test_threshold_at_fpr_counts_rates_and_refuses_one_class():
    pos, neg = [3, 4, 5, 1.5], [1, 2, 2.5, 3.5]
    r = alarms.threshold_at_fpr(pos, neg, max_fpr=0.25)  # 3 flags one negative of 4 (3.5): within the cap
    assert r["value"] == 3 and r["fpr"] == 0.25 and r["fnr"] == 0.25 and (r["positives"], r["negatives"]) == (4, 4)
    r = alarms.threshold_at_fpr(pos, neg, max_fpr=0.0)  # just above every negative: 4 and 5 flagged
    assert r["value"] == np.nextafter(3.5, np.inf) and r["fpr"] == 0 and r["fnr"] == 0.5
    r = alarms.threshold_at_fpr([1.0], [2.0], max_fpr=0.0)  # no positive above the negatives: just above the largest
    assert r["value"] == np.nextafter(2.0, np.inf) and r["fnr"] == 1.0
    with pytest.raises(ValueError, match="need positive and negative samples, got 2 and 0"):
        alarms.threshold_at_fpr([1, 2], [])
    with pytest.raises(ValueError, match=r"max_fpr=1.5: expected a fraction in \[0, 1\)"):
        alarms.threshold_at_fpr([1], [2], max_fpr=1.5)


def test_committed_runs_give_every_threshold():
    """On the project's own results: every measure gets a threshold from both classes (the values move as runs are
    added; the doctor reports them with their rates)."""
    thr = alarms.thresholds()
    for m in alarms.MEASURES:
        p = thr[m]["precursor"]
        assert p["positives"] > 0 and p["negatives"] > 0 and 0 <= p["fpr"] <= 1 and 0 <= p["fnr"] <= 1


def test_fp32_level_policies_are_fp32_and_a_bf16_rounding_is_not():
    from lpfa.attention import get_policy
    from lpfa.attention.policy import BF16X6, is_fp32_level

    assert is_fp32_level(get_policy("fp32")) and is_fp32_level(get_policy("fp32_split"))
    assert is_fp32_level(get_policy("fp32").with_(gemm=BF16X6, name="mine"))
    for name in ("fa2", "paper", "pv_fp32", "o_fp32", "scores_fp32"):
        assert not is_fp32_level(get_policy(name)), name
    assert not is_fp32_level(get_policy("fp32_split").with_(o_store="bf16"))


def test_a_soft_cap_keeps_the_precision_label():
    """lpfa.run.attention_precision / layer_precision: a soft-cap is part of the model, not of the precision, so
    fp32_softcap is "fp32" like fp32_split and paper_softcap "bf16" like paper; page 17's speed key agrees."""
    from lpfa.attention import get_policy
    from lpfa.model import GPTConfig
    from lpfa.pages.stabilisers import _speed_key

    def of(name):
        return run.attention_precision("lpfa", get_policy(name))

    for capped, plain, label in (("fp32_softcap", "fp32_split", "fp32"), ("paper_softcap", "paper", "bf16")):
        assert get_policy(capped).softcap == 50.0 and of(capped) == of(plain) == label
        assert run.layer_precision(GPTConfig(n_layer=2, attn_policy=capped)) == [label] * 2
    assert of("fa2") == "mixed"
    assert run.attention_precision("sdpa_fp32", None) == "fp32"
    assert run.attention_precision("sdpa", None) == "mixed"
    cfg = GPTConfig(n_layer=3, attn_policy="paper_softcap", layer_policies={0: "fp32_softcap", 2: "sdpa_fp32"})
    assert run.layer_precision(cfg) == ["fp32", "bf16", "fp32"]
    assert _speed_key("fp32_softcap", True) == _speed_key("fp32_split", True) == "FP32, compiled"
    assert _speed_key("paper_softcap", False, "muon") == _speed_key("paper", False, "muon") == "BF16, eager, muon"


def test_no_committed_runs_fall_back_to_fixed_thresholds(tmp_path, monkeypatch):
    """A checkout without results/ (a pip install, or the GPU machine's transfer without it) has no run to learn from:
    derive gives only the runaway level and current_thresholds the fixed ones (it raised KeyError 'class' before)."""
    assert alarms.labelled_samples(tmp_path).empty
    assert alarms.thresholds(tmp_path) == {"max_logit": {"runaway": {"value": 1000.0}}}
    monkeypatch.setattr(alarms, "results_dir", lambda: tmp_path / "results")
    alarms._cached.cache_clear()
    try:
        assert alarms.current_thresholds() == alarms.fixed_thresholds()
    finally:
        alarms._cached.cache_clear()
