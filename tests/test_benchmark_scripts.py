"""The GPU benchmarks' parts that run on a CPU: tune_attention.py's arguments (the shape it sweeps, and the shape a
sweep rebuilt from a cut run's log records: the book reads only sweeps at GPT-2 shapes against the op's GPT-2 table),
and the interleaved timing that kernel_options.py and sfa_overhead.py share."""

import importlib
import json
import os
import subprocess
import sys

import pytest
import torch
import triton.testing
from conftest import ROOT

SCRIPT = ROOT / "benchmarks" / "tune_attention.py"


def run(tmp_path, *args):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "out"), *args], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)


def _module(name):
    """benchmarks/NAME.py imported in this process (its folder on sys.path, as when it runs as a script)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))


@pytest.mark.parametrize("shape", ["4,12,4096", "4,12,x,64", "4,12,4096,48", "0,12,4096,64"])
def test_a_bad_shape_is_refused_naming_it(shape):
    with pytest.raises(ValueError) as e:
        _module("tune_attention").parse_shape(shape)
    assert str(e.value) == f"--shape {shape!r}: expected B,H,T,D, four positive integers with D in 16, 32, 64, 128"


def test_a_bad_shape_is_one_line_on_the_command_line(tmp_path):
    done = run(tmp_path, "--shape", "4,12,4096")
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == ["--shape '4,12,4096': expected B,H,T,D, four positive integers "
                                                "with D in 16, 32, 64, 128"]
    assert not (tmp_path / "out").exists()


def test_ncu_attention_refuses_a_bad_shape_in_one_line_before_looking_for_ncu(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ncu_attention.py"), "--out", str(tmp_path / "o"),
                           "--shape", "4,12,x,64"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [
        "--shape '4,12,x,64': expected B,H,T,D, four positive integers with D in 16, 32, 64, 128"]
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("script", ["attention.py", "train_throughput.py"])
def test_a_bad_launch_change_is_one_line_before_the_gpu_is_looked_for(tmp_path, script):
    """--launch (a candidate launch table timed in place of the committed one): a malformed change ends the run with
    one line naming it, before the GPU check and before anything is written."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script), "--out", str(tmp_path / "o"),
                           "--launch", "backward.dq_mode=ordered", "backward.stages=2"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [
        "launch change 'backward.stages=2': expected PASS[@HEAD_DIM].FIELD=VALUE with PASS forward or backward, "
        "HEAD_DIM 64 or 128, FIELD one of block_m, block_n, num_warps, num_stages, dq_block_m, dq_block_n, dq_mode"]
    assert not (tmp_path / "o").exists()


def test_a_sweep_rebuilt_from_its_log_keeps_its_shape(tmp_path):
    log = tmp_path / "tune.log"
    log.write_text("sdpa_flash fwd 190.5 bwd 120.25 TFLOP/s\n"
                   "{'impl': 'fa2', 'pass': 'fwd', 'block_m': 64, 'block_n': 128, 'tflops': 150.0, 'graph': True}\n"
                   "check noise\n")
    assert run(tmp_path, "--shape", "4,12,4096,64", "--from-log", str(log)).returncode == 0

    tune = json.loads((tmp_path / "out" / "tune.json").read_text())
    assert tune["shape"] == [4, 12, 4096, 64] and tune["complete"] is False
    assert tune["rows"] == [{"impl": "sdpa_flash", "fwd_tflops": 190.5, "bwd_tflops": 120.25},
                            {"impl": "fa2", "pass": "fwd", "block_m": 64, "block_n": 128, "tflops": 150.0,
                             "graph": True}]


def test_interleaved_timings_take_each_fn_in_turn(monkeypatch):
    """benchmarks/attention.py's interleaved_ms, which kernel_options.py and sfa_overhead.py time with: every fn's
    first timing before any fn's second, each a do_bench median with the L2 flush and the measuring time asked for."""
    bench = _module("attention")
    calls = []

    def fake_do_bench(fn, warmup, rep, return_mode):
        calls.append((fn(), rep, return_mode))
        return float(len(calls))

    monkeypatch.setattr(triton.testing, "do_bench", fake_do_bench)
    ms = bench.interleaved_ms({"a": lambda: "a", "b": lambda: "b", "c": lambda: "c"}, rounds=2, rep_ms=50)
    assert [c[0] for c in calls] == ["a", "b", "c", "a", "b", "c"]
    assert {c[1:] for c in calls} == {(50, "median")}
    assert ms == {"a": [1.0, 4.0], "b": [2.0, 5.0], "c": [3.0, 6.0]}


@pytest.mark.parametrize("rounds", [1, 3])
def test_speed_keeps_the_median_of_interleaved_rounds_and_their_spread(monkeypatch, rounds):
    """benchmarks/attention.py's speed part (the shapes part's, with rounds > 1), on the CPU with a stand-in for the
    kernels: each implementation's forward and forward+backward times are the medians of its rounds, the backward
    their difference, and the rounds and their spread (max / min − 1) are kept; one round keeps no spread."""
    bench = _module("attention")
    g = torch.Generator().manual_seed(0)
    monkeypatch.setattr(bench, "inputs", lambda B, H, T, D, seed=0, requires_grad=True: [
        torch.randn(B, H, T, D, generator=g).requires_grad_(requires_grad) for _ in range(3)])
    called = []

    def fake_attention(q, k, v, policy, backend, assume_finite=False):
        called.append(policy)
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

    monkeypatch.setattr(bench, "attention", fake_attention)
    monkeypatch.setattr(bench, "graph_ms", lambda fn: (None, False))  # CUDA graphs: GPU only
    times = iter([5.0, 9.0, 7.0, 4.0, 6.0] * 40)
    monkeypatch.setattr(triton.testing, "do_bench", lambda fn, warmup, rep, return_mode: (fn(), next(times))[1])
    rows = bench.speed(1, 2, 8, 16, budget_s=0.05, presets=["fa2"], extras=False, rounds=rounds)

    assert {"fa2", "fa2:finite"} <= set(rows) and set(called) == {"fa2"}
    for r in rows.values():
        if rounds == 1:
            assert "spread" not in r
            continue
        f, fb = r["fwd_ms_rounds"], r["fwd_bwd_ms_rounds"]
        assert len(f) == len(fb) == rounds
        assert r["fwd_ms"] == sorted(f)[1] and r["fwd_bwd_ms"] == sorted(fb)[1]
        assert r["bwd_ms"] == max(r["fwd_bwd_ms"] - r["fwd_ms"], 1e-6)
        assert r["spread"] == pytest.approx(max(max(f) / min(f), max(fb) / min(fb)) - 1)
