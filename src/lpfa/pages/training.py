"""Page 13, training: ``lpfa.train`` end to end on the CPU, and GPT-2 S's training speed with each attention backend.

The page shows a run of the CPU smoke preset on the embedded corpus: by default the committed one
(``results/cpu_smoke``, made by ``scripts/cpu_smoke.py``, :func:`smoke_run`), with ``train=True`` one trained here
(:func:`train_smoke`); its loss and the per-head W_Q spectral norms it logs (the quantity whose growth in one early
layer precedes the loss explosion, Figs. 3, 11), and reads ``benchmarks/train_throughput.py``'s committed run
(``results/train_throughput``): tokens/s of GPT-2 S with each backend against SDPA in the same mode
(:func:`throughput_table`, goals :data:`TRAIN_GOALS`), and the FP32 twin ``fp32_split`` against ``sdpa_fp32`` in
speed and in error against float64 (:func:`twin_text`).
"""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import pandas as pd
from matplotlib.ticker import MaxNLocator

from lpfa.attention import PRESETS as POLICIES
from lpfa.book import train_quietly
from lpfa.compare import plot_losses
from lpfa.explosion import attention_label
from lpfa.pages import gpu_name
from lpfa.params import boolean, integer, optional, text
from lpfa.plotting import format_table, use_style
from lpfa.results import experiment_rows, experiments, load, run_dir
from lpfa.results import runs as result_runs
from lpfa.run import Run, layer_precision, load_metrics
from lpfa.train import PRESETS, make_config

# the notebook's papermill parameters, checked right after its parameters cell (lpfa.params.check_params)
PARAMS = {
    "train": boolean(), "preset": text(*PRESETS), "max_steps": integer(1), "attn_policy": text(*POLICIES),
    "diag_interval": integer(0), "out_dir": optional(text()),
}

# the committed CPU run (scripts/cpu_smoke.py): results/<SMOKE_EXPERIMENT>/<run>/<SMOKE_LABEL>/, read by pages 05 and 13
SMOKE_EXPERIMENT, SMOKE_LABEL = "cpu_smoke", "smoke"

# the training-throughput goals: compiled GPT-2 S tokens/s as a fraction of compiled SDPA's
TRAIN_GOALS = {"lpfa_fa2_compiled": 0.95, "lpfa_paper_compiled": 0.9}


