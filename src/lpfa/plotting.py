"""The book's one figure style: colours per precision mode and matplotlib defaults.

Every notebook calls :func:`use_style` once and takes colours from :data:`COLORS`, so a mode has
the same colour in every figure.
"""

from __future__ import annotations

import matplotlib as mpl

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
    """Apply the book's matplotlib defaults."""
    mpl.rcParams.update(STYLE)
