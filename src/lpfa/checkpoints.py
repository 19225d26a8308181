"""Checkpoints: lpfa's own folder format, nanoGPT's ``ckpt.pt`` and Hugging Face GPT-2 folders.

lpfa's format is a *folder* written atomically by :func:`save_checkpoint`:

* ``model.safetensors`` — the weights (safetensors). The tied ``lm_head.weight`` is stored once, as
  ``transformer.wte.weight``, and re-tied on load;
* ``config.json`` — ``{"format": "lpfa-checkpoint", "format_version": 1, "lpfa_version": ...,
  "torch_version": ..., "step": int, "model": GPTConfig.to_dict(), "train": {...}}``;
* ``optimizer.pt`` — ``torch.save(optimizer.state_dict())``, only when an optimizer is given;
* ``state.pt`` — ``torch.save(extra_state)`` (RNG states, data position, ...), only when given.

The folder is first written as a hidden sibling ``.{name}.tmp-<pid>``, every file fsynced, and then
swapped in: an existing checkpoint is renamed aside (``.{name}.old-<pid>``), the new one renamed
into place, and only then is the old one deleted. A crash therefore never leaves a half-written
checkpoint under the target name and never deletes the last good one.

Foreign formats load into :class:`lpfa.model.GPT` (whose parameter names are nanoGPT's):

* :func:`load_nanogpt` — the ``ckpt.pt`` that nanoGPT's ``train.py`` writes;
* :func:`load_hf_gpt2` — a ``GPT2LMHeadModel.save_pretrained`` folder, read without importing
  ``transformers`` (Conv1D weights transposed, as nanoGPT's ``from_pretrained`` does).

Every loader builds the model on the CPU in the stored dtype and then moves it to ``map_location``
(a device string or ``torch.device``). Models come back in training mode like any freshly built
``nn.Module``: call ``.eval()`` for inference. Loading keyword overrides may change only fields that
do not affect the weights (``attn_backend``, ``attn_policy``, ``layer_policies``, ``fp32_heads``,
``dropout``, ``gelu_approximate``).
"""

from __future__ import annotations

import io
import json
import os
import shutil
from dataclasses import dataclass, fields
from pathlib import Path

import safetensors
import safetensors.torch
import torch

import lpfa
from lpfa.model import GPT, GPTConfig

__all__ = ["Checkpoint", "save_checkpoint", "load_checkpoint", "load_nanogpt", "load_hf_gpt2", "read_json"]

FORMAT = "lpfa-checkpoint"
FORMAT_VERSION = 1
WEIGHTS_FILE = "model.safetensors"
CONFIG_FILE = "config.json"
OPTIMIZER_FILE = "optimizer.pt"
STATE_FILE = "state.pt"

# GPTConfig fields that decide which tensors exist and their shapes (or how they are read): a
# checkpoint fixes them, overrides may not change them.
ARCHITECTURE_FIELDS = ("vocab_size", "block_size", "n_layer", "n_head", "n_embd", "bias", "qk_norm", "gated_attn")

_TIED = ("lm_head.weight", "transformer.wte.weight")
_NANOGPT_MODEL_ARGS = ("n_layer", "n_head", "n_embd", "block_size", "bias", "vocab_size")
_HF_CONV1D = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
_HF_GELU = {"gelu_new": "tanh", "gelu_pytorch_tanh": "tanh", "gelu": "none"}


def read_json(path: str | Path, damaged: str = "", missing: str | None = None):
    """``path`` parsed as JSON, with a one-line error that names the file: ``FileNotFoundError(missing)`` when it is
    not a file (with ``missing`` None the caller has checked that), ``ValueError("<path> is not valid JSON (<why>)"
    + damaged)`` when it does not parse. The one reader of the JSON files of a checkpoint or run folder."""
    path = Path(path)
    if missing is not None and not path.is_file():
        raise FileNotFoundError(missing)
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as e:  # json.JSONDecodeError is a ValueError
        raise ValueError(f"{path} is not valid JSON ({e}){damaged}") from e


