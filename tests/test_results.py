"""The results store (lpfa.results) and properties of the committed GPU results that the book relies on."""

import itertools
import json
import math
import re
import shutil

import numpy as np
import pandas as pd
import pytest
from conftest import ROOT, full_throughput_run

from lpfa import results


def _row(d, label):
    (d / label).mkdir(parents=True)
    (d / label / "config.json").write_text(json.dumps({"train": {}}))


def test_run_dir_load_and_experiment_rows(tmp_path):
    exp = tmp_path / "isolation"
    _row(exp / "h200-2026-01-01", "bf16")
    _row(exp / "h200-2026-01-01", "fp32")
    _row(exp / "h200-2026-01-01", "pv_fp32")
    _row(exp / "h200-2026-02-01", "bf16")
    _row(exp / "h200-2026-02-01", "o_fp32")
    (exp / "h200-2026-02-01" / "provenance.json").write_text("{}")
    (exp / "h200-2026-02-01" / "not_a_row").mkdir()
    assert results.run_dir("isolation", root=tmp_path).name == "h200-2026-02-01"
    assert results.run_dir("isolation", "h200-2026-01-01", root=tmp_path).name == "h200-2026-01-01"
    with pytest.raises(FileNotFoundError, match="has no run 'x'"):
        results.run_dir("isolation", "x", root=tmp_path)
    with pytest.raises(FileNotFoundError, match="no provenance.json"):
        results.load("isolation", "bf16/config.json", "h200-2026-01-01", root=tmp_path)
    rows = results.experiment_rows("isolation", ["fp32", "bf16", "o_fp32", "never_run"], root=tmp_path)
    assert list(rows) == ["fp32", "bf16", "o_fp32"]  # the order asked for; rows never run are left out
    assert rows["bf16"].parent.name == "h200-2026-02-01" and rows["fp32"].parent.name == "h200-2026-01-01"
    assert list(results.experiment_rows("isolation", root=tmp_path)) == ["bf16", "fp32", "o_fp32", "pv_fp32"]
    assert results.experiment_rows("nothing", root=tmp_path) == {}


def test_an_unknown_experiment_names_the_committed_ones(tmp_path):
    """A misspelled experiment (a page's ``-p experiment nosuch``) is one line naming it and the experiments the store
    has; experiment_rows still finds nothing for an experiment not run yet."""
    _row(tmp_path / "isolation" / "h200-2026-01-01", "bf16")
    _row(tmp_path / "seeds" / "h200-2026-01-01", "bf16_s1")
    (tmp_path / "README.md").write_text("not an experiment")
    assert results.experiments(tmp_path) == ["isolation", "seeds"]
    expected = f"experiment='nosuch': expected one of 'isolation', 'seeds' (the committed experiments under {tmp_path})"
    for call in (results.runs, results.run_dir):
        with pytest.raises(FileNotFoundError) as e:
            call("nosuch", root=tmp_path)
        assert str(e.value) == expected
    assert results.experiment_rows("nosuch", root=tmp_path) == {}
    assert {"paper_recipe", "isolation", "seeds"} <= set(results.experiments())  # the project's store


def test_load_takes_each_file_from_the_latest_run_that_has_it(tmp_path):
    """A run may measure only some parts (the 2026-12-01 attention benchmark has no memory.json): without a run named,
    each file comes from the latest run that holds it; a named run gives its own file or a clear error."""
    exp = tmp_path / "attention_benchmark"
    for name, files in (("h200-2026-01-01", ("bench.json", "memory.json")), ("h200-2026-02-01", ("bench.json",))):
        (exp / name).mkdir(parents=True)
        (exp / name / "provenance.json").write_text(json.dumps({"date_utc": name[5:]}))
        for f in files:
            (exp / name / f).write_text(json.dumps({"run": name}))
    assert results.load("attention_benchmark", "bench.json", root=tmp_path) == {"run": "h200-2026-02-01"}
    assert results.load("attention_benchmark", "memory.json", root=tmp_path) == {"run": "h200-2026-01-01"}
    assert results.file_run("attention_benchmark", "memory.json", root=tmp_path).name == "h200-2026-01-01"
    with pytest.raises(FileNotFoundError,
                       match=r"memory.json does not exist; the run has \['bench.json', 'provenance.json'\]"):
        results.load("attention_benchmark", "memory.json", "h200-2026-02-01", root=tmp_path)


def test_runs_are_ordered_by_their_provenance_date(tmp_path):
    """The latest run is the one made last, not the last name: "h200x2-…" sorts before "h200x4-…" of the same day."""
    exp = tmp_path / "replays"
    for name, date in (("h200x4-2026-03-01", "2026-03-01T18:54:03+00:00"),
                       ("h200x2-2026-03-01", "2026-03-01T23:10:20+00:00")):
        _row(exp / name, "bf16")
        (exp / name / "provenance.json").write_text(json.dumps({"date_utc": date}))
    assert [r.name for r in results.runs("replays", root=tmp_path)] == ["h200x4-2026-03-01", "h200x2-2026-03-01"]
    assert results.run_dir("replays", root=tmp_path).name == "h200x2-2026-03-01"
    assert results.experiment_rows("replays", root=tmp_path)["bf16"].parent.name == "h200x2-2026-03-01"


def test_committed_eager_bf16_runs_are_bit_identical():
    """The eager BF16 twin rerun on two other machines (repro_runaway: 4 runs sharing a GPU of an x4 machine, then
    alone on an x2 machine) retraces the committed 30k-step twin exactly: every loss, and the SFA sweep computed
    from their checkpoints."""
    from lpfa.scaling import first_difference

    twin = results.run_dir("repro_pair", root=ROOT / "results") / "bf16"
    reruns = [r / "bf16_runaway" for r in results.runs("repro_runaway", root=ROOT / "results")]
    assert len(reruns) == 2
    for rerun in reruns:
        d = first_difference(rerun, twin)
        assert d["common_steps"] == d["identical_steps"] == 6500 and d["first_differing_step"] is None
        a, b = (json.loads((r / "sfa_sweep.json").read_text())["steps"] for r in (rerun, twin))
        shared = sorted(set(a) & set(b), key=int)
        assert len(shared) == 6 and all(a[s] == b[s] for s in shared)


def test_committed_replay_starts_before_the_runaway_and_finds_the_papers_sign():
    """The default replay of the mechanism pages (04-06): from the last checkpoint before layer 1's largest logit
    first passed the runaway threshold, through that step, with δ_lp − δ_hp positive on average in both heads."""
    from lpfa.replay import bias_test, load_replay
    from lpfa.run import runaway_onset

    run = results.run_dir("repro_runaway", root=ROOT / "results")
    result, _ = load_replay(run / "bf16_runaway_replay")
    onset_step, onset_layer = runaway_onset(run / "bf16_runaway")
    assert result["checkpoint_step"] < onset_step < result["checkpoint_step"] + result["steps"]
    assert result["layer"] == onset_layer and result["choice"]["checkpoint"] == "onset"
    for r in bias_test(result).values():
        assert r["t"] > 10 and r["positive_fraction"] > 0.9


def test_committed_explosions_name_every_exploded_run():
    """The loss-explosion page's first paragraph: which committed runs exploded, and whether a BF16 row's FP32 twin
    did."""
    from lpfa.pages.loss_explosion import bf16_only_explosions, committed_explosions, explosions_text

    t = committed_explosions()
    boom = t[t["exploded"]]
    assert sorted(label for _, label in boom.index) == ["bf16_gated_s1", "bf16_gpt2s", "bf16_mechanism_compiled",
                                                         "bf16_mechanism_deterministic", "bf16_muon_lr2",
                                                         "bf16_paper_recipe", "bf16_paper_recipe_s1",
                                                         "bf16_paper_recipe_s2", "bf16_rerun", "delta_o_exact",
                                                         "fp32_gpt2s", "fp32_muon_lr2", "sr", "sr_s1"]
    # the deterministic mechanism twin stopped at step 4,000, before its BF16 run exploded: not Fig. 2's evidence
    r = t.loc[("mechanism", "bf16_mechanism_deterministic")]
    assert r["fp32 twin exploded"] is False and r["fp32 twin steps"] < r["explosion step"]
    assert bool(t.loc[("sizes", "bf16_gpt2s"), "fp32 twin exploded"])
    assert bool(t.loc[("muon_long", "bf16_muon_lr2"), "fp32 twin exploded"])  # Muon lr 0.05: both precisions
    assert list(bf16_only_explosions(t).index) == [("paper_recipe", "bf16_paper_recipe"),  # Fig. 2, seeds 1337, 1, 2
                                                   ("paper_recipe", "bf16_paper_recipe_s1"),
                                                   ("paper_recipe", "bf16_paper_recipe_s2")]
    rerun = t.loc[("stabilisers", "bf16_rerun")]  # seed 1337 again: its FP32 twin stopped before the explosion
    assert rerun["exploded"] and rerun["fp32 twin steps"] < rerun["explosion step"]
    assert not bool(t.loc[("paper_recipe", "bf16_paper_recipe_s2"), "fp32 twin exploded"])
    assert not bool(t.loc[("paper_recipe", "delta_o_fp32_paper_recipe"), "exploded"])  # the first isolation row there
    assert not bool(t.loc[("paper_recipe", "bf16_paper_recipe"), "fp32 twin exploded"])
    text = explosions_text(t)
    assert text.startswith(f"Of the {len(t)} committed runs") and f"{len(boom)} exploded" in text
    assert "its FP32 twin too" in text
    assert "its FP32 twin not" in text
    assert f"its FP32 twin stopped sooner, at step {int(r['fp32 twin steps']):,}" in text


def test_twins_text_states_the_bf16_only_explosion():
    """Page 06's Fig. 2 sentence, from the committed paper-recipe twins (results/paper_recipe): numbers as in their
    files."""
    from lpfa.pages.loss_explosion import fig2_twins, twins_text
    from lpfa.results import run_dir
    from lpfa.run import run_verdict

    runs = fig2_twins()["bf16_paper_recipe"]  # the twins ran in different GPU runs than later seeds
    v = {k: run_verdict(p) for k, p in runs.items()}
    text = twins_text(runs, layer=1)
    assert v["bf16"]["exploded"] and not v["fp32"]["exploded"]
    assert f"exploded at step {v['bf16']['explosion_step']:,}" in text
    assert f"trained {v['fp32']['steps']:,} steps" in text
    assert f"ran away at step {v['bf16']['runaway_step']:,}" in text and "FP32 twin's never did" in text
    repro = run_dir("repro_pair", None)
    text = twins_text({"bf16": repro / "bf16", "fp32": repro / "fp32"}, layer=1)
    assert "did not explode" in text and "do not reproduce Fig. 2" in text


def test_twins_text_and_fig3_step_take_verdicts_and_frames_already_read(monkeypatch):
    """A caller that has judged the runs (page 06, the scorecard) passes its verdicts and W_Q frames: the text and the
    Fig. 3 step are the same, and no run is judged again."""
    import lpfa.compare
    import lpfa.pages.loss_explosion
    from lpfa.compare import head_metric_frame, step_before_failure
    from lpfa.pages.loss_explosion import fig2_twins, twins_text
    from lpfa.run import run_verdict

    runs = fig2_twins()["bf16_paper_recipe"]
    text, at = twins_text(runs, layer=1), step_before_failure(runs)
    v = {k: run_verdict(p) for k, p in runs.items()}
    frames = {k: head_metric_frame(p, "wq_spectral_norm") for k, p in runs.items()}

    def judged_again(*a, **k):
        raise AssertionError("run_verdict called again")

    monkeypatch.setattr(lpfa.compare, "run_verdict", judged_again)
    monkeypatch.setattr(lpfa.pages.loss_explosion, "run_verdict", judged_again)
    assert twins_text(runs, layer=1, verdicts=v) == text
    assert step_before_failure(runs, frames=frames, verdicts=v) == at


def test_scorecard_is_computed_from_the_committed_runs():
    """The intro's scorecard: one row per claim, valid verdicts, and the Fig. 2 row's numbers are the runs' own."""
    from lpfa.pages.intro import COLUMNS, VERDICTS, scorecard, summary_text
    from lpfa.pages.loss_explosion import fig2_twins
    from lpfa.run import run_verdict

    card = scorecard()
    assert list(card.columns) == COLUMNS and len(card) >= 8 and card["verdict"].isin(VERDICTS).all()
    assert card["page"].map(lambda p: (ROOT / "notebooks" / f"{p}.ipynb").is_file()).all()
    pair = fig2_twins()["bf16_paper_recipe"]
    b, f = run_verdict(pair["bf16"]), run_verdict(pair["fp32"])
    fig2 = card.iloc[0]
    assert fig2["paper"] == "Fig. 2"
    from lpfa.pages.loss_explosion import fig2_verdict, recipe_fates

    assert fig2["verdict"] == fig2_verdict(recipe_fates())  # over every run of the recipe, as page 06's lead
    assert f"{b['explosion_step']:,}" in fig2["our result"] and f"{f['steps']:,}" in fig2["our result"]
    iso = card[card["paper"] == "Sec. 3.2"].iloc[0]  # the isolation claim, at the repro preset and at the recipe
    from lpfa.pages.isolation import recipe_isolation_table

    recipe = recipe_isolation_table()
    decided = recipe.index[recipe.verdict.isin(["loss exploded", "logits ran away", "neither"])]
    for label in decided.drop(["bf16_paper_recipe", "fp32_paper_recipe"]):
        assert (f"`{label.removesuffix('_paper_recipe')}`: {recipe.loc[label, 'verdict']} "
                f"({int(recipe.loc[label, 'steps']):,} steps)" in iso["our result"])
    # at the repro preset: where the unchanged bf16 row itself showed neither, the row says its rows cannot separate
    from lpfa.pages.isolation import against_paper, isolation_table

    control_quiet = "bf16" in against_paper(isolation_table(layer=1)[0])["paper_fails_but"]
    assert ("the unchanged `bf16` row itself showed neither there" in iso["our result"]) == control_quiet
    counts = card["verdict"].value_counts()
    assert summary_text(card).startswith(f"Of the {len(card)} claims")
    assert all(f"{n} {v}" in summary_text(card) for v, n in counts.items())


