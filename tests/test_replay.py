"""Code of the twin/replay commit (38a1e14): mechanism.p_bar_ones, delta_accounting, sfa_attenuation;
explosion_step on NumPy arrays and run_verdict; the sdpa_fp32 backend; STOP file, checkpoint history and
the verdict in summary.json; lpfa.replay (the replay follows the run's trajectory bit for bit on CPU) and
lpfa.sfa_sweep. Everything small and on CPU."""

import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from lpfa.explosion import ExplosionCriterion, explosion_step
from lpfa.mechanism import delta_accounting, delta_error, p_bar_ones, sfa_attenuation
from lpfa.run import run_verdict


# --------------------------------------------------------------------------------------------
# mechanism
# --------------------------------------------------------------------------------------------
def _bf(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).float()


def _ref_p_bar(q, k, scale):
    """The untiled ``paper`` P̄ as fed to P̄V, written out: S = bf16(bf16(QKᵀ)·scale) (QKᵀ exact in float64,
    then FP32), causal −inf, m = row max, P̄ = bf16(exp(bf16(S − m))) with exp in float64."""
    T = q.shape[-2]
    s = _bf(_bf((q.double() @ k.double().transpose(-1, -2)).float()) * scale)
    s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
    m = s.amax(dim=-1, keepdim=True)
    return _bf(torch.exp(_bf(s - m).double()).float())


def _qk_with_ties(B, H, T, D, gen, dup=(2, 5)):
    """Random bf16 q, k; for T > max(dup) the key rows ``dup`` are one vector u and every query leans on u,
    so each row t ≥ max(dup) has its maximum score exactly at both keys."""
    q = torch.randn(B, H, T, D, generator=gen).bfloat16().float()
    k = torch.randn(B, H, T, D, generator=gen).bfloat16().float()
    if T > max(dup):
        u = torch.randn(B, H, 1, D, generator=gen).bfloat16().float()
        for j in dup:
            k[:, :, j] = 2 * u[:, :, 0]
        q = (q + 3 * u).bfloat16().float()
    return q, k


@pytest.mark.parametrize("T", [1, 17, 64])
def test_p_bar_ones_matches_explicit_reference(T):
    gen = torch.Generator().manual_seed(100 + T)
    B, H, D = 2, 2, 16
    scale = 1.0 / math.sqrt(D)
    for tied in (False, True):
        if tied:
            q, k = _qk_with_ties(B, H, T, D, gen)
        else:
            q = torch.randn(B, H, T, D, generator=gen).bfloat16().float()
            k = torch.randn(B, H, T, D, generator=gen).bfloat16().float()
        ones = p_bar_ones(q, k, "paper_untiled")
        want = (_ref_p_bar(q, k, scale) == 1.0).sum(-1)
        assert ones.shape == (B, H, T)
        assert torch.equal(ones, want), (tied, ones, want)
        assert (ones >= 1).all()  # the row max itself always gives P̄ = 1
        assert (ones <= torch.arange(1, T + 1)).all()  # never more than the visible keys
        if tied and T > 5:
            assert (ones[..., 5:] >= 2).all(), ones  # every row that sees both copies of u
        if T == 1:
            assert (ones == 1).all()
    # bf16 inputs give the same counts as their float32 values
    assert torch.equal(p_bar_ones(q.bfloat16(), k.bfloat16(), "paper_untiled"), ones)


def test_p_bar_ones_explicit_scale_and_exact_ties():
    # hand-made scores: with scale 1 row 2 sees scores (3, 3, 1) -> two P̄ = 1; row 1 sees (3, 3)
    q = torch.tensor([[1.0, 0.0], [3.0, 0.0], [3.0, 1.0]]).view(1, 1, 3, 2)
    k = torch.tensor([[1.0, 0.0], [1.0, 0.0], [0.0, 1.0]]).view(1, 1, 3, 2)
    assert p_bar_ones(q, k, "paper_untiled", scale=1.0).tolist() == [[[1, 2, 2]]]
    # a score within the BF16 rounding of exp(·) to 1 counts too: exp(-2^-10) rounds to 1 in BF16
    q2 = torch.tensor([[0.0], [1.0]]).view(1, 1, 2, 1)
    k2 = torch.tensor([[1.0 - 2.0**-8], [1.0]]).view(1, 1, 2, 1)
    # S = (0.99609375, 1.0): S − m = −2^-8, exp = 0.9961 -> not 1 in BF16 (1 − 2^-8 is representable)
    assert p_bar_ones(q2, k2, "paper_untiled", scale=1.0).tolist() == [[[1, 1]]]
    assert _bf(torch.exp(torch.tensor(-(2.0**-10)))).item() == 1.0
    # distinct BF16 scores, S − m = −2^-9 -> exp rounds to 1
    k3 = torch.tensor([[0.5 - 2.0**-9], [0.5]]).view(1, 1, 2, 1)
    q3 = torch.tensor([[0.0], [1.0]]).view(1, 1, 2, 1)
    assert p_bar_ones(q3, k3, "paper_untiled", scale=1.0).tolist() == [[[1, 2]]]


def _brute_same_sign(q, k, v, scale):
    p_bar = _ref_p_bar(q, k, scale)
    B, H, T, D = v.shape
    same, n = 0, 0
    for b in range(B):
        for h in range(H):
            for t in range(T):
                pos = [j for j in range(T) if p_bar[b, h, t, j] == 1.0]
                if len(pos) < 2:
                    continue
                for i in range(D):
                    vals = [float(v[b, h, j, i]) for j in pos]
                    same += all(x > 0 for x in vals) or all(x < 0 for x in vals)
                    n += 1
    return same / n if n else float("nan"), n // D


