"""Page 10, isolation (Sec. 3.2): one change of the BF16 run per row, each judged against the FP32 twin.

At the ``repro`` preset the rows of :data:`lpfa.experiments.ISOLATION` are judged by the loss explosion and the logit
runaway (:func:`lpfa.compare.experiment_table`), with the step from which layer 1's largest logit stays above 10× the
FP32 row's measured beside them; at the paper's recipe, where the BF16 loss explodes, the rows
of :data:`lpfa.experiments.RECIPE_ISOLATION` by the loss itself. The page also measures why the row "δ from O
recomputed in FP32 from FP32 scores" fails: the backward differentiates P = exp(S − lse) with the forward's BF16 scores,
and dS = P∘(dP − δ) is that P's gradient only when δ = rowsum(dP∘P) (Eq. 3), which an O built from other scores
does not give (:func:`lpfa.mechanism.delta_formulas`).
"""

from __future__ import annotations

import json
import re

import pandas as pd
import torch

from lpfa.compare import (
    LOGIT_APART,
    OUTCOMES,
    experiment_table,
    head_metric_frame,
    heads_at,
    layer_max,
    outcome,
    plot_logit_runaway,
)
from lpfa.experiments import DESCRIPTIONS, ISOLATION, PAPER_ISOLATION, RECIPE_ISOLATION
from lpfa.experiments import rows as design_rows
from lpfa.explosion import RunawayCriterion, attention_label, heads_text
from lpfa.mechanism import DELTA_FORMULAS, delta_formulas
from lpfa.pages import RERUN_PAGE, and_join
from lpfa.pages.loss_explosion import recipe_fates
from lpfa.params import integer, real, text
from lpfa.results import experiment_rows
from lpfa.run import (
    Run,
    heads_running_away,
    run_verdict,
    runaway_onset,
)
from lpfa.scaling import committed_speed, wall_minutes
from lpfa.survival import failed_within
from lpfa.train import PRESETS

# the notebook's papermill parameters, checked right after its parameters cell (lpfa.params.check_params)
PARAMS = {
    "experiment": text(nonempty=True), "layer": integer(0), "reference_row": text(nonempty=True),
    "logit_ratio": real(0, lo_open=True), "planned_steps": integer(1), "gpus": integer(1),
}

RECIPE_TWINS = ("bf16_paper_recipe", "fp32_paper_recipe")  # the recipe's BF16 and FP32 twins, no isolation rows
DELTA_POLICY = "paper_untiled"  # the BF16 policy whose δ formulas are measured against δ*
LOGIT_SCALES = (0.25, 1, 4, 16, 64)  # the factors q is scaled by, for increasing largest logits
EARLY_STEPS = 1000  # "early in training", for the rows' early logits


def isolation_rows(experiment: str) -> dict:
    """``{label: run folder}`` of the committed rows of :data:`lpfa.experiments.ISOLATION` in ``experiment``."""
    return experiment_rows(experiment, list(ISOLATION))


def plot_rows_runaway(rows: dict, layer: int, experiment: str):
    """Every committed row's largest logit in ``layer`` against step, with the runaway threshold
    (:func:`lpfa.compare.plot_logit_runaway`)."""
    return plot_logit_runaway(rows, layer, RunawayCriterion(), f"results/{experiment}: every row run so far")


def isolation_design(rows: dict):
    """The isolation experiment's design (Sec. 3.2), one row per label of :data:`lpfa.experiments.ISOLATION`: what it
    changes, its ``lpfa.train`` overrides today, what the paper reports, ``run``, the launch that holds it in ``rows``
    (``{label: run folder}``, :func:`lpfa.results.experiment_rows`) or "not run yet", and ``attention as run``, the
    committed run's attention from its ``config.json`` (:func:`lpfa.explosion.attention_label`): a row defined after
    its run (the FP32 twin, now ``fp32_split``) ran what its config says."""
    unknown = sorted(set(rows) - set(ISOLATION))
    if unknown:
        raise ValueError(f"rows={unknown}: expected labels of lpfa.experiments.ISOLATION ({', '.join(ISOLATION)})")
    design = pd.DataFrame({"change": DESCRIPTIONS[k], "overrides": " ".join(v), "paper": PAPER_ISOLATION[k],
                           "run": rows[k].parent.name if k in rows else "not run yet",
                           "attention as run": attention_label(Run(rows[k]).config["train"]) if k in rows else None}
                          for k, v in ISOLATION.items())
    design.index = list(ISOLATION)
    return design


