"""Page 02, the δ bias (Fig. 5): is δ_lp − δ_hp (Eq. 4) biased in an instrumented replay (:mod:`lpfa.replay`), do
rows with several ``p_bar == 1`` entries carry it, and does it hold along the BF16 trajectory? Also the replay's
description and loader, which pages 03 and 04 share."""

from __future__ import annotations

import json
from pathlib import Path

import matplotlib.pyplot as plt
import pandas as pd

from lpfa.compare import same_recipe_runs
from lpfa.explosion import RunawayCriterion
from lpfa.pages import and_join, plural, setting_of
from lpfa.params import dict_of, optional, text
from lpfa.plotting import COLORS, format_table, use_style
from lpfa.replay import bias_test, choose_layer_heads, delta_bias_frame, detail_steps, load_replay
from lpfa.results import file_run, run_dir, runs
from lpfa.run import Run, runaway_onset

# the notebook's papermill parameters, checked right after its parameters cell (lpfa.params.check_params)
# the parameters of a page drawn from one instrumented replay (pages 02-04): where the replay is
REPLAY_PARAMS = {"experiment": text(nonempty=True), "run": optional(text(nonempty=True)), "replay": text(nonempty=True)}
PARAMS = {**REPLAY_PARAMS, "control": text(), "compare": dict_of(text(nonempty=True), text(nonempty=True))}

STRONG_T = 3  # a t statistic below this in every head: the replay's bias is weak
SAME_SIGN_CHANCE = 0.6  # V one-signed at the tied keys below this share in every head: about what random signs give


def replay_dir(experiment: str, run: str | None, replay: str, root=None) -> Path:
    """The replay folder ``replay`` of run ``run`` of ``results/<experiment>``; with ``run`` None, of the latest run
    that holds it (:func:`lpfa.results.file_run`), so that a later run with another replay does not hide it."""
    return (run_dir(experiment, run, root) if run is not None else
            file_run(experiment, f"{replay}/replay.json", root)) / replay


def open_replay(experiment: str, run: str | None, replay: str) -> tuple[Path, dict, dict]:
    """``(folder, result, arrays)`` of the replay folder ``replay`` in run ``run`` of ``results/<experiment>`` (None:
    the latest run that holds it), read by :func:`lpfa.replay.load_replay`: the parameters of pages 02–04."""
    folder = replay_dir(experiment, run, replay)
    result, arrays = load_replay(folder)
    return folder, result, arrays


def detail_step(arrays: dict, head: int, step: int | None = None) -> int:
    """``step`` if ``head`` was measured in detail there (default: its first detail step,
    :func:`lpfa.replay.detail_steps`), else a ValueError naming the steps there are."""
    steps = detail_steps(arrays, head)
    if step is None and steps:
        return steps[0]
    if step not in steps:
        raise ValueError(
            f"head {head}, step={step!r}: expected a step this replay measured in detail for that head, one of {steps}"
        )
    return step


def replay_run(result: dict, replay_folder) -> Path | None:
    """The run folder a replay replayed, where it was committed beside the replay (None if it was not)."""
    run_folder = Path(replay_folder).parent / Path(result["run"]).name
    return run_folder if (run_folder / "config.json").is_file() else None