def test_delta_accounting_is_consistent_and_matches_brute_force():
    gen = torch.Generator().manual_seed(7)
    B, H, T, D = 2, 2, 8, 16
    scale = 1.0 / math.sqrt(D)
    q, k = _qk_with_ties(B, H, T, D, gen, dup=(1, 4))
    v = torch.randn(B, H, T, D, generator=gen).bfloat16().float()
    do = torch.randn(B, H, T, D, generator=gen).bfloat16().float()
    acc = delta_accounting(q, k, v, do)
    ref = delta_error(q, k, v, do, "paper_untiled")
    assert torch.equal(acc["delta_err"], ref["delta_err"])
    assert torch.equal(acc["ones"], p_bar_ones(q, k))
    tied = acc["ones"] >= 2
    assert acc["rows"] == B * H * T
    assert acc["tied_rows"] == int(tied.sum()) == int(((_ref_p_bar(q, k, scale) == 1).sum(-1) >= 2).sum())
    assert acc["tied_rows"] >= B * H * (T - 4)  # rows 4..7 see both copies
    err = ref["delta_err"]
    assert acc["sum_all"] == pytest.approx(float(err.sum()), rel=1e-12, abs=1e-15)
    assert acc["sum_tied"] == pytest.approx(float(err[tied].sum()), rel=1e-12, abs=1e-15)
    assert acc["sum_untied"] == pytest.approx(float(err[~tied].sum()), rel=1e-9, abs=1e-12)
    assert acc["sum_tied"] + acc["sum_untied"] == pytest.approx(acc["sum_all"], rel=1e-12, abs=1e-15)
    assert acc["share_tied"] == pytest.approx(acc["sum_tied"] / acc["sum_all"])
    if acc["sum_tied"] * acc["sum_untied"] >= 0:  # no cancellation between the parts: a share in [0, 1]
        assert 0.0 <= acc["share_tied"] <= 1.0
    assert acc["mean_tied"] == pytest.approx(acc["sum_tied"] / acc["tied_rows"])
    assert acc["mean_untied"] == pytest.approx(acc["sum_untied"] / (acc["rows"] - acc["tied_rows"]))
    want_same, n_tied = _brute_same_sign(q, k, v, scale)
    assert n_tied == acc["tied_rows"]
    assert acc["same_sign"] == pytest.approx(want_same, abs=1e-12)
    assert 0.0 < acc["same_sign"] < 1.0  # random V: some rows agree in sign, some do not

    # V of one sign at the tied keys: every tied (row, feature) agrees
    v_pos = v.abs() + 0.1
    assert delta_accounting(q, k, v_pos, do)["same_sign"] == 1.0

    # no ties at all (T = 1): nothing is tied, the shares and means of tied rows are empty
    one = delta_accounting(q[:, :, :1], k[:, :, :1], v[:, :, :1], do[:, :, :1])
    assert one["tied_rows"] == 0 and one["sum_tied"] == 0.0 and one["sum_untied"] == one["sum_all"]
    assert math.isnan(one["same_sign"]) and math.isnan(one["mean_tied"])


def _hand_qk(rm_pos: float, rm_neg: float):
    """T = 4, D = 4, scale 1, scores exact in BF16:
    row 0: one visible key (never tied); row 1: keys 0 and 1 tie at ``rm_pos``;
    row 2: scores (0, 0, 5): unique max; row 3: keys 0 and 1 tie at ``rm_neg`` < 0, others below."""
    k = torch.tensor([[1.0, 0, 0, 0], [1.0, 0, 0, 0], [0, 1.0, 0, 0], [0, 0, 1.0, 0]])
    q = torch.tensor([[1.0, 0, 0, 0], [rm_pos, 0, 0, 0], [0, 5.0, 0, 0], [rm_neg, rm_neg - 3, rm_neg - 6, 0]])
    return q.view(1, 1, 4, 4), k.view(1, 1, 4, 4)


def test_sfa_attenuation_hand_built_rows():
    q, k = _hand_qk(40.0, -2.0)
    r = sfa_attenuation(q, k, betas=(1.5, 2.0, 4.0), scale=1.0)
    assert set(r) == {1.5, 2.0, 4.0}
    for beta, f in r.items():
        assert f["rows"] == 4
        assert f["sfa"] == 0.5  # rows 1 (rm = 40) and 3 (rm = −2, m = 0) only
    # β = 1.5: m = 60, l = 2·e^-20 ≈ 4e-9 > 1e-10: not attenuated
    assert r[1.5]["attenuated"] == r[1.5]["silenced"] == r[1.5]["zeroed"] == 0.0
    # β = 2: m = 80, l = 2·e^-40 ≈ 8.5e-18 < 1e-10: row 1 attenuated and silenced, but not zeroed in FP32
    assert r[2.0]["attenuated"] == 0.25 and r[2.0]["silenced"] == 0.25 and r[2.0]["zeroed"] == 0.0
    # β = 4: m = 160, e^-120 underflows FP32: row 1 also zeroed
    assert r[4.0]["attenuated"] == 0.25 and r[4.0]["silenced"] == 0.25 and r[4.0]["zeroed"] == 0.25

    # rm = 10: (β − 1)·rm ≤ 10 keeps l ≫ 1e-10: SFA touches the rows, the clamp attenuates none
    q, k = _hand_qk(10.0, -2.0)
    for beta, f in sfa_attenuation(q, k, betas=(1.5, 2.0), scale=1.0).items():
        assert f["sfa"] == 0.5 and f["attenuated"] == f["silenced"] == f["zeroed"] == 0.0

    # a tied row with rm < 0 gets m = 0 whatever β: with rm = −40, l = 2·e^-40 + … < 1e-10 for every β
    # (m = β·rm would instead give l > 1); the rm = 10 row is touched but only attenuated for β = 8
    q, k = _hand_qk(10.0, -40.0)
    for beta, f in sfa_attenuation(q, k, betas=(1.5, 2.0, 8.0), scale=1.0).items():
        if beta == 8.0:  # rm = 10 row: m = 80, l = 2·e^-70 < 1e-10, silenced too
            assert f["attenuated"] == 0.5 and f["silenced"] == 0.5
        else:
            assert f["attenuated"] == 0.25 and f["silenced"] == 0.25
        assert f["sfa"] == 0.5 and f["zeroed"] == 0.0

    # no ties: nothing touched, nothing attenuated, whatever the scores' size
    k_u = torch.tensor([[1.0, 0, 0, 0], [0, 1.0, 0, 0], [0, 0, 1.0, 0], [0, 0, 0, 1.0]]).view(1, 1, 4, 4)
    q_u = torch.tensor([[50.0, 0, 0, 0], [40.0, 60, 0, 0], [-20.0, -30, -40, 0], [1.0, 2, 3, 100]]).view(1, 1, 4, 4)
    for f in sfa_attenuation(q_u, k_u, scale=1.0).values():
        assert f == {"sfa": 0.0, "attenuated": 0.0, "silenced": 0.0, "zeroed": 0.0, "rows": 4}


