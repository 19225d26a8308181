"""Tables and figures of the attention benchmark (``benchmarks/attention.py`` results)."""

from __future__ import annotations

import csv
import io
import re


def speed_table(bench: dict):
    """DataFrame: TFLOP/s per implementation and pass, with the fwd+bwd ratio to SDPA-flash; where the run also timed
    forward+backward replayed from a CUDA graph (the GPU's time alone, without the host's launches), that too and its
    ratio to SDPA-flash's."""
    import pandas as pd

    rows = bench["rows"]
    base = rows["sdpa_flash"]["fwd_bwd_tflops"]
    gbase = rows["sdpa_flash"].get("graph_fwd_bwd_tflops")
    df = pd.DataFrame(
        [{"implementation": n, "fwd": r["fwd_tflops"], "bwd": r["bwd_tflops"], "fwd+bwd": r["fwd_bwd_tflops"],
          "ratio to SDPA-flash": r["fwd_bwd_tflops"] / base,
          **({"fwd+bwd, GPU only": r.get("graph_fwd_bwd_tflops"),
              "GPU-only ratio": r["graph_fwd_bwd_tflops"] / gbase if r.get("graph_fwd_bwd_tflops") else None} if gbase else {})}
         for n, r in rows.items()]
    ).set_index("implementation")
    return df.round(3)


def plot_speed(bench: dict):
    """Horizontal bars of fwd+bwd TFLOP/s, SDPA first."""
    import matplotlib.pyplot as plt

    from lpfa.plotting import COLORS, use_style

    use_style()
    df = speed_table(bench)["fwd+bwd"]
    colors = [COLORS["neutral"] if n.startswith("sdpa") else COLORS["sfa"] if "sfa" in n else
              COLORS["fp32"] if "fp32" in n else COLORS["other"] if n.startswith("reference") else COLORS["bf16"]
              for n in df.index]
    fig, ax = plt.subplots(figsize=(7, 0.32 * len(df) + 1))
    ax.barh(df.index[::-1], df.values[::-1], color=colors[::-1])
    for y, v in enumerate(df.values[::-1]):
        ax.text(v, y, f" {v:.0f}", va="center", fontsize=8)
    B, H, T, D = bench["shape"]
    ax.set_xlabel(f"forward + backward TFLOP/s (causal, B={B}, H={H}, T={T}, D={D})")
    return fig


def plot_memory(memory: dict):
    """Peak memory of forward + backward against sequence length."""
    import matplotlib.pyplot as plt

    from lpfa.plotting import COLORS, use_style

    use_style()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    colors = {"sdpa_flash": COLORS["neutral"], "fa2": COLORS["bf16"], "fp32": COLORS["fp32"]}
    rows = [r for r in memory["rows"].values() if "peak_mib" in r]
    for name in dict.fromkeys(r["name"] for r in rows):
        pts = sorted((r["T"], r["peak_mib"]) for r in rows if r["name"] == name)
        ax.plot(*zip(*pts), marker="o", label=name, color=colors.get(name))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("peak memory above inputs [MiB]")
    ax.set_title(f"B=1, H={memory['H']}, D={memory['D']}", fontsize=9)
    ax.legend()
    return fig


def tuning_best(tune: dict):
    """The launch sweep of ``benchmarks/tune_attention.py`` (its ``tune.json``): per implementation and pass (fwd, bwd),
    the best TFLOP/s with its launch configuration, and the ratio to SDPA-flash measured in the same run. A DataFrame
    indexed by (implementation, pass); SDPA-flash is the first row of the sweep."""
    import pandas as pd

    sdpa = next(r for r in tune["rows"] if r["impl"] == "sdpa_flash")
    out = {}
    for r in tune["rows"]:
        if r["impl"] == "sdpa_flash" or "tflops" not in r:
            continue
        key = (r["impl"], r["pass"])
        if key not in out or r["tflops"] > out[key]["TFLOP/s"]:
            cfg = {k: r[k] for k in ("block_m", "block_n", "num_warps", "num_stages") if k in r}
            out[key] = {"TFLOP/s": r["tflops"], "SDPA-flash TFLOP/s": sdpa[f"{r['pass']}_tflops"],
                        "ratio to SDPA-flash": r["tflops"] / sdpa[f"{r['pass']}_tflops"],
                        "launch": " ".join(f"{k}={v}" for k, v in cfg.items())}
    return pd.DataFrame.from_dict(out, orient="index").rename_axis(["implementation", "pass"])


