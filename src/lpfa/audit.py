"""Is your attention kernel biased? Signed mean errors of attention kernels against float64.

The paper's chain is tied BF16 row maxima → P̄ entries exactly 1 → a biased BF16 rounding of Ō = P̄V (V of one
sign) → δ = rowsum(dO∘O) biased → a W_Q gradient error along a low-rank direction. This module measures the
three links a kernel controls, for any kernel, on the same inputs, against causal attention in float64
(:func:`lpfa.attention.accuracy.attention64`):

* ``o``: O − O₆₄, averaged over the D features of each row;
* ``o_radial``: (O − O₆₄)·sign(O₆₄), averaged over the features of each row: negative when the kernel shrinks |O|
  towards 0 (what a numerator of BF16 P̄ over a row sum of FP32 P̄ does if BF16 rounds P̄ down on average, the
  claim of flash-attention PR #2721), whatever the sign of V;
* ``delta``: δ − δ₆₄ with δ₆₄ = rowsum(dO∘O₆₄) in float64. For lpfa presets δ is the one their backward uses
  (:func:`lpfa.attention.reference.backward_delta`); for other kernels, whose δ is internal, it is
  rowsum(dO∘O) of the O they return, in float64 (FlashAttention computes it in FP32 from the same stored O);
* ``dq_u``: (dQ − dQ₆₄)·u per row, u the unit low-rank direction of the head (below).

Each is reduced to one value per query row (B·H·T rows) and reported as the signed mean over rows with a 95%
confidence interval, mean ± 1.96·sd/√n (:func:`bias`).

**The direction u.** A δ error e_T on row T changes dQ[T] by −scale·e_T·(PK)[T] (dS = P∘(dP − δ), dQ = scale·dS K),
so the W_Q gradient error G = scale·Σ_T e_T (PK)[T]ᵀ X[T] of :func:`lpfa.replay._w_q_error` has its column space
in the span of the rows (PK)[T]. Without a layer input X (these are bare attention calls) we take the same
structure one step earlier: u is the top right singular vector of the float64 matrix PK (T × D) of the head
(P the float64 probabilities), oriented so that Σ_T (PK)[T]·u > 0. It depends only on q and k, not on the kernel,
so every kernel is projected on the same direction; a negative δ bias then shows as a positive ``dq_u``.

**Input families** (:func:`inputs`; q, k, v, dO in BF16, deterministic from the seed):

* ``"random"``: every entry N(0, 1);
* ``"ties"`` (the paper's Fig. 6 setting): in each head one key vector k* is repeated exactly at every
  ``TIE_STRIDE``-th position (0, 4, 8, …), and every query is q = c·k* + 0.3·N(0, 1) with c chosen so that
  q·k*·scale ≈ ``TIE_LOGIT`` (12: the large-logit regime where the runs fail; the other keys are N(0, 1), whose
  scores stay within a few units of 0, so the tied keys dominate each row as in the paper's Fig. 6). Identical keys give
  identical scores at any precision, so every row t has ⌊t/4⌋ + 1 keys tied exactly at its BF16 row max
  (P̄ = 1 there). V = −|N(0, 1)| (one sign, negative, as the tied values in the paper's Fig. 6) and
  dO = +|N(0, 1)| (one sign, so that a one-signed O error becomes a δ error of known sign; with zero-mean dO
  a biased O gives an unbiased δ).

**Kernels** (:data:`KERNELS`): ``float64`` (the reference itself: zero error, a check), ``ref:<preset>`` (lpfa
presets through the exact PyTorch reference, CPU and GPU), ``triton:<preset>`` (lpfa's Triton kernels, GPU),
``sdpa:flash`` / ``sdpa:cudnn`` / ``sdpa:efficient`` (PyTorch SDPA backends on BF16 inputs, GPU),
``sdpa:math`` (SDPA's math backend on BF16 inputs, CPU and GPU) and ``flex`` (FlexAttention, GPU).
:func:`audit` runs a grid of them and lists a kernel that cannot run on the device with its reason.

* **captured** (:func:`audit`'s ``captured``): q, k, v and dO of a trained run's layer as its attention saw them,
  written by ``python -m lpfa.replay ... --save-qkv N`` (:func:`save_captured`) and read back by
  :func:`load_captured`.

* **FP8** (``ref:fa3_fp8``, ``ref:fa3_fp8_p``): FlashAttention-3's FP8 forward on FA2's rounding, P̄ and V (or P̄
  only) in float8_e4m3fn with a per-key-block scale for V (:attr:`lpfa.attention.PrecisionPolicy.fp8`). Emulated in
  the PyTorch reference (no FP8 tensor cores run); its backward is FA2's on the BF16 inputs, so its δ and dQ errors
  come from the FP8 O alone. FlashAttention-3 itself (the ``flash_attn_interface`` package) is not installed here.
"""

