"""The book's widgets: live in JupyterLab, a static figure on the rendered book.

A widget on a static HTML page shows controls that do nothing and embeds its state in the page. The book build
(:func:`lpfa.book.execute_notebook`) starts its kernels with :data:`STATIC_ENV` set; there
:func:`interactive_or_static` draws the update function once, at the page's own values, with plain matplotlib (no
Output widget: a figure drawn into one while papermill executes the cell can leave the executing client waiting for a
reply that never comes) and one line saying where the controls live. Where a reader has a kernel (``make lab``) it
returns an ``ipywidgets.interactive`` over the same function.

An update function returns what it shows: a matplotlib Figure, a Markdown string, anything IPython displays, or a
tuple of these.
"""

from __future__ import annotations

import os
from collections.abc import Callable

STATIC_ENV = "LPFA_STATIC"  # set (not "" or "0") by the book build for the kernels it starts
NOTE = "Interactive in JupyterLab: `make lab`, then this page."


def is_static() -> bool:
    """Whether this kernel renders a static page (:data:`STATIC_ENV` set, as the book build and the notebook tests
    do), where a widget would show dead controls."""
    return os.environ.get(STATIC_ENV, "") not in ("", "0")


def show(result) -> None:
    """Display what an update function returned: a Figure through matplotlib (shown once, then closed), a string as
    Markdown, a tuple item by item, anything else with IPython's ``display``; None shows nothing."""
    from IPython.display import Markdown, display

    if result is None:
        return
    if isinstance(result, tuple):
        for r in result:
            show(r)
        return
    from matplotlib.figure import Figure

    if isinstance(result, Figure):
        import matplotlib.pyplot as plt

        plt.show()  # the inline backend shows the open figures and closes them: the figure appears once
    elif isinstance(result, str):
        display(Markdown(result))
    else:
        display(result)


def interactive_or_static(update: Callable, controls: Callable[[], dict] | dict, static_args: dict | None,
                          note: str = NOTE, manual: bool = False):
    """``update`` under ``controls`` where a reader has a live kernel, drawn once on a static page.

    ``controls``: ``{argument: ipywidgets control}``, or a function returning it (so that no widget is created on a
    static build, where its state would be embedded in the page). ``static_args``: the arguments of the static
    drawing, the page's own values (also those the controls should start at). ``manual``: draw on a "Draw" button
    rather than on every change (for slow drawings).

    Static (:func:`is_static`): calls ``update(**static_args)`` (unless None), shows what it returns (:func:`show`)
    and the one-line ``note``; returns None. Live: returns the ``ipywidgets.interactive``, whose drawings go through
    :func:`show`."""
    if is_static():
        from IPython.display import Markdown, display

        if static_args is not None:
            show(update(**static_args))
        display(Markdown(f"*{note}*"))
        return None
    import ipywidgets as w

    widgets = controls() if callable(controls) else controls
    missing = sorted(set(static_args or ()) - set(widgets))
    if missing:
        raise ValueError(f"static_args {missing}: expected a control for each argument, have {sorted(widgets)}")

    def draw(**kwargs):
        show(update(**kwargs))

    options = {"manual": True, "manual_name": "Draw"} if manual else {}
    return w.interactive(draw, options, **widgets)