def sfa_overhead_table(data: dict):
    """``benchmarks/sfa_overhead.py``'s ``sfa_overhead.json`` as one row per shape ("B×H×T×D"): each base preset's
    forward TFLOP/s, and each SFA variant's forward time over its base preset's (the top-2 tie test, the default, and
    the counting pass it replaced), from the faster of the two timings of each; ``spread``: the largest difference
    between the two timings of one variant at that shape, the noise floor of the comparison."""
    import pandas as pd

    out: dict = {}
    for r in data["rows"]:
        row = out.setdefault(f"{r['B']}×{r['H']}×{r['T']}×{r['D']}", {})
        if r["over_base"] is None:
            row[f"{r['variant']} TFLOP/s"] = r["tflops"]
        else:
            row[f"{r['variant']} over base"] = r["over_base"]
        row["spread"] = max(row.get("spread", 0.0), r["spread"])
    df = pd.DataFrame.from_dict(out, orient="index").rename_axis("B×H×T×D")
    return df[[c for c in df.columns if c != "spread"] + ["spread"]]


def overhead_table(data: dict):
    """``benchmarks/attention.py``'s ``overhead.json`` as one row per (implementation, pass): the host's time to issue
    one call, the GPU's busy time per call (its kernels summed), the time per call back to back, ``do_bench``'s time
    (the speed table's method) and how many distinct kernels one call runs; ``bound by`` says which side sets the pace
    (the host where its issue time exceeds the GPU's busy time), and ``GPU time × SDPA-flash`` is SDPA-flash's GPU
    time over this row's for the same pass (above 1: faster on the GPU than SDPA-flash)."""
    import pandas as pd

    rows = data["rows"]
    out = {}
    for key, r in rows.items():
        name, what = key.split("/")
        sdpa = rows.get(f"sdpa_flash/{what}")
        out[(name, what)] = {"host µs": r["host_us"], "GPU µs": r["gpu_us"], "back to back µs": r["loop_us"],
                             "do_bench µs": r["do_bench_us"], "distinct kernels": len(r["kernels_us"]),
                             "bound by": "host" if r["host_us"] > r["gpu_us"] else "GPU",
                             "GPU time × SDPA-flash": sdpa["gpu_us"] / r["gpu_us"] if sdpa else None}
    return pd.DataFrame.from_dict(out, orient="index").rename_axis(["implementation", "pass"])


def overhead_text(table) -> dict[str, str]:
    """Page 12's clauses from :func:`overhead_table`: ``host``, one ``fa2`` forward+backward's host issue time
    against its GPU work, next to SDPA-flash's, and which side sets the pace; ``gpu_ratio``, ``fa2``'s and ``paper``'s
    forward+backward GPU time as a multiple of SDPA-flash's speed; ``bound``, which of the two the host bounds."""
    fb = {name: table.loc[(name, "fwd_bwd")] for name in ("sdpa_flash", "fa2", "paper")}
    return {
        "host": (f"one `fa2` forward and backward takes {fb['fa2']['host µs']:,.0f} µs of the host's time to issue, against "
                 f"{fb['fa2']['GPU µs']:,.0f} µs of GPU work (SDPA-flash: {fb['sdpa_flash']['host µs']:,.0f} µs and "
                 f"{fb['sdpa_flash']['GPU µs']:,.0f} µs), so the call is {fb['fa2']['bound by']}-bound"),
        "gpu_ratio": (f"{fb['fa2']['GPU time × SDPA-flash']:.2f}× for `fa2` and "
                      f"{fb['paper']['GPU time × SDPA-flash']:.2f}× for `paper`"),
        "bound": _bound_clause([name for name in ("fa2", "paper") if fb[name]["bound by"] == "host"]),
    }


