"""Run twin trainings in the background and bring back their small files (for time-boxed GPU machines).

A GPU command may last at most a few minutes while a machine stays up longer, so runs must outlive
the command that starts them. ``start`` launches each run as its own detached process (a new session,
so it survives its parent), ``wait`` follows them until they finish or a deadline passes, ``status``
prints where they are, and ``collect`` packs every run's small files (config, metrics, log, summary;
never checkpoints) into one ``.tar.gz`` for the trip back. Runs stopped by their time budget continue
with ``start --resume``.

    python -m lpfa.launch start  --name twins --preset repro --set data=data/corpus time_budget_s=1500 \\
        --run bf16 attn_policy=paper_untiled --run fp32 attn_policy=fp32
    python -m lpfa.launch wait    --name twins --max-s 500
    python -m lpfa.launch collect --name twins --out $OUT
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

SMALL_FILES = ("config.json", "metrics.jsonl", "log.txt", "summary.json", "stdout.txt")

# The book's experiments (issue 5): each a set of runs on the same seeded batches, differing as named.
TWINS: dict[str, list[str]] = {  # Figs. 2, 3, 7, 13: only the attention differs
    "bf16": ["attn_policy=paper_untiled", "ckpt_history=true"],  # the authors' BF16 flash attention
    "fp32": ["attn_backend=sdpa_fp32"],  # FP32 attention (fast SDPA twin of the fp32 policy)
    "sfa": ["attn_policy=paper_sfa", "ckpt_history=true"],  # the paper's fix, β = 2
    "fa2": ["attn_policy=fa2"],  # FlashAttention-2's rounding, what SDPA users train with
}
# The isolation table (Sec. 3.2): one change each from the bf16 twin. Layer 1 and its heads 5, 2 are where
# our bf16 twin localised (results/repro_twins: fastest W_Q growth, tied rows and logits in layer 1).
# At T = 512 the paper's 512-key blocks are one block, so the bf16 twin is also the "no tiling" row. The two
# references are run again inside the experiment so that every row shares its settings (e.g. compile=true).
ISOLATION: dict[str, list[str]] = {
    "bf16": ["attn_policy=paper_untiled"],
    "fp32": ["attn_backend=sdpa_fp32"],
    "bf16_tiled": ["attn_policy=paper_tiled"],  # 128 × 128 blocks: does tiling matter?
    "bf16_only_layer1": ["attn_backend=sdpa_fp32", "layer_policies={1: paper_untiled}"],
    "fp32_only_layer1": ["attn_policy=paper_untiled", "layer_policies={1: sdpa_fp32}"],
    "delta_dp": ["attn_policy=delta_dp"],  # δ = rowsum(dP∘P)
    "delta_o_fp32": ["attn_policy=delta_o_fp32"],  # δ from O recomputed in FP32 (from the forward's BF16 S)
    "delta_o_exact": ["attn_policy=delta_o_exact"],  # δ from O recomputed from FP32 scores (inconsistent with P)
    "o_fp32": ["attn_policy=o_fp32"],  # Ō, the accumulators and the stored O in FP32
    "pv_fp32": ["attn_policy=pv_fp32"],  # P̄V in FP32
    "scores_fp32": ["attn_policy=scores_fp32"],  # only S in FP32 (not in the paper)
    "fp32_outlier_heads": ["attn_policy=paper_untiled", "fp32_heads={1: [5, 2]}"],
    "fp32_worst_head": ["attn_policy=paper_untiled", "fp32_heads={1: [5]}"],
}
# What the paper reports for each isolation row (Sec. 3.2): "fails" (the loss explodes) or "stable".
PAPER_ISOLATION: dict[str, str] = {
    "bf16": "fails", "fp32": "stable", "bf16_tiled": "fails", "bf16_only_layer1": "fails", "fp32_only_layer1": "stable",
    "delta_dp": "stable", "delta_o_fp32": "stable", "delta_o_exact": "not reported", "o_fp32": "stable",
    "pv_fp32": "stable", "scores_fp32": "not reported", "fp32_outlier_heads": "stable", "fp32_worst_head": "not reported",
}
SEEDS: dict[str, list[str]] = {  # failure (runaway) rate and spread over seeds of data order and init; 1337 is the twins'
    f"{mode}_s{s}": [ISOLATION[mode][0], f"seed={s}", f"init_seed={s}"] for mode in ("bf16", "fp32") for s in (1, 2, 3)
}
SFA_MUON: dict[str, list[str]] = {  # Fig. 7 with Muon; the FP32 twin is the precursor verdict's reference
    "bf16_muon": [*TWINS["bf16"], "optimizer=muon"],
    "fp32_muon": [*TWINS["fp32"], "optimizer=muon"],
    "sfa_muon": [*TWINS["sfa"], "optimizer=muon"],
}
SIZES: dict[str, list[str]] = {  # Fig. 7 at a second model size: GPT-2 S's 12 layers, 12 heads, d = 768; all else `repro`
    f"{mode}_gpt2s": [TWINS[mode][0], "model=gpt2-s"] for mode in ("bf16", "fp32", "sfa")
}
# Dose-response (issue 16): the δ error of layer 1 (the failing layer) multiplied by k in the backward, the forward
# untouched (PrecisionPolicy.dose): "bias" keeps its sign, "control" gives each row a random sign (same magnitude,
# no bias). bias_x1 is the bf16 twin itself. The FP32 twin has no δ error to dose; SFA as the base at the largest dose;
# seeds 1 and 2 at two doses for the spread (1337 is every other run's).
DOSE_LAYER = 1
DOSES = (1, 4, 8, 16, 32, 64, 128, 256)


def _dosed(k: float, sign: str = "bias", policy: str = "paper_untiled") -> list[str]:
    return [f"attn_policy={policy}", f"delta_dose={k}", f"delta_dose_sign={sign}", f"delta_dose_layers=[{DOSE_LAYER}]"]


DOSE: dict[str, list[str]] = {
    **{f"bias_x{k}": _dosed(k) for k in DOSES},
    **{f"control_x{k}": _dosed(k, "control") for k in DOSES},
    "sfa_bias_x256": _dosed(256, policy="paper_sfa"),
    "fp32": ["attn_backend=sdpa_fp32"],
    **{f"bias_x{k}_s{s}": [*_dosed(k), f"seed={s}", f"init_seed={s}"] for k in (64, 128) for s in (1, 2)},
}
# The paper's own recipe at GPT-2 S size (issue 16 §2), run with preset gpt2-s-paper and batch_size/grad_accum set by
# scripts/gpu/paper_recipe.sh to the largest batch that gives >= 8k steps in one GPU run (lpfa.scaling.batch_for_steps).
# fa2 and SFA join only if the BF16 twin explodes and the FP32 twin does not.
PAPER_RECIPE: dict[str, list[str]] = {f"{mode}_paper_recipe": [TWINS[mode][0]] for mode in ("bf16", "fp32", "fa2", "sfa")}
PAPER_RECIPE["bf16_paper_recipe"] = ["attn_policy=paper"]  # T = 1024: the paper's tiled BF16 kernel, not one block
PAPER_RECIPE["sfa_paper_recipe"] = ["attn_policy=paper_sfa"]
PAPER_RECIPE.update({f"{mode}_paper_recipe_s{s}": [*PAPER_RECIPE[f"{mode}_paper_recipe"], f"seed={s}", f"init_seed={s}"]
                     for mode in ("bf16", "fp32") for s in (1, 2)})  # the spread of the explosion step (1337 above)
# Muon, longer (issue 16 §3): the Fig. 7 Muon twins, and the BF16/FP32 twins again at 2.5x Muon's default lr.
MUON_LR2 = 0.05
MUON_LONG: dict[str, list[str]] = {
    **SFA_MUON,
    **{f"{mode}_muon_lr2": [*TWINS[mode], "optimizer=muon", f"muon_lr={MUON_LR2}"] for mode in ("bf16", "fp32")},
}
# What each run changes, in the paper's words (the rows of the isolation table, the seeds and Muon pages).
DESCRIPTIONS: dict[str, str] = {
    "bf16": "BF16 flash attention everywhere, one 512-key block (the paper's failing run; also its 'no tiling' row)",
    "fp32": "FP32 attention everywhere",
    "bf16_tiled": "BF16 flash attention tiled in 128 × 128 blocks (the paper finds tiling irrelevant)",
    "sfa": "BF16 attention with SFA (β = 2)",
    "fa2": "FlashAttention-2's rounding (FP32 scores, BF16 P̄)",
    "bf16_only_layer1": "BF16 attention only in the localised layer 1, FP32 elsewhere",
    "fp32_only_layer1": "FP32 attention only in the localised layer 1, BF16 elsewhere",
    "delta_dp": "δ = rowsum(dP∘P) instead of rowsum(dO∘O)",
    "delta_o_fp32": "δ from O recomputed in FP32 in the backward, from the forward's BF16 scores",
    "delta_o_exact": "δ from O recomputed in FP32 from FP32 scores (not the P the backward differentiates)",
    "o_fp32": "O in FP32: Ō, the running output and the stored O (P̄ still BF16)",
    "pv_fp32": "P̄ and P̄V in FP32 (the running and stored O still BF16)",
    "scores_fp32": "only the scores S in FP32, every later rounding as the BF16 run",
    "fp32_outlier_heads": "FP32 O for only the outlier heads 5 and 2 of layer 1",
    "fp32_worst_head": "FP32 O for only the worst head (5) of layer 1",
    "bf16_muon": "BF16 attention, Muon optimizer",
    "fp32_muon": "FP32 attention, Muon optimizer",
    "sfa_muon": "BF16 attention with SFA (β = 2), Muon optimizer",
    "bf16_runaway": "the BF16 twin again, eager, every checkpoint kept: replayed before its logit runaway",
    "bf16_gpt2s": "BF16 attention, at GPT-2 S size (12 layers, 12 heads, d = 768)",
    "fp32_gpt2s": "FP32 attention, at GPT-2 S size (12 layers, 12 heads, d = 768)",
    "sfa_gpt2s": "BF16 attention with SFA (β = 2), at GPT-2 S size (12 layers, 12 heads, d = 768)",
    **{k: f"{'BF16' if k.startswith('bf16') else 'FP32'} attention, seed {k.split('_s')[1]} (data order and init)" for k in SEEDS},
    **{k: (f"BF16 attention, layer {DOSE_LAYER}'s δ error × {k.split('_x')[1].split('_')[0]} "
           + ("with its sign (biased dose)" if k.startswith("bias") else "with a random sign per row (control)")
           + (f", seed {k.split('_s')[-1]}" if "_s" in k.split("_x")[1] else ""))
       for k in DOSE if k.startswith(("bias", "control"))},
    "sfa_bias_x256": f"BF16 attention with SFA (β = 2), layer {DOSE_LAYER}'s δ error × 256 with its sign",
    "bf16_paper_recipe": "BF16 flash attention (the paper's 512-key tiles), the paper's GPT-2 S recipe",
    "fp32_paper_recipe": "FP32 attention, the paper's GPT-2 S recipe",
    "fa2_paper_recipe": "FlashAttention-2's rounding, the paper's GPT-2 S recipe",
    "sfa_paper_recipe": "BF16 attention with SFA (β = 2), the paper's GPT-2 S recipe",
    **{f"{m}_paper_recipe_s{s}": f"{'BF16' if m == 'bf16' else 'FP32'} attention, the paper's GPT-2 S recipe, seed {s}"
       for m in ("bf16", "fp32") for s in (1, 2)},
    "bf16_muon_lr2": f"BF16 attention, Muon optimizer at Muon lr {MUON_LR2}",
    "fp32_muon_lr2": f"FP32 attention, Muon optimizer at Muon lr {MUON_LR2}",
}
EXPERIMENTS: dict[str, dict[str, list[str]]] = {"twins": TWINS, "isolation": ISOLATION, "seeds": SEEDS, "sfa_muon": SFA_MUON,
                                                 "sizes": SIZES, "dose": DOSE, "paper_recipe": PAPER_RECIPE,
                                                 "muon_long": MUON_LONG}
EXPERIMENT_PRESETS: dict[str, str] = {"paper_recipe": "gpt2-s-paper"}  # the rest run on "repro"


def _root(root: str | Path | None) -> Path:
    return Path(root or os.environ.get("LPFA_RUNS", "runs"))


def run_experiment(name: str, experiment: str, data: str, budget_s: float, preset: str | None = None,
                   root: str | Path | None = None, extra: list[str] | None = None, only: list[str] | None = None,
                   gpus: list[str] | None = None) -> Path:
    """Start the runs of ``EXPERIMENTS[experiment]`` (or ``only`` those labels) on this machine with a wall-clock
    budget each, wait for them, and return their folder (what ``scripts/gpu/twins.sh`` does across several commands).
    ``preset`` defaults to the experiment's (:data:`EXPERIMENT_PRESETS`); on ``repro`` the runs may go to 40k steps,
    other presets keep their own ``max_steps`` (``gpt2-s-paper``'s is its 600k-step cosine horizon). ``gpus``: as
    :func:`start` (one run per GPU where there are enough)."""
    if experiment not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {experiment!r}: choose one of {sorted(EXPERIMENTS)}")
    runs = EXPERIMENTS[experiment]
    if only is not None:
        unknown = sorted(set(only) - set(runs))
        if unknown or not only:
            raise ValueError(f"only={only!r}: expected labels of experiment {experiment!r}, one of {sorted(runs)}")
        runs = {k: v for k, v in runs.items() if k in only}
    preset = preset or EXPERIMENT_PRESETS.get(experiment, "repro")
    common = [f"data={data}", f"time_budget_s={budget_s}", *(["max_steps=40000"] if preset == "repro" else []),
              "ckpt_interval=1000", *(extra or [])]
    start(name, runs, preset, common, root, gpus=gpus)
    wait(name, budget_s + 600, root, poll_s=60)
    return _root(root) / name


def start(name: str, runs: dict[str, list[str]], preset: str | None = None, common: list[str] | None = None,
          root: str | Path | None = None, resume: bool = False, gpus: list[str] | None = None) -> dict:
    """Launch one detached ``python -m lpfa.train`` per run; ``runs`` maps a label to its key=value overrides.

    ``gpus`` places the runs round-robin on those devices (``CUDA_VISIBLE_DEVICES`` per run), so on a
    machine with two GPUs two runs each get a whole GPU; without it every run sees every GPU and uses the first."""
    if gpus is not None and not gpus:
        raise ValueError("gpus is an empty list: give at least one device index, or None for the default device")
    base = _root(root) / name
    base.mkdir(parents=True, exist_ok=True)
    launch_file = base / "launch.json"
    procs = json.loads(launch_file.read_text())["runs"] if launch_file.exists() else {}
    for i, (label, overrides) in enumerate(runs.items()):
        if label in procs and _alive(procs[label]["pid"]):
            raise RuntimeError(f"run {label!r} of {name!r} is still running (pid {procs[label]['pid']})")
        out_dir = base / label
        cmd = [sys.executable, "-m", "lpfa.train", *(["--preset", preset] if preset else []), *(common or []),
               *overrides, f"out_dir={out_dir}", "progress=false", *(["resume=true"] if resume else [])]
        out_dir.mkdir(parents=True, exist_ok=True)
        stdout = open(out_dir / "stdout.txt", "a")
        env = os.environ.copy()
        if gpus:
            env["CUDA_VISIBLE_DEVICES"] = str(gpus[i % len(gpus)])
        p = subprocess.Popen(cmd, stdout=stdout, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        procs[label] = {"pid": p.pid, "cmd": cmd, "started": time.time(), "out_dir": str(out_dir),
                        "gpu": env.get("CUDA_VISIBLE_DEVICES")}
    launch_file.write_text(json.dumps({"name": name, "runs": procs}, indent=1) + "\n")
    return procs


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    try:  # a finished child that nobody reaped is a zombie: not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except OSError:
        return True


def status(name: str, root: str | Path | None = None) -> list[dict]:
    """One dict per run: label, alive, last step and loss, and the final status once the run wrote it."""
    base = _root(root) / name
    launch_file = base / "launch.json"
    if not launch_file.exists():
        raise FileNotFoundError(f"no launch named {name!r} under {_root(root)} (expected {launch_file})")
    out = []
    for label, info in json.loads(launch_file.read_text())["runs"].items():
        d = Path(info["out_dir"])
        rec = {"label": label, "alive": _alive(info["pid"]), "step": None, "loss": None, "status": None}
        m = d / "metrics.jsonl"
        if m.exists():
            for line in reversed(m.read_text().splitlines()):
                try:
                    r = json.loads(line)
                except json.JSONDecodeError:  # a line being written (or cut short by a kill): the one before it
                    continue
                if isinstance(r, dict) and "loss" in r:
                    rec["step"], rec["loss"] = r["step"], r["loss"]
                    break
        if (d / "summary.json").exists():
            try:
                rec["status"] = json.loads((d / "summary.json").read_text())["status"]
            except (ValueError, KeyError, TypeError) as e:
                rec["status"] = f"unreadable summary.json ({type(e).__name__}: {e})"
        out.append(rec)
    return out


def wait(name: str, max_s: float, root: str | Path | None = None, poll_s: float = 15.0) -> list[dict]:
    """Print progress every ``poll_s`` until every run has ended or ``max_s`` has passed."""
    t_end = time.time() + max_s
    while True:
        st = status(name, root)
        print(time.strftime("%H:%M:%S"), "  ".join(
            f"{r['label']}: step {r['step']} loss {r['loss']:.4f}" if r["loss"] is not None else f"{r['label']}: starting"
            for r in st) + ("" if any(r["alive"] for r in st) else "  (all ended)"), flush=True)
        if not any(r["alive"] for r in st) or time.time() >= t_end:
            return st
        time.sleep(min(poll_s, max(0.0, t_end - time.time())))


def collect(name: str, out: str | Path, root: str | Path | None = None, extra: tuple[str, ...] = ()) -> Path:
    """Pack the small files of every run (and ``launch.json``) into ``out/<name>.tar.gz``."""
    base = _root(root) / name
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    archive = out / f"{name}.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        tar.add(base / "launch.json", arcname=f"{name}/launch.json")
        for d in sorted(p for p in base.iterdir() if p.is_dir()):
            for f in (*SMALL_FILES, *extra):
                if (d / f).exists():
                    tar.add(d / f, arcname=f"{name}/{d.name}/{f}")
    return archive


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m lpfa.launch", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    for c in ("start", "status", "wait", "collect"):
        s = sub.add_parser(c)
        s.add_argument("--name", required=True)
        s.add_argument("--root", default=None, help="folder of launches (default $LPFA_RUNS or ./runs)")
        if c == "start":
            s.add_argument("--preset")
            s.add_argument("--set", nargs="*", default=[], help="key=value for every run")
            s.add_argument("--run", nargs="+", action="append", default=[], metavar=("LABEL", "KEY=VALUE"),
                           help="a run: its label, then its own key=value overrides")
            s.add_argument("--experiment", action="append", default=[], choices=sorted(EXPERIMENTS),
                           help="add the runs of one of the book's experiments (lpfa.launch.EXPERIMENTS)")
            s.add_argument("--only", nargs="+", default=None, metavar="LABEL", help="start only these runs of the experiments")
            s.add_argument("--gpus", nargs="+", default=None, metavar="INDEX",
                           help="place the runs round-robin on these GPUs (CUDA_VISIBLE_DEVICES per run)")
            s.add_argument("--resume", action="store_true")
        if c == "wait":
            s.add_argument("--max-s", type=float, required=True)
            s.add_argument("--poll-s", type=float, default=15.0)
        if c == "collect":
            s.add_argument("--out", required=True)
            s.add_argument("--extra", nargs="*", default=[], help="more file names per run, e.g. replay.jsonl")
    a = p.parse_args(argv)
    if a.cmd == "start":
        runs = {label: o for e in a.experiment for label, o in EXPERIMENTS[e].items()}
        runs.update({r[0]: r[1:] for r in a.run})
        if a.only:
            unknown = sorted(set(a.only) - set(runs))
            if unknown:
                p.error(f"--only names runs that are not defined: {unknown}; defined: {sorted(runs)}")
            runs = {k: v for k, v in runs.items() if k in a.only}
        if not runs:
            p.error("start needs --experiment NAME or at least one --run LABEL [KEY=VALUE ...]")
        procs = start(a.name, runs, a.preset, a.set, a.root, a.resume, a.gpus)
        for label, info in procs.items():
            print(f"{label}: pid {info['pid']} gpu {info.get('gpu')} -> {info['out_dir']}")
    elif a.cmd == "status":
        for r in status(a.name, a.root):
            print(r)
    elif a.cmd == "wait":
        wait(a.name, a.max_s, a.root, a.poll_s)
    else:
        print(collect(a.name, a.out, a.root, tuple(a.extra)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
