"""Page 08 (tie frequency): the Fig. 13 table, figure and sentences, the sequence of events in words and the V-sign
section of lpfa.pages.tie_frequency, checked against the committed results/repro_pair and repro_runaway twins
recomputed from their raw metrics records, and on hand-made tables for the branches those runs do not take."""

import matplotlib
import numpy as np
import pandas as pd
import pytest

from lpfa.diagnostics import DOMINANT_SIGN
from lpfa.explosion import rise_step
from lpfa.pages import tie_frequency as tf
from lpfa.results import run_dir
from lpfa.run import read_records, run_verdict

matplotlib.use("Agg")


def _ties(run):
    """(steps, tie fractions of shape (records, layers, heads)) from the run's raw records."""
    recs = [r for r in read_records(run) if "diag" in r and "tie_fraction" in r["diag"]]
    return np.array([r["step"] for r in recs]), np.array([r["diag"]["tie_fraction"] for r in recs], dtype=float)


@pytest.fixture(scope="module")
def runs():
    folder = run_dir("repro_pair")
    return {label: folder / label for label in ("bf16", "fp32")}


@pytest.fixture(scope="module")
def table(runs):
    return tf.tie_table(runs)


def test_tie_table_recomputed_from_the_logged_ties(runs, table):
    for label, run in runs.items():
        steps, ties = _ties(run)
        mean = ties.mean(axis=2)  # over heads: (records, layers)
        boom = run_verdict(run)["explosion_step"]
        for layer in range(mean.shape[1]):
            row = table.loc[(label, layer)]
            assert row["early tie fraction"] == pytest.approx(mean[:5, layer].mean())
            assert row["last"] == pytest.approx(mean[-1, layer])
            want = rise_step(pd.Series(mean[:, layer], index=steps))
            assert (row["rise step"] if pd.notna(row["rise step"]) else None) == want
            assert (row["explosion step"] if pd.notna(row["explosion step"]) else None) == boom
    assert len(table) == sum(_ties(run)[1].shape[1] for run in runs.values())


def test_tie_rise_text_on_the_committed_twins(runs, table):
    text = tf.tie_rise_text(runs, table)
    assert text.count("\n") == len(runs) - 1
    for label, run in runs.items():
        risen = table.loc[label]["rise step"].dropna()
        line = next(x for x in text.splitlines() if x.startswith(f"* **{label}**: "))
        if len(risen):
            last = max(r["step"] for r in read_records(run) if "loss" in r)
            assert f"(first at step {int(risen.min())})" in line
            assert f"; {last - int(risen.min()):,} steps after the rise the run has still not exploded" in line
        else:
            assert "no layer's tie fraction rises" in line


def test_tie_rise_text_gives_the_lead_time_of_an_explosion():
    table = pd.DataFrame({"run": ["a", "a", "b"], "layer": [0, 1, 0], "rise step": [None, 600.0, None],
                          "explosion step": [1000, 1000, None]}).set_index(["run", "layer"])
    text = tf.tie_rise_text({"a": None, "b": None}, table)
    assert text.splitlines() == ["* **a**: the loss explodes at step 1,000; tie fraction rises in layer 1 (first at "
                                 "step 600); lead time 400 steps",
                                 "* **b**: the loss did not explode; no layer's tie fraction rises"]
    with pytest.raises(ValueError, match=r"^runs \['c'\]: expected runs of the table, \['a', 'b'\]$"):
        tf.tie_rise_text({"a": None, "c": None}, table)


def test_sequence_text_orders_the_events_and_notes_a_transient_wq_lead():
    events = pd.DataFrame([[300, 500, None, None, 700, 100], [None] * 6],
                          index=["bf16", "fp32"], dtype=object,
                          columns=["worst-head ties rise", "mean ties rise", "logit runaway", "explosion",
                                   "W_Q > 1.25× fp32", "W_Q first > 1.25× fp32"])
    lines = tf.sequence_text(events, 1, "fp32").splitlines()
    assert lines[0] == "* **bf16**: worst-head ties rise (300) → mean ties rise (500) → W_Q > 1.25× fp32 (700)."
    assert lines[1].startswith("  Before that, its W_Q norm led the fp32 twin's by the same margin for a while from "
                               "step 100,")
    assert lines[2] == "* **fp32**: none of these events happens in layer 1."
    events.loc["bf16", "W_Q first > 1.25× fp32"] = 400  # after the ties: no transient lead before them
    assert "Before that" not in tf.sequence_text(events, 1, "fp32")


def test_sequence_text_of_the_committed_events(runs):
    events = tf.precursor_events(runs, 1, reference="fp32")
    text = tf.sequence_text(events, 1, "fp32")
    for label, r in events.iterrows():
        for k, v in r.items():
            if v is not None and not k.startswith("W_Q first"):
                assert f"{k} ({v:,})" in text


def test_v_sign_section_reads_the_runs_that_log_it():
    assert tf.v_sign_frames("", {"bf16": "bf16"}) == (None, {})
    assert tf.v_sign_note("", None, {}, 1) == ""
    folder, frames = tf.v_sign_frames("repro_runaway", {"bf16": "bf16_runaway", "fp32": "fp32", "x": "no_such_twin"})
    assert folder == run_dir("repro_runaway") and set(frames) == {"bf16", "fp32"}
    recs = [r for r in read_records(folder / "fp32") if "diag" in r and "v_sign_dominance" in r["diag"]]
    assert frames["fp32"].value.tolist() == pytest.approx(np.ravel([r["diag"]["v_sign_dominance"] for r in recs]))
    note = tf.v_sign_note("repro_runaway", folder, frames, 1)
    assert note.startswith(f"Run `{folder.name}` of `results/repro_runaway` (a share of keys of at least "
                           f"{DOMINANT_SIGN:.0%} with one sign")
    assert note.endswith(tf.v_sign_text(frames, 1))
    missing = tf.v_sign_note("repro_runaway", folder, {}, 1)
    assert missing.startswith(f"**Not logged** by the runs of `results/repro_runaway/{folder.name}`")


def test_tie_figure_has_a_panel_and_a_loss_axis_per_run(runs):
    fig = tf.plot_ties(runs)
    assert len(fig.axes) == 2 * len(runs)  # each panel and its twin loss axis
    steps, ties = _ties(runs["bf16"])
    assert len(fig.axes[0].lines) == ties.shape[1]
    np.testing.assert_allclose(fig.axes[0].lines[1].get_ydata(), ties[:, 1, :].mean(axis=1))