def _bound_clause(host_bound: list[str]) -> str:
    if not host_bound:
        return "the GPU work bounds both `fa2` and `paper`'s forward and backward, not the host"
    names = " and ".join(f"`{n}`" for n in host_bound)
    return f"the host bounds {names}'s forward and backward before the kernels do (it takes longer to issue than to run)"


def shapes_table(shapes: dict):
    """``benchmarks/attention.py --parts shapes``'s ``shapes.json`` as one row per (shape "B×H×T×D", implementation):
    forward, backward and forward+backward TFLOP/s, the forward+backward ratio to SDPA-flash at that shape, and for an
    SFA preset its forward+backward time over its base preset's."""
    import pandas as pd

    sh = pd.DataFrame(shapes["rows"])
    sh["shape"] = [f"{b}×{h}×{t}×{d}" for b, h, t, d in zip(sh.B, sh.H, sh["T"], sh.D)]
    sh["SFA over base"] = [o["fwd_bwd"] if isinstance(o, dict) else None for o in sh["sfa_overhead"]]
    out = sh.set_index(["shape", "impl"])[["fwd_tflops", "bwd_tflops", "fwd_bwd_tflops", "ratio_to_sdpa_flash", "SFA over base"]]
    out.columns = ["fwd TFLOP/s", "bwd TFLOP/s", "fwd+bwd TFLOP/s", "× SDPA-flash", "SFA over base"]
    return out


def shapes_text(shapes: dict, sfa_goal: float, goals: dict | None = None) -> dict[str, str]:
    """Page 12's clauses from ``shapes.json``: ``ratios``, ``fa2``'s and ``paper``'s forward+backward ratio to SDPA-flash
    at T = 4,096, at the longest T (D = 64) and at D = 128, T = 1,024; ``sfa``, the range of the SFA presets' cost over
    their base at T ≥ 4,096 and whether it is within ``sfa_goal`` (a fraction); with ``goals`` (``{impl: ratio}``),
    ``goals``: each one's best ratio over the shapes and whether it reaches its goal there."""
    import pandas as pd

    sh = pd.DataFrame(shapes["rows"])
    ratio = sh.set_index(["T", "D", "impl"])["ratio_to_sdpa_flash"]
    longest = int(sh["T"].max())
    long_sfa = pd.Series([o["fwd_bwd"] for o, t in zip(sh["sfa_overhead"], sh["T"]) if isinstance(o, dict) and t >= 4096])
    return {
        "ratios": (f"at T = 4,096 `fa2` runs at {ratio[(4096, 64, 'fa2')]:.2f}× SDPA-flash and `paper` at "
                   f"{ratio[(4096, 64, 'paper')]:.2f}×; at T = {longest:,} at {ratio[(longest, 64, 'fa2')]:.2f}× and "
                   f"{ratio[(longest, 64, 'paper')]:.2f}×; at D = 128 (T = 1,024) at {ratio[(1024, 128, 'fa2')]:.2f}× and "
                   f"{ratio[(1024, 128, 'paper')]:.2f}×"),
        "sfa": (f"{long_sfa.min():+.1%} to {long_sfa.max():+.1%}, " + ("within" if long_sfa.max() <= sfa_goal else "outside")
                + f" the goal of at most +{100 * sfa_goal:.0f}%") if len(long_sfa) else "not measured at T ≥ 4,096",
        **({"goals": _goals_clause({impl: float(sh[sh.impl == impl]["ratio_to_sdpa_flash"].max()) for impl in goals}, goals)}
           if goals else {}),
    }


def _goals_clause(best: dict, goals: dict) -> str:
    short = [i for i in goals if best[i] < goals[i]]
    each = ", ".join(f"`{i}` reaches {best[i]:.2f}× at best" for i in goals)
    if len(short) == len(goals):
        return f"{each}: {'both' if len(goals) == 2 else 'all'} stay short"
    if not short:
        return f"{each}: {'both' if len(goals) == 2 else 'all'} meet their goals"
    return f"{each}: " + " and ".join(f"`{i}`" for i in short) + " stay" + ("s" if len(short) == 1 else "") + " short"


