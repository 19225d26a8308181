"""Page 10, isolation (Sec. 3.2): one change of the BF16 run per row, each judged against the FP32 twin."""

from __future__ import annotations

from lpfa.compare import experiment_table, layer_max
from lpfa.run import (
    Run,
    heads_running_away,
    run_verdict,
)


def isolation_table(experiment: str = "isolation", layer: int = 1, reference_row: str = "fp32", logit_ratio: float = 10.0,
                    root=None):
    """The isolation table (Sec. 3.2) from the committed runs of ``experiment``: :func:`experiment_table` of every row
    of :data:`lpfa.experiments.ISOLATION` (each from the latest run that has it), each held against ``reference_row`` of its
    own launch (else the latest one), with the paper's verdict in column ``paper``. Returns ``(table, step, rows,
    reference)``: ``rows`` ``{label: run folder}``, ``reference`` the function ``label -> reference run folder``."""
    from lpfa.experiments import ISOLATION, PAPER_ISOLATION
    from lpfa.results import experiment_rows

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


def recipe_isolation_table(experiment: str = "paper_recipe", root=None):
    """The isolation rows at the paper's recipe (:data:`lpfa.experiments.RECIPE_ISOLATION`), judged by the loss itself:
    one row per run of ``experiment``'s BF16 twin, FP32 twin and isolation rows, with ``change``, ``paper`` (the paper's
    outcome), ``steps``, ``explosion step``, ``verdict``: "exploded", "clean" (did not explode in at least as many
    steps as the BF16 twin needed to explode) or "too short" (stopped before that step), or "not run yet", and the
    precursor the loss does not show: ``runaway step`` and ``runaway layer`` (:class:`lpfa.explosion.RunawayCriterion`
    on the logged largest logits; None without a runaway), and ``runaway heads``, the heads of that layer whose own
    logits ran away, earliest first (:func:`lpfa.run.heads_running_away`; a tuple, empty without a runaway)."""
    import pandas as pd

    from lpfa.experiments import RECIPE_ISOLATION
    from lpfa.experiments import rows as experiment_rows_of
    from lpfa.results import experiment_rows

    design = experiment_rows_of(experiment)
    labels = ["bf16_paper_recipe", "fp32_paper_recipe", *(f"{row}_paper_recipe" for row in RECIPE_ISOLATION)]
    found = experiment_rows(experiment, labels, root=root)
    bf16 = run_verdict(found["bf16_paper_recipe"]) if "bf16_paper_recipe" in found else None
    boom = bf16["explosion_step"] if bf16 is not None else None
    out = {}
    for label in labels:
        r = design[label]
        row = {"change": r.description, "paper": r.paper or ("fails" if label.startswith("bf16") else "stable"),
               "steps": None, "explosion step": None, "verdict": "not run yet", "runaway step": None, "runaway layer": None,
               "runaway heads": ()}
        if label in found:
            v = run_verdict(found[label])
            row.update(steps=v["steps"], **{"explosion step": v["explosion_step"], "runaway step": v["runaway_step"],
                                            "runaway layer": v["runaway_layer"]})
            if v["runaway_layer"] is not None:
                row["runaway heads"] = tuple(heads_running_away(found[label], int(v["runaway_layer"])))
            row["verdict"] = ("exploded" if v["exploded"] else
                              "clean" if boom is not None and v["steps"] > boom else "too short")
        out[label] = row
    return pd.DataFrame.from_dict(out, orient="index")