from __future__ import annotations

import importlib.util
import json
import math
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from lpfa import results
from lpfa.attention import AttentionStats, attention, get_policy
from lpfa.attention.accuracy import attention64, run_policy
from lpfa.attention.reference import backward_delta

FAMILIES = ("random", "ties")
QUANTITIES = ("o", "o_radial", "delta", "dq_u")
TIE_STRIDE = 4
TIE_LOGIT = 12.0
PRESET_KERNELS = ("paper", "fa2", "fp32", "paper_sfa", "fa2_sfa", "paper_sr")  # paper_sr: stochastic rounding of O
FP8_KERNELS = ("fa3_fp8", "fa3_fp8_p")  # lpfa.attention.EMULATED: the reference only
PRODUCTION = ("sdpa:flash", "sdpa:cudnn", "sdpa:efficient", "flex")  # the GPU kernels people train with (not sdpa:math)
KERNELS = ("float64", *(f"ref:{p}" for p in (*PRESET_KERNELS, *FP8_KERNELS)), *(f"triton:{p}" for p in PRESET_KERNELS),
           *PRODUCTION[:3], "sdpa:math", PRODUCTION[3])
CPU_KERNELS = tuple(k for k in KERNELS if k == "float64" or k.startswith("ref:") or k == "sdpa:math")
Z95 = 1.96


def _check_choice(name: str, value, choices) -> None:
    if not (isinstance(value, str) and value in choices):
        raise ValueError(f"{name}={value!r}: expected one of {', '.join(map(repr, choices))}")


def inputs(family: str = "random", B: int = 1, H: int = 2, T: int = 64, D: int = 32, seed: int = 0) -> dict:
    """``{"q", "k", "v", "do"}``, BF16 tensors (B, H, T, D) on the CPU, of ``family`` (module docstring)."""
    _check_choice("family", family, FAMILIES)
    for n, x in (("B", B), ("H", H), ("T", T), ("D", D)):
        if not (isinstance(x, int) and not isinstance(x, bool) and x >= 1):
            raise ValueError(f"{n}={x!r}: expected an int >= 1")
    g = torch.Generator().manual_seed(int(seed))
    n = lambda: torch.randn(B, H, T, D, generator=g)  # noqa: E731
    if family == "random":
        q, k, v, do = n(), n(), n(), n()
    else:
        scale = 1.0 / math.sqrt(D)
        k_star = torch.randn(B, H, 1, D, generator=g).bfloat16().float()
        k = n()
        k[:, :, ::TIE_STRIDE] = k_star
        c = TIE_LOGIT / (scale * k_star.pow(2).sum(-1, keepdim=True))
        q = c * k_star + 0.3 * n()
        v, do = -n().abs(), n().abs()
    return {name: t.bfloat16() for name, t in zip(("q", "k", "v", "do"), (q, k, v, do))}


CAPTURED_NAMES = ("q", "k", "v", "do")


def save_captured(path, tensors: dict, meta: dict) -> Path:
    """Write a captured ``{"q", "k", "v", "do"}`` (B, H, T, D each; :func:`lpfa.replay.replay`'s ``save_qkv``) as an
    npz: their bits as BF16 (uint16 arrays, half the size of FP32, exact for the BF16 activations of a BF16 run), and
    ``meta`` (run, step, layer, policy) as JSON."""
    path = Path(path)
    arrays = {n: tensors[n].detach().to("cpu", torch.bfloat16).contiguous().view(torch.int16).numpy().view(np.uint16)
              for n in CAPTURED_NAMES}
    np.savez_compressed(path, **arrays, meta=np.array(json.dumps(meta)))
    return path


