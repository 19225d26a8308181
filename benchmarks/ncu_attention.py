"""What limits each attention kernel: Nsight Compute's counters for one forward+backward.

For SDPA-flash (the FlashAttention-2 kernel that ``fa2`` emulates) and each lpfa preset, one call of forward+backward
at GPT-2 shapes (B=16, H=12, T=1024, D=64, causal, BF16; ``--shape`` for another) runs under ``ncu`` after two
warm-up calls (Triton compiles there), and every kernel of that call is profiled: its duration, compute and memory
throughput as a share of the GPU's peak (speed of light), achieved occupancy, registers per thread, the busiest pipes,
and the warp stall reasons per issued instruction.
``lpfa.pages.kernels.ncu_table`` reads the result into page 12's table.

``ncu`` runs with ``--clock-control none`` (the device guide: leave the clocks alone), so durations are at the clocks
the GPU runs at, and each kernel is replayed once per counter pass; the durations are ncu's, not the benchmark's.

Usage::

    python benchmarks/ncu_attention.py --out DIR [--targets sdpa_flash,fa2,paper] [--shape B,H,T,D] [--ncu PATH]

Writes ``DIR/<target>.csv`` (ncu's raw page), ``DIR/ncu.json`` (target → kernels → metrics, by
:func:`lpfa.attention.ncu.parse_ncu_csv`), ``DIR/ncu.log`` and ``DIR/provenance.json``.
"""

from __future__ import annotations

import argparse
import glob
import json
import shutil
import subprocess
import sys
from pathlib import Path

import torch
from tune_attention import GPT2_SHAPE, parse_shape  # benchmarks/tune_attention.py (on sys.path as a script)

from lpfa.attention import attention
from lpfa.attention.ncu import parse_ncu_csv
from lpfa.provenance import provenance, write_json

SECTIONS = ("SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats", "ComputeWorkloadAnalysis",
            "MemoryWorkloadAnalysis")
SHAPE = dict(zip("BHTD", GPT2_SHAPE))  # the default: tune_attention.py's GPT-2 shape


def child(target: str, shape: dict) -> None:
    """One profiled forward+backward of ``target`` (``sdpa_flash`` or an lpfa preset) at ``shape``, between
    cudaProfilerStart/Stop so that ncu (``--profile-from-start off``) sees only that call's kernels."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    B, H, T, D = shape.values()
    g = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_()
               for _ in range(3))
    do = torch.randn(B, H, T, D, device="cuda", generator=g, dtype=torch.bfloat16)

    def call():
        if target == "sdpa_flash":
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            o = attention(q, k, v, policy=target, backend="triton")
        torch.autograd.grad(o, (q, k, v), do)  # no .grad accumulation kernels in the profile

    for _ in range(2):
        call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStart()
    call()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()


def find_ncu(given: str | None) -> str:
    found = given or shutil.which("ncu") or next(iter(sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu"))), None) \
        or next(iter(sorted(glob.glob("/usr/local/cuda*/bin/ncu"))), None)
    if not found:
        raise SystemExit("ncu_attention: no ncu found (looked on PATH, /opt/nvidia/nsight-compute, /usr/local/cuda*); "
                         "pass --ncu PATH")
    return found


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out")
    p.add_argument("--targets", default="sdpa_flash,fa2,paper")
    p.add_argument("--ncu", default=None,
                   help="path of the ncu executable (default: found on PATH or under /opt/nvidia)")
    p.add_argument("--shape", default=",".join(map(str, SHAPE.values())),
                   help="B,H,T,D of the profiled call (default GPT-2's: %(default)s)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    try:
        shape = dict(zip(SHAPE, parse_shape(a.shape)))
    except ValueError as e:
        p.exit(2, f"{e}\n")
    if a.child:
        return child(a.child, shape)
    if not a.out:
        p.error("--out DIR is required")
    ncu = find_ncu(a.ncu)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    result, log = {}, []
    for target in a.targets.split(","):
        csv = out / f"{target}.csv"
        cmd = [ncu, "--profile-from-start", "off", "--clock-control", "none", "--csv", "--page", "raw",
               "--print-units", "base", "--print-kernel-base", "function",
               "--log-file", str(csv), *[x for s in SECTIONS for x in ("--section", s)],
               sys.executable, __file__, "--child", target, "--shape", a.shape]
        print("$", " ".join(cmd), flush=True)
        r = subprocess.run(cmd, capture_output=True, text=True)
        log.append(f"$ {' '.join(cmd)}\n{r.stdout}\n{r.stderr}\nexit {r.returncode}\n")
        if r.returncode != 0 or not csv.exists():
            print(f"{target}: ncu exited {r.returncode}; see ncu.log", flush=True)
            continue
        result[target] = parse_ncu_csv(csv.read_text())
        for name, m in result[target].items():
            print(f"{target:11s} {name[:40]:40s} {m['duration_us']:8.1f} us  sm {m['sm_pct']:5.1f}%  "
                  f"mem {m['mem_pct']:5.1f}%  stall {m['top_stall']}", flush=True)
    (out / "ncu.log").write_text("\n".join(log))
    (out / "ncu.json").write_text(json.dumps(result, indent=1))
    write_json(out / "provenance.json", provenance(config={**shape, "targets": a.targets.split(","),
                                                           "sections": list(SECTIONS), "ncu": ncu}))


if __name__ == "__main__":
    main()
