"""Precision policies: every rounding point of FlashAttention-2, named and switchable.

A :class:`PrecisionPolicy` says, for each intermediate of the tiled forward and backward passes,
whether it is rounded to BF16 or kept in FP32 (paper Sec. 2 and 3.2). The forward, for each query
block and each key block (Alg. 1 of FlashAttention-2, in the paper's notation)::

    S      = Q_b K_bᵀ · scale                      scores        (policy.scores)
    rm     = rowmax(S);  SFA may raise it           row_max       (policy.sfa)
    m_new  = max(m, rm)                             running max   (policy.accumulator)
    p_bar  = exp(S − m_new)                         P̄             (policy.p_bar: as fed to P̄V)
    o_bar  = p_bar V_b                              Ō             (policy.o_block)
    l      = exp(m − m_new)·l + rowsum(p_bar)       row sums      (policy.accumulator)
    o      = exp(m − m_new)·o + o_bar               output acc.   (policy.accumulator)
    O      = o / l;  lse = m + log(l)               stored O      (policy.o_store)

and the backward recomputes ``P = exp(S − lse)`` per block pair, with GEMM outputs and gradient
accumulators in BF16 or FP32 (``policy.backward``) and ``delta`` from one of three formulas
(``policy.delta``, Sec. 3.2 isolation experiments).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

BF16, FP32 = "bf16", "fp32"
_PRECISIONS = (BF16, FP32)
DELTA_FORMULAS = ("o_stored", "dp_p", "o_fp32", "o_exact")


@dataclass(frozen=True)
class SFA:
    """The paper's softmax fix (Sec. 4, Eq. 6): where a row has ``rs > 1`` scores within ``eps`` of its
    max ``rm``, use ``m = beta·rm`` (rm > 0) or ``m = 0`` (rm < 0) instead of ``rm``, so every P̄ < 1."""

    beta: float = 2.0
    eps: float = 1e-3

    def __post_init__(self):
        if not (isinstance(self.beta, (int, float)) and math.isfinite(self.beta) and self.beta > 1.0):
            raise ValueError(f"SFA beta must be a finite number > 1 (so that m = beta·rm > rm), got {self.beta!r}")
        if not (isinstance(self.eps, (int, float)) and math.isfinite(self.eps) and self.eps >= 0.0):
            raise ValueError(f"SFA eps must be a finite number >= 0, got {self.eps!r}")


@dataclass(frozen=True)
class PrecisionPolicy:
    """Where flash attention rounds to BF16. See the module docstring for the algorithm.

    * ``scores``: S in BF16 (``bf16(bf16(QKᵀ)·scale)``, the paper's autocast einsum) or FP32.
    * ``p_bar``: P̄ as fed to the P̄V product, rounded to BF16 or kept FP32.
    * ``o_block``: each block's Ō = P̄V rounded to BF16 or kept FP32 (FP32 accumulation inside the GEMM).
    * ``accumulator``: storage of the running o, l and m (BF16 tensors in the paper's code).
    * ``o_store``: precision of the output O returned and saved for the backward.
    * ``delta``: ``"o_stored"`` = rowsum(dO∘O) with the stored O; ``"dp_p"`` = rowsum(dP∘P);
      ``"o_fp32"`` = rowsum(dO∘O) with O recomputed in the backward from the forward's scores S, with P̄,
      P̄V, row sums and O in FP32 (:func:`delta_o_policy`: only the rounding of P̄V and O is gone);
      ``"o_exact"`` = the same with O recomputed from FP32 scores as well. With BF16 scores that O is not
      the one whose P the backward differentiates (P = exp(S − lse) from the BF16 S), so this δ is
      inconsistent with P (:func:`lpfa.mechanism.delta_formulas` measures it).
    * ``backward``: BF16 GEMM outputs and gradient accumulators (the paper's code) or FP32 (FA2).
    * ``block_q``, ``block_k``: tile sizes; ``None`` = one block over the whole sequence (no tiling).
    * ``row_sum_clamp``: the paper clamps each block's row sum at 1e-10; ``None`` = no clamp.
    * ``sfa``: :class:`SFA` or ``None``.
    * ``fp32_heads``: heads computed entirely with the ``fp32`` policy (the "outlier heads" experiment).
    """

    scores: str = FP32
    p_bar: str = BF16
    o_block: str = FP32
    accumulator: str = FP32
    o_store: str = BF16
    delta: str = "o_stored"
    backward: str = FP32
    block_q: int | None = 128
    block_k: int | None = 128
    row_sum_clamp: float | None = None
    sfa: SFA | None = None
    fp32_heads: frozenset[int] = field(default_factory=frozenset)
    name: str = "custom"

    def __post_init__(self):
        for f in ("scores", "p_bar", "o_block", "accumulator", "o_store", "backward"):
            v = getattr(self, f)
            if v not in _PRECISIONS:
                raise ValueError(f"PrecisionPolicy.{f} must be 'bf16' or 'fp32', got {v!r}")
        if self.delta not in DELTA_FORMULAS:
            raise ValueError(f"PrecisionPolicy.delta must be one of {DELTA_FORMULAS}, got {self.delta!r}")
        for f in ("block_q", "block_k"):
            v = getattr(self, f)
            if v is not None and not (isinstance(v, int) and v >= 1):
                raise ValueError(f"PrecisionPolicy.{f} must be a positive int or None (no tiling), got {v!r}")
        if self.row_sum_clamp is not None and not (math.isfinite(self.row_sum_clamp) and self.row_sum_clamp > 0):
            raise ValueError(f"row_sum_clamp must be a positive finite number or None, got {self.row_sum_clamp!r}")
        if self.sfa is not None and not isinstance(self.sfa, SFA):
            raise TypeError(f"PrecisionPolicy.sfa must be an SFA(beta, eps) or None, got {type(self.sfa).__name__}")
        heads = frozenset(self.fp32_heads)
        if any(not isinstance(h, int) or h < 0 for h in heads):
            raise ValueError(f"fp32_heads must be non-negative head indices, got {sorted(self.fp32_heads)}")
        object.__setattr__(self, "fp32_heads", heads)

    def with_(self, **changes) -> "PrecisionPolicy":
        """A copy with some fields changed (named ``custom`` unless ``name`` is given)."""
        changes.setdefault("name", f"{self.name}+custom" if self.name != "custom" else "custom")
        return replace(self, **changes)


# --------------------------------------------------------------------------------------------
# Presets (one definition each; see the docstrings for the paper section each serves)
# --------------------------------------------------------------------------------------------
PAPER = PrecisionPolicy(
    scores=BF16, p_bar=BF16, o_block=BF16, accumulator=BF16, o_store=BF16, delta="o_stored", backward=BF16,
    block_q=512, block_k=512, row_sum_clamp=1e-10, name="paper",
)
"""The authors' pure-PyTorch FlashAttention-2 under CUDA BF16 autocast, 512 × 512 blocks (Sec. 3.1):
BF16 S, m, l and o tensors; P̄ computed in FP32 and rounded to BF16 for the P̄V einsum, whose output is
BF16; in-place BF16 updates ``o ← o·c`` then ``o ← o + Ō``; BF16 backward GEMMs and accumulators."""

FA2 = PrecisionPolicy(
    scores=FP32, p_bar=BF16, o_block=FP32, accumulator=FP32, o_store=BF16, delta="o_stored", backward=FP32,
    block_q=128, block_k=128, name="fa2",
)
"""FlashAttention-2's CUDA kernel as PyTorch SDPA runs it: FP32 S, row sums and accumulators, P̄ cast
to BF16 before P̄V, O stored in BF16 (what nanoGPT users train with)."""

FP32_POLICY = PrecisionPolicy(
    scores=FP32, p_bar=FP32, o_block=FP32, accumulator=FP32, o_store=FP32, delta="o_stored", backward=FP32,
    block_q=128, block_k=128, name="fp32",
)
"""Everything in FP32 (TF32 off): the stable twin of Sec. 3.1."""

PRESETS: dict[str, PrecisionPolicy] = {
    "paper": PAPER,
    "fa2": FA2,
    "fp32": FP32_POLICY,
    # SFA validation (Sec. 4, Fig. 7)
    "paper_sfa": replace(PAPER, sfa=SFA(), name="paper_sfa"),
    "fa2_sfa": replace(FA2, sfa=SFA(), name="fa2_sfa"),
    # isolation experiments (Sec. 3.2), each a one-point change of `paper`
    "pv_fp32": replace(PAPER, p_bar=FP32, o_block=FP32, name="pv_fp32"),
    "delta_dp": replace(PAPER, delta="dp_p", name="delta_dp"),
    "o_fp32": replace(PAPER, o_block=FP32, accumulator=FP32, o_store=FP32, name="o_fp32"),
    # not in the paper: only S = QKᵀ·scale in FP32, every later rounding as `paper` (do BF16 scores make the ties?)
    "scores_fp32": replace(PAPER, scores=FP32, name="scores_fp32"),
    "delta_o_fp32": replace(PAPER, delta="o_fp32", name="delta_o_fp32"),  # O recomputed in FP32 for δ only
    # the same from FP32 scores: what "delta_o_fp32" computed up to commit 60e6089 (results/isolation says why it moved)
    "delta_o_exact": replace(PAPER, delta="o_exact", name="delta_o_exact"),
    "paper_untiled": replace(PAPER, block_q=None, block_k=None, name="paper_untiled"),
    # tiled at T = 512: 4 × 4 blocks of 128 (the isolation table's "tiling" comparison with paper_untiled)
    "paper_tiled": replace(PAPER, block_q=128, block_k=128, name="paper_tiled"),
}


def fp32_twin(policy: PrecisionPolicy) -> PrecisionPolicy:
    """The all-FP32 policy with ``policy``'s blocks: what its FP32 heads run, and the O of ``delta="o_exact"``."""
    return FP32_POLICY.with_(block_q=policy.block_q, block_k=policy.block_k, name="fp32")


def delta_o_policy(policy: PrecisionPolicy) -> PrecisionPolicy:
    """The policy whose forward recomputes O for δ when ``policy.delta`` is ``"o_fp32"`` (the same scores S,
    SFA, clamp and blocks; P̄, Ō, the accumulators and O in FP32) or ``"o_exact"`` (everything FP32)."""
    if policy.delta == "o_exact":
        return fp32_twin(policy)
    if policy.delta != "o_fp32":
        raise ValueError(f"delta_o_policy is for delta 'o_fp32' or 'o_exact', got {policy.delta!r}")
    return replace(policy, p_bar=FP32, o_block=FP32, accumulator=FP32, o_store=FP32, delta="o_stored", backward=FP32,
                   fp32_heads=frozenset(), name=f"{policy.name}:o_fp32")


def get_policy(policy: str | PrecisionPolicy) -> PrecisionPolicy:
    """A preset by name, or the policy itself."""
    if isinstance(policy, PrecisionPolicy):
        return policy
    if policy not in PRESETS:
        raise ValueError(f"unknown precision policy {policy!r}: presets are {sorted(PRESETS)}")
    return PRESETS[policy]
