"""Page 12, attention kernels: the precision presets, their accuracy against float64, and the committed H200
measurements of the Triton kernels next to PyTorch's SDPA-flash.

Every experiment of the paper changes where attention rounds to BF16: the scores S, the probabilities ``p_bar``
(P̄ = exp(S − ``row_max``) in BF16, Eq. 2), the block output, the stored O and ``delta`` = rowsum(dO∘O) (Eq. 3). Each
preset of :data:`lpfa.attention.PRESETS` names these rounding points. The page reads ``benchmarks/attention.py``'s run
(``results/attention_benchmark``: speed, memory, host overhead, longer shapes), ``benchmarks/host_overhead.py``'s
(the host's time layer by layer), ``benchmarks/ncu_attention.py``'s (Nsight Compute's counters, parsed by
:mod:`lpfa.attention.ncu`), ``benchmarks/sfa_overhead.py``'s and ``benchmarks/tune_attention.py``'s launch sweeps.
Speed ratios are to SDPA-flash measured in the same run; the page's goals are :data:`TARGETS`.
"""

from __future__ import annotations

import datetime
import json
import subprocess
import sys
from dataclasses import dataclass

import matplotlib.pyplot as plt
import pandas as pd
import torch

from lpfa.attention import GPT2_SHAPE, PRESETS, attention, get_policy
from lpfa.attention.ncu import BOUND_PCT, kernel_pass, limited_by, parse_ncu_csv
from lpfa.pages import and_join, gpu_name
from lpfa.params import boolean, integer, optional, text
from lpfa.paths import repo_root
from lpfa.plotting import COLORS, MAX_ROWS, format_table, use_style
from lpfa.results import file_run, load, run_date, run_dir
from lpfa.results import runs as result_runs

# the notebook's papermill parameters, checked right after its parameters cell (lpfa.params.check_params)
PARAMS = {"run": optional(text(nonempty=True)), "rerun": boolean(), "T_demo": integer(1), "seed": integer(0)}

EXPERIMENT = "attention_benchmark"  # results/<EXPERIMENT>/<run>: benchmarks/attention.py's runs
# the page's goals: fwd+bwd speed as a multiple of SDPA-flash's, `paper` against the PyTorch reference's `paper`
# path, and SFA's cost over its base preset (a fraction)
TARGETS = {"fa2": 1.0, "paper": 0.8, "paper vs reference": 10, "SFA cost": 0.05}
NCU_MIN_US, NCU_BIG_US = 5.0, 100.0  # kernels counted per pass; the attention kernels proper
POLICY_FIELDS = ("scores", "p_bar", "o_block", "accumulator", "o_store", "delta", "backward")


def is_complete(bench: dict) -> bool:
    """Whether a ``bench.json`` holds every row its run set out to time: ``benchmarks/attention.py`` writes it after
    each row, with ``complete`` false until the last (a run cut by its time limit keeps the rows it timed). Runs
    written before the flag existed are complete."""
    return bool(bench.get("complete", True))


def bench_run_of(name: str, run: str | None = None):
    """The folder the page reads ``name`` from: ``run``'s where it holds ``name`` (its ``bench.json`` always: a run
    that is not committed is a one-line FileNotFoundError), else the latest run that holds ``name`` (a run may
    measure only some parts); for ``bench.json`` without ``run``, the latest whose table is complete
    (:func:`is_complete`: the page's ratios need every row)."""
    if run:
        folder = run_dir(EXPERIMENT, run)
        if name == "bench.json" or (folder / name).is_file():
            return folder
        return file_run(EXPERIMENT, name)
    if name == "bench.json":
        for r in reversed(result_runs(EXPERIMENT)):
            bench = _bench_of(r)
            if bench is not None and is_complete(bench):
                return r
    return file_run(EXPERIMENT, name)


def _bench_of(folder) -> dict | None:
    """The ``bench.json`` of a run folder; None where it has none, or no provenance (results without provenance are
    not used)."""
    if (folder / "bench.json").is_file() and (folder / "provenance.json").is_file():
        return load(EXPERIMENT, "bench.json", folder.name)
    return None


def bench_file(name: str, run: str | None = None):
    """``name`` of the attention benchmark's run ``run`` (:func:`lpfa.results.load`; None: the run
    :func:`bench_run_of` picks), parsed where it is JSON."""
    return load(EXPERIMENT, name, bench_run_of(name, run).name)


def partial_runs(run: str | None = None) -> list:
    """The benchmark runs after the page's speed table's (:func:`bench_run_of`) whose ``bench.json`` is not complete
    (cut by their time limit), oldest first: what they timed is newer than the page's table, but not all of it."""
    base = bench_run_of("bench.json", run)
    later = result_runs(EXPERIMENT)
    later = later[later.index(base) + 1:]
    return [r for r in later if (bench := _bench_of(r)) is not None and not is_complete(bench)]


def partial_speed_text(runs: list) -> str:
    """One sentence per run of :func:`partial_runs`: its device, commit and the rows it timed, with ``fa2``'s and
    ``paper``'s forward+backward ratio to SDPA-flash by GPU time (replayed from a CUDA graph), and with the non-finite
    checks off (``:finite``, as the trainer calls them) where it timed that. "" without such runs."""
    out = []
    for r in runs:
        bench, prov = _bench_of(r), load(EXPERIMENT, "provenance.json", r.name)
        t = speed_table(bench)
        col = "GPU-only ratio" if "GPU-only ratio" in t.columns else "ratio to SDPA-flash"
        how = "by GPU time (replayed from a CUDA graph)" if col == "GPU-only ratio" else "by `do_bench`"
        parts = [f"{t.loc[n, col]:.2f}× for `{n}`" for n in ("fa2", "paper") if n in t.index]
        finite = [f"{t.loc[n, col]:.2f}× for `{n}`" for n in ("fa2:finite", "paper:finite") if n in t.index]
        if not parts:
            continue
        commit = str(prov["git_commit"]).removesuffix("-dirty")[:7]
        out.append(f"A later run, `{r.name}` ({prov['device']}, commit `{commit}`), was cut by its time limit after "
                   f"{len(t)} rows of the speed table; {how}, forward and backward ran at " + " and ".join(parts)
                   + " of SDPA-flash's speed in the same run"
                   + (", and with the non-finite checks off (as the trainer calls the kernels) at "
                      + " and ".join(finite) if finite else "") + ".")
    return " ".join(out)


def presets_table():
    """The presets of :data:`lpfa.attention.PRESETS`, one row each: every rounding point of :data:`POLICY_FIELDS`
    (``bf16`` rounds, ``fp32`` keeps), the policy blocks (q × k), the row-sum clamp and SFA's β and ε."""
    return pd.DataFrame([{**{f: getattr(p, f) for f in POLICY_FIELDS},
                          "blocks (q × k)": "one block" if p.block_q is None else f"{p.block_q} × {p.block_k}",
                          "row-sum clamp": "—" if p.row_sum_clamp is None else f"{p.row_sum_clamp:g}",
                          "SFA": f"β={p.sfa.beta:g}, ε={p.sfa.eps:g}" if p.sfa else "—"}
                         for p in PRESETS.values()], index=list(PRESETS))


