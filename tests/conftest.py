import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("LPFA_ROOT", str(ROOT))


@pytest.fixture(scope="session")
def built_book(tmp_path_factory):
    """The book built once per test session at the `small` profile; returns the html folder."""
    from lpfa.book import build

    out = tmp_path_factory.mktemp("book")
    index = build("small", out=out, root=ROOT)
    return index.parent
