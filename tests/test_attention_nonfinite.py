"""NaN and ±inf in q, k or v: both backends against a float64 oracle, and against each other.

The rule (lpfa.attention.reference): a row sees only its visible keys, and a non-finite value reaches exactly
the outputs whose computation sees it. The oracle is plain float64 softmax attention whose sum over keys runs
over the visible keys only (so nothing invisible can leak in through 0·NaN). Each case poisons q in batch
element 0, k in 1 and v in 2, at one (position, feature) per head, the positions inside a 16-block and at its
edges, with NaN, +inf or −inf, for every preset, causal and not; forward and backward.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: no GPU here

import math
import zlib

import pytest
import torch

from lpfa.attention import PRESETS, attention

pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

T, D, BLOCK = 33, 16, 16
# one position per head, two heads per preset (the interpreter's time grows with heads), rotated over the presets
# so that every backend meets each: the first row, inside a block, the block edge 15 | 16, the last row
POSITION_PAIRS = [(15, 16), (0, 7), (16, 32), (7, 15), (32, 0)]
FEATURES = [5, 15]
H = 2


def _policy(name):
    pol = PRESETS[name]
    return pol if pol.block_q is None else pol.with_(block_q=BLOCK, block_k=BLOCK, name=name)


WHICH = ("q", "k", "v")  # the tensor poisoned in batch element 0, 1, 2


def _inputs(value, positions, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v, do = (torch.randn(len(WHICH), H, T, D, generator=g).bfloat16() for _ in range(4))
    for b, t in enumerate((q, k, v)):
        for h, (pos, feat) in enumerate(zip(positions, FEATURES)):
            t[b, h, pos, feat] = value
    return q, k, v, do


def _visible(causal):
    return torch.ones(T, T, dtype=torch.bool).tril() if causal else torch.ones(T, T, dtype=torch.bool)


def oracle_finite(q, k, v, causal, clamp, softcap=None):
    """Elementwise isfinite of float64 softmax attention summed over visible keys only. With the paper's row-sum
    clamp, a row whose visible scores are all −inf is 0/clamp = 0 (finite) instead of 0/0. With a soft-cap c the
    scores are c·tanh(S / c): ±inf become ±c, finite, and only NaN survives."""
    vis = _visible(causal)
    s = (q.double() @ k.double().transpose(-1, -2)) / math.sqrt(D)
    if softcap is not None:
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(~vis, -math.inf)
    p = torch.softmax(s, dim=-1)
    terms = p[..., None] * v.double()[:, :, None, :, :]  # (B, H, T, T, D)
    o = torch.where(vis[..., None], terms, torch.zeros((), dtype=torch.float64)).sum(dim=-2)
    if clamp:
        all_masked = (s == -math.inf).all(dim=-1)
        o = torch.where(all_masked[..., None], torch.zeros_like(o), o)
    return torch.isfinite(o)


def clean_gradients(which, positions, causal):
    """Index rule: which entries of dq, dk, dv must stay finite (nothing non-finite reaches them)."""
    vis = _visible(causal)
    poisoned = torch.zeros(H, T, dtype=torch.bool)
    for h, pos in enumerate(positions):
        poisoned[h, pos] = True
    if which == "q":
        dirty_rows = poisoned
    else:  # a row is dirty when it sees a poisoned key
        dirty_rows = (vis.double() @ poisoned.double().T).T > 0
    # dq_i needs row i clean; dk_j, dv_j need every row that sees j clean, and k_j, v_j themselves finite
    dq_ok = ~dirty_rows
    key_seen_by_dirty = (dirty_rows.double() @ vis.double()) > 0
    dkv_ok = ~key_seen_by_dirty & ~(poisoned if which != "q" else torch.zeros_like(poisoned))
    return dq_ok, dkv_ok


def _run(q, k, v, do, pol, causal, backend):
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    o = attention(q, k, v, is_causal=causal, policy=pol, backend=backend)
    o.backward(do.to(o.dtype))
    return o.detach().float(), q.grad.float(), k.grad.float(), v.grad.float()


VALUES = [math.nan, math.inf, -math.inf]


def _triton_case(value, name) -> bool:
    """Whether the Triton kernels run this (value, preset) case against the reference (each run takes seconds in the
    interpreter): one value per preset, rotated, so that every preset meets the kernels and each value meets them on a
    third of the presets, the SFA, clamp and soft-cap ones among them (every case checks the reference against the
    float64 oracle)."""
    names = sorted(PRESETS)
    return names.index(name) % len(VALUES) == [repr(x) for x in VALUES].index(repr(value))  # (NaN != NaN)


def test_every_value_meets_the_kernels_on_the_presets_that_change_them():
    for value in VALUES:
        met = [n for n in PRESETS if _triton_case(value, n)]
        assert len(met) >= len(PRESETS) // len(VALUES)
    for name in PRESETS:
        assert sum(_triton_case(v, name) for v in VALUES) == 1
    special = {n for n, p in PRESETS.items() if p.sfa or p.row_sum_clamp is not None or p.softcap is not None}
    for value in VALUES:
        assert {n for n in special if _triton_case(value, n)}, value


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("value", VALUES, ids=["nan", "+inf", "-inf"])
def test_nonfinite_reaches_only_what_sees_it(value, name, causal):
    pol = _policy(name)
    positions = POSITION_PAIRS[sorted(PRESETS).index(name) % len(POSITION_PAIRS)]
    q, k, v, do = _inputs(value, positions, seed=zlib.crc32(repr((value, name)).encode()))
    backends = ["reference", "triton"] if causal and _triton_case(value, name) else ["reference"]
    outs = {b: _run(q, k, v, do, pol, causal, b) for b in backends}

    o_ref, dq, dk, dv = outs["reference"]
    want = oracle_finite(q, k, v, causal, clamp=pol.row_sum_clamp is not None, softcap=pol.softcap)
    if pol.fp32_heads:
        pytest.fail("presets have no FP32 heads")
    assert torch.equal(torch.isfinite(o_ref), want), "reference: finite outputs differ from the float64 oracle"
    for b, which in enumerate(WHICH):
        if pol.softcap is None or which == "v" or math.isnan(value):  # a soft-cap turns ±inf scores into ±c
            assert not torch.isfinite(o_ref[b]).all(), f"the poisoned {which} reached no output"
        dq_ok, dkv_ok = clean_gradients(which, positions, causal)
        for gname, g, ok in (("dq", dq[b], dq_ok), ("dk", dk[b], dkv_ok), ("dv", dv[b], dkv_ok)):
            leaked = ok[:, :, None] & ~torch.isfinite(g)
            assert not leaked.any(), f"reference {gname}, {which} poisoned: non-finite where nothing non-finite is seen"

    if "triton" in outs:
        for part, a, b in zip(("O", "dq", "dk", "dv"), outs["triton"], outs["reference"]):
            assert torch.equal(torch.isfinite(a), torch.isfinite(b)), \
                f"{part}: backends disagree on which entries are finite"
            fin = torch.isfinite(b)
            m = b[fin].abs().max().item() if fin.any() else 0.0
            err = (a[fin] - b[fin]).abs().max().item() if fin.any() else 0.0
            assert err <= 2**-5 * max(m, 1.0), f"{part}: finite entries differ by {err} (max |ref| {m})"


def test_masked_minus_inf_key_keeps_rows_finite():
    """A −inf score is a masked key: rows that see it, with other finite scores, stay finite and equal the
    attention without that key."""
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, 1, 8, 16, generator=g) for _ in range(3))
    q[..., 0] = q[..., 0].abs() + 0.5  # q·k = −inf at key 2 for every row: key 2 is masked
    k2 = k.clone()
    k2[0, 0, 2, 0] = -math.inf
    for backend in ("reference", "triton"):
        o = attention(q, k2, v, policy="fp32", backend=backend).float()
        assert torch.isfinite(o[0, 0, 3:]).all()  # rows 3.. see key 2 and others
        keep = [0, 1, 3, 4, 5, 6, 7]
        s = (q @ k.transpose(-1, -2) / 4.0)[..., keep]
        s = s.masked_fill(torch.tensor(keep)[None, :] > torch.arange(8)[:, None], -math.inf)
        want = torch.softmax(s.double(), -1) @ v[..., keep, :].double()
        torch.testing.assert_close(o[0, 0, 3:].double(), want[0, 0, 3:], rtol=1e-5, atol=1e-6)



@pytest.mark.parametrize("name", ["fa2", "paper"])
def test_nonfinite_do_reaches_only_what_sees_it(name):
    """A NaN in dO at row i reaches dQ's row i and the dK, dV rows of the keys row i sees (j <= i), nothing else,
    in both backends: the Triton kernels' fast path would spread it to every key of the tile through 0·NaN, and
    the programs it reaches run again on the non-finite path."""
    pol = _policy(name)
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    q, k, v, do = (torch.randn(1, H, T, D, generator=g).bfloat16() for _ in range(4))
    rows = [int(torch.randint(T, (1,), generator=g)) for _ in range(H)]
    for h, i in enumerate(rows):
        do[0, h, i, int(torch.randint(D, (1,), generator=g))] = math.nan
    for backend in ("reference", "triton"):
        _, dq, dk, dv = _run(q, k, v, do, pol, True, backend)
        for h, i in enumerate(rows):
            assert dq[0, h, i].isnan().any() and torch.cat([dq[0, h, :i], dq[0, h, i + 1:]]).isfinite().all()
            for grad in (dk, dv):
                assert grad[0, h, : i + 1].isnan().any(dim=-1).all(), (backend, h, i)
                assert grad[0, h, i + 1:].isfinite().all(), (backend, h, i)
