"""One training run folder, read through one object: :class:`Run` (what :mod:`lpfa.train` writes).

A run folder holds ``config.json`` (the TrainConfig under ``"train"``, the model under ``"model"``, the data
folder, the device, the provenance; a resume's record under ``"resumes"``), ``metrics.jsonl`` (one JSON record a
line: training steps, evaluations, diagnostics; committed runs keep ``metrics.jsonl.gz``), ``log.txt``,
``summary.json``, ``replay.jsonl`` and the checkpoints ``ckpt/`` and ``ckpt_history/step_NNNNNN/``::

    run = Run("results/isolation/h200x4-2026-11-29/bf16")
    run.train["attn_policy"], run.steps, run.verdict()["exploded"]
    train, val, diag = run.metrics()

The module sits at the bottom of the package (only :mod:`lpfa.explosion`'s pure verdicts below it); the readers
are also plain functions of a folder (:func:`read_run_config`, :func:`read_records`, :func:`load_metrics`,
:func:`run_verdict`, :func:`checkpoints_of`), which :class:`Run` caches.
"""

from __future__ import annotations

import contextlib
import functools
import gzip
import json
import re
import warnings
from pathlib import Path

import pandas as pd
import torch

from lpfa import data as lpfa_data
from lpfa.attention.policy import BF16, is_fp32_level
from lpfa.checkpoints import load_checkpoint, read_json
from lpfa.data import drop_partial_line  # noqa: F401  (re-exported with the other readers of a run folder)
from lpfa.explosion import (
    ExplosionCriterion,
    RunawayCriterion,
    attention_label,
    explosion_step,
    logit_runaway,
    runaway_heads,
)
from lpfa.model import GPTConfig


# ------------------------------------------------------------------------------------------------------------
# the readers of a run folder
# ------------------------------------------------------------------------------------------------------------
def metrics_path(run_dir: str | Path) -> Path:
    """A run's ``metrics.jsonl``, or the ``metrics.jsonl.gz`` that long runs are committed as."""
    d = Path(run_dir)
    for name in ("metrics.jsonl", "metrics.jsonl.gz"):
        if (d / name).is_file():
            return d / name
    raise FileNotFoundError(f"{d} has no metrics.jsonl or metrics.jsonl.gz: not a training run folder")


def read_run_config(run_dir: str | Path, require: tuple[str, ...] = ("train",)) -> dict:
    """A run folder's ``config.json`` (written by :mod:`lpfa.train`), parsed; a one-line error naming the file
    when it is missing or damaged, or lacks one of the objects ``require`` names."""
    path = Path(run_dir) / "config.json"
    conf = read_json(path, ": the run folder is damaged",
                     missing=f"{path} does not exist: {run_dir} is not an lpfa.train run folder (or it lost its "
                             "config.json)")
    if not isinstance(conf, dict) or any(not isinstance(conf.get(k), dict) for k in require):
        raise ValueError(f"{path} is not an lpfa.train config: expected a JSON object"
                         + "".join(f" with a {k!r} object" for k in require))
    return conf


def check_layer(layer: int, runs, what: str = "the committed runs") -> int:
    """``layer`` when every run folder of ``runs`` (a dict of them, or an iterable) has it, by its config's
    ``n_layer``; else ValueError ``"layer=30: expected a layer in [0, 11] of the committed runs"``."""
    folders = list(runs.values()) if isinstance(runs, dict) else list(runs)
    n_layer = min(int(read_run_config(d, require=("model",))["model"]["n_layer"]) for d in folders)
    if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < n_layer:
        raise ValueError(f"layer={layer!r}: expected a layer in [0, {n_layer - 1}] of {what}")
    return layer


def read_records(run_dir: str | Path) -> list[dict]:
    """Every record of a run's metrics file (plain or gzip-compressed), in order. Needs only the standard library. A
    file is parsed once while it is unchanged (the tables read the same 30k-step runs many times); the records are
    shared, so treat them as read-only. A last line cut short (a run killed while writing it, or a run still writing) is
    skipped with a warning, so a killed run keeps its logs; any other line that is not a JSON record is an error naming
    its line number."""
    path = metrics_path(run_dir)
    st = path.stat()
    return list(_parse_records(str(path.resolve()), st.st_mtime_ns, st.st_size))