def describe(result: dict, replay_folder=None) -> str:
    """One paragraph (Markdown) saying what a replay measured: which run and in which setting, from which checkpoint
    relative to the run's explosion or logit runaway, which layer and heads and why, whether the replayed losses
    equal the run's, with its commit and date. ``replay_folder``: where the replay lies, to read the run beside it."""
    v, ck = result["verdict"], result["checkpoint_step"]
    ra = v.get("runaway_step")
    run_folder = replay_run(result, replay_folder) if replay_folder is not None else None
    choice = result.get("choice", {"layer": "wq_growth", "heads": "wq_growth"})  # replays before the field: automatic
    onset = choice.get("onset")
    if onset is None and ra is None and not v["exploded"] and run_folder is not None:
        onset = runaway_onset(run_folder)
    if run_folder is not None:  # the run may have gone on after the replay was made (a resume): its verdict now
        v = {**v, **Run(run_folder).verdict()}
        ra = v.get("runaway_step")
    if v["exploded"]:
        where = (
            f"before its loss exploded at step {v['explosion_step']:,}"
            if ck < v["explosion_step"]
            else f"after its loss exploded at step {v['explosion_step']:,}"
        )
    else:
        where = (
            ""
            if ra is None
            else (
                f"before its logits ran away at step {ra:,}; "
                if ck < ra
                else f"{ck - ra:,} steps after its logits ran away at step {ra:,}; "
            )
        )
        if ra is None and onset:
            logit = RunawayCriterion().logit
            where += (
                f"{'before' if ck < onset[0] else f'{ck - onset[0]:,} steps after'} layer {onset[1]}'s largest "
                f"logit first passed {logit:g} at step {onset[0]:,}, too late in the run for the runaway "
                "verdict; "
            )
        where += f"its loss did not explode in its {v['steps']:,} steps"
    why_layer = {
        "runaway": "the layer whose logits ran away (or began to)",
        "wq_growth": "the layer whose W_Q norm grew most",
        "given": "chosen by hand",
    }[choice["layer"]]
    why_heads = "its fastest-growing W_Q heads" if choice["heads"] == "wq_growth" else "chosen by hand"
    if run_folder is not None and choice["layer"] == "given" and result["layer"] == v.get("runaway_layer"):
        why_layer = "the layer whose logits ran away"
    last = ck + result["steps"] - 1
    if (
        run_folder is not None
        and choice["heads"] == "given"
        and choose_layer_heads(run_folder, len(result["heads"]), result["layer"], until=last)[1] == result["heads"]
    ):
        why_heads = f"its fastest-growing W_Q heads up to step {last:,}"
    setting = f", {setting_of(Run(run_folder).train)}" if run_folder is not None else ""
    measured = (
        f"; measured with `{result['policy']}` attention, which the run did not train with"
        if result.get("own_policy", result.get("policy")) != result.get("policy")
        else ""
    )
    ag = result.get("agreement")
    follows = (
        f" Every replayed loss equals the loss the run logged at that step ({ag['bit_equal']:,} of "
        f"{ag['compared']:,}): the measures are the run's own steps."
        if ag and ag["compared"] and ag["bit_equal"] == ag["compared"]
        else f" The replayed losses equal the run's at {ag['bit_equal']:,} of {ag['compared']:,} steps (the first "
        f"difference at step {ag['first_mismatch']:,})."
        if ag and ag["compared"]
        else ""
    )
    if result.get("measured_by") == "side pass":
        follows += (" The run was compiled"
                    + (" with deterministic kernels (`deterministic=true`)" if result.get("deterministic") else "")
                    + ", and so is its replay; the layer is measured by an eager forward and "
                    "backward at each step's weights just before the step (their gradients dropped), so its q, k, v "
                    "and dO may differ from the compiled step's in their last bits.")
    prov = result["provenance"]
    return (
        f"Instrumented replay of `{result['run'].split('/')[-1]}` ({v['policy']}{setting}): {result['steps']:,} "
        f"training steps from its checkpoint at step {ck:,} ({where}), measuring layer {result['layer']} "
        f"({why_layer}) and heads {', '.join(map(str, result['heads']))} ({why_heads}) on {result['n_seq']} "
        f"sequences of each batch{measured}.{follows} Commit `{prov['git_commit']}`, {prov['date_utc']}; "
        "`python -m lpfa.replay --run <run folder> --out <folder>` makes one on the GPU that trained the run "
        "(`scripts/gpu/mechanism.py` trains the recipe run and replays it)."
    )


