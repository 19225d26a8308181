"""lpfa.dose on synthetic run folders and tables with known answers (the dose-response experiment)."""

import json
import math

import matplotlib
import numpy as np
import pandas as pd
import pytest

from lpfa.dose import dose_table, fit_dose_response, predict, t_quantile
from lpfa.pages.loss_explosion import CENSORED_LABEL, DODGE, dose_summary, extrapolation_text, plot_dose_response

matplotlib.use("Agg")

DIAG = 50  # steps between diagnostics records
TRAIN = {"attn_backend": "lpfa", "attn_policy": "paper_untiled", "optimizer": "adamw", "seed": 1337, "init_seed": 1337,
         "batch_size": 16, "block_size": 128, "grad_accum": 1}


def write_run(d, steps, train=None, explode_at=None, runaway_at=None, logit=30.0, val=(3.5, 3.1)):
    """A run folder as lpfa.train writes it: ``steps`` training records with a flat loss of 3.0 that turns NaN at
    ``explode_at`` (an explosion exactly there), diagnostics every DIAG steps of 2 layers × 2 heads whose layer-1
    head-1 logit is ``logit`` (5000 from ``runaway_at``: a runaway exactly there), and evaluations ``val``."""
    d.mkdir(parents=True)
    conf = {"train": {**TRAIN, **(train or {})}, "model": {"n_layer": 2, "n_head": 2}}
    (d / "config.json").write_text(json.dumps(conf))
    recs = []
    for s in range(steps):
        recs.append({"step": s, "loss": math.nan if explode_at is not None and s >= explode_at else 3.0, "lr": 1e-3,
                     "grad_norm": 1.0})
        if s % DIAG == 0:
            l1 = 5000.0 if runaway_at is not None and s >= runaway_at else logit
            recs.append({"step": s, "diag": {"max_logit": [[10.0, 12.0], [7.0, l1]], "tie_fraction": [[0, 0], [0, 0]]}})
    for i, v in enumerate(val):
        recs.append({"step": (i + 1) * steps // len(val), "val_loss": v})
    (d / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return d


def dosed(k, sign="bias", **extra):
    return {"delta_dose": k, "delta_dose_sign": sign, "delta_dose_layers": [1], **extra}


@pytest.fixture
def runs(tmp_path):
    return {
        "bias_x64": write_run(tmp_path / "bias_x64", 600, dosed(64), explode_at=400, runaway_at=200, logit=40.0),
        "bias_x64_s1": write_run(tmp_path / "bias_x64_s1", 600, dosed(64, seed=1, init_seed=1), runaway_at=300),
        "control_x64": write_run(tmp_path / "control_x64", 600, dosed(64, "control"), val=(3.4, 2.9)),
        "control_x1": write_run(tmp_path / "control_x1", 600, dosed(1, "control")),
        "sfa_bias_x256": write_run(tmp_path / "sfa_bias_x256", 600, dosed(256, attn_policy="paper_sfa"),
                                   runaway_at=100),
        "fp32": write_run(tmp_path / "fp32", 500, {"attn_backend": "sdpa_fp32"}, logit=20.0, val=()),
        "bf16": write_run(tmp_path / "bf16", 600, {"layer_policies": {"1": "paper"}}),
    }


def test_table_parses_dose_sign_base_seed(runs):
    t = dose_table(runs)
    assert list(t.index) == list(runs)
    assert t.attrs["layer"] == 1
    assert t.loc["bias_x64", "k"] == 64.0 and t.loc["bias_x64", "sign"] == "bias"
    assert t.loc["bias_x64", "base"] == "paper_untiled" and t.loc["bias_x64", "seed"] == 1337
    assert t.loc["bias_x64_s1", "seed"] == 1
    assert t.loc["control_x64", "sign"] == "control" and t.loc["control_x64", "k"] == 64.0
    # k = 1 with a random sign is still a dose
    assert (t.loc["control_x1", "k"], t.loc["control_x1", "sign"]) == (1.0, "control")
    assert t.loc["sfa_bias_x256", "base"] == "paper_sfa" and t.loc["sfa_bias_x256", "k"] == 256.0
    # no dose fields: the undosed policy at k = 1 with the policy's own sign
    assert (t.loc["fp32", "k"], t.loc["fp32", "sign"], t.loc["fp32", "base"]) == (1.0, "bias", "sdpa_fp32")
    assert t.loc["bf16", "base"] == "paper"  # layer 1's own policy
    assert t["k"].dtype == float and str(t["failure step"].dtype) == "Int64"


def test_table_verdicts_and_censoring(runs):
    t = dose_table(runs)
    r = t.loc["bias_x64"]
    assert r["exploded"] and r["explosion step"] == 400 and r["runaway step"] == 200 and r["runaway layer"] == 1
    assert r["failure step"] == 400 and not r["censored"]  # the explosion wins over the earlier runaway
    assert r["steps"] == 600 and r["final eval loss"] == 3.1 and r["max logit"] == 5000.0
    r = t.loc["bias_x64_s1"]
    assert not r["exploded"] and pd.isna(r["explosion step"]) and r["failure step"] == 300 and not r["censored"]
    r = t.loc["control_x64"]
    assert r["censored"] and pd.isna(r["failure step"]) and pd.isna(r["runaway layer"])
    assert r["final eval loss"] == 2.9 and r["max logit"] == 30.0
    r = t.loc["fp32"]
    assert r["censored"] and r["steps"] == 500 and math.isnan(r["final eval loss"]) and r["max logit"] == 20.0
    assert t.loc["sfa_bias_x256", "failure step"] == 100
    assert list(t.index[t["censored"]]) == ["control_x64", "control_x1", "fp32", "bf16"]
    assert dose_table(runs, layer=0).loc["bias_x64", "max logit"] == 12.0


def ladder(steps_at, sign="bias", base="paper_untiled"):
    """A dose table of ``{label: (k, failure step or None, steps run)}``, as :func:`dose_table` gives it."""
    rows = {label: {"k": float(k), "sign": sign, "base": base, "seed": 1337, "steps": n, "exploded": s is not None,
                    "explosion step": s, "runaway step": None, "runaway layer": None, "failure step": s,
                    "censored": s is None, "final eval loss": 3.0, "max logit": 100.0}
            for label, (k, s, n) in steps_at.items()}
    t = pd.DataFrame.from_dict(rows, orient="index")
    for col in ("explosion step", "runaway step", "runaway layer", "failure step"):
        t[col] = t[col].astype(float)  # noisy steps are not whole numbers; the fit reads either
    return t


EXACT = {f"bias_x{k}": (k, int(round(3000 * k ** -0.5)), 4000) for k in (4, 9, 16, 25, 36, 64, 100)}


def test_t_quantile_matches_the_tables():
    assert t_quantile(0.95, 1) == pytest.approx(12.706204736, rel=1e-9)
    assert t_quantile(0.95, 2) == pytest.approx(4.302652730, rel=1e-9)
    assert t_quantile(0.95, 5) == pytest.approx(2.570581836, rel=1e-9)
    assert t_quantile(0.95, 30) == pytest.approx(2.042272456, rel=1e-9)
    assert t_quantile(0.68, 1) == pytest.approx(math.tan(0.68 * math.pi / 2), rel=1e-12)  # Cauchy
    with pytest.raises(ValueError, match="integer df"):
        t_quantile(0.95, 0)


def test_exact_power_law():
    t = ladder({**EXACT, "bias_x16_s1": (16, 750, 4000)})
    t = pd.concat([t, ladder({"control_x64": (64, None, 4000), "control_x16": (16, 9000, 9000)}, sign="control")])
    fit = fit_dose_response(t)
    assert fit["n"] == 8 and fit["n_censored"] == 0 and fit["df"] == 6 and fit["note"] is None
    assert fit["slope"] == pytest.approx(-0.5, rel=1e-9)
    assert fit["intercept"] == pytest.approx(math.log10(3000), rel=1e-12)
    assert fit["predicted_at_1"] == pytest.approx(3000, rel=1e-9)
    assert fit["residual_sd"] < 1e-12 and fit["slope_se"] < 1e-12
    for lo, hi in (fit["interval_68"], fit["interval_95"]):  # exact points: a zero-width interval
        assert lo == pytest.approx(3000, rel=1e-9) and hi == pytest.approx(3000, rel=1e-9)
    assert (fit["k_min"], fit["k_max"]) == (4.0, 100.0)
    assert predict(fit, 400)[0] == pytest.approx(150, rel=1e-9)
    assert fit_dose_response(t, sign="control")["n"] == 1  # the control fit is separate


def test_noisy_fit_has_a_positive_width_interval():
    # log10 step = log10 3000 − 0.5·log10 k + e, e = (+d, −2d, +d) at k = 1, 10, 100: orthogonal to 1 and log10 k, so
    # the least-squares line is exactly the true one and the residuals are e (s = √6·d, Sxx = 2, mean log10 k = 1)
    d = 0.01
    steps = {f"bias_x{k}": (k, 3000 * k ** -0.5 * 10 ** e, 4000) for k, e in ((1, d), (10, -2 * d), (100, d))}
    fit = fit_dose_response(ladder(steps))
    assert fit["n"] == 3 and fit["df"] == 1
    assert fit["slope"] == pytest.approx(-0.5, rel=1e-9) and fit["predicted_at_1"] == pytest.approx(3000, rel=1e-9)
    assert fit["residual_sd"] == pytest.approx(math.sqrt(6) * d, rel=1e-9)
    assert fit["slope_se"] == pytest.approx(math.sqrt(3) * d, rel=1e-9)
    assert fit["intercept_se"] == pytest.approx(math.sqrt(6) * d * math.sqrt(1 / 3 + 1 / 2), rel=1e-9)
    assert fit["log10_prediction_se"] == pytest.approx(math.sqrt(11) * d, rel=1e-9)
    half = 12.706204736174698 * math.sqrt(11) * d  # t(0.975, 1 df) × prediction se at log10 k = 0
    assert fit["interval_95"][0] == pytest.approx(3000 * 10 ** -half, rel=1e-9)
    assert fit["interval_95"][1] == pytest.approx(3000 * 10 ** half, rel=1e-9)
    lo68, hi68 = fit["interval_68"]
    assert fit["interval_95"][0] < lo68 < 3000 < hi68 < fit["interval_95"][1]
    # seeds at one dose are separate points: the fit agrees with NumPy's least squares
    k = np.array([4, 4, 4, 16, 64, 64, 256], dtype=float)
    s = 3000 * k ** -0.5 * np.array([1.2, 0.9, 1.0, 1.1, 0.8, 1.05, 1.0])
    fit = fit_dose_response(ladder({f"r{i}": (k[i], s[i], 4000) for i in range(len(k))}))
    (b, a), cov = np.polyfit(np.log10(k), np.log10(s), 1, cov=True)
    assert fit["n"] == 7 and fit["slope"] == pytest.approx(b, rel=1e-9)
    assert fit["intercept"] == pytest.approx(a, rel=1e-9)
    assert fit["slope_se"] == pytest.approx(math.sqrt(cov[0, 0]), rel=1e-6)
    assert fit["interval_95"][1] / fit["interval_95"][0] > 1.5


def test_too_few_points_give_nans_and_a_note():
    t = ladder({"bias_x64": (64, 400, 600), "bias_x128": (128, 200, 600), "bias_x8": (8, None, 600)})
    fit = fit_dose_response(t)  # no exception
    assert fit["n"] == 2 and fit["n_censored"] == 1
    assert math.isnan(fit["slope"]) and math.isnan(fit["predicted_at_1"]) and math.isnan(fit["interval_95"][0])
    assert fit["note"] == "only 2 bias runs with a failure step (a fit with an uncertainty needs at least 3)"
    one_dose = fit_dose_response(ladder({f"s{i}": (64, 400 + i, 600) for i in range(3)}))
    assert one_dose["n"] == 3 and math.isnan(one_dose["slope"]) and "one dose (k = 64)" in one_dose["note"]
    assert fit_dose_response(t, base="paper_sfa")["n"] == 0
    assert math.isnan(predict(fit, 1)[0])
    text = extrapolation_text(fit, tokens_per_step=2048)
    assert text == ("There is no extrapolation of the failure to dose 1: only 2 bias runs with a failure step "
                    "(a fit with an uncertainty needs at least 3).")


def test_fit_on_the_table_of_run_folders(tmp_path):
    folders = {label: write_run(tmp_path / label, s + 100, dosed(k), explode_at=s)
               for label, (k, s, _) in EXACT.items()}
    folders["control_x64"] = write_run(tmp_path / "control_x64", 1000, dosed(64, "control"))
    t = dose_table(folders)
    assert list(t.loc[list(EXACT), "failure step"]) == [1500, 1000, 750, 600, 500, 375, 300]
    fit = fit_dose_response(t, base="paper_untiled")
    assert fit["n"] == 7 and fit["slope"] == pytest.approx(-0.5, rel=1e-9)
    assert fit["predicted_at_1"] == pytest.approx(3000, rel=1e-9) and fit["labels"] == list(EXACT)


def test_extrapolation_text_gives_the_numbers():
    fit = fit_dose_response(ladder(EXACT))
    text = extrapolation_text(fit, tokens_per_step=524_288, steps_per_minute=100)
    assert text == ("Extrapolated to dose k = 1, the power law fitted to 7 bias runs (slope -0.50 ± 0.00, k = 4–100) "
                    "puts the failure at step 3,000 (95% prediction interval 3,000–3,000), "
                    "that is 1.57B tokens (1.57B–1.57B) "
                    "at 524,288 tokens per step and 30 GPU-minutes (30–30) at 100 steps per minute.")
    assert "GPU-minutes" not in extrapolation_text(fit, tokens_per_step=524_288)
    rising = fit_dose_response(ladder({f"b{k}": (k, 100 * k, 9000) for k in (4, 16, 64)}))
    assert rising["slope"] == pytest.approx(1.0, rel=1e-9)
    assert extrapolation_text(rising, 2048).endswith("so this is no evidence that the δ bias drives it.")


def test_summary():
    t = pd.concat([ladder({**EXACT, "bias_x1": (1, None, 4000)}),
                   ladder({"control_x64": (64, None, 4000), "control_x128": (128, None, 4000)}, sign="control"),
                   ladder({"sfa_bias_x2": (2, 100, 4000)}, base="paper_sfa")])
    t.loc["control_x128", "final eval loss"] = 2.7
    t.loc["bias_x9", "exploded"] = False  # a runaway, not an explosion
    fit = fit_dose_response(t, base="paper_untiled")
    s = dose_summary(t, fit)
    assert s["base"] == "paper_untiled" and s["biased_runs"] == 8
    assert s["biased_failed"] == 7 and s["biased_exploded"] == 6
    # the SFA row (k = 2) is not on the ladder
    assert s["smallest_biased_k_failed"] == 4.0 and s["smallest_biased_k_exploded"] == 4.0
    assert s["control_runs"] == 2 and s["control_failed"] == 0 and s["any_control_failed"] is False
    assert s["largest_control_k"] == 128.0 and s["largest_control_k_final_eval_loss"] == 2.7
    assert s["slope"] == pytest.approx(-0.5, rel=1e-9) and s["n_fit"] == 7
    assert s["predicted_at_1"] == pytest.approx(3000, rel=1e-9)
    assert s["predicted_at_1_low_95"] == pytest.approx(3000, rel=1e-9)
    assert s["predicted_at_1_high_95"] == pytest.approx(3000, rel=1e-9)
    json.dumps(s)  # plain values
    empty = dose_summary(ladder({"bias_x4": (4, None, 100)}), fit_dose_response(ladder({"bias_x4": (4, None, 100)})))
    assert empty["smallest_biased_k_exploded"] is None and empty["largest_control_k"] is None
    assert empty["n_fit"] == 0 and math.isnan(empty["slope"])


def test_plot():
    from matplotlib.figure import Figure
    from matplotlib.text import Text

    t = pd.concat([ladder({**EXACT, "bias_x64_s1": (64, 300, 4000), "bias_x2": (2, None, 4000)}),
                   ladder({"control_x64": (64, None, 4000), "control_x100": (100, None, 5000)}, sign="control")])
    fit = fit_dose_response(t)
    fig = plot_dose_response(t, fit, affordable_steps=2000)
    assert isinstance(fig, Figure) and fig.get_size_inches()[0] == pytest.approx(6.4)
    ax = fig.axes[0]
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    assert ax.get_xlabel() == "dose k (× layer-1 δ error)" and ax.get_ylabel() == "step of failure"
    legend = [x.get_text() for x in ax.get_legend().get_texts()]
    assert CENSORED_LABEL in legend and "one GPU run" in legend and "95% prediction interval" in legend
    assert "biased δ error (its BF16 sign kept)" in legend and "control (a random sign per row)" in legend
    assert "several seeds: min–max" in legend
    assert ax.get_xlim()[0] < 1  # the extrapolation reaches k = 1
    # censored runs at their length as upward triangles; controls hollow squares in another colour than the biased
    lines = [x for x in ax.get_lines() if len(x.get_xdata())]
    tri = {(round(k, 9), y) for x in lines if x.get_marker() == "^" for k, y in zip(x.get_xdata(), x.get_ydata())}
    c = DODGE["control"]  # controls sit a little right of their dose
    assert tri == {(2.0, 4000.0), (round(64.0 * c, 9), 4000.0), (round(100.0 * c, 9), 5000.0)}
    circles = next(x for x in lines if x.get_marker() == "o")
    squares = [x for x in ax.get_legend().legend_handles if getattr(x, "get_marker", lambda: None)() == "s"][0]
    assert squares.get_markerfacecolor() == "none" and squares.get_markeredgecolor() != circles.get_markeredgecolor()
    assert circles.get_markerfacecolor() == circles.get_markeredgecolor()
    fig.canvas.draw()
    sizes = [x.get_fontsize() for x in fig.findobj(Text) if x.get_text()]
    assert len(sizes) > 10 and min(sizes) >= 9


def test_plot_without_a_fit(runs):
    t = dose_table(runs)
    fit = fit_dose_response(t, base="paper_untiled")
    assert fit["n"] == 2
    fig = plot_dose_response(t, fit)  # 2 points: no fit line, no band, no exception
    legend = [x.get_text() for x in fig.axes[0].get_legend().get_texts()]
    assert CENSORED_LABEL in legend and not any(x.startswith("fit") for x in legend)
    assert "paper_sfa, biased δ error" in legend and "sdpa_fp32, undosed" in legend and "paper, undosed" in legend


def test_committed_dose_experiment():
    """The committed runs (results/dose, with the isolation table's bf16 and fp32 rows as k = 1 and the FP32
    reference) read as the pages state them."""
    from lpfa.dose import committed_runs, dose_findings
    from lpfa.pages.loss_explosion import dose_text

    runs = committed_runs()
    if not runs:
        pytest.skip("no committed dose results")
    table = dose_table(runs)
    assert runs["bias_x1"].parts[-3:-1] == ("isolation", "h200x4-2026-11-29")
    assert table.loc["bias_x1", "k"] == 1 and table.loc["fp32", "base"] == "sdpa_fp32"
    f = dose_findings(table)
    assert f["bias"]["exploded_ks"] == [32.0, 64.0, 128.0, 256.0] and f["bias"]["exploded_runs"] == 8
    assert f["control"]["exploded_ks"] == [256.0]
    assert f["bias_decides_ks"] == [32.0, 64.0, 128.0] and f["magnitude_suffices_ks"] == [256.0]
    assert f["undosed"] == {"steps": 8000, "exploded": False, "runaway step": None}
    assert f["sfa"]["exploded"] and f["sfa"]["explosion step"] > max(f["sfa"]["without_sfa"])
    fit = fit_dose_response(table, what="runaway step", base="paper_untiled")
    assert fit["n"] == 11 and -0.8 < fit["slope"] < -0.4
    assert fit["interval_95"][0] < 6400 < fit["interval_95"][1]  # the eager 30k BF16 twin ran away at step 6,400
    text = dose_text(table)
    assert "8 of 11 runs" in text
    n_256 = int(((table["sign"] == "control") & (table["k"] == 256)).sum())
    assert (f"at k = 256, with {'one control run' if n_256 == 1 else f'{n_256} control runs'} at each dose, the "
            "magnitude alone sufficed") in text
