"""lpfa.diagnostics and QK-clip: exact on constructed weights."""

import math

import pytest
import torch

from lpfa.diagnostics import attention_probe, probe_record, v_sign_dominance, wq_spectral_norms
from lpfa.model import GPT, GPTConfig


def _model(**kw):
    torch.manual_seed(torch.seed() % 2**31)
    return GPT(GPTConfig.from_size("debug", vocab_size=61, block_size=32, attn_backend="math", **kw)).eval()


def test_wq_spectral_norms_match_svd():
    m = _model()
    norms = wq_spectral_norms(m)
    D = m.config.n_embd // m.config.n_head
    for layer in range(m.config.n_layer):
        w = m.transformer.h[layer].attn.c_attn.weight[: m.config.n_embd]
        for h in range(m.config.n_head):
            want = torch.linalg.svdvals(w[h * D : (h + 1) * D].double())[0]
            assert abs(norms[layer, h].item() - want.item()) < 1e-5 * want.item()


@pytest.mark.parametrize("shape", [(3, 7, 50), (2, 50, 7), (1, 13, 13), (4, 64, 768)])
def test_spectral_norms_match_float64_svd(shape):
    """Wide, tall and square stacks, with one scaled far up, one of rank 1, one zero and one with a NaN entry: each
    norm is the float64 SVD's largest singular value rounded to FP32 (within 2 FP32 ulps), NaN where w is not finite."""
    from lpfa.diagnostics import spectral_norms

    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    w = torch.randn(shape, generator=g, dtype=torch.float64)
    w[0] *= 3e4
    if shape[0] > 2:
        w[1] = (torch.randn(shape[1], 1, generator=g, dtype=torch.float64)
                @ torch.randn(1, shape[2], generator=g, dtype=torch.float64))
        w[2] = 0.0
    if shape[0] > 3:
        w[3, 5, 7] = math.nan
    got = spectral_norms(w.float())
    assert got.dtype == torch.float32 and got.shape == shape[:1]
    for h in range(shape[0]):
        if not torch.isfinite(w[h]).all():
            assert math.isnan(got[h])
        else:
            want = torch.linalg.svdvals(w[h].float().double())[0].item()
            assert abs(got[h].item() - want) <= 2 * 2**-23 * want, (h, got[h], want)


@pytest.mark.parametrize("n", [1, 2, 7, 64])
def test_top_eigenvalue_matches_float64_eigvalsh_within_its_stated_bound(n):
    """lpfa.diagnostics.top_eigenvalue (the GPU path of spectral_norms) on fresh PSD matrices: Gram matrices of random
    and far-scaled rows, rank 1, zero, and eigenvalue clusters down to the worst gap of its error bound
    (r = 1 − 2^-(k+1)): within n²/(2e·2^k)·λ₁ of float64 eigvalsh, plus float64 rounding."""
    from lpfa.diagnostics import SQUARINGS, top_eigenvalue

    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    w = torch.randn(8, n, 3 * n + 5, generator=g, dtype=torch.float64)
    w[0] *= 3e4
    w[1] *= 1e-30
    w[2] = (torch.randn(n, 1, generator=g, dtype=torch.float64)
            @ torch.randn(1, 3 * n + 5, generator=g, dtype=torch.float64))
    w[3] = 0.0
    gram = w @ w.mT
    for i, gaps in ((4, [0.0, 1e-13]), (5, [2.0 ** -(SQUARINGS + 1)] * 3), (6, [1e-6, 1e-3]), (7, [0.5])):
        u, _ = torch.linalg.qr(torch.randn(n, n, generator=g, dtype=torch.float64))
        lam = torch.rand(n, generator=g, dtype=torch.float64) * 0.4
        lam[: len(gaps) + 1][: n] = torch.tensor([1.0, *(1.0 - x for x in gaps)], dtype=torch.float64)[: n]
        gram[i] = (u * lam) @ u.T
    want = torch.linalg.eigvalsh(gram)[..., -1].clamp_min(0)
    got = top_eigenvalue(gram)
    assert got.dtype == torch.float64 and got.shape == (8,) and got[3] == 0.0
    bound = n * n / (2 * math.e * 2.0**SQUARINGS) + 64 * n * 2.0**-52
    assert ((got - want).abs() <= bound * want).all(), ((got - want).abs() / want).max()