def parted_replays(experiment: str, root=None) -> list[dict]:
    """Every committed replay of ``experiment`` whose losses did not all equal its run's (``agreement``,
    :func:`lpfa.replay.loss_agreement`), with its run committed beside it: ``replay`` (its folder), ``run`` (the run's
    name), ``compiled``, ``deterministic``, the ``agreement``, the run's ``verdict``, and the largest loss over the
    replayed steps, the replay's (``replay_max``) and the run's (``run_max``). Such a replay measured another
    trajectory than the run's, so no page reads it as the run's mechanism."""
    out = []
    for r in runs(experiment, root):
        for path in sorted(r.glob("*/replay.json")):
            result = json.loads(path.read_text())
            ag = result.get("agreement") or {}
            run_folder = replay_run(result, path.parent)
            if not ag.get("compared") or ag["bit_equal"] == ag["compared"] or run_folder is None:
                continue
            run = Run(run_folder)
            steps = {p["step"] for p in result["per_step"]}
            logged = [rec["loss"] for rec in run.records if rec.get("step") in steps and "loss" in rec]
            out.append({"replay": path.parent, "run": run_folder.name, "compiled": bool(result.get("compiled")),
                        "deterministic": bool(result.get("deterministic")), "agreement": ag,
                        "verdict": run.verdict(), "checkpoint_step": result["checkpoint_step"],
                        "steps": result["steps"], "replay_max": max(p["loss"] for p in result["per_step"]),
                        "run_max": max(logged) if logged else None})
    return out


def parted_text(parted: list[dict]) -> str:
    """:func:`parted_replays` in sentences (Markdown): where each replay left its run, and whether the run's loss
    exploded over the replayed steps while the replay's did not. "" when every committed replay followed its run."""
    parts = []
    for p in parted:
        ag, v = p["agreement"], p["verdict"]
        window = p["checkpoint_step"] <= (v["explosion_step"] or -1) < p["checkpoint_step"] + p["steps"]
        parts.append(
            f"`{p['run']}` ({'compiled' if p['compiled'] else 'eager'}"
            + (", deterministic kernels" if p["deterministic"] else "") + ")"
            + (f", whose loss exploded at step {v['explosion_step']:,}," if v["exploded"] else "")
            + f" was replayed from its step-{p['checkpoint_step']:,} checkpoint for {p['steps']:,} steps; the replayed "
            f"losses equal the run's at {ag['bit_equal']:,} of {ag['compared']:,} steps (the first difference at step "
            f"{ag['first_mismatch']:,})"
            + (f", and the replay's largest loss was {p['replay_max']:.2f} where the run's reached {p['run_max']:.2f}"
               if window and p["run_max"] is not None else "")
        )
    if not parts:
        return ""
    return ("Not every replay follows its run. " + "; ".join(parts) + ". Such a replay measures a trajectory of its "
            "own, not the run's, and the book's mechanism pages do not read it. A compiled run's kernels need not "
            "round alike in two processes; `lpfa.train`'s `deterministic=true` asks for kernels that do, and the "
            "replay of such a run applies it.")


def plot_delta_bias(result: dict, control: dict | None = None):
    """Fig. 5a: the running sum over replayed steps of Σ_T (δ_lp − δ_hp)[T], split by row kind, per head
    (:func:`lpfa.replay.delta_bias_frame`); with ``control`` (the FP32 twin's replay with the BF16 policy measured,
    :func:`open_control`), its running sum over all rows in the same heads."""
    use_style()
    f = delta_bias_frame(result)
    c = delta_bias_frame(control) if control is not None else None
    boom = result["verdict"].get("explosion_step")
    heads = sorted(f["head"].unique())
    fig, axes = plt.subplots(1, len(heads), figsize=(min(7.0, 3.5 * len(heads)), 3.6), squeeze=False, sharey=True)
    for ax, h in zip(axes[0], heads):
        g = f[f["head"] == h]
        ax.plot(g.step, g["cumulative all"], color=COLORS["bf16"], label="BF16 run: all rows")
        ax.plot(g.step, g["cumulative tied rows"], color=COLORS["bf16"], ls="--", label="BF16 run: rows with ≥ 2 P̄ = 1")
        ax.plot(g.step, g["cumulative other rows"], color=COLORS["neutral"], ls=":", label="BF16 run: other rows")
        if c is not None and h in set(c["head"]):
            gc = c[c["head"] == h]
            ax.plot(gc.step, gc["cumulative all"], color=COLORS["fp32"], label="FP32 twin, BF16 policy: all rows")
        ax.axhline(0, color="black", lw=0.5)
        if boom is not None and g.step.min() <= boom <= g.step.max():
            ax.axvline(boom, color="black", lw=0.8, ls="-.", label="BF16 loss exploded")
        ax.set_title(f"layer {result['layer']}, head {h}", fontsize=9)
        ax.set_xlabel("step")
    axes[0, 0].set_ylabel("cumulative Σ_T (δ_lp − δ_hp)[T]")
    axes[0, 0].legend(fontsize=9)
    return fig


