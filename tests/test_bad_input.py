"""Bad input to the attention op, PrecisionPolicy and SFA, as someone porting SDPA code passes it.

One table: each row builds a call and says what must come out, either the specific one-line error (exception type
and a regex naming the value and what is expected) or, for inputs that are fine (NumPy scalars, lists of heads),
the correct result. The training CLI, damaged run folders and notebook parameters: test_bad_input_train.py.
"""

import os

os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported: the Triton rows run in the interpreter

import math

import numpy as np
import pytest
import torch

from lpfa.attention import PRESETS, SFA, AttentionStats, PrecisionPolicy, attention

pytestmark = [pytest.mark.filterwarnings("ignore::RuntimeWarning"),
              pytest.mark.filterwarnings("ignore::DeprecationWarning")]


def qkv(B=1, H=2, T=8, D=16, dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(0)
    return tuple(torch.randn(B, H, T, D, generator=g).to(dtype) for _ in range(3))


Q, K, V = qkv()
MASK = torch.ones(8, 8, dtype=torch.bool).tril()
OK = None  # the row's call must succeed (its check says what the result must be)

ATTENTION = [
    # SDPA's positional order: q, k, v, attn_mask, dropout_p, is_causal, scale
    ("sdpa positional mask", lambda: attention(Q, K, V, MASK), TypeError,
     r"takes q, k, v positionally.*1 more positional argument\(s\) \(Tensor\)"),
    ("sdpa positional None", lambda: attention(Q, K, V, None), TypeError,
     r"1 more positional argument\(s\) \(NoneType\).*by name"),
    ("sdpa positional all", lambda: attention(Q, K, V, None, 0.0, True), TypeError, r"3 more positional argument\(s\)"),
    ("attn_mask given", lambda: attention(Q, K, V, attn_mask=MASK), ValueError,
     r"attn_mask of type Tensor: expected None"),
    ("dropout", lambda: attention(Q, K, V, dropout_p=0.1), ValueError, r"dropout_p=0.1: expected 0.0"),
    ("dropout string", lambda: attention(Q, K, V, dropout_p="0"), ValueError, r"dropout_p='0': expected 0.0"),
    ("gqa", lambda: attention(Q, K, V, enable_gqa=True), ValueError, r"enable_gqa=True: expected False"),
    ("is_causal int", lambda: attention(Q, K, V, is_causal=1), TypeError, r"is_causal=1: expected True or False"),
    ("is_causal str", lambda: attention(Q, K, V, is_causal="yes"), TypeError,
     r"is_causal='yes': expected True or False"),
    ("is_causal None", lambda: attention(Q, K, V, is_causal=None), TypeError,
     r"is_causal=None: expected True or False"),
    ("scale zero", lambda: attention(Q, K, V, scale=0.0), ValueError, r"scale=0.0: expected a positive finite number"),
    ("scale negative", lambda: attention(Q, K, V, scale=-1), ValueError, r"scale=-1: expected a positive finite"),
    ("scale nan", lambda: attention(Q, K, V, scale=math.nan), ValueError, r"scale=nan: expected a positive finite"),
    ("scale inf", lambda: attention(Q, K, V, scale=math.inf), ValueError, r"scale=inf: expected"),
    ("scale bool", lambda: attention(Q, K, V, scale=True), ValueError,
     r"scale=True: expected a positive finite number"),
    ("scale str", lambda: attention(Q, K, V, scale="0.25"), ValueError, r"scale='0.25': expected"),
    ("scale tensor", lambda: attention(Q, K, V, scale=torch.tensor(0.25)), ValueError,
     r"scale=tensor\(0.2500\): expected"),
    ("policy dict", lambda: attention(Q, K, V, policy={"scores": "bf16"}), TypeError,
     r"policy=\{'scores': 'bf16'\}: expected a preset name \(delta_dp, .*fa2.*\) or a PrecisionPolicy; build one"),
    ("policy int", lambda: attention(Q, K, V, policy=3), TypeError, r"policy=3: expected a preset name"),
    ("policy None", lambda: attention(Q, K, V, policy=None), TypeError, r"policy=None: expected a preset name"),
    ("policy unknown", lambda: attention(Q, K, V, policy="fp16"), ValueError,
     r"policy='fp16': unknown precision policy; expected a preset name \(.*paper_sfa.*\)"),
    ("stats dict", lambda: attention(Q, K, V, stats={}), TypeError,
     r"stats of type dict: expected an lpfa.attention.AttentionStats or None"),
    ("stats class", lambda: attention(Q, K, V, stats=AttentionStats), TypeError, r"stats of type type: expected"),
    ("backend", lambda: attention(Q, K, V, backend="cuda"), ValueError,
     r"backend='cuda': expected 'auto', 'reference' or 'triton'"),
    ("backend None", lambda: attention(Q, K, V, backend=None), ValueError, r"backend=None: expected"),
    ("numpy q", lambda: attention(Q.float().numpy(), K, V), TypeError, r"q must be a torch.Tensor, got ndarray"),
    ("3-D q", lambda: attention(Q[0], K[0], V[0]), ValueError,
     r"q must have shape \(batch, heads, seq_len, head_dim\), got \(2, 8, 16\) \(3-D\)"),
    ("int dtype", lambda: attention(Q.int(), K.int(), V.int()), TypeError,
     r"q has dtype torch.int32; expected torch.bfloat16 or torch.float32"),
    ("float16", lambda: attention(Q.half(), K.half(), V.half()), TypeError,
     r"q has dtype torch.float16; expected torch.bfloat16 or torch.float32"),
    ("float64", lambda: attention(Q.double(), K.double(), V.double()), TypeError, r"q has dtype torch.float64"),
    ("mixed dtypes", lambda: attention(Q, K.float(), V), TypeError,
     r"share one dtype, got torch.bfloat16, torch.float32"),
    ("gqa shapes", lambda: attention(Q, K[:, :1], V[:, :1]), ValueError,
     r"same shape \(B, H, T, D\), got \(1, 2, 8, 16\), \(1, 1, 8, 16\)"),
    ("T = 0", lambda: attention(Q[:, :, :0], K[:, :, :0], V[:, :, :0]), ValueError,
     r"seq_len and head_dim must be >= 1, got shape \(1, 2, 0, 16\)"),
    ("devices", lambda: attention(Q, K.to("meta"), V), ValueError, r"one device, got cpu, meta"),
    ("fp32 head out of range", lambda: attention(Q, K, V, policy=PRESETS["paper"].with_(fp32_heads={7})), ValueError,
     r"fp32_heads \[7\] name heads >= H = 2"),
    ("triton non-causal", lambda: attention(Q, K, V, is_causal=False, backend="triton"), ValueError,
     r"causal only \(is_causal=False is not supported\)"),
    ("triton head_dim 48", lambda: attention(*qkv(D=48), backend="triton"), ValueError,
     r"head_dim 48 is not supported here; supported: \(16, 32, 64, 128\)"),
    # fine inputs, with the result they must give
    ("numpy scale", lambda: attention(Q, K, V, scale=np.float32(0.25)), OK,
     lambda o: torch.equal(o, attention(Q, K, V, scale=0.25))),
    ("numpy bool causal", lambda: attention(Q, K, V, is_causal=np.bool_(False)), OK,
     lambda o: torch.equal(o, attention(Q, K, V, is_causal=False))),
    ("integer scale", lambda: attention(Q, K, V, scale=1), OK, lambda o: torch.equal(o, attention(Q, K, V, scale=1.0))),
    ("dropout 0 int", lambda: attention(Q, K, V, dropout_p=0), OK, lambda o: torch.equal(o, attention(Q, K, V))),
]

POLICY = [
    ("scores fp16", lambda: PrecisionPolicy(scores="fp16"), ValueError,
     r"PrecisionPolicy.scores='fp16': expected 'bf16' or 'fp32'"),
    ("p_bar None", lambda: PrecisionPolicy(p_bar=None), ValueError,
     r"PrecisionPolicy.p_bar=None: expected 'bf16' or 'fp32'"),
    ("backward torch dtype", lambda: PrecisionPolicy(backward=torch.bfloat16), ValueError,
     r"PrecisionPolicy.backward=torch.bfloat16: expected"),
    ("delta", lambda: PrecisionPolicy(delta="rowsum"), ValueError,
     r"PrecisionPolicy.delta='rowsum': expected one of 'o_stored', 'dp_p', 'o_fp32', 'o_exact'"),
    ("exp", lambda: PrecisionPolicy(exp="exp10"), ValueError,
     r"PrecisionPolicy.exp='exp10': expected 'exp' \(exp\(S − m\)\) or 'exp2'"),
    ("block 0", lambda: PrecisionPolicy(block_q=0), ValueError,
     r"PrecisionPolicy.block_q=0: expected a positive int, or None for no tiling"),
    ("block bool", lambda: PrecisionPolicy(block_q=True), ValueError,
     r"PrecisionPolicy.block_q=True: expected a positive int"),
    ("block float", lambda: PrecisionPolicy(block_k=64.0), ValueError,
     r"PrecisionPolicy.block_k=64.0: expected a positive int"),
    ("block str", lambda: PrecisionPolicy(block_k="64"), ValueError,
     r"PrecisionPolicy.block_k='64': expected a positive int"),
    ("clamp str", lambda: PrecisionPolicy(row_sum_clamp="1e-10"), ValueError,
     r"PrecisionPolicy.row_sum_clamp='1e-10': expected a positive finite number, or None"),
    ("clamp 0", lambda: PrecisionPolicy(row_sum_clamp=0.0), ValueError, r"row_sum_clamp=0.0: expected a positive"),
    ("clamp nan", lambda: PrecisionPolicy(row_sum_clamp=math.nan), ValueError, r"row_sum_clamp=nan: expected"),
    ("clamp bool", lambda: PrecisionPolicy(row_sum_clamp=True), ValueError, r"row_sum_clamp=True: expected"),
    ("sfa float", lambda: PrecisionPolicy(sfa=2.0), TypeError,
     r"PrecisionPolicy.sfa=2.0: expected an SFA\(beta, eps\) or None"),
    ("sfa dict", lambda: PrecisionPolicy(sfa={"beta": 2.0}), TypeError,
     r"PrecisionPolicy.sfa=\{'beta': 2.0\}: expected an SFA"),
    ("heads int", lambda: PrecisionPolicy(fp32_heads=3), TypeError,
     r"PrecisionPolicy.fp32_heads=3: expected a set of non-negative head indices \(ints\)"),
    ("heads negative", lambda: PrecisionPolicy(fp32_heads={-1}), TypeError,
     r"fp32_heads=\{-1\}: expected a set of non-negative"),
    ("heads str", lambda: PrecisionPolicy(fp32_heads="01"), TypeError, r"fp32_heads='01': expected a set"),
    ("heads str items", lambda: PrecisionPolicy(fp32_heads={"0"}), TypeError, r"fp32_heads=\{'0'\}: expected"),
    ("heads bool", lambda: PrecisionPolicy(fp32_heads={True}), TypeError, r"fp32_heads=\{True\}: expected"),
    ("name", lambda: PrecisionPolicy(name=3), TypeError, r"PrecisionPolicy.name=3: expected a str"),
    ("with_ typo", lambda: PRESETS["paper"].with_(socres="fp32"), TypeError,
     r"PrecisionPolicy has no field 'socres'; its fields: scores, p_bar"),
    ("sfa beta 1", lambda: SFA(beta=1.0), ValueError, r"SFA.beta=1.0: expected a finite number > 1"),
    ("sfa beta nan", lambda: SFA(beta=math.nan), ValueError, r"SFA.beta=nan: expected"),
    ("sfa beta str", lambda: SFA(beta="2"), ValueError, r"SFA.beta='2': expected"),
    ("sfa eps negative", lambda: SFA(eps=-1e-3), ValueError, r"SFA.eps=-0.001: expected a finite number >= 0"),
    ("sfa eps inf", lambda: SFA(eps=math.inf), ValueError, r"SFA.eps=inf: expected"),
    ("sfa min_shift nan", lambda: SFA(min_shift=math.nan), ValueError,
     r"SFA.min_shift=nan: expected a finite number >= 0 \(0: Eq. 6 as printed\)"),
    # fine inputs
    ("heads list", lambda: PrecisionPolicy(fp32_heads=[2, 0]), OK, lambda p: p.fp32_heads == frozenset({0, 2})),
    ("block numpy int", lambda: PrecisionPolicy(block_q=np.int64(64)), OK,
     lambda p: p.block_q == 64 and type(p.block_q) is int),
    ("sfa numpy beta", lambda: SFA(beta=np.float32(1.5)), OK, lambda s: s.beta == 1.5 and type(s.beta) is float),
]


@pytest.mark.parametrize("build, exc, expect", [r[1:] for r in ATTENTION + POLICY],
                         ids=[r[0] for r in ATTENTION + POLICY])
def test_bad_input(build, exc, expect):
    if exc is OK:
        assert expect(build())
        return
    with pytest.raises(exc, match=expect) as info:
        build()
    assert "\n" not in str(info.value), "the message must be one line"
