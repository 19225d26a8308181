import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
os.environ.setdefault("LPFA_ROOT", str(ROOT))


_EXECUTED: dict = {}  # notebook -> its executed copy at the small profile, or the error it raised


@pytest.fixture(scope="session")
def executed_notebook(tmp_path_factory):
    """``executed_notebook(nb)``: notebook ``nb`` executed at the `small` profile, once per test session (the notebook
    tests and the book share the run; an error is raised again to every caller). Tests that use it belong to the
    ``notebooks`` xdist group, so that one worker holds the session's copies."""
    from lpfa.book import execute_notebook, profile_parameters

    small = profile_parameters(ROOT, "small")

    def run(nb: Path) -> Path:
        if nb not in _EXECUTED:
            try:
                _EXECUTED[nb] = execute_notebook(nb, tmp_path_factory.mktemp(nb.stem) / nb.name, small.get(nb.stem))
            except Exception as e:  # noqa: BLE001  (kept, and raised to each test of this notebook)
                _EXECUTED[nb] = e
        if isinstance(_EXECUTED[nb], Exception):
            raise _EXECUTED[nb]
        return _EXECUTED[nb]

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
