"""benchmarks/stabiliser_cost.py: each stabiliser row built as lpfa.train builds it, timed alone (the
stabilisers' cost in speed)."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
from conftest import ROOT

from lpfa.experiments import RERUNS, STABILISERS, stabiliser_seed

spec = importlib.util.spec_from_file_location("stabiliser_cost", ROOT / "benchmarks" / "stabiliser_cost.py")
cost = importlib.util.module_from_spec(spec)
spec.loader.exec_module(cost)


def test_every_stabiliser_row_has_a_speed_base_timed_in_the_same_run():
    """Each row of STABILISERS but the reruns is timed, and its speed base is a timed row of the same precision
    (FP32 rows against FP32, the Muon QK-clip rows against Muon, the eager sr_reseed against eager BF16)."""
    assert {label for label in STABILISERS if stabiliser_seed(label)[1] is None} - set(RERUNS) <= set(cost.ROWS)
    assert not any(stabiliser_seed(label)[1] for label in cost.ROWS)  # another seed costs what its row costs
    for label in cost.ROWS:
        base = cost.speed_base(label)
        assert base is None or base in cost.ROWS, label
        if label.startswith("fp32") and label != "fp32_paper_recipe":
            assert base.startswith("fp32"), label
        if "muon" in label:
            assert "muon" in base or label.endswith("_muon_recipe"), label
    assert cost.speed_base("sr_reseed") == cost.EAGER_BASE and "compile=false" in cost.ROWS[cost.EAGER_BASE]
    assert cost.row_config("sr_reseed", 24, []).compile is False
    assert cost.row_config("bf16_qkclip", 24, []).compile is True
    assert cost.row_config("bf16_qkclip_muon", 24, []).optimizer == "muon"


def test_the_summary_says_which_forward_the_soft_cap_was_timed_with():
    """``softcap_row_max_raw``: on a GPU the BF16 soft-cap row's forward takes its row max from the raw Q Kᵀ (its
    512-key blocks span several tiles, its scores are BF16); the FP32 soft-cap row's scores are FP32, so it caps every
    score; a row without a cap records None."""
    from lpfa.train import model_config

    def raw(label, cuda=True):
        return cost.softcap_row_max_raw(model_config(cost.row_config(label, 24, []), 50304), cuda)

    assert raw("bf16_softcap") is True and raw("fp32_softcap") is False
    assert raw("bf16_paper_recipe") is None and raw("bf16_qknorm") is None


def test_a_bad_row_is_one_line_naming_it():
    with pytest.raises(ValueError, match=r"row 'bf16_nope': expected one of bf16_paper_recipe"):
        cost.row_config("bf16_nope", 24, [])


def test_the_benchmark_times_rows_on_the_cpu(tmp_path):
    """The driver at a CPU smoke size: every requested row gets a timing (a worker process each, two warming up at
    once), its ratio is its tokens/s over its speed base's, and the rows keep their overrides and provenance."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    rows = ["bf16_paper_recipe", "fp32_paper_recipe", "fp32_qkclip_muon", "fp32_muon_recipe"]
    cmd = [sys.executable, str(ROOT / "benchmarks" / "stabiliser_cost.py"), "--out", str(tmp_path / "out"),
           "--device", "cpu", "--batch", "2", "--steps", "2", "--warmup", "1", "--parallel", "2", "--rows", *rows,
           "--set", "model=tiny", "block_size=32", "compile=false"]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    s = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert list(s) == rows
    for label, r in s.items():
        assert r["tokens_per_s"] > 0 and math.isclose(r["tokens_per_s"], 2 * 32 / (r["step_ms"] / 1e3), rel_tol=1e-9)
        assert r["overrides"] == cost.ROWS[label] and r["speed_base"] == cost.speed_base(label)
        base = cost.speed_base(label)
        if base is None:
            assert r["ratio_to_base"] is None
        else:
            assert math.isclose(r["ratio_to_base"], r["tokens_per_s"] / s[base]["tokens_per_s"], rel_tol=1e-12)
    assert s["fp32_qkclip_muon"]["optimizer"] == "muon" and s["fp32_qkclip_muon"]["qk_clipped"] is not None
    assert all(r["softcap_row_max_raw"] is None for r in s.values())  # no soft-cap among these rows
    prov = json.loads((tmp_path / "out" / "provenance.json").read_text())
    assert prov["config"]["rows"] == {label: cost.ROWS[label] for label in rows} and "git_commit" in prov
    assert "fp32_qkclip_muon" in (tmp_path / "out" / "table.txt").read_text()


@pytest.mark.parametrize("args, message",
                         [(["--rows", "bf16_nope"], "row 'bf16_nope': expected one of bf16_paper_recipe"),
                                           (["--set", "lr=fast"], "lr="),
                                           (["--steps", "0"], "--steps 0: expected a positive integer")])
def test_bad_arguments_are_one_line(tmp_path, args, message):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "stabiliser_cost.py"), "--out", str(tmp_path / "out"), *args]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode != 0 and message in done.stderr and "Traceback" not in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not (tmp_path / "out").exists()
