"""lpfa.train on CPU: loss falls, exact resume, replay, non-finite stop, time budget, config errors (DDP:
test_ddp.py)."""

import json
import re
from dataclasses import fields
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
    return {r["step"]: r["loss"] for r in map(json.loads, (Path(out_dir) / "metrics.jsonl").read_text().splitlines())
            if "loss" in r}


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
    # the first start's record stays, the resume is added
    conf = json.loads((tmp_path / "part" / "config.json").read_text())
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
    with pytest.raises(ValueError, match="preset='huge': expected one of cpu-smoke"):
        make_config("huge")
    with pytest.raises(ValueError, match="optimizer='sgd': expected one of 'adamw', 'muon'"):
        TrainConfig(optimizer="sgd")
    with pytest.raises(ValueError, match="key=value"):
        parse_overrides(["lr"])


def test_overrides_follow_each_fields_type():
    # a string field takes the text as written, a bool field only true/false, a number field numbers
    # (YAML 1.1 reads 3e-4 as text)
    assert parse_overrides(["out_dir=123", "replay=", "tokenizer=yes", "resume=True", "progress=false", "lr=1",
                            "max_steps=1e3", "fp32_heads={1: [5, 2]}"]) == {
        "out_dir": "123", "replay": "", "tokenizer": "yes", "resume": True, "progress": False, "lr": 1,
        "max_steps": 1000.0, "fp32_heads": {1: [5, 2]}}
    # left for TrainConfig to refuse, with the field named
    assert parse_overrides(["qk_norm=yes"]) == {"qk_norm": "yes"}
    c = TrainConfig(lr=1, layer_policies={"1": "paper"}, fp32_heads={"0": [1]})  # config.json keeps int keys as strings
    assert c.lr == 1.0 and isinstance(c.lr, float) and c.layer_policies == {1: "paper"} and c.fp32_heads == {0: [1]}
    assert TrainConfig(dtype="float64", log_interval=0, attn_backend="sdpa",
                       layer_policies={1: "sdpa_fp32"}).dtype == "float64"
    types = {"int": int, "float": float, "bool": bool, "str": str, "dict": dict, "list": list}
    for f in fields(TrainConfig):  # every field is checked against its declared type (a bool is no number)
        wrong = [v for v in ("abc", 2.5, True, None, [1]) if type(v) is not types[f.type]]
        for v in wrong:
            with pytest.raises(ValueError, match=rf"^{f.name}=.*: expected "):
                TrainConfig(**{f.name: v})


def test_config_file(tmp_path):
    f = tmp_path / "my.yaml"
    f.write_text("preset: cpu-smoke\nlr: 3e-4\nmin_lr: 1e-5\nlayer_policies: {1: paper}\nout_dir: runs/x\n")
    c = make_config(None, str(f), {"max_steps": 7})
    assert (c.lr, c.min_lr, c.layer_policies, c.max_steps, c.model) == (3e-4, 1e-5, {1: "paper"}, 7, "tiny")
    f.write_text("lr: abc\n")
    with pytest.raises(ValueError, match=r"^lr='abc': expected a finite number > 0 \(set in .*my.yaml\)$"):
        make_config(None, str(f))
    assert make_config(None, str(f), {"lr": 0.1}).lr == 0.1  # an override wins over the file


