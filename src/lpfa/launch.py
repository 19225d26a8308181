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

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

from lpfa.experiments import (  # noqa: F401  (re-exported: the tables live in lpfa.experiments)
    DESCRIPTIONS,
    DOSE,
    DOSE_LAYER,
    DOSES,
    EXPERIMENT_PRESETS,
    EXPERIMENTS,
    ISOLATION,
    MUON_LONG,
    MUON_LR2,
    PAPER_ISOLATION,
    PAPER_RECIPE,
    SEEDS,
    SFA_MUON,
    SIZES,
    TWINS,
)

SMALL_FILES = ("config.json", "metrics.jsonl", "log.txt", "summary.json", "stdout.txt")


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
        runs = "  ".join(f"{r['label']}: step {r['step']} loss {r['loss']:.4f}" if r["loss"] is not None
                         else f"{r['label']}: starting" for r in st)
        print(time.strftime("%H:%M:%S"), runs + ("" if any(r["alive"] for r in st) else "  (all ended)"), flush=True)
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
    p = argparse.ArgumentParser(prog="python -m lpfa.launch", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
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
                           help="add the runs of one of the book's experiments (lpfa.experiments.EXPERIMENTS)")
            s.add_argument("--only", nargs="+", default=None, metavar="LABEL",
                           help="start only these runs of the experiments")
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
