"""Triton kernels on a GPU (native BF16 tensor-core path) against the reference, at GPT-2 shapes.

Skipped without CUDA (CI has no GPU); run on a GPU machine with ``pytest tests/test_attention_gpu.py``.
Tolerance rule as in the interpreter tests: FP32 accumulation order differs from the reference's
exactly-rounded sums, so a BF16 rounding can flip by one ulp in rare elements.
"""

import math

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from lpfa.attention import PRESETS, attention  # noqa: E402
from lpfa.attention import reference as ref  # noqa: E402
from lpfa.attention.policy import BF16  # noqa: E402


def _compare(x, y, min_same):
    """At least `min_same` of the elements bit-identical, and every difference below 2% of the tensor's
    scale (its max magnitude, at least 1: gradients that are pure rounding noise around 0, e.g. dq at T = 1,
    are compared absolutely)."""
    x, y = x.float(), y.float()
    same = (x == y).double().mean().item()
    rel = ((x - y).abs().max() / y.abs().max().clamp_min(1.0)).item()
    assert same >= min_same and rel < 2e-2, (same, rel)


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_gpt2_shapes_match_reference(name):
    from lpfa.attention.triton_bwd import flash_backward
    from lpfa.attention.triton_fwd import flash_forward

    torch.manual_seed(torch.seed() % 2**31)
    B, H, T, D = 16, 12, 1024, 64
    q, k, v, do = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    pol, scale = PRESETS[name], 1 / math.sqrt(D)
    o, lse = flash_forward(q, k, v, pol, scale)
    ro, rlse = ref.forward(q.float(), k.float(), v.float(), pol, scale)
    if BF16 in (pol.scores, pol.accumulator):
        # an FP32-order difference can flip a BF16 rounding of one of a row's 1024 scores (ulp 0.03 at
        # |S| ≈ 4) or of l (a relative 2^-7): about 0.1% of the rows move, by up to a few 1e-2
        off = (lse - rlse).abs()
        assert (off > 1e-5).double().mean() < 1e-2 and off.max() < 0.05, ((off > 1e-5).double().mean(), off.max())
    else:
        torch.testing.assert_close(lse, rlse, rtol=1e-5, atol=1e-5)
    bf16_out = pol.o_store == BF16
    _compare(o, ro, 0.99 if bf16_out else 0.0)
    grads = flash_backward(do, q, k, v, o.float(), lse, pol, scale)
    rgrads = ref.backward(do.float(), q.float(), k.float(), v.float(), ro, rlse, pol, scale)
    for g, rg in zip(grads, rgrads):
        _compare(g, rg, 0.95 if pol.backward == BF16 else 0.0)


