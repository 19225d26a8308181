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


@pytest.fixture(scope="session")
def byte_tokens(tmp_path_factory):
    """A small byte-tokenized corpus (the first 200 kB of the embedded KJV text) for training tests."""
    import lzma

    from lpfa import data as lpfa_data

    src = tmp_path_factory.mktemp("texts")
    text = lzma.decompress((ROOT / "src/lpfa/embedded_corpus/kjv.txt.xz").read_bytes())[:200_000].decode("utf-8", "ignore")
    (src / "kjv.txt").write_text(text)
    out = tmp_path_factory.mktemp("tokens")
    lpfa_data.build_token_files(src, out, tokenizer="bytes", val_fraction=0.1)
    return out
