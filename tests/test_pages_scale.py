"""Page 14's tables and sentences (lpfa.pages.scale) against the committed 1- vs 2-GPU run, recomputed here."""

import json
import math
import re
import statistics

import matplotlib
import pytest

from lpfa import results
from lpfa.pages import scale as sc
from lpfa.scaling import PAPER_EXPLOSION_STEP, PAPER_TOKENS_PER_STEP

matplotlib.use("Agg")


@pytest.fixture(scope="module")
def cmp():
    return sc.ddp_comparison("ddp", None, skip=50)


def _metrics(run):
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r}


def test_labels_and_throughput_table_follow_the_world_sizes(cmp):
    folder = results.run_dir("ddp")
    worlds = [json.loads((folder / k / "config.json").read_text())["world_size"] for k in ("one", "two")]
    assert sc.run_labels(cmp) == {"a": f"{worlds[0]} GPU", "b": f"{worlds[1]} GPUs"}
    t = sc.throughput_table(cmp)
    tok = [statistics.median(r["tokens_per_s"] for s, r in _metrics(folder / k).items() if s >= 50)
           for k in ("one", "two")]
    assert list(t.index) == ["1 GPU", "2 GPUs"] and list(t["processes (GPUs)"]) == worlds
    assert list(t["median tokens/s, steps ≥ 50"]) == [round(x) for x in tok]
    assert t.loc["2 GPUs", "speedup"] == round(tok[1] / tok[0], 2)


def test_agreement_notes_recompute_the_first_step_apart(cmp):
    folder = results.run_dir("ddp")
    a, b = _metrics(folder / "one"), _metrics(folder / "two")
    common = sorted(set(a) & set(b))
    rel = {s: abs(b[s]["loss"] - a[s]["loss"]) / abs(a[s]["loss"]) for s in common}
    notes = sc.agreement_notes(cmp)
    assert notes["ag_first_above"] == str(next(s for s in common if rel[s] > 1e-3))
    assert notes["ag_tight_until"] == str(next(s for s in common if rel[s] >= sc.TIGHT) - 1)
    assert notes["ag_n_steps"] == str(len(common)) and notes["ag_late_n"] == str(sc.LATE_STEPS)
    assert notes["ag_all_max"] == f"{max(rel.values()):.1e}"
    assert (notes["fp32_eps"], notes["bf16_eps"], notes["ag_tight"]) == ("1.2e-07", "7.8e-03", "1e-5")
    late = common[-sc.LATE_STEPS:]
    assert notes["ag_late_loss_a"] == f"{statistics.mean(a[s]['loss'] for s in late):.3f} on 1 GPU"
    assert sc.agreement_display(cmp).data.shape == sc.agreement_table(cmp).shape


def test_speed_notes_read_the_model_size_and_step_time(cmp):
    one = results.run_dir("ddp") / "one"
    notes = sc.speed_notes(cmp)
    size = re.search(r"([\d.]+)M parameters", (one / "log.txt").read_text()).group(1)
    assert notes["sp_params"] == f"{size}M"
    tp = cmp["throughput"]
    block = json.loads((one / "config.json").read_text())["train"]["block_size"]
    assert notes["sp_ms_b"] == f"{1e3 * tp['batch_a'] * block / tp['tokens_per_s_b']:.0f}"
    assert notes["sp_batch"] == f"{tp['batch_a']} × {block}" and notes["sp_gpu_ratio"] == "2"


def test_provenance_notes_carry_no_tracker_number():
    prov = results.load("ddp", "provenance.json")
    notes = sc.provenance_notes()
    assert notes["ddp_run"] == f"`{results.run_dir('ddp').name}`"
    assert not re.search(r"issue \d", notes["ddp_what"]) and f"commit `{prov['git_commit']}`" in notes["ddp_what"]


def test_paper_scale_minutes_recomputed_from_the_probe_speed(cmp):
    tps = sc.one_gpu_speed()
    plan, notes = sc.paper_scale(cmp, gpus=8, budget_min=24)
    minutes = (PAPER_EXPLOSION_STEP * PAPER_TOKENS_PER_STEP / (tps * 8) + 120) / 60
    assert notes["ps_paper_min"] == f"{minutes:.0f}" and notes["ps_tps"] == f"{tps:,.0f}"
    assert plan.loc["paper", "fits"] == (minutes <= 24)
    eff = cmp["throughput"]["efficiency"]
    minutes_eff = (PAPER_EXPLOSION_STEP * PAPER_TOKENS_PER_STEP / (tps * 8 * eff) + 120) / 60
    assert notes["ps_paper_min_eff"] == f"{minutes_eff:.0f}"
    assert notes["ps_split"].startswith(f"{plan.loc['paper', 'micro-batch']} sequences per micro-batch")
    assert notes["ps_status"].startswith(("Committed paper-scale runs", "No paper-scale run"))
    assert math.isfinite(tps) and tps > 0


def test_bad_input_is_named():
    with pytest.raises(FileNotFoundError, match="no run 'nope'"):
        sc.ddp_comparison("ddp", "nope")
    with pytest.raises(ValueError, match="budget_s=0"):
        sc.paper_scale({"throughput": {"efficiency": 0.8}}, gpus=8, budget_min=0)