@pytest.mark.parametrize("T", [1, 77, 1000])
@pytest.mark.parametrize("D", [64, 128])
def test_awkward_shapes_autograd(T, D):
    q, k, v = (torch.randn(2, 3, T, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    for name in ("fa2", "paper", "paper_sfa"):
        o = attention(q, k, v, policy=name, backend="triton")
        o_ref = attention(q, k, v, policy=name, backend="reference")
        _compare(o, o_ref, 0.99)
        do = torch.randn_like(o)
        g = torch.autograd.grad(o, (q, k, v), do)
        g_ref = torch.autograd.grad(o_ref, (q, k, v), do)
        # at T = 1, dq and dk are exactly 0 in exact arithmetic: both sides return rounding noise (~1e-7)
        for a, b, noise in zip(g, g_ref, (T == 1, T == 1, False)):
            _compare(a, b, 0.0 if noise else 0.95)


@pytest.mark.parametrize("name", ["fa2", "fp32", "fp32_split", "fp32_softcap", "paper_tiled"])
def test_fp32_inputs_at_head_dim_128_launch_and_match(name):
    """FP32 inputs at D = 128 (and the fp32 preset's FP32 P̄V) take launches whose shared memory fits an sm_90 block
    (triton_common.FP32_INPUTS_128, FP32_PV_FORWARD_128): they run, forward and backward, and match the reference."""
    from lpfa.attention.triton_bwd import flash_backward
    from lpfa.attention.triton_fwd import flash_forward

    torch.manual_seed(torch.seed() % 2**31)
    q, k, v, do = (torch.randn(2, 3, 300, 128, device="cuda") for _ in range(4))
    pol, scale = PRESETS[name], 128**-0.5
    for dtype in (torch.float32, torch.bfloat16):
        x = [t.to(dtype) for t in (q, k, v, do)]
        o, lse = flash_forward(*x[:3], pol, scale)
        ro, rlse = ref.forward(*(t.float() for t in x[:3]), pol, scale)
        _compare(o, ro, 0.0)
        grads = flash_backward(x[3], *x[:3], o.float(), lse, pol, scale)
        for g, rg in zip(grads, ref.backward(*(t.float() for t in (x[3], *x[:3])), ro, rlse, pol, scale)):
            _compare(g, rg, 0.0)


def test_fp32_heads_and_compile():
    q, k, v = (torch.randn(2, 4, 256, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    pol = PRESETS["paper"].with_(fp32_heads={1, 2})
    o = attention(q, k, v, policy=pol, backend="triton")
    o_ref = attention(q, k, v, policy=pol, backend="reference")
    _compare(o, o_ref, 0.99)
    f = torch.compile(lambda q, k, v: attention(q, k, v, policy="fa2", backend="triton"), fullgraph=True)
    assert torch.equal(f(q, k, v), attention(q, k, v, policy="fa2", backend="triton"))
    # FP32 heads under compile (the isolation rows fp32_outlier_heads / fp32_worst_head): registered first, as GPT does
    from lpfa.attention.kernels import register

    heads = PRESETS["paper_untiled"].with_(fp32_heads={1}, name="paper_untiled")
    register(heads)
    g = torch.compile(lambda q, k, v: attention(q, k, v, policy=heads, backend="triton"), fullgraph=True)
    assert torch.equal(g(q, k, v), attention(q, k, v, policy=heads, backend="triton"))


@pytest.mark.parametrize("name", ["fa2", "paper"])
def test_assume_finite_and_cuda_graphs_keep_the_bits(name):
    """``assume_finite=True`` (no non-finite checks: the trainer's default) and training compiled with CUDA graphs
    (``torch.compile(mode="reduce-overhead")``, the op replayed from a graph) give the eager op's O and gradients bit
    for bit, from the third call on (the first two warm up and record the graph)."""
    torch.manual_seed(torch.seed() % 2**31)
    q, k, v, do = (torch.randn(4, 12, 1024, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))

    def fwd_bwd(f, **kw):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        o = f(*x, **kw)
        o.backward(do)
        return (o.detach(), *(t.grad for t in x))

    def op(q, k, v, **kw):
        return attention(q, k, v, policy=name, backend="triton", **kw)

    eager = fwd_bwd(op)
    for a, b in zip(eager, fwd_bwd(op, assume_finite=True)):
        assert torch.equal(a, b)
    torch._dynamo.reset()
    graphed = torch.compile(lambda q, k, v: op(q, k, v, assume_finite=True), mode="reduce-overhead")
    for _ in range(3):
        out = fwd_bwd(graphed)
    for a, b in zip(eager, out):
        assert torch.equal(a, b)


@pytest.mark.parametrize("name", ["fa2", "paper", "paper_sfa"])
@pytest.mark.parametrize("which", ["q", "k", "v", "do"])
def test_nonfinite_reaches_the_same_entries_as_the_reference(which, name):
    """NaN and ±inf on the native BF16 tensor-core path: the same finite entries of O, dq, dk, dv as the
    reference (tests/test_attention_nonfinite.py checks the reference against a float64 oracle): the fast path's
    tensor-core GEMMs must carry every inf and NaN they meet to the stored result, for the second launch to redo
    those tiles (triton_common.redo_launches)."""
    torch.manual_seed(0)
    B, H, T, D = 3, 2, 300, 64
    q, k, v, do = (torch.randn(B, H, T, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    t = {"q": q, "k": k, "v": v, "do": do}[which]
    for b, value in enumerate((math.nan, math.inf, -math.inf)):
        t[b, 0, 127, 5] = value  # the last row/key of a 128-block
        t[b, 1, 200, 0] = value
    outs = {}
    for backend in ("triton", "reference"):
        x = [u.clone().requires_grad_() for u in (q, k, v)]
        o = attention(*x, policy=name, backend=backend)
        o.backward(do)
        outs[backend] = [o.detach(), *(u.grad for u in x)]
    for part, a, b in zip(("O", "dq", "dk", "dv"), outs["triton"], outs["reference"]):
        assert torch.equal(torch.isfinite(a), torch.isfinite(b)), part
        if part == "O" and which != "do":
            assert torch.isfinite(a[:, :, :127]).all()  # no row before the first poisoned position sees it


@pytest.mark.parametrize("name", ["fa2", "paper", "paper_sfa", "fp32", "fp32_split", "delta_dp", "paper_untiled"])
@pytest.mark.parametrize("T", [1000, 1024, 77])
def test_causal_split_is_bit_identical_on_the_gpu(name, T):
    """The unmasked off-diagonal tiles (causal_split=True, the default) give the same bits as masking every tile, on
    the native BF16 tensor-core path too: O, lse, dq, dk, dv."""
    from lpfa.attention.triton_bwd import flash_backward
    from lpfa.attention.triton_fwd import flash_forward

    seed = torch.seed() % 2**31
    torch.manual_seed(seed)
    q, k, v, do = (torch.randn(2, 12, T, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    pol, scale = PRESETS[name], 0.125
    outs = {}
    for split in (True, False):
        o, lse = flash_forward(q, k, v, pol, scale, causal_split=split)
        outs[split] = (o, lse, *flash_backward(do, q, k, v, o.float(), lse, pol, scale, causal_split=split))
    for a, b, what in zip(outs[True], outs[False], ("o", "lse", "dq", "dk", "dv")):
        diff = a.float().view(torch.int32) != b.float().view(torch.int32)
        where = diff.nonzero()[:3].tolist()
        assert not diff.any(), (what, f"{int(diff.sum())} of {diff.numel()} differ, first at {where}", f"seed={seed}",
                                f"max |a-b| {(a.float() - b.float()).abs().max().item():.3g}")


@pytest.mark.parametrize("name", ["fa2", "fa2_sfa", "fp32"])
@pytest.mark.parametrize("B,H,T", [(16, 12, 1024), (1, 12, 4096), (3, 2, 77)])
def test_ordered_dq_is_deterministic_on_the_gpu(name, B, H, T):
    """dq_mode="ordered" on the GPU: the dK/dV kernel's programs add dQ in key-tile order through acquire/release
    counts, so five runs give the same bits (programs finish in another order each time); dK and dV are the default
    mode's bits and dQ is close to the dQ kernel's (a BF16 rounding of dS may flip between the two kernels' sums, so
    by _compare's rule); a NaN in K reaches the reference's rows."""
    from lpfa.attention.triton_bwd import flash_backward
    from lpfa.attention.triton_fwd import flash_forward

    seed = torch.seed() % 2**31
    torch.manual_seed(seed)
    q, k, v, do = (torch.randn(B, H, T, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    pol, scale = PRESETS[name], 0.125
    o, lse = flash_forward(q, k, v, pol, scale)
    runs = [flash_backward(do, q, k, v, o.float(), lse, pol, scale, dq_mode="ordered") for _ in range(5)]
    plain = flash_backward(do, q, k, v, o.float(), lse, pol, scale)
    for run in runs[1:]:
        for a, b, what in zip(run, runs[0], ("dq", "dk", "dv")):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (what, f"seed={seed}")
    for a, b, what in zip(runs[0][1:], plain[1:], ("dk", "dv")):
        assert torch.equal(a.view(torch.int32), b.view(torch.int32)), (what, f"seed={seed}")
    _compare(runs[0][0], plain[0], 0.0)
    k[0, 0, min(5, T - 1), 3] = math.nan  # a key every later row sees: earlier rows must stay finite
    o, lse = flash_forward(q, k, v, pol, scale)
    ro, rlse = ref.forward(q.float(), k.float(), v.float(), pol, scale)
    got = flash_backward(do, q, k, v, o.float(), lse, pol, scale, dq_mode="ordered")
    want = ref.backward(do.float(), q.float(), k.float(), v.float(), ro, rlse, pol, scale)
    for a, b, what in zip(got, want, ("dq", "dk", "dv")):
        assert torch.equal(torch.isfinite(a), torch.isfinite(b)), (what, f"seed={seed}")


def test_kernel_tanh_is_non_decreasing_on_every_bf16_value_on_the_gpu():
    """The forward's soft-capped row max from the raw Q Kᵀ (lpfa.attention.triton_fwd.raw_row_max) needs the
    kernels' tanh, with libdevice's exp2 as the GPU runs it, non-decreasing on the BF16 scores: all 2¹⁶ of them."""
    from lpfa.attention.triton_common import kernel_tanh
    from lpfa.bf16 import every_bf16

    x = every_bf16().cuda()
    t = kernel_tanh(x)
    assert (t[1:] >= t[:-1]).all(), f"the kernels' tanh decreases after x = {x[:-1][t[1:] < t[:-1]][:5].tolist()}"
    assert ((t - x.tanh()).abs() <= 2.0**-20).all()  # a few FP32 ulps of torch's (libdevice's exp2: 2 ulps)


@pytest.mark.parametrize("sfa", [False, True])
def test_softcap_row_max_from_the_raw_scores_is_bit_identical_on_the_gpu(sfa):
    """paper_softcap's 512-key policy blocks span several compute tiles, so its row-max pass caps only each row's
    largest raw scores: O and lse must be the bits of capping every score first (raw_max=False), with logits far past a
    cap of 5 (saturated ties) and, with SFA, the top-two tie test."""
    from lpfa.attention import SFA
    from lpfa.attention.triton_fwd import flash_forward

    seed = torch.seed() % 2**31
    torch.manual_seed(seed)
    q, k, v = (torch.randn(2, 12, 1000, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    q = q * 8
    pol = PRESETS["paper_softcap"].with_(softcap=5.0, sfa=SFA() if sfa else None)
    a = flash_forward(q, k, v, pol, 0.125)
    b = flash_forward(q, k, v, pol, 0.125, raw_max=False)
    for x, y, what in zip(a, b, ("o", "lse")):
        diff = x.float().view(torch.int32) != y.float().view(torch.int32)
        assert not diff.any(), (what, f"{int(diff.sum())} of {diff.numel()} differ", f"seed={seed}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("T", [1000, 1024])
def test_fp32_split_on_tensor_cores_is_fp32_level(T, dtype):
    """``fp32_split`` (gemm="bf16x6": split FP32 operands on BF16 tensor cores) against float64 next to
    ``fp32`` (IEEE FP32 GEMMs) on the same inputs: within 4× of its errors for O, lse, dq, dk, dv (max and mean),
    which also checks the tensor cores' FP32 accumulation; and against the reference at FP32 tolerance."""
    from lpfa.attention.accuracy import errors_vs_float64, run_policy

    seed = torch.seed() % 2**31
    g = torch.Generator(device="cuda").manual_seed(seed)
    B, H, D = 2, 12, 64
    q, k, v = (torch.randn(B, H, T, D, device="cuda", generator=g).to(dtype) for _ in range(3))
    do = torch.randn(B, H, T, D, device="cuda", generator=g)
    err = errors_vs_float64(q, k, v, do, ["fp32", "fp32_split"], 1 / math.sqrt(D))
    print(f"T={T} {dtype} seed={seed}: {err}")
    for part, e in err["fp32_split"].items():
        for stat, x in e.items():
            assert x <= 4 * err["fp32"][part][stat], (part, stat, x, err["fp32"][part][stat], seed)
    got = run_policy(q, k, v, do, "fp32_split", 1 / math.sqrt(D))
    want = run_policy(q, k, v, do, "fp32_split", 1 / math.sqrt(D), backend="reference")
    for part in ("o", "lse", "dq", "dk", "dv"):
        a, b = got[part].float(), want[part]
        rel = ((a - b).abs().max() / b.abs().max().clamp_min(1.0)).item()
        assert rel < 1e-5, (part, rel, seed)


@pytest.mark.parametrize("name", ["fa2", "paper", "fp32"])
def test_bf16_gradients_stored_by_the_kernels_match_a_cast(name):
    """The op's BF16 gradients, stored by the kernels themselves (``grad_dtype``), are the FP32 gradients rounded to
    nearest even by PyTorch, bit for bit, on the tensor-core path."""
    from lpfa.attention.triton_bwd import flash_backward
    from lpfa.attention.triton_fwd import flash_forward

    seed = torch.seed() % 2**31
    torch.manual_seed(seed)
    q, k, v, do = (torch.randn(2, 12, 1000, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    o, lse = flash_forward(q, k, v, name, 0.125)
    want = flash_backward(do, q, k, v, o, lse, name, 0.125)
    got = flash_backward(do, q, k, v, o, lse, name, 0.125, grad_dtype=torch.bfloat16)
    for part, a, b in zip(("dq", "dk", "dv"), got, want):
        assert torch.equal(a.view(torch.int16), b.to(torch.bfloat16).view(torch.int16)), (part, f"seed={seed}")


@pytest.mark.parametrize("B,H,T,D", [(4, 12, 1024, 64), (2, 6, 1000, 128), (3, 4, 77, 64)])
def test_fa2_agrees_with_sdpa_flash_within_the_arithmetic_bound(B, H, T, D):
    """lpfa ``fa2`` against SDPA's flash backend (the real FlashAttention-2 kernel) on fresh random BF16 inputs: every
    element of O within :func:`lpfa.attention.accuracy.flash_agreement_bound` (two BF16 roundings of O and one BF16 ulp
    of each P̄ apart), and most elements bit-identical (a difference needs the two FP32 values of O, within ~1e-6 of
    each other but where a P̄ rounding flipped, to straddle a BF16 rounding boundary)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from lpfa.attention.accuracy import agreement_with_flash

    seed = torch.seed() % 2**31
    g = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v = (torch.randn(B, H, T, D, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(3))
    scale = 1 / math.sqrt(D)
    o = attention(q, k, v, policy="fa2", backend="triton")
    with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
        o_flash = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    r = agreement_with_flash(o, o_flash, q, k, v, scale)
    print(f"fa2 vs SDPA-flash {(B, H, T, D)} seed={seed}: {r}")
    assert r["max_over_bound"] <= 1.0, (r, seed)
    assert r["bit_identical"] >= 0.5, (r, seed)


def test_spectral_norms_on_the_gpu_match_the_cpu_eigensolver():
    """lpfa.diagnostics.spectral_norms on CUDA (top_eigenvalue, no eigensolver) against the CPU path (float64 eigvalsh)
    on W_Q-shaped stacks with a far-scaled, a rank-1, a zero and a non-finite head: within 2 FP32 ulps, NaN in place."""
    from lpfa.diagnostics import spectral_norms

    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    w = torch.randn(12, 12, 64, 768, generator=g)
    w[0, 0] *= 3e4
    w[0, 1] = torch.randn(64, 1, generator=g) @ torch.randn(1, 768, generator=g)
    w[0, 2] = 0.0
    w[0, 3, 5, 7] = float("nan")
    want, got = spectral_norms(w), spectral_norms(w.cuda())
    assert got.device.type == "cpu" and got.dtype == torch.float32 and torch.isnan(got[0, 3]) and got[0, 2] == 0
    ok = torch.isfinite(want)
    assert ((got[ok] - want[ok]).abs() <= 2 * 2**-23 * want[ok]).all()
