"""Page 10 (isolation): the design, verdict, findings, δ-consistency and plan builders of lpfa.pages.isolation, checked
against the committed results/isolation and results/paper_recipe runs recomputed from their files."""

import json
import math
from pathlib import Path

import pandas as pd
import pytest
import torch

from lpfa.compare import layer_max
from lpfa.experiments import DESCRIPTIONS, ISOLATION, PAPER_ISOLATION
from lpfa.mechanism import DELTA_FORMULAS
from lpfa.pages import RERUN_PAGE
from lpfa.pages.isolation import (
    VERDICT_NOTES,
    delta_consistency,
    early_logit_notes,
    isolation_design,
    isolation_findings,
    isolation_plan,
    isolation_table,
    o_exact_notes,
    recipe_display_table,
    recipe_iso_text,
    recipe_plan,
    verdict_notes,
    verdict_tables,
)
from lpfa.results import experiment_rows
from lpfa.run import read_records, run_verdict
from lpfa.scaling import committed_speed
from lpfa.train import PRESETS

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def iso():
    """The committed isolation table at the page's defaults: (table, step, rows, reference)."""
    return isolation_table()


def test_isolation_design_names_the_launch_of_each_row():
    rows = experiment_rows("isolation", list(ISOLATION))
    design = isolation_design(rows)
    assert list(design.index) == list(ISOLATION)
    for label, overrides in ISOLATION.items():
        held = [p.parent.parent.name for p in (ROOT / "results/isolation").glob(f"*/{label}/config.json")]
        want = rows[label].parent.name if label in rows else "not run yet"
        assert design.loc[label, "run"] == want and (want in held if held else want == "not run yet")
        assert design.loc[label, "overrides"] == " ".join(overrides)
        assert design.loc[label, "paper"] == PAPER_ISOLATION[label]
        assert design.loc[label, "change"] == DESCRIPTIONS[label]
        if label in rows:  # what the committed run's config.json says it ran, whatever the row's definition is now
            train = json.loads((rows[label] / "config.json").read_text())["train"]
            backend = train.get("attn_backend", "lpfa")
            assert design.loc[label, "attention as run"].split(";")[0] == (train["attn_policy"] if backend == "lpfa"
                                                                          else backend)
    assert isolation_design({k: v for k, v in rows.items() if k != "delta_dp"}).loc["delta_dp", "run"] == "not run yet"
    with pytest.raises(ValueError, match=r"^rows=\['nope'\]: expected labels of lpfa.experiments.ISOLATION"):
        isolation_design({"nope": ROOT})


def test_design_note_names_each_row_that_ran_another_attention():
    """A row redefined after its run (fp32: sdpa_fp32 then, fp32_split now) is named with both; a row whose run
    matches, or that has not run, is not; with none, the note says every row ran as defined."""
    from lpfa.pages.isolation import design_note

    design = pd.DataFrame({"overrides": ["attn_policy=fp32_split", "attn_policy=paper_untiled fp32_heads={1: [5]}",
                                         "attn_backend=sdpa_fp32 layer_policies={1: paper_untiled}",
                                         "attn_policy=paper_tiled"],
                           "attention as run": ["sdpa_fp32", "paper_untiled; FP32 head 5 of layer 1",
                                                "sdpa_fp32; layer 1: paper_untiled", None]},
                          index=["fp32", "fp32_worst_head", "bf16_only_layer1", "bf16_tiled"])
    text = design_note(design)
    assert "`fp32` ran `sdpa_fp32`, before the row was defined as `attn_policy=fp32_split`." in text
    assert "fp32_worst_head" not in text and "bf16_only_layer1" not in text and "bf16_tiled" not in text
    assert design_note(design.iloc[1:]) == "Every committed row ran the attention its `overrides` set today."