def load_captured(path) -> tuple[dict, dict]:
    """``(inputs, meta)`` of a :func:`save_captured` file: BF16 q, k, v, dO on the CPU, as :func:`inputs` gives its
    families, for :func:`audit`'s ``captured`` family (activations of a trained run's failing layer). A file without
    them, or with tensors of other shapes, is a one-line error naming what is wrong."""
    path = Path(path)
    try:
        z = np.load(path)
    except (OSError, ValueError) as e:
        raise ValueError(f"captured={str(path)!r}: not a readable .npz ({e})") from None
    missing = [n for n in (*CAPTURED_NAMES, "meta") if n not in z.files]
    if missing:
        raise ValueError(f"captured={str(path)!r}: expected arrays {', '.join(CAPTURED_NAMES)} and meta "
                         f"(lpfa.replay --save-qkv), missing {', '.join(missing)}")
    out = {n: torch.from_numpy(z[n].astype(np.int16)).view(torch.bfloat16) for n in CAPTURED_NAMES}
    shapes = {n: tuple(t.shape) for n, t in out.items()}
    if len(set(shapes.values())) != 1 or len(shapes["q"]) != 4:
        raise ValueError(f"captured={str(path)!r}: expected q, k, v, do of one (B, H, T, D) shape, got {shapes}")
    return out, json.loads(str(z["meta"]))


def direction(q, k, scale: float | None = None) -> torch.Tensor:
    """(B, H, D) unit low-rank direction u per head: the top right singular vector of the float64 PK, oriented so
    that Σ_T (PK)[T]·u > 0 (module docstring)."""
    q, k = q.double(), k.double()
    T, D = q.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    s = s.masked_fill(~torch.ones(T, T, dtype=torch.bool, device=q.device).tril(), -math.inf)
    pk = torch.softmax(s, -1) @ k
    u = torch.linalg.svd(pk, full_matrices=False)[2][..., 0, :]
    sign = torch.sign((pk.sum(-2) * u).sum(-1, keepdim=True))
    return u * torch.where(sign == 0, torch.ones_like(sign), sign)


def _unavailable(kernel: str, device: str) -> str | None:
    """Why ``kernel`` cannot run on ``device`` (None when it can)."""
    cuda = device.startswith("cuda")
    if kernel.startswith(("triton:", "sdpa:flash", "sdpa:cudnn", "sdpa:efficient", "flex")) and not cuda:
        return "needs a CUDA GPU"
    if cuda and not torch.cuda.is_available():
        return "no CUDA device is available"
    if kernel.startswith("triton:"):
        if importlib.util.find_spec("triton") is None:
            return "Triton is not installed"
    if kernel == "flex":
        if importlib.util.find_spec("torch.nn.attention.flex_attention") is None:
            return "torch.nn.attention.flex_attention is missing in this PyTorch"
    return None


def _sdpa(kernel, q, k, v, do, scale):
    backend = {"sdpa:flash": SDPBackend.FLASH_ATTENTION, "sdpa:cudnn": SDPBackend.CUDNN_ATTENTION,
               "sdpa:efficient": SDPBackend.EFFICIENT_ATTENTION, "sdpa:math": SDPBackend.MATH}[kernel]
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    with sdpa_kernel([backend]):
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)
        o.backward(do)
    return o.detach(), q.grad


def _flex(q, k, v, do, scale):
    # FlexAttention is missing in some PyTorch builds (:func:`_unavailable` says so): imported when it runs
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    B, H, T, _ = q.shape
    mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, B=None, H=None, Q_LEN=T, KV_LEN=T, device=q.device)
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = torch.compile(flex_attention)(q, k, v, block_mask=mask, scale=scale)
    o.backward(do)
    return o.detach(), q.grad


def run_kernel(kernel: str, q, k, v, do, scale: float | None = None) -> dict:
    """``{"o", "delta", "dq"}`` of ``kernel`` on BF16 inputs (on the inputs' device), as float64 tensors."""
    _check_choice("kernel", kernel, KERNELS)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    if kernel == "float64":
        t = attention64(q, k, v, do, scale)
        o, dq = t["o"], t["dq"]
        delta = (do.double() * o).sum(-1)
    elif kernel.startswith(("ref:", "triton:")):
        backend, preset = kernel.split(":")
        pol = get_policy(preset)
        with torch.no_grad():
            got = run_policy(q, k, v, do, pol, scale, "reference" if backend == "ref" else "triton")
            delta = backward_delta(do.float(), q.float(), k.float(), v.float(), got["o"].float(), got["lse"].float(),
                                   pol, scale)
        o, dq = got["o"], got["dq"]
    elif kernel == "flex":
        o, dq = _flex(q, k, v, do, scale)
        delta = (do.double() * o.double()).sum(-1)
    else:
        o, dq = _sdpa(kernel, q, k, v, do, scale)
        delta = (do.double() * o.double()).sum(-1)
    return {"o": o.double(), "delta": delta.double(), "dq": dq.double()}


