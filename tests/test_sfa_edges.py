"""SFA (Eq. 6) where the equation leaves gaps: rm = 0, tiny |rm|, a tie split across key blocks, large |rm|.

Scores are built exactly: scale 1, q = a·e₀ and k_j = b_j·e₀, so S_ij = a·b_j with BF16-exact a, b_j. Each case
checks the P̄ = 1 count (``AttentionStats.p_bar_ones``), SFA's own count (``sfa_rows``), the silenced-row counts,
and that the Triton kernel (interpreter) computes the same output (up to a BF16 ulp from FP32 summation order).
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: no GPU here

import math

import pytest
import torch

from lpfa.attention import PRESETS, SFA, AttentionStats, attention
from lpfa.attention.policy import MIN_SHIFT

pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]

D = 16


def scores_inputs(keys: list[float], a: float = 1.0):
    """q, k, v (1, 1, T, D) with S[i, j] = a·keys[j] for every row i (visible keys j ≤ i), V random."""
    T = len(keys)
    q = torch.zeros(1, 1, T, D)
    k = torch.zeros(1, 1, T, D)
    q[..., 0] = a
    k[0, 0, :, 0] = torch.tensor(keys)
    v = torch.randn(1, 1, T, D, generator=torch.Generator().manual_seed(0))
    return q.bfloat16(), k.bfloat16(), v.bfloat16()


def same_output(a, b):
    """Triton (interpreter) against the reference: FP32 sums in another order may flip a BF16 rounding of O by one
    ulp (tests/test_attention_triton_fwd.py), so equal within 2⁻⁷ of the output's scale, and finite alike."""
    a, b = a.float(), b.float()
    assert torch.equal(torch.isfinite(a), torch.isfinite(b))
    fin = torch.isfinite(b)
    assert ((a[fin] - b[fin]).abs() <= 2**-7 * max(b[fin].abs().max().item(), 1.0)).all()


def run(q, k, v, pol, backend="reference"):
    st = AttentionStats()
    o = attention(q, k, v, scale=1.0, policy=pol, stats=st, backend=backend)
    return o, st


def untiled_sfa(base="paper_untiled", **sfa):
    return PRESETS[base].with_(sfa=SFA(**sfa), name="sfa_test")


@pytest.mark.parametrize("rm", [0.0, 2.0**-11, -(2.0**-11), 2.0**-10, -(2.0**-10)])
def test_min_shift_keeps_every_shifted_p_bar_below_one(rm):
    """(a) rm = 0 has no case in Eq. 6, and (b) 0 < |rm| < 2⁻⁹ shifts too little: P̄ rounds back to 1. With
    ``min_shift=0`` (Eq. 6 as printed) the tied keys keep P̄ = 1; the default shift of 2⁻⁸ removes them."""
    keys = [rm, rm, -1.0, -2.0, rm - 0.5, -3.0, -0.75, -1.5]  # keys 0 and 1 tie at the max rm in rows ≥ 1
    q, k, v = scores_inputs(keys)
    printed = untiled_sfa(min_shift=0.0)
    _, st = run(q, k, v, printed)
    assert st.sfa_rows.item() == len(keys) - 1  # every row from 1 on is tied, and SFA fires...
    assert st.p_bar_ones.item() >= 2 * (len(keys) - 1)  # ...but both tied keys keep P̄ = 1 in every tied row
    o, st = run(q, k, v, untiled_sfa())  # default min_shift = 2⁻⁸
    assert st.sfa_rows.item() == len(keys) - 1
    assert st.p_bar_ones.item() == 1  # only row 0 (one visible key, no tie) keeps its P̄ = 1
    o_fp32 = attention(q, k, v, scale=1.0, policy="fp32", backend="reference")
    torch.testing.assert_close(o.float(), o_fp32.float(), rtol=2**-7, atol=2**-7)  # the shift changes P̄, not O
    for pol in (printed, untiled_sfa()):
        o_ref, _ = run(q, k, v, pol)
        o_tri, st_tri = run(q, k, v, pol, backend="triton")
        same_output(o_tri, o_ref)


def test_min_shift_validation_and_default():
    assert SFA().min_shift == MIN_SHIFT == 2.0**-8
    assert torch.tensor(math.exp(-MIN_SHIFT)).bfloat16().item() < 1.0
    assert torch.tensor(math.exp(-(2.0**-10))).bfloat16().item() == 1.0  # why 2⁻⁹-ish shifts are not enough
    with pytest.raises(ValueError, match=r"SFA.min_shift=-1.0: expected"):
        SFA(min_shift=-1.0)


