"""Ties and low-rank structure in a trained model (paper Figs. 8, 9).

The mechanism needs two ingredients that the paper shows in a pretrained GPT-2: rows of scores with
several (near-)tied maxima (Fig. 8), and rank-1 matrices (PK)[T]ᵀX[T] that point the same way for many
tokens T (Fig. 9), so that per-token δ errors add up instead of cancelling.

* :func:`summarize` — both, for one model on one batch of token ids: the tie fraction of every layer and
  head with the scores rounded to BF16 (as the paper's attention computes them) and in FP32, and for the
  most tied head the cosine similarities of the tokens' rank-1 matrices against random vectors of the
  same sizes; a JSON-ready dict;
* :func:`summarize_run` — the same for a checkpoint of an ``lpfa.train`` run, on its validation data (what
  a GPU machine computes for the book, since checkpoints cannot travel);
* :func:`plot_ties`, :func:`plot_similarity`, :func:`describe` — the page's figures and text from a summary.

    python -m lpfa.structure --run runs/twins/fp32 --out runs/twins/fp32/structure.json
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from lpfa.attention import get_policy
from lpfa.attention.policy import is_fp32_level

BINS = np.linspace(-1.0, 1.0, 41)  # the similarity histograms' bin edges
MATRIX_TOKENS = 128  # the similarity matrix kept in a summary covers at most this many tokens


def _sim_stats(sim: np.ndarray) -> dict:
    off = sim[~np.eye(len(sim), dtype=bool)]
    return {"median": float(np.median(off)), "above_0.5": float((off > 0.5).mean()),
            "hist": np.histogram(off, bins=BINS)[0].tolist()}


@torch.no_grad()
def summarize(model, idx: torch.Tensor, eps: float = 1e-3, seed: int = 0, autocast=None) -> dict:
    """Figs. 8 and 9 for ``model`` on token ids ``idx`` (B, T).

    ``ties``: {"bf16", "fp32"} → (n_layer × n_head) fraction of causal rows with more than one score within
    ``eps`` of the row max (:func:`lpfa.mechanism.tie_fractions`, batch-averaged). ``head``: the (layer, head)
    most tied with BF16 scores. ``similarity``: for that head and the first sequence, the cosine similarity of
    the rank-1 matrices (PK)[T]ᵀX[T] of all token pairs (:func:`lpfa.mechanism.rank1_similarity`) — median,
    share above 0.5 and a histogram over ``BINS`` — for the model and for random Gaussian vectors of the same
    sizes (seeded by ``seed``), and the matrix of the first ``MATRIX_TOKENS`` tokens. ``autocast``: the context
    the model runs in (BF16 on a GPU, as in training). ``v_sign_dominance``: (n_layer × n_head) share of V's
    feature columns with one sign on at least :data:`lpfa.diagnostics.DOMINANT_SIGN` of the keys
    (:func:`lpfa.diagnostics.v_sign_dominance`), the other ingredient of a biased Ō = P̄V."""
    import contextlib

    from lpfa.diagnostics import DOMINANT_SIGN, capture_qkv, v_sign_dominance
    from lpfa.mechanism import layer_tensors, rank1_similarity, tie_fractions

    if idx.ndim != 2 or idx.shape[1] < 2:
        raise ValueError(f"idx must be (batch, tokens) token ids with at least 2 tokens, got shape {tuple(idx.shape)}")
    ctx = autocast or contextlib.nullcontext()
    with ctx:
        caps = capture_qkv(model, idx)  # q, k and v of every layer, from one forward pass
        ties = {"bf16": tie_fractions(model, idx, "paper", eps, caps), "fp32": tie_fractions(model, idx, "fp32", eps, caps)}
        v_dom = torch.stack([v_sign_dominance(c["v"]) for c in caps])
    layer, head = (int(i) for i in np.unravel_index(int(ties["bf16"].argmax()), tuple(ties["bf16"].shape)))
    with ctx:
        t = layer_tensors(model, idx[:1], layer)
    sim = rank1_similarity(t["p"][0, head], t["k"][0, head], t["x"][0]).cpu().numpy()
    T = sim.shape[0]
    g = torch.Generator().manual_seed(seed)
    rand = rank1_similarity(torch.eye(T), torch.randn(T, t["k"].shape[-1], generator=g),
                            torch.randn(T, t["x"].shape[-1], generator=g)).numpy()
    cfg = model.config
    return {"model": {"n_layer": cfg.n_layer, "n_head": cfg.n_head, "n_embd": cfg.n_embd},
            "batch": list(idx.shape), "eps": eps, "seed": seed,
            "ties": {k: v.cpu().tolist() for k, v in ties.items()}, "head": [layer, head],
            "v_sign_dominance": v_dom.cpu().tolist(), "dominant_sign": DOMINANT_SIGN,
            "similarity": {"model": _sim_stats(sim), "random": _sim_stats(rand), "bins": BINS.tolist(),
                           "matrix": np.round(sim[:MATRIX_TOKENS, :MATRIX_TOKENS], 4).tolist()}}


def summarize_run(run_dir, step: int | None = None, n_seq: int = 4, seq_len: int | None = None, device: str = "auto",
                  command: str | None = None) -> dict:
    """:func:`summarize` for a checkpoint of ``run_dir`` (default: its last, ``ckpt/``; ``step``: one of
    ``ckpt_history/``) on ``n_seq`` sequences of its validation data (the batch :mod:`lpfa.sfa_sweep` uses, cut
    to ``seq_len`` tokens; default the run's block size), in BF16 autocast on a GPU as in training."""
    from lpfa.provenance import provenance
    from lpfa.run import Run, autocast, resolve_device

    run = Run(run_dir)
    train = run.train
    cks = run.checkpoints
    if not cks:
        raise FileNotFoundError(f"{run_dir} has no checkpoints (ckpt/ or ckpt_history/)")
    step = max(cks) if step is None else step
    device = resolve_device(device)
    idx = run.probe_batch(0, n_seq, device)[:, : seq_len or train["block_size"]]
    model = run.checkpoint(step, map_location=device).model.to(device).eval()
    out = summarize(model, idx, autocast=autocast(device, "auto"))
    return {"run": str(run_dir), "step": step, "policy": train.get("attn_policy"), "attn_backend": train.get("attn_backend"),
            **out, "provenance": provenance(command=command)}


def _load(summary) -> dict:
    return summary if isinstance(summary, dict) else json.loads(Path(summary).read_text())


def plot_ties(summary, title: str = ""):
    """Fig. 8: the tie fraction of every layer (rows) and head (columns), BF16 scores next to FP32 scores."""
    import matplotlib.pyplot as plt

    from lpfa.plotting import use_style

    use_style()
    s = _load(summary)
    b, f = np.asarray(s["ties"]["bf16"]), np.asarray(s["ties"]["fp32"])
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    for ax, t, name in zip(axes, (b, f), ("BF16 scores", "FP32 scores")):
        im = ax.imshow(t, cmap="viridis", vmin=0, vmax=max(b.max(), f.max(), 1e-3), aspect="auto")
        ax.grid(False)
        ax.set_xlabel("head"); ax.set_ylabel("layer"); ax.set_title(f"{title}{': ' if title else ''}{name}", fontsize=9)
    fig.colorbar(im, ax=list(axes), label="rows with tied maxima")
    return fig


def plot_similarity(summary, title: str = ""):
    """Fig. 9: the rank-1 similarity matrix of the most tied head and its distribution against random vectors."""
    import matplotlib.pyplot as plt

    from lpfa.plotting import COLORS, use_style

    use_style()
    s = _load(summary)
    sim, (layer, head) = s["similarity"], s["head"]
    fig, axes = plt.subplots(1, 2, figsize=(8, 3.2))
    im = axes[0].imshow(np.asarray(sim["matrix"]), cmap="RdBu_r", vmin=-1, vmax=1)
    axes[0].grid(False)
    fig.colorbar(im, ax=axes[0], shrink=0.9, label="cosine similarity")
    axes[0].set_title(f"{title}{': ' if title else ''}layer {layer}, head {head}", fontsize=9)
    axes[0].set_xlabel("token T'"); axes[0].set_ylabel("token T")
    edges = np.asarray(sim["bins"])
    for key, color in (("model", COLORS["bf16"]), ("random", COLORS["neutral"])):
        counts = np.asarray(sim[key]["hist"], dtype=float)
        axes[1].stairs(counts / counts.sum() / np.diff(edges), edges, color=color, fill=True, alpha=0.6,
                       label="model" if key == "model" else "random vectors")
    axes[1].set_xlabel("cosine similarity of rank-1 matrices"); axes[1].legend()
    return fig


def describe(summary) -> str:
    """The numbers of both figures in one paragraph (Markdown)."""
    s = _load(summary)
    b, f = np.asarray(s["ties"]["bf16"]), np.asarray(s["ties"]["fp32"])
    layer, head = s["head"]
    m, r = s["similarity"]["model"], s["similarity"]["random"]
    return (f"With BF16 scores, {b.mean():.1%} of rows have tied maxima on average over layers and heads, {b.max():.1%} in the "
            f"most tied head (layer {layer}, head {head}); with FP32 scores {f.mean():.2%} on average and {f.max():.2%} at most. "
            f"In that head, the median cosine similarity between tokens' rank-1 matrices is **{m['median']:.2f}** "
            f"({m['above_0.5']:.0%} of pairs above 0.5); for random vectors of the same sizes {round(r['median'], 2) + 0.0:.2f} "
            f"({r['above_0.5']:.0%} above 0.5)." + _v_sign_text(s))


def _v_sign_text(s: dict) -> str:
    if "v_sign_dominance" not in s:  # summaries made before it was measured
        return ""
    d, (layer, head) = np.asarray(s["v_sign_dominance"]), s["head"]
    return (f" V's feature columns with one sign on at least {s['dominant_sign']:.0%} of the keys: {d.mean():.1%} on average, "
            f"{d[layer, head]:.1%} in that head, {d.max():.1%} at most.")


def main(argv: list[str] | None = None) -> int:
    import argparse
    import sys

    from lpfa.provenance import write_json

    p = argparse.ArgumentParser(prog="python -m lpfa.structure", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="an lpfa.train run folder with checkpoints")
    p.add_argument("--out", required=True, help="a .json file")
    p.add_argument("--step", type=int, default=None, help="a checkpoint step (default: the last)")
    p.add_argument("--n-seq", type=int, default=4)
    p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the run's block size)")
    p.add_argument("--device", default="auto")
    a = p.parse_args(argv)
    res = summarize_run(a.run, a.step, a.n_seq, a.seq_len, a.device,
                        command=" ".join(["python -m lpfa.structure", *(sys.argv[1:] if argv is None else argv)]))
    write_json(a.out, res)
    print(f"{a.run} step {res['step']}: " + describe(res).replace("**", ""))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


def _bf16_trained(s: dict) -> bool:
    """Whether a :func:`summarize_run` summary's run trained with BF16 roundings in its attention: an lpfa policy that
    is not FP32-level (``fp32_split``, the FP32 twin since issue 17, is)."""
    return s["attn_backend"] == "lpfa" and not (s.get("policy") and is_fp32_level(get_policy(s["policy"])))


def compare_text(found: list[tuple[str, dict]], replay_within: list[float]) -> list[str]:
    """Page 05's comparison of GPU-trained checkpoints (``found``: (label, summary) pairs, in the order measured).
    Those trained without BF16 attention first, in one paragraph set against the paper's pretrained GPT-2: how many
    times BF16 scores multiply the tied rows, and their rank-1 similarity against random vectors and against the failing
    run's replayed heads (``replay_within``: their within-step median similarities, :func:`lpfa.replay.rank1_text`). Then
    one paragraph per BF16-trained checkpoint, next to its FP32 twin at the same step where there is one."""

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
            parts.append(f"`{label}` at step {s['step']:,}: {tb / max(tf, 1e-12):.0f}-fold ({tf:.2%} → {tb:.1%} on average, "
                         f"{mb:.1%} in its most tied head), rank-1 similarity median {med:.2f}")
        out.append(
            "Against the paper's pretrained GPT-2, in models that never trained with BF16 attention: rounding the scores to "
            "BF16 multiplies the tied rows " + "; ".join(parts) + ". So the first ingredient is there without BF16 training; "
            f"the rank-1 matrices of the most tied head are similar (random vectors: "
            f"{round(found[0][1]['similarity']['random']['median'], 2) + 0.0:.2f})"
            + (f" but far less than in the failing run's replayed heads ({min(replay_within):.2f} to {max(replay_within):.2f})."
               if replay_within and max(meds) < min(replay_within) else "."))
    for label, s in bf16_trained:
        tb, tf, mb, mf, med = numbers(s)
        layer, head = s["head"]
        twin = next(((tl, t) for tl, t in fp32_trained
                     if t["step"] == s["step"] and tl.rsplit("/", 1)[0] == label.rsplit("/", 1)[0]), None)
        text = (f"The BF16-trained `{label}` at step {s['step']:,} is another kind of model: with BF16 scores {mb:.0%} of the "
                f"rows of its most tied head (layer {layer}, head {head}) are tied, with FP32 scores at most {mf:.2%} in any "
                f"head (so nearly all are ties on BF16's grid, not in FP32), and that head's rank-1 similarity median is "
                f"{med:.2f}")
        if twin:
            _, _, tmb, _, tmed = numbers(twin[1])
            text += f"; the FP32 twin at the same step: {tmb:.1%} in its most tied head and {tmed:.2f}"
            if mb > 2 * tmb and med > tmed:
                text += (". Training with BF16 attention built both ingredients far beyond what BF16 rounding gives a model "
                         "trained without it")
        out.append(text + ".")
    return out
