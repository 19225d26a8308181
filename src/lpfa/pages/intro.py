"""The intro page: the book's scorecard (each claim of the paper, what the committed runs here show, and a verdict,
all computed), the Fig. 2 twins' losses, and the numbers of its text.

:func:`scorecard` reads the committed results (``results/``) through the same functions the pages use, so a number
in the scorecard is the number on the page it links to. Verdicts:

* **reproduced**: the committed runs show the claim (the rule is stated in the row);
* **partly**: shown under some of the paper's conditions, or for some rows, not all;
* **not reproduced**: the runs that test it do not show it;
* **not run**: no committed run tests it yet;
* **shown** / **not shown**: for a claim of our own, beyond the paper.
"""

from __future__ import annotations

import html
import math
import re

import pandas as pd

from lpfa.audit import PRODUCTION, at_largest_T, ci_text, excludes_zero, load_audit, result
from lpfa.compare import head_metric_frame, heads_at, precursor_table, step_before_failure
from lpfa.data import GPU_CORPUS_TRAIN_TOKENS
from lpfa.dose import committed_runs, dose_findings, dose_table
from lpfa.experiments import MECHANISM_CONTROL, MECHANISM_REPLAY
from lpfa.pages import VERDICT_WORDS, and_join, capital, setting_of
from lpfa.pages.delta_bias import STRONG_T, replay_dir, replay_run
from lpfa.pages.isolation import against_paper, as_reported, isolation_table, recipe_isolation_table
from lpfa.pages.loss_explosion import (
    TWIN_MARGIN,
    fate_counts,
    fig2_twins,
    fig2_verdict,
    horizon_text,
    plot_twin_losses,
    recipe_fates,
    recipe_rows,
    seed_table,
    seed_twins,
    seeds_text,
)
from lpfa.pages.pktx_structure import PARALLEL, within_range
from lpfa.pages.sfa import GPT2M_STEPS, gpt2m_minutes, gpt2m_price, sfa_findings
from lpfa.pages.stabilisers import PAPER_CLAIMS, paper_claims, paper_claims_lead, seed_evidence, stabiliser_table
from lpfa.params import integer, text
from lpfa.plotting import format_table
from lpfa.replay import bias_test, load_replay
from lpfa.results import run_dir
from lpfa.run import Run, run_verdict
from lpfa.scaling import tokens_per_step
from lpfa.train import PRESETS

# the notebook's papermill parameters, checked right after its parameters cell (lpfa.params.check_params)
PARAMS = {
    "layer": integer(0), "fig2_experiment": text(nonempty=True), "replay_experiment": text(nonempty=True),
    "replay": text(nonempty=True), "twins_experiment": text(nonempty=True), "repro_experiment": text(nonempty=True),
}

VERDICTS = ("reproduced", "partly", "not reproduced", "not run", "shown", "not shown")
COLUMNS = ["claim", "paper", "our result", "verdict", "page"]
# the pages the scorecard's rows link to (:func:`scorecard`'s ``pages``)
SCORED_PAGES = ("02_delta_bias", "03_pktx_structure", "06_loss_explosion", "07_spectral_norms", "08_tie_frequency",
                "09_sfa", "10_isolation", "16_kernel_bias", "17_stabilisers")
FIG2_CLAIM = "BF16 flash attention makes the loss explode; FP32 attention on the same data does not"


def _row(claim: str, paper: str, result: str, verdict: str, page: str) -> dict:
    if verdict not in VERDICTS:
        raise ValueError(f"verdict={verdict!r}: expected one of {VERDICTS}")
    return dict(zip(COLUMNS, (claim, paper, result, verdict, page)))


