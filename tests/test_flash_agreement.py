"""The FA2 agreement bound (lpfa.attention.accuracy.flash_agreement_bound) on CPU: two FA2-style implementations that
differ only in their key blocks, and hence in which max P̄ is taken against and in the order of their sums (the
reference's ``fa2`` at 128-key and at 48-key blocks), stay inside it; an O that misses one key does not."""

import math

import pytest
import torch

from lpfa.attention import PRESETS
from lpfa.attention import reference as ref
from lpfa.attention.accuracy import agreement_with_flash, flash_agreement_bound


def _inputs(B, H, T, D, seed):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(B, H, T, D, generator=g).to(torch.bfloat16).float() for _ in range(3)]


@pytest.mark.parametrize("B,H,T,D", [(1, 3, 200, 64), (2, 2, 77, 32), (1, 2, 129, 16)])
def test_two_fa2_block_sizes_agree_within_the_bound(B, H, T, D):
    seed = torch.seed() % 2**31
    q, k, v = _inputs(B, H, T, D, seed)
    scale = 1 / math.sqrt(D)
    o_a, _ = ref.forward(q, k, v, PRESETS["fa2"], scale)
    o_b, _ = ref.forward(q, k, v, PRESETS["fa2"].with_(block_k=48, name="fa2_48"), scale)
    r = agreement_with_flash(o_a, o_b, q, k, v, scale)
    assert r["max_over_bound"] <= 1.0, (r, seed)
    assert r["bit_identical"] > 0.5, (r, seed)


def test_the_bound_rejects_an_output_that_misses_a_key():
    q, k, v = _inputs(1, 2, 64, 16, seed=3)
    v = v * 4.0  # a key whose V stands out, so that leaving it out moves O by far more than rounding does
    scale = 0.25
    o, _ = ref.forward(q, k, v, PRESETS["fa2"], scale)
    k_miss = k.clone()
    k_miss[:, :, 10] = -1e4 * q[:, :, 10:11].sum(-2).sign()  # key 10 gets ~ zero weight in row 10
    o_miss, _ = ref.forward(q, k_miss, v, PRESETS["fa2"], scale)
    d = (o.double() - o_miss.double()).abs()[:, :, 10]
    bound = flash_agreement_bound(o, o_miss, q, k, v, scale)[:, :, 10]
    assert (d > bound).any()


def test_bound_is_two_half_ulps_of_o_plus_one_ulp_of_the_weighted_v():
    q, k, v = _inputs(1, 1, 1, 16, seed=4)  # one row, one key: P = 1, a = |V|
    o = v.clone()
    bound = flash_agreement_bound(o, o, q, k, v, scale=1.0, slack=1.0)
    want = 2 ** -8 * 2 * o.double().abs() + 2 ** -7 * v.double().abs() + 1e-6
    torch.testing.assert_close(bound, want, rtol=1e-12, atol=0)
