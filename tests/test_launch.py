"""lpfa.launch: detached twin runs, progress, resume after a time budget, and the archive that comes back."""

import json
import tarfile
from pathlib import Path

import pytest

from lpfa import launch

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def tokens(byte_tokens):
    return byte_tokens


def test_start_wait_collect(tokens, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONPATH", str(ROOT / "src"))
    common = [f"data={tokens}", "model=debug", "block_size=32", "batch_size=4", "max_steps=8", "eval_interval=0",
              "eval_batches=1", "ckpt_interval=0", "warmup_steps=2"]
    procs = launch.start("twins", {"bf16": ["attn_policy=paper"], "fp32": ["attn_policy=fp32"]}, None, common, tmp_path)
    assert set(procs) == {"bf16", "fp32"}
    with pytest.raises(RuntimeError, match="still running"):
        launch.start("twins", {"bf16": ["attn_policy=paper"]}, None, common, tmp_path)
    st = launch.wait("twins", max_s=240, root=tmp_path, poll_s=1)
    assert all(not r["alive"] and r["status"] == "completed" and r["step"] == 7 for r in st), st
    archive = launch.collect("twins", tmp_path / "out", tmp_path)
    with tarfile.open(archive) as tar:
        names = set(tar.getnames())
    for label in ("bf16", "fp32"):
        for f in ("config.json", "metrics.jsonl", "log.txt", "summary.json"):
            assert f"twins/{label}/{f}" in names
    assert not any("ckpt" in n for n in names)
    # a run stopped by its budget continues with resume
    launch.start("tb", {"a": ["attn_policy=fa2", "stop_at_step=3"]}, None, common, tmp_path)
    launch.wait("tb", max_s=240, root=tmp_path, poll_s=1)
    assert launch.status("tb", tmp_path)[0]["status"] == "stopped"
    launch.start("tb", {"a": ["attn_policy=fa2"]}, None, common, tmp_path, resume=True)
    st = launch.wait("tb", max_s=240, root=tmp_path, poll_s=1)
    assert st[0]["status"] == "completed" and st[0]["step"] == 7
    steps = [json.loads(l)["step"] for l in (tmp_path / "tb" / "a" / "metrics.jsonl").read_text().splitlines() if '"loss"' in l]
    assert steps == list(range(8))


def test_status_of_unknown_launch(tmp_path):
    with pytest.raises(FileNotFoundError, match="no launch named"):
        launch.status("nope", tmp_path)
