"""A/B timing of flash_forward's (or flash_backward's) options on one GPU: each option set against the defaults, in
the same process, interleaved, by ``triton.testing.do_bench`` medians.

    python benchmarks/kernel_options.py --out DIR --presets paper,paper_sfa --options raw_max=False sfa_count_pass=True
    python benchmarks/kernel_options.py --kernel backward --presets fa2,paper --options fold_scale=False num_warps=8
    python benchmarks/kernel_options.py --kernel backward --presets fa2 --shapes 16x1024,4x4096,1x16384 \
        --options "dq_mode='ordered'" "dq_mode='ordered'+block_m=32"

Prints one line per (preset, T, option): the default's and the option's µs and their ratio, and whether the option
gives the default's bits (an option set may join several keyword=value by "+"; the bit-identical options are
switches for tests and benchmarks,
:mod:`lpfa.attention.triton_fwd` and :mod:`lpfa.attention.triton_bwd`; launch tuning may round differently).
``--kernel backward`` times flash_backward alone, on the default forward's O and lse. With ``--out``, writes the
rows to ``DIR/forward_options.json`` (``DIR/backward_options.json``) beside its ``provenance.json``.
"""

import argparse
import ast
import math
import statistics
from pathlib import Path

import torch
from attention import interleaved_ms  # benchmarks/attention.py (this folder is on sys.path when run as a script)

from lpfa.attention.triton_bwd import flash_backward
from lpfa.attention.triton_fwd import flash_forward
from lpfa.provenance import provenance, write_json


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--presets", default="paper,paper_sfa")
    p.add_argument("--kernel", choices=["forward", "backward"], default="forward")
    p.add_argument("--options", nargs="+", default=["raw_max=False"],
                   help="keyword=value of flash_forward (flash_backward), each timed against the defaults")
    p.add_argument("--T", default="1024,4096", help="sequence lengths, each at batch 16 (or --shapes)")
    p.add_argument("--shapes", default=None, help="BxT pairs instead of --T, e.g. 16x1024,4x4096,1x16384")
    p.add_argument("--rounds", type=int, default=3, help="interleaved rounds per pair")
    p.add_argument("--out", default=None, help="folder for KERNEL_options.json and provenance.json")
    a = p.parse_args()
    if not torch.cuda.is_available():
        p.error("needs a CUDA GPU")
    opts = {}
    for o in a.options:
        opts[o] = {}
        for part in o.split("+"):
            key, _, value = part.partition("=")
            if not value:
                p.error(f"--options {o!r}: expected keyword=value, several joined by '+'")
            opts[o][key] = ast.literal_eval(value)
    try:
        shapes = ([tuple(int(x) for x in s.split("x")) for s in a.shapes.split(",")] if a.shapes else
                  [(16, int(t)) for t in a.T.split(",")])
    except ValueError:
        p.error(f"--shapes {a.shapes!r} / --T {a.T!r}: expected BxT pairs (16x1024,1x16384) / lengths (1024,4096)")
    prov = provenance(config=vars(a))
    out = Path(a.out) / f"{a.kernel}_options.json" if a.out else None
    if a.out:
        write_json(Path(a.out) / "provenance.json", prov)
    print(prov["device"], flush=True)
    rows = []
    H, D = 12, 64
    for B, T in shapes:
        q, k, v, do = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        for name in a.presets.split(","):
            if a.kernel == "forward":
                def call(**kw):
                    return flash_forward(q, k, v, name, 1 / math.sqrt(D), **kw)
            else:
                o, lse = flash_forward(q, k, v, name, 1 / math.sqrt(D))

                def call(**kw):
                    return flash_backward(do, q, k, v, o, lse, name, 1 / math.sqrt(D), grad_dtype=q.dtype, **kw)
            base = call()
            for label, kw in opts.items():
                other = call(**kw)
                same = all(torch.equal(x, y) for x, y in zip(base, other))
                t0, t1 = interleaved_ms({"default": call, label: lambda: call(**kw)}, a.rounds).values()
                m0, m1 = statistics.median(t0) * 1e3, statistics.median(t1) * 1e3
                print(f"{name:10s} T {T:5d}  default {m0:8.1f} us  {label} {m1:8.1f} us  ratio {m1 / m0:.3f}  "
                      f"{'same bits' if same else 'BITS DIFFER'}", flush=True)
                rows.append({"preset": name, "B": B, "H": H, "T": T, "D": D, "option": label, "default_us": m0,
                             "option_us": m1, "ratio": m1 / m0, "same_bits": same})
                if out:  # after every row: a run cut by its time limit keeps what it measured
                    write_json(out, rows)


if __name__ == "__main__":
    main()
