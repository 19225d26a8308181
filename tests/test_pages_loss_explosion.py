"""Page 06 (the loss explosion): lpfa.pages.loss_explosion's twins, tables, sentences and figures, checked against the
committed results/paper_recipe, repro_pair, repro_twins, dose and throughput runs read from their own files
(config.json, summary.json, provenance.json), and on small tables with known answers."""

import json
from pathlib import Path

import matplotlib
import numpy as np
import pandas as pd
import pytest
from conftest import full_throughput_run

from lpfa.explosion import ExplosionCriterion
from lpfa.pages.loss_explosion import (
    cost_text,
    dose_ladder,
    dose_note,
    dose_runs_table,
    fig2_runs,
    four_modes_text,
    opening_text,
    plot_twin_losses,
    provenance_text,
    repro_numbers,
    twin_runs,
    verdict_table,
)
from lpfa.plotting import MAX_ROWS
from lpfa.run import run_verdict
from lpfa.scaling import PAPER_EXPLOSION_STEP, committed_speed
from lpfa.train import PRESETS

matplotlib.use("Agg")

ROOT = Path(__file__).resolve().parents[1]
TWINS = {"bf16": "bf16_paper_recipe", "fp32": "fp32_paper_recipe"}


def _json(path):
    return json.loads(Path(path).read_text())


def _tokens(train: dict) -> int:
    return train["batch_size"] * train["block_size"] * train.get("grad_accum", 1)


@pytest.fixture(scope="module")
def fig2():
    runs, prov = fig2_runs("paper_recipe", None, TWINS)
    crit = ExplosionCriterion()
    return runs, prov, crit, {label: run_verdict(d, crit) for label, d in runs.items()}


def test_fig2_runs_are_the_committed_twins_with_their_provenance(fig2):
    runs, prov, _, verdicts = fig2
    assert set(runs) == {"bf16", "fp32"} and runs["bf16"].parent == runs["fp32"].parent
    assert runs["bf16"].parent.parent == ROOT / "results" / "paper_recipe"
    assert prov == _json(runs["bf16"].parent / "provenance.json")
    # the verdicts the page glues agree with what the training runs wrote themselves
    for label, d in runs.items():
        summary = _json(d / "summary.json")
        assert (verdicts[label]["exploded"], verdicts[label]["explosion_step"], verdicts[label]["steps"]) == (
            summary["exploded"], summary["explosion_step"], summary["steps"])
    assert verdicts["bf16"]["exploded"] and not verdicts["fp32"]["exploded"]


def test_fig2_runs_reject_bad_twins_in_one_line():
    with pytest.raises(ValueError, match=r"^twins=\{.*\}: \['nope'\] not among the committed runs of 'paper_recipe'"):
        fig2_runs("paper_recipe", None, {"bf16": "nope", "fp32": "fp32_paper_recipe"})
    # a rerun is checked before anything trains
    with pytest.raises(ValueError, match=r"^rerun_experiment='nope': expected an lpfa.experiments experiment"):
        fig2_runs("paper_recipe", None, TWINS, rerun=True, rerun_experiment="nope")


def test_opening_text_carries_the_twins_numbers(fig2):
    runs, _, crit, verdicts = fig2
    conf = _json(runs["bf16"] / "config.json")["train"]
    text = opening_text("paper_recipe", None, TWINS, verdicts, conf, crit)
    bf16 = _json(runs["bf16"] / "summary.json")
    from lpfa.pages import VERDICT_WORDS
    from lpfa.pages.loss_explosion import fate_counts, fig2_verdict, recipe_fates

    # the verdict over every run; the counts are the scorecard's note above the lead, not repeated in it
    assert text.startswith(f"**Fig. 2 is {VERDICT_WORDS[fig2_verdict(recipe_fates())]}** by every committed run")
    assert fate_counts(recipe_fates()) not in text
    assert f"the BF16 twin's loss exploded at step {bf16['explosion_step']:,}" in text
    assert f"**{_tokens(conf):,} tokens per step**" in text
    assert f"about step {PAPER_EXPLOSION_STEP:,}" in text
    assert "BF16-only explosions (Fig. 2): `bf16_paper_recipe`" in text
    assert "dose experiment" not in text  # no dose table given


