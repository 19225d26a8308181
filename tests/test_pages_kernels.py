"""Page 12's tables and sentences (lpfa.pages.kernels) against the committed benchmark files, recomputed here."""

import csv
import io
import json

import matplotlib
import pytest
import torch

from lpfa import results
from lpfa.attention import PRESETS
from lpfa.pages import kernels as kn

matplotlib.use("Agg")


def test_presets_table_lists_every_rounding_point_of_every_preset():
    t = kn.presets_table()
    assert list(t.index) == list(PRESETS)
    for name, p in PRESETS.items():
        for field in kn.POLICY_FIELDS:
            assert t.loc[name, field] == getattr(p, field)
        assert t.loc[name, "blocks (q × k)"] == ("one block" if p.block_q is None else f"{p.block_q} × {p.block_k}")
        assert (t.loc[name, "SFA"] == "—") == (p.sfa is None)


def test_accuracy_table_fp32_is_far_closer_to_float64_than_bf16():
    t = kn.accuracy_table(T=8, seed=1)
    assert list(t.index) == list(PRESETS) and list(t.columns) == ["O", "dq", "dk", "dv"]
    assert (t >= 0).all().all() and t.notna().all().all()
    # the inputs are BF16 values; an FP32 path errs at FP32 level, one that rounds P̄ to BF16 (Eq. 2) at BF16 level
    assert t.loc["fp32", "O"] < 1e-5 < t.loc["fa2", "O"] < 0.1


@pytest.mark.parametrize("kwargs, match", [({"T": 0}, "T=0: expected an integer >= 1"),
                                           ({"seed": -1}, "seed=-1: expected an integer >= 0")])
def test_accuracy_table_rejects_bad_input(kwargs, match):
    with pytest.raises(ValueError, match=match):
        kn.accuracy_table(**kwargs)


def test_rerun_benchmark_needs_a_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(RuntimeError, match="rerun=True needs a CUDA GPU"):
        kn.rerun_benchmark()


def test_bench_file_names_a_missing_run():
    with pytest.raises(FileNotFoundError, match="no run 'nope'"):
        kn.bench_file("bench.json", "nope")


def test_provenance_notes_name_the_latest_complete_run_and_its_commit():
    complete = [r for r in results.runs(kn.EXPERIMENT) if (r / "bench.json").is_file()
                and json.loads((r / "bench.json").read_text()).get("complete", True)]
    latest = complete[-1]
    prov = json.loads((latest / "provenance.json").read_text())
    notes = kn.provenance_notes()
    assert notes["bench_run"] == f"`{latest.name}`" and f"commit `{prov['git_commit']}`" in notes["bench_env"]
    assert notes["bench_command"] == f"`{prov['command']}`"


def _row(tflops, graph):
    return {"fwd_tflops": tflops, "bwd_tflops": tflops, "fwd_bwd_tflops": tflops, "graph_fwd_bwd_tflops": graph}


@pytest.fixture
def store(tmp_path, monkeypatch):
    """A results store with an attention benchmark whose newest run was cut after three speed rows."""
    monkeypatch.setattr(results, "results_dir", lambda: tmp_path)
    exp = tmp_path / kn.EXPERIMENT
    runs = {"h200-2026-01-01": ({"rows": {"sdpa_flash": _row(100.0, 120.0)}, "complete": True}, "2026-01-01"),
            "h100-2026-02-01": ({"rows": {"sdpa_flash": _row(100.0, 160.0), "fa2": _row(50.0, 120.0),
                                          "fa2:finite": _row(90.0, 200.0)}, "complete": False}, "2026-02-01")}
    for name, (bench, date) in runs.items():
        (exp / name).mkdir(parents=True)
        (exp / name / "bench.json").write_text(json.dumps(bench))
        (exp / name / "provenance.json").write_text(json.dumps(
            {"date_utc": date, "device": f"GPU {name[:4]}", "git_commit": "abcdef0123-dirty", "torch": "t",
             "triton": "tr", "command": "c"}))
    (exp / "h200-2026-01-01" / "memory.json").write_text("{}")
    return exp


