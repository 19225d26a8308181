"""Where the host's time goes when it issues one attention call, layer by layer.

At GPT-2 shapes (B=16, H=12, T=1024, D=64) the op is host-bound: issuing a forward and backward takes the host
longer than the GPU takes to run them. This splits the host's time per call into the layers of the call, each timed
on its own (n calls back to back, no sync, then one sync; n = 100, 30 with a backward: the GPU's launch queue does not
fill at these n):

* ``flash_forward`` / ``flash_backward``: the launch wrappers (allocations, every launch);
* ``op/fwd``: the ``lpfa::flash_attention_fwd`` custom op (dispatch, then ``flash_forward``);
* ``attention/fwd``, ``attention/fwd_bwd``: the public call (input checks, policy, op, autograd);
* the same two for SDPA-flash, for scale;
* ``fwd.backward``: forward then ``.backward()``, as a training step calls it (gradients accumulate into ``.grad``);
* the forward+backward rows again after a ``torch.profiler`` session, then after a ``torch.compile``, in the same
  process: what either leaves behind that slows the host's later eager calls.

and writes a cProfile of ``attention/fwd_bwd`` (the 30 functions with the most time of their own).
Usage: ``python benchmarks/host_overhead.py --out DIR [--policy fa2]``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import math
import pstats
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from lpfa.attention import GPT2_SHAPE, attention, get_policy
from lpfa.provenance import provenance, write_json


def host_us(fn, n=100) -> float:
    """Host µs per call of ``fn``: n calls back to back after warm-up, no sync between them."""
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t = (time.perf_counter() - t0) / n * 1e6
    torch.cuda.synchronize()
    return t


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--policy", default="fa2")
    p.add_argument("--shape", nargs=4, type=int, default=list(GPT2_SHAPE), metavar=("B", "H", "T", "D"))
    a = p.parse_args()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from lpfa.attention.kernels import _fwd_op, policy_key
    from lpfa.attention.triton_bwd import flash_backward
    from lpfa.attention.triton_fwd import flash_forward

    B, H, T, D = a.shape
    pol, scale = get_policy(a.policy), 1 / math.sqrt(D)
    q, k, v, do = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    o, lse = flash_forward(q, k, v, pol, scale)
    key = policy_key(pol)

    def sdpa(x, y, z):
        with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(x, y, z, is_causal=True)

    def fwd_bwd(f):
        def run():
            torch.autograd.grad(f(qg, kg, vg), (qg, kg, vg), do)
        return run

    def fwd_backward(f):  # as a training step calls it: .backward() accumulates into the leaves' .grad
        def run():
            f(qg, kg, vg).backward(do)
        return run

    rows = {
        "flash_forward": lambda: flash_forward(q, k, v, pol, scale, validate=False),
        "flash_backward": lambda: flash_backward(do, q, k, v, o, lse, pol, scale, validate=False,
                                                 grad_dtype=torch.bfloat16),
        "op/fwd": lambda: _fwd_op(q, k, v, key, scale, False),
        "attention/fwd": lambda: attention(q, k, v, policy=pol, backend="triton"),
        "attention/fwd_bwd": fwd_bwd(lambda x, y, z: attention(x, y, z, policy=pol, backend="triton")),
        "attention/fwd_bwd assume_finite": fwd_bwd(lambda x, y, z: attention(x, y, z, policy=pol, backend="triton",
                                                                           assume_finite=True)),
        "attention/fwd.backward": fwd_backward(lambda x, y, z: attention(x, y, z, policy=pol, backend="triton")),
        "sdpa_flash/fwd": lambda: sdpa(q, k, v),
        "sdpa_flash/fwd_bwd": fwd_bwd(sdpa),
        "sdpa_flash/fwd.backward": fwd_backward(sdpa),
    }
    out = {}
    for name, fn in rows.items():
        out[name] = host_us(fn, n=30 if "fwd_bwd" in name or "backward" in name else 100)
        print(f"host {name:36s} {out[name]:8.1f} us", flush=True)
    # The same public calls once a torch.profiler session has run in this process (as the benchmark's overhead part
    # runs one per row), then once torch.compile has compiled a function (as its compile check does before its speed
    # part): whatever either leaves behind (CUPTI callbacks, threads, hooks) shows as host time here.
    with profile(activities=[ProfilerActivity.CUDA]):
        rows["attention/fwd_bwd"]()
        torch.cuda.synchronize()
    compiled = torch.compile(lambda x, y, z: attention(x, y, z, policy=pol, backend="triton") * 2.0, fullgraph=True)
    for phase, before in (("after torch.profiler", None),
                          ("after torch.compile", lambda: torch.autograd.grad(compiled(qg, kg, vg).float().sum(),
                                                                              (qg, kg, vg)))):
        if before is not None:
            before()
        for name in ("attention/fwd_bwd", "attention/fwd.backward", "sdpa_flash/fwd_bwd", "sdpa_flash/fwd.backward"):
            out[f"{name} {phase}"] = host_us(rows[name], n=30)
            print(f"host {name + ' ' + phase:48s} {out[name + ' ' + phase]:8.1f} us", flush=True)

    prof = cProfile.Profile()
    run = fwd_bwd(lambda x, y, z: attention(x, y, z, policy=pol, backend="triton"))
    run()
    prof.enable()
    for _ in range(50):
        run()
    prof.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(30)
    dest = Path(a.out)
    dest.mkdir(parents=True, exist_ok=True)
    (dest / "host_profile.txt").write_text(s.getvalue())
    print("\n".join(s.getvalue().splitlines()[:45]))
    write_json(dest / "host_overhead.json", {"shape": a.shape, "policy": a.policy, "host_us": out})
    write_json(dest / "provenance.json", provenance(config=vars(a)))


if __name__ == "__main__":
    main()