def recipe_runaway_text(recipe, root=None) -> str:
    """Page 10's sentence on the precursor the loss does not show: for each row of :func:`recipe_isolation_table`
    (``recipe``) that stayed clean by the loss although one layer's logits ran away, from which step, in which heads
    (all of them, or named), and for a row with FP32 heads in that layer whether those stayed below the threshold;
    next to the BF16 twin's runaway and explosion steps."""
    from lpfa.explosion import heads_text
    from lpfa.results import experiment_rows

    done = recipe[~recipe.index.isin(["bf16_paper_recipe", "fp32_paper_recipe"]) & (recipe.verdict == "clean")]
    ran_away = [label for label in done.index if done.loc[label, "runaway step"] is not None
                and done.loc[label, "runaway step"] == done.loc[label, "runaway step"]]  # not None, not NaN
    if not ran_away:
        return "No row that stayed clean by the loss showed a logit runaway either."
    found = experiment_rows("paper_recipe", ran_away, root=root)

    def where(label):
        run = Run(found[label])
        heads, n_heads, layer = done.loc[label, "runaway heads"], run.model_config().n_head, int(done.loc[label, "runaway layer"])
        text = f"all {n_heads} heads" if len(heads) == n_heads else heads_text(heads)
        kept = sorted(set((run.train.get("fp32_heads") or {}).get(str(layer), [])) - set(heads))
        return text + (f", while its FP32 {heads_text(kept)} stayed below the runaway threshold" if kept else "")

    bf16 = recipe.loc["bf16_paper_recipe"]
    rows = "; ".join(
        f"`{label}` stayed clean by the loss for {done.loc[label, 'steps']:,.0f} steps, yet its layer-"
        f"{done.loc[label, 'runaway layer']:.0f} logits ran away from step {done.loc[label, 'runaway step']:,.0f} in {where(label)}"
        for label in ran_away)
    return (f"The loss is not the whole story. The BF16 twin's layer-1 logits ran away from step {bf16['runaway step']:,.0f} "
            f"and its loss exploded at {bf16['explosion step']:,.0f}; {rows}. "
            + ("Such a change" if len(ran_away) == 1 else "Each such change")
            + " delays the failure or leaves its precursor in place; whether its loss would explode later is not measured "
              "within one GPU run.")


def against_paper(table) -> dict:
    """How an :func:`isolation_table` compares with the paper: ``sick`` (rows with a precursor or worse), ``by_outcome``
    ``{outcome: [rows]}``, ``paper_stable_but`` (reported stable, sick here), ``paper_fails_but`` (reported failing, clean
    here), ``reported`` (rows the paper reports) and ``agree`` (those that behave as reported)."""
    by = {o: [label for label in table.index if table.loc[label, "outcome"] == o]
          for o in ("exploded", "ran away", "precursor", "clean")}
    sick = set(by["precursor"] + by["ran away"] + by["exploded"])
    reported = [label for label in table.index if table.loc[label, "paper"] in ("fails", "stable")]
    agree = [label for label in reported if (table.loc[label, "paper"] == "fails") == (label in sick)]
    return {"sick": sick, "by_outcome": by, "reported": reported, "agree": agree,
            "paper_stable_but": [label for label in reported if table.loc[label, "paper"] == "stable" and label in sick],
            "paper_fails_but": [label for label in reported if table.loc[label, "paper"] == "fails" and label not in sick]}


def isolation_ties(rows: dict, table, layer: int):
    """Page 10's ties per isolation row: its outcome (from ``table``), the largest tie fraction and the largest logit of
    any head of ``layer`` over the run (:func:`layer_max`)."""
    import pandas as pd

    return pd.DataFrame({label: {"outcome": table.loc[label, "outcome"],
                                 "largest tie fraction": layer_max(rows[label], "tie_fraction", layer).max(),
                                 "largest logit": layer_max(rows[label], "max_logit", layer).max()}
                         for label in table.index}).T


def isolation_ties_text(ties, reference_row: str, sick) -> str:
    """Page 10's finding from :func:`isolation_ties`: the stable ``reference_row``'s largest tie fraction, the failing
    rows (``sick``) with ties above twice that, and those failing without them (not the paper's chain start)."""
    tie, top = ties["largest tie fraction"].astype(float), ties["largest logit"].astype(float)
    base = tie[reference_row]
    untied = [label for label in sorted(sick) if tie[label] <= 2 * base]
    tied = [label for label in sorted(sick) if label not in untied]
    text = f"The `{reference_row}` row's worst head never exceeds a tie fraction of {base:.3f}. "
    if tied:
        text += "Failing rows with ties well above that: " + ", ".join(f"`{label}` ({tie[label]:.2f})" for label in tied) + ". "
    if untied:
        text += ("**Failing without ties**: " + ", ".join(f"`{label}` (at most {tie[label]:.3f}, largest logit {top[label]:,.0f})"
                                                         for label in untied)
                 + ": in these rows the logits grow without the tied maxima the paper's chain starts from, so ties are not "
                 "necessary for the failure here; what they share with the tied rows is the BF16-rounded O that δ is computed from.")
    else:
        text += "Every failing row has ties well above the stable row's."
    return text
