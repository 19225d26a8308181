"""Page 07 (W_Q spectral norms): the twins, provenance line, per-layer and per-head figures and the shorter-experiment
comparison of lpfa.pages.spectral_norms, checked against the committed results/paper_recipe, repro_pair and
repro_twins runs recomputed from their raw metrics records."""

import json

import matplotlib
import numpy as np
import pytest

from lpfa.compare import layer_max
from lpfa.pages import provenance_line
from lpfa.pages import spectral_norms as sn
from lpfa.pages.loss_explosion import recipe_rows
from lpfa.results import experiments, run_dir, what
from lpfa.run import check_layer, read_records

matplotlib.use("Agg")

TWINS = {"bf16": "bf16_paper_recipe", "fp32": "fp32_paper_recipe"}


def _logged(run, metric="wq_spectral_norm"):
    """(steps, values of shape (records, layers, heads)) of a run's diagnostics, read from its raw records."""
    recs = [r for r in read_records(run) if "diag" in r and metric in r["diag"]]
    return np.array([r["step"] for r in recs]), np.array([r["diag"][metric] for r in recs], dtype=float)


@pytest.fixture(scope="module")
def runs():
    return sn.recipe_twins("paper_recipe", None, TWINS)


def test_recipe_twins_are_the_committed_folders_and_a_missing_one_is_named(runs):
    rows = recipe_rows("paper_recipe")
    assert runs == {"bf16": rows["bf16_paper_recipe"], "fp32": rows["fp32_paper_recipe"]}
    with pytest.raises(ValueError, match=r"^twins=.*: \['nope'\] not among the committed runs of 'paper_recipe': "):
        sn.recipe_twins("paper_recipe", None, {"bf16": "bf16_paper_recipe", "fp32": "nope"})


def test_provenance_line_quotes_the_run_folders_provenance(runs):
    folder = runs["bf16"].parent
    prov = json.loads((folder / "provenance.json").read_text())
    line = provenance_line("paper_recipe", folder)
    assert line == f"{what(prov).rstrip('. ')}. {prov['device']}, commit `{prov['git_commit']}`"
    assert not line.endswith(".")


def _panels(fig):
    return [ax for ax in fig.axes if ax.get_visible()]


def test_layer_max_figure_draws_each_layers_largest_head(runs):
    """One panel per layer, every run in it in its own colour (no colour repeats within a panel)."""
    fig = sn.plot_layer_max(runs)
    logged = {label: _logged(run) for label, run in runs.items()}
    n_layer = next(iter(logged.values()))[1].shape[1]
    assert len(_panels(fig)) == n_layer
    for layer, ax in enumerate(_panels(fig)):
        assert [line.get_label() for line in ax.lines] == list(runs)
        assert len({line.get_color() for line in ax.lines}) == len(runs)
        for line, (steps, values) in zip(ax.lines, logged.values()):
            assert list(line.get_xdata()) == sorted(set(steps.tolist()))
            np.testing.assert_allclose(line.get_ydata(), values[:, layer, :].max(axis=1))


def test_layer_heads_figure_draws_every_head_of_the_layer(runs):
    fig = sn.plot_layer_heads(runs, 1)
    logged = {label: _logged(run)[1] for label, run in runs.items()}
    assert len(_panels(fig)) == next(iter(logged.values())).shape[2]  # one panel per head
    for h, ax in enumerate(_panels(fig)):
        assert len({line.get_color() for line in ax.lines}) == len(ax.lines) == len(runs)
        for line, values in zip(ax.lines, logged.values()):
            np.testing.assert_allclose(line.get_ydata(), values[:, 1, h])
    with pytest.raises(ValueError, match=r"^layer=99: expected a layer in \[0, 11\] of the committed runs$"):
        sn.plot_layer_heads(runs, 99)


def test_a_bad_layer_or_experiment_is_named_in_one_line(runs):
    """``-p layer 30`` and ``-p experiment nosuch`` stop the page's first call with one line naming the value and what
    is expected: the layers of the committed runs' model (lpfa.run.check_layer; lpfa.compare.layer_max, by the layers
    a run logged), the committed experiments (lpfa.results.runs)."""
    bad_layer = r"^layer=30: expected a layer in \[0, 11\] of the committed runs$"
    for call in (lambda: sn.page_texts("paper_recipe", runs, TWINS, 30, 200, ""),
                 lambda: sn.plot_head_bars(runs, 30, 200)):
        with pytest.raises(ValueError, match=bad_layer):
            call()
    with pytest.raises(ValueError, match=r"^layer=30: expected a layer in \[0, 11\] of the runs \(.*bf16_paper_recipe "
                                         r"has no layer 30\)$"):
        layer_max(runs["bf16"], "max_logit", 30)  # what pages 06, 08-11 and the intro read a layer through
    with pytest.raises(ValueError, match=r"^layer=-1: expected a layer in \[0, 11\] of the committed runs$"):
        check_layer(-1, runs)
    assert check_layer(11, runs) == 11
    for run in (None, "h200x2-2026-11-30"):
        with pytest.raises(FileNotFoundError) as e:
            sn.recipe_twins("nosuch", run, TWINS)
        msg = str(e.value)
        assert msg.startswith("experiment='nosuch': expected one of ") and "\n" not in msg
        assert all(repr(name) in msg for name in experiments()) and "'paper_recipe'" in msg


def test_short_twins_count_the_bit_identical_losses():
    assert sn.short_twins("", {"bf16": "bf16", "fp32": "fp32"}, {}) == (None, None)
    folder = run_dir("repro_pair")
    long = {label: folder / label for label in ("bf16", "fp32")}
    short, same = sn.short_twins("repro_twins", {"bf16": "bf16", "fp32": "fp32"}, long)
    assert short == {label: run_dir("repro_twins") / label for label in ("bf16", "fp32")}
    for label in ("bf16", "fp32"):
        losses = [{r["step"]: r["loss"] for r in read_records(d) if "loss" in r} for d in (long[label], short[label])]
        common = sorted(set(losses[0]) & set(losses[1]))
        equal = [s for s in common if losses[0][s] == losses[1][s]]
        differ = [s for s in common if losses[0][s] != losses[1][s]]
        assert same[label]["common_steps"] == len(common) and same[label]["identical_steps"] == len(equal)
        assert same[label]["first_differing_step"] == (differ[0] if differ else None)
    text = sn.wq_comparison_text(long, 1, short, "repro_twins", same)
    assert f"bit-identical losses at {len(equal):,} of their {len(common):,} common steps" in text
