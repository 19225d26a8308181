"""lpfa.structure: Figs. 8, 9 statistics of a model, of a run's checkpoint (the CLI the GPU machine runs), and bad
input."""

import json

import numpy as np
import pytest
import torch

from lpfa.diagnostics import DOMINANT_SIGN, v_sign_dominance
from lpfa.mechanism import layer_tensors, rank1_similarity, tie_fractions
from lpfa.model import GPT, GPTConfig
from lpfa.pages.structure import plot_similarity, plot_ties
from lpfa.structure import BINS, MATRIX_TOKENS, describe, main, summarize, summarize_run


def _model(seed):
    torch.manual_seed(seed)
    return GPT(GPTConfig(vocab_size=97, block_size=160, n_layer=2, n_head=4, n_embd=32, attn_backend="math")).eval()


def test_summarize_matches_its_parts():
    seed = int(torch.randint(0, 2**31, ()))
    model = _model(seed)
    g = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, 97, (2, 150), generator=g)
    s = summarize(model, idx, eps=1e-3, seed=seed)
    b = tie_fractions(model, idx, "paper", 1e-3)
    assert np.array_equal(np.asarray(s["ties"]["bf16"]), b.numpy())
    assert np.array_equal(np.asarray(s["ties"]["fp32"]), tie_fractions(model, idx, "fp32", 1e-3).numpy())
    layer, head = s["head"]
    assert b[layer, head] == b.max()  # the most tied head with BF16 scores
    t = layer_tensors(model, idx[:1], layer)
    sim = rank1_similarity(t["p"][0, head], t["k"][0, head], t["x"][0]).numpy()
    off = sim[~np.eye(150, dtype=bool)]
    m = s["similarity"]["model"]
    assert m["median"] == pytest.approx(float(np.median(off)), abs=1e-12)
    assert m["above_0.5"] == pytest.approx(float((off > 0.5).mean()))
    assert sum(m["hist"]) == 150 * 149 == sum(s["similarity"]["random"]["hist"]) and len(m["hist"]) == len(BINS) - 1
    mat = np.asarray(s["similarity"]["matrix"])
    assert mat.shape == (MATRIX_TOKENS, MATRIX_TOKENS)
    assert np.abs(mat - sim[:MATRIX_TOKENS, :MATRIX_TOKENS]).max() <= 5e-5
    assert abs(s["similarity"]["random"]["median"]) < 0.05  # random vectors: no shared direction
    json.dumps(s)  # JSON-ready
    vd = np.asarray(s["v_sign_dominance"])
    assert vd.shape == (2, 4) and s["dominant_sign"] == DOMINANT_SIGN
    for lay in range(2):
        v = layer_tensors(model, idx, lay)["v"]
        assert np.allclose(vd[lay], v_sign_dominance(v).numpy(), atol=1e-6)
    assert "most tied head (layer" in describe(s)
    assert "V's feature columns with one sign on at least 90% of the keys of these sequences" in describe(s)
    old = {k: v for k, v in s.items() if k not in ("v_sign_dominance", "dominant_sign")}
    assert "V's feature columns" not in describe(old)  # summaries made before it was measured
    with pytest.raises(ValueError, match="idx must be"):
        summarize(model, idx[0])


def test_summarize_run_cli_and_figures(byte_tokens, tmp_path):
    from lpfa.train import TrainConfig, train

    run = tmp_path / "run"
    train(TrainConfig(data=str(byte_tokens), model="debug", block_size=32, batch_size=4, max_steps=4, eval_interval=0,
                      eval_batches=1, ckpt_interval=2, ckpt_history=True, out_dir=str(run), progress=False,
                      attn_policy="paper_untiled", log_interval=100))
    assert main(["--run", str(run), "--out", str(tmp_path / "s.json"), "--n-seq", "2", "--device", "cpu"]) == 0
    s = json.loads((tmp_path / "s.json").read_text())
    assert s["step"] == 4 and s["batch"] == [2, 32] and s["policy"] == "paper_untiled" and s["provenance"]["command"]
    s2 = summarize_run(run, step=2, n_seq=2, seq_len=16, device="cpu")
    assert s2["step"] == 2 and s2["batch"] == [2, 16]
    assert len(plot_ties(s).axes) == 3 and len(plot_similarity(s, "run").axes) == 3  # panels + colourbar
    with pytest.raises(ValueError, match="no checkpoint at step 3; it has steps"):
        summarize_run(run, step=3, device="cpu")
    with pytest.raises(FileNotFoundError, match="not an lpfa.train run folder"):
        summarize_run(tmp_path, device="cpu")


def test_fp32_split_twins_count_as_fp32_trained():
    """fp32_split is the FP32 twin: its summaries join the FP32-trained paragraph, as sdpa_fp32's do."""
    from lpfa.pages.structure import _bf16_trained

    assert _bf16_trained({"attn_backend": "lpfa", "policy": "paper_untiled"})
    assert not _bf16_trained({"attn_backend": "lpfa", "policy": "fp32_split"})
    assert not _bf16_trained({"attn_backend": "sdpa_fp32", "policy": "fa2"})
