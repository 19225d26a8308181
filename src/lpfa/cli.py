"""``lpfa`` command line: ``lpfa book ...``, ``lpfa tokens ...``."""

from __future__ import annotations

import argparse
import sys


def _tokens(argv: list[str]) -> int:
    from lpfa.data import TOKENIZERS, build_token_files

    p = argparse.ArgumentParser(prog="lpfa tokens", description="Tokenize a folder of .txt[.xz|.gz] files into nanoGPT train.bin/val.bin")
    p.add_argument("src", help="folder of text files")
    p.add_argument("out", help="output folder")
    p.add_argument("--tokenizer", default="auto", choices=TOKENIZERS)
    p.add_argument("--val-fraction", type=float, default=0.05)
    a = p.parse_args(argv)
    meta = build_token_files(a.src, a.out, a.tokenizer, a.val_fraction)
    print(f"{a.out}: {meta['train_tokens']:,} train / {meta['val_tokens']:,} val tokens ({meta['tokenizer']})")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    commands = {"book": "lpfa.book", "tokens": None}
    if not argv or argv[0] not in commands:
        print(f"usage: lpfa {{{','.join(commands)}}} [options]   (lpfa COMMAND --help for more)", file=sys.stderr)
        return 2
    if argv[0] == "book":
        from lpfa.book import main as book_main

        return book_main(argv[1:])
    return _tokens(argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