def test_fig3_head_bars_before_the_explosion():
    """Page 07's Fig. 3: the step is the last diagnostics step before the BF16 explosion; one bar per head and run."""
    import matplotlib

    matplotlib.use("Agg")
    from lpfa.compare import head_metric_frame, step_before_failure
    from lpfa.pages.loss_explosion import fig2_twins
    from lpfa.pages.spectral_norms import plot_head_bars
    from lpfa.run import run_verdict

    runs = fig2_twins()["bf16_paper_recipe"]
    step = step_before_failure(runs)
    boom = run_verdict(runs["bf16"])["explosion_step"]
    steps = sorted(set(head_metric_frame(runs["bf16"], "wq_spectral_norm").step))
    assert step < boom and [s for s in steps if step < s < boom] == []
    fig = plot_head_bars(runs, layer=1, step=step)
    bars = [b for c in fig.axes[0].containers for b in c]
    assert len(bars) == 2 * 12
    f = head_metric_frame(runs["fp32"], "wq_spectral_norm")
    want = sorted(f[(f.layer == 1) & (f.step == step)].value)
    assert sorted(b.get_height() for b in fig.axes[0].containers[1]) == pytest.approx(want)
    with pytest.raises(ValueError, match="logged no 'wq_spectral_norm' at step 7"):
        plot_head_bars(runs, layer=1, step=7)


def test_recipe_isolation_table_judges_rows_by_the_loss():
    """Page 10's rows at the paper's recipe: every defined row is listed; committed ones get the explosion verdict
    of their files, the rest "not run yet"; a row is judged "logits ran away" or "neither" only past the step where
    the BF16 twin exploded."""
    from lpfa.experiments import RECIPE_ISOLATION
    from lpfa.pages.isolation import recipe_isolation_table
    from lpfa.results import experiment_rows
    from lpfa.run import run_verdict

    t = recipe_isolation_table()
    labels = ["bf16_paper_recipe", "fp32_paper_recipe", *(f"{r}_paper_recipe" for r in RECIPE_ISOLATION)]
    assert list(t.index) == labels and t["change"].str.len().gt(0).all()
    found = experiment_rows("paper_recipe", labels)
    boom = run_verdict(found["bf16_paper_recipe"])["explosion_step"]
    for label in labels:
        if label not in found:
            assert t.loc[label, "verdict"] == "not run yet"
            continue
        v = run_verdict(found[label])
        want = ("loss exploded" if v["exploded"] else "too short" if v["steps"] <= boom else
                "logits ran away" if v["runaway_step"] is not None else "neither")
        assert t.loc[label, "verdict"] == want and t.loc[label, "steps"] == v["steps"]
        assert (t.loc[label, "runaway step"] == v["runaway_step"]
                or (v["runaway_step"] is None and pd.isna(t.loc[label, "runaway step"])))
    # pv_fp32 at the recipe (results/paper_recipe/h200-2026-12-01-s3): clean by the loss, but layer 1's logits ran away
    assert t.loc["pv_fp32_paper_recipe", "verdict"] == "logits ran away"
    assert t.loc["pv_fp32_paper_recipe", "runaway layer"] == 1
    assert t.loc["delta_dp_paper_recipe", "verdict"] == "neither"
    assert pd.isna(t.loc["delta_dp_paper_recipe", "runaway step"])
    assert t.loc["bf16_paper_recipe", "paper"] == "loss exploded" and t.loc["fp32_paper_recipe", "paper"] == "neither"
    # FP32 outlier heads (results/paper_recipe/h200-2026-12-02): the runaway moves to other heads of layer 1; each
    # listed head's own logged logits stay above the threshold for the criterion's patience, the FP32 heads' never do
    from lpfa.explosion import RunawayCriterion
    from lpfa.run import Run, read_records

    label = "fp32_outlier_heads_paper_recipe"
    heads = t.loc[label, "runaway heads"]
    fp32 = set(Run(found[label]).train["fp32_heads"]["1"])
    assert heads and not fp32 & set(heads)
    crit = RunawayCriterion()
    logits = np.array([r["diag"]["max_logit"] for r in read_records(found[label]) if "diag" in r])[:, 1, :]
    above = logits > crit.logit
    streak = lambda col: max((sum(1 for _ in g) for k, g in itertools.groupby(col) if k), default=0)  # noqa: E731
    assert {h for h in range(above.shape[1]) if streak(above[:, h]) >= crit.patience} == set(heads)
    assert t.loc["delta_dp_paper_recipe", "runaway heads"] == ()
    # page 10's sentence from the same table: every row without an explosion but with a runaway, in the heads the
    # table names
    from lpfa.pages.isolation import recipe_runaway_text

    text = recipe_runaway_text(t)
    assert ("`fp32_outlier_heads_paper_recipe`'s loss did not explode in 6,000 steps, yet its layer-1 logits ran away "
            f"from step {t.loc[label, 'runaway step']:,.0f} in heads {', '.join(map(str, sorted(heads)))}, "
            f"while its FP32 heads {', '.join(map(str, sorted(fp32)))} stayed below the runaway threshold") in text
    assert "`pv_fp32_paper_recipe`" in text and "in all 12 heads" in text and "`delta_dp_paper_recipe`" not in text
    quiet = t.assign(**{"runaway step": None, "runaway layer": None})
    assert recipe_runaway_text(quiet) == "No row whose loss did not explode had logits that ran away either."


def test_muon_text_gives_each_learning_rate_its_verdicts():
    """Page 09's Muon sentences from results/muon_long: the verdicts as in the runs' files, and the lr-0.05 pair called
    generic because both precisions exploded."""
    from lpfa.experiments import MUON_LONG, MUON_LR2
    from lpfa.pages.sfa import muon_text
    from lpfa.results import experiment_rows
    from lpfa.run import run_verdict

    runs = experiment_rows("muon_long", list(MUON_LONG))
    v = {label: run_verdict(d) for label, d in runs.items()}
    text = muon_text(runs)
    assert text.count("At Muon lr") == 2 and f"At Muon lr {MUON_LR2:g}" in text
    for label in ("bf16_muon_lr2", "fp32_muon_lr2"):
        assert v[label]["exploded"] and f"exploded at step {v[label]['explosion_step']:,}" in text
    assert "The loss exploded at both precisions" in text
    assert "the SFA run neither exploded nor had its logits run away" in text
    assert f"ran away from step {v['bf16_muon']['runaway_step']:,}" in text


def test_tuning_best_picks_each_pass_best_launch():
    """Page 12's sweep table from results/attention_tuning: the best row per (implementation, pass), its ratio to the
    SDPA-flash row of the same sweep."""
    from lpfa.pages.kernels import tuning_best

    for d in results.runs("attention_tuning"):
        tune = json.loads((d / "tune.json").read_text())
        best = tuning_best(tune)
        sdpa = next(r for r in tune["rows"] if r["impl"] == "sdpa_flash")
        for (impl, pss), row in best.iterrows():
            mine = [r["tflops"] for r in tune["rows"]
                    if r.get("impl") == impl and r.get("pass") == pss and "tflops" in r]
            assert row["TFLOP/s"] == max(mine) and row["ratio to SDPA-flash"] == max(mine) / sdpa[f"{pss}_tflops"]
        every = {(i, p) for i in ("fa2", "paper") for p in ("fwd", "bwd")}
        if tune.get("complete", True):
            assert set(best.index) == every
        else:  # a sweep cut by its time limit (h200-2026-12-02: the paper preset's backward rows are missing;
            # h100-2026-12-06-d128: one configuration of its last pass)
            assert set(best.index) <= every and ("fa2", "fwd") in best.index


def test_overhead_table_says_which_side_sets_the_pace():
    """lpfa.pages.kernels.overhead_table on the committed overhead.json: one row per (implementation, pass), bound
    by the host exactly where its issue time exceeds the GPU's busy time, and the GPU-time ratio to SDPA-flash."""
    from lpfa.pages.kernels import overhead_table

    data = results.load("attention_benchmark", "overhead.json")
    t = overhead_table(data)
    assert len(t) == len(data["rows"]) and {"sdpa_flash", "fa2", "paper"} <= set(t.index.get_level_values(0))
    for (name, what), row in t.iterrows():
        r = data["rows"][f"{name}/{what}"]
        assert row["bound by"] == ("host" if r["host_us"] > r["gpu_us"] else "GPU")
        assert row["GPU time × SDPA-flash"] == pytest.approx(data["rows"][f"sdpa_flash/{what}"]["gpu_us"] / r["gpu_us"])
        assert row["distinct kernels"] == len(r["kernels_us"])
    assert t.loc[("sdpa_flash", "fwd"), "GPU time × SDPA-flash"] == 1.0


def test_sfa_overhead_table_reads_the_benchmark_rows():
    """lpfa.pages.kernels.sfa_overhead_table: per shape, the base presets' TFLOP/s and each SFA variant's time over
    its base, from the rows of benchmarks/sfa_overhead.py; the spread is the largest of the shape's rows."""
    from lpfa.pages.kernels import sfa_overhead_table

    def row(variant, over, spread, tflops=50.0, T=1024):
        return {"B": 2, "H": 3, "T": T, "D": 64, "variant": variant, "over_base": over, "spread": spread,
                "tflops": tflops}

    t = sfa_overhead_table({"rows": [row("paper", None, 0.01, 80.0), row("paper_sfa", 0.2, 0.03),
                                     row("paper_sfa count pass", 0.25, 0.0), row("paper", None, 0.0, 90.0, T=4096)]})
    assert list(t.index) == ["2×3×1024×64", "2×3×4096×64"]
    assert t.loc["2×3×1024×64", "paper TFLOP/s"] == 80.0 and t.loc["2×3×4096×64", "paper TFLOP/s"] == 90.0
    assert t.loc["2×3×1024×64", "paper_sfa over base"] == 0.2
    assert t.loc["2×3×1024×64", "paper_sfa count pass over base"] == 0.25
    assert t.loc["2×3×1024×64", "spread"] == 0.03 and list(t.columns)[-1] == "spread"


def test_committed_sfa_overhead_has_both_tie_tests_for_every_shape():
    """The committed run the kernels page reads (results/sfa_overhead): complete, every SFA preset timed with both tie
    tests at every shape, each against its base preset timed in the same run."""
    data = json.loads((results.run_dir("sfa_overhead") / "sfa_overhead.json").read_text())
    assert data["complete"]
    shapes = {(r["B"], r["H"], r["T"], r["D"]) for r in data["rows"]}
    for s in shapes:
        variants = {r["variant"] for r in data["rows"] if (r["B"], r["H"], r["T"], r["D"]) == s}
        assert {"paper", "fa2", "paper_sfa", "fa2_sfa", "paper_sfa count pass", "fa2_sfa count pass"} <= variants


def test_committed_gpu_audit_has_every_kernel_and_the_captured_family():
    """results/kernel_bias (the kernel-bias audit): every kernel of its config ran on the GPU, on the random and tied
    families at each T and on the captured layer, whose qkv.npz is committed beside it; the page's T pick is one row
    each."""
    from lpfa import audit as A

    df, config, folder = A.load_audit()
    assert config["device"].startswith("cuda") and df.unavailable.isna().all()
    fams = set(df.family)
    assert set(A.FAMILIES) <= fams and any(f.startswith("captured:") for f in fams)
    assert set(df.kernel) == set(config["kernels"])
    top = A.at_largest_T(df)
    assert not top.duplicated(["kernel", "family", "quantity"]).any()
    assert (folder / "layer1_step6000" / "qkv.npz").is_file()
    c, meta = A.load_captured(folder / "layer1_step6000" / "qkv.npz")
    assert meta["layer"] == 1 and c["q"].shape[2] == int(top[top.family.str.startswith("captured")]["T"].iloc[0])


