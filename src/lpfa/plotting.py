"""The book's one figure style (seaborn's theme with the book's sizes), colours per precision mode, table formatting.

Every plotting function of lpfa calls :func:`use_style` and takes colours from :data:`COLORS`, so a mode has
the same colour in every figure.
"""

from __future__ import annotations

import json
import math

import numpy as np

# One colour per concept, shared by all figures (colour-blind-safe Okabe–Ito palette).
COLORS = {
    "bf16": "#D55E00",  # low precision, the failing mode
    "fp32": "#0072B2",  # high precision, the stable twin
    "sfa": "#009E73",  # the paper's softmax fix
    "fa2": "#E69F00",  # FlashAttention-2 rounding (what SDPA users train with)
    "other": "#CC79A7",
    "neutral": "#7F7F7F",
    "accent": "#E69F00",
    "sky": "#56B4E9",
}

STYLE = {
    "figure.dpi": 110,
    "savefig.dpi": 150,
    "figure.figsize": (7.0, 4.0),
    "figure.constrained_layout.use": True,
    "axes.grid": True,
    "grid.alpha": 0.3,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.titlesize": 11,
    "axes.labelsize": 10,
    "legend.fontsize": 9,
    "legend.frameon": False,
    "font.size": 10,
}


def use_style() -> None:
    """Apply the book's figure style: seaborn's theme (white grid, colour-blind palette) with the book's sizes, so that
    text stays at least 9 pt at page width (:data:`STYLE`)."""
    import seaborn as sns  # heavy (matplotlib, about 0.7 s): loaded by the first figure

    _register_bundled_fonts()
    sns.set_theme(context="notebook", style="whitegrid", palette="colorblind", rc=STYLE)
    _tag_notebook_pngs()


MIN_TEXT_PT = 9  # the smallest text a figure may have at the page's width
# the page's text column, 688 CSS px at a 1280 px window, holds a figure this wide at its own size or larger: its
# 9-pt text then renders at 9 × 688 / (72 × 7) ≈ 12 px, 9 CSS pt
PAGE_WIDTH_IN = 7.0


def fit_page_width(fig, width_in: float = PAGE_WIDTH_IN) -> float:
    """Shrink ``fig``, keeping its aspect, until its PNG as a page shows it (what it draws, labels and legends outside
    the axes included, plus the ``savefig.pad_inches`` margin on each side) is at most ``width_in`` wide, so that the
    page does not scale its text below :data:`MIN_TEXT_PT`; the constrained layout reflows the axes. Returns the PNG's
    width in inches."""
    import matplotlib

    pad = matplotlib.rcParams["savefig.pad_inches"]
    pad = 2 * pad if isinstance(pad, (int, float)) else 0.0
    for _ in range(4):  # text keeps its size, so a shrink by the ratio can leave it a little wide: again
        fig.draw_without_rendering()  # (any canvas: a figure made without pyplot has a bare one)
        width = fig.get_tightbbox().width + pad
        if width <= width_in * 1.005:
            return width
        f = (width_in - pad) / (width - pad)
        fig.set_size_inches(fig.get_figwidth() * f, fig.get_figheight() * f)
    fig.draw_without_rendering()
    return fig.get_tightbbox().width + pad


PNG_TEXT_KEY = "lpfa:smallest_text_pt"  # a page figure's PNG says its smallest text in pt (and "lpfa:dpi" its dpi)


def smallest_text_pt(fig, drawn: bool = False) -> float:
    """The font size (pt) of the smallest visible, non-empty text of ``fig`` (titles, labels, tick labels, legend,
    annotations), as drawn; inf for a figure without text. ``drawn``: the figure is laid out as it stands (no draw)."""
    from matplotlib.text import Text

    if not drawn:
        fig.draw_without_rendering()  # lays the text out (its extents) without rasterising the figure
    sizes = [t.get_fontsize() for t in fig.findobj(Text)
             if t.get_visible() and t.get_text().strip() and t.get_window_extent().width > 0]
    return min(sizes, default=math.inf)


PNG_PROBLEMS_KEY = "lpfa:figure_problems"  # and what figure_problems found, as a JSON list


