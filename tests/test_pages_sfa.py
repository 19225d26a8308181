"""Page 09 (SFA): the recipe twins, the β-sweep tables, figures and sentences, the Muon and second-size sections and the
dose row of lpfa.pages.sfa, checked against the committed results (paper_recipe, repro_twins, repro_pair, sfa_muon,
sizes, muon_long, dose) recomputed from their raw records and sweep files, and the not-run branches."""

import json

import matplotlib
import pytest
from conftest import ROOT

from lpfa.experiments import MUON_LR2, SFA_MUON, SIZES
from lpfa.pages import RERUN_PAGE, sfa
from lpfa.pages.loss_explosion import recipe_rows
from lpfa.results import experiment_rows, run_dir, what
from lpfa.run import read_records, run_verdict
from lpfa.scaling import committed_speed, wall_minutes
from lpfa.sfa_sweep import sweep_frame
from lpfa.train import PRESETS

matplotlib.use("Agg")

RECIPE = {"bf16": "bf16_paper_recipe", "sfa": "sfa_paper_recipe", "fp32": "fp32_paper_recipe"}
TWINS = {"bf16": "bf16", "sfa": "sfa", "fp32": "fp32"}


def _sweep(path, layer=1) -> dict:
    """``{step: {beta: {sfa, attenuated, silenced, zeroed, rows}}}`` of ``layer`` from a raw sfa_sweep.json."""
    return {int(s): {float(b): v for b, v in layers[layer].items()}
            for s, layers in json.loads(path.read_text())["steps"].items()}


def _final_eval(run) -> float:
    return [r["val_loss"] for r in read_records(run) if "val_loss" in r][-1]


@pytest.fixture(scope="module")
def runs():
    return sfa.twin_runs("repro_twins", None, TWINS)


@pytest.fixture(scope="module")
def measured():
    return sfa.second_looks(1)


def test_recipe_twins_text_and_provenance():
    assert sfa.recipe_runs("", RECIPE) == {}
    recipe = sfa.recipe_runs("paper_recipe", RECIPE)
    rows = recipe_rows("paper_recipe")
    assert recipe == {label: rows[name] for label, name in RECIPE.items()}
    found = sfa.sfa_findings(recipe)
    text = sfa.recipe_text(recipe, RECIPE, "paper_recipe", found)
    sfa_v, bf16_v = run_verdict(recipe["sfa"]), run_verdict(recipe["bf16"])
    assert text.startswith(f"**With SFA the loss did not explode in {sfa_v['steps']:,} steps**, ")
    assert f"the step at which its BF16 twin exploded ({bf16_v['explosion_step']:,})" in text
    prov = sfa.recipe_provenance(recipe, "paper_recipe")
    for d in recipe.values():
        p = json.loads((d / "config.json").read_text())["provenance"]
        where = f"{p['device']}, commit `{p['git_commit'][:7]}`, {p['date_utc'][:10]}"
        assert f"`{d.parent.name}/{d.name}` ({where})" in prov
    partial = sfa.recipe_runs("paper_recipe", {**RECIPE, "sfa": "no_such_twin"})
    assert set(partial) == {"bf16", "fp32"} and sfa.recipe_provenance(partial, "paper_recipe") == ""
    assert sfa.recipe_text(partial, {**RECIPE, "sfa": "no_such_twin"}, "paper_recipe", None) == (
        "**Fig. 7 is not run at the paper's recipe yet:** of ['bf16_paper_recipe', 'fp32_paper_recipe', "
        "'no_such_twin'], `results/paper_recipe` has ['bf16_paper_recipe', 'fp32_paper_recipe']. The sections below "
        "validate SFA on the `repro` preset's logit runaway.")


def test_recipe_text_compares_sfa_with_fp32_on_held_out_text_too():
    """The SFA/FP32 comparison states the validation losses at their last common evaluation, recomputed here from the
    raw records, and how often the corpus had been seen by then: the FP32 run's training loss falls by memorising."""
    from lpfa.data import GPU_CORPUS_TRAIN_TOKENS

    recipe = sfa.recipe_runs("paper_recipe", RECIPE)
    found = sfa.sfa_findings(recipe)
    evals = {label: {r["step"]: r["val_loss"] for r in read_records(recipe[label]) if "val_loss" in r}
             for label in ("sfa", "fp32")}
    step = max(set(evals["sfa"]) & set(evals["fp32"]) & set(range(found["loss step"] + 1)))
    assert found["val step"] == step
    conf = json.loads((recipe["fp32"] / "config.json").read_text())["train"]
    epochs = step * conf["batch_size"] * conf["grad_accum"] * conf["block_size"] / GPU_CORPUS_TRAIN_TOKENS
    text = sfa.sfa_text(found, n_layers=12)
    assert (f"(validation loss at step {step:,}: {evals['sfa'][step]:.2f} with SFA, {evals['fp32'][step]:.2f} "
            f"with FP32)") in text
    assert f"corpus {epochs:.1f} times" in text