def test_stabiliser_table_holds_each_row_against_the_bf16_run_before_its_explosion():
    """Page 17 (the stabilisers): the BF16, SFA and FP32 runs at the recipe, the committed isolation cuts and stabiliser
    rows, compared at the last diagnostics step before the BF16 loss explodes; the ratios are the links over the BF16
    run's."""
    from lpfa.compare import layer_max
    from lpfa.experiments import STABILISERS
    from lpfa.pages.stabilisers import STABILISER_LINKS, stabiliser_table
    from lpfa.run import Run, read_records, run_verdict

    t, step, pending = stabiliser_table()
    assert {"bf16_paper_recipe", "sfa_paper_recipe", "fp32_paper_recipe"} <= set(t.index)
    assert set(pending) | {label for label in STABILISERS if label in t.index} == set(STABILISERS)
    bf16 = results.experiment_rows("paper_recipe", ["bf16_paper_recipe"])["bf16_paper_recipe"]
    boom = run_verdict(bf16)["explosion_step"]
    assert step < boom and step + 200 >= boom  # diagnostics every 200 steps
    # the doctor's links: exactly the rows whose folder (or a rerun in it) holds a doctor report, read from it
    found = {**results.experiment_rows("paper_recipe"), **results.experiment_rows("stabilisers")}
    with_doctor = {label for label in t.index if Run(found[label]).doctor_reports}
    assert set(t.index[t["doctor step"].notna()]) == with_doctor
    for label in with_doctor:
        step_, rep = max(Run(found[label]).doctor_reports.items())
        layer1 = [r for r in rep["table"] if r["layer"] == 1]
        assert t.loc[label, "doctor step"] == step_
        assert t.loc[label, "δ |t| paper"] == max(abs(r["delta_t_paper"]) for r in layer1)
    want = layer_max(bf16, "max_logit", 1)
    assert t.loc["bf16_paper_recipe", f"{STABILISER_LINKS['logit']} @ {step}"] == \
        pytest.approx(float(want[want.index <= step].iloc[-1]))
    assert (t.loc["bf16_paper_recipe", [f"{k} ÷ bf16" for k in STABILISER_LINKS]] == 1).all()
    fp32 = t.loc["fp32_paper_recipe"]
    assert fp32["logit ÷ bf16"] < 0.01 and fp32["outcome"] == "neither"
    assert t.loc["delta_dp_paper_recipe", "stabiliser"] == "isolation: delta_dp"
    # the cost in loss: each row's eval loss minus its twin's at the last eval step both logged, from the records
    evals = {label: {r["step"]: r["val_loss"] for r in read_records(d) if "val_loss" in r}
             for label, d in found.items()}
    assert t.loc["sfa_paper_recipe", "FP32 twin"] == "fp32_paper_recipe"
    for label, row in t.iterrows():
        mine, twin = evals[label], evals[row["FP32 twin"]]
        assert row["gap step"] == max(set(mine) & set(twin))
        assert row["eval loss − twin"] == mine[row["gap step"]] - twin[row["gap step"]]


def test_speed_table_adds_the_gpu_only_columns_where_the_run_timed_them():
    """lpfa.pages.kernels.speed_table: the committed op table as measured (ratios to SDPA-flash of the same run), and
    the CUDA-graph columns only for a run that has them, each ratio to SDPA-flash's own."""
    from lpfa.pages.kernels import speed_table

    bench = results.load("attention_benchmark", "bench.json")
    t = speed_table(bench)
    base = bench["rows"]["sdpa_flash"]["fwd_bwd_tflops"]
    for name, r in bench["rows"].items():
        assert t.loc[name, "ratio to SDPA-flash"] == pytest.approx(r["fwd_bwd_tflops"] / base, abs=1e-3)
    has_graph = bench["rows"]["sdpa_flash"].get("graph_fwd_bwd_tflops") is not None
    assert ("GPU-only ratio" in t.columns) == has_graph

    def row(tf, g):
        return {"fwd_tflops": tf, "bwd_tflops": tf, "fwd_bwd_tflops": tf, "graph_fwd_bwd_tflops": g}

    t = speed_table({"rows": {"sdpa_flash": row(100.0, 200.0), "fa2": row(50.0, 180.0), "x": row(10.0, None)}})
    assert t.loc["fa2", "ratio to SDPA-flash"] == 0.5 and t.loc["fa2", "GPU-only ratio"] == 0.9
    assert pd.isna(t.loc["x", "GPU-only ratio"])


def test_shapes_and_overhead_text_read_the_committed_benchmark():
    """Page 12's clauses on the longer shapes and the host overhead, computed from the committed files."""
    from lpfa.pages.kernels import overhead_table, overhead_text, shapes_table, shapes_text

    shapes = results.load("attention_benchmark", "shapes.json")
    t = shapes_table(shapes)
    assert len(t) == len(shapes["rows"]) and list(t.columns)[3:5] == ["× SDPA-flash", "SFA over base"]
    assert ("timing spread" in t.columns) == ("spread" in shapes["rows"][0])
    r = {(x["T"], x["D"], x["impl"]): x for x in shapes["rows"]}
    text = shapes_text(shapes, 0.05)
    assert f"at T = 4,096 `fa2` runs at {r[(4096, 64, 'fa2')]['ratio_to_sdpa_flash']:.2f}× SDPA-flash" in text["ratios"]
    long_sfa = [x["sfa_overhead"]["fwd_bwd"] for x in shapes["rows"] if x["sfa_overhead"] and x["T"] >= 4096]
    assert text["sfa"].startswith(f"{min(long_sfa):+.1%} to {max(long_sfa):+.1%}, ")
    assert ("within" in text["sfa"]) == (max(long_sfa) <= 0.05)
    assert ("within" in shapes_text(shapes, -1.0)["sfa"]) is False
    longest = max(x["T"] for x in shapes["rows"])
    up = {r[(longest, 64, n)]["ratio_to_sdpa_flash"] > r[(1024, 64, n)]["ratio_to_sdpa_flash"]
          for n in ("fa2", "paper")}
    assert text["trend"] == {frozenset({True}): "rise", frozenset({False}): "fall"}.get(frozenset(up), "move apart") \
        + f" from T = 1,024 to T = {longest:,}"
    data = results.load("attention_benchmark", "overhead.json")
    o = overhead_text(overhead_table(data))
    fa2 = data["rows"]["fa2/fwd_bwd"]
    assert f"takes {fa2['host_us']:,.0f} µs of the host's time to issue, against {fa2['gpu_us']:,.0f} µs" in o["host"]
    assert o["host"].endswith("host-bound" if fa2["host_us"] > fa2["gpu_us"] else "GPU-bound")
    ratio = data["rows"]["sdpa_flash/fwd_bwd"]["gpu_us"] / fa2["gpu_us"]
    assert o["gpu_ratio"].startswith(f"{ratio:.2f}× for `fa2`")
    host = [n for n in ("fa2", "paper")
            if data["rows"][f"{n}/fwd_bwd"]["host_us"] > data["rows"][f"{n}/fwd_bwd"]["gpu_us"]]
    assert o["bound"].startswith("the host bounds " + " and ".join(f"`{n}`" for n in host) if host
                                 else "the GPU work bounds")
    goals = shapes_text(shapes, 0.05, {"fa2": 1.0, "paper": 0.8})["goals"]
    for n, goal in (("fa2", 1.0), ("paper", 0.8)):
        rows = [x for x in shapes["rows"] if x["impl"] == n]
        met = sum(x["ratio_to_sdpa_flash"] >= goal for x in rows)
        assert f"`{n}` (≥ {goal:g}×) meets its goal at {met} of {len(rows)} shapes" in goals
        short = [x["ratio_to_sdpa_flash"] for x in rows if x["ratio_to_sdpa_flash"] < goal]
        assert (f"down to {min(short):.2f}×" in goals) if short else True
    every = shapes_text(shapes, 0.05, {"fa2": 0.0})["goals"]
    n_fa2 = sum(x["impl"] == "fa2" for x in shapes["rows"])
    assert every.startswith(f"`fa2` (≥ 0×) meets its goal at {n_fa2} of {n_fa2} shapes (T = ")
    assert "down to" not in every


def test_fig2_headline_states_the_verdict_of_the_committed_twins():
    """Page 06's opening sentence (lpfa.pages.loss_explosion.fig2_headline): reproduced from the committed recipe twins,
    with their explosion step, the FP32 twin's steps, the seed count and the SFA twin; "not reproduced" when the FP32
    twin explodes too or the BF16 one does not."""
    from lpfa.pages.loss_explosion import fig2_headline, fig2_twins, recipe_rows, seed_table
    from lpfa.run import Run, run_verdict

    rows = recipe_rows()
    pair = fig2_twins()["bf16_paper_recipe"]
    v = {m: run_verdict(pair[m]) for m in ("bf16", "fp32")}
    conf = Run(pair["bf16"]).train
    sfa = run_verdict(rows["sfa_paper_recipe"])
    n = len(fig2_twins())
    text = fig2_headline(v, conf, n, seeds=seed_table(rows), sfa=sfa)
    assert text.startswith(f"**Fig. 2 is reproduced, with {n} seeds.**")
    assert f"the BF16 twin's loss exploded at step {v['bf16']['explosion_step']:,}" in text
    assert f"its FP32 twin trained {v['fp32']['steps']:,} steps on the same batches without exploding" in text
    assert f"**{conf['batch_size'] * conf['grad_accum'] * conf['block_size']:,} tokens per step**" in text
    assert f"The SFA twin at this recipe did not explode in {sfa['steps']:,} steps" in text and not sfa["exploded"]
    assert "still to run" not in text
    table = seed_table(rows)
    for label, r in table.iterrows():  # every seed is in the sentence: its explosion step, or its last step if none
        step = r["explosion step"] if pd.notna(r["explosion step"]) else r["steps"]
        assert f"{int(step):,}" in text, label
    one = fig2_headline(v, conf, 1)
    assert one.startswith("**Fig. 2 is reproduced, with one seed.**") and "One pair does not measure the spread" in one
    assert "The SFA twin at this recipe is still to run" in one
    both = fig2_headline({"bf16": v["bf16"], "fp32": {**v["fp32"], "exploded": True}}, conf, n)
    assert both.startswith("**Fig. 2 is not reproduced.**") and both.endswith("exploded and so did its FP32 twin. ")
    none = fig2_headline({"bf16": {**v["bf16"], "exploded": False}, "fp32": v["fp32"]}, conf, n)
    assert (f"the BF16 twin trained {v['bf16']['steps']:,} steps without exploding; its FP32 twin did not "
            "explode" in none)


def test_stabiliser_summary_from_the_committed_table():
    """Page 17's rows in words (lpfa.pages.stabilisers.stabiliser_summary) from stabiliser_table: the count of committed
    stabiliser runs, each isolation cut with its ratios and outcome, and the rows that keep the ties without
    exploding."""
    from lpfa.experiments import RERUNS, STABILISERS
    from lpfa.pages.stabilisers import stabiliser_summary, stabiliser_table

    table, step, pending = stabiliser_table(layer=1)
    text = stabiliser_summary(table, step, 1)
    rows = [label for label in STABILISERS if label not in RERUNS]  # the Muon bases are runs to make too
    done = [label for label in rows if label in table.index]
    assert text.startswith(f"**{len(done)} of the {len(rows)} stabiliser runs are committed")
    assert len(done) + len(pending) == len(rows)  # the count agrees with the page's list of rows not run yet
    assert f"At step {step:,}, the last record before the BF16 run's loss explodes" in text
    if "bf16_rerun" in table.index and table.loc["bf16_rerun", "exploded"]:  # the spread over every run of the seed
        from lpfa.pages.loss_explosion import recipe_fates

        fates = recipe_fates()
        same = fates[(fates.precision == "bf16") & (fates.seed == table.loc["bf16_rerun", "seed"])]
        booms = same["explosion step"].dropna()
        assert f"exploded at steps {int(booms.min()):,} to {int(booms.max()):,} ({len(booms)} runs" in text
        assert f"moves the explosion by up to {int(booms.max() - booms.min()):,} steps" in text
        for label in table.index:  # a row that exploded sooner than every such run says by how much
            r = table.loc[label]
            if r["exploded"] and r["seed"] == table.loc["bf16_rerun", "seed"] and r["explosion step"] < booms.min():
                assert (f"it exploded {int(booms.min() - r['explosion step']):,} steps before the earliest BF16 run "
                        f"of this seed (step {int(booms.min()):,})") in text
    r = table.loc["fp32_outlier_heads_paper_recipe"]
    assert (f"`fp32_outlier_heads`: ties ×{r['ties ÷ bf16']:.2f}, largest logit ×{r['logit ÷ bf16']:.2g}, W_Q ×"
            f"{r['W_Q ÷ bf16']:.2f}, its loss did not explode in 6,000 steps, its eval loss "
            f"{r['eval loss − twin']:+.2f} against `fp32_paper_recipe`'s at step {r['gap step']:,}, its layer-1 logits "
            f"running away from step {r['runaway step']:,}") in text
    cuts = [label for label in table.index if str(table.loc[label, "stabiliser"]).startswith("isolation")]
    keepers = [label for label in ["sfa_paper_recipe", *cuts, *done]
               if table.loc[label, "ties ÷ bf16"] > 0.5 and not table.loc[label, "exploded"]]
    assert keepers  # the committed cuts keep the ties (results/paper_recipe)
    seeds = sorted({int(table.loc[label, "seed"]) for label in keepers})  # bf16_qkclip_s1 too: two seeds
    heading = "**Ties need not go" + (", in one seed" if len(seeds) == 1 else "") + ":**"
    assert all(f"`{label}`" in text.split(heading)[1] for label in keepers)
    assert (f"their loss did not explode (one run each, at seed{'s' if len(seeds) > 1 else ''} "
            f"{', '.join(map(str, seeds))};") in text.split(heading)[1]
    mixed = table["seed"].nunique() > 1  # a second seed's rows are divided by that seed's BF16 run: the lead says so
    assert ("each row's links as ratios to the BF16 run's of the row's seed:" in text) == mixed
    doctor = text.split("**lpfa doctor on layer 1**")[1]  # one line per row with a doctor report, naming a rerun
    for label in table.index[table["doctor step"].notna()]:
        r = table.loc[label]
        again = (f" (the run again, `{r['doctor source'].split('/')[0]}/`)"
                 if r["doctor source"].startswith("rerun_") else "")
        assert (f"- `{label}` at step {int(r['doctor step']):,}{again}: rank-1 similarity "
                f"{r['rank-1 similarity']:.3f}, largest |t| of the δ error ") in doctor
    # results/stabilisers/h100-2026-12-07/bf16_qknorm_s1/rerun_to_5000: a row that ran without a checkpoint
    assert "- `bf16_qknorm_s1` at step 5,000 (the run again, `rerun_to_5000/`)" in doctor
    assert stabiliser_summary(table.iloc[:0], step).startswith("**Nothing to compare yet:**")


