"""Bad input to the training CLI, a damaged run folder and notebook parameters: each is one clear line.

Every case asserts the specific message. CLI cases run ``lpfa.train.main`` in-process and check the exit status,
that stderr is exactly one line, and that the line names the field and the value given."""

import ast
import gzip
import json
import math
import re
import shutil
from pathlib import Path

import nbformat
import pytest
import torch
from conftest import ROOT

from lpfa import launch
from lpfa.book import execute_notebook, profile_parameters, toc_notebooks
from lpfa.checkpoints import load_checkpoint
from lpfa.data import ReplayLog
from lpfa.params import Param, check_params, integer, undeclared
from lpfa.run import checkpoints_of, load_metrics, read_records, run_verdict
from lpfa.scaling import compare_runs
from lpfa.structure import summarize_run
from lpfa.train import TrainConfig, main, train

BASE = ["data={data}", "model=debug", "block_size=32", "batch_size=4", "max_steps=2", "eval_interval=0",
        "eval_batches=1", "progress=false", "warmup_steps=1", "log_interval=0", "out_dir={tmp}/run"]


@pytest.fixture(scope="module")
def trained(byte_tokens, tmp_path_factory):
    """A finished 2-step run of BASE's config: config.json, metrics.jsonl, replay.jsonl, summary.json, ckpt/."""
    out = tmp_path_factory.mktemp("trained") / "run"
    train(TrainConfig(data=str(byte_tokens), model="debug", block_size=32, batch_size=4, max_steps=2, eval_interval=0,
                      eval_batches=1, progress=False, warmup_steps=1, log_interval=0, out_dir=str(out)))
    return out


def _fill(argv: list[str], data: Path, tmp: Path) -> list[str]:
    return [a.replace("{data}", str(data)).replace("{tmp}", str(tmp)) for a in argv]


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _cut(path: Path, keep: int) -> None:
    """Truncate a file to its first ``keep`` bytes (negative: drop that many from the end), as a full disk or a kill
    would."""
    data = path.read_bytes()
    path.write_bytes(data[:keep])


def _other_vocab(tmp: Path, data: Path) -> None:
    """A copy of the token folder whose meta.json claims a larger vocabulary (as a GPT-2 BPE folder would)."""
    shutil.copytree(data, tmp / "other")
    meta = json.loads((tmp / "other" / "meta.json").read_text())
    (tmp / "other" / "meta.json").write_text(json.dumps({**meta, "vocab_size": 1000}))


