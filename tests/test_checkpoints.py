"""lpfa.checkpoints: our folder format (round trip, atomic replace, clear errors), nanoGPT's ckpt.pt, Hugging Face
GPT-2."""

import fractions
import json
import os

import numpy as np
import pytest
import safetensors.torch
import torch

from lpfa.checkpoints import load_checkpoint, load_hf_gpt2, load_nanogpt, save_checkpoint
from lpfa.model import GPT, GPTConfig


def tiny_gpt(seed=0, **overrides):
    torch.manual_seed(seed)
    cfg = GPTConfig.from_size("debug", vocab_size=97, block_size=32, attn_backend="math", **overrides)
    return GPT(cfg)


def ids(vocab=97, T=16, seed=1):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (2, T), generator=g)


def trained(steps=2):
    """A tiny GPT and its AdamW after ``steps`` optimisation steps."""
    model = tiny_gpt()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    for s in range(steps):
        x = ids(seed=10 + s)
        _, loss = model(x[:, :-1].contiguous(), x[:, 1:].contiguous())
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model, opt


def logits(model, x):
    model.eval()
    with torch.no_grad():
        return model(x)[0]


# --------------------------------------------------------------------------------------------------
# our format


def test_round_trip(tmp_path):
    model, opt = trained()
    extra = {"rng": torch.get_rng_state(), "data_pos": 1234, "epoch": 3, "note": "hello", "hist": [1.5, 2.5]}
    train = {"lr": 1e-3, "batch_size": 8, "name": "debug-run", "betas": [0.9, 0.95]}
    folder = save_checkpoint(tmp_path / "ckpt", model, opt, step=2, train_config=train, extra_state=extra)
    assert sorted(p.name for p in folder.iterdir()) == ["config.json", "model.safetensors", "optimizer.pt", "state.pt"]
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temp folder left behind

    ck = load_checkpoint(folder)
    loaded = ck.model
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    assert loaded.lm_head.weight.data_ptr() == loaded.transformer.wte.weight.data_ptr()
    assert loaded.config == model.config
    x = ids()
    assert torch.equal(logits(model, x), logits(loaded, x))

    assert ck.step == 2 and ck.train_config == train
    assert torch.equal(ck.extra_state["rng"], extra["rng"])
    assert {k: v for k, v in ck.extra_state.items() if k != "rng"} == {k: v for k, v in extra.items() if k != "rng"}
    assert ck.config["model"] == model.config.to_dict() and "lpfa_version" in ck.config

    opt2 = torch.optim.AdamW(loaded.parameters(), lr=1e-3, weight_decay=0.1)
    opt2.load_state_dict(ck.optimizer_state)
    s1, s2 = opt.state_dict(), opt2.state_dict()
    assert s1["param_groups"] == s2["param_groups"]
    assert s1["state"].keys() == s2["state"].keys()
    for i in s1["state"]:
        for name, v in s1["state"][i].items():
            assert torch.equal(v, s2["state"][i][name]), (i, name)


def test_without_optimizer_and_overrides(tmp_path):
    model = tiny_gpt(attn_policy="fa2")
    save_checkpoint(tmp_path / "c", model, step=0)
    ck = load_checkpoint(tmp_path / "c", model_overrides={"attn_backend": "math", "attn_policy": "fp32"})
    assert ck.optimizer_state is None and ck.extra_state is None and ck.train_config == {}
    assert ck.model.config.attn_policy == "fp32"
    with pytest.raises(ValueError, match="n_embd"):
        load_checkpoint(tmp_path / "c", model_overrides={"n_embd": 128})
    with pytest.raises(ValueError, match="unknown GPTConfig fields"):
        load_checkpoint(tmp_path / "c", model_overrides={"nope": 1})


def test_bf16_model_keeps_dtype(tmp_path):
    model = tiny_gpt().to(torch.bfloat16)
    save_checkpoint(tmp_path / "c", model, step=1)
    loaded = load_checkpoint(tmp_path / "c").model
    assert loaded.transformer.wte.weight.dtype == torch.bfloat16
    assert all(torch.equal(v, loaded.state_dict()[k]) for k, v in model.state_dict().items())