@dataclass
class Checkpoint:
    """What :func:`load_checkpoint` returns: ``model`` is the GPT with its weights; ``config`` the whole parsed
    ``config.json``; ``step`` and ``train_config`` what :func:`save_checkpoint` was given; ``optimizer_state`` an
    optimizer ``state_dict`` for ``optimizer.load_state_dict`` (``None`` if none was saved); ``extra_state`` the saved
    extra dict (``None`` if none was saved)."""

    model: GPT
    config: dict
    step: int
    train_config: dict
    optimizer_state: dict | None = None
    extra_state: dict | None = None


# --------------------------------------------------------------------------------------------------
# lpfa's own format


def save_checkpoint(
    folder,
    model: GPT,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    step: int,
    train_config: dict | None = None,
    extra_state: dict | None = None,
) -> Path:
    """Write ``model`` (and optionally ``optimizer`` and ``extra_state``) to the checkpoint folder ``folder``: ``step``
    the training step (an int). ``train_config``: any JSON-serialisable dict, stored in ``config.json`` under
    ``"train"``. ``extra_state``: a dict of tensors and plain Python values (ints, floats, strings, lists, tuples,
    dicts), e.g. ``torch.get_rng_state()`` and the data position; it must load with ``torch.load(weights_only=True)``
    (convert NumPy arrays to tensors). The write is atomic (module docstring). Returns the checkpoint folder's path."""
    folder = Path(folder)
    if not isinstance(model, GPT):
        raise TypeError(f"save_checkpoint expects an lpfa.model.GPT, got {type(model).__name__}")
    if isinstance(step, bool) or not isinstance(step, int):
        raise TypeError(f"step must be an int, got {step!r} ({type(step).__name__})")
    if folder.exists() and not folder.is_dir():
        raise FileExistsError(f"{folder} exists and is not a folder; a checkpoint is a folder (expected a folder or no "
                              "such path)")
    # everything that can be checked is checked before anything is written
    config = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "lpfa_version": lpfa.__version__,
        "torch_version": torch.__version__,
        "step": step,
        "model": model.config.to_dict(),
        "train": dict(train_config or {}),
        "has_optimizer": optimizer is not None,
        "has_extra_state": extra_state is not None,
    }
    try:
        config_text = json.dumps(config, indent=2, sort_keys=True, allow_nan=True) + "\n"
    except (TypeError, ValueError) as e:
        raise TypeError(f"train_config must be JSON-serialisable (str/int/float/bool/None, lists, dicts): {e}") from e
    state_bytes = None
    if extra_state is not None:
        if not isinstance(extra_state, dict):
            raise TypeError(f"extra_state must be a dict, got {type(extra_state).__name__}")
        state_bytes = _serialise_weights_only(extra_state, "extra_state")

    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = folder.parent / f".{folder.name}.tmp-{os.getpid()}"
    if tmp.exists():  # left by an earlier crash of a process with our pid
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        weights = _state_dict_for_saving(model)
        safetensors.torch.save_file(weights, str(tmp / WEIGHTS_FILE), metadata={"format": "pt", "lpfa": FORMAT})
        _fsync(tmp / WEIGHTS_FILE)
        if optimizer is not None:
            torch.save(optimizer.state_dict(), tmp / OPTIMIZER_FILE)
            _fsync(tmp / OPTIMIZER_FILE)
        if state_bytes is not None:
            (tmp / STATE_FILE).write_bytes(state_bytes)
            _fsync(tmp / STATE_FILE)
        (tmp / CONFIG_FILE).write_text(config_text)  # last: a folder with config.json is complete
        _fsync(tmp / CONFIG_FILE)
        _fsync(tmp)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _replace_folder(tmp, folder)
    return folder