def test_help_all_lists_every_preset_and_field_by_section(capsys):
    from dataclasses import MISSING

    from lpfa.train import FIELD_CHECKS, PRESET_HELP, field_help, field_sections, main

    with pytest.raises(SystemExit) as e:
        main(["--help-all"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    sections = field_sections()
    assert list(sections) == ["data", "model", "optimisation", "precision and device", "bookkeeping"]
    assert [n for names in sections.values() for n in names] == [f.name for f in fields(TrainConfig)]
    heads = [out.index(f"\n{s} fields (") for s in sections]
    assert heads == sorted(heads)  # the sections in the source's order, each field under its own
    assert heads[1] < out.index("\n  attn_policy (") < heads[2] < out.index("\n  lr (") < heads[3]
    assert set(PRESET_HELP) == set(PRESETS)
    assert set(FIELD_CHECKS) == set(field_help()) == {f.name for f in fields(TrainConfig)}
    for name in PRESETS:
        assert f"  {name} " in out and PRESET_HELP[name] in out
    for f in fields(TrainConfig):
        default = f.default_factory() if f.default is MISSING else f.default
        assert f"  {f.name} ({f.type}, default {json.dumps(default)}): {field_help()[f.name]}\n" in out, f.name
    assert "--debug" in out


def test_help_is_short_presets_and_the_common_fields(capsys):
    """``--help`` fits a screen: usage, the presets and the fields most runs change; it points to --help-all."""
    from lpfa.train import COMMON_FIELDS, PRESET_HELP, field_help, main

    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m lpfa.train") and len(out.splitlines()) <= 60
    assert all(PRESET_HELP[name] in out for name in PRESETS)
    listed = re.findall(r"^  (\w+) \(\w+, default ", out, flags=re.M)
    assert listed == list(COMMON_FIELDS) and 8 <= len(listed) <= 12
    assert all(f"  {name} (" in out and field_help()[name] in out for name in COMMON_FIELDS)
    assert f"--help-all lists all {len(fields(TrainConfig))} fields, by section" in out
    assert "  delta_dose_sign (" not in out and "Outputs in ``out_dir``" not in out


def test_resume_with_a_changed_field_names_it(token_dir, tmp_path, capsys):
    from lpfa.train import main

    args = [f"data={token_dir}", "model=debug", "block_size=32", "batch_size=4", "max_steps=4", "eval_interval=0",
            "eval_batches=1", "progress=false", "warmup_steps=1", f"out_dir={tmp_path / 'r'}"]
    assert main([*args, "stop_at_step=2"]) == 0
    capsys.readouterr()
    assert main([*args, "resume=true", "block_size=64"]) == 2
    assert capsys.readouterr().err == ("error: block_size=64: expected 32, the value the checkpoint "
                                       f"{tmp_path / 'r' / 'ckpt'} was trained with (resume=true continues a run as "
                                       "it was; another out_dir starts a new one)\n")
    # --debug: the exception itself, with its traceback
    with pytest.raises(ValueError, match="block_size=64: expected 32"):
        main([*args, "resume=true", "block_size=64", "--debug"])


def test_resume_after_a_kill_that_cut_a_line_short(token_dir, tmp_path):
    run = tmp_path / "k"
    assert train(cfg(token_dir, run, max_steps=6, stop_at_step=3))["status"] == "stopped"
    with open(run / "metrics.jsonl", "a") as f:  # the kill came while a line was being written
        f.write('{"step": 3, "loss": 4.')
    with open(run / "replay.jsonl", "a") as f:
        f.write('{"step": 3, "sta')
    assert train(cfg(token_dir, run, max_steps=6, resume=True))["status"] == "completed"
    assert sorted(losses(run)) == list(range(6))  # every line whole again, no step lost
    assert "cut short" in (run / "log.txt").read_text()
    assert sorted(lpfa_data.ReplayLog.open(run / "replay.jsonl", token_dir / "train.bin").steps) == list(range(6))


def test_delta_dose_reaches_only_the_chosen_layers(token_dir, tmp_path):
    """delta_dose* (the dose-response experiment's δ dose) become PrecisionPolicy.dose in the named layers; the others
    keep the policy's own δ."""
    from lpfa.model import GPT

    c = cfg(token_dir, tmp_path / "d", attn_policy="paper_untiled", delta_dose=64.0, delta_dose_sign="control",
            delta_dose_layers=[1])
    s = train(c.__class__(**{**c.__dict__, "max_steps": 2}))
    assert s["status"] == "completed"
    conf = json.loads((tmp_path / "d" / "config.json").read_text())["model"]
    from lpfa.model import GPTConfig

    m = GPT(GPTConfig.from_dict(conf))
    p0, p1 = m.transformer.h[0].attn.policy, m.transformer.h[1].attn.policy
    assert (p0.dose, p0.dose_sign) == (1.0, "bias") and (p1.dose, p1.dose_sign) == (64.0, "control")
    assert p1.with_(dose=1.0, dose_sign="bias", name=p0.name) == p0  # nothing else differs
    with pytest.raises(ValueError, match=r"delta_dose_layers=\[5\]: expected layers 0..1"):
        cfg(token_dir, tmp_path / "e", delta_dose=2.0, delta_dose_layers=[5])


def test_explosion_stop_ends_an_exploded_run(token_dir, tmp_path, monkeypatch):
    """explosion_stop=N stops N steps after the loss explodes (lpfa.explosion's criterion), status 'exploded'."""
    import lpfa.model as m

    calls = {"n": 0}
    orig = m.GPT.forward

    def jumping(self, idx, targets=None):
        logits, loss = orig(self, idx, targets)
        if self.training and loss is not None:
            calls["n"] += 1
            if calls["n"] > 30:
                loss = loss + 5.0  # the logged loss jumps by 5 and stays up (the gradients are unchanged)
        return logits, loss

    monkeypatch.setattr(m.GPT, "forward", jumping)
    s = train(cfg(token_dir, tmp_path / "x", max_steps=400, explosion_stop=20))
    assert s["status"] == "exploded" and s["exploded"] is True
    assert s["explosion_step"] is not None and 25 <= s["explosion_step"] <= 40
    assert s["steps"] < 200  # it did not run on to max_steps
    assert "the loss exploded at step" in (tmp_path / "x" / "log.txt").read_text()


def test_float64_needs_a_float64_attention(token_dir, tmp_path):
    with pytest.raises(ValueError, match=r"dtype='float64': expected attn_backend sdpa or math in every layer"):
        cfg(token_dir, tmp_path / "f", dtype="float64", attn_backend="lpfa")
    cfg(token_dir, tmp_path / "f", dtype="float64", attn_backend="sdpa")  # fine


def _warning_records(out_dir):
    return [r for r in map(json.loads, (Path(out_dir) / "metrics.jsonl").read_text().splitlines()) if "warning" in r]


def _thresholds_file(tmp_path, logit):
    """Thresholds any head crosses: max_logit at ``logit`` (precursor) and far above (runaway)."""
    path = tmp_path / "thresholds.json"
    path.write_text(json.dumps({"max_logit": {"precursor": logit, "runaway": 1e9}}))
    return str(path)


def test_on_warning_log_records_each_new_crossing_and_trains_on(token_dir, tmp_path):
    c = cfg(token_dir, tmp_path / "run", diag_interval=4, on_warning="log",
            warning_thresholds=_thresholds_file(tmp_path, -1e9))
    s = train(c)
    assert s["status"] == "completed" and s["steps"] == 12 and "switched_layers" not in s
    w = _warning_records(tmp_path / "run")
    n_layer, n_head = 2, 2  # model="debug"
    assert {r["step"] for r in w} == {4}  # every head crosses at the first record, and stays above: reported once
    assert len(w) == n_layer * n_head and {r["warning"]["action"] for r in w} == {"logged"}
    assert {(r["warning"]["layer"], r["warning"]["head"]) for r in w} == {(a, b) for a in range(n_layer)
                                                                          for b in range(n_head)}
    assert "warning: step 4: layer 0 head 0 max_logit" in (tmp_path / "run" / "log.txt").read_text()


def test_on_warning_stop_ends_the_run_with_a_checkpoint(token_dir, tmp_path):
    s = train(cfg(token_dir, tmp_path / "run", diag_interval=4, on_warning="stop",
                  warning_thresholds=_thresholds_file(tmp_path, -1e9)))
    assert s["status"] == "warned" and s["steps"] == 4
    assert (tmp_path / "run" / "ckpt" / "model.safetensors").exists()


def test_on_warning_sfa_switches_the_flagged_layer_and_resume_keeps_it(token_dir, tmp_path):
    from lpfa.checkpoints import load_checkpoint

    kw = dict(diag_interval=4, on_warning="sfa", attn_policy="paper",
              warning_thresholds=_thresholds_file(tmp_path, -1e9))
    s = train(cfg(token_dir, tmp_path / "part", stop_at_step=8, **kw))
    assert s["status"] == "stopped" and s["switched_layers"] == {0: "paper_sfa", 1: "paper_sfa"}
    actions = [r["warning"]["action"] for r in _warning_records(tmp_path / "part")]
    assert actions.count("layer 0 switched to paper_sfa") == 1 and actions.count("layer 1 switched to paper_sfa") == 1
    ck = load_checkpoint(tmp_path / "part" / "ckpt")  # the checkpoint's model runs the switched layers
    assert {int(k): v for k, v in ck.config["model"]["layer_policies"].items()} == {0: "paper_sfa", 1: "paper_sfa"}
    # the switch changes the run from step 4 on, and a resume continues it exactly: as one run that never stopped
    train(cfg(token_dir, tmp_path / "full", **kw))
    train(cfg(token_dir, tmp_path / "part", resume=True, **kw))
    full, part = losses(tmp_path / "full"), losses(tmp_path / "part")
    assert [full[i] for i in range(12)] == [part[i] for i in range(12)]


def test_on_warning_fp32_switches_to_sdpa_fp32(token_dir, tmp_path):
    s = train(cfg(token_dir, tmp_path / "run", diag_interval=4, on_warning="fp32", attn_policy="paper",
                  warning_thresholds=_thresholds_file(tmp_path, -1e9)))
    assert s["switched_layers"] == {0: "sdpa_fp32", 1: "sdpa_fp32"}


@pytest.mark.parametrize("kw, message", [
    (dict(on_warning="explode"), r"^on_warning='explode': expected one of 'off', 'log', 'stop', 'sfa', 'fp32'"),
    (dict(on_warning="log"), r"^on_warning='log': expected diag_interval > 0"),
    (dict(on_warning="sfa", diag_interval=4, attn_policy="delta_o_exact"),
     r"^on_warning='sfa': layer 0's policy 'delta_o_exact' has no SFA preset"),
    (dict(on_warning="sfa", diag_interval=4, attn_policy="paper_untiled", block_size=1024),
     r"^on_warning='sfa': layer 0's policy 'paper_untiled' has no SFA preset"),
])
def test_on_warning_config_errors(kw, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**kw)


def test_on_warning_thresholds_file_errors(token_dir, tmp_path):
    with pytest.raises(FileNotFoundError,
                       match=r"^warning_thresholds='.*nope.json': expected a JSON file of thresholds"):
        train(cfg(token_dir, tmp_path / "a", diag_interval=4, on_warning="log",
                  warning_thresholds=str(tmp_path / "nope.json")))
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"max_logits": {"precursor": 1}}))
    with pytest.raises(ValueError, match=r"^warning_thresholds='.*bad.json': thresholds name measure 'max_logits'"):
        train(cfg(token_dir, tmp_path / "b", diag_interval=4, on_warning="log", warning_thresholds=str(bad)))
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# ---- QK-clip as a training switch (a stabiliser): Kimi K2's MuonClip, α = ½ ------------------------------------------