def design_note(design: pd.DataFrame) -> str:
    """Under :func:`isolation_design`: which committed rows ran another attention than their ``overrides`` set today
    (the attention policy, else backend, against the first part of ``attention as run``), so that a reader of the
    table knows the verdicts are of the runs as they ran."""
    changed = []
    for label, r in design.iterrows():
        if not isinstance(r["attention as run"], str):
            continue
        policy = re.search(r"attn_policy=(\S+)", r["overrides"]) or re.search(r"attn_backend=(\S+)", r["overrides"])
        ran = r["attention as run"].split(";")[0].strip()
        if policy and policy.group(1) != ran:
            changed.append(f"`{label}` ran `{ran}`, before the row was defined as `{policy.group(0)}`")
    if not changed:
        return "Every committed row ran the attention its `overrides` set today."
    return ("`overrides` is each row as defined today and `attention as run` what its committed run's config says: "
            + and_join(changed) + ". The verdicts below are of the runs as they ran.")


def isolation_table(experiment: str = "isolation", layer: int = 1, reference_row: str = "fp32",
                    logit_ratio: float = 10.0, root=None):
    """The isolation table (Sec. 3.2): :func:`experiment_table` of every committed row of
    :data:`lpfa.experiments.ISOLATION` in ``experiment`` (each from the latest run that has it), each held against
    ``reference_row`` of its own launch (else the latest one), with the paper's verdict in column ``paper``. Returns
    ``(table, step, rows, reference)``: ``rows`` ``{label: run folder}``, ``reference`` the function ``label ->
    reference run folder``."""
    rows = experiment_rows(experiment, list(ISOLATION), root=root)
    if reference_row not in rows:
        raise FileNotFoundError(f"reference_row={reference_row!r}: experiment {experiment!r} has no such committed row "
                                f"(rows: {sorted(rows)})")

    def reference(label):  # the reference row of the row's own launch, else the latest one
        own = rows[label].parent / reference_row
        return own if (own / "summary.json").exists() else rows[reference_row]

    table, step = experiment_table(rows, layer=layer, reference=reference, logit_ratio=logit_ratio)
    table.insert(7, "paper", [PAPER_ISOLATION[label] for label in table.index])
    return table, step, rows, reference


VERDICT_NOTES = ("iso_explosion", "iso_runaway", "iso_layer", "iso_ratio", "iso_reference", "iso_against", "iso_step")


def verdict_notes(table, step, rows: dict, reference, reference_row: str = "fp32", layer: int = 1,
                  logit_ratio: float = 10.0) -> dict:
    """How page 10 judges its rows, as ``{name: text}`` for each of :data:`VERDICT_NOTES`: the explosion criterion
    (from ``reference_row``'s ``summary.json``), the runaway criterion, the layer, ratio and reference row of the
    logit held apart, the rows held against another launch's reference, and the comparison ``step``; the arguments
    are :func:`isolation_table`'s. Every text is "–" when ``table`` is None (no committed row)."""
    if table is None:
        return dict.fromkeys(VERDICT_NOTES, "–")
    foreign = [label for label in table.index if reference(label).parent != rows[label].parent]
    crit_text = json.loads((rows[reference_row] / "summary.json").read_text())["criterion"]["description"]
    against = (f"for {', '.join(f'`{label}`' for label in foreign)} the `{reference_row}` row of run "
               f"`{rows[reference_row].parent.name}`" if foreign else "each against its own launch's")
    return {"iso_explosion": crit_text, "iso_runaway": RunawayCriterion().describe(), "iso_layer": f"{layer}",
            "iso_ratio": f"{logit_ratio:g}", "iso_reference": f"`{reference_row}`", "iso_against": against,
            "iso_step": f"{step:,}"}