def test_tie_split_across_key_blocks_is_invisible_to_sfa():
    """(c) SFA acts per key block (the paper's tiled code): a tie whose two keys fall in different blocks has
    rs = 1 in each, so both keep P̄ = 1. ``tied_rows`` (ties of whole rows of S) counts it, ``sfa_rows`` does
    not; untiled, SFA sees and removes it."""
    keys = [-1.0 - j / 16 for j in range(32)]  # distinct (no other ties), BF16-exact
    keys[15] = keys[16] = 2.0  # the tie straddles the boundary of 16-key blocks
    q, k, v = scores_inputs(keys)
    tiled = PRESETS["fa2_sfa"].with_(block_q=16, block_k=16, name="fa2_sfa16")
    rows_with_both = 32 - 16  # rows 16..31 see keys 15 and 16
    o, st = run(q, k, v, tiled)
    assert st.tied_rows.item() >= rows_with_both
    assert st.sfa_rows.item() == 0
    assert st.p_bar_ones.item() >= 2 * rows_with_both
    same_output(run(q, k, v, tiled, backend="triton")[0], o)
    untiled = PRESETS["fa2_sfa"].with_(block_q=None, block_k=None, name="fa2_sfa_untiled")
    _, st = run(q, k, v, untiled)
    assert st.sfa_rows.item() == rows_with_both and st.p_bar_ones.item() == 16  # rows 0..15: their max, untied


@pytest.mark.parametrize("base, rm, silenced", [
    ("paper_untiled", 30.0, "attenuated_rows"),  # exp(−30) < the 1e-10 clamp: O scaled down
    ("paper_untiled", -30.0, "attenuated_rows"),  # m = 0: P̄ = exp(−30) as well
    ("paper_untiled", 10.0, None),  # exp(−10) > 1e-10: the clamp stays idle, O is right
    ("fa2", 110.0, "zeroed_rows"),  # exp(−110) underflows FP32: every P̄ = 0, O = 0/0
])
def test_large_rm_silences_rows_and_is_counted(base, rm, silenced):
    """(d) SFA's shift scales every P̄ of a tied row by exp(rm − m); O = o/l would not change, but the paper's
    clamp (from |rm| ≈ 23) or FP32 underflow (from ≈ 87) takes over. The stats count the rows."""
    keys = [rm, rm] + [rm - 1.0] * 6
    q, k, v = scores_inputs(keys)
    pol = untiled_sfa(base)
    o, st = run(q, k, v, pol)
    o_fp32 = attention(q, k, v, scale=1.0, policy="fp32", backend="reference").float()
    tied_rows = len(keys) - 1
    assert st.sfa_rows.item() == tied_rows
    if silenced is None:
        assert st.attenuated_rows.item() == st.zeroed_rows.item() == 0
        torch.testing.assert_close(o.float(), o_fp32, rtol=2**-6, atol=2**-6)
    else:
        assert getattr(st, silenced).item() == tied_rows
        assert st.silenced_fraction().item() == pytest.approx(tied_rows / len(keys))
        wrong = ~torch.isclose(o.float()[0, 0, 1:], o_fp32[0, 0, 1:], rtol=0.1, atol=0.1)
        assert wrong.any(dim=-1).all()  # every silenced row's output is wrong (scaled down, or NaN)
    st_tri = AttentionStats()
    o_tri = attention(q, k, v, scale=1.0, policy=pol, stats=st_tri, backend="triton")
    assert torch.equal(torch.isfinite(o_tri), torch.isfinite(o))
    assert st_tri.attenuated_rows.item() == st.attenuated_rows.item()
    assert st_tri.zeroed_rows.item() == st.zeroed_rows.item()


def test_training_diagnostics_record_silenced_rows():
    """probe_record carries silenced_fraction per layer and head (0 here: small logits), computed by
    diagnostics.row_stats, which counts SFA's silenced rows as the attention op's stats do."""
    from lpfa.diagnostics import probe_record, row_stats
    from lpfa.model import GPT, GPTConfig

    torch.manual_seed(0)
    m = GPT(GPTConfig(n_layer=2, n_head=2, n_embd=32, vocab_size=64, block_size=16, attn_policy="paper_sfa"))
    rec = probe_record(m, torch.randint(0, 64, (2, 16)))
    assert len(rec["silenced_fraction"]) == 2 and len(rec["silenced_fraction"][0]) == 2
    assert all(f == 0.0 for row in rec["silenced_fraction"] for f in row)
    q, k, v = scores_inputs([30.0, 30.0] + [29.0] * 6)  # tied at rm = 30: the clamp silences rows 1..7
    st = row_stats({"q": q * 4.0, "k": k}, PRESETS["paper_sfa"])  # row_stats scales by 1/sqrt(16)
    assert st.silenced_fraction().item() == pytest.approx(7 / 8)