def test_the_speed_table_skips_a_run_cut_by_its_time_limit(store):
    """A bench.json with complete false lacks rows the page's ratios need: the page keeps the latest complete run's
    table and provenance, names the cut run apart, and still reads a named run as it is."""
    assert kn.bench_run_of("bench.json") == store / "h200-2026-01-01"
    assert kn.bench_file("bench.json")["complete"] is True
    assert kn.provenance_notes()["bench_run"] == "`h200-2026-01-01`"
    assert kn.bench_file("bench.json", "h100-2026-02-01")["complete"] is False
    # a part the named run did not measure comes from the latest run that did
    assert kn.bench_run_of("memory.json", "h100-2026-02-01") == store / "h200-2026-01-01"
    assert kn.partial_runs() == [store / "h100-2026-02-01"]
    assert kn.partial_runs("h100-2026-02-01") == []
    with pytest.raises(ValueError, match=r"^run='h100-2026-02-01': its speed table was cut by its time limit .*"
                                         r"e\.g\. 'h200-2026-01-01', or None for the latest$"):
        kn.load_page("h100-2026-02-01")


def test_partial_speed_text_gives_the_cut_runs_gpu_time_ratios(store):
    text = kn.partial_speed_text(kn.partial_runs())
    # by GPU time (the CUDA-graph columns): fa2 120/160, fa2:finite 200/160; paper was not timed, so not named
    assert text.startswith("A later run, `h100-2026-02-01` (GPU h100, commit `abcdef0`), was cut by its time limit "
                           "after 3 rows of the speed table;")
    assert "0.75× for `fa2` of SDPA-flash's speed" in text and "paper" not in text
    assert "checks off (as the trainer calls the kernels) at 1.25× for `fa2:finite`" in text
    assert kn.partial_speed_text([]) == ""


def test_check_table_holds_each_tensor_of_each_preset():
    check = kn.bench_file("check.json")
    t = kn.check_table(check)
    assert list(t.index) == list(check["presets"])
    for name, r in check["presets"].items():
        for tensor, v in r.items():
            assert t.loc[name, f"{tensor} same"] == v["bit_identical"]
            assert t.loc[name, f"{tensor} max"] == v["max_rel_to_max"]


def test_speed_notes_recompute_the_ratios_and_sfa_cost():
    bench = kn.bench_file("bench.json")
    rows = bench["rows"]
    notes = kn.speed_notes(bench)
    fa2 = round(rows["fa2"]["fwd_bwd_tflops"] / rows["sdpa_flash"]["fwd_bwd_tflops"], 3)
    assert notes["fa2_ratio"] == f"**{fa2:.2f}×**"
    assert notes["fa2_target"] == f"target ≥ 1×: {'met' if fa2 >= 1 else 'not met'}"
    fb = {n: round(r["fwd_bwd_tflops"], 3) for n, r in rows.items()}
    assert notes["paper_ref_ratio"] == f"**{fb['paper'] / fb['reference_paper']:.1f}×**"
    cost = {k: 1 - fb[f"{k}_sfa"] / fb[k] for k in ("fa2", "paper")}
    assert notes["sfa_cost_paper"] == f"{100 * cost['paper']:+.1f}%"
    assert notes["sfa_target"].endswith("not met" if max(cost.values()) > 0.05 else ": met")
    assert notes["goals_text"] == "`fa2` ≥ 1×, `paper` ≥ 0.8×"
    assert kn.plot_speed(bench).axes[0].get_xlabel().startswith("forward + backward TFLOP/s")


def test_memory_notes_recompute_the_growth_from_the_shortest_to_the_longest_T():
    memory = kn.bench_file("memory.json")
    rows = [r for r in memory["rows"].values() if "peak_mib" in r]
    Ts = sorted({r["T"] for r in rows})
    peak = {(r["name"], r["T"]): r["peak_mib"] for r in rows}
    notes = kn.memory_notes(memory)
    assert notes["mem_run"] == f"`{results.file_run(kn.EXPERIMENT, 'memory.json').name}`"
    assert (notes["mem_T_min"], notes["mem_T_max"]) == (str(Ts[0]), str(Ts[-1]))
    assert notes["mem_growth_fa2"] == f"{peak[('fa2', Ts[-1])] / peak[('fa2', Ts[0])]:.1f}"
    no_fp32 = {"rows": {k: r for k, r in memory["rows"].items() if r.get("name") != "fp32"}}
    with pytest.raises(ValueError, match=r"memory rows \['fp32'\]: missing"):
        kn.memory_notes(no_fp32)


