"""The book's full tables: a table too long for its page (more than :data:`lpfa.plotting.MAX_ROWS` rows) is shown
there as a summary, and in full as a CSV under ``results/tables/`` that the page links (:func:`link`).

Each CSV is made by code from committed results (:data:`FULL_TABLES`), never by hand, and opens with ``#`` lines
saying what it is, which function made it from which results, and from which commit:
``python -m lpfa.pages.tables`` writes them all again (``pandas.read_csv(path, comment="#", index_col=...)`` reads
one back).
"""

from __future__ import annotations

import importlib
import io
import sys
from pathlib import Path

import pandas as pd

from lpfa.paths import repo_root

FOLDER = "results/tables"  # under the repository root; the book copies it beside the pages
# name -> (module, function): the function returns (DataFrame, what it is in a sentence, [results folders it read])
FULL_TABLES = {
    "recipe_fates": ("lpfa.pages.loss_explosion", "full_fates_table"),
    "early_warning_replay": ("lpfa.pages.early_warning", "full_replay_table"),
    "kernel_bias_audit": ("lpfa.pages.kernel_bias", "full_bias_table"),
    "attention_shapes": ("lpfa.pages.kernels", "full_shapes_table"),
    "stabiliser_links": ("lpfa.pages.stabilisers", "full_stabiliser_table"),
}


def path(name: str, root=None) -> Path:
    """Where full table ``name`` lives."""
    if name not in FULL_TABLES:
        raise ValueError(f"name={name!r}: expected one of {', '.join(FULL_TABLES)}")
    return Path(root or repo_root()) / FOLDER / f"{name}.csv"


def make(name: str):
    """``(table, what, sources)`` of full table ``name``, computed now from the committed results."""
    module, function = FULL_TABLES[name]
    return getattr(importlib.import_module(module), function)()


def csv_text(name: str, commit: str | None = None) -> str:
    """Full table ``name`` as its CSV file holds it: ``#`` lines (what it is, the function and the results it was made
    from, ``commit``), then the table."""
    table, what, sources = make(name)
    module, function = FULL_TABLES[name]
    head = [f"# {what}", f"# made by {module}.{function} (python -m lpfa.pages.tables) from "
            + ", ".join(f"{s}" for s in sources)]
    if commit:
        head.append(f"# lpfa commit {commit}")
    buf = io.StringIO()
    table.to_csv(buf)
    return "\n".join(head) + "\n" + buf.getvalue()


def read(name: str, root=None) -> pd.DataFrame:
    """The committed full table ``name`` (its index as written)."""
    return pd.read_csv(path(name, root), comment="#")


def link(name: str, text: str | None = None) -> str:
    """A MyST link from a page (``notebooks/``) to the committed CSV of full table ``name``, for its glued text:
    "the full table (CSV, N rows)"."""
    n = len(read(name))
    return f"{{download}}`{text or 'the full table'} (CSV, {n:,} rows) <../{FOLDER}/{name}.csv>`"


def main(argv: list[str] | None = None) -> int:
    """Write every full table (or those named) under ``results/tables/``."""
    from lpfa.provenance import git_commit

    names = (argv if argv is not None else sys.argv[1:]) or list(FULL_TABLES)
    for name in names:
        p = path(name)
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(csv_text(name, git_commit()))
        print(p)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
