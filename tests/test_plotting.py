import numpy as np
import pytest


def test_table_formats_numbers_units_and_missing_values():
    import pandas as pd

    from lpfa.plotting import format_table as table

    df = pd.DataFrame({"tokens/s": [438106.0, 1234.5], "loss": [2.23284, float("nan")], "share": [0.571, None],
                       "exploded": [True, False], "steps": [9920, 5450]}, index=["fp32", "bf16"])
    html = table(df.assign(seed=[1337, 1]), units={"tokens/s": "median"}, percent=("share",)).to_html()
    for cell in (">1337<", "438,106", "1,230", "2.23", "–", "57.1%", "yes", "no", "9,920", "tokens/s (median)"):
        assert cell in html, cell
    assert "nan" not in html.lower() and "None" not in html
    wide = pd.DataFrame([range(12)], columns=[f"c{i}" for i in range(12)], index=["only row"])
    assert list(table(wide).data.columns) == ["only row"]  # transposed to fit the page column
    assert table(wide, max_columns=20).data.shape == (1, 12)
    kept = table(wide, transpose=False)  # never transposed: split into tables that fit the column instead
    parts = getattr(kept, "parts", None) or [kept]
    assert all(list(p.data.index) == ["only row"] for p in parts)
    assert [c for p in parts for c in p.data.columns] == list(wide.columns)
    tall = pd.DataFrame([range(12)] * 10, columns=[f"c{i}" for i in range(12)])
    assert table(tall).data.shape == (10, 12)  # transposing would not make it fit: left as it is


def test_style_finds_matplotlibs_own_fonts_under_a_foreign_font_cache(monkeypatch, caplog):
    """A font cache that lists only system fonts (written by a matplotlib whose bundled fonts were stripped) made every
    mathtext glyph missing from DejaVu Sans log "findfont: ... not found" to the page; the style registers them."""
    import logging
    from pathlib import Path

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib import font_manager

    from lpfa.plotting import use_style

    bundled = Path(matplotlib.get_data_path()) / "fonts"
    system_only = [f for f in font_manager.fontManager.ttflist if bundled not in Path(f.fname).parents]
    monkeypatch.setattr(font_manager.fontManager, "ttflist", system_only)
    font_manager.fontManager._findfont_cached.cache_clear()
    use_style()
    names = {f.name for f in font_manager.fontManager.ttflist}
    assert {"STIXGeneral", "cmr10", "DejaVu Sans"} <= names
    with caplog.at_level(logging.WARNING, logger="matplotlib.font_manager"):
        fig, ax = plt.subplots(figsize=(2, 1))
        ax.set_title(r"$\bar{P} = 1,\ \delta_{lp} \circ \mathcal{L}$")
        fig.canvas.draw()
        plt.close(fig)
    assert not [r for r in caplog.records if "not found" in r.getMessage()]
    font_manager.fontManager._findfont_cached.cache_clear()


