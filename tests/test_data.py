"""lpfa.data: tokenizer choice, nanoGPT token files with their tokenizer recorded, clear errors."""

import gzip
import json
import lzma
from pathlib import Path

import numpy as np
import pytest

from lpfa import data
from lpfa.paths import EMBEDDED_CORPUS_DIR

SHARED_BPE = Path(__file__).resolve().parents[2] / "shared" / "tiktoken-cache"


@pytest.fixture
def no_bpe_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(tmp_path / "empty-cache"))


def test_auto_falls_back_to_bytes_offline(no_bpe_cache):
    assert not data.gpt2_bpe_available()
    tok = data.get_tokenizer("auto")
    assert (tok.name, tok.vocab_size, tok.eot_token) == ("bytes", 257, 256)
    text = "Let there be light: ünïcode ✓"
    assert tok.encode(text) == list(text.encode("utf-8"))
    assert tok.decode(tok.encode(text)) == text


@pytest.mark.skipif(not SHARED_BPE.is_dir(), reason="GPT-2 BPE files not available (../shared/tiktoken-cache)")
def test_auto_uses_gpt2_when_cached(monkeypatch):
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", str(SHARED_BPE))
    tok = data.get_tokenizer("auto")
    assert (tok.name, tok.vocab_size, tok.eot_token) == ("gpt2", 50257, 50256)
    assert tok.encode("Hello world") == [15496, 995]  # GPT-2's ids
    assert tok.decode([15496, 995]) == "Hello world"


def test_unknown_tokenizer():
    with pytest.raises(ValueError, match="unknown tokenizer 'bpe'.*auto"):
        data.get_tokenizer("bpe")


def test_build_token_files_roundtrip(tmp_path, no_bpe_cache):
    src = tmp_path / "texts"
    src.mkdir()
    docs = {"a.txt": "alpha " * 50, "b.txt.xz": "beta gamma " * 40, "c.txt.gz": "delta\n" * 30}
    (src / "a.txt").write_text(docs["a.txt"])
    (src / "b.txt.xz").write_bytes(lzma.compress(docs["b.txt.xz"].encode()))
    (src / "c.txt.gz").write_bytes(gzip.compress(docs["c.txt.gz"].encode()))
    (src / "ignored.md").write_text("not a text file")
    meta = data.build_token_files(src, tmp_path / "out", tokenizer="auto", val_fraction=0.1)
    train, m_train = data.load_tokens(tmp_path / "out", "train")
    val, _ = data.load_tokens(tmp_path / "out", "val")
    assert m_train == meta == json.loads((tmp_path / "out" / "meta.json").read_text())
    assert meta["tokenizer"] == "bytes" and meta["vocab_size"] == 257
    assert [s["file"] for s in meta["sources"]] == ["a.txt", "b.txt.xz", "c.txt.gz"]
    assert train.dtype == np.uint16 and meta["train_tokens"] == train.size and meta["val_tokens"] == val.size
    # every document plus its end-of-text token, split 90/10 per document, nothing lost or reordered
    total = sum(len(t.encode()) + 1 for t in docs.values())
    assert train.size + val.size == total
    assert int((np.concatenate([train, val]) == 256).sum()) == 3
    assert bytes(train[:12].astype(np.uint8)).decode() == "alpha alpha "
    assert not list((tmp_path / "out").glob(".*tmp"))  # no temporary files left


def test_load_tokens_reads_plain_nanogpt_folder(tmp_path):
    ids = np.arange(100, dtype=np.uint16)
    ids.tofile(tmp_path / "train.bin")
    arr, meta = data.load_tokens(tmp_path, "train")
    assert meta == {} and np.array_equal(arr, ids)