def _fig2_rows(experiment: str, layer: int, root) -> list[dict]:
    pairs = fig2_twins(experiment, root=root)
    if not pairs:
        return [_row(FIG2_CLAIM, "Fig. 2", "no committed paper-recipe twins", "not run", "06_loss_explosion")]
    verdicts = {seed: {k: run_verdict(d) for k, d in pair.items()} for seed, pair in pairs.items()}
    alone = [s for s, v in verdicts.items() if v["bf16"]["exploded"] and not v["fp32"]["exploded"]]
    first = next(iter(pairs)) if not alone else alone[0]
    v = verdicts[first]
    fates = recipe_fates(root)
    if fates.empty:
        seeds = seeds_text(seed_table(recipe_rows(experiment, root=root)))
        result = "GPT-2 S at the paper's lr: " + seeds[0].lower() + seeds[1:]
    else:
        twins = seed_twins(fates)
        result = (f"GPT-2 S at the paper's lr: {fate_counts(fates)}. {horizon_text(fates)} FP32 attention trained "
                  f"{TWIN_MARGIN:,} steps past the seed's BF16 explosion (or as far as its BF16 run) on "
                  f"{int(twins.twin.sum()) if len(twins) else 0} of {len(twins)} seeds with both.")
    verdict = (fig2_verdict(fates) if not fates.empty else
               "reproduced" if alone and len(alone) == len(pairs) else "partly" if alone else "not reproduced")
    rows = [_row(FIG2_CLAIM, "Fig. 2", result, verdict, "06_loss_explosion")]
    # Fig. 3: every head of the layer at the last diagnostics step before the BF16 explosion (as page 07 draws it)
    frames = {k: head_metric_frame(d, "wq_spectral_norm") for k, d in pairs[first].items()}  # read once, used twice
    at = step_before_failure(pairs[first], frames=frames, verdicts=v)
    heads = {k: heads_at(f, layer, at) for k, f in frames.items()}
    ratio = heads["bf16"] / heads["fp32"]
    grown = int((ratio > 1.25).sum())
    rows.append(_row("The W_Q spectral norm of a few heads in an early layer grows before the explosion", "Fig. 3",
                     f"one BF16/FP32 pair (seed {v['bf16']['seed']}), layer {layer}, step {at:,}: largest ‖W_Q[h]‖₂ "
                     f"{heads['bf16'].max():.1f} with BF16 against "
                     f"{heads['fp32'].max():.1f} with FP32; {grown} of {len(ratio)} heads above 1.25× their FP32 twin's"
                     + (" (layer-wide, not a few heads)" if grown > len(ratio) / 2 else ""),
                     "not reproduced" if grown == 0 else "partly" if grown > len(ratio) / 2 else "reproduced",
                     "07_spectral_norms"))
    # ties, at the same step
    table, step = precursor_table(pairs[first], layer, step=at, verdicts=v)
    b, f = table.loc["bf16"], table.loc["fp32"]
    tie_b, tie_f = b[f"largest per-head tie fraction @ {step}"], f[f"largest per-head tie fraction @ {step}"]
    rows.append(_row("BF16 scores give rows with tied maxima, so P̄ has several entries exactly 1", "Fig. 13",
                     f"one BF16/FP32 pair (seed {v['bf16']['seed']}), layer {layer}, step {step:,}: {tie_b:.0%} of "
                     "the most tied head's rows (BF16) against "
                     f"{tie_f:.1%} (FP32)",
                     "reproduced" if tie_b > 10 * tie_f else "not reproduced", "08_tie_frequency"))
    return rows


def _floor(x: float, digits: int) -> float:
    """x rounded down to ``digits`` decimals, for a lower bound printed after "≥" (0.937 is "≥ 0.93", not 0.94)."""
    return math.floor(x * 10**digits) / 10**digits


def _head_verdict(passed: list[bool]) -> str:
    """A mechanism claim measured in several heads: reproduced in every head, partly in some, else not."""
    return "reproduced" if all(passed) else "partly" if any(passed) else "not reproduced"


def _per_head(values: dict, fmt: str) -> str:
    """``{4: 10.48, 8: 1.80}`` with ``fmt`` "t = {:.1f}" as "t = 10.5 (head 4) and t = 1.8 (head 8)"."""
    return and_join([f"{fmt.format(v)} (head {h})" for h, v in values.items()])