def _hex(c) -> str | None:
    """A colour as "#rrggbb"; a collection's colours by their first row; None for none ("none", empty, unset)."""
    from matplotlib.colors import to_hex, to_rgba

    arr = np.asarray(c, dtype=object) if c is not None else None
    if arr is not None and arr.ndim == 2:
        c = tuple(arr[0]) if len(arr) else None
    try:
        return None if c is None or to_rgba(c)[3] == 0 else to_hex(c, keep_alpha=False)
    except (ValueError, TypeError):
        return None


def _legend_key(handle) -> tuple:
    """What tells a legend entry apart when it is drawn: the colours it shows (a line's, unless it draws no line; its
    markers' face and edge; a patch's or collection's face and edge), line style, marker and hatch."""
    ls = getattr(handle, "get_linestyle", lambda: None)()
    line_drawn = ls not in (None, "None", "none", "", " ")
    colours = [getattr(handle, "get_color", lambda: None)() if line_drawn else None]
    colours += [getattr(handle, get, lambda: None)() for get in
                ("get_markerfacecolor", "get_markeredgecolor", "get_facecolor", "get_edgecolor")]
    marker = getattr(handle, "get_marker", lambda: None)()
    if marker in (None, "None", "none", "", " "):
        colours[1:3] = [None, None]
    return (tuple(_hex(c) for c in colours), str(ls), str(marker), getattr(handle, "get_hatch", lambda: None)())


def _legend_entries(legend) -> list[tuple[str, list]]:
    """``(label, artists)`` per entry of ``legend``: every artist its handler drew for the entry (an error bar's line,
    markers and bars), from the legend's packed boxes; each entry's one handle where those are not there."""
    box = getattr(legend, "_legend_handle_box", None)  # (matplotlib keeps its entries there since 3.0)
    if box is not None:
        rows = [row for column in box.get_children() for row in column.get_children()]
        if all(len(row.get_children()) == 2 for row in rows):
            return [(row.get_children()[1].get_text(), row.get_children()[0].get_children()) for row in rows]
    return [(t.get_text(), [h]) for h, t in zip(legend.legend_handles, legend.get_texts()) if h is not None]


SAME_COLOUR_DE = 10.0  # CIELAB ΔE below which two colours read as one in a legend (the palette's closest pair: 21)


def _lab(colour: str) -> np.ndarray:
    """CIELAB (D65) of an sRGB colour "#rrggbb": where distance is how different colours look."""
    from matplotlib.colors import to_rgb

    rgb = np.array(to_rgb(colour))
    lin = np.where(rgb <= 0.04045, rgb / 12.92, ((rgb + 0.055) / 1.055) ** 2.4)
    xyz = np.array([[0.4124, 0.3576, 0.1805], [0.2126, 0.7152, 0.0722], [0.0193, 0.1192, 0.9505]]) @ lin
    t = xyz / np.array([0.95047, 1.0, 1.08883])
    f = np.where(t > 0.008856, np.cbrt(t), 7.787 * t + 16 / 116)
    return np.array([116 * f[1] - 16, 500 * (f[0] - f[1]), 200 * (f[1] - f[2])])


def _look_alike(a: list[tuple], b: list[tuple]) -> bool:
    """Whether two legend entries (their artists' :func:`_legend_key` s, sorted) draw alike: the same styles, and
    colours closer than :data:`SAME_COLOUR_DE`."""
    if len(a) != len(b):
        return False
    for (ca, *style_a), (cb, *style_b) in zip(a, b):
        if style_a != style_b or [x is None for x in ca] != [x is None for x in cb]:
            return False
        if any(x is not None and np.linalg.norm(_lab(x) - _lab(y)) >= SAME_COLOUR_DE for x, y in zip(ca, cb)):
            return False
    return True


def _legend_clashes(legend, where: str) -> list[str]:
    """Entries of one legend that a reader cannot tell apart (what their artists draw, :func:`_legend_key`, alike:
    :func:`_look_alike`; labels different)."""
    seen: list[tuple[list, str, list]] = []
    out = []
    for label, artists in _legend_entries(legend):
        if not label.strip():
            continue
        keys = sorted((_legend_key(a) for a in artists if a.get_visible()), key=repr)
        colours = [c for k in keys for c in dict.fromkeys(k[0]) if c is not None]
        if not colours:
            continue
        twin = next(((other, c) for k, other, c in seen if other != label and _look_alike(k, keys)), None)
        if twin is not None:
            out.append(f"{where}: legend entries {twin[0]!r} and {label!r} look alike (colour "
                       f"{', '.join(dict.fromkeys(twin[1]))} against {', '.join(dict.fromkeys(colours))}, same style)")
        else:
            seen.append((keys, label, colours))
    return out


