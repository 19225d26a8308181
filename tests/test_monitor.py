"""lpfa.monitor: the live early-warning monitor (our GPT's hook and the SDPA TorchFunctionMode), its decision and its
thresholds (the committed file)."""

import json
import math
import os
import subprocess
import sys
import warnings

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from conftest import ROOT

from lpfa import monitor as mon
from lpfa.attention import get_policy
from lpfa.diagnostics import capture_qkv, tie_fraction, wq_spectral_norms
from lpfa.model import GPT, GPTConfig

QUIET = {"max_logit": {"precursor": {"value": 1e9}, "runaway": {"value": 1e10}}}  # never crossed


def _gpt(seed=0):
    torch.manual_seed(seed)
    return GPT(GPTConfig.from_size("debug", vocab_size=256, block_size=32, attn_backend="sdpa")).eval()


class PlainAttention(nn.Module):
    """A user's model: ``n_layer`` attention layers calling F.scaled_dot_product_attention, no lpfa anywhere;
    ``probe`` records the torch-function mode stack depth seen inside each forward."""

    def __init__(self, n_layer=2, n_head=3, d=24, causal=True):
        super().__init__()
        self.n_head, self.causal = n_head, causal
        self.qkv = nn.ModuleList(nn.Linear(d, 3 * d, bias=False) for _ in range(n_layer))
        self.stack_depths = []

    def forward(self, x):
        self.stack_depths.append(torch._C._len_torch_function_stack())
        B, T, C = x.shape
        for lin in self.qkv:
            q, k, v = (t.view(B, T, self.n_head, -1).transpose(1, 2) for t in lin(x).split(C, dim=2))
            x = x + F.scaled_dot_product_attention(q, k, v, is_causal=self.causal).transpose(1, 2).reshape(B, T, C)
        return x


def _logits64(q, k, causal=True):
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(q.shape[-1])
    if causal:
        T = q.shape[-2]
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
    return s.amax(dim=(0, 2, 3)).numpy()


def test_gpt_capture_matches_float64_and_lpfa_diagnostics():
    model, x = _gpt(), torch.randint(0, 256, (6, 32))
    m = mon.AttentionMonitor(model, every=1, thresholds=QUIET, sequences=4)
    with m.step(0):
        model(x)
    h = m.history
    assert list(h.columns) == ["step", "layer", "head", *mon.MEASURE_COLUMNS] and len(h) == 2 * 2
    caps = capture_qkv(model, x[:4])
    wq = wq_spectral_norms(model).double().numpy()
    for layer, cap in enumerate(caps):
        rows = h[h.layer == layer].sort_values("head")
        np.testing.assert_allclose(rows.max_logit, _logits64(cap["q"], cap["k"]), rtol=1e-12)
        np.testing.assert_array_equal(rows.tie_fraction_bf16, tie_fraction(cap, get_policy("paper")).numpy())
        np.testing.assert_allclose(rows.wq_spectral_norm, wq[layer], rtol=1e-6)
        np.testing.assert_allclose(rows.wq_outlier, wq[layer] / np.median(wq[layer]), rtol=1e-6)
    assert h.wq_growth.isna().all()  # the first capture has nothing to grow from


def test_sdpa_mode_captures_a_plain_module_with_its_wq():
    torch.manual_seed(1)
    model, x = PlainAttention(), torch.randn(5, 16, 24)
    m = mon.AttentionMonitor(model, every=10, thresholds=QUIET, w_q=lambda i: model.qkv[i].weight[:24] * (1 + i))
    with m.step(10):
        model(x)
    h = m.history
    assert sorted(set(h.layer)) == [0, 1] and (h.step == 10).all() and len(h) == 2 * 3
    # recompute layer 0's q, k as the module does
    B, T, C = x.shape
    q, k, _ = (t.view(B, T, 3, -1).transpose(1, 2) for t in model.qkv[0](x).split(C, dim=2))
    np.testing.assert_allclose(h[h.layer == 0].sort_values("head").max_logit, _logits64(q[:4].detach(), k[:4].detach()),
                               rtol=1e-12)
    w = model.qkv[1].weight[:24].detach().view(3, 8, 24) * 2
    np.testing.assert_allclose(h[h.layer == 1].sort_values("head").wq_spectral_norm,
                               torch.linalg.matrix_norm(w, ord=2).double().numpy(), rtol=1e-6)
    # a second capture 10 steps later: W_Q grew by 10 % → wq_growth = 0.1 per 10 steps = 10 per 1000 steps
    with torch.no_grad():
        model.qkv[1].weight[:24] *= 1.1
    with m.step(20):
        model(x)
    np.testing.assert_allclose(m.history.query("step == 20 and layer == 1").wq_growth, 10.0, rtol=1e-5)


