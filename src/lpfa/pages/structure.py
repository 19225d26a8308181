"""Page 05, structure (Figs. 8, 9): the two ingredients the mechanism needs, rows with tied maxima and rank-1 matrices
(PK)[T]ᵀX[T] that point the same way, measured (:func:`lpfa.structure.summarize`) in a CPU-trained model (by default
the committed run of ``scripts/cpu_smoke.py``, :func:`model_summary`; ``train=True`` trains it here), in the GPU-
trained twins' logged ties, in the replay of the BF16 recipe run and in the GPU-trained checkpoints."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
from matplotlib.ticker import MaxNLocator

from lpfa import data as lpfa_data
from lpfa.attention import get_policy
from lpfa.attention.policy import is_fp32_level
from lpfa.book import train_quietly
from lpfa.checkpoints import load_checkpoint, load_hf_gpt2
from lpfa.compare import head_metric_frame
from lpfa.pages import RERUN_PAGE
from lpfa.pages.training import SMOKE_EXPERIMENT, committed_smoke
from lpfa.params import boolean, integer, list_of, optional, real, text
from lpfa.plotting import COLORS, fixed, use_style
from lpfa.replay import load_replay, rank1_stats
from lpfa.results import run_dir, what
from lpfa.structure import describe, load_summary, summarize
from lpfa.train import make_config

# the notebook's papermill parameters, checked right after its parameters cell (lpfa.params.check_params)
PARAMS = {
    "hf_gpt2": optional(text()), "checkpoint": optional(text()), "train": boolean(), "train_steps": integer(1),
    "n_seqs": integer(1), "seq_len": integer(1), "eps": real(0), "seed": integer(0),
    "gpu_experiment": text(), "replay_experiment": text(), "replay": text(nonempty=True),
    "structure_experiments": list_of(text(nonempty=True), nonempty=False),
}


def load_model(hf_gpt2: str | None = None, checkpoint: str | None = None, train_steps: int = 150):
    """Page 05's model, in eval mode with the exact ``math`` attention: the Hugging Face GPT-2 folder ``hf_gpt2``, else
    the lpfa checkpoint folder ``checkpoint``, else the ``cpu-smoke`` recipe trained here for ``train_steps`` steps in a
    temporary folder. Returns ``(model, tokenizer, source)``: the tokenizer the model reads and where it came from, in
    words."""
    if hf_gpt2:
        model, tokenizer = load_hf_gpt2(hf_gpt2, attn_backend="math"), "gpt2"
        source = f"Hugging Face GPT-2 from `{hf_gpt2}`"
    elif checkpoint:
        ck = load_checkpoint(checkpoint, model_overrides={"attn_backend": "math"})
        model, tokenizer = ck.model, ck.train_config.get("tokenizer", "auto")
        source = f"lpfa checkpoint `{checkpoint}` (step {ck.step})"
    else:
        out = Path(tempfile.mkdtemp(prefix="lpfa-structure-")) / "run"
        train_quietly(make_config("cpu-smoke", None, {"max_steps": train_steps, "out_dir": str(out), "progress": False,
                                                      "eval_interval": 0}))
        ck = load_checkpoint(out / "ckpt", model_overrides={"attn_backend": "math"})
        model, tokenizer, source = ck.model, "auto", f"the cpu-smoke recipe trained here for {train_steps} steps"
    return model.eval(), tokenizer, source


def committed_summary(n_seqs: int, seq_len: int, eps: float, seed: int, experiment: str = SMOKE_EXPERIMENT,
                      root=None) -> tuple[dict, dict]:
    """The committed CPU run's Figs. 8, 9 summary (``structure.json`` of :func:`lpfa.pages.training.committed_smoke`)
    and :func:`model_texts`' words for it; a ValueError when ``n_seqs``, ``seq_len``, ``eps`` or ``seed`` differ from
    what it was measured with (``train=True`` measures them here)."""
    run = committed_smoke(experiment, root)
    s = json.loads((run / "structure.json").read_text())
    asked, had = (n_seqs, seq_len, eps, seed), (*s["batch"], s["eps"], s["seed"])
    if tuple(asked) != tuple(had):
        raise ValueError(f"(n_seqs, seq_len, eps, seed)={asked}: the committed run `{run.parent.name}` was measured "
                         f"with {had}; set train=True to measure other values here")
    meta = json.loads((run / "config.json").read_text()).get("data_meta", {})
    m = s["model"]
    texts = {"model_source": (f"the cpu-smoke recipe trained on a CPU for {s['step']} steps (the committed run "
                              f"`{run.parent.name}` of `results/{experiment}`; `train=True` trains it here)"),
             "model_shape": f"{m['n_layer']} layers × {m['n_head']} heads, d = {m['n_embd']}",
             "input_shape": f"{n_seqs} validation sequences of {seq_len} tokens",
             "input_tokenizer": f"`{meta.get('tokenizer', 'auto')}`"}
    return s, texts


def model_summary(hf_gpt2: str | None = None, checkpoint: str | None = None, train: bool = False,
                  train_steps: int = 150, n_seqs: int = 4, seq_len: int = 128, eps: float = 1e-3, seed: int = 0,
                  experiment: str = SMOKE_EXPERIMENT) -> tuple[dict, dict]:
    """Page 05's model measured: ``(summary, texts)``, :func:`lpfa.structure.summarize` on ``n_seqs`` sequences of
    ``seq_len`` tokens of :func:`load_model`'s model (``hf_gpt2``, else ``checkpoint``, else with ``train`` the
    cpu-smoke recipe trained here) with :func:`model_texts`' words; with none of the three, the committed CPU run's
    summary (:func:`committed_summary`), so that the default book trains nothing."""
    if not (hf_gpt2 or checkpoint or train):
        return committed_summary(n_seqs, seq_len, eps, seed, experiment)
    model, tokenizer, source = load_model(hf_gpt2, checkpoint, train_steps)
    idx, meta = model_batch(model, tokenizer, n_seqs, seq_len, seed)
    return summarize(model, idx, eps, seed), model_texts(model, source, meta, n_seqs, seq_len)


def model_batch(model, tokenizer: str, n_seqs: int, seq_len: int, seed: int):
    """``(idx, meta)``: ``n_seqs`` sequences of ``seq_len`` token ids (seeded by ``seed``) from the validation split of
    the embedded corpus in ``tokenizer``, and the token file's metadata; a ValueError when the tokenizer's ids do not
    fit the model's vocabulary."""
    tokens, meta = lpfa_data.load_tokens(lpfa_data.embedded_token_dir(tokenizer), "val")
    if meta["vocab_size"] > model.config.vocab_size:
        raise ValueError(f"the tokenizer ({meta['tokenizer']}, {meta['vocab_size']} ids) does not fit the model's "
                         f"vocabulary ({model.config.vocab_size})")
    idx, _ = lpfa_data.get_batch(tokens, lpfa_data.batch_starts(seed, 0, 0, n_seqs, len(tokens), seq_len), seq_len)
    return idx, meta