def test_overhead_notes_name_the_run_that_measured_the_overhead():
    data = kn.bench_file("overhead.json")
    notes = kn.overhead_notes(kn.overhead_table(data))
    assert notes["ovh_run"] == f"`{results.file_run(kn.EXPERIMENT, 'overhead.json').name}`"
    fa2 = data["rows"]["fa2/fwd_bwd"]
    assert notes["ovh_fa2"].startswith(f"one `fa2` forward and backward takes {fa2['host_us']:,.0f} µs")
    sdpa = data["rows"]["sdpa_flash/fwd_bwd"]["gpu_us"]
    assert notes["ovh_gpu_ratio"].startswith(f"{sdpa / fa2['gpu_us']:.2f}× for `fa2`")


def test_short_sfa_spread_ranges_over_every_shapes_run(tmp_path):
    """The T = 1,024 SFA cell, per SFA preset, as its range over the runs that hold shapes.json (runs without one and
    other shapes left out); "" where no run times it."""
    def run(name, date, fa2, paper=None):
        d = tmp_path / "attention_benchmark" / name
        d.mkdir(parents=True)
        (d / "provenance.json").write_text(json.dumps({"date_utc": date}))
        if fa2 is None:
            return
        rows = [{"T": 1024, "D": 64, "impl": "fa2_sfa", "sfa_overhead": {"fwd_bwd": fa2}},
                {"T": 4096, "D": 64, "impl": "fa2_sfa", "sfa_overhead": {"fwd_bwd": 0.9}},
                {"T": 1024, "D": 64, "impl": "fa2", "sfa_overhead": None}]
        if paper is not None:
            rows.append({"T": 1024, "D": 64, "impl": "paper_sfa", "sfa_overhead": {"fwd_bwd": paper}})
        (d / "shapes.json").write_text(json.dumps({"rows": rows}))

    run("h100-2026-01-01", "2026-01-01T00:00:00+00:00", None)
    assert kn.short_sfa_spread(tmp_path) == ""
    run("h100-2026-01-02", "2026-01-02T00:00:00+00:00", 0.22, 0.01)
    run("h200-2026-01-03", "2026-01-03T00:00:00+00:00", -0.2, -0.05)
    assert kn.short_sfa_spread(tmp_path) == ("over the 2 committed shapes runs it ranged from -20% to +22% for "
                                             "`fa2_sfa` and -5% to +1% for `paper_sfa`")


def test_shapes_notes_state_each_goal_shape_by_shape():
    shapes = kn.bench_file("shapes.json")
    notes = kn.shapes_notes(shapes)
    for impl in ("fa2", "paper"):
        rows = [r for r in shapes["rows"] if r["impl"] == impl]
        met = [r for r in rows if r["ratio_to_sdpa_flash"] >= kn.TARGETS[impl]]
        assert f"`{impl}` (≥ {kn.TARGETS[impl]:g}×) meets its goal at {len(met)} of {len(rows)} shapes" in \
            notes["shape_goals"]
    assert notes["shape_long"].startswith("at T = 4,096 `fa2` runs at ")
    measured = [d for d in results.runs("attention_benchmark") if (d / "shapes.json").is_file()][-1]
    prov = json.loads((measured / "provenance.json").read_text())
    assert notes["shape_run"] == f"run `{measured.name}` on one {prov['device'].split('NVIDIA ')[1].split()[0]}, " \
        f"commit `{prov['git_commit'][:7]}`"


def test_host_runs_are_every_committed_host_overhead_run():
    runs = kn.host_runs()
    assert list(runs) == [f.name for f in results.runs("host_overhead")]
    assert all("host_us" in r for r in runs.values())


