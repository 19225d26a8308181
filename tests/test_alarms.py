"""lpfa.alarms: thresholds learnt from run folders whose classes are known by construction, and the committed file
of thresholds that the monitor, the trainer and the doctor read at run time."""

import gzip
import json
import tomllib

import numpy as np
import pandas as pd
import pytest
import torch.nn as nn
from conftest import ROOT, write_diag_run

from lpfa import alarms, monitor, run


def known_runs(root, rng):
    """Three clean FP32 runs, a clean BF16 run and two BF16 runs that run away at step 1000 under ``root``; returns
    the FP32 runs' logits."""
    lo = list(rng.uniform(5, 20, size=20))  # FP32 runs: logits 5..20, W_Q 1..1.2x the median, ties of FP32 scores
    for i in range(3):
        write_diag_run(root, f"fp32_{i}", lo, [0.5] * 20, list(rng.uniform(1.0, 1.2, size=20)), backend="sdpa_fp32")
    write_diag_run(root, "bf16_clean", lo, list(rng.uniform(0.0, 0.05, size=20)), [1.0] * 20)  # BF16, never ran away
    # BF16 runs that run away at step 1000 (5 records > 1000 from there): logit 300, ties 0.3, W_Q 3x before it
    up = [10.0] * 5 + [300.0] * 5 + [5000.0] * 10
    for i in range(2):
        write_diag_run(root, f"bf16_{i}", up, [0.01] * 5 + [0.3] * 15, [1.0] * 5 + [3.0] * 15)
    return lo


def test_thresholds_separate_known_classes(tmp_path):
    lo = known_runs(tmp_path, np.random.default_rng())
    s = alarms.labelled_samples(tmp_path, lead=500)
    pos = s[s["class"] == "positive"]
    assert set(pos.run) == {"exp/r1/bf16_0", "exp/r1/bf16_1"} and set(pos.step) == {500, 600, 700, 800, 900}
    assert (pos.layer == 1).all() and (s[s.run == "exp/r1/fp32_0"]["class"] == "negative").all()
    assert (s[s.run == "exp/r1/fp32_0"].precision == "fp32").all() and (pos.precision == "bf16").all()
    thr = alarms.derive(s, lead=500)
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


def test_no_alarm_miss_rate_counts_positives_no_threshold_flags(tmp_path):
    """A longer lead makes steps 300 and 400 of each runaway positives: their logit, ties and W_Q (10, 0.01, 1x) are
    among the clean runs', so no threshold flags them, and the miss rate of all measures together is 4 of 14."""
    known_runs(tmp_path, np.random.default_rng(0))
    s = alarms.labelled_samples(tmp_path, lead=700)
    thr = alarms.derive(s, lead=700)
    assert thr[monitor.NO_ALARM] == {"fnr": 4 / 14, "missed": 4, "positives": 14, "lead_steps": 700}
    pos = s[s["class"] == "positive"]
    assert alarms.miss_rate(pos, {})["missed"] == 14  # no threshold: every positive is missed
    late = pos[pos.step >= 500]  # the 300s (logit, ties, W_Q 3x): flagged by each measure alone
    for m in alarms.MEASURES:
        assert alarms.miss_rate(late, {m: thr[m]})["missed"] == 0, m
    assert alarms.miss_rate(late.assign(precision="fp32"), {"tie_fraction_bf16": thr["tie_fraction_bf16"]}) == {
        "fnr": 1.0, "missed": 10, "positives": 10}  # ties of FP32 scores are not judged by the BF16 level
    assert monitor.normalise_thresholds(thr) == monitor.normalise_thresholds(
        {m: v for m, v in thr.items() if m != monitor.NO_ALARM})  # not a level: the monitor leaves it out


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


def test_committed_thresholds_file_is_what_the_committed_runs_give():
    """The committed file that the monitor, ``lpfa.train`` and ``lpfa doctor`` read at run time equals the learning on
    the committed runs (a run added to results/ without ``python -m lpfa.alarms --write`` fails here), ships as package
    data, and has every measure's threshold learnt from both classes with its rates."""
    committed = json.loads(monitor.THRESHOLDS_FILE.read_text())
    assert committed == alarms.learnt_thresholds(), "stale: run `python -m lpfa.alarms --write`"
    assert alarms.current_thresholds() == monitor.default_thresholds() == committed
    for m in alarms.MEASURES:
        p = committed[m]["precursor"]
        assert p["positives"] > 0 and p["negatives"] > 0 and 0 <= p["fpr"] <= alarms.MAX_FPR and 0 <= p["fnr"] <= 1
    assert committed["max_logit"]["runaway"] == {"value": 1000.0}
    package_data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["lpfa"]
    assert monitor.THRESHOLDS_FILE.parent == ROOT / "src" / "lpfa" and monitor.THRESHOLDS_FILE.name in package_data


