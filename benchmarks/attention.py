"""GPU check and benchmark of lpfa's precision-policy attention against PyTorch SDPA.

Its parts, all in one run on one GPU:

1. **check** — at GPT-2 shapes (B=16, H=12, T=1024, D=64), every preset through the Triton kernels
   (native BF16 tensor-core path) against the PyTorch reference on the same GPU: the fraction of O,
   lse, dq, dk, dv elements bit-identical, and the largest difference relative to the tensor's max.
2. **speed** — forward, backward and forward+backward TFLOP/s for each preset, for SDPA's flash and
   cuDNN backends, and for the reference ``paper`` path, measured in the same run; ratios to SDPA-flash.
3. **shapes** — the same at D = 128, T = 4k and 16k (GPT-2's width, about 16k tokens per call) for ``fa2``, ``paper``
   and their SFA presets, with SFA's time over its base preset's (``shapes.json``, ``shapes.txt``): each time the
   median of :data:`SHAPE_ROUNDS` timings taken in turn across the implementations, with their spread; the kernels
   are causal only, so there is no non-causal row.
4. **memory** — peak memory of forward+backward against T (1k … 16k) for ``fa2``, ``fp32`` and SDPA.
5. **overhead** — per call of SDPA-flash, ``fa2`` and ``paper`` (forward, and forward+backward): the host's issue
   time, the GPU's busy time summed over the kernels (by name, torch.profiler), and the time of calls back to back
   with and without an L2 flush between them, to tell launch overhead from kernel time (``overhead.json``).
6. **error** — O, lse, dq, dk, dv of ``fp32`` (IEEE FP32 GEMMs), ``fp32_split`` (BF16 tensor-core GEMMs of split
   FP32 operands) and ``fa2`` against float64 attention on the same inputs (BF16 and FP32 q, k, v; FP32
   dO): max and mean error relative to the float64 tensor's max and mean magnitude (:mod:`lpfa.attention.accuracy`).

The speed part also times SDPA on FP32 q, k, v (``sdpa_fp32``: the experiments' FP32 twin today, TF32 off), the row
that ``fp32_split`` has to beat to replace it.

Usage::

    python benchmarks/attention.py --out results/attention_benchmark/<run>   [--quick] [--parts check,error,speed]
    python benchmarks/attention.py --out DIR --parts speed --presets fa2,paper   # a screening run, never complete
    python benchmarks/attention.py --out DIR --parts speed,shapes --launch backward.dq_mode=ordered   # the same:
        # a candidate launch table (lpfa.attention.triton_common.changed_launches) timed in place of the committed one

Writes ``check.json``, ``error.json``, ``bench.json``, ``overhead.json``, ``memory.json``, ``summary.json`` (preset →
fwd+bwd TFLOP/s and ratio to SDPA-flash; read by the book), ``table.txt`` and ``provenance.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from pathlib import Path

import torch

from lpfa.attention import PRESETS, attention
from lpfa.attention import reference as ref
from lpfa.attention.triton_common import changed_launches, launches_changed
from lpfa.provenance import provenance, write_json

PRESET_ORDER = ["fa2", "paper", "fp32", "fp32_split", "fa2_sfa", "paper_sfa", "pv_fp32", "delta_dp", "o_fp32",
                "paper_untiled"]


def flops(B, H, T, D, mode):
    """Causal attention FLOPs (FlashAttention convention): fwd 2 GEMMs, bwd 2.5× fwd, halved by the mask."""
    f = 4 * B * H * T * T * D / 2
    return {"fwd": f, "bwd": 2.5 * f, "fwd_bwd": 3.5 * f}[mode]


def bench_ms(fn, budget_s=20.0):
    """Median time of ``fn`` in ms by ``triton.testing.do_bench`` (the method of the kernel speed measurements): calls
    queued back to back, so the host's launch overhead hides behind the GPU's work as it does inside a training step,
    with the L2 cache flushed between calls. ``budget_s`` caps the measuring time (do_bench's ``rep``, in ms)."""
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=max(10, min(100, int(budget_s * 1000))), return_mode="median")


