"""lpfa.audit: the input families, a zero-bias float64 kernel, the paper's sign on tied rows, unavailable kernels."""

import math

import pandas as pd
import pytest
import torch

from lpfa import audit as A
from lpfa.mechanism import p_bar_ones
from lpfa.pages.kernel_bias import headline


def test_ties_family_has_tied_bf16_maxima_and_one_signed_v():
    x = A.inputs("ties", B=1, H=2, T=64, D=32, seed=3)
    assert all(t.dtype == torch.bfloat16 for t in x.values())
    s = (x["q"].double() @ x["k"].double().transpose(-1, -2)).to(torch.bfloat16).float() / math.sqrt(32)
    s = s.to(torch.bfloat16).float().masked_fill(torch.ones(64, 64, dtype=torch.bool).triu(1), -math.inf)
    rowmax = s.amax(-1, keepdim=True)
    ties = (s == rowmax).sum(-1)
    t = torch.arange(64)
    assert torch.equal(ties[0, 0], t // A.TIE_STRIDE + 1) and torch.equal(ties[0, 1], t // A.TIE_STRIDE + 1)
    assert torch.equal(p_bar_ones(x["q"], x["k"], "paper_untiled")[0, 0], t // A.TIE_STRIDE + 1)
    assert (x["v"] <= 0).all() and (x["do"] >= 0).all()
    y = A.inputs("ties", B=1, H=2, T=64, D=32, seed=3)
    assert all(torch.equal(x[n], y[n]) for n in x)  # deterministic from the seed


def test_float64_kernel_has_zero_bias():
    x = A.inputs("random", B=1, H=2, T=32, D=16, seed=0)
    for q, r in A.bias("float64", x["q"], x["k"], x["v"], x["do"]).items():
        assert r["mean"] == 0 and r["ci_low"] == 0 == r["ci_high"] and r["n"] == 64, q


def test_paper_preset_is_biased_on_tied_rows_with_the_papers_sign():
    """Fig. 6: the BF16 sum over P̄ = 1 keys of negative V grows in magnitude, so O and δ are biased negative
    (dO > 0) and dQ moves along +u; FP32 attention shows no bias."""
    x = A.inputs("ties", B=2, H=4, T=128, D=32, seed=0)
    r = A.bias("ref:paper", x["q"], x["k"], x["v"], x["do"])
    assert r["o"]["ci_high"] < 0 and r["delta"]["ci_high"] < 0 and r["dq_u"]["ci_low"] > 0
    f = A.bias("ref:fp32", x["q"], x["k"], x["v"], x["do"])
    assert abs(f["o"]["mean"]) < 1e-3 * abs(r["o"]["mean"])


def test_unavailable_kernels_are_listed_with_a_reason_on_cpu():
    df = A.audit(["random"], ["ref:fp32", "triton:fa2", "sdpa:flash", "sdpa:cudnn", "flex"], "cpu", T=16, D=16)
    gpu = df[df.kernel != "ref:fp32"]
    assert (gpu.unavailable == "needs a CUDA GPU").all() and gpu["mean"].isna().all() and (gpu.n == 0).all()
    assert df[df.kernel == "ref:fp32"].unavailable.isna().all()
    assert set(df.columns) >= {"kernel", "family", "quantity", "mean", "ci_low", "ci_high", "n", "device"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the reason given on a machine without a GPU")
def test_cuda_device_without_a_gpu_lists_every_kernel_with_a_reason():
    """device="cuda" on a machine without one: each kernel is listed unavailable, none crashes the audit (the first
    GPU run of benchmarks/kernel_bias.py died here on a local import that shadowed ``torch``)."""
    df = A.audit(["random"], ["ref:fp32", "triton:fa2", "sdpa:math", "flex"], "cuda", T=16, D=16)
    assert (df.unavailable == "no CUDA device is available").all() and df["mean"].isna().all()


@pytest.mark.parametrize("call, message", [
    (lambda: A.inputs("tied"), r"family='tied': expected one of 'random', 'ties'"),
    (lambda: A.audit(["random", "noise"]), r"family='noise': expected one of"),
    (lambda: A.audit(["random"], ["sdpa:fast"]), r"kernel='sdpa:fast': expected one of 'float64'"),
    (lambda: A.bias("ref:papr", *A.inputs("random", T=8, D=8).values()), r"kernel='ref:papr': expected one of"),
    (lambda: A.inputs("random", T=0), r"T=0: expected an int >= 1"),
    (lambda: A.audit(device="tpu"), r"device='tpu': expected 'cpu' or 'cuda\[:N\]'"),
])
def test_bad_input_gives_one_line_naming_the_value(call, message):
    with pytest.raises(ValueError, match=f"^{message}") as e:
        call()
    assert "\n" not in str(e.value)


def test_chance_exclusions_counts_intervals_that_exclude_zero():
    """lpfa.audit.chance_exclusions: intervals of kernels that ran (float64 and unavailable kernels left out), those
    excluding 0 on either side, and the 5% expected by chance, per family when asked."""
    import pandas as pd

    def row(kernel, family, lo, hi, why=None):
        return {"kernel": kernel, "family": family, "quantity": "o", "mean": (lo + hi) / 2, "ci_low": lo, "ci_high": hi,
                "n": 10, "device": "cpu", "unavailable": why}

    df = pd.DataFrame([row("float64", "random", 1.0, 2.0), row("ref:paper", "ties", -3.0, -1.0),
                       row("ref:paper", "random", -1.0, 1.0), row("ref:fa2", "random", 0.5, 1.5),
                       row("sdpa:flash", "random", float("nan"), float("nan"), why="needs a GPU")])
    # p_chance = P(X >= 2), X ~ B(3, 0.05)
    assert A.chance_exclusions(df) == {"n": 3, "excluding": 2, "expected": pytest.approx(0.15),
                                       "p_chance": pytest.approx(3 * 0.05**2 * 0.95 + 0.05**3)}
    assert A.chance_exclusions(df, "random") == {"n": 2, "excluding": 1, "expected": pytest.approx(0.1),
                                                 "p_chance": pytest.approx(1 - 0.95**2)}
    with pytest.raises(ValueError, match="family"):
        A.chance_exclusions(df, "nope")


def test_captured_inputs_round_trip_and_bad_files(tmp_path):
    """lpfa.audit.save_captured / load_captured keep BF16 q, k, v, dO bit for bit with their meta; a file that is not
    an npz, lacks an array, or mixes shapes is a one-line error naming the file."""
    import numpy as np

    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    x = {n: torch.randn(1, 2, 9, 16, generator=g).bfloat16() for n in A.CAPTURED_NAMES}
    path = A.save_captured(tmp_path / "qkv.npz", x, {"step": 7, "layer": 1})
    got, meta = A.load_captured(path)
    assert meta == {"step": 7, "layer": 1}
    for n in A.CAPTURED_NAMES:
        assert got[n].dtype == torch.bfloat16 and torch.equal(got[n].view(torch.int16), x[n].view(torch.int16))
    (tmp_path / "junk.npz").write_text("not an archive")
    with pytest.raises(ValueError, match=r"^captured='.*junk.npz': not a readable .npz"):
        A.load_captured(tmp_path / "junk.npz")
    np.savez(tmp_path / "part.npz", q=np.zeros((1, 1, 2, 16), np.uint16))
    with pytest.raises(ValueError,
                       match=r"^captured='.*part.npz': expected arrays q, k, v, do and meta .*missing k, v, do, meta"):
        A.load_captured(tmp_path / "part.npz")
    bad = dict(x, v=x["v"][:, :, :5])
    A.save_captured(tmp_path / "shapes.npz", bad, {})
    with pytest.raises(ValueError, match=r"one \(B, H, T, D\) shape"):
        A.load_captured(tmp_path / "shapes.npz")


def test_audit_takes_a_captured_family():
    """A captured family runs through every CPU kernel like the built-in ones, at its own shape; a name that clashes
    with a built-in family, or a dict without q, k, v, do, is refused."""
    x = A.inputs("ties", B=1, H=2, T=24, D=16, seed=3)  # stands in for a trained layer's activations
    df = A.audit(["random"], ["float64", "ref:paper", "ref:fp32"], "cpu", B=1, H=2, T=16, D=16, captured={"layer1": x})
    assert set(df.family) == {"random", "layer1"}
    rows = df[(df.family == "layer1") & (df.kernel == "ref:paper")]
    assert len(rows) == len(A.QUANTITIES) and (rows.n == 1 * 2 * 24).all() and rows["mean"].notna().all()
    same = A.audit([], ["ref:paper"], "cpu", captured={"t": x})
    want = A.audit(["ties"], ["ref:paper"], "cpu", B=1, H=2, T=24, D=16, seed=3)
    assert same["mean"].tolist() == want["mean"].tolist()  # the same inputs give the built-in family's numbers
    with pytest.raises(ValueError, match=r"captured\['ties'\]: expected a new family name"):
        A.audit(["random"], ["float64"], "cpu", captured={"ties": x})
    with pytest.raises(ValueError, match=r"captured\['c'\]: expected a new family name and a dict of q, k, v, do"):
        A.audit(["random"], ["float64"], "cpu", captured={"c": {"q": x["q"]}})


def test_silenced_rows_counts_sfa_underflow_on_large_tied_logits():
    """Every key the same vector and q·k·scale = 200: rows t >= 1 see t + 1 tied keys at the max, so SFA (β = 2) shifts
    by rm and their P̄ = exp(−200) underflows in FP32: paper_sfa's clamp outputs 0 (zeroed), fa2_sfa gives 0/0 = NaN.
    Row 0 sees one key (no tie) and keeps P̄ = 1; without SFA nothing is lost."""
    B, H, T, D = 1, 2, 8, 4
    k = torch.ones(B, H, T, D)
    q = torch.full((B, H, T, D), 200.0 / (D * 0.5))  # scale 1/sqrt(4) = 0.5: q·k·scale = 200
    sil = A.silenced_rows({"q": q.bfloat16(), "k": k.bfloat16(), "v": torch.randn(B, H, T, D).bfloat16()})
    tied = B * H * (T - 1)
    assert sil.loc["paper", "tied"] == tied and sil.loc["fa2", "tied"] == tied
    assert (sil.loc[["paper", "fa2"], ["zeroed", "NaN rows", "sfa shifted"]] == 0).all().all()
    assert sil.loc["paper_sfa", "sfa shifted"] == tied and sil.loc["paper_sfa", "zeroed"] == tied
    assert sil.loc["paper_sfa", "NaN rows"] == 0
    assert sil.loc["fa2_sfa", "NaN rows"] == tied and sil.loc["fa2_sfa", "zeroed"] == tied
    assert sil["largest logit"].iloc[0] == pytest.approx(200.0)


def test_result_helpers_pick_one_row_per_family():
    df = A.audit(["random"], ["float64", "ref:paper"], "cpu", B=1, H=1, T=16, D=8)
    two = pd.concat([df.assign(T=16), df.assign(T=32, mean=df["mean"] + 1)])
    with pytest.raises(KeyError, match="expected one"):
        A.result(two, "ref:paper", "random", "o")
    top = A.at_largest_T(two)
    assert set(top["T"]) == {32} and len(top) == len(df)
    row = A.result(top, "ref:paper", "random", "o")
    assert row["mean"] == pytest.approx(A.result(df, "ref:paper", "random", "o")["mean"] + 1)
    assert A.ci_text(row).startswith(f"{row['mean']:+.2e} (95% CI")
    assert A.excludes_zero(row) == bool(row.ci_low > 0 or row.ci_high < 0)
    nan_row = row.copy()
    nan_row["mean"] = nan_row["ci_low"] = nan_row["ci_high"] = float("nan")
    assert A.ci_text(nan_row) == "NaN" and not A.excludes_zero(nan_row)


def test_headline_states_the_committed_gpu_audit():
    """Page 16's opening finding (lpfa.pages.kernel_bias.headline) from the committed GPU audit: paper's three
    tied-row errors with their intervals, and the production kernels' largest δ error against paper's, with its ratio
    and sign."""
    full, config, folder = A.load_audit()
    df = A.at_largest_T(full)
    text = headline(df, "on one H200")
    ran = df[df.unavailable.isna()]
    p = {q: A.result(ran, "ref:paper", "ties", q) for q in ("o", "delta", "dq_u")}
    assert text.startswith("**On one H200, lpfa's `paper` rounding is biased exactly where the paper says")
    assert text.endswith("**.")
    assert all(A.ci_text(row) in text for row in p.values())
    assert (", every interval excluding 0" in text) == all(A.excludes_zero(row) for row in p.values())
    assert f"({int(p['o'].n):,} rows, T = {max(config['T'])})" in text
    prod = [k for k in ("sdpa:flash", "sdpa:cudnn", "sdpa:efficient", "flex") if k in set(ran.kernel)]
    worst = max(prod, key=lambda k: abs(A.result(ran, k, "ties", "delta")["mean"]))
    w = A.result(ran, worst, "ties", "delta")
    assert f"`{worst}`'s {A.ci_text(w)}, is {abs(p['delta']['mean']) / abs(w['mean']):.0f}× smaller" in text
    assert ("of the opposite sign" in text) == (w["mean"] * p["delta"]["mean"] < 0)