def _layer_column(table, layer: int, what: str) -> str:
    """The name of ``table``'s column ``layer {layer} {what}``, or a one-line error for a table of another layer."""
    col = f"layer {layer} {what}"
    if col not in table.columns:
        raise ValueError(f"layer={layer}: the table has no column {col!r}; expected the layer its isolation_table "
                         "was built for")
    return col


def verdict_tables(table, layer: int = 1):
    """Page 10's two tables of an :func:`isolation_table` (two, so that each fits the page column): the verdicts
    (attention, ``layer``'s score precision and δ source, the paper's and our outcome, the step the logit parted from
    the reference's, explosion and runaway steps), and the remaining columns: seed, compilation, steps, the precursor
    values (largest logit, ties, W_Q norm) and the final loss."""
    verdict_cols = ["attention", _layer_column(table, layer, "scores"), _layer_column(table, layer, "δ from"), "paper",
                    "outcome", LOGIT_APART, "explosion step", "runaway step"]
    return table[verdict_cols], table.drop(columns=["change", *verdict_cols, "exploded", "runaway layer"])


# an outcome of :func:`lpfa.compare.experiment_table` as a sentence's predicate
OUTCOME_WORDS = {"loss exploded": "exploded", "logits ran away": "had its logits run away",
                 "neither": "neither exploded nor had its logits run away"}


def against_paper(table) -> dict:
    """How an :func:`isolation_table` compares with the paper: ``sick`` (rows whose logits ran away or loss exploded),
    ``by_outcome`` ``{outcome: [rows]}``, ``paper_stable_but`` (no explosion reported, sick here), ``paper_fails_but``
    (a loss explosion reported, neither here), ``reported`` (rows the paper reports) and ``agree`` (those that behave as
    reported)."""
    by = {o: [label for label in table.index if table.loc[label, "outcome"] == o] for o in OUTCOMES}
    sick = set(by["logits ran away"] + by["loss exploded"])
    reported = [label for label in table.index if table.loc[label, "paper"] in ("loss exploded", "neither")]
    agree = [label for label in reported if (table.loc[label, "paper"] == "loss exploded") == (label in sick)]
    paper = {label: table.loc[label, "paper"] for label in reported}
    return {"sick": sick, "by_outcome": by, "reported": reported, "agree": agree,
            "paper_stable_but": [label for label in reported if paper[label] == "neither" and label in sick],
            "paper_fails_but": [label for label in reported if paper[label] == "loss exploded" and label not in sick]}