def accuracy_table(T: int = 64, seed: int = 0):
    """Each preset's reference backend on random BF16 inputs (B=2, H=4, ``T``, D=64, causal, generator seeded with
    ``seed``) against softmax attention in float64: the largest absolute error of O and of dQ, dK, dV, one row per
    preset. Raises ValueError for ``T`` < 1 or ``seed`` < 0."""
    if not (isinstance(T, int) and T >= 1):
        raise ValueError(f"T={T!r}: expected an integer >= 1")
    if not (isinstance(seed, int) and seed >= 0):
        raise ValueError(f"seed={seed!r}: expected an integer >= 0")
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(2, 4, T, 64, generator=g).bfloat16().requires_grad_() for _ in range(3))
    do = torch.randn(2, 4, T, 64, generator=g)
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    o64 = torch.nn.functional.scaled_dot_product_attention(q64, k64, v64, is_causal=True)
    g64 = torch.autograd.grad(o64, (q64, k64, v64), do.double())
    rows = []
    for name in PRESETS:
        o = attention(q, k, v, policy=name, backend="reference")
        grads = torch.autograd.grad(o, (q, k, v), do.to(o.dtype))
        rows.append({"preset": name, "O": (o.double() - o64).abs().max().item(),
                     **{f"d{n}": (a.double() - b).abs().max().item() for n, a, b in zip("qkv", grads, g64)}})
    return pd.DataFrame(rows).set_index("preset")


def rerun_benchmark() -> str:
    """Run ``benchmarks/attention.py`` on this machine's GPU into ``results/attention_benchmark/<gpu>-<date>`` and
    return that run's name. Raises RuntimeError without a CUDA GPU."""
    if not torch.cuda.is_available():
        raise RuntimeError("rerun=True needs a CUDA GPU; set rerun=False to plot the committed results")
    name = f"{torch.cuda.get_device_name(0).split()[-1].lower()}-{datetime.date.today().isoformat()}"
    out = repo_root() / "results" / EXPERIMENT / name
    subprocess.run([sys.executable, str(repo_root() / "benchmarks" / "attention.py"), "--out", str(out)], check=True)
    return name


def provenance_notes(run: str | None = None) -> dict[str, str]:
    """The provenance of the speed table's run (:func:`bench_run_of`) for the page's text: ``bench_run`` (its name),
    ``bench_device`` ("one H100", as page 13 names its GPU: :func:`lpfa.pages.gpu_name`), ``bench_env`` (device,
    torch, Triton, commit, date) and ``bench_command``."""
    folder = bench_run_of("bench.json", run)
    prov = load(EXPERIMENT, "provenance.json", folder.name)
    return {"bench_run": f"`{folder.name}`", "bench_device": f"one {gpu_name(prov['device'])}",
            "bench_env": (f"{prov['device']}, torch {prov['torch']}, Triton {prov['triton']}, "
                          f"commit `{prov['git_commit']}`, {prov['date_utc']}"),
            "bench_command": f"`{prov['command']}`"}


def check_table(check: dict):
    """``check.json`` (the kernels against the PyTorch reference on one GPU) as one row per preset: per tensor
    (``O``, ``dq``, ...), the fraction of elements bit-identical (``same``) and the largest difference relative to the
    tensor's largest magnitude (``max``)."""
    return pd.DataFrame({name: {f"{t} same": r[t]["bit_identical"] for t in r}
                         | {f"{t} max": r[t]["max_rel_to_max"] for t in r}
                         for name, r in check["presets"].items()}).T


def speed_table(bench: dict):
    """DataFrame: TFLOP/s per implementation and pass, with the fwd+bwd ratio to SDPA-flash; where the run also timed
    forward+backward replayed from a CUDA graph (the GPU's time alone, without the host's launches), that too and its
    ratio to SDPA-flash's."""
    rows = bench["rows"]
    base = rows["sdpa_flash"]["fwd_bwd_tflops"]
    gbase = rows["sdpa_flash"].get("graph_fwd_bwd_tflops")
    df = pd.DataFrame(
        [{"implementation": n, "fwd": r["fwd_tflops"], "bwd": r["bwd_tflops"], "fwd+bwd": r["fwd_bwd_tflops"],
          "ratio to SDPA-flash": r["fwd_bwd_tflops"] / base,
          **({"fwd+bwd, GPU only": r.get("graph_fwd_bwd_tflops"),
              "GPU-only ratio": r["graph_fwd_bwd_tflops"] / gbase if r.get("graph_fwd_bwd_tflops") else None}
             if gbase else {})}
         for n, r in rows.items()]
    ).set_index("implementation")
    return df.round(3)


def plot_speed(bench: dict):
    """Horizontal bars of fwd+bwd TFLOP/s, SDPA first."""
    use_style()
    df = speed_table(bench)["fwd+bwd"]
    colors = [COLORS["neutral"] if n.startswith("sdpa") else COLORS["sfa"] if "sfa" in n else
              COLORS["fp32"] if "fp32" in n else COLORS["other"] if n.startswith("reference") else COLORS["bf16"]
              for n in df.index]
    fig, ax = plt.subplots(figsize=(7, 0.32 * len(df) + 1))
    ax.barh(df.index[::-1], df.values[::-1], color=colors[::-1])
    for y, v in enumerate(df.values[::-1]):
        ax.text(v, y, f" {v:.0f}", va="center", fontsize=9)
    B, H, T, D = bench["shape"]
    ax.set_xlabel(f"forward + backward TFLOP/s (causal, B={B}, H={H}, T={T}, D={D})")
    return fig


def _verdict(ok: bool) -> str:
    return "met" if ok else "not met"


def speed_notes(bench: dict, targets: dict = TARGETS) -> dict[str, str]:
    """The speed table's findings against ``targets`` (:data:`TARGETS`): ``fa2_ratio``, ``paper_ratio`` (fwd+bwd ×
    SDPA-flash) and ``paper_ref_ratio`` (× the reference ``paper`` path), each with its ``*_target`` (met or not);
    ``sfa_cost_fa2``, ``sfa_cost_paper`` (1 − SFA's TFLOP/s over its base's) and ``sfa_target``; ``goals_text``."""
    t = speed_table(bench)["ratio to SDPA-flash"]
    fb = speed_table(bench)["fwd+bwd"]
    sfa_cost = {k: 1 - fb[f"{k}_sfa"] / fb[k] for k in ("fa2", "paper")}
    measured = {"fa2": t["fa2"], "paper": t["paper"], "paper vs reference": fb["paper"] / fb["reference_paper"]}
    out = {}
    for key, name in (("fa2", "fa2"), ("paper", "paper"), ("paper vs reference", "paper_ref")):
        out[f"{name}_ratio"] = f"**{measured[key]:.{1 if key == 'paper vs reference' else 2}f}×**"
        out[f"{name}_target"] = f"target ≥ {targets[key]:g}×: {_verdict(measured[key] >= targets[key])}"
    for k, v in sfa_cost.items():
        out[f"sfa_cost_{k}"] = f"{100 * v:+.1f}%"
    out["sfa_target"] = (f"target ≤ {100 * targets['SFA cost']:.0f}%: "
                         f"{_verdict(max(sfa_cost.values()) <= targets['SFA cost'])}")
    out["goals_text"] = f"`fa2` ≥ {targets['fa2']:g}×, `paper` ≥ {targets['paper']:g}×"
    return out


