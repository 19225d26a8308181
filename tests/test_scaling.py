"""lpfa.scaling on synthetic run folders with known differences, and on the committed 1- vs 2-GPU run."""

import json

import matplotlib
import numpy as np
import pytest
from conftest import ROOT

from lpfa.pages.scale import agreement_table, plot_compare
from lpfa.scaling import compare_runs

matplotlib.use("Agg")

N, SKIP = 100, 60
R = 3e-5  # relative loss difference at step s: R * s, so it first exceeds 1e-3 at step 34


def tok_a(s):
    return 1.0 if s < SKIP else (5000.0 if s % 10 == 0 else 1000.0)  # median over s >= SKIP: 1000


def tok_b(s):
    return 1e9 if s < SKIP else (10.0 if s % 10 == 0 else 1800.0)  # median over s >= SKIP: 1800


def write_run(d, world, records, batch_size=32):
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"train": {"batch_size": batch_size, "grad_accum": 1},
                                               "world_size": world}))
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return d


@pytest.fixture
def pair(tmp_path):
    a = [{"step": s, "loss": 4.0, "lr": 1e-3, "grad_norm": 2.0, "step_s": 0.1, "tokens_per_s": tok_a(s)}
         for s in range(N)]
    b = [{"step": s, "loss": 4.0 * (1 + R * s), "lr": 1e-3, "grad_norm": 2.0 * (1 - (1e-4 if s % 2 == 0 else 3e-4)),
          "step_s": 0.1, "tokens_per_s": tok_b(s)} for s in range(N + 1)]  # one step more than a: not compared
    a[50:50] = [{"step": 50, "val_loss": 3.9}]
    b[50:50] = [{"step": 50, "val_loss": 3.8}]
    a.append({"step": N, "val_loss": 3.5})
    b.append({"step": N, "val_loss": 3.6})
    return write_run(tmp_path / "one", 1, a), write_run(tmp_path / "two", 2, b)


def test_per_step_frame(pair):
    c = compare_runs(*pair, skip=SKIP)
    s = c["steps"]
    assert list(s.columns) == ["loss_a", "loss_b", "rel_loss_diff", "grad_norm_a", "grad_norm_b", "rel_grad_diff"]
    assert list(s.index) == list(range(N))
    assert s.rel_loss_diff.iloc[0] == 0
    assert s.rel_loss_diff.iloc[20] == pytest.approx(20 * R, rel=1e-9)
    assert s.rel_grad_diff.iloc[4] == pytest.approx(1e-4, rel=1e-9)  # b below a: the difference is absolute
    assert s.rel_grad_diff.iloc[5] == pytest.approx(3e-4, rel=1e-9)
    assert c["run_a"] == pair[0] and c["run_b"] == pair[1]


def test_agreement_numbers(pair):
    ag = compare_runs(*pair, skip=SKIP)["agreement"]
    assert ag["n_steps"] == N and ag["threshold"] == 1e-3
    assert ag["first_step_above"] == 34 and ag["first_grad_step_above"] is None
    loss = ag["loss"]
    assert list(loss) == ["first 10", "first 50", "all"]
    assert loss["first 10"]["max"] == pytest.approx(9 * R, rel=1e-9)
    assert loss["first 10"]["median"] == pytest.approx(4.5 * R, rel=1e-9)
    assert loss["first 50"]["max"] == pytest.approx(49 * R, rel=1e-9)
    assert loss["first 50"]["median"] == pytest.approx(24.5 * R, rel=1e-9)
    assert loss["all"]["max"] == pytest.approx(99 * R, rel=1e-9)
    assert loss["all"]["median"] == pytest.approx(49.5 * R, rel=1e-9)
    for window in ("first 10", "first 50", "all"):
        assert ag["grad_norm"][window]["max"] == pytest.approx(3e-4, rel=1e-9)
        assert ag["grad_norm"][window]["median"] == pytest.approx(2e-4, rel=1e-9)
    other = compare_runs(*pair, skip=SKIP, windows=(5,), threshold=1.0)["agreement"]
    assert list(other["loss"]) == ["first 5", "all"] and other["first_step_above"] is None
    assert compare_runs(*pair, skip=SKIP, threshold=2e-4)["agreement"]["first_grad_step_above"] == 1


