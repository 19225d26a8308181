"""lpfa.pages.early_warning (page 15): the monitor replayed over run folders whose failures are known by
construction, the page's tables, figure and sentences, and the doctor's verdicts on the committed reports."""

import json
import math

import numpy as np
import pandas as pd
import pytest
from conftest import ROOT, write_diag_run

from lpfa import alarms, compare, monitor
from lpfa.experiments import FP32_RERUN
from lpfa.pages import early_warning as ew
from lpfa.run import run_verdict

THR = {"max_logit": {"precursor": {"value": 100.0}, "runaway": {"value": 1000.0}}}
UP = [10.0] * 5 + [300.0] * 5 + [5000.0] * 10  # ran away at step 1000
TIES = [0.01] * 3 + [0.3] * 17  # BF16 ties rise at step 300
ALL = {**THR, "tie_fraction_bf16": {"precursor": {"value": 0.2}}, "wq_outlier": {"precursor": {"value": 2.0}}}


def test_replay_logged_uses_the_shared_decision_and_bf16_ties_only(tmp_path):
    bf16 = write_diag_run(tmp_path, "bf16", UP, TIES, [1.0] * 20)
    fp32 = write_diag_run(tmp_path, "fp32", UP, TIES, [1.0] * 20, backend="sdpa_fp32")  # its ties are of FP32 scores
    assert ew.replay_logged(bf16, ALL) == 300 and ew.replay_logged(fp32, ALL) == 500
    assert ew.replay_logged(bf16, THR) == 500 and ew.replay_logged(bf16, {"max_logit": {"runaway": 1000.0}}) == 1000
    frame = ew.logged_frame(fp32)
    assert frame.tie_fraction_bf16.isna().all()
    assert list(frame.columns) == ["step", "layer", "head", *monitor.MEASURE_COLUMNS]
    hit = ew.first_warning(bf16, ALL)
    assert hit == {"step": 300, "layer": 1, "head": 2, "measure": "tie_fraction_bf16", "level": "precursor",
                   "value": 0.3, "threshold": 0.2}
    assert ew.replay_logged(write_diag_run(tmp_path, "quiet", [10.0] * 20, [0.0] * 20, [1.0] * 20), ALL) is None


def test_warning_table_leads_and_false_alarms(tmp_path):
    write_diag_run(tmp_path, "ran_away", UP, [0.0] * 20, [1.0] * 20)  # warned at 500, ran away at 1000
    boom = write_diag_run(tmp_path, "exploded", [10.0] * 7 + [150.0] * 13, [0.0] * 20, [1.0] * 20,
                          losses=[3.0] * 1500 + [10.0] * 500)  # no runaway; warned at 700, exploded near 1500
    write_diag_run(tmp_path, "clean_warned", [10.0] * 20, [0.0] * 20, [1.0] * 4 + [2.5] * 16, backend="sdpa_fp32")
    write_diag_run(tmp_path, "clean", [10.0] * 20, [0.0] * 20, [1.0] * 20, backend="sdpa_fp32")
    thr = {"max_logit": {"precursor": 100.0, "runaway": 1000.0}, "wq_outlier": {"precursor": 2.0}}
    t = ew.warning_table(tmp_path, thr)
    assert list(t.index) == [f"exp/r1/{n}" for n in ("clean", "clean_warned", "exploded", "ran_away")]
    r = t.loc["exp/r1/ran_away"]
    assert (r["runaway step"], r["first warning step"], r["lead"]) == (1000, 500, 500)
    assert r["warned before"] and not r["false alarm"]
    ex = run_verdict(boom)["explosion_step"]
    r = t.loc["exp/r1/exploded"]
    assert ex is not None and r["runaway step"] is pd.NA and r["lead"] == ex - 700 and r["warned before"]
    assert t.loc["exp/r1/clean_warned", "false alarm"] and t.loc["exp/r1/clean_warned", "first warning step"] == 400
    assert not t.loc["exp/r1/clean", "false alarm"] and pd.isna(t.loc["exp/r1/clean", "warning"])
    assert list(t["attention"]) == ["fp32", "fp32", "low precision", "low precision"]
    s = ew.warning_summary(t)
    assert (s["failed"], s["warned before"], s["neither"], s["false alarms"]) == (2, 2, 2, 1)
    assert s["median lead"] == (500 + ex - 700) / 2
    assert (s["fp32 neither"], s["fp32 false alarms"]) == (2, 1)
    assert (s["low-precision neither"], s["low-precision neither warned"]) == (0, 0)


