"""Tokenizers and token files in nanoGPT's format.

Token files are flat little-endian ``uint16`` arrays, ``train.bin`` and ``val.bin``, exactly as
nanoGPT writes them, plus a ``meta.json`` that records which tokenizer produced them (and the
checksums of the texts they came from), so a model never silently reads ids of another vocabulary.

Tokenizers:

* ``"gpt2"`` — GPT-2's byte-level BPE through tiktoken (vocabulary 50,257, ``<|endoftext|>`` = 50256).
  tiktoken downloads its two BPE files once; offline it needs them in its cache
  (``TIKTOKEN_CACHE_DIR``).
* ``"bytes"`` — the documented deterministic fallback: the UTF-8 bytes of the text (ids 0–255) and
  an end-of-text id 256, vocabulary 257. Needs nothing.
* ``"auto"`` — ``"gpt2"`` when tiktoken's cache already holds the GPT-2 files, else ``"bytes"``. It
  never touches the network, so a fresh offline machine works and gives the same result every time.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import lzma
import os
import tempfile
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tiktoken
from tqdm.auto import tqdm

from lpfa.paths import EMBEDDED_CORPUS_DIR, cache_dir

__all__ = [
    "Tokenizer",
    "get_tokenizer",
    "gpt2_bpe_available",
    "read_documents",
    "build_token_files",
    "build_from_hf_dataset",
    "load_tokens",
    "embedded_token_dir",
]

# tiktoken's GPT-2 BPE files; tiktoken caches each under the SHA-1 of its URL.
_GPT2_BPE_URLS = (
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/vocab.bpe",
    "https://openaipublic.blob.core.windows.net/gpt-2/encodings/main/encoder.json",
)
TOKENIZERS = ("auto", "gpt2", "bytes")
GPU_CORPUS_TRAIN_TOKENS = 43_109_361
"""Tokens in ``train.bin`` of the GPU runs' corpus (``../shared/corpus``: Debian documentation, GPT-2 BPE; not
OpenWebText), for epoch counts on the pages; ``tests/test_data.py`` checks it against the corpus where it is present."""


@dataclass(frozen=True)
class Tokenizer:
    """A named tokenizer: ``encode(text) -> list[int]`` without special tokens, plus its end-of-text id."""

    name: str
    vocab_size: int
    eot_token: int
    _enc: object = None

    def encode(self, text: str) -> list[int]:
        if self.name == "bytes":
            return list(text.encode("utf-8"))
        return self._enc.encode_ordinary(text)

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self.name == "bytes":
            return bytes(i for i in ids if i < 256).decode("utf-8", errors="replace")
        return self._enc.decode(ids)


def _tiktoken_cache_dirs() -> list[Path]:
    # the same order tiktoken.load.read_file_cached uses
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        return [Path(os.environ["TIKTOKEN_CACHE_DIR"])]
    if "DATA_GYM_CACHE_DIR" in os.environ:
        return [Path(os.environ["DATA_GYM_CACHE_DIR"])]
    return [Path(tempfile.gettempdir()) / "data-gym-cache"]


def gpt2_bpe_available() -> bool:
    """True when tiktoken can build the GPT-2 encoding without a download."""
    keys = [hashlib.sha1(u.encode()).hexdigest() for u in _GPT2_BPE_URLS]
    return any(all((d / k).is_file() for k in keys) for d in _tiktoken_cache_dirs())


def get_tokenizer(name: str = "auto") -> Tokenizer:
    """Return the tokenizer ``name`` (one of ``"auto"``, ``"gpt2"``, ``"bytes"``; see the module docs)."""
    if name not in TOKENIZERS:
        raise ValueError(f"unknown tokenizer {name!r}: expected one of {TOKENIZERS}")
    if name == "auto":
        name = "gpt2" if gpt2_bpe_available() else "bytes"
    if name == "bytes":
        return Tokenizer("bytes", 257, 256)
    try:
        enc = tiktoken.get_encoding("gpt2")
    except Exception as e:  # no network and no cache
        raise RuntimeError(
            "tiktoken could not load the GPT-2 BPE files (no network and not in its cache). Set "
            "TIKTOKEN_CACHE_DIR to a folder holding them, or use tokenizer='bytes' (or 'auto')."
        ) from e
    return Tokenizer("gpt2", enc.n_vocab, enc.eot_token, enc)


def _read_text(path: Path) -> str:
    opener = {".xz": lzma.open, ".gz": gzip.open}.get(path.suffix, open)
    with opener(path, "rt", encoding="utf-8") as f:
        return f.read()


def read_documents(folder: str | Path) -> list[tuple[str, str]]:
    """All ``*.txt``, ``*.txt.xz`` and ``*.txt.gz`` files of ``folder`` (sorted by name) as (name, text)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"text folder {folder} does not exist")
    files = sorted(p for p in folder.iterdir() if p.name.endswith((".txt", ".txt.xz", ".txt.gz")))
    if not files:
        raise FileNotFoundError(f"no .txt, .txt.xz or .txt.gz files in {folder}")
    return [(p.name, _read_text(p)) for p in files]