def test_atomic_replace_keeps_old_checkpoint(tmp_path, monkeypatch):
    old = tiny_gpt(seed=0)
    folder = save_checkpoint(tmp_path / "ckpt", old, step=1)
    new = tiny_gpt(seed=1)

    def failing_save(tensors, filename, metadata=None):
        with open(filename, "wb") as f:
            f.write(b"\x00" * 100)  # half a file, then the crash
        raise OSError("disk full (simulated)")

    monkeypatch.setattr(safetensors.torch, "save_file", failing_save)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(folder, new, step=2)
    monkeypatch.undo()
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no temp folder left behind
    ck = load_checkpoint(folder)
    assert ck.step == 1
    assert torch.equal(ck.model.transformer.wte.weight, old.transformer.wte.weight)

    # a successful save replaces it, again leaving nothing aside
    save_checkpoint(folder, new, step=2)
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]
    ck = load_checkpoint(folder)
    assert ck.step == 2 and torch.equal(ck.model.transformer.wte.weight, new.transformer.wte.weight)


def test_bad_inputs_to_save(tmp_path):
    model = tiny_gpt()
    with pytest.raises(TypeError, match="JSON"):
        save_checkpoint(tmp_path / "c", model, step=0, train_config={"f": object()})
    with pytest.raises(TypeError, match="step"):
        save_checkpoint(tmp_path / "c", model, step=1.5)
    with pytest.raises(TypeError, match="extra_state.*NumPy"):
        save_checkpoint(tmp_path / "c", model, step=0, extra_state={"rng": np.random.get_state()})
    assert not any(tmp_path.iterdir())  # nothing written


def test_corrupt_weights(tmp_path):
    folder = save_checkpoint(tmp_path / "c", tiny_gpt(), step=0)
    w = folder / "model.safetensors"
    w.write_bytes(w.read_bytes()[: w.stat().st_size // 2])
    with pytest.raises(ValueError, match="model.safetensors"):
        load_checkpoint(folder)
    w.write_bytes(b"")
    with pytest.raises(ValueError, match="model.safetensors"):
        load_checkpoint(folder)


def test_missing_pieces(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_checkpoint(tmp_path / "nope")
    folder = save_checkpoint(tmp_path / "c", tiny_gpt(), step=0)
    (folder / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="model.safetensors"):
        load_checkpoint(folder)
    (folder / "config.json").write_text("{not json")
    with pytest.raises(ValueError, match="config.json"):
        load_checkpoint(folder)
    (folder / "config.json").unlink()
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_checkpoint(folder)


def test_config_mismatch(tmp_path):
    folder = save_checkpoint(tmp_path / "c", tiny_gpt(), step=0)
    cfg = json.loads((folder / "config.json").read_text())
    cfg["model"]["n_embd"] = 128
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"n_embd=128.*shape mismatch.*transformer\.") as e:
        load_checkpoint(folder)
    assert "(64,)" in str(e.value) or "64)" in str(e.value)
    cfg["model"]["n_embd"], cfg["model"]["n_layer"] = 64, 3
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=r"missing keys, e\.g\. transformer\.h\.2\."):
        load_checkpoint(folder)


# --------------------------------------------------------------------------------------------------
# nanoGPT


def nanogpt_ckpt(model, opt):
    """The dict nanoGPT's train.py saves (compiled model: keys prefixed "_orig_mod.")."""
    c = model.config
    sd = {"_orig_mod." + k: v for k, v in model.state_dict().items()}
    causal = torch.tril(torch.ones(c.block_size, c.block_size))
    sd["_orig_mod.transformer.h.0.attn.bias"] = causal.view(1, 1, c.block_size, c.block_size)
    model_args = dict(n_layer=c.n_layer, n_head=c.n_head, n_embd=c.n_embd, block_size=c.block_size, bias=c.bias,
                      vocab_size=c.vocab_size, dropout=0.0)
    config = {"out_dir": "out", "batch_size": 12, "learning_rate": 6e-4, "compile": True, "dtype": "bfloat16",
              "wandb_log": False}
    return {"model": sd, "optimizer": opt.state_dict(), "model_args": model_args, "iter_num": 2,
            "best_val_loss": torch.tensor(3.25), "config": config}


def test_nanogpt(tmp_path):
    model, opt = trained()
    torch.save(nanogpt_ckpt(model, opt), tmp_path / "ckpt.pt")
    loaded = load_nanogpt(tmp_path / "ckpt.pt", attn_backend="math")
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    x = ids()
    assert torch.equal(logits(model, x), logits(loaded, x))


def test_nanogpt_rejects_other_files(tmp_path):
    torch.save({"state_dict": tiny_gpt().state_dict()}, tmp_path / "other.pt")
    with pytest.raises(ValueError, match="not a nanoGPT checkpoint"):
        load_nanogpt(tmp_path / "other.pt")
    (tmp_path / "text.pt").write_text("hello")
    with pytest.raises(ValueError, match="weights_only"):
        load_nanogpt(tmp_path / "text.pt")
    # an arbitrary Python object that weights_only=True refuses to unpickle
    torch.save({"model": {}, "model_args": {}, "obj": fractions.Fraction(1, 3)}, tmp_path / "pickle.pt")
    with pytest.raises(ValueError, match="weights_only=True"):
        load_nanogpt(tmp_path / "pickle.pt")
    with pytest.raises(FileNotFoundError):
        load_nanogpt(tmp_path / "missing.pt")


# --------------------------------------------------------------------------------------------------
# Hugging Face GPT-2


def hf_model(**cfg):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_head=2, n_embd=64, n_positions=64, vocab_size=101, **cfg)
    return transformers.GPT2LMHeadModel(config).eval()