def test_provenance_text_and_verdict_table(fig2):
    runs, prov, crit, verdicts = fig2
    text = provenance_text(runs, prov, crit)
    assert text.startswith(f"Run `{runs['bf16'].parent.name}`: ")
    assert f"commit `{prov['git_commit']}`" in text and crit.describe() in text
    table = verdict_table(verdicts)
    assert list(table.index) == ["bf16", "fp32"]
    assert list(table.columns) == ["policy", "optimizer", "seed", "steps", "exploded", "explosion_step",
                                   "runaway_step", "runaway_layer"]
    assert table.loc["bf16", "explosion_step"] == _json(runs["bf16"] / "summary.json")["explosion_step"]


def test_plot_twin_losses_marks_the_explosion(fig2):
    runs, _, _, verdicts = fig2
    fig = plot_twin_losses(runs, verdicts, smooth=50, title="Fig. 2")
    ax = fig.axes[0]
    assert ax.get_ylim()[1] <= 8 and ax.get_title() == "Fig. 2"
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert "bf16 explodes" in legend and "fp32 explodes" not in legend
    step = _json(runs["bf16"] / "summary.json")["explosion_step"]
    assert any(list(line.get_xdata()) == [step, step] for line in ax.get_lines())
    fig = plot_twin_losses(runs, smooth=50, top=5)
    assert fig.axes[0].get_ylim()[1] <= 5 and not any("explodes" in t.get_text()
                                                     for t in fig.axes[0].get_legend().get_texts())


def test_repro_numbers_from_the_config():
    runs = twin_runs("repro_pair", {"bf16": "bf16", "fp32": "fp32"})
    conf = _json(runs["bf16"] / "config.json")
    m, t = conf["model"], conf["train"]
    numbers = repro_numbers(runs)
    assert numbers["repro_setup"] == (f"{m['n_layer']} layers, d = {m['n_embd']}, T = {m['block_size']}, "
                                      f"{_tokens(t):,} tokens/step, lr {t['lr']:g} {t['lr_schedule']}")
    assert numbers["repro_steps"] == f"{_json(runs['bf16'] / 'summary.json')['steps']:,}"


def _modes(logits: dict, exploded=()) -> pd.DataFrame:
    return pd.DataFrame({"exploded": [k in exploded for k in logits],
                         "largest attention logit @ 100": list(logits.values())}, index=list(logits))


def test_four_modes_text_says_which_ran_away():
    text = four_modes_text(_modes({"bf16": 500.0, "fp32": 20.0, "sfa": 30.0, "fa2": 18.0}), 100, 1)
    assert text.startswith("0 of 4 runs exploded. At step 100, layer 1's largest attention logit relative to the FP32 "
                           "run's 20: bf16 ×25.0, sfa ×1.5, fa2 ×0.9.")
    assert "only `bf16` lets it run away" in text
    other = four_modes_text(_modes({"bf16": 50.0, "fp32": 20.0, "sfa": 30.0}, exploded={"sfa"}), 100, 2)
    assert other == "1 of 3 runs exploded; layer 2's largest attention logit at step 100: bf16 50, fp32 20, sfa 30."


