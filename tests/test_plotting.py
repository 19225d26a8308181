

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