def test_sfa_attenuation_random_invariants():
    gen = torch.Generator().manual_seed(3)
    q, k = _qk_with_ties(2, 2, 24, 16, gen)
    q = q * 8  # large scores: attenuation for the larger β
    r = sfa_attenuation(q, k)
    assert list(r) == [1.5, 2.0, 4.0, 8.0]
    for f in r.values():
        assert f["rows"] == 2 * 2 * 24
        assert 0 <= f["zeroed"] <= f["silenced"] <= f["attenuated"] <= f["sfa"] <= 1
        assert f["sfa"] >= (24 - 5) / 24  # all rows that see both copies are tied
    att = [f["attenuated"] for f in r.values()]
    assert att == sorted(att)  # a larger β attenuates at least the same rows


# --------------------------------------------------------------------------------------------
# explosion: NumPy path, old pandas algorithm, run_verdict
# --------------------------------------------------------------------------------------------
def _pandas_explosion_step(loss: pd.Series, c: ExplosionCriterion):
    """The pandas implementation before 38a1e14, kept here as the reference."""
    vals = loss.to_numpy(dtype=float)
    steps = loss.index.to_numpy()
    bad = ~np.isfinite(vals)
    first_bad = int(steps[bad.argmax()]) if bad.any() else None
    finite = loss[~bad] if first_bad is None else loss[loss.index < first_bad]
    smooth = finite.rolling(c.window, min_periods=1).mean()
    above = (smooth - smooth.cummin() > c.margin).to_numpy()
    idx = finite.index.to_numpy()
    streak = 0
    for i, a in enumerate(above):
        streak = streak + 1 if a else 0
        if streak >= c.patience:
            return int(idx[i - c.patience + 1])
    return first_bad


def test_explosion_step_numpy_equals_pandas():
    c = ExplosionCriterion(window=10, margin=1.0, patience=20)
    rng = np.random.default_rng(11)
    found = 0
    for trial in range(30):
        n = int(rng.integers(50, 400))
        steps = np.arange(n) * int(rng.integers(1, 4)) + int(rng.integers(0, 100))
        vals = 5.0 + np.cumsum((0.08 if trial % 2 else 0.02) * rng.standard_normal(n))
        base = explosion_step(vals, c, steps=steps)
        if trial % 3 == 1:
            at = int(rng.integers(10, n - 30))
            vals[at:] += 4.0  # a synthetic explosion at a known step
        if trial % 5 == 2:
            vals[int(rng.integers(0, n))] = np.nan
        ser = pd.Series(vals, index=steps)
        got_np = explosion_step(vals, c, steps=steps)
        got_list = explosion_step(list(vals), c, steps=list(steps))
        assert got_np == got_list == explosion_step(ser, c) == _pandas_explosion_step(ser, c), trial
        if trial % 3 == 1 and not np.isnan(vals).any() and (base is None or base > steps[at]):
            found += 1
            assert got_np is not None and steps[at] <= got_np <= steps[min(at + c.window, n - 1)], \
                (trial, got_np, steps[at])
    assert found >= 3
    # known answers on NumPy input: a jump of 3 at step 300 of a flat curve shows in the 10-step mean
    # (3 + 3·n/10 > 3 + 1) once n = 4 new steps are in it; a jump of 20 at once; a NaN at step 123
    flat = np.full(600, 3.0)
    flat[300:] += 3.0
    assert explosion_step(flat, c, steps=np.arange(600)) == 303
    flat[300:] += 17.0
    assert explosion_step(flat, c, steps=np.arange(600)) == 300
    assert explosion_step(flat, c, steps=np.arange(600) * 10) == 3000
    flat[123] = np.nan
    assert explosion_step(flat, c, steps=np.arange(600)) == 123
    assert explosion_step(np.full(600, 3.0), c, steps=np.arange(600)) is None
    assert explosion_step(np.array([]), c, steps=np.array([], dtype=int)) is None