def plot_worst_token(arrays: dict, head: int, step: int | None = None):
    """Figs. 5b, c: dO[T, :] and O_lp[T, :] − O_hp[T, :] per feature, and their product (which sums to δ_lp − δ_hp),
    for the token with the largest |δ error| of ``head`` at ``step`` (default: the first detail step,
    :func:`lpfa.replay.detail_steps`), titled with both."""
    step = detail_step(arrays, head, step)
    use_style()
    do, err = arrays[f"h{head}_s{step}_worst_do"], arrays[f"h{head}_s{step}_worst_o_err"]
    fig, axes = plt.subplots(3, 1, figsize=(7.0, 5.6), sharex=True)  # one above the other: the page's width
    axes[0].bar(range(len(do)), do, color=COLORS["neutral"])
    axes[0].set_title("dO[T, i]", fontsize=9)
    axes[1].bar(range(len(err)), err, color=COLORS["bf16"])
    axes[1].set_title("O_lp[T, i] − O_hp[T, i]", fontsize=9)
    axes[2].bar(range(len(err)), do * err, color=COLORS["sfa"])
    axes[2].set_title("dO ∘ (O_lp − O_hp): sums to δ_lp − δ_hp", fontsize=9)
    axes[2].set_xlabel("feature i")
    for ax in axes:
        ax.axhline(0, color="black", lw=0.5)
    fig.suptitle(f"head {head}, step {step}", fontsize=9)
    return fig


def bias_table(result: dict) -> pd.DataFrame:
    """:func:`lpfa.replay.bias_test` of a replay as a table, one row per head."""
    return pd.DataFrame(bias_test(result)).T


def bias_text(result: dict) -> str:
    """Page 02's finding (Markdown) from :func:`lpfa.replay.bias_test`: per head, how often and how significantly
    Σ_T (δ_lp − δ_hp)[T] is positive, the tied rows' share of rows and of the cumulative error, and how often V is
    one-signed at the ``p_bar == 1`` keys; whether the sign agrees with the paper's, and that share against chance
    (:data:`SAME_SIGN_CHANCE`)."""
    test = bias_test(result)
    lines = [
        f"* **head {h}**: Σ_T (δ_lp − δ_hp)[T] is positive in {r['positive_fraction']:.0%} of {r['steps']} steps; "
        f"its mean per step, {r['mean']:.2e} (95% interval {r['ci_low']:.2e} to {r['ci_high']:.2e}), is "
        f"{r['t']:.1f} standard errors from zero. Rows "
        f"with at least two P̄ = 1 entries are {r['tied_row_fraction']:.0%} of the rows and carry "
        f"{r['share_tied']:.0%} of the cumulative error; at their P̄ = 1 keys, V has one sign in "
        f"{r['same_sign']:.0%} of (row, feature) pairs."
        for h, r in test.items()
    ]
    sign_ok = all(r["t"] > 0 for r in test.values())
    return (
        "**Measured.**\n\n"
        + "\n".join(lines)
        + (
            "\n\nThe sign agrees with the paper (δ_lp − δ_hp > 0 on average). "
            if sign_ok
            else "\n\nThe sign does not agree with the paper in every head (it finds δ_lp − δ_hp > 0 on average). "
        )
        + 'The tied-row share is the counterfactual "tied rows computed exactly": without their contribution the '
        "cumulative error would be the remainder. "
        + (
            "For scale: two keys of independent random sign agree half the time, three a quarter. At the tied keys "
            "V shares a sign about that often here, and V's columns are rarely one-signed (the tie-frequency page "
            "logs it over training), so the same-sign V of the paper's Fig. 6 is not a standing property of V in "
            "this run; the tied rows carry the bias all the same."
            if max(r["same_sign"] for r in test.values()) < SAME_SIGN_CHANCE
            else "For scale: two keys of independent random sign agree half the time, three a quarter; V at the tied "
            "keys shares a sign more often than that."
        )
    )


