"""lpfa doctor: the three checkpoint formats, measures against independent computations, verdicts on a model built to
run away, the report files, and one-line errors for bad input (exit 2)."""

import json
import math

import numpy as np
import pytest
import safetensors.torch
import torch

from lpfa import cli, doctor
from lpfa.checkpoints import save_checkpoint
from lpfa.diagnostics import capture_qkv, wq_spectral_norms
from lpfa.mechanism import layer_tensors, rank1_similarity
from lpfa.model import GPT, GPTConfig

pytestmark = [pytest.mark.filterwarnings("ignore::DeprecationWarning"),
              pytest.mark.filterwarnings("ignore::PendingDeprecationWarning")]

VOCAB, BLOCK = 97, 64
PROBE = dict(batches=2, seq_len=32, seed=3, progress=False)


def tiny_gpt(seed=0, **overrides):
    torch.manual_seed(seed)
    return GPT(GPTConfig.from_size("debug", vocab_size=VOCAB, block_size=BLOCK,
                                   **{"attn_backend": "math", **overrides}))


def save_nanogpt(model, path):
    """What nanoGPT's train.py saves (a compiled model: keys prefixed "_orig_mod.")."""
    c = model.config
    args = dict(n_layer=c.n_layer, n_head=c.n_head, n_embd=c.n_embd, block_size=c.block_size, bias=c.bias,
                vocab_size=c.vocab_size, dropout=0.0)
    torch.save({"model": {"_orig_mod." + k: v for k, v in model.state_dict().items()}, "model_args": args,
                "iter_num": 1}, path)
    return path


def save_hf(model, folder):
    """A GPT2LMHeadModel.save_pretrained folder written by hand: HF names, Conv1D (in, out) weights."""
    c = model.config
    folder.mkdir()
    sd = {}
    for k, v in model.state_dict().items():
        if k == "lm_head.weight":
            continue  # tied to wte
        if k.endswith(("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")):
            v = v.t()
        sd[k.removeprefix("transformer.")] = v.contiguous()
    safetensors.torch.save_file(sd, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_layer": c.n_layer, "n_head": c.n_head,
                                                    "n_embd": c.n_embd, "n_positions": c.block_size,
                                                    "vocab_size": c.vocab_size, "activation_function": "gelu_new"}))
    return folder


def token_folder(folder, n=4000, high=VOCAB, seed=0):
    folder.mkdir()
    np.random.default_rng(seed).integers(0, high, n).astype(np.uint16).tofile(folder / "val.bin")
    return folder


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    return token_folder(tmp_path_factory.mktemp("d") / "tokens")


@pytest.fixture(scope="module")
def lpfa_ckpt(tmp_path_factory):
    return save_checkpoint(tmp_path_factory.mktemp("c") / "ckpt", tiny_gpt(), step=5)


@pytest.mark.parametrize("fmt", doctor.FORMATS)
def test_each_format_gives_the_table(fmt, tmp_path, data):
    if fmt == "hf":
        model = tiny_gpt(bias=True, gelu_approximate="tanh")
        path = save_hf(model, tmp_path / "hf")
    elif fmt == "nanogpt":
        model = tiny_gpt()
        path = save_nanogpt(model, tmp_path / "ckpt.pt")
    else:
        model = tiny_gpt()
        path = save_checkpoint(tmp_path / "ck", model, step=1)
    assert doctor.detect_format(path)[0] == fmt
    r = doctor.doctor(path, data, **PROBE)
    t = r["table"]
    c = model.config
    assert len(t) == c.n_layer * c.n_head
    assert sorted(zip(t["layer"], t["head"])) == [(i, h) for i in range(c.n_layer) for h in range(c.n_head)]
    own = {m[0] for m in doctor.MEASURES if m[0].endswith("_trained")}  # only for a checkpoint of another BF16 policy
    assert {"layer", "head", "verdict"} | {m[0] for m in doctor.MEASURES} - own == set(t.columns)
    assert r["info"]["format"] == fmt and r["info"]["probe"]["shape"] == [2, 32]
    wq = wq_spectral_norms(model).numpy()
    np.testing.assert_allclose(t.sort_values(["layer", "head"]).wq_spectral_norm, wq.ravel(), rtol=1e-6)
    if fmt == "nanogpt":  # nanoGPT's out_dir holding ckpt.pt is recognised too
        assert doctor.detect_format(tmp_path) == ("nanogpt", path)


