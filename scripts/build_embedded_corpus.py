"""Rebuild src/lpfa/embedded_corpus/*.txt.xz from Debian packages (run once by a maintainer).

Needs Debian's `bible-kjv` (the `bible` program and the KJV text) and `jargon-text`:

    apt-get install bible-kjv jargon-text
    python scripts/build_embedded_corpus.py

Both texts are in the public domain; see src/lpfa/embedded_corpus/SOURCES.md.
"""

import gzip
import lzma
import re
import subprocess
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "src" / "lpfa" / "embedded_corpus"


def kjv() -> str:
    raw = subprocess.run(["bible", "-f", "Gen1:1-Rev22:21"], capture_output=True, text=True, check=True).stdout
    chapters: dict[tuple[str, int], list[str]] = {}
    order: list[tuple[str, int]] = []
    for line in raw.splitlines():
        m = re.match(r"^(\S+?)(\d+):(\d+) (.*)$", line)
        if not m:
            continue
        key = (m.group(1), int(m.group(2)))
        if key not in chapters:
            chapters[key] = []
            order.append(key)
        chapters[key].append(m.group(4).strip())
    if len(order) != 1189:  # chapters in the KJV
        raise SystemExit(f"expected 1189 chapters, got {len(order)}")
    return "\n\n".join(" ".join(chapters[k]) for k in order) + "\n"


def jargon() -> str:
    with gzip.open("/usr/share/doc/jargon-text/jargon.txt.gz", "rt", encoding="utf-8") as f:
        text = f.read()
    text = re.sub(r"[ \t]+\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


if __name__ == "__main__":
    for name, text in (("kjv", kjv()), ("jargon", jargon())):
        path = OUT / f"{name}.txt.xz"
        path.write_bytes(lzma.compress(text.encode("utf-8"), preset=9 | lzma.PRESET_EXTREME))
        print(f"{path}: {len(text):,} characters, {path.stat().st_size:,} bytes compressed")
