"""`attention(backend="triton")`: the torch.library op with autograd, FP32-head split and tie stats (interpreter)."""

import os
import shutil

os.environ["TRITON_INTERPRET"] = "1"

import pytest
import torch

pytest.importorskip("triton")

from lpfa.attention import PRESETS, AttentionStats, attention  # noqa: E402
from lpfa.attention.kernels import _fwd_op, policy_key  # noqa: E402
from lpfa.attention.triton_bwd import ordered_dq_unsupported  # noqa: E402
from lpfa.attention.triton_common import default_launch, policy_tiles  # noqa: E402

pytestmark = [
    pytest.mark.filterwarnings("ignore::RuntimeWarning"),
    # the interpreter converts 1-element arrays with int(), which NumPy deprecates
    pytest.mark.filterwarnings("ignore::DeprecationWarning"),
]


def _qkv(B=1, H=3, T=40, D=16):
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    return [torch.randn(B, H, T, D, generator=g).bfloat16().requires_grad_() for _ in range(3)]


def _close(a, b, min_same=0.98):
    a, b = a.float(), b.float()
    assert (a == b).double().mean() >= min_same
    assert ((a - b).abs().max() / b.abs().max()) < 2e-2


@pytest.mark.parametrize("name", ["paper", "fa2", "paper_sfa"])
def test_autograd_matches_reference(name):
    pol = PRESETS[name].with_(block_q=16, block_k=16)
    q, k, v = _qkv()
    o = attention(q, k, v, policy=pol, backend="triton")
    o_ref = attention(q, k, v, policy=pol, backend="reference")
    assert o.dtype == o_ref.dtype == torch.bfloat16
    _close(o, o_ref, 0.99)
    do = torch.randn_like(o)
    for g, g_ref in zip(torch.autograd.grad(o, (q, k, v), do), torch.autograd.grad(o_ref, (q, k, v), do)):
        # the BF16 gradients round FP32 sums taken in another order (the interpreter's matmul, the reference's float64):
        # how many land on the other side of a BF16 rounding depends on the inputs and the machine (97.8% seen)
        _close(g, g_ref, 0.95)


def test_fp32_heads_through_the_op():
    pol = PRESETS["paper"].with_(block_q=16, block_k=16, fp32_heads={0, 2})
    q, k, v = _qkv(H=4)
    o = attention(q, k, v, policy=pol, backend="triton")
    o_ref = attention(q, k, v, policy=pol, backend="reference")
    _close(o, o_ref, 0.99)
    do = torch.randn_like(o)
    for g, g_ref in zip(torch.autograd.grad(o, (q, k, v), do), torch.autograd.grad(o_ref, (q, k, v), do)):
        # the BF16 gradients round FP32 sums taken in another order (the interpreter's matmul, the reference's float64):
        # how many land on the other side of a BF16 rounding depends on the inputs and the machine (97.8% seen)
        _close(g, g_ref, 0.95)


def test_tie_stats_with_triton_backend():
    q, k, v = _qkv()
    st, st_ref = AttentionStats(eps=0.5), AttentionStats(eps=0.5)
    attention(q, k, v, policy="fa2", backend="triton", stats=st)
    attention(q, k, v, policy="fa2", backend="reference", stats=st_ref)
    for name in ("tied_rows", "rs_sum", "p_bar_ones", "sfa_rows", "attenuated_rows", "zeroed_rows"):
        # the Triton path's counts are the reference's
        assert torch.equal(getattr(st, name), getattr(st_ref, name)), name
    assert st.rows == st_ref.rows == q.shape[2]


def test_custom_op_registration():
    q, k, v = (t.detach() for t in _qkv(T=32))
    key = policy_key(PRESETS["fa2"].with_(block_q=16, block_k=16))
    for assume_finite in (False, True):
        torch.library.opcheck(_fwd_op, (q, k, v, key, 0.25, assume_finite),
                              test_utils=("test_schema", "test_faketensor"))


def test_custom_policies_under_torch_compile():
    """A custom policy with FP32 heads splits into two policies the op must know by key. Under torch.compile
    a key made while Dynamo traces reaches the fake kernel before Dynamo applies the registration (the
    isolation runs 'fp32_outlier_heads' failed so on the GPU); policy_key now registers through a graph
    break, and ``register`` beforehand (what GPT does) allows fullgraph."""
    import torch._dynamo

    from lpfa.attention.kernels import register

    blocks = 8 + int(torch.randint(1, 1000, ()))  # a policy no other test registered
    pol = PRESETS["paper"].with_(block_q=blocks, block_k=blocks, fp32_heads={1}, name="paper")
    q, k, v = (t.detach() for t in _qkv(H=3, T=24))
    eager = attention(q, k, v, policy=pol, backend="reference")
    torch._dynamo.reset()
    f = torch.compile(lambda q, k, v: attention(q, k, v, policy=pol, backend="triton"), backend="eager")
    _close(f(q, k, v), eager, 0.99)
    pol2 = pol.with_(block_q=blocks + 1, block_k=blocks + 1, name="paper")
    key = register(pol2)
    assert key == policy_key(pol2) and register(pol2) == key  # idempotent
    torch._dynamo.reset()
    g = torch.compile(lambda q, k, v: attention(q, k, v, policy=pol2, backend="triton"), backend="eager",
                      fullgraph=True)
    _close(g(q, k, v), attention(q, k, v, policy=pol2, backend="reference"), 0.99)
    with pytest.raises(KeyError, match="no precision policy is registered under 'nonsense'"):
        _fwd_op(q, k, v, "nonsense", 0.25, False)