def model_texts(model, source: str, meta: dict, n_seqs: int, seq_len: int) -> dict:
    """The words page 05 glues about its model and input: ``model_source``, ``model_shape`` (layers × heads, width),
    ``input_shape`` and ``input_tokenizer``."""
    c = model.config
    return {"model_source": source, "model_shape": f"{c.n_layer} layers × {c.n_head} heads, d = {c.n_embd}",
            "input_shape": f"{n_seqs} sequences of {seq_len} tokens", "input_tokenizer": f"`{meta['tokenizer']}`"}


def plot_ties(summary, title: str = ""):
    """Fig. 8: the tie fraction of every layer (rows) and head (columns) of a :func:`lpfa.structure.summarize`
    summary, BF16 scores next to FP32 scores, on one colour scale."""
    use_style()
    s = load_summary(summary)
    b, f = np.asarray(s["ties"]["bf16"]), np.asarray(s["ties"]["fp32"])
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    for ax, t, name in zip(axes, (b, f), ("BF16 scores", "FP32 scores")):
        im = ax.imshow(t, cmap="viridis", vmin=0, vmax=max(b.max(), f.max(), 1e-3), aspect="auto")
        ax.grid(False)
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.set_title(f"{title}{': ' if title else ''}{name}", fontsize=9)
    fig.colorbar(im, ax=list(axes), label="rows with tied maxima")
    return fig