def open_control(experiment: str, run: str | None, control: str) -> dict | None:
    """The control replay ``control`` (an FP32 twin replayed with the BF16 policy measured,
    ``lpfa.experiments.MECHANISM_CONTROL``) of run ``run`` of ``results/<experiment>`` (None: the latest run that holds
    it); None for ``control == ""``."""
    return load_replay(replay_dir(experiment, run, control))[0] if control else None


def control_table(result: dict, control: dict) -> pd.DataFrame:
    """:func:`lpfa.replay.bias_test` of the BF16 run's replay and of its control, one row per trajectory and head: the
    steps, the share of positive steps, the mean per step with its 95% interval and t, and the share of tied rows."""
    rows = []
    for name, res in (("BF16 run", result), ("FP32 twin, BF16 policy measured", control)):
        for h, r in bias_test(res).items():
            rows.append({"trajectory": name, "head": h,
                         "steps": f"{res['checkpoint_step']:,}–{res['checkpoint_step'] + r['steps'] - 1:,}",
                         "positive steps": r["positive_fraction"], "mean per step": r["mean"],
                         "95% interval": f"{r['ci_low']:.1e} to {r['ci_high']:.1e}", "t": r["t"],
                         "tied rows": r["tied_row_fraction"]})
    return pd.DataFrame(rows).set_index(["trajectory", "head"])


def style_control(table: pd.DataFrame):
    """:func:`control_table` for the page (:func:`lpfa.plotting.format_table`): shares as percentages."""
    return format_table(table, percent=("positive steps", "tied rows"), digits=2)


def control_text(result: dict, control: dict) -> str:
    """Page 02's reading of :func:`control_table` (Markdown): per head, the mean δ error per step and its t on the BF16
    run against the same heads measured with the BF16 policy on the FP32 twin's trajectory, and how often rows are
    tied on each."""
    bf, fp = bias_test(result), bias_test(control)
    heads = [h for h in bf if h in fp]
    if not heads:
        return ""
    lines = [
        f"* **head {h}**: mean {bf[h]['mean']:.2e} per step (t = {bf[h]['t']:.1f}) on the BF16 run, "
        f"{fp[h]['mean']:.2e} (t = {fp[h]['t']:.1f}) on the FP32 twin's trajectory; tied rows "
        f"{bf[h]['tied_row_fraction']:.0%} of rows against {fp[h]['tied_row_fraction']:.1%}."
        for h in heads
    ]
    strong = [h for h in heads if bf[h]["t"] > STRONG_T]
    if not strong:
        reading = f"No head's bias on the BF16 run reaches t = {STRONG_T}, so the control cannot separate the two."
    else:
        clear = f"head{'s' * (len(strong) > 1)} {and_join(list(map(str, strong)))}"
        if all(abs(fp[h]["t"]) < STRONG_T for h in strong):
            reading = (f"Where the BF16 run's bias is clear ({clear}), the same rounding on the FP32 trajectory shows "
                       f"none: its t stays below {STRONG_T}. In this one pair of runs (one seed), the bias comes with "
                       "BF16 rounding on the weights that BF16 training made, where rows with tied maxima are common, "
                       "and not with the same rounding on weights that FP32 attention trained.")
        else:
            reading = (f"Where the BF16 run's bias is clear ({clear}), the same rounding on the FP32 trajectory is "
                       "biased as well: in this pair of runs the bias does not need the weights that BF16 training "
                       "made.")
    return (
        f"**The control.** The FP32 twin trained on the same batches from the same initial weights to step "
        f"{control['checkpoint_step']:,} and was continued from there by the replay for {control['steps']:,} steps "
        f"(to step {control['checkpoint_step'] + control['steps'] - 1:,}; the BF16 run's replay spans steps "
        f"{result['checkpoint_step']:,}–{result['checkpoint_step'] + result['steps'] - 1:,}), its own FP32 attention "
        "training it and the BF16 run's policy measured in the same heads: what BF16 flash attention would have "
        "computed on a trajectory that FP32 attention shaped.\n\n" + "\n".join(lines) + "\n\n" + reading
    )