def test_spectral_norms_of_a_stack_of_layers_are_each_layers():
    """(layers, H, rows, cols) in one call: the same norms as one (H, rows, cols) call per layer, NaN in place."""
    from lpfa.diagnostics import spectral_norms

    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    w = torch.randn(3, 5, 9, 31, generator=g)
    w[1, 2, 0, 4] = math.inf
    got = spectral_norms(w)
    assert got.shape == (3, 5)
    torch.testing.assert_close(got, torch.stack([spectral_norms(x) for x in w]), rtol=1e-6, atol=0, equal_nan=True)
    assert math.isnan(got[1, 2]) and torch.isfinite(got).sum() == 14


def test_probe_counts_ties_and_max_logits():
    m = _model()
    with torch.no_grad():
        m.transformer.h[0].attn.c_attn.weight[m.config.n_embd : 2 * m.config.n_embd] = 0.0  # W_K = 0: all scores 0
    x = torch.randint(0, 61, (3, 32))
    ties, maxes = attention_probe(m, x)
    T = 32
    assert torch.allclose(ties[0], torch.full_like(ties[0], (T - 1) / T, dtype=ties.dtype))  # every row but the first
    assert torch.all(maxes[0] == 0)
    # layer 1: the max logit equals a brute-force computation from the same activations
    cap = {}
    h = m.transformer.h[1].attn.c_attn.register_forward_hook(lambda mod, i, o: cap.setdefault("qkv", o.detach()))
    with torch.no_grad():
        m(x)
    h.remove()
    q, k, _ = cap["qkv"].split(m.config.n_embd, dim=2)
    H, D = m.config.n_head, m.config.n_embd // m.config.n_head
    q, k = (t.view(3, T, H, D).transpose(1, 2).double() for t in (q, k))
    s = (q @ k.transpose(-1, -2)) / math.sqrt(D)
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
    assert torch.allclose(maxes[1].double(), s.amax(dim=(-1, -2)).amax(0), rtol=1e-5)
    assert all(a.attn.capture is None for a in m.transformer.h)  # probe leaves no hooks behind
    rec = probe_record(m, x)
    assert set(rec) == {"wq_spectral_norm", "tie_fraction", "max_logit", "silenced_fraction", "v_sign_dominance"}
    # no SFA, no clamp
    assert len(rec["tie_fraction"]) == 2 and rec["silenced_fraction"] == [[0.0] * m.config.n_head] * m.config.n_layer
    assert torch.equal(torch.tensor(rec["tie_fraction"], dtype=ties.dtype), ties)
    assert torch.equal(torch.tensor(rec["max_logit"], dtype=maxes.dtype), maxes)
    v = cap["qkv"].split(m.config.n_embd, dim=2)[2].view(3, T, H, D).transpose(1, 2)
    assert torch.equal(torch.tensor(rec["v_sign_dominance"][1]), v_sign_dominance(v))  # layer 1's V, as captured above


def test_v_sign_dominance_counts_one_signed_columns():
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    B, H, T, D = 3, 5, 37, 11
    v = torch.randn(B, H, T, D, generator=g)
    v = torch.where(torch.rand(B, H, 1, D, generator=g) < 0.4, v.abs(), v)  # about 40% of the columns one-signed
    v[0, 0, :4, :] = 0.0  # zeros count for neither sign: 33/37 < 0.9 of these columns can share one
    v[1, 2, :, 3] = -v[1, 2, :, 3].abs()
    v[1, 2, :3, 3] = 1.0  # 34/37 ≥ 0.9 negative: still dominant
    for threshold in (0.9, 1.0, 0.6):
        got = v_sign_dominance(v, threshold)
        counts = torch.zeros(H, dtype=torch.float64)
        for b in range(B):
            for h in range(H):
                for i in range(D):
                    col = v[b, h, :, i].tolist()
                    counts[h] += max(sum(x > 0 for x in col), sum(x < 0 for x in col)) / T >= threshold
        assert torch.equal((got.double() * B * D).round(), counts)
    assert v_sign_dominance(v)[2] > 0
    with pytest.raises(ValueError, match="batch, heads, keys, features"):
        v_sign_dominance(v[0])
    with pytest.raises(ValueError, match="threshold must be in"):
        v_sign_dominance(v, 0.5)