def test_host_layers_read_the_committed_host_overhead_runs():
    """Page 12's host-time table: one row per committed benchmarks/host_overhead.py run, oldest first, each layer's µs
    as the run measured it, and the sentence's first and last numbers from those rows."""
    from lpfa.pages.kernels import HOST_LAYERS, host_layers_table, host_layers_text

    folders = results.runs("host_overhead")
    data = {f.name: results.load("host_overhead", "host_overhead.json", f.name) for f in folders}
    t = host_layers_table(data)
    assert list(t.index) == [f.name for f in folders] and list(t.columns)[:-1] == list(HOST_LAYERS.values())
    last = data[folders[-1].name]["host_us"]
    assert t.iloc[-1]["attention(), fwd+bwd"] == last["attention/fwd_bwd"]
    assert t.iloc[-1]["fwd+bwd × SDPA-flash"] == last["attention/fwd_bwd"] / last["sdpa_flash/fwd_bwd"]
    text = host_layers_text(t)
    first = data[folders[0].name]["host_us"]["attention/fwd_bwd"]
    assert text.startswith("the host's time to issue one forward and backward through `attention()` went from "
                           f"{first:,.0f} µs")
    assert f"to {last['attention/fwd_bwd']:,.0f} µs" in text


def test_host_layers_table_leaves_a_missing_layer_empty():
    import pandas as pd

    from lpfa.pages.kernels import host_layers_table

    t = host_layers_table({"a": {"host_us": {"attention/fwd_bwd": 300.0, "sdpa_flash/fwd_bwd": 150.0}}})
    assert t.loc["a", "fwd+bwd × SDPA-flash"] == 2.0 and pd.isna(t.loc["a", "flash_forward"])


def test_throughput_text_reads_the_committed_training_run():
    """Page 13's sentence: each compiled lpfa row's ratio to SDPA compiled, against the speed goals (fa2 ≥ 0.95×, paper
    ≥ 0.9×)."""
    from lpfa.pages.training import TRAIN_GOALS, throughput_table, throughput_text

    tput = results.load("train_throughput", "throughput.json", full_throughput_run().name)
    t = throughput_table(tput)
    assert t.loc["sdpa", "ratio to SDPA"] == 1.0
    text = throughput_text(t)
    for row, goal in TRAIN_GOALS.items():
        if row in tput:
            r = tput[row]["tokens_per_s"] / tput["sdpa_compiled"]["tokens_per_s"]
            assert f"at {r:.3f}× (goal ≥ {goal:.2f}×: {'met' if r >= goal else 'not met'}" in text
    eager = throughput_text(throughput_table({k: v for k, v in tput.items() if not k.endswith("_compiled")}))
    assert "`fa2` not measured compiled" in eager and "eager, against eager SDPA: `fa2` " in eager


def test_throughput_table_compares_with_sdpa_pinned_to_flash_in_the_same_mode_only():
    """Rows pinned to FlashAttention-2 give a second ratio, each mode against its own SDPA row: a compiled row has no
    ratio where the compiled SDPA row failed (never the eager one), and a failed row drops out."""
    import math

    from lpfa.pages.training import throughput_table, throughput_text

    t = throughput_table({"sdpa": {"tokens_per_s": 100.0}, "sdpa_flash": {"tokens_per_s": 80.0},
                          "lpfa_fa2": {"tokens_per_s": 76.0}, "sdpa_compiled": {"tokens_per_s": 200.0},
                          "sdpa_flash_compiled": {"error": "RuntimeError: x"},
                          "lpfa_fa2_compiled": {"tokens_per_s": 190.0}})
    assert "sdpa_flash_compiled" not in t.index
    assert t.loc["lpfa_fa2", "ratio to SDPA-flash"] == 0.95 and t.loc["lpfa_fa2", "ratio to SDPA"] == 0.76
    assert math.isnan(t.loc["lpfa_fa2_compiled", "ratio to SDPA-flash"])
    assert "`fa2` at 0.950× (goal ≥ 0.95×: met)" in throughput_text(t)
    t = throughput_table({"sdpa_compiled": {"tokens_per_s": 200.0}, "sdpa_flash_compiled": {"tokens_per_s": 160.0},
                          "lpfa_fa2_compiled": {"tokens_per_s": 180.0}})
    assert "`fa2` at 0.900× (goal ≥ 0.95×: not met; 1.12× SDPA pinned to FlashAttention-2)" in throughput_text(t)


def _recipe_twins():
    from lpfa.pages.loss_explosion import recipe_rows

    rows = recipe_rows("paper_recipe", None)
    return {"bf16": rows["bf16_paper_recipe"], "fp32": rows["fp32_paper_recipe"]}


def test_wq_ratio_text_reads_the_recipe_twins():
    """Page 07's Fig. 3 sentence: the per-head BF16/FP32 ratios of ‖W_Q‖₂ in layer 1 at the step before the failure,
    recomputed here from the logged norms."""
    from lpfa.compare import head_metric_frame, step_before_failure
    from lpfa.pages.spectral_norms import wq_ratio_text

    runs = _recipe_twins()
    step = step_before_failure(runs)
    f = {k: head_metric_frame(d, "wq_spectral_norm") for k, d in runs.items()}
    at = {k: v[(v.layer == 1) & (v.step == step)].set_index("head").value for k, v in f.items()}
    ratio = (at["bf16"] / at["fp32"]).sort_values(ascending=False)
    text = wq_ratio_text(runs, 1, step)
    assert text.startswith(f"At step {step:,}, layer 1's heads {ratio.index[0]}, {ratio.index[1]}, {ratio.index[2]} ")
    assert f"({ratio.iloc[0]:.1f}×," in text and f"the median ratio is {ratio.median():.2f}" in text
    n = int((ratio > 1.25).sum())
    assert f"{n} of {len(ratio)} heads" in text and ("layer-wide" in text) == (n > len(ratio) / 2)


def test_growth_and_comparison_texts_read_the_recipe_twins():
    from lpfa.compare import growth_table
    from lpfa.pages.spectral_norms import growth_text, wq_comparison_text

    runs = _recipe_twins()
    items, sentence = growth_text(runs, 1)
    g = growth_table(runs)
    assert items.count("\n* ") == len(g) - 1 and f"×{g.loc['bf16', 'growth']:.2f}" in items
    assert sentence.startswith("At step ") and "in bf16 (head " in sentence and "in fp32 (head " in sentence
    text = wq_comparison_text(runs, 1)
    assert text.startswith("**Compared with the paper.**") and "the largest layer-1 norm of fp32" in text
    assert "For scale" not in text  # no shorter experiment given
    same = {"bf16": {"identical_steps": 5, "common_steps": 5, "first_differing_step": None},
            "fp32": {"identical_steps": 3, "common_steps": 5, "first_differing_step": 40}}
    both = wq_comparison_text(runs, 1, short=runs, short_name="itself", same=same)
    assert "(`itself`, same seed and data" in both and "first differ at step 40" in both and "deterministic" in both


def _v_frame(first: float, late: float, steps=(100, 200, 300, 400)):
    """A v_sign_dominance frame of 2 layers × 2 heads: every value `first` at the first step, `late` after it."""
    import pandas as pd

    rows = [{"step": s, "layer": lay, "head": h, "value": first if s == steps[0] else late + 0.01 * h}
            for s in steps for lay in (0, 1) for h in (0, 1)]
    return pd.DataFrame(rows)


@pytest.mark.parametrize("bf16, fp32, words", [(0.3, 0.1, "part of what BF16 training builds"),
                                               (0.1, 0.3, "the FP32 twin has more of them"),
                                               (0.2, 0.19, "too close in one run pair")])
def test_v_sign_text_compares_the_twins_in_the_layer(bf16, fp32, words):
    from lpfa.pages.tie_frequency import plot_v_sign, v_sign_text

    frames = {"bf16": _v_frame(0.05, bf16), "fp32": _v_frame(0.05, fp32)}
    text = v_sign_text(frames, 1)
    assert text.startswith(f"* **bf16** at step 400: {bf16 + 0.005:.1%} of V's columns one-signed")
    assert f"the most in layer 0, head 1 ({bf16 + 0.01:.1%}); at step 100: 5.0% on average." in text
    ratio = (bf16 + 0.005) / (fp32 + 0.005)  # layer 1, steps after the run's half (300, 400), mean over heads
    assert f"the BF16 run has {ratio:.1f} times the FP32 twin's" in text and words in text
    assert "In layer" not in v_sign_text({"bf16": frames["bf16"]}, 1)
    assert len(plot_v_sign(frames).axes) == 2


def test_tie_grids_read_the_logged_ties_of_the_twins():
    """Page 05's logged-ties figure and sentence: layer × head grids at two common steps, numbers from the grids."""
    from lpfa.compare import head_metric_frame
    from lpfa.pages.structure import plot_tie_grids, tie_grids, tie_grids_text

    folder = results.run_dir("repro_pair")
    runs = {label: folder / label for label in ("bf16", "fp32")}
    grids, at = tie_grids(runs)
    assert at[0] < at[-1] and set(grids) == {(label, s) for label in runs for s in at}
    f = head_metric_frame(runs["bf16"], "tie_fraction")
    last = f[f.step == at[-1]]
    g = grids[("bf16", at[-1])]
    assert g.shape == (last["layer"].nunique(), last["head"].nunique()) and g.values.max() == last.value.max()
    text = tie_grids_text(grids, at)
    assert text.startswith(f"`bf16` at step {at[-1]:,}: {last.value.mean():.1%} of rows tied on average")
    assert "; `fp32` at step" in text
    assert len(plot_tie_grids(grids).axes) == len(grids) + 1  # and the colourbar


def test_rank1_and_structure_texts_read_the_committed_replay_and_checkpoints():
    import json

    from lpfa.pages.structure import compare_text, rank1_text
    from lpfa.replay import load_replay, rank1_stats

    folder = results.run_dir("repro_runaway") / "bf16_runaway_replay"
    res, arr = load_replay(folder)
    text, within = rank1_text(res, arr, "x/y")
    h = res["heads"][0]
    med = rank1_stats(arr, h)["medians"]
    assert text.startswith(f"Rank-1 similarity in the GPU-trained BF16 run (layer {res['layer']}, the replay in "
                           f"`x/y`): head {h}: ")
    assert f"against {med['random vectors']:.2f} for random vectors" in text
    assert len(within) == len(res["heads"]) * sum(k.startswith("within") for k in med)
    found = [(f"{e}/{p.parent.name}", json.loads(p.read_text()))
             for e in ("structure", "repro_runaway") for p in sorted(results.run_dir(e).glob("*/structure.json"))]
    paragraphs = compare_text(found, within)
    fp32 = [s for _, s in found if s["attn_backend"] != "lpfa"]
    bf16 = [s for _, s in found if s["attn_backend"] == "lpfa"]
    assert len(paragraphs) == bool(fp32) + len(bf16)
    if fp32:
        assert paragraphs[0].startswith("Against the paper's pretrained GPT-2")
    assert compare_text([], within) == []


def test_isolation_ties_text_splits_runaway_rows_by_their_ties():
    import pandas as pd

    from lpfa.pages.isolation import isolation_ties_text

    ties = pd.DataFrame({"largest tie fraction": {"fp32": 0.05, "a": 0.8, "b": 0.06},
                         "largest logit": {"fp32": 40.0, "a": 9000.0, "b": 2500.0}})
    text = isolation_ties_text(ties, "fp32", {"a", "b"})
    assert text.startswith("The `fp32` row's worst head never exceeds a tie fraction of 0.050. ")
    assert "Rows whose logits ran away or loss exploded, with ties well above that: `a` (0.80). " in text
    assert "**Running away without ties**: `b` (at most 0.060, largest logit 2,500)" in text
    assert isolation_ties_text(ties, "fp32", {"a"}).endswith(
        "Every row whose logits ran away or loss exploded has ties well above that.")


def test_isolation_ties_reads_the_layer_maxima_of_the_committed_rows():
    import pandas as pd

    from lpfa.compare import layer_max
    from lpfa.pages.isolation import isolation_ties

    rows = {label: d for label, d in results.experiment_rows("isolation").items() if label in ("bf16", "fp32")}
    table = pd.DataFrame({"outcome": {label: "x" for label in rows}})
    t = isolation_ties(rows, table, 1)
    assert t.loc["bf16", "largest logit"] == layer_max(rows["bf16"], "max_logit", 1).max()
    assert t.loc["fp32", "largest tie fraction"] == layer_max(rows["fp32"], "tie_fraction", 1).max()


