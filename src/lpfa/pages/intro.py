"""The book's scorecard: each claim of the paper, what the committed runs here show, and a verdict, all computed.

:func:`scorecard` reads the committed results (``results/``) through the same functions the pages use, so a number
in the scorecard is the number on the page it links to. Verdicts:

* **reproduced**: the committed runs show the claim (the rule is stated in the row);
* **partly**: shown under some of the paper's conditions, or for some rows, not all;
* **not reproduced**: the runs that test it do not show it;
* **not run**: no committed run tests it yet;
* **shown** / **not shown**: for a claim of our own, beyond the paper.

The intro page (``book/intro.ipynb``) shows the table and :func:`summary_text`.
"""

from __future__ import annotations

import html
import re
from pathlib import Path

import pandas as pd

from lpfa.audit import PRODUCTION, at_largest_T, ci_text, excludes_zero, load_audit, result
from lpfa.compare import head_metric_frame, precursor_table, step_before_failure
from lpfa.dose import committed_runs, dose_findings, dose_table
from lpfa.pages.isolation import against_paper, isolation_table, recipe_isolation_table
from lpfa.pages.loss_explosion import seed_table, seeds_text
from lpfa.pages.sfa import sfa_findings
from lpfa.pages.stabilisers import PAPER_CLAIMS, paper_claims, paper_claims_lead, stabiliser_table
from lpfa.replay import bias_test, load_replay, rank1_stats
from lpfa.results import experiment_rows, run_dir
from lpfa.run import run_verdict

VERDICTS = ("reproduced", "partly", "not reproduced", "not run", "shown", "not shown")
COLUMNS = ["claim", "paper", "our result", "verdict", "page"]


def _row(claim: str, paper: str, result: str, verdict: str, page: str) -> dict:
    if verdict not in VERDICTS:
        raise ValueError(f"verdict={verdict!r}: expected one of {VERDICTS}")
    return dict(zip(COLUMNS, (claim, paper, result, verdict, page)))


def fig2_twins(experiment: str = "paper_recipe", run: str | None = None, root=None) -> dict[str, dict[str, Path]]:
    """The committed BF16/FP32 pairs of ``experiment`` by their BF16 label, e.g. ``{"bf16_paper_recipe": {"bf16": dir,
    "fp32": dir}, "bf16_paper_recipe_s1": ...}`` (a label ``bf16<x>`` pairs with ``fp32<x>``). ``run`` None: every run
    folder of the experiment, each label from the latest that has it (twins may run in different GPU runs,
    :func:`lpfa.results.experiment_rows`); else that run folder alone."""
    rows = recipe_rows(experiment, run, root)
    return {label: {"bf16": rows[label], "fp32": rows["fp32" + label[4:]]}
            for label in rows if label.startswith("bf16") and "fp32" + label[4:] in rows}


def recipe_rows(experiment: str = "paper_recipe", run: str | None = None, root=None) -> dict[str, Path]:
    """``{label: run folder}`` of ``experiment``: over all its run folders (``run`` None,
    :func:`lpfa.results.experiment_rows`) or in run folder ``run``."""
    if run is None:
        return experiment_rows(experiment, root=root)
    folder = run_dir(experiment, run, root)
    return {p.name: p for p in sorted(folder.iterdir()) if (p / "config.json").is_file()}


