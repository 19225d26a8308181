"""Page 06, the loss explosion (Fig. 2): which committed runs exploded, the BF16/FP32 twins and seeds, the precursors."""

from __future__ import annotations

from lpfa.compare import PRECURSORS, divergence_step, layer_max, precursor_panels, precursor_table
from lpfa.pages import and_join
from lpfa.run import (
    run_verdict,
)


def plot_precursors(runs: dict, layer: int):
    """The three precursors of one layer over training, one panel per row (legible at page width), every run in its
    mode's colour and line style (:func:`lpfa.plotting.color_of`, :func:`lpfa.plotting.dash_of`)."""
    import matplotlib.pyplot as plt

    from lpfa.plotting import color_of, dash_of, use_style

    use_style()
    fig, axes = plt.subplots(3, 1, figsize=(7.5, 7.2), sharex=True)
    precursor_panels(axes, runs, layer, {label: (color_of(label), dash_of(label)) for label in runs})
    for ax, name in zip(axes, PRECURSORS.values()):
        ax.set_title(f"layer {layer}: {name}", fontsize=10)
    axes[-1].set_xlabel("step")
    axes[0].set_yscale("log")
    axes[0].legend(fontsize=9)
    return fig


def committed_explosions(experiments=("paper_recipe", "isolation", "seeds", "sfa_muon", "muon_long", "sizes"), root=None):
    """Every committed run of ``experiments`` (:func:`lpfa.results.experiment_rows`) with its verdict: a DataFrame
    indexed by (experiment, label) with ``change`` (:data:`lpfa.experiments.DESCRIPTIONS`), ``attention``, ``steps``,
    ``exploded``, ``explosion step``, and ``fp32 twin exploded``: for a ``bf16...`` row, whether the row of the same
    experiment named ``fp32...`` exploded too (None without one). A BF16-only loss explosion, Fig. 2, is a row with
    ``exploded`` and not ``fp32 twin exploded``."""
    import pandas as pd

    from lpfa.experiments import DESCRIPTIONS
    from lpfa.results import experiment_rows

    rows = {}
    for exp in experiments:
        runs = experiment_rows(exp, root=root)
        verdicts = {label: run_verdict(d) for label, d in runs.items()}
        for label, v in verdicts.items():
            twin = verdicts.get("fp32" + label[4:]) if label.startswith("bf16") else None
            rows[exp, label] = {"change": DESCRIPTIONS.get(label, ""), "attention": v["policy"], "steps": v["steps"],
                                "exploded": v["exploded"], "explosion step": v["explosion_step"],
                                "fp32 twin exploded": None if twin is None else twin["exploded"]}
    return pd.DataFrame.from_dict(rows, orient="index")


def bf16_only_explosions(table):
    """The rows of :func:`committed_explosions` that are Fig. 2: a BF16 run that exploded while its FP32 twin (same
    experiment, same data order) did not."""
    return table[table["exploded"].astype(bool) & table["fp32 twin exploded"].eq(False)]  # None (no twin) is not False


def seed_table(rows: dict, prefix: str = "bf16"):
    """Fig. 2 over seeds: one row per run of ``rows`` (``{label: run folder}``, :func:`lpfa.results.experiment_rows`)
    whose label starts with ``prefix``, with its ``seed``, ``steps``, ``explosion step`` (None: did not explode) and its
    FP32 twin's (the row named ``fp32`` + the rest of the label): ``fp32 steps`` and ``fp32 explosion step``, both None
    where the twin is not run yet, and ``fp32 exploded`` (None without a twin)."""
    import pandas as pd

    out = {}
    for label, d in rows.items():
        if not label.startswith(prefix):
            continue
        v = run_verdict(d)
        twin = rows.get("fp32" + label[len(prefix):])
        t = run_verdict(twin) if twin is not None else None
        out[label] = {"seed": v["seed"], "steps": v["steps"], "explosion step": v["explosion_step"],
                      "fp32 steps": None if t is None else t["steps"],
                      "fp32 explosion step": None if t is None else t["explosion_step"],
                      "fp32 exploded": None if t is None else bool(t["exploded"])}
    return pd.DataFrame.from_dict(out, orient="index")


def seeds_text(table) -> str:
    """:func:`seed_table` in one sentence: in how many seeds the BF16 run exploded (at which steps), and how many of
    their FP32 twins have run and exploded."""
    if table.empty:
        return "No BF16 run at this recipe is committed."
    boom = table["explosion step"].dropna().astype(int)
    ran = table[table["fp32 exploded"].notna()]
    text = (f"The BF16 run exploded in {len(boom)} of {len(table)} seed{'s' if len(table) > 1 else ''}"
            + (f" (at step{'s' if len(boom) > 1 else ''} {and_join([f'{s:,}' for s in sorted(boom)])})" if len(boom) else "")
            + f"; {len(ran)} FP32 twin{'s' if len(ran) != 1 else ''} ran"
            + (f" ({and_join([f'{int(s):,}' for s in ran['fp32 steps']])} steps)" if len(ran) else "")
            + f" and {int(ran['fp32 exploded'].astype(bool).sum())} exploded")
    missing = [f"`fp32{label[4:]}`" for label in table.index[table["fp32 exploded"].isna()]]
    return text + (f"; still to run: {', '.join(missing)}." if missing else ".")


