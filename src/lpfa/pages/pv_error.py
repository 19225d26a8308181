"""Page 04, where the Ō error jumps (Fig. 6): the running error of ``o_bar[T, i] = Σ_t p_bar[T, t]·V[t, i]`` summed
key by key in BF16 (:func:`lpfa.mechanism.pv_running_error`) for the worst token and feature of an instrumented
replay's detail steps, and how much of it the additions at ``p_bar == 1`` keys make."""

from __future__ import annotations

import matplotlib.pyplot as plt
import numpy as np

from lpfa.pages.delta_bias import REPLAY_PARAMS, detail_step
from lpfa.plotting import COLORS, use_style
from lpfa.replay import detail_steps

# the notebook's papermill parameters, checked right after its parameters cell (lpfa.params.check_params)
PARAMS = REPLAY_PARAMS


def _pv(arrays: dict, head: int, step: int):
    step = detail_step(arrays, head, step)
    return (arrays[f"h{head}_s{step}_pv_{n}"] for n in ("p_bar", "v", "error"))


def plot_pv_error(arrays: dict, head: int, step: int, title: str = ""):
    """Fig. 6: for the worst token and feature of ``head`` at ``step``, the running error of
    Ō = Σ_t P̄[T, t]·V[t, i] accumulated key by key in BF16, with the ``p_bar == 1`` positions marked, and V[:, i]
    coloured by sign; ``title`` over the figure."""
    use_style()
    p_bar, v, err = _pv(arrays, head, step)
    ones = np.flatnonzero(p_bar == 1)
    fig, axes = plt.subplots(2, 1, figsize=(8, 4), sharex=True)
    axes[0].plot(err, color=COLORS["bf16"], lw=1)
    for t in ones:
        axes[0].axvline(t, color=COLORS["sfa"], lw=0.8, ls="--")
    axes[0].set_ylabel("running Ō error")
    axes[0].set_title(f"{len(ones)} key(s) with P̄ = 1 (dashed)", fontsize=9)
    axes[1].bar(range(len(v)), v, color=[COLORS["bf16"] if x < 0 else COLORS["fp32"] for x in v], width=1.0)
    axes[1].set_ylabel("V[t, i]")
    axes[1].set_xlabel("key t")
    if title:
        fig.suptitle(title, fontsize=9)
    return fig


def plot_pv_errors(result: dict, arrays: dict) -> list:
    """:func:`plot_pv_error` for every replayed head at its first and last detail steps
    (:func:`lpfa.replay.detail_steps`: the replay's first step and its last, after the explosion where the run
    exploded), titled with the layer, head and step; :func:`pv_error_text` lists every detail step, and the page's step
    explorer draws any."""
    return [plot_pv_error(arrays, h, s, f"layer {result['layer']}, head {h}, step {s}")
            for h in result["heads"] for s in first_and_last(detail_steps(arrays, h))]


def first_and_last(steps: list[int]) -> list[int]:
    """The first and the last of ``steps`` (one step if there is one)."""
    return list(dict.fromkeys(steps[:1] + steps[-1:]))


def pv_error_stats(arrays: dict, head: int, step: int) -> dict:
    """The Fig. 6 row of ``head`` at ``step``: its ``keys``, the ``ones`` (keys with ``p_bar == 1``), ``signs`` of V
    there ("one sign", "mixed signs", or "—" for fewer than two), the ``final`` running error, and ``share``: the
    additions at those keys' part of the summed |error increments|."""
    p_bar, v, err = _pv(arrays, head, step)
    ones = np.flatnonzero(p_bar == 1)
    step_err = np.diff(err, prepend=0.0)
    at_ones = float(np.abs(step_err[ones]).sum()) if len(ones) else 0.0
    signs = ("one sign" if len(ones) > 1 and (np.all(v[ones] > 0) or np.all(v[ones] < 0))
             else ("mixed signs" if len(ones) > 1 else "—"))
    return {"keys": len(p_bar), "ones": len(ones), "signs": signs, "final": float(err[-1]),
            "share": at_ones / max(np.abs(step_err).sum(), 1e-300)}


def pv_error_text(result: dict, arrays: dict) -> str:
    """Page 04's finding (Markdown): for every replayed head and detail step, :func:`pv_error_stats` in a sentence, and
    at how many of them the worst token is a tied row (two or more keys with P̄ = 1)."""
    lines, tied = [], 0
    for h in result["heads"]:
        for s in detail_steps(arrays, h):
            st = pv_error_stats(arrays, h, s)
            tied += st["ones"] > 1
            lines.append(f"* head {h}, step {s}: {st['ones']} key{'s' * (st['ones'] != 1)} with P̄ = 1 out of "
                         f"{st['keys']} (V there: {st['signs']}); final Ō error {st['final']:+.2e}; the additions at "
                         f"P̄ = 1 keys account for {st['share']:.0%} of the summed |error increments|.")
    return ("**Measured.**\n\n" + "\n".join(lines)
            + f"\n\nThe worst token is a tied row (two or more keys with P̄ = 1) at {tied} of these {len(lines)} "
              "head-steps.")


def pv_error_view(result: dict, arrays: dict, head: int, step: int):
    """:func:`plot_pv_error` at a replayed ``head`` and detail ``step``, titled with the layer, head and step; a head or
    step the replay did not measure is a one-line ValueError naming the ones it did."""
    from lpfa.pages.delta_bias import _replay_head

    head = _replay_head(result, head)
    return plot_pv_error(arrays, head, step, f"layer {result['layer']}, head {head}, step {step}")