def test_hf_gpt2_safetensors(tmp_path):
    hf = hf_model()
    hf.save_pretrained(tmp_path)
    assert (tmp_path / "model.safetensors").exists()
    loaded = load_hf_gpt2(tmp_path, attn_backend="math").eval()
    assert loaded.config.gelu_approximate == "tanh" and loaded.config.bias and loaded.config.block_size == 64
    x = ids(vocab=101, T=40)
    with torch.no_grad():
        ref = hf(x).logits
    torch.testing.assert_close(logits(loaded, x), ref, atol=1e-5, rtol=0)


def test_hf_gpt2_pytorch_model_bin(tmp_path):
    hf = hf_model()
    # what save_pretrained(safe_serialization=False) wrote in transformers 4.x (5.x always writes
    # safetensors): the full state dict, including lm_head.weight and the old mask buffers
    sd = dict(hf.state_dict())
    for i in range(2):
        sd[f"transformer.h.{i}.attn.bias"] = torch.tril(torch.ones(64, 64, dtype=torch.bool)).view(1, 1, 64, 64)
        sd[f"transformer.h.{i}.attn.masked_bias"] = torch.tensor(-1e4)
    torch.save(sd, tmp_path / "pytorch_model.bin")
    hf.config.to_json_file(tmp_path / "config.json")
    loaded = load_hf_gpt2(tmp_path, attn_backend="math")
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    x = ids(vocab=101, T=40)
    with torch.no_grad():
        ref = hf(x).logits
    torch.testing.assert_close(logits(loaded, x), ref, atol=1e-5, rtol=0)


def test_hf_gpt2_unsupported_config(tmp_path):
    hf_model(activation_function="relu").save_pretrained(tmp_path / "relu")
    with pytest.raises(ValueError, match="activation_function='relu'"):
        load_hf_gpt2(tmp_path / "relu")
    hf_model(scale_attn_by_inverse_layer_idx=True).save_pretrained(tmp_path / "inv")
    with pytest.raises(ValueError, match="scale_attn_by_inverse_layer_idx"):
        load_hf_gpt2(tmp_path / "inv")


def test_hf_gpt2_without_transformers(tmp_path):
    """The loader only needs config.json and the weights: a hand-written folder, no transformers."""
    torch.manual_seed(0)
    cfg = {"model_type": "gpt2", "n_layer": 1, "n_head": 2, "n_embd": 8, "n_positions": 16, "vocab_size": 11,
           "activation_function": "gelu_new"}
    sd = {
        "wte.weight": torch.randn(11, 8), "wpe.weight": torch.randn(16, 8),
        "ln_f.weight": torch.randn(8), "ln_f.bias": torch.randn(8),
        "h.0.ln_1.weight": torch.randn(8), "h.0.ln_1.bias": torch.randn(8),
        "h.0.ln_2.weight": torch.randn(8), "h.0.ln_2.bias": torch.randn(8),
        "h.0.attn.c_attn.weight": torch.randn(8, 24), "h.0.attn.c_attn.bias": torch.randn(24),
        "h.0.attn.c_proj.weight": torch.randn(8, 8), "h.0.attn.c_proj.bias": torch.randn(8),
        "h.0.mlp.c_fc.weight": torch.randn(8, 32), "h.0.mlp.c_fc.bias": torch.randn(32),
        "h.0.mlp.c_proj.weight": torch.randn(32, 8), "h.0.mlp.c_proj.bias": torch.randn(8),
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    safetensors.torch.save_file(sd, str(tmp_path / "model.safetensors"))
    model = load_hf_gpt2(tmp_path)
    assert torch.equal(model.transformer.h[0].attn.c_attn.weight, sd["h.0.attn.c_attn.weight"].t())
    assert torch.equal(model.lm_head.weight, sd["wte.weight"])
    os.remove(tmp_path / "model.safetensors")
    with pytest.raises(FileNotFoundError, match="no weights"):
        load_hf_gpt2(tmp_path)