def interleaved_ms(fns: dict, rounds: int, rep_ms: int = 200) -> dict[str, list[float]]:
    """``{label: [ms, ...]}``: ``rounds`` timings of each callable of ``fns`` (``{label: fn}``), each a
    ``triton.testing.do_bench`` median (L2 flushed between calls, ``rep_ms`` of measuring), taken in turn (every fn's
    first timing, then every fn's second, ...), so that a drift of the GPU's clock during the run touches each alike
    (METHOD: "time the same version twice"; the spread of one fn's timings says how much of a difference is noise)."""
    from triton.testing import do_bench

    ms = {label: [] for label in fns}
    for _ in range(rounds):
        for label, fn in fns.items():
            ms[label].append(do_bench(fn, warmup=25, rep=rep_ms, return_mode="median"))
    return ms


def graph_ms(fn, rep=20, replays=3):
    """Mean ms per call of ``fn`` replayed from a CUDA graph of ``rep`` calls: the GPU's time alone. Called eagerly,
    the host's launches (several per call, tens of µs each) can outlast a kernel at GPT-2 shapes and would be timed
    instead of it (the overhead part); a graph launches them all at once. Falls back to ``(None, False)`` where the
    capture fails."""
    try:
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm up (compile) off the capturing stream, as torch.cuda.graph asks
            for _ in range(3):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            for _ in range(rep):
                fn()
        g.replay()
        torch.cuda.synchronize()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(replays):
            g.replay()
        e.record()
        torch.cuda.synchronize()
        return s.elapsed_time(e) / (rep * replays), True
    except Exception as err:  # noqa: BLE001  (any capture failure: time eagerly and say so in the row)
        print(f"CUDA graph capture failed ({type(err).__name__}: {str(err)[:120]}); timing eagerly", flush=True)
        torch.cuda.synchronize()
        return None, False


def inputs(B, H, T, D, seed=0, requires_grad=True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return [torch.randn(B, H, T, D, device="cuda", generator=g, dtype=torch.bfloat16).requires_grad_(requires_grad)
            for _ in range(3)]


def compare(x, y):
    x, y = x.float(), y.float()
    scale = y.abs().max().clamp_min(1e-30)
    return {"bit_identical": (x == y).double().mean().item(), "max_rel_to_max": ((x - y).abs().max() / scale).item()}


def check(B, H, T, D):
    from lpfa.attention.triton_bwd import flash_backward
    from lpfa.attention.triton_fwd import flash_forward

    out = {}
    q, k, v = (t.detach() for t in inputs(B, H, T, D, seed=1))
    do = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)
    scale = 1 / math.sqrt(D)
    for name in PRESET_ORDER:
        pol = PRESETS[name]
        o, lse = flash_forward(q, k, v, pol, scale)
        ro, rlse = ref.forward(q.float(), k.float(), v.float(), pol, scale)
        dq, dk, dv = flash_backward(do, q, k, v, o.float(), lse, pol, scale)
        rdq, rdk, rdv = ref.backward(do.float(), q.float(), k.float(), v.float(), ro, rlse, pol, scale)
        out[name] = {n: compare(a, b) for n, a, b in (("o", o, ro), ("lse", lse, rlse), ("dq", dq, rdq),
                                                      ("dk", dk, rdk), ("dv", dv, rdv))}
        print(f"check {name:14s} "
              + "  ".join(f"{n}: {r['bit_identical']:.4%} same, max {r['max_rel_to_max']:.2e}"
                          for n, r in out[name].items()), flush=True)
    return out


ERROR_POLICIES = ["fp32", "fp32_split", "fa2"]


def error(B, H, T, D):
    """``{input dtype: {policy: {part: {"max_rel", "mean_rel"}}}}`` against float64 (lpfa.attention.accuracy)."""
    from lpfa.attention.accuracy import errors_vs_float64

    out = {}
    for dname, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        g = torch.Generator(device="cuda").manual_seed(2)
        q, k, v = (torch.randn(B, H, T, D, device="cuda", generator=g).to(dtype) for _ in range(3))
        do = torch.randn(B, H, T, D, device="cuda", generator=g)  # FP32: the FP32 policies' O (and dO) is FP32
        out[dname] = errors_vs_float64(q, k, v, do, ERROR_POLICIES, 1 / math.sqrt(D))
        for name, parts in out[dname].items():
            print(f"error {dname} inputs {name:11s} " + "  ".join(
                f"{n}: max {e['max_rel']:.2e} mean {e['mean_rel']:.2e}" for n, e in parts.items()), flush=True)
        del q, k, v, do
        torch.cuda.empty_cache()
    return out