def _write_run(d: Path, losses: dict, train_conf: dict, extra_lines=()):
    d.mkdir(parents=True)
    lines = [json.dumps({"step": s, "loss": loss}) for s, loss in losses.items()] + list(extra_lines)
    (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    (d / "config.json").write_text(json.dumps({"train": train_conf}))


def test_run_verdict_on_hand_written_runs(tmp_path):
    conf = {"attn_policy": "paper", "optimizer": "adamw", "seed": 5, "init_seed": 6}
    c = ExplosionCriterion(window=5, margin=1.0, patience=5)
    losses = {s: 3.0 for s in range(40)}
    losses.update({s: 9.0 for s in range(25, 40)})  # smoothed over 5 steps: 4.2 > 3 + 1 already at step 25
    extra = [json.dumps({"step": s, "val_loss": 99.0}) for s in (10, 20)] + [json.dumps({"step": 30, "diag": {}})]
    _write_run(tmp_path / "a", losses, conf, extra)
    v = run_verdict(tmp_path / "a", c)
    assert v["policy"] == "paper" and v["attn_backend"] == "lpfa" and v["seed"] == 5 and v["init_seed"] == 6
    assert v["steps"] == 40 and v["exploded"] and v["explosion_step"] == 25
    assert v["criterion"]["window"] == 5 and "description" in v["criterion"]
    # resumed: first a bad record of step 3 (before a resume), then a good one; the last wins
    lines = [json.dumps({"step": 3, "loss": float("nan")})]
    _write_run(tmp_path / "b", {s: 3.0 for s in range(12)}, {**conf, "attn_backend": "sdpa_fp32"}, ())
    txt = (tmp_path / "b" / "metrics.jsonl").read_text()
    (tmp_path / "b" / "metrics.jsonl").write_text(lines[0] + "\n" + txt)
    v = run_verdict(tmp_path / "b", c)
    assert v["policy"] == "sdpa_fp32" and v["attn_backend"] == "sdpa_fp32"
    assert not v["exploded"] and v["explosion_step"] is None and v["steps"] == 12
    # a NaN loss that stays (json writes NaN) is an explosion at that step
    _write_run(tmp_path / "c", {**{s: 3.0 for s in range(12)}, 7: float("nan")}, conf)
    assert run_verdict(tmp_path / "c", c)["explosion_step"] == 7


# --------------------------------------------------------------------------------------------
# model: the sdpa_fp32 backend
# --------------------------------------------------------------------------------------------
def _models(backends, **kw):
    from lpfa.model import GPT, GPTConfig

    torch.manual_seed(0)
    ref = GPT(GPTConfig.from_size("debug", vocab_size=64, block_size=16, attn_backend=backends[0], **kw))
    out = [ref]
    for b in backends[1:]:
        m = GPT(GPTConfig.from_size("debug", vocab_size=64, block_size=16, attn_backend=b, **kw))
        m.load_state_dict(ref.state_dict())
        out.append(m)
    return out


def test_sdpa_fp32_matches_math_in_float32():
    math_m, fp32_m = _models(["math", "sdpa_fp32"])
    # larger weights than the init, so attention is far from uniform
    with torch.no_grad():
        for m in (math_m, fp32_m):
            for b in m.transformer.h:
                b.attn.c_attn.weight.mul_(8)
    g = torch.Generator().manual_seed(1)
    idx = torch.randint(0, 64, (3, 16), generator=g)
    tgt = torch.randint(0, 64, (3, 16), generator=g)
    la, lossa = math_m(idx, tgt)
    lb, lossb = fp32_m(idx, tgt)
    assert lb.dtype == torch.float32
    torch.testing.assert_close(lb, la, rtol=1e-5, atol=1e-5)
    lossa.backward()
    lossb.backward()
    ga, gb = dict(math_m.named_parameters()), dict(fp32_m.named_parameters())
    for name, p in ga.items():
        assert p.grad is not None and gb[name].grad is not None, name
        torch.testing.assert_close(gb[name].grad, p.grad, rtol=1e-4, atol=1e-5, msg=name)
    assert float(ga["transformer.h.0.attn.c_attn.weight"].grad.abs().max()) > 1e-4  # the gradient is not trivial


def test_sdpa_fp32_attention_is_fp32_under_bf16_autocast():
    import torch.nn.functional as F

    (fp32_m, sdpa_m) = _models(["sdpa_fp32", "sdpa"])
    with torch.no_grad():
        for m in (fp32_m, sdpa_m):
            for b in m.transformer.h:
                b.attn.c_attn.weight.mul_(8)
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(2))
    caps = {}
    for name, m in (("fp32", fp32_m), ("sdpa", sdpa_m)):
        attn = m.transformer.h[0].attn  # layer 0: both models see the same q, k, v
        attn.capture = {"all": True}
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits, _ = m(idx)
        caps[name] = attn.capture
        attn.capture = None
    cap = caps["fp32"]
    assert cap["q"].dtype == torch.bfloat16  # autocast made the projections BF16
    o = cap["o"]
    assert o.dtype == torch.float32
    want = F.scaled_dot_product_attention(cap["q"].float(), cap["k"].float(), cap["v"].float(), is_causal=True)
    torch.testing.assert_close(o, want, rtol=0, atol=1e-6)
    # the output is not BF16 arithmetic: it is not even BF16-representable, unlike the sdpa backend's
    assert (o.bfloat16().float() != o).float().mean() > 0.5
    assert torch.equal(caps["sdpa"]["q"], cap["q"]) and torch.equal(caps["sdpa"]["v"], cap["v"])
    assert caps["sdpa"]["o"].dtype == torch.bfloat16
    assert (caps["sdpa"]["o"].float() - want).abs().max() > 10 * (o - want).abs().max()


# --------------------------------------------------------------------------------------------
# train: STOP file, checkpoint history, the verdict in summary.json
# --------------------------------------------------------------------------------------------
def _cfg(token_dir, out_dir, **kw):
    """test_train's small config, with 4 sequences per batch and one eval batch."""
    from test_train import cfg

    return cfg(token_dir, out_dir, **{"batch_size": 4, "eval_batches": 1, **kw})


def _losses(out_dir):
    from test_train import losses

    return losses(out_dir)


def test_stop_file_ends_the_run_with_a_checkpoint(byte_tokens, tmp_path, monkeypatch):
    import lpfa.train as lt
    from lpfa.checkpoints import load_checkpoint

    out = tmp_path / "run"
    orig = lt.RunWriter.metric

    def metric(self, rec):
        orig(self, rec)
        if rec.get("step") == 3 and "loss" in rec:
            (out / "STOP").touch()  # as a user would, while step 3 is being finished

    monkeypatch.setattr(lt.RunWriter, "metric", metric)
    s = lt.train(_cfg(byte_tokens, out, max_steps=12, attn_backend="sdpa"))
    assert s["status"] == "stopped" and s["steps"] == 4
    assert sorted(_losses(out)) == [0, 1, 2, 3]
    assert load_checkpoint(out / "ckpt").step == 4
    assert "STOP file found" in (out / "log.txt").read_text()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["status"] == "stopped" and summary["steps"] == 4
    # resume continues once the file is gone
    monkeypatch.setattr(lt.RunWriter, "metric", orig)
    (out / "STOP").unlink()
    s = lt.train(_cfg(byte_tokens, out, max_steps=12, attn_backend="sdpa", resume=True))
    assert s["status"] == "completed" and sorted(_losses(out)) == list(range(12))