def plot_similarity(summary, title: str = ""):
    """Fig. 9: the rank-1 similarity matrix of a summary's most tied head and its distribution against random
    vectors."""
    use_style()
    s = load_summary(summary)
    sim, (layer, head) = s["similarity"], s["head"]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    im = axes[0].imshow(np.asarray(sim["matrix"]), cmap="RdBu_r", vmin=-1, vmax=1)
    axes[0].grid(False)
    fig.colorbar(im, ax=axes[0], shrink=0.9, label="cosine similarity")
    axes[0].set_title(f"{title}{': ' if title else ''}layer {layer}, head {head}", fontsize=9)
    axes[0].set_xlabel("token T'")
    axes[0].set_ylabel("token T")
    edges = np.asarray(sim["bins"])
    for key, color in (("model", COLORS["bf16"]), ("random", COLORS["neutral"])):
        counts = np.asarray(sim[key]["hist"], dtype=float)
        axes[1].stairs(counts / counts.sum() / np.diff(edges), edges, color=color, fill=True, alpha=0.6,
                       label="model" if key == "model" else "random vectors")
    axes[1].set_xlabel("cosine similarity of rank-1 matrices")
    axes[1].legend()
    return fig


def tie_grids(runs: dict, early: int = 1000):
    """Page 05's logged ties: per run (label → folder) its ``tie_fraction`` as a layer × head grid at two steps both
    runs logged, the first at or after ``early`` (or the last) and the last; returns ({(label, step): grid}, [the two
    steps])."""
    frames = {label: head_metric_frame(d, "tie_fraction") for label, d in runs.items()}
    common = sorted(set.intersection(*(set(f.step) for f in frames.values())))
    at = [next(s for s in common if s >= min(early, common[-1])), common[-1]]
    grids = {(label, s): f[f.step == s].pivot_table(index="layer", columns="head", values="value")
             for label, f in frames.items() for s in at}
    return grids, at


def plot_tie_grids(grids: dict):
    """The grids of :func:`tie_grids` side by side on one colour scale, with its colourbar."""
    use_style()
    top = max(float(g.values.max()) for g in grids.values())
    ncols = min(2, len(grids))  # at most two grids abreast, so that the figure keeps the page's width
    nrows = -(-len(grids) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(7.0, 2.9 * nrows), squeeze=False)
    for ax, ((label, s), g) in zip(axes.flat, grids.items()):
        im = ax.imshow(g.values, cmap="viridis", vmin=0, vmax=max(top, 1e-3), aspect="auto")
        ax.set_title(f"{label}, step {s:,}")
        ax.set_xlabel("head")
        ax.set_ylabel("layer")
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # heads and layers: integer ticks
        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    for ax in axes.flat[len(grids):]:
        ax.remove()
    fig.colorbar(im, ax=axes.ravel().tolist(), label="rows with tied maxima")
    return fig


def tie_grids_text(grids: dict, at: list[int]) -> str:
    """Per run of :func:`tie_grids`: its mean and largest tie fraction at the last step (with the most tied head) and at
    the early one."""
    lines = []
    for label in dict.fromkeys(label for label, _ in grids):
        g = grids[(label, at[-1])]
        L, H = np.unravel_index(np.nanargmax(g.values), g.shape)
        e = grids[(label, at[0])]
        lines.append(f"`{label}` at step {at[-1]:,}: {g.values.mean():.1%} of rows tied on average over layers and "
                     f"heads, {g.values.max():.1%} in its most tied head (layer {g.index[L]}, head {g.columns[H]}); at "
                     f"step {at[0]:,}: {e.values.mean():.1%} on average, {e.values.max():.1%} at most")
    return "; ".join(lines)


def twin_ties(experiment: str) -> tuple[dict, str]:
    """The logged ties of the ``bf16`` and ``fp32`` twins in the latest run of ``results/<experiment>``: the grids of
    :func:`tie_grids` and page 05's sentence on them, naming the run."""
    folder = run_dir(experiment, None)
    runs = {label: folder / label for label in ("bf16", "fp32") if (folder / label / "config.json").exists()}
    if not runs:
        raise FileNotFoundError(f"{folder} holds no bf16 or fp32 run (a config.json in either): expected an "
                                "experiment of twins")
    grids, at = tie_grids(runs)
    return grids, f"Run `{folder.name}` of `results/{experiment}`. " + tie_grids_text(grids, at) + "."


