"""lpfa.pages.tables: the committed full tables under results/tables are what their code makes from the committed
results now, and each opens with where it came from; page 16's summary of the full audit and its figure's text."""

import io

import matplotlib
import pandas as pd
import pytest

from lpfa.pages import kernel_bias as kb
from lpfa.pages import tables
from lpfa.plotting import MAX_ROWS, MIN_TEXT_PT, smallest_text_pt

matplotlib.use("Agg")


def _data(text: str) -> pd.DataFrame:
    return pd.read_csv(io.StringIO(text), comment="#")


@pytest.mark.parametrize("name", [pytest.param(n, marks=pytest.mark.slow) if n == "early_warning_replay" else n
                                  for n in tables.FULL_TABLES])
def test_committed_full_table_is_fresh_and_says_where_it_came_from(name):
    committed = tables.path(name).read_text()
    module, function = tables.FULL_TABLES[name]
    head = [line for line in committed.splitlines() if line.startswith("#")]
    assert any(f"{module}.{function}" in line and "results/" in line for line in head), head
    pd.testing.assert_frame_equal(_data(committed), _data(tables.csv_text(name)))
    assert len(tables.read(name)) > MAX_ROWS  # a table short enough for its page needs no CSV
    assert f"<../{tables.FOLDER}/{name}.csv>" in tables.link(name) and "{download}" in tables.link(name)


def test_kernel_bias_summary_fits_a_page_and_agrees_with_the_full_table():
    page = kb.load_page("latest")
    full, summary = kb.bias_table(page.df), kb.bias_summary(page.df)
    assert len(summary) <= MAX_ROWS and set(summary.index) == set(full.index.get_level_values("kernel"))
    for (kernel, family, quantity), row in full.iterrows():
        cell = summary.loc[kernel, family.split(":")[0]]
        word = f"{kb.QUANTITY_SHORT[quantity]} {'+' if row['mean'] > 0 else '−'}"
        assert (word in cell.split(", ")) == bool(row["CI excludes 0"]), (kernel, family, quantity, cell)
    fig = kb.plot_bias(page.df, page.where)
    assert smallest_text_pt(fig) >= MIN_TEXT_PT and fig.get_size_inches()[0] <= 7
    assert all(len(ax.get_xticks()) <= 3 for ax in fig.axes)  # a 2-inch panel holds three tick labels
