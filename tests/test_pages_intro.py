"""The intro page: lpfa.pages.intro's Fig. 2 line, figure and text numbers, checked against the committed
results/paper_recipe and results/repro_pair runs read from their own files (config.json, summary.json)."""

import json
from pathlib import Path

import matplotlib
import pandas as pd
import pytest

from lpfa.data import GPU_CORPUS_TRAIN_TOKENS
from lpfa.pages.intro import COLUMNS, fig2_text, intro_numbers, plot_fig2, summary_text
from lpfa.pages.loss_explosion import fig2_twins
from lpfa.train import PRESETS

matplotlib.use("Agg")

ROOT = Path(__file__).resolve().parents[1]


def _json(path):
    return json.loads(Path(path).read_text())


def _tokens(train: dict) -> int:
    return train["batch_size"] * train["block_size"] * train.get("grad_accum", 1)


def _card(*verdicts) -> pd.DataFrame:
    return pd.DataFrame([[f"claim {i}", "Fig. 2", f"result {i}", v, "06_loss_explosion"]
                         for i, v in enumerate(verdicts)], columns=COLUMNS)


def test_fig2_text_and_summary_on_a_small_card():
    card = _card("partly", "reproduced", "reproduced", "not run")
    assert fig2_text(card) == "Fig. 2 (partly): result 0"
    assert summary_text(card) == "Of the 4 claims on this card, 2 reproduced, 1 partly and 1 not run."
    assert summary_text(_card("shown")) == "Of the 1 claims on this card, 1 shown."


def test_intro_numbers_from_the_configs():
    numbers = intro_numbers("paper_recipe", "repro_pair")
    bf16 = next(iter(fig2_twins("paper_recipe").values()))["bf16"]
    ratio = _tokens(PRESETS["gpt2-s-paper"]) / _tokens(_json(bf16 / "config.json")["train"])
    assert numbers["batch_ratio"] == f"{ratio:.0f}"
    repro = sorted((ROOT / "results" / "repro_pair").iterdir())[-1] / "bf16"
    m = _json(repro / "config.json")["model"]
    assert numbers["repro_model"] == f"{m['n_layer']} layers, d = {m['n_embd']}, T = {m['block_size']}"
    assert numbers["repro_steps"] == f"{_json(repro / 'summary.json')['steps']:,}"
    assert numbers["corpus_tokens"] == f"{GPU_CORPUS_TRAIN_TOKENS / 1e6:.0f}M"


def test_intro_numbers_name_a_missing_experiment(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"^experiment='paper_recipe': expected a committed experiment, but "):
        intro_numbers("paper_recipe", "nothing", root=tmp_path)


def test_plot_fig2_marks_the_bf16_explosion(tmp_path):
    fig = plot_fig2("paper_recipe")
    ax = fig.axes[0]
    assert ax.get_title().startswith("Fig. 2 here") and ax.get_ylim()[1] <= 8
    legend = [t.get_text() for t in ax.get_legend().get_texts()]
    assert legend.count("bf16 explodes") == 1 and "fp32 explodes" not in legend
    bf16 = next(iter(fig2_twins("paper_recipe").values()))["bf16"]
    step = _json(bf16 / "summary.json")["explosion_step"]
    assert any(list(line.get_xdata()) == [step, step] for line in ax.get_lines())
    assert plot_fig2("paper_recipe", root=tmp_path) is None  # no committed twins: no figure


def test_the_pages_word_helpers():
    from lpfa.pages import and_join, capital, gpu_name, plural

    assert [plural(n, "seed") for n in (0, 1, 2)] == ["seeds", "seed", "seeds"]
    assert gpu_name("NVIDIA H100 80GB HBM3") == "H100" and gpu_name("2 x NVIDIA H200 (nvidia-h200-x2)") == "H200"
    assert gpu_name("cpu") == "cpu"
    assert and_join([]) == "" and and_join(["a"]) == "a" and and_join(["a", "b", "c"]) == "a, b and c"
    assert capital("the loss") == "The loss" and capital("") == ""


def test_setting_of_names_the_preset_a_run_was_trained_with():
    from lpfa.pages import setting_of
    from lpfa.train import PRESETS

    assert setting_of({**PRESETS["gpt2-s-paper"], "batch_size": 24, "grad_accum": 1}) == "the paper's GPT-2 S recipe"
    assert setting_of(PRESETS["repro"]) == "the `repro` preset"
    assert setting_of({**PRESETS["repro"], "lr": 1.0}) == "a `repro` model"
    assert setting_of({}) == "a `?` model"


def test_same_recipe_runs_differ_only_in_bookkeeping():
    from lpfa.compare import BOOKKEEPING, DEFAULTS, same_recipe_runs
    from lpfa.paths import results_dir
    from lpfa.run import read_run_config

    base = results_dir() / "paper_recipe" / "h200x2-2026-11-30" / "bf16_paper_recipe"
    found = same_recipe_runs(base)
    assert "stabilisers/h200-2026-12-02/bf16_rerun" in found and base not in found.values()
    want = read_run_config(base)["train"]
    for d in found.values():
        t = read_run_config(d)["train"]
        assert {k for k in DEFAULTS if t.get(k, DEFAULTS[k]) != want.get(k, DEFAULTS[k])} <= set(BOOKKEEPING)