@pytest.mark.parametrize("content, said", [
    (None, "expected a JSON file of thresholds as lpfa.alarms.thresholds() returns them, but there is no such file"),
    ("{\"max_logit\": ", "is not valid JSON (Expecting value: line 1 column 15"),
    ('{"loss": {"precursor": 1.0}}', "thresholds name measure 'loss'"),
    ("[1, 2]", "thresholds must be a dict like lpfa.alarms.thresholds() returns, got list"),
])
def test_a_missing_or_damaged_thresholds_file_is_a_one_line_error(tmp_path, monkeypatch, content, said):
    """Every run-time reader of the committed file (the monitor, ``lpfa.train``'s on_warning, the doctor through
    current_thresholds) stops with one line naming the file, what is wrong and the command that writes it."""
    from lpfa.train import TrainConfig, _alarm

    path = tmp_path / "warning_thresholds.json"
    if content is not None:
        path.write_text(content)
    monkeypatch.setattr(monitor, "THRESHOLDS_FILE", path)
    calls = (alarms.current_thresholds, monitor.default_thresholds, lambda: monitor.AttentionMonitor(nn.Linear(2, 2)),
             lambda: _alarm(TrainConfig(diag_interval=4, on_warning="log")))
    for call in calls:
        with pytest.raises((ValueError, FileNotFoundError)) as e:
            call()
        msg = str(e.value)
        assert "\n" not in msg and said in msg and str(path) in msg, msg
        assert msg.endswith("; `python -m lpfa.alarms --write` writes it from the committed runs"), msg


def test_write_command_writes_what_the_runs_give_and_sees_a_stale_file(tmp_path, monkeypatch, capsys):
    """``python -m lpfa.alarms --write`` writes thresholds() of the runs to the file the run time reads; without
    ``--write`` it exits 0 while the file holds them and 1 once it does not (or is missing)."""
    root = tmp_path / "results"
    known_runs(root, np.random.default_rng())
    path = tmp_path / "warning_thresholds.json"
    monkeypatch.setattr(monitor, "THRESHOLDS_FILE", path)
    assert alarms.main(["--results", str(root)]) == 1 and "there is no such file" in capsys.readouterr().err
    assert alarms.main(["--write", "--results", str(root)]) == 0
    learnt = alarms.thresholds(root)
    assert json.loads(path.read_text()) == learnt and set(learnt) == {*alarms.MEASURES, monitor.NO_ALARM}
    assert monitor.AttentionMonitor(nn.Linear(2, 2)).thresholds == monitor.normalise_thresholds(learnt)
    assert alarms.main(["--results", str(root)]) == 0 and "holds the thresholds" in capsys.readouterr().out
    learnt["max_logit"]["precursor"]["value"] += 1
    path.write_text(json.dumps(learnt))
    assert alarms.main(["--results", str(root)]) == 1 and "is stale" in capsys.readouterr().err


def test_layer_samples_group_a_step_logged_twice(tmp_path):
    """A resumed run that logged a diagnostics step twice: layer_samples takes both records' heads as one group, as a
    long-format pandas groupby over (step, layer) does (the independent reference here)."""
    rng = np.random.default_rng()
    d = write_diag_run(tmp_path, "resumed", list(rng.uniform(1, 50, 6)), list(rng.uniform(0, 1, 6)),
                       list(rng.uniform(1, 3, 6)))
    f = d / "metrics.jsonl.gz"
    recs = [json.loads(line) for line in gzip.decompress(f.read_bytes()).decode().splitlines()]
    again = {m: rng.uniform(0.5, 4, (2, 3)).tolist() for m in ("max_logit", "tie_fraction", "wq_spectral_norm")}
    recs.append({"step": 200, "diag": again})  # step 200 again, after a resume
    f.write_bytes(gzip.compress("\n".join(json.dumps(r) for r in recs).encode()))
    got = alarms.layer_samples(d)
    rows = [(r["step"], layer, head, *(r["diag"][m][layer][head] for m in ("max_logit", "tie_fraction",
                                                                          "wq_spectral_norm")))
            for r in recs if "diag" in r for layer in range(2) for head in range(3)]
    long = pd.DataFrame(rows, columns=["step", "layer", "head", "max_logit", "tie_fraction", "wq"])
    long["wq_outlier"] = long.wq / long.groupby(["step", "layer"]).wq.transform("median")
    want = long.groupby(["step", "layer"])[["max_logit", "tie_fraction", "wq_outlier"]].max().reset_index()
    assert len(got) == 6 * 2 and (got.precision == "bf16").all()
    pd.testing.assert_frame_equal(got.drop(columns="precision"), want, check_exact=False, rtol=1e-15)
    assert got.loc[(got.step == 200) & (got.layer == 0), "max_logit"].item() == max(1.0, *again["max_logit"][0])


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


def test_no_committed_runs_write_the_fixed_thresholds(tmp_path):
    """A results folder without runs (a pip install has none) has nothing to learn from: derive gives only the runaway
    level, and the write command would commit the fixed round levels."""
    assert alarms.labelled_samples(tmp_path).empty
    assert alarms.thresholds(tmp_path) == {"max_logit": {"runaway": {"value": 1000.0}}}
    assert alarms.learnt_thresholds(tmp_path) == alarms.fixed_thresholds()
    alarms.write_thresholds(tmp_path / "thr.json", root=tmp_path)
    assert monitor.read_thresholds(tmp_path / "thr.json") == alarms.fixed_thresholds()
