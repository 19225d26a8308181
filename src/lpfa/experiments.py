"""The book's experiments, in one place: every run of every experiment, what it changes, what the paper reports
for it and the run it is judged against.

An experiment is a set of ``lpfa.train`` runs on the same seeded batches that differ as named. The compact
definitions below (``TWINS``, ``ISOLATION``, ...: label -> key=value overrides) are gathered in
:data:`EXPERIMENTS`; :func:`rows` and :func:`table` present them as one table of :class:`Row` entries (label, overrides,
description, the paper's outcome, the reference row). ``lpfa.launch`` starts them (``--experiment NAME``), the pages
read their committed results by these labels.
"""

from __future__ import annotations

from dataclasses import dataclass

import pandas as pd

# The FP32 twin of every experiment: the fp32 policy with its GEMMs on BF16 tensor cores over split FP32 operands
# (lpfa.attention.policy.GEMM_SPLIT_DOC): FP32-level error against float64 (results/attention_benchmark, error.json),
# bit-deterministic (no atomics), and faster in GPT-2 S training than SDPA on FP32 inputs (results/train_throughput).
# Runs committed before this choice used "attn_backend=sdpa_fp32"; their config.json says so. Single FP32 layers
# (layer_policies) still name sdpa_fp32.
FP32_TWIN = "attn_policy=fp32_split"

# The book's experiments: each a set of runs on the same seeded batches, differing as named.
TWINS: dict[str, list[str]] = {  # Figs. 2, 3, 7, 13: only the attention differs
    "bf16": ["attn_policy=paper_untiled", "ckpt_history=true"],  # the authors' BF16 flash attention
    "fp32": [FP32_TWIN],  # FP32 attention
    "sfa": ["attn_policy=paper_sfa", "ckpt_history=true"],  # the paper's fix, β = 2
    "fa2": ["attn_policy=fa2"],  # FlashAttention-2's rounding, what SDPA users train with
}
# The isolation table (Sec. 3.2): one change each from the bf16 twin. Layer 1 and its heads 5, 2 are where
# our bf16 twin localised (results/repro_twins: fastest W_Q growth, tied rows and logits in layer 1).
# At T = 512 the paper's 512-key blocks are one block, so the bf16 twin is also the "no tiling" row. The two
# references are run again inside the experiment so that every row shares its settings (e.g. compile=true).
ISOLATION: dict[str, list[str]] = {
    "bf16": ["attn_policy=paper_untiled"],
    "fp32": [FP32_TWIN],
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
# What the paper reports for each isolation row (Sec. 3.2), in the book's outcomes: "loss exploded" or "neither".
PAPER_ISOLATION: dict[str, str] = {
    "bf16": "loss exploded", "fp32": "neither", "bf16_tiled": "loss exploded", "bf16_only_layer1": "loss exploded",
    "fp32_only_layer1": "neither",
    "delta_dp": "neither", "delta_o_fp32": "neither", "delta_o_exact": "not reported", "o_fp32": "neither",
    "pv_fp32": "neither", "scores_fp32": "not reported", "fp32_outlier_heads": "neither",
    "fp32_worst_head": "not reported",
}
# failure (runaway) rate and spread over seeds of data order and init; 1337 is the twins'
SEEDS: dict[str, list[str]] = {
    f"{mode}_s{s}": [ISOLATION[mode][0], f"seed={s}", f"init_seed={s}"] for mode in ("bf16", "fp32") for s in (1, 2, 3)
}
SFA_MUON: dict[str, list[str]] = {  # Fig. 7 with Muon; the FP32 twin is the precursor verdict's reference
    "bf16_muon": [*TWINS["bf16"], "optimizer=muon"],
    "fp32_muon": [*TWINS["fp32"], "optimizer=muon"],
    "sfa_muon": [*TWINS["sfa"], "optimizer=muon"],
}
# Fig. 7 at a second model size: GPT-2 S's 12 layers, 12 heads, d = 768; all else `repro`
SIZES: dict[str, list[str]] = {
    f"{mode}_gpt2s": [TWINS[mode][0], "model=gpt2-s"] for mode in ("bf16", "fp32", "sfa")
}
# Dose-response: the δ error of layer 1 (the failing layer) multiplied by k in the backward, the forward
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
    "fp32": [FP32_TWIN],
    **{f"bias_x{k}_s{s}": [*_dosed(k), f"seed={s}", f"init_seed={s}"] for k in (64, 128) for s in (1, 2)},
}
# The paper's own recipe at GPT-2 S size, run with preset gpt2-s-paper and batch_size/grad_accum set by
# scripts/gpu/paper_recipe.sh to the largest batch that gives >= 8k steps in one GPU run (lpfa.scaling.batch_for_steps).
# fa2 and SFA join only if the BF16 twin explodes and the FP32 twin does not.
PAPER_RECIPE: dict[str, list[str]] = {f"{mode}_paper_recipe": [TWINS[mode][0]]
                                      for mode in ("bf16", "fp32", "fa2", "sfa")}
