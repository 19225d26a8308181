"""lpfa.run.Run: one run folder read through one object (config, records, metrics, verdict, checkpoints, batches)."""

import json

import numpy as np
import pandas as pd
import pytest
import torch
from conftest import ROOT

from lpfa import data as lpfa_data
from lpfa.run import Run, autocast, autocast_dtype, read_run_config, resolve_device, run_verdict
from lpfa.train import TrainConfig, recorded_config, train


@pytest.fixture(scope="module")
def tiny(byte_tokens, tmp_path_factory):
    out = tmp_path_factory.mktemp("run") / "r"
    train(TrainConfig(data=str(byte_tokens), model="debug", block_size=32, batch_size=4, max_steps=6, warmup_steps=2,
                      eval_interval=0, eval_batches=1, ckpt_interval=3, ckpt_history=True, diag_interval=3,
                      diag_batch=2, out_dir=str(out), progress=False, attn_policy="paper_untiled"))
    return out


def test_run_reads_its_folder(tiny, byte_tokens):
    run = Run(tiny)
    assert run.label == "r" and repr(run) == f"Run({str(tiny)!r})"
    assert run.config == read_run_config(tiny) and run.train["attn_policy"] == "paper_untiled"
    assert recorded_config(run).max_steps == 6 and run.model_config().n_layer == 2
    assert run.data_dir == byte_tokens and run.steps == 6
    train_df, val, diag = run.metrics()
    assert list(train_df.index) == list(range(6)) and list(diag["step"]) == [3, 6] and len(val) == 1
    assert run.summary["status"] == "completed" and run.verdict() == run_verdict(tiny)
    assert sorted(run.checkpoints) == [3, 6]
    assert run.checkpoint().step == 6 and run.checkpoint(3).step == 3
    with pytest.raises(ValueError, match=r"has no checkpoint at step 4; it has steps \[3, 6\]"):
        run.checkpoint(4)


def test_probe_batch_is_the_diagnostics_batch(tiny, byte_tokens):
    run = Run(tiny)
    val, _ = lpfa_data.load_tokens(byte_tokens, "val")
    starts = lpfa_data.batch_starts(1337 + 2, 3, 0, 2, len(val), 32)
    assert torch.equal(run.probe_batch(3), lpfa_data.get_batch(val, starts, 32, "cpu")[0])
    assert run.probe_batch(0, n=5).shape == (5, 32)


def test_missing_and_damaged_files(tiny, tmp_path):
    import shutil

    copy = tmp_path / "copy"
    shutil.copytree(tiny, copy)
    (copy / "summary.json").unlink()
    assert Run(copy).summary is None  # a killed run has none
    (copy / "summary.json").write_text("{")
    with pytest.raises(ValueError, match=r"summary.json is not valid JSON"):
        Run(copy).summary
    conf = json.loads((copy / "config.json").read_text())
    del conf["data_dir"]
    (copy / "config.json").write_text(json.dumps(conf))
    with pytest.raises(ValueError, match=r"config.json has no data_dir"):
        Run(copy).data_dir
    with pytest.raises(FileNotFoundError, match=r"config.json does not exist"):
        Run(tmp_path / "nowhere").config


def test_device_and_autocast():
    assert resolve_device("cpu") == "cpu" and resolve_device("auto") in ("cpu", "cuda")
    assert autocast_dtype("auto", "cpu") == "float32" and autocast_dtype("auto", "cuda:0") == "bfloat16"
    assert autocast_dtype("float64", "cuda") == "float64"
    assert isinstance(autocast("cpu", "bfloat16"), torch.autocast)
    with autocast("cpu", "float32"):
        assert not torch.is_autocast_enabled("cpu")


def test_doctor_reports_of_the_run_and_of_its_rerun(tmp_path):
    """Run.doctor_reports: doctor_step_NNNNNN/report.json in the run folder and in a rerun_*/ subfolder (a rerun to a
    step the run did not reach), by step, each with its source; lpfa.pages.stabilisers.doctor_links reads one layer of
    the last."""
    from lpfa.pages.stabilisers import doctor_links

    run = tmp_path / "sr"
    heads = [{"layer": 1, "head": h, "delta_t_paper": t, "delta_t_trained": -2 * t, "rank1_median": r}
             for h, (t, r) in enumerate([(0.5, 0.9), (-3.5, 0.7), (1.0, 0.8)])]
    heads.append({"layer": 0, "head": 0, "delta_t_paper": 99.0, "delta_t_trained": None, "rank1_median": 0.0})
    for folder, step in (("", 5000), ("rerun_to_2850/", 2800)):
        d = run / f"{folder}doctor_step_{step:06d}"
        d.mkdir(parents=True)
        (d / "report.json").write_text(json.dumps({"table": heads if step == 2800 else heads[:1],
                                                   "probe": {"shape": [4, 256]}}))
    reports = Run(run).doctor_reports
    assert list(reports) == [2800, 5000]
    assert reports[2800]["source"] == "rerun_to_2850/doctor_step_002800"
    assert reports[5000]["source"] == "doctor_step_005000"
    assert doctor_links(run, layer=1) == {"doctor step": 5000, "δ |t| paper": 0.5, "δ |t| own": 1.0,
                                          "rank-1 similarity": 0.9, "doctor source": "doctor_step_005000",
                                          "doctor probe": "4 × 256"}
    (run / "doctor_step_005000" / "report.json").unlink()
    (run / "doctor_step_005000").rmdir()
    assert doctor_links(Run(run), layer=1) == {"doctor step": 2800, "δ |t| paper": 3.5, "δ |t| own": 7.0,
                                               "rank-1 similarity": 0.8,
                                               "doctor source": "rerun_to_2850/doctor_step_002800",
                                               "doctor probe": "4 × 256"}
    assert doctor_links(tmp_path / "none") == {}