def test_qk_clip_bounds_the_max_logit():
    # one layer, so clipping cannot change any head's input
    torch.manual_seed(torch.seed() % 2**31)
    m = GPT(GPTConfig(vocab_size=61, block_size=32, n_layer=1, n_head=4, n_embd=64, attn_backend="math")).eval()
    x = torch.randint(0, 61, (2, 32))
    _, before = attention_probe(m, x)
    tau = float(before.median())
    n = m.qk_clip_(before, tau=tau)
    _, after = attention_probe(m, x)
    assert n == int((before > tau).sum())
    assert torch.all(after <= tau * (1 + 1e-5))
    assert torch.allclose(after[before > tau], torch.full_like(after[before > tau], tau), rtol=1e-5)
    untouched = before <= tau
    assert torch.allclose(after[untouched], before[untouched])


def test_metrics_read_plain_or_gzip(tmp_path):
    """Long runs are committed as metrics.jsonl.gz: every reader takes either."""
    import gzip
    import json

    from lpfa.run import load_metrics, metrics_path, read_records, run_verdict

    recs = [{"step": s, "loss": 3.0 - 0.01 * s} for s in range(20)] + [
        {"step": 19, "val_loss": 2.9}, {"step": 10, "diag": {"wq_spectral_norm": [[1.0]]}}]
    text = "\n".join(json.dumps(r) for r in recs) + "\n"
    conf = {"train": {"attn_policy": "paper", "optimizer": "adamw", "seed": 1, "init_seed": 2}}
    plain, packed = tmp_path / "plain", tmp_path / "packed"
    for d in (plain, packed):
        d.mkdir()
        (d / "config.json").write_text(json.dumps(conf))
    (plain / "metrics.jsonl").write_text(text)
    (packed / "metrics.jsonl.gz").write_bytes(gzip.compress(text.encode()))
    assert metrics_path(packed).name == "metrics.jsonl.gz"
    assert read_records(plain) == read_records(packed) == recs
    (tp, vp, dp), (tz, vz, dz) = load_metrics(plain), load_metrics(packed)
    assert tp.equals(tz) and vp.equals(vz) and dp.equals(dz) and len(tp) == 20
    assert run_verdict(plain) == run_verdict(packed) and run_verdict(packed)["steps"] == 20
    with pytest.raises(FileNotFoundError, match="metrics.jsonl.gz"):
        read_records(tmp_path)


def _fake_run(d, steps, logit, tie, wq, losses, vals):
    import json

    d.mkdir()
    (d / "config.json").write_text(json.dumps({"train": {"attn_policy": "paper", "optimizer": "adamw", "seed": 1,
                                                         "init_seed": 1}}))
    recs = [{"step": s, "loss": loss} for s, loss in enumerate(losses)] + [{"step": s, "val_loss": v} for s, v in vals]
    for i, s in enumerate(steps):  # 2 layers x 3 heads; layer 1 head 2 carries the values, the rest are smaller
        rec = {m: [[0.1, 0.2, 0.3], [0.0, 0.0, x[i]]] for m, x in (("max_logit", logit), ("tie_fraction", tie),
                                                                   ("wq_spectral_norm", wq))}
        recs.append({"step": s, "diag": rec})
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs))