def test_dose_ladder_fits_the_committed_runs():
    runs, table, fits = dose_ladder()
    if not runs:
        pytest.skip("no committed dose results")
    assert list(table.index) == list(runs)
    for what, fit in fits.items():
        rows = table[(table["sign"] == "bias") & (table["base"] == "paper_untiled") & table[what].notna()]
        x, y = np.log10(rows["k"].to_numpy(float)), np.log10(rows[what].to_numpy(float))
        slope, intercept = np.polyfit(x, y, 1)  # an independent least-squares fit
        assert fit["n"] == len(rows) and fit["slope"] == pytest.approx(slope, rel=1e-9)
        assert fit["predicted_at_1"] == pytest.approx(10 ** intercept, rel=1e-9)
    # every explosion step of the table is the one the training run wrote
    for label, d in runs.items():
        summary = _json(d / "summary.json")
        step = table.loc[label, "explosion step"]
        assert (None if pd.isna(step) else int(step)) == (summary["explosion_step"] if summary["exploded"] else None)
    shown = dose_runs_table(table)
    assert "runaway layer" not in shown and sorted(shown.index) == sorted(table.index)
    assert list(shown["sign"]) == sorted(shown["sign"])


def test_dose_note_carries_the_extrapolation(fig2):
    _, _, crit, verdicts = fig2
    runs, table, fits = dose_ladder()
    if not runs:
        pytest.skip("no committed dose results")
    assert dose_note(None, {}, {}, verdicts) == ""
    text = dose_note(table, fits, runs, verdicts, None, crit)
    fit = fits["explosion step"]
    lo, hi = fit["interval_95"]
    assert text.startswith("**Extrapolating to k = 1.** Extrapolated to dose k = 1, the power law fitted to "
                           f"{fit['n']} bias runs")
    assert (f"puts the explosion at step {fit['predicted_at_1']:,.0f} (95% prediction interval "
            f"{lo:,.0f}–{hi:,.0f})") in text
    seeds = table[(table["sign"] == "bias") & (table["base"] == "paper_untiled")].groupby("k")["explosion step"]
    spread = max(s.max() / s.min() for _, s in seeds if s.notna().sum() > 1)
    assert f"spread by up to {spread:.1f}×" in text
    assert f"it exploded at dose 1, at step {verdicts['bf16']['explosion_step']:,}." in text


def test_cost_text_from_the_committed_speeds(fig2):
    runs = fig2[0]
    speeds = committed_speed("compile_throughput")
    text = cost_text(speeds, runs, None, 30_000)
    latest = full_throughput_run()  # the latest by date of every backend, as the page takes it
    tps = _json(latest / "summary.json")["backends"]["lpfa_paper"]["tokens_per_s"]
    gpu = _json(latest / "provenance.json")["device"].split("NVIDIA ")[1].split()[0]  # "H100", "H200"
    assert f"tokens/s on one {gpu} (GPT-2 S, eager, `results/train_throughput/{latest.name}`)" in text
    tokens = PAPER_EXPLOSION_STEP * _tokens(PRESETS["gpt2-s-paper"])
    assert f"one such run takes {tokens / tps / 3600:.1f} GPU-hours" in text
    minutes = 30_000 * _tokens(PRESETS["repro"]) / speeds.loc["eager", "median tokens/s"] / 60
    assert f"i.e. 30,000 steps in about {minutes:.0f} or " in text
    wall = _json(runs["bf16"] / "summary.json")["wall_s"]
    assert f"reached its explosion in {wall / 60:.0f} minutes" in text


def test_twin_runs_name_a_missing_experiment(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"^experiment='nothing': expected a committed experiment, but .* holds "
                                                r"none$"):
        twin_runs("nothing", {"bf16": "bf16"}, root=tmp_path)



def _recipe_runs_from_files():
    """Every committed run folder of the paper's GPT-2 S recipe with plain BF16 or FP32 attention, read from the
    files alone: config.json's train fields and summary.json's or metrics' verdict."""
    from lpfa.run import Run

    out = {}
    for conf in sorted((ROOT / "results").glob("*/*/*/config.json")):
        t = _json(conf)["train"]
        if (t["model"], t["lr"], t["warmup_steps"], t.get("lr_schedule")) != ("gpt2-s", 1e-3, 2000, "cosine"):
            continue
        if t.get("optimizer", "adamw") != "adamw" or t.get("qk_norm") or t.get("gated_attn") or t.get("qk_clip"):
            continue
        if t.get("layer_policies") or t.get("fp32_heads") or t.get("delta_dose", 1.0) != 1.0 or t.get("sr_reseed"):
            continue
        precision = ("bf16" if (t["attn_backend"], t["attn_policy"]) == ("lpfa", "paper") else
                     "fp32" if t["attn_backend"] == "sdpa_fp32" or t["attn_policy"] == "fp32_split" else None)
        if precision:
            out[conf.parent] = (precision, t["seed"], Run(conf.parent).verdict())
    return out


