"""Stochastic rounding at the scores' and the O-path rounding points (``PrecisionPolicy.stochastic``, a stabiliser).

The reference's hash against a plain-Python lowbias32, the rounding's unbiasedness against float64, its edge
values, the kernels against the reference bit for bit (Triton's interpreter), and the policy's checks.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: no GPU here

import math
import random

import pytest
import torch

from lpfa.attention import PRESETS, PrecisionPolicy
from lpfa.attention.reference import forward as ref_forward
from lpfa.attention.reference import mix32, stochastic_round_bf16

pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def _lowbias32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & 0xFFFFFFFF
    x ^= x >> 15
    x = (x * 0x846CA68B) & 0xFFFFFFFF
    return x ^ (x >> 16)


def test_mix32_is_lowbias32_on_ints_and_tensors():
    rng = random.Random(torch.seed())
    xs = [0, 1, 2**31, 2**32 - 1] + [rng.getrandbits(32) for _ in range(2000)]
    want = [_lowbias32(x) for x in xs]
    assert [mix32(x) for x in xs] == want
    assert mix32(torch.tensor(xs, dtype=torch.int64)).tolist() == want


@pytest.mark.parametrize("frac", [0.0, 1 / 3, 0.5, 0.9])
def test_stochastic_rounding_rounds_up_with_the_fraction(frac):
    """x = a + frac·(b − a) between BF16 neighbours a < b rounds to b in a share frac of 2¹⁸ positions (5σ), never
    elsewhere; negative x mirror it (rounding away from zero)."""
    a = 1.5
    ulp = 2.0**-7  # BF16 spacing in [1, 2)
    x = torch.full((2, 2, 1024, 64), a + frac * ulp, dtype=torch.float64).float()
    for sign in (1.0, -1.0):
        y = stochastic_round_bf16(sign * x, seed=torch.seed() % 2**32, point="o_block", j=3, row0=17)
        assert set(y.abs().unique().tolist()) <= {a, a + ulp}
        up = (y.abs() > a).double().mean().item()
        sigma = math.sqrt(max(frac * (1 - frac), 1e-12) / y.numel())
        assert abs(up - frac) <= 5 * sigma + 1e-12, (sign, up, frac)


def test_stochastic_rounding_is_unbiased_where_nearest_is_not():
    """On values just above a BF16 value (low 16 bits below one half), round to nearest always rounds down: its mean
    error is −(mean offset); stochastic rounding's mean error is within 5 standard errors of 0 (float64 oracle)."""
    seed = torch.seed() % 2**32
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(1, 4, 512, 64, generator=g).bfloat16().double()
    ulp = torch.ldexp(torch.ones_like(base), torch.frexp(base)[1] - 8)  # BF16 spacing at each value
    x = (base + 0.3 * ulp * torch.rand(base.shape, generator=g, dtype=torch.float64)).float()
    err_sr = (stochastic_round_bf16(x, seed, "o_store", 0, 0).double() - x.double()) / ulp
    err_rne = (x.bfloat16().double() - x.double()) / ulp
    assert err_rne.mean().item() < -0.1  # the bias that nearest rounding has here
    assert abs(err_sr.mean().item()) <= 5 * err_sr.std().item() / math.sqrt(x.numel()), (err_sr.mean().item(), seed)


def test_stochastic_rounding_keeps_bf16_values_and_non_finite_ones():
    x = torch.tensor([0.0, -0.0, 1.0, -2.5, 2.0**127, float("inf"), -float("inf"), float("nan"),
                      torch.finfo(torch.bfloat16).tiny]).view(1, 1, 1, -1)
    y = stochastic_round_bf16(x, 123, "o_scale", 1, 0)
    assert torch.equal(y[..., :7].view(torch.int32), x[..., :7].view(torch.int32))  # exact BF16 values: unchanged
    assert math.isnan(y[0, 0, 0, 7].item()) and y[0, 0, 0, 8].item() == x[0, 0, 0, 8].item()