def _ci(x: torch.Tensor) -> dict:
    x = x.double().flatten()
    n = x.numel()
    m = float(x.mean())
    half = Z95 * float(x.std()) / math.sqrt(n) if n > 1 else float("nan")
    return {"mean": m, "ci_low": m - half, "ci_high": m + half, "n": n}


def bias(kernel: str, q, k, v, do, scale: float | None = None) -> dict:
    """Signed mean errors of ``kernel`` against float64 on (B, H, T, D) inputs: ``{quantity: {"mean", "ci_low",
    "ci_high", "n"}}`` for ``o`` (per row, averaged over features), ``delta`` and ``dq_u`` (module docstring);
    the CI is mean ± 1.96·sd/√n over the n = B·H·T rows."""
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    got = run_kernel(kernel, q, k, v, do, scale)
    dev = got["o"].device
    q, k, v, do = (t.to(dev) for t in (q, k, v, do))
    t = attention64(q, k, v, do, scale)
    delta64 = (do.double() * t["o"]).sum(-1)
    u = direction(q, k, scale)
    err = {"o": (got["o"] - t["o"]).mean(-1), "o_radial": ((got["o"] - t["o"]) * torch.sign(t["o"])).mean(-1),
           "delta": got["delta"] - delta64, "dq_u": ((got["dq"] - t["dq"]) * u[..., None, :]).sum(-1)}
    return {name: _ci(e) for name, e in err.items()}


def audit(families=FAMILIES, kernels=CPU_KERNELS, device: str = "cpu", B: int = 1, H: int = 2, T: int = 64,
          D: int = 32, seed: int = 0, captured: dict | None = None):
    """A tidy DataFrame, one row per (kernel, family, quantity): ``mean``, ``ci_low``, ``ci_high``, ``n``, ``device``
    and ``unavailable`` (the reason a kernel cannot run on ``device``, its numbers then missing). ``captured``: more
    families by name, each ``{"q", "k", "v", "do"}`` as :func:`load_captured` gives them (their own shape)."""
    families, kernels = list(families), list(kernels)
    for f in families:
        _check_choice("family", f, FAMILIES)
    for kname in kernels:
        _check_choice("kernel", kname, KERNELS)
    if not (isinstance(device, str) and (device == "cpu" or device.startswith("cuda"))):
        raise ValueError(f"device={device!r}: expected 'cpu' or 'cuda[:N]'")
    captured = dict(captured or {})
    for name, x in captured.items():
        if name in FAMILIES or not (isinstance(x, dict) and set(CAPTURED_NAMES) <= set(x)):
            raise ValueError(f"captured[{name!r}]: expected a new family name and a dict of "
                             f"{', '.join(CAPTURED_NAMES)} (lpfa.audit.load_captured)")
    rows = []
    for f in [*families, *captured]:
        x = captured[f] if f in captured else inputs(f, B, H, T, D, seed)
        x = {n: t.to(device) if torch.cuda.is_available() or device == "cpu" else t for n, t in x.items()}
        for kname in kernels:
            why = _unavailable(kname, device)
            res = None
            if why is None:
                try:
                    res = bias(kname, x["q"], x["k"], x["v"], x["do"])
                except Exception as e:  # a backend that refuses these shapes or this GPU: say so, keep going
                    why = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            for qn in QUANTITIES:
                base = {"kernel": kname, "family": f, "quantity": qn, "device": device}
                if res is None:
                    rows.append({**base, "mean": float("nan"), "ci_low": float("nan"), "ci_high": float("nan"),
                                 "n": 0, "unavailable": why})
                else:
                    rows.append({**base, **res[qn], "unavailable": None})
    cols = ["kernel", "family", "quantity", "mean", "ci_low", "ci_high", "n", "device", "unavailable"]
    return pd.DataFrame(rows, columns=cols)


