import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SMALL_CELL_TIMEOUT_S = 300  # the slowest cell at the small profile takes well under a minute
os.environ.setdefault("LPFA_ROOT", str(ROOT))


@pytest.fixture(scope="session")
def executed_notebook(tmp_path_factory):
    """``executed_notebook(nb)``: notebook ``nb`` executed at the `small` profile, once per test run whatever the
    number of pytest-xdist workers: the first worker to ask executes it into a folder the workers share (under a file
    lock), the others read that copy; an error is kept beside it and raised again to every caller. The notebook tests
    and the book share these copies."""
    from filelock import FileLock

    from lpfa.book import execute_notebook, profile_parameters

    small = profile_parameters(ROOT, "small")
    base = tmp_path_factory.getbasetemp()
    shared = (base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base) / "executed_notebooks"
    shared.mkdir(exist_ok=True)

    def run(nb: Path) -> Path:
        out, failed = shared / nb.name, shared / f"{nb.name}.error"
        with FileLock(str(shared / f"{nb.name}.lock")):
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
        if failed.is_file():
            raise RuntimeError(f"{nb.name} failed at the small profile: {failed.read_text()}")
        return out

    return run


@pytest.fixture(scope="session")
def built_book(tmp_path_factory, executed_notebook):
    """The book built once per test session at the `small` profile from the notebooks the notebook tests executed
    (:func:`executed_notebook`); returns the html folder."""
    from lpfa.book import build, toc_notebooks

    out = tmp_path_factory.mktemp("book")
    index = build("small", out=out, root=ROOT, executed={nb: executed_notebook(nb) for nb in toc_notebooks(ROOT)})
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
    import json

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