# (id, extra argv, files to write under tmp, what to do to a copy of the trained run at tmp/run (None: no run), message)
CLI = [
    # wrong types (each once ended in a bare TypeError from a comparison)
    ("int_given_text", ["max_steps=abc"], {}, None, r"max_steps='abc': expected an int >= 1"),
    ("int_given_fraction", ["max_steps=2.5"], {}, None, r"max_steps=2\.5: expected an int >= 1"),
    ("int_given_exponent", ["max_steps=1e3"], {}, None, r"max_steps=1000\.0: expected an int >= 1"),
    ("int_given_bool", ["batch_size=true"], {}, None, r"batch_size=True: expected an int >= 1"),
    ("float_given_text", ["lr=abc"], {}, None, r"lr='abc': expected a finite number > 0"),
    ("float_given_list", ["tie_eps=[1]"], {}, None, r"tie_eps=\[1\]: expected a finite number >= 0"),
    ("bool_given_yes", ["qk_norm=yes"], {}, None, r"qk_norm='yes': expected true or false"),
    ("bool_given_1", ["resume=1"], {}, None, r"resume='1': expected true or false"),
    ("dict_given_text", ["layer_policies=paper"], {}, None,
     r"layer_policies='paper': expected a dict, each key an int >= 0"),
    ("dict_value_not_list", ["fp32_heads={1: 2}"], {}, None,
     r"fp32_heads=\{1: 2\}: expected a dict, each key an int >= 0 and each value a list"),
    ("yaml_unclosed", ["layer_policies={1: paper"], {}, None,
     r"layer_policies='\{1: paper': expected a YAML value, but it does not parse"),
    ("empty_out_dir", ["out_dir="], {}, None, r"out_dir='': expected a non-empty string"),
    # ranges
    ("zero_lr", ["lr=0"], {}, None, r"lr=0: expected a finite number > 0"),
    ("nan_lr", ["lr=nan"], {}, None, r"lr=nan: expected a finite number > 0"),
    ("min_lr_above_lr", ["lr=1e-3", "min_lr=0.5"], {}, None, r"min_lr=0\.5: expected a number <= lr \(0\.001\)"),
    ("negative_grad_clip", ["grad_clip=-1"], {}, None, r"grad_clip=-1: expected a finite number >= 0"),
    ("negative_warmup", ["warmup_steps=-5"], {}, None, r"warmup_steps=-5: expected an int >= 0"),
    ("dropout_one", ["dropout=1"], {}, None, r"dropout=1: expected a finite number in \[0, 1\)"),
    ("beta2_one", ["beta2=1.0"], {}, None, r"beta2=1\.0: expected a finite number in \[0, 1\)"),
    ("negative_weight_decay", ["weight_decay=-0.1"], {}, None, r"weight_decay=-0\.1: expected a finite number >= 0"),
    ("zero_batch", ["batch_size=0"], {}, None, r"batch_size=0: expected an int >= 1"),
    ("zero_eval_batches", ["eval_batches=0"], {}, None, r"eval_batches=0: expected an int >= 1"),
    ("zero_diag_batch", ["diag_batch=0"], {}, None, r"diag_batch=0: expected an int >= 1"),
    ("negative_interval", ["ckpt_interval=-100"], {}, None, r"ckpt_interval=-100: expected an int >= 0"),
    ("negative_budget", ["time_budget_s=-1"], {}, None, r"time_budget_s=-1: expected a finite number >= 0"),
    ("negative_seed", ["seed=-1"], {}, None, r"seed=-1: expected an int >= 0"),
    # choices
    ("unknown_model", ["model=huge"], {}, None, r"model='huge': expected one of 'gpt2-s', .*'debug'"),
    ("unknown_policy", ["attn_policy=papr"], {}, None, r"attn_policy='papr': expected one of 'paper', 'fa2', "),
    ("unknown_backend", ["attn_backend=flash"], {}, None, r"attn_backend='flash': expected one of 'lpfa', 'sdpa'"),
    ("unknown_optimizer", ["optimizer=sgd"], {}, None, r"optimizer='sgd': expected one of 'adamw', 'muon'"),
    ("unknown_schedule", ["lr_schedule=linear"], {}, None,
     r"lr_schedule='linear': expected one of 'cosine', 'constant'"),
    ("unknown_tokenizer", ["tokenizer=bpe"], {}, None, r"tokenizer='bpe': expected one of 'auto', 'gpt2', 'bytes'"),
    ("unknown_dtype", ["dtype=float16"], {}, None,
     r"dtype='float16': expected one of 'auto', 'bfloat16', 'float32', 'float64'"),
    ("unknown_device", ["device=gpu"], {}, None, r"device='gpu': expected auto, cpu, cuda or cuda:N"),
    ("layer_policy_unknown", ["layer_policies={1: papr}"], {}, None,
     r"layer_policies=\{1: 'papr'\}: expected a dict.* each value one of 'paper'"),
    ("layer_policy_lpfa", ["layer_policies={1: lpfa}"], {}, None, r"layer_policies=\{1: 'lpfa'\}: expected a dict"),
    ("layer_out_of_model", ["layer_policies={5: paper}"], {}, None,
     r"layer_policies=\{5: 'paper'\}: expected layers 0\.\.1 \(model='debug' has 2\)"),
    ("head_out_of_model", ["fp32_heads={1: [9]}"], {}, None,
     r"fp32_heads=\{1: \[9\]\}: expected layers 0\.\.1 and heads 0\.\.1 \(model='debug' has 2 layers of 2 heads\)"),
    # names and the command line
    ("unknown_field_nanogpt", ["learning_rate=1e-3"], {}, None,
     r"learning_rate=0\.001: unknown TrainConfig field; .*\(did you mean lr\?\)"),
    ("unknown_field_typo", ["max_step=5"], {}, None,
     r"max_step=5: unknown TrainConfig field; .*\(did you mean max_steps\?\)"),
    ("not_key_value", ["lr"], {}, None, r"'lr': expected key=value"),
    ("flag_instead_of_key_value", ["--lr", "3e-4"], {}, None,
     r"--lr: not an option; TrainConfig fields are set as key=value, e\.g\. lr="),
    ("unknown_preset", ["--preset", "huge"], {}, None, r"preset='huge': expected one of cpu-smoke, repro, gpt2-s"),
    ("missing_option_value", ["--config"], {}, None, r"error: argument --config: expected one argument"),
    # the YAML config file
    ("config_missing", ["--config", "{tmp}/nope.yaml"], {}, None,
     r"config='.*nope\.yaml': expected a YAML file of TrainConfig fields; no such file"),
    ("config_is_folder", ["--config", "{tmp}"], {}, None,
     r"config='.*': expected a YAML file of TrainConfig fields; it is a folder"),
    ("config_not_mapping", ["--config", "{tmp}/c.yaml"], {"c.yaml": "- lr\n- 3e-4\n"}, None,
     r"config='.*c\.yaml': expected a mapping of TrainConfig fields \(field: value\), got a list"),
    ("config_not_yaml", ["--config", "{tmp}/c.yaml"], {"c.yaml": "lr: [3e-4\n"}, None,
     r"config='.*c\.yaml': expected a YAML file .* does not parse"),
    ("config_unknown_preset", ["--config", "{tmp}/c.yaml"], {"c.yaml": "preset: huge\n"}, None,
     r"preset='huge' \(in .*c\.yaml\): expected one of cpu-smoke"),
    ("config_unknown_field", ["--config", "{tmp}/c.yaml"], {"c.yaml": "learning_rate: 3e-4\n"}, None,
     r"learning_rate='3e-4' \(in .*c\.yaml\): unknown TrainConfig field; .*\(did you mean lr\?\)"),
    ("config_bad_value", ["--config", "{tmp}/c.yaml"], {"c.yaml": "grad_clip: -1\n"}, None,
     r"grad_clip=-1: expected a finite number >= 0 \(set in .*c\.yaml\)"),
    # the machine and the data
    ("cuda_without_gpu", ["device=cuda"], {}, None,
     r"device='cuda': expected a CUDA GPU, but (this torch build has no CUDA|no CUDA GPU is visible)"),
    ("data_folder_missing", ["data={tmp}/nowhere"], {}, None,
     r"data='.*nowhere': expected a folder with train\.bin and val\.bin \(nanoGPT's format\), "
     r"but there is no such folder"),
    ("data_without_val", ["data={tmp}/d"], {"d/train.bin": "\0\0" * 1000}, None,
     r"data='.*d': expected a folder with .*, but it has no val\.bin"),
    ("replay_missing", ["replay={tmp}/nope.jsonl"], {}, None, r"replay='.*nope\.jsonl': replay file .* does not exist"),
    # the run folder: overwriting and resuming
    ("out_dir_holds_a_run", [], {}, lambda tmp, data: None,
     r"out_dir='.*run': expected a new run folder, but it already holds a run; pass resume=true"),
    ("resume_without_checkpoint", ["resume=true"], {}, None, r"resume=true: checkpoint folder .*ckpt does not exist"),
    ("resume_other_model", ["resume=true", "model=tiny"], {}, lambda tmp, data: None,
     r"model='tiny': expected 'debug', the value the checkpoint"),
    ("resume_other_block_size", ["resume=true", "block_size=64"], {}, lambda tmp, data: None,
     r"block_size=64: expected 32, the value the checkpoint"),
    ("resume_other_optimizer", ["resume=true", "optimizer=muon"], {}, lambda tmp, data: None,
     r"optimizer='muon': expected 'adamw', the value"),
    ("resume_other_qk_norm", ["resume=true", "qk_norm=true"], {}, lambda tmp, data: None,
     r"qk_norm=True: expected False, the value"),
    ("resume_other_vocab", ["resume=true", "data={tmp}/other"], {}, _other_vocab,
     r"data='.*other': gives vocab_size 1024, but the checkpoint .* has 320"),
    ("resume_truncated_weights", ["resume=true"], {}, lambda tmp, data: _cut(tmp / "run/ckpt/model.safetensors", 1000),
     r"resume=true: .*model\.safetensors is not a readable safetensors file, it is truncated or corrupt"),
    ("resume_checkpoint_config_not_json", ["resume=true"], {}, lambda tmp, data: _cut(tmp / "run/ckpt/config.json", 50),
     r"resume=true: .*ckpt/config\.json is not valid JSON"),
    ("resume_without_state", ["resume=true"], {}, lambda tmp, data: (tmp / "run/ckpt/state.pt").unlink(),
     r"resume=true: .*state\.pt is missing: .* says the checkpoint has one"),
    ("resume_run_config_not_json", ["resume=true"], {}, lambda tmp, data: _cut(tmp / "run/config.json", 30),
     r"resume=true: .*run/config\.json is not valid JSON .*; move it aside to resume"),
]


