"""Sweep the Triton kernels' launch configurations (tiles, warps, stages, exp flavour) on one GPU.

Launch tuning only: a policy's blocks fix the rounding, so every configuration computes the same
policy. Prints forward and backward TFLOP/s per configuration at GPT-2 shapes (B=16, H=12, T=1024,
D=64; ``--shape B,H,T,D`` for another) next to SDPA-flash measured in the same run, timed from CUDA graphs (the
GPU's time, without the host's launches; ``--eager`` times calls as the host issues them).
Usage: ``python benchmarks/tune_attention.py --out DIR``.
"""

from __future__ import annotations

import argparse
import ast
import math
import time
from pathlib import Path

import torch
from attention import graph_ms  # benchmarks/attention.py (this folder is on sys.path when run as a script)

from lpfa.attention import GPT2_SHAPE  # B, H, T, D
from lpfa.provenance import provenance, write_json


def ms(fn, rep=20):
    """Mean ms per call of ``fn``, ``rep`` calls back to back between two CUDA events, after three warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for _ in range(rep):
        fn()
    e.record()
    torch.cuda.synchronize()
    return s.elapsed_time(e) / rep


def parse_shape(text: str) -> tuple[int, int, int, int]:
    """``"4,12,4096,64"`` as (B, H, T, D); a one-line ValueError naming the text otherwise."""
    try:
        shape = tuple(int(x) for x in text.split(","))
    except ValueError:
        shape = ()
    if len(shape) != 4 or min(shape) < 1 or shape[3] not in (16, 32, 64, 128):
        raise ValueError(f"--shape {text!r}: expected B,H,T,D, four positive integers with D in 16, 32, 64, 128")
    return shape


def rows_from_log(log: str, shape=GPT2_SHAPE) -> dict:
    """tune.json's content from a run's printed output: the SDPA-flash line and one dict per configuration
    (``complete`` False: the run's own file was not written to the end)."""
    rows = []
    for line in log.splitlines():
        if line.startswith("sdpa_flash fwd "):
            f, b = (float(x) for x in line.split()[2:5:2])
            rows.append({"impl": "sdpa_flash", "fwd_tflops": f, "bwd_tflops": b})
        elif line.startswith("{'impl'"):
            rows.append(ast.literal_eval(line))
    return {"shape": list(shape), "rows": rows, "complete": False, "from_log": True}


def main():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from lpfa.attention.triton_bwd import flash_backward
    from lpfa.attention.triton_fwd import flash_forward

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--presets", default="fa2,paper")
    p.add_argument("--shape", default=",".join(map(str, GPT2_SHAPE)), metavar="B,H,T,D",
                   help="the shape swept (default GPT-2's: %(default)s)")
    p.add_argument("--quick", action="store_true",
                   help="a few launch configurations each (precise math only), for a short GPU call")
    p.add_argument("--eager", action="store_true",
                   help="time the calls as issued by the host (the speed the op sees when host-bound), "
                        "not from a CUDA graph")
    p.add_argument("--compare-split", action="store_true",
                   help="also time every configuration with causal_split=False "
                        "(every tile masked, as before the causal split)")
    p.add_argument("--from-log", metavar="LOG",
                   help="only rebuild DIR/tune.json from the printed rows of a run cut by its time limit "
                        "(no GPU needed)")
    a = p.parse_args()
    try:
        B, H, T, D = parse_shape(a.shape)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    out = Path(a.out)
    if a.from_log:
        write_json(out / "tune.json", rows_from_log(Path(a.from_log).read_text(), (B, H, T, D)))
        return
    write_json(out / "provenance.json",
               provenance(config={"B": B, "H": H, "T": T, "D": D, "presets": a.presets, "quick": a.quick,
                                                          "compare_split": a.compare_split, "graph": not a.eager}))

    def timed(fn):  # (ms, whether from a CUDA graph); eagerly where the capture fails (graph_ms says so)
        t, g = (None, False) if a.eager else graph_ms(fn)
        return (t, g) if g else (ms(fn), False)
    f_fwd = 4 * B * H * T * T * D / 2
    q, k, v, do = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    scale = 1 / math.sqrt(D)
    rows = []
    qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))

    def sdpa():
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(qs, ks, vs, is_causal=True)

    t_f, g_f = timed(lambda: sdpa().detach())
    o = sdpa()
    t_b, g_b = timed(lambda: torch.autograd.grad(o, (qs, ks, vs), do, retain_graph=True))
    rows.append({"impl": "sdpa_flash", "fwd_tflops": f_fwd / t_f / 1e9, "bwd_tflops": 2.5 * f_fwd / t_b / 1e9,
                 "graph": g_f and g_b})
    print(f"sdpa_flash fwd {f_fwd / t_f / 1e9:.1f} bwd {2.5 * f_fwd / t_b / 1e9:.1f} TFLOP/s", flush=True)

    fwd_cfgs = [dict(block_m=m, block_n=n, num_warps=w, num_stages=s, precise_math=pm)
                for (m, n, w, s) in [(64, 64, 4, 2), (128, 64, 8, 2), (128, 128, 8, 2), (64, 128, 4, 3),
                                     (128, 128, 8, 3), (64, 128, 8, 2), (128, 64, 4, 3), (64, 256, 8, 2),
                                     # the paper's 512-key block as one tile: its S computed once, not once for the
                                     # row max and again for P̄ (the multi-pass row max of a block of several tiles)
                                     (64, 512, 8, 2)]
                for pm in (True, False)]
    bwd_cfgs = [dict(block_m=m, block_n=n, num_warps=w, num_stages=s)
                for (m, n, w, s) in [(64, 64, 4, 2), (32, 64, 4, 2), (64, 128, 8, 2), (32, 128, 4, 3), (64, 64, 4, 3),
                                     (64, 64, 8, 2), (128, 64, 8, 2), (32, 32, 4, 3), (128, 128, 8, 2)]]
    # the dQ kernel with tiles of its own (many rows, few keys per step), next to dK/dV tiles of few rows and many keys,
    # as in Triton's fused-attention tutorial; without spills at D = 64 by benchmarks/compile_check.py:
    # dQ 128 × 32 (4 warps)
    split_cfgs = [dict(block_m=m, block_n=n, num_warps=w, num_stages=s, dq_block_m=qm, dq_block_n=qn)
                  for (m, n, w, s, qm, qn) in [(64, 64, 4, 3, 128, 32), (64, 64, 4, 3, 128, 64),
                                               (32, 128, 8, 2, 128, 32), (64, 128, 8, 2, 128, 64),
                                               (32, 64, 4, 3, 128, 32)]]
    bwd_cfgs += split_cfgs
    if a.quick:
        fwd_cfgs = [dict(block_m=m, block_n=n, num_warps=w, num_stages=s, precise_math=True)
                    for (m, n, w, s) in [(64, 128, 4, 3), (64, 64, 4, 3), (128, 64, 8, 2), (128, 128, 8, 2)]]
        bwd_cfgs = [dict(block_m=m, block_n=n, num_warps=w, num_stages=s)
                    for (m, n, w, s) in [(64, 64, 4, 3), (64, 64, 8, 2), (32, 64, 4, 3), (64, 128, 8, 2)]]
        bwd_cfgs += split_cfgs[:3]
    if a.compare_split:
        fwd_cfgs += [dict(cfg, causal_split=False) for cfg in fwd_cfgs]
        bwd_cfgs += [dict(cfg, causal_split=False) for cfg in bwd_cfgs]
    t0 = time.time()

    def save(rows, complete=False):  # after every row, so that a run cut by its time limit keeps what it measured
        write_json(out / "tune.json",
                   {"shape": [B, H, T, D], "rows": rows, "seconds": time.time() - t0, "complete": complete})

    for name in a.presets.split(","):
        for cfg in fwd_cfgs:
            try:
                t, g = timed(lambda: flash_forward(q, k, v, name, scale, **cfg))
                r = {"impl": name, "pass": "fwd", **cfg, "tflops": f_fwd / t / 1e9, "graph": g}
            except Exception as e:
                r = {"impl": name, "pass": "fwd", **cfg, "error": f"{type(e).__name__}: {str(e)[:200]}"}
            rows.append(r)
            print(r, flush=True)
            save(rows)
        o, lse = flash_forward(q, k, v, name, scale)
        of = o.float()
        for cfg in bwd_cfgs:
            try:
                t, g = timed(lambda: flash_backward(do, q, k, v, of, lse, name, scale, **cfg))
                r = {"impl": name, "pass": "bwd", **cfg, "tflops": 2.5 * f_fwd / t / 1e9, "graph": g}
            except Exception as e:
                r = {"impl": name, "pass": "bwd", **cfg, "error": f"{type(e).__name__}: {str(e)[:200]}"}
            rows.append(r)
            print(r, flush=True)
            save(rows)
    save(rows, complete=True)


if __name__ == "__main__":
    main()
