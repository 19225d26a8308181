"""DDP (``torchrun``, gloo) trains as one process does: the same losses, gradient norms and weights.

Both runs are float64 (``dtype=float64``, SDPA attention), so the comparison does not hinge on summation
order. One process accumulates each step's gradient over 2 micro-batches of 8 sequences; DDP gives each of
2 ranks 4 sequences of each micro-batch and averages the ranks' gradients with an all-reduce. The two are
one mathematical sum taken in two orders. The tolerances follow from float64 arithmetic (u = 2⁻⁵³):

* **loss, gradient norm** (a sum over the step's n = 512 tokens): |δ| ≤ γ_n·Σ|terms| with γ_n ≈ n·u ≈ 6e-14;
  per-token terms exceed their mean by far less than 10³ here, so a relative 1e-10 holds on any IEEE machine.
* **weights after 4 AdamW steps:** an update is lr·m̂/(√v̂ + ε); its derivative in one gradient element is at
  most about 2/ε (at g ≈ 0, where Adam divides by ε = 1e-8; this is what amplified FP32's order noise to 5e-6
  on some CPUs). With |δg| ≤ 1e-10·‖g‖ and ‖g‖ ≤ 10 per element: |δw| ≤ Σ_steps lr·2·1e-9/1e-8 ≈ 2e-4·Σlr,
  i.e. below 1e-6 for Σlr ≈ 2.5e-3. Every real DDP error below moves weights by O(lr) = 1e-4 or more.

The test must also fail when DDP is wrong: two deliberately broken variants (a rank that drops one of its
micro-batches, an all-reduce that sums instead of averaging) run through the same comparison and fail it.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lpfa.checkpoints import load_checkpoint

ROOT = Path(__file__).resolve().parents[1]
ARGS = ["model=debug", "block_size=32", "batch_size=8", "grad_accum=2", "max_steps=4", "eval_interval=0",
        "eval_batches=2", "ckpt_interval=0", "progress=false", "attn_backend=sdpa", "dtype=float64",
        "warmup_steps=2", "lr=1e-3"]
REL_TOL = 1e-10  # losses and gradient norms (see the module docstring)
W_TOL = 1e-6  # weights, absolute

# Broken DDP, for the negative controls: run by `python LAUNCHER MODE lpfa.train args...` under torchrun.
LAUNCHER = '''
import os, sys
import torch, torch.distributed as dist
import lpfa.data, lpfa.train

mode = sys.argv.pop(1)
rank = int(os.environ.get("RANK", "0"))
if mode == "drop_microbatch":  # rank 1 trains on its first micro-batch twice and never sees the second
    get_batch, seen = lpfa.data.get_batch, []
    def first_twice(*args, **kw):
        seen.append(get_batch(*args, **kw))
        return seen[-2] if rank == 1 and len(seen) % 2 == 0 else seen[-1]
    lpfa.train.lpfa_data.get_batch = first_twice
elif mode == "sum_not_mean":  # the all-reduce sums the ranks' gradients and forgets to divide
    DDP = torch.nn.parallel.DistributedDataParallel
    ddp_init = DDP.__init__
    def summing_init(self, *args, **kw):
        ddp_init(self, *args, **kw)
        def hook(state, bucket):
            fut = dist.all_reduce(bucket.buffer(), async_op=True).get_future()
            return fut.then(lambda f: f.value()[0])
        self.register_comm_hook(None, hook)
    DDP.__init__ = summing_init
else:
    raise SystemExit(f"unknown mode {mode!r}")
sys.exit(lpfa.train.main(sys.argv[1:]))
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env() -> dict:
    return {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}


def _train_one(out: Path, data: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "lpfa.train", *ARGS, f"data={data}", f"out_dir={out}"],
                       env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]


def _train_ddp(out: Path, data: Path, program: list[str]) -> None:
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                        f"--master_port={_free_port()}", *program, *ARGS, f"data={data}", f"out_dir={out}"],
                       env=_env(), capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]


def _records(out: Path, key: str) -> dict[int, float]:
    recs = map(json.loads, (out / "metrics.jsonl").read_text().splitlines())
    return {r["step"]: r[key] for r in recs if key in r and "val_loss" not in r}


def mismatches(one: Path, two: Path) -> list[str]:
    """What differs between two runs beyond the float64 tolerances above (empty: the runs agree)."""
    found = []
    for key in ("loss", "grad_norm"):
        a, b = _records(one, key), _records(two, key)
        if sorted(a) != sorted(b):
            found.append(f"{key}: steps {sorted(a)} vs {sorted(b)}")
            continue
        for s in a:
            if abs(a[s] - b[s]) > REL_TOL * abs(a[s]):
                found.append(f"{key} at step {s}: {a[s]!r} vs {b[s]!r}")
    w1 = load_checkpoint(one / "ckpt").model.state_dict()
    w2 = load_checkpoint(two / "ckpt").model.state_dict()
    for name in w1:
        assert w1[name].dtype == torch.float64, (name, w1[name].dtype)
        err = float((w1[name] - w2[name]).abs().max())
        if err > W_TOL:
            found.append(f"weight {name}: max |difference| {err:.3g}")
    return found


@pytest.fixture(scope="module")
def single_run(byte_tokens, tmp_path_factory):
    out = tmp_path_factory.mktemp("ddp") / "one"
    _train_one(out, byte_tokens)
    return out


def test_ddp_gloo_matches_single_process(single_run, byte_tokens, tmp_path):
    _train_ddp(tmp_path / "two", byte_tokens, ["-m", "lpfa.train"])
    assert mismatches(single_run, tmp_path / "two") == []
    conf = json.loads((tmp_path / "two" / "config.json").read_text())
    assert conf["world_size"] == 2 and conf["dtype"] == "float64"


# A doubled gradient leaves the weights almost unchanged (clipping to norm 1 and Adam's m̂/√v̂ both undo a
# scale), so only the logged gradient norm can catch a sum taken for a mean: the comparison needs all three.
@pytest.mark.parametrize("mode, caught_by", [
    ("drop_microbatch", ("loss at step 0", "grad_norm at step 0", "weight ")),
    ("sum_not_mean", ("grad_norm at step 0",)),
])
def test_broken_ddp_fails_the_comparison(single_run, byte_tokens, tmp_path, mode, caught_by):
    launcher = tmp_path / "broken_ddp.py"
    launcher.write_text(LAUNCHER)
    _train_ddp(tmp_path / mode, byte_tokens, [str(launcher), mode])
    found = mismatches(single_run, tmp_path / mode)
    for what in caught_by:
        assert any(f.startswith(what) for f in found), (what, found)
