"""The book's one figure style (seaborn's theme with the book's sizes), colours per precision mode, table formatting.

Every plotting function of lpfa calls :func:`use_style` and takes colours from :data:`COLORS`, so a mode has
the same colour in every figure.
"""

from __future__ import annotations

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


def _number(x, digits: int) -> str:
    """One table cell: integers with thousands separators, other numbers to ``digits`` significant digits, missing
    values as an en dash, booleans as yes/no."""
    if x is None or (isinstance(x, (float, np.floating)) and math.isnan(x)):
        return "–"
    if isinstance(x, (bool, np.bool_)):
        return "yes" if x else "no"
    if isinstance(x, (int, np.integer)) or (isinstance(x, (float, np.floating)) and float(x).is_integer()
                                            and abs(x) >= 1000):
        return f"{int(x):,}"
    if isinstance(x, (float, np.floating)):
        if not math.isfinite(x):
            return str(x)
        v = float(f"{x:.{digits}g}")
        return f"{v:,.{max(digits - 1 - int(math.floor(math.log10(abs(v)))), 0)}f}" if v else "0"
    return str(x)


def format_table(df, units: dict | None = None, percent=(), digits: int = 3, max_columns: int = 8, index: bool = True,
                 raw=("seed", "init_seed")):
    """A DataFrame as a page shows it: numbers to ``digits`` significant digits (integers with thousands
    separators), the ``percent`` columns as percentages, missing values as "–", booleans as yes/no, ``units``
    (``{column: unit}``) in the column names, and a table with more than ``max_columns`` columns transposed when that
    makes it fit the page column (at most ``max_columns`` rows). ``raw`` columns (seeds) are shown as they are.
    Returns a pandas Styler."""
    shown = df.copy()
    for col in shown.columns:
        if col in raw:
            shown[col] = [str(v) for v in shown[col]]
        elif col in percent:
            shown[col] = [("–" if v is None or v != v else f"{v:.{max(digits - 2, 0)}%}") for v in shown[col]]
        else:
            shown[col] = [_number(v, digits) for v in shown[col]]
    shown.columns = [f"{c} ({units[c]})" if units and c in units else c for c in shown.columns]
    if len(shown.columns) > max_columns and len(shown.index) <= max_columns:
        shown = shown.T
    styler = shown.style
    return styler if index else styler.hide(axis="index")