def test_twin_text_reads_the_committed_throughput_and_error_runs():
    """Page 13's FP32-twin sentence: fp32_split's tokens/s over sdpa_fp32's in the same run, and the worst error of
    each against float64, recomputed from the committed files."""
    from lpfa.pages.training import throughput_table, twin_text

    tput = results.load("train_throughput", "throughput.json", full_throughput_run().name)
    error = results.load("attention_benchmark", "error.json")
    text = twin_text(throughput_table(tput), error)
    r = tput["lpfa_fp32_split_compiled"]["tokens_per_s"] / tput["sdpa_fp32_compiled"]["tokens_per_s"]
    assert text.startswith(f"`fp32_split` trains GPT-2 S at compiled {r:.2f}× and eager ")
    worst = max(t["max_rel"] for inp in error["inputs"].values() for t in inp["fp32_split"].values())
    assert f"within {worst:.1e} of float64" in text
    with pytest.raises(ValueError, match="no fp32_split and sdpa_fp32 rows"):
        twin_text(throughput_table({k: v for k, v in tput.items() if "fp32" not in k}), error)


def test_stabiliser_groups_put_the_cuts_and_the_stabilisers_in_two_columns():
    """Page 17's figure columns (lpfa.pages.stabilisers.stabiliser_groups): the recipe's BF16 and FP32 runs head the
    first two, the paper's cuts (*_paper_recipe) and the reruns go left, every other seed-1337 row right, each in the
    order given; each second seed of a stabiliser row gets a column headed by that seed's recipe runs."""
    from lpfa.experiments import stabiliser_seed
    from lpfa.pages.stabilisers import seed_base_of, stabiliser_groups

    labels = ["bf16_qknorm", "sfa_paper_recipe", "fp32_paper_recipe", "bf16_rerun", "delta_dp_paper_recipe",
              "bf16_paper_recipe", "sr", "fp32_rerun", "bf16_gated", "fp32_gated"]
    assert stabiliser_groups(labels) == {
        "the paper's cuts and reruns": ["bf16_paper_recipe", "fp32_paper_recipe", "sfa_paper_recipe", "bf16_rerun",
                                        "delta_dp_paper_recipe", "fp32_rerun"],
        "stabilisers and their FP32 twins": ["bf16_paper_recipe", "fp32_paper_recipe", "bf16_qknorm", "sr",
                                             "bf16_gated", "fp32_gated"]}
    assert stabiliser_groups(["bf16_paper_recipe", "bf16_gated"]) == {
        "the paper's cuts and reruns": ["bf16_paper_recipe"],
        "stabilisers and their FP32 twins": ["bf16_paper_recipe", "bf16_gated"]}
    assert stabiliser_groups([]) == {"the paper's cuts and reruns": [], "stabilisers and their FP32 twins": []}
    seeded = [*labels, "bf16_qknorm_s1", "fp32_paper_recipe_s1", "bf16_paper_recipe_s2", "bf16_paper_recipe_s1"]
    assert list(stabiliser_groups(seeded).items())[2:] == [  # a second seed's column, headed by its recipe runs
        ("the same at seed 1", ["bf16_paper_recipe_s1", "fp32_paper_recipe_s1", "bf16_qknorm_s1"])]
    rows = [*results.experiment_rows("paper_recipe"), *results.experiment_rows("stabilisers")]
    left, right, *seeds = stabiliser_groups(rows).values()
    assert left[:2] == right[:2] == ["bf16_paper_recipe", "fp32_paper_recipe"]
    drawn = left + right[2:] + [label for column in seeds for label in column]
    stabilised = {stabiliser_seed(label)[1] for label in rows} - {None}  # seeds that have stabiliser rows
    unseeded = [label for label in rows if seed_base_of(label) not in (None, *stabilised)]
    assert len(drawn) == len(set(drawn))  # every committed row drawn at most once, the base in both first columns
    assert sorted(drawn + unseeded) == sorted(rows)  # and only the recipe runs of seeds without stabilisers left out


def test_page_6_and_page_17_figures_share_their_precursor_panels():
    """plot_precursors (page 6) and plot_stabilisers (page 17) draw their panels in one loop: on the same base runs
    each panel holds, in order, one line per run, its layer_max of that precursor, in the run's mode's colour and dash
    (stabiliser_styles gives the base runs those)."""
    import matplotlib.pyplot as plt

    from lpfa.compare import PRECURSORS, layer_max
    from lpfa.pages.loss_explosion import plot_precursors
    from lpfa.pages.stabilisers import plot_stabilisers

    rows = results.experiment_rows("paper_recipe", ["bf16_paper_recipe", "fp32_paper_recipe", "sfa_paper_recipe"])
    assert len(rows) == 3
    page6, page17 = plot_precursors(rows, 1), plot_stabilisers(rows, 1, {"base": list(rows)})
    assert len(page6.axes) == len(page17.axes) == len(PRECURSORS)
    for a, b, metric in zip(page6.axes, page17.axes, PRECURSORS):
        assert [ln.get_label() for ln in a.get_lines()] == [ln.get_label() for ln in b.get_lines()] == list(rows)
        for label, la, lb in zip(rows, a.get_lines(), b.get_lines()):
            s = layer_max(rows[label], metric, 1)
            for ln in (la, lb):
                assert np.array_equal(ln.get_xdata(), s.index) and np.array_equal(ln.get_ydata(), s.values)
            assert (la.get_color(), la.get_linestyle(), la.get_linewidth()) == (lb.get_color(), lb.get_linestyle(), 1.4)
    plt.close(page6)
    plt.close(page17)


def test_stabiliser_plan_times_each_row_alone_with_the_measured_overhead():
    """Page 17's plan (lpfa.pages.stabilisers.stabiliser_plan) on the committed runs: the overhead of a run alone is
    its wall time less its steps at their median step time, each pending row takes its steps at its speed alone plus
    that overhead, and the sharing comparison counts both sides with compilation and evaluations."""
    from lpfa.pages.stabilisers import (
        STABILISER_STEPS,
        alone_overhead,
        finish_overhead,
        stabiliser_costs,
        stabiliser_plan,
        stabiliser_speeds,
        stabiliser_table,
    )
    from lpfa.run import Run
    from lpfa.scaling import run_price

    assert stabiliser_plan([]) == "Every stabiliser row is committed."
    seconds, name = alone_overhead()
    folder = results.results_dir() / "paper_recipe" / name
    runs = [d for d in folder.parent.iterdir() if (d / "summary.json").is_file()]
    assert runs == [folder]  # a launch of one run
    summary = Run(folder).summary
    assert seconds == pytest.approx(summary["wall_s"] - summary["steps"] * run_price(folder)["step_s"])
    assert 0 < seconds < summary["wall_s"] / 2
    # a row's finish (doctor, then replay): from its clock stopping to its replay.json, in every committed run with both
    ends = []
    for rep in sorted(results.results_dir().glob("*/*/*/**/replay_step_*/replay.json")):
        run = rep.parent.parent
        launch = run / "launch.json" if (run / "launch.json").is_file() else run.parent / "launch.json"
        experiment = run.relative_to(results.results_dir()).parts[0]
        if experiment not in ("stabilisers", "paper_recipe") or not launch.is_file() or not list(
                run.glob("doctor_step_*")):
            continue
        label = run.parent.name if run.name.startswith("rerun_") else run.name
        started = json.loads(launch.read_text())["runs"][label]["started"]
        done = pd.Timestamp(json.loads(rep.read_text())["provenance"]["date_utc"]).timestamp()
        ends.append(done - started - json.loads((run / "summary.json").read_text())["wall_s"])
    finish = finish_overhead()
    assert len(ends) >= 3 and finish[:2] == (pytest.approx(float(np.median(ends))), len(ends))  # 3 at 54b1851
    assert 0 < finish[0] < 600 and finish[2] == 200
    _, _, pending = stabiliser_table()
    if not pending:
        return
    text = stabiliser_plan(pending)
    assert f"the {finish[0]:.0f} s that its finish takes (the median of {len(ends)} committed runs" in text
    alone = stabiliser_costs()["tokens/s"]
    tokens = STABILISER_STEPS * 24 * 1024
    for label, minutes in re.findall(r"`(\w+)` ([\d.]+) min", text):
        assert float(minutes) == pytest.approx((tokens / alone[label.removesuffix("_s1")] + seconds + finish[0]) / 60,
                                               abs=0.051)
    speeds, sharing = stabiliser_speeds()
    tps, run = speeds["FP32, compiled"]
    solo = tokens / (tokens / alone["fp32_paper_recipe"] + seconds)
    assert f"FP32, compiled: {sharing} × {tps:,.0f} tokens/s (`{run}`) against {solo:,.0f} for" in text
    shared = f"Runs sharing an H200 ({sharing} at a time) trained "
    assert text.startswith(shared + "no faster together" if max(
        sharing * speeds[k][0] / (tokens / (tokens / alone[r] + seconds)) for k, r in
        (("FP32, compiled", "fp32_paper_recipe"), ("BF16, compiled", "bf16_paper_recipe"))) < 1.05 else shared)


def test_muon_clip_rows_are_held_against_their_twins_and_the_muon_base():
    """QK-clip with Muon (Kimi K2's MuonClip), a stabiliser: the BF16 rows' references are their FP32 twins, the only
    change from the Muon base is the clip, and the Muon base is no stabiliser row (BASES)."""
    from lpfa.experiments import BASES, MUON_BASE, QK_CLIP_TAU, rows

    r = rows("stabilisers")
    assert set(MUON_BASE) <= set(BASES) and r["bf16_qkclip_muon"].reference == "fp32_qkclip_muon"
    assert r["bf16_muon_recipe"].reference == "fp32_muon_recipe"
    for mode in ("bf16", "fp32"):
        clip, base = set(r[f"{mode}_qkclip_muon"].overrides), set(r[f"{mode}_muon_recipe"].overrides)
        assert clip - base == {f"qk_clip={QK_CLIP_TAU:g}"} and "optimizer=muon" in base
        assert clip - {"optimizer=muon"} == set(r[f"{mode}_qkclip"].overrides)


def _stabiliser_root(tmp, walls: dict[str, float]):
    """A results root with the recipe's BF16 run and one stabiliser launch of ``walls`` (label: wall seconds for
    6,000 steps), from the committed configs."""
    src = {**results.experiment_rows("paper_recipe", ["bf16_paper_recipe"]), **results.experiment_rows("stabilisers")}
    for exp, launch, labels in (("paper_recipe", "h200-2026-01-01", ["bf16_paper_recipe"]),
                                ("stabilisers", "h200-2026-01-02", walls)):
        (tmp / exp / launch).mkdir(parents=True)
        (tmp / exp / launch / "provenance.json").write_text(json.dumps({"date_utc": launch[5:] + "T00:00:00+00:00",
                                                                        "device": "1 x NVIDIA H200 (nvidia-h200)"}))
        for label in labels:
            d = tmp / exp / launch / label
            d.mkdir()
            shutil.copy(src[label] / "config.json", d)
            if label in walls:
                (d / "summary.json").write_text(json.dumps({"steps": 6000, "wall_s": walls[label]}))
    return tmp


def test_sr_persistence_on_the_committed_capture():
    """Page 17's stochastic-rounding check (lpfa.pages.stabilisers.sr_persistence) on the kernel-bias audit's captured
    batch: one row per policy of SR_POLICIES, paper's worst head as the unit, the sentence built from the table."""
    from lpfa.pages.stabilisers import SR_POLICIES, sr_persistence

    table, text, meta = sr_persistence(sequences=1, steps=3)
    assert list(table.index) == list(SR_POLICIES) and table.loc["paper", "÷ paper"] == 1.0
    assert ((table["its accumulation"] >= 0) & (table["its accumulation"] <= 3 ** 0.5 + 1e-12)).all()
    assert f"captured at step {meta['step']:,}" in text and f"{table.loc['paper_sr', '÷ paper']:.2f}×" in text
    assert f"`paper_sr_scores`, the `sr_scores` row's policy) leaves {table.loc['paper_sr_scores', '÷ paper']:.2f}×" \
        in text


def test_rescue_table_reads_the_committed_rescue():
    """Page 15's rescue (lpfa.compare.rescue_table): the unrescued bias_x128 and each committed rescue run, its warnings
    and switches as the metrics log them (read here straight from metrics.jsonl.gz), its verdict as summary.json has
    it, and the sentence built from the table."""
    import gzip

    from lpfa.dose import rescue_headline, rescue_table
    from lpfa.experiments import RESCUE

    table = rescue_table()
    found = results.experiment_rows("rescue", list(RESCUE))
    assert found and set(found) <= set(table.index) and "bias_x128" in table.index
    for label, d in found.items():
        recs = [json.loads(line) for line in gzip.open(d / "metrics.jsonl.gz", "rt")]
        warns = [r["warning"] for r in recs if "warning" in r]
        summary = json.loads((d / "summary.json").read_text())
        row = table.loc[label]
        assert row["warnings"] == len(warns) and row["steps"] == summary["steps"]
        assert row["explosion step"] == summary["explosion_step"] and row["runaway step"] == summary["runaway_step"]
        switched = [w for w in warns if w["action"].startswith("layer ")]
        assert row["switches"].count("→") == len(switched)
        if switched:
            assert row["switches"].startswith(f"layer {switched[0]['layer']} at {switched[0]['step']:,} → ")
        assert row["on warning"] == json.loads((d / "config.json").read_text())["train"]["on_warning"]
    text = rescue_headline(table)
    b = table.loc["bias_x128"]
    assert f"(`bias_x128`) exploded at step {b['explosion step']:,}" in text
    for label in found:
        assert f"(`{label}`: " in text
    # one seed per row, held against every unrescued seed at the dose (bias_x128_s2 exploded at step 4,246)
    assert "1,086, 1,306, 4,246, so a rescued run that did not explode in 3,000 steps may still explode later" in text
    assert rescue_headline(table.iloc[:0]).startswith("The rescue runs")


