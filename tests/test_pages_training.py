"""Page 13's training run, sentences and tables (lpfa.pages.training), against committed runs recomputed here."""

import json
import tempfile

import matplotlib
import pytest
from conftest import full_throughput_run

from lpfa import results
from lpfa.pages import training as tr

matplotlib.use("Agg")


def _ddp_one():
    return results.run_dir("ddp") / "one"


def test_smoke_notes_recompute_the_losses_from_the_metrics():
    run = _ddp_one()
    losses = [r["loss"] for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r]
    conf = json.loads((run / "config.json").read_text())
    notes = tr.smoke_notes(run, {"steps": 200, "wall_s": 12.6, "final_val_loss": 5.4321}, "repro")
    assert notes["smoke_loss_first"] == f"{sum(losses[:10]) / 10:.2f}"
    assert notes["smoke_loss_last"] == f"{sum(losses[-10:]) / 10:.2f}"
    t = conf["train"]
    tokenizer = conf["data_meta"].get("tokenizer") or t["tokenizer"]
    assert notes["smoke_setup"] == (f"`repro` ({t['model']} model, {t['batch_size']}×{t['block_size']} tokens per "
                                    f"step, attention `{t['attn_policy']}`, tokenizer `{tokenizer}`)")
    assert (notes["smoke_steps"], notes["smoke_wall_s"], notes["smoke_val_loss"]) == ("200", "13", "5.43")


def test_plot_head_metric_names_a_run_without_diagnostics():
    with pytest.raises(ValueError, match="has no 'wq_spectral_norm' diagnostics"):
        tr.plot_head_metric(_ddp_one())