def test_throughput_and_val_loss(pair):
    c = compare_runs(*pair, skip=SKIP)
    t = c["throughput"]
    assert t["skip"] == SKIP
    assert t["tokens_per_s_a"] == 1000.0 and t["tokens_per_s_b"] == 1800.0
    assert (t["world_a"], t["world_b"]) == (1, 2)
    assert (t["batch_a"], t["batch_b"], t["per_gpu_batch_a"], t["per_gpu_batch_b"]) == (32, 32, 32, 16)
    assert t["speedup"] == pytest.approx(1.8) and t["efficiency"] == pytest.approx(0.9)
    assert c["val_loss"] == {"step": N, "a": 3.5, "b": 3.6}
    t0 = compare_runs(*pair, skip=0)["throughput"]  # the start-up steps dominate the medians
    assert (t0["tokens_per_s_a"], t0["tokens_per_s_b"]) == (1.0, 1e9)


def test_table_and_plot(pair):
    c = compare_runs(*pair, skip=SKIP)
    tab = agreement_table(c)
    assert list(tab.index) == ["first 10 steps", "first 50 steps", f"all {N} steps"]
    assert tab.loc["first 10 steps", "loss: max"] == pytest.approx(9 * R, rel=1e-9)
    assert tab.loc[f"all {N} steps", "grad norm: median"] == pytest.approx(2e-4, rel=1e-9)
    fig = plot_compare(c)
    assert len(fig.axes) == 2 and fig.axes[1].get_yscale() == "log"
    assert len(fig.axes[0].lines) == 2 and len(fig.axes[1].lines) == 3  # loss, grad norm, threshold


def test_clear_errors(pair, tmp_path):
    a, b = pair
    with pytest.raises(FileNotFoundError, match="does not exist"):
        compare_runs(tmp_path / "nope", b)
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="config.json"):
        compare_runs(a, tmp_path / "empty")
    (tmp_path / "noworld").mkdir()
    (tmp_path / "noworld" / "config.json").write_text("{}")
    (tmp_path / "noworld" / "metrics.jsonl").write_text((a / "metrics.jsonl").read_text())
    with pytest.raises(ValueError, match="world_size"):
        compare_runs(a, tmp_path / "noworld")
    with pytest.raises(ValueError, match="skip"):
        compare_runs(a, b, skip=N)
    late = write_run(tmp_path / "late", 2, [{"step": 500, "loss": 1.0, "grad_norm": 1.0, "tokens_per_s": 1.0}])
    with pytest.raises(ValueError, match="no step in common"):
        compare_runs(a, late)


def test_committed_ddp_run():
    d = ROOT / "results" / "ddp" / "h200x2-2026-11-29"
    assert (d / "provenance.json").is_file()
    c = compare_runs(d / "one", d / "two")
    assert (c["throughput"]["world_a"], c["throughput"]["world_b"]) == (1, 2)
    assert c["throughput"]["batch_a"] == c["throughput"]["batch_b"] == 32
    assert c["agreement"]["n_steps"] == 200 and list(c["steps"].index) == list(range(200))
    assert c["steps"].notna().all().all()
    assert c["throughput"]["speedup"] > 0 and c["val_loss"]["step"] == 200


