"""What each stabiliser costs in training speed (tokens/s), alone on one GPU.

The committed stabiliser runs shared their H200 two ways with partners that differ from launch to launch, so their own
tokens/s mix the stabiliser's cost with the partner's. Here every row of :data:`lpfa.experiments.STABILISERS` (the
reruns aside: they are the base runs again), the recipe runs it is held against, and the eager BF16 run that
``sr_reseed`` (eager) is timed against, train for a few steps exactly as ``lpfa.train`` builds them: the
``gpt2-s-paper`` preset, ``compile=true``, one micro-batch of ``--batch`` sequences (the committed runs' 24), then the
row's overrides; the model from :func:`lpfa.train.model_config`, the optimizers from :func:`lpfa.train.build_optimizers`
(Muon included) and each step from :func:`lpfa.train.train_step` (QK-clip's logit tracking and rescale included), with
``sr_reseed``'s redraw before each step as in the loop. The data are random token ids: the speed does not depend on
them, except that QK-clip rescales no head here (no logit near τ at initialisation): its cost is the tracking and the
check.

Compilation takes most of the time, so the rows warm up (compile) ``--parallel`` at a time, each in its own process;
once a wave is warm, its rows are timed one after another while the others wait idle, so no timing shares the GPU.
Each row is reported as tokens/s and as a ratio to its speed base (:func:`speed_base`) measured in the same run.

Usage::

    python benchmarks/stabiliser_cost.py --out DIR                       # every row, GPT-2 S, batch 24 (one H200)
    python benchmarks/stabiliser_cost.py --out DIR --device cpu --batch 2 --steps 2 --warmup 1 \\
        --set model=tiny block_size=64 compile=false                     # CPU smoke

``DIR`` gets ``rows/<label>.json`` as each row finishes (a run cut short keeps what it measured), ``summary.json`` and
``table.txt``, with the provenance.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import torch

from lpfa.attention import get_policy
from lpfa.attention.triton_common import default_launch, policy_tiles
from lpfa.attention.triton_fwd import raw_row_max
from lpfa.experiments import PAPER_RECIPE, RERUNS, STABILISERS, stabiliser_seed
from lpfa.model import GPT
from lpfa.provenance import provenance, write_json
from lpfa.run import autocast
from lpfa.train import (
    build_optimizers,
    make_config,
    model_config,
    parse_overrides,
    reseed_stochastic_rounding,
    train_step,
)

PRESET = "gpt2-s-paper"
EAGER_BASE = "bf16_eager"  # sr_reseed runs eager (a new seed each step is a new policy to torch.compile)
ROWS: dict[str, list[str]] = {
    **{label: PAPER_RECIPE[label] for label in ("bf16_paper_recipe", "fp32_paper_recipe", "sfa_paper_recipe")},
    EAGER_BASE: [*PAPER_RECIPE["bf16_paper_recipe"], "compile=false"],
    **{label: o for label, o in STABILISERS.items() if label not in RERUNS and stabiliser_seed(label)[1] is None},
}  # (a row's other seeds cost what it costs: lpfa.experiments.STABILISER_SEEDS)


def speed_base(label: str) -> str | None:
    """The row a row's speed is divided by: the recipe run of its precision (``fp32_*`` rows: ``fp32_paper_recipe``,
    the rest ``bf16_paper_recipe``) with nothing else changed; for the Muon QK-clip rows the Muon run of their
    precision, for ``sr_reseed`` the eager BF16 run. The FP32 and eager runs are themselves held against the BF16 run,
    which has none."""
    mode = "fp32" if label.startswith("fp32") else "bf16"
    if label == "bf16_paper_recipe":
        return None
    if label in ("fp32_paper_recipe", EAGER_BASE):
        return "bf16_paper_recipe"
    if label == "sr_reseed":
        return EAGER_BASE
    if label.endswith("_qkclip_muon"):
        return f"{mode}_muon_recipe"
    return f"{mode}_paper_recipe"


def row_config(label: str, batch: int, extra: list[str]):
    """The TrainConfig of ``label``: the preset, compiled, one micro-batch of ``batch``, ``extra``, then the row."""
    if label not in ROWS:
        raise ValueError(f"row {label!r}: expected one of {', '.join(ROWS)}")
    items = ["compile=true", "grad_accum=1", f"batch_size={batch}", *extra, *ROWS[label]]
    return make_config(PRESET, overrides=parse_overrides(items))


def softcap_row_max_raw(mcfg, cuda: bool) -> bool | None:
    """Under a soft-cap on lpfa's kernels, whether the forward's row-max pass takes the raw Q Kᵀ and caps only each
    row's largest value at the model's shape (:func:`lpfa.attention.triton_fwd.raw_row_max`), rather than capping
    every score; None without a cap. Page 17 says from it what bounds the cap's cost in the run timed."""
    pol = get_policy(mcfg.attn_policy)
    if mcfg.attn_backend != "lpfa" or not pol.softcap:
        return None
    head_dim = mcfg.n_embd // mcfg.n_head
    n_sub = policy_tiles(pol.block_k, mcfg.block_size, default_launch("forward", pol, head_dim).block_n)[2]
    return raw_row_max(True, pol, n_sub, precise_math=cuda)


