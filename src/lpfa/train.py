"""Train GPT-2 the way the paper does, on one CPU, one GPU or several (``torchrun``).

The recipe (Sec. 3.1): BF16 autocast with FP32 master weights, AdamW (β = 0.9, 0.95, no weight
decay) or Muon, linear warmup then cosine decay (or a constant rate), gradient clipping, gradient
accumulation. Every run sees the same batches for the same ``seed`` (:func:`lpfa.data.batch_starts`),
whatever its attention precision, and records them in ``replay.jsonl`` so another run can replay them.

Command line (a preset, a YAML config file, then ``key=value`` overrides, later ones winning)::

    python -m lpfa.train --preset cpu-smoke out_dir=runs/smoke max_steps=300
    python -m lpfa.train --config my.yaml attn_policy=paper
    torchrun --nproc_per_node=2 -m lpfa.train --preset repro data=/path/to/nanogpt/data

Outputs in ``out_dir``: ``config.json``, ``metrics.jsonl`` (every step; evals and diagnostics too),
``log.txt``, ``replay.jsonl``, ``ckpt/`` (the last good checkpoint, written atomically) and
``summary.json``. A non-finite loss stops the run and keeps the last good checkpoint and all logs; a
wall-clock budget (``time_budget_s``) or a file named ``STOP`` in ``out_dir`` ends it cleanly with a
checkpoint; ``resume=true`` continues exactly where the checkpoint left off (``config.json`` keeps the first
start's record and lists each resume, with what it changed, under ``resumes``).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import numpy as np
import torch

from lpfa import data as lpfa_data
from lpfa.model import GPT, GPTConfig, SIZES


@dataclass
class TrainConfig:
    # data
    data: str = "embedded"  # "embedded" (the corpus shipped with lpfa) or a folder with train.bin/val.bin
    tokenizer: str = "auto"  # for "embedded": auto, gpt2 or bytes
    # model
    model: str = "tiny"  # a size from lpfa.model.SIZES
    block_size: int = 128
    attn_backend: str = "lpfa"  # lpfa (attn_policy decides), sdpa, sdpa_fp32 (fast FP32 twin) or math
    attn_policy: str = "fa2"  # a preset of lpfa.attention.PRESETS
    layer_policies: dict = field(default_factory=dict)  # {layer: preset}
    fp32_heads: dict = field(default_factory=dict)  # {layer: [heads]}
    qk_norm: bool = False
    gated_attn: bool = False
    bias: bool = False
    dropout: float = 0.0
    # optimisation
    optimizer: str = "adamw"  # adamw or muon (Muon for 2-D weights, AdamW for the rest)
    lr: float = 1e-3
    min_lr: float = 1e-4
    lr_schedule: str = "cosine"  # cosine (to min_lr at max_steps) or constant, both after linear warmup
    warmup_steps: int = 100
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 = off
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    batch_size: int = 16  # sequences per micro-step, summed over all processes
    grad_accum: int = 1  # micro-steps per optimizer step
    max_steps: int = 300
    # precision and device
    device: str = "auto"  # auto, cpu, cuda, cuda:N
    dtype: str = "auto"  # autocast dtype: auto (bfloat16 on CUDA, float32 on CPU), bfloat16, float32
    compile: bool = False
    # bookkeeping
    out_dir: str = "runs/default"
    seed: int = 1337  # data order
    init_seed: int = 1337  # weights
    eval_interval: int = 100  # 0 = only at the end
    eval_batches: int = 10
    log_interval: int = 10  # console; metrics.jsonl gets every step
    ckpt_interval: int = 500  # 0 = only at the end
    ckpt_history: bool = False  # also keep every interval's checkpoint in ckpt_history/step_NNNNNN (for replays)
    diag_interval: int = 0  # W_Q norms, tie fractions, max logits every N steps; 0 = off
    diag_batch: int = 4
    tie_eps: float = 1e-3
    time_budget_s: float = 0.0  # wall-clock budget; 0 = none
    stop_at_step: int = 0  # stop cleanly (with a checkpoint) after this many steps, as if killed; 0 = off
    replay: str = ""  # a replay.jsonl to follow instead of the seeded batch order
    resume: bool = False
    progress: bool = True

    def __post_init__(self):
        if self.model not in SIZES:
            raise ValueError(f"unknown model size {self.model!r}: choose one of {sorted(SIZES)}")
        if self.optimizer not in ("adamw", "muon"):
            raise ValueError(f"optimizer must be 'adamw' or 'muon', got {self.optimizer!r}")
        if self.lr_schedule not in ("cosine", "constant"):
            raise ValueError(f"lr_schedule must be 'cosine' or 'constant', got {self.lr_schedule!r}")
        if self.dtype not in ("auto", "bfloat16", "float32"):
            raise ValueError(f"dtype must be auto, bfloat16 or float32, got {self.dtype!r}")
        for name in ("batch_size", "grad_accum", "max_steps", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")


PRESETS: dict[str, dict] = {
    # the book's CPU default: a tiny model on the embedded corpus, a few minutes on 2 cores
    "cpu-smoke": dict(model="tiny", block_size=128, batch_size=16, max_steps=300, lr=2e-3, min_lr=2e-4,
                      warmup_steps=30, eval_interval=100, eval_batches=8, ckpt_interval=0, attn_policy="fa2"),
    # the feasibility study's failing configuration (issue 5): 8 layers, d = 512, T = 512, 16k tokens/step,
    # flat lr 2e-3 after 200 warmup steps, AdamW (0.9, 0.95), no weight decay, clip 1.0, paper semantics untiled
    "repro": dict(model="repro", block_size=512, batch_size=32, lr=2e-3, min_lr=2e-3, lr_schedule="constant",
                  warmup_steps=200, max_steps=20000, attn_policy="paper_untiled", eval_interval=500,
                  diag_interval=100, ckpt_interval=2000, log_interval=100),
    # GPT-2 small at the paper's sequence length
    "gpt2-s": dict(model="gpt2-s", block_size=1024, batch_size=16, grad_accum=4, lr=6e-4, min_lr=6e-5,
                   warmup_steps=700, max_steps=20000, attn_policy="paper", eval_interval=500, diag_interval=200,
                   ckpt_interval=2000, log_interval=50),
}


# --------------------------------------------------------------------------------------------
# Configuration from presets, files and key=value overrides
# --------------------------------------------------------------------------------------------
def parse_overrides(items: list[str]) -> dict:
    """``["lr=3e-4", "layer_policies={1: paper}"]`` → typed dict (values parsed as YAML)."""
    import yaml

    out = {}
    for item in items:
        if "=" not in item:
            raise ValueError(f"override {item!r} is not key=value")
        key, val = item.split("=", 1)
        v = yaml.safe_load(val)
        if isinstance(v, str):  # YAML 1.1 reads "3e-4" as a string; numbers are meant
            for cast in (int, float):
                try:
                    v = cast(v)
                    break
                except ValueError:
                    pass
        out[key.strip()] = v
    return out


def make_config(preset: str | None = None, config_file: str | None = None, overrides: dict | None = None) -> TrainConfig:
    """TrainConfig from a preset, then a YAML/JSON file, then overrides; unknown keys are an error."""
    import yaml

    d: dict = {}
    if preset:
        if preset not in PRESETS:
            raise ValueError(f"unknown preset {preset!r}: choose one of {sorted(PRESETS)}")
        d.update(PRESETS[preset])
    if config_file:
        loaded = yaml.safe_load(Path(config_file).read_text()) or {}
        if not isinstance(loaded, dict):
            raise ValueError(f"{config_file} must hold a mapping of TrainConfig fields")
        if "preset" in loaded:
            d.update(PRESETS[loaded.pop("preset")])
        d.update(loaded)
    d.update(overrides or {})
    known = {f.name for f in fields(TrainConfig)}
    unknown = sorted(set(d) - known)
    if unknown:
        raise ValueError(f"unknown TrainConfig field(s) {unknown}; known fields: {sorted(known)}")
    return TrainConfig(**d)


# --------------------------------------------------------------------------------------------
# Pieces of the loop
# --------------------------------------------------------------------------------------------
def lr_at(cfg: TrainConfig, step: int) -> float:
    """Linear warmup over ``warmup_steps``, then cosine to ``min_lr`` at ``max_steps`` (or constant)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    if cfg.lr_schedule == "constant":
        return cfg.lr
    frac = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps))
    return cfg.min_lr + 0.5 * (1.0 + math.cos(math.pi * frac)) * (cfg.lr - cfg.min_lr)