@pytest.fixture
def known_root(tmp_path):
    """Two clean FP32 runs, a clean BF16 run, two BF16 runs whose layer 1 head 2 runs away at step 1000 (logit 300
    from step 500) and one whose ties rise early but never runs away."""
    rng = np.random.default_rng(7)
    lo = list(rng.uniform(5, 20, size=20))
    for i in range(2):
        write_diag_run(tmp_path, f"fp32_{i}", lo, [0.5] * 20, list(rng.uniform(1.0, 1.2, size=20)), backend="sdpa_fp32")
    write_diag_run(tmp_path, "bf16_clean", lo, list(rng.uniform(0.0, 0.05, size=20)), [1.0] * 20)
    for i in range(2):
        write_diag_run(tmp_path, f"bf16_{i}", UP, [0.01] * 5 + [0.3] * 15, [1.0] * 5 + [3.0] * 15)
    write_diag_run(tmp_path, "bf16_ties", lo, TIES, [1.0] * 20)
    return tmp_path


def test_replay_committed_learns_in_sample_and_replays_with_it(known_root):
    samples, thr, table = ew.replay_committed(lead=500, max_fpr=0.0, root=known_root)
    assert len(samples) == 6 * 20 * 2  # runs × diagnostics records × layers
    assert (samples["class"] == "positive").sum() == 2 * 5  # layer 1 of the runaways, steps 500..900
    assert thr == alarms.derive(alarms.labelled_samples(known_root, lead=500), 0.0, lead=500)
    assert thr["max_logit"]["precursor"]["value"] == np.nextafter(max(
        v for name in ("fp32_0", "fp32_1") for v in samples[samples.run == f"exp/r1/{name}"].max_logit), np.inf)
    assert list(table.index) == sorted(f"exp/r1/{n}" for n in ("bf16_0", "bf16_1", "bf16_clean", "bf16_ties",
                                                              "fp32_0", "fp32_1"))
    for run_name, row in table.iterrows():  # each row: the replay of that run alone with the learnt thresholds
        warn = ew.replay_logged(known_root / run_name, thr)
        assert (pd.isna(row["first warning step"]) and warn is None) or row["first warning step"] == warn
    assert table.loc["exp/r1/bf16_0", "runaway step"] == 1000 and table.loc["exp/r1/bf16_0", "lead"] == 500
    s = ew.warning_summary(table)
    text = ew.headline(s)
    warned = int(((table["first warning step"] < table["runaway step"]).fillna(False)).sum())
    assert text.startswith(f"**Replayed through the monitor, the committed runs' diagnostics warn {warned} of the 2 "
                           "runs that ran away or exploded before they did** (median 500 steps ahead), ")
    lp_clean = table[table["runaway step"].isna() & (table["attention"] != "fp32")]
    assert f"{int(lp_clean['false alarm'].sum())} of the {len(lp_clean)} low-precision runs" in text
    assert "0 of the 2 FP32-attention runs where neither happened (false alarms)" in text


def test_replay_committed_refuses_bad_parameters(known_root):
    with pytest.raises(ValueError, match=r"^lead=0: expected an int >= 1$"):
        ew.replay_committed(lead=0, root=known_root)
    with pytest.raises(ValueError, match=r"^max_fpr=1.0: expected a finite number in \[0, 1\)$"):
        ew.replay_committed(max_fpr=1.0, root=known_root)


def test_threshold_and_replay_tables_and_the_figure(known_root):
    samples, thr, table = ew.replay_committed(lead=500, max_fpr=0.0, root=known_root)
    t = ew.threshold_table(thr)
    assert list(t.index) == [m for m in thr if "precursor" in thr[m]] and len(t) == 3
    for m, row in t.iterrows():
        p = thr[m]["precursor"]
        assert (row["threshold"], row["false-positive rate"], row["false-negative rate"]) == (p["value"], p["fpr"],
                                                                                              p["fnr"])
        assert (row["positives"], row["negatives"]) == (p["positives"], p["negatives"])
    assert ew.threshold_table({"max_logit": {"runaway": {"value": 1000.0}}}).empty
    shown = ew.replay_table(table)
    assert list(shown.columns) == ew.REPLAY_COLUMNS and set(shown.index) == set(table.index)
    assert list(shown["attention"]) == sorted(shown["attention"])  # fp32 first, then low precision
    lp = shown[shown["attention"] == "low precision"]
    assert list(lp.index[:2]) == ["exp/r1/bf16_0", "exp/r1/bf16_1"]  # the runaways first, by their step
    fig = ew.plot_first_warnings(table)
    ax = fig.axes[0]
    points = np.concatenate([c.get_offsets() for c in ax.collections])
    failed = table[table["runaway step"].notna()]
    assert sorted(map(tuple, points)) == sorted(zip(failed["runaway step"].astype(float),
                                                    failed["first warning step"].astype(float)))
    diagonal = [line for line in ax.lines if line.get_label() == "warning = runaway (or explosion)"]
    assert len(diagonal) == 1 and diagonal[0].get_xdata()[1] == diagonal[0].get_ydata()[1] == 1000 * 1.05


