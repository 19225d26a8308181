"""The results store: small artifacts of real runs under ``results/<experiment>/<run>/``.

Each run folder holds JSON and text files plus a ``provenance.json`` (see :mod:`lpfa.provenance`).
Notebooks read them through :func:`load`, so a figure always names the run it plots.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from lpfa.paths import results_dir


def run_date(run: Path) -> str:
    """When a run was made: ``date_utc`` of its ``provenance.json`` (ISO 8601, so it sorts), "" without one."""
    try:
        return str(json.loads((Path(run) / "provenance.json").read_text()).get("date_utc") or "")
    except (FileNotFoundError, json.JSONDecodeError):
        return ""


def experiments(root: str | Path | None = None) -> list[str]:
    """The committed experiments: the folders of the results store (``results/<experiment>/``), sorted."""
    base = Path(root) if root else results_dir()
    return sorted(p.name for p in base.iterdir() if p.is_dir()) if base.is_dir() else []


def runs(experiment: str, root: str | Path | None = None) -> list[Path]:
    """Run folders of ``experiment``, oldest first: by the date in their provenance, then by name (names start
    with the device and the date, so a 2-GPU run of the same day would sort before a 4-GPU one by name alone).
    An experiment that is not in the store is a one-line FileNotFoundError naming the ones that are."""
    base = Path(root) if root else results_dir()
    folder = base / experiment
    if not folder.is_dir():
        known = experiments(base)
        raise FileNotFoundError(f"experiment={experiment!r}: expected one of {', '.join(map(repr, known))} (the "
                                f"committed experiments under {base})" if known else
                                f"experiment={experiment!r}: expected a committed experiment, but {base} holds none")
    return sorted((p for p in folder.iterdir() if p.is_dir()), key=lambda p: (run_date(p), p.name))


def run_dir(experiment: str, run: str | None = None, root: str | Path | None = None) -> Path:
    """The folder of ``run`` (default: the latest, :func:`runs`)."""
    all_runs = runs(experiment, root)
    if not all_runs:
        raise FileNotFoundError(f"experiment {experiment!r} has no runs yet")
    if run is None:
        return all_runs[-1]
    for r in all_runs:
        if r.name == run:
            return r
    raise FileNotFoundError(f"experiment {experiment!r} has no run {run!r}; runs: {[r.name for r in all_runs]}")


def load(experiment: str, name: str, run: str | None = None, root: str | Path | None = None):
    """A JSON file of a run, parsed; other files as text. Raises if the run has no provenance. ``run`` None: the
    latest run that holds ``name`` (:func:`file_run`; a run may measure only some parts, e.g. no memory.json)."""
    d = run_dir(experiment, run, root) if run is not None else file_run(experiment, name, root)
    if not (d / "provenance.json").is_file():
        raise FileNotFoundError(f"{d} has no provenance.json: results without provenance are not used")
    path = d / name
    if not path.is_file():
        raise FileNotFoundError(f"{path} does not exist; the run has {sorted(p.name for p in d.iterdir())}")
    return json.loads(path.read_text()) if path.suffix == ".json" else path.read_text()


def file_run(experiment: str, name: str, root: str | Path | None = None) -> Path:
    """The latest run folder of ``experiment`` (:func:`runs`) that holds the file ``name``; the latest run if none does
    (so that :func:`load` names what it has)."""
    all_runs = runs(experiment, root)
    if not all_runs:
        raise FileNotFoundError(f"experiment {experiment!r} has no runs yet")
    return next((r for r in reversed(all_runs) if (r / name).is_file()), all_runs[-1])


def experiment_rows(experiment: str, labels=None, root: str | Path | None = None) -> dict[str, Path]:
    """``{label: run folder}`` for an experiment whose rows were run over several sessions (the isolation
    table): each label from the latest run (:func:`runs`) that has it, in the order of ``labels`` (default:
    every label found, sorted). Empty if the experiment has no results."""
    try:
        all_runs = runs(experiment, root)
    except FileNotFoundError:
        return {}
    found: dict[str, Path] = {}
    for r in all_runs:  # later runs overwrite earlier ones
        for d in sorted(p for p in r.iterdir() if (p / "config.json").is_file()):
            found[d.name] = d
    order = sorted(found) if labels is None else [label for label in labels if label in found]
    return {label: found[label] for label in order}


# a leading label of the project's tracker in a provenance's "what": "issue NN, section N: ", "issues N/N: "
_TRACKER_LABEL = re.compile(r"^issues? \d+(?:/\d+)?(?: §\d+)?(?:, sections? \d+(?: and 'page \d+')?|, 'page \d+')?"
                            r"(?: and issue \d+ §\d+)?(?::\s+|,\s+|\s+)")


def what(prov: dict) -> str:
    """A run's ``provenance.json`` "what", as a page shows it: without the label of the project's issue tracker that
    the older runs' records begin with, and without the sentences about the GPU sessions that made them (a lost
    first attempt, the device time left), which name no science. The record itself is left as it was written."""
    text = _TRACKER_LABEL.sub("", str(prov.get("what", "")), count=1)
    sentences = re.split(r"(?<=[.)])\s+(?=[A-Z])", text)  # a new sentence: a capital after a full stop
    return " ".join(x for x in sentences if not re.search(r"\bsession(?:'s)?\b", x))