def _sources_digest(folder: Path) -> list[dict]:
    files = sorted(p for p in folder.iterdir() if p.name.endswith((".txt", ".txt.xz", ".txt.gz")))
    return [{"file": p.name, "sha256": hashlib.sha256(p.read_bytes()).hexdigest()} for p in files]


class _TokenFileWriter:
    """Streams token ids into ``.train.bin.<pid>.tmp`` / ``.val.bin.<pid>.tmp`` and renames them when finished, so an
    interrupted build never leaves a file that looks complete, and two processes building the same folder at once
    (two runs started together on a fresh machine) each finish with the same complete files."""

    def __init__(self, out: Path, tok: Tokenizer):
        if tok.vocab_size > 2**16:
            raise ValueError(f"tokenizer {tok.name} has {tok.vocab_size} ids; uint16 token files hold at most 65536")
        self.out, self.tok = out, tok
        out.mkdir(parents=True, exist_ok=True)
        self.tmp = {split: out / f".{split}.{os.getpid()}.tmp" for split in ("train.bin", "val.bin", "meta.json")}
        self.files = {split: open(self.tmp[f"{split}.bin"], "wb") for split in ("train", "val")}
        self.counts = {"train": 0, "val": 0}

    def write(self, split: str, ids) -> None:
        a = np.asarray(ids, dtype=np.uint16)
        a.tofile(self.files[split])
        self.counts[split] += int(a.size)

    def finish(self, meta: dict) -> dict:
        for f in self.files.values():
            f.close()
        meta = {"format": "nanoGPT uint16 token ids", "tokenizer": self.tok.name, "vocab_size": self.tok.vocab_size,
                "eot_token": self.tok.eot_token, **meta,
                "train_tokens": self.counts["train"], "val_tokens": self.counts["val"]}
        for split in ("train", "val"):
            self.tmp[f"{split}.bin"].replace(self.out / f"{split}.bin")
        self.tmp["meta.json"].write_text(json.dumps(meta, indent=1) + "\n")
        self.tmp["meta.json"].replace(self.out / "meta.json")
        return meta

    def abort(self) -> None:
        for split, f in self.files.items():
            f.close()
            self.tmp[f"{split}.bin"].unlink(missing_ok=True)