HOST_LAYERS = {  # benchmarks/host_overhead.py's rows, in the order of the call's layers, with page 12's names
    "launch/_nonfinite_kernel": "one Triton launch",
    "flash_forward": "flash_forward",
    "flash_backward": "flash_backward",
    "op/fwd": "custom op, fwd",
    "attention/fwd": "attention(), fwd",
    "attention/fwd_bwd": "attention(), fwd+bwd",
    "sdpa_flash/fwd": "SDPA-flash, fwd",
    "sdpa_flash/fwd_bwd": "SDPA-flash, fwd+bwd",
}


def host_layers_table(runs: dict[str, dict]):
    """``benchmarks/host_overhead.py`` runs side by side: one row per run (``runs`` maps a label, e.g. the commit, to
    its ``host_overhead.json``), one column per layer of the call (:data:`HOST_LAYERS`), in µs of the host's time per
    call; ``fwd+bwd × SDPA-flash`` is the host's time for ``attention()``'s forward+backward over SDPA-flash's measured
    in the same run (the hosts of two machines differ, the ratio less)."""
    import pandas as pd

    df = pd.DataFrame({label: {name: r["host_us"].get(key) for key, name in HOST_LAYERS.items()}
                       for label, r in runs.items()}).T
    df["fwd+bwd × SDPA-flash"] = df["attention(), fwd+bwd"] / df["SDPA-flash, fwd+bwd"]
    return df.rename_axis("run")


def host_layers_text(table) -> str:
    """Page 12's sentence from :func:`host_layers_table`: the host's time for one forward+backward through
    ``attention()`` in the first and the last run, each as a multiple of SDPA-flash's in its own run."""
    first, last = table.iloc[0], table.iloc[-1]
    return (f"the host's time to issue one forward and backward through `attention()` went from "
            f"{first['attention(), fwd+bwd']:,.0f} µs ({first['fwd+bwd × SDPA-flash']:.1f}× SDPA-flash's in the same run, "
            f"`{table.index[0]}`) to {last['attention(), fwd+bwd']:,.0f} µs ({last['fwd+bwd × SDPA-flash']:.1f}×, "
            f"`{table.index[-1]}`)")


TRAIN_GOALS = {"lpfa_fa2_compiled": 0.95, "lpfa_paper_compiled": 0.9}  # issue 17: compiled GPT-2 S against SDPA compiled


def throughput_table(tput: dict):
    """``benchmarks/train_throughput.py``'s ``throughput.json`` as one row per backend, with ``ratio to SDPA``: its
    tokens/s over SDPA's in the same mode (a row ending in ``_compiled`` against ``sdpa_compiled``, the rest against
    eager ``sdpa``)."""
    import pandas as pd

    df = pd.DataFrame(tput).T
    base = {n: df.loc["sdpa_compiled" if n.endswith("_compiled") and "sdpa_compiled" in df.index else "sdpa", "tokens_per_s"]
            for n in df.index}
    df["ratio to SDPA"] = df["tokens_per_s"] / pd.Series(base)
    return df


def throughput_text(table, goals: dict[str, float] = TRAIN_GOALS) -> str:
    """Page 13's sentence from :func:`throughput_table`: each compiled lpfa row's ratio to SDPA compiled against its goal,
    and the eager rows' ratios; "not measured compiled" for a run made without ``--compile``."""
    ratio = table["ratio to SDPA"]
    parts = []
    for row, goal in goals.items():
        name = row.removeprefix("lpfa_").removesuffix("_compiled")
        if row in ratio:
            parts.append(f"`{name}` at {ratio[row]:.2f}× (goal ≥ {goal:.2f}×: {'met' if ratio[row] >= goal else 'not met'})")
        else:
            parts.append(f"`{name}` not measured compiled")
    eager = [f"`{n.removeprefix('lpfa_')}` {ratio[n]:.2f}×" for n in ratio.index if n.startswith("lpfa_") and not n.endswith("_compiled")]
    return ("compiled, GPT-2 S trains with " + " and ".join(parts) + " SDPA's tokens/s" +
            (f"; eager, against eager SDPA: {', '.join(eager)}" if eager else ""))


