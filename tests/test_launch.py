"""lpfa.launch: detached twin runs, progress, resume after a time budget, and the archive that comes back."""

import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
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
    lines = (tmp_path / "tb" / "a" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in lines if '"loss"' in line]
    assert steps == list(range(8))


def test_status_of_unknown_launch(tmp_path):
    with pytest.raises(FileNotFoundError, match="no launch named"):
        launch.status("nope", tmp_path)


def test_every_experiment_is_a_valid_repro_config():
    """The runs of lpfa.launch.EXPERIMENTS parse into TrainConfigs and GPT configs of their experiment's preset
    (``repro`` unless lpfa.experiments.EXPERIMENT_PRESETS names another)."""
    from lpfa.launch import EXPERIMENT_PRESETS, EXPERIMENTS
    from lpfa.model import GPTConfig
    from lpfa.train import make_config, parse_overrides

    for exp, runs in EXPERIMENTS.items():
        assert runs, exp
        for label, overrides in runs.items():
            cfg = make_config(EXPERIMENT_PRESETS.get(exp, "repro"), None, parse_overrides(overrides))
            m = GPTConfig.from_size(cfg.model, attn_backend=cfg.attn_backend, attn_policy=cfg.attn_policy,
                                    layer_policies=cfg.layer_policies, fp32_heads=cfg.fp32_heads)
            backends = {m.layer_backend(i) for i in range(m.n_layer)}
            assert backends <= {"lpfa", "sdpa_fp32"}, (exp, label, backends)
    iso = EXPERIMENTS["isolation"]
    only = GPTConfig.from_size("repro", **{k: v for k, v in parse_overrides(iso["bf16_only_layer1"]).items()})
    assert [only.layer_backend(i) for i in range(8)] == ["sdpa_fp32"] + ["lpfa"] + ["sdpa_fp32"] * 6
    assert only.policy(0) is None
    assert only.policy(1).name == "paper_untiled"
    fp32_l1 = GPTConfig.from_size("repro", **parse_overrides(iso["fp32_only_layer1"]))
    assert fp32_l1.layer_backend(1) == "sdpa_fp32" and fp32_l1.policy(1) is None
    assert fp32_l1.policy(0).name == "paper_untiled"
    heads = GPTConfig.from_size("repro", **parse_overrides(iso["fp32_outlier_heads"]))
    assert heads.policy(1).fp32_heads == frozenset({5, 2}) and not heads.policy(0).fp32_heads


def test_every_fp32_twin_is_fp32_split_and_fp32_in_every_layer():
    """The experiments' FP32 twin is the fp32_split policy (FP32-level, deterministic, on tensor cores), and
    the early-warning classes read its every layer as FP32."""
    from lpfa.experiments import EXPERIMENT_PRESETS, EXPERIMENTS, FP32_TWIN
    from lpfa.model import GPTConfig
    from lpfa.run import layer_precision
    from lpfa.train import make_config, parse_overrides

    twins = {(exp, label) for exp, runs in EXPERIMENTS.items() for label, o in runs.items()
             if label == "fp32" or FP32_TWIN in o}
    assert {("twins", "fp32"), ("isolation", "fp32"), ("dose", "fp32")} <= twins
    for exp, label in twins:
        cfg = make_config(EXPERIMENT_PRESETS.get(exp, "repro"), None, parse_overrides(EXPERIMENTS[exp][label]))
        m = GPTConfig.from_size(cfg.model, attn_backend=cfg.attn_backend, attn_policy=cfg.attn_policy,
                                layer_policies=cfg.layer_policies, fp32_heads=cfg.fp32_heads)
        assert m.policy(0).name == "fp32_split" and layer_precision(m) == ["fp32"] * m.n_layer, (exp, label)


def test_every_run_is_described():
    from lpfa.launch import DESCRIPTIONS, EXPERIMENTS

    for exp, runs in EXPERIMENTS.items():
        for label in runs:
            assert DESCRIPTIONS.get(label), (exp, label)
    assert DESCRIPTIONS["fp32_s3"] == "FP32 attention, seed 3 (data order and init)"
    assert EXPERIMENTS["seeds"]["bf16_s2"] == ["attn_policy=paper_untiled", "seed=2", "init_seed=2"]


def test_start_needs_runs(tmp_path):
    from lpfa.launch import main

    with pytest.raises(SystemExit):
        main(["start", "--name", "x", "--root", str(tmp_path)])


