"""What SFA does to a model's rows, for several β (paper Sec. 4, Eq. 6): the β sweep over a run's checkpoints.

SFA replaces a tied row's max ``rm > 0`` by ``β·rm``, so every P̄ = exp(S − β·rm) < 1. The authors' code
then clamps each row sum at ``l ≥ 1e-10``: once (β − 1)·rm exceeds about 23, the row's output is divided
by 1e-10 instead of by l and so shrinks by the factor l / 1e-10 — "stable" can then mean "silenced".
For each checkpoint of a run this module measures, per layer, the fraction of rows that SFA touches,
that the clamp attenuates, that it silences (factor < 1e-3) and whose P̄ all underflow
(:func:`lpfa.mechanism.sfa_attenuation`), on a fixed validation batch with the run's BF16 scores.

    python -m lpfa.sfa_sweep --run runs/twins/sfa --out results/.../sfa_sweep_sfa.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import pandas as pd
import torch
from tqdm.auto import tqdm

from lpfa.diagnostics import capture_qkv
from lpfa.mechanism import sfa_attenuation
from lpfa.provenance import provenance, write_json
from lpfa.run import Run, autocast, resolve_device

BETAS = (1.5, 2.0, 4.0, 8.0)


@torch.no_grad()
def sweep_model(model, x: torch.Tensor, betas=BETAS, eps: float = 1e-3, autocast=None) -> list[dict]:
    """Per layer, :func:`lpfa.mechanism.sfa_attenuation` of the model's BF16 scores on token ids ``x``."""
    return [sfa_attenuation(c["q"].float(), c["k"].float(), betas, eps) for c in capture_qkv(model, x, autocast)]


def sweep_run(run_dir, betas=BETAS, n_seq: int = 8, device: str = "auto", command: str | None = None) -> dict:
    """:func:`sweep_model` at every checkpoint of ``run_dir`` (``ckpt_history/`` and ``ckpt/``)."""
    run = Run(run_dir)
    device = resolve_device(device)
    x = run.probe_batch(0, n_seq, device)
    if not run.checkpoints:
        raise FileNotFoundError(f"{run_dir} has no checkpoints (ckpt/ or ckpt_history/)")
    result = {}
    for step in tqdm(run.checkpoints, desc="SFA sweep", unit="ckpt"):
        model = run.checkpoint(step, map_location=device).model.to(device).eval()
        result[str(step)] = sweep_model(model, x, betas, autocast=autocast(device, "auto"))
    return {"run": str(run_dir), "betas": list(betas), "n_seq": n_seq, "clamp": 1e-10, "eps": 1e-3,
            "scores": "bf16", "steps": result, "provenance": provenance(command=command)}


def sweep_frame(sweep: dict | str | Path) -> pd.DataFrame:
    """Long DataFrame (step, layer, beta, sfa, attenuated, silenced, zeroed) of a sweep of :func:`sweep_run` (the dict
    or its JSON file)."""
    if not isinstance(sweep, dict):
        sweep = json.loads(Path(sweep).read_text())
    rows = [{"step": int(step), "layer": layer, "beta": float(beta), **{k: v for k, v in r.items() if k != "rows"}}
            for step, layers in sweep["steps"].items() for layer, per_beta in enumerate(layers)
            for beta, r in per_beta.items()]
    return pd.DataFrame(rows).sort_values(["step", "layer", "beta"]).reset_index(drop=True)


def main(argv: list[str] | None = None) -> int:
    """``python -m lpfa.sfa_sweep``: :func:`sweep_run` of ``--run`` written to ``--out`` (JSON, with provenance), and
    the last checkpoint's attenuated and silenced shares per layer and β printed."""
    p = argparse.ArgumentParser(prog="python -m lpfa.sfa_sweep", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--run", required=True)
    p.add_argument("--out", required=True, help="a .json file")
    p.add_argument("--betas", type=float, nargs="*", default=list(BETAS))
    p.add_argument("--n-seq", type=int, default=8)
    p.add_argument("--device", default="auto")
    a = p.parse_args(argv)
    command = " ".join(["python -m lpfa.sfa_sweep", *(sys.argv[1:] if argv is None else argv)])
    res = sweep_run(a.run, tuple(a.betas), a.n_seq, a.device, command=command)
    write_json(a.out, res)
    last = list(res["steps"])[-1]
    for layer, per_beta in enumerate(res["steps"][last]):
        print(f"step {last} layer {layer}: "
              + "  ".join(f"β={b}: att {v['attenuated']:.3f} sil {v['silenced']:.3f}" for b, v in per_beta.items()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
