"""The book's own layer: one module per notebook, holding that page's tables, figures and sentences.

A notebook imports its page module and calls it: prose in Markdown, one call per figure or table, numbers glued.
The library below (:mod:`lpfa.run`, :mod:`lpfa.compare`, :mod:`lpfa.experiments`, the analyses) never imports this
package. The modules, in the book's reading order: :mod:`.intro` (the scorecard), :mod:`.structure` (page 05),
:mod:`.loss_explosion` (06), :mod:`.spectral_norms` (07), :mod:`.tie_frequency` (08), :mod:`.sfa` (09),
:mod:`.isolation` (10), :mod:`.seeds` (11), :mod:`.training` (13), :mod:`.stabilisers` (17).
"""

from __future__ import annotations


def and_join(items: list[str]) -> str:
    """``a``, ``a and b``, ``a, b and c``."""
    return " and ".join([", ".join(items[:-1]), items[-1]] if len(items) > 1 else items)
