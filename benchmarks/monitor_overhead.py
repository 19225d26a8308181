"""Step-time overhead of :class:`lpfa.monitor.AttentionMonitor` in a training loop (goal ≤ 2 % at every=100).

One training step = forward + backward + AdamW on B × T random token ids (the time does not depend on the data),
under BF16 autocast on CUDA (FP32 on CPU), eager mode. The same model and optimizer alternate segments of ``--steps``
steps without the monitor and with it (``every``; captures at steps 0, every, 2·every, ... of each segment, so a
segment of 3·every steps captures exactly once per ``every``), ``--repeats`` times each, after ``--warmup`` steps.
Every step is synchronised and timed. Reported: the mean step time of each, the overhead ratio (monitored / plain − 1),
the mean time of a capture step against a plain one (what one capture costs; the process's first capture, which pays
one-off costs, is timed apart before the segments), and that cost spread over ``every`` steps
(:func:`lpfa.monitor.amortised_overhead`), which the GPU clock's drift between segments does not move.

Usage::

    python benchmarks/monitor_overhead.py                                   # GPT-2 S, B=8, T=1024, every=100 (GPU)
    python benchmarks/monitor_overhead.py --model debug --batch 2 --seq 64 --steps 20 --every 5 --warmup 2  # CPU smoke

``--out DIR`` writes ``monitor_overhead.json`` with the provenance.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from pathlib import Path

import torch

from lpfa.model import GPT, SIZES, GPTConfig
from lpfa.monitor import OVERHEAD_GOAL, AttentionMonitor, amortised_overhead


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="gpt2-s", choices=sorted(SIZES), help="GPTConfig.from_size name")
    p.add_argument("--backend", default="sdpa", help="attention backend of the model (GPTConfig.attn_backend)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--every", type=int, default=100)
    p.add_argument("--steps", type=int, default=300, help="steps per segment (a multiple of --every)")
    p.add_argument("--repeats", type=int, default=3, help="segments with and without the monitor, alternating")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--device", default="auto")
    p.add_argument("--out", default=None)
    a = p.parse_args(argv)
    if a.steps % a.every:
        p.error(f"--steps ({a.steps}) must be a multiple of --every ({a.every}) for a fair capture rate")
    device = ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    cfg = GPTConfig.from_size(a.model, vocab_size=50304, block_size=a.seq, attn_backend=a.backend)
    model = GPT(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.0)
    x = torch.randint(0, 50257, (a.batch, a.seq + 1), device=device)
    inp, tgt = x[:, :-1].contiguous(), x[:, 1:].contiguous()
    autocast = (torch.autocast("cuda", dtype=torch.bfloat16) if device.startswith("cuda") else contextlib.nullcontext())
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    events = []
    monitor = AttentionMonitor(model, every=a.every, on_warning=events.append)  # thresholds loaded here, not timed

    def step(ctx):
        t0 = time.perf_counter()
        with autocast, ctx:
            _, loss = model(inp, tgt)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()
        return time.perf_counter() - t0

    for _ in range(a.warmup):
        step(contextlib.nullcontext())
    # the first capture of a process pays one-off costs (lazy imports, loading the CUDA kernels of the measures): timed
    # here on its own, as a training run pays it once, and then once more untimed so the segments see steady captures
    # (the monitor's step numbers keep rising across segments, as in a training run: its W_Q growth needs them to)
    first_capture_ms = step(monitor.step(0)) * 1e3
    step(monitor.step(a.every))
    start = 2 * a.every
    plain, monitored, capture = [], [], []
    for r in range(a.repeats):
        plain += [step(contextlib.nullcontext()) for _ in range(a.steps)]
        for s in range(a.steps):
            dt = step(monitor.step(start + r * a.steps + s))
            monitored.append(dt)
            if monitor.due(s):
                capture.append(dt)
        print(f"repeat {r}: plain {statistics.mean(plain[-a.steps:]) * 1e3:.2f} ms/step, monitored "
              f"{statistics.mean(monitored[-a.steps:]) * 1e3:.2f} ms/step", file=sys.stderr, flush=True)
    mp, mm = statistics.mean(plain), statistics.mean(monitored)
    non_capture = [t for i, t in enumerate(monitored) if i % a.steps % a.every]
    res = {"device": torch.cuda.get_device_name() if device.startswith("cuda") else "cpu", "model": a.model,
           "backend": a.backend, "batch": a.batch, "seq": a.seq, "every": a.every, "steps": a.steps,
           "repeats": a.repeats, "plain_ms": mp * 1e3, "monitored_ms": mm * 1e3, "overhead": mm / mp - 1,
           "plain_median_ms": statistics.median(plain) * 1e3,
           "monitored_non_capture_median_ms": statistics.median(non_capture) * 1e3 if non_capture else None,
           "capture_step_ms": statistics.mean(capture) * 1e3, "captures": len(capture),
           "capture_step_median_ms": statistics.median(capture) * 1e3, "first_capture_step_ms": first_capture_ms,
           "capture_extra_ms": (statistics.mean(capture) - statistics.median(plain)) * 1e3,
           "warnings": len(events), "goal": f"overhead <= {OVERHEAD_GOAL} at every=100"}
    res["amortised_overhead"] = amortised_overhead(res)
    print(f"{a.model} on {res['device']}, B={a.batch} T={a.seq}: plain {res['plain_ms']:.2f} ms/step, with the monitor "
          f"(every={a.every}) {res['monitored_ms']:.2f} ms/step: overhead {100 * res['overhead']:+.2f} %; "
          f"one capture step {res['capture_step_ms']:.1f} ms (+{res['capture_extra_ms']:.1f} ms over a plain step's "
          f"median), amortised over {a.every} steps {100 * res['amortised_overhead']:+.2f} %; "
          f"the process's first capture step {first_capture_ms:.0f} ms")
    if a.out:
        from lpfa.provenance import provenance, write_json

        write_json(Path(a.out) / "monitor_overhead.json", {**res, "provenance": provenance(config=vars(a))})
    return res


if __name__ == "__main__":
    main()
