"""``lpfa`` command line: one verb per tool, each handing its arguments to that tool's own ``main(argv)``.

    lpfa                          # the verbs, one line each
    lpfa VERB --help              # a verb's options (``lpfa train --help`` = ``python -m lpfa.train --help``)
    lpfa book --profile small     # = python -m lpfa.book --profile small
"""

from __future__ import annotations

import argparse
import importlib
import runpy
import sys

# verb: (module whose main(argv) it runs, one-line description). The modules are imported only when their verb runs.
VERBS: dict[str, tuple[str, str]] = {
    "book": ("lpfa.book", "execute the notebooks (a parameter profile) and build the HTML book"),
    "tokens": ("lpfa.cli", "tokenize a folder of .txt[.xz|.gz] files into nanoGPT train.bin/val.bin"),
    "train": ("lpfa.train",
              "train GPT-2 with an attention precision policy (presets, a YAML config, key=value fields)"),
    "launch": ("lpfa.launch", "start twin trainings in the background, follow them and collect their small files"),
    "replay": ("lpfa.replay",
               "replay a run from a checkpoint and measure low- against high-precision attention (Figs. 4-6)"),
    "structure": ("lpfa.structure", "ties and rank-1 structure of a trained run's checkpoint (Figs. 8, 9)"),
    "sfa-sweep": ("lpfa.sfa_sweep",
                  "what SFA's row-sum clamp does to a run's rows, for several β, at every checkpoint"),
    "doctor": ("lpfa.doctor",
               "every link of the failure chain per layer and head of one checkpoint, with a verdict per head"),
}


def usage() -> str:
    width = max(map(len, VERBS))
    lines = ["usage: lpfa VERB [options]   (lpfa VERB --help for a verb's options)", "", "verbs:"]
    lines += [f"  {verb:<{width}}  {VERBS[verb][1]}" for verb in VERBS]
    return "\n".join(lines)


class _OneLineErrors(argparse.ArgumentParser):
    def error(self, message):  # one line, without the usage block
        self.exit(2, f"{self.prog}: error: {message} ({self.prog} --help lists the options)\n")


def _tokens(argv: list[str]) -> int:
    # the verb's module, imported when the verb runs as every verb's is (NumPy, tiktoken: `lpfa --help` stays instant)
    from lpfa.data import TOKENIZERS, build_token_files

    p = _OneLineErrors(prog="lpfa tokens",
                       description="Tokenize a folder of .txt[.xz|.gz] files into nanoGPT train.bin/val.bin")
    p.add_argument("src", help="folder of text files")
    p.add_argument("out", help="output folder")
    p.add_argument("--tokenizer", default="auto", choices=TOKENIZERS)
    p.add_argument("--val-fraction", type=float, default=0.05)
    a = p.parse_args(argv)
    meta = build_token_files(a.src, a.out, a.tokenizer, a.val_fraction)
    print(f"{a.out}: {meta['train_tokens']:,} train / {meta['val_tokens']:,} val tokens ({meta['tokenizer']})")
    return 0


def _exit_code(e: SystemExit) -> int:
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    print(e.code, file=sys.stderr)  # sys.exit("message"): the interpreter would print it and exit 1
    return 1


def run_verb(verb: str, argv: list[str]) -> int:
    """Run ``verb``'s module on ``argv`` (its ``main(argv)``, else the module as ``python -m``); returns the exit
    status."""
    if verb == "tokens":
        entry = _tokens
    else:
        module = VERBS[verb][0]
        entry = getattr(importlib.import_module(module), "main", None)
        if not callable(entry):  # no main(argv): run it as `python -m module argv...`
            def entry(args: list[str], module: str = module) -> int:
                saved = sys.argv
                sys.argv = [module, *args]
                try:
                    runpy.run_module(module, run_name="__main__", alter_sys=True)
                finally:
                    sys.argv = saved
                return 0
    try:
        return int(entry(argv) or 0)
    except SystemExit as e:  # argparse's --help and its usage errors
        return _exit_code(e)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    verb = argv[0]
    if verb not in VERBS:
        print(f"lpfa: unknown verb {verb!r}; the verbs are {', '.join(VERBS)} (lpfa --help describes them)",
              file=sys.stderr)
        return 2
    return run_verb(verb, argv[1:])


if __name__ == "__main__":
    raise SystemExit(main())