def test_only_and_gpus_place_runs(tokens, tmp_path, monkeypatch):
    """``--only`` picks runs of an experiment; ``--gpus`` gives each run its own CUDA_VISIBLE_DEVICES, round-robin."""
    from lpfa.launch import main

    monkeypatch.setenv("PYTHONPATH", str(ROOT / "src"))
    with pytest.raises(SystemExit):  # a label the experiment does not define
        main(["start", "--name", "x", "--root", str(tmp_path), "--experiment", "twins", "--only", "bf16", "nope"])
    with pytest.raises(ValueError, match="empty"):
        launch.start("x", {"a": []}, None, [], tmp_path, gpus=[])
    common = [f"data={tokens}", "model=debug", "block_size=32", "batch_size=4", "max_steps=2", "eval_interval=0",
              "eval_batches=1", "ckpt_interval=0", "warmup_steps=1", "diag_interval=0", "device=cpu"]
    assert main(["start", "--name", "g", "--root", str(tmp_path), "--preset", "repro", "--set", *common,
                 "--experiment", "twins", "--only", "bf16", "fp32", "sfa", "--gpus", "1", "0"]) == 0
    runs = json.loads((tmp_path / "g" / "launch.json").read_text())["runs"]
    assert {k: v["gpu"] for k, v in runs.items()} == {"bf16": "1", "fp32": "0", "sfa": "1"}
    st = launch.wait("g", max_s=240, root=tmp_path, poll_s=1)
    assert all(r["status"] == "completed" for r in st), st


def test_paper_isolation_covers_the_table():
    from lpfa.launch import ISOLATION, PAPER_ISOLATION

    assert set(PAPER_ISOLATION) == set(ISOLATION)
    assert set(PAPER_ISOLATION.values()) <= {"loss exploded", "neither", "not reported"}


@pytest.mark.skipif(shutil.which("bash") is None, reason="scripts/gpu/twins.sh needs bash")
def test_gpu_script_end_to_end_on_cpu(tokens, tmp_path):
    """scripts/gpu/twins.sh's start and finish phases on tiny runs: the twins train, the BF16 run is replayed, the
    SFA β sweep and the structure statistics are computed on its checkpoints, and everything lands in the archive."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PY": sys.executable, "ROOT": str(tmp_path / "runs"),
           "OUT": str(tmp_path / "out"), "DATA": str(tokens), "NAME": "t", "POLL": "1", "GPU_TESTS": "0"}
    extra = ("model=debug block_size=32 batch_size=4 max_steps=8 ckpt_interval=4 diag_interval=2 eval_interval=0 "
             "eval_batches=1")

    def run(**kw):
        return subprocess.run(["bash", str(ROOT / "scripts/gpu/twins.sh")], env={**env, **kw}, cwd=ROOT,
                              capture_output=True, text=True, timeout=600)

    r = run(PHASE="start", EXPERIMENT="twins", ONLY="bf16 fp32", EXTRA=extra, BUDGET="300", WAIT="300")
    assert r.returncode == 0, r.stdout + r.stderr
    r = run(PHASE="finish", WAIT="60", REPLAY_STEPS="2")
    assert r.returncode == 0, r.stdout + r.stderr
    with tarfile.open(tmp_path / "out" / "t.tar.gz") as tar:
        names = set(tar.getnames())
    for f in ("t/launch.json", "t/bf16/summary.json", "t/bf16/sfa_sweep.json", "t/bf16/structure.json",
              "t/fp32/structure.json", "t/bf16_replay/replay.json", "t/bf16_replay/replay.npz"):
        assert f in names, (f, sorted(names))
    s = json.loads((tmp_path / "runs" / "t" / "fp32" / "structure.json").read_text())
    # the debug model's 2 layers; the FP32 twin runs fp32_split
    assert s["step"] == 8 and s["attn_backend"] == "lpfa" and len(s["ties"]["bf16"]) == 2


def test_run_experiment_refuses_unknown_labels_before_starting(tmp_path):
    from lpfa.launch import run_experiment

    with pytest.raises(ValueError,
                       match=r"only=\['bf16_paper_recipe', 'nope'\]: expected labels of experiment 'paper_recipe'"):
        run_experiment("x", "paper_recipe", "data", 10, root=tmp_path, only=["bf16_paper_recipe", "nope"])
    with pytest.raises(ValueError, match="unknown experiment 'nope'"):
        run_experiment("x", "nope", "data", 10, root=tmp_path)
    assert not (tmp_path / "x").exists()


def test_experiment_presets_and_paper_recipe_twins():
    """Every experiment's preset exists; the paper-recipe twins differ only in their attention."""
    from lpfa.launch import DESCRIPTIONS, EXPERIMENT_PRESETS, EXPERIMENTS, PAPER_RECIPE
    from lpfa.train import PRESETS

    assert set(EXPERIMENT_PRESETS) <= set(EXPERIMENTS) and set(EXPERIMENT_PRESETS.values()) <= set(PRESETS)
    for label, o in PAPER_RECIPE.items():  # the attention, then (seed variants) the seed of data order and init
        assert o[0].startswith(("attn_policy=", "attn_backend=")), label
        assert all(x.startswith(("seed=", "init_seed=", "fp32_heads=")) for x in o[1:]), label
        if "_s" in label:
            assert o[0] == PAPER_RECIPE[label.split("_s")[0]][0] and f"seed={label.split('_s')[1]}" in o
    assert all(label in DESCRIPTIONS for e in EXPERIMENTS.values() for label in e
               if not label.startswith(("bias_", "control_")))


