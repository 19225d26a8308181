"""Ties and low-rank structure in a trained model (paper Figs. 8, 9).

The mechanism needs two ingredients that the paper shows in a pretrained GPT-2: rows of scores with
several (near-)tied maxima (Fig. 8), and rank-1 matrices (PK)[T]ᵀX[T] that point the same way for many
tokens T (Fig. 9), so that per-token δ errors add up instead of cancelling.

* :func:`summarize` — both, for one model on one batch of token ids: the tie fraction of every layer and
  head with the scores rounded to BF16 (as the paper's attention computes them) and in FP32, and for the
  most tied head the cosine similarities of the tokens' rank-1 matrices against random vectors of the
  same sizes; a JSON-ready dict;
* :func:`summarize_run` — the same for a checkpoint of an ``lpfa.train`` run, on its validation data (what
  a GPU machine computes where the checkpoints are, since they cannot travel);
* :func:`describe` — both figures' numbers in one paragraph; :func:`load_summary` reads a summary back.

A summary holds ``ties``: {"bf16", "fp32"} → (n_layer × n_head) fraction of causal rows with more than one
score within ``eps`` of the row max (:func:`lpfa.mechanism.tie_fractions`, batch-averaged); ``head``: the
(layer, head) most tied with BF16 scores; ``similarity``: for that head and the first sequence, the cosine
similarity of the rank-1 matrices of all token pairs (:func:`lpfa.mechanism.rank1_similarity`) — median,
share above 0.5 and a histogram over :data:`BINS` — for the model and for random Gaussian vectors of the
same sizes, and the matrix of the first :data:`MATRIX_TOKENS` tokens; ``v_sign_dominance``: (n_layer ×
n_head) share of V's feature columns with one sign on at least :data:`lpfa.diagnostics.DOMINANT_SIGN` of the
keys (:func:`lpfa.diagnostics.v_sign_dominance`), the other ingredient of a biased Ō = P̄V.

    python -m lpfa.structure --run runs/twins/fp32 --out runs/twins/fp32/structure.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import numpy as np
import torch

from lpfa.diagnostics import DOMINANT_SIGN, capture_qkv, v_sign_dominance
from lpfa.mechanism import layer_tensors, rank1_similarity, tie_fractions
from lpfa.plotting import fixed
from lpfa.provenance import provenance, write_json
from lpfa.run import Run, resolve_device
from lpfa.run import autocast as amp_context

BINS = np.linspace(-1.0, 1.0, 41)  # the similarity histograms' bin edges
MATRIX_TOKENS = 128  # the similarity matrix kept in a summary covers at most this many tokens


def _sim_stats(sim: np.ndarray) -> dict:
    off = sim[~np.eye(len(sim), dtype=bool)]
    return {"median": float(np.median(off)), "above_0.5": float((off > 0.5).mean()),
            "hist": np.histogram(off, bins=BINS)[0].tolist()}


@torch.no_grad()
def summarize(model, idx: torch.Tensor, eps: float = 1e-3, seed: int = 0, autocast=None) -> dict:
    """Figs. 8 and 9 for ``model`` on token ids ``idx`` (B, T): the tie fractions of every layer and head with BF16 and
    FP32 scores (``eps`` from the row max), the rank-1 similarities of the most tied head against random vectors
    seeded by ``seed``, and V's sign dominance, as a JSON-ready summary (the module docstring lists its fields).
    ``autocast``: the context the model runs in (BF16 on a GPU, as in training)."""
    if idx.ndim != 2 or idx.shape[1] < 2:
        raise ValueError(f"idx must be (batch, tokens) token ids with at least 2 tokens, got shape {tuple(idx.shape)}")
    ctx = autocast or contextlib.nullcontext()
    with ctx:
        caps = capture_qkv(model, idx)  # q, k and v of every layer, from one forward pass
        ties = {"bf16": tie_fractions(model, idx, "paper", eps, caps),
                "fp32": tie_fractions(model, idx, "fp32", eps, caps)}
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
    run = Run(run_dir)
    train = run.train
    cks = run.checkpoints
    if not cks:
        raise FileNotFoundError(f"{run_dir} has no checkpoints (ckpt/ or ckpt_history/)")
    step = max(cks) if step is None else step
    device = resolve_device(device)
    idx = run.probe_batch(0, n_seq, device)[:, : seq_len or train["block_size"]]
    model = run.checkpoint(step, map_location=device).model.to(device).eval()
    out = summarize(model, idx, autocast=amp_context(device, "auto"))
    return {"run": str(run_dir), "step": step, "policy": train.get("attn_policy"),
            "attn_backend": train.get("attn_backend"), **out, "provenance": provenance(command=command)}


def load_summary(summary) -> dict:
    """A :func:`summarize` or :func:`summarize_run` summary: ``summary`` itself if a dict, else the JSON file it
    names."""
    return summary if isinstance(summary, dict) else json.loads(Path(summary).read_text())


def describe(summary) -> str:
    """The numbers of Figs. 8 and 9 in one paragraph (Markdown): the tie fractions with BF16 and FP32 scores (mean and
    most tied head), that head's rank-1 similarity median against random vectors, and V's sign dominance."""
    s = load_summary(summary)
    b, f = np.asarray(s["ties"]["bf16"]), np.asarray(s["ties"]["fp32"])
    layer, head = s["head"]
    m, r = s["similarity"]["model"], s["similarity"]["random"]
    return (f"With BF16 scores, {b.mean():.1%} of rows have tied maxima on average over layers and heads, "
            f"{b.max():.1%} in the most tied head (layer {layer}, head {head}); with FP32 scores {f.mean():.2%} on "
            f"average and {f.max():.2%} at most. In that head, the median cosine similarity between tokens' rank-1 "
            f"matrices is **{m['median']:.2f}** ({m['above_0.5']:.0%} of pairs above 0.5); for random vectors of the "
            f"same sizes {fixed(r['median'], 2)} ({r['above_0.5']:.0%} above 0.5)." + _v_sign_text(s))


def _v_sign_text(s: dict) -> str:
    if "v_sign_dominance" not in s:  # summaries made before it was measured
        return ""
    d, (layer, head) = np.asarray(s["v_sign_dominance"]), s["head"]
    return (f" V's feature columns with one sign on at least {s['dominant_sign']:.0%} of the keys of these sequences: "
            f"{d.mean():.1%} on average, {d[layer, head]:.1%} in that head, {d.max():.1%} at most.")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lpfa.structure", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
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