def speed(B, H, T, D, budget_s, presets=None, extras=True, save=None, rounds=1):
    """``{impl: times and TFLOP/s}`` at (B, H, T, D): SDPA's flash and cuDNN backends, then lpfa's ``presets`` (default
    :data:`PRESET_ORDER`) through the Triton kernels; ``extras``: also SDPA on FP32 inputs and the reference path.
    ``rounds`` = 1: each implementation timed once, in turn, and ``save(rows)``, if given, runs after each row, so that
    a run cut by its time limit keeps the rows it measured. ``rounds`` > 1: every implementation's forward, then every
    one's forward+backward, each timed ``rounds`` times in turn (:func:`interleaved_ms`), the median kept and the
    spread of the rounds (max / min − 1) recorded, so that a row's difference to another can be told from noise
    (METHOD: "time the same version twice")."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    rows = {}
    q, k, v = inputs(B, H, T, D)
    do = inputs(B, H, T, D, seed=1, requires_grad=False)[0]
    rep_ms = max(10, min(100, int(budget_s * 1000)))  # bench_ms's measuring time

    def forward_only(fwd):
        def f():
            with torch.no_grad():
                fwd()
        return f

    def forward_backward(fwd):
        def fb():
            o = fwd()
            o.backward(do.to(o.dtype))
        return fb

    def add_row(name, fwd, graph, t_f, t_fb, f_rounds=None, fb_rounds=None):
        for t in (q, k, v):
            t.grad = None

        def grads():  # forward and backward without accumulating into .grad (a graph replays the same buffers)
            o = fwd()
            return torch.autograd.grad(o, (q, k, v), do.to(o.dtype))

        g_fb = graph_ms(grads)[0] if graph else None  # the GPU's time alone
        t_b = max(t_fb - t_f, 1e-6)
        rows[name] = {
            "fwd_ms": t_f, "bwd_ms": t_b, "fwd_bwd_ms": t_fb,
            "fwd_tflops": flops(B, H, T, D, "fwd") / t_f / 1e9,
            "bwd_tflops": flops(B, H, T, D, "bwd") / t_b / 1e9,
            "fwd_bwd_tflops": flops(B, H, T, D, "fwd_bwd") / t_fb / 1e9,
            "graph_fwd_bwd_ms": g_fb,
            "graph_fwd_bwd_tflops": flops(B, H, T, D, "fwd_bwd") / g_fb / 1e9 if g_fb else None,
        }
        if f_rounds is not None:
            rows[name].update({"fwd_ms_rounds": f_rounds, "fwd_bwd_ms_rounds": fb_rounds,
                               "spread": max(spread(f_rounds), spread(fb_rounds))})
        r = rows[name]
        if save is not None:
            save(rows)
        g = f"{r['graph_fwd_bwd_tflops']:7.1f}" if r["graph_fwd_bwd_tflops"] else "    n/a"
        noise = f" (rounds' spread {r['spread']:.1%})" if "spread" in r else ""
        print(f"speed {name:16s} fwd {r['fwd_tflops']:7.1f}  bwd {r['bwd_tflops']:7.1f}  "
              f"fwd+bwd {r['fwd_bwd_tflops']:7.1f} (from a CUDA graph: {g}) TFLOP/s{noise}", flush=True)

    def sdpa(backend):
        def fwd():
            with sdpa_kernel(backend):
                return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)

        return fwd

    impls = {"sdpa_flash": (sdpa(SDPBackend.FLASH_ATTENTION), True),  # name -> (forward, time a CUDA graph too)
             "sdpa_cudnn": (sdpa(SDPBackend.CUDNN_ATTENTION), True)}
    # the experiments' FP32 twin today (lpfa.model attn_backend="sdpa_fp32"): SDPA's own choice on FP32 q, k, v
    if extras:
        impls["sdpa_fp32"] = (lambda: torch.nn.functional.scaled_dot_product_attention(
            q.float(), k.float(), v.float(), is_causal=True), True)
    for name in PRESET_ORDER if presets is None else presets:
        impls[name] = (lambda name=name: attention(q, k, v, policy=name, backend="triton"), True)
        if name in FINITE_PRESETS:  # the trainer's setting once it vouches for finite inputs: no non-finite checks
            impls[f"{name}:finite"] = (lambda name=name: attention(q, k, v, policy=name, backend="triton",
                                                                   assume_finite=True), True)
    if extras:
        # no CUDA graph: the reference's block loop is host-bound by design, and the GPU-only time says nothing of it
        impls["reference_paper"] = (lambda: attention(q, k, v, policy="paper", backend="reference"), False)

    def unavailable(name, e):  # a backend not available on this build, or this GPU
        print(f"speed {name}: unavailable ({type(e).__name__}: {e})", flush=True)

    if rounds <= 1:
        for name, (fwd, graph) in impls.items():
            try:
                t_f = bench_ms(forward_only(fwd), budget_s=budget_s)
                t_fb = bench_ms(forward_backward(fwd), budget_s=budget_s)
            except Exception as e:  # noqa: BLE001
                unavailable(name, e)
                continue
            add_row(name, fwd, graph, t_f, t_fb)
        return rows
    live = {}
    for name, (fwd, graph) in impls.items():  # each once (which compiles it), to time only those that run
        try:
            forward_backward(fwd)()
            live[name] = (fwd, graph)
        except Exception as e:  # noqa: BLE001
            unavailable(name, e)
    t_f = interleaved_ms({name: forward_only(fwd) for name, (fwd, _) in live.items()}, rounds, rep_ms)
    t_fb = interleaved_ms({name: forward_backward(fwd) for name, (fwd, _) in live.items()}, rounds, rep_ms)
    for name, (fwd, graph) in live.items():
        add_row(name, fwd, graph, statistics.median(t_f[name]), statistics.median(t_fb[name]), t_f[name],
                t_fb[name])
    return rows


def spread(ms: list[float]) -> float:
    """How far repeated timings of one implementation lie apart: max / min − 1."""
    return max(ms) / min(ms) - 1


# the sweep's shapes, at GPT-2's model width (H·D = 768) and about 16k tokens per call; non-causal attention is not
# in the table: the Triton kernels are causal only (lpfa.attention.triton_common.check_triton_support)
SHAPES = [(16, 12, 1024, 64), (16, 6, 1024, 128), (4, 12, 4096, 64), (1, 12, 16384, 64)]
SHAPE_PRESETS = ["fa2", "paper", "fa2_sfa", "paper_sfa"]
FINITE_PRESETS = ["fa2", "paper"]  # also measured with attention(assume_finite=True), as "<preset>:finite"
SHAPE_ROUNDS = 3  # interleaved timings of each implementation per shape (speed's rounds): SFA's cost and the ratios
# are differences of a few per cent, which a single timing of each cannot tell from the GPU's drift


def shapes(budget_s, deadline):
    """The kernels against SDPA at each of :data:`SHAPES`: one row per (shape, impl) with fwd, bwd, fwd+bwd TFLOP/s
    (medians of :data:`SHAPE_ROUNDS` interleaved timings, with their spread), the fwd+bwd ratio to SDPA-flash at that
    shape, and the SFA presets' time over their base preset's, with ``noise``: the larger of the two rows' spreads."""
    out = []
    for B, H, T, D in SHAPES:
        if time.time() > deadline:
            print(f"shapes: out of time before {(B, H, T, D)}", flush=True)
            break
        rows = speed(B, H, T, D, budget_s, presets=SHAPE_PRESETS, extras=False, rounds=SHAPE_ROUNDS)
        base = rows.get("sdpa_flash", {}).get("fwd_bwd_tflops")
        for name, r in rows.items():
            sfa_over = None
            if name.endswith("_sfa") and name[:-4] in rows:
                sfa_over = {p: r[f"{p}_ms"] / rows[name[:-4]][f"{p}_ms"] - 1 for p in ("fwd", "bwd", "fwd_bwd")}
                sfa_over["noise"] = max(r.get("spread", 0.0), rows[name[:-4]].get("spread", 0.0))
            out.append({"B": B, "H": H, "T": T, "D": D, "impl": name, **r,
                        "ratio_to_sdpa_flash": r["fwd_bwd_tflops"] / base if base else None, "sfa_overhead": sfa_over})
        torch.cuda.empty_cache()
    return out