PAPER_RECIPE["bf16_paper_recipe"] = ["attn_policy=paper"]  # T = 1024: the paper's tiled BF16 kernel, not one block
PAPER_RECIPE["sfa_paper_recipe"] = ["attn_policy=paper_sfa"]
# Fig. 2's FP32 twins run PyTorch's SDPA in FP32, as the first of them did, so that every seed's twin differs from the
# others by its seed alone (fp32_split, FP32_TWIN, is as exact and faster, but came later).
PAPER_RECIPE["fp32_paper_recipe"] = ["attn_backend=sdpa_fp32"]
# Seeds beside 1337, for the fraction of runs whose loss explodes and its survival curve (lpfa.survival): data order and
# initialisation are pure functions of the seed, so a seed's FP32 twin may run in another GPU session.
RECIPE_SEEDS = tuple(range(1, 10))
PAPER_RECIPE.update({f"{mode}_paper_recipe_s{s}": [*PAPER_RECIPE[f"{mode}_paper_recipe"], f"seed={s}", f"init_seed={s}"]
                     for mode in ("bf16", "fp32") for s in RECIPE_SEEDS})
# The isolation rows (Sec. 3.2) at the recipe, where the BF16 loss does explode: each one change from bf16_paper_recipe
# (seed 1337), judged against fp32_paper_recipe. The presets are one-point changes of `paper` (512-key tiles), so the
# tiling stays the BF16 twin's. The outlier heads are layer 1's heads 7 and 9: the two whose W_Q norm had grown most
# against the FP32 twin's, and whose logits were largest, when the BF16 twin's layer 1 ran away (step 2,800,
# results/paper_recipe/h200x2-2026-11-30).
# scores_fp32 (only S in FP32): the worst head's δ error on a captured batch comes from rounding S to BF16
# (lpfa.pages.stabilisers.sr_persistence): does the recipe's BF16 run stay clean with FP32 scores alone?
RECIPE_ISOLATION = ("delta_o_fp32", "pv_fp32", "delta_dp", "o_fp32", "scores_fp32", "fp32_outlier_heads")
PAPER_RECIPE.update({f"{row}_paper_recipe": [f"attn_policy={row}"] for row in RECIPE_ISOLATION[:-1]})
PAPER_RECIPE["fp32_outlier_heads_paper_recipe"] = ["attn_policy=paper", "fp32_heads={1: [7, 9]}"]
# Muon, longer: the Fig. 7 Muon twins, and the BF16/FP32 twins again at 2.5x Muon's default lr.
MUON_LR2 = 0.05
MUON_LONG: dict[str, list[str]] = {
    **SFA_MUON,
    **{f"{mode}_muon_lr2": [*TWINS[mode], "optimizer=muon", f"muon_lr={MUON_LR2}"] for mode in ("bf16", "fp32")},
}
# The rescue: the dose that derails the BF16 run (layer 1's δ error × 128, results/dose) with lpfa.train's
# on_warning: at the first early warning (lpfa.monitor.Alarm on the run's diagnostics, thresholds of
# lpfa.alarms.current_thresholds) the flagged layer switches to SFA or to FP32 attention for the rest of the run.
# Held against the dose table's bias_x128 (same seed and data order), which exploded.
RESCUE_DOSE = 128
RESCUE: dict[str, list[str]] = {f"rescue_{to}_x{RESCUE_DOSE}": [*_dosed(RESCUE_DOSE), f"on_warning={to}"]
                                 for to in ("sfa", "fp32")}