def chance_exclusions(df, family: str | None = None) -> dict:
    """How many of an :func:`audit`'s 95% intervals exclude 0, against chance: ``{"n": the intervals of the kernels
    that ran (float64 left out), "excluding": those excluding 0, "expected": 0.05·n, the count if no kernel were
    biased, "p_chance": the chance of at least that many among n independent unbiased intervals (binomial tail)}``,
    over ``family`` only when given. A few exclusions among many intervals are no evidence of a bias; correlated rows
    (O and its radial error, say) are not independent either."""
    ran = df[df.unavailable.isna() & (df.kernel != "float64")]
    if family is not None:
        _check_choice("family", family, FAMILIES)
        ran = ran[ran.family == family]
    n, excluding = len(ran), int(((ran.ci_low > 0) | (ran.ci_high < 0)).sum())
    tail = sum(math.comb(n, j) * 0.05**j * 0.95 ** (n - j) for j in range(excluding, n + 1))
    return {"n": n, "excluding": excluding, "expected": 0.05 * n, "p_chance": tail}


def load_audit(run: str | None = None, root=None):
    """A committed GPU audit (``results/kernel_bias/<run>/audit.json``, written by ``benchmarks/kernel_bias.py``):
    ``(df, config, folder)``, ``df`` as :func:`audit` returns it with the ``T`` column, ``run`` None the latest."""
    folder = results.run_dir("kernel_bias", run, root)
    d = results.load("kernel_bias", "audit.json", folder.name, root)
    df = pd.DataFrame(d["rows"])
    for c in ("mean", "ci_low", "ci_high"):
        df[c] = df[c].astype(float)  # JSON null (a NaN result) back to NaN
    return df, d["config"], folder


def at_largest_T(df):
    """The rows of each family at its largest sequence length (an :func:`audit` frame without a ``T`` column is
    returned as it is): one row per (kernel, family, quantity)."""
    if "T" not in df.columns:
        return df
    top = df.groupby("family")["T"].transform("max")
    return df[df["T"] == top]


def result(df, kernel: str, family: str, quantity: str):
    """The one row of ``df`` (one T per family: :func:`at_largest_T`) for ``kernel``, ``family``, ``quantity``."""
    r = df[(df.kernel == kernel) & (df.family == family) & (df.quantity == quantity)]
    if len(r) != 1:
        raise KeyError(f"audit has {len(r)} rows for kernel={kernel!r}, family={family!r}, quantity={quantity!r}; "
                       "expected one (pass a frame with one T per family: lpfa.audit.at_largest_T)")
    return r.iloc[0]


def excludes_zero(row) -> bool:
    """Whether an audit row's 95% interval excludes 0 (a bias); False for a NaN result."""
    return bool(row.ci_low > 0 or row.ci_high < 0)


def ci_text(row) -> str:
    """An audit row as "+1.2e-04 (95% CI +1.0e-04 to +1.4e-04)", or "NaN" where the kernel's output had NaN rows."""
    if math.isnan(row["mean"]):
        return "NaN"
    return f"{row['mean']:+.2e} (95% CI {row.ci_low:+.2e} to {row.ci_high:+.2e})"


def silenced_rows(captured: dict, policies=("paper", "fa2", "paper_sfa", "fa2_sfa")):
    """What each policy's forward does to the rows of a captured layer (:func:`load_captured`), through the exact
    reference on the CPU: per policy the rows, tied rows (:class:`lpfa.attention.AttentionStats`' ``tied_rows``, in
    its score precision), rows SFA shifted, rows the row-sum clamp attenuated, rows whose row sum underflowed to 0
    (``zeroed``: with the clamp O is then 0, without it 0/0), rows of O holding a NaN, and the largest logit of the
    layer. SFA's hazard of :class:`lpfa.attention.SFA` (large |rm|), counted on real activations."""
    q, k, v = (captured[n] for n in ("q", "k", "v"))
    T, D = q.shape[-2], q.shape[-1]
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(D)
    top = float(s.masked_fill(~torch.ones(T, T, dtype=torch.bool).tril(), -math.inf).amax())
    out = {}
    for name in policies:
        st = AttentionStats()
        with torch.no_grad():
            o = attention(q, k, v, policy=name, backend="reference", stats=st)
        out[name] = {"rows": int(q.shape[0] * q.shape[1] * T), "tied": int(st.tied_rows.sum()),
                     "sfa shifted": int(st.sfa_rows.sum()), "attenuated": int(st.attenuated_rows.sum()),
                     "zeroed": int(st.zeroed_rows.sum()), "NaN rows": int(torch.isnan(o).any(-1).sum()),
                     "largest logit": top}
    return pd.DataFrame.from_dict(out, orient="index")
