"""The book's layer sits on top: no library module imports ``lpfa.pages``, and the trainer and the monitor load no page
code, no plotting and no reader of the committed results."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

SRC = ROOT / "src"
PAGES = SRC / "lpfa" / "pages"
# what `import lpfa.train` and `import lpfa.monitor` must not load: the book's pages, plotting, the results readers
# and the learning of the thresholds (the run time reads the committed file instead)
NOT_LOADED = ("lpfa.pages", "matplotlib", "seaborn", "lpfa.compare", "lpfa.results", "lpfa.alarms")


def module_name(path: Path) -> str:
    """``src/lpfa/a/b.py`` → ``lpfa.a.b``; a package's ``__init__.py`` → the package."""
    parts = path.relative_to(SRC).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imported_modules(source: str, module: str, is_package: bool = False) -> set[str]:
    """Every module that ``source`` (the code of ``module``) imports anywhere, inside functions too, with relative
    imports resolved and each ``from X import name`` counted as ``X`` and as ``X.name`` (name may be a submodule)."""
    package = module if is_package else module.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")
            if node.level:
                base = base[: len(base) - (node.level - 1)]
                target = ".".join([*base, node.module] if node.module else base)
            else:
                target = node.module
            out.add(target)
            out.update(f"{target}.{a.name}" for a in node.names)
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None))
              in ("import_module", "__import__") and node.args and isinstance(node.args[0], ast.Constant)):
            out.add(str(node.args[0].value))
    return out


def is_pages(name: str) -> bool:
    return name == "lpfa.pages" or name.startswith("lpfa.pages.")


def test_the_import_parser_sees_every_form():
    """The parser the next test relies on: top-level, in-function, relative and dynamic imports of lpfa.pages."""
    src = ("import os\nfrom lpfa import run\n"
           "def f():\n    from lpfa.pages import seeds\n"
           "def g():\n    from .pages.intro import x\n"
           "def h():\n    import importlib\n    importlib.import_module('lpfa.pages.sfa')\n"
           "class C:\n    def m(self):\n        from . import pages\n")
    got = imported_modules(src, "lpfa.doctor")
    assert {"os", "lpfa", "lpfa.run", "lpfa.pages", "lpfa.pages.seeds", "lpfa.pages.intro", "lpfa.pages.sfa"} <= got
    assert imported_modules("from .reference import x\n", "lpfa.attention", is_package=True) == {
        "lpfa.attention.reference", "lpfa.attention.reference.x"}
    assert not any(map(is_pages, imported_modules("from lpfa import run, pagesx\nimport lpfa.page\n", "lpfa.a")))


def test_no_module_outside_lpfa_pages_imports_it():
    """The library below the book does not know the book exists: no module of src/lpfa outside src/lpfa/pages/
    imports lpfa.pages, at the top or inside a function."""
    files = [p for p in sorted((SRC / "lpfa").rglob("*.py")) if PAGES not in p.parents]
    assert len(files) > 20 and not any(p.is_relative_to(PAGES) for p in files)
    offenders = {}
    for p in files:
        found = sorted(filter(is_pages, imported_modules(p.read_text(), module_name(p), p.name == "__init__.py")))
        if found:
            offenders[str(p.relative_to(ROOT))] = found
    assert not offenders, f"library modules that import the book's pages: {offenders}"


@pytest.mark.parametrize("module", ["lpfa.train", "lpfa.monitor"])
def test_the_trainer_and_the_monitor_load_no_page_plotting_or_results_reading(module):
    """In a fresh interpreter, importing ``module`` leaves none of :data:`NOT_LOADED` in ``sys.modules``."""
    code = (f"import json, sys\nimport {module}\n"
            "print(json.dumps(sorted(m for m in sys.modules if m.startswith(('lpfa', 'matplotlib', 'seaborn')))))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    loaded = json.loads(done.stdout.strip().splitlines()[-1])
    assert module in loaded  # the listing works
    bad = [m for m in loaded if any(m == n or m.startswith(n + ".") for n in NOT_LOADED)]
    assert not bad, f"`import {module}` loads {bad}"