def fig2_headline(verdicts: dict, conf: dict, n_pairs: int, seeds=None, sfa: dict | None = None) -> str:
    """Page 06's opening sentence on Fig. 2: ``verdicts`` (``{"bf16": ..., "fp32": ...}``, :func:`lpfa.run.run_verdict`)
    of the twins trained with ``conf`` (the BF16 twin's train config), set against the paper's recipe and explosion step;
    with ``n_pairs`` committed BF16/FP32 pairs (:func:`fig2_twins`), their ``seeds`` (:func:`lpfa.pages.loss_explosion.seed_table`, when
    there are at least two) and the SFA twin's verdict ``sfa`` where one is committed."""
    from lpfa.scaling import PAPER_EXPLOSION_STEP, paper_explosion_tokens, tokens_per_step
    from lpfa.train import PRESETS

    b, f = verdicts["bf16"], verdicts["fp32"]
    paper = PRESETS["gpt2-s-paper"]
    recipe = (f"the paper's own recipe at GPT-2 S size (`{conf['model']}`, T = {conf['block_size']}, peak lr {conf['lr']:g} after "
              f"{conf['warmup_steps']:,} warmup steps, AdamW ({conf['beta1']}, {conf['beta2']}), weight decay "
              f"{conf['weight_decay']:g}, clip {conf['grad_clip']:g}) but **{tokens_per_step(conf):,} tokens per step**, "
              f"{tokens_per_step(paper) / tokens_per_step(conf):.0f}× fewer than the paper's {tokens_per_step(paper):,}, so that "
              "8,000 steps fit in one GPU run")
    if not (b["exploded"] and not f["exploded"]):
        return (f"**Fig. 2 is not reproduced.** With {recipe}, the BF16 twin "
                + ("exploded" if b["exploded"] else f"trained {b['steps']:,} steps without exploding")
                + (" and so did its FP32 twin" if f["exploded"] else f"; its FP32 twin did not explode in {f['steps']:,} steps")
                + ". ")
    sfa_line = ("" if sfa is None else "The SFA twin at this recipe "
                + (f"exploded too, at step {sfa['explosion_step']:,}" if sfa["exploded"] else f"did not explode in {sfa['steps']:,} steps")
                + " ({doc}`09_sfa`). ")
    return (f"**Fig. 2 is reproduced, with {n_pairs if n_pairs > 1 else 'one'} seed{'s' if n_pairs > 1 else ''}.** With {recipe}, "
            f"the BF16 twin's loss exploded at step {b['explosion_step']:,} "
            f"({b['explosion_step'] * tokens_per_step(conf) / 1e6:.0f}M tokens), while its FP32 twin trained {f['steps']:,} steps on "
            f"the same batches without exploding. The paper's run exploded at about step {PAPER_EXPLOSION_STEP:,} "
            f"({paper_explosion_tokens() / 1e9:.1f}B tokens at its batch). "
            + ("" if seeds is None or len(seeds) < 2 else seeds_text(seeds) + " ")
            + ("" if n_pairs >= 3 else f"{'One pair does' if n_pairs == 1 else f'{n_pairs} pairs do'} not measure the spread of "
               "the explosion step: more seeds at this recipe are still to run. ")
            + (sfa_line or "The SFA twin at this recipe is still to run, so the SFA page validates the fix on the `repro` "
                           "preset's logit runaway. "))


def _fig2_rows(experiment: str, layer: int, root) -> list[dict]:
    pairs = fig2_twins(experiment, root=root)
    if not pairs:
        return [_row("BF16 flash attention makes the loss explode; FP32 attention on the same data does not", "Fig. 2",
                     "no committed paper-recipe twins", "not run", "06_loss_explosion")]
    verdicts = {seed: {k: run_verdict(d) for k, d in pair.items()} for seed, pair in pairs.items()}
    alone = [s for s, v in verdicts.items() if v["bf16"]["exploded"] and not v["fp32"]["exploded"]]
    first = next(iter(pairs)) if not alone else alone[0]
    v = verdicts[first]
    seeds = seeds_text(seed_table(recipe_rows(experiment, root=root)))
    result = "GPT-2 S at the paper's lr: " + seeds[0].lower() + seeds[1:]
    verdict = ("reproduced" if alone and len(alone) == len(pairs) else "partly" if alone else "not reproduced")
    rows = [_row("BF16 flash attention makes the loss explode; FP32 attention on the same data does not", "Fig. 2",
                 result, verdict, "06_loss_explosion")]
    # Fig. 3: every head of the layer at the last diagnostics step before the BF16 explosion (as page 07 draws it)
    frames = {k: head_metric_frame(d, "wq_spectral_norm") for k, d in pairs[first].items()}  # read once, used twice
    at = step_before_failure(pairs[first], frames=frames, verdicts=v)
    heads = {k: f[(f.layer == layer) & (f.step == at)].set_index("head").value for k, f in frames.items()}
    ratio = heads["bf16"] / heads["fp32"]
    grown = int((ratio > 1.25).sum())
    rows.append(_row("The W_Q spectral norm of a few heads in an early layer grows before the explosion", "Fig. 3",
                     f"layer {layer}, step {at:,}: largest ‖W_Q[h]‖₂ {heads['bf16'].max():.1f} with BF16 against "
                     f"{heads['fp32'].max():.1f} with FP32; {grown} of {len(ratio)} heads above 1.25× their FP32 twin's"
                     + (" (layer-wide, not a few heads)" if grown > len(ratio) / 2 else ""),
                     "not reproduced" if grown == 0 else "partly" if grown > len(ratio) / 2 else "reproduced", "07_spectral_norms"))
    # ties, at the same step
    table, step = precursor_table(pairs[first], layer, step=at, verdicts=v)
    b, f = table.loc["bf16"], table.loc["fp32"]
    tie_b, tie_f = b[f"largest per-head tie fraction @ {step}"], f[f"largest per-head tie fraction @ {step}"]
    rows.append(_row("BF16 scores give rows with tied maxima, so P̄ has several entries exactly 1", "Fig. 13",
                     f"layer {layer}, step {step:,}: {tie_b:.0%} of the most tied head's rows (BF16) against {tie_f:.1%} (FP32)",
                     "reproduced" if tie_b > 10 * tie_f else "not reproduced", "08_tie_frequency"))
    return rows