def load_checkpoint(folder, map_location="cpu", model_overrides: dict | None = None) -> Checkpoint:
    """Load a checkpoint folder written by :func:`save_checkpoint`. ``map_location``: device for the model, the
    optimizer state and the extra state (``"cpu"``, ``"cuda"``, a ``torch.device``). ``model_overrides``: GPTConfig
    fields to change on loading, only those that do not affect the weights, e.g. ``{"attn_backend": "math"}`` or
    ``{"attn_policy": "fp32"}``. Raises ``FileNotFoundError`` for a missing folder or file and ``ValueError`` for a file
    that is not what it should be (invalid JSON, corrupt safetensors, weights that do not fit the config)."""
    folder = Path(folder)
    if not folder.exists():
        hint = ""
        aside = sorted(folder.parent.glob(f".{folder.name}.old-*")) if folder.parent.is_dir() else []
        if aside:
            hint = f"; a save was interrupted while swapping folders, the previous checkpoint is at {aside[0]}"
        raise FileNotFoundError(f"checkpoint folder {folder} does not exist (expected a folder written by "
                                f"save_checkpoint){hint}")
    if not folder.is_dir():
        raise NotADirectoryError(
            f"{folder} is a file, but an lpfa checkpoint is a folder with {WEIGHTS_FILE} and {CONFIG_FILE} "
            "(for nanoGPT's ckpt.pt use load_nanogpt)"
        )
    config_path = folder / CONFIG_FILE
    config = read_json(config_path, "; expected the config.json written by save_checkpoint",
                       missing=f"{config_path} is missing: {folder} is not a complete lpfa checkpoint folder")
    if (not isinstance(config, dict) or not isinstance(config.get("model"), dict)
            or not isinstance(config.get("step"), int) or isinstance(config.get("step"), bool)):
        raise ValueError(f"{config_path} is not an lpfa checkpoint config: expected a JSON object with 'model' "
                         "(a dict) and 'step' (an int)")
    if config.get("format", FORMAT) != FORMAT or config.get("format_version", FORMAT_VERSION) > FORMAT_VERSION:
        raise ValueError(
            f"{config_path} has format {config.get('format')!r} version {config.get('format_version')!r}; "
            f"this lpfa reads {FORMAT!r} up to version {FORMAT_VERSION}"
        )
    try:
        model_config = _model_config(config["model"], model_overrides or {}, str(config_path))
    except TypeError as e:
        raise ValueError(f"{config_path}: invalid model config: {e}") from e

    weights_path = folder / WEIGHTS_FILE
    if not weights_path.is_file():
        raise FileNotFoundError(f"{weights_path} is missing: the checkpoint folder {folder} has no weights")
    state_dict = _read_safetensors(weights_path)
    model = _build_and_load(model_config, state_dict, str(weights_path), map_location)

    for name, flag in ((OPTIMIZER_FILE, "has_optimizer"), (STATE_FILE, "has_extra_state")):
        if config.get(flag) and not (folder / name).is_file():
            raise FileNotFoundError(f"{folder / name} is missing: {config_path} says the checkpoint has one "
                                    f"({flag}: true)")
    optimizer_state = _torch_load_optional(folder / OPTIMIZER_FILE, map_location)
    extra_state = _torch_load_optional(folder / STATE_FILE, map_location)
    return Checkpoint(
        model=model,
        config=config,
        step=int(config["step"]),
        train_config=config.get("train") or {},
        optimizer_state=optimizer_state,
        extra_state=extra_state,
    )


# --------------------------------------------------------------------------------------------------
# nanoGPT