# Nsight Compute (benchmarks/ncu_attention.py): the metrics page 12 reads from ncu's raw page
NCU_METRICS = {"duration_us": "gpu__time_duration.sum", "sm_pct": "sm__throughput.avg.pct_of_peak_sustained_elapsed",
               "mem_pct": "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed",
               "instructions": "smsp__inst_executed.sum", "issue_pct": "sm__issue_active.avg.pct_of_peak_sustained_elapsed",
               "tensor_pct": "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
               "cycles_per_inst": "smsp__average_warp_latency_per_inst_issued.ratio",
               "occupancy_pct": "sm__warps_active.avg.pct_of_peak_sustained_active",
               "registers": "launch__registers_per_thread"}
_ALIASES = {"smsp__inst_executed.sum": ("inst_executed", "sm__inst_executed.sum")}  # names differ across ncu versions
_TIME_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6, "s": 1e6}
_PIPE = re.compile(r"^sm__(?:inst_executed_pipe_(\w+?)|pipe_(\w+?)_cycles_active)\.avg\.pct_of_peak_sustained_active$")
_STALL = re.compile(r"^smsp__average_warps?_issue_stalled_(\w+?)_per_issue_active\.ratio$")
_OCC_LIMIT = re.compile(r"^launch__occupancy_limit_(\w+)$")
BOUND_PCT = 60.0  # ncu's rule of thumb: below 60% of peak on both compute and memory, latency (stalls) limits the kernel


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def parse_ncu_csv(text: str) -> dict[str, dict]:
    """ncu's ``--csv --page raw`` output (one row per profiled kernel launch, a row of units under the header; lines of
    ncu's own ``==PROF==`` messages skipped) as kernel name → metrics: :data:`NCU_METRICS` (time in µs whatever the
    unit), ``pipes`` (pipe → % of peak, the three busiest), ``stalls`` (reason → warp cycles stalled per issued
    instruction, the three largest; ``selected``, one cycle per instruction by definition, left out), ``top_stall``, and
    ``occupancy_limit`` (the resource that allows the fewest blocks per SM: registers, shared_mem, warps, ...). A name
    launched more than once gets ``#2``, ``#3``, ... in launch order; a template or argument list is cut from the name."""
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


def ncu_table(ncu: dict, min_us: float = 5.0):
    """``benchmarks/ncu_attention.py``'s kernels (target → :func:`parse_ncu_csv` of its CSV, as in ``ncu.json``) as one row per (target, kernel) of at least ``min_us``: its pass
    (:func:`kernel_pass`), duration, millions of instructions executed, SM and memory throughput and issue slots busy
    (% of peak), tensor pipe (% of peak cycles), warp cycles per issued instruction, achieved occupancy and the resource
    that limits it, registers per thread, busiest pipe, top stall reason and :func:`limited_by`."""
    import pandas as pd

    rows = []
    for target, kernels in ncu.items():
        for name, m in kernels.items():
            if (m.get("duration_us") or 0.0) < min_us:
                continue
            pipe = next(iter(m.get("pipes") or {}), None)
            rows.append({"target": target, "kernel": name, "pass": kernel_pass(name), "µs": m["duration_us"],
                         "M instructions": (m.get("instructions") or float("nan")) / 1e6,
                         "SM %": m.get("sm_pct"), "memory %": m.get("mem_pct"), "issue %": m.get("issue_pct"),
                         "tensor %": m.get("tensor_pct"), "cycles/instruction": m.get("cycles_per_inst"),
                         "occupancy %": m.get("occupancy_pct"), "occupancy limit": m.get("occupancy_limit"),
                         "registers": m.get("registers"), "busiest pipe": f"{pipe} {m['pipes'][pipe]:.0f}%" if pipe else None,
                         "top stall": m.get("top_stall"), "limited by": limited_by(m)})
    return pd.DataFrame(rows).set_index(["target", "kernel"]).round(2)