def build_token_files(
    src: str | Path, out: str | Path, tokenizer: str = "auto", val_fraction: float = 0.05
) -> dict:
    """Tokenize every document of folder ``src`` into ``out/train.bin``, ``out/val.bin`` and ``out/meta.json``. Each
    document is followed by the end-of-text token. The last ``val_fraction`` of each document's tokens goes to
    ``val.bin``, the rest to ``train.bin``, so both splits see every source. Files are written under temporary names and
    renamed, so an interrupted build leaves no half file. Returns the meta record."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must lie strictly between 0 and 1, got {val_fraction}")
    src, out = Path(src), Path(out)
    docs = read_documents(src)
    tok = get_tokenizer(tokenizer)
    w = _TokenFileWriter(out, tok)
    try:
        for _, text in docs:
            ids = tok.encode(text) + [tok.eot_token]
            cut = len(ids) - max(1, int(round(len(ids) * val_fraction)))
            w.write("train", ids[:cut])
            w.write("val", ids[cut:])
    except BaseException:
        w.abort()
        raise
    return w.finish({"val_fraction": val_fraction, "sources": _sources_digest(src)})


def build_from_hf_dataset(
    dataset, out: str | Path, tokenizer: str = "gpt2", text_field: str = "text", split: str = "train",
    val_every: int = 2000, num_proc: int | None = None,
) -> dict:
    """Tokenize a Hugging Face dataset (e.g. ``"openwebtext"``, as nanoGPT does) into nanoGPT token files: ``dataset`` a
    hub name (downloaded by ``datasets.load_dataset``: needs network), a folder written by ``Dataset.save_to_disk``, or
    a ``datasets.Dataset``. Every ``val_every``-th document goes to ``val.bin``. Returns the meta record."""
    import datasets  # optional (the test extra), and heavy: only this function uses it

    if isinstance(dataset, (str, Path)):
        name = str(dataset)
        ds = datasets.load_from_disk(name) if Path(name).is_dir() else datasets.load_dataset(name, split=split)
    else:
        ds, name = dataset, getattr(dataset, "info", None) and dataset.info.dataset_name
    if isinstance(ds, datasets.DatasetDict):
        ds = ds[split]
    if text_field not in ds.column_names:
        raise ValueError(f"the dataset has no column {text_field!r}; its columns are {ds.column_names}")
    if val_every < 2:
        raise ValueError(f"val_every must be >= 2, got {val_every}")
    tok = get_tokenizer(tokenizer)
    ids = ds.map(lambda ex: {"ids": tok.encode(ex[text_field]) + [tok.eot_token]},
                 remove_columns=ds.column_names, num_proc=num_proc, desc="tokenizing")
    w = _TokenFileWriter(Path(out), tok)
    try:
        for i, ex in enumerate(tqdm(ids, desc="writing", unit="doc")):
            w.write("val" if i % val_every == val_every - 1 else "train", ex["ids"])
    except BaseException:
        w.abort()
        raise
    return w.finish({"source": str(name), "documents": len(ds), "val_every": val_every})


def load_tokens(folder: str | Path, split: str = "train") -> tuple[np.memmap, dict]:
    """Memory-map ``folder/{split}.bin`` and return it with the folder's ``meta.json`` (or ``{}`` if absent). A nanoGPT
    data folder without ``meta.json`` loads too; its tokenizer is then unknown."""
    if split not in ("train", "val"):
        raise ValueError(f"split must be 'train' or 'val', got {split!r}")
    folder = Path(folder)
    path = folder / f"{split}.bin"
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist (expected nanoGPT-format train.bin/val.bin)")
    if path.stat().st_size % 2:
        raise ValueError(f"{path} has an odd number of bytes: not a uint16 token file")
    meta_path = folder / "meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.is_file() else {}
    return np.memmap(path, dtype=np.uint16, mode="r"), meta


def embedded_token_dir(tokenizer: str = "auto") -> Path:
    """Token files of the embedded corpus, built on first use into the cache (a few seconds)."""
    tok = get_tokenizer(tokenizer)
    out = cache_dir() / f"embedded-{tok.name}"
    meta_path = out / "meta.json"
    if meta_path.is_file():
        meta = json.loads(meta_path.read_text())
        if meta.get("sources") == _sources_digest(EMBEDDED_CORPUS_DIR) and meta.get("tokenizer") == tok.name:
            return out
    build_token_files(EMBEDDED_CORPUS_DIR, out, tokenizer=tok.name)
    return out


# --------------------------------------------------------------------------------------------
# Deterministic batches and replay (paper Sec. 3.1: every run sees the same data in the same order)
# --------------------------------------------------------------------------------------------
_CHECKSUMS: dict[tuple, str] = {}


def data_checksum(path: str | Path) -> str:
    """SHA-256 of a token file (cached per path, size and modification time)."""
    path = Path(path)
    st = path.stat()
    key = (str(path.resolve()), st.st_size, st.st_mtime_ns)
    if key not in _CHECKSUMS:
        h = hashlib.sha256()
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 24), b""):
                h.update(chunk)
        _CHECKSUMS[key] = h.hexdigest()
    return _CHECKSUMS[key]


def batch_starts(seed: int, step: int, micro: int, batch_size: int, n_tokens: int, block_size: int) -> np.ndarray:
    """Start offsets of the sequences of optimizer step ``step``, micro-step ``micro``, a pure function of (seed, step,
    micro): independent of every model, precision or device setting, so twin runs see identical batches, a resumed run
    continues the same stream, and any step can be replayed on its own."""
    if n_tokens <= block_size + 1:
        raise ValueError(f"the token file has {n_tokens} tokens; a block of {block_size} needs at least "
                         f"{block_size + 2}")
    rng = np.random.default_rng([seed, step, micro])
    return rng.integers(0, n_tokens - block_size - 1, size=batch_size, dtype=np.int64)


def get_batch(tokens: np.ndarray, starts: np.ndarray, block_size: int, device: str = "cpu"):
    """Inputs and next-token targets ``(x, y)``, each (len(starts), block_size) int64."""
    import torch  # heavy (about 1 s): tokenizing (lpfa tokens) needs NumPy alone, batches load it

    x = torch.from_numpy(np.stack([np.asarray(tokens[s : s + block_size], dtype=np.int64) for s in starts]))
    y = torch.from_numpy(np.stack([np.asarray(tokens[s + 1 : s + 1 + block_size], dtype=np.int64) for s in starts]))
    if device.startswith("cuda"):
        return x.pin_memory().to(device, non_blocking=True), y.pin_memory().to(device, non_blocking=True)
    return x.to(device), y.to(device)


def drop_partial_line(path: str | Path) -> int:
    """Make an append-only JSON-lines file (metrics.jsonl, replay.jsonl) end with a whole line before appending to
    it: a last line without its newline that is not valid JSON (a write cut short by a kill) is dropped; a valid
    one gets its newline. Returns the number of bytes dropped."""
    path = Path(path)
    if not path.is_file():
        return 0
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return 0
    cut = data.rfind(b"\n") + 1
    try:
        json.loads(data[cut:])
    except ValueError:  # JSONDecodeError, UnicodeDecodeError
        with open(path, "r+b") as f:
            f.truncate(cut)
        return len(data) - cut
    with open(path, "ab") as f:
        f.write(b"\n")
    return 0


class ReplayLog:
    """The batches a run used, one JSON line per optimizer step, headed by the data's checksum. Writing: ``log =
    ReplayLog.create(path, data_file, header)``, then ``log.append(step, starts)``. Reading: ``ReplayLog.open(path,
    data_file)`` refuses a log made for other data; ``starts(step)`` returns the recorded offsets (one array per
    micro-step)."""

    def __init__(self, path: Path, header: dict, steps: dict[int, list[list[int]]]):
        self.path, self.header, self.steps = path, header, steps

    @classmethod
    def create(cls, path: str | Path, data_file: str | Path, header: dict | None = None) -> "ReplayLog":
        path = Path(path)
        head = {"format": "lpfa replay v1", "data_file": Path(data_file).name, "data_sha256": data_checksum(data_file),
                **(header or {})}
        if path.exists():  # appending to a resumed run's log: keep what is there if it matches
            drop_partial_line(path)  # a line the kill cut short: appending starts a fresh one
            return cls.open(path, data_file)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(head) + "\n")
        return cls(path, head, {})

    @classmethod
    def open(cls, path: str | Path, data_file: str | Path) -> "ReplayLog":
        path = Path(path)
        if not path.is_file():
            raise FileNotFoundError(f"replay file {path} does not exist")
        lines = path.read_text().splitlines()
        try:
            head = json.loads(lines[0])
        except (IndexError, json.JSONDecodeError) as e:
            raise ValueError(f"{path} is not an lpfa replay file (no JSON header line)") from e
        if head.get("format") != "lpfa replay v1":
            raise ValueError(f"{path} is not an lpfa replay file (format {head.get('format')!r})")
        have = data_checksum(data_file)
        if head.get("data_sha256") != have:
            raise ValueError(
                f"replay file {path} was recorded on data with SHA-256 {head.get('data_sha256', '?')[:16]}…, "
                f"but {data_file} has {have[:16]}…: refusing to replay it on other data"
            )
        steps = {}
        last = max((i for i, ln in enumerate(lines) if ln.strip()), default=0)
        for i, ln in enumerate(lines[1:], 1):
            if not ln.strip():
                continue
            try:
                rec = json.loads(ln)
                steps[int(rec["step"])] = rec["starts"]
            except (ValueError, KeyError, TypeError) as e:
                if i == last and isinstance(e, json.JSONDecodeError):
                    warnings.warn(f"{path}: skipped line {i + 1}, which is cut short (the run was killed while "
                                  "writing it?)", stacklevel=2)
                    continue
                raise ValueError(f"{path}: line {i + 1} is not a replay record (a JSON object with 'step' and "
                                 f"'starts'): {ln[:60]!r}") from e
        return cls(path, head, steps)

    def append(self, step: int, starts: list[np.ndarray]) -> None:
        rec = {"step": int(step), "starts": [np.asarray(s).tolist() for s in starts]}
        self.steps[int(step)] = rec["starts"]
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")

    def starts(self, step: int) -> list[np.ndarray]:
        if step not in self.steps:
            span = f"{min(self.steps, default=None)}..{max(self.steps, default=None)}"
            raise KeyError(f"replay file {self.path} has no step {step} (it covers {span})")
        return [np.asarray(s, dtype=np.int64) for s in self.steps[step]]
