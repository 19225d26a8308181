"""Page 04 (where the Ō error jumps, Fig. 6): lpfa.pages.pv_error on a hand-made P̄V row and on the committed replay
of the BF16 run, the share of the error made at p_bar == 1 keys recomputed here."""

import numpy as np
import pytest

from lpfa.pages.pv_error import first_and_last, plot_pv_error, plot_pv_errors, pv_error_stats, pv_error_text
from lpfa.replay import detail_steps, load_replay
from lpfa.results import run_dir


def _row(p_bar, v, error, head=0, step=10):
    keys = {"p_bar": p_bar, "v": v, "error": error, "top_pk": np.ones((2, 2))}
    return {f"h{head}_s{step}_{'pv_' if k != 'top_pk' else ''}{k}": np.asarray(a, dtype=float) for k, a in keys.items()}


def test_stats_of_a_row_by_hand():
    # increments 0.0, 0.1, 0.2, -0.1: the p_bar == 1 keys (0 and 2) make |0| + |0.2| of 0.4
    arrays = _row([1.0, 0.5, 1.0, 0.25], [-1.0, 2.0, -3.0, 1.0], [0.0, 0.1, 0.3, 0.2])
    st = pv_error_stats(arrays, 0, 10)
    assert st["keys"] == 4 and st["ones"] == 2 and st["signs"] == "one sign" and st["final"] == pytest.approx(0.2)
    assert st["share"] == pytest.approx(0.2 / 0.4)
    mixed = pv_error_stats(_row([1.0, 1.0], [-1.0, 2.0], [0.0, 0.0]), 0, 10)
    assert mixed["signs"] == "mixed signs" and mixed["share"] == 0.0
    assert pv_error_stats(_row([1.0, 0.5], [-1.0, 2.0], [0.0, 1.0]), 0, 10)["signs"] == "—"
    with pytest.raises(ValueError, match=r"head 0, step=11: expected a step this replay measured in detail for that "
                                         r"head, one of \[10\]"):
        pv_error_stats(arrays, 0, 11)


def test_text_and_figures_on_the_committed_replay():
    result, arrays = load_replay(run_dir("repro_runaway") / "bf16_runaway_replay")
    text = pv_error_text(result, arrays)
    cases = [(h, s) for h in result["heads"] for s in detail_steps(arrays, h)]
    assert text.startswith("**Measured.**\n\n") and text.count("\n* head ") == len(cases)
    for h, s in cases:
        p_bar, err = arrays[f"h{h}_s{s}_pv_p_bar"], arrays[f"h{h}_s{s}_pv_error"].astype(float)
        inc = np.abs(np.diff(err, prepend=0.0))
        share = inc[p_bar == 1].sum() / inc.sum()
        ones = int((p_bar == 1).sum())
        assert (f"* head {h}, step {s}: {ones} key{'s' * (ones != 1)} with P̄ = 1 out of {len(p_bar)}") in text
        assert f"final Ō error {err[-1]:+.2e}; the additions at P̄ = 1 keys account for {share:.0%}" in text
    tied = sum(int((arrays[f"h{h}_s{s}_pv_p_bar"] == 1).sum()) > 1 for h, s in cases)
    assert text.endswith(f"The worst token is a tied row (two or more keys with P̄ = 1) at {tied} of these "
                         f"{len(cases)} head-steps.")
    figs = plot_pv_errors(result, arrays)
    drawn = [(h, s) for h in result["heads"] for s in (detail_steps(arrays, h)[0], detail_steps(arrays, h)[-1])]
    assert [f._suptitle.get_text() for f in figs] == [f"layer {result['layer']}, head {h}, step {s}"
                                                       for h, s in dict.fromkeys(drawn)]
    assert first_and_last([5]) == [5] and first_and_last([1, 2, 3]) == [1, 3] and first_and_last([]) == []
    h, s = cases[0]
    assert len(plot_pv_error(arrays, h, s).axes) == 2