def build_optimizers(model: GPT, cfg: TrainConfig) -> list[torch.optim.Optimizer]:
    """AdamW for everything, or Muon for the 2-D weights of the blocks and AdamW for the rest."""
    params = [p for p in model.parameters() if p.requires_grad]
    adam = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=cfg.weight_decay)
    if cfg.optimizer == "adamw":
        return [torch.optim.AdamW(params, **adam)]
    if not hasattr(torch.optim, "Muon"):
        raise RuntimeError("optimizer=muon needs torch.optim.Muon (PyTorch >= 2.9)")
    hidden = [p for n, p in model.named_parameters() if p.ndim == 2 and n.startswith("transformer.h.")]
    ids = {id(p) for p in hidden}
    rest = [p for p in params if id(p) not in ids]
    muon = torch.optim.Muon(hidden, lr=cfg.muon_lr, momentum=cfg.muon_momentum, weight_decay=cfg.weight_decay)
    return [muon, torch.optim.AdamW(rest, **adam)]


def _autocast(device: str, dtype: str):
    if dtype == "bfloat16":
        return torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16)
    return contextlib.nullcontext()


class Run:
    """Files of one run: metrics, log, summary; only rank 0 writes."""

    def __init__(self, out_dir: Path, rank: int):
        self.out_dir, self.rank = out_dir, rank
        self.tb = None
        if rank == 0:
            out_dir.mkdir(parents=True, exist_ok=True)
            try:  # TensorBoard when installed, next to metrics.jsonl
                from torch.utils.tensorboard import SummaryWriter

                self.tb = SummaryWriter(str(out_dir / "tensorboard"))
            except Exception:
                self.tb = None
        self.t0 = time.time()

    def metric(self, rec: dict) -> None:
        if self.rank == 0:
            with open(self.out_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(rec) + "\n")
            if self.tb is not None:
                for k, v in rec.items():
                    if k != "step" and isinstance(v, (int, float)):
                        self.tb.add_scalar(k, v, rec["step"])

    def log(self, msg: str) -> None:
        if self.rank == 0:
            line = f"[{time.strftime('%H:%M:%S')} +{time.time() - self.t0:7.1f}s] {msg}"
            with open(self.out_dir / "log.txt", "a") as f:
                f.write(line + "\n")
            from tqdm.auto import tqdm

            tqdm.write(line, file=sys.stderr)

    def summary(self, rec: dict) -> None:
        if self.rank == 0:
            from lpfa.provenance import write_json

            write_json(self.out_dir / "summary.json", rec)