# Stabilisers: each a change of the paper-recipe BF16 run (bf16_paper_recipe, same preset, seed 1337,
# batch and data order), where the BF16 loss explodes and FP32 attention's does not (results/paper_recipe). Stochastic
# rounding changes only the attention's rounding, so it is judged against paper_recipe's fp32_paper_recipe; QK-norm, the
# output gate and the logit soft-cap change the model, so each has its own FP32 twin (the soft-cap's: the FP32 policy on
# split-BF16 tensor cores, fp32_softcap, since SDPA has no cap). QK-clip changes the training (it rescales W_Q and
# W_K), so it has an FP32 twin too; its tau is Kimi K2's (100), above the FP32 twins' layer-1 logits at the recipe
# (at most 84 in 9,920 steps, results/paper_recipe). SFA's row is paper_recipe's sfa_paper_recipe.
# bf16_rerun is bf16_paper_recipe again (same switches, seed and data order): that run kept no checkpoint, so the
# links that need one (lpfa doctor's δ bias and rank-1 similarity, scripts/gpu/paper_recipe.sh DOCTOR_STEP) come from
# this run's step-5,000 checkpoint, the base of every row's ratio; its logged links and explosion step measure a
# rerun's spread.
# fp32_rerun is fp32_paper_recipe again to step 5,000, for the same reason: its checkpoint gives the FP32 twin's
# doctor links at the BF16 rerun's step (and lpfa doctor's page its no-alarm example); it is bf16_rerun's reference.
QK_CLIP_TAU = 100.0
STABILISER_RERUN, FP32_RERUN = "bf16_rerun", "fp32_rerun"
RERUNS = (STABILISER_RERUN, FP32_RERUN)  # the base runs again: no stabiliser rows
MUON_BASE = ("bf16_muon_recipe", "fp32_muon_recipe")  # the recipe with Muon, no stabiliser: the Muon QK-clip rows' base
BASES = (*RERUNS, *MUON_BASE)  # the STABILISERS rows that carry no stabiliser
RERUN_STOP = 5000  # fp32_rerun's last step: the doctor's step (scripts/gpu/paper_recipe.sh DOCTOR_STEP)
_STABILISER_BASE = {"bf16": PAPER_RECIPE["bf16_paper_recipe"][0], "fp32": FP32_TWIN}  # each row's attention, as run
STABILISERS: dict[str, list[str]] = {
    STABILISER_RERUN: list(PAPER_RECIPE["bf16_paper_recipe"]),
    FP32_RERUN: [FP32_TWIN, f"stop_at_step={RERUN_STOP}"],
    "sr": ["attn_policy=paper_sr"],
    **{f"{mode}_{name}": [_STABILISER_BASE[mode], switch]
       for name, switch in (("qknorm", "qk_norm=true"), ("gated", "gated_attn=true"),
                            ("qkclip", f"qk_clip={QK_CLIP_TAU:g}"))
       for mode in ("bf16", "fp32")},
    "bf16_softcap": ["attn_policy=paper_softcap"],
    "fp32_softcap": ["attn_policy=fp32_softcap"],
    # QK-clip is Kimi K2's MuonClip: the clip with Muon as well, held against the recipe with Muon and no clip
    **{f"{mode}_{name}": [_STABILISER_BASE[mode], *switch, "optimizer=muon"]
       for name, switch in (("muon_recipe", []), ("qkclip_muon", [f"qk_clip={QK_CLIP_TAU:g}"]))
       for mode in ("bf16", "fp32")},
    # sr exploded before the BF16 run (results/stabilisers/h200-2026-12-02). Its rounding is a hash of position and
    # value under one seed, so a stable value at a stable position rounds the same way every step: does SR drawn
    # afresh each step (lpfa.train's sr_reseed; eager, since a new seed is a new policy to torch.compile) behave
    # differently?
    "sr_reseed": ["attn_policy=paper_sr", "sr_reseed=true", "compile=false"],
    # the δ error traces to the BF16 scores (page 17), which sr rounds to nearest: the scores alone rounded
    # stochastically, every other rounding as in the BF16 run
    "sr_scores": ["attn_policy=paper_sr_scores"],
}
# A second seed for the rows whose verdicts decide page 17's conclusions (QK-norm, gated attention and QK-clip, BF16
# and FP32; stochastic rounding): the plain BF16 recipe run's fate changes with the seed (results/paper_recipe), so
# a verdict from one seed is one observation. Each is its seed-1337 row with the seed of paper_recipe's
# bf16_paper_recipe_s<s> / fp32_paper_recipe_s<s>, its base; a seed changes no cost (benchmarks/stabiliser_cost.py
# times the seed-1337 rows).
STABILISER_SEEDS = (1,)
SEEDED_STABILISERS = ("sr", *(f"{mode}_{name}" for name in ("qknorm", "gated", "qkclip") for mode in ("bf16", "fp32")))
STABILISERS.update({f"{label}_s{s}": [*STABILISERS[label], f"seed={s}", f"init_seed={s}"]
                    for s in STABILISER_SEEDS for label in SEEDED_STABILISERS})