def test_log_throughput_reads_train_logs(tmp_path):
    from lpfa.scaling import compare_throughput, log_throughput

    a, b = tmp_path / "a.log", tmp_path / "b.log"
    a.write_text("[00:00 + 1s] model x\n" + "".join(
        f"[00:00 + 1s] step {s}: loss {5 - s / 1000:.4f}, lr 2.00e-03, grad norm 0.5, {1000 + s:,} tok/s\n"
        for s in range(0, 1000, 100)))
    b.write_text("".join(f"[t] step {s}: loss nan, lr 1e-3, grad norm 0.1, {3000 + s:,} tok/s\n"
                         for s in range(0, 500, 100)))
    t = log_throughput(a)
    assert t.index.tolist() == list(range(0, 1000, 100)) and t.loc[300, "tokens_per_s"] == 1300
    assert t.loc[300, "loss"] == pytest.approx(4.7)
    f = compare_throughput({"eager": a, "compiled": b}, skip=200)
    assert f.loc["eager", "median tokens/s"] == 1000 + 550 and f.loc["compiled", "median tokens/s"] == 3300
    assert f.loc["compiled", "ratio"] == pytest.approx(3300 / 1550) and f.loc["compiled", "last logged step"] == 400
    (tmp_path / "c.log").write_text("hello\n")
    with pytest.raises(ValueError, match="not an lpfa.train log"):
        log_throughput(tmp_path / "c.log")
    with pytest.raises(FileNotFoundError):
        log_throughput(tmp_path / "none.log")


def test_first_difference(tmp_path):
    from lpfa.scaling import first_difference

    rng = np.random.default_rng()
    loss = rng.uniform(2, 5, size=30)
    k = int(rng.integers(1, 30))
    other = loss.copy()
    other[k:] += 1e-7  # differs from step k on
    for name, losses in (("a", loss), ("b", other), ("c", loss[:20])):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"train": {}, "world_size": 1}))
        (d / "metrics.jsonl").write_text("\n".join(json.dumps({"step": s, "loss": float(x)})
                                                   for s, x in enumerate(losses)))
    assert first_difference(tmp_path / "a", tmp_path / "b") == {"common_steps": 30, "identical_steps": k,
                                                                "first_differing_step": k}
    assert first_difference(tmp_path / "a", tmp_path / "c") == {"common_steps": 20, "identical_steps": 20,
                                                                "first_differing_step": None}
    with pytest.raises(ValueError, match="grad_norm"):
        first_difference(tmp_path / "a", tmp_path / "c", "grad_norm")


def test_cost_helpers():
    from lpfa.scaling import committed_speed, tokens_per_step, wall_minutes
    from lpfa.train import PRESETS

    assert tokens_per_step(PRESETS["repro"]) == 32 * 512 and tokens_per_step(PRESETS["gpt2-s"]) == 16 * 1024 * 4
    assert wall_minutes(600, 16384 * 10, PRESETS["repro"]) == pytest.approx(1.0)  # 10 steps/s
    assert wall_minutes(600, 16384 * 10, PRESETS["repro"], runs=4, gpus=2) == pytest.approx(2.0)
    assert wall_minutes(600, 16384 * 10, PRESETS["repro"], runs=5, gpus=4) == pytest.approx(2.0)  # one GPU holds two
    speed = committed_speed()
    assert list(speed.index) == ["eager", "compiled"] and speed.loc["compiled", "ratio"] > 1


def test_run_price_is_compile_then_median_steps(tmp_path):
    """Step 0 holds compilation; the price per step is the median of the rest, so one slow step does not move it."""
    from lpfa.model import GPT, GPTConfig
    from lpfa.scaling import minutes_for, run_price

    rng = np.random.default_rng()
    step_s = rng.uniform(0.1, 0.2, size=41)
    step_s[0], step_s[7] = 60.0, 9.0  # compilation, and one stall
    model = GPTConfig.from_size("debug", block_size=64)
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model": model.to_dict(), "train": {}}))
    (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 3.0, "step_s": float(x),
                                                         "tokens_per_s": 4096 / float(x)}) + "\n"
                                             for s, x in enumerate(step_s)))
    p = run_price(d)
    med = float(np.median(step_s[1:]))
    assert p["model"] == "debug" and p["params"] == GPT(model).num_params() and p["steps"] == 41
    assert p["compile_s"] == 60.0 and p["step_s"] == pytest.approx(med, rel=1e-12)
    assert p["steps_per_s"] == pytest.approx(1 / med)
    assert p["tokens_per_s"] == pytest.approx(np.median(4096 / step_s[1:]))
    assert minutes_for(p, 600) == pytest.approx((60.0 + 600 * med) / 60)
    (d / "metrics.jsonl").write_text(json.dumps({"step": 0, "loss": 3.0}) + "\n")
    with pytest.raises(ValueError, match="step_s"):
        run_price(d)