def load_nanogpt(path, map_location="cpu", **config_overrides) -> GPT:
    """Load the ``ckpt.pt`` written by nanoGPT's ``train.py`` into an lpfa GPT. The file is read with
    ``torch.load(weights_only=True)``. It must be a dict with ``"model"`` (a state dict; a ``"_orig_mod."`` prefix from
    ``torch.compile`` is removed, old ``.attn.bias`` mask buffers are ignored) and ``"model_args"`` (n_layer, n_head,
    n_embd, block_size, bias, vocab_size and optionally dropout). ``config_overrides``: GPTConfig fields that do not
    affect the weights, e.g. ``attn_backend="math"``, ``dropout=0.0``."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"nanoGPT checkpoint {path} does not exist (expected the ckpt.pt file written by "
                                "nanoGPT's train.py)")
    try:
        ckpt = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # UnpicklingError, RuntimeError, KeyError, EOFError, ... for foreign or broken files
        raise ValueError(
            f"{path} could not be loaded with torch.load(weights_only=True) ({_why(e)}); "
            "expected nanoGPT's ckpt.pt (tensors and plain Python values only)"
        ) from e
    if (not isinstance(ckpt, dict) or not isinstance(ckpt.get("model"), dict)
            or not isinstance(ckpt.get("model_args"), dict)):
        found = sorted(map(str, ckpt)) if isinstance(ckpt, dict) else type(ckpt).__name__
        raise ValueError(
            f"{path} is not a nanoGPT checkpoint: expected a dict with 'model' (state dict) and 'model_args' (dict), "
            f"found {found}"
        )
    args = ckpt["model_args"]
    missing = [k for k in _NANOGPT_MODEL_ARGS if k not in args]
    if missing:
        raise ValueError(f"{path}: model_args lacks {missing}; nanoGPT's model_args has "
                         f"{list(_NANOGPT_MODEL_ARGS) + ['dropout']}")
    model_dict = {k: args[k] for k in _NANOGPT_MODEL_ARGS}
    model_dict["dropout"] = float(args.get("dropout", 0.0))
    model_config = _model_config(model_dict, config_overrides, str(path))

    prefix = "_orig_mod."
    state_dict = {}
    for key, value in ckpt["model"].items():
        key = key[len(prefix) :] if key.startswith(prefix) else key
        if key.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # the causal-mask buffer of old nanoGPT versions
        state_dict[key] = value
    return _build_and_load(model_config, state_dict, str(path), map_location)


# --------------------------------------------------------------------------------------------------
# Hugging Face GPT-2


def load_hf_gpt2(folder, map_location="cpu", **config_overrides) -> GPT:
    """Load a Hugging Face GPT-2 folder (``GPT2LMHeadModel.save_pretrained``) into an lpfa GPT. Reads ``config.json``
    and ``model.safetensors`` (or a sharded ``model.safetensors.index.json``, or ``pytorch_model.bin`` with
    ``torch.load(weights_only=True)``); ``transformers`` is not needed. Conv1D weights are transposed to ``nn.Linear``'s
    layout, the attention-mask buffers are ignored, and the config maps to ``bias=True``, ``dropout=0``,
    ``block_size=n_positions`` and ``gelu_approximate="tanh"`` for ``gelu_new``. Configs lpfa cannot represent raise
    ``ValueError``. ``config_overrides``: GPTConfig fields that do not affect the weights, e.g.
    ``attn_backend="math"``."""
    folder = Path(folder)
    if not folder.is_dir():
        raise FileNotFoundError(f"{folder} is not a folder; expected a Hugging Face save_pretrained folder with "
                                "config.json and model.safetensors")
    config_path = folder / "config.json"
    hf = read_json(config_path, missing=f"{config_path} is missing; expected a Hugging Face save_pretrained folder")
    model_config = _model_config(_hf_to_lpfa_config(hf, config_path), config_overrides, str(config_path))

    source, hf_state = _read_hf_weights(folder)
    state_dict = {}
    for key, value in hf_state.items():
        if not key.startswith("transformer.") and key != "lm_head.weight":
            key = "transformer." + key  # GPT2Model's (and the original OpenAI upload's) names
        if key.endswith((".attn.bias", ".attn.masked_bias")):
            continue  # causal-mask buffers
        if key.endswith(_HF_CONV1D):
            value = value.t().contiguous()  # Conv1D stores (in, out); nn.Linear wants (out, in)
        state_dict[key] = value
    return _build_and_load(model_config, state_dict, source, map_location)


def _hf_to_lpfa_config(hf: dict, config_path: Path) -> dict:
    if not isinstance(hf, dict):
        raise ValueError(f"{config_path} is not a JSON object")
    if hf.get("model_type", "gpt2") != "gpt2":
        raise ValueError(f"{config_path} has model_type {hf.get('model_type')!r}; load_hf_gpt2 reads GPT-2 ('gpt2') "
                         "only")
    missing = [k for k in ("n_layer", "n_head", "n_embd", "n_positions", "vocab_size") if k not in hf]
    if missing:
        raise ValueError(f"{config_path} lacks {missing}; expected a GPT-2 config (n_layer, n_head, n_embd, "
                         "n_positions, vocab_size)")
    act = hf.get("activation_function", "gelu_new")
    problems = []
    if act not in _HF_GELU:
        problems.append(f"activation_function={act!r} (supported: {sorted(_HF_GELU)})")
    for key, default in (("scale_attn_by_inverse_layer_idx", False), ("reorder_and_upcast_attn", False),
                         ("add_cross_attention", False)):
        if hf.get(key, default):
            problems.append(f"{key}=true (must be false)")
    if not hf.get("scale_attn_weights", True):
        problems.append("scale_attn_weights=false (lpfa always scales by 1/sqrt(head_dim))")
    if hf.get("n_inner") not in (None, 4 * hf["n_embd"]):
        problems.append(f"n_inner={hf['n_inner']} (lpfa's MLP width is 4*n_embd = {4 * hf['n_embd']})")
    if abs(float(hf.get("layer_norm_epsilon", 1e-5)) - 1e-5) > 1e-12:
        problems.append(f"layer_norm_epsilon={hf['layer_norm_epsilon']} (lpfa uses 1e-5)")
    if problems:
        raise ValueError(f"{config_path}: this GPT-2 config cannot be represented by lpfa's GPT: "
                         + "; ".join(problems))
    return {
        "n_layer": hf["n_layer"],
        "n_head": hf["n_head"],
        "n_embd": hf["n_embd"],
        "block_size": hf["n_positions"],
        "vocab_size": hf["vocab_size"],
        "bias": True,
        "dropout": 0.0,
        "gelu_approximate": _HF_GELU[act],
    }


def _read_hf_weights(folder: Path) -> tuple[str, dict]:
    single, index = folder / "model.safetensors", folder / "model.safetensors.index.json"
    bin_ = folder / "pytorch_model.bin"
    if single.is_file():
        return str(single), _read_safetensors(single)
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index} is not a safetensors index (expected JSON with a 'weight_map'): {e}") from e
        state = {}
        for shard in sorted(set(weight_map.values())):
            if not (folder / shard).is_file():
                raise FileNotFoundError(f"{folder / shard}, named in {index}, is missing")
            state.update(_read_safetensors(folder / shard))
        return str(index), state
    if bin_.is_file():
        try:
            state = torch.load(bin_, map_location="cpu", weights_only=True)
        except Exception as e:  # UnpicklingError, RuntimeError, KeyError, EOFError, ... for foreign or broken files
            raise ValueError(f"{bin_} could not be loaded with torch.load(weights_only=True) ({_why(e)})") from e
        if not isinstance(state, dict):
            raise ValueError(f"{bin_} is not a state dict (found {type(state).__name__})")
        return str(bin_), state
    raise FileNotFoundError(f"{folder} has no weights: expected model.safetensors, model.safetensors.index.json or "
                            "pytorch_model.bin")


# --------------------------------------------------------------------------------------------------
# shared helpers


def _model_config(model_dict: dict, overrides: dict, source: str) -> GPTConfig:
    """GPTConfig from a stored dict plus overrides of fields that do not change the weights."""
    names = {f.name for f in fields(GPTConfig)}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ValueError(f"unknown GPTConfig fields in overrides: {unknown}; GPTConfig has {sorted(names)}")
    fixed = sorted(k for k in overrides if k in ARCHITECTURE_FIELDS and overrides[k] != model_dict.get(k))
    if fixed:
        raise ValueError(
            f"cannot override {fixed} when loading {source}: they decide the weights' shapes, which the checkpoint "
            f"fixes; overridable fields are {sorted(names - set(ARCHITECTURE_FIELDS))}"
        )
    return GPTConfig.from_dict({**model_dict, **overrides})


def _state_dict_for_saving(model: GPT) -> dict[str, torch.Tensor]:
    """The model's state dict with the tied LM head dropped (stored once, as the token embedding)."""
    sd = model.state_dict()
    head, wte = sd.get(_TIED[0]), sd.get(_TIED[1])
    if head is not None and wte is not None and head.data_ptr() == wte.data_ptr() and head.shape == wte.shape:
        del sd[_TIED[0]]
    return {k: v.detach().to("cpu").contiguous() for k, v in sd.items()}