def test_token_file_errors(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        data.load_tokens(tmp_path, "train")
    (tmp_path / "val.bin").write_bytes(b"\x00\x01\x02")
    with pytest.raises(ValueError, match="odd number of bytes"):
        data.load_tokens(tmp_path, "val")
    with pytest.raises(ValueError, match="split must be"):
        data.load_tokens(tmp_path, "test")
    with pytest.raises(FileNotFoundError, match="no .txt"):
        data.build_token_files(tmp_path, tmp_path / "o")
    with pytest.raises(ValueError, match="val_fraction"):
        data.build_token_files(EMBEDDED_CORPUS_DIR, tmp_path / "o", val_fraction=1.5)


def test_embedded_corpus_builds_and_is_cached(tmp_path, monkeypatch, no_bpe_cache):
    monkeypatch.setenv("LPFA_CACHE", str(tmp_path / "cache"))
    out = data.embedded_token_dir("auto")
    train, meta = data.load_tokens(out, "train")
    assert meta["tokenizer"] == "bytes"
    assert meta["train_tokens"] > 5_000_000  # ~5.8 MB of UTF-8 text
    first_doc = lzma.decompress((EMBEDDED_CORPUS_DIR / "jargon.txt.xz").read_bytes())  # sorted first
    assert bytes(train[:200].astype(np.uint8)) == first_doc[:200]
    stamp = (out / "train.bin").stat().st_mtime_ns
    assert data.embedded_token_dir("auto") == out and (out / "train.bin").stat().st_mtime_ns == stamp


def test_embedded_corpus_is_small_and_documented():
    files = sorted(EMBEDDED_CORPUS_DIR.glob("*.txt.xz"))
    assert [f.name for f in files] == ["jargon.txt.xz", "kjv.txt.xz"]
    assert sum(f.stat().st_size for f in files) < 10 * 2**20
    sources = (EMBEDDED_CORPUS_DIR / "SOURCES.md").read_text()
    for f in files:
        assert f.name in sources
    assert "public domain" in sources


def test_build_from_hf_dataset_on_a_local_dataset(tmp_path, no_bpe_cache):
    datasets = pytest.importorskip("datasets")
    texts = [f"document {i}: " + "word " * (i % 7 + 1) for i in range(10)]
    datasets.Dataset.from_dict({"text": texts, "id": list(range(10))}).save_to_disk(str(tmp_path / "ds"))
    meta = data.build_from_hf_dataset(tmp_path / "ds", tmp_path / "out", tokenizer="bytes", val_every=5)
    train, _ = data.load_tokens(tmp_path / "out", "train")
    val, _ = data.load_tokens(tmp_path / "out", "val")
    assert meta["documents"] == 10 and meta["tokenizer"] == "bytes"
    # documents 4 and 9 (every 5th) are validation, the rest training, each followed by end-of-text
    want_val = b"".join(t.encode() + b"\x00" for t in (texts[4], texts[9]))
    got_val = bytes(int(x) if x != 256 else 0 for x in val)
    assert got_val == want_val
    assert int((train == 256).sum()) == 8 and train.size + val.size == sum(len(t) + 1 for t in texts)
    with pytest.raises(ValueError, match="no column 'content'"):
        data.build_from_hf_dataset(tmp_path / "ds", tmp_path / "out2", tokenizer="bytes", text_field="content")
    assert not (tmp_path / "out2" / "train.bin").exists()


def test_gpu_corpus_size_matches_the_corpus_where_present():
    """lpfa.data.GPU_CORPUS_TRAIN_TOKENS is the GPU corpus's train.bin size: checked against the shipped xz file when
    the checkout sits next to ../shared/corpus (the GPU runs' corpus; CI may not have it)."""
    import lzma

    from lpfa.data import GPU_CORPUS_TRAIN_TOKENS
    from lpfa.paths import repo_root

    xz = repo_root().parent / "shared" / "corpus" / "train.bin.xz"
    if not xz.is_file():
        pytest.skip(f"{xz} is not here")
    with lzma.open(xz) as f:
        n = sum(len(chunk) for chunk in iter(lambda: f.read(1 << 24), b"")) // 2  # uint16 token ids
    assert n == GPU_CORPUS_TRAIN_TOKENS


def test_two_processes_building_one_folder_both_finish(tmp_path):
    """Two runs started together on a fresh machine build the same token folder at once: each keeps its own temporary
    files, so both finish, with the same files."""
    import subprocess
    import sys
    import time

    src = tmp_path / "src"
    src.mkdir()
    rng = np.random.default_rng()
    words = ["attention", "rounding", "bias", "flash", "tie", "softmax", "gradient"]
    for i in range(3):
        (src / f"doc{i}.txt").write_text(" ".join(rng.choice(words, size=200_000)))
    go = tmp_path / "go"  # both start building at once, after their imports
    code = ("import sys, time, pathlib; from lpfa.data import build_token_files\n"
            "while not pathlib.Path(sys.argv[3]).exists(): time.sleep(0.005)\n"
            "build_token_files(sys.argv[1], sys.argv[2], tokenizer='bytes')")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(src), str(tmp_path / "out"), str(go)],
                              stderr=subprocess.PIPE)
             for _ in range(2)]
    time.sleep(1.0)
    go.touch()
    for p in procs:
        assert p.wait(timeout=120) == 0, p.stderr.read().decode()[-500:]
    want = data.build_token_files(src, tmp_path / "again", tokenizer="bytes")
    assert json.loads((tmp_path / "out" / "meta.json").read_text())["train_tokens"] == want["train_tokens"]
    for split in ("train", "val"):
        assert (tmp_path / "out" / f"{split}.bin").read_bytes() == (tmp_path / "again" / f"{split}.bin").read_bytes()
    assert not list((tmp_path / "out").glob(".*.tmp"))