def test_recipe_fates_are_every_plain_run_of_the_recipe():
    from lpfa.pages.loss_explosion import fate_counts, recipe_fates

    fates = recipe_fates()
    want = _recipe_runs_from_files()
    assert len(fates) == len(want) and len(want) >= 8
    for d, (precision, seed, v) in want.items():
        row = fates.loc[f"{d.parent.parent.name}/{d.parent.name}/{d.name}"]
        assert (row.precision, row.seed, row.exploded, row.steps) == (precision, seed, v["exploded"], v["steps"])
        assert row.end == (v["explosion_step"] if v["exploded"] else v["steps"])
    counts = fate_counts(fates)
    for precision in ("bf16", "fp32"):
        g = [(s, v) for p, s, v in want.values() if p == precision]
        seeds = {s for s, _ in g}
        boom = {s for s, v in g if v["exploded"]}
        assert (f"in {sum(v['exploded'] for _, v in g)} of {len(g)} {precision.upper()} runs, on {len(boom)} of "
                f"{len(seeds)} seeds") in counts
    assert f"{max(v['steps'] for p, _, v in want.values() if p == 'fp32'):,} steps" in counts


def test_horizon_text_counts_what_fig2_verdict_judges():
    """The share by the horizon leaves out runs stopped sooner, says how many, and is the count the verdict uses."""
    from lpfa.pages.loss_explosion import horizon_text

    fates = pd.DataFrame({"precision": ["bf16"] * 4 + ["fp32"] * 2, "end": [5000, 6300, 5100, 5900, 9000, 3000],
                          "exploded": [True, False, False, True, False, False]})
    text = horizon_text(fates, horizon=6000)
    assert "in 2 of 3 BF16 runs (95% interval 9%–99%) and 0 of 1 FP32 runs (95% interval 0%–97%)" in text
    assert text.endswith("; the other 2 stopped too soon to say.")


def test_fig2_verdict_counts_only_runs_that_could_have_exploded():
    """Fig. 2's verdict over the recipe's runs: a BF16 run stopped before the horizon does not count either way; one
    that ran past it without exploding makes the verdict "partly"; an FP32 explosion, or none in BF16, refutes it."""
    from lpfa.pages.loss_explosion import fig2_verdict

    def fates(bf16_ends, bf16_exploded, fp32_exploded=(False,)):
        ends = [*bf16_ends, *[9000] * len(fp32_exploded)]
        return pd.DataFrame({"precision": ["bf16"] * len(bf16_ends) + ["fp32"] * len(fp32_exploded),
                             "end": ends, "exploded": [*bf16_exploded, *fp32_exploded],
                             "seed": range(len(ends))})

    assert fig2_verdict(fates([5000, 5800, 5100], [True, True, False]), horizon=6000) == "reproduced"  # 5,100: too soon
    assert fig2_verdict(fates([5000, 6300], [True, False]), horizon=6000) == "partly"
    assert fig2_verdict(fates([5000, 5300], [True, False]), horizon=5500) == "reproduced"
    assert fig2_verdict(fates([5000], [True], fp32_exploded=(False, True)), horizon=6000) == "not reproduced"
    assert fig2_verdict(fates([6300], [False]), horizon=6000) == "not reproduced"
    assert fig2_verdict(pd.DataFrame()) == "not run"