def test_experiments_table_one_row_per_run_with_its_reference():
    """lpfa.experiments.table: every run of every experiment once, with the paper's verdict for isolation rows and a
    reference run that exists in the same experiment (or, for the dose ladder, the isolation table's fp32)."""
    from lpfa import experiments as ex

    t = ex.table()
    assert len(t) == sum(len(e) for e in ex.EXPERIMENTS.values()) and t.index.is_unique
    iso = ex.rows("isolation")
    assert {label: r.paper for label, r in iso.items()} == ex.PAPER_ISOLATION
    assert iso["bf16_only_layer1"].reference == "fp32" and iso["fp32"].reference is None
    assert ex.rows("paper_recipe")["bf16_paper_recipe_s1"].reference == "fp32_paper_recipe_s1"
    recipe = ex.rows("paper_recipe")  # the isolation rows at the recipe: the paper's outcome, the recipe's FP32 twin
    for row in ex.RECIPE_ISOLATION:
        r = recipe[f"{row}_paper_recipe"]
        assert r.paper == ex.PAPER_ISOLATION[row] and r.reference == "fp32_paper_recipe" and r.description, row
    assert recipe["bf16_paper_recipe"].paper is None and recipe["fp32_paper_recipe"].reference is None
    for (exp, label), r in t.iterrows():
        if isinstance(r["reference"], str) and exp != "dose":
            assert r["reference"] in ex.EXPERIMENTS[exp], (exp, label)
    with pytest.raises(ValueError, match="unknown experiment 'nope'"):
        ex.rows("nope")


