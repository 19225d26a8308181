"""Page 03 (the rank-1 matrices (PK)[T]ᵀX[T], Fig. 4): lpfa.pages.pktx_structure on the committed replay of the BF16
run, its similarities recomputed here from the stored PK and X rows of the worst tokens."""

import numpy as np
import pytest

from lpfa.pages import and_join
from lpfa.pages import pktx_structure as pks
from lpfa.pages.pktx_structure import FIRST, PREV, plot_rank1, similarity_table, similarity_text
from lpfa.replay import detail_steps, load_replay
from lpfa.results import run_dir


@pytest.fixture(scope="module")
def replay():
    return load_replay(run_dir("repro_runaway") / "bf16_runaway_replay")


def _within_median(arrays, head, step):
    """Median over token pairs of cos(PK_T, PK_T')·cos(X_T, X_T'): the cosine of the two rank-1 matrices."""
    pk, x = arrays[f"h{head}_s{step}_top_pk"].astype(float), arrays[f"h{head}_s{step}_top_x"].astype(float)
    sims = [np.dot(pk[i], pk[j]) / np.linalg.norm(pk[i]) / np.linalg.norm(pk[j])
            * np.dot(x[i], x[j]) / np.linalg.norm(x[i]) / np.linalg.norm(x[j])
            for i in range(len(pk)) for j in range(i + 1, len(pk))]
    return float(np.median(sims))


def test_similarity_table_recomputed(replay):
    result, arrays = replay
    table = similarity_table(result, arrays)
    assert list(table.columns) == [f"head {h}" for h in result["heads"]]
    for h in result["heads"]:
        c = table[f"head {h}"]
        for s in detail_steps(arrays, h):
            assert c[f"median similarity, within {s}"] == pytest.approx(_within_median(arrays, h, s), abs=1e-9)
        assert c[PREV] == pytest.approx(float(np.nanmedian(arrays[f"h{h}_overlap_prev"])))
        assert c[FIRST] == pytest.approx(float(np.median(arrays[f"h{h}_overlap_first"][1:])))
        assert abs(c["median similarity, random vectors"]) < 0.1


def test_similarity_text_carries_the_table(replay):
    result, arrays = replay
    table = similarity_table(result, arrays)
    text = similarity_text(result, arrays, table)
    assert text.startswith("**Measured.**\n\n* **head ")
    for h in result["heads"]:
        c = table[f"head {h}"]
        within = c.filter(like="within")
        assert (f"* **head {h}**: median similarity within a step {within.min():.3f} to {within.max():.3f} over the "
                f"{len(within)} detail steps (the lowest at step {int(within.idxmin().split()[-1]):,}) and "
                f"{c.filter(like='across').iloc[0]:.3f} across the {result['steps']:,} replayed steps") in text
        assert f"which overlaps {c[PREV]:.2f} with the previous step's and {c[FIRST]:.2f} with the first step's" in text
    odd = [h for h in result["heads"]  # the first step's direction is no later step's, while the later ones agree
           if arrays[f"h{h}_overlap_first"][1:].max() < 0.5 < np.nanmedian(arrays[f"h{h}_overlap_prev"])]
    if odd:
        assert (f"For head{'s' if len(odd) > 1 else ''} {and_join([str(h) for h in odd])} the first replayed step is "
                "the exception") in text
    else:
        assert "the first replayed step is the exception" not in text


def test_plot_rank1_and_a_head_not_replayed(replay):
    result, arrays = replay
    h = result["heads"][0]
    fig = plot_rank1(arrays, h, title=f"layer {result['layer']}, head {h}")
    assert fig._suptitle.get_text() == f"layer 1, head {h}" and len(fig.axes) == 5  # 3 panels + 2 colourbars
    with pytest.raises(ValueError, match=r"head=99: expected a head this replay measured in detail, one of \[2, 5\]"):
        plot_rank1(arrays, 99)


def _shrunk(arrays: dict, head: int, factor: float) -> dict:
    """``arrays`` with ``head``'s X rows at its first detail step pulled towards independent noise: less alike."""
    out = dict(arrays)
    s = detail_steps(arrays, head)[0]
    x = arrays[f"h{head}_s{s}_top_x"].astype(float)
    noise = np.random.default_rng(0).normal(size=x.shape) * np.linalg.norm(x, axis=1, keepdims=True)
    out[f"h{head}_s{s}_top_x"] = (factor * x + (1 - factor) * noise).astype(arrays[f"h{head}_s{s}_top_x"].dtype)
    return out


def test_similarity_text_judges_every_detail_step_and_reads_the_control(replay):
    """The lead says the picture holds only where every detail step of a head is parallel (PARALLEL), names a head
    that is not with its lowest step; a control's ranges are printed per head and compared at their lowest."""
    result, arrays = replay
    table = similarity_table(result, arrays)
    h = result["heads"][0]
    assert all(pks.within_range(arrays, k)[0] > pks.PARALLEL for k in result["heads"])
    assert "the paper's qualitative picture holds: at every detail step" in similarity_text(result, arrays, table)
    loose = _shrunk(arrays, h, 0.3)
    low, _, at, _ = pks.within_range(loose, h)
    assert low < pks.PARALLEL
    text = similarity_text(result, loose, similarity_table(result, loose))
    assert f"in part in head {h} (down to {low:.3f} at step {at:,})" in text
    assert "at every detail step the rank-1 matrices" not in text and "**The control.**" not in text
    text = similarity_text(result, arrays, table, control=(result, loose))
    assert "**The control.**" in text and "not lower than on the BF16 run in every head" in text
    both = dict(loose)
    for k in result["heads"][1:]:
        both.update({n: v for n, v in _shrunk(arrays, k, 0.3).items() if n.startswith(f"h{k}_")})
    assert ": lower than on the BF16 run in every head" in similarity_text(result, arrays, table, (result, both))
    for k in result["heads"]:
        lo, hi, _, _ = pks.within_range(loose, k)
        assert f"{lo:.3f} to {hi:.3f} (head {k})" in text.split("**The control.**")[1]
