"""Execute every notebook of the book with papermill, then build the Jupyter Book (1.x).

The source notebooks in ``notebooks/`` stay output-free. :func:`build` copies the book's sources
into ``<out>/_build/stage``, executes each notebook listed in ``_toc.yml`` there with papermill (with
the parameters of a *profile*), and runs ``jupyter-book build`` on the stage; the HTML lands in
``<out>/_build/html`` (``<out>`` is the repository by default).

Profiles live in ``notebooks/parameters.yml``: ``default`` is what the book shows (each notebook's
own defaults plus any overrides there), ``small`` is the quick set CI uses. Notebooks that train call
:func:`train_quietly`, so that the training log lands in the run folder, not on the page. Command line::

    lpfa book                      # default profile, HTML in _build/html
    lpfa book --profile small --out /tmp/book
"""

from __future__ import annotations

import argparse
import contextlib
import multiprocessing
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path

import yaml
from tqdm.auto import tqdm

from lpfa.paths import repo_root

BOOK_SOURCES = ("_config.yml", "_toc.yml", "book", "references.bib", "results/tables")  # tables: the pages link them
CELL_TIMEOUT_S = 1200  # the slowest default cell (300 CPU training steps) takes about 2 minutes
CONSOLE_LOG = "console.txt"  # what a quiet block would have printed, in the run folder


@contextlib.contextmanager
def quiet(log_path: str | Path) -> Iterator[Path]:
    """Send what the block prints (stdout, stderr: progress bars, log lines, warnings) to ``log_path`` (appended)
    instead of the notebook page; yields the path. Output written below Python (C libraries) is not caught."""
    log_path = Path(log_path)
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "a") as f, contextlib.redirect_stdout(f), contextlib.redirect_stderr(f):
        yield log_path


def train_quietly(cfg, quiet_log: bool = True) -> dict:
    """``lpfa.train.train(cfg)`` for a notebook: with ``quiet_log`` its console output (the log lines, which
    ``log.txt`` in the run folder keeps anyway, and any progress bar) goes to ``<out_dir>/console.txt``, not
    the page. Returns the run's summary."""
    from lpfa.train import train  # torch and the trainer (seconds to import): only training notebooks need them

    if not quiet_log:
        return train(cfg)
    with quiet(Path(cfg.out_dir) / CONSOLE_LOG):
        return train(cfg)


def toc_files(root: Path) -> list[str]:
    """Every ``file:`` entry of ``_toc.yml``, in order (paths without suffix)."""
    toc = yaml.safe_load((root / "_toc.yml").read_text())
    out: list[str] = []

    def walk(node):
        if isinstance(node, dict):
            for key in ("root", "file"):
                if key in node:
                    out.append(str(node[key]))
            for v in node.values():
                if isinstance(v, (list, dict)):
                    walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(toc)
    return out


def toc_notebooks(root: Path) -> list[Path]:
    """The notebooks the book renders, in table-of-contents order."""
    return [root / f"{f}.ipynb" for f in toc_files(root) if (root / f"{f}.ipynb").is_file()]


def profile_parameters(root: Path, profile: str) -> dict[str, dict]:
    """``{notebook stem: papermill parameters}`` for ``profile`` from ``notebooks/parameters.yml``."""
    path = root / "notebooks" / "parameters.yml"
    profiles = yaml.safe_load(path.read_text()) if path.is_file() else {}
    if profile != "default" and profile not in (profiles or {}):
        raise ValueError(f"unknown profile {profile!r}: {path} defines {sorted(profiles or {})}")
    return (profiles or {}).get(profile) or {}


def _ipc_kernel_manager():
    """A kernel manager whose kernel talks over Unix sockets in a folder of its own. Kernels launched at the same time
    by several processes (the book's parallel execution, the test workers) can be handed the same TCP ports; a
    message then goes to the wrong kernel and papermill waits for it forever."""
    import uuid

    from jupyter_client.manager import AsyncKernelManager  # optional (the book extra), as papermill
    from jupyter_core.paths import jupyter_runtime_dir

    class IPCKernelManager(AsyncKernelManager):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            runtime = jupyter_runtime_dir()
            os.makedirs(runtime, exist_ok=True)
            self.transport = "ipc"
            self.ip = os.path.join(runtime, f"lpfa-{uuid.uuid4().hex[:12]}")  # sockets <ip>-<n>, removed at shutdown

    return IPCKernelManager