def test_replays_of_the_run_and_the_links_page_17_reads_from_them(tmp_path):
    """Run.replays: replay_step_NNNNNN/replay.json in the run folder and in a rerun_*/ subfolder, by step, each with its
    source; lpfa.pages.stabilisers.replay_links takes the last that instruments the layer and gives Fig. 5's bias test
    of its most biased head, recomputed here by hand from the per-step sums of a committed replay."""
    from lpfa.pages.stabilisers import replay_links, replay_text

    committed = json.loads((ROOT / "results/mechanism/h100-2026-12-06/bf16_mechanism_deterministic_replay/"
                                    "replay.json").read_text())
    run = tmp_path / "bf16_qknorm"
    short = {**committed, "per_step": committed["per_step"][:40]}
    for folder, step, rep in (("", 5000, short), ("rerun_to_2850/", 2800, {**short, "layer": 3})):
        (run / f"{folder}replay_step_{step:06d}").mkdir(parents=True)
        (run / f"{folder}replay_step_{step:06d}" / "replay.json").write_text(json.dumps(rep))
    replays = Run(run).replays
    assert list(replays) == [2800, 5000] and replays[2800]["source"] == "rerun_to_2850/replay_step_002800"
    links = replay_links(run, layer=committed["layer"])
    t, mean, share = {}, {}, {}
    for h in committed["heads"]:  # per head: the t statistic of the per-step Σ δ error, and its tied rows' share
        x = np.array([r["heads"][str(h)]["sum_all"] for r in short["per_step"]])
        t[h], mean[h] = x.mean() / (x.std(ddof=1) / np.sqrt(len(x))), x.mean()
        share[h] = sum(r["heads"][str(h)]["sum_tied"] for r in short["per_step"]) / x.sum()
    worst = max(t, key=lambda h: abs(t[h]))
    assert links["replay step"] == 5000 and links["replay steps"] == 40
    assert links["replay source"] == "replay_step_005000"
    assert links["δ |t| replay"] == pytest.approx(abs(t[worst]), rel=1e-9)
    assert links["δ replay sign"] == ("+" if t[worst] > 0 else "−") and links["replay policy"] == committed["policy"]
    assert links["δ replay mean"] == pytest.approx(mean[worst], rel=1e-9)
    assert links["δ replay tied share"] == pytest.approx(share[worst], rel=1e-9)
    assert replay_links(run, layer=3)["replay step"] == 2800 and replay_links(run, layer=7) == {}
    assert replay_links(tmp_path / "none") == {}
    table = pd.DataFrame([{**links, "seed": 1337}], index=["bf16_qknorm"])
    text = replay_text(table, layer=committed["layer"])
    resolved = "resolved" if abs(t[worst]) >= 3 else "not resolved"
    assert text.startswith("\n\n**The δ bias by replay**") and (
        f"- `bf16_qknorm`: 40 steps from step 5,000, the δ error of `{committed['policy']}`: largest |t| "
        f"{abs(t[worst]):.1f}, mean δ error ") in text and text.endswith(f", {resolved}")
    assert (f"{mean[worst]:.2g} per step, {share[worst]:.0%} of it from rows with a tied maximum, {resolved}"
            in text)
    assert replay_text(table.assign(**{"replay steps": None})) == ""


def test_checkpoint_before_explosion_picks_the_last_kept_state_before_it(tmp_path):
    """Run.checkpoint_before_explosion: the largest kept checkpoint step <= limit and before the explosion step of the
    run's verdict (what paper_recipe.sh's DOCTOR_STEP examines), None when there is none."""
    from dataclasses import asdict

    d = tmp_path / "run"
    for s in (1000, 2000, 3000, 4000):
        (d / "ckpt_history" / f"step_{s:06d}").mkdir(parents=True)
    (d / "config.json").write_text(json.dumps({"train": asdict(TrainConfig())}))
    for jump, limit, expected in ((3100, 5000, 3000), (None, 5000, 4000), (None, 2500, 2000), (400, 5000, None)):
        losses = [1.0 if jump is None or s < jump else 10.0 for s in range(4500)]  # the loss jumps for good at `jump`
        (d / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": v}) + "\n"
                                                 for s, v in enumerate(losses)))
        boom = Run(d).verdict()["explosion_step"]
        assert (boom is None) == (jump is None) and (jump is None or jump <= boom < jump + 100)
        assert Run(d).checkpoint_before_explosion(limit) == expected, (jump, boom, limit)