def test_precursor_table_and_divergence(tmp_path):
    import numpy as np

    from lpfa.compare import divergence_step, layer_max, precursor_table
    from lpfa.pages.loss_explosion import plot_precursors

    rng = np.random.default_rng()
    base = rng.uniform(1, 2, size=6)
    _fake_run(tmp_path / "a", [0, 100, 200, 300, 400, 500], base * [1, 1, 3, 5, 8, 9], [0.1] * 6, base, [3.0] * 600,
              [(500, 2.5)])
    _fake_run(tmp_path / "b", [0, 100, 200, 300], base[:4], [0.01] * 4, base[:4] * 2, [3.0] * 400, [(300, 2.6)])
    runs = {"bf16": tmp_path / "a", "fp32": tmp_path / "b"}
    table, step = precursor_table(runs, layer=1)
    assert step == 300  # the last step both reached
    assert table.loc["bf16", "largest attention logit @ 300"] == pytest.approx(base[3] * 5)
    assert table.loc["fp32", "largest per-head ‖W_Q[h]‖₂ @ 300"] == pytest.approx(base[3] * 2)
    assert table.loc["bf16", "steps"] == 600 and table.loc["fp32", "final eval loss"] == pytest.approx(2.6)
    assert not table.loc["bf16", "exploded"]
    t2, s2 = precursor_table(runs, layer=1, step=250)  # each run's last record at or before 250
    assert s2 == 250 and t2.loc["bf16", "largest attention logit @ 250"] == pytest.approx(base[2] * 3)
    la, lb = layer_max(runs["bf16"], "max_logit", 1), layer_max(runs["fp32"], "max_logit", 1)
    assert divergence_step(la, lb, 2.0, patience=2) == 200
    assert divergence_step(la, lb, 100.0) is None
    import pandas as pd

    x, y = pd.Series([1, 5, 5, 5, 1, 5, 5], index=range(7)), pd.Series([1.0] * 7, index=range(7))
    assert divergence_step(x, y, 2.0, patience=3, permanent=False) == 1  # the first stretch, though it falls back
    assert divergence_step(x, y, 2.0, patience=2) == 5  # for good only from step 5
    assert divergence_step(x, y, 2.0, patience=3) is None  # that last stretch is too short
    with pytest.raises(ValueError, match="no layer 5"):
        layer_max(runs["bf16"], "max_logit", 5)
    assert len(plot_precursors(runs, 1).axes) == 3
    from lpfa.compare import plot_logit_runaway

    ax = plot_logit_runaway({"bf16_s2": runs["bf16"], "x": runs["fp32"]}, 1).axes[0]
    assert [line.get_label() for line in ax.get_lines()] == ["bf16_s2", "x", "runaway threshold 1000"]
    from lpfa.plotting import figure_problems

    # seeds: one panel per seed with its twins, so that no colour repeats within a panel
    fig = plot_logit_runaway({f"{m}_s{s}": runs[m] for s in (1, 2) for m in ("bf16", "fp32")}, 1, by_twin=True)
    shown = [ax for ax in fig.axes if ax.get_title()]
    assert [ax.get_title() for ax in shown] == ["s1", "s2"] and figure_problems(fig) == []
    assert [[line.get_label() for line in ax.get_lines()] for ax in shown] == [["bf16", "fp32",
                                                                                "runaway threshold 1000"]] * 2