def test_backend_errors():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="backend=.cuda.: expected"):
        attention(q, k, v, backend="cuda")
    with pytest.raises(ValueError, match="causal only"):
        attention(q, k, v, is_causal=False, backend="triton")


def test_fake_kernels_match_real_layouts_for_model_shaped_inputs():
    """The model hands the op (B, H, T, D) views of a (B, T, H, D) tensor; the fake (meta) kernels must
    predict the real outputs' strides, or ``torch.compile`` of the model fails at run time."""
    from lpfa.attention.kernels import _bwd_op

    B, T, H, D = 2, 32, 2, 16
    q, k, v = (torch.randn(B, T, H, D).bfloat16().transpose(1, 2) for _ in range(3))
    assert not q.is_contiguous()
    key = policy_key(PRESETS["paper"].with_(block_q=16, block_k=16))
    torch.library.opcheck(_fwd_op, (q, k, v, key, 0.25, False), test_utils=("test_schema", "test_faketensor"))
    o, lse = _fwd_op(q, k, v, key, 0.25, False)
    do = torch.randn(B, T, H, D).bfloat16().transpose(1, 2)
    torch.library.opcheck(_bwd_op, (do, q, k, v, o, lse, key, 0.25, False),
                          test_utils=("test_schema", "test_faketensor"))
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode() as mode:
        fake = [mode.from_tensor(t) for t in (do, q, k, v, o, lse)]
        fake_out = _bwd_op(*fake, key, 0.25, False)
    for real, f in zip(_bwd_op(do, q, k, v, o, lse, key, 0.25, False), fake_out):
        assert real.stride() == f.stride() and real.dtype == f.dtype


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                    reason="torch.compile on CPU needs a C compiler")
def test_model_with_mixed_backends_compiles():
    """``compile=true`` on the isolation experiment's most mixed row (BF16 policy with FP32 heads in layer 1,
    FP32 SDPA in another layer): the compiled model's loss and gradients match eager. Inductor reorders the
    FP32 work around the attention op, and the op's emulated BF16 rounding can turn those last-bit changes
    into one-BF16-ulp flips, so gradients agree to 1% of each tensor's largest entry (seen: 0.2%)."""
    from lpfa.model import GPT, GPTConfig

    cfg = GPTConfig(vocab_size=257, block_size=32, n_layer=2, n_head=8, n_embd=128, attn_policy="paper_untiled",
                    layer_policies={0: "sdpa_fp32"}, fp32_heads={1: [5, 2]})
    torch.manual_seed(int(torch.randint(0, 2**31, ())))
    model = GPT(cfg)
    x = torch.randint(0, 257, (2, 32))
    loss_e = model(x, x)[1]
    loss_e.backward()
    loss_e = float(loss_e.detach())
    g_e = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    loss_c = torch.compile(model)(x, x)[1]
    loss_c.backward()
    assert float(loss_c.detach()) == pytest.approx(loss_e, rel=1e-4)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, g_e[n], rtol=0, atol=1e-2 * float(g_e[n].abs().max()), msg=n)


def test_inputs_are_validated_once_per_call(monkeypatch):
    """The policy and the inputs are checked once, in attention(); the op's forward and backward launches trust it
    (they used to be checked three times per call). Direct calls of the wrappers still check."""
    import lpfa.attention as la
    import lpfa.attention.triton_common as tc
    from lpfa.attention.triton_fwd import flash_forward

    calls = {"inputs": 0, "support": 0}
    real_inputs, real_support = la.check_inputs, tc.check_triton_support

    def count_inputs(*a, **k):
        calls["inputs"] += 1
        return real_inputs(*a, **k)

    def count_support(*a, **k):
        calls["support"] += 1
        return real_support(*a, **k)

    monkeypatch.setattr(la, "check_inputs", count_inputs)
    monkeypatch.setattr(tc, "check_triton_support", count_support)
    q, k, v = _qkv(T=24)
    attention(q, k, v, policy=PRESETS["paper"].with_(block_q=16, block_k=16), backend="triton").float().sum().backward()
    assert calls == {"inputs": 1, "support": 1} and q.grad is not None
    with pytest.raises(ValueError, match="causal only"):
        flash_forward(q.detach(), k.detach(), v.detach(), "paper", 0.25, causal=False)
    assert calls["inputs"] == 2  # the direct call checked its inputs


