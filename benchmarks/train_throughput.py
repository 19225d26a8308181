"""GPT-2 small training throughput with lpfa attention against the same model on PyTorch SDPA.

One optimizer step = forward + backward + AdamW on B × 1024 tokens under BF16 autocast with FP32
master weights (the paper's recipe), random token ids (throughput does not depend on the data).
Every backend eagerly, and with ``--compile`` also the model under ``torch.compile`` (the goal: lpfa ``fa2``
≥ 0.95× and ``paper`` ≥ 0.9× the same model on SDPA, compiled, in the same run) for :data:`COMPILED`; each compiled
model is warmed up (compiled) before its timing starts. MFU uses nanoGPT's FLOP estimate (6N + 12·L·H·D·T per
token) against the H200's 989 TFLOP/s dense BF16 peak.

``--profile``: after the timing, two more steps of each backend under ``torch.profiler``: the GPU's busy time per step
(its kernels summed) against the step's wall time (their difference: time the GPU waited for the host), and the
kernels with the most GPU time per step, so that a gap to SDPA can be split into attention kernels, copies and the rest.

``sdpa`` lets PyTorch choose SDPA's kernel (cuDNN's on Hopper); ``sdpa_flash`` pins it to FlashAttention-2's, the
kernel the ``fa2`` policy emulates: every row's ratio to both is written.

Usage: ``python benchmarks/train_throughput.py --out DIR [--batch 16] [--steps 10] [--compile] [--profile]
[--compile-mode reduce-overhead] [--assume-finite] [--rows sdpa,lpfa_fa2,...]``
"""

from __future__ import annotations

import argparse
import contextlib
import time
from pathlib import Path

import torch
from torch._inductor import config as inductor_config

from lpfa.attention.triton_common import changed_launches, launches_changed
from lpfa.model import GPT, GPTConfig
from lpfa.provenance import provenance, write_json

PEAK_BF16 = 989e12  # H200 SXM dense BF16 (datasheet)
BACKENDS = [("sdpa", "sdpa", "fa2"), ("sdpa_flash", "sdpa", "fa2"), ("lpfa_fa2", "lpfa", "fa2"),
            ("lpfa_paper", "lpfa", "paper"), ("lpfa_fa2_sfa", "lpfa", "fa2_sfa"),
            ("lpfa_paper_sfa", "lpfa", "paper_sfa"), ("math", "math", "fa2"), ("sdpa_fp32", "sdpa_fp32", "fa2"),
            ("lpfa_fp32_split", "lpfa", "fp32_split")]
# compiled as well with --compile (each costs a compilation); the last two are the FP32 twins: SDPA on FP32 q, k, v (the
# committed twins') against fp32_split (FP32-level, bit-deterministic, BF16 tensor cores): which FP32 twin is faster
COMPILED = ("sdpa", "sdpa_flash", "lpfa_fa2", "lpfa_paper", "sdpa_fp32", "lpfa_fp32_split")
# "sdpa" lets PyTorch pick SDPA's kernel (cuDNN's on Hopper, 1.6× FlashAttention-2's forward+backward at these shapes:
# results/attention_benchmark); "sdpa_flash" pins it to FlashAttention-2, the kernel lpfa's fa2 policy emulates