def _mechanism_rows(replay_experiment: str, replay: str, root) -> list[dict]:
    result, arrays = load_replay(run_dir(replay_experiment, None, root) / replay)
    bt = bias_test(result)
    heads = ", ".join(str(h) for h in bt)
    t_min = min(r["t"] for r in bt.values())
    pos = min(r["positive_fraction"] for r in bt.values())
    sims = [min(v for k, v in rank1_stats(arrays, h)["medians"].items() if k.startswith("within")) for h in result["heads"]]
    where = f"`repro` preset, the BF16 run's layer {result['layer']}, heads {heads}, {result['steps']} steps replayed from step {result['checkpoint_step']:,}"
    return [
        _row("δ = rowsum(dO∘O) from BF16 O is biased against its high-precision value", "Fig. 5",
             f"{where}: the δ error is positive in ≥ {pos:.0%} of steps, t ≥ {t_min:.1f}",
             "reproduced" if t_min > 3 else "not reproduced", "02_delta_bias"),
        _row("The W_Q gradient error accumulates along one low-rank direction", "Fig. 4",
             f"{where}: median similarity of the per-token rank-1 matrices ≥ {min(sims):.2f} (random: ~0)",
             "reproduced" if min(sims) > 0.9 else "not reproduced", "03_pktx_structure"),
    ]


def _sfa_row(fig2_experiment: str, twins_experiment: str, layer: int, root) -> dict:
    claim = "SFA (shifting a tied row max) removes the ties and stabilises training"
    rows = recipe_rows(fig2_experiment, root=root)
    recipe = {label: {"bf16": rows[label], "fp32": rows["fp32" + label[4:]], "sfa": rows["sfa" + label[4:]]}
              for label in fig2_twins(fig2_experiment, root=root) if "sfa" + label[4:] in rows}
    folder = run_dir(twins_experiment, None, root)
    runs = {k: folder / k for k in ("bf16", "sfa", "fp32")}
    table, step = precursor_table(runs, layer)
    col = f"largest attention logit @ {step}"
    ratio = {k: table.loc[k, col] / table.loc["fp32", col] for k in ("bf16", "sfa")}
    v = {k: run_verdict(d) for k, d in runs.items()}
    repro = (f"`repro` preset, step {step:,}: layer {layer}'s largest logit {ratio['sfa']:.1f}× the FP32 twin's with SFA, "
             f"{ratio['bf16']:.1f}× without; SFA {'ran away' if v['sfa']['runaway_step'] is not None else 'no runaway'}")
    if recipe:
        found = [sfa_findings(trio) for trio in recipe.values()]
        n_ok = sum(f["explosion step"]["sfa"] is None for f in found)
        n_runaway = sum(bool(f["runaway layers"]["sfa"]) for f in found)
        f = found[0]
        result = (f"paper recipe, {len(found)} seed{'s' if len(found) > 1 else ''}: SFA exploded in {len(found) - n_ok} "
                  f"(first: {f['steps']['sfa']:,} steps, BF16 twin exploded at "
                  f"{f['explosion step']['bf16'] if f['explosion step']['bf16'] is None else format(f['explosion step']['bf16'], ',')}; "
                  f"loss {f['loss']['sfa']:.2f} against FP32's {f['loss']['fp32']:.2f} at step {f['loss step']:,}); "
                  f"logits ran away (> {f['logit']:,.0f}) in {len(f['runaway layers']['sfa'])} layers with SFA, "
                  f"{len(f['runaway layers']['fp32'])} with FP32; " + repro)
        verdict = ("not reproduced" if n_ok < len(found) else "partly" if n_runaway else "reproduced")
        return _row(claim, "Fig. 7", result, verdict, "09_sfa")
    ok = v["sfa"]["runaway_step"] is None and v["bf16"]["runaway_step"] is not None
    return _row(claim, "Fig. 7", repro + "; not yet run at the paper recipe, where BF16 explodes",
                "partly" if ok else "not reproduced", "09_sfa")