def test_masks_measure_as_causal():
    """A boolean lower-triangular mask, an additive -inf mask and is_causal give the same measures."""
    torch.manual_seed(2)
    q, k = torch.randn(2, 3, 12, 8) * 3, torch.randn(2, 3, 12, 8) * 3
    ref = mon.call_measures(q, k, causal=True)
    vis = torch.ones(12, 12, dtype=torch.bool).tril()
    add = torch.zeros(12, 12).masked_fill(~vis, -math.inf)
    for got in (mon.call_measures(q, k, causal=False, mask=vis), mon.call_measures(q, k, causal=False, mask=add)):
        np.testing.assert_array_equal(got["max_logit"], ref["max_logit"])
        np.testing.assert_array_equal(got["tie_fraction_bf16"], ref["tie_fraction_bf16"])
    np.testing.assert_allclose(ref["max_logit"], _logits64(q, k), rtol=1e-12)


def test_chunked_sequences_measure_as_one_at_a_time(monkeypatch):
    """Sequences measured in chunks (CHUNK_BYTES) give each sequence's measures, per-sequence masks included: the max
    over sequences of the float64 logits and the mean of each sequence's own tie fraction, at an awkward shape."""
    torch.manual_seed(5)
    B, H, L, D = 5, 3, 13, 8
    q, k = torch.randn(B, H, L, D) * 4, torch.randn(B, H, L, D) * 4
    q[1, :, :, :] = q[1, :, :1, :]  # every query of sequence 1 the same: tied rows wherever two keys tie
    keep = torch.rand(B, 1, L, L) > 0.3  # a boolean mask of its own per sequence, on top of the causal one
    keep[..., 0] = True  # every row keeps a key
    one = [mon.call_measures(q[b : b + 1], k[b : b + 1], causal=True, mask=keep[b : b + 1]) for b in range(B)]
    for chunk in (1, 2 * H * L * L * 8, 1 << 40):  # one sequence, two, all at once
        monkeypatch.setattr(mon, "CHUNK_BYTES", chunk)
        got = mon.call_measures(q, k, causal=True, mask=keep)
        np.testing.assert_array_equal(got["max_logit"], np.max([o["max_logit"] for o in one], axis=0))
        np.testing.assert_allclose(got["tie_fraction_bf16"], np.mean([o["tie_fraction_bf16"] for o in one], axis=0),
                                   rtol=1e-15)
    vis = torch.ones(L, L, dtype=torch.bool).tril()
    s = (q.double() @ k.double().mT) / math.sqrt(D)
    ref = s.masked_fill(~(vis & keep), -math.inf).amax(dim=(-1, -2)).amax(0)
    np.testing.assert_allclose(got["max_logit"], ref.numpy(), rtol=1e-12)


def _runaway_gpt():
    """Layer 1 head 0's W_Q set to 1e5 × its W_K: q·k = 1e5 ‖k‖² on the diagonal, logits far above 1000."""
    model = _gpt()
    attn = model.transformer.h[1].attn
    C, D = model.config.n_embd, attn.head_dim
    with torch.no_grad():
        attn.c_attn.weight[:D] = 1e5 * attn.c_attn.weight[C : C + D]
    return model


THR = {"max_logit": {"precursor": {"value": 100.0}, "runaway": {"value": 1000.0}}}