NEEDS_NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA GPU")


@pytest.mark.parametrize("argv, files, damage, message",
                         [pytest.param(*c[1:], id=c[0], marks=[NEEDS_NO_GPU] if "cuda" in c[0] else []) for c in CLI])
def test_cli_bad_input_is_one_line(argv, files, damage, message, byte_tokens, trained, tmp_path, capsys):
    for name, text in files.items():
        _write(tmp_path / name, text)
    if damage is not None:
        shutil.copytree(trained, tmp_path / "run")
        damage(tmp_path, byte_tokens)
    try:
        code = main(_fill(BASE + argv, byte_tokens, tmp_path))
    except SystemExit as e:  # argparse's own errors
        code = e.code
    err = capsys.readouterr().err
    assert code == 2, err
    assert err.count("\n") == 1 and err.endswith("\n"), err  # exactly one line
    assert err.startswith("error: ") and "Traceback" not in err
    assert re.search(message, err), err


def test_cli_debug_shows_the_exception(byte_tokens, tmp_path):
    with pytest.raises(ValueError, match="max_steps='abc': expected an int >= 1"):
        main(_fill(BASE, byte_tokens, tmp_path) + ["max_steps=abc", "--debug"])


# ---- a damaged run folder: each reader names the file and what is wrong ---------------------------------------
def _append(path: Path, text: str) -> None:
    with open(path, "a") as f:
        f.write(text)