def test_ckpt_history_and_summary_verdict(byte_tokens, tmp_path):
    from lpfa.checkpoints import load_checkpoint
    from lpfa.train import train

    out = tmp_path / "hist"
    s = train(_cfg(byte_tokens, out, max_steps=12, ckpt_interval=4, ckpt_history=True, attn_policy="paper", seed=21))
    hist = sorted(p.name for p in (out / "ckpt_history").iterdir())
    assert hist == ["step_000004", "step_000008"]  # the final one is ckpt/ only
    cks = {n: load_checkpoint(out / "ckpt_history" / n) for n in hist}
    assert [c.step for c in cks.values()] == [4, 8]
    for c in cks.values():
        assert c.extra_state is not None and len(c.extra_state["optimizers"]) == 1
    final = load_checkpoint(out / "ckpt")
    assert final.step == 12
    w4, w8, w12 = (c.model.state_dict()["transformer.h.0.attn.c_attn.weight"]
                   for c in (*cks.values(), final))
    assert not torch.equal(w4, w8) and not torch.equal(w8, w12)  # copies, not one folder seen three times
    summary = json.loads((out / "summary.json").read_text())
    for key in ("status", "steps", "policy", "seed", "exploded", "explosion_step"):
        assert s[key] == summary[key], key  # the returned summary is the written one
    assert summary["status"] == "completed" and summary["steps"] == 12
    assert summary["policy"] == "paper" and summary["attn_backend"] == "lpfa" and summary["seed"] == 21
    assert summary["exploded"] is False and summary["explosion_step"] is None
    assert summary["criterion"] == ExplosionCriterion().to_dict()
    assert summary["optimizer"] == "adamw" and summary["init_seed"] == 1337


# --------------------------------------------------------------------------------------------
# replay and SFA sweep on one tiny run
# --------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_run(byte_tokens, tmp_path_factory):
    from lpfa.train import train

    out = tmp_path_factory.mktemp("replay_run") / "run"
    s = train(_cfg(byte_tokens, out, block_size=32, batch_size=4, max_steps=20, diag_interval=5, ckpt_interval=10,
                   ckpt_history=True, attn_policy="paper_untiled", lr=1e-2, warmup_steps=2))
    assert s["status"] == "completed"
    return out


def test_choose_checkpoint(tiny_run):
    from lpfa.replay import choose_checkpoint
    from lpfa.run import checkpoints_of

    cks = checkpoints_of(tiny_run)
    assert sorted(cks) == [10, 20]
    assert cks[10] == tiny_run / "ckpt_history" / "step_000010" and cks[20] == tiny_run / "ckpt"
    assert choose_checkpoint(tiny_run, None) == 20
    assert choose_checkpoint(tiny_run, 15) == 10
    assert choose_checkpoint(tiny_run, 20) == 10  # strictly before the explosion
    assert choose_checkpoint(tiny_run, 21) == 20
    assert choose_checkpoint(tiny_run, 3) == 10  # none before: the earliest
    assert choose_checkpoint(tiny_run, None, 15) == 10  # no explosion: before the logit runaway
    assert choose_checkpoint(tiny_run, 21, 15) == 20  # an explosion comes first
    with pytest.raises(FileNotFoundError):
        choose_checkpoint(tiny_run / "nothing", None)


def test_replay_follows_the_trajectory_and_writes_its_files(tiny_run, tmp_path, monkeypatch):
    import lpfa.run as lc  # the replay loads its checkpoint through lpfa.run.Run
    from lpfa.replay import replay

    loaded = []
    orig = lc.load_checkpoint

    def spy(*a, **kw):
        ck = orig(*a, **kw)
        loaded.append(ck)
        return ck

    monkeypatch.setattr(lc, "load_checkpoint", spy)
    r = replay(tiny_run, tmp_path / "rep", step=10, layer="auto", heads=None, steps=10, n_seq=4, device="cpu")
    monkeypatch.setattr(lc, "load_checkpoint", orig)
    assert len(loaded) == 1 and loaded[0].step == 10
    # the replayed model (trained in place from step 10 to 20) equals the run's own step-20 weights, bit for bit
    got = loaded[0].model.state_dict()
    want = orig(tiny_run / "ckpt").model.state_dict()
    start = orig(tiny_run / "ckpt_history" / "step_000010").model.state_dict()
    assert set(got) == set(want) == set(start)
    assert not torch.equal(start["transformer.h.0.attn.c_attn.weight"], want["transformer.h.0.attn.c_attn.weight"])
    for name in want:
        assert torch.equal(got[name], want[name]), name
    # ... and its losses are the run's
    run_losses = _losses(tiny_run)
    assert [p["step"] for p in r["per_step"]] == list(range(10, 20))
    assert [p["loss"] for p in r["per_step"]] == [run_losses[s] for s in range(10, 20)]

    js = json.loads((tmp_path / "rep" / "replay.json").read_text())
    assert json.loads((tmp_path / "rep" / "provenance.json").read_text()) == js["provenance"]
    for key in ("run", "verdict", "checkpoint_step", "steps", "layer", "heads", "choice", "policy", "n_seq", "summary",
                "per_step", "provenance", "agreement"):
        assert key in js, key
    assert js["agreement"] == {"compared": 10, "bit_equal": 10, "first_mismatch": None, "max_abs_diff": 0.0}
    assert js["checkpoint_step"] == 10 and js["steps"] == 10 and js["policy"] == "paper_untiled"
    assert js["layer"] in (0, 1) and sorted(js["heads"]) == [0, 1]
    assert js["verdict"]["exploded"] is False
    T = 32
    for p in js["per_step"]:
        for h in js["heads"]:
            m = p["heads"][str(h)]
            assert m["rows"] == 4 * T and 0 <= m["tied_rows"] <= m["rows"]
            assert m["sum_tied"] + m["sum_untied"] == pytest.approx(m["sum_all"], abs=1e-12)
            assert m["g_norm"] >= 0 and 0 < m["g_top_energy"] <= 1 + 1e-12 and m["abs_err_mean"] > 0
            assert ("worst_token" in m) == (p["step"] in (10, 19))
    for h in js["heads"]:
        sm = js["summary"][str(h)]
        assert sm["steps"] == 10
        assert sm["cum_delta_err"] == pytest.approx(sum(p["heads"][str(h)]["sum_all"] for p in js["per_step"]))
        assert 0 <= sm["tied_row_fraction"] <= 1 and 0 <= sm["overlap_chance"] <= 1
    npz = np.load(tmp_path / "rep" / "replay.npz")
    for h in js["heads"]:
        assert npz[f"h{h}_delta_err"].shape == (2, 4, T)  # every 10th replayed step and the last
        assert npz[f"h{h}_delta_err_steps"].tolist() == [10, 19]
        assert npz[f"h{h}_overlap_first"].shape == (10,) and npz[f"h{h}_overlap_first"][0] == pytest.approx(1.0)
        assert np.isnan(npz[f"h{h}_overlap_prev"][0]) and (npz[f"h{h}_overlap_prev"][1:] <= 1 + 1e-9).all()
        for s in (10, 19):
            for key in ("top_tokens", "top_pk", "top_x", "top_delta_err", "worst_do", "worst_o_err", "pv_p_bar", "pv_v",
                        "pv_error"):
                assert f"h{h}_s{s}_{key}" in npz.files, (h, s, key)
        # the per-step δ errors are delta_accounting's, summed as in replay.json
        assert float(npz[f"h{h}_delta_err"][0].astype(np.float64).sum()) == pytest.approx(
            js["per_step"][0]["heads"][str(h)]["sum_all"], rel=1e-5, abs=1e-6)