def isolation_findings(table, layer: int = 1) -> str:
    """Page 10's "Measured" list from an :func:`isolation_table` (``table``, of ``layer``): the rows per outcome with
    their steps, how they compare with the paper (:func:`against_paper`), and which rows each candidate cause predicts
    wrongly: ``layer``'s scores S rounded to BF16, or its δ computed from a BF16-rounded O (the chain of Sec. 3.1)."""
    scores, delta = _layer_column(table, layer, "scores"), _layer_column(table, layer, "δ from")
    cmp = against_paper(table)
    by, sick, stable_but, fails_but = cmp["by_outcome"], cmp["sick"], cmp["paper_stable_but"], cmp["paper_fails_but"]

    def when(label, o):  # the step outcome o is dated by; for neither, where the logit parted, if it did
        col = dict(zip(OUTCOMES[:2], ("explosion step", "runaway step"))).get(o)
        if col:
            return f" (step {table.loc[label, col]:,})"
        apart = table.loc[label, LOGIT_APART] if LOGIT_APART in table else None
        return f" (its logit apart from step {apart:,})" if apart is not None else ""

    lines = [f"* **{o}**: " + ", ".join(f"`{label}`" + when(label, o) for label in labels)
             for o, labels in by.items() if labels]
    lines.append("* **against the paper**: " + ("; ".join(
        ([f"it reports no explosion for {', '.join(f'`{label}`' for label in stable_but)}, and here their loss "
          "exploded or their logits ran away"]
         if stable_but else [])
        + ([f"it reports {', '.join(f'`{label}`' for label in fails_but)} exploding, and here neither their loss "
            "exploded nor their logits ran away"]
           if fails_but else []))
        or "every row the paper reports behaves as reported") + ".")
    # two candidate explanations, each a column of the table: which rows does each predict wrongly?
    candidates = {
        f"layer-{layer} scores S rounded to BF16 in every head": (scores, "bf16"),
        f"layer-{layer} δ computed from a BF16-rounded O in every head (the chain of Sec. 3.1)": (delta, "bf16 O")}
    for claim, (col, bad) in candidates.items():
        miss = [label for label in table.index if (table.loc[label, col] == bad) != (label in sick)]
        lines.append(f"* **'{claim}' predicts that the logits run away or the loss explodes**: " + (
            f"it fits every one of the {len(table)} rows." if not miss else
            f"it fits {len(table) - len(miss)} of {len(table)} rows; not " + ", ".join(
                f"`{label}` ({col} {table.loc[label, col]}, {table.loc[label, 'outcome']})" for label in miss) + "."))
    if "bf16" in table.index and table.loc["bf16", "outcome"] == "neither":
        # the unchanged BF16 row is the control of every claim: where it shows neither, no row can contradict one
        lines.append("* **The unchanged `bf16` row itself** neither exploded nor had its logits run away"
                     + (f" (its logit apart from step {table.loc['bf16', LOGIT_APART]:,})"
                        if LOGIT_APART in table and table.loc["bf16", LOGIT_APART] is not None else "")
                     + ", so at this preset and length the rows cannot test the claims above: a row that prevents "
                     "the loss explosion looks the same as one whose loss would have exploded later.")
    return "**Measured.**\n\n" + "\n".join(lines)


def isolation_ties(rows: dict, table, layer: int):
    """Page 10's ties per isolation row: its outcome (from ``table``), the largest tie fraction and the largest logit of
    any head of ``layer`` over the run (:func:`layer_max`)."""
    return pd.DataFrame({label: {"outcome": table.loc[label, "outcome"],
                                 "largest tie fraction": layer_max(rows[label], "tie_fraction", layer).max(),
                                 "largest logit": layer_max(rows[label], "max_logit", layer).max()}
                         for label in table.index}).T


def isolation_ties_text(ties, reference_row: str, sick) -> str:
    """Page 10's finding from :func:`isolation_ties`: the ``reference_row``'s largest tie fraction (a row where neither
    happened), the rows whose logits ran away or loss exploded (``sick``) with ties above twice that, and those without
    them (not the paper's chain start)."""
    tie, top = ties["largest tie fraction"].astype(float), ties["largest logit"].astype(float)
    base = tie[reference_row]
    untied = [label for label in sorted(sick) if tie[label] <= 2 * base]
    tied = [label for label in sorted(sick) if label not in untied]
    text = f"The `{reference_row}` row's worst head never exceeds a tie fraction of {base:.3f}. "
    if tied:
        text += ("Rows whose logits ran away or loss exploded, with ties well above that: "
                 + ", ".join(f"`{x}` ({tie[x]:.2f})" for x in tied) + ". ")
    if untied:
        text += ("**Running away without ties**: " + ", ".join(
            f"`{label}` (at most {tie[label]:.3f}, largest logit {top[label]:,.0f})" for label in untied)
                 + (": in these rows" if len(untied) > 1 else ": in this row")
                 + " the logits grow without the tied maxima the paper's chain starts from, so ties are "
                 "not necessary for the runaway here; what they share with the tied rows is the BF16-rounded O that δ "
                 "is computed from.")
    else:
        text += "Every row whose logits ran away or loss exploded has ties well above that."
    return text


