"""lpfa.pages.kernel_bias: page 16's sentences and table from the committed GPU audit, checked against the audit's rows
recomputed here; the CPU path on a small audit; a wrong run name is a one-line error."""

import math

import matplotlib
import pandas as pd
import pytest

from lpfa import audit as A
from lpfa.pages import kernel_bias as kb

matplotlib.use("Agg")


@pytest.fixture(scope="module")
def page():
    return kb.load_page("latest")


@pytest.fixture(scope="module")
def cpu_page():
    return kb.load_page("", T=16, B=1, H=2, D=8, seed=0)


def row(df, kernel, family, quantity):
    ran = df[df.unavailable.isna()]
    r = ran[(ran.kernel == kernel) & (ran.family == family) & (ran.quantity == quantity)]
    assert len(r) == 1
    return r.iloc[0]


def ci(df, kernel, family, quantity):
    r = row(df, kernel, family, quantity)
    return f"{r['mean']:+.2e} (95% CI {r['ci_low']:+.2e} to {r['ci_high']:+.2e})"


def test_load_page_reads_the_committed_audit_at_its_largest_t(page):
    full, config, folder = A.load_audit()
    assert page.folder == folder and page.config == config and page.where == "on one H200"
    assert len(page.full) == len(full)
    for fam, d in page.df.groupby("family"):  # one T per family, the largest the audit has for it
        assert set(d["T"]) == {full[full.family == fam]["T"].max()}
    assert page.captured == [f for f in dict.fromkeys(full.family) if f.startswith("captured:")]
    assert f"`results/kernel_bias/{folder.name}`" in page.source
    assert f"T = {' and '.join(map(str, config['T']))}" in page.source
    text = kb.captured_text(page)
    fam = page.captured[0]
    assert f"at step {config['captured'][fam]['step']:,}" in text
    assert f"`{folder.name}/{fam.split(':', 1)[1]}/qkv.npz`" in text


def test_bias_table_holds_every_kernel_that_ran_but_float64(page):
    t = kb.bias_table(page.df)
    ran = page.df[page.df.unavailable.isna() & (page.df.kernel != "float64")]
    assert len(t) == len(ran) and "float64" not in t.index.get_level_values("kernel")
    excl = [(r.ci_low > 0) or (r.ci_high < 0) for r in ran.itertuples()]
    assert int(t["CI excludes 0"].sum()) == sum(excl)


def test_exclusion_texts_count_the_intervals_against_chance(page):
    n, excluding, rand = kb.exclusion_texts(page.df)
    ran = page.df[page.df.unavailable.isna() & (page.df.kernel != "float64")]
    out = (ran.ci_low > 0) | (ran.ci_high < 0)
    assert (int(n), int(excluding)) == (len(ran), int(out.sum()))
    rnd = ran[ran.family == "random"]
    k, m = int(((rnd.ci_low > 0) | (rnd.ci_high < 0)).sum()), len(rnd)
    tail = sum(math.comb(m, j) * 0.05**j * 0.95 ** (m - j) for j in range(k, m + 1))
    assert rand.startswith(f"{k} of its {m}, against {0.05 * m:.1f} expected by chance (at least that many in "
                           f"{tail:.2g} of such tables")
    for kernel in set(rnd[(rnd.ci_low > 0) | (rnd.ci_high < 0)].kernel):
        assert f"`{kernel}` (" in rand


def test_pr2721_text_states_the_radial_errors_and_their_ratio(page):
    df = page.df
    text = kb.pr2721_text(df)
    fams = list(dict.fromkeys(df.family))
    kernels = ["ref:fa2", "triton:fa2", "sdpa:flash"]
    for k in kernels:
        for f in fams:
            assert f"{ci(df, k, f, 'o_radial')} on {f}" in text
    largest = max(abs(row(df, k, f, "o_radial")["mean"]) for k in kernels for f in fams)
    ratio = abs(row(df, "ref:paper", "ties", "o_radial")["mean"]) / largest
    assert f"The largest of these radial errors, {largest:.1e}, is {ratio:.0f}× smaller" in text
    shrinks = [f for f in fams if row(df, "triton:fa2", f, "o_radial").ci_high < 0]  # negative, excluding 0
    assert ("`triton:fa2` shrinks |O|" in text) == bool(shrinks)