def rank1_text(result: dict, arrays: dict, folder_name: str) -> tuple[str, list[float]]:
    """Page 05's sentence on a replay (:func:`lpfa.replay.load_replay`; ``folder_name`` names it): per replayed head,
    its rank-1 similarity medians within a step (their range) and across steps, against random vectors
    (:func:`lpfa.replay.rank1_stats`); and every head's within-step medians, for :func:`compare_text`."""
    parts, within_all = [], []
    for h in result["heads"]:
        st = rank1_stats(arrays, h)
        within = [v for k, v in st["medians"].items() if k.startswith("within")]
        within_all += within
        lo, hi = f"{min(within):.2f}", f"{max(within):.2f}"
        parts.append(f"head {h}: median {lo if lo == hi else f'{lo} to {hi}'} within a step"
                     + "".join(f", {v:.2f} {k}" for k, v in st["medians"].items() if k.startswith("across"))
                     + f", against {fixed(st['medians']['random vectors'], 2)} for random vectors")
    return (f"Rank-1 similarity in the GPU-trained BF16 run (layer {result['layer']}, the replay in `{folder_name}`): "
            + "; ".join(parts) + "."), within_all


def replay_rank1(experiment: str, replay: str) -> tuple[str, list[float]]:
    """:func:`rank1_text` of the replay folder ``replay`` in the latest run of ``results/<experiment>``; ``("", [])``
    for an empty ``experiment`` (the section skipped)."""
    if not experiment:
        return "", []
    folder = run_dir(experiment, None) / replay
    result, arrays = load_replay(folder)
    return rank1_text(result, arrays, f"{folder.parent.name}/{replay}")


def gpu_structures(experiments: list[str]) -> list[dict]:
    """The structure summaries (:func:`lpfa.structure.summarize_run`, ``<label>/structure.json``) in the latest run of
    each of ``experiments`` that has one: per such run its ``experiment``, ``run`` name, what it is (``what``, from its
    provenance) and its ``summaries``, ``(experiment/label, summary)`` pairs."""
    out = []
    for exp in experiments:
        try:
            root = run_dir(exp, None)
        except FileNotFoundError:  # no run of that experiment committed
            continue
        files = sorted(root.glob("*/structure.json"))
        if files:
            out.append({"experiment": exp, "run": root.name,
                        "what": what(json.loads((root / "provenance.json").read_text())),
                        "summaries": [(f"{exp}/{f.parent.name}", json.loads(f.read_text())) for f in files]})
    return out


def _bf16_trained(s: dict) -> bool:
    """Whether a :func:`lpfa.structure.summarize_run` summary's run trained with BF16 roundings in its attention: an
    lpfa policy that is not FP32-level (``fp32_split``, the FP32 twin of the recipe runs, is)."""
    return s["attn_backend"] == "lpfa" and not (s.get("policy") and is_fp32_level(get_policy(s["policy"])))


