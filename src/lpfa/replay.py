"""Instrumented replay (paper Figs. 4–6): continue a run from one of its checkpoints on its recorded
batches and measure, in one layer, the low- and high-precision attention side by side.

From the checkpoint at ``step`` the run's own training step is repeated for ``steps`` steps (same
policy, optimizer state, learning rate and batches from ``replay.jsonl``), so the weights follow the
original trajectory. At every step the chosen layer's input X, q, k, v and the gradient dO reaching
its attention output are captured, and for each chosen head (on the first ``n_seq`` sequences):

* :func:`lpfa.mechanism.delta_accounting`: δ_lp − δ_hp per token (Eq. 4, Fig. 5a), its split between
  rows with several P̄ = 1 entries and the rest, and how often V has one sign at those positions;
* the W_Q gradient error G = scale · Σ_T (δ_lp − δ_hp)[T] · (PK)[T]ᵀ X[T] (Sec. 3.3): its norm, how much
  of it lies in its top singular direction, and how that direction overlaps across steps (the paper's
  "recurring low-rank direction");
* at two steps (first and last): the rank-1 matrices' cosine similarities among the tokens with the
  largest |δ error| (Fig. 4), dO and O_lp − O_hp of the worst tokens (Fig. 5b, c) and the running P̄V
  error along the key axis of the worst token and feature (Fig. 6).

    python -m lpfa.replay --run runs/twins/bf16 --layer auto --steps 100 --out results/replay

writes ``replay.json`` (numbers, provenance) and ``replay.npz`` (arrays for the figures). ``max_s`` > 0
ends the replay early (its last step measured in detail) once that many seconds passed. ``measure_policy``
measures that policy's δ error instead of the layer's own (the FP32 twin measured with the BF16 run's
``paper``: what BF16 attention would have done on the twin's trajectory); ``detail_every`` > 0 measures in
detail (Figs. 4–6) every that many steps as well as the first and last; ``save_qkv`` > 0 also writes
``out/qkv.npz``: the layer's q, k, v and dO (every head) of the first replayed step's first micro-batch, its
first ``save_qkv`` sequences, as the run's attention saw them (the kernel-bias audit's captured family,
:func:`lpfa.audit.load_captured`).

Reading a replay (:func:`load_replay`) and its statistics: :func:`delta_bias_frame` and :func:`bias_test`
(Fig. 5a: is δ_lp − δ_hp biased, and do the tied rows carry it?), :func:`rank1_stats` (Fig. 4).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import sys
import time
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from tqdm.auto import tqdm

from lpfa import data as lpfa_data
from lpfa.audit import save_captured
from lpfa.mechanism import delta_accounting, p_bar, pv_running_error
from lpfa.provenance import provenance, write_json
from lpfa.run import Run, checkpoints_of, read_records, resolve_device, runaway_onset
from lpfa.train import build_optimizers, recorded_config, set_deterministic, train_step


def choose_checkpoint(run_dir, explosion_step: int | None, runaway_step: int | None = None) -> int:
    """The last checkpoint before ``explosion_step`` (the paper's "shortly before"); without an explosion,
    the last before the logit runaway (:class:`lpfa.explosion.RunawayCriterion`); else the latest one."""
    cks = checkpoints_of(run_dir)
    if not cks:
        raise FileNotFoundError(f"{run_dir} has no checkpoints (ckpt/ or ckpt_history/)")
    event = explosion_step if explosion_step is not None else runaway_step
    before = [s for s in cks if event is None or s < event]
    return max(before) if before else min(cks)


def choose_layer_heads(run_dir, n_heads: int = 2, layer: int | None = None,
                       until: int | None = None) -> tuple[int, list[int]]:
    """The layer whose largest per-head W_Q spectral norm grew the most (ratio, last record / first), or
    ``layer`` if given, and its ``n_heads`` fastest-growing heads: where the paper finds the failure (Figs. 3, 11).
    ``until``: only the diagnostics records up to that step (what the run had logged then)."""
    w = np.array([r["diag"]["wq_spectral_norm"] for r in read_records(run_dir)
                  if "diag" in r and (until is None or r["step"] <= until)])
    if not len(w):
        raise ValueError(f"{run_dir} has no diagnostics records: pass --layer and --heads")
    # w: (records, layers, heads)
    growth = w[-1] / w[0]
    layer = int(growth.max(axis=1).argmax()) if layer is None else int(layer)
    heads = [int(h) for h in np.argsort(-growth[layer])[:n_heads]]
    return layer, heads


def _w_q_error(delta_err, p, k, x, scale):
    """G = scale · Σ_T δerr[T] (PK)[T]ᵀ X[T] for one sequence and head: (D, C), float64."""
    pk = p @ k  # (T, D)
    return scale * (pk * delta_err[:, None]).T @ x


def _top_direction(g):
    u, s, vh = torch.linalg.svd(g, full_matrices=False)
    return u[:, 0], vh[0], float(s[0] ** 2 / (s ** 2).sum())


@torch.no_grad()
def _head_measures(cap: dict, head: int, n_seq: int, policy: str, detail: bool, n_top: int = 64) -> tuple[dict, dict]:
    # dO as the attention kernel receives it: in v's dtype (a no-op for a BF16 run; the FP32 twin's FP32 dO rounded to
    # BF16, as a BF16 kernel would see it when the twin is measured with a BF16 policy)
    cap = {**cap, "do": cap["do"].to(cap["v"].dtype)}
    q, k, v, do = (cap[n][:n_seq, head : head + 1].float() for n in ("q", "k", "v", "do"))
    x = cap["x"][:n_seq].double()  # (n, T, C): the layer's attention input (after ln_1)
    D = q.shape[-1]
    scale = 1.0 / math.sqrt(D)
    acc = delta_accounting(q, k, v, do, policy, scale)
    err = acc["delta_err"][:, 0]  # (n, T)
    T = q.shape[2]
    s = (q[:, 0].double() @ k[:, 0].double().transpose(-1, -2)) * scale
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool, device=s.device).triu(1), -math.inf)
    p = torch.softmax(s, dim=-1)  # (n, T, T) the high-precision P of the gradient formula
    g = sum(_w_q_error(err[b], p[b], k[b, 0].double(), x[b], scale) for b in range(err.shape[0]))
    u, vh, energy = _top_direction(g)
    num = {key: acc[key] for key in ("sum_all", "sum_tied", "sum_untied", "share_tied", "tied_rows", "rows",
                                     "mean_tied", "mean_untied", "same_sign")}
    num.update({"g_norm": float(g.norm()), "g_top_energy": energy, "abs_err_mean": float(err.abs().mean())})
    arrays = {"delta_err": err.float().cpu().numpy(), "g_u": u.cpu().numpy(), "g_v": vh.cpu().numpy()}
    if detail:
        flat = err.flatten()
        top = torch.argsort(flat.abs(), descending=True)[:n_top]
        b_idx, t_idx = top // T, top % T
        pk = torch.stack([p[b] @ k[b, 0].double() for b in range(err.shape[0])])  # (n, T, D)
        arrays["top_tokens"] = torch.stack([b_idx, t_idx], 1).cpu().numpy()
        arrays["top_pk"] = pk[b_idx, t_idx].float().cpu().numpy()
        arrays["top_x"] = x[b_idx, t_idx].float().cpu().numpy()
        arrays["top_delta_err"] = flat[top].float().cpu().numpy()
        wb, wt = int(b_idx[0]), int(t_idx[0])
        acc_o_err = acc["o_err"][wb, 0, wt]
        arrays["worst_do"] = do[wb, 0, wt].cpu().numpy()
        arrays["worst_o_err"] = acc_o_err.float().cpu().numpy()
        # Fig. 6: the P̄ row of the worst token as P̄V sees it, and the feature with the largest |dO · O error|
        p_row = p_bar(q[wb : wb + 1], k[wb : wb + 1], policy, scale)[0, 0, wt, : wt + 1]
        feat = int((do[wb, 0, wt].double() * acc_o_err).abs().argmax())
        run = pv_running_error(p_row.cpu(), v[wb, 0, : wt + 1, feat].cpu())
        arrays["pv_p_bar"] = p_row.cpu().numpy()
        arrays["pv_v"] = v[wb, 0, : wt + 1, feat].cpu().numpy()
        arrays["pv_error"] = run["error"].numpy()
        num.update({"worst_token": [wb, wt], "worst_feature": feat, "worst_p_bar_ones": int((p_row == 1).sum())})
    return num, arrays


def thin_delta_err(arrays: dict, steps, every: int) -> dict:
    """Keep the per-step arrays ``h<head>_delta_err`` (per-token δ errors: replayed steps × sequences × tokens),
    ``h<head>_g_u`` and ``h<head>_g_v`` (G's top singular vectors) of every ``every``-th replayed step and the last,
    recording which in ``h<head>_<name>_steps``. The per-step sums and overlaps of every step stay in ``replay.json``
    and the overlap arrays; this only keeps ``replay.npz`` small. Arrays already thinned (with their ``_steps`` key) are
    left as they are."""
    if every < 1:
        raise ValueError(f"every must be >= 1, got {every}")
    steps = np.asarray(steps)
    keep = np.unique(np.r_[np.arange(0, len(steps), every), len(steps) - 1]) if len(steps) else np.arange(0)
    out = dict(arrays)
    for key in [k for k in arrays if re.fullmatch(r"h\d+_(delta_err|g_u|g_v)", k)]:
        if f"{key}_steps" in arrays:
            continue
        if len(arrays[key]) != len(steps):
            raise ValueError(f"{key} has {len(arrays[key])} steps but {len(steps)} step numbers were given")
        out[key] = arrays[key][keep]
        out[f"{key}_steps"] = steps[keep].astype(np.int64)
    return out


def loss_agreement(per_step: list[dict], records: list[dict]) -> dict:
    """How closely a replay followed its run: each replayed step's loss against the loss the run logged at that step.
    ``compared`` steps (those the run logged), ``bit_equal`` of them, the ``first_mismatch`` step (None when all agree)
    and the largest absolute difference. A replay that follows the run bit for bit has ``bit_equal == compared``."""
    logged = {r["step"]: r["loss"] for r in records if "loss" in r and "diag" not in r}
    pairs = [(p["step"], p["loss"], logged[p["step"]]) for p in per_step if p["step"] in logged]
    diff = [abs(a - b) for _, a, b in pairs if math.isfinite(a) and math.isfinite(b)]
    first = next((s for s, a, b in pairs if a != b), None)
    return {"compared": len(pairs), "bit_equal": sum(a == b for _, a, b in pairs), "first_mismatch": first,
            "max_abs_diff": max(diff) if diff else None}


def _side_pass(model, attn, batch, n_micro: int, autocast) -> dict:
    """The layer's x, q, k, v, O and dO on ``batch`` (micro-batch 0) from an eager forward and backward of ``model`` at
    its current weights, its loss divided by ``n_micro`` as :func:`lpfa.train.train_step` divides it; the gradients
    are then dropped, so the step that follows is the run's own."""
    attn.capture = {"all": True}
    x, y = batch
    with autocast:
        _, loss = model(x, y)
        (loss / n_micro).backward()
    cap, attn.capture = attn.capture, None
    model.zero_grad(set_to_none=True)
    return cap


def replay(run_dir, out, step: int | None = None, layer: int | str = "auto", heads: list[int] | None = None,
           steps: int = 100, n_seq: int = 8, device: str = "auto", command: str | None = None,
           max_s: float = 0.0, delta_err_every: int = 10, save_qkv: int = 0, measure_policy: str | None = None,
           detail_every: int = 0, side_pass: bool | None = None) -> dict:
    """Replay ``steps`` training steps of ``run_dir`` from its checkpoint at ``step`` (default: the last before its
    explosion, else before its logit runaway, else before the first record above the runaway threshold, else the
    latest; ``choice`` in the result says which), measure ``layer``/``heads`` on ``n_seq`` sequences, and write
    ``out/replay.{json,npz}``; returns the result. ``max_s`` > 0 ends it early; ``delta_err_every`` thins the
    per-token δ errors kept (:func:`thin_delta_err`); ``measure_policy``, ``detail_every`` and ``save_qkv`` are
    described in the module docstring. ``agreement`` in the result compares the replayed losses with the run's
    (:func:`loss_agreement`). A run trained with ``compile=true`` is replayed compiled, its layer measured by an eager
    side pass before each step (``side_pass`` None: exactly then; True forces it on an eager run)."""
    t_start = time.time()
    given_step = step is not None
    run_dir, out = Path(run_dir), Path(out)
    run = Run(run_dir)
    cfg = recorded_config(run)
    set_deterministic(cfg.deterministic)  # as the run did: its compiled kernels then compute the run's bits
    data_dir = run.data_dir
    verdict = run.verdict()
    # without an explosion or a confirmed runaway: the first record above the runaway threshold, if any
    quiet = verdict["explosion_step"] is None and verdict.get("runaway_step") is None
    onset = runaway_onset(run_dir) if quiet else None
    event = ("explosion" if verdict["explosion_step"] is not None
             else "runaway" if verdict.get("runaway_step") is not None else "onset" if onset else "latest")
    if step is None:
        step = choose_checkpoint(run_dir, verdict["explosion_step"],
                                 verdict.get("runaway_step") or (onset[0] if onset else None))
    ra_layer = (verdict.get("runaway_layer") if verdict.get("runaway_layer") is not None
                else (onset[1] if onset else None))
    choice = {"layer": "given" if layer != "auto" else ("runaway" if ra_layer is not None else "wq_growth"),
              "heads": "given" if heads is not None else "wq_growth",
              "checkpoint": "given" if given_step else event, "onset": list(onset) if onset else None}
    if layer == "auto" or heads is None:
        auto_layer, auto_heads = choose_layer_heads(  # the layer that ran away (or began to), if one did
            run_dir, layer=ra_layer if layer == "auto" else int(layer))
        layer = auto_layer if layer == "auto" else int(layer)
        heads = auto_heads if heads is None else heads
    layer = int(layer)

    device = resolve_device(device)
    autocast = run.autocast(device)
    ck = run.checkpoint(step, map_location=device)
    if not isinstance(ck.extra_state, dict) or "optimizers" not in ck.extra_state:
        raise ValueError(f"the checkpoint of step {step} of {run_dir} holds no optimizer state (state.pt, written by "
                         "lpfa.train): the replay continues training from it and needs one")
    model = ck.model.to(device)
    model.train()
    optimizers = build_optimizers(model, cfg)
    for opt, st in zip(optimizers, ck.extra_state["optimizers"]):
        opt.load_state_dict(st)
    tokens, _ = lpfa_data.load_tokens(data_dir, "train")
    log = lpfa_data.ReplayLog.open(run_dir / "replay.jsonl", data_dir / "train.bin")
    if measure_policy is None and model.config.layer_backend(layer) != "lpfa":
        raise ValueError(f"layer {layer} of {run_dir} used attention backend {model.config.layer_backend(layer)!r}; "
                         "the replay measures a layer that ran an lpfa precision policy, or the one measure_policy "
                         "names")
    own_policy = model.config.layer_policies.get(layer, model.config.attn_policy)
    policy = measure_policy or own_policy
    if detail_every < 0:
        raise ValueError(f"detail_every={detail_every!r}: expected 0 (first and last step only) or a positive step "
                         "count")
    attn = model.transformer.h[layer].attn
    # the run's own step: compiled if the run was (lpfa.train compiles the same way). A compiled step cannot capture
    # the layer's tensors, so they come from a side pass (:func:`_side_pass`) at the same weights before each step.
    side_pass = bool(cfg.compile) if side_pass is None else side_pass
    step_model = torch.compile(model) if cfg.compile else model

    per_step, series, details = [], {h: {"delta_err": [], "g_u": [], "g_v": []} for h in heads}, {}
    last = step + steps - 1
    for s in tqdm(range(step, step + steps), desc="replay", unit="step"):
        if max_s and s > step + 1 and s < last and time.time() - t_start > max_s:
            last = s  # out of time: measure this step in detail and stop
        # the recorded batches; past the end of the record, the run's seeded order (the same function made them)
        starts = log.starts(s) if s in log.steps else [
            lpfa_data.batch_starts(cfg.seed, s, m, cfg.batch_size, len(tokens), cfg.block_size)
            for m in range(cfg.grad_accum)]
        batches = [lpfa_data.get_batch(tokens, st, cfg.block_size, device) for st in starts]
        captured = {}

        def capture_first(micro):  # the layer's q, k, v, x, O and dO of micro-batch 0, in lpfa.train's own step
            if micro == 1:
                captured["cap"] = attn.capture
            attn.capture = {"all": True} if micro == 0 else None

        if side_pass:
            cap = _side_pass(model, attn, batches[0], len(batches), autocast)
            loss, gnorm, _ = train_step(step_model, optimizers, cfg, s, batches, autocast)
        else:
            loss, gnorm, _ = train_step(model, optimizers, cfg, s, batches, autocast, before_micro=capture_first)
            cap = captured.get("cap", attn.capture)
            attn.capture = None
        if not (math.isfinite(loss) and math.isfinite(gnorm)):
            break  # training stops here too (lpfa.train): nothing after a non-finite step is the run's trajectory
        if save_qkv and s == step:
            out.mkdir(parents=True, exist_ok=True)
            save_captured(out / "qkv.npz", {n: cap[n][:save_qkv] for n in ("q", "k", "v", "do")},
                          {"run": str(run_dir), "step": s, "layer": layer, "policy": policy, "micro_batch": 0})
        rec = {"step": s, "loss": loss, "heads": {}}
        for h in heads:
            detail = s in (step, last) or bool(detail_every and (s - step) % detail_every == 0)
            num, arr = _head_measures(cap, h, n_seq, policy, detail=detail)
            rec["heads"][str(h)] = num
            for key in ("delta_err", "g_u", "g_v"):
                series[h][key].append(arr.pop(key))
            if arr:
                details[(h, s)] = arr
        per_step.append(rec)
        if s == last:
            break

    if not per_step:
        raise RuntimeError(f"the first replayed step ({step}) of {run_dir} was non-finite: nothing to measure")
    # the recurring direction: overlap of each step's top singular vectors with the first step's and the previous step's
    summary_heads = {}
    arrays: dict[str, np.ndarray] = {}
    for h in heads:
        U = np.stack(series[h]["g_u"])
        V = np.stack(series[h]["g_v"])
        first = (U @ U[0]) ** 2 * (V @ V[0]) ** 2  # squared cosines of the rank-1 directions u vᵀ
        prev = np.r_[np.nan, ((U[1:] * U[:-1]).sum(1) ** 2) * ((V[1:] * V[:-1]).sum(1) ** 2)]
        rng = np.random.default_rng(0)
        ru = rng.standard_normal(U.shape)
        rv = rng.standard_normal(V.shape)
        ru /= np.linalg.norm(ru, axis=1, keepdims=True)
        rv /= np.linalg.norm(rv, axis=1, keepdims=True)
        chance = float(np.mean(((ru * U).sum(1) ** 2) * ((rv * V).sum(1) ** 2)))
        d = np.stack(series[h]["delta_err"])  # (steps, n_seq, T)
        arrays[f"h{h}_delta_err"] = d.astype(np.float32)
        arrays[f"h{h}_overlap_first"] = first
        arrays[f"h{h}_overlap_prev"] = prev
        # G's top direction per step
        arrays[f"h{h}_g_u"], arrays[f"h{h}_g_v"] = U.astype(np.float32), V.astype(np.float32)
        sums = np.array([r["heads"][str(h)]["sum_all"] for r in per_step])
        tied = np.array([r["heads"][str(h)]["sum_tied"] for r in per_step])
        summary_heads[str(h)] = {
            "cum_delta_err": float(sums.sum()), "cum_delta_err_tied_rows": float(tied.sum()),
            "share_tied": float(tied.sum() / sums.sum()) if sums.sum() != 0 else None,
            "steps_with_positive_sum": int((sums > 0).sum()), "steps": len(sums),
            "tied_row_fraction": float(np.mean([r["heads"][str(h)]["tied_rows"] / r["heads"][str(h)]["rows"]
                                                for r in per_step])),
            "same_sign_fraction": float(np.nanmean([r["heads"][str(h)]["same_sign"] for r in per_step])),
            "g_top_energy_median": float(np.median([r["heads"][str(h)]["g_top_energy"] for r in per_step])),
            "overlap_prev_median": float(np.nanmedian(prev)),
            "overlap_first_median": float(np.median(first[1:])) if len(first) > 1 else None,
            "overlap_chance": chance,
        }
    for (h, s), arr in details.items():
        for key, val in arr.items():
            arrays[f"h{h}_s{s}_{key}"] = np.asarray(val)
    out.mkdir(parents=True, exist_ok=True)
    result = {"run": str(run_dir), "verdict": verdict, "checkpoint_step": step, "steps": len(per_step), "layer": layer,
              "heads": heads, "choice": choice, "policy": policy, "own_policy": own_policy, "n_seq": n_seq,
              "compiled": bool(cfg.compile), "deterministic": bool(cfg.deterministic),
              "measured_by": "side pass" if side_pass else "the step",
              "summary": summary_heads, "per_step": per_step,
              "agreement": loss_agreement(per_step, run.records), "provenance": provenance(command=command)}
    write_json(out / "replay.json", result)
    write_json(out / "provenance.json", result["provenance"])  # the folder's record, as every results folder has
    np.savez_compressed(out / "replay.npz", **thin_delta_err(arrays, [r["step"] for r in per_step], delta_err_every))
    return result


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m lpfa.replay", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True, help="a training run folder (with config.json, replay.jsonl, checkpoints)")
    p.add_argument("--out", required=True, help="folder for replay.json and replay.npz")
    p.add_argument("--step", type=int, default=None,
                   help="checkpoint step (default: last before the explosion, else before the logit runaway, "
                        "else latest)")
    p.add_argument("--layer", default="auto",
                   help="layer index, or auto (the layer that ran away, else fastest W_Q norm growth)")
    p.add_argument("--heads", type=int, nargs="*", default=None, help="heads (default: the layer's 2 fastest-growing)")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--n-seq", type=int, default=8, help="sequences of each batch to measure")
    p.add_argument("--device", default="auto")
    p.add_argument("--max-s", type=float, default=0.0, help="stop early after this many seconds (0 = never)")
    p.add_argument("--delta-err-every", type=int, default=10,
                   help="keep per-token δ errors of every N-th step in replay.npz")
    p.add_argument("--measure-policy", default=None,
                   help="measure this policy's δ error (e.g. paper) instead of the layer's own")
    p.add_argument("--detail-every", type=int, default=0,
                   help="also measure in detail (Figs. 4-6) every N steps (0: first and last only)")
    p.add_argument("--save-qkv", type=int, default=0, metavar="N",
                   help="also write qkv.npz: the layer's q, k, v, dO of N sequences of the first step "
                        "(the kernel-bias audit's captured family)")
    a = p.parse_args(argv)
    command = " ".join(["python -m lpfa.replay", *(sys.argv[1:] if argv is None else argv)])
    r = replay(a.run, a.out, a.step, a.layer, a.heads, a.steps, a.n_seq, a.device, command=command, max_s=a.max_s,
               delta_err_every=a.delta_err_every, save_qkv=a.save_qkv, measure_policy=a.measure_policy,
               detail_every=a.detail_every)
    print(json.dumps({"layer": r["layer"], "heads": r["heads"], "checkpoint_step": r["checkpoint_step"],
                      "summary": r["summary"]}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())


# --------------------------------------------------------------------------------------------
# Reading a replay: the statistics of Figs. 4, 5
# --------------------------------------------------------------------------------------------
def load_replay(folder) -> tuple[dict, dict]:
    """``(result, arrays)``: ``replay.json`` and the arrays of ``replay.npz`` in ``folder``."""
    folder = Path(folder)
    for f in ("replay.json", "replay.npz"):
        if not (folder / f).is_file():
            raise FileNotFoundError(f"{folder / f} does not exist: not a replay folder (python -m lpfa.replay writes "
                                    "one)")
    with np.load(folder / "replay.npz") as z:
        arrays = {k: z[k] for k in z.files}
    return json.loads((folder / "replay.json").read_text()), arrays


def detail_steps(arrays: dict, head: int) -> list[int]:
    """The steps measured in detail for ``head``: the replay's first and last (and every ``detail_every``-th)."""
    return sorted({int(k.split("_")[1][1:]) for k in arrays if k.startswith(f"h{head}_s") and k.endswith("_top_pk")})


def delta_bias_frame(result: dict):
    """Per step and head: Σ δ error over all rows, over rows with ≥ 2 P̄ = 1 entries and over the rest,
    with their running sums over steps (Fig. 5a)."""
    rows = [{"step": r["step"], "head": int(h), "all": v["sum_all"], "tied rows": v["sum_tied"],
             "other rows": v["sum_untied"], "tied row fraction": v["tied_rows"] / v["rows"],
             "same sign": v["same_sign"], "g_top_energy": v["g_top_energy"]}
            for r in result["per_step"] for h, v in r["heads"].items()]
    f = pd.DataFrame(rows).sort_values(["head", "step"])
    for c in ("all", "tied rows", "other rows"):
        f[f"cumulative {c}"] = f.groupby("head")[c].cumsum()
    return f


Z95 = 1.959963984540054  # the standard normal's 97.5th percentile


def bias_test(result: dict) -> dict:
    """Per head: mean and standard error of the per-step Σ δ error, its t statistic and 95% interval (mean ± 1.96
    standard errors: the steps are many), the fraction of positive steps, and the share of the cumulative error from
    tied rows: is δ_lp − δ_hp biased (Fig. 5), and where from?"""
    f = delta_bias_frame(result)
    out = {}
    for h, g in f.groupby("head"):
        x = g["all"].to_numpy()
        se = x.std(ddof=1) / np.sqrt(len(x)) if len(x) > 1 else float("nan")
        out[int(h)] = {"steps": len(x), "mean": float(x.mean()), "stderr": float(se),
                       "t": float(x.mean() / se) if se else float("nan"),
                       "ci_low": float(x.mean() - Z95 * se), "ci_high": float(x.mean() + Z95 * se),
                       "positive_fraction": float((x > 0).mean()), "cumulative": float(x.sum()),
                       "share_tied": float(g["tied rows"].sum() / x.sum()) if x.sum() else float("nan"),
                       "tied_row_fraction": float(g["tied row fraction"].mean()),
                       "same_sign": float(g["same sign"].mean())}
    return out


def _cos_matrix(a: np.ndarray) -> np.ndarray:
    a = a.astype(np.float64)
    a = a / np.linalg.norm(a, axis=1, keepdims=True)
    return a @ a.T


def rank1_stats(arrays: dict, head: int, seed: int = 0) -> dict:
    """Cosine similarity of the rank-1 matrices (PK)[T]ᵀ X[T] among the tokens with the largest |δ error|
    (cos(PK_T, PK_T')·cos(X_T, X_T')), within each detail step and across the first and last, against random
    vectors of the same shapes (Fig. 4). Returns the similarity arrays and their medians."""
    steps = detail_steps(arrays, head)
    if not steps:
        heads = sorted({int(k.split("_")[0][1:]) for k in arrays if k.endswith("_top_pk")})
        raise ValueError(f"head={head!r}: expected a head this replay measured in detail, one of {heads}")
    pk = {s: arrays[f"h{head}_s{s}_top_pk"].astype(np.float64) for s in steps}
    x = {s: arrays[f"h{head}_s{s}_top_x"].astype(np.float64) for s in steps}
    out = {"steps": steps}
    for s in steps:
        c = _cos_matrix(pk[s]) * _cos_matrix(x[s])
        out[f"within {s}"] = c[np.triu_indices(len(c), 1)]
    if len(steps) >= 2:
        a, b = steps[0], steps[-1]

        def n(m):
            return m / np.linalg.norm(m, axis=1, keepdims=True)

        out[f"across {a}→{b}"] = ((n(pk[a]) @ n(pk[b]).T) * (n(x[a]) @ n(x[b]).T)).ravel()
    rng = np.random.default_rng(seed)
    s0 = steps[0]
    r = _cos_matrix(rng.standard_normal(pk[s0].shape)) * _cos_matrix(rng.standard_normal(x[s0].shape))
    out["random vectors"] = r[np.triu_indices(len(r), 1)]
    out["medians"] = {k: float(np.median(v)) for k, v in out.items() if isinstance(v, np.ndarray)}
    return out