# Room for every metrics file of the committed store (under a hundred, 0.6 GB parsed): the scorecard alone reads 60,
# and a cache smaller than one such pass keeps none of them for the next one (least recently used goes first).
@functools.lru_cache(maxsize=128)
def _parse_records(path: str, mtime_ns: int, size: int) -> tuple[dict, ...]:
    raw = Path(path).read_bytes()
    try:
        text = (gzip.decompress(raw) if path.endswith(".gz") else raw).decode()
    except (OSError, EOFError, UnicodeDecodeError) as e:  # a truncated or corrupt gzip file, or not text
        raise ValueError(f"{path} cannot be read ({type(e).__name__}: {e}): the file is damaged") from e
    lines = text.splitlines()
    last = max((i for i, line in enumerate(lines) if line.strip()), default=-1)
    records = []
    for i, line in enumerate(lines):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
        except json.JSONDecodeError as e:
            if i == last:
                warnings.warn(f"{path}: skipped line {i + 1}, which is cut short (the run was killed while writing "
                              "it?)", stacklevel=2)
                continue
            raise ValueError(f"{path}: line {i + 1} is not valid JSON ({e.msg}): {line[:60]!r}") from e
        if not isinstance(rec, dict) or "step" not in rec:
            raise ValueError(f"{path}: line {i + 1} is not a metrics record (a JSON object with a 'step'): "
                             f"{line[:60]!r}")
        records.append(rec)
    return tuple(records)


def load_metrics(run_dir: str | Path):
    """``(train, val, diag)``: DataFrames of the per-step records and the evaluations, and a DataFrame with
    one row per diagnostics record (columns step, wq_spectral_norm, tie_fraction, max_logit as lists)."""
    recs = read_records(run_dir)
    if not any("loss" in r for r in recs):
        raise ValueError(f"{metrics_path(run_dir)} has no training records (the run ended before its first step)")
    train = pd.DataFrame([r for r in recs if "loss" in r]).drop_duplicates("step", keep="last").set_index("step")
    val = pd.DataFrame([r for r in recs if "val_loss" in r]).drop_duplicates("step", keep="last")
    return train, (val.set_index("step") if len(val) else val), _diag_frame(recs)


def _diag_frame(recs) -> pd.DataFrame:
    return pd.DataFrame([{"step": r["step"], **r["diag"]} for r in recs if "diag" in r])


def diag_frame(run_dir: str | Path) -> pd.DataFrame:
    """The diagnostics of :func:`load_metrics` alone (one row per diagnostics record), without building the frames of
    every step's record: what the per-head readers need."""
    return _diag_frame(read_records(run_dir))


def _logged_max_logits(run_dir) -> tuple[list[int], list]:
    """The steps of a run folder's diagnostics records that logged ``max_logit``, and those logits (per layer, or per
    layer and head), in record order."""
    recs = [(int(r["step"]), r["diag"]["max_logit"]) for r in read_records(run_dir)
            if "diag" in r and "max_logit" in r["diag"]]
    return [s for s, _ in recs], [m for _, m in recs]


def runaway_onset(run_dir, criterion: RunawayCriterion = RunawayCriterion()) -> tuple[int, int] | None:
    """``(step, layer)`` of the first diagnostics record where a layer's largest logit exceeded ``criterion.logit``,
    sustained or not: where a run that stopped too early for the runaway verdict was heading. None if never."""
    steps, logits = _logged_max_logits(run_dir)
    if not steps:
        return None
    return logit_runaway(logits, steps, RunawayCriterion(criterion.logit, patience=1))