def _data_values(ax, axis: str) -> list[float]:
    """The data coordinates along ``axis`` ("x" or "y") of what ``ax`` draws in data coordinates: lines, scatter
    points, bar centres and image pixel centres (reference lines drawn across the axes count on their data axis
    only)."""
    from matplotlib.image import AxesImage
    from matplotlib.patches import Rectangle

    i = 0 if axis == "x" else 1
    data_axis = {id(ax.transData): (True, True), id(ax.get_xaxis_transform()): (True, False),
                 id(ax.get_yaxis_transform()): (False, True)}
    vals: list[float] = []
    for line in ax.get_lines():
        if not line.get_visible():
            continue
        kind = data_axis.get(id(line.get_transform()))
        if kind is None and line.get_transform().contains_branch(ax.transData):
            kind = (True, True)
        if kind and kind[i]:
            vals.extend(np.asarray(line.get_xdata() if i == 0 else line.get_ydata(), dtype=float).ravel())
    for coll in ax.collections:
        if coll.get_visible() and coll.get_offset_transform() is ax.transData:
            off = np.asarray(coll.get_offsets(), dtype=float)
            if off.ndim == 2 and len(off):
                vals.extend(off[:, i])
    for patch in ax.patches:  # bars: their centres (a bar's length along the other axis is a value, not a place)
        if isinstance(patch, Rectangle) and patch.get_visible() and patch.get_transform().contains_branch(ax.transData):
            vals.append(patch.get_x() + patch.get_width() / 2 if i == 0 else patch.get_y() + patch.get_height() / 2)
    for im in ax.images:
        if isinstance(im, AxesImage) and im.get_visible():
            left, right, bottom, top = im.get_extent()
            n = im.get_array().shape[1 - i]
            lo, hi = (left, right) if i == 0 else (bottom, top)
            vals.extend(lo + (np.arange(n) + 0.5) * (hi - lo) / n)
    return [v for v in vals if math.isfinite(v)]


def _tick_number(text: str) -> float | None:
    t = text.replace("\u2212", "-").replace(",", "").replace("$", "").strip()
    try:
        return float(t)
    except ValueError:
        return None


def figure_problems(fig, drawn: bool = False) -> list[str]:
    """What a reader of ``fig`` would trip on, as sentences (empty: none). Two rules of the book's figures:

    * no colour repeats within a panel: two entries of one legend (an axes' or the figure's) never share colour,
      line style, marker and hatch;
    * integer axes get integer ticks: where everything an axis draws sits at whole numbers (layers, heads, steps,
      seeds, the cells of an image), no tick label is a fraction ("-0.5", "2.5").

    ``drawn``: the figure is laid out as it stands (no draw).
    """
    if not drawn:
        fig.draw_without_rendering()
    out = []
    for n, legend in enumerate(fig.legends):
        out += _legend_clashes(legend, f"figure legend {n}")
    panels = [ax for ax in fig.axes if ax.get_visible() and not hasattr(ax, "_colorbar")]
    for n, ax in enumerate(panels):
        where = f"panel {n}" + (f" ({ax.get_title()!r})" if ax.get_title() else "")
        if ax.get_legend() is not None:
            out += _legend_clashes(ax.get_legend(), where)
        for axis, name in ((ax.xaxis, "x"), (ax.yaxis, "y")):
            if axis.get_scale() != "linear":
                continue
            vals = np.asarray(_data_values(ax, name))
            if len(np.unique(vals)) < 2 or not np.allclose(vals, np.round(vals), rtol=0, atol=1e-9):
                continue
            lo, hi = sorted(axis.get_view_interval())
            shown = [t.get_text() for t, loc in zip(axis.get_ticklabels(), axis.get_ticklocs())
                     if t.get_visible() and t.get_text().strip() and lo - 1e-9 <= loc <= hi + 1e-9]
            fractions = [t for t in shown if (v := _tick_number(t)) is not None and v != round(v)]
            if fractions:
                out.append(f"{where}: its {name} axis draws whole numbers but has tick labels {fractions}")
    return out


