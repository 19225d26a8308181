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
(``policy.delta``, Sec. 3.2 isolation experiments). ``policy.gemm`` says how every GEMM multiplies the
operands it keeps in FP32: exactly (``"ieee"``) or through BF16 tensor cores with a 3-way split (``"bf16x6"``,
:data:`GEMM_SPLIT_DOC`).

**The fields of** :class:`PrecisionPolicy`:

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
* ``exp``: how ``exp(S − m)`` is evaluated (P̄ in the forward, the rescale c = exp(m − m_new), and the backward's
  P = exp(S − lse)). ``"exp"``: exp of the difference S − m, rounded as the scores are (the paper's PyTorch code).
  ``"exp2"``: FlashAttention-2's ``scale_apply_exp2`` (csrc/flash_attn/src/softmax.h): P̄ = exp2(fma(S, log₂e,
  −fl(m·log₂e))), one FMA in FP32 whatever the scores' precision, with log₂e rounded to FP32; c =
  exp2(fl(acc(m − m_new)·log₂e)); the backward's P = exp2(fma(S, log₂e, −fl(lse·log₂e))). FlashAttention-2 folds
  the softmax scale into the FMA's constant (S unscaled, scale·log₂e); here S is already scaled, which is the same
  arithmetic bit for bit when the scale is a power of two (head dims 16, 64 and 256), and differs by the rounding of
  S·scale otherwise. At a tied maximum the FMA leaves the rounding error of fl(m·log₂e), at most half an FP32 ulp
  of m·log₂e, so P̄ there is 1 to within about |m|·2⁻²⁴ (not exactly 1 in FP32), and exactly 1 once rounded to
  BF16 (for |m| < 2¹⁵), as in FlashAttention-2.
