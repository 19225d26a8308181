"""Page 11 (seeds): lpfa.pages.seeds' runs and their references, the table built from them and the plan, checked against
the committed results/seeds, results/repro_pair and results/isolation runs read from their config files."""

import json
import math
from pathlib import Path

import pytest

from lpfa.compare import divergence_step, experiment_table, layer_max
from lpfa.experiments import SEEDS
from lpfa.pages import RERUN_PAGE
from lpfa.pages.seeds import SEED_COLUMNS, seed_runs, seeds_committed, seeds_plan, seeds_summary
from lpfa.scaling import committed_speed
from lpfa.train import PRESETS

ROOT = Path(__file__).resolve().parents[1]


def _train(folder):
    return json.loads((Path(folder) / "config.json").read_text())["train"]


def _fp32(train) -> bool:  # FP32 attention, in the configs of these runs
    return train["attn_backend"] == "sdpa_fp32" or train["attn_policy"].startswith("fp32")


def test_seed_runs_pair_each_run_with_the_fp32_run_of_its_seed_and_settings():
    runs, references = seed_runs()
    assert list(runs) == ["bf16_s1337", "fp32_s1337", "bf16_s1337_compiled", "fp32_s1337_compiled", *SEEDS]
    assert set(references) == set(runs)
    assert runs["bf16_s1337"].parent.parent == ROOT / "results" / "repro_pair"
    assert runs["bf16_s1337_compiled"].parent.parent == ROOT / "results" / "isolation"
    for label, run in runs.items():
        own, ref = _train(run), _train(references[label])
        if label.startswith("fp32"):  # a reference row is held against itself: it never shows the precursor
            assert references[label] == run and _fp32(own)
            continue
        assert not _fp32(own) and _fp32(ref) and references[label] != run
        same = ("seed", "init_seed", "compile")
        assert [ref.get(k) for k in same] == [own.get(k) for k in same]


def _fake_run(root, *parts):
    d = Path(root, *parts)
    d.mkdir(parents=True)
    (d / "config.json").write_text("{}")


def test_seed_runs_name_a_missing_reference(tmp_path):
    for m in ("bf16", "fp32"):
        _fake_run(tmp_path, "repro_pair", "r1", m)
        _fake_run(tmp_path, "isolation", "r1", m)
    _fake_run(tmp_path, "seeds", "r1", "bf16_s2")
    assert seeds_committed(root=tmp_path) and not seeds_committed("nothing", root=tmp_path)
    with pytest.raises(FileNotFoundError, match=r"^reference runs fp32_s2 \(for bf16_s2\) are not committed"):
        seed_runs(root=tmp_path)
    _fake_run(tmp_path, "seeds", "r1", "fp32_s2")
    runs, references = seed_runs(root=tmp_path)
    assert list(runs) == ["bf16_s1337", "fp32_s1337", "bf16_s1337_compiled", "fp32_s1337_compiled", "bf16_s2",
                          "fp32_s2"]
    assert references["bf16_s2"] == tmp_path / "seeds" / "r1" / "fp32_s2"


def test_the_seeds_table_holds_each_run_against_its_twin():
    runs, references = seed_runs()
    table, _ = experiment_table(runs, layer=1, reference=references.get, logit_ratio=10.0)
    assert set(SEED_COLUMNS) <= set(table.columns)
    for label, run in runs.items():  # the twin found again by seed and compilation among the FP32 runs
        own = _train(run)
        twin = [d for d in runs.values() if _fp32(_train(d)) and (_train(d)["seed"], _train(d)["compile"])
                == (own["seed"], own["compile"])]
        assert len(twin) == 1
        want = divergence_step(layer_max(run, "max_logit", 1), layer_max(twin[0], "max_logit", 1), 10.0)
        assert table.loc[label, "logit apart from"] == want
    summary = seeds_summary(table)
    assert summary.loc["fp32", "logit apart or worse"] == 0 and summary.loc["bf16", "runs"] == 5


def test_seeds_plan_prices_the_seeds_while_none_is_committed(tmp_path):
    assert seeds_plan() == ""  # results/seeds is committed
    (tmp_path / "seeds").mkdir()
    text = seeds_plan(planned_steps=3_000, gpus=4, root=tmp_path)
    tps = committed_speed().loc["compiled", "median tokens/s"]
    repro = PRESETS["repro"]
    minutes = math.ceil(len(SEEDS) / 4) * 3_000 * repro["batch_size"] * repro["block_size"] / tps / 60
    assert text.startswith(f"**Not run yet**: only seed 1337 is in the table. The {len(SEEDS)} runs of "
                           f"`lpfa.experiments.SEEDS` ({', '.join(SEEDS)}) at 3,000 steps each take about "
                           f"{minutes:.0f} minutes on 4 H200s")
    assert text.endswith(f"with `compile=true` ({RERUN_PAGE} gives the commands).")
    with pytest.raises(ValueError, match=r"^planned_steps=8000, gpus=0: expected both >= 1$"):
        seeds_plan(gpus=0)


def test_recipe_text_leads_with_the_recipe_runs():
    from lpfa.pages.loss_explosion import fate_counts, recipe_fates
    from lpfa.pages.seeds import recipe_text

    text = recipe_text()
    assert text.startswith(f"**At the paper's GPT-2 S recipe, {fate_counts(recipe_fates())}**")
    assert "(the loss-explosion page draws them as a survival curve)" in text
