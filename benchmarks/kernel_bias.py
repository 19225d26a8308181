"""Is your attention kernel biased? The audit of :mod:`lpfa.audit` on one device.

For each input family (random; tied BF16 row maxima with one-signed V, the paper's Fig. 6 setting) and each kernel
(lpfa presets through the reference and the Triton kernels, PyTorch SDPA flash / cuDNN / efficient / math,
FlexAttention), the signed mean error against float64 of O, |O| (radial), δ = rowsum(dO∘O) and dQ along the
low-rank direction, with 95% confidence intervals over rows. Kernels that cannot run on the device are listed
with the reason.

Usage (the next GPU session commits the folder as ``results/kernel_bias/<run>/``)::

    python benchmarks/kernel_bias.py --out results/kernel_bias/<run> --device cuda [--T 1024] [--B 4 --H 8 --D 64]
        [--captured REPLAY_OUT/qkv.npz]      # the third family: a trained layer's q, k, v, dO

Writes ``audit.json`` (the rows of :func:`lpfa.audit.audit`, plus the settings) and ``provenance.json``.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

from lpfa import audit as A
from lpfa.provenance import provenance, write_json


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="folder for audit.json and provenance.json")
    ap.add_argument("--device", default="cpu", help="'cpu' or 'cuda[:N]' (default cpu)")
    ap.add_argument("--T", type=int, nargs="+", default=[256], help="sequence length(s) (default 256)")
    ap.add_argument("--B", type=int, default=4)
    ap.add_argument("--H", type=int, default=4)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--families", nargs="+", default=list(A.FAMILIES), choices=A.FAMILIES)
    ap.add_argument("--kernels", nargs="+", default=list(A.KERNELS), choices=A.KERNELS)
    ap.add_argument("--captured", nargs="*", default=[], metavar="QKV_NPZ",
                    help="qkv.npz files of lpfa.replay --save-qkv: each a family of its own, "
                         "named by its file's folder")
    a = ap.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    captured, captured_meta = {}, {}
    for path in a.captured:
        name = f"captured:{Path(path).parent.name}"
        captured[name], captured_meta[name] = A.load_captured(path)
    frames = []
    for i, T in enumerate(a.T):  # the captured families (their own shapes) once, with the first T
        df = A.audit(a.families, a.kernels, a.device, B=a.B, H=a.H, T=T, D=a.D, seed=a.seed,
                     captured=captured if i == 0 else None)
        df.insert(2, "T", [int(captured[f]["q"].shape[2]) if f in captured else T for f in df.family])
        frames.append(df)
        print(df[df.quantity == "o"][["kernel", "family", "T", "mean", "ci_low", "ci_high", "unavailable"]].to_string())
    import pandas as pd

    rows = pd.concat(frames).to_dict(orient="records")
    rows = [{k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in r.items()} for r in rows]
    config = {"device": a.device, "T": a.T, "B": a.B, "H": a.H, "D": a.D, "seed": a.seed, "families": a.families,
              "kernels": a.kernels, "tie_stride": A.TIE_STRIDE, "tie_logit": A.TIE_LOGIT, "captured": captured_meta}
    (out / "audit.json").write_text(json.dumps({"config": config, "rows": rows}, indent=1) + "\n")
    write_json(out / "provenance.json", provenance(config=config))
    print(f"wrote {out / 'audit.json'} and {out / 'provenance.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
