"""A small, exact implementation of the Llama / Qwen2 decoder in plain torch.

Both the trainer and the built-in engine run this one module, which is what makes the built-in
path truly on-policy: the engine's log-probs for sampled tokens equal the trainer's forward pass
on the same weights (a test checks 1e-5). Parameter names and layouts are Hugging Face's, so a
snapshot is an ordinary HF checkpoint that transformers and SGLang load.

Two entry points:
- `forward(input_ids_bt, attention_mask_bt)`: whole sequences, causal, right padding (training).
- `forward_cached(input_ids_nt, cache, slots_n, start_pos_n)`: the engine's path, reading and
  writing a slot-indexed KV cache so that requests can join and leave a running batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

_HF_KEYS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
            "num_key_value_heads", "head_dim", "max_position_embeddings", "rms_norm_eps", "rope_theta")  # fmt: skip
"""The fields a config.json holds under their own names, in its order."""


@dataclass
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    max_position_embeddings: int = 2048
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    head_dim: int | None = None
    model_type: str = "llama"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.model_type == "qwen2":
            self.attention_bias = True  # Qwen2 always has q/k/v biases

    @property
    def eos_ids(self) -> list[int]:
        if self.eos_token_id is None:
            return []
        return list(self.eos_token_id) if isinstance(self.eos_token_id, list) else [self.eos_token_id]

    @classmethod
    def from_hf_dict(cls, d: dict) -> ModelConfig:
        model_type = d.get("model_type", "llama")
        if model_type not in ("llama", "qwen2"):
            raise ValueError(f"model_type {model_type!r} is not supported by the built-in engine and trainer "
                             "(llama, qwen2); use --engine sglang for other architectures")  # fmt: skip
        rope = d.get("rope_parameters") or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if (d.get("rope_scaling") or {}).get("rope_type", "default") != "default" or rope_type != "default":
            raise ValueError("only default RoPE is supported by the built-in model")
        keys = _HF_KEYS + ("tie_word_embeddings", "bos_token_id", "eos_token_id", "pad_token_id")
        kwargs = {k: d[k] for k in keys if d.get(k) is not None}
        kwargs["num_key_value_heads"] = d.get("num_key_value_heads") or d["num_attention_heads"]
        kwargs["rope_theta"] = float(rope.get("rope_theta", d.get("rope_theta", 10000.0)))
        return cls(**kwargs, attention_bias=bool(d.get("attention_bias", model_type == "qwen2")), model_type=model_type)

    def to_hf_dict(self) -> dict:
        arch = "Qwen2ForCausalLM" if self.model_type == "qwen2" else "LlamaForCausalLM"
        d = {"architectures": [arch], "model_type": self.model_type, **{k: getattr(self, k) for k in _HF_KEYS},
             "rope_parameters": {"rope_type": "default", "rope_theta": self.rope_theta},
             "tie_word_embeddings": self.tie_word_embeddings, "hidden_act": "silu", "attention_dropout": 0.0,
             "torch_dtype": "float32", "bos_token_id": self.bos_token_id, "eos_token_id": self.eos_token_id,
             "pad_token_id": self.pad_token_id}  # fmt: skip
        if self.model_type == "llama":
            d["attention_bias"] = self.attention_bias
            d["mlp_bias"] = False
        return d


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin of shape positions.shape + (head_dim,), computed exactly as HF Llama does."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
    freqs = positions.float()[..., None] * inv_freq
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x_bhtd: torch.Tensor, cos_btd: torch.Tensor, sin_btd: torch.Tensor) -> torch.Tensor:
    x1, x2 = x_bhtd.chunk(2, dim=-1)  # rotate_half: (-x2, x1)
    return x_bhtd * cos_btd[:, None].to(x_bhtd.dtype) + torch.cat((-x2, x1), dim=-1) * sin_btd[:, None].to(x_bhtd.dtype)


class KVCache:
    """Slot-indexed KV cache: k, v of shape [layers, slots, kv_heads, max_len, head_dim]."""

    def __init__(self, cfg: ModelConfig, num_slots: int, max_len: int, dtype=torch.float32):
        shape = (cfg.num_hidden_layers, num_slots, cfg.num_key_value_heads, max_len, cfg.head_dim)
        self.k = torch.zeros(shape, dtype=dtype)
        self.v = torch.zeros(shape, dtype=dtype)
        self.num_slots = num_slots
        self.max_len = max_len

    def copy_prefix(self, src_slot: int, dst_slot: int, length: int) -> None:
        """Reuse a cached prompt prefix: the prefix cache's only operation."""
        self.k[:, dst_slot, :, :length] = self.k[:, src_slot, :, :length]
        self.v[:, dst_slot, :, :length] = self.v[:, src_slot, :, :length]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        h, kv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, h * d, bias=cfg.attention_bias)
        self.k_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.attention_bias)
        self.v_proj = nn.Linear(cfg.hidden_size, kv * d, bias=cfg.attention_bias)
        self.o_proj = nn.Linear(h * d, cfg.hidden_size, bias=False)

    def _qkv(self, x_btc: torch.Tensor, cos, sin):
        b, t, _ = x_btc.shape
        h, kv, d = self.cfg.num_attention_heads, self.cfg.num_key_value_heads, self.cfg.head_dim
        q = self.q_proj(x_btc).view(b, t, h, d).transpose(1, 2)
        k = self.k_proj(x_btc).view(b, t, kv, d).transpose(1, 2)
        v = self.v_proj(x_btc).view(b, t, kv, d).transpose(1, 2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin), v

    def _attend(self, q, k, v, allowed_btk: torch.Tensor) -> torch.Tensor:
        groups = self.cfg.num_attention_heads // self.cfg.num_key_value_heads
        if groups > 1:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(self.cfg.head_dim)
        scores = scores.masked_fill(~allowed_btk[:, None], float("-inf"))
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
        out = torch.matmul(probs, v)
        b, _, t, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))

    def forward(self, x_btc, cos, sin, allowed_btt):
        return self._attend(*self._qkv(x_btc, cos, sin), allowed_btt)

    def forward_cached(self, x_ntc, cos, sin, layer: int, cache: KVCache, slots_n, pos_nt, allowed_ntk):
        q, k, v = self._qkv(x_ntc, cos, sin)
        n, _, t, _ = k.shape
        kl = allowed_ntk.shape[-1]
        slot_idx = slots_n[:, None].expand(n, t)
        # write this step's keys/values at their absolute positions
        cache.k[layer, slot_idx, :, pos_nt] = k.transpose(1, 2)
        cache.v[layer, slot_idx, :, pos_nt] = v.transpose(1, 2)
        # index_select on a sliced view gathers only the first kl positions, and is several times
        # faster than advanced indexing over (slot, :, :kl)
        keys = cache.k[layer][:, :, :kl].index_select(0, slots_n)
        vals = cache.v[layer][:, :, :kl].index_select(0, slots_n)
        return self._attend(q, keys, vals, allowed_ntk)


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.self_attn = Attention(cfg)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def init_weights(self, seed: int, std: float = 0.02) -> None:
        gen = torch.Generator().manual_seed(seed)
        for name, p in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "model.norm.weight":
                nn.init.ones_(p)
            elif name.endswith(".bias"):
                nn.init.zeros_(p)
            else:
                with torch.no_grad():
                    p.copy_(torch.randn(p.shape, generator=gen) * std)

    def forward(self, input_ids_bt: torch.Tensor, attention_mask_bt: torch.Tensor | None = None) -> torch.Tensor:
        """Logits [B, T, V] for right-padded sequences (padding only ever at the end)."""
        b, t = input_ids_bt.shape
        pos_bt = torch.arange(t).expand(b, t)
        cos, sin = rope_cos_sin(pos_bt, self.cfg.head_dim, self.cfg.rope_theta)
        allowed_btt = torch.ones(t, t, dtype=torch.bool).tril().expand(b, t, t)
        if attention_mask_bt is not None:
            allowed_btt = allowed_btt & attention_mask_bt.bool()[:, None, :]
            # a padded query row would see nothing: let it see itself, its output is ignored
            allowed_btt = allowed_btt | torch.eye(t, dtype=torch.bool)[None]
        x = self.model.embed_tokens(input_ids_bt)
        for layer in self.model.layers:
            x = x + layer.self_attn(layer.input_layernorm(x), cos, sin, allowed_btt)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.lm_head(self.model.norm(x))

    @torch.no_grad()
    def forward_cached(self, input_ids_nt: torch.Tensor, cache: KVCache, slots_n: torch.Tensor,
                       start_pos_n: torch.Tensor) -> torch.Tensor:  # fmt: skip
        """Logits [N, T, V] for T new tokens per request, each at start_pos[i] + t, attending to
        the request's cached positions < start_pos[i] and to its new tokens causally."""
        n, t = input_ids_nt.shape
        pos_nt = start_pos_n[:, None] + torch.arange(t)[None]
        key_len = int(pos_nt.max()) + 1
        if key_len > cache.max_len:
            raise ValueError(f"sequence of {key_len} tokens exceeds the KV cache ({cache.max_len})")
        allowed_ntk = torch.arange(key_len)[None, None, :] <= pos_nt[:, :, None]
        cos, sin = rope_cos_sin(pos_nt, self.cfg.head_dim, self.cfg.rope_theta)
        x = self.model.embed_tokens(input_ids_nt)
        for i, layer in enumerate(self.model.layers):
            x = x + layer.self_attn.forward_cached(
                layer.input_layernorm(x), cos, sin, i, cache, slots_n, pos_nt, allowed_ntk
            )
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return self.lm_head(self.model.norm(x))


def token_logprobs(logits_btv: torch.Tensor, targets_bt: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """log p(target) under softmax(logits / temperature): the quantity the engine reports."""
    if temperature != 1.0 and temperature > 0:
        logits_btv = logits_btv / temperature
    logp = torch.log_softmax(logits_btv.float(), dim=-1)
    return logp.gather(-1, targets_bt[..., None]).squeeze(-1)