def delta_consistency(policy: str = DELTA_POLICY, scales=LOGIT_SCALES, seed: int = 0):
    """How far each δ formula of Sec. 3.2 lies from δ* = rowsum(dP∘P) (Eq. 3) as the logits grow: a DataFrame indexed by
    the largest logit, one column per :data:`lpfa.mechanism.DELTA_FORMULAS` with the RMS of δ − δ* relative to mean
    |δ*| (:func:`lpfa.mechanism.delta_formulas` under ``policy``), on seeded random (2, 4, 256, 64) BF16 k, v, dO and q
    scaled by each of ``scales`` before its rounding to BF16."""
    scales = tuple(scales)
    if not scales or not all(c > 0 for c in scales):
        raise ValueError(f"scales={scales}: expected at least one positive factor for q")
    g = torch.Generator().manual_seed(seed)
    k, v, do = (torch.randn(2, 4, 256, 64, generator=g).bfloat16() for _ in range(3))
    q = torch.randn(2, 4, 256, 64, generator=g)
    out = []
    for c in scales:
        r = delta_formulas((q * c).bfloat16(), k, v, do, policy=policy)
        out.append({"largest logit": r["max_logit"], **{f: r[f]["rms"] for f in DELTA_FORMULAS}})
    return pd.DataFrame(out).set_index("largest logit")


def early_logit_notes(rows: dict, early_steps: int = EARLY_STEPS) -> dict:
    """The range of the rows' early logits, for page 10's text on δ*: ``early_steps``, and ``early_logit_lo`` and
    ``early_logit_hi``, the smallest and largest over ``rows`` (``{label: run folder}``) of a run's largest attention
    logit of any layer and head at diagnostics steps up to ``early_steps``, each with its row."""
    if not rows:
        raise ValueError("rows={}: expected at least one run folder")
    if early_steps < 0:
        raise ValueError(f"early_steps={early_steps}: expected a step >= 0")
    early = {}
    for label, d in rows.items():
        f = head_metric_frame(d, "max_logit")
        early[label] = float(f[f.step <= early_steps].value.max())
    lo, hi = min(early, key=early.get), max(early, key=early.get)
    return {"early_steps": f"{early_steps:,}", "early_logit_lo": f"{early[lo]:.0f} (`{lo}`)",
            "early_logit_hi": f"{early[hi]:.0f} (`{hi}`)"}


def o_exact_notes(consistency, table=None, rows=None) -> dict:
    """Page 10's sentences on the ``o_exact`` δ, from :func:`delta_consistency` (``consistency``): ``oe_logit``, the
    largest logit measured; ``oe_ratio``, how many times further from δ* the ``o_exact`` δ lies there than the closer of
    ``o_stored`` and ``o_fp32``; ``oe_growth``, its error's growth with the logits ("" unless monotonic); ``oe_row`` and
    ``ofp32_row``, what the rows ``delta_o_exact`` and ``delta_o_fp32`` of an :func:`isolation_table` (``table``,
    ``rows``) did ("" without them)."""
    rows = rows or {}
    err = consistency["o_exact"]
    top = consistency.iloc[-1]
    lo, hi = consistency.index[0], consistency.index[-1]
    growth = (f"Its error grows with the logits, from {err.iloc[0]:.1e} at a largest logit of {lo:.1f} to "
              f"{err.iloc[-1]:.1e} at {hi:.0f}: BF16's spacing, and so the rounding of S, grows with them."
              if err.is_monotonic_increasing else "")
    exact = fp32 = ""
    if table is not None and "delta_o_exact" in rows:
        v = table.loc["delta_o_exact"]
        exact = (f"The `delta_o_exact` row exploded at step {v['explosion step']:,}, its logits ran away in layer "
                 f"{v['runaway layer']} from step {v['runaway step']:,}, and it ended at an eval loss of "
                 f"{v['final eval loss']:.2f}.")
    if table is not None and "delta_o_fp32" in rows:
        v = table.loc["delta_o_fp32"]
        fp32 = (f"; run that way (run `{rows['delta_o_fp32'].parent.name}`, {v['steps']:,} steps) the row "
                f"{OUTCOME_WORDS[v['outcome']]}, " + ("as the paper reports" if v["outcome"] == "neither" else
                                                      "unlike the paper's report"))
    return {"oe_logit": f"{consistency.index[-1]:.0f}",
            "oe_ratio": f"{top['o_exact'] / max(top['o_stored'], top['o_fp32']):.0f}",
            "oe_growth": growth, "oe_row": exact, "ofp32_row": fp32}