def trajectory_replays(compare: dict) -> dict:
    """The replays named by ``compare`` (``{"experiment" or "experiment/run": replay folder}``, the latest run where
    none is named), each labelled ``experiment/run``, in that order."""
    replays = {}
    for name, rep in compare.items():
        exp, _, name_run = name.partition("/")
        folder = run_dir(exp, name_run or None)
        replays[f"{exp}/{folder.name}"] = load_replay(folder / rep)[0]
    return replays


def trajectory_table(replays: dict) -> pd.DataFrame:
    """:func:`lpfa.replay.bias_test` of every replay of :func:`trajectory_replays`, one row per checkpoint step and
    head: the replayed steps, the share of positive steps, t, the tied rows' share of rows and of the error, and how
    often V is one-signed at ``p_bar == 1``."""
    rows = [
        {
            "checkpoint step": res["checkpoint_step"],
            "experiment": name,
            "layer": res["layer"],
            "head": h,
            "steps": r["steps"],
            "positive steps": r["positive_fraction"],
            "t": r["t"],
            "tied rows": r["tied_row_fraction"],
            "share of error from tied rows": r["share_tied"],
            "V one-signed at P̄ = 1": r["same_sign"],
        }
        for name, res in replays.items()
        for h, r in bias_test(res).items()
    ]
    return pd.DataFrame(rows).sort_values(["checkpoint step", "head"]).set_index(["checkpoint step", "head"])


def style_trajectory(table: pd.DataFrame):
    """:func:`trajectory_table` for the page (:func:`lpfa.plotting.format_table`): shares as percentages."""
    return format_table(table, percent=("positive steps", "tied rows", "share of error from tied rows",
                                        "V one-signed at P̄ = 1"), digits=2)


def trajectory_text(table: pd.DataFrame) -> str:
    """Page 02's reading of :func:`trajectory_table`: per checkpoint, each head's share of positive steps, t and the
    tied rows' share of the error; where the bias is strongest, the checkpoints where no head's t reaches
    :data:`STRONG_T`, and whether every replay has the paper's sign and tied rows carrying most of the error."""
    lines = [
        f"* step {step:,} (`{g['experiment'].iloc[0]}`): "
        + "; ".join(
            f"head {h}: positive in {row['positive steps']:.0%} of steps, t = {row['t']:.1f}, tied rows carry "
            f"{row['share of error from tied rows']:.0%} of the error"
            for (_, h), row in g.iterrows()
        )
        for step, g in table.groupby(level=0)
    ]
    best = table["t"].idxmax()
    weak = [f"{s:,}" for s, g in table.groupby(level=0) if (g["t"] < STRONG_T).all()]
    return (
        "\n".join(lines) + f"\n\nThe bias is strongest at step {best[0]:,} (head {best[1]}, t = "
        f"{table['t'].max():.1f})"
        + (
            f"; at {plural(len(weak), 'step')} {', '.join(weak)} no head's t statistic reaches {STRONG_T}"
            if weak
            else ""
        )
        + ". "
        + (
            "In every replay and head the mean is positive, the paper's sign"
            if (table["t"] > 0).all()
            else "Not every replay and head has the paper's sign (a positive mean)"
        )
        + (
            ", and rows with tied maxima carry most of the error."
            if (table["share of error from tied rows"] > 0.5).all()
            else "; rows with tied maxima do not carry most of the error everywhere."
        )
    )