def _read_safetensors(path: Path) -> dict[str, torch.Tensor]:
    try:
        return safetensors.torch.load_file(str(path), device="cpu")
    except Exception as e:  # SafetensorError and friends: truncated, corrupt, not safetensors
        raise ValueError(f"{path} is not a readable safetensors file, it is truncated or corrupt: {e}") from e


def _build_and_load(config: GPTConfig, state_dict: dict, source: str, map_location) -> GPT:
    """Build GPT(config) and load ``state_dict`` into it, strictly, with errors that name the keys."""
    float_dtypes = {v.dtype for v in state_dict.values() if torch.is_floating_point(v)}
    model = GPT(config)
    expected = model.state_dict()
    tied = _TIED[0] not in state_dict and _TIED[1] in state_dict
    want = {k: v for k, v in expected.items() if not (tied and k == _TIED[0])}
    missing = [k for k in want if k not in state_dict]
    unexpected = [k for k in state_dict if k not in want]
    mismatched = [k for k in want if k in state_dict and tuple(state_dict[k].shape) != tuple(want[k].shape)]
    if missing or unexpected or mismatched:
        parts = []
        if missing:
            parts.append(f"{len(missing)} missing keys, e.g. "
                         + ", ".join(f"{k} {tuple(want[k].shape)}" for k in missing[:4]))
        if unexpected:
            parts.append(f"{len(unexpected)} unexpected keys, e.g. "
                         + ", ".join(f"{k} {tuple(state_dict[k].shape)}" for k in unexpected[:4]))
        if mismatched:
            parts.append(
                f"{len(mismatched)} shape mismatches, e.g. "
                + ", ".join(f"{k}: stored {tuple(state_dict[k].shape)}, config expects {tuple(want[k].shape)}"
                            for k in mismatched[:4])
            )
        c = config
        raise ValueError(
            f"the weights in {source} do not fit the model config (n_layer={c.n_layer}, n_head={c.n_head}, "
            f"n_embd={c.n_embd}, vocab_size={c.vocab_size}, block_size={c.block_size}, bias={c.bias}, "
            f"qk_norm={c.qk_norm}, gated_attn={c.gated_attn}): " + "; ".join(parts)
        )
    if len(float_dtypes) == 1:
        model.to(next(iter(float_dtypes)))  # keep the stored precision (e.g. a bf16 checkpoint)
    head = state_dict.get(_TIED[0])
    if head is not None and not torch.equal(head, state_dict[_TIED[1]]):
        model.lm_head.weight = torch.nn.Parameter(torch.empty_like(model.lm_head.weight))  # stored untied: keep untied
    model.load_state_dict(state_dict, strict=False)  # strictness checked above (the tied head may be absent)
    return model.to(map_location) if map_location is not None else model