def test_survival_table_and_text_on_known_runs():
    from lpfa.pages.loss_explosion import plot_survival, survival_table, survival_text

    fates = pd.DataFrame({"precision": ["bf16"] * 4 + ["fp32"] * 2, "seed": [1, 2, 3, 3, 1, 2],
                          "compiled": [True, True, True, False, True, True],
                          "steps": [5200, 6000, 7000, 6500, 9000, 4000],
                          "exploded": [True, True, False, False, False, False],
                          "explosion step": [5000, 5900, None, None, None, None], "runaway step": [None] * 6,
                          "end": [5000, 5900, 7000, 6500, 9000, 4000]}, index=[f"e/r/run{i}" for i in range(6)])
    km = survival_table(fates)
    bf = km[km.precision == "bf16"]
    assert bf.step.tolist() == [0, 5000, 5900, 7000] and bf.survival.tolist() == pytest.approx([1, 0.75, 0.5, 0.5])
    assert km[km.precision == "fp32"].survival.tolist() == [1.0, 1.0]
    text = survival_text(fates, horizon=6000)
    assert text.startswith("The loss exploded in 2 of 4 BF16 runs, on 2 of 3 seeds (at steps 5,000 and 5,900; the "
                           "other 2 stopped without exploding at 6,500 to 7,000 steps) and in 0 of 2 FP32 runs")
    assert "by then in 2 of 4 BF16 runs (95% interval 7%–93%) and 0 of 1 FP32 runs" in text  # 4,000: too soon
    assert "run2" not in text  # each run's row is the table's and its CSV's, not the sentence's
    assert len(plot_survival(fates).axes[0].get_lines()) >= 2
    assert survival_text(pd.DataFrame()) == "No run of the paper's GPT-2 S recipe is committed."


def test_fates_summary_counts_each_precision_and_seed():
    """Page 06's table: one row per (precision, seed), the runs and explosions of that seed, the longest run that did
    not explode and the earliest runaway; the full table (every run) goes to a CSV instead."""
    from lpfa.pages.loss_explosion import fates_summary, full_fates_table, recipe_fates

    fates = pd.DataFrame({"precision": ["bf16"] * 4 + ["fp32"] * 2, "seed": [3, 1, 3, 3, 1, 3],
                          "compiled": [True] * 6, "steps": [5200, 6000, 7000, 5500, 9000, 4000],
                          "exploded": [True, False, False, True, False, False],
                          "explosion step": [5000, None, None, 5400, None, None],
                          "runaway step": [3000, None, 2800, None, None, None],
                          "end": [5000, 6000, 7000, 5400, 9000, 4000]}, index=[f"e/r/run{i}" for i in range(6)])
    t = fates_summary(fates)
    assert t.index.tolist() == [("bf16", 1), ("bf16", 3), ("fp32", 1), ("fp32", 3)]
    assert t.loc[("bf16", 3)].tolist() == [3, 2, "5,000, 5,400", 7000, 2800]
    assert t.loc[("bf16", 1), "explosion steps"] == "" and pd.isna(t.loc[("bf16", 1), "first runaway step"])
    assert t.loc[("fp32", 3), "longest run without exploding"] == 4000
    committed = recipe_fates()
    assert len(fates_summary(committed)) <= MAX_ROWS and fates_summary(pd.DataFrame()).empty
    full, what, sources = full_fates_table()
    assert full.index.tolist() == committed.index.tolist() and "end" not in full.columns
    assert sources == sorted(sources) and all(s.startswith("results/") for s in sources)


def test_batch_text_says_what_the_smaller_batch_changes():
    from lpfa.data import GPU_CORPUS_TRAIN_TOKENS
    from lpfa.pages.loss_explosion import batch_text

    conf = {**PRESETS["gpt2-s-paper"], "batch_size": 24, "grad_accum": 1}
    text = batch_text(conf, 5136)
    assert "21× more optimizer steps per token" in text and "span 49M tokens instead of 1.05B" in text
    assert f"seen {5136 * 24 * 1024 / GPU_CORPUS_TRAIN_TOKENS:.1f} times by the explosion at step 5,136" in text
    assert f"{6000 * 24 * 1024 / GPU_CORPUS_TRAIN_TOKENS:.1f} times by step 6,000" in text


