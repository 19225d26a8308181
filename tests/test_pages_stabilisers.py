"""lpfa.pages.stabilisers: page 17's shown table, figure and pending rows from the committed results; each run's
evaluations read once; where LOSS_MATCH comes from; a step the table was not compared at is a one-line error."""

import matplotlib
import pytest

from lpfa.experiments import STABILISERS
from lpfa.pages import stabilisers as st
from lpfa.results import experiment_rows
from lpfa.run import load_metrics

matplotlib.use("Agg")


@pytest.fixture(scope="module")
def committed():
    return st.stabiliser_table(layer=1)


def test_stabiliser_table_reads_each_runs_evaluations_once(monkeypatch):
    calls = []

    def counted(run_dir):
        calls.append(str(run_dir))
        return load_metrics(run_dir)

    monkeypatch.setattr(st, "load_metrics", counted)
    table, step, _ = st.stabiliser_table(layer=1)
    assert len(calls) == len(set(calls)) and len(calls) >= len(table)
    runs = {**experiment_rows("paper_recipe"), **experiment_rows("stabilisers")}
    for label in table.index:  # the gap is the row's eval loss minus its twin's, at the last eval step both logged
        val, twin = (load_metrics(runs[x])[1] for x in (label, table.loc[label, "FP32 twin"]))
        common = val.index.intersection(twin.index)
        assert table.loc[label, "gap step"] == common.max()
        want = val.loc[common.max(), "val_loss"] - twin.loc[common.max(), "val_loss"]
        assert table.loc[label, "eval loss − twin"] == pytest.approx(want, abs=1e-12)


def test_loss_match_is_ten_times_the_spread_of_two_fp32_runs(committed):
    table, _, _ = committed
    spread = abs(table.loc["fp32_rerun", "eval loss − twin"])
    assert table.loc["fp32_rerun", "FP32 twin"] == "fp32_paper_recipe"
    assert f"{10 * spread:.2f}" == f"{st.LOSS_MATCH:.2f}"


def test_shown_table_renames_the_links_by_their_keys(committed):
    table, step, _ = committed
    shown = st.shown_table(table, step)
    assert list(shown.index) == list(table.index)
    seeds = table["seed"].astype(int)
    for key, name in st.STABILISER_LINKS.items():  # each row against the BF16 recipe run of its own seed
        assert (shown[f"{key} @ {step}"] == table[f"{name} @ {step}"]).all()
        bf16 = {s: table.loc["bf16_paper_recipe" + ("" if s == 1337 else f"_s{s}"), f"{name} @ {step}"]
                for s in set(seeds)}
        ratio = [float(table.loc[label, f"{name} @ {step}"]) / float(bf16[seeds[label]]) for label in table.index]
        assert shown[f"{key} ÷ bf16"].tolist() == pytest.approx(ratio)
    bases = [x for x in table.index if x.startswith("bf16_paper_recipe")]  # each seed's BF16 run against itself
    assert len(bases) == len(set(seeds)) and table.loc[bases, "ties ÷ bf16"].tolist() == [1.0] * len(bases)
    assert list(shown.columns[:5]) == ["stabiliser", "outcome", "steps", "explosion step", "runaway step"]
    links = [*st.DOCTOR_LINKS, *st.REPLAY_LINKS]  # the links a checkpoint gives, by the doctor and by replay
    assert list(shown.columns[-len(links):]) == links
    with pytest.raises(ValueError, match=rf"^step=123: expected the step the table compares its rows at \({step}\)$"):
        st.shown_table(table, 123)


def test_page_shows_the_bf16_runs_and_links_every_row(committed):
    """Page 17's table fits the page (MAX_ROWS): the BF16 runs, stabilised or not, every BF16 stabiliser row and base
    run at every seed; the FP32 twins, SFA and the paper's cuts are only in the full table, which holds every row."""
    from lpfa.experiments import RECIPE_ISOLATION, rows
    from lpfa.plotting import MAX_ROWS

    table, step, _ = committed
    shown = st.page_rows(table)
    design = rows("stabilisers")
    bf16 = [label for label in table.index if label in design and design[label].reference is not None
            or label.startswith(("sr", "bf16_paper_recipe"))]  # a BF16 row has an FP32 reference, or is SR or a base
    assert len(shown) <= MAX_ROWS and set(bf16) <= set(shown) and "bf16_rerun" in shown
    left_out = set(table.index) - set(shown)
    assert left_out == {label for label in table.index if label.startswith("fp32_")
                        or label.removesuffix("_paper_recipe") in RECIPE_ISOLATION or label == "sfa_paper_recipe"}
    full, what, sources = st.full_stabiliser_table()
    assert list(full.index) == list(table.index) and full.equals(st.shown_table(table, step))
    assert what.startswith("Page 17's full table") and "results/stabilisers" in sources
    text = st.full_table_text(table)
    assert text.startswith(f"The table shows the {len(shown)} BF16 runs; all {len(table)} rows")
    assert "results/tables/stabiliser_links.csv" in text


def test_stabiliser_figure_draws_every_committed_row(committed):
    import matplotlib.pyplot as plt

    table, _, _ = committed
    fig = st.stabiliser_figure(table, layer=1)
    axes = fig.axes
    drawn = {line.get_label() for ax in axes for line in ax.get_lines()}
    assert set(table.index) <= drawn
    groups = st.stabiliser_groups(list(table.index))  # a column per second seed after the first two
    assert [axes[i].get_title() for i in range(len(groups))] == list(groups)
    assert len(axes) == 3 * len(groups)
    plt.close(fig)


def test_pending_text_names_the_rows_not_run_then_the_plan(committed):
    _, _, pending = committed
    assert pending == [label for label in STABILISERS if not experiment_rows("stabilisers", [label])]
    text = st.pending_text(pending)
    if pending:
        assert text.startswith("**Not run yet:** " + ", ".join(f"`{label}`" for label in pending) + ". ")
        assert text.endswith(st.stabiliser_plan(pending))
    assert st.pending_text([]) == "Every stabiliser row is committed."
    table, _, _ = committed  # a committed row that holds without the link its claim names is listed after the plan
    open_claims = [c["label"] for claim in st.paper_claims(table) for c in claim["per"] if c["stands"] is None]
    assert all(f"`{label}`" in st.unmeasured_text(table) for label in open_claims)
    assert (st.unmeasured_text(table) == "") == (not open_claims)
