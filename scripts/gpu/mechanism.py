"""The mechanism on the run that fails, in one GPU session: train, replay, bring back (lpfa.experiments.MECHANISM).

``run`` (detached, on the GPU machine) does everything before ``--deadline-s`` seconds from its start:

1. starts ``--bf16`` (default ``bf16_mechanism_deterministic``: the paper-recipe BF16 run, compiled as the recipe runs
   are but with deterministic kernels, so that a replay in another process follows it; a checkpoint every 500 steps
   kept, stopped ``--explosion-stop`` steps after its loss explodes) and its FP32 twin (the row's reference in
   lpfa.experiments: ``fp32_mechanism_deterministic``, compiled, to step 4,000) side by side on one GPU;
2. once the BF16 run has stopped, replays it from its last checkpoint at least ``--window`` steps before the explosion
   (a later one when the time left, at ``--s-per-step``, would not reach the explosion) to 50 steps past it; a run
   that did not explode is replayed up to its last step;
3. once the twin has stopped and the BF16 replay has begun (the BF16 run has the GPU first), replays the twin from
   step 4,000 with the BF16 run's policy measured (``--measure-policy paper``): what BF16 attention would have done on
   the FP32 trajectory, the control of Fig. 5. Both replays stop at the deadline and write what they measured;
4. packs every run's small files, the replays and the logs into ``ROOT/NAME/mechanism.tar.gz``.

The two halves can also run apart, each in a shorter GPU session (the twin's data order and init are functions of
its seed, like the BF16 run's): ``--no-twin`` does steps 1, 2 and 4 for the BF16 run alone; ``--twin-only --heads
H H`` does steps 1, 3 and 4 for the twin alone, measuring the heads the BF16 run's replay measured.

``follow`` prints where it stands every ``--poll-s`` until it is done or ``--max-s`` has passed, and with ``--out``
copies the archive there once it exists, or else ``mechanism-partial.tar.gz``: the same files as they stand. Give
every device command ``--out $OUT``: a machine can be taken back between two calls, and then only what an earlier
call brought back survives::

    setsid nohup python3 scripts/gpu/mechanism.py run --data data/corpus > /tmp/mechanism.log 2>&1 &
    python3 scripts/gpu/mechanism.py follow --max-s 560 --out $OUT
    python3 scripts/gpu/mechanism.py follow --max-s 560 --out $OUT
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import traceback
from pathlib import Path

from lpfa import launch
from lpfa.experiments import MECHANISM, MECHANISM_TWIN_STOP, rows
from lpfa.replay import choose_layer_heads
from lpfa.run import Run, checkpoints_of

PARTIAL = "mechanism-partial.tar.gz"  # what ``follow --out`` brings back before the driver has packed
PAST_EXPLOSION = 50  # replayed steps after the explosion step: the figures show it begin


def log(base: Path, msg: str) -> None:
    line = f"{time.strftime('%H:%M:%S')} {msg}"
    print(line, flush=True)
    with open(base / "driver.log", "a") as f:
        f.write(line + "\n")


def bf16_window(run_dir: Path, window: int, steps_affordable: float) -> tuple[int, int, str]:
    """``(checkpoint step, steps to replay, why)`` for the BF16 run (module docstring, step 3)."""
    run = Run(run_dir)
    v = run.verdict()
    end = v["explosion_step"] + PAST_EXPLOSION if v["explosion_step"] is not None else run.steps
    cks = sorted(s for s in checkpoints_of(run_dir) if s < end)
    if not cks:
        raise RuntimeError(f"{run_dir} has no checkpoint before step {end}")
    wanted = [s for s in cks if s <= end - window] or cks[:1]
    ck, why = wanted[-1], f"the last checkpoint at least {window} steps before step {end}"
    if end - ck > steps_affordable:
        later = [s for s in cks if end - s <= steps_affordable]
        if later:
            ck, why = later[0], f"the earliest checkpoint from which {end - later[0]} steps fit the time left"
    return ck, end - ck, why


def start_replay(base: Path, label: str, step: int, steps: int, max_s: float, heads: list[int], a,
                 measure_policy: str | None = None):
    out = base / f"{label}_replay"
    cmd = [sys.executable, "-m", "lpfa.replay", "--run", str(base / label), "--out", str(out), "--step", str(step),
           "--steps", str(steps), "--layer", str(a.layer), "--heads", *map(str, heads), "--n-seq", str(a.n_seq),
           "--max-s", f"{max_s:.0f}",
           "--delta-err-every", str(a.delta_err_every), "--detail-every", str(a.detail_every),
           *(["--measure-policy", measure_policy] if measure_policy else [])]
    log(base, f"replay {label}: {' '.join(cmd[1:])}")
    return subprocess.Popen(cmd, stdout=open(base / f"{label}_replay.log", "w"), stderr=subprocess.STDOUT)


def pack(base: Path, name: str = "mechanism.tar.gz") -> Path:
    """The small files of every run ``base/launch.json`` names, their replays and the logs that exist now, into
    ``base/name``."""
    archive = base / name
    tmp = base / f"{name}.part"
    labels = list(json.loads((base / "launch.json").read_text())["runs"]) if (base / "launch.json").exists() else []
    with tarfile.open(tmp, "w:gz") as tar:
        for f in ("launch.json", "driver.log", *(f"{label}_replay.log" for label in labels)):
            if (base / f).exists():
                tar.add(base / f, arcname=f)
        for label in labels:
            for f in launch.SMALL_FILES:
                if (base / label / f).exists():
                    tar.add(base / label / f, arcname=f"{label}/{f}")
            for f in ("replay.json", "replay.npz", "provenance.json"):
                if (base / f"{label}_replay" / f).exists():
                    tar.add(base / f"{label}_replay" / f, arcname=f"{label}_replay/{f}")
    tmp.rename(archive)
    return archive


def run(a) -> int:
    """Steps 1-4 of the module docstring; whatever fails, what exists is packed (a failed run never loses its logs)."""
    if a.no_twin and a.twin_only:
        raise SystemExit("--no-twin and --twin-only: expected at most one of them")
    if a.twin_only and not a.heads:
        raise SystemExit("--twin-only needs --heads: the heads the BF16 run's replay measured (its replay.json)")
    t0 = time.time()
    base = Path(a.root) / a.name
    base.mkdir(parents=True, exist_ok=True)
    (base / "driver.pid").write_text(str(os.getpid()))
    try:
        _run(a, base, t0)
    except Exception:
        log(base, "failed:\n" + traceback.format_exc())
    finally:
        for r in launch.status(a.name, a.root) if (base / "launch.json").exists() else []:
            if r["alive"]:
                (base / r["label"] / "STOP").touch()
                log(base, f"{r['label']} still training at the end: STOP")
        time.sleep(5)
        log(base, f"packed {pack(base)} after {time.time() - t0:.0f} s")
    return 0


def _run(a, base: Path, t0: float) -> None:
    left = lambda: a.deadline_s - (time.time() - t0)  # noqa: E731
    fp32 = rows("mechanism")[a.bf16].reference  # the BF16 row's FP32 twin
    data = Path(a.data)
    if not (data / "train.bin").is_file():
        # unpack outside the checkout: the device tool carries data/corpus afresh into every call's tree, which would
        # take the unpacked files away from the runs and replays of a later call
        unpacked = Path(a.root) / "corpus"
        unpacked.mkdir(parents=True, exist_ok=True)
        for name in ("train.bin", "val.bin"):
            if not (unpacked / name).is_file():
                with open(unpacked / name, "wb") as f:
                    subprocess.run(["xz", "-dc", str(data / f"{name}.xz")], stdout=f, check=True)
        data = unpacked.resolve()
    # the BF16 run must leave its replay time: it stops by then even if its loss has not exploded
    budget = max(60.0, a.deadline_s - a.replay_reserve_s)
    common = [f"data={data}", f"batch_size={a.batch}", "grad_accum=1", f"explosion_stop={a.explosion_stop}",
              f"time_budget_s={budget:.0f}", "log_interval=100"]
    runs = {label: [*o, *a.extra, *([f"stop_at_step={a.twin_stop}"] if label == fp32 else [])]
            for label, o in MECHANISM.items()
            if (label == a.bf16 and not a.twin_only) or (label == fp32 and not a.no_twin)}
    launch.start(a.name, runs, a.preset, common, a.root)
    log(base,
        f"started {' and '.join(runs)}: batch {a.batch}, time budget {budget:.0f} s, deadline {a.deadline_s:.0f} s")
    procs: dict[str, subprocess.Popen] = {}
    # both replays measure the same heads: given, else the BF16 run's two fastest-growing W_Q heads of the layer
    heads: list[int] = list(a.heads or [])
    if a.twin_only:
        procs[a.bf16] = None  # trained and replayed by an earlier driver
    while left() > 0:
        st = {r["label"]: r for r in launch.status(a.name, a.root)}
        if fp32 not in procs and a.no_twin:
            procs[fp32] = None
        if fp32 not in procs and not st[fp32]["alive"] and a.bf16 in procs:  # after the BF16 run: it has the GPU first
            if a.twin_stop in checkpoints_of(base / fp32):
                heads = heads or choose_layer_heads(base / a.bf16, layer=int(a.layer))[1]
                procs[fp32] = start_replay(base, fp32, a.twin_stop, a.twin_steps, left() - 30, heads, a, a.policy)
            else:
                log(base, f"{fp32} ended without its step-{a.twin_stop} checkpoint: no control replay")
                procs[fp32] = None
        if a.bf16 not in procs and not st[a.bf16]["alive"]:
            speed = a.s_per_step * 1.25  # the twin's replay will share the GPU
            affordable = (left() - 40) / speed
            ck, steps, why = bf16_window(base / a.bf16, a.window, affordable)
            v = Run(base / a.bf16).verdict()
            log(base,
                f"{a.bf16}: {v['steps']} steps, loss exploded at {v['explosion_step']}, layer {v['runaway_layer']}'s "
                      f"logits ran away at {v['runaway_step']}; replaying {steps} steps from step {ck} ({why}; "
                      f"{speed:.3f} s/step assumed, {affordable:.0f} steps affordable)")
            heads = heads or choose_layer_heads(base / a.bf16, layer=int(a.layer))[1]
            procs[a.bf16] = start_replay(base, a.bf16, ck, steps, left() - 25, heads, a)
        running = [p for p in procs.values() if p is not None and p.poll() is None]
        if len(procs) == 2 and not running:
            break
        log(base, "  ".join(f"{k}: step {r['step']} loss {r['loss']}" for k, r in st.items())
            + "".join(f"  {k} replay {'running' if p is not None and p.poll() is None else 'done'}"
                      for k, p in procs.items()))
        time.sleep(a.poll_s)
    for label, p in procs.items():
        if p is not None and p.poll() is None:
            log(base, f"{label} replay still running at the deadline: stopped")
            p.kill()


def follow(a) -> int:
    base = Path(a.root) / a.name
    t_end = time.time() + a.max_s
    archive = base / "mechanism.tar.gz"
    seen = 0
    while True:
        if (base / "driver.log").is_file():
            lines = (base / "driver.log").read_text().splitlines()
            for line in lines[seen:]:
                print(line, flush=True)
            seen = len(lines)
        if archive.exists() or time.time() >= t_end:
            break
        pid = base / "driver.pid"
        if pid.is_file() and not launch._alive(int(pid.read_text())):
            print("the driver is no longer running and packed nothing", flush=True)
            break
        time.sleep(min(a.poll_s, max(0.0, t_end - time.time())))
    for f in sorted(base.glob("*_replay.log")):  # tqdm's last line
        if f.is_file():
            print(f.name, f.read_text(errors="replace").replace("\r", "\n").strip().splitlines()[-1:], flush=True)
    if a.out:
        # not done yet: what exists now comes back too, so that a machine lost before the next call loses nothing
        # this call could have brought back
        if not archive.exists() and (base / "launch.json").exists():
            archive = pack(base, PARTIAL)
        if archive.exists():
            Path(a.out).mkdir(parents=True, exist_ok=True)
            shutil.copy(archive, Path(a.out) / archive.name)
            print("copied", archive, "to", a.out)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--data", default="data/corpus")
    r.add_argument("--preset", default="gpt2-s-paper")
    r.add_argument("--extra", nargs="*", default=[],
                   help="more key=value for both runs (a CPU smoke test: model=tiny ...)")
    r.add_argument("--bf16", default="bf16_mechanism_deterministic",
                   choices=[k for k in MECHANISM if k.startswith("bf16")],
                   help="the BF16 row of lpfa.experiments.MECHANISM to train and replay")
    r.add_argument("--policy", default="paper", help="the BF16 run's policy, measured on the FP32 twin's trajectory")
    r.add_argument("--no-twin", action="store_true", help="the BF16 run and its replay only (a short GPU session)")
    r.add_argument("--twin-only", action="store_true",
                   help="the FP32 twin and its control replay only, measuring --heads (the BF16 run's came earlier)")
    r.add_argument("--heads", type=int, nargs="+", default=None,
                   help="the heads both replays measure (default: the BF16 run's two fastest-growing W_Q heads)")
    r.add_argument("--twin-stop", type=int, default=MECHANISM_TWIN_STOP,
                   help="the FP32 twin's last step, replayed from")
    r.add_argument("--deadline-s", type=float, default=1450.0)
    r.add_argument("--batch", type=int, default=24)
    r.add_argument("--explosion-stop", type=int, default=60)
    r.add_argument("--replay-reserve-s", type=float, default=350.0,
                   help="the BF16 run stops this long before the deadline")
    r.add_argument("--window", type=int, default=1000, help="replay at least this many steps before the explosion")
    r.add_argument("--twin-steps", type=int, default=1300, help="steps of the FP32 twin's replay from step 4,000")
    r.add_argument("--s-per-step", type=float, default=0.35, help="replay seconds per step, until one is measured")
    r.add_argument("--layer", default="1", help="the replayed layer (1: where the recipe runs' logits ran away)")
    r.add_argument("--n-seq", type=int, default=8)
    r.add_argument("--delta-err-every", type=int, default=25)
    r.add_argument("--detail-every", type=int, default=250)
    f = sub.add_parser("follow")
    f.add_argument("--max-s", type=float, required=True)
    f.add_argument("--out", default=None)
    for s in (r, f):
        s.add_argument("--root", default="/tmp/runs")
        s.add_argument("--name", default="mechanism")
        s.add_argument("--poll-s", type=float, default=60.0)
    a = p.parse_args(argv)
    return run(a) if a.cmd == "run" else follow(a)


if __name__ == "__main__":
    raise SystemExit(main())
