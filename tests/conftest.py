import json
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMALL_CELL_TIMEOUT_S = 300  # the slowest cell at the small profile takes well under a minute
os.environ.setdefault("LPFA_ROOT", str(ROOT))

if os.environ.get("PYTEST_XDIST_WORKER"):
    # Each pytest-xdist worker (and the notebook kernels and subprocesses it starts) gets its share of the cores, set
    # before torch is imported. By default torch and BLAS in every worker use every core: two workers on two cores
    # then make OpenMP threads wait on each other, and the suite runs about twice as long.
    from lpfa.book import THREAD_VARS, kernel_threads

    for var in THREAD_VARS:
        os.environ.setdefault(var, str(kernel_threads(int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))))



def _patch_triton_language_once_per_launch() -> None:
    """Triton 3.6's interpreter patches ``triton.language`` for the interpreter at every launch (and restores it
    after), and again at every call of a ``@triton.jit`` helper inside the launch, although nothing has changed: about
    a millisecond per helper call, and the kernels call small helpers (rounding, row max, the soft-cap) thousands of
    times per launch (one test_attention_nonfinite case: 13.4 of 30.2 s in ``_patch_lang`` under cProfile; 13.0 s
    without this patch, 8.4 s with it). Here a helper call patches only the language
    modules its own module sees that the running launch has not patched yet, which is every call's effect but the
    first; outside a launch, or on another Triton, the interpreter is left as it is."""
    try:
        import triton
    except ImportError:  # no Triton here: nothing to patch
        return

    if not triton.__version__.startswith("3.6."):
        return
    from triton.runtime import interpreter as ti

    needed = ("_patch_lang", "GridExecutor", "InterpretedFunction", "InterpreterError")
    if not all(hasattr(ti, name) for name in needed):
        return
    patched = []  # per running launch (nested launches stack): the ids of the language modules patched in it
    seen_by = {}  # function -> the ids of the language modules among its globals

    def langs(fn) -> set:
        if fn not in seen_by:
            seen_by[fn] = frozenset(id(v) for v in fn.__globals__.values() if v is ti.tl or v is ti.tl.core)
        return seen_by[fn]

    launch = ti.GridExecutor.__call__

    def grid_call(self, *args, **kwargs):
        patched.append(set(langs(self.fn)))
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.pop()

    def device_call(self, *args, **kwargs):
        seen = langs(self.fn)
        if not patched or not seen <= patched[-1]:
            ti._patch_lang(self.fn)
            if patched:
                patched[-1] |= seen
        fn = self.rewrite()
        try:
            return fn(*args, **kwargs)
        except Exception as e:
            raise ti.InterpreterError(repr(e)) from e

    ti.GridExecutor.__call__ = grid_call
    ti.InterpretedFunction.__call__ = device_call


@pytest.fixture(scope="session", autouse=True)
def _triton_interpreter_patched_once_per_launch():
    """:func:`_patch_triton_language_once_per_launch` for the whole run, applied after collection: importing Triton
    here before the test modules set ``TRITON_INTERPRET`` would fix its choice of the compiled path. It touches the
    interpreter's classes only, which compiled kernels never meet."""
    _patch_triton_language_once_per_launch()


@pytest.fixture(autouse=True)
def _figures_closed():
    """Each test's matplotlib figures are closed after it: the page functions return figures for the notebooks to
    show, and kept open across a worker's tests they passed matplotlib's limit of 20 (a RuntimeWarning) and held
    their memory to the end of the run."""
    yield
    plt = sys.modules.get("matplotlib.pyplot")  # (not imported by a test that draws nothing)
    if plt is not None:
        plt.close("all")

def full_throughput_run() -> Path:
    """The latest committed benchmarks/train_throughput.py run of every backend (no --rows in its recorded command),
    the run pages 06 and 13 read; found here from the files, apart from lpfa.pages.training.throughput_runs."""
    done = sorted((ROOT / "results" / "train_throughput").iterdir(),
                  key=lambda d: json.loads((d / "provenance.json").read_text())["date_utc"])
    return [d for d in done if "--rows" not in json.loads((d / "provenance.json").read_text())["command"]][-1]