def test_monitor_overhead_table_reads_each_committed_benchmark():
    from lpfa.pages.early_warning import monitor_overhead_table

    table = monitor_overhead_table()
    folders = results.runs("monitor_overhead")
    assert list(table.index) == [f.name for f in folders]
    for f in folders:
        b = json.loads((f / "monitor_overhead.json").read_text())
        row = table.loc[f.name]
        assert row["overhead"] == b["overhead"] and abs(b["overhead"] - (b["monitored_ms"] / b["plain_ms"] - 1)) < 1e-12
        amortised = b["capture_extra_ms"] / (b["every"] * b["plain_median_ms"])
        assert abs(row["amortised capture"] - amortised) < 1e-12
        assert row["goal met"] == (max(b["overhead"], amortised) <= 0.02)
        assert row["commit"] == b["provenance"]["git_commit"][:7]
        assert row["every"] == b["every"]
        if "first_capture_step_ms" in b:
            assert row["first capture ms"] == b["first_capture_step_ms"]
        else:
            assert math.isnan(row["first capture ms"])


def test_overhead_text_states_the_latest_run_and_its_commits_spread():
    """Page 15's sentence on the monitor's cost (lpfa.pages.early_warning.overhead_text) from the committed runs, and
    from edited tables: one run, a first capture not timed apart, nothing committed."""
    from lpfa.pages.early_warning import ONE_OFF, monitor_overhead_table, overhead_text

    cost = monitor_overhead_table()
    last = cost.iloc[-1]
    text = overhead_text(cost)
    assert text.startswith(f"**At every {last['every']} steps one capture costs {last['capture extra ms']:,.0f} ms")
    assert f"{last['amortised capture']:.1%} of the step time" in text
    assert f"({last['overhead']:.1%} as the ratio" in text
    assert ("within the 2% goal" if last["goal met"] else "above the 2% goal") in text
    same = cost[cost["commit"] == last["commit"]]
    assert (f"The {len(same)} runs of {last['commit']}" in text) == (len(same) > 1)
    if len(same) > 1:
        assert f"ratio of means between {same['overhead'].min():.2%} and {same['overhead'].max():.2%}" in text
    assert text.count(ONE_OFF) == 1 and f"took {last['first capture ms']:,.0f} ms" in text
    one = cost.iloc[:1].copy()
    one.loc[one.index[0], "first capture ms"] = float("nan")
    t1 = overhead_text(one)
    assert "That mean includes the process's first capture" in t1 and " At " not in t1.split(".**")[1]
    assert overhead_text(cost.iloc[:0]).startswith("No run of")


def test_eval_loss_gap_at_the_last_eval_step_both_runs_logged(tmp_path):
    """lpfa.pages.stabilisers.eval_loss_gap: a stabiliser's cost in loss is its eval loss minus its twin's at the last
    eval step both logged (not at each run's own last step); no shared step, or no evals, gives (None, nan)."""
    from lpfa.pages.stabilisers import eval_loss_gap
    from lpfa.run import load_metrics

    rng = np.random.default_rng()
    a, b, c = (tmp_path / n for n in "abc")
    va, vb = rng.uniform(2, 4, 4), rng.uniform(2, 4, 3)
    for d, steps, vals in ((a, [500, 1000, 1500, 1800], va), (b, [500, 1000, 1500], vb), (c, [700], [3.0])):
        d.mkdir()
        (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s_, "loss": 9.0}) + "\n"
                                                 + json.dumps({"step": s_, "val_loss": v}) + "\n"
                                                 for s_, v in zip(steps, vals)))
    val = {d: load_metrics(d)[1] for d in (a, b, c)}
    step, gap = eval_loss_gap(val[a], val[b])
    assert step == 1500 and gap == float(va[2]) - float(vb[2])
    assert eval_loss_gap(val[b], val[a]) == (1500, float(vb[2]) - float(va[2]))
    for none in (eval_loss_gap(val[a], val[c]), eval_loss_gap(val[a], val[a].iloc[:0])):
        assert none[0] is None and math.isnan(none[1])


def test_stabiliser_finding_names_the_rows_that_hold_and_how_the_others_fail():
    """Page 17's one-sentence finding (lpfa.pages.stabilisers.stabiliser_finding): from the committed table and from
    edited copies, a row holds only without explosion, without runaway and within LOSS_MATCH of its FP32 twin."""
    from lpfa.experiments import BASES, STABILISERS
    from lpfa.pages.stabilisers import LOSS_MATCH, _failure, stabiliser_finding, stabiliser_table

    table, _, _ = stabiliser_table(layer=1)
    text = stabiliser_finding(table)
    assert text.startswith("**At the paper's recipe, ") and text.endswith(".**")
    rerun = table.loc["fp32_rerun"]  # LOSS_MATCH's comment: ten times the spread of two FP32 runs of one seed
    assert rerun["FP32 twin"] == "fp32_paper_recipe" and rerun["gap step"] == 5000
    assert round(rerun["eval loss − twin"], 3) == -0.005 and LOSS_MATCH == 0.05
    g = table.loc["bf16_gated"]  # results/stabilisers/h200-2026-12-03b: ran away and ended above fp32_gated
    assert g["FP32 twin"] == "fp32_gated" and g["runaway step"] is not None and g["eval loss − twin"] > LOSS_MATCH
    assert (f"`bf16_gated`: its logits ran away (layer 1, from step {g['runaway step']:,}) and its eval loss ended "
            f"{g['eval loss − twin']:.2f} above its FP32 twin's") in text
    assert f"`sr`: its loss exploded (step {table.loc['sr', 'explosion step']:,})" in text
    assert "`fp32_gated`" not in text  # FP32 twins are references, not stabiliser rows
    q = table.loc["bf16_qknorm_s1"]  # results/stabilisers/h100-2026-12-07: its own FP32 twin is not committed
    assert q["FP32 twin"] == ("fp32_qknorm_s1" if "fp32_qknorm_s1" in table.index else "fp32_paper_recipe_s1")
    held_plain = [label for label in STABILISERS if label in table.index and label.startswith("bf16_")
                  and label not in BASES and not _failure(table.loc[label])
                  and table.loc[label, "FP32 twin"].startswith("fp32_paper_recipe")]
    if held_plain:
        assert f"(for {', '.join(f'`{x}`' for x in held_plain)} the plain FP32 run's of the same seed: " in text
    edited = table.copy()
    edited.loc["bf16_gated", "runaway step"] = None
    edited.loc["bf16_gated", "eval loss − twin"] = LOSS_MATCH / 2
    t2 = stabiliser_finding(edited)
    assert "`bf16_gated`" in t2.split(" the criterion: ")[0] and "`bf16_gated`: its logits ran away" not in t2
    edited.loc["bf16_gated", "eval loss − twin"] = -2 * LOSS_MATCH
    assert f"`bf16_gated`: its eval loss ended {2 * LOSS_MATCH:.2f} below its FP32 twin's" in stabiliser_finding(edited)
    assert stabiliser_finding(table.iloc[:0]).startswith("**Nothing to compare yet:**")
    only_bases = table.drop(index=[label for label in STABILISERS if label in table.index and label not in BASES])
    assert stabiliser_finding(only_bases) == "**No BF16 stabiliser row is committed yet.**"


def test_paper_claims_text_measures_each_committed_claim():
    """Page 17's test of the paper's Discussion (lpfa.pages.stabilisers.paper_claims_text): each committed BF16 row of
    QK-norm, gated attention or QK-clip with its claimed link measured against the BF16 run, from stabiliser_table's
    columns."""
    from lpfa.experiments import STABILISER_SEEDS, stabiliser_seed
    from lpfa.pages.stabilisers import PAPER_CLAIMS, paper_claims_text, similarity_reference, stabiliser_table

    table, _, _ = stabiliser_table(layer=1)
    text = paper_claims_text(table)
    done = [label for n in PAPER_CLAIMS for label in (f"bf16_{n}", *(f"bf16_{n}_s{s}" for s in STABILISER_SEEDS))
            if label in table.index]  # every committed seed of each claim's row
    assert "bf16_qknorm" in done and "bf16_qknorm_s1" in done  # results/stabilisers/h200-2026-12-02b, h100-2026-12-07
    for label in done:
        r = table.loc[label]
        assert f"`{label}` ({'its loss exploded' if r['exploded'] else 'its loss did not explode'}" in text
        assert f"ties ×{r['ties ÷ bf16']:.2f}" in text
        if r["rank-1 similarity"] is not None:  # against the BF16 and FP32 runs of the row's seed where measured
            seed = int(r["seed"])
            bf16 = f"bf16_paper_recipe_s{seed}"
            if bf16 not in table.index or table.loc[bf16, "rank-1 similarity"] is None:
                bf16 = "bf16_rerun"
            assert similarity_reference(table, "bf16", stabiliser_seed(label)[1]) == bf16
            base = table.loc[bf16]
            other = "" if int(base["seed"]) == seed else f", seed {int(base['seed'])}"
            assert (f"rank-1 similarity {r['rank-1 similarity']:.3f} against the BF16 run's "
                    f"{base['rank-1 similarity']:.3f} (`{bf16}` at step {base['doctor step']:,}{other}; ×"
                    f"{r['rank-1 similarity'] / base['rank-1 similarity']:.2f})") in text
            healthy = table.loc["fp32_rerun"]  # results/stabilisers/h200-2026-12-03: the FP32 run's doctor report
            other = "" if int(healthy["seed"]) == seed else f", seed {int(healthy['seed'])}"
            assert (f"the FP32 run's {healthy['rank-1 similarity']:.3f} (`fp32_rerun` at step "
                    f"{healthy['doctor step']:,}{other})" in text)
    # results/paper_recipe/h200x2-2026-12-01/bf16_paper_recipe_s1/rerun_to_5000: seed 1's own BF16 reference
    assert "(`bf16_paper_recipe_s1` at step 5,000; ×" in text
    assert "the FP32 run's" not in paper_claims_text(table.drop(index="fp32_rerun"))
    assert paper_claims_text(table.drop(index=done)).startswith("None of")


def test_similarity_reference_is_the_run_of_the_rows_seed_where_measured():
    """lpfa.pages.stabilisers.similarity_reference: a seeded row's similarity is held against its own seed's recipe run
    when that run's doctor measured it, else against the default seed's run again; None when neither was measured."""
    from lpfa.pages.stabilisers import similarity_reference

    t = pd.DataFrame({"rank-1 similarity": [0.99, 0.95, 0.96, None], "seed": [1337, 1337, 1, 1]}, dtype=object,
                     index=["bf16_rerun", "fp32_rerun", "bf16_paper_recipe_s1", "fp32_paper_recipe_s1"])
    assert similarity_reference(t, "bf16", 1) == "bf16_paper_recipe_s1"
    assert similarity_reference(t, "fp32", 1) == "fp32_rerun"  # seed 1's FP32 run has no doctor report
    assert similarity_reference(t, "bf16", None) == "bf16_rerun" == similarity_reference(t, "bf16", 2)
    assert similarity_reference(t.drop(index="fp32_rerun"), "fp32", 1) is None


def test_similarity_spread_over_seeds_flags_the_verdicts_it_could_turn():
    """Page 17's Discussion ends with how far the doctor's similarity moves with the seed alone (pairs of one
    configuration at two seeds, at the same doctor step), and names the similarity verdicts whose margin to their
    reference is smaller than that."""
    from lpfa.pages.stabilisers import paper_claims_text, similarity_spread, stabiliser_table

    table, _, _ = stabiliser_table(layer=1)
    sim = table["rank-1 similarity"]
    pairs = {(a, b): d for a, b, d in similarity_spread(table)}
    # results/paper_recipe/h200x2-2026-12-01/bf16_paper_recipe_s1/rerun_to_5000, stabilisers/h100-2026-12-07/...
    for a, b in (("bf16_paper_recipe_s1", "bf16_rerun"), ("bf16_qknorm_s1", "bf16_qknorm")):
        assert pairs[(a, b)] == pytest.approx(abs(sim[a] - sim[b]))
    assert ("sr_s1", "sr") not in pairs  # their doctors ran at steps 4,000 and 2,800
    spread = max(pairs.values())
    text = paper_claims_text(table)
    assert f"differ by {pairs[('bf16_qknorm_s1', 'bf16_qknorm')]:.3f}" in text
    margin = abs(sim["bf16_qknorm"] - sim["fp32_qknorm"])  # the row's own FP32 twin is its reference
    assert (margin < spread) == (f"`bf16_qknorm` ({margin:.3f} from its FP32 twin's)" in text)
    same = table.copy()  # each pair made equal: no spread, so no margin is within it
    for a, b in pairs:
        same.loc[a, "rank-1 similarity"] = sim[b]
    assert {d for _, _, d in similarity_spread(same)} == {0.0}
    assert paper_claims_text(same).endswith("Every similarity verdict above clears its reference by more than 0.000.")
    assert "moves with the seed" not in paper_claims_text(table.drop(index=[a for a, _ in pairs]))