def twins_text(runs: dict, layer: int, criterion=None, bf16: str = "bf16", fp32: str = "fp32",
               verdicts: dict | None = None) -> str:
    """Fig. 2's verdict for one BF16/FP32 pair in sentences: whether each exploded (``lpfa.explosion``), where the BF16
    run's layer ``layer`` ran away, the precursors of both at the last diagnostics step both reached
    (:func:`precursor_table`), and from when the BF16 logit and W_Q norm stay apart (:func:`divergence_step`).
    ``verdicts``: ``{label: run_verdict(run, criterion)}`` where the caller has them already; each run is judged once."""
    v = {label: (verdicts or {}).get(label) or (run_verdict(d, criterion) if criterion else run_verdict(d)) for label, d in runs.items()}
    table, common = precursor_table(runs, layer, criterion=criterion, verdicts=v)
    name = {m: f"{n} @ {common}" for m, n in PRECURSORS.items()}
    b, f = table.loc[bf16], table.loc[fp32]
    if v[bf16]["exploded"] and not v[fp32]["exploded"]:
        text = [f"**The BF16 run's loss exploded at step {v[bf16]['explosion_step']:,}; its FP32 twin trained "
                f"{v[fp32]['steps']:,} steps on the same batches without exploding** (final eval loss {f['final eval loss']:.2f})."]
    elif v[bf16]["exploded"]:
        text = [f"Both runs exploded (BF16 at step {v[bf16]['explosion_step']:,}, FP32 at {v[fp32]['explosion_step']:,}): "
                "a generic instability, not Fig. 2."]
    else:
        text = [f"The BF16 run did not explode in its {v[bf16]['steps']:,} steps"
                + (f" (its FP32 twin did, at step {v[fp32]['explosion_step']:,})" if v[fp32]["exploded"] else
                   f" (nor its FP32 twin in {v[fp32]['steps']:,})") + ", so these runs do not reproduce Fig. 2's explosion."]
    ra = v[bf16]["runaway_step"]
    if ra is not None:
        text.append(f"By the runaway criterion the BF16 run's layer {v[bf16]['runaway_layer']} ran away at step {ra:,}"
                    + (f", {v[bf16]['explosion_step'] - ra:,} steps before its loss exploded; " if v[bf16]["exploded"] else
                       f", {v[bf16]['steps'] - ra:,} steps before the run ended; ")
                    + ("the FP32 twin's never did." if v[fp32]["runaway_step"] is None else
                       f"the FP32 twin's at step {v[fp32]['runaway_step']:,}."))
    text.append(f"At step {common:,}, layer {layer}'s largest attention logit is {b[name['max_logit']]:,.0f} with BF16 attention "
                f"against {f[name['max_logit']]:,.0f} with FP32, its most tied head has tied maxima in "
                f"{b[name['tie_fraction']]:.0%} of its rows (BF16 scores) against {f[name['tie_fraction']]:.1%} (FP32 scores), "
                f"and its largest ‖W_Q[h]‖₂ is {b[name['wq_spectral_norm']]:.1f} against {f[name['wq_spectral_norm']]:.1f}.")
    div = {m: divergence_step(layer_max(runs[bf16], m, layer), layer_max(runs[fp32], m, layer), r)
           for m, r in (("max_logit", 10.0), ("wq_spectral_norm", 1.25))}
    when = lambda s: "never for good" if s is None else f"from step {s:,} on"  # noqa: E731
    text.append(f"The BF16 logit stays above 10× the FP32 twin's {when(div['max_logit'])}, and the BF16 W_Q norm above "
                f"1.25× {when(div['wq_spectral_norm'])} (`lpfa.compare.divergence_step`).")
    return " ".join(text)


def explosions_text(table) -> str:
    """:func:`committed_explosions` in one sentence: how many runs, which exploded (and whether the FP32 twin of a
    BF16 row did too)."""
    boom = table[table["exploded"]]
    text = f"Of the {len(table)} committed runs of the {', '.join(dict.fromkeys(e for e, _ in table.index))} experiments, "
    if boom.empty:
        return text + "none exploded."
    parts = []
    for (exp, label), r in boom.iterrows():
        twin = "" if r["fp32 twin exploded"] is None else (", its FP32 twin too" if r["fp32 twin exploded"] else
                                                           ", its FP32 twin not")
        parts.append(f"`{label}` ({exp}: {r['change'] or r['attention']}; step {int(r['explosion step']):,}{twin})")
    return text + f"{len(boom)} exploded: " + "; ".join(parts) + "."