* ``backward``: BF16 GEMM outputs and gradient accumulators (the paper's code) or FP32 (FA2).
* ``gemm``: how every GEMM (QKᵀ, P̄V; dP = dO Vᵀ, dV = Pᵀ dO, dQ = dS K, dK = dSᵀ Q) multiplies operands it
  keeps in FP32: ``"ieee"`` = exact FP32 products (``tl.dot(input_precision="ieee")``, CUDA cores) or
  ``"bf16x6"`` = each FP32 operand split into three BF16 parts and six BF16 tensor-core GEMMs summed in FP32,
  about 2⁻²³ relative error per product (:data:`GEMM_SPLIT_DOC`). Operands the policy rounds to BF16, and BF16
  inputs, are multiplied as they are either way.
* ``block_q``, ``block_k``: tile sizes; ``None`` = one block over the whole sequence (no tiling).
* ``row_sum_clamp``: the paper clamps each block's row sum at 1e-10; ``None`` = no clamp.
* ``sfa``: :class:`SFA` or ``None``.
* ``stochastic``: rounding points, of ``"scores"`` (S: the QKᵀ GEMM output and its product with the scale, in the
  forward and as the backward recomputes them; S − m and the soft-cap's roundings stay to nearest), ``"o_block"``
  (Ō), ``"accumulator"`` (the running o and l: o·c, o + Ō, o / l and l = c·l + rowsum(P̄); not m, a maximum of
  scores) and ``"o_store"`` (O), that round to BF16 stochastically instead of to nearest (a stabiliser, not in the
  paper; each must be a BF16 point of the policy).
  A value x between the BF16 neighbours a < x < b rounds to b with probability (x − a)/(b − a), so the rounding
  is unbiased. The random threshold is a hash of ``sr_seed``, the rounding point, the (batch·head, row, column)
  position (for S: query·T + key, whatever the tiling), the key block and x's BF16-truncated bits
  (:func:`lpfa.attention.reference.stochastic_round_bf16`): reproducible bit for bit, the same in the reference and
  the kernels, and insensitive to an FP32 ulp of x. The
  step is not hashed: a value that stays in the same BF16 interval at the same position rounds the same way at
  every step; the rounding is unbiased over positions (the columns a row's δ sums, the tokens a W_Q gradient
  sums), and changes wherever the values do.
* ``sr_seed``: the stochastic rounding's seed (an int in [0, 2³²)).
* ``softcap``: logit soft-capping (Gemma 2; a stabiliser, not in the paper), ``None`` = off, else a cap c > 0:
  S' = c·tanh(S·fl(1/c)) (a multiply by the FP32 reciprocal, as FlashAttention-2 caps, not a division), each of its
  three operations rounded as the scores are, and the backward's dS = dS'·(1 − t²) with t the rounded tanh. tanh is
  taken as (1 − e)/(1 + e) with e = exp2(|x|·fl(−2·log₂e)) = exp(−2|x|), in FP32 (the reference and the kernels
  alike). Part of the model, not of the precision: FP32 twins keep it.
* ``fp8``: operands of the P̄V product rounded to FP8 (float8_e4m3fn, round to nearest even), of ``"p_bar"`` and
  ``"v"``, as FlashAttention-3's FP8 forward feeds its tensor cores (not in the paper). P̄ ≤ 1 is
  converted without a scale (in place of its BF16 rounding; values below 2⁻¹⁰ become 0). V gets one FP32 scale
  per (batch, head, key block), s = max|V_j| / 448 (block quantization): V_j ≈ s·e4m3(V_j / s), and Ō =
  (P̄ V8_j)·s, the product accumulated in FP32 and multiplied by s in FP32. The row sum l keeps the FP32 P̄, so
  numerator and denominator see different P̄ (the pattern of flash-attention PR #2721). **Emulated** in the
  PyTorch reference only (the Triton kernels refuse it); forward only, since FlashAttention-3 has no FP8
  backward: the backward is the policy's own, on the BF16 inputs. Q and K stay as they are (FlashAttention-3
  quantizes them too). Non-finite V entries pass unquantized, so they reach only the rows that see them.
* ``fp32_heads``: heads computed entirely with the ``fp32`` policy (the "outlier heads" experiment).
* ``dose``, ``dose_sign``: the dose-response experiment on δ's error (not in the paper). The backward uses
  δ = δ_ref + dose·s·(δ − δ_ref), with δ from ``delta`` and δ_ref from O recomputed in FP32 from the same
  scores (``delta="o_fp32"``); s = +1 (``"bias"``: the policy's own error, amplified) or a fresh random ±1
  per row and call (``"control"``: the same magnitude without the bias). The forward is untouched; dose 1 with
  ``"bias"`` is the policy itself, dose 0 is ``delta="o_fp32"``. :func:`delta_dose_active` says when it acts.

**SFA where Eq. 6 is silent** (:class:`SFA`, per key block):

* **rm = 0** has no case in Eq. 6, and **0 < |rm| < 2⁻⁹/(β − 1)** (or |rm| < 2⁻⁹ for rm < 0) shifts so little
  that bf16(exp(S − m)) rounds back to 1. ``min_shift`` (default 2⁻⁸, :data:`MIN_SHIFT`) raises m to at least
  rm + 2⁻⁸ there, which keeps P̄ < 1; ``min_shift=0`` is Eq. 6 as printed.
* **A tie split across a key block boundary** (one maximal key in each block) has rs = 1 in both blocks: SFA
  does not see it, and P̄ = 1 stays in each block's P̄V product. ``AttentionStats.tied_rows`` counts whole-row
  ties of S, ``sfa_rows`` the rows SFA shifted; ``p_bar_ones`` counts the P̄ = 1 entries that remain.
* **Large |rm|**: the shift multiplies the block's P̄ by exp(rm − m) (= exp(−(β − 1)·rm) for rm > 0,
  exp(rm) for rm < 0). O = o / l is unchanged in exact arithmetic, but once that factor reaches the
  paper's row-sum clamp (1e-10, ``paper_sfa``: from |rm| ≈ 23/(β − 1), resp. |rm| ≈ 23) the clamp takes over
  and the output is silently scaled down, and once P̄ underflows in FP32 (``fa2_sfa``: |rm| ≈ 87/(β − 1),
  resp. 87) the row is lost (0/0). This is SFA as published; ``AttentionStats.attenuated_rows`` and
  ``zeroed_rows`` (and the training diagnostics' ``silenced_fraction``) count such rows at every step.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field, fields, replace

import numpy as np
import torch

BF16, FP32 = "bf16", "fp32"
_PRECISIONS = (BF16, FP32)
DELTA_FORMULAS = ("o_stored", "dp_p", "o_fp32", "o_exact")
DOSE_SIGNS = ("bias", "control")
EXPS = ("exp", "exp2")  # PrecisionPolicy.exp: exp(S − m), or FlashAttention-2's exp2 of one FMA
IEEE, BF16X6 = "ieee", "bf16x6"
GEMMS = (IEEE, BF16X6)
SR_POINTS = ("scores", "o_block", "accumulator", "o_store")  # the rounding points that may round stochastically
FP8_POINTS = ("p_bar", "v")  # the P̄V product's operands that PrecisionPolicy.fp8 may round to float8_e4m3fn
E4M3_MAX = 448.0  # float8_e4m3fn's largest finite value (1.75·2⁸); its unit roundoff is 2⁻⁴, its smallest subnormal 2⁻⁹


MIN_SHIFT = 2.0**-8
"""SFA's smallest shift m − rm: bf16(exp(−x)) rounds to 1 for x < 2⁻⁹, so a shift of 2⁻⁸ is the least that keeps
every shifted P̄ < 1 (exp(−2⁻⁸) rounds to 1 − 2⁻⁸ in BF16)."""


GEMM_SPLIT_DOC = """``gemm="bf16x6"``: FP32 products through BF16 tensor cores (the experiments' fast FP32 twin).

Each FP32 operand x of a GEMM is split into three BF16 values (round to nearest even)::

    x0 = bf16(x),   x1 = bf16(x − x0),   x2 = bf16(x − x0 − x1)

``x − x0`` and ``x − x0 − x1`` are exact in FP32, and x2 needs no rounding, so x = x0 + x1 + x2 exactly for
every finite FP32 x up to BF16's overflow threshold (|x| < 2¹²⁸·(1 − 2⁻⁹) ≈ 3.39e38) whose x2 is not below
BF16's subnormal range (|x| ≳ 2⁻¹¹⁰): with u = 2⁻⁸ (BF16's unit roundoff), |x1| ≤ u·|x| and |x2| ≤ u²·|x|.
A product a·b = Σᵢⱼ aᵢ·bⱼ is taken as the six terms with i + j ≤ 2, summed in FP32 (the small terms first)::

    a·b ≈ a1·b1 + a0·b2 + a2·b0 + a0·b1 + a1·b0 + a0·b0          (6 BF16 GEMMs, FP32 accumulation)

Each aᵢ·bⱼ is exact in FP32 (8 × 8 significant bits), as on a tensor core. The three dropped terms
a1·b2 + a2·b1 + a2·b2 bound the error of one product by (2u³ + u⁴)·|a·b| ≈ 2⁻²³·|a·b|, against IEEE FP32's
rounding of one product, ≤ 2⁻²⁴·|a·b|; both are then summed in FP32, which adds the usual K·2⁻²⁴·Σ|aₖbₖ|
(K = the GEMM's inner length; here each product's six terms are six of the summands). So a bf16x6 GEMM is
accurate to about twice FP32's unit roundoff per product, i.e. FP32 level, not BF16 level (the name counts
BF16 GEMMs, as Triton's ``tf32x3`` does; three terms, i + j ≤ 1, would stop at u² = 2⁻¹⁶).

An operand that is BF16 already (BF16 inputs; P̄, P or dS rounded by the policy) has x1 = x2 = 0, so only the
other operand is split and its three products a·b0, a·b1, a·b2 are exact. The kernels skip the vanishing
terms (``SPLIT_A``/``SPLIT_B`` in :func:`lpfa.attention.triton_common.gemm_mode`); with both operands BF16
the GEMM is the one plain BF16 GEMM it always was, so ``gemm`` changes nothing where the policy rounds both.

Non-finite operands: where x0 is ±inf or NaN, x1 = x2 = 0 and the cross terms use x0 = 0, so only a0·b0
carries the inf or NaN, as an IEEE product would (inf·b for b ≠ 0; inf·0 = NaN). Hardware caveat (GPU
only): a tensor core's FP32 accumulation is not an IEEE sum in every respect (its alignment of the addends
truncates); the GPU tests measure the result against the reference instead of assuming it.
"""


@dataclass(frozen=True)
class SFA:
    """The paper's softmax fix (Sec. 4, Eq. 6), applied per key block as in the paper's tiled code: in a key block
    where a row has ``rs > 1`` visible scores within ``eps`` of the block's row max ``rm``, subtract ``m = beta·rm``
    (rm > 0) or ``m = 0`` (rm < 0) instead of ``rm``, and at least ``rm + min_shift``, so every P̄ of the block is
    < 1. What it does where Eq. 6 is silent (rm = 0, tiny |rm|, ties across blocks, large |rm|) is in the module
    docstring.
    """

    beta: float = 2.0
    eps: float = 1e-3
    min_shift: float = MIN_SHIFT

    def __post_init__(self):
        for f, ok, what in (("beta", lambda x: x > 1.0, "a finite number > 1 (so that m = beta·rm > rm)"),
                            ("eps", lambda x: x >= 0.0, "a finite number >= 0"),
                            ("min_shift", lambda x: x >= 0.0, "a finite number >= 0 (0: Eq. 6 as printed)")):
            x = getattr(self, f)
            if not (_is_number(x) and math.isfinite(x) and ok(x)):
                raise ValueError(f"SFA.{f}={x!r}: expected {what}")
            object.__setattr__(self, f, float(x))


def _is_number(x) -> bool:
    """A real number, NumPy scalars included, but not a bool."""
    return isinstance(x, numbers.Real) and not isinstance(x, (bool, np.bool_))


@dataclass(frozen=True)
class PrecisionPolicy:
    """Where flash attention rounds to BF16: one field per rounding point of the module docstring's algorithm
    (paper Sec. 2, 3.2), plus the tiling, the paper's row-sum clamp, SFA and the switches of the experiments beyond
    the paper (stochastic rounding, soft-cap, FP8, FP32 heads, δ dose); each field is described in the module
    docstring. Frozen; every field is checked on construction (a ValueError or TypeError naming the field and what
    it expects), sets are stored as frozensets. :meth:`with_` makes a changed copy.
    """

    scores: str = FP32
    p_bar: str = BF16
    o_block: str = FP32
    accumulator: str = FP32
    o_store: str = BF16
    delta: str = "o_stored"
    backward: str = FP32
    gemm: str = IEEE
    block_q: int | None = 128
    block_k: int | None = 128
    row_sum_clamp: float | None = None
    sfa: SFA | None = None
    stochastic: frozenset[str] = field(default_factory=frozenset)
    sr_seed: int = 0
    softcap: float | None = None
    fp8: frozenset[str] = field(default_factory=frozenset)
    fp32_heads: frozenset[int] = field(default_factory=frozenset)
    dose: float = 1.0
    dose_sign: str = "bias"
    exp: str = "exp"
    name: str = "custom"

    def __post_init__(self):
        for f in ("scores", "p_bar", "o_block", "accumulator", "o_store", "backward"):
            v = getattr(self, f)
            if not (isinstance(v, str) and v in _PRECISIONS):
                raise ValueError(f"PrecisionPolicy.{f}={v!r}: expected 'bf16' or 'fp32'")
        if not (isinstance(self.gemm, str) and self.gemm in GEMMS):
            raise ValueError(f"PrecisionPolicy.gemm={self.gemm!r}: expected 'ieee' (exact FP32 products) or 'bf16x6' "
                             "(3-way BF16 split)")
        if not (isinstance(self.delta, str) and self.delta in DELTA_FORMULAS):
            raise ValueError(f"PrecisionPolicy.delta={self.delta!r}: expected one of "
                             f"{', '.join(map(repr, DELTA_FORMULAS))}")
        if not (isinstance(self.exp, str) and self.exp in EXPS):
            raise ValueError(f"PrecisionPolicy.exp={self.exp!r}: expected 'exp' (exp(S − m)) or 'exp2' "
                             "(FlashAttention-2's exp2(fma(S, log2 e, −m·log2 e)))")
        for f in ("block_q", "block_k"):
            v = getattr(self, f)
            if v is not None and not (isinstance(v, numbers.Integral) and not isinstance(v, (bool, np.bool_))
                                      and v >= 1):
                raise ValueError(f"PrecisionPolicy.{f}={v!r}: expected a positive int, or None for no tiling")
            if v is not None:
                object.__setattr__(self, f, int(v))
        c = self.row_sum_clamp
        if c is not None and not (_is_number(c) and math.isfinite(c) and c > 0):
            raise ValueError(f"PrecisionPolicy.row_sum_clamp={c!r}: expected a positive finite number, "
                             "or None for no clamp")
        if c is not None:
            object.__setattr__(self, "row_sum_clamp", float(c))
        if self.sfa is not None and not isinstance(self.sfa, SFA):
            raise TypeError(f"PrecisionPolicy.sfa={self.sfa!r}: expected an SFA(beta, eps) or None")
        self._set_of("stochastic", SR_POINTS, "rounding points")
        for p in sorted(self.stochastic):
            if getattr(self, p) != BF16:
                raise ValueError(f"PrecisionPolicy.stochastic names {p!r}, but {p}={getattr(self, p)!r}: only a BF16 "
                                 "rounding point can round stochastically")
        sd = self.sr_seed
        if not (isinstance(sd, numbers.Integral) and not isinstance(sd, (bool, np.bool_)) and 0 <= sd < 2**32):
            raise ValueError(f"PrecisionPolicy.sr_seed={sd!r}: expected an int in [0, 2**32)")
        object.__setattr__(self, "sr_seed", int(sd))
        cap = self.softcap
        if cap is not None and not (_is_number(cap) and math.isfinite(cap) and cap > 0):
            raise ValueError(f"PrecisionPolicy.softcap={cap!r}: expected a positive finite number, "
                             "or None for no soft-capping")
        if cap is not None:
            object.__setattr__(self, "softcap", float(cap))
        self._set_of("fp8", FP8_POINTS, "P̄V operands")
        if "p_bar" in self.fp8 and self.p_bar != BF16:
            raise ValueError(f"PrecisionPolicy.fp8 names 'p_bar', but p_bar={self.p_bar!r}: FP8 P̄ replaces a "
                             "low-precision P̄, so p_bar must be 'bf16'")
        heads = self.fp32_heads
        if isinstance(heads, (str, bytes)) or not isinstance(heads, (set, frozenset, list, tuple, range)) or any(
                not isinstance(h, numbers.Integral) or isinstance(h, (bool, np.bool_)) or h < 0 for h in heads):
            raise TypeError(f"PrecisionPolicy.fp32_heads={heads!r}: expected a set of non-negative head indices (ints)")
        object.__setattr__(self, "fp32_heads", frozenset(int(h) for h in heads))
        if not (_is_number(self.dose) and math.isfinite(self.dose) and self.dose >= 0):
            raise ValueError(f"PrecisionPolicy.dose={self.dose!r}: expected a finite number >= 0 "
                             "(1: the policy's own δ)")
        object.__setattr__(self, "dose", float(self.dose))
        if not (isinstance(self.dose_sign, str) and self.dose_sign in DOSE_SIGNS):
            raise ValueError(f"PrecisionPolicy.dose_sign={self.dose_sign!r}: expected 'bias' or 'control'")
        if not isinstance(self.name, str):
            raise TypeError(f"PrecisionPolicy.name={self.name!r}: expected a str")

    def _set_of(self, name: str, choices: tuple[str, ...], what: str) -> None:
        """Check that field ``name`` is a set (or list/tuple) of ``choices`` and store it as a frozenset."""
        pts = getattr(self, name)
        if isinstance(pts, (str, bytes)) or not isinstance(pts, (set, frozenset, list, tuple)) or any(
                p not in choices for p in pts):
            raise ValueError(f"PrecisionPolicy.{name}={pts!r}: expected a set of {what} from "
                             f"{', '.join(map(repr, choices))}")
        object.__setattr__(self, name, frozenset(pts))

    def with_(self, **changes) -> "PrecisionPolicy":
        """A copy with some fields changed (named ``custom`` unless ``name`` is given)."""
        names = [f.name for f in fields(self)]
        unknown = sorted(set(changes) - set(names))
        if unknown:
            raise TypeError(f"PrecisionPolicy has no field {unknown[0]!r}; its fields: {', '.join(names)}")
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
    scores=FP32, p_bar=BF16, o_block=FP32, accumulator=FP32, o_store=BF16, delta="o_stored", exp="exp2",
    backward=FP32, block_q=128, block_k=128, name="fa2",
)
"""FlashAttention-2's CUDA kernel as PyTorch SDPA runs it: FP32 S, row sums and accumulators, P̄ = exp2 of one
FMA (``exp="exp2"``), cast to BF16 before P̄V, O stored in BF16 (what nanoGPT users train with). Runs committed
before 2026-12-05 evaluated its P̄ as exp(S − m) (``exp="exp"``): the same values within an FP32 ulp or two."""

FP32_POLICY = PrecisionPolicy(
    scores=FP32, p_bar=FP32, o_block=FP32, accumulator=FP32, o_store=FP32, delta="o_stored", backward=FP32,
    block_q=128, block_k=128, name="fp32",
)
"""Everything in FP32 (TF32 off): the stable twin of Sec. 3.1."""

FP32_SPLIT = replace(FP32_POLICY, gemm=BF16X6, name="fp32_split")
"""``fp32`` with its FP32 GEMMs through BF16 tensor cores, each FP32 operand split in three BF16 parts: the
experiments' FP32 twin (:data:`lpfa.experiments.FP32_TWIN`; error bound in :data:`GEMM_SPLIT_DOC`)."""

PRESETS: dict[str, PrecisionPolicy] = {
    "paper": PAPER,
    "fa2": FA2,
    "fp32": FP32_POLICY,
    "fp32_split": FP32_SPLIT,
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
    # not in the paper (a stabiliser of the paper-recipe run): `paper` with Ō, the running o and l and O rounded
    # stochastically
    "paper_sr": replace(PAPER, stochastic=frozenset({"o_block", "accumulator", "o_store"}), name="paper_sr"),
    # `paper` with only the scores S rounded stochastically: the rounding that makes the ties (P̄ = 1) unbiased
    "paper_sr_scores": replace(PAPER, stochastic=frozenset({"scores"}), name="paper_sr_scores"),
    # logit soft-capping at Gemma 2's cap for attention logits (50), on `paper` and on the fast FP32 twin
    "paper_softcap": replace(PAPER, softcap=50.0, name="paper_softcap"),
    "fp32_softcap": replace(FP32_SPLIT, softcap=50.0, name="fp32_softcap"),
    # tiled at T = 512: 4 × 4 blocks of 128 (the isolation table's "tiling" comparison with paper_untiled)
    "paper_tiled": replace(PAPER, block_q=128, block_k=128, name="paper_tiled"),
}

EMULATED: dict[str, PrecisionPolicy] = {
    # FlashAttention-3's FP8 forward on FA2's rounding (FP32 scores and accumulators): P̄ and V in e4m3, or P̄ only
    "fa3_fp8": replace(FA2, fp8=frozenset(FP8_POINTS), name="fa3_fp8"),
    "fa3_fp8_p": replace(FA2, fp8=frozenset({"p_bar"}), name="fa3_fp8_p"),
}
"""Presets that only the PyTorch reference runs (``PrecisionPolicy.fp8``: FP8 is emulated there, not in the Triton
kernels); :func:`get_policy` resolves them like :data:`PRESETS`."""


def reseeded(policy: PrecisionPolicy, step: int) -> PrecisionPolicy:
    """``policy`` with its stochastic rounding drawn afresh for training step ``step``: ``sr_seed`` + ``step``
    mod 2³², the name kept (lpfa.train's ``sr_reseed``)."""
    return policy.with_(sr_seed=(policy.sr_seed + step) % 2**32, name=policy.name)


def is_fp32_level(policy: PrecisionPolicy) -> bool:
    """True where ``policy`` rounds nothing to BF16 and differs from :data:`FP32_POLICY` at most in its name and in how
    its GEMMs reach FP32 accuracy (``gemm``: IEEE FP32, or split BF16 parts as in ``fp32_split``)."""
    return policy.with_(name=FP32_POLICY.name, gemm=FP32_POLICY.gemm) == FP32_POLICY


def fp32_twin(policy: PrecisionPolicy) -> PrecisionPolicy:
    """The all-FP32 policy with ``policy``'s blocks and soft-cap: what its FP32 heads run, and the O of
    ``delta="o_exact"``."""
    return FP32_POLICY.with_(block_q=policy.block_q, block_k=policy.block_k, softcap=policy.softcap, name="fp32")


def delta_o_policy(policy: PrecisionPolicy) -> PrecisionPolicy:
    """The policy whose forward recomputes O for δ when ``policy.delta`` is ``"o_fp32"`` (the same scores S, their
    stochastic rounding included, SFA, clamp and blocks; P̄, Ō, the accumulators and O in FP32) or ``"o_exact"``
    (everything FP32)."""
    if policy.delta == "o_exact":
        return fp32_twin(policy)
    if policy.delta != "o_fp32":
        raise ValueError(f"delta_o_policy is for delta 'o_fp32' or 'o_exact', got {policy.delta!r}")
    return replace(policy, p_bar=FP32, o_block=FP32, accumulator=FP32, o_store=FP32, delta="o_stored", backward=FP32,
                   stochastic=policy.stochastic & {"scores"}, fp8=frozenset(), fp32_heads=frozenset(), dose=1.0,
                   dose_sign="bias", name=f"{policy.name}:o_fp32")


def delta_dose_active(policy: PrecisionPolicy) -> bool:
    """Whether the backward doses δ's error (``policy.dose``): anything but dose 1 with the ``"bias"`` sign."""
    return not (policy.dose == 1.0 and policy.dose_sign == "bias")


def dose_delta(delta: torch.Tensor, delta_ref: torch.Tensor, policy: PrecisionPolicy) -> torch.Tensor:
    """δ_ref + dose·s·(δ − δ_ref) (see :class:`PrecisionPolicy`), in float64 and rounded once to FP32; s is +1, or
    for ``dose_sign="control"`` a fresh ±1 per row drawn from torch's default generator on δ's device."""
    err = delta.double() - delta_ref.double()
    if policy.dose_sign == "control":
        err = err * (torch.randint(0, 2, delta.shape, device=delta.device) * 2 - 1)
    return (delta_ref.double() + policy.dose * err).float()


def get_policy(policy: str | PrecisionPolicy) -> PrecisionPolicy:
    """A preset by name (:data:`PRESETS` or the reference-only :data:`EMULATED`), or the policy itself."""
    if isinstance(policy, PrecisionPolicy):
        return policy
    names = ", ".join(sorted({**PRESETS, **EMULATED}))
    if not isinstance(policy, str):
        raise TypeError(f"policy={policy!r}: expected a preset name ({names}) or a PrecisionPolicy; "
                        "build one from fields with PrecisionPolicy(**fields)")
    if policy in EMULATED:
        return EMULATED[policy]
    if policy not in PRESETS:
        raise ValueError(f"policy={policy!r}: unknown precision policy; expected a preset name ({names}) "
                         "or a PrecisionPolicy")
    return PRESETS[policy]
