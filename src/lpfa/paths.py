"""Where things live. One definition, imported everywhere."""

from __future__ import annotations

import os
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parent
EMBEDDED_CORPUS_DIR = PACKAGE_DIR / "embedded_corpus"


def repo_root() -> Path:
    """The lpfa checkout (the folder with ``_toc.yml``), from ``$LPFA_ROOT`` or by walking up. Raises a clear error
    for an installed (non-editable) package used outside a checkout."""
    env = os.environ.get("LPFA_ROOT")
    candidates = [Path(env)] if env else []
    candidates += [Path.cwd(), *Path.cwd().parents, *PACKAGE_DIR.parents]
    for c in candidates:
        if (c / "_toc.yml").is_file() and (c / "notebooks").is_dir():
            return c.resolve()
    raise FileNotFoundError(
        "cannot find the lpfa checkout (a folder with _toc.yml and notebooks/): run from inside it "
        "or set LPFA_ROOT to its path"
    )


def results_dir() -> Path:
    """Committed results of real runs: ``<repo>/results``."""
    return repo_root() / "results"


def cache_dir() -> Path:
    """Derived, re-creatable files (token files, ...): ``$LPFA_CACHE`` or ``~/.cache/lpfa``."""
    d = Path(os.environ.get("LPFA_CACHE", Path.home() / ".cache" / "lpfa"))
    d.mkdir(parents=True, exist_ok=True)
    return d