def overhead(B, H, T, D, presets=("fa2", "paper"), n=20):
    """Where the op's time goes, per call, for SDPA-flash and ``presets`` through ``attention()``: the forward alone
    (no grad) and forward+backward. ``host_us``: the host's time to issue one call (n calls back to back, no sync;
    the GPU queue does not fill at this n); ``gpu_us``: the GPU's busy time per call, the sum of its kernels'
    durations (torch.profiler), with the kernels by name; ``loop_us``: n calls back to back between two events (no
    L2 flush, the GPU never waits for the host when host_us < gpu_us); ``do_bench_us``: the speed part's method
    (L2 flushed before each call, so the host's issue time shows wherever it exceeds the flush's). Every call's host,
    loop and do_bench times come before the first profiler session, which may leave the process's launches slower."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.profiler import ProfilerActivity, profile
    from triton.testing import do_bench

    q, k, v = inputs(B, H, T, D)
    do = torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16)

    def call(name):
        if name == "sdpa_flash":
            def fwd():
                with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                    return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return fwd
        return lambda: attention(q, k, v, policy=name, backend="triton")

    calls = {}
    for name in ("sdpa_flash", *presets):
        fwd = call(name)

        def f(fwd=fwd):
            with torch.no_grad():
                fwd()

        def fb(fwd=fwd):
            fwd().backward(do)

        calls[f"{name}/fwd"], calls[f"{name}/fwd_bwd"] = f, fb
    out = {}
    for key, fn in calls.items():  # host and loop times first, for every call: no profiler has run in the process yet
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        for _ in range(n):
            fn()
        host = (time.perf_counter() - t0) / n * 1e6
        e.record()
        torch.cuda.synchronize()
        out[key] = {"host_us": host, "loop_us": s.elapsed_time(e) / n * 1e3,
                    "do_bench_us": do_bench(fn, warmup=25, rep=100, return_mode="median") * 1e3}
        for t in (q, k, v):
            t.grad = None
    for key, fn in calls.items():  # then the GPU's time per kernel, under torch.profiler
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                fn()
            torch.cuda.synchronize()
        kernels = {}
        for ev in prof.key_averages():
            t = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)
            if t > 0:
                kernels[ev.key[:80]] = t / n
        for t in (q, k, v):
            t.grad = None
        row = out[key]
        row.update(gpu_us=sum(kernels.values()), kernels_us=dict(sorted(kernels.items(), key=lambda kv: -kv[1])))
        name, what = key.split("/")
        print(f"overhead {name:10s} {what:7s} host {row['host_us']:7.1f} us  gpu {row['gpu_us']:7.1f} us  "
              f"loop {row['loop_us']:7.1f} us  do_bench {row['do_bench_us']:7.1f} us  ({len(kernels)} kernels: "
              + ", ".join(f"{k[:40]} {t:.0f}" for k, t in list(row["kernels_us"].items())[:6]) + ")", flush=True)
    return out


def memory(Ts, H, D, deadline):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    out = {}
    for T in Ts:
        for name in ("sdpa_flash", "fa2", "fp32"):
            torch.cuda.empty_cache()
            q, k, v = inputs(1, H, T, D)
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            t0 = time.time()
            try:
                if name == "sdpa_flash":
                    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
                else:
                    o = attention(q, k, v, policy=name, backend="triton")
                o.float().sum().backward()
                torch.cuda.synchronize()
                peak = torch.cuda.max_memory_allocated() - base
                out[f"{name}@{T}"] = {"name": name, "T": T, "peak_mib": peak / 2**20, "seconds": time.time() - t0}
                print(f"memory {name:10s} T={T:6d}: peak {peak / 2**20:8.1f} MiB above inputs, "
                      f"{time.time() - t0:.2f} s", flush=True)
            except Exception as e:
                out[f"{name}@{T}"] = {"name": name, "T": T, "error": f"{type(e).__name__}: {e}"[:300]}
                print(f"memory {name} T={T}: {type(e).__name__}: {e}", flush=True)
            del q, k, v
            if time.time() > deadline:
                return out
    return out


def compile_check(D=64):
    """attention(backend='triton') inside torch.compile: same output and gradients as eager."""
    q, k, v = inputs(2, 4, 256, D, seed=3)

    def f(q, k, v):
        return attention(q, k, v, policy="paper", backend="triton") * 2.0

    o_eager = f(q, k, v)
    g_eager = torch.autograd.grad(o_eager.float().sum(), (q, k, v))
    cf = torch.compile(f, fullgraph=True)
    o_c = cf(q, k, v)
    g_c = torch.autograd.grad(o_c.float().sum(), (q, k, v))
    same = torch.equal(o_eager, o_c) and all(torch.equal(a, b) for a, b in zip(g_eager, g_c))
    print(f"torch.compile(fullgraph=True): {'identical to eager' if same else 'DIFFERS from eager'}", flush=True)
    return {"fullgraph": True, "identical_to_eager": same}


def write_speed_summary(out: Path, shape: dict, rows: dict) -> str:
    """``summary.json`` (preset → fwd+bwd TFLOP/s and ratio to SDPA-flash; read by the book) and ``table.txt`` from the
    speed part's rows (``bench.json``'s ``rows``); returns the table. Also run on its own, to rebuild both from a
    committed ``bench.json``: ``python benchmarks/attention.py --out DIR --summarize``."""
    base = rows.get("sdpa_flash", {}).get("fwd_bwd_tflops")
    gbase = rows.get("sdpa_flash", {}).get("graph_fwd_bwd_tflops")  # None in runs before the graph timing

    def graph_ratio(r):
        return r["graph_fwd_bwd_tflops"] / gbase if gbase and r.get("graph_fwd_bwd_tflops") else None

    summary = {
        "shape": shape,
        "sdpa_flash_fwd_bwd_tflops": base,
        "presets": {
            n: {"fwd_bwd_tflops": r["fwd_bwd_tflops"],
                "ratio_to_sdpa_flash": (r["fwd_bwd_tflops"] / base) if base else None,
                "graph_fwd_bwd_tflops": r.get("graph_fwd_bwd_tflops"), "graph_ratio_to_sdpa_flash": graph_ratio(r)}
            for n, r in rows.items()
        },
    }
    write_json(out / "summary.json", summary)
    lines = [f"{'impl':16s} {'fwd':>8s} {'bwd':>8s} {'fwd+bwd':>8s} {'ratio':>7s} {'graph':>8s} {'ratio':>7s}   "
             "(TFLOP/s; ratio = fwd+bwd / SDPA-flash's; graph: fwd+bwd replayed from a CUDA graph, the GPU's time "
             "alone)"]
    for n, r in rows.items():
        ratio = r["fwd_bwd_tflops"] / base if base else float("nan")
        g, gr = r.get("graph_fwd_bwd_tflops"), graph_ratio(r)
        lines.append(f"{n:16s} {r['fwd_tflops']:8.1f} {r['bwd_tflops']:8.1f} {r['fwd_bwd_tflops']:8.1f} {ratio:7.3f} "
                     f"{g if g else float('nan'):8.1f} {gr if gr else float('nan'):7.3f}")
    table = "\n".join(lines)
    print(table, flush=True)
    (out / "table.txt").write_text(table + "\n")
    return table


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--quick", action="store_true", help="fewer repetitions and sizes (a smoke run)")
    p.add_argument("--parts", default="check,error,speed,shapes,memory,compile")
    p.add_argument("--presets", default=None,
                   help="comma-separated presets for the speed part (default: all of PRESET_ORDER); a run with a "
                        "subset is a screening run: its bench.json is never marked complete, so no page takes it")
    p.add_argument("--summarize", action="store_true",
                   help="only rebuild summary.json and table.txt from DIR/bench.json (no GPU needed)")
    p.add_argument("--launch", nargs="+", default=[], metavar="PASS[@D].FIELD=VALUE",
                   help="changes of the launch table (lpfa.attention.triton_common.changed_launches), e.g. "
                        "backward.dq_mode=ordered: a candidate table timed in place of the committed one, named in "
                        "provenance.json")
    a = p.parse_args()
    unknown = [n for n in (a.presets or "").split(",") if n and n not in PRESETS]
    if unknown:
        p.error(f"--presets names {', '.join(unknown)}: expected presets of lpfa.attention.PRESETS")
    if a.summarize:
        bench = json.loads((Path(a.out) / "bench.json").read_text())
        B, H, T, D = bench["shape"]
        write_speed_summary(Path(a.out), {"B": B, "H": H, "T": T, "D": D}, bench["rows"])
        return
    try:
        changed_launches(a.launch)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    with launches_changed(*a.launch):
        run(a)


def run(a):
    """The parts ``a.parts`` of the benchmark into ``a.out`` (:func:`main`'s arguments)."""
    if not torch.cuda.is_available():
        raise SystemExit("this benchmark needs a CUDA GPU")
    torch.backends.cuda.matmul.allow_tf32 = False
    out = Path(a.out)
    parts = a.parts.split(",")
    B, H, T, D = 16, 12, 1024, 64
    t0 = time.time()
    write_json(out / "provenance.json",
               provenance(config={"B": B, "H": H, "T": T, "D": D, "parts": parts, "quick": a.quick,
                                  "presets": a.presets, "launch_changes": a.launch}))
    results = {}
    if "check" in parts:
        results["check"] = check(2 if a.quick else B, H, T, D)
        write_json(out / "check.json", {"shape": [B, H, T, D], "presets": results["check"]})
    if "error" in parts:
        B_err = 2 if a.quick else 4  # float64 autograd holds a few (B, H, T, T) tensors
        results["error"] = error(B_err, H, T, D)
        write_json(out / "error.json", {"shape": [B_err, H, T, D], "dO": "fp32", "policies": ERROR_POLICIES,
                                        "inputs": results["error"]})
    if "speed" in parts:
        def save(rows, done=False):
            write_json(out / "bench.json", {"shape": [B, H, T, D], "rows": rows, "complete": done})

        presets = a.presets.split(",") if a.presets else None
        rows = speed(B, H, T, D, budget_s=5.0 if a.quick else 20.0, presets=presets, extras=presets is None,
                     save=save)
        save(rows, done=presets is None and not a.launch)  # (a changed launch table is not the kernels' own)
        write_speed_summary(out, {"B": B, "H": H, "T": T, "D": D}, rows)
    if "shapes" in parts:
        rows = shapes(budget_s=5.0 if a.quick else 10.0, deadline=t0 + 480)
        write_json(out / "shapes.json", {"rows": rows})
        lines = [f"{'B':>3s} {'H':>3s} {'T':>6s} {'D':>4s} {'impl':12s} {'fwd':>7s} {'bwd':>7s} {'fwd+bwd':>8s} "
                 f"{'ratio':>6s} {'spread':>7s} {'SFA over base':>14s}   (TFLOP/s, medians of {SHAPE_ROUNDS} "
                 f"interleaved timings; ratio = fwd+bwd / SDPA-flash at that shape; spread: max / min - 1 of the "
                 f"timings)"]
        for r in rows:
            sfa = f"{r['sfa_overhead']['fwd_bwd']:+.1%}" if r["sfa_overhead"] else ""
            ratio = f"{r['ratio_to_sdpa_flash']:.3f}" if r["ratio_to_sdpa_flash"] is not None else "-"
            noise = f"{r['spread']:.1%}" if r.get("spread") is not None else "-"
            lines.append(f"{r['B']:3d} {r['H']:3d} {r['T']:6d} {r['D']:4d} {r['impl']:12s} {r['fwd_tflops']:7.1f} "
                         f"{r['bwd_tflops']:7.1f} {r['fwd_bwd_tflops']:8.1f} {ratio:>6s} {noise:>7s} {sfa:>14s}")
        table = "\n".join(lines)
        print(table, flush=True)
        (out / "shapes.txt").write_text(table + "\n")
    if "overhead" in parts:
        write_json(out / "overhead.json", {"shape": [B, H, T, D], "rows": overhead(B, H, T, D)})
    if "memory" in parts:
        Ts = [1024, 4096] if a.quick else [1024, 2048, 4096, 8192, 16384]
        H_mem = 4  # peak memory is linear in heads; 4 keeps the FP32 policy's 16k run short
        write_json(out / "memory.json", {"H": H_mem, "D": D, "B": 1, "rows": memory(Ts, H_mem, D, deadline=t0 + 420)})
    if "compile" in parts:  # last: whatever compiling leaves in the process must not reach the timings above
        results["compile"] = compile_check()
        if "check" in parts:
            write_json(out / "check.json",
                       {"shape": [B, H, T, D], "presets": results["check"], "compile": results["compile"]})
    print(f"done in {time.time() - t0:.0f} s", flush=True)


if __name__ == "__main__":
    main()