def _mechanism_rows(replay_experiment: str, replay: str, root, control: str = MECHANISM_CONTROL) -> list[dict]:
    """The Fig. 5 and Fig. 4 rows from the replay ``replay``: judged per measured head (:func:`_head_verdict`): t >
    :data:`lpfa.pages.delta_bias.STRONG_T` for the δ bias, and for the rank-1 structure a median similarity above
    :data:`PARALLEL` at every detail step. ``control`` (a replay of the FP32 twin with the BF16 policy measured, in the
    latest run that holds it; "" for none) adds the same test on the FP32 trajectory."""
    folder = replay_dir(replay_experiment, None, replay, root)
    result, arrays = load_replay(folder)
    bt = bias_test(result)
    run = replay_run(result, folder)
    setting = setting_of(Run(run).train) if run is not None else "a committed run"
    if run is not None:  # the replayed run's own fate: whether its loss exploded, and when
        v = Run(run).verdict()
        setting += (f" (a BF16 run whose loss exploded at step {v['explosion_step']:,})" if v["exploded"] else
                    f" (a BF16 run whose loss had not exploded by step {v['steps']:,}, its last)")
    ag = result.get("agreement") or {}
    exact = " bit for bit" if ag.get("compared") and ag["bit_equal"] == ag["compared"] else ""
    heads = and_join([str(h) for h in bt])
    ranges = {h: within_range(arrays, h) for h in result["heads"]}  # (lowest, highest, its step, detail steps)
    sims = {h: r[0] for h, r in ranges.items()}
    share = min(r["share_tied"] for r in bt.values())
    where = (f"{setting}, the BF16 run's layer {result['layer']}, heads {heads}, {result['steps']:,} steps replayed"
             f"{exact} from step {result['checkpoint_step']:,}")
    fig5 = (f"{where}: Σ_T (δ_lp − δ_hp)[T] is positive in "
            + _per_head({h: r["positive_fraction"] for h, r in bt.items()}, "{:.0%}")
            + " of steps, its mean per step "
            + _per_head({h: r["t"] for h, r in bt.items()}, "t = {:.1f}")
            + f"; rows with tied maxima carry ≥ {_floor(share, 2):.0%} of it")
    if control:
        c_result, _ = load_replay(replay_dir(replay_experiment, None, control, root))
        c_bt = bias_test(c_result)
        fig5 += (f"; on the FP32 twin's trajectory, the BF16 policy measured in the same heads ({c_result['steps']:,} "
                 f"steps from step {c_result['checkpoint_step']:,}, the control), "
                 + _per_head({h: r["t"] for h, r in c_bt.items()}, "t = {:.1f}"))
    return [
        _row("δ = rowsum(dO∘O) from BF16 O is biased against its high-precision value", "Fig. 5", fig5,
             _head_verdict([r["t"] > STRONG_T for r in bt.values()]), "02_delta_bias"),
        _row("The W_Q gradient error accumulates along one low-rank direction", "Fig. 4",
             f"{where}: the smallest median similarity of the per-token rank-1 matrices over the "
             f"{ranges[result['heads'][0]][3]} detail steps is "
             + _per_head(sims, "{:.2f}") + " (random: ~0)",
             _head_verdict([x > PARALLEL for x in sims.values()]), "03_pktx_structure"),
    ]


def _sfa_row(fig2_experiment: str, twins_experiment: str, layer: int, root) -> dict:
    claim = "SFA (shifting a tied row max, so that the tied row holds no P̄ = 1) stabilises training"
    rows = recipe_rows(fig2_experiment, root=root)
    recipe = {label: {"bf16": rows[label], "fp32": rows["fp32" + label[4:]], "sfa": rows["sfa" + label[4:]]}
              for label in fig2_twins(fig2_experiment, root=root) if "sfa" + label[4:] in rows}
    folder = run_dir(twins_experiment, None, root)
    runs = {k: folder / k for k in ("bf16", "sfa", "fp32")}
    table, step = precursor_table(runs, layer)
    col = f"largest attention logit @ {step}"
    ratio = {k: table.loc[k, col] / table.loc["fp32", col] for k in ("bf16", "sfa")}
    v = {k: run_verdict(d) for k, d in runs.items()}
    repro = (f"`repro` preset, step {step:,}: layer {layer}'s largest logit {ratio['sfa']:.1f}× the FP32 twin's "
             f"with SFA, {ratio['bf16']:.1f}× without; with SFA its logits "
             f"{'ran away' if v['sfa']['runaway_step'] is not None else 'did not run away'}")
    if recipe:
        found = [sfa_findings(trio) for trio in recipe.values()]
        n_ok = sum(f["explosion step"]["sfa"] is None for f in found)
        n_runaway = sum(bool(f["runaway layers"]["sfa"]) for f in found)
        f = found[0]
        bf16_step = f["explosion step"]["bf16"]
        fate = (f"its loss exploded at step {f['explosion step']['sfa']:,}" if f["explosion step"]["sfa"] is not None
                else f"its loss did not explode in {f['steps']['sfa']:,} steps")
        loss = (f"validation loss {f['val loss']['sfa']:.2f} against FP32's {f['val loss']['fp32']:.2f} at step "
                f"{f['val step']:,}" if f.get("val step") is not None else
                f"training loss {f['loss']['sfa']:.2f} against FP32's {f['loss']['fp32']:.2f} at step "
                f"{f['loss step']:,}")
        result = (f"paper recipe: the loss of {len(found) - n_ok} of {len(found)} SFA "
                  f"run{'s' if len(found) > 1 else ''} exploded; {'in the first, ' if len(found) > 1 else ''}{fate}, "
                  "while its BF16 twin's "
                  + (f"exploded at step {bf16_step:,}" if bf16_step is not None else "did not explode")
                  + f"; {loss}; the largest logit passed {f['logit']:,.0f} (before the loss exploded, where it did) in "
                  f"{len(f['runaway layers']['sfa'])} layers with SFA, {len(f['runaway layers']['fp32'])} with FP32; "
                  + repro)
        verdict = ("not reproduced" if n_ok < len(found) else "partly" if n_runaway else "reproduced")
        return _row(claim, "Fig. 7", result, verdict, "09_sfa")
    ok = v["sfa"]["runaway_step"] is None and v["bf16"]["runaway_step"] is not None
    return _row(claim, "Fig. 7", repro + "; not yet run at the paper recipe, where BF16 explodes",
                "partly" if ok else "not reproduced", "09_sfa")