def test_head_max_logits_matches_float64_at_awkward_chunks():
    """lpfa.diagnostics.head_max_logits against a float64 brute force: causal rows only, the largest over the batch,
    query chunks that do not divide T."""
    from lpfa.diagnostics import head_max_logits

    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    q, k = torch.randn(2, 3, 37, 16, generator=g), torch.randn(2, 3, 37, 16, generator=g)
    q[1, 2, 5] *= 9  # one large logit of head 2 in the second sequence, at a row inside the second chunk
    s = (q.double() @ k.double().transpose(-1, -2)) / 4
    want = s.masked_fill(torch.ones(37, 37, dtype=torch.bool).triu(1), float("-inf")).amax(dim=(0, 2, 3))
    for chunk in (1, 5, 16, 37, 64):
        got = head_max_logits(q, k, chunk=chunk)
        torch.testing.assert_close(got.double(), want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("bias", [False, True])
def test_qk_clip_step_scales_only_the_heads_over_tau(token_dir, tmp_path, bias):
    """One train_step with qk_clip = τ against the same step without it, from the same model and optimizer state: every
    parameter is the same, except that each head whose largest logit in the step's forwards (recorded on the
    micro-batches, before the update) exceeded τ has its W_Q and W_K rows, and biases, times √(τ / logit)."""
    import copy
    import math

    from lpfa.diagnostics import head_max_logits
    from lpfa.model import GPT, GPTConfig
    from lpfa.train import build_optimizers, train_step

    torch.manual_seed(torch.seed() % 2**31)
    model = GPT(GPTConfig(vocab_size=257, block_size=32, n_layer=2, n_head=4, n_embd=64, attn_backend="math",
                          bias=bias))
    tokens, _ = lpfa_data.load_tokens(token_dir, "train")
    batches = [lpfa_data.get_batch(tokens, torch.randint(0, len(tokens) - 33, (4,)).tolist(), 32, "cpu")
               for _ in range(2)]
    caps = []  # the logits an independent computation sees: each micro-batch's q, k before the update
    from lpfa.diagnostics import capture_qkv

    for x, _ in batches:
        caps.append(torch.stack([head_max_logits(c["q"], c["k"]) for c in capture_qkv(model, x)]))
    logits = torch.stack(caps).amax(0)  # (n_layer, n_head)
    tau = float(logits.flatten().sort().values[3])  # some heads above, some below
    base = TrainConfig(model="debug", block_size=32, batch_size=4, lr=1e-3, warmup_steps=0, grad_clip=1.0)
    results = {}
    for clip in (0.0, tau):
        m = copy.deepcopy(model)
        c = TrainConfig(**{**base.__dict__, "qk_clip": clip})
        info: dict = {}
        train_step(m, build_optimizers(m, c), c, 5, batches, torch.autocast("cpu", enabled=False), info=info)
        results[clip] = (m, info)
    plain, (clipped, info) = results[0.0][0], results[tau]
    assert info["qk_clipped"] == int((logits > tau).sum()) > 0 and "qk_clipped" not in results[0.0][1]
    torch.testing.assert_close(clipped.max_logits(), logits, rtol=1e-6, atol=1e-6)
    C, hd = 64, 16
    for name, p in clipped.named_parameters():
        ref = dict(plain.named_parameters())[name]
        if "c_attn" not in name:
            assert torch.equal(p, ref), name
            continue
        layer = int(name.split(".")[2])
        f = torch.where(logits[layer] > tau, torch.sqrt(tau / logits[layer]), torch.ones(4)).repeat_interleave(hd)
        want = ref.clone()
        want[:C] *= f.view(-1, *([1] * (ref.dim() - 1)))
        want[C:2 * C] *= f.view(-1, *([1] * (ref.dim() - 1)))
        torch.testing.assert_close(p, want, rtol=1e-6, atol=0)  # V rows (2C:) untouched
        assert torch.equal(p[2 * C:], ref[2 * C:])
    assert not math.isinf(float(clipped.max_logits().min()))


def test_qk_clip_in_a_training_run_logs_the_clipped_heads(token_dir, tmp_path):
    """lpfa.train with qk_clip: every step's record says how many heads were clipped; a τ below the logits a tiny
    model reaches clips some; qk_clip = 0 records nothing and tracks nothing."""
    s = train(cfg(token_dir, tmp_path / "clip", max_steps=6, attn_backend="math", qk_clip=1e-4))
    assert s["status"] == "completed"
    recs = [json.loads(line) for line in (tmp_path / "clip" / "metrics.jsonl").read_text().splitlines()]
    counts = [r["qk_clipped"] for r in recs if "loss" in r]
    # debug model: 2 layers, 2 heads
    assert len(counts) == 6 and sum(counts) > 0 and all(0 <= n <= 2 * 2 for n in counts)
    train(cfg(token_dir, tmp_path / "plain", max_steps=2, attn_backend="math"))
    assert not any("qk_clipped" in line for line in (tmp_path / "plain" / "metrics.jsonl").read_text().splitlines())


@pytest.mark.parametrize("kw, message", [
    (dict(qk_clip=-1.0), r"^qk_clip=-1.0: expected"),
    (dict(qk_clip=100.0, qk_norm=True), r"^qk_clip=100.0: expected 0 with qk_norm=true"),
])
def test_qk_clip_config_errors(kw, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**kw)


def test_sr_reseed_draws_each_steps_rounding_afresh(token_dir, tmp_path):
    """sr_reseed (the stochastic-rounding stabiliser): step s rounds with sr_seed + s in every stochastic layer (others
    untouched), so the first step matches a run with one seed and the later steps do not."""
    from lpfa.model import GPT, GPTConfig
    from lpfa.train import reseed_stochastic_rounding

    m = GPT(GPTConfig.from_size("debug", vocab_size=256, block_size=32, attn_backend="lpfa", attn_policy="paper",
                                layer_policies={1: "paper_sr"}))
    base = m.transformer.h[1].attn.policy
    reseed_stochastic_rounding(m, 7)
    assert m.transformer.h[1].attn.policy == base.with_(sr_seed=base.sr_seed + 7, name=base.name)
    assert m.transformer.h[0].attn.policy == m.config.policy(0)  # no stochastic rounding there: as it was
    reseed_stochastic_rounding(m, 2**32 - base.sr_seed + 3)
    assert m.transformer.h[1].attn.policy.sr_seed == 3  # mod 2**32
    runs = {}
    for reseed in (False, True):
        out = tmp_path / f"r{reseed}"
        assert train(cfg(token_dir, out, attn_policy="paper_sr", max_steps=4,
                         sr_reseed=reseed))["status"] == "completed"
        runs[reseed] = losses(out)
    assert runs[True][0] == runs[False][0] and any(runs[True][s] != runs[False][s] for s in (1, 2, 3))


@pytest.mark.parametrize("kw, message", [
    (dict(attn_policy="paper_sr", sr_reseed=True, compile=True), r"^sr_reseed=true: expected compile=false"),
    (dict(attn_policy="paper", sr_reseed=True),
     r"^sr_reseed=true: expected a policy with stochastic rounding .*attn_policy='paper'"),
    (dict(attn_backend="sdpa", attn_policy="paper_sr", sr_reseed=True),
     r"^sr_reseed=true: expected a policy with stochastic"),
])
def test_sr_reseed_config_errors(kw, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**kw)



class _FP32Out(torch.nn.Module):
    """A norm as CUDA autocast runs it: layer_norm is on autocast's FP32 list there (not on the CPU's), so it returns
    FP32."""

    def __init__(self, norm):
        super().__init__()
        self.norm = norm

    def forward(self, x):
        return self.norm(x).float()


@pytest.mark.parametrize("switch", [dict(qk_norm=True), dict(gated_attn=True), dict(qk_norm=True, gated_attn=True)])
@pytest.mark.parametrize("backend", ["lpfa", "sdpa", "sdpa_fp32"])
def test_model_switches_run_under_bf16_autocast(switch, backend):
    """The GPU runs train under BF16 autocast, the CPU tests without it: each model switch must hand the attention q,
    k and v of one dtype there too, with QK-norm's norms returning FP32 as they do under CUDA autocast, and train."""
    from lpfa.model import GPT, GPTConfig

    torch.manual_seed(0)
    m = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=61, block_size=19, bias=False, attn_backend=backend,
                      attn_policy="paper", **switch))
    attn = m.transformer.h[0].attn
    if attn.q_norm is not None:
        attn.q_norm, attn.k_norm = _FP32Out(attn.q_norm), _FP32Out(attn.k_norm)
    attn.register_forward_pre_hook(lambda mod, args: setattr(mod, "capture", {}))
    x = torch.randint(0, 61, (2, 19))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        _, loss = m(x, x)
    assert {attn.capture[n].dtype for n in "qkv"} == {torch.bfloat16}
    loss.backward()
    assert torch.isfinite(loss) and all(torch.isfinite(p.grad).all() for p in m.parameters() if p.grad is not None)