def _tag_notebook_pngs() -> None:
    """In a notebook kernel, have every figure's PNG carry its smallest text size and dpi as PNG text
    (:data:`PNG_TEXT_KEY`), so that the book's browser test can tell the text's size as the page renders it, and what
    :func:`figure_problems` found (:data:`PNG_PROBLEMS_KEY`)."""
    try:
        from IPython import get_ipython
    except ImportError:
        return
    shell = get_ipython()
    if shell is None:
        return
    import matplotlib
    from matplotlib.figure import Figure

    png = shell.display_formatter.formatters["image/png"]
    backend = matplotlib.get_backend()
    if Figure not in png.type_printers and "inline" in backend:  # the inline backend may register its printer late
        from matplotlib_inline.backend_inline import configure_inline_support

        configure_inline_support(shell, backend)  # (once: a second call leaves the printers alone)
    try:
        draw = png.lookup_by_type(Figure)
    except KeyError:
        return
    if getattr(draw, "lpfa_tagged", False):
        return

    def tagged(fig):
        fit_page_width(fig)  # (it leaves the figure laid out at its final size)
        return draw(fig, metadata={PNG_TEXT_KEY: f"{smallest_text_pt(fig, drawn=True):g}", "lpfa:dpi": f"{fig.dpi:g}",
                                   PNG_PROBLEMS_KEY: json.dumps(figure_problems(fig, drawn=True))})

    tagged.lpfa_tagged = True
    png.for_type(Figure, tagged)


def _register_bundled_fonts() -> None:
    """Make sure matplotlib knows the fonts it ships (STIX, Computer Modern), which mathtext falls back to for glyphs
    that DejaVu Sans lacks. A font cache written by another matplotlib build of the same cache version (one whose
    fonts were stripped, as Linux distributions do) lists only system fonts; matplotlib then logs "findfont: Font
    family ['STIXGeneral'] not found" to stderr for every such glyph, which lands on the rendered page."""
    from pathlib import Path

    import matplotlib
    from matplotlib import font_manager

    known = {Path(f.fname).name for f in font_manager.fontManager.ttflist}
    for path in sorted((Path(matplotlib.get_data_path()) / "fonts" / "ttf").glob("*.ttf")):
        if path.name not in known:
            font_manager.fontManager.addfont(str(path))


DASHES = {"bf16": "-", "fp32": "--", "sfa": "-.", "fa2": ":"}  # a second cue besides colour


def dash_of(label: str) -> str:
    """The line style of a run by its label's mode (:data:`DASHES`; solid otherwise)."""
    return next((d for mode, d in DASHES.items() if label.startswith(mode)), "-")


def color_of(label: str) -> str:
    """The colour of a run by its label's mode: ``bf16...``, ``fp32...``, ``sfa...``, ``fa2...`` (else "other")."""
    for mode in ("bf16", "fp32", "sfa", "fa2"):
        if label.startswith(mode):
            return COLORS[mode]
    return COLORS["other"]