def _serialise_weights_only(obj, what: str) -> bytes:
    """torch.save ``obj`` to bytes, checking that it loads back with weights_only=True."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    data = buf.getvalue()
    try:
        torch.load(io.BytesIO(data), weights_only=True)
    except Exception as e:
        raise TypeError(
            f"{what} must hold only tensors and plain Python values (so it loads with "
            f"torch.load(weights_only=True)); convert e.g. NumPy arrays to tensors or lists ({_why(e)})"
        ) from e
    return data


def _torch_load_optional(path: Path, map_location):
    if not path.exists():
        return None
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as e:  # UnpicklingError, RuntimeError, KeyError, EOFError, ... for foreign or broken files
        raise ValueError(f"{path} could not be loaded with torch.load(weights_only=True), it is corrupt or truncated "
                         f"({_why(e)})") from e


def _why(e: Exception) -> str:
    """The informative line of a torch.load error (weights_only errors carry a page of advice)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    for ln in lines:
        if "Unsupported global" in ln or "WeightsUnpickler error" in ln:
            return ln
    return f"{type(e).__name__}: {lines[0]}" if lines else type(e).__name__


def _fsync(path: Path) -> None:
    """Flush a file or a folder to disk (folders: where the OS allows it)."""
    flags = os.O_RDONLY | (getattr(os, "O_DIRECTORY", 0) if path.is_dir() else 0)
    try:
        fd = os.open(path, flags)
    except OSError:
        if path.is_dir():
            return  # e.g. Windows cannot open folders
        raise
    try:
        os.fsync(fd)
    except OSError:
        if not path.is_dir():
            raise
    finally:
        os.close(fd)


def _replace_folder(new: Path, target: Path) -> None:
    """Put the complete folder ``new`` at ``target``, never leaving ``target`` half written or lost."""
    if not target.exists():
        os.replace(new, target)
        _fsync(target.parent)
        return
    aside = target.parent / f".{target.name}.old-{os.getpid()}"
    if aside.exists():
        shutil.rmtree(aside)
    os.replace(target, aside)
    try:
        os.replace(new, target)
    except BaseException:
        os.replace(aside, target)  # put the last good checkpoint back
        shutil.rmtree(new, ignore_errors=True)
        raise
    _fsync(target.parent)
    shutil.rmtree(aside)