def stabiliser_seed(label: str) -> tuple[str, int | None]:
    """``("bf16_qknorm", 1)`` for ``bf16_qknorm_s1``: a stabiliser row's seed-1337 label and its other seed (None for a
    seed-1337 row)."""
    head, _, tail = label.rpartition("_s")
    if head in SEEDED_STABILISERS and tail.isdigit() and int(tail) in STABILISER_SEEDS:
        return head, int(tail)
    return label, None
# The mechanism on the run that fails (Figs. 3-6, 11, 13 at the recipe): bf16_paper_recipe again with a checkpoint
# every 500 steps kept, so that the instrumented replay (lpfa.replay) can start about 1,000 steps before the explosion,
# and diagnostics every 100 steps. bf16_mechanism ran eagerly (results/mechanism/h200-2026-12-04), since the replay
# then followed only eager runs bit for bit; its loss had not exploded by step 6,310. bf16_mechanism_compiled trains
# compiled, as the recipe runs do; its loss exploded at step 6,787 (results/mechanism/h200-2026-12-06), but its replay,
# compiled in another process, parted from it at the second step and did not explode. bf16_mechanism_deterministic
# adds lpfa.train's deterministic=true, which asks torch.compile and torch for kernels that compute the same bits in
# every process (tests/test_train_gpu.py checks it on a GPU); its loss exploded at step 4,933 and its replay followed
# it bit for bit through the explosion (results/mechanism/h100-2026-12-06). Each BF16 row's FP32 twin (the same
# suffix, else fp32_mechanism) runs to step 4,000 and is replayed with the BF16 run's policy measured on its
# trajectory: the control of Fig. 5. scripts/gpu/mechanism.py runs a BF16 row, its twin and their replays.
MECHANISM_CKPT, MECHANISM_TWIN_STOP = 500, 4000
# The replay the book's mechanism pages (02-04) and scorecard read by default: results/mechanism/<the latest run that
# holds it>/MECHANISM_REPLAY. The notebooks' parameter cells carry the same literal (a test checks it).
MECHANISM_REPLAY = "bf16_mechanism_deterministic_replay"
# its control: the FP32 twin replayed with the BF16 policy measured (page 02 holds the two against each other)
MECHANISM_CONTROL = "fp32_mechanism_deterministic_replay"
_MECHANISM_KEEP = [f"ckpt_interval={MECHANISM_CKPT}", "ckpt_history=true", "diag_interval=100"]
_TWIN_STOP = [f"ckpt_interval={MECHANISM_TWIN_STOP}", f"stop_at_step={MECHANISM_TWIN_STOP}", "diag_interval=100"]
MECHANISM: dict[str, list[str]] = {
    "bf16_mechanism": [*PAPER_RECIPE["bf16_paper_recipe"], "compile=false", *_MECHANISM_KEEP],
    "bf16_mechanism_compiled": [*PAPER_RECIPE["bf16_paper_recipe"], "compile=true", *_MECHANISM_KEEP],
    "bf16_mechanism_deterministic": [*PAPER_RECIPE["bf16_paper_recipe"], "compile=true", "deterministic=true",
                                     *_MECHANISM_KEEP],
    "fp32_mechanism": [*PAPER_RECIPE["fp32_paper_recipe"], "compile=true", *_TWIN_STOP],
    "fp32_mechanism_deterministic": [*PAPER_RECIPE["fp32_paper_recipe"], "compile=true", "deterministic=true",
                                     *_TWIN_STOP],
}
# What each run changes, in the paper's words (the rows of the isolation table, the seeds and Muon pages).
DESCRIPTIONS: dict[str, str] = {
    "bf16": ("BF16 flash attention everywhere, one 512-key block (the paper's run whose loss explodes; also its "
             "'no tiling' row)"),
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
    **{k: f"{'BF16' if k.startswith('bf16') else 'FP32'} attention, seed {k.split('_s')[1]} (data order and init)"
       for k in SEEDS},
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
       for m in ("bf16", "fp32") for s in RECIPE_SEEDS},
    **{f"{row}_paper_recipe": f"{desc}; the paper's GPT-2 S recipe" for row, desc in (
        ("delta_o_fp32", "δ from O recomputed in FP32 in the backward, from the forward's BF16 scores"),
        ("pv_fp32", "P̄ and P̄V in FP32 (the running and stored O still BF16)"),
        ("delta_dp", "δ = rowsum(dP∘P) instead of rowsum(dO∘O)"),
        ("o_fp32", "O in FP32: Ō, the running output and the stored O (P̄ still BF16)"),
        ("scores_fp32", "only the scores S in FP32, every later rounding as the BF16 run"),
        ("fp32_outlier_heads", "FP32 O for only the outlier heads 7 and 9 of layer 1"))},
    **{f"rescue_{to}_x{RESCUE_DOSE}": (f"BF16 attention, layer {DOSE_LAYER}'s δ error × {RESCUE_DOSE} with its "
                                       "sign; at the first early warning the flagged layer switches to "
                                       f"{'SFA' if to == 'sfa' else 'FP32 attention'}")
       for to in ("sfa", "fp32")},
    STABILISER_RERUN: ("bf16_paper_recipe run again, keeping its step-5,000 checkpoint for lpfa doctor (the base of "
                       "the δ-bias and similarity links)"),
    FP32_RERUN: (f"fp32_paper_recipe run again to step {RERUN_STOP:,}, keeping that checkpoint for lpfa doctor "
                 "(the FP32 twin's δ-bias and similarity links)"),
    "sr": ("BF16 flash attention with Ō, the running o and l and O rounded stochastically (unbiased: a hash of "
           "position and value under one fixed seed, not redrawn per step), the paper's GPT-2 S recipe"),
    "sr_reseed": "as sr, with the stochastic rounding drawn afresh each step (sr_seed + step; eager, not compiled)",
    "sr_scores": ("BF16 flash attention with the scores S (the QKᵀ output and its product with the scale) rounded "
                  "stochastically, every other rounding to nearest, the paper's GPT-2 S recipe"),
    **{f"{m}_{name}": f"{'BF16' if m == 'bf16' else 'FP32'} attention with {what}, the paper's GPT-2 S recipe"
       for name, what in (("qknorm", "QK-norm (LayerNorm on q and k per head)"),
                          ("gated", "a sigmoid output gate per head and channel"),
                          ("softcap", "logits soft-capped at 50 (Gemma 2)"),
                          ("qkclip", f"QK-clip at τ = {QK_CLIP_TAU:g} (Kimi K2's MuonClip: W_Q, W_K of a head scaled "
                                     "by √(τ / its largest logit) after each step it exceeds τ)"))
       for m in ("bf16", "fp32")},
    **{f"{m}_muon_recipe": (f"{'BF16' if m == 'bf16' else 'FP32'} attention, Muon optimizer, the paper's GPT-2 S "
                            "recipe (the base of the Muon QK-clip rows)")
       for m in ("bf16", "fp32")},
    **{f"{m}_qkclip_muon": (f"{'BF16' if m == 'bf16' else 'FP32'} attention with QK-clip at τ = {QK_CLIP_TAU:g} and "
                            "the Muon optimizer (Kimi K2's MuonClip), the paper's GPT-2 S recipe")
       for m in ("bf16", "fp32")},
    "bf16_mechanism": "bf16_paper_recipe again, eager, a checkpoint every 500 steps kept: replayed up to its explosion",
    "bf16_mechanism_compiled": ("bf16_paper_recipe again, compiled, a checkpoint every 500 steps kept: replayed up to "
                                "its explosion"),
    "bf16_mechanism_deterministic": ("bf16_paper_recipe again, compiled with deterministic kernels, a checkpoint every "
                                     "500 steps kept: replayed up to its explosion"),
    "fp32_mechanism": f"fp32_paper_recipe again to step {MECHANISM_TWIN_STOP:,}: replayed from there as the control",
    "fp32_mechanism_deterministic": (f"fp32_paper_recipe again, compiled with deterministic kernels, to step "
                                     f"{MECHANISM_TWIN_STOP:,}: replayed from there as the control"),
    "bf16_muon_lr2": f"BF16 attention, Muon optimizer at Muon lr {MUON_LR2}",
    "fp32_muon_lr2": f"FP32 attention, Muon optimizer at Muon lr {MUON_LR2}",
}
DESCRIPTIONS.update({f"{label}_s{s}": f"{DESCRIPTIONS[label]}; seed {s}" for s in STABILISER_SEEDS
                     for label in SEEDED_STABILISERS})
