"""Page 02 (the δ bias, Fig. 5): the tables, sentences and figures of lpfa.pages.delta_bias on the committed replays of
the BF16 trajectory (results/repro_runaway, repro_twins, repro_pair), checked against statistics recomputed here from
each replay's per-step sums."""

import math
from pathlib import Path

import numpy as np
import pytest

from lpfa.experiments import MECHANISM_REPLAY
from lpfa.pages.delta_bias import (
    STRONG_T,
    bias_table,
    bias_text,
    describe,
    detail_step,
    open_replay,
    plot_delta_bias,
    plot_worst_token,
    style_trajectory,
    trajectory_replays,
    trajectory_table,
    trajectory_text,
)
from lpfa.replay import load_replay
from lpfa.results import run_dir

COMPARE = {"repro_runaway/h200x4-2026-11-29": "bf16_runaway_replay", "repro_twins": "bf16_replay",
           "repro_pair": "bf16_replay"}  # page 02's default


@pytest.fixture(scope="module")
def replay():
    return open_replay("repro_runaway", None, "bf16_runaway_replay")


def _sums(result, head):
    """The per-step Σ_T (δ_lp − δ_hp)[T] of ``head`` and that over tied rows, straight from replay.json."""
    per = [r["heads"][str(head)] for r in result["per_step"]]
    return np.array([p["sum_all"] for p in per]), np.array([p["sum_tied"] for p in per])


def _se(x):
    return x.std(ddof=1) / math.sqrt(len(x))


def _t(x):
    return x.mean() / _se(x)


def test_open_replay_reads_the_latest_run(replay):
    folder, result, arrays = replay
    assert folder == run_dir("repro_runaway") / "bf16_runaway_replay"
    again, arr = load_replay(folder)
    assert result == again and arrays.keys() == arr.keys()
    assert f"from its checkpoint at step {result['checkpoint_step']:,}" in describe(result, folder)
    with pytest.raises(FileNotFoundError, match="not a replay folder"):
        open_replay("repro_runaway", None, "no_such_replay")


def test_bias_table_and_text_recomputed(replay):
    _, result, _ = replay
    table, text = bias_table(result), bias_text(result)
    assert sorted(table.index) == sorted(result["heads"])
    for h in result["heads"]:
        x, tied = _sums(result, h)
        assert table.loc[h, "steps"] == len(x) and table.loc[h, "t"] == pytest.approx(_t(x))
        assert table.loc[h, "share_tied"] == pytest.approx(tied.sum() / x.sum())
        assert (f"* **head {h}**: Σ_T (δ_lp − δ_hp)[T] is positive in {(x > 0).mean():.0%} of {len(x)} steps; its mean "
                f"per step, {x.mean():.2e} (95% interval {x.mean() - 1.959964 * _se(x):.2e} to "
                f"{x.mean() + 1.959964 * _se(x):.2e}), is {_t(x):.1f} standard errors from zero.") in text
        assert f"carry {tied.sum() / x.sum():.0%} of the cumulative error" in text
    agrees = all(_t(_sums(result, h)[0]) > 0 for h in result["heads"])
    assert ("The sign agrees with the paper" in text) == agrees and text.startswith("**Measured.**\n\n")


def test_trajectory_follows_every_replay(replay):
    folder, result, _ = replay
    replays = trajectory_replays({f"repro_runaway/{folder.parent.name}": folder.name, **COMPARE})
    assert list(replays) == ["repro_runaway/h200x2-2026-11-29", "repro_runaway/h200x4-2026-11-29",
                             "repro_twins/h200-2026-11-29", "repro_pair/h200x2-2026-11-29"]
    table = trajectory_table(replays)
    assert len(table) == sum(len(r["heads"]) for r in replays.values())
    t = {(r["checkpoint_step"], h): _t(_sums(r, h)[0]) for r in replays.values() for h in r["heads"]}
    best = max(t, key=t.get)
    assert table["t"].to_dict() == pytest.approx(t)
    text = trajectory_text(table)
    assert f"The bias is strongest at step {best[0]:,} (head {best[1]}, t = {t[best]:.1f})" in text
    weak = [f"{s:,}" for s in sorted({s for s, _ in t}) if all(v < STRONG_T for (s2, _), v in t.items() if s2 == s)]
    assert (f"no head's t statistic reaches {STRONG_T}" in text) == bool(weak)
    if weak:
        assert f"; at step{'s' if len(weak) > 1 else ''} {', '.join(weak)} no head's t statistic" in text
    assert len([line for line in text.splitlines() if line.startswith("* step ")]) == len({s for s, _ in t})
    html = style_trajectory(table).to_html()
    assert f"{table['positive steps'].iloc[0]:.0%}" in html