def test_side_pass_measures_what_the_step_sees_and_leaves_the_trajectory(tiny_run, tmp_path):
    """A compiled run is measured by a side pass before each step: on an eager run, forced, it must measure exactly
    what the step's own capture measures, and its gradients must not leak into the step (losses stay the run's)."""
    from lpfa.replay import replay

    kw = dict(step=10, layer=1, heads=[0, 1], steps=4, n_seq=2, device="cpu", detail_every=2)
    own = replay(tiny_run, tmp_path / "own", **kw)
    side = replay(tiny_run, tmp_path / "side", side_pass=True, **kw)
    assert own["measured_by"] == "the step" and side["measured_by"] == "side pass" and side["compiled"] is False
    assert side["agreement"]["bit_equal"] == side["agreement"]["compared"] == 4
    assert [p["heads"] for p in side["per_step"]] == [p["heads"] for p in own["per_step"]]


def test_replay_cli_max_s_stops_early_and_still_writes(tiny_run, tmp_path, capsys):
    from lpfa.replay import main

    out = tmp_path / "early"
    assert main(["--run", str(tiny_run), "--out", str(out), "--step", "10", "--layer", "1", "--heads", "0",
                 "--steps", "8", "--n-seq", "2", "--device", "cpu", "--max-s", "1e-9"]) == 0
    js = json.loads((out / "replay.json").read_text())
    # the check starts after two steps, so it stops at the third and measures it in detail
    assert [p["step"] for p in js["per_step"]] == [10, 11, 12]
    assert js["steps"] == 3 and js["layer"] == 1 and js["heads"] == [0] and js["n_seq"] == 2
    npz = np.load(out / "replay.npz")
    assert npz["h0_delta_err"].shape == (2, 2, 32) and npz["h0_delta_err_steps"].tolist() == [10, 12]
    assert "h0_s10_pv_error" in npz.files and "h0_s12_pv_error" in npz.files
    assert "checkpoint_step" in capsys.readouterr().out


def test_replay_refuses_unknown_checkpoint(tiny_run, tmp_path):
    from lpfa.replay import replay

    with pytest.raises(ValueError, match="no checkpoint at step 5"):
        replay(tiny_run, tmp_path / "x", step=5, layer=0, heads=[0], steps=1, device="cpu")


def test_sfa_sweep_run(tiny_run):
    from lpfa.sfa_sweep import BETAS, sweep_run

    res = sweep_run(tiny_run, n_seq=2, device="cpu")
    assert res["betas"] == list(BETAS) and res["n_seq"] == 2
    assert sorted(res["steps"]) == ["10", "20"]  # one entry per checkpoint
    for step, layers in res["steps"].items():
        assert len(layers) == 2  # debug: 2 layers
        for per_beta in layers:
            assert list(per_beta) == list(BETAS)
            for f in per_beta.values():
                assert f["rows"] == 2 * 2 * 32
                for key in ("sfa", "attenuated", "silenced", "zeroed"):
                    assert 0.0 <= f[key] <= 1.0, (step, key, f)
                assert f["zeroed"] <= f["silenced"] <= f["attenuated"] <= f["sfa"]


def test_layer_policies_can_name_a_backend_per_layer():
    """``layer_policies`` may give one layer another backend (the isolation rows "BF16 / FP32 attention only in
    one layer"): a model whose layer 0 is ``paper_untiled`` under a global ``sdpa_fp32`` equals, layer by layer,
    the all-``sdpa_fp32`` model everywhere except in what layer 0's attention computes."""
    from lpfa.model import GPT, GPTConfig

    torch.manual_seed(0)
    mixed = GPT(GPTConfig.from_size("debug", vocab_size=64, block_size=16, attn_backend="sdpa_fp32",
                                    layer_policies={0: "paper_untiled"}))
    assert [b.attn.backend for b in mixed.transformer.h] == ["lpfa", "sdpa_fp32"]
    assert mixed.transformer.h[0].attn.policy.name == "paper_untiled" and mixed.transformer.h[1].attn.policy is None
    lp = GPT(GPTConfig.from_size("debug", vocab_size=64, block_size=16, attn_policy="paper_untiled"))
    hp = GPT(GPTConfig.from_size("debug", vocab_size=64, block_size=16, attn_backend="sdpa_fp32"))
    lp.load_state_dict(mixed.state_dict())
    hp.load_state_dict(mixed.state_dict())
    idx = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(3))
    outs = {}
    for name, m in (("mixed", mixed), ("lp", lp), ("hp", hp)):
        got = []
        hooks = [b.attn.register_forward_hook(lambda mod, i, o, got=got: got.append(o.detach()))
                 for b in m.transformer.h]
        m(idx)
        for h in hooks:
            h.remove()
        outs[name] = got
    assert torch.equal(outs["mixed"][0], outs["lp"][0])  # layer 0 as the BF16 policy computes it
    assert not torch.equal(outs["lp"][0], outs["hp"][0])  # which differs from FP32 attention
    with pytest.raises(ValueError, match="unknown"):
        GPTConfig.from_size("debug", layer_policies={0: "no_such_thing"})