def test_ncu_notes_recount_the_kernels_and_the_big_ones_use_of_the_tensor_pipe():
    ncu, folder = kn.load_ncu()
    holding = [f for f in results.runs("attention_ncu")
               if set(kn.NCU_TARGETS) <= set(json.loads((f / "provenance.json").read_text())["config"]["targets"])]
    assert folder == holding[-1] and set(ncu) >= set(kn.NCU_TARGETS)
    table = kn.ncu_table(ncu)
    notes = kn.ncu_notes(ncu, table, folder)
    text = (folder / "fa2.csv").read_text()
    kept = "\n".join(ln for ln in text.splitlines() if ln.strip() and not ln.startswith("=="))
    rows = list(csv.reader(io.StringIO(kept)))
    assert notes["ncu_launches"] == str(len(rows) - 2)  # the header and the units row
    big = [m for kernels in ncu.values() for m in kernels.values() if m["duration_us"] >= kn.NCU_BIG_US]
    assert notes["ncu_tensor"] == f"{max(round(m['tensor_pct'], 2) for m in big):.0f}%"
    assert (notes["ncu_min_us"], notes["ncu_big_us"], notes["ncu_bound_pct"]) == ("5 µs", "100 µs", "60%")
    assert list(table[kn.NCU_SHOWN].columns) == kn.NCU_SHOWN
    config = json.loads((folder / "provenance.json").read_text())["config"]
    assert f"T = {config['T']:,}" in notes["ncu_shape"] and f"D = {config['D']}" in notes["ncu_shape"]
    assert notes["ncu_shape"].startswith("GPT-2 shapes") == ([config[k] for k in "BHTD"] == [16, 12, 1024, 64])
    assert notes["ncu_targets"].count("`") == 2 * sum(t != "sdpa_flash" for t in config["targets"])
    # the passes said to execute more instructions than SDPA-flash's: exactly those with a ratio above 1
    ratios = kn.ncu_passes(table)["M instructions × sdpa_flash"].drop("sdpa_flash", level="target")
    for (target, p), r in ratios.items():
        assert (f"`{target}`'s {p} ({r:.2f}×)" in notes["ncu_more"]) == (r > 1), (target, p, r)


def test_ncu_sfa_text_recomputes_the_forward_cost_from_the_latest_run_per_shape():
    latest = {}
    for f in results.runs("attention_ncu"):
        config = json.loads((f / "provenance.json").read_text())["config"]
        if "fa2_sfa" in config["targets"] and "fa2" in config["targets"]:
            latest[config["T"], config["D"]] = f
    text = kn.ncu_sfa_text()
    assert latest and text.count("(run `") == len(latest)
    for (T, D), f in latest.items():
        ncu = json.loads((f / "ncu.json").read_text())
        fwd = {t: sum(m["duration_us"] for k, m in ncu[t].items()  # the page's table: kernels of NCU_MIN_US or more
                      if k.startswith("_flash_fwd") and m["duration_us"] >= kn.NCU_MIN_US) for t in ("fa2", "fa2_sfa")}
        more = fwd["fa2_sfa"] / fwd["fa2"] - 1
        assert f"at T = {T:,}, D = {D} (run `{f.name}`) `fa2_sfa`'s forward takes {more:+.0%}" in text


def test_ncu_sfa_text_is_empty_without_an_sfa_preset_and_its_base(tmp_path):
    run = tmp_path / "attention_ncu" / "h100-2026-01-01"
    run.mkdir(parents=True)
    (run / "provenance.json").write_text(json.dumps(
        {"config": {"B": 1, "H": 1, "T": 64, "D": 64, "targets": ["sdpa_flash", "fa2_sfa"]}, "date_utc": "x"}))
    assert kn.ncu_sfa_text(tmp_path) == ""
    with pytest.raises(FileNotFoundError, match="profiles all of sdpa_flash, fa2, paper"):
        kn.load_ncu(tmp_path)