EXPERIMENTS: dict[str, dict[str, list[str]]] = {"twins": TWINS, "isolation": ISOLATION, "seeds": SEEDS,
                                                 "sfa_muon": SFA_MUON, "sizes": SIZES, "dose": DOSE,
                                                 "paper_recipe": PAPER_RECIPE, "muon_long": MUON_LONG, "rescue": RESCUE,
                                                 "stabilisers": STABILISERS, "mechanism": MECHANISM}
EXPERIMENT_PRESETS: dict[str, str] = {"paper_recipe": "gpt2-s-paper", "stabilisers": "gpt2-s-paper",
                                      "mechanism": "gpt2-s-paper"}  # the rest: "repro"


@dataclass(frozen=True)
class Row:
    """One run of an experiment: ``overrides`` (key=value for ``lpfa.train`` on top of the experiment's preset),
    ``description`` (what it changes, in the paper's words), ``paper`` (what the paper reports for it: "loss exploded",
    "neither", "not reported", or None when the paper has no such row) and ``reference`` (the label of the stable run of
    the same experiment it is judged against, None for a reference itself)."""

    experiment: str
    label: str
    overrides: tuple[str, ...]
    description: str
    paper: str | None
    reference: str | None


def _reference(experiment: str, label: str) -> str | None:
    """The stable run a row is held against: ``fp32`` in the one-change tables (isolation, twins, dose: in the dose
    experiment it is the isolation table's, see :func:`lpfa.dose.committed_runs`); elsewhere the FP32 run with the
    same suffix (``bf16_muon`` -> ``fp32_muon``, ``bf16_paper_recipe_s1`` -> ``fp32_paper_recipe_s1``; a mechanism
    row without one -> ``fp32_mechanism``)."""
    if experiment == "paper_recipe" and label.removesuffix("_paper_recipe") in RECIPE_ISOLATION:
        return "fp32_paper_recipe"
    if label.startswith("fp32"):
        return None
    if experiment in ("isolation", "twins", "dose"):
        return "fp32"
    twin = "fp32" + label[label.index("_"):] if "_" in label else "fp32"
    if twin in EXPERIMENTS[experiment]:
        return twin
    return "fp32_mechanism" if experiment == "mechanism" else None  # the mechanism's one twin without a suffix


