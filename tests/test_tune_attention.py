"""benchmarks/tune_attention.py's arguments, on the CPU: the shape it sweeps, and the shape a sweep rebuilt from a
cut run's log records (the book reads only sweeps at GPT-2 shapes against the op's GPT-2 table)."""

import json
import os
import subprocess
import sys

import pytest
from conftest import ROOT

SCRIPT = ROOT / "benchmarks" / "tune_attention.py"


def run(tmp_path, *args):
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    return subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp_path / "out"), *args], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("shape", ["4,12,4096", "4,12,x,64", "4,12,4096,48", "0,12,4096,64"])
def test_a_bad_shape_is_one_line_naming_it(tmp_path, shape):
    done = run(tmp_path, "--shape", shape)
    assert done.returncode != 0 and "Traceback" not in done.stderr
    assert done.stderr.strip().splitlines() == [f"--shape {shape!r}: expected B,H,T,D, four positive integers "
                                                f"with D in 16, 32, 64, 128"]
    assert not (tmp_path / "out").exists()


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
