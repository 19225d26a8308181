"""Nsight Compute's counters of the attention kernels: reading ``ncu --csv --page raw`` and what limits a kernel.

``benchmarks/ncu_attention.py`` profiles one forward and backward of each implementation under ``ncu`` and stores, per
target, :func:`parse_ncu_csv` of its CSV (``ncu.json``). :func:`limited_by` applies ncu's speed-of-light rule
(:data:`BOUND_PCT`) to one kernel's metrics; :func:`kernel_pass` tells a forward kernel from a backward one by name.
"""

from __future__ import annotations

import csv
import io
import re

# the metrics read from ncu's raw page
NCU_METRICS = {"duration_us": "gpu__time_duration.sum", "sm_pct": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
               "mem_pct": "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
               "instructions": "smsp__inst_executed.sum",
               "issue_pct": "sm__issue_active.avg.pct_of_peak_sustained_elapsed",
               "tensor_pct": "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
               "cycles_per_inst": "smsp__average_warp_latency_per_inst_issued.ratio",
               "occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
               "registers": "launch__registers_per_thread"}
_ALIASES = {"smsp__inst_executed.sum": ("inst_executed", "sm__inst_executed.sum")}  # names differ across ncu versions
_TIME_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6, "s": 1e6}
_PIPE = re.compile(r"^sm__(?:inst_executed_pipe_(\w+?)|pipe_(\w+?)_cycles_active)\.avg\.pct_of_peak_sustained_active$")
_STALL = re.compile(r"^smsp__average_warps?_issue_stalled_(\w+?)_per_issue_active\.ratio$")
_OCC_LIMIT = re.compile(r"^launch__occupancy_limit_(\w+)$")
# ncu's rule of thumb: below 60% of peak on both compute and memory, latency (stalls) limits the kernel
BOUND_PCT = 60.0


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def parse_ncu_csv(text: str) -> dict[str, dict]:
    """ncu's ``--csv --page raw`` output (a units row under the header, ``==PROF==`` lines skipped) as kernel name →
    metrics: :data:`NCU_METRICS` (time in µs whatever the unit), ``pipes`` (the three busiest, % of peak), ``stalls``
    (the three largest reasons, warp cycles per issued instruction, ``selected`` left out), ``top_stall`` and
    ``occupancy_limit`` (the resource allowing the fewest blocks per SM). A name launched again gets ``#2``, ``#3``, ...
    in launch order; templates and argument lists are cut from names. Raises ValueError without a Kernel Name column."""
    lines = [ln for ln in text.splitlines() if ln.strip() and not ln.startswith("==")]
    rows = list(csv.reader(io.StringIO("\n".join(lines))))
    if not rows or "Kernel Name" not in rows[0]:
        first = repr(lines[0][:80]) if lines else "nothing but ==PROF== lines"
        raise ValueError(f"parse_ncu_csv: no 'Kernel Name' column in ncu's output (first line: {first}); "
                         "expected ncu --csv --page raw")
    header, units, body = rows[0], {}, rows[1:]
    if body and "ID" in header and not body[0][header.index("ID")].strip():
        units, body = dict(zip(header, body[0])), body[1:]
    out: dict[str, dict] = {}
    for row in body:
        rec = dict(zip(header, row))
        name = re.split(r"[<(]", rec["Kernel Name"].strip())[0].removeprefix("void ").split("::")[-1]
        m = {}
        for key, col in NCU_METRICS.items():
            col = next((c for c in (col, *_ALIASES.get(col, ())) if c in rec), col)
            v = _number(rec.get(col, ""))
            if v is not None and key == "duration_us":
                v *= _TIME_US.get(units.get(col, "nsecond").strip(), 1e-3)
            m[key] = v
        pipes, stalls, limits = {}, {}, {}
        for col, val in rec.items():
            v = _number(val)
            if v is None:
                continue
            if (hit := _PIPE.match(col)):
                pipe = hit.group(1) or hit.group(2)
                pipes[pipe] = max(v, pipes.get(pipe, 0.0))
            elif (hit := _STALL.match(col)) and hit.group(1) != "selected":
                stalls[hit.group(1)] = v
            elif (hit := _OCC_LIMIT.match(col)):
                limits[hit.group(1)] = v
        m["pipes"] = dict(sorted(pipes.items(), key=lambda kv: -kv[1])[:3])
        m["stalls"] = dict(sorted(stalls.items(), key=lambda kv: -kv[1])[:3])
        m["top_stall"] = next(iter(m["stalls"]), None)
        m["occupancy_limit"] = min(limits, key=limits.get) if limits else None
        key, n = name, 1
        while key in out:
            n += 1
            key = f"{name}#{n}"
        out[key] = m
    return out


def limited_by(m: dict) -> str:
    """What limits one kernel, by ncu's speed-of-light rule (:data:`BOUND_PCT`): ``compute (<busiest pipe>)`` or
    ``memory`` where that throughput reaches the bound and exceeds the other, else ``latency (<top stall>)``."""
    sm, mem = m.get("sm_pct") or 0.0, m.get("mem_pct") or 0.0
    if max(sm, mem) < BOUND_PCT:
        return f"latency ({m.get('top_stall') or 'stall unknown'})"
    if sm >= mem:
        return f"compute ({next(iter(m.get('pipes') or {}), 'pipe unknown')})"
    return "memory"


def kernel_pass(name: str) -> str:
    """``forward``, ``backward`` or ``other`` (checks, fills, conversions) from a kernel's name: FlashAttention's and
    lpfa's kernels carry ``fwd``/``bwd`` in theirs."""
    low = name.lower()
    return "forward" if "fwd" in low else "backward" if "bwd" in low else "other"
