"""The tree passes `ruff check` with the project's configuration (pyproject.toml: pycodestyle with the 120-character
line limit, pyflakes, import order): a long line or an unused import fails the suite, as CI runs it."""

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT


def test_ruff_check_passes():
    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(ruff).exists():
        pytest.fail("ruff is not installed: pip install 'lpfa[test]' (make test does)")
    out = subprocess.run([ruff, "check", "--no-cache", "src", "tests", "benchmarks", "scripts"], cwd=ROOT,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-1000:]


def test_no_tracker_numbers_in_code_or_pages():
    """Code, help texts and pages say what a thing is, not which tracker issue asked for it: nothing under src/,
    notebooks/ or book/ matches "issue" followed by a number."""
    import re

    hits = [f"{p.relative_to(ROOT)}:{i}" for d in ("src", "notebooks", "book") for p in sorted((ROOT / d).rglob("*"))
            if p.is_file() and p.suffix in (".py", ".ipynb", ".md", ".json", ".yml")
            for i, line in enumerate(p.read_text(errors="replace").splitlines(), 1)
            if re.search(r"(?i)\bissues? [0-9]", line)]
    assert not hits, hits[:20]


# what a page would say about its own development, not about the science or the project: the machines lent for a
# session, the GPU call planned next, a rerun command (book/rerun.md holds those)
DEVELOPMENT_NOTES = ("next GPU call", "lent machine", "machines lent", "can be held for", "bash scripts/gpu",
                     "PHASE=start", "PHASE=finish")


def _reader_texts():
    """``(name, text)`` of what a reader's page is made of: each notebook cell's source, each page module's source (its
    sentences) and the book's own pages, but book/rerun.md, where the rerun commands belong."""
    import nbformat

    for nb in sorted((ROOT / "notebooks").glob("*.ipynb")):
        for i, cell in enumerate(nbformat.read(nb, as_version=4).cells):
            yield f"{nb.relative_to(ROOT)} cell {i}", cell.source
    for p in sorted((ROOT / "src/lpfa/pages").glob("*.py")):
        yield str(p.relative_to(ROOT)), p.read_text()
    for p in sorted((ROOT / "book").rglob("*.md")):
        if p.name != "rerun.md":
            yield str(p.relative_to(ROOT)), p.read_text()


def test_no_development_notes_on_reader_pages():
    """A page speaks of the science and the project, never of its own development: no phrase of DEVELOPMENT_NOTES
    in the notebooks, the page modules or the book's pages ("not run yet" as a finding is fine); rerun commands live
    on book/rerun.md."""
    texts = list(_reader_texts())
    assert len(texts) > 50 and any("lpfa.pages" in t for _, t in texts)  # the notebooks and page modules were read
    hits = [f"{name}: {phrase!r}" for name, text in texts for phrase in DEVELOPMENT_NOTES
            if phrase.lower() in text.lower()]
    assert not hits, hits[:20]
    rerun = (ROOT / "book/rerun.md").read_text()
    assert "bash scripts/gpu" in rerun  # where the commands went


def test_rerun_page_title_is_the_one_pages_name():
    """Pages point to the rerun commands by book/rerun.md's title (lpfa.pages.RERUN_PAGE)."""
    from lpfa.pages import RERUN_PAGE

    title = (ROOT / "book/rerun.md").read_text().splitlines()[0].removeprefix("# ")
    assert RERUN_PAGE == f"the page *{title}*"