def isolation_plan(rows: dict, planned_steps: int = 8_000, gpus: int = 4) -> str:
    """Page 10's next step for the rows of :data:`lpfa.experiments.ISOLATION` not in ``rows`` (``{label: run
    folder}``): their names, the minutes of ``planned_steps`` steps of them and the two references again on ``gpus``
    GPUs at the committed compiled speed (:func:`lpfa.scaling.committed_speed`); "" when every row
    is committed."""
    if planned_steps < 1 or gpus < 1:
        raise ValueError(f"planned_steps={planned_steps}, gpus={gpus}: expected both >= 1")
    pending = [label for label in ISOLATION if label not in rows]
    if not pending:
        return ""
    tps = committed_speed().loc["compiled", "median tokens/s"]
    minutes = wall_minutes(planned_steps, tps, PRESETS["repro"], runs=len(pending) + 2, gpus=gpus)
    return (f"**Not run yet**: {', '.join(f'`{label}`' for label in pending)}. With the two references again, "
            f"{len(pending) + 2} runs at {planned_steps:,} steps take about {minutes:.0f} minutes on {gpus} H200s with "
            f"`compile=true` ({tps:,.0f} tokens/s per GPU, `results/compile_throughput`; {RERUN_PAGE} gives the "
            "commands).")


def recipe_isolation_table(experiment: str = "paper_recipe", root=None):
    """The isolation rows at the paper's recipe (:data:`lpfa.experiments.RECIPE_ISOLATION`), judged by the loss: one
    row per BF16 twin, FP32 twin and isolation row of ``experiment``, with ``change``, ``paper``, ``steps``,
    ``explosion step``, ``verdict`` in the book's one vocabulary ("loss exploded"; "logits ran away": no explosion in
    more steps than the BF16 twin needed, but one layer's logits ran away; "neither"; "too short": stopped without
    exploding before the BF16 twin exploded; "not run yet"), and the precursor: ``runaway step``, ``runaway layer``
    (:class:`lpfa.explosion.RunawayCriterion`; None without one) and ``runaway heads``, that layer's heads whose own
    logits ran away, earliest first (:func:`lpfa.run.heads_running_away`; a tuple)."""
    design = design_rows(experiment)
    labels = [*RECIPE_TWINS, *(f"{row}_paper_recipe" for row in RECIPE_ISOLATION)]
    found = experiment_rows(experiment, labels, root=root)
    bf16 = run_verdict(found["bf16_paper_recipe"]) if "bf16_paper_recipe" in found else None
    boom = bf16["explosion_step"] if bf16 is not None else None
    out = {}
    for label in labels:
        r = design[label]
        reported = r.paper or ("loss exploded" if label.startswith("bf16") else "neither")
        row = {"change": r.description, "paper": reported,
               "steps": None, "explosion step": None, "verdict": "not run yet", "runaway step": None,
               "runaway layer": None, "runaway heads": ()}
        if label in found:
            v = run_verdict(found[label])
            row.update(steps=v["steps"], **{"explosion step": v["explosion_step"], "runaway step": v["runaway_step"],
                                            "runaway layer": v["runaway_layer"]})
            if v["runaway_layer"] is not None:
                row["runaway heads"] = tuple(heads_running_away(found[label], int(v["runaway_layer"])))
            row["verdict"] = ("too short" if not v["exploded"] and (boom is None or v["steps"] <= boom)
                              else outcome(v["exploded"], v["runaway_step"]))
        out[label] = row
    return pd.DataFrame.from_dict(out, orient="index")


def as_reported(row) -> bool:
    """Whether a row of :func:`recipe_isolation_table` behaves as the paper reports: its loss exploded where the paper
    reports a loss explosion, neither happened where it reports none; "too short" and "not run yet" rows do not."""
    if row["verdict"] in ("too short", "not run yet"):
        return False
    return row["verdict"] == ("loss exploded" if row["paper"] == "loss exploded" else "neither")