def line_styles(n: int, avoid=()) -> list[dict]:
    """``n`` line styles a reader can tell apart in one panel (one per layer, head or run): the colour-blind palette's
    colours, then again dashed, then dotted (``ax.plot(..., **style)``); without the palette's colours that look like
    one in ``avoid`` (colours the panel already gives other lines, :data:`SAME_COLOUR_DE`)."""
    import seaborn as sns
    from matplotlib.colors import to_hex

    palette = [c for c in sns.color_palette("colorblind", 10).as_hex()
               if all(np.linalg.norm(_lab(c) - _lab(to_hex(a))) >= SAME_COLOUR_DE for a in avoid)]
    dashes = ["-", "--", ":", "-."]
    return [{"color": palette[i % len(palette)], "ls": dashes[(i // len(palette)) % len(dashes)]} for i in range(n)]


TABLE_CLASS = "lpfa-table"  # the class of every table a page shows (format_table); the book's test looks for it
MAX_ROWS = 20  # the most body rows a page's table has: longer ones are summarised, the full table a CSV under results/


def _missing(x) -> bool:
    """None, NaN, pandas' NA or NaT, or an empty string."""
    if x is None or (isinstance(x, str) and not x):
        return True
    try:
        import pandas as pd

        return bool(pd.isna(x))
    except (TypeError, ValueError):  # a list or array: a value
        return False


def facet_lines(frames: dict, facet: str, ylabel: str, title: str = "", ncols: int = 4, width: float = 7.0):
    """Small multiples instead of one panel of many same-coloured lines: one panel per value of column ``facet``
    (a layer, a head) of the frames (``{run label: DataFrame with step, facet, value}``), each panel holding every
    run in its mode's colour and dash (:func:`color_of`, :func:`dash_of`), so that no colour repeats within a panel.
    Integer panel names, three step ticks per panel, one legend below. Returns the figure."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    use_style()
    keys = sorted({k for f in frames.values() for k in f[facet].unique()})
    nrows = math.ceil(len(keys) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(width, 1.55 * nrows + 1.0), sharex=True, sharey=True,
                             squeeze=False)
    for ax, key in zip(axes.flat, keys):
        for label, f in frames.items():
            g = f[f[facet] == key].sort_values("step")
            ax.plot(g.step, g.value, lw=1.2, color=color_of(label), ls=dash_of(label), label=label)
        ax.set_title(f"{facet} {int(key)}")
        ax.xaxis.set_major_locator(MaxNLocator(3, integer=True))
        ax.yaxis.set_major_locator(MaxNLocator(4))
    for ax in axes.flat[len(keys):]:
        ax.remove()
    for ax in axes[-1]:
        ax.set_xlabel("step")
    fig.supylabel(ylabel)
    if title:
        fig.suptitle(title)
    handles, labels = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="outside lower center", ncol=len(labels))
    return fig


def _number(x, digits: int) -> str:
    """One table cell: integers with thousands separators, other numbers to ``digits`` significant digits, missing
    values as an en dash, booleans as yes/no."""
    if _missing(x):
        return "–"
    if isinstance(x, (bool, np.bool_)):
        return "yes" if x else "no"
    if isinstance(x, (int, np.integer)) or (isinstance(x, (float, np.floating)) and float(x).is_integer()
                                            and abs(x) >= 10 ** (digits - 1)):
        return f"{int(x):,}"
    if isinstance(x, (float, np.floating)):
        if not math.isfinite(x):
            return str(x)
        v = float(f"{x:.{digits}g}")
        if v and abs(v) < 10 ** -(digits + 1):  # tiny: scientific, not a row of zeros
            return f"{v:.{digits - 1}e}"
        return f"{v:,.{max(digits - 1 - int(math.floor(math.log10(abs(v)))), 0)}f}" if v else "0"
    return str(x)


def fixed(x: float, digits: int) -> str:
    """``x`` to ``digits`` decimals for a sentence, with no "−0.00": a value that rounds to zero prints as zero."""
    return f"{round(float(x), digits) + 0.0:.{digits}f}"


def _whole(values) -> bool:
    """Whether every value that is not missing is a float with an integer value (and there is one)."""
    present = [v for v in values if not _missing(v)]
    return bool(present) and all(isinstance(v, (float, np.floating)) and math.isfinite(v) and float(v).is_integer()
                                 for v in present)


def format_table(df, units: dict | None = None, percent=(), digits: int | dict = 3, max_columns: int = 8,
                 index: bool = True, raw=("seed", "init_seed"), classes: str = "", transpose: bool = True):
    """A DataFrame as a page shows it, the one formatter of every table of the book: numbers to ``digits``
    significant digits (an int, or ``{column: digits}`` with 3 for the others; integers with thousands separators),
    the ``percent`` columns as percentages, missing values as "–" (a column with no value at all is dropped),
    booleans as yes/no, ``units`` (``{column: unit}``) in the column names, a numeric index formatted like the cells,
    and a table with more than ``max_columns`` columns transposed when that makes it fit the page column (at most
    ``max_columns`` rows; ``transpose=False``: never, for a table with more columns than a page's rows). ``raw``
    columns (seeds) are shown as they are. The table carries the class
    :data:`TABLE_CLASS` (and ``classes``). Returns a pandas Styler."""
    import pandas as pd

    shown = df.copy()
    shown = shown[[c for c in shown.columns if not all(_missing(v) for v in shown[c])]]
    ndig = (lambda c: digits.get(c, 3)) if isinstance(digits, dict) else (lambda c: digits)
    for col in shown.columns:
        if col in raw:
            shown[col] = [str(v) for v in shown[col]]
        elif col in percent:
            shown[col] = [("–" if _missing(v) else f"{v:.{max(ndig(col) - 2, 0)}%}") for v in shown[col]]
        elif _whole(shown[col]):  # counts and steps, made floats by a missing value: integers
            shown[col] = [_number(v if _missing(v) else int(v), ndig(col)) for v in shown[col]]
        else:
            shown[col] = [_number(v, ndig(col)) for v in shown[col]]
    if isinstance(shown.index, pd.MultiIndex):
        shown.index = pd.MultiIndex.from_arrays(
            [[_number(v, 3) if isinstance(v, (float, np.floating)) else v for v in shown.index.get_level_values(i)]
             for i in range(shown.index.nlevels)], names=shown.index.names)
    elif shown.index.dtype.kind == "f":
        shown.index = pd.Index([_number(v, 3) for v in shown.index], name=shown.index.name)
    shown.columns = [f"{c} ({units[c]})" if units and c in units else c for c in shown.columns]
    if transpose and len(shown.index) <= max_columns and (len(shown.columns) > max_columns or (
            _width_px(shown, index) > TABLE_WIDTH_PX >= _width_px(shown.T, index))):
        shown = shown.T
    parts, start = [], 0
    for stop in range(1, len(shown.columns) + 1):  # columns split into tables that each fit the page column
        if stop - start > 1 and _width_px(shown.iloc[:, start:stop], index) > TABLE_WIDTH_PX:
            parts.append(shown.iloc[:, start:stop - 1])
            start = stop - 1
    parts.append(shown.iloc[:, start:])
    attrs = f'class="{" ".join(filter(None, (TABLE_CLASS, classes)))}"'
    stylers = [(part.style if index else part.style.hide(axis="index")).set_table_attributes(attrs) for part in parts]
    return stylers[0] if len(stylers) == 1 else Tables(stylers)


TABLE_WIDTH_PX = 680  # the page's text column at a 1280 px window is 688 px wide; a table must fit it
_CELL_PAD_PX = 18  # a table cell's padding


def _text_px(word: str) -> float:
    """A word's width in px in a table's 16 px font: digits, capitals and symbols are wider than lower case."""
    return sum(8.3 if c.islower() or c in " .,:;'-()[]/" else 10.4 for c in word)


def _width_px(shown, index: bool = True) -> float:
    """A rough narrowest width in px of ``shown`` (cells already text) as the page renders it, which is what must fit
    the column (the browser wraps cells between words and after hyphens to fit, never elsewhere): per column its
    longest word of a cell or the header, plus the index's levels."""
    import re

    def col(header, cells) -> float:  # (cells may hold HTML: a link, a code span)
        words = [w for text in [header, *cells] for w in re.split(r"\s+|(?<=-)", re.sub(r"<[^>]+>", "", str(text)))]
        return max(map(_text_px, words), default=0) + _CELL_PAD_PX
    total = sum(col(h, shown[h] if not isinstance(shown[h], type(shown)) else shown[h].iloc[:, 0])
                for h in shown.columns)
    if index:
        for i in range(shown.index.nlevels):
            total += col(shown.index.names[i] or "", shown.index.get_level_values(i))
    return total


class Tables:
    """Several parts of one table (:func:`format_table` split its columns so that each part fits the page column),
    shown one below the other; ``parts``: their Stylers."""

    def __init__(self, parts):
        self.parts = parts

    def _repr_html_(self) -> str:
        return "\n".join(p.to_html() for p in self.parts)

    def to_html(self) -> str:
        return self._repr_html_()

    def set_caption(self, caption: str):
        self.parts[0].set_caption(caption)
        return self