def train_smoke(preset: str = "cpu-smoke", max_steps: int = 300, attn_policy: str = "fa2", diag_interval: int = 50,
                out_dir: str | None = None) -> tuple[Path, dict]:
    """Train ``preset`` for ``max_steps`` steps with attention ``attn_policy``, diagnostics every ``diag_interval``
    steps and three evaluations, into ``out_dir`` (None: a fresh temporary folder), its log kept off the page
    (:func:`lpfa.book.train_quietly`). Returns ``(run folder, summary)``; a bad value raises ValueError naming it."""
    out = Path(out_dir) if out_dir else Path(tempfile.mkdtemp(prefix="lpfa-smoke-")) / "run"
    cfg = make_config(preset, None, {"max_steps": max_steps, "attn_policy": attn_policy, "diag_interval": diag_interval,
                                     "out_dir": str(out), "progress": False, "eval_interval": max(max_steps // 3, 1)})
    return out, train_quietly(cfg)


def committed_smoke(experiment: str = SMOKE_EXPERIMENT, root=None) -> Path:
    """The training-run folder of the latest committed run of ``results/<experiment>`` (``scripts/cpu_smoke.py``)."""
    return run_dir(experiment, None, root) / SMOKE_LABEL


def smoke_run(train: bool = False, preset: str = "cpu-smoke", max_steps: int = 300, attn_policy: str = "fa2",
              diag_interval: int = 50, out_dir: str | None = None, experiment: str = SMOKE_EXPERIMENT,
              root=None) -> tuple[Path, dict, str]:
    """Page 13's run: with ``train``, :func:`train_smoke` of the other arguments, here on this machine's CPU; else the
    committed run (:func:`committed_smoke`), so that the default book trains nothing. Returns ``(run folder,
    summary, where)``: ``where`` says on which machine it ran, for the page's text."""
    if train:
        out, summary = train_smoke(preset, max_steps, attn_policy, diag_interval, out_dir)
        return out, summary, "on this machine's CPU"
    out = committed_smoke(experiment, root)
    prov = json.loads((out.parent / "provenance.json").read_text())
    n = prov.get("torch_threads")
    return out, json.loads((out / "summary.json").read_text()), (
        f"on a CPU ({prov.get('platform', prov['device'])}"
        + (f", {n} torch thread{'s' * (n > 1)}" if n else "") + f") in the committed run `{out.parent.name}` of "
        f"`results/{experiment}` (commit `{prov['git_commit']}`; `train=True` trains it here)")


def smoke_notes(out: str | Path, summary: dict, preset: str) -> dict[str, str]:
    """What ran and how the loss went, for the page's text: ``smoke_steps``, ``smoke_setup`` (``preset``, model,
    tokens per step, attention policy, tokenizer, from the run's ``config.json``), ``smoke_wall_s``,
    ``smoke_loss_first`` and ``smoke_loss_last`` (mean training loss of the first and last 10 steps) and
    ``smoke_val_loss``, from the run folder ``out`` and :func:`train_smoke`'s ``summary``."""
    conf = Run(out).config
    train_df = load_metrics(out)[0]
    t = conf["train"]
    tokenizer = conf.get("data_meta", {}).get("tokenizer") or t["tokenizer"]  # the data's, else the configured one
    return {"smoke_steps": f"{summary['steps']}",
            "smoke_setup": (f"`{preset}` ({t['model']} model, {t['batch_size']}×{t['block_size']} tokens per step, "
                            f"attention `{t['attn_policy']}`, tokenizer `{tokenizer}`)"),
            "smoke_wall_s": f"{summary['wall_s']:.0f}",
            "smoke_loss_first": f"{train_df['loss'].iloc[:10].mean():.2f}",
            "smoke_loss_last": f"{train_df['loss'].iloc[-10:].mean():.2f}",
            "smoke_val_loss": f"{summary['final_val_loss']:.2f}"}


def plot_smoke_loss(out: str | Path, label: str):
    """The run's training loss (rolling mean over 10 steps) and evaluation loss, as ``label``
    (:func:`lpfa.compare.plot_losses`)."""
    return plot_losses({label: out}, smooth=10)


def plot_head_metric(run_dir: str | Path, metric: str = "wq_spectral_norm", layers=None):
    """One panel per layer: ``metric`` (wq_spectral_norm, tie_fraction or max_logit) of every head over training."""
    use_style()
    _, _, diag = load_metrics(run_dir)
    if diag.empty or metric not in diag:
        raise ValueError(f"{run_dir} has no {metric!r} diagnostics (was diag_interval 0?)")
    values = np.array(diag[metric].tolist())  # (records, layers, heads)
    layers = list(range(values.shape[1])) if layers is None else list(layers)
    ncols = min(3, len(layers))  # the figure keeps the page's width: more layers, more rows
    nrows = -(-len(layers) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(7.0, 2.3 * nrows + 0.4), sharey=True, squeeze=False)
    for ax, layer in zip(axes.flat, layers):
        ax.plot(diag["step"], values[:, layer, :], lw=1)
        ax.set_title(f"layer {layer}")
        ax.set_xlabel("step")
        ax.xaxis.set_major_locator(MaxNLocator(3, integer=True))
    for ax in axes.flat[len(layers):]:
        ax.remove()
    fig.supylabel(metric.replace("_", " "))
    return fig


def throughput_table(tput: dict):
    """``benchmarks/train_throughput.py``'s ``throughput.json`` as one row per backend, with ``ratio to SDPA``: its
    tokens/s over SDPA's in the same mode (a row ending in ``_compiled`` against ``sdpa_compiled``, the rest against
    eager ``sdpa``; NaN where the run lacks that row); where the run has SDPA pinned to FlashAttention-2
    (``sdpa_flash`` rows: plain SDPA runs cuDNN's kernel on Hopper), also ``ratio to SDPA-flash``, the same way."""
    df = pd.DataFrame(tput).T
    df = df[df["tokens_per_s"].notna()] if "tokens_per_s" in df else df  # a row that failed holds only its error

    def ratios(sdpa):  # each row over the SDPA row of its own mode; none (NaN) where the run lacks that row
        out = {}
        for n in df.index:
            base = f"{sdpa}_compiled" if n.endswith("_compiled") else sdpa
            out[n] = df.loc[n, "tokens_per_s"] / df.loc[base, "tokens_per_s"] if base in df.index else float("nan")
        return pd.Series(out, dtype=float)

    df["ratio to SDPA"] = ratios("sdpa")
    if "sdpa_flash" in df.index or "sdpa_flash_compiled" in df.index:
        df["ratio to SDPA-flash"] = ratios("sdpa_flash")
    return df


def throughput_text(table, goals: dict[str, float] = TRAIN_GOALS) -> str:
    """Page 13's sentence from :func:`throughput_table`: each compiled lpfa row's ratio to SDPA compiled against its
    goal, and the eager rows' ratios; "not measured compiled" for a run made without ``--compile``."""
    ratio = table["ratio to SDPA"]
    flash = table["ratio to SDPA-flash"] if "ratio to SDPA-flash" in table else None
    parts = []
    for row, goal in goals.items():
        name = row.removeprefix("lpfa_").removesuffix("_compiled")
        if row in ratio:
            pinned = (f"; {flash[row]:.2f}× SDPA pinned to FlashAttention-2"
                      if flash is not None and pd.notna(flash.get(row)) else "")
            parts.append(f"`{name}` at {ratio[row]:.3f}× (goal ≥ {goal:.2f}×: "  # 3 digits: 0.948 is not 0.95
                         f"{'met' if ratio[row] >= goal else 'not met'}{pinned})")
        else:
            parts.append(f"`{name}` not measured compiled")
    eager = [f"`{n.removeprefix('lpfa_')}` {ratio[n]:.2f}×" for n in ratio.index
             if n.startswith("lpfa_") and not n.endswith("_compiled")]
    return ("compiled, GPT-2 S trains with " + " and ".join(parts) + " SDPA's tokens/s" +
            (f"; eager, against eager SDPA: {', '.join(eager)}" if eager else ""))


def twin_text(table, error: dict) -> str:
    """Page 13's sentence on the FP32 twin: ``fp32_split``'s GPT-2 S tokens/s over ``sdpa_fp32``'s, compiled where
    :func:`throughput_table` has both compiled rows, and eager; and the largest error of its O and gradients against
    float64 next to the IEEE ``fp32`` policy's, over every input dtype of ``benchmarks/attention.py``'s
    ``error.json``. Raises ValueError when the run has neither pair of rows."""
    tps = table["tokens_per_s"]
    speed = [f"{mode} {tps[f'lpfa_fp32_split{suffix}'] / tps[f'sdpa_fp32{suffix}']:.2f}×"
             for mode, suffix in (("compiled", "_compiled"), ("eager", ""))
             if f"lpfa_fp32_split{suffix}" in tps and f"sdpa_fp32{suffix}" in tps]
    if not speed:
        raise ValueError("twin_text: the throughput run has no fp32_split and sdpa_fp32 rows; "
                         "expected a benchmarks/train_throughput.py run that times both")
    worst = {p: max(t["max_rel"] for inp in error["inputs"].values() for t in inp[p].values())
             for p in ("fp32_split", "fp32")}
    return (f"`fp32_split` trains GPT-2 S at {' and '.join(speed)} the tokens/s of `sdpa_fp32` (SDPA on FP32 inputs), "
            f"and its O and gradients stay within {worst['fp32_split']:.1e} of float64 relative to each tensor's "
            f"largest value, where the IEEE `fp32` policy's stay within {worst['fp32']:.1e}")


def fp32_attention_runs(root=None) -> dict[str, list[str]]:
    """``{attention: experiments}`` over every committed run (:func:`lpfa.results.experiment_rows`) whose every
    layer's attention is FP32 (:func:`lpfa.run.layer_precision`): which FP32 attention each experiment's runs used,
    read from their ``config.json`` (:func:`lpfa.explosion.attention_label`), experiments sorted."""
    found: dict[str, set[str]] = {}
    for experiment in experiments(root):
        for d in experiment_rows(experiment, root=root).values():
            run = Run(d)
            if set(layer_precision(run)) == {"fp32"}:
                found.setdefault(attention_label(run.train), set()).add(experiment)
    return {label: sorted(found[label]) for label in sorted(found)}


def fp32_attention_text(found: dict[str, list[str]]) -> str:
    """:func:`fp32_attention_runs` as a sentence: "`fp32_split` in the committed runs of `stabilisers`; `sdpa_fp32` in
    the committed runs of `paper_recipe`, `seeds`"."""
    if not found:
        raise ValueError("fp32_attention_text: no committed run has FP32 attention; expected at least one")
    return "; ".join(f"`{label}` in the committed runs of {', '.join(f'`{e}`' for e in exps)}"
                     for label, exps in found.items())


THROUGHPUT = "train_throughput"  # results/<THROUGHPUT>/<run>: benchmarks/train_throughput.py's runs


def timed_rows(run: Path) -> list[str] | None:
    """The rows a ``benchmarks/train_throughput.py`` run was asked to time (its command's ``--rows``, as its
    ``provenance.json`` records the command), None where it timed every backend."""
    found = re.search(r"--rows[ =](\S+)", json.loads((run / "provenance.json").read_text()).get("command", ""))
    return found.group(1).split(",") if found else None


def throughput_runs(experiment: str = THROUGHPUT, root=None) -> tuple[Path, list[Path]]:
    """The training-throughput run the pages read (``results/<experiment>``), the latest committed one that timed
    every backend (no ``--rows``: the page's table, the FP32 twin and the eager speeds need them all), and the later
    runs that timed only some rows (:func:`timed_rows`), oldest first. Raises FileNotFoundError without a run of every
    backend."""
    done = result_runs(experiment, root)
    full = [r for r in done if timed_rows(r) is None]
    if not full:
        raise FileNotFoundError(f"results/{experiment} has no run of every backend (runs: {[r.name for r in done]})")
    return full[-1], done[done.index(full[-1]) + 1:]


def committed_throughput():
    """:func:`throughput_table` of the latest committed ``benchmarks/train_throughput.py`` run of every backend
    (:func:`throughput_runs`)."""
    return throughput_table(load(THROUGHPUT, "throughput.json", throughput_runs()[0].name))


def later_throughput_text(later: list[Path], experiment: str = THROUGHPUT, root=None) -> str:
    """One sentence per later run of only some rows (:func:`throughput_runs`): its GPU, commit and
    :func:`throughput_text` of its rows; "" without one."""
    out = []
    for run in later:
        prov = load(experiment, "provenance.json", run.name, root)
        table = throughput_table(load(experiment, "throughput.json", run.name, root))
        out.append(f"A later run, `{run.name}` (one {gpu_name(prov['device'])}, commit `{prov['git_commit'][:7]}`), "
                   f"timed only {', '.join(f'`{r}`' for r in table.index)}; in it, {throughput_text(table)}.")
    return " ".join(out)


def throughput_notes(table) -> dict[str, str]:
    """The committed training-throughput run of every backend (:func:`throughput_runs`) in words: ``tput_text``
    (:func:`throughput_text` of ``table``), ``tput_run``, ``tput_env`` (its device, torch and commit) and ``tput_gpu``
    ("one H100"), ``tput_later`` (:func:`later_throughput_text`: later runs of some rows), ``twin_text``
    (:func:`twin_text` against the attention benchmark's latest ``error.json``) and ``fp32_runs_text``
    (:func:`fp32_attention_text`)."""
    run, later = throughput_runs()
    prov = load(THROUGHPUT, "provenance.json", run.name)
    return {"tput_text": throughput_text(table), "tput_later": later_throughput_text(later),
            "tput_run": f"`{run.name}`",
            "tput_env": f"{prov['device']}, torch {prov['torch']}, commit `{prov['git_commit']}`",
            "tput_gpu": f"one {gpu_name(prov['device'])}",
            "twin_text": twin_text(table, load("attention_benchmark", "error.json")),
            "fp32_runs_text": fp32_attention_text(fp32_attention_runs())}


def throughput_display(table):
    """:func:`throughput_table` as the page shows it: tokens/s (on the committed run's GPU), MFU, the ratio to SDPA (and
    to SDPA-flash where the run has it) and peak memory per backend."""
    gpu = gpu_name(load(THROUGHPUT, "provenance.json", throughput_runs()[0].name)["device"])
    flash = ["ratio to SDPA-flash"] if "ratio to SDPA-flash" in table else []
    cols = ["tokens_per_s", "mfu", "ratio to SDPA", *flash, "peak_mem_gib"]
    return format_table(table[cols].astype(float),
                        units={"tokens_per_s": f"GPT-2 S, {gpu}", "peak_mem_gib": "GiB"})