def profile_steps(step, n: int = 2, top: int = 15) -> dict:
    """``n`` calls of ``step`` under torch.profiler: wall and GPU-busy ms per step, and the ``top`` kernels' ms per
    step."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        t0 = time.time()
        for _ in range(n):
            step()
        torch.cuda.synchronize()
        wall = (time.time() - t0) / n
    kernels = {}
    for ev in prof.key_averages():
        t = getattr(ev, "self_device_time_total", None) or getattr(ev, "self_cuda_time_total", 0)
        if t > 0:
            kernels[ev.key[:80]] = kernels.get(ev.key[:80], 0.0) + t / n / 1e3
    busy = sum(kernels.values())
    return {"wall_ms": wall * 1e3, "gpu_busy_ms": busy, "gpu_idle_ms": max(wall * 1e3 - busy, 0.0),
            "top_kernels_ms": dict(sorted(kernels.items(), key=lambda kv: -kv[1])[:top])}


def measure(backend: str, policy: str, batch: int, steps: int, T: int = 1024, compile: bool = False,
            profile: bool = False, mode: str | None = None, assume_finite: bool = False, flash_only: bool = False):
    torch.manual_seed(0)
    cfg = GPTConfig.from_size("gpt2-s", vocab_size=50304, block_size=T, attn_backend=backend, attn_policy=policy,
                              attn_assume_finite=assume_finite)
    model = GPT(cfg).cuda()
    if compile:  # a fresh compilation per row: no graph of an earlier row is reused
        torch._dynamo.reset()
    fwd = torch.compile(model, mode=mode) if compile else model
    # SDPA picks its kernel when AOTAutograd traces the graph, but the compile caches key on the graph Dynamo captured,
    # where the sdpa_kernel pin is not seen: with them a pinned row loaded the graph compiled for SDPA's own choice
    # (cuDNN's kernel, 1 s of warm-up, in a run at a8a8d9d), so a pinned row compiles with the caches off
    no_cache = inductor_config.patch(force_disable_caches=True) if compile and flash_only else contextlib.nullcontext()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0, fused=True)
    x = torch.randint(0, 50257, (batch, T + 1), device="cuda")
    inp, tgt = x[:, :-1].contiguous(), x[:, 1:].contiguous()

    from torch.nn.attention import SDPBackend, sdpa_kernel

    def step():
        pin = sdpa_kernel(SDPBackend.FLASH_ATTENTION) if flash_only else contextlib.nullcontext()
        with pin, torch.autocast("cuda", dtype=torch.bfloat16):
            _, loss = fwd(inp, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    t_warm = time.time()
    with no_cache:
        for _ in range(3):  # warm-up (the compilation, with --compile)
            step()
    torch.cuda.synchronize()
    warmup_s = time.time() - t_warm
    torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    for _ in range(steps):
        loss = step()
    torch.cuda.synchronize()
    dt = (time.time() - t0) / steps
    n = model.num_params()
    L, H, D = cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head
    flops_per_token = 6 * n + 12 * L * H * D * T
    tok_s = batch * T / dt
    out = {"tokens_per_s": tok_s, "step_ms": dt * 1e3, "mfu": flops_per_token * tok_s / PEAK_BF16,
           "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30, "loss": float(loss.detach()),
           "warmup_s": warmup_s}
    if profile:
        out["profile"] = profile_steps(step)
        ran_cudnn = [k for k in out["profile"]["top_kernels_ms"] if "cudnn" in k]
        if flash_only and ran_cudnn:  # the pin did not hold: this row is not FlashAttention-2
            raise RuntimeError(f"SDPA pinned to FlashAttention-2 ran cuDNN's {ran_cudnn[0]}: the row is not valid")
    return out  # its model, optimizer and step are freed on return; the caller empties the cache


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--compile", action="store_true", help="also time the COMPILED backends under torch.compile")
    p.add_argument("--profile", action="store_true", help="then profile two steps of each (GPU busy time, top kernels)")
    p.add_argument("--compile-mode", default=None, help="torch.compile's mode for the compiled rows (e.g. "
                   "reduce-overhead: CUDA graphs), default torch's")
    p.add_argument("--rows", default=None,
                   help="comma-separated rows to run (e.g. sdpa,lpfa_fa2_compiled), default all")
    p.add_argument("--assume-finite", action="store_true", help="lpfa attention without its non-finite checks "
                   "(GPTConfig.attn_assume_finite) in every lpfa row")
    p.add_argument("--launch", nargs="+", default=[], metavar="PASS[@D].FIELD=VALUE",
                   help="changes of the launch table (lpfa.attention.triton_common.changed_launches), e.g. "
                        "backward.dq_mode=ordered: a candidate table timed in place of the committed one, named in "
                        "provenance.json")
    a = p.parse_args()
    try:
        changed_launches(a.launch)
    except ValueError as e:
        raise SystemExit(str(e)) from None
    with launches_changed(*a.launch):
        run(a, p)


def run(a, p):
    """Every row of ``a`` into ``a.out`` (:func:`main`'s arguments; ``p`` its parser, for errors)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    out = Path(a.out)
    write_json(out / "provenance.json",
               provenance(config={"model": "gpt2-s", "T": 1024, "batch": a.batch, "steps": a.steps,
                                                           "autocast": "bfloat16", "compile": a.compile,
                                                           "compile_mode": a.compile_mode,
                                                           "assume_finite": a.assume_finite,
                                                           "launch_changes": a.launch,
                                                           "profile": a.profile}))
    rows = {}
    runs = [(name, backend, policy, False) for name, backend, policy in BACKENDS]
    if a.compile:
        runs += [(f"{name}_compiled", backend, policy, True) for name, backend, policy in BACKENDS if name in COMPILED]
    if a.rows:
        wanted = a.rows.split(",")
        unknown = [w for w in wanted if w not in {r[0] for r in runs}]
        if unknown:
            p.error(f"--rows names {', '.join(unknown)}: expected some of {', '.join(r[0] for r in runs)}")
        runs = [r for r in runs if r[0] in wanted]
    for name, backend, policy, compiled in runs:
        try:
            rows[name] = measure(backend, policy, a.batch, a.steps, compile=compiled, profile=a.profile,
                                 mode=a.compile_mode if compiled else None, assume_finite=a.assume_finite,
                                 flash_only=name.startswith("sdpa_flash"))
        except Exception as e:  # keep going: one backend failing must not lose the others
            rows[name] = {"error": f"{type(e).__name__}: {str(e)[:300]}"}
        torch.cuda.empty_cache()  # measure's model and optimizer are gone by now: give their memory back
        # after every backend: a run cut by its time limit keeps what it measured
        write_json(out / "throughput.json", rows)
        r = rows[name]
        print(name, {k: round(v, 4) if isinstance(v, float) else v for k, v in r.items() if k != "profile"}, flush=True)
        if "profile" in r:
            pr = r["profile"]
            print(f"  profile: wall {pr['wall_ms']:.1f} ms, GPU busy {pr['gpu_busy_ms']:.1f} ms; "
                  + "; ".join(f"{k[:50]} {v:.2f}" for k, v in list(pr["top_kernels_ms"].items())[:8]), flush=True)

    def base_of(name, sdpa="sdpa"):  # each mode against SDPA (or SDPA pinned to FlashAttention-2) in the same mode
        return rows.get(f"{sdpa}_compiled" if name.endswith("_compiled") else sdpa, {}).get("tokens_per_s")

    def ratio(name, sdpa="sdpa"):
        r, b = rows[name], base_of(name, sdpa)
        return r["tokens_per_s"] / b if b and "tokens_per_s" in r else None

    summary = {"model": "gpt2-s", "T": 1024, "batch": a.batch,
               "backends": {n: {"tokens_per_s": r.get("tokens_per_s"), "mfu": r.get("mfu"),
                                "compiled": n.endswith("_compiled"),
                                "ratio_to_sdpa": ratio(n), "ratio_to_sdpa_flash": ratio(n, "sdpa_flash")}
                            for n, r in rows.items()}}
    write_json(out / "summary.json", summary)
    lines = [f"{'backend':24s} {'tokens/s':>10s} {'MFU':>6s} {'ratio':>6s} {'× flash':>7s} {'peak GiB':>8s}   "
             "(ratio: to SDPA in the same mode; × flash: to SDPA pinned to FlashAttention-2)"]
    for n, r in rows.items():
        if "tokens_per_s" in r and base_of(n):
            flash = f"{ratio(n, 'sdpa_flash'):7.3f}" if ratio(n, "sdpa_flash") else f"{'-':>7s}"
            lines.append(f"{n:24s} {r['tokens_per_s']:10,.0f} {r['mfu']:6.3f} {ratio(n):6.3f} {flash} "
                         f"{r['peak_mem_gib']:8.1f}")
        else:
            lines.append(f"{n:24s} {r.get('error', 'no SDPA row to compare with')}")
    table = "\n".join(lines)
    print(table)
    (out / "table.txt").write_text(table + "\n")


if __name__ == "__main__":
    main()