def test_explorer_draws_when_asked(tmp_path, monkeypatch):
    """The per-head explorer waits for its button (papermill never renders into its output widget), then draws one
    line per head of the chosen run and layer."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from conftest import write_diag_run

    from lpfa.compare import explorer
    from lpfa.widgets import STATIC_ENV

    monkeypatch.delenv(STATIC_ENV, raising=False)  # a reader's kernel (the book's draw once: tests/test_widgets.py)
    runs = {"bf16": write_diag_run(tmp_path, "bf16", [1.0, 5.0, 9.0], [0.0] * 3, [1.0, 2.0, 3.0])}
    drawn = []
    monkeypatch.setattr(plt, "show", lambda *a, **k: drawn.append(len(plt.gca().get_lines())))
    widget = explorer(runs, "wq_spectral_norm")
    assert widget.manual and widget.children[0].description == "run" and drawn == []
    widget.update()
    assert drawn == [3]  # layer 1's three heads
    plt.close("all")


def test_table_cells_missing_thousands_significant_figures_and_empty_columns():
    """The one table formatter: NaN, None and pandas' NA as "–", integers (and whole floats, as a missing value makes
    a column of counts) with thousands separators, other numbers to the significant figures asked (per column too),
    booleans as words, and a column with no value at all dropped."""
    import pandas as pd

    from lpfa.plotting import TABLE_CLASS, format_table

    df = pd.DataFrame({"tokens/s": [438106.0, 1234567.0], "ratio": [1.0, 0.0123456], "loss": [2.23284, float("nan")],
                       "steps": [5450.0, None], "first": pd.array([20, None], dtype="Int64"),
                       "empty": [None, float("nan")], "ok": [True, False]})
    shown = format_table(df, digits={"loss": 2}).data
    assert "empty" not in shown.columns
    assert list(shown["tokens/s"]) == ["438,106", "1,234,567"]
    assert list(shown["ratio"]) == ["1.00", "0.0123"]
    assert list(shown["loss"]) == ["2.2", "–"]
    assert list(shown["steps"]) == ["5,450", "–"] and list(shown["first"]) == ["20", "–"]
    assert list(shown["ok"]) == ["yes", "no"]
    assert f'class="{TABLE_CLASS}' in format_table(df).to_html()


def test_table_wider_than_the_page_column_is_split_into_parts_that_fit():
    import pandas as pd

    from lpfa.plotting import TABLE_WIDTH_PX, Tables, _width_px, format_table

    wide = pd.DataFrame([[123456.789 * (i + j) for j in range(14)] for i in range(12)],
                        columns=[f"a long column header {j}" for j in range(14)])
    shown = format_table(wide)
    assert isinstance(shown, Tables) and len(shown.parts) > 1
    assert all(_width_px(part.data) <= TABLE_WIDTH_PX for part in shown.parts)
    assert sum(part.data.shape[1] for part in shown.parts) == 14
    assert shown._repr_html_().count("<table") == len(shown.parts)


def test_style_keeps_every_text_at_least_the_smallest_size():
    """Under the book's style a figure's titles, labels, tick labels and legend are all at least MIN_TEXT_PT; a text
    set smaller is what smallest_text_pt reports."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lpfa.plotting import MIN_TEXT_PT, smallest_text_pt, use_style

    use_style()
    fig, axes = plt.subplots(1, 2)
    for ax in axes:
        ax.plot([0, 1], [0, 1], label="a line")
        ax.set(title="title", xlabel="x", ylabel="y")
        ax.legend(title="legend")
    fig.suptitle("figure")
    assert smallest_text_pt(fig) >= MIN_TEXT_PT
    axes[0].text(0.5, 0.5, "small", fontsize=7)
    assert smallest_text_pt(fig) == 7
    plt.close(fig)