def test_recipe_loss_figure_marks_the_bf16_explosion():
    recipe = sfa.recipe_runs("paper_recipe", RECIPE)
    found = sfa.sfa_findings(recipe)
    ax = sfa.plot_recipe_losses(recipe, found).axes[0]
    assert ax.get_ylim()[1] <= 7
    assert [tuple(line.get_xdata()) for line in ax.lines if line.get_label() == "bf16 explodes"] == [
        (run_verdict(recipe["bf16"])["explosion_step"],) * 2]


def test_twin_verdicts_and_note(runs):
    folder = run_dir("repro_twins")
    assert runs == {label: folder / name for label, name in TWINS.items()}
    verdicts = sfa.twin_verdicts(runs)
    assert list(verdicts.index) == list(TWINS) and set(sfa.VERDICT_COLUMNS) <= set(verdicts.columns)
    assert verdicts.loc["sfa", "steps"] == run_verdict(runs["sfa"])["steps"]
    prov = json.loads((folder / "provenance.json").read_text())
    shown = what(prov).rstrip(". ")
    assert sfa.twins_note("repro_twins", runs).startswith(
        f"Run `{folder.name}`: {shown}. {prov['device']}, commit `{prov['git_commit']}`. To regenerate: ")


def test_last_sweep_table_is_the_last_checkpoint_of_the_sweep_files(runs):
    sweeps = sfa.sweeps_of(runs)
    assert sweeps == {label: runs[label] / "sfa_sweep.json" for label in ("bf16", "sfa")}  # fp32 has none
    frames = {label: sweep_frame(p) for label, p in sweeps.items()}
    table = sfa.last_sweep_table(frames, 1)
    for label, path in sweeps.items():
        raw = _sweep(path)
        for beta, v in raw[max(raw)].items():
            assert table.loc[(label, beta)].to_dict() == pytest.approx({k: v[k] for k in sfa.SWEPT})
    with pytest.raises(ValueError, match=r"^layer=42: expected a layer of the sweep, 0 to 7$"):
        sfa.last_sweep_table(frames, 42)


def test_sweep_text_numbers_from_the_sweeps_and_logged_logits(runs):
    sweeps = sfa.sweeps_of(runs)
    frames = {label: sweep_frame(p) for label, p in sweeps.items()}
    verdicts = sfa.twin_verdicts(runs)
    text = sfa.sweep_text(frames, verdicts, runs, 1)
    common = min(run_verdict(d)["steps"] for d in runs.values()) // 100 * 100
    logits = {}
    for label, d in runs.items():  # layer 1's largest logit at the last diagnostics record up to the common step
        recs = [r for r in read_records(d) if "diag" in r and r["step"] <= common]
        logits[label] = max(recs[-1]["diag"]["max_logit"][1])
    assert (f"At step {common:,}, layer 1's largest attention logit is {logits['sfa']:.0f} with SFA, "
            f"{logits['fp32']:.0f} with FP32 and {logits['bf16']:.0f} with BF16 attention.") in text
    s, b = _sweep(sweeps["sfa"]), _sweep(sweeps["bf16"])
    s_last, b_last = s[max(s)], b[max(b)]
    assert (f"SFA touches {s_last[2.0]['sfa']:.1%} of layer 1's rows; with β = 2 the row-sum clamp attenuates "
            f"{s_last[2.0]['attenuated']:.1%} and silences {s_last[2.0]['silenced']:.1%}") in text
    assert f"β = 8 {s_last[8.0]['silenced']:.1%}" in text
    assert (f"(its last checkpoint, step {max(b):,}), β = 2 would silence {b_last[2.0]['silenced']:.1%} of layer 1's "
            f"rows and zero {b_last[2.0]['zeroed']:.1%}.") in text


def test_long_sweep_text_follows_the_30k_step_run():
    assert sfa.long_sweep("") == {} and sfa.long_sweep_text({}, 1) == ""
    sweeps = sfa.long_sweep("repro_pair")
    path = sweeps["bf16, 30k steps"]
    assert path == run_dir("repro_pair") / "bf16" / "sfa_sweep.json"
    raw = _sweep(path)
    first, last = min(raw), max(raw)
    text = sfa.long_sweep_text(sweeps, 1)
    assert text.startswith(f"With β = 2, the share of layer 1's rows that SFA would silence goes from "
                           f"{raw[first][2.0]['silenced']:.1%} at step {first:,} to a peak of "
                           f"{max(v[2.0]['silenced'] for v in raw.values()):.1%}")
    assert f"{raw[last][2.0]['silenced']:.1%} at step {last:,}, where {raw[last][2.0]['zeroed']:.1%} would be" in text
    share = raw[last][2.0]["silenced"] / raw[last][2.0]["sfa"]
    assert text.endswith(f"so it silences {share:.0%} of the rows it touches.")


