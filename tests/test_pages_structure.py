"""Page 05 (ties and rank-1 structure, Figs. 8, 9): lpfa.pages.structure's model loading, logged ties, replay sentence
and GPU-checkpoint section, on a tiny model and on the committed results (repro_pair, repro_runaway, structure), their
numbers recomputed here from the files."""

import json

import numpy as np
import pytest
import torch

from lpfa.checkpoints import save_checkpoint
from lpfa.compare import head_metric_frame
from lpfa.model import GPT, GPTConfig
from lpfa.pages.structure import (
    gpu_structures,
    gpu_structures_runs,
    gpu_structures_text,
    load_model,
    model_batch,
    model_texts,
    rank1_text,
    replay_rank1,
    twin_ties,
)
from lpfa.replay import load_replay
from lpfa.results import run_dir, what
from lpfa.structure import describe


def _model(vocab=257):
    torch.manual_seed(0)
    return GPT(GPTConfig(vocab_size=vocab, block_size=64, n_layer=2, n_head=4, n_embd=32, attn_backend="math"))


def test_model_from_a_checkpoint_its_batch_and_words(tmp_path):
    save_checkpoint(tmp_path / "ckpt", _model(), step=7, train_config={"tokenizer": "bytes"})
    model, tokenizer, source = load_model(checkpoint=str(tmp_path / "ckpt"))
    assert tokenizer == "bytes" and source == f"lpfa checkpoint `{tmp_path / 'ckpt'}` (step 7)" and not model.training
    assert model.config.attn_backend == "math"
    idx, meta = model_batch(model, tokenizer, 3, 40, seed=1)
    assert tuple(idx.shape) == (3, 40) and int(idx.max()) < meta["vocab_size"] == 257
    assert torch.equal(idx, model_batch(model, tokenizer, 3, 40, seed=1)[0])  # seeded
    assert model_texts(model, source, meta, 3, 40) == {
        "model_source": source, "model_shape": "2 layers × 4 heads, d = 32", "input_shape": "3 sequences of 40 tokens",
        "input_tokenizer": "`bytes`"}
    with pytest.raises(ValueError, match=r"tokenizer \(bytes, 257 ids\) does not fit the model's vocabulary \(97\)"):
        model_batch(_model(97), "bytes", 1, 8, seed=0)


def test_twin_ties_read_the_logged_ties(tmp_path, monkeypatch):
    grids, text = twin_ties("repro_pair")
    folder = run_dir("repro_pair")
    f = head_metric_frame(folder / "bf16", "tie_fraction")
    last = f[f.step == f.step.max()]
    assert text.startswith(f"Run `{folder.name}` of `results/repro_pair`. `bf16` at step {last.step.iloc[0]:,}: "
                           f"{last.value.mean():.1%} of rows tied on average") and text.endswith(".")
    assert {label for label, _ in grids} == {"bf16", "fp32"}
    (tmp_path / "_toc.yml").write_text("format: jb-book\n")
    (tmp_path / "notebooks").mkdir()
    (tmp_path / "results" / "solo" / "r1" / "sfa").mkdir(parents=True)
    monkeypatch.setenv("LPFA_ROOT", str(tmp_path))
    with pytest.raises(FileNotFoundError, match="r1 holds no bf16 or fp32 run"):
        twin_ties("solo")


def test_replay_rank1_on_the_committed_replay():
    assert replay_rank1("", "bf16_runaway_replay") == ("", [])
    text, within = replay_rank1("repro_runaway", "bf16_runaway_replay")
    folder = run_dir("repro_runaway") / "bf16_runaway_replay"
    assert (text, within) == rank1_text(*load_replay(folder), f"{folder.parent.name}/bf16_runaway_replay")
    assert f"the replay in `{folder.parent.name}/bf16_runaway_replay`" in text and len(within) == 4  # 2 heads × 2 steps


def test_gpu_structures_and_their_section():
    measured = gpu_structures(["structure", "no_such_experiment", "repro_runaway"])
    files = {f"{e}/{p.parent.name}": json.loads(p.read_text())
             for e in ("structure", "repro_runaway") for p in sorted(run_dir(e).glob("*/structure.json"))}
    assert [label for m in measured for label, _ in m["summaries"]] == list(files)
    assert [m["experiment"] for m in measured] == ["structure", "repro_runaway"]
    text = gpu_structures_text(measured, [0.9, 0.95], ["structure", "repro_runaway"])
    shown = what(json.loads((run_dir("structure") / "provenance.json").read_text()))
    assert not shown.startswith("issue")
    runs = gpu_structures_runs(measured)  # the run records, in a collapsed block apart from the findings
    assert runs.startswith(f"Run `{run_dir('structure').name}` of `results/structure`: {shown}.\n\n")
    assert shown not in text and gpu_structures_runs([]) == "No GPU-trained checkpoint is measured yet."
    for label, s in files.items():
        b = np.asarray(s["ties"]["bf16"])
        assert f"`{label}` (`" in text and describe(s) in text and f"{b.mean():.1%} of rows have tied maxima" in text
    assert "Against the paper's pretrained GPT-2" in text and "Not run yet" not in text
    empty = gpu_structures_text([], [], ["a", "b"])
    assert empty.startswith("**Not run yet** for the GPU-trained checkpoints (no `structure.json` in the latest run of "
                            "`results/a`, `results/b`)")
