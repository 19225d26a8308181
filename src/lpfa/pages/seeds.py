"""Page 11, seeds: the spread of the failure over seeds of data order and initialisation."""

from __future__ import annotations


def seeds_summary(table, mode=lambda label: label.split("_s")[0]):
    """Per mode (``mode(label)``, default the part before ``_s<seed>``): runs, how many exploded and how many
    ran away (:class:`lpfa.explosion.RunawayCriterion`), the spread of their runaway steps, and the steps run;
    when the table has a ``precursor from`` column (:func:`experiment_table` with a reference), also how many
    showed the precursor or worse and the spread of the precursor steps."""
    import pandas as pd

    rows = {}
    for m, g in table.groupby([mode(label) for label in table.index]):
        ra = pd.to_numeric(g["runaway step"], errors="coerce").dropna()
        row = {"runs": len(g), "seeds": ", ".join(str(s) for s in g["seed"]), "exploded": int(g["exploded"].sum()),
               "ran away": len(ra), "first runaway": ra.min() if len(ra) else None,
               "median runaway": ra.median() if len(ra) else None, "last runaway": ra.max() if len(ra) else None}
        if "precursor from" in g:
            pre = pd.to_numeric(g["precursor from"], errors="coerce").dropna()
            row.update({"precursor or worse": int(g["outcome"].isin(["precursor", "ran away", "exploded"]).sum()),
                        "first precursor": pre.min() if len(pre) else None, "last precursor": pre.max() if len(pre) else None})
        rows[m] = {**row, "fewest steps run": int(g["steps"].min())}
    return pd.DataFrame(rows).T


def seed_spread_text(summary, table) -> str:
    """Page 11's "Measured" findings: per mode of :func:`seeds_summary` (``summary``) how many runs exploded, ran away
    and showed the precursor or worse, with the spread of those steps; and, where every BF16 run shows the precursor
    and no FP32 run does, how many BF16 runs ran away within the steps all of them reached and how far apart the
    precursor starts (``table``: the :func:`experiment_table` the summary came from)."""
    import pandas as pd

    lines = []
    for m, r in summary.iterrows():
        line = f"* **{m}**: of {int(r['runs'])} runs, {int(r['exploded'])} exploded and {int(r['ran away'])} ran away"
        if r["ran away"]:
            line += f" (steps {int(r['first runaway']):,} to {int(r['last runaway']):,})"
        line += f"; {int(r['precursor or worse'])} showed the precursor or worse"
        if r["precursor or worse"]:
            line += f", the precursor starting between steps {int(r['first precursor']):,} and {int(r['last precursor']):,}"
        lines.append(line + f". Every run trained at least {int(r['fewest steps run']):,} steps.")
    text = "**Measured.**\n\n" + "\n".join(lines)
    bf16, fp32 = summary.loc["bf16"], summary.loc["fp32"]
    if bf16["precursor or worse"] == bf16["runs"] and fp32["precursor or worse"] == 0:
        horizon = int(bf16["fewest steps run"])  # the steps every BF16 run reached
        early = table[pd.to_numeric(table["runaway step"], errors="coerce") < horizon]
        s1337 = ", ".join(f"step {table.loc[label, 'precursor from']:,} {'compiled' if table.loc[label, 'compiled'] else 'eager'}"
                          for label in table.index if label.startswith("bf16_s1337"))
        text += (f"\n\nWithin the first {horizon:,} steps, {len(early)} of the {int(table.index.str.startswith('bf16').sum())} "
                 "BF16 runs ran away; the others showed the precursor and may run away later. The precursor starts over a span "
                 f"of {int(bf16['last precursor'] - bf16['first precursor']):,} steps across these runs (seed 1337: {s1337}), so "
                 "a single trajectory (the paper's) says little about when; that every BF16 run shows it and no FP32 run does is "
                 "the robust part.")
    return text