def recipe_iso_text(recipe) -> str:
    """How many of :func:`recipe_isolation_table`'s isolation rows (``recipe``) have run, and how many of those behave
    as the paper reports (the loss exploded where it reports a loss explosion; neither where it reports none,
    so a row whose logits ran away is not; a row "too short" does not count), for page 10's introduction."""
    run_rows = recipe[~recipe.index.isin(RECIPE_TWINS)]
    done = run_rows[run_rows.verdict != "not run yet"]
    agree = [label for label in done.index if as_reported(done.loc[label])]
    return ((f"{len(done)} of its {len(run_rows)} rows have run, {len(agree)} as the paper reports" if len(done) else
             f"none of its {len(run_rows)} rows has run yet") + ", in `results/paper_recipe`")


def base_rate_text(recipe, fates: pd.DataFrame | None = None) -> str:
    """How much one run of a :func:`recipe_isolation_table` row whose loss did not explode can say: for each such
    row (verdict "neither" or "logits ran away"), in how many of the plain BF16 runs of the recipe
    (:func:`lpfa.pages.loss_explosion.recipe_fates`) the loss had exploded by the row's last step, counting the runs
    that exploded by then or trained that far (:func:`lpfa.survival.failed_within`); ``fates`` defaults to the
    committed ones. "" without such a row."""
    fates = recipe_fates() if fates is None else fates
    quiet = recipe[recipe.verdict.isin(["neither", "logits ran away"]) & ~recipe.index.isin(RECIPE_TWINS)]
    bf16 = fates[fates.precision == "bf16"] if len(fates) else fates
    if quiet.empty or bf16.empty:
        return ""
    groups: dict[tuple[int, int], list[str]] = {}  # (k, n) -> the rows it holds for, with their steps
    for label, r in quiet.iterrows():
        k, n = failed_within(bf16["end"], bf16["exploded"], int(r["steps"]))
        groups.setdefault((k, n), []).append(f"`{label.removesuffix('_paper_recipe')}` ({int(r['steps']):,} steps)")
    return ("Each row is one run, so a row whose loss did not explode is read against how often the plain BF16 loss "
            "explodes that soon: "
            + "; ".join(f"{and_join(rows)}: the plain BF16 loss had exploded by then in {k} of {n} runs"
                        for (k, n), rows in groups.items()) + ".")


def outlier_heads_text(experiment: str = "paper_recipe", row: str = "fp32_outlier_heads_paper_recipe",
                       root=None) -> str:
    """Why the ``row``'s FP32 heads are the outlier heads, measured: at the BF16 twin's runaway onset
    (:func:`lpfa.run.runaway_onset`, the first record of a layer's logit past the runaway level), the heads of that
    layer ranked by their W_Q spectral norm over the FP32 twin's and by their own largest logit; says whether the
    row's heads are the top two of both. "" when the row or the twins are not committed."""
    found = experiment_rows(experiment, ["bf16_paper_recipe", "fp32_paper_recipe", row], root=root)
    if len(found) < 3:
        return ""
    onset = runaway_onset(found["bf16_paper_recipe"])
    heads = {int(k): v for k, v in Run(found[row]).train.get("fp32_heads", {}).items()}
    if onset is None or not heads:
        return ""
    step, layer = onset
    chosen = sorted(heads.get(layer, []))

    def at(label, metric):
        return heads_at(head_metric_frame(found[label], metric), layer, step)

    ratio = (at("bf16_paper_recipe", "wq_spectral_norm") / at("fp32_paper_recipe", "wq_spectral_norm")).sort_values(
        ascending=False)
    logit = at("bf16_paper_recipe", "max_logit").sort_values(ascending=False)
    lead = sorted(ratio.index[:2]) == chosen and sorted(logit.index[:2]) == chosen
    return (f"The outlier heads {and_join([str(h) for h in chosen])} of layer {layer}: at step {step:,}, when the BF16 "
            f"twin's layer {layer} first logged a logit past the runaway level, the heads with the largest W_Q norm "
            f"over the FP32 twin's were {and_join([f'{h} (×{ratio[h]:.2f})' for h in ratio.index[:2]])}, and those "
            f"with the largest logit {and_join([f'{h} ({logit[h]:,.0f})' for h in logit.index[:2]])}"
            + (": the row's heads lead both." if lead else ": the row's heads are not the leaders of both."))