def plot_memory(memory: dict):
    """Peak memory of forward + backward against sequence length."""
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


def memory_notes(memory: dict, run: str | None = None) -> dict[str, str]:
    """The memory figure's findings: ``mem_run`` (the run that measured it), ``mem_T_min``, ``mem_T_max``,
    ``mem_T_ratio`` (the longest T over the shortest) and ``mem_growth_fa2``, ``mem_growth_fp32``: each one's peak
    memory at the longest T over that at the shortest. Raises ValueError without ``fa2`` and ``fp32`` rows."""
    rows = [r for r in memory["rows"].values() if "peak_mib" in r]
    missing = sorted({"fa2", "fp32"} - {r["name"] for r in rows})
    if missing:
        raise ValueError(f"memory rows {missing}: missing, expected peak_mib rows of fa2 and fp32 in memory.json")
    Ts = sorted({r["T"] for r in rows})

    def peak(name, T):
        return next(r["peak_mib"] for r in rows if r["name"] == name and r["T"] == T)

    return {"mem_run": f"`{bench_run_of('memory.json', run).name}`", "mem_T_min": f"{Ts[0]}", "mem_T_max": f"{Ts[-1]}",
            "mem_T_ratio": f"{Ts[-1] // Ts[0]}",
            **{f"mem_growth_{name}": f"{peak(name, Ts[-1]) / peak(name, Ts[0]):.1f}" for name in ("fa2", "fp32")}}


GPT2_SWEEP = list(GPT2_SHAPE)  # B, H, T, D as a list, as the sweeps' JSON records it (tune_attention.py's default)


def tuning_best(tune: dict):
    """The launch sweep of ``benchmarks/tune_attention.py`` (its ``tune.json``): per implementation and pass (fwd, bwd),
    the best TFLOP/s with its launch configuration, and the ratio to SDPA-flash measured in the same run. A DataFrame
    indexed by (implementation, pass); SDPA-flash is the first row of the sweep."""
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


def _sweeps() -> dict:
    """``{run name: tune.json's content}`` of the committed launch sweeps (``results/attention_tuning``) at GPT-2 shapes
    (B 16, H 12, T 1,024, D 64: the shape of the op's table they are read against), oldest first."""
    tunes = {d.name: json.loads((d / "tune.json").read_text())
             for d in result_runs("attention_tuning") if (d / "tune.json").is_file()}
    return {name: t for name, t in tunes.items() if t.get("shape", GPT2_SWEEP) == GPT2_SWEEP}


def tuning_sweeps():
    """:func:`tuning_best` of every committed launch sweep, concatenated: indexed by (run, implementation, pass)."""
    return pd.concat({name: tuning_best(tune) for name, tune in _sweeps().items()}, names=["run"])


def tuning_notes(best, run: str | None = None) -> dict[str, str]:
    """The latest sweep of :func:`tuning_sweeps` (``best``) in words: ``sweep_run``; ``sweep_fa2`` and ``sweep_paper``,
    the forward's and backward's best ratio to SDPA-flash (a missing pass said so); ``sweep_vs_op``, whether that
    sweep and the op's benchmark run ``run`` measured the same kernels (the same commit), else which is the older."""
    name = best.index.get_level_values("run")[-1]
    r = best.loc[name]["ratio to SDPA-flash"]

    def pass_name(p):
        return "forward" if p == "fwd" else "backward"

    sweep_dir = run_dir("attention_tuning", name)
    op_dir = bench_run_of("bench.json", run)  # the speed table's run (a later run may hold only some parts)
    op_commit = load(EXPERIMENT, "provenance.json", op_dir.name)["git_commit"][:7]
    sweep_commit = json.loads((sweep_dir / "provenance.json").read_text())["git_commit"][:7]
    if op_commit == sweep_commit:
        vs = (f"The sweep and the table of the autograd op above (`{op_dir.name}`) measured the same kernels "
              f"(commit `{op_commit}`).")
    else:
        vs = (f"The table of the autograd op above (`{op_dir.name}`, commit `{op_commit}`) and this sweep (commit "
              f"`{sweep_commit}`) " + ("measured different kernels: the op's table is the older."
                                       if run_date(op_dir) < run_date(sweep_dir) else
                                       "measured different kernels: the sweep is the older."))
    return {"sweep_run": f"`{name}`",
            "sweep_fa2": f"{r['fa2', 'fwd']:.2f}× forward and {r['fa2', 'bwd']:.2f}× backward",
            "sweep_paper": " and ".join(f"{r['paper', p]:.2f}× {pass_name(p)}" if ("paper", p) in r.index
                                        else f"no {pass_name(p)} row (the sweep was cut short)"
                                        for p in ("fwd", "bwd")),
            "sweep_vs_op": vs}


def tuning_display(best):
    """:func:`tuning_sweeps` as the page shows it (:func:`lpfa.plotting.format_table`)."""
    return format_table(best)


def sfa_overhead_table(data: dict):
    """``benchmarks/sfa_overhead.py``'s ``sfa_overhead.json`` as one row per shape ("B×H×T×D"): each base preset's
    forward TFLOP/s, and each SFA variant's forward time over its base preset's (the top-2 tie test, the default, and
    the counting pass it replaced), from the faster of the two timings of each; ``spread``: the largest difference
    between the two timings of one variant at that shape, the noise floor of the comparison."""
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


SFA_NOTES = ("sfa_run", "sfa_commit", "sfa_device", "sfa_now", "sfa_goal", "sfa_saved", "sfa_spread", "sfa_tiles")


def sfa_tiles_text(rows: list[dict]) -> str:
    """Where the row-max tie test can save anything, from ``sfa_overhead.json``'s ``rows``: which SFA presets split
    their policy block into several compute tiles at which head dims (``tiles_per_block`` > 1: the counting pass
    then was a second pass over the block's keys), and which hold it in one tile (the count was a pass over
    registers). Runs that predate the tiles' record say so."""
    sfa = [r for r in rows if r["variant"] == r["preset"] and r["preset"].endswith("_sfa")]
    if not sfa or any("tiles_per_block" not in r for r in sfa):
        return "where a policy block spans several compute tiles (this run did not record its tiles)"

    def where(preset: str, many: bool) -> str:
        ds = sorted({r["D"] for r in sfa if r["preset"] == preset and (r["tiles_per_block"] > 1) == many})
        alls = sorted({r["D"] for r in sfa if r["preset"] == preset})
        return "" if not ds else "" if ds == alls else " at D = " + and_join([str(d) for d in ds])

    multi, one = [], []
    for preset in dict.fromkeys(r["preset"] for r in sfa):
        block = get_policy(preset).block_k
        for r in (x for x in sfa if x["preset"] == preset and x["tiles_per_block"] > 1):
            phrase = f"`{preset}`'s {block}-key blocks in {r['key_tile']}-key tiles{where(preset, True)}"
            if phrase not in multi:
                multi.append(phrase)
        if any(r["tiles_per_block"] == 1 for r in sfa if r["preset"] == preset):
            one.append(f"`{preset}`{where(preset, False)}")
    text = "where a policy block spans several compute tiles" + (f": {and_join(multi)}" if multi else
                                                                 ", which none of its rows does")
    if one:
        verb = "holds" if len(one) == 1 else "hold"
        text += f"; {and_join(one)} {verb} the block in one tile, where the count was already a pass over registers"
    return text