def test_runaway_head_calls_back_once_then_warns_without_callback():
    model, x = _runaway_gpt(), torch.randint(0, 256, (2, 32))
    events = []
    m = mon.AttentionMonitor(model, every=2, thresholds=THR, on_warning=events.append)
    for _ in range(5):  # steps 0..4: captures at 0, 2, 4
        with m.step():
            model(x)
    assert sorted(m.history.step.unique()) == [0, 2, 4]
    assert [(e.step, e.layer, e.head, e.measure, e.level) for e in events] == [(0, 1, 0, "max_logit", "runaway")]
    assert events[0].value > 1000 and events[0].threshold == 1000.0 and m.events == events  # not again while above
    m2 = mon.AttentionMonitor(model, every=1, thresholds=THR)
    said = r"^step 3: layer 1 head 0 max_logit = .* runaway threshold 1000$"
    with pytest.warns(mon.AttentionWarning, match=said) as rec:
        with m2.step(3):
            model(x)
    assert len(rec) == 1


def test_non_capture_steps_record_nothing_and_install_nothing():
    model, x = PlainAttention(), torch.randn(2, 8, 24)
    m = mon.AttentionMonitor(model, every=3, thresholds=QUIET)
    for s in range(4):
        with m.step(s):
            model(x)
    assert model.stack_depths == [1, 0, 0, 1] and sorted(m.history.step.unique()) == [0, 3]
    assert torch._C._len_torch_function_stack() == 0
    gpt, seen = _gpt(), []
    gpt.transformer.h[0].attn.register_forward_pre_hook(lambda mod, a: seen.append(mod.capture is not None))
    m = mon.AttentionMonitor(gpt, every=3, thresholds=QUIET)
    for s in range(1, 4):
        with m.step(s):
            gpt(torch.randint(0, 256, (1, 8)))
    assert seen == [False, False, True] and (m.history.step == 3).all()
    assert all(b.attn.capture is None for b in gpt.transformer.h)  # the hook is cleared after the capture


class FakeWriter:
    def __init__(self):
        self.scalars = []

    def add_scalar(self, tag, value, step):
        self.scalars.append((tag, value, step))


def test_tensorboard_gets_every_finite_measure():
    model, w = _gpt(), FakeWriter()
    m = mon.AttentionMonitor(model, every=5, thresholds=QUIET, tensorboard=w)
    with m.step(5):
        model(torch.randint(0, 256, (2, 16)))
    assert len(w.scalars) == 2 * 2 * 4  # wq_growth is NaN on the first capture: not logged
    row = m.history.query("layer == 1 and head == 0").iloc[0]
    assert ("attention/max_logit/layer1/head0", row.max_logit, 5) in w.scalars


def test_bad_input_one_line_errors():
    gpt = _gpt()
    for every in (0, -5, 2.5, "100", True):
        with pytest.raises(mon.MonitorError, match=f"every must be an integer >= 1 .*got {every!r}"):
            mon.AttentionMonitor(gpt, every=every, thresholds=QUIET)
    with pytest.raises(mon.MonitorError, match=r"layers \[5\] are not layers of the model: expected 0..1"):
        mon.AttentionMonitor(gpt, layers=[0, 5], thresholds=QUIET)
    with pytest.raises(mon.MonitorError, match="thresholds name measure 'loss'"):
        mon.AttentionMonitor(gpt, thresholds={"loss": {"precursor": 1.0}})
    with pytest.raises(mon.MonitorError, match=r"thresholds\['max_logit'\] has level 'warn'"):
        mon.AttentionMonitor(gpt, thresholds={"max_logit": {"warn": 1.0}})
    with pytest.raises(mon.MonitorError, match="tensorboard must be a SummaryWriter"):
        mon.AttentionMonitor(gpt, thresholds=QUIET, tensorboard=object())
    with pytest.raises(mon.MonitorError, match="step must be an integer >= 0, got -1"):
        mon.AttentionMonitor(gpt, thresholds=QUIET).step(-1)
    plain = PlainAttention()  # 2 SDPA calls: layer 4 shows only on the first capture
    m = mon.AttentionMonitor(plain, layers=[4], thresholds=QUIET)
    said = r"layers \[4\] are not layers of the model: its forward made 2 attention calls"
    with pytest.raises(mon.MonitorError, match=said):
        with m.step(0):
            plain(torch.randn(1, 4, 24))
    lin = nn.Linear(4, 4)
    m = mon.AttentionMonitor(lin, thresholds=QUIET)
    said = "step 0: the forward run inside monitor.step.. made no scaled_dot_product_attention call"
    with pytest.raises(mon.MonitorError, match=said):
        with m.step(0):
            lin(torch.randn(2, 4))
    with m.step(1):  # not a capture step: nothing checked
        lin(torch.randn(2, 4))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(RuntimeError, match="boom"):  # the body's error passes through, the mode is removed
            with mon.AttentionMonitor(plain, thresholds=QUIET).step(0):
                raise RuntimeError("boom")
    assert torch._C._len_torch_function_stack() == 0