def test_sweep_figure_draws_one_line_per_beta_and_names_a_bad_quantity(runs):
    sweeps = sfa.sweeps_of(runs)
    fig = sfa.plot_sweep(sweeps, 1, "zeroed")
    assert len(fig.axes) == len(sweeps)
    raw = _sweep(sweeps["bf16"])
    line = next(line for line in fig.axes[0].lines if line.get_label() == "β = 2")
    assert list(line.get_xdata()) == sorted(raw)
    assert list(line.get_ydata()) == [raw[s][2.0]["zeroed"] for s in sorted(raw)]
    with pytest.raises(ValueError, match=r"^what='muted': expected one of sfa, attenuated, silenced, zeroed$"):
        sfa.plot_sweep(sweeps, 1, "muted")


def test_second_looks_hold_the_committed_rows_and_the_plans_cost_the_rest(measured):
    assert set(measured) == {"sfa_muon", "sizes"}
    for exp, labels in (("sfa_muon", SFA_MUON), ("sizes", SIZES)):
        rows, table, step = measured[exp]
        assert rows == experiment_rows(exp, list(labels)) and list(table.index) == list(rows)
        caption = sfa.second_look_table(exp, rows, table, step).caption
        assert caption == f"results/{exp}/{next(iter(rows.values())).parent.name}: precursor values at step {step:,}"
    assert sfa.plans_text(measured, 8000, 4) == ""
    plans = sfa.plans_text({}, 8000, 4).split("\n\n")
    assert len(plans) == 2 and plans[0].startswith("**Not run yet** (`sfa_muon`: `bf16_muon`, `fp32_muon`, `sfa_muon`)")
    assert all(p.endswith(f"({RERUN_PAGE} gives the commands).") for p in plans)  # the commands: book/rerun.md
    tps = committed_speed().loc["compiled", "median tokens/s"]
    minutes = wall_minutes(8000, tps, PRESETS["repro"], runs=3, gpus=4)
    assert f"3 runs take about {minutes:.0f} minutes on 4 H200s" in plans[0]
    assert f"({tps:,.0f} tokens/s per GPU" in plans[0]
    assert plans[1].startswith("**Not run yet** (`sizes`") and "(estimated: the measured `repro` throughput" in plans[1]


def test_muon_section_on_the_committed_rows(measured):
    assert sfa.sfa_muon_text({}, None, 1) == "" and sfa.muon_sweeps({}) == {}
    t_adam = sfa.adamw_table(1)
    assert list(t_adam.index) == ["bf16", "fp32"]
    rows, table, _ = measured["sfa_muon"]
    text = sfa.sfa_muon_text(measured, t_adam, 1)
    assert "Final eval losses: " + ", ".join(f"{label} {_final_eval(rows[label]):.3f}" for label in rows) + "." in text
    pre_m, pre_a = table.loc["bf16_muon", "logit apart from"], t_adam.loc["bf16", "logit apart from"]
    assert f"from step {pre_m:,} with Muon against {pre_a:,} with AdamW" in text
    raw = _sweep(rows["sfa_muon"] / "sfa_sweep.json")
    silenced = [v[2.0]["silenced"] for v in raw.values()]
    assert f"At β = 2 it silenced between {min(silenced):.1%} and {max(silenced):.1%} of layer 1's rows" in text
    assert set(sfa.muon_sweeps(measured)) == {label for label in ("sfa_muon", "bf16_muon")
                                              if (rows[label] / "sfa_sweep.json").exists()}


def test_muon_long_and_sizes_texts(measured):
    not_run = f"The Muon twins at lr {MUON_LR2:g} (`lpfa.experiments.MUON_LONG`) are not run yet."
    assert sfa.muon_long_text({}, {}) == not_run
    long = sfa.muon_long_runs()
    text = sfa.muon_long_text(long, measured)
    assert text.startswith(f"**Muon again, and at lr {MUON_LR2:g}** (`results/muon_long`). " + sfa.muon_text(long))
    assert sfa.sizes_text({}, None) == ""
    rows, table, _ = measured["sizes"]
    sizes = sfa.sizes_text(measured, sfa.adamw_table(1))
    assert sizes.startswith(f"* **At GPT-2 S size**: the BF16 run {sfa.outcome_text(table, 'bf16_gpt2s')};")
    assert f"with a final eval loss of {_final_eval(rows['sfa_gpt2s']):.2f}." in sizes
    stopped = [label for label, d in rows.items()
               if json.loads((d / "summary.json").read_text())["status"] == "stopped"]
    assert (", ".join(f"`{label}`" for label in stopped) + " were stopped by hand" in sizes) == bool(stopped)