def sfa_overhead():
    """The latest committed ``benchmarks/sfa_overhead.py`` run (``results/sfa_overhead``): ``(table, folder)``, the
    table by :func:`sfa_overhead_table`; ``(None, None)`` when none is committed."""
    try:
        folder = run_dir("sfa_overhead")
    except FileNotFoundError:
        return None, None
    return sfa_overhead_table(load("sfa_overhead", "sfa_overhead.json", folder.name)), folder


def sfa_overhead_display(table):
    """:func:`sfa_overhead_table` as the page shows it (:func:`lpfa.plotting.format_table`): the costs over base and
    their spread as percentages."""
    return format_table(table, percent=tuple(c for c in table.columns if not c.endswith("TFLOP/s")))


def sfa_overhead_notes(table, folder, target: float = TARGETS["SFA cost"]) -> dict[str, str]:
    """The SFA forward's cost in words, from :func:`sfa_overhead`'s ``(table, folder)``: ``sfa_run``, ``sfa_commit``,
    ``sfa_now`` (the range of SFA's time over its base), ``sfa_goal`` (within ``target`` or not), ``sfa_saved`` (what
    the row-max tie test saved over the counting pass, percentage points), ``sfa_spread``, ``sfa_device`` (the GPU)
    and ``p12_note1`` (how to make a run, when ``table`` is None; the others are then "–")."""
    if table is None:
        return {**dict.fromkeys(SFA_NOTES, "–"), "p12_note1": (
            "**Not run yet**: `python benchmarks/sfa_overhead.py --out results/sfa_overhead/<run>` on a GPU.")}
    now = table[["paper_sfa over base", "fa2_sfa over base"]]
    saved = table[["paper_sfa count pass over base", "fa2_sfa count pass over base"]].to_numpy() - now.to_numpy()
    prov = load("sfa_overhead", "provenance.json", folder.name)
    rows = load("sfa_overhead", "sfa_overhead.json", folder.name)["rows"]
    return {"sfa_run": f"`{folder.name}`", "sfa_tiles": sfa_tiles_text(rows),
            "sfa_commit": f"`{prov['git_commit'][:7]}`", "sfa_device": f"one {gpu_name(prov['device'])}",
            "sfa_now": f"{now.min().min():+.0%} to {now.max().max():+.0%}",
            "sfa_goal": f"the goal of at most +{100 * target:.0f}% is {_verdict(now.max().max() <= target)}",
            "sfa_saved": f"up to {100 * saved.max():.0f} percentage points",
            "sfa_spread": f"{table['spread'].max():.1%}",
            "p12_note1": ""}


def overhead_table(data: dict):
    """``benchmarks/attention.py``'s ``overhead.json`` as one row per (implementation, pass): the host's time to issue
    one call, the GPU's busy time per call (its kernels summed), the time per call back to back, ``do_bench``'s time
    and the number of distinct kernels; ``bound by``: the host where its issue time exceeds the GPU's busy time, else
    the GPU; ``GPU time × SDPA-flash``: SDPA-flash's GPU time over this row's in the same pass (above 1: faster)."""
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


def overhead_display(table):
    """:func:`overhead_table` as the page shows it (:func:`lpfa.plotting.format_table`)."""
    return format_table(table)


def overhead_text(table) -> dict[str, str]:
    """Page 12's clauses from :func:`overhead_table`: ``host``, one ``fa2`` forward+backward's host issue time
    against its GPU work, next to SDPA-flash's, and which side sets the pace; ``gpu_ratio``, ``fa2``'s and ``paper``'s
    forward+backward GPU time as a multiple of SDPA-flash's speed; ``bound``, which of the two the host bounds."""
    fb = {name: table.loc[(name, "fwd_bwd")] for name in ("sdpa_flash", "fa2", "paper")}
    return {
        "host": (f"one `fa2` forward and backward takes {fb['fa2']['host µs']:,.0f} µs of the host's time to issue, "
                 f"against {fb['fa2']['GPU µs']:,.0f} µs of GPU work (SDPA-flash: "
                 f"{fb['sdpa_flash']['host µs']:,.0f} µs and {fb['sdpa_flash']['GPU µs']:,.0f} µs), so the call is "
                 f"{fb['fa2']['bound by']}-bound"),
        "gpu_ratio": (f"{fb['fa2']['GPU time × SDPA-flash']:.2f}× for `fa2` and "
                      f"{fb['paper']['GPU time × SDPA-flash']:.2f}× for `paper`"),
        "bound": _bound_clause([name for name in ("fa2", "paper") if fb[name]["bound by"] == "host"]),
    }


def _bound_clause(host_bound: list[str]) -> str:
    if not host_bound:
        return "the GPU work bounds both `fa2` and `paper`'s forward and backward, not the host"
    names = " and ".join(f"`{n}`" for n in host_bound)
    return (f"the host bounds {names}'s forward and backward before the kernels do "
            "(it takes longer to issue than to run)")


def overhead_notes(table, run: str | None = None) -> dict[str, str]:
    """:func:`overhead_text`'s clauses under the page's names (``ovh_fa2``, ``ovh_gpu_ratio``, ``ovh_bound``), with
    ``ovh_run``, the run that measured ``overhead.json``."""
    text = overhead_text(table)
    return {"ovh_run": f"`{bench_run_of('overhead.json', run).name}`", "ovh_fa2": text["host"],
            "ovh_gpu_ratio": text["gpu_ratio"], "ovh_bound": text["bound"]}


def shapes_table(shapes: dict):
    """``benchmarks/attention.py --parts shapes``'s ``shapes.json`` as one row per (shape "B×H×T×D", implementation):
    forward, backward and forward+backward TFLOP/s, the forward+backward ratio to SDPA-flash at that shape, and for an
    SFA preset its forward+backward time over its base preset's; for a run that timed each implementation several
    times, interleaved, also the spread of those timings (max / min − 1: how large a difference is noise)."""
    sh = pd.DataFrame(shapes["rows"])
    sh["shape"] = [f"{b}×{h}×{t}×{d}" for b, h, t, d in zip(sh.B, sh.H, sh["T"], sh.D)]
    sh["SFA over base"] = [o["fwd_bwd"] if isinstance(o, dict) else None for o in sh["sfa_overhead"]]
    columns = {"fwd_tflops": "fwd TFLOP/s", "bwd_tflops": "bwd TFLOP/s", "fwd_bwd_tflops": "fwd+bwd TFLOP/s",
               "ratio_to_sdpa_flash": "× SDPA-flash", "SFA over base": "SFA over base"}
    if "spread" in sh:
        columns["spread"] = "timing spread"
    return sh.set_index(["shape", "impl"])[list(columns)].rename(columns=columns)