def recipe_display_table(recipe):
    """Page 10's table of the rows at the recipe: :func:`recipe_isolation_table`'s change, paper, steps, explosion step,
    verdict, runaway step and runaway heads (as "7, 9")."""
    shown = recipe.assign(**{"runaway heads": recipe["runaway heads"].map(lambda h: ", ".join(map(str, h)))})
    return shown[["change", "paper", "steps", "explosion step", "verdict", "runaway step", "runaway heads"]]


def recipe_runaway_text(recipe, root=None) -> str:
    """Page 10's sentence on the precursor the loss does not show: for each row of :func:`recipe_isolation_table`
    (``recipe``) whose loss did not explode although one layer's logits ran away, from which step, in which heads
    (all of them, or named), and for a row with FP32 heads in that layer whether those stayed below the threshold;
    next to the BF16 twin's runaway and explosion steps."""
    done = recipe[~recipe.index.isin(RECIPE_TWINS) & (recipe.verdict == "logits ran away")]
    ran_away = [label for label in done.index if done.loc[label, "runaway step"] is not None
                and done.loc[label, "runaway step"] == done.loc[label, "runaway step"]]  # not None, not NaN
    if not ran_away:
        return "No row whose loss did not explode had logits that ran away either."
    found = experiment_rows("paper_recipe", ran_away, root=root)

    def where(label):
        run = Run(found[label])
        heads, n_heads = done.loc[label, "runaway heads"], run.model_config().n_head
        layer = int(done.loc[label, "runaway layer"])
        text = f"all {n_heads} heads" if len(heads) == n_heads else heads_text(heads)
        kept = sorted(set((run.train.get("fp32_heads") or {}).get(str(layer), [])) - set(heads))
        return text + (f", while its FP32 {heads_text(kept)} stayed below the runaway threshold" if kept else "")

    bf16 = recipe.loc["bf16_paper_recipe"]
    rows = "; ".join(
        f"`{label}`'s loss did not explode in {done.loc[label, 'steps']:,.0f} steps, yet its layer-"
        f"{done.loc[label, 'runaway layer']:.0f} logits ran away from step {done.loc[label, 'runaway step']:,.0f} in "
        f"{where(label)}" for label in ran_away)
    return (f"The loss is not the whole story. The BF16 twin's layer-1 logits ran away from step "
            f"{bf16['runaway step']:,.0f} and its loss exploded at {bf16['explosion step']:,.0f}; {rows}. "
            + ("Such a change" if len(ran_away) == 1 else "Each such change")
            + " left the logit runaway in place in this one run; whether its loss would explode later is not "
              "measured within one GPU run.")


def recipe_plan(recipe, root=None) -> str:
    """Page 10's next step for the rows of :func:`recipe_isolation_table` (``recipe``) not run yet: their names, and the
    GPU time they need at the committed BF16 twin's batch and time budget, two per 2-GPU run (or where they run
    while that twin is not committed); "" when every row has run."""
    pending = [label for label in recipe.index if recipe.loc[label, "verdict"] == "not run yet"]
    if not pending:
        return ""
    twin = experiment_rows("paper_recipe", ["bf16_paper_recipe"], root=root)  # the batch and budget to match
    t = Run(twin["bf16_paper_recipe"]).train if twin else None
    return (f"**Not run yet**: {', '.join(f'`{label}`' for label in pending)}. "
            + (f"Each needs one H200 for the BF16 twin's {t['time_budget_s'] / 60:.0f} minutes plus compilation, two "
               f"per 2-GPU run, at its batch of {t['batch_size']} ({RERUN_PAGE} gives the commands)." if t else
               "They run at the BF16 twin's batch once that twin is committed (`scripts/gpu/paper_recipe.sh`)."))
