"""GPT-2 with nanoGPT semantics, and attention whose precision is chosen per layer.

Learned position embeddings, pre-LayerNorm blocks, GELU MLP, tied token embedding / LM head, init
N(0, 0.02) with residual projections scaled by 1/√(2·n_layer), optional biases (the paper uses
none). Parameter names are nanoGPT's, so nanoGPT checkpoints load as they are and Hugging Face GPT-2
weights load with nanoGPT's transposes (:mod:`lpfa.checkpoints`).

Attention per layer (``GPTConfig.attn_backend``, ``attn_policy``, ``layer_policies``, ``fp32_heads``):

* ``"lpfa"`` — :func:`lpfa.attention.attention` with a precision policy (a preset name), optionally
  a different policy (or another backend) in chosen layers and FP32 for chosen heads (the paper's
  Sec. 3.2 isolation experiments);
* ``"sdpa"`` — PyTorch's ``scaled_dot_product_attention`` (what nanoGPT users train with);
* ``"sdpa_fp32"`` — the same on q, k, v cast to FP32 with autocast off (TF32 is off in training): a fast
  FP32-attention twin, numerically the ``fp32`` policy up to FP32 summation order;
* ``"math"`` — plain materialised softmax attention in the input precision.

Stabilisers, for comparison with the paper's discussion: ``qk_norm`` (LayerNorm on q and k per head),
``gated_attn`` (a sigmoid output gate per head and channel, computed from the block input), and QK-clip
(:meth:`GPT.qk_clip_`, rescaling W_q and W_k of heads whose max logit exceeds a threshold; ``lpfa.train``'s
``qk_clip`` applies it after every step from the logits that each layer records, :meth:`GPT.track_max_logits`).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, fields, replace

import torch
import torch.nn as nn
import torch.nn.functional as F

from lpfa.attention import attention, get_policy
from lpfa.diagnostics import head_max_logits

SIZES = {
    # name: (n_layer, n_head, n_embd)
    "gpt2-s": (12, 12, 768),
    "gpt2-m": (24, 16, 1024),
    "repro": (8, 8, 512),  # a smaller model whose BF16 logits run away within a GPU run
    "tiny": (4, 4, 128),
    "debug": (2, 2, 64),
}
ATTN_BACKENDS = ("lpfa", "sdpa", "sdpa_fp32", "math")


def unwrap(model):
    """The module under DDP (``.module``) and ``torch.compile`` (``._orig_mod``) wrappers, however nested."""
    while True:
        inner = getattr(model, "_orig_mod", None) or (getattr(model, "module", None) if type(model).__name__ in
                                                      ("DistributedDataParallel", "DataParallel") else None)
        if not isinstance(inner, torch.nn.Module):
            return model
        model = inner


@dataclass
class GPTConfig:
    vocab_size: int = 50304  # GPT-2's 50257 padded to a multiple of 64, as nanoGPT does
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = False
    attn_backend: str = "lpfa"
    attn_policy: str = "fa2"
    layer_policies: dict[int, str] = field(default_factory=dict)  # layer -> preset, overrides attn_policy
    fp32_heads: dict[int, list[int]] = field(default_factory=dict)  # layer -> heads computed in FP32
    delta_dose: float = 1.0  # PrecisionPolicy.dose of the dosed layers (the dose-response experiment); 1 = off
    delta_dose_sign: str = "bias"  # PrecisionPolicy.dose_sign: bias or control
    delta_dose_layers: list[int] = field(default_factory=list)  # the dosed layers; [] = every lpfa layer
    qk_norm: bool = False
    gated_attn: bool = False
    gelu_approximate: str = "none"  # "tanh" for OpenAI/Hugging Face GPT-2 weights ("gelu_new")
    attn_assume_finite: bool = False  # lpfa attention skips its non-finite checks (attention(assume_finite=True))

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.attn_backend not in ATTN_BACKENDS:
            raise ValueError(f"attn_backend must be one of {ATTN_BACKENDS}, got {self.attn_backend!r}")
        # JSON turns int keys into strings: accept both
        self.layer_policies = {int(k): v for k, v in self.layer_policies.items()}
        self.fp32_heads = {int(k): [int(h) for h in v] for k, v in self.fp32_heads.items()}
        for layer, name in [(None, self.attn_policy), *self.layer_policies.items()]:
            if layer is None or name not in ATTN_BACKENDS:
                get_policy(name)  # clear error for unknown presets
            if layer is not None and not 0 <= layer < self.n_layer:
                raise ValueError(f"layer_policies names layer {layer}; the model has layers 0..{self.n_layer - 1}")
        for layer, heads in self.fp32_heads.items():
            if not 0 <= layer < self.n_layer or any(not 0 <= h < self.n_head for h in heads):
                raise ValueError(f"fp32_heads {{{layer}: {heads}}} is outside {self.n_layer} layers × "
                                 f"{self.n_head} heads")

    @classmethod
    def from_size(cls, size: str, **overrides) -> "GPTConfig":
        if size not in SIZES:
            raise ValueError(f"unknown model size {size!r}: choose one of {sorted(SIZES)}")
        n_layer, n_head, n_embd = SIZES[size]
        return cls(n_layer=n_layer, n_head=n_head, n_embd=n_embd, **overrides)

    @classmethod
    def from_dict(cls, d: dict) -> "GPTConfig":
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown GPTConfig fields {sorted(unknown)}")
        return cls(**d)

    def to_dict(self) -> dict:
        return asdict(self)

    def layer_backend(self, layer: int) -> str:
        """The attention backend of ``layer``: ``layer_policies`` may name a preset (the ``lpfa`` backend with
        that policy) or another backend (``sdpa``, ``sdpa_fp32``, ``math``) for that layer alone."""
        name = self.layer_policies.get(layer)
        if name is None:
            return self.attn_backend
        return name if name in ATTN_BACKENDS else "lpfa"

    def policy(self, layer: int):
        """The precision policy of ``layer`` (with its FP32 heads) when its backend is ``lpfa``, else None."""
        if self.layer_backend(layer) != "lpfa":
            return None
        pol = get_policy(self.layer_policies.get(layer, self.attn_policy))
        heads = self.fp32_heads.get(layer)
        if heads:
            pol = pol.with_(fp32_heads=frozenset(heads), name=pol.name)
        dosed = self.delta_dose != 1.0 or self.delta_dose_sign != "bias"
        if dosed and (not self.delta_dose_layers or layer in self.delta_dose_layers):
            sign = "c" if self.delta_dose_sign == "control" else ""
            pol = pol.with_(dose=self.delta_dose, dose_sign=self.delta_dose_sign,
                            name=f"{pol.name}:dose{self.delta_dose:g}{sign}")
        return pol


def _register(policy) -> None:
    """Give ``policy`` a key for the Triton op before ``torch.compile`` traces it
    (:func:`lpfa.attention.kernels.register`)."""
    # lpfa.attention.kernels imports torch._dynamo (about 1 s): loaded by the first model that needs it
    from lpfa.attention.kernels import register

    register(policy)


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (PyTorch's has no bias=False before 2.1; nanoGPT's class)."""

    def __init__(self, ndim: int, bias: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, x):
        return F.layer_norm(x, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        self.layer, self.n_head, self.n_embd = layer, config.n_head, config.n_embd
        self.head_dim = config.n_embd // config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.dropout = config.dropout
        self.backend = config.layer_backend(layer)
        self.policy = config.policy(layer)
        self.assume_finite = config.attn_assume_finite
        if self.policy is not None:  # a key for the Triton op before torch.compile traces it
            _register(self.policy)
        self.q_norm = LayerNorm(self.head_dim, config.bias) if config.qk_norm else None
        self.k_norm = LayerNorm(self.head_dim, config.bias) if config.qk_norm else None
        self.gate = nn.Linear(config.n_embd, config.n_embd, bias=config.bias) if config.gated_attn else None
        self.capture = None  # a dict here receives q, k and v of the next forward (x, o, do too with "all": True)
        # QK-clip (lpfa.train's qk_clip): with track_max_logit on, every forward raises max_logit to its heads' largest
        # logit (lpfa.diagnostics.head_max_logits); train_step resets it before each step and clips after it
        self.track_max_logit = False
        self.register_buffer("max_logit", torch.full((config.n_head,), float("-inf")), persistent=False)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, self.head_dim).transpose(1, 2) for t in (q, k, v))  # (B, H, T, D)
        if self.q_norm is not None:  # under CUDA autocast LayerNorm returns FP32: back to v's (the autocast) dtype
            q, k = self.q_norm(q).to(v.dtype), self.k_norm(k).to(v.dtype)
        if self.track_max_logit:
            self.max_logit.copy_(torch.maximum(self.max_logit, head_max_logits(q.detach(), k.detach())))
        cap = self.capture
        if cap is not None:
            cap["q"], cap["k"], cap["v"] = q.detach(), k.detach(), v.detach()
            if cap.get("all"):  # lpfa.replay: the layer input, the output O and (after backward) dO
                cap["x"] = x.detach()
        if self.backend == "lpfa":
            y = attention(q, k, v, is_causal=True, policy=self.policy, assume_finite=self.assume_finite)
        elif self.backend == "sdpa":
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                               dropout_p=self.dropout if self.training else 0.0)
        elif self.backend == "sdpa_fp32":
            with torch.autocast(device_type=x.device.type, enabled=False):
                y = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True,
                                                   dropout_p=self.dropout if self.training else 0.0)
        else:
            att = (q @ k.transpose(-2, -1)) / math.sqrt(self.head_dim)
            att = att.masked_fill(torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
            y = F.softmax(att, dim=-1) @ v
        if cap is not None and cap.get("all"):
            cap["o"] = y.detach()
            if y.requires_grad:
                y.register_hook(lambda g: cap.__setitem__("do", g.detach()))
        y = y.to(x.dtype).transpose(1, 2).contiguous().view(B, T, C)
        if self.gate is not None:
            y = y * torch.sigmoid(self.gate(x))
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate=config.gelu_approximate)
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, layer: int):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, config.bias)
        self.attn = CausalSelfAttention(config, layer)
        self.ln_2 = LayerNorm(config.n_embd, config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                drop=nn.Dropout(config.dropout),
                h=nn.ModuleList([Block(config, i) for i in range(config.n_layer)]),
                ln_f=LayerNorm(config.n_embd, config.bias),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for name, p in self.named_parameters():
            if name.endswith("c_proj.weight"):
                nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module):
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.transformer.wpe.weight.numel() if non_embedding else n

    def forward(self, idx, targets=None):
        B, T = idx.shape
        if T > self.config.block_size:
            raise ValueError(f"sequence length {T} exceeds the model's block_size {self.config.block_size}")
        pos = torch.arange(T, device=idx.device)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        logits = self.lm_head(x)
        loss = None
        if targets is not None:
            logits_hp = logits if logits.dtype == torch.float64 else logits.float()  # FP32 or better for the loss
            loss = F.cross_entropy(logits_hp.view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    def set_layer_policy(self, layer: int, name: str) -> None:
        """Run ``layer``'s attention with ``name`` from the next forward on (a preset or a backend, as a
        ``GPTConfig.layer_policies`` value): ``lpfa.train``'s ``on_warning`` switch. The config records it, so the
        model's checkpoints carry it; a model compiled with ``torch.compile`` must be re-traced
        (``torch._dynamo.reset()``)."""
        if not (isinstance(layer, int) and 0 <= layer < self.config.n_layer):
            raise ValueError(f"layer={layer!r}: expected a layer 0..{self.config.n_layer - 1}")
        changed = replace(self.config, layer_policies={**self.config.layer_policies, layer: name})  # validated there
        self.config = changed
        attn = self.transformer.h[layer].attn
        attn.backend, attn.policy = changed.layer_backend(layer), changed.policy(layer)
        if attn.policy is not None:
            _register(attn.policy)

    def w_q(self, layer: int) -> torch.Tensor:
        """W_Q of ``layer`` as (n_head, head_dim, n_embd): q_h = W_Q[h] x (paper Figs. 3, 11)."""
        attn = self.transformer.h[layer].attn
        return attn.c_attn.weight[: self.config.n_embd].view(self.config.n_head, attn.head_dim, self.config.n_embd)

    @torch.no_grad()
    def qk_clip_(self, max_logits: torch.Tensor, tau: float = 100.0) -> int:
        """QK-clip (Kimi K2's MuonClip with α = ½): for each (layer, head) whose max attention logit exceeds ``tau``,
        scale its W_Q and W_K rows (and their biases) by √(tau / max_logit), so that logit q·k becomes tau.
        ``max_logits``: (n_layer, n_head); a NaN one clips nothing. Returns the number of heads clipped."""
        m = torch.as_tensor(max_logits, dtype=torch.float32).to(self.transformer.wte.weight.device)
        over = m > tau
        factor = torch.where(over, torch.sqrt(tau / m), torch.ones_like(m))
        C = self.config.n_embd
        for layer, block in enumerate(self.transformer.h):
            attn = block.attn
            f = factor[layer].repeat_interleave(attn.head_dim)  # (C,): each head's factor on its rows
            for p in (attn.c_attn.weight, attn.c_attn.bias):
                if p is not None:
                    rows = f.to(p.dtype).view(-1, *([1] * (p.dim() - 1)))
                    p[:C] *= rows  # W_Q (and b_Q)
                    p[C : 2 * C] *= rows  # W_K (and b_K)
        return int(over.sum())

    def track_max_logits(self, on: bool = True) -> None:
        """Let every layer's attention record its heads' largest logit on each forward (QK-clip's input)."""
        for block in self.transformer.h:
            block.attn.track_max_logit = on

    @torch.no_grad()
    def max_logits(self, reset: bool = False) -> torch.Tensor:
        """(n_layer, n_head) the largest logits recorded since the last reset (−inf where nothing was recorded)."""
        out = torch.stack([block.attn.max_logit.clone() for block in self.transformer.h])
        if reset:
            for block in self.transformer.h:
                block.attn.max_logit.fill_(float("-inf"))
        return out