@pytest.mark.parametrize("which", ["gpt", "plain"])
def test_compiled_models_are_monitored_as_eager(which):
    """Under torch.compile (Inductor on the CPU here) our GPT's capture hook and the SDPA mode of any other model still
    see every layer's q and k: the history equals the eager model's, the logits up to the compiled kernels' FP32
    rounding of q and k, the W_Q norms exactly, on a capture step and the next one; non-capture steps record nothing."""
    torch.manual_seed(torch.seed() % 2**31)
    if which == "gpt":
        model, x = _gpt(), torch.randint(0, 256, (3, 32))
        kw = {}
    else:
        model, x = PlainAttention(), torch.randn(3, 16, 24)
        kw = {"w_q": lambda i: model.qkv[i].weight[:24]}
    runs = {}
    for name, m in (("eager", model), ("compiled", torch.compile(model))):
        monitor = mon.AttentionMonitor(m, every=2, thresholds=QUIET, **kw)
        for step in range(4):
            with monitor.step(step):
                m(x)
        runs[name] = monitor.history
    eager, compiled = runs["eager"], runs["compiled"]
    assert sorted(set(compiled.step)) == [0, 2] and len(compiled) == len(eager) > 0
    np.testing.assert_array_equal(compiled[["step", "layer", "head"]], eager[["step", "layer", "head"]])
    np.testing.assert_allclose(compiled.max_logit, eager.max_logit, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(compiled.wq_spectral_norm, eager.wq_spectral_norm, rtol=1e-6)
    assert compiled.tie_fraction_bf16.notna().all()


def test_monitor_overhead_benchmark_runs_on_the_cpu(tmp_path):
    """benchmarks/monitor_overhead.py at its CPU smoke size writes a result whose fields agree with each other and
    with lpfa.monitor.amortised_overhead, the number page 15 judges the goal by."""
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    cmd = [sys.executable, str(ROOT / "benchmarks" / "monitor_overhead.py"), "--model", "debug", "--batch", "2",
           "--seq", "64", "--steps", "10", "--every", "5", "--warmup", "2", "--repeats", "1", "--device", "cpu",
           "--out", str(tmp_path / "out")]
    done = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    b = json.loads((tmp_path / "out" / "monitor_overhead.json").read_text())
    assert (b["model"], b["batch"], b["seq"], b["every"], b["steps"], b["repeats"]) == ("debug", 2, 64, 5, 10, 1)
    assert b["captures"] >= 1 and b["first_capture_step_ms"] > 0 and b["plain_ms"] > 0 and b["monitored_ms"] > 0
    assert math.isclose(b["overhead"], b["monitored_ms"] / b["plain_ms"] - 1, rel_tol=1e-12, abs_tol=1e-15)
    assert math.isclose(b["capture_extra_ms"], b["capture_step_ms"] - b["plain_median_ms"], rel_tol=1e-9, abs_tol=1e-9)
    assert math.isclose(b["amortised_overhead"], mon.amortised_overhead(b), rel_tol=1e-12)
    assert b["provenance"]["config"]["model"] == "debug" and "git_commit" in b["provenance"]


@pytest.mark.parametrize("drop", [0, 5])
def test_add_derived_matches_a_loop_over_heads(drop):
    """lpfa.monitor.add_derived (NumPy) against a plain loop: wq_outlier is each head's norm over its (step, layer)'s
    nanmedian, wq_growth the relative growth per GROWTH_STEPS since the same head's previous step, in the frame or in
    the previous frame; on shuffled rows of several steps, with NaN norms and (drop > 0) heads missing at some steps."""
    from lpfa.monitor import GROWTH_STEPS, add_derived

    rng = np.random.default_rng()
    L, H = 3, 5
    def grid(steps):
        return pd.DataFrame([(s, layer, h) for s in steps for layer in range(L) for h in range(H)],
                            columns=["step", "layer", "head"])
    prev, frame = grid([40, 70]), grid([100, 130, 190])
    for f in (prev, frame):
        f["max_logit"] = rng.uniform(0, 50, len(f))
        f["tie_fraction_bf16"] = rng.uniform(0, 1, len(f))
        f["wq_spectral_norm"] = rng.uniform(1, 3, len(f))
    frame.loc[rng.choice(len(frame), 4, replace=False), "wq_spectral_norm"] = np.nan
    frame = frame.drop(index=rng.choice(len(frame), drop, replace=False))
    frame = frame.sample(frac=1, random_state=int(rng.integers(1 << 30)))
    got = add_derived(frame, prev)
    assert list(got.index) == list(frame.index) and got[frame.columns].equals(frame)
    both = pd.concat([prev, frame], ignore_index=True)
    for i, r in frame.iterrows():
        peers = frame[(frame.step == r.step) & (frame.layer == r.layer)].wq_spectral_norm.to_numpy()
        want = r.wq_spectral_norm / np.nanmedian(peers) if np.isfinite(peers).any() else np.nan
        np.testing.assert_equal(got.loc[i, "wq_outlier"], want)
        earlier = both[(both.layer == r.layer) & (both["head"] == r["head"]) & (both.step < r.step)]
        if earlier.empty:
            assert np.isnan(got.loc[i, "wq_growth"])
        else:
            e = earlier.loc[earlier.step.idxmax()]
            want = (r.wq_spectral_norm / e.wq_spectral_norm - 1.0) * GROWTH_STEPS / (r.step - e.step)
            np.testing.assert_allclose(got.loc[i, "wq_growth"], want, rtol=1e-15, atol=0, equal_nan=True)
    first = add_derived(frame)
    assert first.groupby(["layer", "head"]).wq_growth.apply(lambda g: g.isna().sum() >= 1).all()


def test_monitor_on_a_transformers_gpt2_matches_float64():
    """A Hugging Face GPT2LMHeadModel (random weights, made offline, SDPA attention) through the TorchFunctionMode:
    each layer's per-head largest logit equals float64 q·kᵀ/√d of the q, k its c_attn made (causal), and ‖W_Q[h]‖₂ from
    the documented w_q (c_attn's Conv1D weight, (in, out), transposed) equals the float64 SVD's."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(torch.seed() % 2**31)
    C, H, L = 48, 3, 2
    config = transformers.GPT2Config(n_layer=L, n_head=H, n_embd=C, n_positions=40, vocab_size=97, bos_token_id=0,
                                     eos_token_id=0, attn_implementation="sdpa")
    model = transformers.GPT2LMHeadModel(config).eval()
    qk = {}
    hooks = [b.attn.c_attn.register_forward_hook(lambda mod, inp, out, i=i: qk.__setitem__(i, out.detach()))
             for i, b in enumerate(model.transformer.h)]
    x = torch.randint(0, 97, (5, 37))
    m = mon.AttentionMonitor(model, every=1, thresholds=QUIET, sequences=4,
                             w_q=lambda i: model.transformer.h[i].attn.c_attn.weight[:, :C].T)
    with torch.no_grad(), m.step(0):
        model(x)
    for h_ in hooks:
        h_.remove()
    hist = m.history
    assert sorted(set(hist.layer)) == list(range(L)) and len(hist) == L * H
    for layer in range(L):
        q, k, _ = (t.view(5, 37, H, C // H).transpose(1, 2) for t in qk[layer].split(C, dim=2))
        rows = hist[hist.layer == layer].sort_values("head")
        np.testing.assert_allclose(rows.max_logit, _logits64(q[:4], k[:4]), rtol=1e-12)
        w = model.transformer.h[layer].attn.c_attn.weight[:, :C].T.detach().double().view(H, C // H, C)
        np.testing.assert_allclose(rows.wq_spectral_norm, torch.linalg.svdvals(w)[:, 0].numpy(), rtol=1e-6)
