"""Make ``results/cpu_smoke/<run>/``: the CPU run that pages 05 and 13 show by default, so that building the book
trains nothing.

    python scripts/cpu_smoke.py                 # results/cpu_smoke/cpu-<date>/
    python scripts/cpu_smoke.py --name cpu-test --out /tmp/results

It trains the ``cpu-smoke`` preset with the parameters of page 13's parameters cell
(:func:`lpfa.pages.training.train_smoke`) into ``<run>/smoke/``, measures Figs. 8 and 9 on its last checkpoint with
``python -m lpfa.structure`` (:func:`lpfa.structure.summarize_run`, on as many validation sequences of as many tokens
as page 05's parameters cell says) into ``<run>/smoke/structure.json``, drops the checkpoint and the
replay log (megabytes that no page reads), and writes ``<run>/provenance.json``. A few minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import datetime as dt
import os
import shutil
import sys
import time
from pathlib import Path

import torch

from lpfa.book import notebook_parameters
from lpfa.pages.training import SMOKE_EXPERIMENT, SMOKE_LABEL, train_smoke
from lpfa.paths import repo_root, results_dir
from lpfa.provenance import provenance, write_json
from lpfa.structure import main as structure_main


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--name", default=f"cpu-{dt.date.today().isoformat()}", help="the run folder's name")
    p.add_argument("--out", default=None, help="the results folder (default: the repository's results/)")
    a = p.parse_args(argv)
    run = Path(os.path.relpath(Path(a.out or results_dir()) / SMOKE_EXPERIMENT / a.name))  # as the records name it
    if run.exists():
        raise SystemExit(f"{run} exists: choose another --name")
    smoke = run / SMOKE_LABEL
    p13 = notebook_parameters(repo_root() / "notebooks" / "13_training.ipynb")  # the pages' defaults: one source
    p05 = notebook_parameters(repo_root() / "notebooks" / "05_structure.ipynb")
    train_args = [p13[k] for k in ("preset", "max_steps", "attn_policy", "diag_interval")]
    t0 = time.time()
    _, summary = train_smoke(*train_args, out_dir=str(smoke))
    structure_cmd = ["--run", str(smoke), "--out", str(smoke / "structure.json"), "--n-seq", str(p05["n_seqs"]),
                     "--seq-len", str(p05["seq_len"]), "--device", "cpu"]
    structure_main(structure_cmd)
    for name in ("ckpt", "replay.jsonl"):
        path = smoke / name
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    prov = provenance(command=" ".join(["python scripts/cpu_smoke.py", *(sys.argv[1:] if argv is None else argv)]))
    prov["what"] = (f"the `{p13['preset']}` preset trained on the CPU for {summary['steps']} steps (page 13's "
                    "parameters), then `python -m lpfa.structure` on its last checkpoint "
                    f"({p05['n_seqs']} validation sequences of {p05['seq_len']} tokens, page 05's); the checkpoint "
                    "and replay log are not kept")
    prov["commands"] = [f"lpfa.pages.training.train_smoke({', '.join(map(repr, train_args))}, out_dir={str(smoke)!r})",
                        "python -m lpfa.structure " + " ".join(structure_cmd)]
    prov["wall_s"] = round(time.time() - t0, 1)
    prov["torch_threads"] = torch.get_num_threads()  # a busy machine trains faster on fewer (lpfa.book.kernel_threads)
    write_json(run / "provenance.json", prov)
    print(f"wrote {run} in {prov['wall_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