def test_redo_text_counts_second_launches_too_short_for_the_table():
    """The second launches (``name#2``) that only read flags take a few µs each, below the per-kernel table's
    threshold: the text still sums them, from every kernel of the run."""
    ncu = {"fa2": {"_flash_fwd_kernel": {"duration_us": 130.0}, "_flash_fwd_kernel#2": {"duration_us": 3.5},
                   "_bwd_dq_kernel": {"duration_us": 140.0}, "_bwd_dq_kernel#2": {"duration_us": 3.0}},
           "sdpa_flash": {"flash_fwd_kernel": {"duration_us": 135.0}}}
    assert kn.redo_text(ncu) == ("in `fa2`'s forward and backward the 2 second launches take 6 µs of 276 µs (2%), "
                                 "though no tile is redone on finite inputs")
    assert kn.redo_text(ncu, "sdpa_flash") == "" and kn.redo_text(ncu, "paper") == ""
    assert kn.redo_text({"fa2": {"k": {"duration_us": 9.0}, "k#2": {"duration_us": 1.0}}}).startswith(
        "in `fa2`'s forward and backward the second launch takes 1 µs of 10 µs (10%)")


def test_sfa_overhead_notes_recompute_the_range_and_say_how_to_run_it():
    table, folder = kn.sfa_overhead()
    assert folder == results.runs("sfa_overhead")[-1]
    rows = json.loads((folder / "sfa_overhead.json").read_text())["rows"]
    now = [r["over_base"] for r in rows if r["variant"] in ("paper_sfa", "fa2_sfa")]
    notes = kn.sfa_overhead_notes(table, folder)
    assert notes["sfa_now"] == f"{min(now):+.0%} to {max(now):+.0%}" and notes["p12_note1"] == ""
    assert notes["sfa_goal"].endswith("not met" if max(now) > 0.05 else " met")
    empty = kn.sfa_overhead_notes(None, None)
    assert set(empty) == {*kn.SFA_NOTES, "p12_note1"} and empty["sfa_now"] == "–"
    assert "benchmarks/sfa_overhead.py" in empty["p12_note1"]


def test_sfa_tiles_text_names_the_presets_whose_block_spans_several_tiles():
    """The sentence on where the row-max tie test saves anything follows the tiles each run recorded: `paper_sfa`'s
    512-key blocks span 64-key tiles at every D, `fa2_sfa`'s 128-key block is one tile at D = 64 and (with the D = 128
    table's 128-key tiles) at D = 128 too; a run whose D = 128 row split it says so; a run without the record says
    that it predates it."""
    def row(preset, D, tile, tiles, variant=None):
        return {"preset": preset, "variant": variant or preset, "D": D, "key_tile": tile, "tiles_per_block": tiles}
    rows = [row("paper", 64, 64, 8), row("paper_sfa", 64, 64, 8), row("paper_sfa", 64, 64, 8, "paper_sfa count pass"),
            row("fa2_sfa", 64, 128, 1), row("paper_sfa", 128, 64, 8), row("fa2_sfa", 128, 128, 1)]
    lead = "where a policy block spans several compute tiles: "
    one = "holds the block in one tile, where the count was already a pass over registers"
    assert kn.sfa_tiles_text(rows) == f"{lead}`paper_sfa`'s 512-key blocks in 64-key tiles; `fa2_sfa` {one}"
    rows[-1] = row("fa2_sfa", 128, 64, 2)
    assert kn.sfa_tiles_text(rows) == (f"{lead}`paper_sfa`'s 512-key blocks in 64-key tiles and `fa2_sfa`'s 128-key "
                                       f"blocks in 64-key tiles at D = 128; `fa2_sfa` at D = 64 {one}")
    old = [{k: v for k, v in r.items() if k not in ("key_tile", "tiles_per_block")} for r in rows]
    assert kn.sfa_tiles_text(old).endswith("(this run did not record its tiles)")