def test_thin_delta_err():
    from lpfa.replay import thin_delta_err

    rng = np.random.default_rng()
    n = int(rng.integers(1, 40))
    steps = np.arange(100, 100 + n)
    arrays = {"h3_delta_err": rng.standard_normal((n, 2, 5)).astype(np.float32), "h3_g_u": rng.standard_normal((n, 4)),
              "h3_g_v": rng.standard_normal((n, 6)), "h3_overlap_first": rng.standard_normal(n)}
    t = thin_delta_err(arrays, steps, 7)
    keep = sorted(set(range(0, n, 7)) | {n - 1})
    for key in ("h3_delta_err", "h3_g_u", "h3_g_v"):  # the per-step arrays are thinned
        assert t[f"{key}_steps"].tolist() == [100 + i for i in keep]
        assert np.array_equal(t[key], arrays[key][keep])
    assert t["h3_overlap_first"] is arrays["h3_overlap_first"]  # the overlaps keep every step
    assert thin_delta_err(t, steps, 3)["h3_delta_err"] is t["h3_delta_err"]  # already thinned: left alone
    assert np.array_equal(thin_delta_err(arrays, steps, 1)["h3_delta_err"], arrays["h3_delta_err"])
    with pytest.raises(ValueError, match="every must be"):
        thin_delta_err(arrays, steps, 0)
    with pytest.raises(ValueError, match="step numbers"):
        thin_delta_err(arrays, steps[:-1], 2) if n > 1 else thin_delta_err(arrays, np.arange(2), 2)


def test_describe_replay():
    from lpfa.pages.delta_bias import describe

    prov = {"git_commit": "abc", "date_utc": "2026-11-29"}
    base = {"run": "/x/runs/bf16", "steps": 200, "layer": 1, "heads": [5, 2], "n_seq": 8, "provenance": prov}
    v = {"policy": "paper_untiled", "exploded": False, "explosion_step": None, "steps": 30168, "runaway_step": 6400}
    t = describe({**base, "verdict": v, "checkpoint_step": 6000, "choice": {"layer": "runaway", "heads": "wq_growth"}})
    assert "before its logits ran away at step 6,400" in t and "its loss did not explode in its 30,168 steps" in t
    assert "layer 1 (the layer whose logits ran away (or began to))" in t
    assert "heads 5, 2 (its fastest-growing W_Q heads)" in t
    t = describe({**base, "verdict": v, "checkpoint_step": 30168})  # an older replay: no "choice" recorded
    assert "23,768 steps after its logits ran away" in t and "grew most" in t
    t = describe({**base, "verdict": {**v, "exploded": True, "explosion_step": 9000}, "checkpoint_step": 8000,
                  "choice": {"layer": "given", "heads": "given"}})
    assert "before its loss exploded at step 9,000" in t and "layer 1 (chosen by hand)" in t
    assert "heads 5, 2 (chosen by hand)" in t
    # a run that stopped before the runaway verdict: relative to the first record above the threshold
    quiet = {**v, "steps": 6500, "runaway_step": None}
    t = describe({**base, "verdict": quiet, "checkpoint_step": 6000,
                  "choice": {"layer": "runaway", "heads": "wq_growth", "checkpoint": "onset", "onset": [6400, 1]}})
    assert ("before layer 1's largest logit first passed 1000 at step 6,400, too late in the run for the runaway "
            "verdict" in t)
    assert "eager forward" not in t
    t = describe({**base, "verdict": v, "checkpoint_step": 6000, "compiled": True, "measured_by": "side pass"})
    assert "The run was compiled, and so is its replay; the layer is measured by an eager forward" in t


def test_runaway_onset(tmp_path):
    """The first record above the runaway threshold, sustained or not; the replay starts before it."""
    from lpfa.explosion import RunawayCriterion
    from lpfa.pages.delta_bias import describe
    from lpfa.run import run_verdict, runaway_onset

    conf = {"attn_policy": "paper", "optimizer": "adamw", "seed": 5, "init_seed": 6}
    logits = {0: 10.0, 100: 900.0, 200: 1200.0, 300: 800.0, 400: 1500.0, 500: 1600.0}
    extra = [json.dumps({"step": s, "diag": {"max_logit": [[5.0, 6.0], [x, 7.0]]}}) for s, x in logits.items()]
    _write_run(tmp_path / "r", {s: 3.0 for s in range(501)}, conf, extra)
    assert run_verdict(tmp_path / "r")["runaway_step"] is None  # never 5 records in a row
    assert runaway_onset(tmp_path / "r") == (200, 1)
    assert runaway_onset(tmp_path / "r", RunawayCriterion(logit=1550)) == (500, 1)
    assert runaway_onset(tmp_path / "r", RunawayCriterion(logit=1e4)) is None
    prov = {"git_commit": "abc", "date_utc": "2026-11-29"}
    old = {"run": "/x/r", "steps": 20, "layer": 1, "heads": [0], "n_seq": 8, "provenance": prov, "checkpoint_step": 400,
           "verdict": run_verdict(tmp_path / "r")}  # a replay made before "choice" recorded the onset, beside its run
    replayed_here = describe(old, tmp_path / "r_replay")
    assert "200 steps after layer 1's largest logit first passed 1000 at step 200" in replayed_here
    assert "first passed" not in describe(old)
    assert "first passed" not in describe(old, tmp_path / "elsewhere" / "r_replay")


