"""Execute every notebook of the book with papermill, then build the Jupyter Book (1.x).

The source notebooks in ``notebooks/`` stay output-free. :func:`build` copies the book's sources
into ``<out>/_build/stage``, executes each notebook listed in ``_toc.yml`` there with papermill (with
the parameters of a *profile*), and runs ``jupyter-book build`` on the stage; the HTML lands in
``<out>/_build/html`` (``<out>`` is the repository by default).

Profiles live in ``notebooks/parameters.yml``: ``default`` is what the book shows (each notebook's
own defaults plus any overrides there), ``small`` is the quick set CI uses. The default profile trains nothing and
runs no long computation: the pages read committed runs (``results/``), and training on the CPU is a parameter
(``train=True``). Notebooks that train call :func:`train_quietly`, so that the training log lands in the run folder,
not on the page.

The notebooks execute ``jobs`` at a time, each kernel limited to its share of the CPU cores (:func:`kernel_threads`),
so that a busy machine is not oversubscribed; the progress bar names the notebooks running and how long each has run
(:func:`running_postfix`), and a notebook that fails leaves its log and its partly executed copy in
``<out>/_build/logs/``. Command line::

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
import time
import traceback
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from pathlib import Path

import yaml
from tqdm.auto import tqdm

from lpfa.paths import repo_root

BOOK_SOURCES = ("_config.yml", "_toc.yml", "book", "references.bib", "results/tables")  # tables: the pages link them
CELL_TIMEOUT_S = 1200  # a hung cell fails the build; the longest, 300 CPU training steps (train=True), takes minutes
CONSOLE_LOG = "console.txt"  # what a quiet block would have printed, in the run folder
THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")  # what torch and numpy's BLAS read


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


def notebook_parameters(notebook: Path, profile: str = "default", root: Path | None = None) -> dict:
    """The parameters ``notebook`` runs with in the book at ``profile``: its ``parameters`` cell's values, then the
    profile's overrides (:func:`profile_parameters`). Lets a test call a page module as the book would, without
    executing the notebook."""
    import nbformat  # optional (the book extra)

    root = Path(root) if root else repo_root()
    cell = next(c for c in nbformat.read(notebook, as_version=4).cells if "parameters" in c.metadata.get("tags", []))
    ns: dict = {}
    exec(cell.source, ns)  # the cell holds assignments of literals (tests/test_notebooks.py)
    values = {k: v for k, v in ns.items() if not k.startswith("__")}
    return {**values, **(profile_parameters(root, profile).get(Path(notebook).stem) or {})}


def _ipc_kernel_manager():
    """A kernel manager whose kernel talks over Unix sockets in a folder of its own. Kernels launched at the same time
    by several processes (the book's parallel execution, the test workers) can be handed the same TCP ports; a
    message then goes to the wrong kernel and papermill waits for it forever. Its kernels run with
    :data:`lpfa.widgets.STATIC_ENV` set: a rendered page gets static figures, not widgets that do nothing there."""
    import uuid

    from jupyter_client.manager import AsyncKernelManager  # optional (the book extra), as papermill
    from jupyter_core.paths import jupyter_runtime_dir

    from lpfa.widgets import STATIC_ENV

    class IPCKernelManager(AsyncKernelManager):
        def __init__(self, **kwargs):
            super().__init__(**kwargs)
            runtime = jupyter_runtime_dir()
            os.makedirs(runtime, exist_ok=True)
            self.transport = "ipc"
            self.ip = os.path.join(runtime, f"lpfa-{uuid.uuid4().hex[:12]}")  # sockets <ip>-<n>, removed at shutdown

        async def _async_pre_start_kernel(self, **kw):
            # the page is rendered, not read live: widgets draw once (lpfa.widgets.interactive_or_static)
            kw["env"] = {**(kw.get("env") or os.environ), STATIC_ENV: "1"}
            return await super()._async_pre_start_kernel(**kw)

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


def cpu_cores() -> int:
    """The CPU cores this process may run on (its affinity; ``os.cpu_count()`` counts the host's)."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def kernel_threads(jobs: int, cores: int | None = None) -> int:
    """Threads per notebook kernel when ``jobs`` run at once on ``cores`` cores (default :func:`cpu_cores`): their
    share, at least 1. More threads than cores make torch's OpenMP workers wait on each other, which on a busy
    machine slows a kernel down many times over."""
    return max(1, (cores or cpu_cores()) // max(1, jobs))


def _limit_threads(threads: int) -> None:
    """A build worker's initializer: the kernels it starts inherit ``threads`` as their thread count."""
    for var in THREAD_VARS:
        os.environ[var] = str(threads)


def _clock(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m}:{s:02d}"


def running_postfix(running: dict[str, float], now: float | None = None) -> str:
    """The progress bar's postfix: each running notebook (``{name: start time}``, :func:`time.monotonic`) with how
    long it has run, the longest first: ``"13_training 2:31, 05_structure 0:12"``."""
    now = time.monotonic() if now is None else now
    return ", ".join(f"{name} {_clock(now - t0)}" for name, t0 in sorted(running.items(), key=lambda kv: kv[1]))


def _execute_logged(src: Path, dst: Path, parameters: dict | None, log: Path) -> float:
    """:func:`execute_notebook` in a build worker; returns its wall time in seconds. A failure writes ``log`` (the
    notebook, its parameters, the error with the failing cell's traceback, and where papermill left the partly
    executed copy) and raises RuntimeError naming it."""
    t0 = time.monotonic()
    try:
        execute_notebook(src, dst, parameters)
    except Exception as e:  # noqa: BLE001  (logged, then raised again with the log's path)
        log.parent.mkdir(parents=True, exist_ok=True)
        kept = log.with_suffix(".ipynb")
        if dst.is_file():
            shutil.copy2(dst, kept)
        log.write_text(f"{src.name} failed after {time.monotonic() - t0:.0f} s with parameters {parameters or {}}\n"
                       f"partly executed copy: {kept if kept.is_file() else '(none written)'}\n\n"
                       + "".join(traceback.format_exception(e)))
        raise RuntimeError(f"{src.name} failed: {type(e).__name__}: {str(e)[:2000]}\nlog: {log}") from None
    return time.monotonic() - t0


def execute_all(todo: list[tuple[Path, Path, dict | None]], jobs: int, logs: Path, desc: str = "executing notebooks",
                threads: int | None = None) -> dict[str, float]:
    """Execute ``todo`` (``(notebook, executed copy, parameters)``) ``jobs`` at a time in fresh worker processes, each
    kernel with :func:`kernel_threads` threads (or ``threads``); returns ``{notebook stem: seconds}``. The progress
    bar counts the notebooks done and names those running (:func:`running_postfix`). After a failure no more start;
    those running finish, then RuntimeError names every failed notebook and its log under ``logs``."""
    threads = threads or kernel_threads(jobs)
    queue, running, times, failed = list(todo), {}, {}, []
    with ProcessPoolExecutor(jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_limit_threads,
                             initargs=(threads,)) as pool, \
            tqdm(total=len(todo), desc=f"{desc} ({jobs} at a time, {threads} thread{'s' * (threads > 1)} each)",
                 unit="nb") as bar:
        while queue or running:
            while queue and len(running) < jobs and not failed:  # exactly `jobs` in flight: the postfix names them
                src, dst, params = queue.pop(0)
                fut = pool.submit(_execute_logged, src, dst, params, logs / f"{src.stem}.log")
                running[fut] = (src.stem, time.monotonic())
            if not running:
                break
            done, _ = wait(running, timeout=1.0, return_when=FIRST_COMPLETED)
            for fut in done:
                name, _ = running.pop(fut)
                try:
                    times[name] = fut.result()
                    bar.write(f"  {name}: {times[name]:.0f} s")
                except Exception as e:  # noqa: BLE001  (collected: the build fails below, naming each)
                    failed.append(str(e))
                    bar.write(f"  {name}: FAILED ({e})")
                bar.update(1)
            bar.set_postfix_str(running_postfix({n: t0 for n, t0 in running.values()}), refresh=True)
    if failed:
        raise RuntimeError(f"{len(failed)} notebook(s) failed:\n" + "\n".join(failed))
    return times


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
    CPU core, :func:`cpu_cores`), each in its own kernel (:func:`execute_all`)."""
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
    jobs = max(1, min(jobs or cpu_cores(), len(todo) or 1))
    t0 = time.monotonic()
    times = execute_all([(nb, stage / nb.relative_to(root), params.get(nb.stem)) for nb in todo], jobs,
                        out / "_build" / "logs", desc=f"executing notebooks ({profile})")
    if times:
        print(f"executed {len(times)} notebooks in {time.monotonic() - t0:.0f} s; the slowest: "
              + ", ".join(f"{n} {t:.0f} s" for n, t in sorted(times.items(), key=lambda kv: -kv[1])[:3]))
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