def heads_running_away(run_dir, layer: int, criterion: RunawayCriterion = RunawayCriterion()) -> dict[int, int]:
    """:func:`lpfa.explosion.runaway_heads` of a run folder's logged per-head largest logits: ``{head: step}`` of
    ``layer``'s heads that ran away; empty if none did (or nothing per head was logged)."""
    steps, logits = _logged_max_logits(run_dir)
    if not steps or any(not isinstance(m[0], list) for m in logits):
        return {}
    return runaway_heads(logits, steps, layer, criterion)


def run_verdict(run_dir, criterion: ExplosionCriterion = ExplosionCriterion(),
                runaway: RunawayCriterion = RunawayCriterion()) -> dict:
    """``summary.json``-style verdict of a training run folder: policy, seed, steps, exploded, explosion_step,
    and the logit runaway (``runaway_step``, ``runaway_layer``; None without one or without diagnostics)."""
    recs, diag = {}, {}
    for r in read_records(run_dir):
        if "loss" in r:
            recs[int(r["step"])] = float(r["loss"])  # a resumed run may repeat steps: the last record wins
        if "diag" in r and "max_logit" in r["diag"]:
            diag[int(r["step"])] = r["diag"]["max_logit"]
    conf = read_run_config(run_dir)["train"]
    steps = sorted(recs)
    step = explosion_step([recs[s] for s in steps], criterion, steps=steps)
    d_steps = sorted(diag)
    ra = logit_runaway([diag[s] for s in d_steps], d_steps, runaway) if d_steps else None
    return {"policy": attention_label(conf), "attn_backend": conf.get("attn_backend", "lpfa"),
            "layer_policies": conf.get("layer_policies", {}), "optimizer": conf["optimizer"],
            "seed": conf["seed"], "init_seed": conf["init_seed"], "steps": (steps[-1] + 1) if steps else 0,
            "exploded": step is not None, "explosion_step": step, "criterion": criterion.to_dict(),
            "runaway_step": ra[0] if ra else None, "runaway_layer": ra[1] if ra else None,
            "runaway_criterion": runaway.to_dict() if d_steps else None}


def checkpoints_of(run_dir) -> dict[int, Path]:
    """{step: folder} of a run's checkpoints: ``ckpt_history/step_N`` and the latest ``ckpt``."""
    run_dir = Path(run_dir)
    out = {}
    for d in sorted((run_dir / "ckpt_history").glob("step_*")):
        if re.fullmatch(r"step_\d+", d.name):
            out[int(d.name.split("_")[1])] = d
    path = run_dir / "ckpt" / "config.json"
    if path.exists():
        try:
            step = json.loads(path.read_text())["step"]
        except (ValueError, KeyError, TypeError) as e:  # JSONDecodeError, UnicodeDecodeError, no "step"
            raise ValueError(f"{path} is damaged: expected a checkpoint's config.json with its 'step' "
                             f"({type(e).__name__}: {e})") from e
        out.setdefault(int(step), run_dir / "ckpt")
    return dict(sorted(out.items()))


# ------------------------------------------------------------------------------------------------------------
# the device a run (or a replay of it) computes on
# ------------------------------------------------------------------------------------------------------------
def resolve_device(name: str = "auto") -> str:
    """``auto`` → ``cuda`` when a GPU is visible, else ``cpu``; on CUDA, TF32 is switched off (FP32 means FP32, the
    paper's FP32 twin). Other names are returned as they are."""
    device = ("cuda" if torch.cuda.is_available() else "cpu") if name == "auto" else name
    if device.startswith("cuda"):
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    return device


def autocast_dtype(dtype: str, device: str) -> str:
    """A TrainConfig ``dtype`` resolved for ``device``: ``auto`` is ``bfloat16`` on CUDA and ``float32`` elsewhere."""
    return dtype if dtype != "auto" else ("bfloat16" if device.startswith("cuda") else "float32")


def autocast(device: str, dtype: str):
    """The autocast context of a run: BF16 autocast for ``bfloat16`` (the paper's mixed precision), none otherwise
    (``float32``; ``float64`` runs hold float64 weights)."""
    if autocast_dtype(dtype, device) == "bfloat16":
        return torch.autocast(device_type=device.split(":")[0], dtype=torch.bfloat16)
    return contextlib.nullcontext()