def test_figures_and_the_worst_token_step(replay):
    _, result, arrays = replay
    assert len(plot_delta_bias(result).axes) == len(result["heads"])
    h = result["heads"][0]
    fig = plot_worst_token(arrays, h)
    assert fig._suptitle.get_text() == f"head {h}, step {result['checkpoint_step']}"  # the first detail step
    assert detail_step(arrays, h) == result["checkpoint_step"]
    with pytest.raises(ValueError, match=f"head {h}, step=7: expected a step this replay measured in detail"):
        plot_worst_token(arrays, h, 7)


def test_the_recipe_replay_is_described_with_its_run_and_its_reruns():
    """The default replay (the paper-recipe run): its description names the setting, the run's own verdict read from
    the run beside it, and that every replayed loss equals the logged one; the reruns sentence lists every committed
    run of the same recipe, seed and attention with its own verdict."""
    from lpfa.compare import same_recipe_runs
    from lpfa.pages.delta_bias import describe, replay_run, reruns_text
    from lpfa.run import Run

    folder, result, _ = open_replay("mechanism", None, MECHANISM_REPLAY)
    run = replay_run(result, folder)
    v = Run(run).verdict()
    text = describe(result, folder)
    ag = result["agreement"]
    assert "the paper's GPT-2 S recipe" in text and f"checkpoint at step {result['checkpoint_step']:,}" in text
    assert (f"({ag['bit_equal']:,} of {ag['compared']:,})" in text) == (ag["bit_equal"] == ag["compared"])
    assert (f"did not explode in its {v['steps']:,} steps" in text) == (not v["exploded"])
    others = same_recipe_runs(run)
    assert others and all(Run(d).train["seed"] == Run(run).train["seed"] for d in others.values())
    reruns = reruns_text(result, folder)
    booms = [Run(d).verdict() for d in [run, *others.values()]]
    assert f"The loss exploded in {sum(b['exploded'] for b in booms)} of these {len(booms)} runs." in reruns
    for name, d in others.items():
        b = Run(d).verdict()
        assert f"`{name}`" in reruns
        assert not b["exploded"] or f"loss exploded at step {b['explosion_step']:,}" in reruns


def test_bias_test_interval_is_the_mean_plus_minus_1_96_standard_errors():
    from lpfa.replay import bias_test

    _, result, _ = open_replay("mechanism", None, MECHANISM_REPLAY)
    for h, r in bias_test(result).items():
        x, _ = _sums(result, h)
        assert r["ci_low"] == pytest.approx(x.mean() - 1.959964 * _se(x), rel=1e-6)
        assert r["ci_high"] == pytest.approx(x.mean() + 1.959964 * _se(x), rel=1e-6)
        assert r["ci_low"] < r["mean"] < r["ci_high"]


def test_mechanism_pages_and_scorecard_read_one_replay(tmp_path):
    """Pages 02-04 and the intro's scorecard default to lpfa.experiments.MECHANISM_REPLAY; with run None a replay is
    read from the latest run that holds it, not hidden by a later run that holds another."""
    import inspect
    import shutil

    from lpfa.book import notebook_parameters
    from lpfa.pages.delta_bias import replay_dir
    from lpfa.pages.intro import scorecard
    from lpfa.paths import results_dir
    from lpfa.results import run_dir

    root = Path(__file__).resolve().parents[1]
    for nb in ("notebooks/02_delta_bias.ipynb", "notebooks/03_pktx_structure.ipynb", "notebooks/04_pv_error.ipynb"):
        assert notebook_parameters(root / nb)["replay"] == MECHANISM_REPLAY, nb
    assert notebook_parameters(root / "book" / "intro.ipynb")["replay"] == MECHANISM_REPLAY
    assert inspect.signature(scorecard).parameters["replay"].default == MECHANISM_REPLAY
    held = replay_dir("mechanism", None, MECHANISM_REPLAY)
    assert (held / "replay.json").is_file()
    # a copy of the mechanism results with a later run that holds another replay only
    shutil.copytree(results_dir() / "mechanism" / held.parent.name, tmp_path / "mechanism" / held.parent.name)
    later = tmp_path / "mechanism" / "zz-later" / "other_replay"
    later.mkdir(parents=True)
    (later / "replay.json").write_text("{}")
    (later.parent / "provenance.json").write_text('{"date_utc": "2999-01-01T00:00:00Z"}')
    assert run_dir("mechanism", None, tmp_path) == later.parent  # the latest run, which lacks the replay
    assert replay_dir("mechanism", None, MECHANISM_REPLAY, tmp_path) == tmp_path / "mechanism" / held.parent.name / \
        MECHANISM_REPLAY
    assert replay_dir("mechanism", None, "other_replay", tmp_path) == later


