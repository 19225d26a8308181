"""Compile the attention kernels ahead of time for an NVIDIA GPU, on a machine without one.

Usage (from the repository root; no CUDA device needed, TRITON_INTERPRET must be unset)::

    PYTHONPATH=src python benchmarks/compile_check.py                      # the default presets, D 64 and 128
    PYTHONPATH=src python benchmarks/compile_check.py --presets fp32_split --d 64 --dtype fp32
    PYTHONPATH=src python benchmarks/compile_check.py --no-cubin --jobs 2  # stop at PTX
    PYTHONPATH=src python benchmarks/compile_check.py --presets fp32 --d 128 --num-stages 2  # launch tuning

How it works: ``JITFunction.run`` is replaced by a recorder, and the real launch wrappers
(:func:`lpfa.attention.triton_fwd.flash_forward`, :func:`lpfa.attention.triton_bwd.flash_backward`, and through
it ``_delta`` and the δ forward of ``o_fp32``/``o_exact``) are called with small-enough CPU tensors of the
requested shape, with ``dot_bf16`` and ``precise_math`` left at their GPU defaults (the interpreter is off, so
the wrappers take their GPU branches: native dtypes, tensor-core flags, ``enable_fp_fusion=False``). Each recorded
launch then goes through the same steps as ``JITFunction.run`` on a device (the binder of
``create_function_from_signature``, ``_pack_args``: signature, constexprs, divisibility attributes, options) with
the CUDA backend of ``GPUTarget("cuda", ARCH, 32)`` (default sm_90, an H100/H200), and ``triton.compile`` lowers it
to PTX and, with ptxas (Triton's bundled one), to a cubin. Identical launches are compiled once. Nothing runs on
a GPU: this checks typing and lowering, not numerics.

Prints one row per (kernel, preset, dtype, D): ``ok`` (with the stages reached, registers and shared memory from
the cubin's metadata) or the compiler's error; a kernel whose shared memory exceeds the arch's per-block limit
(227 KiB on sm_90) is marked ``FAIL at launch``: Triton raises OutOfResources there before launching it.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import multiprocessing as mp
import os
import re
import sys
import time
import traceback

MAX_SHARED = {90: 232448, 80: 166912, 89: 101376, 86: 101376}  # opt-in shared memory per block (bytes), by arch
DEFAULT_PRESETS = ["fa2", "paper", "paper_sfa", "fa2_sfa", "fp32", "fp32_split", "delta_dp", "pv_fp32", "o_fp32",
                   "paper_untiled"]

_RECORDED: list = []  # (JITFunction, args, kwargs) of each launch the wrappers made
_JOBS: list = []  # unique compile jobs: (kernel, args, kwargs)


def _record(self, *args, grid, warmup, **kwargs):
    _RECORDED.append((self, args, dict(kwargs)))
    return None


def capture(preset: str, dtype, B: int, H: int, T: int, D: int, launch: dict | None = None,
            backward: dict | None = None, passes: str = "both"):
    """The launches (kernel, args, kwargs) of one forward and one backward of ``preset`` on (B, H, T, D) inputs
    (``passes``: "forward" or "backward" keeps that pass's alone); ``launch``: extra keyword arguments for both wrappers
    (num_stages, num_warps), ``backward`` for the backward's alone (dq_mode)."""
    import torch
    from triton.runtime.jit import JITFunction

    from lpfa.attention.triton_bwd import flash_backward
    from lpfa.attention.triton_fwd import flash_forward

    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(B, H, T, D, generator=g).to(dtype) for _ in range(4))
    scale = D**-0.5
    real_run = JITFunction.run
    JITFunction.run = _record
    try:
        _RECORDED.clear()
        o, _ = flash_forward(q, k, v, preset, scale, **(launch or {}))
        n_forward = len(_RECORDED)
        if passes == "forward":
            return list(_RECORDED)
        lse = torch.zeros(B, H, T, dtype=torch.float32)
        flash_backward(do.to(dtype), q, k, v, o, lse, preset, scale, **(launch or {}), **(backward or {}))
        return list(_RECORDED[n_forward:] if passes == "backward" else _RECORDED)
    finally:
        JITFunction.run = real_run