# ------------------------------------------------------------------------------------------------------------
# the run
# ------------------------------------------------------------------------------------------------------------
class Run:
    """A training run folder. Its files are read when first asked for and kept (``config``); ``records`` and
    ``metrics()`` follow the metrics file while it changes (a run still training)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"Run({str(self.path)!r})"

    @property
    def label(self) -> str:
        """The folder's name (the experiment table's label of the run)."""
        return self.path.name

    @functools.cached_property
    def config(self) -> dict:
        """``config.json``, parsed (:func:`read_run_config`)."""
        return read_run_config(self.path)

    @property
    def train(self) -> dict:
        """The run's TrainConfig fields as recorded at its first start."""
        return self.config["train"]

    def model_config(self):
        """The :class:`lpfa.model.GPTConfig` the run trained."""
        if not isinstance(self.config.get("model"), dict):
            raise ValueError(f"{self.path / 'config.json'} has no 'model' object: expected the config.json lpfa.train "
                             "writes")
        return GPTConfig.from_dict(self.config["model"])

    @property
    def data_dir(self) -> Path:
        """The token folder the run trained on."""
        if "data_dir" not in self.config:
            raise ValueError(f"{self.path / 'config.json'} has no data_dir: expected the config.json lpfa.train writes")
        return Path(self.config["data_dir"])

    @property
    def records(self) -> list[dict]:
        """Every metrics record, in order (:func:`read_records`)."""
        return read_records(self.path)

    def metrics(self):
        """``(train, val, diag)`` DataFrames (:func:`load_metrics`)."""
        return load_metrics(self.path)

    @property
    def steps(self) -> int:
        """Training steps completed (the last step logged, plus one)."""
        return max((int(r["step"]) + 1 for r in self.records if "loss" in r), default=0)

    @property
    def summary(self) -> dict | None:
        """``summary.json`` (written when the run ended), or None for a run that is still going or was killed."""
        path = self.path / "summary.json"
        return read_json(path, ": the run folder is damaged") if path.is_file() else None

    @property
    def warnings(self) -> list[dict]:
        """The early warnings ``lpfa.train``'s ``on_warning`` logged (:class:`lpfa.monitor.Alarm` events with the
        ``action`` taken: ``"logged"``, ``"stop"`` or ``"layer L switched to NAME"``), in step order."""
        return [r["warning"] for r in self.records if "warning" in r]

    def verdict(self, criterion: ExplosionCriterion = ExplosionCriterion(),
                runaway: RunawayCriterion = RunawayCriterion()) -> dict:
        """:func:`run_verdict` of the run."""
        return run_verdict(self.path, criterion, runaway)

    @property
    def checkpoints(self) -> dict[int, Path]:
        """``{step: folder}`` of the kept checkpoints (:func:`checkpoints_of`)."""
        return checkpoints_of(self.path)

    def _by_step(self, prefix: str, name: str, damaged: str) -> dict[int, dict]:
        """``{step: contents}`` of the JSON files ``<prefix>NNNNNN/<name>`` in the run folder, then in its ``rerun_*/``
        subfolders (a step the run folder has wins), each with ``"source"``: its folder, relative to the run's."""
        out = {}
        found = sorted(self.path.glob(f"{prefix}*/{name}"))
        for f in found + sorted(self.path.glob(f"rerun_*/{prefix}*/{name}")):
            step = int(f.parent.name.removeprefix(prefix))
            out.setdefault(step, {**read_json(f, damaged), "source": str(f.parent.relative_to(self.path))})
        return dict(sorted(out.items()))

    @property
    def doctor_reports(self) -> dict[int, dict]:
        """``{step: report}``: the ``lpfa doctor`` reports on the run's checkpoints, ``doctor_step_NNNNNN/report.json``
        (what scripts/gpu/paper_recipe.sh's ``DOCTOR_STEP`` brings back, since a checkpoint cannot leave the GPU
        machine), also those in a ``rerun_*/`` subfolder: the same run again to a step it did not reach with a
        checkpoint (e.g. it exploded first). Each report gets ``"source"``, the folder it came from, relative to the
        run's."""
        return self._by_step("doctor_step_", "report.json", ": expected the report.json lpfa doctor writes")

    @property
    def replays(self) -> dict[int, dict]:
        """``{step: replay}``: the instrumented replays of the run's training from its checkpoints,
        ``replay_step_NNNNNN/replay.json`` (``python -m lpfa.replay``'s numbers, what scripts/gpu/paper_recipe.sh's
        ``REPLAY_STEPS`` brings back beside the doctor's report), also those in a ``rerun_*/`` subfolder, as
        :attr:`doctor_reports`. Each gets ``"source"``, the folder it came from, relative to the run's."""
        return self._by_step("replay_step_", "replay.json", ": expected the replay.json python -m lpfa.replay writes")

    def checkpoint_before_explosion(self, limit: int) -> int | None:
        """The step of the last kept checkpoint at or before ``limit`` and before the loss exploded (the run's verdict),
        or None: what ``lpfa doctor`` examines for the links that need a checkpoint (scripts/gpu/paper_recipe.sh's
        DOCTOR_STEP), so that a run that exploded early still brings back a state from before it."""
        boom = self.verdict()["explosion_step"]
        ok = [s for s in self.checkpoints if s <= limit and (boom is None or s < boom)]
        return max(ok) if ok else None

    def checkpoint(self, step: int | None = None, map_location="cpu"):
        """The checkpoint of ``step`` (default: the latest), loaded (:func:`lpfa.checkpoints.load_checkpoint`)."""
        cks = self.checkpoints
        if not cks:
            raise FileNotFoundError(f"{self.path} has no checkpoints (ckpt/ or ckpt_history/)")
        step = max(cks) if step is None else step
        if step not in cks:
            raise ValueError(f"{self.path} has no checkpoint at step {step}; it has steps {sorted(cks)}")
        return load_checkpoint(cks[step], map_location=map_location)

    def probe_batch(self, step: int = 0, n: int | None = None, device: str = "cpu"):
        """The diagnostics batch lpfa.train measures at ``step`` (validation tokens, seed + 2), ``n`` sequences
        (default: the run's ``diag_batch``)."""
        t = self.train
        tokens, _ = lpfa_data.load_tokens(self.data_dir, "val")
        starts = lpfa_data.batch_starts(t["seed"] + 2, step, 0, n or t.get("diag_batch", 4), len(tokens),
                                        t["block_size"])
        return lpfa_data.get_batch(tokens, starts, t["block_size"], device)[0]

    def autocast(self, device: str):
        """The run's autocast context on ``device`` (its recorded ``dtype``)."""
        return autocast(device, self.train.get("dtype", "auto"))


def attention_precision(backend: str, pol) -> str:
    """One layer's attention precision: "fp32" where its scores are FP32 and nothing is rounded to BF16 (``sdpa_fp32``,
    or the lpfa backend with an FP32-level policy: fp32, fp32_split), "bf16" where its scores are BF16, "mixed"
    otherwise (FP32 scores with later BF16 roundings: fa2, SDPA under BF16 autocast). ``pol``: the layer's
    :class:`~lpfa.attention.policy.PrecisionPolicy`, None for a backend other than lpfa. A soft-cap is part of the
    model, not of the precision: a soft-capped policy has the label of the same policy without the cap."""
    if backend == "sdpa_fp32" or (pol is not None and is_fp32_level(pol.with_(softcap=None))):
        return "fp32"
    if pol is not None and pol.scores == BF16:
        return "bf16"
    return "mixed"


def layer_precision(run) -> list[str]:
    """Per layer of a :class:`~lpfa.run.Run` (or of a :class:`lpfa.model.GPTConfig`): its
    :func:`attention_precision`, "fp32", "bf16" or "mixed"."""
    m = run.model_config() if isinstance(run, Run) else run
    return [attention_precision(m.layer_backend(i), m.policy(i)) for i in range(m.n_layer)]
