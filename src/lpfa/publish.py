"""Where the book is published and how one of its pages reruns elsewhere, from one value.

The repository is ``repository.url`` (with ``branch``) in ``_config.yml``, the one place to change for whoever hosts or
forks the book. From it come the launch buttons of every notebook page (Binder, Colab, JupyterHub: Jupyter Book builds
them), the published book's address (:func:`pages_url`, GitHub Pages) and the first cell of every notebook
(:func:`setup_source`): a cell the book removes (tag ``remove-cell``) that does nothing where lpfa is installed and
elsewhere (Colab, a JupyterHub) clones the repository, for lpfa and ``results/``, installs lpfa from it and moves to
the page's folder there. That cell is plain Python, as it runs where lpfa is missing; this module writes it::

    python -m lpfa.publish            # rewrite every notebook's setup cell from _config.yml
    python -m lpfa.publish --check    # exit 1, naming them, if some notebook's setup cell is not the current one
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import nbformat
import yaml

from lpfa.paths import repo_root

SETUP_CELL_ID = "lpfa-setup"  # a fixed id: rewriting the cell changes its source only
SETUP_TAGS = ["remove-cell"]  # not on the book's pages
CLONE_DIR = "lpfa-clone"  # not "lpfa": a folder of that name would import as an (empty) namespace package
CPU_WHEELS = "https://download.pytorch.org/whl/cpu"  # PyTorch's CPU wheels, where no torch is installed yet


def repository(root: Path | None = None) -> tuple[str, str]:
    """``(url, branch)`` of ``repository`` in ``_config.yml``."""
    cfg = yaml.safe_load(((Path(root) if root else repo_root()) / "_config.yml").read_text())
    repo = cfg.get("repository") or {}
    if not repo.get("url"):
        raise ValueError("_config.yml names no repository.url")
    return str(repo["url"]).rstrip("/"), str(repo.get("branch") or "main")


def github_parts(url: str) -> tuple[str, str]:
    """``(owner, name)`` of a ``https://github.com/OWNER/NAME`` repository URL."""
    m = re.fullmatch(r"https://github\.com/([\w.-]+)/([\w.-]+?)(?:\.git)?/?", url)
    if not m:
        raise ValueError(f"{url!r}: expected https://github.com/OWNER/NAME (GitHub Pages publishes the book)")
    return m.group(1), m.group(2)


def pages_url(url: str) -> str:
    """Where GitHub Pages publishes repository ``url``: ``https://OWNER.github.io/NAME/`` (a repository named
    ``OWNER.github.io`` is published at the root)."""
    owner, name = github_parts(url)
    host = f"{owner.lower()}.github.io"
    return f"https://{host}/" if name.lower() == host else f"https://{host}/{name}/"


def setup_source(url: str, branch: str, folder: str) -> str:
    """The setup cell of a notebook in ``folder`` (``notebooks``, ``book``) of repository ``url`` at ``branch``."""
    if not re.fullmatch(r"[\w./-]+", branch) or not re.fullmatch(r"[\w.:/@-]+", url):
        raise ValueError(f"repository {url!r} at branch {branch!r}: unexpected characters")
    return f"""\
# Setup where lpfa is not installed (Colab, a JupyterHub): clone the book's repository (lpfa and results/), install
# lpfa from it and run this page from its folder there. Where lpfa is installed (make lab, Binder) it does nothing.
try:
    import lpfa  # noqa: F401
except ImportError:
    import importlib, importlib.util, os, pathlib, subprocess, sys
    here = pathlib.Path.cwd()
    root = next((p for p in (here, *here.parents) if (p / "src/lpfa/__init__.py").is_file()), here / "{CLONE_DIR}")
    if not root.is_dir():
        subprocess.run(["git", "clone", "--depth", "1", "--branch", "{branch}", "{url}", str(root)], check=True)
    cpu = [] if importlib.util.find_spec("torch") else ["--extra-index-url", "{CPU_WHEELS}"]
    subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", f"{{root}}[book]", *cpu], check=True)
    importlib.invalidate_caches()
    os.environ["LPFA_ROOT"] = str(root)
    os.chdir(root / "{folder}")
    del here, root, cpu  # the parameter check refuses names that are not the page's parameters"""


def with_setup_cell(nb, source: str):
    """``nb`` with its setup cell (id :data:`SETUP_CELL_ID`) set to ``source``: replaced where it is, else inserted
    just before the cell tagged ``parameters`` (papermill inserts its parameters after that one)."""
    cells = [c for c in nb.cells if c.get("id") != SETUP_CELL_ID]
    at = next((i for i, c in enumerate(cells) if "parameters" in c.metadata.get("tags", [])), None)
    if at is None:
        raise ValueError("the notebook has no cell tagged 'parameters'")
    cell = nbformat.v4.new_code_cell(source, id=SETUP_CELL_ID, metadata={"tags": list(SETUP_TAGS)})
    nb.cells = cells[:at] + [cell] + cells[at:]
    return nb


def sync(root: Path | None = None, check: bool = False) -> list[Path]:
    """Give every notebook of the book the setup cell of ``_config.yml``'s repository; returns those that lacked it
    (with ``check``, changing nothing)."""
    from lpfa.book import toc_notebooks

    root = Path(root) if root else repo_root()
    url, branch = repository(root)
    stale = []
    for path in toc_notebooks(root):
        text = path.read_text()
        nb = with_setup_cell(nbformat.reads(text, as_version=4), setup_source(url, branch, path.parent.name))
        new = nbformat.writes(nb)
        new += "" if new.endswith("\n") else "\n"  # as nbformat.write ends a file
        if new != text:
            stale.append(path)
            if not check:
                path.write_text(new)
    return stale


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lpfa.publish", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--check", action="store_true", help="change nothing; exit 1 if a notebook's setup cell is stale")
    a = p.parse_args(argv)
    root = repo_root()
    stale = sync(root, check=a.check)
    names = ", ".join(str(s.relative_to(root)) for s in stale)
    url, branch = repository(root)
    if a.check and stale:
        print(f"setup cells not those of {url} ({branch}): {names}; python -m lpfa.publish rewrites them",
              file=sys.stderr)
        return 1
    print(f"{len(stale)} notebook(s) rewritten for {url} ({branch}){': ' + names if stale else ''}; "
          f"published at {pages_url(url)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