def _isolation_row(layer: int, root) -> dict:
    table, _, _, _ = isolation_table(layer=layer, root=root)
    cmp = against_paper(table)
    n, k = len(cmp["reported"]), len(cmp["agree"])
    differ = cmp["paper_stable_but"] + cmp["paper_fails_but"]
    # the same rows at the paper's recipe, where the BF16 loss explodes: judged by the loss itself
    recipe = recipe_isolation_table(root=root).drop(index=["bf16_paper_recipe", "fp32_paper_recipe"])
    ran = recipe[~recipe.verdict.isin(["not run yet", "too short"])]
    as_reported = [label for label in ran.index if (ran.loc[label, "verdict"] == "exploded") == (ran.loc[label, "paper"] == "fails")]
    at_recipe = (f"; at the paper recipe, judged by the loss, {len(ran)} of {len(recipe)} rows run: "
                 + ", ".join(f"`{label.removesuffix('_paper_recipe')}` {ran.loc[label, 'verdict']} in {int(ran.loc[label, 'steps']):,} steps"
                             for label in ran.index)
                 + f" ({len(as_reported)} as reported)" if len(ran) else "; none of its rows has run at the paper recipe yet")
    complete = k == n and len(ran) == len(recipe) and len(as_reported) == len(ran)
    return _row("Which change removes the failure: FP32 O for δ, P̄V in FP32, δ = rowsum(dP∘P), FP32 for the outlier heads",
                "Sec. 3.2", f"{k} of {n} rows the paper reports behave as reported (`repro` preset, judged by the precursor)"
                + (f"; not: {', '.join(differ)}" if differ else "") + at_recipe,
                "reproduced" if complete else "partly" if k or as_reported else "not reproduced", "10_isolation")


def _dose_row(root) -> dict:
    runs = committed_runs(root=root)
    f = dose_findings(dose_table(runs))
    ks = f["bias_decides_ks"]
    return _row("Beyond the paper: the δ error's bias, not its size, drives the failure (layer 1's δ error × k)", "dose test",
                f"biased dose exploded in {f['bias']['exploded_runs']} of {f['bias']['runs']} runs, the random-sign control in "
                f"{f['control']['exploded_runs']} of {f['control']['runs']}"
                + (f"; at k = {', '.join(f'{k:g}' for k in ks)} every biased run exploded and no control" if ks else ""),
                "shown" if ks else "not shown", "06_loss_explosion")


def _discussion_row(layer: int, root) -> dict:
    """The paper's Discussion on why stabilisers work, judged on page 17's rows (:func:`lpfa.pages.stabilisers.paper_claims`)."""
    table, _, _ = stabiliser_table(layer=layer, root=root)
    judged = [c for c in paper_claims(table) if c["broken"] is not None]
    stand = [c for c in judged if c["broken"] and c["holds"]]
    verdict = ("not run" if not judged else "reproduced" if len(stand) == len(judged) == len(PAPER_CLAIMS)
               else "partly" if stand else "not reproduced")
    return _row("QK-norm and gated attention work by disrupting the structure of (PK)[T]ᵀX[T], QK-clipping by making "
                "P̄ = 1 rarer", "Discussion (no experiment)",
                paper_claims_lead(judged) if judged else "no BF16 stabiliser row with its link measured is committed",
                verdict, "17_stabilisers")


