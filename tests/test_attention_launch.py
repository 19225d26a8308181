"""lpfa.attention.triton_common.launch: the first launch of a specialization goes through Triton's ``run``, later ones
straight to the compiled kernel's launcher with the same arguments, and a change of anything Triton specializes on
(a tensor's dtype or 16-byte alignment, an int's value, a constexpr, a launch option) goes through ``run`` again.

A stand-in kernel records both paths (no GPU here); the GPU tests run the real kernels through it."""

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
import torch

pytest.importorskip("triton")
from lpfa.attention import triton_common  # noqa: E402


class CompiledKernel:  # the name launch() recognises, as Triton's own class is named
    function, packed_metadata = "fn", "meta"

    def __init__(self, log):
        self.log = log

    def run(self, *a):
        self.log.append(("fast", a))


class StandIn:
    """A JITFunction-like kernel: kernel[grid](*args, **meta) logs the call and returns its compiled kernel."""

    arg_names = ["X", "Y", "N", "scale", "BLOCK", "MODE"]

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def run(*args, **meta):
            self.log.append(("run", grid, args, meta))
            return CompiledKernel(self.log)
        return run


@pytest.fixture
def kernel(monkeypatch):
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda index: 7, raising=False)
    triton_common._LAUNCHES.clear()
    return StandIn()


def paths(k):
    return [entry[0] for entry in k.log]


def test_second_launch_goes_to_the_compiled_kernel_with_every_argument_in_order(kernel):
    x, y = torch.zeros(64), torch.ones(64)
    for _ in range(3):
        triton_common.launch(kernel, (4, 2), x, y, 1000, 0.5, BLOCK=64, MODE=1, num_warps=4)
    assert paths(kernel) == ["run", "fast", "fast"]
    assert kernel.log[1][1] == (4, 2, 1, 7, "fn", "meta", None, None, None, x, y, 1000, 0.5, 64, 1)


@pytest.mark.parametrize("change", ["dtype", "alignment", "int", "constexpr", "option"])
def test_what_triton_specializes_on_goes_through_run_again(kernel, change):
    x, y = torch.zeros(64), torch.ones(64)
    args, meta = [x, y, 1000, 0.5], dict(BLOCK=64, MODE=1, num_warps=4)
    triton_common.launch(kernel, (4,), *args, **meta)
    if change == "dtype":
        args[0] = x.double()
    elif change == "alignment":
        args[0] = x[1:]  # 4 bytes past a 16-byte boundary
    elif change == "int":
        args[2] = 1001
    elif change == "constexpr":
        meta["MODE"] = 2
    else:
        meta["num_warps"] = 8
    triton_common.launch(kernel, (4,), *args, **meta)
    assert paths(kernel) == ["run", "run"]
    triton_common.launch(kernel, (4,), *args, **meta)
    assert paths(kernel) == ["run", "run", "fast"]


def test_a_float_argument_changes_no_specialization(kernel):
    x = torch.zeros(64)
    triton_common.launch(kernel, (1,), x, x, 8, 0.5, BLOCK=16, MODE=0)
    triton_common.launch(kernel, (1,), x, x, 8, 0.25, BLOCK=16, MODE=0)
    assert paths(kernel) == ["run", "fast"] and kernel.log[1][1][-3] == 0.25


def test_a_launch_hook_sends_every_call_through_run(kernel, monkeypatch):
    x = torch.zeros(64)
    triton_common.launch(kernel, (1,), x, x, 8, 0.5, BLOCK=16, MODE=0)
    monkeypatch.setattr(triton_common.triton.knobs.runtime, "launch_enter_hook", lambda *a: None)
    triton_common.launch(kernel, (1,), x, x, 8, 0.5, BLOCK=16, MODE=0)
    assert paths(kernel) == ["run", "run"]


def test_a_missing_constexpr_keeps_the_slow_path(kernel):
    x = torch.zeros(64)
    for _ in range(2):
        triton_common.launch(kernel, (1,), x, x, 8, 0.5, BLOCK=16)  # MODE left to a default: not lined up
    assert paths(kernel) == ["run", "run"]


def _ptxas_available() -> bool:
    """Whether Triton's bundled CUDA toolchain is here (the compile-ahead test needs ptxas, not a GPU)."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas
        return bool(get_ptxas(90).path)
    except Exception:  # no NVIDIA backend in this Triton
        return False


@pytest.mark.skipif(not _ptxas_available(), reason="needs Triton's NVIDIA backend and its bundled ptxas")
@pytest.mark.parametrize("preset,pass_,extra", [
    ("fp32", "forward", ["--d", "128"]),  # FP32 P̄ and V staged at D = 128 (triton_common.FP32_PV_FORWARD_128)
    ("fp32_split", "both", ["--d", "128", "--dtype", "fp32"]),  # FP32 inputs split in BF16 parts (FP32_INPUTS_128)
    ("fa2", "backward", ["--d", "64", "128", "--dq-mode", "ordered"]),  # the spin-wait and stores in a pipelined loop
])
def test_launches_compile_for_sm90_within_its_shared_memory(preset, pass_, extra, tmp_path):
    """benchmarks/compile_check.py compiles kernels for an H100/H200 (sm_90) on this CPU: the default launches compile
    and fit a block's shared memory where they once did not (FP32 operands at D = 128 asked for up to 352 KiB of
    the 227 KiB; the ordered dQ's stores failed Triton's software pipeliner at D = 64). The ordered dQ's dK/dV
    kernel also stays software-pipelined: its TTGIR prefetches tiles by cp.async, which a spin loop of Triton's or a
    block barrier in its loop over query tiles once turned off (0 async copies)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = str(root / "src")
    r = subprocess.run([sys.executable, str(root / "benchmarks" / "compile_check.py"), "--presets", preset,
                        "--pass", pass_, "--jobs", "2", "--shape", "1", "2", "256", "--dump-ptx", str(tmp_path),
                        *extra], capture_output=True, text=True, timeout=600, env=env, cwd=root)
    rows = [line for line in r.stdout.splitlines() if line.startswith("| _")]
    assert r.returncode == 0 and rows and all("| ok (" in row for row in rows), r.stdout[-3000:] + r.stderr[-2000:]
    if "ordered" in extra:
        dkdv = sorted(tmp_path.glob("_bwd_dkdv_kernel_*.ttgir"))
        assert dkdv and all("async_copy_global_to_local" in f.read_text() for f in dkdv), [f.name for f in dkdv]