def test_verdict_notes_from_the_committed_rows(iso):
    table, step, rows, reference = iso
    notes = verdict_notes(table, step, rows, reference)
    assert list(notes) == list(VERDICT_NOTES)
    summary = json.loads((rows["fp32"] / "summary.json").read_text())
    assert notes["iso_explosion"] == summary["criterion"]["description"]
    assert notes["iso_runaway"].endswith("above 1000 for 5 consecutive diagnostics records")
    assert (notes["iso_layer"], notes["iso_ratio"], notes["iso_reference"]) == ("1", "10", "`fp32`")
    # rows whose own launch has no fp32 row are held against the latest one
    foreign = [label for label in table.index if not (rows[label].parent / "fp32" / "summary.json").exists()]
    assert foreign and notes["iso_against"] == (f"for {', '.join(f'`{x}`' for x in foreign)} the `fp32` row of run "
                                                f"`{rows['fp32'].parent.name}`")
    # the comparison step: the last diagnostics step every row reached
    last = min(int(layer_max(d, "max_logit", 1).index.max()) for d in rows.values())
    assert step == last and notes["iso_step"] == f"{last:,}"
    assert verdict_notes(None, None, {}, None) == dict.fromkeys(VERDICT_NOTES, "–")


def test_verdict_tables_split_the_table_in_two(iso):
    table = iso[0]
    verdicts, rest = verdict_tables(table, 1)
    assert list(verdicts.columns) == ["attention", "layer 1 scores", "layer 1 δ from", "paper", "outcome",
                                      "logit apart from", "explosion step", "runaway step"]
    assert set(verdicts.columns) | set(rest.columns) | {"change", "exploded", "runaway layer"} == set(table.columns)
    assert not set(verdicts.columns) & set(rest.columns) and (rest.index == table.index).all()
    with pytest.raises(ValueError, match=r"^layer=2: the table has no column 'layer 2 scores'"):
        verdict_tables(table, 2)


def test_isolation_findings_on_a_small_table():
    table = pd.DataFrame({
        "outcome": {"fp32": "neither", "a": "loss exploded", "b": "logits ran away", "c": "neither"},
        "paper": {"fp32": "neither", "a": "loss exploded", "b": "neither", "c": "loss exploded"},
        "logit apart from": pd.Series({"fp32": None, "a": 1500, "b": 4800, "c": 6100}, dtype=object),
        "explosion step": pd.Series({"fp32": None, "a": 1995, "b": None, "c": None}, dtype=object),
        "runaway step": pd.Series({"fp32": None, "a": 2400, "b": 5200, "c": None}, dtype=object),
        "layer 1 scores": {"fp32": "fp32", "a": "bf16", "b": "bf16", "c": "bf16"},
        "layer 1 δ from": {"fp32": "fp32 O", "a": "bf16 O", "b": "bf16 O", "c": "fp32 O"}})
    assert isolation_findings(table, 1) == (
        "**Measured.**\n\n* **loss exploded**: `a` (step 1,995)\n* **logits ran away**: `b` (step 5,200)\n"
        "* **neither**: `fp32`, `c` (its logit apart from step 6,100)\n"
        "* **against the paper**: it reports no explosion for `b`, and here their loss exploded or their logits ran "
        "away; it reports `c` exploding, and here "
        "neither their loss exploded nor their logits ran away.\n"
        "* **'layer-1 scores S rounded to BF16 in every head' predicts that the logits run away or the loss "
        "explodes**: it fits 3 of 4 rows; not `c` (layer 1 scores bf16, neither).\n"
        "* **'layer-1 δ computed from a BF16-rounded O in every head (the chain of Sec. 3.1)' predicts that the "
        "logits run away or the loss explodes**: it fits every one of the 4 rows.")
    with pytest.raises(ValueError, match=r"^layer=3: the table has no column 'layer 3 scores'"):
        isolation_findings(table, 3)