def ncu_passes(table, base: str = "sdpa_flash"):
    """:func:`ncu_table` summed per (target, pass): µs and millions of instructions, each also as a multiple of
    ``base``'s in the same pass (where the table has ``base``)."""
    df = table.groupby(["target", "pass"])[["µs", "M instructions"]].sum()
    if base in df.index.get_level_values("target"):
        ref = df.loc[base]
        for col in ("µs", "M instructions"):
            df[f"{col} × {base}"] = [df.loc[(t, p), col] / ref.loc[p, col] if p in ref.index else float("nan")
                                     for t, p in df.index]
    return df.round(2)


def _fmt(v, spec: str) -> str:
    """``v`` formatted by ``spec``, or "?" where ncu did not report it (None or NaN)."""
    return "?" if v is None or v != v else format(v, spec)


def ncu_text(table, base: str = "sdpa_flash") -> str:
    """Page 12's sentence from :func:`ncu_table`: per target, its forward and backward kernels' time and instructions
    against ``base``'s (:func:`ncu_passes`), its largest kernel's tensor-pipe use, issue slots and occupancy, and what
    limits it."""
    passes = ncu_passes(table, base)
    parts = []
    for target in dict.fromkeys(table.index.get_level_values("target")):
        if target == base:
            continue
        own = passes.loc[target]
        vs = []
        for p in ("forward", "backward"):
            if p not in own.index:
                continue
            ratio = own.loc[p].get(f"µs × {base}", float("nan"))  # NaN: no base, or base has no such pass
            vs.append(f"{p} {own.loc[p, 'µs']:,.0f} µs, {own.loc[p, 'M instructions']:,.0f}M instructions"
                      + ("" if ratio != ratio else
                         f" ({ratio:.2f}× {base}'s time, {own.loc[p, f'M instructions × {base}']:.2f}× its instructions)"))
        k = table.loc[target]["µs"].idxmax()
        r = table.loc[(target, k)]
        parts.append(f"`{target}`: {'; '.join(vs)}. Its longest kernel, `{k}` ({r['µs']:,.0f} µs), keeps the tensor pipe "
                     f"busy {_fmt(r['tensor %'], '.0f')}% of the time and the issue slots {_fmt(r['issue %'], '.0f')}%, at "
                     f"{_fmt(r['occupancy %'], '.0f')}% occupancy (limited by {r['occupancy limit'] or 'unknown'}), "
                     f"{_fmt(r['cycles/instruction'], '.1f')} cycles per instruction: {r['limited by']}")
    return " ".join(p + "." for p in parts)


def twin_text(table, error: dict) -> str:
    """Page 13's sentence on the FP32 twin (issue 17): ``fp32_split``'s GPT-2 S tokens/s over ``sdpa_fp32``'s (the twin
    of the committed runs), compiled where :func:`throughput_table` has both compiled rows, and eager; and the largest
    error of its O and gradients against float64 next to the IEEE ``fp32`` policy's, over every input dtype of
    ``benchmarks/attention.py``'s ``error.json``."""
    tps = table["tokens_per_s"]
    speed = [f"{mode} {tps[f'lpfa_fp32_split{suffix}'] / tps[f'sdpa_fp32{suffix}']:.2f}×"
             for mode, suffix in (("compiled", "_compiled"), ("eager", ""))
             if f"lpfa_fp32_split{suffix}" in tps and f"sdpa_fp32{suffix}" in tps]
    if not speed:
        raise ValueError("twin_text: the throughput run has no fp32_split and sdpa_fp32 rows; "
                         "expected benchmarks/train_throughput.py from issue 17 on")
    worst = {p: max(t["max_rel"] for inp in error["inputs"].values() for t in inp[p].values()) for p in ("fp32_split", "fp32")}
    return (f"`fp32_split` trains GPT-2 S at {' and '.join(speed)} the tokens/s of `sdpa_fp32` (SDPA on FP32 inputs), and its "
            f"O and gradients stay within {worst['fp32_split']:.1e} of float64 relative to each tensor's largest value, where "
            f"the IEEE `fp32` policy's stay within {worst['fp32']:.1e}")