@pytest.mark.parametrize("T,block,block_m,block_n", [(45, 16, 16, 16), (33, 32, 16, 16), (20, None, 16, 16)])
def test_kernel_rounds_stochastically_as_the_reference(T, block, block_m, block_n):
    """``paper_sr`` through the Triton forward (interpreter) against the reference on fresh inputs: the same O bits
    except where an FP32 ulp between their sums crosses a threshold (at most 1% of entries, by one BF16 ulp); the
    same call twice is bit-identical, and another seed rounds differently."""
    from lpfa.attention.triton_fwd import flash_forward

    pol = PRESETS["paper_sr"] if block is None else PRESETS["paper_sr"].with_(block_q=block, block_k=block)
    seed = torch.seed() % 2**31
    pol = pol.with_(sr_seed=seed % 2**32)
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, 2, T, 16, generator=g).bfloat16() for _ in range(3))
    launch = dict(block_m=block_m, block_n=block_n)
    o, lse = flash_forward(q, k, v, pol, 0.3, **launch)
    ro, rlse = ref_forward(q.float(), k.float(), v.float(), pol, 0.3)
    diff = o.float() != ro
    assert diff.double().mean().item() <= 0.01, (int(diff.sum()), f"seed={seed}")
    ulp = torch.ldexp(torch.ones_like(ro), torch.frexp(ro)[1] - 8)
    assert ((o.float() - ro).abs() <= ulp).all(), f"seed={seed}"
    assert torch.equal(flash_forward(q, k, v, pol, 0.3, **launch)[0], o)
    other = flash_forward(q, k, v, pol.with_(sr_seed=(seed + 1) % 2**32), 0.3, **launch)[0]
    assert not torch.equal(other, o)
    nearest = flash_forward(q, k, v, pol.with_(stochastic=frozenset()), 0.3, **launch)[0]
    assert not torch.equal(nearest, o)


@pytest.mark.parametrize("fields,match", [
    (dict(stochastic={"p_bar"}),
     r"stochastic=\{'p_bar'\}: expected a set of rounding points from 'scores', 'o_block', 'accumulator', 'o_store'"),
    (dict(stochastic="o_block"), r"stochastic='o_block': expected a set of rounding points"),
    (dict(stochastic={"o_block"}, o_block="fp32"),
     r"stochastic names 'o_block', but o_block='fp32': only a BF16 rounding point"),
    (dict(stochastic={"scores"}, scores="fp32"),
     r"stochastic names 'scores', but scores='fp32': only a BF16 rounding point"),
    (dict(sr_seed=-1), r"sr_seed=-1: expected an int in \[0, 2\*\*32\)"),
    (dict(sr_seed=1.5), r"sr_seed=1.5: expected an int"),
])
def test_policy_refuses_bad_stochastic_fields(fields, match):
    base = dict(scores="bf16", p_bar="bf16", o_block="bf16", accumulator="bf16", o_store="bf16")
    with pytest.raises(ValueError, match=match):
        PrecisionPolicy(**{**base, **fields})


def test_scores_round_stochastically_by_position_whatever_the_tiling():
    """``stochastic={"scores"}``: each score is one of the two BF16 neighbours of bf16(QKᵀ)'s product with the scale,
    the choice hashed by (batch·head, query·T + key), so a block of S equals the same entries of the whole matrix
    (the backward's tiles recompute exactly the forward's S), a batch element alone equals its slice of the batch,
    and the rounding is unbiased: over 2¹⁶ entries the mean of S − S_fp32 is within 5 standard errors of 0, where
    rounding to nearest of values in one position of their BF16 interval is not."""
    from lpfa.attention.reference import _scores

    pol = PRESETS["paper_sr_scores"].with_(sr_seed=torch.seed() % 2**32)
    assert pol.stochastic == {"scores"}
    g = torch.Generator().manual_seed(torch.seed() % 2**31)
    B, H, T, D = 2, 2, 37, 16
    q, k = (torch.randn(B, H, T, D, generator=g).bfloat16().float() for _ in range(2))
    whole = _scores(q, k, 0.25, pol)
    assert torch.equal(_scores(q[:, :, 5:21], k[:, :, 16:32], 0.25, pol, 5, 16, T), whole[:, :, 5:21, 16:32])
    assert torch.equal(_scores(q[1:], k[1:], 0.25, pol, bh0=H), whole[1:])
    nearest = _scores(q, k, 0.25, pol.with_(stochastic=frozenset()))
    assert not torch.equal(whole, nearest)
    # x between BF16 neighbours: the scaled GEMM output in FP32, its two roundings in float64
    x = torch.full((1, 4, 128, 128), 1.5 + 2.0**-7 / 3, dtype=torch.float64).float()
    ones = torch.eye(128).expand(1, 4, 128, 128)
    s = _scores(x, ones, 1.0, pol)  # S = bf16_sr(bf16_sr(x·I)·1): x·I = x exactly
    err = s.double() - x.double()
    assert set(s.unique().tolist()) <= {1.5, 1.5 + 2.0**-7}
    assert abs(err.mean().item()) <= 5 * err.std().item() / math.sqrt(err.numel())
    assert (_scores(x, ones, 1.0, pol.with_(stochastic=frozenset())) == 1.5).all()  # nearest: always down