def test_tuning_notes_read_the_latest_sweep():
    best = kn.tuning_sweeps()
    sweeps = [d for d in results.runs("attention_tuning") if (d / "tune.json").is_file()
              and json.loads((d / "tune.json").read_text())["shape"] == kn.GPT2_SWEEP]  # other shapes: not this table
    assert list(dict.fromkeys(best.index.get_level_values("run"))) == [d.name for d in sweeps]
    tune = json.loads((sweeps[-1] / "tune.json").read_text())
    sdpa = next(r for r in tune["rows"] if r["impl"] == "sdpa_flash")
    fwd = max(r["tflops"] for r in tune["rows"] if r.get("impl") == "fa2" and r.get("pass") == "fwd" and "tflops" in r)
    notes = kn.tuning_notes(best)
    assert notes["sweep_run"] == f"`{sweeps[-1].name}`"
    assert notes["sweep_fa2"].startswith(f"{fwd / sdpa['fwd_tflops']:.2f}× forward")
    assert notes["sweep_vs_op"].startswith("The ")
    speed = [d for d in results.runs("attention_benchmark") if (d / "bench.json").is_file()
             and json.loads((d / "bench.json").read_text()).get("complete", True)][-1]  # the speed table's run
    assert f"(`{speed.name}`" in notes["sweep_vs_op"]


def _options_run(root, name, date, kernel, rows, device="NVIDIA H100 80GB HBM3"):
    folder = root / "kernel_options" / name
    folder.mkdir(parents=True)
    (folder / "provenance.json").write_text(json.dumps({"date_utc": date, "device": device}))
    (folder / f"{kernel}_options.json").write_text(json.dumps([
        {"preset": p, "B": b, "T": t, "D": 64, "option": o, "default_us": d, "option_us": u, "ratio": u / d,
         "same_bits": bits} for p, b, t, o, d, u, bits in rows]))


def test_kernel_choices_read_the_latest_run_that_timed_the_design(tmp_path):
    """The page's sentences on designs not taken recompute each ratio from the latest run that timed the design's
    option (an older run of it and a later run of another option do not count), say whether the bits stayed and
    whether it was slower at every shape, and say "not yet timed" where no run timed it."""
    assert kn.kernel_options_table(tmp_path).empty
    name, kernel, preset, option = kn.KERNEL_CHOICES[0][:4]
    other = "backward" if kernel == "forward" else "forward"
    _options_run(tmp_path, "h100-2026-01-01", "2026-01-01T00:00:00", kernel,
                 [(preset, 16, 1024, option, 100, 900, True)])
    _options_run(tmp_path, "h200-2026-01-02", "2026-01-02T00:00:00", kernel,
                 [(preset, 16, 1024, option, 400.0, 600.0, True), (preset, 1, 16384, option, 1000.0, 1234.0, False),
                  ("not-" + preset, 16, 1024, option, 100, 50, True)], device="1 x NVIDIA H200 (nvidia-h200)")
    _options_run(tmp_path, "h100-2026-01-03", "2026-01-03T00:00:00", other, [(preset, 16, 1024, option, 1, 7, True)])
    table = kn.kernel_options_table(tmp_path)
    assert len(table) == 5 and list(table["run"].unique()) == ["h100-2026-01-01", "h200-2026-01-02", "h100-2026-01-03"]
    notes = kn.kernel_choice_notes(table)
    assert set(notes) == {c[0] for c in kn.KERNEL_CHOICES}
    text = notes[name]
    assert "×1.50 (B × T = 16 × 1,024) and ×1.23 (1 × 16,384)" in text and "one H200" in text, text
    assert "other bits" in text and "`h200-2026-01-02`" in text and "×9.00" not in text and "×7.00" not in text
    assert "; so " in text  # slower at every shape
    for n, *_ in kn.KERNEL_CHOICES[1:]:
        assert "is not yet timed on a GPU" in notes[n], notes[n]
    _options_run(tmp_path, "h100-2026-01-04", "2026-01-04T00:00:00", kernel,
                 [(preset, 16, 1024, option, 100, 90, True)])
    assert "×0.90" in (faster := kn.kernel_choice_notes(kn.kernel_options_table(tmp_path))[name]) and \
        "faster at some shapes" in faster, faster


def test_committed_kernel_choices_are_measured():
    """Both designs the page says it measured and left are in the committed store, with their runs named."""
    notes = kn.kernel_choice_notes(kn.kernel_options_table())
    for name, *_ in kn.KERNEL_CHOICES:
        assert "not yet timed" not in notes[name] and "of the default's time on one H" in notes[name], notes[name]