def test_measures_equal_independent_computations(lpfa_ckpt, data):
    model, _, _ = doctor.load_model(lpfa_ckpt)
    x, y, _ = doctor.probe_batch(data, VOCAB, BLOCK, 2, 32, seed=3)
    t = doctor.measure_heads(model, x, y, progress=False).set_index(["layer", "head"])
    caps = capture_qkv(model, x)
    C, H = model.config.n_embd, model.config.n_head
    for layer, cap in enumerate(caps):
        q, k = cap["q"].double(), cap["k"].double()
        T = q.shape[2]
        s = (q @ k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), -math.inf)
        tl = layer_tensors(model, x[:1], layer)
        tok = torch.linspace(0, T - 1, doctor.RANK1_TOKENS).round().long().unique()
        w_k = model.transformer.h[layer].attn.c_attn.weight[C : 2 * C].detach().view(H, C // H, C)
        for h in range(H):
            row = t.loc[(layer, h)]
            assert row.max_logit == pytest.approx(float(s[:, h].max()), rel=1e-12)
            sim = rank1_similarity(tl["p"][0, h][tok], tl["k"][0, h], tl["x"][0][tok]).numpy()
            assert row.rank1_median == pytest.approx(float(np.median(sim[~np.eye(len(tok), dtype=bool)])), abs=1e-5)
            assert row.wk_spectral_norm == pytest.approx(float(torch.linalg.svdvals(w_k[h])[0]), rel=1e-5)
            assert 0 <= row.tie_fraction_fp32 <= 1 and 0 <= row.tie_fraction_bf16 <= 1 and row.p_bar_ones >= 1
    assert np.isfinite(t[["delta_err_paper", "delta_t_paper", "delta_err_fa2", "delta_t_fa2"]].to_numpy()).all()


@pytest.mark.parametrize("backend, policy, expected", [
    ("lpfa", "paper_sr", "paper_sr"), ("lpfa", "paper_sfa", "paper_sfa"), ("lpfa", "paper", None),
    ("lpfa", "fa2", None), ("lpfa", "fp32_split", None), ("lpfa", "fp32_softcap", None),
    ("lpfa", "paper_softcap", "paper_softcap"), ("math", "paper_sr", None)])
def test_trained_policy_is_the_runs_own_bf16_policy(tmp_path, backend, policy, expected):
    path = save_checkpoint(tmp_path / "ck", tiny_gpt(attn_backend=backend, attn_policy=policy), step=1)
    assert doctor.trained_policy(path) == expected


def test_trained_policy_delta_is_the_runs_own_kernels(tmp_path, data):
    from lpfa.mechanism import delta_error

    path = save_checkpoint(tmp_path / "sr", tiny_gpt(attn_backend="lpfa", attn_policy="paper_sr"), step=1)
    r = doctor.doctor(path, data, **PROBE)
    t = r["table"].set_index(["layer", "head"])
    assert r["info"]["trained_policy"] == "paper_sr"
    model, _, _ = doctor.load_model(path)
    x, y, _ = doctor.probe_batch(data, VOCAB, BLOCK, 2, 32, seed=3)
    cap = doctor.capture_all(model, x, y)[0]
    err = {p: delta_error(cap["q"], cap["k"], cap["v"], cap["do"], p)["delta_err"] for p in ("paper_sr", "paper")}
    for h in range(model.config.n_head):
        for col, p in (("delta_err_trained", "paper_sr"), ("delta_err_paper", "paper")):
            assert t.loc[(0, h), col] == pytest.approx(float(err[p][:, h].mean()), rel=1e-9, abs=1e-15)
    assert not np.allclose(t["delta_err_trained"], t["delta_err_paper"])  # stochastic, not nearest, rounding


def test_softcapped_checkpoint_keeps_its_cap(tmp_path, data):
    """A paper_softcap checkpoint: the probe runs FP32-level attention with the same cap (SDPA has none), and the δ
    error of every policy is against the exactly capped attention (lpfa.mechanism.delta_error with the cap)."""
    from lpfa.attention import get_policy
    from lpfa.mechanism import delta_error

    path = save_checkpoint(tmp_path / "cap", tiny_gpt(attn_backend="lpfa", attn_policy="paper_softcap"), step=1)
    assert doctor.trained_softcap(path) == 50.0 and doctor.trained_policy(path) == "paper_softcap"
    model, _, _ = doctor.load_model(path)
    assert (model.config.attn_backend, model.config.attn_policy) == ("lpfa", "fp32_softcap")
    r = doctor.doctor(path, data, **PROBE)
    assert r["info"]["softcap"] == 50.0
    t = r["table"].set_index(["layer", "head"])
    x, y, _ = doctor.probe_batch(data, VOCAB, BLOCK, 2, 32, seed=3)
    cap = doctor.capture_all(model, x, y)[1]
    err = delta_error(cap["q"], cap["k"], cap["v"], cap["do"], get_policy("paper").with_(softcap=50.0))["delta_err"]
    for h in range(model.config.n_head):
        assert t.loc[(1, h), "delta_err_paper"] == pytest.approx(float(err[:, h].mean()), rel=1e-9, abs=1e-15)
    assert doctor.probe_overrides(None) == doctor.PROBE_OVERRIDES
    with pytest.raises(doctor.DoctorError,
                       match=r"soft-cap 7: expected a cap that an FP32-level preset has \(\[50.0\]\)"):
        doctor.probe_overrides(7.0)


def aligned_gpt(wq_scale=1.0, c=math.sqrt(5.0)):
    """Every head's W_Q = W_K = c·(its head_dim coordinates of x): q = k, S[t, t] ≈ c²·√head_dim ≈ 28 dominates
    each row (no ties), so no head raises an alarm; W_Q × 50 puts the diagonal logits near 1400, a runaway."""
    model = tiny_gpt()
    C, D = model.config.n_embd, model.config.n_embd // model.config.n_head
    with torch.no_grad():
        for b in model.transformer.h:
            w = b.attn.c_attn.weight
            w[: 2 * C] = 0
            for h in range(model.config.n_head):
                rows = slice(h * D, (h + 1) * D)
                w[rows, rows] = c * wq_scale * torch.eye(D)  # W_Q[h]
                w[C + h * D : C + (h + 1) * D, rows] = c * torch.eye(D)  # W_K[h]
    return model


def test_scaled_wq_runs_away_and_unscaled_raises_no_alarm(tmp_path, data):
    thr = doctor._default_thresholds()
    tables = {}
    for scale in (1.0, 50.0):
        path = save_checkpoint(tmp_path / f"x{scale:g}", aligned_gpt(scale), step=0)
        tables[scale] = doctor.doctor(path, data, thresholds=thr, **PROBE)["table"]
    quiet, runaway = tables[1.0], tables[50.0]
    assert (quiet.verdict == "no alarm").all(), quiet
    assert quiet.max_logit.max() < thr["max_logit"]["precursor"]
    assert (runaway.verdict == "runaway").any()
    assert runaway.max_logit.max() > 10 * quiet.max_logit.max()
    assert runaway.verdict.iloc[0] == "runaway"  # worst first
    np.testing.assert_allclose(runaway.wq_spectral_norm.max(), 50 * quiet.wq_spectral_norm.max(), rtol=1e-5)


def test_exploded_checkpoint_is_a_runaway_not_a_crash(tmp_path, data):
    """NaN in one head's W_Q (a checkpoint saved after the explosion): that head and every later layer's heads see
    non-finite logits and are runaways, the other head of layer 0 is measured as usual."""
    model = tiny_gpt()
    with torch.no_grad():
        model.transformer.h[0].attn.c_attn.weight[0, 0] = math.nan  # W_Q of layer 0, head 0
    # fixed thresholds: the learnt ones move with results/
    r = doctor.doctor(save_checkpoint(tmp_path / "nan", model, step=9), data, out=tmp_path / "report",
                      thresholds=doctor._default_thresholds(), **PROBE)
    t = r["table"].set_index(["layer", "head"])
    rep = json.loads((tmp_path / "report" / "report.json").read_text(),
                     parse_constant=lambda c: pytest.fail(f"{c} in JSON"))
    assert rep["verdicts"]["runaway"] == 3 and any(row["max_logit"] is None for row in rep["table"])
    assert t.loc[(0, 0)].verdict == "runaway" and math.isnan(t.loc[(0, 0)].wq_spectral_norm)
    assert (t.loc[1].verdict == "runaway").all()
    assert t.loc[(0, 1)].verdict == "no alarm" and math.isfinite(t.loc[(0, 1)].max_logit)


def test_verdicts_follow_thresholds(lpfa_ckpt, data):
    t = doctor.doctor(lpfa_ckpt, data, **PROBE)["table"]
    lo = float(t.max_logit.min())
    thr = {"max_logit": {"precursor": lo, "runaway": float(t.max_logit.max())}, "wq_growth": {"precursor": 1.5}}
    d = doctor.diagnose(t.drop(columns="verdict"), thr)
    assert (d.verdict != "no alarm").all() and (d.verdict == "runaway").sum() == 1 and d.verdict.iloc[0] == "runaway"
    assert doctor.unused_thresholds(d, thr) == ["wq_growth"]


def test_no_alarm_verdict_says_what_it_cannot_rule_out(lpfa_ckpt, data, tmp_path, capsys):
    """Next to a no-alarm verdict: the share of the committed runs' layers that ran away soon after and raised no alarm
    either, read from the committed thresholds (lpfa.alarms.miss_rate); thresholds without it say they have none."""
    thr = doctor.current_thresholds()
    miss = thr[doctor.NO_ALARM]
    assert miss["positives"] > 0 and 0 < miss["fnr"] <= 1 and miss["missed"] == round(miss["fnr"] * miss["positives"])
    text = doctor.no_alarm_text(thr)
    assert text.startswith("no alarm is not safe: ") and "\n" not in text
    assert (f"stayed silent on {miss['fnr']:.0%} of the layers that ran away within the next {miss['lead_steps']:,} "
            f"steps ({miss['missed']} of {miss['positives']} diagnostics samples of the committed runs)") in text
    assert "carry no measured miss rate" in doctor.no_alarm_text(doctor.fixed_thresholds())
    out = tmp_path / "report"
    assert cli.main(["doctor", str(lpfa_ckpt), "--data", str(data), "--batches", "2", "--seq-len", "32", "--seed", "3",
                     "--out", str(out)]) == 0
    lines = capsys.readouterr().out.splitlines()
    verdicts = next(i for i, line in enumerate(lines) if line.startswith("verdicts: "))
    assert " no alarm of 4 heads" in lines[verdicts] and lines[verdicts + 1] == text  # right under the verdict
    assert f"no alarm of 4 heads. {text}." in (out / "report.md").read_text()
    assert doctor.unused_thresholds(doctor.doctor(lpfa_ckpt, data, **PROBE)["table"], thr) == []


def test_cli_writes_report_that_round_trips(lpfa_ckpt, data, tmp_path, capsys):
    out = tmp_path / "report"
    assert cli.main(["doctor", str(lpfa_ckpt), "--data", str(data), "--batches", "2", "--seq-len", "32", "--seed", "3",
                     "--device", "cpu", "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "verdicts: " in printed and "worst 4 heads of 4" in printed
    md = (out / "report.md").read_text()
    for name in [ln.split("](")[1].rstrip(")") for ln in md.splitlines() if ln.startswith("![")]:
        assert (out / name).stat().st_size > 1000, name
    rep = json.loads((out / "report.json").read_text())
    # every measure the table has (no *_trained for this checkpoint of the math backend), the verdicts, the worst
    # layer's bars
    assert md.count("![") == len([m for m in doctor.MEASURES if m[0] in rep["table"][0]]) + 2
    assert rep["trained_policy"] is None
    assert rep["format"] == "lpfa" and rep["probe"]["shape"] == [2, 32] and rep["probe"]["seed"] == 3
    assert rep["thresholds"] == doctor.current_thresholds() and "git_commit" in rep["provenance"]
    expect = doctor.doctor(lpfa_ckpt, data, **PROBE)["table"]
    assert rep["table"] == json.loads(json.dumps(doctor._json_table(expect)))


def test_cli_thresholds_file_sets_the_verdicts(lpfa_ckpt, data, tmp_path, capsys):
    # a runaway threshold below every head's largest logit makes every head a runaway, and the report keeps the file's
    t = doctor.doctor(lpfa_ckpt, data, **PROBE)["table"]
    thr = {"max_logit": {"precursor": {"value": 1e9, "fpr": 0.0}, "runaway": float(t.max_logit.min()) / 2}}
    f = tmp_path / "thr.json"
    f.write_text(json.dumps(thr))
    out = tmp_path / "report"
    assert cli.main(["doctor", str(lpfa_ckpt), "--data", str(data), "--batches", "2", "--seq-len", "32", "--seed", "3",
                     "--device", "cpu", "--out", str(out), "--thresholds", str(f)]) == 0
    rep = json.loads((out / "report.json").read_text())
    assert rep["thresholds"] == thr and rep["thresholds_source"] == "given"
    assert rep["verdicts"]["runaway"] == len(t) and "runaway" in capsys.readouterr().out


def test_report_table_gives_back_the_doctors_table(tmp_path, data):
    """report.json's table read back (lpfa.doctor.report_table) equals the doctor's own, NaN where the JSON has null
    (a blown-up head), with the same verdicts; other thresholds give the verdicts diagnose gives."""
    m = tiny_gpt(seed=3)
    with torch.no_grad():
        m.transformer.h[0].attn.c_attn.weight[0, 0] = float("nan")
    ck = save_checkpoint(tmp_path / "nan", m, step=0)
    r = doctor.doctor(ck, data, **PROBE, out=tmp_path / "rep")
    rep = json.loads((tmp_path / "rep" / "report.json").read_text())
    back = doctor.report_table(rep)
    want = r["table"]
    assert list(back.columns) == list(want.columns) and (back["verdict"] == want["verdict"]).all()
    assert back.drop(columns="verdict").equals(want.drop(columns="verdict").astype(back.drop(columns="verdict").dtypes))
    thr = {"max_logit": {"runaway": float(want.max_logit.max(skipna=True))}}
    again = doctor.report_table(rep, thr)
    diagnosed = doctor.diagnose(want.drop(columns="verdict"), thr)
    assert (again["verdict"].to_numpy() == diagnosed["verdict"].to_numpy()).all()


def test_run_folder_means_its_latest_checkpoint(tmp_path, data, capsys):
    """An lpfa.train run folder (config.json with "train") is read through lpfa.run.Run: its latest checkpoint, from
    ckpt_history/ or ckpt/; the command line says which one it examined."""
    run = tmp_path / "run"
    early = save_checkpoint(run / "ckpt_history" / "step_000005", tiny_gpt(seed=1), step=5)
    (run / "config.json").write_text(json.dumps({"train": {"max_steps": 10}, "model": {}}))
    assert doctor.detect_format(run) == ("lpfa", early)
    model = tiny_gpt(seed=2)
    latest = save_checkpoint(run / "ckpt", model, step=10)
    assert doctor.detect_format(run) == ("lpfa", latest)
    (run / "config.json").unlink()  # a run folder without its config.json: still its checkpoints
    assert doctor.detect_format(run) == ("lpfa", latest)
    argv = ["doctor", str(run), "--data", str(data), "--batches", "2", "--seq-len", "32", "--seed", "3"]
    assert cli.main([*argv, "--top", "1"]) == 0
    assert capsys.readouterr().out.startswith(f"{run} (lpfa: {latest}), probe 2 × 32 tokens")
    t = doctor.doctor(run, data, **PROBE)["table"]
    np.testing.assert_allclose(t.sort_values(["layer", "head"]).wq_spectral_norm, wq_spectral_norms(model).ravel(),
                               rtol=1e-6)


def test_help():
    assert cli.main(["doctor", "--help"]) == 0


def _bad_cases(tmp_path, lpfa_ckpt, data):
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "weights.npy").write_bytes(b"0")
    broken = save_checkpoint(tmp_path / "broken", tiny_gpt(), step=0)
    sd = safetensors.torch.load_file(str(broken / "model.safetensors"))
    del sd["transformer.h.1.attn.c_attn.weight"]
    safetensors.torch.save_file(sd, str(broken / "model.safetensors"))
    wide = token_folder(tmp_path / "wide", high=300)
    short = token_folder(tmp_path / "short", n=50)
    d = ["--data", str(data)]
    bad_thr = tmp_path / "bad_thr.json"
    bad_thr.write_text(json.dumps({"max_logit": {"precursor": "high"}}))
    not_json = tmp_path / "not_json.json"
    not_json.write_text("{max_logit")
    no_ckpt = tmp_path / "no_ckpt"  # an lpfa.train run folder as committed under results/: no checkpoint kept
    no_ckpt.mkdir()
    (no_ckpt / "config.json").write_text(json.dumps({"train": {}, "model": {}}))
    return {
        "no thresholds file": ([str(lpfa_ckpt), *d, "--thresholds", str(tmp_path / "t.json")],
                               r"--thresholds='.*t\.json': expected a JSON file of thresholds"),
        "bad thresholds": ([str(lpfa_ckpt), *d, "--thresholds", str(bad_thr)],
                           r"--thresholds='.*bad_thr\.json': "
                           r"thresholds\['max_logit'\]\['precursor'\] must be a number"),
        "thresholds not JSON": ([str(lpfa_ckpt), *d, "--thresholds", str(not_json)],
                                r"not_json\.json is not valid JSON"),
        "missing path": ([str(tmp_path / "nope"), *d],
                         r"checkpoint .*nope does not exist; expected an lpfa checkpoint folder"),
        "unknown format": ([str(unknown), *d], r"cannot tell the format of checkpoint .*unknown"),
        "run without checkpoint": ([str(no_ckpt), *d], r"run folder .*no_ckpt has no checkpoint; expected ckpt/ or "
                                                       r"ckpt_history/step_NNNNNN/ in it"),
        "missing keys": ([str(broken), *d], r"1 missing keys, e\.g\. transformer\.h\.1\.attn\.c_attn\.weight"),
        "vocabulary": ([str(lpfa_ckpt), "--data", str(wide)],
                       r"token id 29\d, outside the model's vocabulary \(vocab_size 97\)"),
        "too few tokens": ([str(lpfa_ckpt), "--data", str(short), "--batches", "4", "--seq-len", "32"],
                           r"has 50 tokens, too few for --batches 4 × --seq-len 32 \(needs at least 129\)"),
        "seq-len": ([str(lpfa_ckpt), *d, "--seq-len", "65"], r"--seq-len 65: expected 2 to the model's block_size 64"),
        "no data folder": ([str(lpfa_ckpt), "--data", str(tmp_path / "none")],
                           r"--data .*none has neither val.bin nor train.bin"),
        "no data, small vocab": ([str(lpfa_ckpt)], r"vocab_size is 97, smaller than the embedded corpus.*pass --data"),
        "bad option": ([str(lpfa_ckpt), "--batches", "two"], r"argument --batches: invalid int value: 'two'"),
        "bad device": ([str(lpfa_ckpt), "--device", "tpu"], r"argument --device: invalid choice: 'tpu'"),
        **({} if torch.cuda.is_available() else
           {"no gpu": ([str(lpfa_ckpt), *d, "--device", "cuda"], r"--device cuda: no CUDA device is visible")}),
    }


def test_bad_input_is_one_line_and_exit_2(tmp_path, lpfa_ckpt, data, capsys):
    import re

    for name, (argv, pattern) in _bad_cases(tmp_path, lpfa_ckpt, data).items():
        assert cli.main(["doctor", *argv]) == 2, name
        cap = capsys.readouterr()
        lines = cap.err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("lpfa doctor: error: "), (name, cap.err)
        assert re.search(pattern, lines[0]), (name, lines[0])
        assert cap.out == "", name