def _gpt2m_row(root, steps: int = GPT2M_STEPS) -> dict:
    """Fig. 7c: GPT-2 M, priced from its committed throughput (:func:`lpfa.pages.sfa.gpt2m_price`) and not run."""
    claim = "The BF16 loss explosion and SFA's fix carry over to GPT-2 M"
    price = gpt2m_price(root=root)
    if price.empty:
        return _row(claim, "Fig. 7c", "not run, not priced", "not run", "09_sfa")
    return _row(claim, "Fig. 7c", f"priced: one seed's BF16, FP32 and SFA rows at {steps:,} steps take about "
                f"{gpt2m_minutes(price, steps):.0f} minutes of one H200 (`results/gpt2m_price/{price.index.name}`)",
                "not run", "09_sfa")


def _isolation_row(layer: int, root) -> dict:
    table, _, _, _ = isolation_table(layer=layer, root=root)
    cmp = against_paper(table)
    n, k = len(cmp["reported"]), len(cmp["agree"])
    differ = cmp["paper_stable_but"] + cmp["paper_fails_but"]
    # the same rows at the paper's recipe, where the BF16 loss explodes: judged by the loss itself
    recipe = recipe_isolation_table(root=root).drop(index=["bf16_paper_recipe", "fp32_paper_recipe"])
    ran = recipe[~recipe.verdict.isin(["not run yet", "too short"])]
    reported = [label for label in ran.index if as_reported(ran.loc[label])]
    at_recipe = (f"; at the paper recipe, {len(ran)} of {len(recipe)} rows run: "
                 + ", ".join(f"`{label.removesuffix('_paper_recipe')}`: {ran.loc[label, 'verdict']} "
                             f"({int(ran.loc[label, 'steps']):,} steps)" for label in ran.index)
                 + f"; {len(reported)} of them as reported" if len(ran)
                 else "; none of its rows has run at the paper recipe yet")
    complete = k == n and len(ran) == len(recipe) and len(reported) == len(ran)
    return _row("Which change prevents the loss explosion: FP32 O for δ, P̄V in FP32, δ = rowsum(dP∘P), FP32 for the "
                "outlier heads", "Sec. 3.2",
                f"`repro` preset, judged by whether the logits ran away: {k} of {n} rows the paper reports behave "
                "as reported"
                + (f"; not: {', '.join(differ)}" if differ else "")
                + ("; the unchanged `bf16` row itself showed neither there, so those rows cannot separate the causes"
                   if "bf16" in cmp["paper_fails_but"] else "") + at_recipe,
                "reproduced" if complete else "partly" if k or reported else "not reproduced", "10_isolation")


def _dose_row(root) -> dict:
    runs = committed_runs(root=root)
    table = dose_table(runs)
    f = dose_findings(table)
    ks = f["bias_decides_ks"]
    n_control = int(((table["sign"] == "control") & table["k"].isin(ks)).sum()) if ks else 0
    return _row("Beyond the paper: with layer 1's δ error multiplied by k, its bias, not its size, decides whether "
                "the loss explodes (`repro` preset, one control seed per k)",
                "dose test",
                f"the loss exploded in {f['bias']['exploded_runs']} of {f['bias']['runs']} biased-dose runs and in "
                f"{f['control']['exploded_runs']} of {f['control']['runs']} random-sign control runs"
                + (f"; at k = {', '.join(f'{k:g}' for k in ks)} in every biased run and in none of the "
                   f"{n_control} control runs there (one control seed per k; `repro` preset only)" if ks else ""),
                "shown" if ks else "not shown", "06_loss_explosion")


