"""Compiled training on a GPU: with ``deterministic=true`` a replay in another process follows the run bit for bit.

The mechanism pages measure a run by replaying it from a checkpoint (lpfa.replay), which says something about the run
only if the replay computes the run's losses. A compiled run trained without ``deterministic`` need not be followed:
the compiled BF16 recipe run of results/mechanism/h200-2026-12-06 was not, from the second replayed step on.
Skipped without CUDA (CI has no GPU); ``scripts/gpu/kernels.sh`` runs it with the kernels' GPU tests.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("attention, measure", [(["attn_policy=paper"], []),
                                                (["attn_backend=sdpa_fp32"], ["--measure-policy", "paper"])],
                         ids=["bf16", "fp32"])
def test_compiled_deterministic_run_is_replayed_bit_for_bit(byte_tokens, tmp_path, attention, measure):
    """The BF16 mechanism row's attention and its FP32 twin's (PyTorch's SDPA, whose memory-efficient backward is
    deterministic only when torch is asked without warn_only), the twin measured with the BF16 policy as its control
    replay is (``--measure-policy paper``)."""
    # two processes with no cache between them, as a replay on another machine would be
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "TORCHINDUCTOR_FORCE_DISABLE_CACHES": "1"}
    run, out = tmp_path / "run", tmp_path / "replay"
    subprocess.run([sys.executable, "-m", "lpfa.train", f"data={byte_tokens}", "model=tiny", "block_size=256",
                    "batch_size=8", "max_steps=10", "warmup_steps=2", "lr=3e-3", *attention, "compile=true",
                    "deterministic=true", "ckpt_interval=4", "ckpt_history=true", "eval_interval=0",
                    f"out_dir={run}", "progress=false"], check=True, env=env, timeout=400)
    subprocess.run([sys.executable, "-m", "lpfa.replay", "--run", str(run), "--out", str(out), "--step", "4",
                    "--steps", "6", "--layer", "1", "--heads", "0", "1", "--n-seq", "2", *measure],
                   check=True, env=env, timeout=400)
    result = json.loads((out / "replay.json").read_text())
    assert result["compiled"] and result["deterministic"]
    assert result["agreement"]["bit_equal"] == result["agreement"]["compared"] == 6, result["agreement"]