def compare_text(found: list[tuple[str, dict]], replay_within: list[float]) -> list[str]:
    """Page 05's comparison of GPU-trained checkpoints (``found``: (label, summary) pairs, in the order measured).
    Those trained without BF16 attention first, in one paragraph set against the paper's pretrained GPT-2: how many
    times BF16 scores multiply the tied rows, and their rank-1 similarity against random vectors and against the
    replayed run's heads (``replay_within``: their within-step median similarities, :func:`rank1_text`). Then one
    paragraph per BF16-trained checkpoint, next to its FP32 twin at the same step where there is one."""

    def numbers(s):
        tb, tf = np.asarray(s["ties"]["bf16"]), np.asarray(s["ties"]["fp32"])
        return tb.mean(), tf.mean(), tb.max(), tf.max(), s["similarity"]["model"]["median"]

    out = []
    fp32_trained = [(label, s) for label, s in found if not _bf16_trained(s)]  # never trained with BF16 attention
    bf16_trained = [(label, s) for label, s in found if _bf16_trained(s)]
    if fp32_trained:
        parts, meds = [], []
        for label, s in fp32_trained:
            tb, tf, mb, _, med = numbers(s)
            meds.append(med)
            parts.append(f"`{label}` at step {s['step']:,}: {tb / max(tf, 1e-12):.0f}-fold ({tf:.2%} → {tb:.1%} on "
                         f"average, {mb:.1%} in its most tied head), rank-1 similarity median {med:.2f}")
        out.append(
            "Against the paper's pretrained GPT-2, in models that never trained with BF16 attention: rounding the "
            "scores to BF16 multiplies the share of rows with tied maxima: " + "; ".join(parts)
            + ". So the first ingredient is there without BF16 training; the rank-1 matrices of the most tied head are "
            "similar (random vectors: "
            f"{fixed(found[0][1]['similarity']['random']['median'], 2)})"
            + (f" but far less than in the replayed heads of the BF16 run ({min(replay_within):.2f} to "
               f"{max(replay_within):.2f})." if replay_within and max(meds) < min(replay_within) else "."))
    for label, s in bf16_trained:
        tb, tf, mb, mf, med = numbers(s)
        layer, head = s["head"]
        twin = next(((tl, t) for tl, t in fp32_trained
                     if t["step"] == s["step"] and tl.rsplit("/", 1)[0] == label.rsplit("/", 1)[0]), None)
        text = (f"The BF16-trained `{label}` at step {s['step']:,} is another kind of model: with BF16 scores {mb:.0%} "
                f"of the rows of its most tied head (layer {layer}, head {head}) are tied, with FP32 scores at most "
                f"{mf:.2%} in any head (so nearly all are ties on BF16's grid, not in FP32), and that head's rank-1 "
                f"similarity median is {med:.2f}")
        if twin:
            _, _, tmb, _, tmed = numbers(twin[1])
            text += f"; the FP32 twin at the same step: {tmb:.1%} in its most tied head and {tmed:.2f}"
            if mb > 2 * tmb and med > tmed:
                text += (". In this pair of runs, training with BF16 attention built both ingredients far beyond what "
                         "BF16 rounding gives a model trained without it")
        out.append(text + ".")
    return out


def gpu_structures_runs(measured: list[dict]) -> str:
    """What each run of :func:`gpu_structures` is, from its provenance (Markdown, one paragraph per run): the record
    that page 05 keeps in a collapsed block, apart from the findings (:func:`gpu_structures_text`)."""
    if not measured:
        return "No GPU-trained checkpoint is measured yet."
    return "\n\n".join(f"Run `{m['run']}` of `results/{m['experiment']}`: {m['what']}." for m in measured)


def gpu_structures_text(measured: list[dict], replay_within: list[float], experiments: list[str]) -> str:
    """Page 05's section on the GPU-trained checkpoints (Markdown): per summary of :func:`gpu_structures` its run,
    policy, step and batch with :func:`lpfa.structure.describe`, then :func:`compare_text`; where none was measured in
    ``experiments``, what is missing (:func:`gpu_structures_runs` says what each run is)."""
    md = []
    for m in measured:
        md += [f"`{label}` (`{s['policy'] if s['attn_backend'] == 'lpfa' else s['attn_backend']}`) at step "
               f"{s['step']:,}, {s['batch'][0]} validation sequences of {s['batch'][1]} tokens, in BF16 autocast: "
               + describe(s) for label, s in m["summaries"]]
    found = [pair for m in measured for pair in m["summaries"]]
    md += compare_text(found, replay_within)
    if not found:
        md.append(
            f"**Not run yet** for the GPU-trained checkpoints (no `structure.json` in the latest run of "
            f"{', '.join(f'`results/{e}`' for e in experiments)}): the logged ties above count each run at its own "
            "score precision, so the BF16-rounded ties of the FP32-trained twin, the closest thing here to the paper's "
            "pretrained GPT-2, need its checkpoint, which stays on the GPU machine; `python -m lpfa.structure` "
            f"computes both figures' statistics from it there ({RERUN_PAGE} gives the command).")
    return "\n\n".join(md)