def test_paper_claims_verdicts_need_the_link_broken_and_the_row_holding():
    """Page 17's verdicts on the paper's Discussion (lpfa.pages.stabilisers.paper_claims_text): a claim stands only when
    its BF16 row breaks the claimed link (similarity at most its FP32 twin's, else the FP32 run's; ties at most
    TIES_KEPT of the BF16 run's) and holds (no explosion, no runaway, eval loss within LOSS_MATCH of its twin's); each
    other case says which part fails, and a row that fails is against the claim even with its link unmeasured. The
    committed lead's counts are recomputed over every seed from the table's columns."""
    from lpfa.experiments import STABILISER_SEEDS
    from lpfa.pages.stabilisers import LOSS_MATCH, PAPER_CLAIMS, TIES_KEPT, paper_claims_text, stabiliser_table

    table, _, _ = stabiliser_table(layer=1)
    healthy = table.loc["fp32_rerun", "rank-1 similarity"]
    seeded = [f"bf16_{n}_s{s}" for n in PAPER_CLAIMS for s in STABILISER_SEEDS]
    one_seed = table.drop(index=[label for label in seeded if label in table.index])

    def verdict(t, name):
        item = [line for line in paper_claims_text(t).splitlines()
                if line.startswith("- ") and f"`bf16_{name}`" in line]
        assert len(item) == 1
        return item[0].split("Verdict: ")[1]

    def holding(t, label):
        t.loc[label, ["exploded", "runaway step", "eval loss − twin"]] = [False, None, LOSS_MATCH / 2]

    def measured(t, label):
        return label in t.index and t.loc[label, "rank-1 similarity"] is not None

    def reference(t, label):  # the similarity without BF16 attention: the row's FP32 twin's, else the FP32 run's
        twin = label.replace("bf16_", "fp32_", 1)  # (the FP32 run of the row's seed where measured, else seed 1337's)
        own = f"fp32_paper_recipe_s{int(t.loc[label, 'seed'])}"
        return t.loc[twin, "rank-1 similarity"] if measured(t, twin) else \
            t.loc[own, "rank-1 similarity"] if measured(t, own) else healthy

    done = [n for n in PAPER_CLAIMS if f"bf16_{n}" in one_seed.index]
    for name in done:  # every branch, on an edited copy of each committed seed-1337 row
        label, link = f"bf16_{name}", PAPER_CLAIMS[name][0]
        t = one_seed.copy()
        ref = reference(t, label)
        broken_value, kept_value = (ref - 0.1, ref + 0.01) if link == "rank-1 similarity" else (TIES_KEPT, 1.5)
        column = "rank-1 similarity" if link == "rank-1 similarity" else "ties ÷ bf16"
        holding(t, label)
        t.loc[label, column] = broken_value
        assert verdict(t, name) == ("consistent with the claim: the row breaks the link, and neither its loss "
                                    "exploded nor its logits ran away.")
        t.loc[label, column] = kept_value
        assert verdict(t, name).startswith("**against the claim**: the row keeps the link, yet neither its loss")
        t.loc[label, "eval loss − twin"] = 2 * LOSS_MATCH
        assert verdict(t, name) == ("**against the claim**: the row leaves the link intact and its eval loss ended "
                                    f"{2 * LOSS_MATCH:.2f} above its FP32 twin's: in this run the stabiliser neither "
                                    "broke the link nor met the page's criterion.")
        t.loc[label, column] = broken_value
        t.loc[label, ["exploded", "explosion step"]] = [True, 4321]
        assert verdict(t, name) == ("**against the claim**: the row breaks the link, yet its loss exploded (step "
                                    "4,321), so breaking the link is not enough here.")
        if link == "rank-1 similarity":
            t.loc[label, column] = None
            assert verdict(t, name) == ("**against the claim**: its loss exploded (step 4,321), so the stabiliser did "
                                        "not work here (the link is not measured on this row).")
            holding(t, label)
            assert verdict(t, name) == "not judged: the link is not measured on this row."
    lead = paper_claims_text(table).splitlines()[0]
    judged, stand = [], []
    for name, (link, _) in PAPER_CLAIMS.items():  # the committed verdicts at every seed, recomputed
        per = []
        for label in [f"bf16_{name}", *(f"bf16_{name}_s{s}" for s in STABILISER_SEEDS)]:
            if label not in table.index:
                continue
            r = table.loc[label]
            holds = not r["exploded"] and r["runaway step"] is None and abs(r["eval loss − twin"]) <= LOSS_MATCH
            if link == "ties":
                broken = r["ties ÷ bf16"] <= TIES_KEPT
            else:
                sim = r["rank-1 similarity"]
                broken = None if sim is None else sim <= reference(table, label)
            per.append(None if holds and broken is None else bool(holds and broken))
        decided = {x for x in per if x is not None}
        judged += [name] if decided else []
        stand += [name] if decided == {True} else []
    assert lead.startswith(f"**{len(stand)} of the paper's {len(judged)} explanations measured here fit")
    assert lead.endswith(".**")


def test_stabiliser_styles_pair_twins_and_never_repeat():
    """Page 17's figure (lpfa.pages.stabilisers.stabiliser_styles, plot_stabilisers): a stabiliser and its FP32 twin
    share a colour and differ in dash, no two labels of a column share both, also past the palette; the FP32-level runs
    are the dashed ones (every layer "fp32" in lpfa.run.layer_precision on the committed configs); one line per label
    and panel."""
    import matplotlib.pyplot as plt

    from lpfa.pages.stabilisers import STABILISER_COLORS, plot_stabilisers, stabiliser_styles
    from lpfa.run import Run, layer_precision

    names = [f"s{i}" for i in range(2 * len(STABILISER_COLORS) + 1)]
    labels = ["bf16_paper_recipe", "fp32_paper_recipe", "bf16_rerun",
              *(f"{m}_{n}" for n in names for m in ("bf16", "fp32"))]
    fp32 = {label for label in labels if label.startswith("fp32_")}
    st = stabiliser_styles(labels, fp32)
    assert len(set(map(repr, st.values()))) == len(labels)
    for n in names:
        assert st[f"bf16_{n}"][0] == st[f"fp32_{n}"][0] and st[f"bf16_{n}"][1] != st[f"fp32_{n}"][1]
    assert st["bf16_s0"][1] == "-" and st["fp32_s0"][1] == "--"
    rows = {**results.experiment_rows("paper_recipe"), **results.experiment_rows("stabilisers")}
    precision = {label: set(layer_precision(Run(rows[label]))) for label in
                 ("fp32_paper_recipe", "fp32_gated", "bf16_gated", "fp32_outlier_heads_paper_recipe")}
    assert precision["fp32_paper_recipe"] == precision["fp32_gated"] == {"fp32"}  # sdpa_fp32; lpfa fp32_split
    assert precision["bf16_gated"] == {"bf16"} and "fp32" not in precision["fp32_outlier_heads_paper_recipe"]
    groups = {"a": ["bf16_paper_recipe", "fp32_outlier_heads_paper_recipe"],
              "b": ["bf16_paper_recipe", "bf16_gated", "fp32_gated"]}
    fig = plot_stabilisers(rows, 1, groups)
    assert fig.axes[0].get_yscale() == "log" and len(fig.axes) == 6
    for ax, col in zip(fig.axes, [0, 1] * 3):
        lines = {ln.get_label(): ln for ln in ax.get_lines()}
        assert list(lines) == list(groups["ab"[col]])
    dashed = {ln.get_label(): ln.get_linestyle() for ln in fig.axes[1].get_lines()}
    assert dashed["fp32_gated"] == "--" and dashed["bf16_gated"] == "-"
    left = {ln.get_label(): ln.get_linestyle() for ln in fig.axes[0].get_lines()}
    assert left["fp32_outlier_heads_paper_recipe"] == "-"
    plt.close(fig)


def test_stabiliser_costs_read_the_committed_benchmark():
    """Page 17's speed cost (lpfa.pages.stabilisers.stabiliser_costs) is the committed benchmark's summary.json: each
    row's ratio is its tokens/s over its speed base's of the same run, every BF16 stabiliser row of STABILISERS was
    timed, and the sentence quotes the slowest row and the row measured furthest above its base (the noise)."""
    import json

    from lpfa.experiments import BASES, STABILISERS, stabiliser_seed
    from lpfa.pages.stabilisers import stabiliser_cost_text, stabiliser_costs, stabiliser_table, untimed_stabilisers

    costs = stabiliser_costs()
    raw = {}  # each row from the latest run that timed it
    for folder in results.runs("stabiliser_cost"):
        summary = json.loads((folder / "summary.json").read_text())
        raw.update({label: {**r, "run": folder.name, "base": summary.get(r["speed_base"])}
                    for label, r in summary.items() if r.get("tokens_per_s") is not None or label not in raw})
    assert set(costs.index) == set(raw)
    for label, r in costs.iterrows():
        assert r["run"] == raw[label]["run"] and r["tokens/s"] == raw[label]["tokens_per_s"]
        if isinstance(r["speed base"], str):  # its base of the same run
            assert r["÷ base"] == pytest.approx(r["tokens/s"] / raw[label]["base"]["tokens_per_s"], rel=1e-12)
    # every row is timed, or named as not timed (another seed costs what its row costs: not timed again)
    untimed = {label for label in STABILISERS if label not in BASES and stabiliser_seed(label)[1] is None} - set(
        costs.index)
    text = stabiliser_cost_text(costs)
    assert set(untimed_stabilisers(costs)) == untimed
    assert all(f"`{label}`" in text.split("Not timed:")[-1] for label in untimed) and ("Not timed" in text) == bool(
        untimed)
    clipped = [r.get("qk_clipped") for r in raw.values() if r.get("qk_clipped") is not None]
    assert clipped and ("QK-clip rescaled no head" in text) == (sum(clipped) == 0)
    rows = costs.loc[[label for label in costs.index if label in STABILISERS and label not in BASES]]
    slowest = rows["÷ base"].astype(float).idxmin()
    assert f"`{slowest}` ×{costs.loc[slowest, '÷ base']:.2f}" in text
    same = costs[costs["base backend"].isna() | (costs["base backend"] == costs["backend"])]  # not two backends
    top = same["÷ base"].dropna().astype(float)
    if top.max() > 1:
        assert f"`{top.idxmax()}` measured ×{top.max():.3f} of its base" in text
    for label in costs.index[costs["base backend"].notna() & (costs["base backend"] != costs["backend"])]:
        if label in rows.index:  # a ratio of two attention backends is said to be one
            assert (f"`{label}` ×{costs.loc[label, '÷ base']:.2f} (its attention on {costs.loc[label, 'backend']}'s "
                    f"kernels, its base's on {costs.loc[label, 'base backend']}'s)") in text
    cap = costs.loc["bf16_softcap", "÷ base"]
    assert ("What bounds it is arithmetic per score" in text) == (cap < 0.9)
    if cap < 0.9:  # which forward was timed: capping every score of the row-max pass, or only each row's largest
        raw = costs.copy()
        raw["cap row max raw"] = raw["cap row max raw"].astype(object)
        raw.loc["bf16_softcap", "cap row max raw"] = True
        assert "in the forward's P̄ pass (its row-max pass" in stabiliser_cost_text(raw)
        assert ("the timing predates" in text) == (costs.loc["bf16_softcap", "cap row max raw"] is None)
    table, _, _ = stabiliser_table()
    assert costs.loc["bf16_paper_recipe", "speed base"] is None or costs["speed base"].isna()["bf16_paper_recipe"]
    assert table["speed ÷ base"].isna()["bf16_rerun"]  # the BF16 run again: the base of the ratios, none of its own
    assert table.loc["fp32_rerun", "speed ÷ base"] == costs.loc["fp32_paper_recipe", "÷ base"]
    assert table.loc["delta_dp_paper_recipe", "speed ÷ base"] is None  # the cuts were not timed


def test_stabiliser_cost_without_a_benchmark(tmp_path):
    from lpfa.pages.stabilisers import stabiliser_cost_text, stabiliser_costs

    costs = stabiliser_costs(root=tmp_path)
    assert costs.empty and list(costs.columns) == ["tokens/s", "speed base", "÷ base", "heads clipped", "run",
                                                   "backend", "base backend", "cap row max raw"]
    assert stabiliser_cost_text(costs).startswith("No speed benchmark of the stabilisers is committed yet")