def test_isolation_findings_date_the_committed_rows_from_their_files(iso):
    table, _, rows, _ = iso
    text = isolation_findings(table, 1)
    for label in rows:
        v = run_verdict(rows[label])
        if v["exploded"]:
            assert f"`{label}` (step {v['explosion_step']:,})" in text
        elif v["runaway_step"] is not None:
            assert f"`{label}` (step {v['runaway_step']:,})" in text
    stable_but = [x for x in table.index if PAPER_ISOLATION[x] == "neither" and table.loc[x, "outcome"] != "neither"]
    assert ((f"it reports {', '.join(f'`{x}`' for x in stable_but)} stable, and here they are not" in text)
            if stable_but else "stable, and here they are not" not in text)


def test_delta_consistency_grows_with_the_logits():
    t = delta_consistency(scales=(1, 64))
    assert list(t.columns) == list(DELTA_FORMULAS) and len(t) == 2
    # the largest logit, recomputed: BF16 q·kᵀ/√64 under the causal mask, rounded to BF16 as the policy's scores
    g = torch.Generator().manual_seed(0)
    k, _, _ = (torch.randn(2, 4, 256, 64, generator=g).bfloat16() for _ in range(3))
    q = torch.randn(2, 4, 256, 64, generator=g)
    mask = torch.ones(256, 256, dtype=torch.bool).tril()
    for c, logit in zip((1, 64), t.index):
        s = ((q * c).bfloat16().float() @ k.float().transpose(-1, -2) / 8).bfloat16().float()
        assert logit == pytest.approx(float(s.masked_fill(~mask, -math.inf).amax()), rel=1e-2)
    assert t.index[1] > 30 * t.index[0]
    top = t.iloc[-1]
    assert top["o_exact"] > 5 * max(top["o_stored"], top["o_fp32"]) and t["o_exact"].is_monotonic_increasing
    for bad in ((), (1, -1)):
        with pytest.raises(ValueError, match=r"^scales=\(.*\): expected at least one positive factor for q$"):
            delta_consistency(scales=bad)


def test_early_logit_notes_recomputed_from_the_metrics():
    rows = experiment_rows("isolation", ["bf16", "fp32", "delta_o_exact"])
    early = {label: max(max(max(h) for h in r["diag"]["max_logit"]) for r in read_records(d)
                        if "diag" in r and r["step"] <= 1000) for label, d in rows.items()}
    lo, hi = min(early, key=early.get), max(early, key=early.get)
    assert early_logit_notes(rows) == {"early_steps": "1,000", "early_logit_lo": f"{early[lo]:.0f} (`{lo}`)",
                                       "early_logit_hi": f"{early[hi]:.0f} (`{hi}`)"}
    with pytest.raises(ValueError, match=r"^rows=\{\}: expected at least one run folder$"):
        early_logit_notes({})
    with pytest.raises(ValueError, match=r"^early_steps=-1: expected a step >= 0$"):
        early_logit_notes(rows, -1)


def test_o_exact_notes_from_a_consistency_frame_and_the_committed_rows(iso):
    c = pd.DataFrame({"o_stored": [1e-3, 1e-3, 1e-3], "o_fp32": [2e-3, 2e-3, 2e-3], "o_exact": [1e-3, 1e-2, 1e-1]},
                     index=pd.Index([1.0, 10.0, 100.0], name="largest logit"))
    notes = o_exact_notes(c)
    assert (notes["oe_logit"], notes["oe_ratio"], notes["oe_row"], notes["ofp32_row"]) == ("100", "50", "", "")
    assert notes["oe_growth"].startswith("Its error grows with the logits, from 1.0e-03 at a largest logit of 1.0 to "
                                         "1.0e-01 at 100:")
    assert o_exact_notes(c.assign(o_exact=[1e-3, 1e-1, 1e-2]))["oe_growth"] == ""
    table, _, rows, _ = iso
    notes = o_exact_notes(c, table, rows)
    v = run_verdict(rows["delta_o_exact"])
    assert notes["oe_row"].startswith(f"The `delta_o_exact` row exploded at step {v['explosion_step']:,}, its logits "
                                      f"ran away in layer {v['runaway_layer']} from step {v['runaway_step']:,}")
    w = run_verdict(rows["delta_o_fp32"])
    assert f"run `{rows['delta_o_fp32'].parent.name}`, {w['steps']:,} steps" in notes["ofp32_row"]