def test_train_smoke_configures_the_run_it_trains(tmp_path, monkeypatch):
    seen = {}

    def fake_train(cfg):
        seen["cfg"] = cfg
        return {"steps": cfg.max_steps}

    monkeypatch.setattr(tr, "train_quietly", fake_train)
    out, summary = tr.train_smoke("cpu-smoke", max_steps=30, attn_policy="paper", diag_interval=5,
                                  out_dir=str(tmp_path / "run"))
    cfg = seen["cfg"]
    assert out == tmp_path / "run" and cfg.out_dir == str(out) and summary == {"steps": 30}
    assert (cfg.attn_policy, cfg.diag_interval, cfg.eval_interval, cfg.progress) == ("paper", 5, 10, False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    out, _ = tr.train_smoke(max_steps=2)  # no out_dir: a fresh temporary folder, three evaluations at least every step
    assert out.name == "run" and out.parent.name.startswith("lpfa-smoke-") and seen["cfg"].eval_interval == 1


def test_plot_head_metric_draws_every_head_of_every_layer():
    run = results.run_dir("repro_twins") / "fa2"
    model = json.loads((run / "config.json").read_text())["model"]
    diag = [r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "diag" in r]
    fig = tr.plot_head_metric(run)
    assert len(fig.axes) == model["n_layer"] and all(len(ax.lines) == model["n_head"] for ax in fig.axes)
    assert list(fig.axes[1].lines[2].get_ydata())[-1] == diag[-1]["diag"]["wq_spectral_norm"][1][2]
    assert len(tr.plot_smoke_loss(run, "fa2").axes) >= 1


def test_loss_plot_of_a_short_run_ticks_whole_steps(tmp_path):
    """A run of 20 steps (the small profile's page 13) gets whole-number step ticks, not 2.5, 7.5, ..."""
    from conftest import write_diag_run

    from lpfa.plotting import figure_problems

    run = write_diag_run(tmp_path, "short", [1.0], [0.0], [1.0], losses=[5.0 - 0.1 * s for s in range(20)])
    fig = tr.plot_smoke_loss(run, "fa2")
    assert figure_problems(fig) == []


def test_train_smoke_rejects_an_unknown_policy(tmp_path):
    with pytest.raises(ValueError, match="attn_policy"):
        tr.train_smoke(attn_policy="nope", out_dir=str(tmp_path / "run"))


def test_throughput_notes_name_the_committed_run_and_its_twin():
    """The notes read the latest run of every backend; a later run of some rows gets its own sentence."""
    latest = full_throughput_run()
    prov = json.loads((latest / "provenance.json").read_text())
    tput = json.loads((latest / "throughput.json").read_text())
    table = tr.committed_throughput()
    assert table.loc["sdpa", "ratio to SDPA"] == 1.0
    notes = tr.throughput_notes(table)
    assert notes["tput_run"] == f"`{latest.name}`" and notes["tput_env"].endswith(f"commit `{prov['git_commit']}`")
    r = tput["lpfa_fa2_compiled"]["tokens_per_s"] / tput["sdpa_compiled"]["tokens_per_s"]
    assert f"`fa2` at {r:.3f}×" in notes["tput_text"]
    assert notes["twin_text"].startswith("`fp32_split` trains GPT-2 S at compiled ")
    later = results.runs("train_throughput")
    later = later[later.index(latest) + 1:]
    assert (notes["tput_later"] == "") == (not later)
    for run in later:
        t = json.loads((run / "throughput.json").read_text())
        assert f"A later run, `{run.name}` (one " in notes["tput_later"]
        if "lpfa_fa2_compiled" in t and "sdpa_compiled" in t:
            r = t["lpfa_fa2_compiled"]["tokens_per_s"] / t["sdpa_compiled"]["tokens_per_s"]
            assert f"`fa2` at {r:.3f}×" in notes["tput_later"]
    shown = tr.throughput_display(table)  # a Styler, or Tables when its columns are split to fit the page
    assert all(len(part.data) == len(tput) for part in getattr(shown, "parts", [shown]))


def test_throughput_runs_read_the_latest_run_of_every_backend(tmp_path):
    """A run made with --rows (only some backends) never becomes the pages' run, whatever its date: it is a later run,
    with its own sentence; a root of such runs only is a one-line FileNotFoundError."""
    def run(name, date, rows=None):
        d = tmp_path / "train_throughput" / name
        d.mkdir(parents=True)
        cmd = "python3 benchmarks/train_throughput.py --out /tmp/x --compile" + (f" --rows {rows}" if rows else "")
        (d / "provenance.json").write_text(json.dumps({"date_utc": date, "command": cmd, "git_commit": "abcdef0123",
                                                       "device": "NVIDIA H100 80GB HBM3"}))
        (d / "throughput.json").write_text(json.dumps({"sdpa_compiled": {"tokens_per_s": 400.0},
                                                       "lpfa_fa2_compiled": {"tokens_per_s": 380.0}}))
        return d

    only = run("h100-2026-01-01", "2026-01-01T00:00:00+00:00", "sdpa_compiled,lpfa_fa2_compiled")
    with pytest.raises(FileNotFoundError, match="no run of every backend"):
        tr.throughput_runs(root=tmp_path)
    full = run("h100-2026-01-02", "2026-01-02T00:00:00+00:00")
    later = run("h100-2026-01-03", "2026-01-03T00:00:00+00:00", "sdpa_compiled,lpfa_fa2_compiled")
    assert tr.timed_rows(later) == ["sdpa_compiled", "lpfa_fa2_compiled"] and tr.timed_rows(full) is None
    assert tr.throughput_runs(root=tmp_path) == (full, [later]) and only not in tr.throughput_runs(root=tmp_path)[1]
    text = tr.later_throughput_text([later], root=tmp_path)
    assert text.startswith("A later run, `h100-2026-01-03` (one H100, commit `abcdef0`), timed only `sdpa_compiled`, "
                           "`lpfa_fa2_compiled`; in it, compiled, GPT-2 S trains with `fa2` at 0.950×")


def test_fp32_attention_runs_count_runs_whose_every_layer_is_fp32(tmp_path):
    import shutil

    src = {("isolation", "h200x4-2026-11-29", "fp32"): "sdpa_fp32",  # FP32 by backend
           ("isolation", "h200x4-2026-11-29", "bf16_only_layer1"): None,  # one BF16 layer: not FP32 attention
           ("isolation", "h200x4-2026-11-29", "fp32_only_layer1"): None,  # one FP32 layer: not either
           ("stabilisers", "h200-2026-12-03", "fp32_rerun"): "fp32_split",  # FP32 by policy
           ("paper_recipe", "h200-2026-12-01", "bf16_paper_recipe_s2"): None}
    for (exp, run, label) in src:
        d = tmp_path / exp / run / label
        d.mkdir(parents=True)
        shutil.copy(results.results_dir() / exp / run / label / "config.json", d / "config.json")
    found = tr.fp32_attention_runs(tmp_path)
    assert found == {"fp32_split": ["stabilisers"], "sdpa_fp32": ["isolation"]}
    assert tr.fp32_attention_text(found) == ("`fp32_split` in the committed runs of `stabilisers`; `sdpa_fp32` in the "
                                             "committed runs of `isolation`")
    with pytest.raises(ValueError, match="no committed run has FP32 attention"):
        tr.fp32_attention_text({})
    # the committed store: Fig. 2's FP32 twins ran sdpa_fp32, as page 13 says
    assert "paper_recipe" in tr.fp32_attention_runs()["sdpa_fp32"]