def test_stabiliser_costs_take_each_row_from_the_latest_run_that_timed_it(tmp_path):
    """A later benchmark run of a few rows (the soft-cap after a kernel change, say) replaces those rows and keeps the
    others from the earlier run; a row the later run tried but could not time keeps its earlier timing."""
    from lpfa.pages.stabilisers import stabiliser_cost_text, stabiliser_costs

    def row(tps, base=None, ratio=None, *overrides):
        return {"tokens_per_s": tps, "speed_base": base, "ratio_to_base": ratio, "overrides": list(overrides)}

    for day, rows in (("01", {"bf16_paper_recipe": row(400.0), "bf16_softcap": row(300.0, "bf16_paper_recipe", 0.75),
                              "bf16_qknorm": row(390.0, "bf16_paper_recipe", 0.975),
                              "fp32_paper_recipe": row(300.0, "bf16_paper_recipe", 0.75, "attn_policy=fp32_split")}),
                      ("02", {"bf16_paper_recipe": row(380.0), "bf16_softcap": row(361.0, "bf16_paper_recipe", 0.95),
                              "bf16_qknorm": row(None, "bf16_paper_recipe"),
                              "fp32_paper_recipe": row(190.0, "bf16_paper_recipe", 0.5, "attn_backend=sdpa_fp32"),
                              "fp32_softcap": row(228.0, "fp32_paper_recipe", 1.2)})):
        folder = tmp_path / "stabiliser_cost" / f"h200-2026-01-{day}"
        folder.mkdir(parents=True)
        (folder / "provenance.json").write_text(json.dumps({"date_utc": f"2026-01-{day}T00:00:00+00:00"}))
        (folder / "summary.json").write_text(json.dumps(rows))
    costs = stabiliser_costs(root=tmp_path)
    assert list(costs.index) == ["bf16_paper_recipe", "bf16_softcap", "bf16_qknorm", "fp32_paper_recipe",
                                 "fp32_softcap"]
    assert costs["tokens/s"].tolist() == [380.0, 361.0, 390.0, 190.0, 228.0]
    assert costs["÷ base"].tolist()[1:] == [0.95, 0.975, 0.5, 1.2]
    assert costs["run"].tolist() == ["h200-2026-01-02", "h200-2026-01-02", "h200-2026-01-01", "h200-2026-01-02",
                                     "h200-2026-01-02"]
    # each row's attention backend and its base's in the same run: the soft-cap's FP32 twin ran on lpfa's kernels,
    # its base on SDPA's, so its ratio is not noise over a base
    assert costs["backend"].tolist() == ["lpfa", "lpfa", "lpfa", "sdpa_fp32", "lpfa"]
    assert costs["base backend"].isna()["bf16_paper_recipe"]  # no base
    assert costs["base backend"].tolist()[1:] == ["lpfa", "lpfa", "lpfa", "sdpa_fp32"]
    text = stabiliser_cost_text(costs)
    assert "`fp32_softcap` ×1.20 (its attention on lpfa's kernels, its base's on sdpa_fp32's)" in text
    assert "measured ×" not in text  # no row of one backend measured above its base
    assert "The soft-cap costs" not in text  # 5 %: within its goal
    assert ("The rows come from `h200-2026-01-02` (`bf16_paper_recipe`, `bf16_softcap`, `fp32_paper_recipe`, "
            "`fp32_softcap`) and `h200-2026-01-01` (`bf16_qknorm`), each divided by its base of the same run.") in text


def test_stabiliser_plan_times_rows_alone_and_says_whether_sharing_gains(tmp_path):
    """On a made-up results root: each row's minutes are its steps at its speed alone (no launch of a run alone, so
    no overhead), a row the benchmark did not time is named, a second seed takes its row's speed, and the lead says
    whether two runs sharing the H200 trained faster together, each side over the same steps."""
    from lpfa.pages import RERUN_PAGE
    from lpfa.pages.stabilisers import alone_overhead, stabiliser_plan, stabiliser_speeds

    tokens = 6000 * 24 * 1024
    alone = {"bf16_paper_recipe": 300_000.0, "fp32_paper_recipe": 200_000.0, "bf16_softcap": 250_000.0,
             "bf16_qknorm": 280_000.0}

    def plan(walls):
        root = _stabiliser_root(tmp_path / str(len(list(tmp_path.iterdir()))), walls)
        folder = root / "stabiliser_cost" / "h200-2026-01-03"
        folder.mkdir(parents=True)
        (folder / "provenance.json").write_text(json.dumps({"date_utc": "2026-01-03T00:00:00+00:00"}))
        (folder / "summary.json").write_text(json.dumps({k: {"tokens_per_s": v, "speed_base": None,
                                                             "ratio_to_base": None} for k, v in alone.items()}))
        assert alone_overhead(root) is None
        return stabiliser_plan(["bf16_softcap", "bf16_qknorm_s1", "fp32_softcap"], root=root)

    slow = plan({"bf16_gated": tokens / 140_000, "fp32_gated": tokens / 90_000})  # 2 × 140k < 300k; 2 × 90k < 200k
    assert slow.startswith("Runs sharing an H200 (2 at a time) trained no faster together than one alone, each "
                           "counted over 6,000 steps with compilation and evaluations (BF16, compiled: 2 × 140,000 "
                           "tokens/s (`bf16_gated`) against 300,000 for `bf16_paper_recipe` alone; FP32, compiled: "
                           "2 × 90,000")
    assert f"`bf16_softcap` {tokens / 250_000 / 60:.1f} min, `bf16_qknorm_s1` {tokens / 280_000 / 60:.1f} min" in slow
    assert f": {(tokens / 250_000 + tokens / 280_000) / 60:.0f} GPU-minutes in all; `fp32_softcap` not timed" in slow
    assert slow.endswith(f"({RERUN_PAGE} gives the commands).")
    fast = plan({"bf16_gated": tokens / 180_000, "fp32_gated": tokens / 90_000})  # 360k: 20% over one alone
    assert fast.startswith("Runs sharing an H200 (2 at a time) trained up to 20% faster together than one alone")
    # three runs sharing an H100, later: another GPU's speeds, left out of the H200's sentence
    h200 = tmp_path / "0" / "stabilisers" / "h200-2026-01-02"  # the first plan's root: 140k and 90k
    h100 = h200.with_name("h100-2026-01-04")
    shutil.copytree(h200, h100)
    shutil.copytree(h100 / "bf16_gated", h100 / "bf16_qknorm")
    (h100 / "provenance.json").write_text(json.dumps({"date_utc": "2026-01-04T00:00:00+00:00",
                                                      "device": "NVIDIA H100 80GB HBM3"}))
    assert stabiliser_speeds(h200.parent.parent) == ({"BF16, compiled": (140_000.0, "bf16_gated"),
                                                      "FP32, compiled": (90_000.0, "fp32_gated")}, 2)
    assert stabiliser_plan(["bf16_qkclip"], root=tmp_path / "nothing") == ""


def test_scorecard_judges_the_discussion_and_the_production_kernels(tmp_path):
    """The intro's two rows from the stabilisers: the paper's Discussion judged as page 17 judges it (the same sentence,
    a verdict from its counts) and the production kernels' tied-row δ error from page 16's audit (shown only when one
    has paper's sign with an interval excluding 0); with nothing committed both say "not run"."""
    from lpfa.audit import PRODUCTION, at_largest_T, ci_text, excludes_zero, load_audit, result
    from lpfa.pages.intro import _discussion_row, _kernel_row, scorecard, styled
    from lpfa.pages.stabilisers import paper_claims, paper_claims_lead, seed_evidence, stabiliser_table

    card = scorecard().set_index("page")
    table = stabiliser_table()[0]
    judged = [c for c in paper_claims(table) if c["judged"]]
    row = card.loc["17_stabilisers"]
    labels = [label for c in judged for label in c["labels"]]
    evidence = seed_evidence(table, labels)
    assert row["our result"] == paper_claims_lead(judged, evidence)
    seeds = sorted({int(table.loc[label, "seed"]) for label in labels})
    assert f"(one run each, at seed{'s' if len(seeds) > 1 else ''} {', '.join(map(str, seeds))})" in row["our result"]
    stand = sum(bool(c["stands"]) for c in judged)
    assert row["verdict"] == ("reproduced" if stand == len(judged) == 3 else "partly" if stand else "not reproduced")
    full, _, folder = load_audit()
    ran = at_largest_T(full)
    ran = ran[ran.unavailable.isna()]
    paper = result(ran, "ref:paper", "ties", "delta")
    carry = [k for k in PRODUCTION if k in set(ran.kernel) and excludes_zero(r := result(ran, k, "ties", "delta"))
             and r["mean"] * paper["mean"] > 0]
    row = card.loc["16_kernel_bias"]
    assert ci_text(paper) in row["our result"] and folder.name in row["our result"]
    assert row["verdict"] == ("shown" if carry else "not shown")
    empty = tmp_path / "empty"
    (empty / "paper_recipe").mkdir(parents=True)
    assert _kernel_row(empty)["verdict"] == "not run" and _discussion_row(1, empty)["verdict"] == "not run"
    html = styled(scorecard()).to_html()
    assert "`" not in html and "<code>paper</code>" in html


def test_what_drops_the_tracker_label_and_keeps_the_rest():
    """A page shows a run's provenance "what" without the tracker label the older records begin with and without the
    sentences about the sessions that made it, for every committed record, and leaves the science in it."""
    import json

    from lpfa.paths import results_dir
    from lpfa.results import what

    for f in sorted(results_dir().glob("*/*/provenance.json")):
        w = json.loads(f.read_text()).get("what", "")
        shown = what({"what": w})
        assert not re.match(r"(?i)issues? \d", shown), (f, shown[:60])
        assert "session" not in shown, (f, shown)
        if "session" not in w:
            assert w.endswith(shown) and len(shown) >= len(w) - 40, (f, shown[:60])
    assert what({"what": "A run. It ran alone (the session's device time ran out). The loss exploded at 5.1k."}) == (
        "A run. The loss exploded at 5.1k.")
    assert what({"what": "issue 16, section 2: the recipe"}) == "the recipe"
    assert what({"what": "issue 5/6 twin runs"}) == "twin runs"
    assert what({"what": "the issue slots stay busy"}) == "the issue slots stay busy"
    assert what({}) == ""


def test_stabiliser_verdicts_at_a_second_seed_agree_or_say_seed_dependent():
    """Page 17 with a row at a second seed (lpfa.experiments.STABILISER_SEEDS), from edited copies of the committed
    table: when the seeds agree, the claim's verdict says on how many seeds; when one seed holds and the other fails,
    the claim, its lead, the finding and the scorecard's count call it seed-dependent, and no explanation stands on it;
    a second seed that holds with its link unmeasured leaves the claim to the seed that decides it; the evidence names
    both seeds."""
    from lpfa.pages.stabilisers import (
        paper_claims,
        paper_claims_lead,
        paper_claims_text,
        seed_evidence,
        stabiliser_finding,
        stabiliser_table,
        unmeasured_text,
    )

    table, _, _ = stabiliser_table(layer=1)
    table = table.drop(index=[label for label in table.index if label.startswith("bf16_qknorm_s")])  # edited below
    assert table.loc["bf16_qknorm", "seed"] == 1337 and not table.loc["bf16_qknorm", "exploded"]
    same = table.loc[["bf16_qknorm"]].rename(index={"bf16_qknorm": "bf16_qknorm_s1"}).assign(seed=1)
    agree = pd.concat([table, same])
    text = paper_claims_text(agree)
    item = next(line for line in text.splitlines() if "`bf16_qknorm_s1`" in line)
    assert "`bf16_qknorm` (" in item and "(at 2 seeds)." in item and "seed-dependent" not in text
    assert "(one run each, at seeds 1, 1337)" in text.splitlines()[0]

    failed = same.assign(exploded=True, **{"explosion step": 4000})
    mixed = pd.concat([table, failed])
    claims = {c["label"]: c for c in paper_claims(mixed)}
    qk = claims["bf16_qknorm"]
    assert qk["seed_dependent"] and qk["labels"] == ["bf16_qknorm", "bf16_qknorm_s1"] and not qk["holds"]
    assert "Verdict: **seed-dependent**: at seed 1337, consistent with the claim" in qk["item"]
    assert "at seed 1, **against the claim**: the row breaks the link, yet its loss exploded (step 4,000)" in qk["item"]
    lead = paper_claims_lead(list(claims.values()), seed_evidence(mixed, ["bf16_qknorm", "bf16_qknorm_s1"]))
    assert "QK-norm: seed-dependent (seed 1337: " in lead and lead.startswith("0 of the paper's 3")
    finding = stabiliser_finding(mixed)
    assert "seed-dependent: `bf16_qknorm` meets it at seed 1337 and not at seed 1" in finding
    assert "`bf16_qknorm_s1`: its loss exploded (step 4,000)" in finding and "at seeds 1, 1337" in finding

    unmeasured = pd.concat([table, same.assign(**{"rank-1 similarity": None})])
    qk = {c["label"]: c for c in paper_claims(unmeasured)}["bf16_qknorm"]
    assert qk["judged"] and qk["stands"] and not qk["seed_dependent"]
    assert qk["item"].endswith("Verdict: at seed 1337, consistent with the claim: the row breaks the link, and neither "
                               "its loss exploded nor its logits ran away; at seed 1, not judged: the link is not "
                               "measured on this row.")
    assert "QK-norm: seed 1337: breaks the link (" in paper_claims_lead([qk]) and "seed 1: the link not measured" in (
        paper_claims_lead([qk]))
    # the row that leaves its claim unjudged is named with what measures it; a failed row decides without the link
    assert unmeasured_text(unmeasured).startswith("**Committed without the link their claim needs:** "
                                                  "`bf16_qknorm_s1` held but carries no doctor report")
    assert "bf16_qknorm_s1" not in unmeasured_text(pd.concat([table, failed.assign(**{"rank-1 similarity": None})]))
