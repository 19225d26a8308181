"""What SFA costs in the forward kernel: SFA presets against their base presets, and the tie test from the row-max
pass (the default) against the counting pass it replaced (``flash_forward(..., sfa_count_pass=True)``), in one run.

The goal is SFA within 5% of its base preset. SFA works in the forward only (the backward recomputes P from
the stored lse, which already holds SFA's m), so the forward kernel alone is timed, by ``triton.testing.do_bench``
medians with the L2 flushed between calls. Each variant is timed twice, interleaved, so that the spread between the
two timings of one variant says how much of a difference is noise (METHOD: "time the same version twice").

Usage (on a GPU)::

    python benchmarks/sfa_overhead.py --out results/sfa_overhead/<run>      # writes sfa_overhead.json, provenance.json

Prints one row per (shape, variant): ms (both timings), TFLOP/s and the time over the base preset's.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from attention import interleaved_ms, spread  # benchmarks/attention.py (its folder is on sys.path as a script)

from lpfa.provenance import provenance, write_json

SHAPES = [(16, 12, 1024, 64), (4, 12, 4096, 64), (16, 12, 1024, 128)]  # GPT-2 S; a 4k context; GPT-2's D = 128 sizes
# (label, preset, sfa_count_pass): each SFA preset with both tie tests, after its base
VARIANTS = [("paper", "paper", False), ("paper_sfa", "paper_sfa", False), ("paper_sfa count pass", "paper_sfa", True),
            ("fa2", "fa2", False), ("fa2_sfa", "fa2_sfa", False), ("fa2_sfa count pass", "fa2_sfa", True)]


def fwd_flops(B, H, T, D):
    """Causal forward FLOPs, FlashAttention's convention: two GEMMs, halved by the mask."""
    return 4 * B * H * T * T * D / 2


def main(argv=None) -> int:
    from lpfa.attention.policy import get_policy
    from lpfa.attention.triton_common import default_launch, policy_tiles
    from lpfa.attention.triton_fwd import flash_forward

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--rep-ms", type=int, default=300, help="do_bench's measuring time per timing (ms)")
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("sfa_overhead: this benchmark needs a CUDA GPU")
    out = Path(a.out)
    write_json(out / "provenance.json", provenance(config={"shapes": SHAPES, "variants": VARIANTS, "rep_ms": a.rep_ms}))
    rows = []
    t0 = time.time()
    for B, H, T, D in SHAPES:
        g = torch.Generator(device="cuda").manual_seed(0)
        q, k, v = (torch.randn(B, H, T, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
        scale = D ** -0.5
        # q, k, v bound like pol and cp, so that the del below frees them once fns and fn are gone too
        fns = {label: (lambda pol=pol, cp=cp, q=q, k=k, v=v: flash_forward(q, k, v, pol, scale, sfa_count_pass=cp))
               for label, pol, cp in VARIANTS}
        for label, fn in fns.items():  # compile and check that both tie tests give the same bits here too
            fn()
        for base in ("paper_sfa", "fa2_sfa"):
            o1, l1 = fns[base]()
            o2, l2 = fns[f"{base} count pass"]()
            assert torch.equal(o1, o2) and torch.equal(l1, l2), \
                f"{base}: top-2 and counting pass differ at {(B, H, T, D)}"
        ms = interleaved_ms(fns, rounds=2, rep_ms=a.rep_ms)  # two interleaved timings of each variant
        for label, pol, cp in VARIANTS:
            base = pol.removesuffix("_sfa")
            t, tb = min(ms[label]), min(ms[base])
            policy = get_policy(pol)
            launch = default_launch("forward", policy, D)  # the tiles flash_forward ran with
            _, tile, tiles = policy_tiles(policy.block_k, T, launch.block_n)
            rows.append({"B": B, "H": H, "T": T, "D": D, "variant": label, "preset": pol, "sfa_count_pass": cp,
                         "ms": ms[label], "tflops": fwd_flops(B, H, T, D) / t / 1e9,
                         "over_base": None if label == base else t / tb - 1,
                         "spread": spread(ms[label]),
                         "block_m": launch.block_m, "key_tile": tile, "tiles_per_block": tiles})
            r = rows[-1]
            over = "" if r["over_base"] is None else f"{r['over_base']:+7.1%}"
            print(f"{B:3d} {H:3d} {T:5d} {D:4d} {label:22s} {ms[label][0]:7.3f} {ms[label][1]:7.3f} ms "
                  f"{r['tflops']:6.1f} TFLOP/s {over:>8s}  (spread {r['spread']:.1%})", flush=True)
        write_json(out / "sfa_overhead.json", {"rows": rows, "complete": False})
        del fns, fn, q, k, v
        torch.cuda.empty_cache()
    write_json(out / "sfa_overhead.json", {"rows": rows, "complete": True})
    print(f"done in {time.time() - t0:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
