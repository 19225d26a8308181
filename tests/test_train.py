"""lpfa.train on CPU: loss falls, exact resume, replay, non-finite stop, time budget, config errors, DDP (gloo)."""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lpfa import data as lpfa_data
from lpfa.train import PRESETS, TrainConfig, make_config, parse_overrides, train

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def token_dir(byte_tokens):
    return byte_tokens


def cfg(token_dir, out_dir, **kw):
    base = dict(data=str(token_dir), model="debug", block_size=32, batch_size=8, max_steps=12, lr=3e-3, min_lr=3e-4,
                warmup_steps=3, eval_interval=0, eval_batches=2, ckpt_interval=0, out_dir=str(out_dir), progress=False,
                attn_backend="lpfa", attn_policy="fa2", log_interval=100)
    base.update(kw)
    return TrainConfig(**base)


def losses(out_dir):
    return {r["step"]: r["loss"] for r in map(json.loads, (Path(out_dir) / "metrics.jsonl").read_text().splitlines()) if "loss" in r}


def test_loss_falls_and_files_are_written(token_dir, tmp_path):
    s = train(cfg(token_dir, tmp_path / "run", max_steps=60, attn_backend="sdpa"))
    assert s["status"] == "completed" and s["steps"] == 60
    ls = losses(tmp_path / "run")
    assert sorted(ls) == list(range(60))
    first, last = sum(ls[i] for i in range(5)) / 5, sum(ls[i] for i in range(55, 60)) / 5
    assert first > 5.0 and last < first - 1.5, (first, last)  # ln(257) ≈ 5.55 at the start
    for name in ("config.json", "metrics.jsonl", "log.txt", "replay.jsonl", "summary.json", "ckpt/model.safetensors"):
        assert (tmp_path / "run" / name).exists(), name
    conf = json.loads((tmp_path / "run" / "config.json").read_text())
    assert conf["data_meta"]["tokenizer"] == "bytes" and conf["provenance"]["git_commit"] is not None


def test_exact_resume(token_dir, tmp_path):
    train(cfg(token_dir, tmp_path / "full", max_steps=12))
    assert train(cfg(token_dir, tmp_path / "part", max_steps=12, stop_at_step=6))["status"] == "stopped"
    s = train(cfg(token_dir, tmp_path / "part", max_steps=12, resume=True))
    assert s["status"] == "completed"
    full, part = losses(tmp_path / "full"), losses(tmp_path / "part")
    assert [full[i] for i in range(12)] == [part[i] for i in range(12)]  # bit-identical losses
    conf = json.loads((tmp_path / "part" / "config.json").read_text())  # the first start's record stays, the resume is added
    assert conf["train"]["resume"] is False and conf["train"]["stop_at_step"] == 6
    (resume,) = conf["resumes"]
    assert resume["step"] == 6 and resume["changed"] == {"resume": True, "stop_at_step": 0}
    assert resume["provenance"]["command"]


def test_refuses_to_overwrite_a_run(token_dir, tmp_path):
    train(cfg(token_dir, tmp_path / "r", max_steps=2))
    with pytest.raises(FileExistsError, match="resume=true"):
        train(cfg(token_dir, tmp_path / "r", max_steps=2))


def test_replay_reproduces_batches_and_refuses_other_data(token_dir, tmp_path):
    train(cfg(token_dir, tmp_path / "a", max_steps=5, seed=7))
    # another seed, but replaying a's batches: identical losses
    train(cfg(token_dir, tmp_path / "b", max_steps=5, seed=99, replay=str(tmp_path / "a" / "replay.jsonl")))
    assert losses(tmp_path / "a") == losses(tmp_path / "b")
    other = tmp_path / "other"
    other.mkdir()
    (other / "t.txt").write_text("some other text " * 500)
    odir = tmp_path / "other_tokens"
    lpfa_data.build_token_files(other, odir, tokenizer="bytes")
    with pytest.raises(ValueError, match="refusing to replay"):
        train(cfg(odir, tmp_path / "c", max_steps=2, replay=str(tmp_path / "a" / "replay.jsonl")))


def test_batches_do_not_depend_on_precision(token_dir, tmp_path):
    train(cfg(token_dir, tmp_path / "lp", max_steps=3, attn_policy="paper"))
    train(cfg(token_dir, tmp_path / "hp", max_steps=3, attn_policy="fp32"))
    a, b = ((tmp_path / d / "replay.jsonl").read_text().splitlines()[1:] for d in ("lp", "hp"))
    assert a == b