def shapes_display(shapes: dict):
    """:func:`shapes_table` as the page shows it (:func:`lpfa.plotting.format_table`): the forward+backward ratio to
    SDPA-flash, one row per shape and one column per implementation; the full table is a CSV
    (:func:`full_shapes_table`)."""
    ratio = shapes_table(shapes)["× SDPA-flash"].unstack("shape")
    ratio = ratio.loc[list(dict.fromkeys(shapes_table(shapes).index.get_level_values("impl"))),
                      list(dict.fromkeys(shapes_table(shapes).index.get_level_values("shape")))]
    ratio.index.name, ratio.columns.name = "implementation", "B×H×T×D"
    return format_table(ratio.T).set_caption("Forward+backward speed ÷ SDPA-flash's, per shape (B×H×T×D)")


def full_shapes_table():
    """The full table behind :func:`shapes_display` for :mod:`lpfa.pages.tables`: :func:`shapes_table` of the latest
    committed run that holds ``shapes.json``, what it is, and that folder."""
    folder = bench_run_of("shapes.json")
    what = (f"Page 12's full shapes table: TFLOP/s forward, backward and forward+backward per shape and "
            "implementation, the ratio to SDPA-flash and SFA's cost over its base preset, from "
            f"results/{EXPERIMENT}/{folder.name}")
    return shapes_table(bench_file("shapes.json", folder.name)), what, [f"results/{EXPERIMENT}/{folder.name}"]


def shapes_text(shapes: dict, sfa_goal: float, goals: dict | None = None) -> dict[str, str]:
    """Page 12's clauses from ``shapes.json``: ``trend``, whether ``fa2``'s and ``paper``'s ratios rise or fall from
    T = 1,024 to the longest T; ``ratios``, ``fa2``'s and ``paper``'s forward+backward ratio to
    SDPA-flash at T = 4,096, at the longest T (D = 64) and at D = 128, T = 1,024; ``sfa``, the range of the SFA
    presets' cost over their base at T ≥ 4,096 and whether it is within ``sfa_goal`` (a fraction); with ``goals``
    (``{impl: ratio}``), ``goals``: the shapes at which each one meets its goal, and its worst ratio elsewhere."""
    sh = pd.DataFrame(shapes["rows"])
    ratio = sh.set_index(["T", "D", "impl"])["ratio_to_sdpa_flash"]
    longest = int(sh["T"].max())
    long_sfa = pd.Series([o["fwd_bwd"] for o, t in zip(sh["sfa_overhead"], sh["T"])
                          if isinstance(o, dict) and t >= 4096])
    # from T = 1,024 to the longest T (D = 64): both ratios up, both down, or one of each
    moves = {ratio[(longest, 64, impl)] > ratio[(1024, 64, impl)] for impl in ("fa2", "paper")}
    return {
        "trend": ("rise" if moves == {True} else "fall" if moves == {False} else "move apart")
        + f" from T = 1,024 to T = {longest:,}",
        "ratios": (f"at T = 4,096 `fa2` runs at {ratio[(4096, 64, 'fa2')]:.2f}× SDPA-flash and `paper` at "
                   f"{ratio[(4096, 64, 'paper')]:.2f}×; at T = {longest:,} at {ratio[(longest, 64, 'fa2')]:.2f}× and "
                   f"{ratio[(longest, 64, 'paper')]:.2f}×; at D = 128 (T = 1,024) at "
                   f"{ratio[(1024, 128, 'fa2')]:.2f}× and {ratio[(1024, 128, 'paper')]:.2f}×"),
        "sfa": (f"{long_sfa.min():+.1%} to {long_sfa.max():+.1%}, "
                + ("within" if long_sfa.max() <= sfa_goal else "outside")
                + f" the goal of at most +{100 * sfa_goal:.0f}%") if len(long_sfa) else "not measured at T ≥ 4,096",
        **({"goals": _goals_clause(sh, goals)} if goals else {}),
    }


def _shape_name(T: int, D: int) -> str:
    return f"T = {T:,}" + ("" if D == 64 else f", D = {D}")


def _goals_clause(sh: pd.DataFrame, goals: dict) -> str:
    """Each implementation's goal (``{impl: ratio}``) against every shape of ``shapes.json``'s rows ``sh``: at which
    shapes it is met, and the worst ratio where it is not."""
    parts = []
    for impl, goal in goals.items():
        r = sh[sh.impl == impl]
        met = r[r["ratio_to_sdpa_flash"] >= goal]
        short = r[r["ratio_to_sdpa_flash"] < goal]
        text = f"`{impl}` (≥ {goal:g}×) meets its goal at {len(met)} of {len(r)} shapes"
        if len(met):
            text += " (" + "; ".join(_shape_name(t, d) for t, d in zip(met["T"], met["D"])) + ")"
        if len(short):
            worst = short.loc[short["ratio_to_sdpa_flash"].idxmin()]
            text += f", down to {worst['ratio_to_sdpa_flash']:.2f}× at {_shape_name(worst['T'], worst['D'])}"
        parts.append(text)
    return "; ".join(parts)


def short_sfa_spread(root=None) -> str:
    """SFA's forward+backward cost over its base at T = 1,024, D = 64 in every committed ``shapes.json``
    (``results/attention_benchmark``), per SFA preset as a range over the runs: how far that one cell moves between
    runs of the same benchmark. "" without a run that times it."""
    found: dict[str, list[float]] = {}
    for folder in result_runs(EXPERIMENT, root):
        if not (folder / "shapes.json").is_file():
            continue
        for r in load(EXPERIMENT, "shapes.json", folder.name, root)["rows"]:
            if (r["T"], r["D"]) == (1024, 64) and isinstance(r.get("sfa_overhead"), dict):
                found.setdefault(r["impl"], []).append(r["sfa_overhead"]["fwd_bwd"])
    if not found:
        return ""
    n = max(len(v) for v in found.values())
    return (f"over the {n} committed shapes runs it ranged from "
            + and_join([f"{min(v):+.0%} to {max(v):+.0%} for `{impl}`" for impl, v in found.items()]))


