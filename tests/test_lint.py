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
