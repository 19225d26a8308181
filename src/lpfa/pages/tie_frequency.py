"""Page 08, tie frequency (Fig. 13): when ties, logits and W_Q norms part from the FP32 twin; V's sign dominance."""

from __future__ import annotations

from lpfa.compare import divergence_step, head_metric_frame, layer_max
from lpfa.run import (
    run_verdict,
)


def precursor_events(runs: dict, layer: int, reference: str | None = None, logit_ratio: float = 10.0,
                     wq_ratio: float = 1.25):
    """When did each precursor start, per run (``{label: run_dir}``)? Columns: the rise of the layer's worst-head
    and mean-over-heads tie fraction (:func:`lpfa.explosion.rise_step`), the logit runaway and the explosion
    (:func:`lpfa.run.run_verdict`) and, against the ``reference`` run (e.g. the FP32 twin), the step from
    which the layer's largest logit stays above ``logit_ratio`` × and its largest W_Q norm above ``wq_ratio`` ×
    the reference's for good, and when the W_Q norm first did so for a while (:func:`divergence_step`).
    Steps are None where the event did not happen."""
    import pandas as pd

    from lpfa.explosion import rise_step

    rows = {}
    for label, d in runs.items():
        v = run_verdict(d)
        ties = head_metric_frame(d, "tie_fraction")
        ties = ties[ties.layer == layer].groupby("step").value
        row = {"worst-head ties rise": rise_step(ties.max()), "mean ties rise": rise_step(ties.mean()),
               "logit runaway": v["runaway_step"] if v["runaway_layer"] in (None, layer) else None,
               "explosion": v["explosion_step"]}
        if reference is not None and label != reference:
            row[f"logit > {logit_ratio:g}× {reference}"] = divergence_step(
                layer_max(d, "max_logit", layer), layer_max(runs[reference], "max_logit", layer), logit_ratio)
            wa, wb = layer_max(d, "wq_spectral_norm", layer), layer_max(runs[reference], "wq_spectral_norm", layer)
            row[f"W_Q > {wq_ratio:g}× {reference}"] = divergence_step(wa, wb, wq_ratio)
            row[f"W_Q first > {wq_ratio:g}× {reference}"] = divergence_step(wa, wb, wq_ratio, permanent=False)
        rows[label] = row
    cols = list(dict.fromkeys(k for r in rows.values() for k in r))
    return pd.DataFrame([[r.get(c) for c in cols] for r in rows.values()], index=list(rows), columns=cols, dtype=object)


def plot_v_sign(frames: dict):
    """Page 08's figure: per run (label → :func:`head_metric_frame` of ``v_sign_dominance``), the share of V's columns
    with a dominant sign, mean over heads, one line per layer against the step."""
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(frames), figsize=(4.4 * len(frames), 3.2), squeeze=False, sharey=True)
    for ax, (label, f) in zip(axes[0], frames.items()):
        per_layer = f.groupby(["step", "layer"]).value.mean().unstack()
        for lay in per_layer.columns:
            ax.plot(per_layer.index, per_layer[lay], lw=1.2, label=f"layer {lay}")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("step")
        ax.set_ylabel("V columns with a dominant sign (mean over heads)")
    axes[0, -1].legend(fontsize=9, ncol=2)
    return fig


def v_sign_text(frames: dict, layer: int) -> str:
    """Page 08's findings on V's sign structure: per run (label → :func:`head_metric_frame` of ``v_sign_dominance``), a
    Markdown item with the share of one-signed V columns at its last record (mean over layers and heads, in ``layer``,
    over the run's second half in ``layer``, the most one-signed head) and at its first; with both "bf16" and "fp32", the
    ratio of their second-half shares in ``layer`` and what it says (above 1.5: BF16 training builds the structure;
    below 1/1.5: the FP32 twin has more; else about the same)."""
    lines, at_layer = [], {}
    for label, f in frames.items():
        first, last = f[f.step == f.step.min()], f[f.step == f.step.max()]
        top = last.loc[last.value.idxmax()]
        late = f[(f.layer == layer) & (f.step > f.step.max() / 2)]  # one record is noisy: the second half of the run
        at_layer[label] = float(late.value.mean())
        lines.append(f"* **{label}** at step {int(last.step.iloc[0]):,}: {last.value.mean():.1%} of V's columns one-signed on average "
                     f"over layers and heads, {last[last.layer == layer].value.mean():.1%} in layer {layer} (at most "
                     f"{last[last.layer == layer].value.max():.1%}; {at_layer[label]:.1%} over the run's second half), "
                     f"the most in layer {int(top['layer'])}, head {int(top['head'])} ({top['value']:.1%}); at step "
                     f"{int(first.step.iloc[0]):,}: {first.value.mean():.1%} on average.")
    text = "\n".join(lines)
    if {"bf16", "fp32"} <= set(at_layer):
        ratio = at_layer["bf16"] / max(at_layer["fp32"], 1e-12)
        verdict = ("V's sign structure is part of what BF16 training builds there." if ratio > 1.5 else
                   "the FP32 twin has more of them, so they are not what sets the BF16 run apart." if ratio < 1 / 1.5 else
                   "about the same, so one-signed V columns are not what sets the BF16 run apart; the ties are.")
        text += (f"\n\nIn layer {layer}, over the second half of the runs, the BF16 run has {ratio:.1f} times the FP32 twin's "
                 f"share of one-signed V columns: {verdict}")
    return text