def test_scorecard_note_gives_a_page_its_own_rows_of_the_scorecard():
    """A page's scorecard note is computed from the same rows as the intro's scorecard (computing only that page's
    rows changes none of them), states each row's verdict, and a page that no row links to is refused by name."""
    from lpfa.pages import VERDICT_WORDS
    from lpfa.pages.intro import scorecard, scorecard_note

    card = scorecard()
    for page in ("06_loss_explosion", "02_delta_bias"):
        rows = card[card.page == page].reset_index(drop=True)
        assert len(rows) >= 1
        pd.testing.assert_frame_equal(scorecard(pages=[page]), rows)
        note = scorecard_note(page)
        for row in rows.itertuples():
            assert f"{row.paper[0].upper() + row.paper[1:]}: {VERDICT_WORDS[row.verdict]}.**" in note
            assert row._3.rstrip(".")[1:] in note
    with pytest.raises(ValueError, match="page='01_bf16_rounding'"):
        scorecard_note("01_bf16_rounding")
    # on a results tree without the runs its rows read, the note says so and names what is missing
    note = scorecard_note("07_spectral_norms", fig2_experiment="no_such_experiment")
    assert note.startswith("The book's scorecard rows for this page are not computed here: ")
    assert "no_such_experiment" in note


def test_mechanism_rows_judge_each_head_and_print_its_numbers():
    """The scorecard's Fig. 5 and Fig. 4 rows print each measured head's t and smallest within-step similarity as the
    pages compute them, and judge per head: reproduced in every head, partly in some, not in none. The control's t
    per head comes from its own replay."""
    from lpfa.experiments import MECHANISM_CONTROL, MECHANISM_REPLAY
    from lpfa.pages.delta_bias import STRONG_T, replay_dir
    from lpfa.pages.intro import PARALLEL, _floor, _head_verdict, _mechanism_rows
    from lpfa.replay import bias_test, load_replay, rank1_stats

    assert (_floor(0.937, 2), _floor(6.35, 1), _floor(0.94, 2), _floor(0.999, 2)) == (0.93, 6.3, 0.94, 0.99)
    assert [_head_verdict(p) for p in ([True, True], [True, False], [False, False])] == \
        ["reproduced", "partly", "not reproduced"]
    fig5, fig4 = _mechanism_rows("mechanism", MECHANISM_REPLAY, None)
    result, arrays = load_replay(replay_dir("mechanism", None, MECHANISM_REPLAY, None))
    control, _ = load_replay(replay_dir("mechanism", None, MECHANISM_CONTROL, None))
    bt, ct = bias_test(result), bias_test(control)
    sims = {h: min(v for k, v in rank1_stats(arrays, h)["medians"].items() if k.startswith("within"))
            for h in result["heads"]}
    head_part, control_part = fig5[COLUMNS[2]].split("the control")
    for h, r in bt.items():
        assert f"t = {r['t']:.1f} (head {h})" in head_part
        assert f"{sims[h]:.2f} (head {h})" in fig4[COLUMNS[2]]
    assert all(f"t = {r['t']:.1f} (head {h})" in control_part for h, r in ct.items())
    assert fig5[COLUMNS[3]] == _head_verdict([r["t"] > STRONG_T for r in bt.values()])
    assert fig4[COLUMNS[3]] == _head_verdict([x > PARALLEL for x in sims.values()])
    # without a control the row says nothing of one
    assert "control" not in _mechanism_rows("mechanism", MECHANISM_REPLAY, None, control="")[0][COLUMNS[2]]


def test_dose_and_fig2_rows_count_what_their_pages_count():
    """The scorecard's dose row prints the dose experiment's counts (lpfa.dose.dose_findings) with its limits, and the
    Fig. 2 row the seeds whose FP32 attention trained far enough (lpfa.pages.loss_explosion.seed_twins)."""
    from lpfa.dose import committed_runs, dose_findings, dose_table
    from lpfa.pages.intro import _dose_row, _fig2_rows
    from lpfa.pages.loss_explosion import TWIN_MARGIN, recipe_fates, seed_twins

    f = dose_findings(dose_table(committed_runs()))
    row = _dose_row(None)
    assert "`repro` preset, one control seed per k" in row["claim"]
    assert (f"the loss exploded in {f['bias']['exploded_runs']} of {f['bias']['runs']} biased-dose runs and in "
            f"{f['control']['exploded_runs']} of {f['control']['runs']} random-sign control runs") in row["our result"]
    assert row["verdict"] == ("shown" if f["bias_decides_ks"] else "not shown")
    twins = seed_twins(recipe_fates())
    fig2 = _fig2_rows("paper_recipe", 1, None)[0]
    assert (f"{TWIN_MARGIN:,} steps past the seed's BF16 explosion (or as far as its BF16 run) on "
            f"{int(twins.twin.sum())} of {len(twins)} seeds with both.") in fig2["our result"]