def test_dose_text_reads_the_sfa_row():
    d = experiment_rows("dose")["sfa_bias_x256"]
    boom = run_verdict(d)["explosion_step"]
    plain = run_verdict(experiment_rows("dose")["bias_x256"])["explosion_step"]
    assert sfa.dose_text() == (
        f"With SFA (β = 2) and layer 1's δ error × 256, the loss exploded at step {boom:,}, against step {plain:,} for "
        "the same dose without SFA: in this one pair, SFA delayed the amplified explosion but did not prevent it. At "
        "dose 1, where the "
        "only δ error is the one the ties create, none of the SFA runs above exploded.")


def test_gpt2m_price_from_the_committed_logs():
    """Fig. 7c's price, recomputed from the raw metrics: compilation is step 0, the price per step the median after it;
    the GPT-2 S explosion steps come from the recipe seeds."""
    import numpy as np

    from lpfa.pages.loss_explosion import recipe_fates

    price = sfa.gpt2m_price()
    folder = run_dir("gpt2m_price")
    assert price.index.name == folder.name and set(price.index) == {"bf16_paper_recipe", "fp32_paper_recipe"}
    raw = {label: [r for r in read_records(folder / label) if "step_s" in r] for label in price.index}
    tok = {label: float(np.median([r["tokens_per_s"] for r in recs if r["step"] >= 1])) for label, recs in raw.items()}
    minutes = {label: (recs[0]["step_s"] + 6000 * np.median([r["step_s"] for r in recs[1:]])) / 60
               for label, recs in raw.items()}
    fates = recipe_fates()
    text = sfa.gpt2m_text(price, 6000, fates)
    boom = sorted(int(s) for s in fates.loc[fates.precision == "bf16", "explosion step"].dropna())
    assert len(boom) >= 3
    # every explosion step of the recipe, reruns of a seed included (the scorecard counts them all)
    assert ", ".join(f"{s:,}" for s in boom[:-1]) in text
    assert (", past every step at which" in text if boom[-1] < 6000 else  # not past a step the run does not reach
            f", past {sum(s < 6000 for s in boom)} of the {len(boom)} steps at which" in text)
    for number in (f"{tok['bf16_paper_recipe']:,.0f} tokens/s with BF16", f"{tok['fp32_paper_recipe']:,.0f} tokens/s "
                   "with FP32", f"about {minutes['bf16_paper_recipe']:.0f} minutes in BF16",
                   f"{minutes['fp32_paper_recipe']:.0f} in FP32", f"{boom[-1]:,})",
                   f"about {2 * minutes['bf16_paper_recipe'] + minutes['fp32_paper_recipe']:.0f} minutes of one H200",
                   f"{len(raw['bf16_paper_recipe']):,} and {len(raw['fp32_paper_recipe']):,} steps"):
        assert number in text, number
    assert tok["fp32_paper_recipe"] < tok["bf16_paper_recipe"]  # FP32 attention is the slower
    assert "not tested in this book" in text  # no GPT-2 M training run is committed
    assert sfa.gpt2m_text(sfa.gpt2m_price("no_such_experiment"), 6000, fates).startswith("GPT-2 M (Fig. 7c) is not run")


def test_gpt2m_scorecard_row_and_page_give_one_price(tmp_path):
    """The scorecard's Fig. 7c row and page 09's sentence state the same minutes (one function prices both)."""
    from lpfa.book import notebook_parameters
    from lpfa.pages.intro import _gpt2m_row
    price = sfa.gpt2m_price()
    row = _gpt2m_row(None)
    total = f"about {sfa.gpt2m_minutes(price, sfa.GPT2M_STEPS):.0f} minutes of one H200"
    assert row["verdict"] == "not run" and row["page"] == "09_sfa" and total in row["our result"]
    assert total in sfa.gpt2m_text(price, sfa.GPT2M_STEPS)
    # the page's default is the scorecard's: its parameters cell sets gpt2m_steps to the same constant
    assert notebook_parameters(ROOT / "notebooks" / "09_sfa.ipynb")["gpt2m_steps"] == sfa.GPT2M_STEPS
    assert _gpt2m_row(tmp_path)["our result"] == "not run, not priced"