@pytest.mark.skipif(shutil.which("bash") is None, reason="scripts/gpu/paper_recipe.sh needs bash")
def test_paper_recipe_finish_runs_the_doctor_on_the_kept_checkpoint(tokens, tmp_path):
    """With DOCTOR_STEP, paper_recipe.sh's finish runs `lpfa doctor` on each run's checkpoint of that step and
    brings its report back in the archive (the checkpoint itself never leaves the GPU machine), and with REPLAY_STEPS
    also the replay of its training from that checkpoint; a run without that checkpoint is skipped."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "LPFA_RUNS": str(tmp_path / "runs")}
    common = [f"data={tokens}", "model=debug", "block_size=32", "batch_size=4", "max_steps=8", "eval_interval=0",
              "eval_batches=1", "warmup_steps=2", "device=cpu", "diag_interval=0"]
    launch.start("pr", {"bf16_paper_recipe": ["attn_policy=paper", "ckpt_interval=4", "ckpt_history=true",
                                              "diag_interval=2"],  # the replay picks its heads from diagnostics
                        "fp32_paper_recipe": ["attn_policy=fp32_split", "ckpt_interval=0"]},
                 None, common, tmp_path / "runs")
    r = subprocess.run(["bash", str(ROOT / "scripts/gpu/paper_recipe.sh")], cwd=ROOT, capture_output=True, text=True,
                       timeout=600,
                       env={**env, "PHASE": "finish", "NAME": "pr", "ROOT": str(tmp_path / "runs"), "DATA": str(tokens),
                            "WAIT": "300", "POLL": "1", "OUT": str(tmp_path / "out"), "PY": sys.executable,
                            "DOCTOR_STEP": "4", "REPLAY_STEPS": "3", "REPLAY_MAX_S": "120"})
    assert r.returncode == 0, r.stdout + r.stderr
    with tarfile.open(tmp_path / "out" / "pr.tar.gz") as tar:
        names = set(tar.getnames())
        report = json.load(tar.extractfile("pr/bf16_paper_recipe/doctor_step_000004/report.json"))
        replay = json.load(tar.extractfile("pr/bf16_paper_recipe/replay_step_000004/replay.json"))
    assert {"pr/bf16_paper_recipe/doctor_step_000004/report.md", "pr/bf16_paper_recipe/doctor_step_000004.log",
            "pr/bf16_paper_recipe/replay_step_000004.log"} <= names
    assert not any(n.startswith(("pr/fp32_paper_recipe/doctor", "pr/fp32_paper_recipe/replay")) for n in names)
    assert report and "doctor: " in r.stdout
    # REPLAY_STEPS: the run's training replayed from the doctor's checkpoint, layer 1 (REPLAY_LAYER) instrumented
    assert replay["checkpoint_step"] == 4 and replay["layer"] == 1 and len(replay["per_step"]) == 3


def test_committed_runs_match_their_definition():
    """Every committed run folder named after a row of its experiment (lpfa.experiments.EXPERIMENTS) trained with that
    row's switches (its config.json agrees with each override), so the table stays the one source of truth for what a
    committed run is: redefining a row that has run is caught here."""
    import json

    from lpfa.experiments import EXPERIMENTS, FP32_TWIN
    from lpfa.paths import results_dir
    from lpfa.run import read_run_config
    from lpfa.train import parse_overrides

    checked, wrong = 0, []
    for exp, rows in EXPERIMENTS.items():
        for folder in sorted((results_dir() / exp).glob("*/*/config.json")):
            label = folder.parent.name
            if label not in rows:
                continue
            train = read_run_config(folder.parent)["train"]
            older_twin = FP32_TWIN in rows[label] and train.get("attn_backend") == "sdpa_fp32"  # FP32 before fp32_split
            for key, want in parse_overrides(rows[label]).items():
                if older_twin and key == "attn_policy":
                    continue
                if key in train and json.loads(json.dumps(train[key])) != json.loads(json.dumps(want)):  # JSON's keys
                    wrong.append(f"{exp}/{folder.parent.parent.name}/{label}: {key}={train[key]!r}, defined {want!r}")
            checked += 1
    assert checked > 50 and not wrong, "\n".join(wrong)


def test_mechanism_script_replays_from_the_checkpoint_the_time_allows(monkeypatch):
    """scripts/gpu/mechanism.py's BF16 replay window (bf16_window): from the last kept checkpoint at least ``window``
    steps before the explosion, to 50 steps past it; from a later one when those steps do not fit the time left; up to
    the run's end when its loss did not explode; a one-line error without a checkpoint before the end."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("mechanism_script", Path(__file__).parents[1] / "scripts" / "gpu" /
                                                  "mechanism.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    fate = {"explosion_step": 5136}

    class FakeRun:  # a run of 6,310 steps whose loss exploded (or not) where `fate` says
        steps = 6310

        def __init__(self, run_dir):
            pass

        def verdict(self):
            return dict(fate)

    kept = {s: None for s in range(500, 6500, 500)}  # a checkpoint every 500 steps, the last at 6,000
    monkeypatch.setattr(m, "Run", FakeRun)
    monkeypatch.setattr(m, "checkpoints_of", lambda run_dir: kept)
    assert m.PAST_EXPLOSION == 50
    ck, steps, why = m.bf16_window(Path("run"), 1000, 5000)
    assert (ck, steps) == (4000, 1186) and "at least 1000 steps before step 5186" in why
    ck, steps, why = m.bf16_window(Path("run"), 1000, 700)
    assert (ck, steps) == (4500, 686) and "686 steps fit the time left" in why
    fate["explosion_step"] = None
    assert m.bf16_window(Path("run"), 1000, 5000)[:2] == (5000, 1310)
    kept = {}
    with pytest.raises(RuntimeError, match="no checkpoint before step 6310"):
        m.bf16_window(Path("run"), 1000, 5000)