def time_row(label: str, batch: int, steps: int, warmup: int, device: str, extra: list[str],
             signal: Path | None) -> dict:
    """Build ``label``'s run, warm it up (``warmup`` steps: the compilation), then, once ``signal``/<label>.go exists
    (written by the driver when the GPU is free; None: at once), time ``steps`` steps after ``warmup`` more."""
    cfg = row_config(label, batch, extra)
    cuda = device.startswith("cuda")
    torch.manual_seed(cfg.init_seed)
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False  # as lpfa.train: FP32 means FP32
        torch.backends.cudnn.allow_tf32 = False
    mcfg = model_config(cfg, 50304)
    raw = GPT(mcfg).to(device)
    optimizers = build_optimizers(raw, cfg)
    model = torch.compile(raw) if cfg.compile else raw
    amp = autocast(device, "bfloat16" if cuda else "float32")
    x = torch.randint(0, 50257, (cfg.batch_size, cfg.block_size + 1), device=device)
    batches = [(x[:, :-1].contiguous(), x[:, 1:].contiguous())]
    step = cfg.warmup_steps  # past the warmup: the peak learning rate, as in most of a run
    clipped = 0

    def one():
        nonlocal step, clipped
        if cfg.sr_reseed:
            reseed_stochastic_rounding(raw, step)
        info: dict = {}
        train_step(model, optimizers, cfg, step, batches, amp, info=info)
        clipped += info.get("qk_clipped", 0)
        step += 1

    def sync():
        if cuda:
            torch.cuda.synchronize()

    t0 = time.time()
    for _ in range(warmup):
        one()
    sync()
    warm_s = time.time() - t0
    if cuda:
        torch.cuda.empty_cache()  # hand the activations' memory back while the other rows time
    if signal is not None:
        (signal / f"{label}.ready").touch()
        while not (signal / f"{label}.go").exists():
            time.sleep(0.2)
    for _ in range(warmup):  # the allocator grows back
        one()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.time()
    for _ in range(steps):
        one()
    sync()
    dt = (time.time() - t0) / steps
    return {"label": label, "overrides": ROWS[label], "speed_base": speed_base(label),
            "tokens_per_s": cfg.batch_size * cfg.block_size / dt,
            "step_ms": dt * 1e3, "compiled": cfg.compile, "optimizer": cfg.optimizer, "warmup_s": warm_s,
            "qk_clipped": clipped if cfg.qk_clip else None,
            "softcap_row_max_raw": softcap_row_max_raw(mcfg, cuda),
            "peak_mem_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None}


def drive(labels: list[str], args, out: Path) -> dict:
    """Run ``labels`` in waves of ``args.parallel`` worker processes: all warm up at once, then each is timed alone.
    Stops starting waves once ``args.budget_s`` has passed. Returns ``{label: result or {"error": ...}}``."""
    signal = out / "signal"
    signal.mkdir(parents=True, exist_ok=True)
    (out / "rows").mkdir(exist_ok=True)
    results: dict = {}
    t_start = time.time()
    for i in range(0, len(labels), args.parallel):
        wave = labels[i:i + args.parallel]
        if time.time() - t_start > args.budget_s:
            for label in labels[i:]:
                results[label] = {"error": f"not run: the budget of {args.budget_s:.0f} s was spent"}
            break
        procs = {}
        for label in wave:
            cmd = [sys.executable, __file__, "--worker", label, "--out", str(out), "--batch", str(args.batch),
                   "--steps", str(args.steps), "--warmup", str(args.warmup), "--device", args.device,
                   "--set", *args.set]
            log = open(out / "rows" / f"{label}.log", "w")
            procs[label] = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        print(f"[{time.time() - t_start:6.0f} s] warming up {', '.join(wave)}", flush=True)
        for label, proc in procs.items():  # each in turn, once warm: the others wait idle
            while not (signal / f"{label}.ready").exists() and proc.poll() is None:
                time.sleep(0.5)
        for label, proc in procs.items():
            if proc.poll() is None:
                (signal / f"{label}.go").touch()
            try:
                proc.wait(timeout=args.row_timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
            path = out / "rows" / f"{label}.json"
            if path.is_file():
                results[label] = json.loads(path.read_text())
            else:
                tail = (out / "rows" / f"{label}.log").read_text().strip().splitlines()[-1:]
                results[label] = {"error": f"exit {proc.returncode}: {tail[0][:300] if tail else 'no output'}"}
            r = results[label]
            print(f"[{time.time() - t_start:6.0f} s] {label}: "
                  + (f"{r['tokens_per_s']:,.0f} tokens/s" if "tokens_per_s" in r else r["error"]), flush=True)
    return results


def summarise(results: dict) -> dict:
    """``{label: {..., "ratio_to_base"}}``: each row's tokens/s over its speed base's, where both were measured."""
    out = {}
    for label, r in results.items():
        base = results.get(speed_base(label) or "", {})
        ratio = r["tokens_per_s"] / base["tokens_per_s"] if "tokens_per_s" in r and "tokens_per_s" in base else None
        out[label] = {**r, "speed_base": speed_base(label), "ratio_to_base": ratio}
    return out


def main(argv=None) -> dict | None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--rows", nargs="*", default=list(ROWS), help="labels of ROWS (default: all)")
    p.add_argument("--batch", type=int, default=24)
    p.add_argument("--steps", type=int, default=20, help="timed steps per row")
    p.add_argument("--warmup", type=int, default=3, help="steps before the timing (the first compiles)")
    p.add_argument("--parallel", type=int, default=6, help="rows warming up at once (each holds its GPU memory)")
    p.add_argument("--budget-s", type=float, default=400.0, help="start no wave after this many seconds")
    p.add_argument("--row-timeout-s", type=float, default=300.0)
    p.add_argument("--device", default="cuda")
    p.add_argument("--set", nargs="*", default=[], help="more key=value TrainConfig overrides for every row")
    p.add_argument("--worker", help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    out = Path(a.out)
    if a.worker:
        r = time_row(a.worker, a.batch, a.steps, a.warmup, a.device, a.set, out / "signal")
        write_json(out / "rows" / f"{a.worker}.json", r)
        return None
    for name, v in (("--batch", a.batch), ("--steps", a.steps), ("--parallel", a.parallel)):
        if v < 1:
            raise SystemExit(f"{name} {v}: expected a positive integer")
    for label in a.rows:  # a bad row or override fails here, in one line, before any process starts
        try:
            row_config(label, a.batch, a.set)
        except ValueError as e:
            raise SystemExit(str(e)) from None
    config = {"preset": PRESET, "batch": a.batch, "steps": a.steps, "warmup": a.warmup, "parallel": a.parallel,
              "device": a.device, "set": a.set, "rows": {label: ROWS[label] for label in a.rows}}
    write_json(out / "provenance.json", provenance(config=config))
    summary = summarise(drive(a.rows, a, out))
    write_json(out / "summary.json", summary)
    lines = [f"{'row':22s} {'tokens/s':>10s} {'ratio':>6s}  base"]
    for label, r in summary.items():
        if "tokens_per_s" in r:
            ratio = f"{r['ratio_to_base']:6.3f}" if r["ratio_to_base"] is not None else "     –"
            lines.append(f"{label:22s} {r['tokens_per_s']:10,.0f} {ratio}  {r['speed_base'] or ''}")
        else:
            lines.append(f"{label:22s} {r['error']}")
    (out / "table.txt").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return summary


if __name__ == "__main__":
    main()