def test_isolation_plan_prices_the_rows_not_run():
    rows = experiment_rows("isolation", list(ISOLATION))
    assert isolation_plan({label: ROOT for label in ISOLATION}) == ""
    some = {k: v for k, v in rows.items() if k not in ("delta_dp", "o_fp32")}
    pending = [label for label in ISOLATION if label not in some]
    text = isolation_plan(some, planned_steps=2_000, gpus=2)
    tps = committed_speed().loc["compiled", "median tokens/s"]
    n = len(pending) + 2
    minutes = math.ceil(n / 2) * 2_000 * PRESETS["repro"]["batch_size"] * PRESETS["repro"]["block_size"] / tps / 60
    assert text.startswith(f"**Not run yet**: {', '.join(f'`{x}`' for x in pending)}. With the two references again, "
                           f"{n} runs at 2,000 steps take about {minutes:.0f} minutes on 2 H200s")
    assert text.endswith(f"; {RERUN_PAGE} gives the commands).") and "bash" not in text  # the commands: book/rerun.md
    with pytest.raises(ValueError, match=r"^planned_steps=0, gpus=4: expected both >= 1$"):
        isolation_plan(some, planned_steps=0)


def _recipe(verdicts: dict, papers: dict):
    labels = ["bf16_paper_recipe", "fp32_paper_recipe", *verdicts]
    paper = {"bf16_paper_recipe": "loss exploded", "fp32_paper_recipe": "neither", **papers}
    return pd.DataFrame({"change": "x", "paper": paper,
                         "steps": 6000, "explosion step": None,
                         "verdict": {"bf16_paper_recipe": "loss exploded", "fp32_paper_recipe": "neither", **verdicts},
                         "runaway step": None, "runaway heads": {label: () for label in labels}}, index=labels)


def test_recipe_iso_text_counts_rows_run_and_agreeing():
    recipe = _recipe({"a": "neither", "b": "loss exploded", "c": "not run yet", "d": "too short"},
                     {"a": "neither", "b": "neither", "c": "neither", "d": "loss exploded"})
    assert recipe_iso_text(recipe) == "3 of its 4 rows have run, 1 as the paper reports, in `results/paper_recipe`"
    quiet = _recipe({"a": "not run yet"}, {"a": "neither"})
    assert recipe_iso_text(quiet) == "none of its 1 rows has run yet, in `results/paper_recipe`"


def test_base_rate_text_reads_each_quiet_row_against_the_plain_bf16_runs():
    """A row whose loss did not explode is set against the plain BF16 runs that exploded by its last step or ran that
    far; a row that exploded, was too short or has not run is not named; without a quiet row, nothing."""
    from lpfa.pages.isolation import base_rate_text

    recipe = _recipe({"a": "neither", "b": "logits ran away", "c": "loss exploded", "d": "too short"},
                     {label: "neither" for label in "abcd"}).assign(steps=[5450, 9920, 6000, 5000, 5500, 4000])
    fates = pd.DataFrame({"precision": ["bf16"] * 4 + ["fp32"], "end": [4900, 5800, 7000, 5200, 9000],
                          "exploded": [True, True, False, False, False]})
    text = base_rate_text(recipe, fates)
    # by 6,000: 4,900 and 5,800 exploded, 7,000 ran past; 5,200 stopped too soon; by 5,000: 4,900 of 3 that can say
    assert "`a` (6,000 steps): the plain BF16 loss had exploded by then in 2 of 3 runs" in text
    assert "`b` (5,000 steps): the plain BF16 loss had exploded by then in 1 of 4 runs" in text
    same = recipe.assign(steps=[5450, 9920, 6000, 6000, 5500, 4000])  # one count for both rows: said once
    assert ("`a` (6,000 steps) and `b` (6,000 steps): the plain BF16 loss had exploded by then in 2 of 3 runs."
            in base_rate_text(same, fates))
    assert "`c`" not in text and "`d`" not in text
    assert base_rate_text(recipe.loc[["c", "d"]], fates) == ""