def test_nonfinite_loss_stops_and_keeps_checkpoint_and_logs(token_dir, tmp_path, monkeypatch):
    import lpfa.model as m

    calls = {"n": 0}
    orig = m.GPT.forward

    def poisoned(self, idx, targets=None):
        logits, loss = orig(self, idx, targets)
        if self.training:
            calls["n"] += 1
            if calls["n"] > 7 and loss is not None:
                loss = loss * float("nan")
        return logits, loss

    monkeypatch.setattr(m.GPT, "forward", poisoned)
    s = train(cfg(token_dir, tmp_path / "nan", max_steps=20, ckpt_interval=5))
    assert s["status"] == "nonfinite" and s["steps"] == 7
    from lpfa.checkpoints import load_checkpoint

    assert load_checkpoint(tmp_path / "nan" / "ckpt").step == 5  # the last good checkpoint survives
    log = (tmp_path / "nan" / "log.txt").read_text()
    assert "non-finite" in log and "last good checkpoint" in log
    assert json.loads((tmp_path / "nan" / "summary.json").read_text())["status"] == "nonfinite"


def test_time_budget_ends_cleanly(token_dir, tmp_path):
    s = train(cfg(token_dir, tmp_path / "tb", max_steps=10_000, time_budget_s=1.0))
    assert s["status"] == "time_budget" and 0 < s["steps"] < 10_000
    from lpfa.checkpoints import load_checkpoint

    assert load_checkpoint(tmp_path / "tb" / "ckpt").step == s["steps"]


def test_muon_optimizer_runs(token_dir, tmp_path):
    s = train(cfg(token_dir, tmp_path / "muon", max_steps=8, optimizer="muon", attn_backend="sdpa"))
    ls = losses(tmp_path / "muon")
    assert s["status"] == "completed" and ls[7] < ls[0]


def test_config_errors_and_overrides():
    assert parse_overrides(["lr=3e-4", "layer_policies={1: paper}", "qk_norm=true"]) == {
        "lr": 3e-4, "layer_policies": {1: "paper"}, "qk_norm": True}
    c = make_config("repro", None, {"max_steps": 5})
    assert c.model == "repro" and c.max_steps == 5 and c.attn_policy == PRESETS["repro"]["attn_policy"]
    with pytest.raises(ValueError, match="unknown TrainConfig field"):
        make_config(None, None, {"learning_rate": 1})
    with pytest.raises(ValueError, match="unknown preset"):
        make_config("huge")
    with pytest.raises(ValueError, match="optimizer must be"):
        TrainConfig(optimizer="sgd")
    with pytest.raises(ValueError, match="key=value"):
        parse_overrides(["lr"])


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_ddp_gloo_matches_single_process(token_dir, tmp_path):
    args = [f"data={token_dir}", "model=debug", "block_size=32", "batch_size=8", "grad_accum=2", "max_steps=4",
            "eval_interval=0", "eval_batches=2", "ckpt_interval=0", "progress=false", "attn_backend=lpfa", "warmup_steps=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    single = subprocess.run([sys.executable, "-m", "lpfa.train", *args, f"out_dir={tmp_path / 'one'}"],
                            env=env, capture_output=True, text=True, timeout=300)
    assert single.returncode == 0, single.stderr[-2000:]
    ddp = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={_free_port()}",
                          "-m", "lpfa.train", *args, f"out_dir={tmp_path / 'two'}"],
                         env=env, capture_output=True, text=True, timeout=300)
    assert ddp.returncode == 0, ddp.stderr[-3000:]
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert sorted(one) == sorted(two) == [0, 1, 2, 3]
    for s in one:
        assert abs(one[s] - two[s]) < 1e-5 * abs(one[s]), (s, one[s], two[s])
    g1 = [json.loads(l)["grad_norm"] for l in (tmp_path / "one" / "metrics.jsonl").read_text().splitlines() if "grad_norm" in l]
    g2 = [json.loads(l)["grad_norm"] for l in (tmp_path / "two" / "metrics.jsonl").read_text().splitlines() if "grad_norm" in l]
    assert all(abs(a - b) < 1e-4 * abs(a) for a, b in zip(g1, g2)), (g1, g2)
    from lpfa.checkpoints import load_checkpoint

    w1 = load_checkpoint(tmp_path / "one" / "ckpt").model.state_dict()
    w2 = load_checkpoint(tmp_path / "two" / "ckpt").model.state_dict()
    for k in w1:
        torch.testing.assert_close(w1[k], w2[k], rtol=1e-4, atol=1e-6)