def reruns_text(result: dict, replay_folder) -> str:
    """The replayed run against the committed runs of the same recipe, seed and attention
    (:func:`lpfa.compare.same_recipe_runs`): when each one's logits ran away and its loss exploded, compiled or not;
    "" when the run is not committed beside the replay or has no such twin."""
    run_folder = replay_run(result, replay_folder)
    if run_folder is None:
        return ""
    runs = {"this run": run_folder, **same_recipe_runs(run_folder)}
    if len(runs) == 1:
        return ""

    def fate(name, d):
        r = Run(d)
        v = r.verdict()
        how = "compiled" if r.train.get("compile") else "eager"
        label = f"this run (`{d.name}`, {how})" if name == "this run" else f"`{name}` ({how})"
        ran = (
            f"logits ran away at step {v['runaway_step']:,}"
            if v.get("runaway_step") is not None
            else "no logit runaway"
        )
        boom = (
            f"loss exploded at step {v['explosion_step']:,}"
            if v["exploded"]
            else f"loss had not exploded by step {v['steps']:,}"
        )
        return label, ran, boom, v["exploded"]

    fates = [fate(n, d) for n, d in runs.items()]
    n_boom = sum(f[3] for f in fates)
    return (
        "The same recipe, seed and attention, trained more than once (their configurations agree in every field "
        "that shapes training; they differ where compilation and kernels round): "
        + "; ".join(f"{label}: {ran}, {boom}" for label, ran, boom, _ in fates)
        + f". The loss exploded in {n_boom} of these {len(fates)} runs."
    )


def step_explorer(result: dict, arrays: dict, view, step: int | None = None, static: bool = True):
    """A replay's per-step figure with a head menu and a step slider over the detail steps
    (:func:`lpfa.replay.detail_steps`) through :func:`lpfa.widgets.interactive_or_static`: ``view(result, arrays,
    head, step)`` draws it (:func:`worst_token_view`, :func:`lpfa.pages.pktx_structure.rank1_view`,
    :func:`lpfa.pages.pv_error.pv_error_view`). A static page shows the first head at ``step`` (default: its last
    detail step; the pages' figures show the first), or with ``static`` False (the page already draws every step)
    only the line saying where the slider lives."""
    from lpfa.widgets import interactive_or_static

    heads = [int(h) for h in result["heads"]]
    steps = sorted({s for h in heads for s in detail_steps(arrays, h)})
    if not steps:
        raise ValueError(f"heads {heads}: the replay measured no step in detail for them")
    start = {"head": heads[0], "step": detail_step(arrays, heads[0], step) if step is not None
             else detail_steps(arrays, heads[0])[-1]}

    def draw(head, step):
        return view(result, arrays, head, step)

    def controls():
        import ipywidgets as w

        return {"head": w.Dropdown(options=heads, value=start["head"], description="head"),
                "step": w.SelectionSlider(options=steps, value=start["step"], description="step",
                                          continuous_update=False)}

    return interactive_or_static(draw, controls, start if static else None)


def _replay_head(result: dict, head: int) -> int:
    """``head`` if the replay measured it, else a one-line ValueError naming the heads it did."""
    if head not in [int(h) for h in result["heads"]]:
        raise ValueError(f"head={head!r}: expected a head this replay measured, one of {result['heads']}")
    return int(head)


def worst_token_view(result: dict, arrays: dict, head: int, step: int):
    """Page 02's per-step figure (:func:`plot_worst_token`) at a replayed ``head`` and detail ``step``; a head or step
    the replay did not measure is a one-line ValueError naming the ones it did."""
    return plot_worst_token(arrays, _replay_head(result, head), step)