def test_parted_replays_are_the_committed_replays_that_left_their_run():
    """parted_replays finds exactly the committed mechanism replays whose losses differ from their run's anywhere,
    recounted here from each replay.json's per-step losses against the run's metrics; parted_text says where each
    left, and what the run's loss did over the window; nothing to say when every replay followed."""
    import gzip
    import json

    from lpfa.pages.delta_bias import parted_replays, parted_text
    from lpfa.paths import results_dir

    want = {}
    for path in sorted((results_dir() / "mechanism").glob("*/*/replay.json")):
        result = json.loads(path.read_text())
        metrics = path.parent.parent / Path(result["run"]).name / "metrics.jsonl.gz"
        logged = {r["step"]: r["loss"] for r in map(json.loads, gzip.open(metrics, "rt")) if "loss" in r}
        equal = [p["loss"] == logged[p["step"]] for p in result["per_step"] if p["step"] in logged]
        if not all(equal):
            want[path.parent] = (sum(equal), len(equal), max(logged[p["step"]] for p in result["per_step"]))
    parted = parted_replays("mechanism")
    assert want and {p["replay"] for p in parted} == set(want)
    for p in parted:
        bit_equal, compared, run_max = want[p["replay"]]
        assert (p["agreement"]["bit_equal"], p["agreement"]["compared"]) == (bit_equal, compared)
        assert p["run_max"] == run_max
    text = parted_text(parted)
    for p in parted:
        assert (f"`{p['run']}` ({'compiled' if p['compiled'] else 'eager'})" in text
                and f"losses equal the run's at {p['agreement']['bit_equal']:,} of {p['agreement']['compared']:,} "
                    f"steps (the first difference at step {p['agreement']['first_mismatch']:,})" in text)
    assert parted_text([]) == ""
    quiet = {**parted[0], "deterministic": True, "verdict": {**parted[0]["verdict"], "exploded": False,
                                                            "explosion_step": None}}
    text = parted_text([quiet])
    assert "deterministic kernels)" in text and "exploded" not in text and "largest loss" not in text


def _with_sums(result: dict, sums: dict) -> dict:
    """A copy of a replay result whose per-step Σ δ error of each head is ``sums[head]`` (tied rows carry all of it)."""
    per_step = []
    for i, r in enumerate(result["per_step"]):
        heads = {h: {**v, "sum_all": float(sums[int(h)][i]), "sum_tied": float(sums[int(h)][i]), "sum_untied": 0.0}
                 for h, v in r["heads"].items()}
        per_step.append({**r, "heads": heads})
    return {**result, "per_step": per_step}


def test_control_is_read_against_the_bf16_run_head_by_head():
    """Page 02's control: the table and the sentences carry bias_test of both replays per head, and the reading
    follows the numbers: a control without bias "shows none", a control biased like the run "is biased as well", and
    a run without a clear bias says the control cannot separate the two."""
    from lpfa.experiments import MECHANISM_CONTROL
    from lpfa.pages.delta_bias import STRONG_T, control_table, control_text, open_control
    from lpfa.replay import bias_test

    _, result, _ = open_replay("mechanism", None, MECHANISM_REPLAY)
    control = open_control("mechanism", None, MECHANISM_CONTROL)
    assert open_control("mechanism", None, "") is None
    table = control_table(result, control)
    for name, res in (("BF16 run", result), ("FP32 twin, BF16 policy measured", control)):
        for h, r in bias_test(res).items():
            assert table.loc[(name, h), "t"] == pytest.approx(r["t"])
            assert table.loc[(name, h), "tied rows"] == pytest.approx(r["tied_row_fraction"])
    text = control_text(result, control)
    for h, r in bias_test(control).items():
        assert f"(t = {r['t']:.1f}) on the FP32 twin's trajectory" in text
    rng = np.random.default_rng(0)
    n, m = len(result["per_step"]), len(control["per_step"])
    heads = [int(h) for h in result["per_step"][0]["heads"]]
    biased = _with_sums(result, {h: 1.0 + rng.normal(0, 0.5, n) for h in heads})
    quiet = _with_sums(control, {h: rng.normal(0, 0.5, m) for h in heads})
    assert all(abs(r["t"]) < STRONG_T for r in bias_test(quiet).values())
    assert "shows none" in control_text(biased, quiet)
    assert "is biased as well" in control_text(biased, _with_sums(control, {h: 1.0 + rng.normal(0, 0.5, m)
                                                                           for h in heads}))
    assert "cannot separate" in control_text(_with_sums(result, {h: rng.normal(0, 0.5, n) for h in heads}), quiet)