def test_sr_triton_and_fp8_texts_carry_their_intervals(page):
    df = page.df
    sr = kb.sr_text(df)
    assert f"against {ci(df, 'ref:paper', 'ties', 'delta')} for `paper`" in sr
    paper, paper_sr = row(df, "ref:paper", "ties", "delta"), row(df, "ref:paper_sr", "ties", "delta")
    removes = (paper.ci_high < 0 or paper.ci_low > 0) and not (paper_sr.ci_high < 0 or paper_sr.ci_low > 0)
    assert ("Stochastic rounding removes the δ bias" in sr) == removes
    tri = kb.triton_text(df)
    assert f"`triton:paper`'s δ error is {ci(df, 'triton:paper', 'ties', 'delta')}" in tri
    t32 = row(df, "triton:fp32", "ties", "delta")
    if "`triton:fp32` is the exception" in tri:
        assert t32.ci_low > 0 or t32.ci_high < 0
        assert f"{abs(paper['mean']) / abs(t32['mean']):.0f}× below `paper`'s" in tri
    fp8 = kb.fp8_text(df)
    assert f"δ error on the tied rows {ci(df, 'ref:fa3_fp8', 'ties', 'delta')}" in fp8
    if fp8.endswith("of the opposite sign."):
        ratio = abs(row(df, "ref:fa3_fp8", "ties", "delta")["mean"]) / abs(paper["mean"])
        assert f"the δ error is {ratio:.0f}× `paper`'s in size" in fp8


def test_captured_texts_count_the_silenced_rows(page):
    sil = kb.captured_silenced(page)
    assert sil is not None and set(sil.index) == {"paper", "fa2", "paper_sfa", "fa2_sfa"}
    fam = page.captured[0]
    text = kb.captured_bias_text(page.df, sil)
    ran = page.df[page.df.unavailable.isna() & (page.df.kernel != "float64")]
    d = ran[(ran.family == fam) & (ran.quantity == "delta")]
    biased = int(((d.ci_low > 0) | (d.ci_high < 0)).sum())
    assert text.startswith(f"**On the captured layer, {biased} kernels show a δ bias whose interval excludes 0")
    assert kb.top_logit_text(sil) == f"{sil['largest logit'].iloc[0]:.0f}"
    zeroed, rows = int(sil.loc["paper_sfa", "zeroed"]), int(sil.loc["paper_sfa", "rows"])
    sfa = kb.sfa_text(sil)
    assert f"under `paper_sfa` {zeroed:,} of {rows:,} rows ({zeroed / rows:.1%})" in sfa
    assert f"{int(sil.loc['fa2_sfa', 'NaN rows']):,} rows become NaN" in sfa
    assert list(kb.silenced_table(sil).columns) == ["rows", "tied", "sfa shifted", "attenuated", "zeroed", "NaN rows"]


def test_sfa_text_on_made_up_counts():
    sil = pd.DataFrame({"rows": [100, 100], "tied": [10, 10], "sfa shifted": [10, 4], "attenuated": [3, 0],
                        "zeroed": [5, 4], "NaN rows": [0, 2], "largest logit": [150.4, 150.4]},
                       index=["paper_sfa", "fa2_sfa"])
    text = kb.sfa_text(sil)
    assert "under `paper_sfa` 5 of 100 rows (5.0%)" in text and "and 3 are scaled down" in text
    assert "of the 10 rows it shifted" in text and "2 rows become NaN (0/0), of 4 shifted" in text
    assert kb.top_logit_text(sil) == "150" and kb.top_logit_text(None) == "not available"
    assert kb.sfa_text(None) == "No captured layer is committed."


def test_cpu_path_lists_the_gpu_kernels_it_could_not_run(cpu_page):
    p = cpu_page
    assert p.where == "on the CPU" and p.captured == [] and "T = 16, D = 8" in p.source
    gpu = [k for k in A.KERNELS if k not in A.CPU_KERNELS]
    text = kb.unavailable_text(p.df, p.where)
    assert text.startswith(f"{len(gpu)} kernels could not run on the CPU: ")
    assert all(f"`{k}` (needs a CUDA GPU)" in text for k in gpu)
    assert kb.unavailable_text(p.df[p.df.unavailable.isna()], "on one H200") == "Every kernel ran on one H200."
    assert kb.triton_text(p.df) == "The Triton kernels need a GPU; this audit has none of them."
    assert kb.captured_text(p).startswith("not in this audit")
    head = kb.headline(p.df, p.where, T=16)
    assert head.startswith("**On the CPU, ") and "(32 rows, T = 16)" in head
    assert f"its O error averages {ci(p.df, 'ref:paper', 'ties', 'o')}" in head


def test_plot_bias_draws_one_panel_per_quantity(cpu_page):
    import matplotlib.pyplot as plt

    fig = kb.plot_bias(cpu_page.df, cpu_page.where)
    ticks = [t.get_text() for t in fig.axes[0].get_yticklabels()]
    assert len(fig.axes) == 3 and ticks == [k for k in A.KERNELS if k in A.CPU_KERNELS]
    assert [ax.get_title() for ax in fig.axes] == list(kb.QUANTITY_LABELS.values())
    plt.close(fig)


def test_a_wrong_run_is_a_one_line_error():
    with pytest.raises(FileNotFoundError, match=r"has no run 'no-such-run'; runs: \["):
        kb.load_page("no-such-run")
    with pytest.raises(ValueError, match=r"^gpu_run=3: expected a committed run's name, 'latest' or ''$"):
        kb.load_page(3)