def _dist_setup():
    """(rank, world_size, local_rank) from torchrun's environment; initialises the process group."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1:
        return 0, 1, 0
    import torch.distributed as dist

    backend = "nccl" if torch.cuda.is_available() else "gloo"
    if not dist.is_initialized():
        dist.init_process_group(backend=backend)
    return dist.get_rank(), world, int(os.environ.get("LOCAL_RANK", "0"))


def _stop_requested(out_dir: Path, world: int, device: str) -> bool:
    """Whether ``out_dir/STOP`` exists; under DDP every rank gets the same answer (one tiny all-reduce)."""
    stop = (out_dir / "STOP").exists()
    if world > 1:
        import torch.distributed as dist

        t = torch.tensor(float(stop), device=device)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        stop = bool(t.item())
    return stop


# --------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------
def train(cfg: TrainConfig) -> dict:
    """Run training; returns the summary (also written to ``out_dir/summary.json``)."""
    from lpfa.checkpoints import load_checkpoint, save_checkpoint
    from lpfa.diagnostics import probe_record

    rank, world, local_rank = _dist_setup()
    out_dir = Path(cfg.out_dir)
    ckpt_dir = out_dir / "ckpt"
    if rank == 0 and not cfg.resume and (ckpt_dir.exists() or (out_dir / "metrics.jsonl").exists()):
        raise FileExistsError(f"{out_dir} already holds a run: pass resume=true to continue it, or choose another out_dir")
    if cfg.resume and not ckpt_dir.exists():
        raise FileNotFoundError(f"resume=true but {ckpt_dir} does not exist")
    run = Run(out_dir, rank)

    # device and precision
    if cfg.device == "auto":
        device = f"cuda:{local_rank}" if torch.cuda.is_available() else "cpu"
    else:
        device = cfg.device
    if device.startswith("cuda"):
        torch.cuda.set_device(device)
        torch.backends.cuda.matmul.allow_tf32 = False  # FP32 means FP32 (the paper's FP32 twin)
        torch.backends.cudnn.allow_tf32 = False
    dtype = cfg.dtype if cfg.dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")
    autocast = _autocast(device, dtype)

    # data
    if cfg.data == "embedded":
        data_dir = lpfa_data.embedded_token_dir(cfg.tokenizer)
    else:
        data_dir = Path(cfg.data)
    train_tokens, meta = lpfa_data.load_tokens(data_dir, "train")
    val_tokens, _ = lpfa_data.load_tokens(data_dir, "val")
    vocab = meta.get("vocab_size", 50257)
    vocab_padded = ((vocab + 63) // 64) * 64
    if cfg.batch_size % world:
        raise ValueError(f"batch_size {cfg.batch_size} must be divisible by the number of processes ({world})")
    per_rank = cfg.batch_size // world

    # model and optimizers
    mcfg = GPTConfig.from_size(
        cfg.model, vocab_size=vocab_padded, block_size=cfg.block_size, dropout=cfg.dropout, bias=cfg.bias,
        attn_backend=cfg.attn_backend, attn_policy=cfg.attn_policy, layer_policies=cfg.layer_policies,
        fp32_heads=cfg.fp32_heads, qk_norm=cfg.qk_norm, gated_attn=cfg.gated_attn,
    )
    torch.manual_seed(cfg.init_seed)
    model = GPT(mcfg).to(device)
    optimizers = build_optimizers(model, cfg)
    start_step = 0
    if cfg.resume:
        ck = load_checkpoint(ckpt_dir, map_location=device)
        model.load_state_dict(ck.model.state_dict())
        for opt, st in zip(optimizers, ck.extra_state["optimizers"]):
            opt.load_state_dict(st)
        start_step = ck.step
        if ck.extra_state and "torch_rng" in ck.extra_state:
            torch.set_rng_state(ck.extra_state["torch_rng"].cpu())
        run.log(f"resumed from {ckpt_dir} at step {start_step}")
    raw_model = model
    if cfg.compile:
        model = torch.compile(model)
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model, device_ids=[local_rank] if device.startswith("cuda") else None)

    # replay: follow a recorded order, and always record ours
    replay_in = lpfa_data.ReplayLog.open(cfg.replay, data_dir / "train.bin") if cfg.replay else None
    replay_out = None
    if rank == 0:
        replay_out = lpfa_data.ReplayLog.create(
            out_dir / "replay.jsonl", data_dir / "train.bin",
            {"seed": cfg.seed, "batch_size": cfg.batch_size, "grad_accum": cfg.grad_accum, "block_size": cfg.block_size},
        )
        from lpfa.provenance import provenance, write_json

        conf = {"train": asdict(cfg), "model": mcfg.to_dict(), "data_dir": str(data_dir), "data_meta": meta,
                "world_size": world, "device": device, "dtype": dtype, "provenance": provenance()}
        if cfg.resume and (out_dir / "config.json").exists():  # keep the run's first start; add this one to its resumes
            first = json.loads((out_dir / "config.json").read_text())
            changed = {k: v for k, v in conf["train"].items() if first.get("train", {}).get(k) != v}
            first.setdefault("resumes", []).append({"step": start_step, "changed": changed, "provenance": conf["provenance"]})
            conf = first
        write_json(out_dir / "config.json", conf)
        run.log(f"model {cfg.model}: {raw_model.num_params() / 1e6:.2f}M parameters, attention {cfg.attn_backend}/"
                f"{cfg.attn_policy}, device {device} × {world}, autocast {dtype}, data {data_dir} ({meta.get('tokenizer', '?')})")

    def starts_for(step: int) -> list[np.ndarray]:
        if replay_in is not None:
            return replay_in.starts(step)
        return [lpfa_data.batch_starts(cfg.seed, step, m, cfg.batch_size, len(train_tokens), cfg.block_size)
                for m in range(cfg.grad_accum)]

    @torch.no_grad()
    def evaluate() -> float:
        model.eval()
        losses = []
        for i in range(cfg.eval_batches):
            st = lpfa_data.batch_starts(cfg.seed + 1, i, 0, cfg.batch_size, len(val_tokens), cfg.block_size)
            x, y = lpfa_data.get_batch(val_tokens, st[rank * per_rank : (rank + 1) * per_rank], cfg.block_size, device)
            with autocast:
                _, loss = model(x, y)
            losses.append(loss.float())
        val = torch.stack(losses).mean()
        if world > 1:
            import torch.distributed as dist

            dist.all_reduce(val, op=dist.ReduceOp.AVG)
        model.train()
        return float(val)

    def checkpoint(step: int) -> None:
        if rank == 0:
            save_checkpoint(ckpt_dir, raw_model, None, step=step, train_config=asdict(cfg),
                            extra_state={"torch_rng": torch.get_rng_state(),
                                         "optimizers": [o.state_dict() for o in optimizers]})
        if world > 1:
            import torch.distributed as dist

            dist.barrier()

    status, step, last = "completed", start_step, {}
    tokens_per_step = cfg.batch_size * cfg.grad_accum * cfg.block_size
    t_start = time.time()
    from tqdm.auto import tqdm

    bar = tqdm(total=cfg.max_steps, initial=start_step, disable=(rank != 0 or not cfg.progress), unit="step", dynamic_ncols=True)
    try:
        for step in range(start_step, cfg.max_steps):
            t0 = time.time()
            lr = lr_at(cfg, step)
            for opt in optimizers:
                for g in opt.param_groups:
                    g["lr"] = cfg.muon_lr * lr / cfg.lr if isinstance(opt, getattr(torch.optim, "Muon", ())) else lr
            starts = starts_for(step)
            if replay_out is not None:
                replay_out.append(step, starts)
            loss_sum = torch.zeros((), device=device)
            for micro, st in enumerate(starts):
                x, y = lpfa_data.get_batch(train_tokens, st[rank * per_rank : (rank + 1) * per_rank], cfg.block_size, device)
                sync = micro == len(starts) - 1
                ctx = model.no_sync() if (world > 1 and not sync) else contextlib.nullcontext()
                with ctx, autocast:
                    _, loss = model(x, y)
                    (loss / len(starts)).backward()
                loss_sum += loss.detach().float()
            loss_mean = loss_sum / len(starts)
            if world > 1:
                import torch.distributed as dist

                dist.all_reduce(loss_mean, op=dist.ReduceOp.AVG)
            gnorm = torch.nn.utils.clip_grad_norm_(raw_model.parameters(), cfg.grad_clip if cfg.grad_clip > 0 else float("inf"))
            loss_v, gnorm_v = float(loss_mean), float(gnorm)
            if not (math.isfinite(loss_v) and math.isfinite(gnorm_v)):
                status = "nonfinite"
                run.metric({"step": step, "loss": loss_v, "grad_norm": gnorm_v, "lr": lr})
                run.log(f"step {step}: non-finite loss {loss_v} / grad norm {gnorm_v}: stopping; the last good "
                        f"checkpoint ({ckpt_dir}) and all logs are kept")
                break
            for opt in optimizers:
                opt.step()
                opt.zero_grad(set_to_none=True)
            dt = time.time() - t0
            last = {"step": step, "loss": loss_v, "lr": lr, "grad_norm": gnorm_v, "step_s": dt,
                    "tokens_per_s": tokens_per_step / dt}
            run.metric(last)
            bar.update(1)
            bar.set_postfix(loss=f"{loss_v:.3f}")
            if step % cfg.log_interval == 0:
                run.log(f"step {step}: loss {loss_v:.4f}, lr {lr:.2e}, grad norm {gnorm_v:.3f}, {tokens_per_step / dt:,.0f} tok/s")
            done = step + 1
            if cfg.diag_interval and done % cfg.diag_interval == 0 and rank == 0:
                st = lpfa_data.batch_starts(cfg.seed + 2, done, 0, cfg.diag_batch, len(val_tokens), cfg.block_size)
                x, _ = lpfa_data.get_batch(val_tokens, st, cfg.block_size, device)
                raw_model.eval()
                run.metric({"step": done, "diag": probe_record(raw_model, x, cfg.tie_eps, autocast)})
                raw_model.train()
            if cfg.eval_interval and done % cfg.eval_interval == 0 and done < cfg.max_steps:
                val = evaluate()
                run.metric({"step": done, "val_loss": val})
                run.log(f"step {done}: val loss {val:.4f}")
            if cfg.ckpt_interval and done % cfg.ckpt_interval == 0 and done < cfg.max_steps:
                checkpoint(done)
                if cfg.ckpt_history and rank == 0:
                    import shutil

                    shutil.copytree(ckpt_dir, out_dir / "ckpt_history" / f"step_{done:06d}", dirs_exist_ok=True)
            if cfg.time_budget_s and time.time() - t_start > cfg.time_budget_s:
                status = "time_budget"
                run.log(f"wall-clock budget of {cfg.time_budget_s:.0f} s reached after step {step}")
                break
            if _stop_requested(out_dir, world, device):  # `touch out_dir/STOP` ends a run cleanly, with a checkpoint
                status = "stopped"
                run.log(f"STOP file found after step {step}; resume=true continues (delete the file first)")
                break
            if cfg.stop_at_step and done >= cfg.stop_at_step:
                status = "stopped"
                run.log(f"stopped after step {step} (stop_at_step={cfg.stop_at_step}); resume=true continues")
                break
    except KeyboardInterrupt:
        status = "interrupted"
        run.log("interrupted: writing a checkpoint of the last completed step")
    finally:
        bar.close()
    if status != "nonfinite":
        step = last["step"] + 1 if last else start_step
        checkpoint(step)
    final_val = evaluate() if status != "nonfinite" else None
    if final_val is not None:
        run.metric({"step": step, "val_loss": final_val})
    summary = {"status": status, "steps": step, "last": last, "final_val_loss": final_val,
               "wall_s": time.time() - t_start, "out_dir": str(out_dir)}
    if rank == 0:
        from lpfa.explosion import run_verdict

        verdict = run_verdict(out_dir)  # policy, seed, exploded, explosion_step, criterion
        verdict.pop("steps")  # "steps" stays the number of completed steps
        summary.update(verdict)
    run.summary(summary)
    run.log(f"{status} at step {step}; final val loss {final_val}")
    if world > 1:
        import torch.distributed as dist

        dist.destroy_process_group()
    return summary


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m lpfa.train", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", choices=sorted(PRESETS), help="start from a preset")
    p.add_argument("--config", help="a YAML file of TrainConfig fields (may name a preset)")
    p.add_argument("overrides", nargs="*", help="key=value overrides of TrainConfig fields")
    a = p.parse_args(argv)
    cfg = make_config(a.preset, a.config, parse_overrides(a.overrides))
    summary = train(cfg)
    return 0 if summary["status"] in ("completed", "time_budget", "stopped") else 1


if __name__ == "__main__":
    raise SystemExit(main())