def test_mechanism_follow_brings_back_what_exists_before_the_driver_packs(tmp_path):
    """``follow --out`` before the driver has packed: the runs' small files and the driver's log as they stand come
    back as mechanism-partial.tar.gz, so that a machine taken back between two device calls loses only what came after
    the last call; once the driver's own archive exists, that one comes back instead."""
    import importlib.util
    import json
    import tarfile

    spec = importlib.util.spec_from_file_location("mechanism_script", Path(__file__).parents[1] / "scripts" / "gpu" /
                                                  "mechanism.py")
    m = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(m)
    base = tmp_path / "runs" / "mechanism"
    for label in ("bf16_mechanism_compiled", "fp32_mechanism"):
        (base / label).mkdir(parents=True)
        (base / label / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 5.0}) + "\n")
    (base / "launch.json").write_text(json.dumps({"name": "mechanism", "runs": {
        "bf16_mechanism_compiled": {}, "fp32_mechanism": {}}}))
    (base / "driver.log").write_text("16:32:53 started\n")
    out = tmp_path / "out"
    follow = ["follow", "--max-s", "0", "--poll-s", "0", "--root", str(tmp_path / "runs"), "--out", str(out)]
    assert m.main(follow) == 0
    with tarfile.open(out / m.PARTIAL) as tar:
        names = set(tar.getnames())
    assert {"driver.log", "launch.json", "bf16_mechanism_compiled/metrics.jsonl",
            "fp32_mechanism/metrics.jsonl"} <= names
    assert not (out / "mechanism.tar.gz").exists()
    m.pack(base)
    assert m.main(follow) == 0 and (out / "mechanism.tar.gz").is_file()


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("setsid") is None,
                    reason="scripts/gpu/in_turn.sh needs bash and setsid")
def test_in_turn_stop_ends_the_running_row_cleanly_and_starts_no_other(tokens, tmp_path):
    """PHASE=stop: the running row ends through its STOP file (status "stopped", logs and summary kept), its step still
    finishes and comes back with follow, and no further step starts; with no queue there is nothing to stop."""
    queue, out, runs = tmp_path / "queue", tmp_path / "out", tmp_path / "runs"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PY": sys.executable, "QUEUE": str(queue),
           "ROOT": str(runs), "OUT": str(out), "DATA": str(tokens), "GPUS": "0", "BATCH": "4", "POLL": "1",
           "BUDGET": "300", "EXPERIMENT": "stabilisers", "ONLY": "bf16_qknorm fp32_qknorm",
           "EXTRA": "model=debug block_size=32 max_steps=1000000 eval_interval=0 eval_batches=1 warmup_steps=2 "
                    "device=cpu diag_interval=0 compile=false ckpt_interval=2"}
    script = str(ROOT / "scripts/gpu/in_turn.sh")

    def phase(name, **more):
        return subprocess.run(["bash", script], cwd=ROOT, env={**env, "PHASE": name, **more}, capture_output=True,
                              text=True, timeout=300)

    nothing = phase("stop")
    assert nothing.returncode == 1 and "nothing to stop" in nothing.stdout
    assert phase("start").returncode == 0
    log = runs / "in_turn_bf16_qknorm" / "bf16_qknorm" / "log.txt"
    deadline = time.time() + 120
    while not ((log.parent / "ckpt").is_dir() and "step 1" in log.read_text()) and time.time() < deadline:
        time.sleep(0.5)
    # follow while the row runs: its small files so far come back (a machine taken back loses only checkpoints)
    early = phase("follow", MAX_S="0")
    assert early.returncode == 0, early.stdout + early.stderr
    with tarfile.open(out / "in_turn_partial.tar.gz") as tar:
        names = set(tar.getnames())
    assert {"in_turn_bf16_qknorm/bf16_qknorm/log.txt", "in_turn_bf16_qknorm/bf16_qknorm/config.json"} <= names
    assert not any("/ckpt" in n for n in names), names
    stopped = phase("stop")
    assert stopped.returncode == 0 and "asked to stop" in stopped.stdout and "bf16_qknorm" in stopped.stdout
    followed = phase("follow", MAX_S="200")
    assert "queue ended" in followed.stdout and "stopped before fp32_qknorm" in followed.stdout, followed.stdout
    with tarfile.open(out / "in_turn_bf16_qknorm.tar.gz") as tar:
        summary = json.load(tar.extractfile("in_turn_bf16_qknorm/bf16_qknorm/summary.json"))
        assert summary["status"] == "stopped" and 0 < summary["steps"] < 1_000_000
        assert "in_turn_bf16_qknorm/bf16_qknorm/log.txt" in tar.getnames()
    assert not (runs / "in_turn_fp32_qknorm").exists()
    assert not (out / "in_turn_partial.tar.gz").exists()  # every step finished: its archive, no partial copy