def test_replay_summary_counts_every_run_once(known_root):
    """The page's replay table is a summary per attention and outcome; its counts add up to the full table's."""
    _, _, table = ew.replay_committed(lead=500, max_fpr=0.0, root=known_root)
    s = ew.replay_summary(table)
    assert s["runs"].sum() == len(table) and s.loc[("low precision", "logits ran away"), "runs"] == 2
    assert s.loc[("fp32", "neither"), "runs"] == 2 and pd.isna(s.loc[("fp32", "neither"), "warned ahead"])
    ran = table[table["runaway step"].notna()]
    assert s.loc[("low precision", "logits ran away"), "warned ahead"] == int(ran["warned before"].sum())


def test_replay_summary_names_outcomes_strongest_first():
    """A run whose logits ran away and whose loss then exploded counts as "loss exploded", as everywhere in the book
    (lpfa.compare.outcome); one whose logits only ran away as "logits ran away"."""
    table = pd.DataFrame({"attention": ["low precision"] * 3, "runaway step": [2800.0, 3000.0, None],
                          "explosion step": [5136.0, None, None], "first warning step": [2600.0, None, 100.0],
                          "warned before": [True, False, False], "lead": [200.0, None, None]},
                         index=["a/r/bf16", "a/r/bf16_s1", "a/r/bf16_s2"])
    s = ew.replay_summary(table)
    assert set(s.index) == {("low precision", o) for o in compare.OUTCOMES}
    assert s.loc[("low precision", "loss exploded"), "runs"] == 1
    assert s.loc[("low precision", "loss exploded"), "warned ahead"] == 1


def independent_counts(report: dict, thr: dict) -> dict:
    """Verdict counts of a report.json's heads, straight from its rows: runaway where max_logit is not finite or at
    least the runaway level, else precursor where any measure reaches its precursor level, else no alarm."""
    levels = monitor.normalise_thresholds(thr)
    counts = {"runaway": 0, "precursor": 0, "no alarm": 0}
    for row in report["table"]:
        x = row["max_logit"]
        x = math.nan if x is None else float(x)
        if not math.isfinite(x) or x >= levels["max_logit"]["runaway"]:
            counts["runaway"] += 1
        elif any(row.get(m) is not None and row[m] >= lv["precursor"] for m, lv in levels.items() if "precursor" in lv):
            counts["precursor"] += 1
        else:
            counts["no alarm"] += 1
    return counts


def test_doctor_reports_text_and_figures_from_the_committed_reports():
    """The latest committed doctor report of each of the paper recipe's runs, read straight from its report.json,
    with verdict counts recomputed from its rows against the committed thresholds."""
    thr = monitor.default_thresholds()
    reports = ew.doctor_reports()
    if not reports:
        pytest.skip("no doctor report is committed")
    text = ew.doctor_text(reports, thr)
    assert text.startswith("With the paper's GPT-2 S recipe (the stabilisers page): `")
    for label, (step, rep) in reports.items():
        files = sorted(ROOT.glob(f"results/stabilisers/*/{label}/**/doctor_step_*/report.json"))
        steps = {int(f.parent.name.removeprefix("doctor_step_")): f for f in files}
        assert step == max(steps) and rep["table"] == json.loads(steps[step].read_text())["table"]
        c = independent_counts(rep, thr)
        assert (f"`{label}` at step {step:,}: {c['runaway']} runaway, {c['precursor']} precursor and "
                f"{c['no alarm']} no-alarm heads of {len(rep['table'])}") in text
    assert ("not committed yet" in text) == (FP32_RERUN not in reports)
    figs = ew.doctor_figures(reports, thr)
    assert len(figs) == len(reports)
    for fig, (label, (step, rep)) in zip(figs, reports.items()):
        assert fig.axes[0].get_title() == f"{label}, step {step:,}: verdict per head"
        layers = {r["layer"] for r in rep["table"]}
        assert len(fig.axes[0].get_yticklabels()) == len(layers)
    assert ew.doctor_text({}, thr) == ("No doctor report is committed yet. The FP32 twin's report "
                                       f"(`{FP32_RERUN}`) is not committed yet.")