def execute_notebook(src: Path, dst: Path, parameters: dict | None = None, timeout_s: int = CELL_TIMEOUT_S) -> Path:
    """Run ``src`` with papermill into ``dst`` (working directory: ``src``'s folder), its kernel on Unix sockets
    (:func:`_ipc_kernel_manager`); a cell that runs longer than ``timeout_s`` fails it."""
    import papermill as pm  # optional (the book extra)

    dst.parent.mkdir(parents=True, exist_ok=True)
    pm.execute_notebook(
        str(src),
        str(dst),
        parameters=parameters or {},
        kernel_name="python3",
        cwd=str(src.parent),
        progress_bar=False,
        execution_timeout=timeout_s,  # a hung cell fails the build instead of blocking it forever
        kernel_manager_class=_ipc_kernel_manager(),
    )
    return dst


def _jupyter_book() -> str:
    exe = Path(sys.executable).parent / "jupyter-book"
    found = str(exe) if exe.exists() else shutil.which("jupyter-book")
    if not found:
        raise FileNotFoundError("jupyter-book is not installed: pip install 'lpfa[book]'")
    return found


def build(profile: str = "default", out: str | Path | None = None, root: Path | None = None,
          executed: dict | None = None, jobs: int | None = None) -> Path:
    """Execute the notebooks at ``profile`` and build the HTML book; returns the ``index.html`` path.

    ``executed``: ``{notebook path: its executed copy}`` of notebooks already run at this profile (the tests run each
    notebook once and build the book from those copies); the rest execute here, ``jobs`` at a time (default: one per
    CPU core), each in its own kernel."""
    root = Path(root) if root else repo_root()
    out = Path(out) if out else root
    params = profile_parameters(root, profile)
    stage = out / "_build" / "stage"
    if stage.exists():
        shutil.rmtree(stage)
    stage.mkdir(parents=True)
    for name in BOOK_SOURCES:
        src = root / name
        if src.is_dir():
            shutil.copytree(src, stage / name)
        elif src.is_file():
            shutil.copy2(src, stage / name)
    notebooks = toc_notebooks(root)
    unknown = set(params) - {nb.stem for nb in notebooks}
    if unknown:
        raise ValueError(f"profile {profile!r} names notebooks that are not in _toc.yml: {sorted(unknown)}")
    done = {Path(k): Path(v) for k, v in (executed or {}).items()}
    for nb in notebooks:
        if nb in done:
            (stage / nb.relative_to(root)).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(done[nb], stage / nb.relative_to(root))
    todo = [nb for nb in notebooks if nb not in done]
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(todo) or 1))
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn")) as pool:  # fresh workers
        futures = {pool.submit(execute_notebook, nb, stage / nb.relative_to(root), params.get(nb.stem)): nb
                   for nb in todo}
        for f in tqdm(as_completed(futures), total=len(todo), desc=f"executing notebooks ({profile}, {jobs} at a time)",
                      unit="nb"):
            f.result()  # a failing notebook stops the build with its error
    cmd = [_jupyter_book(), "build", str(stage), "--path-output", str(out), "--all", "-W", "--keep-going"]
    subprocess.run(cmd, check=True)
    index = out / "_build" / "html" / "index.html"
    if not index.is_file():
        raise RuntimeError(f"jupyter-book finished but {index} is missing")
    return index


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="lpfa book", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--profile", default="default", help="parameter profile from notebooks/parameters.yml")
    p.add_argument("--out", default=None, help="folder that receives _build/html (default: the repository)")
    p.add_argument("--jobs", type=int, default=None, help="notebooks executed at a time (default: one per CPU core)")
    a = p.parse_args(argv)
    if a.jobs is not None and a.jobs < 1:
        p.error(f"--jobs={a.jobs}: expected a positive integer")
    index = build(a.profile, a.out, jobs=a.jobs)
    print(f"\nThe book is built: {index}\nOpen it with:  python -m http.server -d {index.parent}  "
          "(then http://localhost:8000)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