def test_recipe_display_table_joins_the_heads():
    recipe = _recipe({"a": "neither"}, {"a": "neither"})
    recipe.at["a", "runaway heads"] = (3, 4)
    shown = recipe_display_table(recipe)
    assert list(shown.columns) == ["change", "paper", "steps", "explosion step", "verdict", "runaway step",
                                   "runaway heads"]
    assert shown.loc["a", "runaway heads"] == "3, 4" and shown.loc["bf16_paper_recipe", "runaway heads"] == ""


def test_recipe_plan_matches_the_committed_twins_batch(tmp_path):
    recipe = _recipe({"a_paper_recipe": "neither", "b_paper_recipe": "not run yet",
                      "c_paper_recipe": "not run yet"},
                     {"a_paper_recipe": "neither", "b_paper_recipe": "neither", "c_paper_recipe": "neither"})
    twin = experiment_rows("paper_recipe", ["bf16_paper_recipe"])["bf16_paper_recipe"]
    train = json.loads((twin / "config.json").read_text())["train"]
    text = recipe_plan(recipe)
    assert text.startswith("**Not run yet**: `b_paper_recipe`, `c_paper_recipe`. Each needs one H200 for the BF16 "
                           f"twin's {train['time_budget_s'] / 60:.0f} minutes")
    assert text.endswith(f"two per 2-GPU run, at its batch of {train['batch_size']} ({RERUN_PAGE} gives the commands).")
    assert recipe_plan(recipe, root=tmp_path).endswith("They run at the BF16 twin's batch once that twin is committed "
                                                       "(`scripts/gpu/paper_recipe.sh`).")
    assert recipe_plan(_recipe({"a": "neither"}, {"a": "neither"})) == ""


def test_outlier_heads_text_measures_the_chosen_heads_at_the_runaway_onset(tmp_path):
    """The recipe's outlier-heads row is explained from the twins' diagnostics at the BF16 twin's runaway onset: the
    W_Q ratios and logits printed are those of the logs, and the verdict says whether the row's heads lead both;
    without the committed rows, nothing."""
    from lpfa.compare import head_metric_frame
    from lpfa.pages.isolation import outlier_heads_text
    from lpfa.run import Run, runaway_onset

    rows = experiment_rows("paper_recipe",
                           ["bf16_paper_recipe", "fp32_paper_recipe", "fp32_outlier_heads_paper_recipe"])
    text = outlier_heads_text()
    step, layer = runaway_onset(rows["bf16_paper_recipe"])
    heads = sorted(Run(rows["fp32_outlier_heads_paper_recipe"]).train["fp32_heads"][str(layer)])

    def at(label, metric):
        f = head_metric_frame(rows[label], metric)
        return f[(f.layer == layer) & (f.step == step)].set_index("head").value

    ratio = at("bf16_paper_recipe", "wq_spectral_norm") / at("fp32_paper_recipe", "wq_spectral_norm")
    logit = at("bf16_paper_recipe", "max_logit")
    assert text.startswith(f"The outlier heads {heads[0]} and {heads[1]} of layer {layer}: at step {step:,},")
    for h in ratio.nlargest(2).index:
        assert f"{h} (×{ratio[h]:.2f})" in text
    for h in logit.nlargest(2).index:
        assert f"{h} ({logit[h]:,.0f})" in text
    lead = sorted(ratio.nlargest(2).index) == heads == sorted(logit.nlargest(2).index)
    assert text.endswith("the row's heads lead both." if lead else "the row's heads are not the leaders of both.")
    assert outlier_heads_text(root=tmp_path) == ""
