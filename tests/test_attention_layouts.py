"""The Triton kernels take q, k, v and dO in any layout with unit stride along D (Triton's CPU interpreter here).

GPT's attention hands the kernels transposed views of its (B, T, 3·C) projection; the kernels address rows through
the tensors' strides instead of copying them. Each layout must give the bits of contiguous inputs, forward and
backward, and a non-finite value must reach the same outputs wherever it sits in memory."""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: no GPU here

import math

import pytest
import torch

pytest.importorskip("triton")

from lpfa.attention import PRESETS, attention  # noqa: E402
from lpfa.attention.triton_bwd import flash_backward  # noqa: E402
from lpfa.attention.triton_common import shared_layout  # noqa: E402
from lpfa.attention.triton_fwd import flash_forward  # noqa: E402

pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

# the smallest shape whose layouts differ in every stride the kernels read: B, H > 1 (batch and head strides), T = 20
# over two 16-row blocks with a ragged tail (the row stride, and the tail's masked loads), D = 16
B, H, T, D = 2, 2, 20, 16


def _layouts(seed):
    """The same q, k, v, dO values in four layouts: contiguous (B, H, T, D); transposed views of (B, T, H, D); the
    model's slices of one (B, T, 3, H, D) projection; and q contiguous with k, v transposed (no shared layout)."""
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(B, T, 3, H, D, generator=g).to(torch.bfloat16)
    do_bthd = torch.randn(B, T, H, D, generator=g).to(torch.bfloat16)
    sliced = [qkv[:, :, i].transpose(1, 2) for i in range(3)]  # strides (T·3·H·D, D, 3·H·D, 1): the model's views
    contiguous = [t.contiguous() for t in sliced]
    transposed = [t.contiguous().transpose(1, 2).contiguous().transpose(1, 2) for t in sliced]  # views of (B, T, H, D)
    mixed = [contiguous[0], transposed[1], transposed[2]]
    do = do_bthd.transpose(1, 2)
    return {"contiguous": (contiguous, do.contiguous()), "transposed": (transposed, do), "sliced": (sliced, do),
            "mixed": (mixed, do.contiguous())}


def test_shared_layout_keeps_views_and_copies_mixed_layouts():
    ls = _layouts(0)
    (q, k, v), st = shared_layout(*ls["sliced"][0])
    assert st == (T * 3 * H * D, D, 3 * H * D) and q.data_ptr() == ls["sliced"][0][0].data_ptr()
    (q, k, v), st = shared_layout(*ls["mixed"][0])
    assert all(t.is_contiguous() for t in (q, k, v)) and st == (H * T * D, T * D, D)
    x = torch.zeros(B, H, T, D).transpose(2, 3)  # D not the unit-stride axis: copied
    assert shared_layout(x)[0][0].is_contiguous()


@pytest.mark.parametrize("name", ["fa2", "paper", "paper_sfa", "delta_dp", "o_fp32"])
def test_every_layout_gives_the_bits_of_contiguous_inputs(name):
    pol = PRESETS[name].with_(block_q=16, block_k=16)
    scale = 1 / math.sqrt(D)
    out = {}
    for layout, ((q, k, v), do) in _layouts(hash(name) % 1000).items():
        o, lse = flash_forward(q, k, v, pol, scale)
        out[layout] = (o, lse, *flash_backward(do, q, k, v, o, lse, pol, scale))
    for layout, got in out.items():
        for a, b, what in zip(got, out["contiguous"], ("o", "lse", "dq", "dk", "dv")):
            assert torch.equal(a, b), (layout, what)


@pytest.mark.parametrize("layout", ["contiguous", "transposed", "sliced", "mixed"])
def test_outputs_are_dense_in_qs_order_of_dimensions(layout):
    """O, dQ, dK, dV come back dense in q's order of dimensions, as FlashAttention and SDPA return them: (B, T, H, D) in
    memory for the model's views, so its ``y.transpose(1, 2).contiguous()`` is the same storage; contiguous else."""
    pol = PRESETS["fa2"].with_(block_q=16, block_k=16)
    (q, k, v), do = _layouts(7)[layout]
    o, lse = flash_forward(q, k, v, pol, 0.25)
    grads = flash_backward(do, q, k, v, o, lse, pol, 0.25, grad_dtype=torch.bfloat16)
    model_order = layout in ("transposed", "sliced")  # q is a view of a (B, T, ·) tensor
    for t in (o, *grads):
        assert (t.transpose(1, 2) if model_order else t).is_contiguous(), t.stride()
    assert lse.is_contiguous()
    y = attention(q, k, v, policy=pol, backend="triton")
    flat = y.transpose(1, 2).contiguous()
    assert (flat.data_ptr() == y.data_ptr()) == model_order


def test_autograd_through_the_models_views_matches_contiguous_inputs():
    ((q, k, v), do) = _layouts(3)["sliced"]
    leaves = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    views = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    o1 = attention(*(t.contiguous() for t in leaves), policy="paper", backend="triton")
    o2 = attention(*views, policy="paper", backend="triton")  # strided leaves: the kernels read them in place
    assert torch.equal(o1, o2)
    g1 = torch.autograd.grad(o1, leaves, do)
    g2 = torch.autograd.grad(o2, views, do)
    assert all(torch.equal(a, b) for a, b in zip(g1, g2))


@pytest.mark.parametrize("layout", ["transposed", "sliced"])
def test_nonfinite_in_a_strided_view_reaches_what_it_reaches_contiguous(layout):
    """A NaN at the last (batch, head, row, column) of a strided K, and at the first of dO: the non-finite path
    (taken by the programs they reach) gives the bits of contiguous inputs, NaN where NaN."""
    pol = PRESETS["fa2"].with_(block_q=16, block_k=16)
    scale = 1 / math.sqrt(D)
    (q, k, v), do = _layouts(5)[layout]  # fresh tensors: poisoned in place, through their strides
    assert k.stride() != k.contiguous().stride() and do.stride() != do.contiguous().stride()
    k[1, H - 1, T - 1, D - 1] = float("nan")  # the last key: only the last row sees it
    do[0, 0, 0, 0] = float("nan")
    got, want = [], []
    for out, ins in ((got, (q, k, v, do)), (want, tuple(t.contiguous() for t in (q, k, v, do)))):
        o, lse = flash_forward(*ins[:3], pol, scale)
        out += [o, lse, *flash_backward(ins[3], *ins[:3], o, lse, pol, scale)]
    for a, b, what in zip(got, want, ("o", "lse", "dq", "dk", "dv")):
        assert torch.equal(a.isnan(), b.isnan()) and torch.equal(a.nan_to_num(), b.nan_to_num()), what
    assert got[0][1, H - 1, -1].isnan().any() and got[0][1, H - 1, :-1].isfinite().all()