def _launches(monkeypatch):
    """The kernels' names, in order, as every Triton launch of the wrappers makes them (a list filled in place)."""
    import lpfa.attention.triton_bwd as tb
    import lpfa.attention.triton_common as tc
    import lpfa.attention.triton_fwd as tf

    launched = []
    real = tc.launch

    def count(kernel, *a, **k):
        launched.append(kernel.fn.__name__)
        return real(kernel, *a, **k)

    for mod in (tc, tf, tb):
        monkeypatch.setattr(mod, "launch", count)
    return launched


def _fast_launches(pol, T, head_dim):
    """The kernels one finite forward+backward launches under ``pol``: no dQ kernel where the launch table orders dQ
    inside the dK/dV kernel (``dq_mode="ordered"`` where the policy and tiles allow it), whose redo launch alone
    remains."""
    run = default_launch("backward", pol, head_dim)
    (bq, bm, _), (bk, bn, _) = policy_tiles(pol.block_q, T, run.block_m), policy_tiles(pol.block_k, T, run.block_n)
    ordered = run.dq_mode == "ordered" and ordered_dq_unsupported(pol, bq, bk, bm, bn) is None
    return ["_flash_fwd_kernel", "_bwd_delta_kernel", "_bwd_dkdv_kernel"] + ([] if ordered else ["_bwd_dq_kernel"])


def _checked_launches(fast):
    """The kernels the same call launches with the non-finite checks on: each of ``fast`` twice (its redo launch), but
    δ's; the dQ kernel's redo launch also where the dK/dV kernel orders dQ (it redoes the sub-tiles that kernel
    flagged)."""
    return [fast[0]] * 2 + [fast[1]] + [fast[2]] * 2 + ["_bwd_dq_kernel"] * (2 if len(fast) == 4 else 1)


def test_assume_finite_skips_the_checks_and_keeps_the_bits(monkeypatch):
    """``assume_finite=True``: the same O and gradients bit for bit on finite inputs, from one launch per kernel
    instead of two (no second launch to redo the tiles that hold an inf or NaN; δ's has none). What it gives up: a NaN
    in V then reaches the rows that cannot see its key, as a plain GEMM spreads it."""
    launched = _launches(monkeypatch)
    pol = PRESETS["fa2"].with_(block_q=16, block_k=16)
    base = [t.detach() for t in _qkv(T=40)]
    grads, n = {}, {}
    for assume in (False, True):
        q, k, v = (t.clone().requires_grad_() for t in base)
        launched.clear()
        o = attention(q, k, v, policy=pol, backend="triton", assume_finite=assume)
        o.float().square().sum().backward()
        grads[assume], n[assume] = (o, q.grad, k.grad, v.grad), list(launched)
    for a, b in zip(grads[False], grads[True]):
        assert torch.equal(a, b)
    assert n[True] == _fast_launches(pol, 40, 16)
    assert n[False] == _checked_launches(n[True])
    q, k, v = base
    v = v.clone()
    v[0, 1, 30, 0] = float("nan")  # key 30: rows 30.. see it
    checked = attention(q, k, v, policy=pol, backend="triton")
    trusted = attention(q, k, v, policy=pol, backend="triton", assume_finite=True)
    assert not checked[0, 1, :30].isnan().any() and checked[0, 1, 30:, 0].isnan().all()
    assert trusted[0, 1, :30, 0].isnan().any()
    with pytest.raises(TypeError, match="assume_finite='yes': expected True or False"):
        attention(q, k, v, policy=pol, backend="triton", assume_finite="yes")


def test_the_redo_launches_leave_the_tiles_nothing_non_finite_reached(monkeypatch):
    """A NaN in V of one batch·head: the second launches recompute only the tiles it reached, so every other
    batch·head's O and gradients keep the fast path's bits (``assume_finite=True``, one launch per kernel), and the
    poisoned one differs only where the fast path spread the NaN to rows that cannot see its key."""
    launched = _launches(monkeypatch)
    pol = PRESETS["fa2"].with_(block_q=16, block_k=16)
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    q, k, v, do = (torch.randn(2, 2, 40, 16, generator=g).bfloat16() for _ in range(4))
    key = int(torch.randint(40, (1,), generator=g))
    v[1, 0, key, 3] = float("nan")
    out = {}
    for assume in (False, True):
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        launched.clear()
        o = attention(*leaves, policy=pol, backend="triton", assume_finite=assume)
        out[assume] = (o, *torch.autograd.grad(o, leaves, do))
        fast = _fast_launches(pol, 40, 16)
        assert launched == (fast if assume else _checked_launches(fast))
    for a, b in zip(out[False], out[True]):
        clean = torch.ones(2, 2, dtype=torch.bool)
        clean[1, 0] = False
        assert torch.equal(a[clean], b[clean])
    o = out[False][0][1, 0]
    assert o[:key].isfinite().all() and o[key:].isnan().any(dim=-1).all()