def test_final_val_loss_is_printed_with_four_decimals(token_dir, tmp_path, capsys):
    """The run's last line gives the final validation loss as every other loss of the log (4 decimals)."""
    s = train(cfg(token_dir, tmp_path / "r", max_steps=2, attn_backend="sdpa"))
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.endswith(f"completed at step 2; final val loss {s['final_val_loss']:.4f}"), last
    assert re.search(r"final val loss \d+\.\d{4}$", last)
    assert (tmp_path / "r" / "log.txt").read_text().splitlines()[-1] == last


def test_compile_mode_reaches_torch_compile_and_assume_finite_the_model(token_dir, tmp_path, monkeypatch):
    """``compile_mode`` is torch.compile's ``mode`` (CUDA graphs: reduce-overhead), refused without compile=true;
    ``attn_assume_finite`` (on by default in training) reaches every lpfa attention layer of the model, and off too."""
    import lpfa.train as t

    seen = {}

    def fake_compile(model, **kw):  # records the call; the model runs eagerly
        seen.update(kw)
        return model

    monkeypatch.setattr(t.torch, "compile", fake_compile)
    c = cfg(token_dir, tmp_path / "run", max_steps=2, compile=True, compile_mode="reduce-overhead")
    assert c.attn_assume_finite  # the trainer's default: it stops at a non-finite loss
    t.train(c)
    assert seen == {"mode": "reduce-overhead"}
    from lpfa.model import GPT

    assert all(block.attn.assume_finite for block in GPT(t.model_config(c, 256)).transformer.h)
    off = TrainConfig(**{**c.__dict__, "attn_assume_finite": False})
    assert not any(block.attn.assume_finite for block in GPT(t.model_config(off, 256)).transformer.h)
    with pytest.raises(ValueError, match=r"compile_mode='max-autotune': expected compile=true"):
        TrainConfig(compile_mode="max-autotune")
    with pytest.raises(ValueError, match=r"compile_mode='fast'"):
        TrainConfig(compile=True, compile_mode="fast")