def test_replay_saves_the_layers_qkv_for_the_audit(tiny_run, tmp_path):
    """``save_qkv=N`` writes the layer's q, k, v and dO of the first replayed step's first micro-batch (N sequences,
    every head) as lpfa.audit.load_captured reads them: q and k as the checkpoint's model computes them on that
    batch."""
    from lpfa import data as lpfa_data
    from lpfa.audit import load_captured
    from lpfa.diagnostics import capture_qkv
    from lpfa.replay import replay
    from lpfa.run import Run

    replay(tiny_run, tmp_path / "rep", step=10, layer=1, heads=[0], steps=2, n_seq=2, device="cpu", save_qkv=3)
    x, meta = load_captured(tmp_path / "rep" / "qkv.npz")
    assert meta["step"] == 10 and meta["layer"] == 1 and meta["policy"] == "paper_untiled" and meta["micro_batch"] == 0
    assert x["q"].shape == (3, 2, 32, 32)  # the debug model: 2 heads of 32
    assert all(torch.isfinite(t.float()).all() for t in x.values()) and x["do"].float().abs().sum() > 0
    run = Run(tiny_run)
    log = lpfa_data.ReplayLog.open(tiny_run / "replay.jsonl", run.data_dir / "train.bin")
    tokens, _ = lpfa_data.load_tokens(run.data_dir, "train")
    xb, _ = lpfa_data.get_batch(tokens, log.starts(10)[0][:3], 32, "cpu")
    cap = capture_qkv(run.checkpoint(10).model.eval(), xb)[1]
    for n in ("q", "k", "v"):
        torch.testing.assert_close(x[n].float(), cap[n].bfloat16().float(), rtol=1e-2, atol=1e-2)


def test_loss_agreement_finds_the_first_mismatch():
    from lpfa.replay import loss_agreement

    records = [{"step": s, "loss": 1.0 + s} for s in range(5)] + [{"step": 5, "diag": {}}, {"step": 5, "val_loss": 9.0}]
    per_step = [{"step": 2, "loss": 3.0}, {"step": 3, "loss": 4.5}, {"step": 4, "loss": 5.0}, {"step": 7, "loss": 1.0}]
    assert loss_agreement(per_step, records) == {"compared": 3, "bit_equal": 2, "first_mismatch": 3,
                                                 "max_abs_diff": 0.5}
    assert loss_agreement([], records)["max_abs_diff"] is None


def test_replay_measures_another_policy_on_an_fp32_run(byte_tokens, tmp_path):
    """The FP32 twin replayed with the BF16 run's policy: its own trajectory, bit for bit, with the δ error that BF16
    attention would have made on it; details every ``detail_every`` steps as well as the first and last."""
    from lpfa.replay import replay
    from lpfa.train import train

    out = tmp_path / "fp32"
    train(_cfg(byte_tokens, out, block_size=32, max_steps=12, ckpt_interval=4, ckpt_history=True,
               attn_backend="sdpa_fp32", lr=1e-2, warmup_steps=2))
    with pytest.raises(ValueError, match="backend 'sdpa_fp32'"):
        replay(out, tmp_path / "r0", step=4, layer=0, heads=[1], steps=2, n_seq=2, device="cpu")
    r = replay(out, tmp_path / "r1", step=4, layer=0, heads=[1], steps=7, n_seq=2, device="cpu",
               measure_policy="paper_untiled", detail_every=3)
    assert r["policy"] == "paper_untiled" and r["own_policy"] != "paper_untiled"
    assert r["agreement"]["compared"] == 7 and r["agreement"]["bit_equal"] == 7
    worst = [p["step"] for p in r["per_step"] if "worst_token" in p["heads"]["1"]]
    assert worst == [4, 7, 10]  # the first, every 3rd, the last
    assert all(p["heads"]["1"]["abs_err_mean"] > 0 for p in r["per_step"])  # BF16 rounding, measured on FP32 weights
    with pytest.raises(ValueError, match="detail_every=-1"):
        replay(out, tmp_path / "r2", step=4, layer=0, heads=[1], steps=2, n_seq=2, device="cpu",
               measure_policy="paper_untiled", detail_every=-1)


def test_head_measures_round_do_as_the_kernel_receives_it():
    """An FP32 dO is measured as the BF16 kernel would receive it (rounded to v's dtype): the same numbers as the
    BF16 dO itself; and the δ errors are delta_accounting's on those inputs."""
    from lpfa.mechanism import delta_accounting
    from lpfa.replay import _head_measures

    g = torch.Generator().manual_seed(int(np.random.default_rng().integers(2**31)))
    B, H, T, D, C = 2, 3, 19, 8, 12
    q, k, v = (torch.randn(B, H, T, D, generator=g).bfloat16() for _ in range(3))
    do32 = torch.randn(B, H, T, D, generator=g)
    cap = {"q": q, "k": k, "v": v, "x": torch.randn(B, T, C, generator=g), "do": do32}
    a, _ = _head_measures(cap, 1, 2, "paper_untiled", detail=False)
    b, arr = _head_measures({**cap, "do": do32.bfloat16()}, 1, 2, "paper_untiled", detail=False)
    assert a.keys() == b.keys()
    for key in a:  # a row kind with no rows gives NaN on both sides
        assert a[key] == b[key] or (math.isnan(a[key]) and math.isnan(b[key])), key
    want = delta_accounting(q[:, 1:2].float(), k[:, 1:2].float(), v[:, 1:2].float(), do32[:, 1:2].bfloat16().float(),
                            "paper_untiled", 1 / math.sqrt(D))
    assert np.array_equal(arr["delta_err"], want["delta_err"][:, 0].float().numpy())