def test_experiment_table_and_seeds_summary(tmp_path):
    import json

    import numpy as np

    from lpfa.compare import experiment_table
    from lpfa.pages.seeds import seeds_summary

    rng = np.random.default_rng()
    steps = [s * 100 for s in range(12)]
    exp = tmp_path / "seeds"
    exp.mkdir()
    runaway = {"bf16_s1": 300, "bf16_s2": 600, "fp32_s1": None, "fp32_s2": None}
    for label, start in runaway.items():
        logit = rng.uniform(100, 300, size=12)  # any two draws within 3x: no precursor (10x) by chance
        if start is not None:
            logit[start // 100:] = 5000
        _fake_run(exp / label, steps, logit, [0.1] * 12, [2.0] * 12, [3.0] * 1200, [(1100, 2.5)])
        conf = {"train": {"attn_policy": "paper_untiled",
                          "attn_backend": "lpfa" if label.startswith("bf16") else "sdpa_fp32",
                          "optimizer": "adamw", "seed": int(label[-1]), "init_seed": int(label[-1])}}
        (exp / label / "config.json").write_text(json.dumps(conf))
    (exp / "not_a_run").mkdir()
    table, step = experiment_table(exp)
    assert list(table.index) == sorted(runaway) and step == 1100
    assert table.loc["fp32_s2", "change"] == "FP32 attention, seed 2 (data order and init)"
    assert table.loc["fp32_s1", "attention"] == "sdpa_fp32" and table.loc["bf16_s2", "seed"] == 2
    assert table.loc["bf16_s1", "runaway step"] == 300 and table.loc["fp32_s1", "runaway step"] is None
    assert table.loc["bf16_s1", "outcome"] == "logits ran away" and table.loc["fp32_s1", "outcome"] == "neither"
    s = seeds_summary(table)
    assert s.loc["bf16", "ran away"] == 2 and s.loc["bf16", "first runaway"] == 300
    assert s.loc["bf16", "last runaway"] == 600
    assert s.loc["fp32", "ran away"] == 0 and s.loc["fp32", "first runaway"] is None and s.loc["fp32", "runs"] == 2
    with pytest.raises(FileNotFoundError, match="no run folders"):
        experiment_table(tmp_path / "nothing")
    # against a reference run: a logit that leaves it behind for good (but stays under the runaway threshold) is
    # measured in "logit apart from", and the outcome is still neither; the per-label reference here is the FP32 run
    # of the same seed
    pre = rng.uniform(10, 20, size=12)
    pre[7:] *= 40
    _fake_run(tmp_path / "pre", steps, pre, [0.1] * 12, [2.0] * 12, [3.0] * 1200, [(1100, 2.5)])
    _fake_run(tmp_path / "ref", steps, rng.uniform(10, 20, size=12), [0.1] * 12, [2.0] * 12, [3.0] * 1200,
              [(1100, 2.5)])
    (tmp_path / "ref" / "config.json").write_text((exp / "fp32_s1" / "config.json").read_text())
    attn = {"attn_policy": "paper_untiled", "attn_backend": "lpfa", "layer_policies": {"1": "sdpa_fp32"},
            "fp32_heads": {"0": [5, 2]}}
    (tmp_path / "pre" / "config.json").write_text(json.dumps({
        "train": {**attn, "optimizer": "adamw", "seed": 1, "init_seed": 1, "compile": True},
        "model": {"n_layer": 2, "n_head": 8, "n_embd": 64, **attn}}))
    t2, _ = experiment_table({"pre": tmp_path / "pre", "ref": tmp_path / "ref", "bf16_s2": exp / "bf16_s2"},
                             reference=lambda label: (tmp_path / "ref" if label in ("pre", "ref")
                                                      else exp / f"fp32_s{label[-1]}"))
    assert t2.loc["pre", "outcome"] == "neither" and t2.loc["pre", "logit apart from"] == 700
    assert t2.loc["ref", "outcome"] == "neither" and t2.loc["ref", "logit apart from"] is None
    assert t2.loc["bf16_s2", "outcome"] == "logits ran away"  # the stronger outcome wins
    assert set(t2["outcome"]) | set(table["outcome"]) <= {"loss exploded", "logits ran away", "neither"}
    assert t2.loc["pre", "attention"] == "paper_untiled; layer 1: sdpa_fp32; FP32 heads 2, 5 of layer 0"
    assert t2.loc["pre", "compiled"] and not t2.loc["ref", "compiled"]
    # no model config: unknown
    assert t2.loc["pre", "layer 1 scores"] == "fp32" and t2.loc["ref", "layer 1 scores"] is None
    assert t2.loc["pre", "layer 1 δ from"] == "fp32 O"  # layer 1 runs sdpa_fp32
    from lpfa.pages.sfa import outcome_text

    assert outcome_text(t2, "pre") == ("neither exploded nor had its logits run away (its logit apart from the FP32 "
                                       "run's from step 700)")
    assert outcome_text(t2, "ref") == "neither exploded nor had its logits run away"
    assert outcome_text(t2, "bf16_s2") == "did not explode, but its layer-1 logits ran away from step 600"
    assert outcome_text(table, "fp32_s1") == "neither exploded nor had its logits run away"  # no reference
    t0, _ = experiment_table({"pre": tmp_path / "pre"}, layer=0)
    assert t0.loc["pre", "layer 0 scores"] == "bf16; fp32 in heads 2, 5"
    assert t0.loc["pre", "layer 0 δ from"] == "bf16 O; fp32 O in heads 2, 5"
    s2 = seeds_summary(t2, mode=lambda label: "x")
    assert s2.loc["x", "logit apart or worse"] == 2 and s2.loc["x", "ran away"] == 1
    # bf16_s2 leaves ref behind as it runs away
    assert s2.loc["x", "first logit apart"] == 600 and s2.loc["x", "last logit apart"] == 700
    assert "logit apart or worse" not in seeds_summary(table).columns  # no reference, no logit-apart columns


def test_precursor_events_on_committed_pair():
    """The order of events in the committed 30k-step pair: worst-head ties, then mean ties, then the runaway;
    the FP32 twin has none of them (its own columns against itself are absent)."""
    from conftest import ROOT

    from lpfa.pages.tie_frequency import precursor_events

    d = ROOT / "results/repro_pair/h200x2-2026-11-29"
    ev = precursor_events({"bf16": d / "bf16", "fp32": d / "fp32"}, layer=1, reference="fp32")
    b, f = ev.loc["bf16"], ev.loc["fp32"]
    assert (b["worst-head ties rise"] < b["mean ties rise"] < b["logit > 10× fp32"] < b["W_Q > 1.25× fp32"]
            < b["logit runaway"] == 6400)
    # an early lead that closed again
    assert b["explosion"] is None and b["W_Q first > 1.25× fp32"] < b["worst-head ties rise"]
    assert f[["worst-head ties rise", "mean ties rise", "logit runaway", "explosion", "logit > 10× fp32"]].isna().all()


def test_delta_source_of_every_isolation_row():
    """What each isolation row's layer-1 δ is computed from, from its overrides alone (the column the
    isolation page tests its pattern with)."""
    from lpfa.compare import delta_source, score_precision
    from lpfa.experiments import ISOLATION
    from lpfa.model import GPTConfig
    from lpfa.train import parse_overrides

    want = {"bf16": "bf16 O", "fp32": "fp32 O", "bf16_tiled": "bf16 O", "bf16_only_layer1": "bf16 O",
            "fp32_only_layer1": "fp32 O", "delta_dp": "dP∘P", "delta_o_fp32": "fp32 O", "delta_o_exact": "exact O",
            "o_fp32": "fp32 O", "pv_fp32": "bf16 O", "scores_fp32": "bf16 O",
            "fp32_outlier_heads": "bf16 O; fp32 O in heads 2, 5", "fp32_worst_head": "bf16 O; fp32 O in head 5"}
    assert set(want) == set(ISOLATION)
    for label, overrides in ISOLATION.items():
        o = parse_overrides(overrides)
        conf = GPTConfig(n_layer=2, n_head=8, n_embd=64,
                         **{k: o[k] for k in ("attn_policy", "attn_backend", "layer_policies", "fp32_heads")
                            if k in o}).to_dict()
        assert delta_source(conf, 1) == want[label], label
        assert delta_source(conf, 0) in ("bf16 O", "fp32 O", "dP∘P", "exact O"), label
    assert score_precision(GPTConfig(attn_policy="scores_fp32").to_dict(), 1) == "fp32"
    assert delta_source(GPTConfig(attn_backend="math").to_dict(), 0) == "dP∘P"
    assert delta_source(GPTConfig(attn_backend="sdpa").to_dict(), 0) == "bf16 O"


def test_seed_table_and_sfa_findings(tmp_path):
    """Fig. 2 over seeds and the Fig. 7 check, on runs whose verdicts are known by construction: a BF16 run whose loss
    jumps by 3 (exploded), its clean FP32 twin, a clean BF16 seed without a twin, and an SFA run whose logits run
    away."""
    import numpy as np

    from lpfa.pages.loss_explosion import seed_table, seeds_text
    from lpfa.pages.sfa import sfa_findings, sfa_text
    from lpfa.run import run_verdict

    rng = np.random.default_rng()
    steps = [0, 100, 200, 300, 400, 500]
    low = list(rng.uniform(1, 2, size=6))
    boom = [3.0] * 300 + [6.0] * 300
    _fake_run(tmp_path / "bf16_a", steps, [5, 50, 500, 5000, 9000, 9000], [0.1] * 6, low, boom, [(500, 6.0)])
    _fake_run(tmp_path / "fp32_a", steps, low, [0.01] * 6, low, [3.0] * 600, [(500, 2.9)])
    _fake_run(tmp_path / "bf16_b", steps[:4], low[:4], [0.1] * 4, low[:4], [3.0] * 400, [(300, 3.0)])
    sfa_loss = list(rng.uniform(3.4, 3.6, size=700))
    _fake_run(tmp_path / "sfa_a", steps + [600], [5, 2000, 2000, 2000, 2000, 2000, 2000], [0.1] * 7, low + [2.0],
              sfa_loss, [])
    rows = {p.name: p for p in sorted(tmp_path.iterdir())}
    b = run_verdict(rows["bf16_a"])["explosion_step"]
    assert b is not None and 300 <= b < 400

    t = seed_table(rows)
    assert list(t.index) == ["bf16_a", "bf16_b"]
    assert t.loc["bf16_a", "explosion step"] == b and t.loc["bf16_a", "fp32 steps"] == 600
    assert t.loc["bf16_a", "fp32 exploded"] is False  # a twin that ran; None (not run) for bf16_b
    assert t.loc["bf16_b", "fp32 exploded"] is None and np.isnan(t.loc["bf16_b", "explosion step"])
    last, seed = int(t.loc["bf16_b", "steps"]), int(t.loc["bf16_b", "seed"])
    assert last == 400  # censored there: the run without an explosion is reported with its last step
    assert seeds_text(t) == (f"The BF16 run's loss exploded in 1 of 2 seeds (at step {b:,}); the other had not "
                             f"exploded when its run ended, at step {last:,}; 1 FP32 twin ran (600 steps) and 0 "
                             f"exploded; seed {seed} has no FP32 twin.")
    assert seeds_text(t.iloc[:0]) == "No BF16 run at this recipe is committed."

    f = sfa_findings({"bf16": rows["bf16_a"], "fp32": rows["fp32_a"], "sfa": rows["sfa_a"]})
    assert f["steps"] == {"bf16": 600, "fp32": 600, "sfa": 700} and f["explosion step"]["sfa"] is None
    assert f["loss step"] == 599  # the last step both the SFA and the FP32 run trained
    assert f["loss"]["sfa"] == pytest.approx(np.mean(sfa_loss[400:600])) and f["loss"]["fp32"] == pytest.approx(3.0)
    # layer 1 head 2 carries the logits: BF16 above 1000 before its explosion (step 300), SFA from step 100, FP32 never
    assert f["runaway layers"] == {"bf16": [1], "fp32": [], "sfa": [1]}
    assert f["runaway"] == {"bf16": None, "fp32": None, "sfa": (100, 1)}  # 5 records above 1000 in a row: SFA only
    text = sfa_text(f, n_layers=2)
    assert text.startswith(f"**With SFA the loss did not explode in 700 steps**, {700 / b:.1f}× the step at which "
                           "its BF16")
    assert f"{f['loss']['sfa'] - 3.0:.2f} above the FP32 twin's 3.00" in text and "1 of its 2 layers" in text
    assert "ran away from step 100 (layer 1)." in text


def test_seed_spread_text_counts_and_spans():
    """lpfa.pages.seeds.seed_spread_text (page 11): a line per mode with its counts and step spans, and the spread
    paragraph only where every BF16 run's logit parts from its FP32 twin's and no FP32 run's does."""
    import pandas as pd

    from lpfa.pages.seeds import seed_spread_text

    index = ["bf16_s1337", "bf16_s1337_compiled", "fp32_s1337", "fp32_s1"]
    # the step columns as experiment_table gives them (objects, None where there is none)
    table = pd.DataFrame({"runaway step": pd.Series([6400, None, None, None], index=index, dtype=object),
                          "logit apart from": pd.Series([5000, 5800, None, None], index=index, dtype=object),
                          "compiled": [False, True, True, True]}, index=index)
    summary = pd.DataFrame({
        "bf16": {"runs": 2, "exploded": 0, "ran away": 1, "first runaway": 6400, "last runaway": 6400,
                 "logit apart or worse": 2, "first logit apart": 5000, "last logit apart": 5800,
                 "fewest steps run": 7000},
        "fp32": {"runs": 2, "exploded": 0, "ran away": 0, "first runaway": None, "last runaway": None,
                 "logit apart or worse": 0, "first logit apart": None, "last logit apart": None,
                 "fewest steps run": 6900}}).T
    text = seed_spread_text(summary, table)
    assert ("* **bf16**: of 2 runs, the loss exploded in 0 and the logits ran away in 1 (steps 6,400 to 6,400); the "
            "logit parted from the FP32 twin's, or worse, in 2, parting between steps 5,000 and 5,800. Every run "
            "trained at least 7,000 steps." in text)
    assert ("* **fp32**: of 2 runs, the loss exploded in 0 and the logits ran away in 0; the logit parted from the "
            "FP32 twin's, or worse, in 0. Every run" in text)
    assert "Within the first 7,000 steps, 1 of the 2 BF16 runs' logits ran away" in text
    assert "a span of 800 steps across these runs (seed 1337: step 5,000 eager, step 5,800 compiled)" in text
    # an FP32 logit apart: no claim of robustness
    summary.loc["fp32", ["logit apart or worse", "first logit apart", "last logit apart"]] = [1, 6000, 6000]
    assert "Within the first" not in seed_spread_text(summary, table)