def test_batch_for_steps_is_the_largest_that_fits():
    from lpfa.scaling import batch_for_steps

    # 250k tok/s for 1000 s with 10 % overhead: 225M tokens; 8000 steps of 1024 tokens -> 27.5 sequences -> 24
    b = batch_for_steps(250_000, 1000, 8000, 1024)
    assert b == 24
    assert 8000 * b * 1024 <= 250_000 * 1000 * 0.9 < 8000 * (b + 8) * 1024
    assert batch_for_steps(250_000, 1000, 8000, 1024, multiple=1) == 27


@pytest.mark.parametrize("kw", [dict(tokens_per_s=0), dict(seconds=float("nan")), dict(min_steps=-1),
                                dict(overhead=1.0), dict(tokens_per_s=1000)])
def test_batch_for_steps_bad_input(kw):
    from lpfa.scaling import batch_for_steps

    args = dict(tokens_per_s=250_000, seconds=1000, min_steps=8000, block_size=1024) | kw
    with pytest.raises(ValueError,
                       match=next(iter(kw)) if "tokens_per_s" not in kw or kw["tokens_per_s"] <= 0 else "do not fit"):
        batch_for_steps(**args)


def test_micro_batches_and_paper_scale_plan():
    """The paper-scale launch arithmetic: tokens per step split over GPUs, micro-batches and accumulation; the plan
    picks the paper's batch when it fits the budget, else the authors' smaller one, else none."""
    from lpfa.scaling import AUTHORS_TOKENS_PER_STEP, PAPER_TOKENS_PER_STEP, micro_batches, paper_scale_plan

    # 40 per GPU
    assert micro_batches(PAPER_TOKENS_PER_STEP, 8) == (16, 4) and micro_batches(AUTHORS_TOKENS_PER_STEP, 8) == (10, 4)
    assert micro_batches(PAPER_TOKENS_PER_STEP, 2, micro_max=12) == (8, 32)  # 256 sequences per GPU: 8 divides it
    for gpus in (1, 2, 4, 8):
        for tps in (PAPER_TOKENS_PER_STEP, AUTHORS_TOKENS_PER_STEP):
            m, a = micro_batches(tps, gpus)
            assert gpus * m * a * 1024 == tps and m <= 16
    with pytest.raises(ValueError,
                       match=r"tokens_per_step=1,000 is not a whole number of 1024-token sequences on each of 8 GPUs"):
        micro_batches(1000, 8)
    with pytest.raises(ValueError, match=r"gpus=0: expected a positive integer"):
        micro_batches(PAPER_TOKENS_PER_STEP, 0)
    fast = paper_scale_plan(1e6, gpus=8)  # 8M tokens/s: both fit, the paper's batch is chosen
    assert fast.loc["paper", "s/step"] == pytest.approx(PAPER_TOKENS_PER_STEP / 8e6)
    assert fast.loc["paper", "minutes to step 6,600"] == pytest.approx((6600 * PAPER_TOKENS_PER_STEP / 8e6 + 120) / 60)
    assert list(fast["chosen"]) == [True, False]
    mid = paper_scale_plan(250_000, gpus=8)  # 2M tokens/s: 28.4 min with the paper's batch, 17.7 with the authors'
    assert list(mid["fits"]) == [False, True] and list(mid["chosen"]) == [False, True]
    slow = paper_scale_plan(250_000, gpus=8, efficiency=0.3)
    assert not slow["fits"].any() and not slow["chosen"].any()
    with pytest.raises(ValueError, match=r"efficiency=1.5: expected a fraction in \(0, 1\]"):
        paper_scale_plan(250_000, efficiency=1.5)