def test_fit_page_width_shrinks_what_the_page_would_scale_down():
    """A figure whose drawing (a legend outside its axes included) is wider than the page's column is shrunk, keeping
    its aspect, until it fits PAGE_WIDTH_IN, so the page shows its text at its own size; a narrow one is left alone."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from lpfa.plotting import PAGE_WIDTH_IN, fit_page_width, use_style

    use_style()
    fig, axes = plt.subplots(1, 3, figsize=(9.5, 3.0))
    for ax in axes:
        ax.plot(range(10), label="a line with a long label")
    axes[-1].legend(loc="upper left", bbox_to_anchor=(1.02, 1))  # outside: the drawing is wider than the figure
    aspect = fig.get_figheight() / fig.get_figwidth()
    width = fit_page_width(fig)
    assert width == pytest.approx(PAGE_WIDTH_IN, rel=0.01)
    assert fig.get_tightbbox().width + 2 * matplotlib.rcParams["savefig.pad_inches"] <= PAGE_WIDTH_IN * 1.01
    assert fig.get_figheight() / fig.get_figwidth() == pytest.approx(aspect)
    small, _ = plt.subplots(figsize=(4, 3))
    assert fit_page_width(small) < PAGE_WIDTH_IN and tuple(small.get_size_inches()) == (4, 3)
    from matplotlib.figure import Figure

    bare = Figure(figsize=(10, 3))  # made without pyplot, as seaborn's grids may be: a bare canvas
    bare.subplots().plot(range(3))
    assert fit_page_width(bare) == pytest.approx(PAGE_WIDTH_IN, rel=0.01)
    plt.close("all")


def test_figure_problems_finds_repeated_colours_and_fractional_ticks():
    """The two figure rules the browser test reads from every page's PNGs (lpfa.plotting.figure_problems): legend
    entries a reader cannot tell apart, and fractional tick labels on an axis whose marks all sit at whole numbers.
    Each case is one the book met (12 seeds in a 10-colour palette, three layers' bars ticked at -0.5, 0.5, ...);
    the clean twins (the same data, styled or ticked apart) must pass."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.lines import Line2D
    from matplotlib.ticker import MaxNLocator

    from lpfa.plotting import figure_problems, use_style

    use_style()
    fig, ax = plt.subplots()
    for i in range(12):
        ax.plot([0, 1000, 2000], np.arange(3) * (i + 1) * 0.1, label=f"seed {i}")
    ax.legend()
    found = figure_problems(fig)
    assert sum("'seed 0' and 'seed 10' look alike" in p for p in found) == 1 and len(found) == 2, found
    for i, line in enumerate(ax.get_lines()):  # a second cue (line style) tells the repeated colours apart
        line.set_linestyle("--" if i >= 10 else "-")
    ax.legend()
    assert figure_problems(fig) == []
    plt.close(fig)

    fig, ax = plt.subplots()  # near-identical colours (ΔE 2.9: matplotlib's blue against the book's) read as one
    ax.plot([0, 1000], [0.2, 0.7], color="#1f77b4", label="fp32_outlier_heads")
    ax.plot([0, 1000], [0.3, 0.5], color="#0072B2", label="fp32")
    ax.legend()
    assert ["look alike" in p for p in figure_problems(fig)] == [True]
    plt.close(fig)

    fig, ax = plt.subplots()  # marker-only entries are told apart by their markers' colours, not the unset line's
    ax.legend(handles=[Line2D([], [], ls="none", marker="D", mec=c, mfc=c, label=c) for c in ("#029e73", "#0173b2")])
    assert figure_problems(fig) == []
    plt.close(fig)

    fig, (a, b) = plt.subplots(2, 1, figsize=(7, 6))
    a.bar(range(3), [0.2, 1.5, 0.7])  # three layers: matplotlib ticks them every 0.5
    b.barh(range(3), [0.2, 1.5, 0.7])
    found = figure_problems(fig)
    assert len(found) == 2 and "panel 0: its x axis" in found[0] and "panel 1: its y axis" in found[1], found
    assert "'−0.5'" in found[0] or "'-0.5'" in found[0]
    a.xaxis.set_major_locator(MaxNLocator(integer=True))
    b.yaxis.set_major_locator(MaxNLocator(integer=True))
    assert figure_problems(fig) == []
    plt.close(fig)

    fig, ax = plt.subplots()  # a fraction on the values axis is fine; a reference line does not make it whole
    ax.plot([0, 1, 2, 3, 4], [0.1, 0.35, 0.2, 0.6, 0.4])
    ax.axhline(0.5)
    ax.imshow(np.zeros((3, 5)), extent=(-0.5, 4.5, 2.5, -0.5), aspect="auto", alpha=0.1)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    assert figure_problems(fig) == []
    plt.close(fig)


def test_fixed_prints_no_negative_zero():
    from lpfa.plotting import fixed

    assert fixed(-0.0004, 2) == "0.00"  # rounds to zero: no "-0.00"
    assert fixed(-0.005001, 2) == "-0.01"
    assert fixed(0.93749, 3) == "0.937"
    assert fixed(np.float32(2.25), 1) == "2.2"  # half to even, as round()