def shapes_notes(shapes: dict, targets: dict = TARGETS, run: str | None = None) -> dict[str, str]:
    """:func:`shapes_text` against the page's ``targets`` under the page's names: ``shape_trend`` (whether the ratios
    rise or fall with T), ``shape_long`` (the ratios), ``shape_sfa`` (SFA's cost at T ≥ 4,096) and ``shape_goals``
    (where ``fa2``'s and ``paper``'s goals are met); ``shape_run``: the run that measured them
    (:func:`bench_run_of` ``run``), its GPU and commit, since it need not be the speed table's;
    ``shape_sfa_short``: :func:`short_sfa_spread`."""
    text = shapes_text(shapes, targets["SFA cost"], {k: targets[k] for k in ("fa2", "paper")})
    folder = bench_run_of("shapes.json", run)
    prov = load(EXPERIMENT, "provenance.json", folder.name)
    return {"shape_trend": text["trend"], "shape_long": text["ratios"], "shape_sfa": text["sfa"],
            "shape_goals": text["goals"], "shape_run": f"run `{folder.name}` on one {gpu_name(prov['device'])}, "
                                                      f"commit `{str(prov['git_commit'])[:7]}`",
            "shape_sfa_short": short_sfa_spread()}


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


def host_runs() -> dict[str, dict]:
    """Every committed ``benchmarks/host_overhead.py`` run (``results/host_overhead``), oldest first: run name → its
    ``host_overhead.json``."""
    return {f.name: load("host_overhead", "host_overhead.json", f.name) for f in result_runs("host_overhead")}


def host_layers_table(runs: dict[str, dict]):
    """``benchmarks/host_overhead.py`` runs side by side: one row per run (``runs`` maps a label, e.g. the commit, to
    its ``host_overhead.json``), one column per layer of the call (:data:`HOST_LAYERS`), in µs of the host's time per
    call; ``fwd+bwd × SDPA-flash`` is the host's time for ``attention()``'s forward+backward over SDPA-flash's measured
    in the same run (the hosts of two machines differ, the ratio less)."""
    df = pd.DataFrame({label: {name: r["host_us"].get(key) for key, name in HOST_LAYERS.items()}
                       for label, r in runs.items()}).T
    df["fwd+bwd × SDPA-flash"] = df["attention(), fwd+bwd"] / df["SDPA-flash, fwd+bwd"]
    return df.rename_axis("run")


def host_layers_display(table):
    """:func:`host_layers_table` as the page shows it (:func:`lpfa.plotting.format_table`)."""
    return format_table(table)


def host_layers_text(table) -> str:
    """Page 12's sentence from :func:`host_layers_table`: the host's time for one forward+backward through
    ``attention()`` in the first and the last run, each as a multiple of SDPA-flash's in its own run."""
    first, last = table.iloc[0], table.iloc[-1]
    return (f"the host's time to issue one forward and backward through `attention()` went from "
            f"{first['attention(), fwd+bwd']:,.0f} µs ({first['fwd+bwd × SDPA-flash']:.1f}× SDPA-flash's in the same "
            f"run, `{table.index[0]}`) to {last['attention(), fwd+bwd']:,.0f} µs "
            f"({last['fwd+bwd × SDPA-flash']:.1f}×, `{table.index[-1]}`)")


NCU_TARGETS = ("sdpa_flash", "fa2", "paper")  # what page 12's Nsight Compute prose compares: a run needs all three


def _ncu_kernels(folder, root=None) -> dict:
    """One ``benchmarks/ncu_attention.py`` run's kernels: each target of its provenance mapped to
    :func:`lpfa.attention.ncu.parse_ncu_csv` of its CSV."""
    prov = load("attention_ncu", "provenance.json", folder.name, root)
    return {t: parse_ncu_csv((folder / f"{t}.csv").read_text()) for t in prov["config"]["targets"]}


def load_ncu(root=None):
    """The latest committed ``benchmarks/ncu_attention.py`` run (``results/attention_ncu``) that profiles every one of
    :data:`NCU_TARGETS`: ``(kernels, folder)``, ``kernels`` as :func:`_ncu_kernels` gives them."""
    runs = [f for f in result_runs("attention_ncu", root)
            if set(NCU_TARGETS) <= set(load("attention_ncu", "provenance.json", f.name, root)["config"]["targets"])]
    if not runs:
        raise FileNotFoundError(f"no committed attention_ncu run profiles all of {', '.join(NCU_TARGETS)}")
    return _ncu_kernels(runs[-1], root), runs[-1]


def _pct(x: float) -> str:
    """A relative change as a signed whole percent, "±0%" where it rounds to zero."""
    return "±0%" if round(100 * x) == 0 else f"{x:+.0%}"


def ncu_sfa_text(root=None) -> str:
    """SFA's cost by Nsight Compute, per shape from the latest committed run there that profiles an SFA preset
    (``<base>_sfa``) and its base: the forward kernels' time and instructions over the base's, and the backward's
    instructions and time (SFA changes only the forward's row max, Eq. 6). "" without such a run."""
    latest = {}
    for folder in result_runs("attention_ncu", root):
        config = load("attention_ncu", "provenance.json", folder.name, root)["config"]
        if any(t.endswith("_sfa") and t[:-4] in config["targets"] for t in config["targets"]):
            latest[tuple(config[k] for k in "BHTD")] = folder
    parts = []
    for (B, H, T, D), folder in latest.items():
        kernels = _ncu_kernels(folder, root)
        passes = ncu_passes(ncu_table(kernels))
        targets = list(dict.fromkeys(passes.index.get_level_values("target")))

        def backward_instructions(target):  # every backward kernel, unrounded (ncu_passes rounds to 10,000)
            return sum(m.get("instructions") or 0 for k, m in kernels[target].items() if kernel_pass(k) == "backward")

        fwd, bwd = [], []
        for sfa in [t for t in targets if t.endswith("_sfa") and t[:-4] in targets]:
            base = sfa[:-4]
            up = passes.loc[sfa] / passes.loc[base] - 1
            fwd.append(f"`{sfa}`'s forward takes {_pct(up.loc['forward', 'µs'])} time for "
                       f"{_pct(up.loc['forward', 'M instructions'])} instructions over `{base}`'s")
            more = backward_instructions(sfa) / backward_instructions(base) - 1
            bwd.append((more, _pct(up.loc["backward", "µs"])))
        if fwd:
            times = and_join([t for _, t in bwd])
            each = "each backward" if len(bwd) > 1 else "the backward"
            same = not any(i for i, _ in bwd)  # the same count, to the instruction
            back = (f"{each} executes exactly its base's instructions ({times} time)" if same
                    else f"{each} executes {and_join([_pct(i) for i, _ in bwd])} instructions ({times} time)")
            parts.append(f"at T = {T:,}, D = {D} (run `{folder.name}`) {and_join(fwd)}, and {back}")
    return "; ".join(parts)


TARGET_NAMES = {"sdpa_flash": "SDPA-flash"}  # a profiled target as the page names it (an lpfa preset: `name`)


def ncu_table(ncu: dict, min_us: float = NCU_MIN_US):
    """``benchmarks/ncu_attention.py``'s kernels (target → parsed kernels, as in ``ncu.json``) as one row per (target,
    kernel) of at least ``min_us``: its pass (:func:`lpfa.attention.ncu.kernel_pass`), µs, millions of instructions,
    SM, memory and issue-slot use and tensor pipe (% of peak), cycles per issued instruction, occupancy and what
    limits it, registers per thread, busiest pipe, top stall and :func:`lpfa.attention.ncu.limited_by`."""
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
                         "registers": m.get("registers"),
                         "busiest pipe": f"{pipe} {m['pipes'][pipe]:.0f}%" if pipe else None,
                         "top stall": m.get("top_stall"), "limited by": limited_by(m)})
    return pd.DataFrame(rows).set_index(["target", "kernel"]).round(2)