def _discussion_row(layer: int, root) -> dict:
    """The paper's Discussion on why stabilisers work, judged on page 17's rows
    (:func:`lpfa.pages.stabilisers.paper_claims`)."""
    table, _, _ = stabiliser_table(layer=layer, root=root)
    judged = [c for c in paper_claims(table) if c["judged"]]
    stand = [c for c in judged if c["stands"]]  # (a seed-dependent explanation does not stand)
    verdict = ("not run" if not judged else "reproduced" if len(stand) == len(judged) == len(PAPER_CLAIMS)
               else "partly" if stand else "not reproduced")
    return _row("QK-norm and gated attention work by disrupting the structure of (PK)[T]ᵀX[T], QK-clipping by making "
                "P̄ = 1 rarer", "Discussion (no experiment)",
                paper_claims_lead(judged, seed_evidence(table, [lb for c in judged for lb in c["labels"]])) if judged
                else "no BF16 stabiliser row with its link measured is committed",
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
        return _row(claim, "kernel audit", "no production kernel ran in the committed audit", "not run",
                    "16_kernel_bias")
    rows = {k: result(ran, k, "ties", "delta") for k in production}
    carry = [k for k, r in rows.items() if excludes_zero(r) and r["mean"] * paper["mean"] > 0]
    worst = max(production, key=lambda k: abs(rows[k]["mean"]))
    text = (f"the `paper` rounding's δ error on the audit's synthetic tied rows {ci_text(paper)}; the production "
            f"kernels' largest, `{worst}`'s {ci_text(rows[worst])}, "
            f"{abs(paper['mean']) / abs(rows[worst]['mean']):.0f}× smaller"
            + (f"; of the `paper` rounding's sign there with an interval excluding 0: "
               f"{', '.join(f'`{k}`' for k in carry)}" if carry else
               f"; none of the {len(production)} has the `paper` rounding's sign there with an interval excluding 0")
            + f" (`results/kernel_bias/{folder.name}`)")
    return _row(claim, "kernel audit", text, "shown" if carry else "not shown", "16_kernel_bias")


def scorecard(layer: int = 1, replay_experiment: str = "mechanism", replay: str = MECHANISM_REPLAY,
              twins_experiment: str = "repro_twins", fig2_experiment: str = "paper_recipe", root=None,
              pages=None, control: str = MECHANISM_CONTROL) -> pd.DataFrame:
    """One row per claim: ``claim``, ``paper`` (figure or section), ``our result`` (numbers from the committed runs),
    ``verdict`` (:data:`VERDICTS`) and ``page`` (the notebook that shows it). ``fig2_experiment``: the BF16/FP32 twins
    of Figs. 2, 3, 13 (and their SFA twin, once run); the replay: Figs. 4, 5, with ``control`` (the FP32 twin's
    replay, "" for none); ``twins_experiment``: the `repro` SFA twin. ``pages`` (notebook names): only the rows that
    link to them, computing only those."""
    def wanted(*names: str) -> bool:
        return pages is None or any(name in pages for name in names)

    rows = []
    if wanted("06_loss_explosion", "07_spectral_norms", "08_tie_frequency"):
        rows += _fig2_rows(fig2_experiment, layer, root)
    if wanted("02_delta_bias", "03_pktx_structure"):
        rows += _mechanism_rows(replay_experiment, replay, root, control)
    if wanted("09_sfa"):
        rows += [_sfa_row(fig2_experiment, twins_experiment, layer, root), _gpt2m_row(root)]
    if wanted("10_isolation"):
        rows.append(_isolation_row(layer, root))
    if wanted("06_loss_explosion"):
        rows.append(_dose_row(root))
    if wanted("17_stabilisers"):
        rows.append(_discussion_row(layer, root))
    if wanted("16_kernel_bias"):
        rows.append(_kernel_row(root))
    card = pd.DataFrame(rows, columns=COLUMNS)
    assert set(card.page) <= set(SCORED_PAGES), f"a row links to a page outside SCORED_PAGES: {set(card.page)}"
    return card if pages is None else card[card.page.isin(pages)].reset_index(drop=True)


def scorecard_note(page: str, **kwargs) -> str:
    """What the scorecard says of the claims that page ``page`` (a notebook name) shows, as one Markdown paragraph:
    "**Fig. 3: partly reproduced.** <our result>." per row, from :func:`scorecard` itself (``kwargs``: its
    arguments), so that a page and the scorecard cannot disagree on a verdict. Raises ValueError for a page that no
    row links to."""
    if page not in SCORED_PAGES:
        raise ValueError(f"page={page!r}: expected a page the scorecard links to, one of {', '.join(SCORED_PAGES)}")
    try:
        card = scorecard(pages=[page], **kwargs)
    except (FileNotFoundError, ValueError) as e:  # a results tree without the runs a row reads (LPFA_ROOT elsewhere)
        return f"The book's scorecard rows for this page are not computed here: {str(e).splitlines()[0]}"
    if card.empty:
        raise ValueError(f"page={page!r}: expected a page the scorecard links to, one of {', '.join(SCORED_PAGES)}")
    return "On the book's scorecard: " + " ".join(
        f"**{capital(row.paper)}: {VERDICT_WORDS[row.verdict]}.** {capital(row._3).rstrip('.')}."
        for row in card.itertuples())


def summary_text(card: pd.DataFrame) -> str:
    """The scorecard in one sentence: how many claims each verdict got."""
    counts = card["verdict"].value_counts()
    parts = [f"{counts[v]} {v}" for v in VERDICTS if v in counts]
    return (f"Of the {len(card)} claims on this card, " + ", ".join(parts[:-1]) + (" and " if len(parts) > 1 else "")
            + parts[-1] + ".")


def fig2_text(card: pd.DataFrame) -> str:
    """The scorecard's Fig. 2 row (its first) in one line: its verdict and our result."""
    fig2 = card.iloc[0]
    return f"Fig. 2 ({fig2['verdict']}): {fig2['our result']}".rstrip(".")  # the page adds the full stop


def styled(card: pd.DataFrame, link: bool = True):
    """The scorecard for a page: page names as links (``../notebooks/<page>.html`` from the intro), the claims and
    results HTML-escaped with their `code` spans as ``<code>``, no index (:func:`lpfa.plotting.format_table`)."""
    shown = card.copy()
    for col in ("claim", "our result"):  # the HTML table does not render Markdown: `code` by hand, the rest escaped
        shown[col] = [re.sub(r"`([^`]+)`", r"<code>\1</code>", html.escape(str(t), quote=False)) for t in shown[col]]
    if link:
        shown["page"] = [f'<a href="../notebooks/{p}.html">{p[:2]}</a>' for p in shown["page"]]
    return format_table(shown, index=False, classes="scorecard")


def plot_fig2(experiment: str = "paper_recipe", root=None):
    """Fig. 2 here: the training and eval losses of the first committed BF16/FP32 pair of ``experiment``
    (:func:`lpfa.pages.loss_explosion.fig2_twins`), a dotted line where the BF16 twin exploded. None without a pair."""
    try:
        pairs = fig2_twins(experiment, root=root)
    except FileNotFoundError:  # the experiment is not in the store
        return None
    if not pairs:
        return None
    runs = next(iter(pairs.values()))
    return plot_twin_losses(runs, {"bf16": run_verdict(runs["bf16"])}, smooth=50,
                            title="Fig. 2 here: GPT-2 S at the paper's recipe, BF16 against FP32 attention on the "
                                  "same batches")


def intro_numbers(fig2_experiment: str = "paper_recipe", repro_experiment: str = "repro_pair", root=None) -> dict:
    """The numbers of the intro's text, ``{name: Markdown}``: ``batch_ratio`` (the paper's tokens per step over the
    Fig. 2 BF16 twin's, absent without twins), ``repro_model`` and ``repro_steps`` (the `repro` BF16 twin of
    ``repro_experiment``: layers, width, context; its steps) and ``corpus_tokens`` (the training corpus, M tokens)."""
    pairs = fig2_twins(fig2_experiment, root=root)
    repro = Run(run_dir(repro_experiment, None, root) / "bf16")
    m = repro.config["model"]
    out = {}
    if pairs:
        bf16 = next(iter(pairs.values()))["bf16"]
        out["batch_ratio"] = f"{tokens_per_step(PRESETS['gpt2-s-paper']) / tokens_per_step(Run(bf16).train):.0f}"
    out["repro_model"] = f"{m['n_layer']} layers, d = {m['n_embd']}, T = {m['block_size']}"
    out["repro_steps"] = f"{repro.steps:,}"
    out["corpus_tokens"] = f"{GPU_CORPUS_TRAIN_TOKENS / 1e6:.0f}M"
    return out