def test_deterministic_turns_off_timed_kernel_choice_and_atomics_and_the_replay_follows(token_dir, tmp_path,
                                                                                       monkeypatch):
    """``deterministic=true`` sets torch's deterministic algorithms (warn only, no NaN fill of new tensors) and
    Inductor's deterministic mode before the run, and records it; the replay of such a run sets them as the run did
    and still follows it bit for bit; ``deterministic=false`` (the default) leaves both as they were; a value that is
    no boolean is refused."""
    import torch._inductor.config as inductor

    import lpfa.train as t
    from lpfa.replay import replay

    monkeypatch.setattr(inductor, "deterministic", False)
    monkeypatch.setattr(torch.utils.deterministic, "fill_uninitialized_memory", True)
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    was, was_warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        t.train(cfg(token_dir, tmp_path / "off", max_steps=2))
        assert not torch.are_deterministic_algorithms_enabled() and not inductor.deterministic
        out = tmp_path / "on"
        t.train(cfg(token_dir, out, max_steps=6, ckpt_interval=3, ckpt_history=True, deterministic=True))
        assert torch.are_deterministic_algorithms_enabled()
        assert not torch.is_deterministic_algorithms_warn_only_enabled()  # an op without one raises
        assert inductor.deterministic and t.os.environ["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
        assert not torch.utils.deterministic.fill_uninitialized_memory  # a fill kernel per allocation: not needed
        assert json.loads((out / "config.json").read_text())["train"]["deterministic"] is True
        torch.use_deterministic_algorithms(False)
        inductor.deterministic = False
        r = replay(out, tmp_path / "replay", step=3, layer=0, heads=[0], steps=3, n_seq=2, device="cpu")
        assert torch.are_deterministic_algorithms_enabled() and inductor.deterministic and r["deterministic"]
        assert r["agreement"]["bit_equal"] == r["agreement"]["compared"] == 3
    finally:
        torch.use_deterministic_algorithms(was, warn_only=was_warn)
    with pytest.raises(ValueError, match=r"^deterministic=1: expected true or false$"):
        TrainConfig(deterministic=1)