def test_same_seed_text_lists_each_repeated_seed_and_nothing_else():
    """Only seeds with two or more runs of the precision are named, each with where its runs exploded or stopped;
    survival_text ends with it; no repeated seed, no sentence."""
    from lpfa.pages.loss_explosion import same_seed_text, survival_text

    fates = pd.DataFrame({"precision": ["bf16"] * 5 + ["fp32"] * 2, "seed": [7, 7, 7, 2, 9, 7, 7],
                          "compiled": [True] * 7, "steps": [5200, 6400, 6900, 5000, 8000, 9000, 4000],
                          "exploded": [True, False, True, True, False, False, False],
                          "explosion step": [5100, None, 6800, 4900, None, None, None],
                          "runaway step": [None] * 7, "end": [5100, 6400, 6800, 4900, 8000, 9000, 4000]},
                         index=[f"e/r/run{i}" for i in range(7)])
    text = same_seed_text(fates)
    assert text.startswith("A seed does not fix the step: the 3 BF16 runs of seed 7: 2 exploded at steps 5,100 and "
                           "6,800, and 1 stopped without exploding at 6,400 steps. ")
    assert "seed 2" not in text and "seed 9" not in text
    assert same_seed_text(fates, "fp32").startswith("A seed does not fix the step: the 2 FP32 runs of seed 7 stopped "
                                                    "without exploding at 4,000 and 9,000 steps. ")
    assert survival_text(fates).endswith(text)
    assert same_seed_text(fates.iloc[2:5]) == "" and same_seed_text(pd.DataFrame()) == ""


def test_seed_twins_judge_each_seed_by_its_first_bf16_explosion_or_last_step():
    """A seed whose BF16 runs exploded needs an FP32 run TWIN_MARGIN steps past the first explosion; one whose BF16
    runs did not needs one as far as the furthest of them; an FP32 run that exploded is no twin; a seed with one
    precision only is left out. The text counts the seeds and names how far short each other one stopped."""
    from lpfa.pages.loss_explosion import TWIN_MARGIN, seed_twins, seed_twins_text

    first = 5000
    rows = [  # (seed, precision, exploded, end)
        (1, "bf16", True, first + 700), (1, "bf16", True, first), (1, "fp32", False, first + TWIN_MARGIN),
        (2, "bf16", True, first), (2, "fp32", False, first + TWIN_MARGIN - 1),
        (3, "bf16", False, 5100), (3, "fp32", False, 5100),
        (4, "bf16", False, 5100), (4, "fp32", False, 5099),
        (5, "bf16", False, 5100), (5, "fp32", True, 7000),
        (6, "bf16", True, 4000),
    ]
    fates = pd.DataFrame([{"seed": s, "precision": p, "exploded": x, "explosion step": e if x else None,
                           "steps": e + (300 if x else 0), "end": e} for s, p, x, e in rows],
                         index=[f"e/r/run{i}" for i in range(len(rows))])
    twins = seed_twins(fates)
    assert twins.index.tolist() == [1, 2, 3, 4, 5]
    assert twins.twin.tolist() == [True, False, True, False, False]
    assert twins.loc[1, "BF16 step"] == first and twins.loc[1, "steps past"] == TWIN_MARGIN
    assert twins.loc[4, "steps past"] == -1 and twins.loc[5, "FP32 exploded"]
    text = seed_twins_text(twins)
    assert "2 of 5 seeds have one (seed 1, 1,000 steps past its BF16 explosion at step 5,000; seed 3, 0 steps" in text
    assert "seed 2, 999 steps past its BF16 explosion at step 5,000" in text
    assert "seed 4, 1 step short of its BF16 run's last step, 5,100" in text
    assert "seed 5, 1,900 steps past its BF16 run's last step, 5,100, and its FP32 attention exploded" in text
    assert seed_twins_text(seed_twins(fates.iloc[-1:])) == "No seed of the recipe has both a BF16 and an FP32 run."