@pytest.mark.skipif(shutil.which("bash") is None or shutil.which("setsid") is None,
                    reason="scripts/gpu/in_turn.sh needs bash and setsid")
def test_in_turn_runs_the_rows_one_after_another_and_brings_each_back(tokens, tmp_path):
    """scripts/gpu/in_turn.sh: start returns at once with the queue detached; the queue trains each step of ONLY
    through paper_recipe.sh, the next only after the last has ended, from its own copy of the scripts and data (rows
    joined by "+" together, in one launch; "@N" stops a step's rows at step N); follow brings one archive per step and
    the logs; a second start while the queue runs is refused, and so is a step whose "@" is not followed by a step."""
    queue, out = tmp_path / "queue", tmp_path / "out"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "PY": sys.executable, "QUEUE": str(queue),
           "ROOT": str(tmp_path / "runs"), "OUT": str(out), "DATA": str(tokens), "GPUS": "0", "BATCH": "4", "POLL": "1",
           "BUDGET": "300", "EXPERIMENT": "stabilisers", "ONLY": "bf16_qknorm@3 fp32_qknorm+fp32_gated",
           "EXTRA": "model=debug block_size=32 max_steps=4 eval_interval=0 eval_batches=1 warmup_steps=2 device=cpu "
                    "diag_interval=0 compile=false"}
    script = str(ROOT / "scripts/gpu/in_turn.sh")
    bad = subprocess.run(["bash", script], cwd=ROOT, env={**env, "PHASE": "start", "ONLY": "bf16_qknorm@5k"},
                         capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and "bf16_qknorm@5k" in bad.stdout and not queue.exists()
    started = subprocess.run(["bash", script], cwd=ROOT, env={**env, "PHASE": "start"}, capture_output=True,
                             text=True, timeout=60)
    assert started.returncode == 0 and "queue started" in started.stdout, started.stdout + started.stderr
    again = subprocess.run(["bash", script], cwd=ROOT, env={**env, "PHASE": "start"}, capture_output=True, text=True,
                           timeout=60)
    assert again.returncode == 1 and "already running" in again.stdout
    followed = subprocess.run(["bash", script], cwd=ROOT, env={**env, "PHASE": "follow", "MAX_S": "400"},
                              capture_output=True, text=True, timeout=480)
    assert followed.returncode == 0 and "queue ended" in followed.stdout, followed.stdout + followed.stderr
    spans = {}
    steps = {"bf16_qknorm": 3, "fp32_qknorm": 4, "fp32_gated": 4}
    for step, labels in (("bf16_qknorm_to3", ["bf16_qknorm"]),
                         ("fp32_qknorm-fp32_gated", ["fp32_qknorm", "fp32_gated"])):
        with tarfile.open(out / f"in_turn_{step}.tar.gz") as tar:
            launched = json.load(tar.extractfile(f"in_turn_{step}/launch.json"))
            assert sorted(launched["runs"]) == sorted(labels)  # a "+" step is one launch of its rows
            for label in labels:
                summary = json.load(tar.extractfile(f"in_turn_{step}/{label}/summary.json"))
                assert summary["steps"] == steps[label], summary
                assert launched["runs"][label]["cmd"][-1] == "progress=false"
                spans[label] = (launched["runs"][label]["started"],
                                (tmp_path / "runs" / f"in_turn_{step}" / label / "summary.json").stat().st_mtime)
    assert spans["bf16_qknorm"][1] <= min(spans["fp32_qknorm"][0], spans["fp32_gated"][0])  # the next step waited
    assert (queue / "tree" / "scripts" / "gpu" / "paper_recipe.sh").is_file() and (queue / "tree" / "data").is_dir()
    with tarfile.open(out / "in_turn_logs.tar.gz") as tar:
        assert {"./queue.log", "./bf16_qknorm_to3.log", "./fp32_qknorm-fp32_gated.log"} <= set(tar.getnames())