def _kernel_row(root) -> dict:
    """Beyond the paper: do PyTorch's production kernels carry the δ bias of the paper's rounding on tied rows? Shown
    when one of them has a tied-row δ error of ``paper``'s sign whose interval excludes 0 (page 16's audit)."""
    claim = "Beyond the paper: PyTorch's production attention kernels carry the paper's δ bias on tied rows"
    try:
        full, _, folder = load_audit(root=root)
    except FileNotFoundError:
        return _row(claim, "kernel audit", "no committed GPU audit", "not run", "16_kernel_bias")
    ran = at_largest_T(full)
    ran = ran[ran.unavailable.isna()]
    paper = result(ran, "ref:paper", "ties", "delta")
    production = [k for k in PRODUCTION if k in set(ran.kernel)]
    if not production:
        return _row(claim, "kernel audit", "no production kernel ran in the committed audit", "not run", "16_kernel_bias")
    rows = {k: result(ran, k, "ties", "delta") for k in production}
    carry = [k for k, r in rows.items() if excludes_zero(r) and r["mean"] * paper["mean"] > 0]
    worst = max(production, key=lambda k: abs(rows[k]["mean"]))
    text = (f"`paper`'s δ error on tied rows {ci_text(paper)}; the production kernels' largest, `{worst}`'s "
            f"{ci_text(rows[worst])}, {abs(paper['mean']) / abs(rows[worst]['mean']):.0f}× smaller"
            + (f"; of `paper`'s sign with an interval excluding 0: {', '.join(f'`{k}`' for k in carry)}" if carry else
               f"; none of the {len(production)} has `paper`'s sign with an interval excluding 0")
            + f" (`results/kernel_bias/{folder.name}`)")
    return _row(claim, "kernel audit", text, "shown" if carry else "not shown", "16_kernel_bias")


def scorecard(layer: int = 1, replay_experiment: str = "repro_runaway", replay: str = "bf16_runaway_replay",
              twins_experiment: str = "repro_twins", fig2_experiment: str = "paper_recipe", root=None) -> pd.DataFrame:
    """One row per claim: ``claim``, ``paper`` (figure or section), ``our result`` (numbers from the committed runs),
    ``verdict`` (:data:`VERDICTS`) and ``page`` (the notebook that shows it). ``fig2_experiment``: the BF16/FP32 twins of
    Figs. 2, 3, 13 (and their SFA twin, once run); the replay: Figs. 4, 5; ``twins_experiment``: the `repro` SFA twin."""
    rows = [*_fig2_rows(fig2_experiment, layer, root), *_mechanism_rows(replay_experiment, replay, root),
            _sfa_row(fig2_experiment, twins_experiment, layer, root),
            _isolation_row(layer, root), _dose_row(root), _discussion_row(layer, root), _kernel_row(root)]
    return pd.DataFrame(rows, columns=COLUMNS)


def summary_text(card: pd.DataFrame) -> str:
    """The scorecard in one sentence: how many claims each verdict got."""
    counts = card["verdict"].value_counts()
    parts = [f"{counts[v]} {v}" for v in VERDICTS if v in counts]
    return f"Of the {len(card)} claims tested here, " + ", ".join(parts[:-1]) + (" and " if len(parts) > 1 else "") + parts[-1] + "."


def styled(card: pd.DataFrame, link: bool = True):
    """The scorecard for a page: page names as links (``../notebooks/<page>.html`` from the intro), the claims and
    results HTML-escaped with their `code` spans as ``<code>``, no index."""
    shown = card.copy()
    for col in ("claim", "our result"):  # the HTML table does not render Markdown: `code` by hand, the rest escaped
        shown[col] = [re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(str(t), quote=False)) for t in shown[col]]
    if link:
        shown["page"] = [f'<a href="../notebooks/{p}.html">{p[:2]}</a>' for p in shown["page"]]
    return shown.style.hide(axis="index").set_table_attributes('class="scorecard"')