def _paper_outcome(experiment: str, label: str) -> str | None:
    """What the paper reports for a row (:data:`PAPER_ISOLATION`): the isolation rows, also at the recipe."""
    if experiment == "isolation":
        return PAPER_ISOLATION.get(label)
    if experiment == "paper_recipe" and label.removesuffix("_paper_recipe") in RECIPE_ISOLATION:
        return PAPER_ISOLATION[label.removesuffix("_paper_recipe")]
    return None


def rows(experiment: str) -> dict[str, Row]:
    """``{label: Row}`` of one experiment of :data:`EXPERIMENTS`."""
    if experiment not in EXPERIMENTS:
        raise ValueError(f"unknown experiment {experiment!r}: choose one of {sorted(EXPERIMENTS)}")
    return {label: Row(experiment, label, tuple(o), DESCRIPTIONS.get(label, ""),
                       _paper_outcome(experiment, label), _reference(experiment, label))
            for label, o in EXPERIMENTS[experiment].items()}


def table(experiments=None):
    """Every row of ``experiments`` (default: all) as one DataFrame indexed by (experiment, label), with the preset."""
    out = []
    for exp in experiments or EXPERIMENTS:
        for r in rows(exp).values():
            out.append({"experiment": exp, "label": r.label, "preset": EXPERIMENT_PRESETS.get(exp, "repro"),
                        "overrides": " ".join(r.overrides), "description": r.description, "paper": r.paper,
                        "reference": r.reference})
    return pd.DataFrame(out).set_index(["experiment", "label"])
