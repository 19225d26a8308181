"""Provenance of a result: what ran, where, from which code, when. Every file under ``results/`` has one."""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import subprocess
import sys
from pathlib import Path

import torch


def git_commit() -> str | None:
    """``$LPFA_GIT_COMMIT`` (set when the code travels without .git, e.g. to a GPU machine) or ``git rev-parse``."""
    if os.environ.get("LPFA_GIT_COMMIT"):
        return os.environ["LPFA_GIT_COMMIT"]
    try:
        here = Path(__file__).parent
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True, cwd=here)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True,
                               cwd=here)
        return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.CalledProcessError):
        return None


def device_info() -> dict:
    """Python, torch, triton (None when absent) and platform versions, and the GPU's name, count, CUDA version and
    capability (``device``: ``"cpu"`` without one)."""
    info = {"python": sys.version.split()[0], "torch": torch.__version__, "platform": platform.platform()}
    try:  # triton is optional: its version, or None
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        info["device"] = torch.cuda.get_device_name(0)
        info["device_count"] = torch.cuda.device_count()
        info["cuda"] = torch.version.cuda
        info["driver_capability"] = ".".join(map(str, torch.cuda.get_device_capability(0)))
    else:
        info["device"] = "cpu"
    return info


def provenance(command: str | None = None, config: dict | None = None) -> dict:
    """A JSON-ready record: exact command, config, git commit, device and software, UTC date."""
    return {
        "command": command if command is not None else " ".join([os.path.basename(sys.executable), *sys.argv]),
        "config": config or {},
        "git_commit": git_commit(),
        "date_utc": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        **device_info(),
    }


def write_json(path: str | Path, obj) -> Path:
    """Write ``obj`` as indented JSON atomically (temp file + rename)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str) + "\n")
    tmp.replace(path)
    return path