# the per-kernel table's columns on the page ("limited by" names the top stall of a latency-bound kernel)
NCU_SHOWN = ["pass", "µs", "M instructions", "tensor %", "issue %", "memory %", "occupancy %", "registers",
             "limited by"]


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
                         f" ({ratio:.2f}× {base}'s time, "
                         f"{own.loc[p, f'M instructions × {base}']:.2f}× its instructions)"))
        k = table.loc[target]["µs"].idxmax()
        r = table.loc[(target, k)]
        parts.append(f"`{target}`: {'; '.join(vs)}. Its longest kernel, `{k}` ({r['µs']:,.0f} µs), keeps the tensor "
                     f"pipe busy {_fmt(r['tensor %'], '.0f')}% of the time and the issue slots "
                     f"{_fmt(r['issue %'], '.0f')}%, at {_fmt(r['occupancy %'], '.0f')}% occupancy (limited by "
                     f"{r['occupancy limit'] or 'unknown'}), {_fmt(r['cycles/instruction'], '.1f')} cycles per "
                     f"instruction: {r['limited by']}")
    return " ".join(p + "." for p in parts)


def redo_text(ncu: dict, target: str = "fa2") -> str:
    """``target``'s second launches in Nsight Compute's run (``ncu``: target → kernels, as :func:`load_ncu` gives
    them; a kernel's second launch is ``name#2``: the tiles redone on the non-finite path, whose programs end at once
    on finite outputs), in words: their time and their share of the target's forward and backward, every kernel
    counted (the second launches fall below :data:`NCU_MIN_US` once they only read flags). "" where the run has
    none."""
    us = {k: m.get("duration_us") or 0.0 for k, m in ncu.get(target, {}).items()}
    redo = {k: t for k, t in us.items() if k.endswith("#2")}
    if not redo:
        return ""
    total, spent = sum(us.values()), sum(redo.values())
    what = "the second launch takes" if len(redo) == 1 else f"the {len(redo)} second launches take"
    return (f"in `{target}`'s forward and backward {what} {spent:,.0f} µs of {total:,.0f} µs "
            f"({spent / total:.0%}), though no tile is redone on finite inputs")


def ncu_notes(ncu: dict, table, folder) -> dict[str, str]:
    """Nsight Compute's findings for the page's text, from :func:`load_ncu`'s ``(ncu, folder)`` and its
    :func:`ncu_table`: ``ncu_run`` (run and commit), ``ncu_launches`` (kernels of one ``fa2`` forward+backward),
    ``ncu_text``, ``ncu_redo`` (:func:`redo_text`), ``redo_tiles`` (the tiles whose flags one program of a second
    launch reads, :data:`lpfa.attention.triton_common.REDO_TILES`), ``ncu_more`` (the lpfa passes that execute more
    instructions than SDPA-flash's, with the multiple); for the kernels of at least :data:`NCU_BIG_US`, ``ncu_bound`` (a
    clause: those bound by compute or memory), ``ncu_occupancy``, ``ncu_tensor`` and ``ncu_memory`` (largest % of
    peak); the thresholds ``ncu_bound_pct``, ``ncu_min_us``, ``ncu_big_us``; ``ncu_shape`` (the profiled call's B, H,
    T, D, and "GPT-2 shapes" where they are :data:`GPT2_SWEEP`), ``ncu_targets`` (what was profiled) and ``ncu_sfa``
    (:func:`ncu_sfa_text`)."""
    from lpfa.attention.triton_common import REDO_TILES  # here: importing it imports Triton

    prov = load("attention_ncu", "provenance.json", folder.name)
    big = table[table["µs"] >= NCU_BIG_US]
    by_reason: dict[str, list[str]] = {}
    for (t, k), r in big["limited by"].items():
        if not r.startswith("latency"):
            by_reason.setdefault(r, []).append(f"`{t}`'s `{k}`")
    bound = "; ".join(f"{and_join(ks)} {'is' if len(ks) == 1 else 'are'} bound by {r}" for r, ks in by_reason.items())
    passes = ncu_passes(table)
    col = "M instructions × sdpa_flash"
    more = [f"`{t}`'s {p} ({r:.2f}×)" for (t, p), r in passes[col].items()
            if t != "sdpa_flash" and pd.notna(r) and r > 1] if col in passes.columns else []
    lo, hi = big["occupancy %"].min(), big["occupancy %"].max()
    shape = {k: prov["config"][k] for k in "BHTD"}
    dims = ", ".join(f"{k} = {v:,}" for k, v in shape.items())
    return {"ncu_run": f"`{folder.name}`, commit `{prov['git_commit'][:7]}`",
            "ncu_shape": f"GPT-2 shapes ({dims})" if list(shape.values()) == GPT2_SWEEP else dims,
            "ncu_sfa": ncu_sfa_text(),
            "ncu_targets": and_join([TARGET_NAMES.get(t, f"`{t}`") for t in prov["config"]["targets"]]),
            "ncu_launches": f"{len(ncu['fa2'])}",
            "ncu_text": ncu_text(table), "ncu_redo": redo_text(ncu), "redo_tiles": f"{REDO_TILES}",
            "ncu_bound": bound or "none is bound by the tensor cores or by memory",
            "ncu_more": and_join(more) or "none of the lpfa passes",
            "ncu_bound_pct": f"{BOUND_PCT:g}%", "ncu_min_us": f"{NCU_MIN_US:g} µs", "ncu_big_us": f"{NCU_BIG_US:g} µs",
            "ncu_occupancy": f"{lo:.0f}%" if round(lo) == round(hi) else f"{lo:.0f}–{hi:.0f}%",
            "ncu_tensor": f"{big['tensor %'].max():.0f}%", "ncu_memory": f"{big['memory %'].max():.0f}%"}


@dataclass
class KernelsPage:
    """Everything page 12 reads from one benchmark run ``run`` (``results/attention_bench/<run>``) and the other
    committed GPU runs it cites: each field is what the function of the same name returns."""

    run: str | None
    bench: dict
    check: dict
    memory: dict
    overhead: pd.DataFrame
    host: pd.DataFrame
    shapes: dict
    ncu: dict
    ncu_run: object
    ncu_table: pd.DataFrame
    sfa: pd.DataFrame | None
    sfa_run: object
    tuning: object