def _spec(kernel, args, kwargs, backend):
    """As JITFunction.run on a device: (signature, constexprs, attrs, options)."""
    from triton import knobs
    from triton.runtime.jit import create_function_from_signature

    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    kwargs["instrumentation_mode"] = knobs.compilation.instrumentation_mode
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    return kernel._pack_args(backend, kwargs, bound_args, specialization, options)


def _key(kernel, spec):
    options, signature, constexprs, attrs = spec
    return (kernel.fn.__module__, kernel.fn.__name__, repr(sorted(signature.items())),
            repr(sorted((k, repr(v)) for k, v in constexprs.items())), repr(sorted(attrs.items())), repr(options))


def _compile(i: int, arch: int, cubin: bool, dump: str | None) -> dict:
    """Compile unique job i (in a forked worker)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    kernel, args, kwargs = _JOBS[i]
    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    t0 = time.time()
    try:
        options, signature, constexprs, attrs = _spec(kernel, args, kwargs, backend)
        src = ASTSource(kernel, signature, constexprs, attrs)
        opts = dict(options.__dict__)
        if cubin:
            ck = triton.compile(src, target=target, options=opts)
            asm = ck.asm
            shared = getattr(ck.metadata, "shared", None)
        else:
            asm, shared = _compile_ptx(src, target, opts), None
        res = {"ok": True, "secs": time.time() - t0, "shared": shared,
               "stages": [s for s in ("ttir", "ttgir", "llir", "ptx", "cubin") if s in asm]}
        if "cubin" in asm:
            res["regs"] = _regs_from_cubin(asm["cubin"])
            res["sass"] = _sass_counts(asm["cubin"])
        for ext in ("ttgir", "ptx") if dump else ():  # the pipelined IR (async copies, wgmma) and the PTX
            if ext in asm:
                with open(os.path.join(dump, f"{kernel.fn.__name__}_{i}.{ext}"), "w") as f:
                    f.write(asm[ext])
        return res
    except Exception as e:  # the compiler's error, whole
        msg = "".join(traceback.format_exception_only(type(e), e)).strip()
        return {"ok": False, "secs": time.time() - t0, "error": msg, "trace": traceback.format_exc()}


def _compile_ptx(src, target, opts):
    """triton.compile's stages up to PTX (no ptxas): the backend's stages, minus make_cubin."""
    from triton._C.libtriton import ir
    from triton.compiler import make_backend

    backend = make_backend(target)
    options = backend.parse_options(opts)
    stages = {}
    backend.add_stages(stages, options, src.language)
    context = ir.context()
    ir.load_dialects(context)
    backend.load_dialects(context)
    codegen_fns = backend.get_codegen_implementation(options)
    module_map = backend.get_module_map()
    metadata = {}
    module = src.make_ir(target, options, codegen_fns, module_map, context)
    asm = {}
    for ext, fn in stages.items():
        if ext == "cubin":
            break
        module = fn(module, metadata)
        asm[ext] = module if isinstance(module, (str, bytes)) else str(module)
    return asm


def _cuobjdump(cubin: bytes, flag: str) -> str | None:
    """``cuobjdump FLAG`` of a cubin (Triton's bundled cuobjdump): its output, or None without the tool or on
    failure."""
    import subprocess
    import tempfile

    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    if not os.path.exists(tool):
        return None
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        try:
            return subprocess.run([tool, flag, f.name], capture_output=True, text=True, timeout=120).stdout
        except Exception:
            return None


def _regs_from_cubin(cubin: bytes):
    """Registers per thread (and stack bytes, when any) from ``cuobjdump -res-usage``, or None."""
    out = _cuobjdump(cubin, "-res-usage")
    m = re.search(r"REG:(\d+)", out or "")
    if not m:
        return None
    st = re.search(r"STACK:(\d+)", out)
    return f"{m.group(1)}" + (f", stack {st.group(1)}" if st and int(st.group(1)) else "")


SASS_OPS = {"HGMMA": "tensor-core GEMMs (wgmma)", "HMMA": "older mma.sync GEMMs", "LDL": "local loads (spills)",
            "STL": "local stores (spills)", "MUFU.EX2": "hardware exp2", "FFMA": "FP32 fused multiply-adds",
            "FMUL": "FP32 multiplies", "FADD": "FP32 adds"}


def _sass_counts(cubin: bytes) -> dict | None:
    """How often each opcode of :data:`SASS_OPS` appears in the cubin's SASS (``cuobjdump -sass``), and the number of
    all its instructions (``instructions``), or None. Static
    counts, not executed ones: a spill (LDL/STL) in the inner loop is what costs."""
    sass = _cuobjdump(cubin, "-sass")
    if sass is None:
        return None
    ops = re.findall(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)", sass)
    counts = {op: sum(1 for o in ops if o == op or o.startswith(op + ".")) for op in SASS_OPS}
    counts["instructions"] = len(ops)
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--presets", nargs="+", default=DEFAULT_PRESETS)
    ap.add_argument("--d", nargs="+", type=int, default=[64, 128], help="head dims")
    ap.add_argument("--dtype", nargs="+", default=["bf16"], choices=["bf16", "fp32"], help="input dtypes")
    ap.add_argument("--shape", nargs=3, type=int, default=[2, 12, 1024], metavar=("B", "H", "T"))
    ap.add_argument("--arch", type=int, default=90, help="CUDA compute capability (90: H100/H200)")
    ap.add_argument("--num-stages", type=int, help="passed to both wrappers (default: theirs)")
    ap.add_argument("--num-warps", type=int, help="passed to both wrappers (default: theirs)")
    ap.add_argument("--block-m", type=int, help="query compute tile, passed to both wrappers (default: theirs)")
    ap.add_argument("--block-n", type=int, help="key compute tile, passed to both wrappers (default: theirs)")
    ap.add_argument("--dq-mode", choices=["kernel", "ordered"], help="the backward's dq_mode (default: its own)")
    ap.add_argument("--pass", dest="passes", choices=["forward", "backward", "both"], default="both",
                    help="compile the forward's kernels, the backward's, or both")
    ap.add_argument("--no-cubin", action="store_true", help="stop at PTX (no ptxas)")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="parallel compiles")
    ap.add_argument("--dump-ptx", metavar="DIR", help="write each kernel's TTGIR and PTX there")
    ap.add_argument("--trace", action="store_true", help="print the full traceback of each failure")
    ap.add_argument("--show-spec", action="store_true", help="print each job's pointer types, constexprs, options")
    a = ap.parse_args(argv)

    if os.environ.get("TRITON_INTERPRET") == "1":
        print("compile_check: unset TRITON_INTERPRET (the wrappers must take their GPU branches)", file=sys.stderr)
        return 2
    import torch

    from lpfa.attention.policy import PRESETS

    dtypes = {"bf16": torch.bfloat16, "fp32": torch.float32}
    B, H, T = a.shape
    rows = []  # (kernel name, preset, dtype, D, job index)
    keys: dict = {}
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend

    backend = make_backend(GPUTarget("cuda", a.arch, 32))
    for preset in a.presets:
        if preset not in PRESETS:
            print(f"# {preset}: no such preset in this tree, skipped")
            continue
        for dt in a.dtype:
            for D in a.d:
                launch = {k: v for k, v in (("num_stages", a.num_stages), ("num_warps", a.num_warps),
                                            ("block_m", a.block_m), ("block_n", a.block_n)) if v is not None}
                bwd = {"dq_mode": a.dq_mode} if a.dq_mode else None
                for kernel, args, kwargs in capture(preset, dtypes[dt], B, H, T, D, launch, bwd, a.passes):
                    k = _key(kernel, _spec(kernel, args, kwargs, backend))
                    if k not in keys:
                        keys[k] = len(_JOBS)
                        _JOBS.append((kernel, args, kwargs))
                    row = (kernel.fn.__name__, preset, dt, D, keys[k])
                    if row not in rows:
                        rows.append(row)
    if a.dump_ptx:
        os.makedirs(a.dump_ptx, exist_ok=True)
    if a.show_spec:
        for i, (kernel, args, kwargs) in enumerate(_JOBS):
            options, signature, constexprs, attrs = _spec(kernel, args, kwargs, backend)
            ptrs = " ".join(f"{n}:{t}" for n, t in signature.items() if t != "constexpr")
            consts = " ".join(f"{kernel.arg_names[p[0]]}={v}" for p, v in constexprs.items())
            print(f"# job {i} {kernel.fn.__name__}: {ptrs} | {consts} | num_warps={options.num_warps} "
                  f"num_stages={options.num_stages} enable_fp_fusion={options.enable_fp_fusion}")
    print(f"# {len(rows)} launches, {len(_JOBS)} distinct compiles, sm_{a.arch}, "
          f"{'PTX only' if a.no_cubin else 'PTX + cubin'}, B={B} H={H} T={T}", flush=True)
    t0 = time.time()
    results: dict[int, dict] = {}
    with cf.ProcessPoolExecutor(max_workers=max(1, a.jobs), mp_context=mp.get_context("fork")) as ex:
        futs = {ex.submit(_compile, i, a.arch, not a.no_cubin, a.dump_ptx): i for i in range(len(_JOBS))}
        for f in cf.as_completed(futs):
            i = futs[f]
            try:
                results[i] = f.result()
            except Exception as e:  # a crashed worker (e.g. an abort inside the MLIR passes)
                results[i] = {"ok": False, "secs": 0.0, "error": f"worker died: {e!r}", "trace": ""}
            r = results[i]
            print(f"#   [{len(results)}/{len(_JOBS)}] {_JOBS[i][0].fn.__name__} job {i}: "
                  f"{'ok' if r['ok'] else 'FAIL'} ({r['secs']:.0f} s)", flush=True)
    print(f"# compiled in {time.time() - t0:.0f} s\n")

    w = max(len(r[0]) for r in rows) if rows else 10
    print(f"| {'kernel':<{w}} | preset        | dtype | D   | job | result")
    print(f"|{'-' * (w + 2)}|---------------|-------|-----|-----|-------")
    errors = {}
    for name, preset, dt, D, i in rows:
        r = results[i]
        if r["ok"]:
            sass = r.get("sass") or {}
            extra = ", ".join(x for x in (f"regs {r['regs']}" if r.get("regs") is not None else "",
                                          f"smem {r['shared']}" if r.get("shared") is not None else "",
                                          " ".join(f"{op} {n}" for op, n in sass.items() if n)) if x)
            res = f"ok ({'+'.join(r['stages'][-2:])}{'; ' + extra if extra else ''})"
            lim = MAX_SHARED.get(a.arch)
            if lim is not None and r.get("shared") is not None and r["shared"] > lim:
                res = f"FAIL at launch: shared memory {r['shared']} > {lim} ({res})"
                errors[i] = dict(r, error=f"OutOfResources: shared memory {r['shared']} > sm_{a.arch}'s {lim}")
        else:
            first = r["error"].splitlines()[0] if r["error"] else "error"
            res = f"FAIL (job {i}): {first[:160]}"
            errors[i] = r
        print(f"| {name:<{w}} | {preset:<13} | {dt:<5} | {D:<3} | {i:<3} | {res}")
    for i, r in sorted(errors.items()):
        detail = r.get("trace") if a.trace and r.get("trace") else r["error"]
        print(f"\n## job {i} ({_JOBS[i][0].fn.__name__}) error:\n{detail}")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