def _gzip_cut(run: Path) -> None:
    data = gzip.compress((run / "metrics.jsonl").read_bytes())
    (run / "metrics.jsonl").unlink()
    (run / "metrics.jsonl.gz").write_bytes(data[: len(data) // 2])


# (id, what to do to the run, what reads it, exception, message)
DAMAGED = [
    ("metrics_middle_line_corrupt",
     lambda r: (r / "metrics.jsonl").write_text('{"step": 0, "loss": 5.5}\n{"step": 1, "lo\n'
                                                '{"step": 2, "loss": 5.4}\n'),
     read_records, ValueError, r"metrics\.jsonl: line 2 is not valid JSON \(.*\): '\{\"step\": 1, \"lo'"),
    ("metrics_line_not_a_record", lambda r: _append(r / "metrics.jsonl", "[1, 2]\n{\"step\": 9}\n"),
     read_records, ValueError, r"metrics\.jsonl: line \d+ is not a metrics record \(a JSON object with a 'step'\)"),
    ("metrics_missing", lambda r: (r / "metrics.jsonl").unlink(), read_records, FileNotFoundError,
     r"has no metrics\.jsonl or metrics\.jsonl\.gz"),
    ("metrics_gz_truncated", _gzip_cut, read_records, ValueError,
     r"metrics\.jsonl\.gz cannot be read \(EOFError: .*\): the file is damaged"),
    ("metrics_without_steps", lambda r: (r / "metrics.jsonl").write_text(""), load_metrics, ValueError,
     r"metrics\.jsonl has no training records \(the run ended before its first step\)"),
    ("config_missing", lambda r: (r / "config.json").unlink(), run_verdict, FileNotFoundError,
     r"config\.json does not exist: .* is not an lpfa\.train run folder \(or it lost its config\.json\)"),
    ("config_truncated", lambda r: _cut(r / "config.json", 40), run_verdict, ValueError,
     r"config\.json is not valid JSON \(.*\): the run folder is damaged"),
    ("config_not_an_object", lambda r: (r / "config.json").write_text("[1, 2]"), run_verdict, ValueError,
     r"config\.json is not an lpfa\.train config: expected a JSON object with a 'train' object"),
    ("config_truncated_scaling", lambda r: _cut(r / "config.json", 40), lambda r: compare_runs(r, r), ValueError,
     r"config\.json is not valid JSON"),
    ("config_missing_structure", lambda r: (r / "config.json").unlink(), summarize_run, FileNotFoundError,
     r"config\.json does not exist"),
    ("ckpt_weights_truncated", lambda r: _cut(r / "ckpt/model.safetensors", -100),
     lambda r: load_checkpoint(r / "ckpt"), ValueError,
     r"model\.safetensors is not a readable safetensors file, it is truncated or corrupt"),
    ("ckpt_weights_missing", lambda r: (r / "ckpt/model.safetensors").unlink(), lambda r: load_checkpoint(r / "ckpt"),
     FileNotFoundError, r"model\.safetensors is missing: the checkpoint folder .* has no weights"),
    ("ckpt_config_missing", lambda r: (r / "ckpt/config.json").unlink(), lambda r: load_checkpoint(r / "ckpt"),
     FileNotFoundError, r"ckpt/config\.json is missing: .* is not a complete lpfa checkpoint folder"),
    ("ckpt_state_missing", lambda r: (r / "ckpt/state.pt").unlink(), lambda r: load_checkpoint(r / "ckpt"),
     FileNotFoundError, r"state\.pt is missing: .*config\.json says the checkpoint has one \(has_extra_state: true\)"),
    ("ckpt_state_truncated", lambda r: _cut(r / "ckpt/state.pt", 200), lambda r: load_checkpoint(r / "ckpt"),
     ValueError, r"state\.pt could not be loaded with torch\.load\(weights_only=True\), it is corrupt or truncated"),
    ("ckpt_folder_missing", lambda r: shutil.rmtree(r / "ckpt"), lambda r: load_checkpoint(r / "ckpt"),
     FileNotFoundError, r"checkpoint folder .*ckpt does not exist"),
    ("ckpt_config_damaged_replay", lambda r: _cut(r / "ckpt/config.json", 20), checkpoints_of, ValueError,
     r"ckpt/config\.json is damaged: expected a checkpoint's config\.json with its 'step'"),
    ("replay_middle_line_corrupt",
     lambda r: _append(r / "replay.jsonl", '{"step": 5, "sta\n{"step": 6, "starts": [[1]]}\n'),
     lambda r: ReplayLog.open(r / "replay.jsonl",
                              json.loads((r / "config.json").read_text())["data_dir"] + "/train.bin"), ValueError,
     r"replay\.jsonl: line \d+ is not a replay record \(a JSON object with 'step' and 'starts'\)"),
]


@pytest.mark.parametrize("damage, read, exc, message", [pytest.param(*c[1:], id=c[0]) for c in DAMAGED])
def test_damaged_run_folder_is_one_line(damage, read, exc, message, trained, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    damage(run)
    with pytest.raises(exc, match=message) as e:
        read(run)
    assert "\n" not in str(e.value)


def test_a_killed_run_keeps_its_logs(trained, tmp_path):
    """A run killed mid-write has a last line cut short and no summary.json: it is read with a warning, not refused."""
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    (run / "summary.json").unlink()
    _append(run / "metrics.jsonl", '{"step": 2, "loss": 5.')
    _append(run / "replay.jsonl", '{"step": 2, "starts": [[1')
    with pytest.warns(UserWarning, match=r"metrics\.jsonl: skipped line \d+, which is cut short"):
        recs = read_records(run)
    assert [r["step"] for r in recs if "loss" in r] == [0, 1]
    assert run_verdict(run)["steps"] == 2 and len(load_metrics(run)[0]) == 2
    with pytest.warns(UserWarning, match=r"replay\.jsonl: skipped line \d+, which is cut short"):
        log = ReplayLog.open(run / "replay.jsonl",
                             Path(json.loads((run / "config.json").read_text())["data_dir"]) / "train.bin")
    assert sorted(log.steps) == [0, 1]
    # the launcher's status of a live or killed run: the last whole record; a damaged summary.json is shown, not fatal
    (run.parent / "exp").mkdir()
    launch_record = {"name": "exp", "runs": {"a": {"pid": 2**22 + 7, "out_dir": str(run)}}}
    (run.parent / "exp" / "launch.json").write_text(json.dumps(launch_record))
    (run / "summary.json").write_text('{"status": "compl')
    (st,) = launch.status("exp", root=run.parent)
    assert st["step"] == 1 and st["status"].startswith("unreadable summary.json (JSONDecodeError")


# ---- notebook parameters: the check cell right after each notebook's parameters cell ---------------------------
def _cells(stem: str):
    path = ROOT / "notebooks" / f"{stem}.ipynb"
    nb = nbformat.read(path if path.exists() else ROOT / "book" / f"{stem}.ipynb", as_version=4)
    i = next(i for i, c in enumerate(nb.cells) if "parameters" in c.metadata.get("tags", []))
    return nb.cells[i], nb.cells[i + 1]


NOTEBOOK_PATHS = toc_notebooks(ROOT)  # notebooks/*.ipynb and book/intro.ipynb


def _run_check(stem: str, **params) -> None:
    """The notebook's parameters cell, papermill's injected values, then its check cell, as papermill runs them."""
    params_cell, check_cell = _cells(stem)
    ns: dict = {}
    exec(params_cell.source, ns)
    ns.update(params)
    exec(check_cell.source, ns)


NOTEBOOK = [
    ("01_bf16_rounding", {"trials": "lots"}, r"trials='lots': expected an int >= 2"),
    ("01_bf16_rounding", {"trials": 2.5}, r"trials=2\.5: expected an int >= 2"),
    ("01_bf16_rounding", {"a": "x"}, r"a='x': expected a finite number in \[-3\.40282e\+38, 3\.40282e\+38\]"),
    ("01_bf16_rounding", {"b": 1e39}, r"b=1e\+39: expected a finite number in"),
    ("01_bf16_rounding", {"n_ones": [0, "x"]}, r"n_ones=\[0, 'x'\]: expected a non-empty list, each item an int >= 0"),
    ("01_bf16_rounding", {"n_ones": [0, 100]}, r"n_ones=\[0, 100\]: expected at most n_keys \(64\) tied keys in a row"),
    ("01_bf16_rounding", {"gaps": [-1.0]},
     r"gaps=\[-1\.0\]: expected a non-empty list, each item a finite number >= 0"),
    ("06_loss_explosion", {"twins": {"bf16": "bf16"}},
     r"twins=\{'bf16': 'bf16'\}: expected a dict with the keys 'bf16', 'fp32'"),
    ("06_loss_explosion", {"window": 0}, r"window=0: expected an int >= 1"),
    ("06_loss_explosion", {"rerun": "yes"}, r"rerun='yes': expected true or false"),
    ("07_spectral_norms", {"layer": -1}, r"layer=-1: expected an int >= 0"),
    ("03_pktx_structure", {"replay": ""}, r"replay='': expected a non-empty string"),
    ("02_delta_bias", {"compare": ["x"]}, r"compare=\['x'\]: expected a dict"),
    ("04_pv_error", {"experiment": None}, r"experiment=None: expected a non-empty string"),
    ("09_sfa", {"twins": {"bf16": "bf16", "fp32": "fp32"}},
     r"twins=.*: expected a dict with the keys 'bf16', 'sfa', 'fp32'"),
    ("05_structure", {"structure_experiments": "structure"}, r"structure_experiments='structure': expected a list"),
    ("12_attention_kernels", {"T_demo": -1}, r"T_demo=-1: expected an int >= 1"),
    ("13_training", {"preset": "huge"}, r"preset='huge': expected one of 'cpu-smoke', 'repro', 'gpt2-s'"),
    ("13_training", {"attn_policy": "papr"}, r"attn_policy='papr': expected one of 'paper', 'fa2'"),
    ("14_running_at_scale", {"skip": -1}, r"skip=-1: expected an int >= 0"),
    ("14_running_at_scale", {"gpus_at_scale": 0}, r"gpus_at_scale=0: expected an int >= 1"),
    ("15_early_warning", {"max_fpr": 1.5}, r"max_fpr=1.5: expected a finite number in \[0, 1\)"),
    ("16_kernel_bias", {"seq_len": 0}, r"seq_len=0: expected an int >= 1"),
    ("08_tie_frequency", {"run": 5}, r"run=5: expected None or a non-empty string"),
    ("10_isolation", {"logit_ratio": 0}, r"logit_ratio=0: expected a finite number > 0"),
    ("11_seeds", {"gpus": 0}, r"gpus=0: expected an int >= 1"),
]


@pytest.mark.parametrize("stem, params, message", NOTEBOOK, ids=[f"{s}-{next(iter(p))}" for s, p, _ in NOTEBOOK])
def test_notebook_parameter_is_checked(stem, params, message):
    with pytest.raises(ValueError, match=f"^{message}"):
        _run_check(stem, **params)


def test_every_notebook_checks_every_parameter_right_after_the_parameters_cell():
    small = profile_parameters(ROOT, "small")
    for path in sorted((ROOT / "notebooks").glob("*.ipynb")):
        params_cell, check_cell = _cells(path.stem)
        assert "remove-input" in check_cell.metadata.get("tags", []), path.name
        names = {t.id for node in ast.parse(params_cell.source).body
                 if isinstance(node, ast.Assign) for t in ast.walk(node.targets[0])
                 if isinstance(t, ast.Name)}
        call = next(n for n in ast.walk(ast.parse(check_cell.source))
                    if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "check_params")
        ns: dict = {}
        exec(params_cell.source, ns)
        exec(check_cell.source, ns)  # the defaults pass
        assert set(eval(ast.unparse(call.args[0]), ns)) == names, path.name  # the page module's PARAMS
        _run_check(path.stem, **(small.get(path.stem) or {}))  # and the small profile


def test_papermill_stops_at_the_check_with_a_clear_message(tmp_path):
    import papermill as pm

    nb = ROOT / "notebooks" / "01_bf16_rounding.ipynb"
    with pytest.raises(pm.PapermillExecutionError) as e:
        execute_notebook(nb, tmp_path / nb.name,
                         {**profile_parameters(ROOT, "small")["01_bf16_rounding"], "trials": "lots"})
    assert e.value.ename == "ValueError" and e.value.evalue == "trials='lots': expected an int >= 2"
    done = nbformat.read(tmp_path / nb.name, as_version=4)
    ran = [c for c in done.cells if c.cell_type == "code" and c.get("execution_count")]
    assert "check_params" in ran[-1].source  # it stopped right after the parameters, before any computation


def test_check_params_refuses_a_name_it_does_not_declare():
    """A name the parameters cell does not declare (a misspelled ``papermill -p``) is one line naming it, its value and
    the notebook's parameters; IPython's globals, "_"-names and the check cell's imports are not parameters."""
    spec = {"trials": integer(2), "seed": integer(0)}
    ipython = {"In": [""], "Out": {}, "get_ipython": print, "exit": print, "quit": print, "_": None, "_i1": "x",
               "__builtins__": {}, "math": math, "integer": integer, "Param": Param}
    check_params(spec, {**ipython, "trials": 5, "seed": 0})
    with pytest.raises(ValueError) as e:
        check_params(spec, {**ipython, "trials": 5, "seed": 0, "trails": 5})
    assert str(e.value) == ("trails=5: not a parameter of this notebook (did you mean trials?); its parameters: "
                            "trials, seed")
    with pytest.raises(ValueError, match=r"^layers=\[1, 2\]: not a parameter of this notebook; its parameters: "
                                         r"trials, seed$"):
        check_params(spec, {"trials": 5, "seed": 0, "layers": [1, 2]})
    assert undeclared(spec, {**ipython, "trials": 5, "Trials": None, "x": {"a": 1}}) == ["Trials", "x"]


@pytest.mark.parametrize("stem", [p.stem for p in NOTEBOOK_PATHS])
def test_every_notebook_refuses_an_undeclared_parameter(stem):
    """Each notebook's parameters cell declares exactly its page's PARAMS (the check cell passes as it is), and a
    name it does not declare stops the check cell."""
    _run_check(stem)
    with pytest.raises(ValueError, match=r"^not_a_param=5: not a parameter of this notebook; its parameters: "):
        _run_check(stem, not_a_param=5)


def test_papermill_stops_at_a_misspelled_parameter(tmp_path):
    import papermill as pm

    nb = ROOT / "notebooks" / "01_bf16_rounding.ipynb"
    with pytest.raises(pm.PapermillExecutionError) as e:
        execute_notebook(nb, tmp_path / nb.name, {**profile_parameters(ROOT, "small")["01_bf16_rounding"], "trails": 5})
    assert e.value.ename == "ValueError"
    assert e.value.evalue == ("trails=5: not a parameter of this notebook (did you mean trials?); its parameters: a, "
                              "b, trials, n_keys, n_ones, gaps, seed")
    done = nbformat.read(tmp_path / nb.name, as_version=4)
    ran = [c for c in done.cells if c.cell_type == "code" and c.get("execution_count")]
    assert "check_params" in ran[-1].source  # it stopped right after the parameters, before any computation


def test_cuda_message_says_why(monkeypatch, byte_tokens, tmp_path, capsys):
    """With a CUDA build but no GPU visible, the message says so (not that the build lacks CUDA)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.version, "cuda", "12.8")
    assert main(_fill(BASE, byte_tokens, tmp_path) + ["device=cuda:0"]) == 2
    assert capsys.readouterr().err == ("error: device='cuda:0': expected a CUDA GPU, but no CUDA GPU is visible "
                                       f"(torch {torch.__version__}); use device=auto or device=cpu\n")