def kernel_options_table(root=None) -> pd.DataFrame:
    """Every committed A/B of a kernel option against the kernel's defaults (``benchmarks/kernel_options.py``, in
    ``results/kernel_options``: both timed interleaved in one process by ``do_bench`` medians, with a bit check), one
    row per run, kernel (``forward``/``backward``), preset, B, T and option: ``default µs``, ``option µs``, ``ratio``
    (option ÷ default), ``same bits``, ``run`` and ``device``, runs oldest first. Empty without a committed run."""
    columns = ["run", "device", "kernel", "preset", "B", "T", "option", "default µs", "option µs", "ratio", "same bits"]
    try:
        folders = result_runs("kernel_options", root)
    except FileNotFoundError:
        folders = []
    rows = []
    for folder in folders:
        device = gpu_name(json.loads((folder / "provenance.json").read_text()).get("device", "?"))
        for kernel in ("forward", "backward"):
            path = folder / f"{kernel}_options.json"
            for r in json.loads(path.read_text()) if path.is_file() else []:
                rows.append([folder.name, device, kernel, r["preset"], r["B"], r["T"], r["option"], r["default_us"],
                             r["option_us"], r["ratio"], r["same_bits"]])
    return pd.DataFrame(rows, columns=columns)


def latest_option_rows(table, kernel: str, preset: str, option: str) -> pd.DataFrame:
    """The rows of :func:`kernel_options_table` for ``option`` of ``preset``'s ``kernel`` from the latest run that
    timed it (empty where none did)."""
    rows = table[(table["kernel"] == kernel) & (table["preset"] == preset) & (table["option"] == option)]
    return rows[rows["run"] == rows["run"].iloc[-1]] if len(rows) else rows


def option_ratios_text(rows) -> str:
    """:func:`latest_option_rows` in words, e.g. "×1.56 (B × T = 16 × 1,024) and ×1.67 (1 × 16,384) of the default's
    time on one H100, with the same bits (`run`)"."""
    at = and_join([f"×{r.ratio:.2f} ({'B × T = ' if i == 0 else ''}{r.B} × {r.T:,})"
                   for i, r in enumerate(rows.itertuples())])
    bits = ("with the same bits" if rows["same bits"].all() else
            "with other bits (a tile of another size sums in FP32 in another order)")
    return f"{at} of the default's time on one {rows['device'].iloc[0]}, {bits} (`{rows['run'].iloc[0]}`)"


# the kernel designs page 12 states as measured and not taken: glue name, kernel, preset, the option that is the
# design (timed by `benchmarks/kernel_options.py --kernel KERNEL --presets PRESET --options "OPTION"`), what the design
# is, and what the launch table keeps instead
KERNEL_CHOICES = (
    ("choice_ordered_dq", "backward", "fa2", "dq_mode='ordered'",
     "Deterministic dQ without recomputing P and dP, the dK/dV kernel adding each key tile's share to FP32 running "
     "sums in key order (`dq_mode=\"ordered\"`: FlashAttention-2's accumulation, in a fixed order)",
     "the launch table keeps the separate dQ kernel"),
    ("choice_one_tile", "forward", "paper", "block_n=512+num_warps=8+num_stages=1",
     "A `paper` block's 512 keys in one compute tile, so that its Q Kᵀ is computed once instead of twice (8 warps, "
     "one pipeline stage)",
     "the forward keeps its 64-key tiles and two passes"),
)


def kernel_choice_notes(table) -> dict[str, str]:
    """Page 12's sentences on the kernel designs measured and not taken (:data:`KERNEL_CHOICES`), from
    :func:`kernel_options_table`: the design's time against the default's per shape, whether it was slower at every
    shape, or that no GPU has timed it."""
    notes = {}
    for name, kernel, preset, option, design, kept in KERNEL_CHOICES:
        rows = latest_option_rows(table, kernel, preset, option)
        if rows.empty:
            notes[name] = f"{design} is not yet timed on a GPU."
        elif (rows["ratio"] > 1).all():
            notes[name] = f"{design} takes {option_ratios_text(rows)}; so {kept}."
        else:
            notes[name] = f"{design} takes {option_ratios_text(rows)}: faster at some shapes, though {kept}."
    return notes


NCU_NAME_CHARS = 28  # a kernel's name on the page, cut with "…" past this


def ncu_display(table):
    """:func:`ncu_table` as the page shows it (:func:`lpfa.plotting.format_table`), with :data:`NCU_SHOWN`: every
    kernel of at least :data:`NCU_MIN_US`, or where they would be more than a page's table holds
    (:data:`lpfa.plotting.MAX_ROWS`), those of at least :data:`NCU_BIG_US`, the attention kernels proper."""
    table = table.rename(index=lambda k: k if len(k) <= NCU_NAME_CHARS else k[:NCU_NAME_CHARS - 1] + "…",
                         level="kernel")  # SDPA's longest kernel name alone would overflow the page column
    if len(table) <= MAX_ROWS:
        return format_table(table[NCU_SHOWN]).set_caption(f"Every kernel of at least {NCU_MIN_US:g} µs")
    return format_table(table.loc[table["µs"] >= NCU_BIG_US, NCU_SHOWN]).set_caption(
        f"The kernels of at least {NCU_BIG_US:g} µs (of {len(table)} of at least {NCU_MIN_US:g} µs)")


def full_table_notes() -> dict[str, str]:
    """Page 12's link to its full table (:mod:`lpfa.pages.tables`): ``shapes_full``."""
    from lpfa.pages.tables import link

    return {"shapes_full": f"Every shape's TFLOP/s, with SFA's cost over its base, is in {link('attention_shapes')}."}


def load_page(run: str | None) -> KernelsPage:
    """Page 12's committed results for benchmark run ``run`` (None: the latest with a complete speed table): see
    :class:`KernelsPage`. A named run whose speed table was cut short is a one-line ValueError."""
    if run and not is_complete(bench_file("bench.json", run)):
        complete = bench_run_of("bench.json").name
        raise ValueError(f"run={run!r}: its speed table was cut by its time limit (bench.json complete=false); "
                         f"expected a run with a complete one, e.g. {complete!r}, or None for the latest")
    ncu, ncu_run = load_ncu()
    sfa, sfa_run = sfa_overhead()
    return KernelsPage(run, *(bench_file(f"{part}.json", run) for part in ("bench", "check", "memory")),
                       overhead=overhead_table(bench_file("overhead.json", run)),
                       host=host_layers_table(host_runs()), shapes=bench_file("shapes.json", run), ncu=ncu,
                       ncu_run=ncu_run, ncu_table=ncu_table(ncu), sfa=sfa, sfa_run=sfa_run, tuning=tuning_sweeps())


def page_texts(p: KernelsPage) -> dict[str, str]:
    """Every sentence and number page 12 glues into its prose, by name, from :func:`load_page`."""
    return {**provenance_notes(p.run), **speed_notes(p.bench),
            "speed_partial": partial_speed_text(partial_runs(p.run)), **overhead_notes(p.overhead, p.run),
            "host_layers": host_layers_text(p.host), **shapes_notes(p.shapes, run=p.run),
            **ncu_notes(p.ncu, p.ncu_table, p.ncu_run), **sfa_overhead_notes(p.sfa, p.sfa_run),
            **tuning_notes(p.tuning, p.run), **memory_notes(p.memory, p.run), **full_table_notes(),
            **kernel_choice_notes(kernel_options_table())}