@pytest.fixture(scope="session")
def executed_notebook(tmp_path_factory):
    """``executed_notebook(nb)``: notebook ``nb`` executed at the `small` profile, once per test run whatever the
    number of pytest-xdist workers: the first worker to ask executes it into a folder the workers share (under a file
    lock), the others read that copy; an error is kept beside it and raised again to every caller. The notebook tests
    and the book share these copies. ``executed_notebook(nb, wait=False)`` returns None at once instead of waiting
    while another worker executes ``nb``."""
    from filelock import FileLock, Timeout

    from lpfa.book import execute_notebook, profile_parameters

    small = profile_parameters(ROOT, "small")
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "executed_notebooks"
    shared.mkdir(exist_ok=True)

    def run(nb: Path, wait: bool = True) -> Path | None:
        out, failed = shared / nb.name, shared / f"{nb.name}.error"
        lock = FileLock(str(shared / f"{nb.name}.lock"))
        try:
            lock.acquire(timeout=None if wait else 0)
        except Timeout:  # another worker is executing it
            return None
        try:
            if not out.is_file() and not failed.is_file():
                for attempt in (1, 2):  # a cell hung past SMALL_CELL_TIMEOUT_S is tried once more, then fails
                    try:
                        execute_notebook(nb, out.with_suffix(".partial.ipynb"), small.get(nb.stem),
                                         timeout_s=SMALL_CELL_TIMEOUT_S)
                        out.with_suffix(".partial.ipynb").rename(out)
                        break
                    except Exception as e:  # noqa: BLE001  (kept, and raised to each test of this notebook)
                        if attempt == 1 and "timed out" in str(e).lower():
                            continue
                        failed.write_text(f"{type(e).__name__}: {e}")
                        break
        finally:
            lock.release()
        if failed.is_file():
            raise RuntimeError(f"{nb.name} failed at the small profile: {failed.read_text()}")
        return out

    return run


@pytest.fixture(scope="session")
def built_book(tmp_path_factory, executed_notebook):
    """The book built once per test session at the `small` profile from the notebooks the notebook tests executed
    (:func:`executed_notebook`); returns the html folder."""
    from lpfa.book import build, toc_notebooks

    notebooks = toc_notebooks(ROOT)
    # First the notebooks that no other worker is executing, from the last: a worker running the notebook tests asks
    # for them from the first, so the two workers execute different notebooks at once instead of one waiting on the
    # other's kernel.
    for nb in reversed(notebooks):
        executed_notebook(nb, wait=False)
    out = tmp_path_factory.mktemp("book")
    index = build("small", out=out, root=ROOT, executed={nb: executed_notebook(nb) for nb in notebooks})
    return index.parent


@pytest.fixture(scope="session")
def byte_tokens(tmp_path_factory):
    """A small byte-tokenized corpus (the first 200 kB of the embedded KJV text) for training tests."""
    import lzma

    from lpfa import data as lpfa_data

    src = tmp_path_factory.mktemp("texts")
    raw = lzma.decompress((ROOT / "src/lpfa/embedded_corpus/kjv.txt.xz").read_bytes())
    text = raw[:200_000].decode("utf-8", "ignore")
    (src / "kjv.txt").write_text(text)
    out = tmp_path_factory.mktemp("tokens")
    lpfa_data.build_token_files(src, out, tokenizer="bytes", val_fraction=0.1)
    return out


def write_diag_run(root, name, logits, ties, wq, backend="lpfa", policy="paper", losses=None):
    """A training-run folder ``root/exp/r1/name`` (config.json + metrics.jsonl.gz) with a 2-layer, 3-head model:
    layer 1 head 2 carries ``logits``, ``ties`` and ``wq`` at diagnostics steps 0, 100, ...; every other head 1.0
    (ties 0). The loss is ``losses`` per step (default 3.0 for every step up to the last diagnostics)."""
    import gzip

    from lpfa.model import GPTConfig

    d = root / "exp" / "r1" / name
    d.mkdir(parents=True)
    model = GPTConfig(n_layer=2, n_head=3, n_embd=48, attn_backend=backend, attn_policy=policy)
    (d / "config.json").write_text(json.dumps({"model": model.to_dict(), "train": {
        "attn_backend": backend, "attn_policy": policy, "optimizer": "adamw", "seed": 1, "init_seed": 1}}))
    recs = [{"step": s, "loss": loss} for s, loss in enumerate(losses or [3.0] * (100 * len(logits)))]
    for i, (x, t, w) in enumerate(zip(logits, ties, wq)):
        recs.append({"step": 100 * i, "diag": {"max_logit": [[1.0, 1.0, 1.0], [1.0, 1.0, x]],
                                               "tie_fraction": [[0.0, 0.0, 0.0], [0.0, 0.0, t]],
                                               "wq_spectral_norm": [[1.0, 1.0, 1.0], [1.0, 1.0, w]]}})
    (d / "metrics.jsonl.gz").write_bytes(gzip.compress("\n".join(json.dumps(r) for r in recs).encode()))
    return d
