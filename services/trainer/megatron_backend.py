"""`--train-backend megatron`: train with megatron-core's GPTModel, speak Hugging Face outside.

The trainer only needs a module whose forward(input_ids, attention_mask) returns logits, plus
a way in and out of HF layouts: `MegatronCausalLM` wraps GPTModel (RMSNorm, SwiGLU, RoPE, GQA,
optional QKV bias: Llama and Qwen2) and converts weights both ways, so checkpoints and weight
snapshots are ordinary HF directories that the engines (SGLang or built-in) load like any other.

Parallelism: tensor and pipeline parallel sizes 1 here (the layouts below are for unsharded
weights); data parallelism comes from the trainer's own ranks.

On a machine without CUDA, megatron-core 0.16.1 still runs forward and backward with gloo after
three small shims (`cpu_shims`): torch.cuda.current_device() answers "cpu" (megatron allocates its
global memory buffer and moves RoPE frequencies there), and the CUDA RNG tracker's fork is a
no-op (dropout is off). They change nothing where CUDA exists.
"""

from __future__ import annotations

import contextlib
import os

import torch
import torch.nn.functional as F
from torch import nn

from services.model.llama import ModelConfig


def cpu_shims() -> None:
    if torch.cuda.is_available():  # else the module docstring's shims (each call sets the same again)
        return
    from megatron.core.tensor_parallel import random as mrandom

    torch.cuda.current_device = lambda: torch.device("cpu")
    mrandom.CudaRNGStatesTracker.fork = lambda self, name="model-parallel-rng": contextlib.nullcontext()


def init_megatron(seed: int = 1234) -> None:
    """A single-rank model-parallel world (gloo on CPU, NCCL on GPU) unless one exists."""
    import torch.distributed as dist
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    cpu_shims()
    if not dist.is_initialized():
        from services.common.procs import free_port

        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    if not ps.model_parallel_is_initialized():
        ps.initialize_model_parallel(1, 1)
    if torch.cuda.is_available():
        tensor_parallel.model_parallel_cuda_manual_seed(seed)


def transformer_config(cfg: ModelConfig):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(
        num_layers=cfg.num_hidden_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_key_value_heads,
        kv_channels=cfg.head_dim,
        ffn_hidden_size=cfg.intermediate_size,
        normalization="RMSNorm",
        layernorm_epsilon=cfg.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=cfg.attention_bias,
        attention_dropout=0.0,
        hidden_dropout=0.0,
        use_cpu_initialization=not torch.cuda.is_available(),
        params_dtype=torch.float32,
        bias_activation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
    )


# ---- HF <-> Megatron layouts -------------------------------------------------------------------


def _fuse_qkv(q, k, v, cfg: ModelConfig, dim: int = 0):
    """Megatron's fused QKV along `dim` (0: weights; -1: activations [..., features], the fused QKV
    linear's output layout): per query group, that group's query heads, then its key, then its value."""
    q, k, v = (x.movedim(dim, 0) for x in (q, k, v))
    g, d = cfg.num_key_value_heads, cfg.head_dim
    per = cfg.num_attention_heads // g
    tail = q.shape[1:]
    fused = torch.cat([q.reshape(g, per * d, *tail), k.reshape(g, d, *tail), v.reshape(g, d, *tail)], dim=1)
    return fused.reshape(-1, *tail).movedim(0, dim)


def _split_qkv(qkv, cfg: ModelConfig):
    g, d = cfg.num_key_value_heads, cfg.head_dim
    per = cfg.num_attention_heads // g
    tail = qkv.shape[1:]
    q, k, v = qkv.reshape(g, (per + 2) * d, *tail).split([per * d, d, d], dim=1)
    return q.reshape(-1, *tail), k.reshape(-1, *tail), v.reshape(-1, *tail)


# names that map one to one: (HF, Megatron), per model and per layer ({i})
_GLOBAL_NAMES = (
    ("model.embed_tokens.weight", "embedding.word_embeddings.weight"),
    ("model.norm.weight", "decoder.final_layernorm.weight"),
)
_LAYER_NAMES = (
    ("model.layers.{i}.input_layernorm.weight", "decoder.layers.{i}.input_layernorm.weight"),
    ("model.layers.{i}.self_attn.o_proj.weight", "decoder.layers.{i}.self_attention.linear_proj.weight"),
    ("model.layers.{i}.post_attention_layernorm.weight", "decoder.layers.{i}.pre_mlp_layernorm.weight"),
    ("model.layers.{i}.mlp.down_proj.weight", "decoder.layers.{i}.mlp.linear_fc2.weight"),
)


def _renames(cfg: ModelConfig) -> list[tuple[str, str]]:
    pairs = list(_GLOBAL_NAMES)
    if not cfg.tie_word_embeddings:
        pairs.append(("lm_head.weight", "output_layer.weight"))
    return pairs + [(h.format(i=i), m.format(i=i)) for i in range(cfg.num_hidden_layers) for h, m in _LAYER_NAMES]


def hf_to_megatron(hf: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out = {m: hf[h] for h, m in _renames(cfg)}
    kinds = ("weight", "bias") if cfg.attention_bias else ("weight",)
    for i in range(cfg.num_hidden_layers):
        a, m = f"model.layers.{i}.self_attn.", f"decoder.layers.{i}."
        for kind in kinds:
            out[m + f"self_attention.linear_qkv.{kind}"] = _fuse_qkv(*(hf[f"{a}{x}_proj.{kind}"] for x in "qkv"), cfg)
        mlp = f"model.layers.{i}.mlp."
        out[m + "mlp.linear_fc1.weight"] = torch.cat([hf[mlp + "gate_proj.weight"], hf[mlp + "up_proj.weight"]], 0)
    return out


def megatron_to_hf(mg: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    out = {h: mg[m] for h, m in _renames(cfg)}
    kinds = ("weight", "bias") if cfg.attention_bias else ("weight",)
    for i in range(cfg.num_hidden_layers):
        a, m = f"model.layers.{i}.self_attn.", f"decoder.layers.{i}."
        for kind in kinds:
            split = _split_qkv(mg[m + f"self_attention.linear_qkv.{kind}"], cfg)
            out.update({f"{a}{x}_proj.{kind}": t for x, t in zip("qkv", split, strict=True)})
        mlp = f"model.layers.{i}.mlp."
        out[mlp + "gate_proj.weight"], out[mlp + "up_proj.weight"] = mg[m + "mlp.linear_fc1.weight"].chunk(2, dim=0)
    return out


class MegatronCausalLM(nn.Module):
    """GPTModel behind the trainer's model interface: forward(input_ids, attention_mask) -> logits."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec

        self.cfg = cfg
        self.gpt = GPTModel(
            config=transformer_config(cfg),
            transformer_layer_spec=get_gpt_layer_local_spec(normalization="RMSNorm"),
            vocab_size=cfg.vocab_size,
            max_sequence_length=cfg.max_position_embeddings,
            position_embedding_type="rope",
            rotary_base=int(cfg.rope_theta),
            share_embeddings_and_output_weights=cfg.tie_word_embeddings,
        )

    def forward(self, input_ids_bt: torch.Tensor, attention_mask_bt: torch.Tensor | None = None) -> torch.Tensor:
        b, t = input_ids_bt.shape
        pos_bt = torch.arange(t, device=input_ids_bt.device).expand(b, t)
        masked = torch.ones(t, t, dtype=torch.bool, device=input_ids_bt.device).triu(1)[None, None].expand(b, 1, t, t)
        if attention_mask_bt is not None:
            masked = masked | ~attention_mask_bt.bool()[:, None, None, :]
            masked = masked & ~torch.eye(t, dtype=torch.bool, device=input_ids_bt.device)  # padded rows see themselves
        return self.gpt(input_ids_bt, pos_bt, attention_mask=masked)

    def lora_sites(self, targets) -> list:
        """Where multi-LoRA factors attach (services.model.lora.MultiLora): the fused QKV linear
        takes q, k and v's deltas in its per-query-group layout, the fused fc1 gate's and up's
        concatenated, linear_proj o's and linear_fc2 down's; activations are [seq, batch, features]."""
        from services.model.lora import LoraSite

        cfg, sites = self.cfg, []
        for i, layer in enumerate(self.gpt.decoder.layers):
            attn, mlp = layer.self_attention, layer.mlp
            for module, names, fuse in (
                (attn.linear_qkv, ("q_proj", "k_proj", "v_proj"), lambda p: _fuse_qkv(*p, cfg, dim=-1)),
                (attn.linear_proj, ("o_proj",), None),
                (mlp.linear_fc1, ("gate_proj", "up_proj"), lambda p: torch.cat(p, dim=-1)),
                (mlp.linear_fc2, ("down_proj",), None),
            ):
                if any(n in targets for n in names):
                    sites.append(LoraSite(module, i, names, batch_dim=1, fuse=fuse))
        return sites

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        mg = {k.removeprefix("gpt."): v for k, v in self.state_dict().items() if not k.endswith("_extra_state")}
        return megatron_to_hf(mg, self.cfg)

    def load_hf_state_dict(self, hf: dict[str, torch.Tensor]) -> None:
        mg = hf_to_megatron(hf, self.cfg)
        own = {k.removeprefix("gpt."): v for k, v in self.state_dict().items() if not k.endswith("_extra_state")}
        if missing := sorted(set(own) - set(mg)):
            raise ValueError(f"HF weights do not cover the Megatron model: missing {missing[:5]}")
        with torch.no_grad():
            for name, p in own.items():
                p.copy_(mg[name].to(p.dtype))


def load_megatron_model(path: str | os.PathLike, seed: int = 1234) -> MegatronCausalLM:
    from services.model.hf_io import load_state_dict, read_config

    init_megatron(seed)
    model = MegatronCausalLM(read_config(path))
    model.load_hf_state_dict(load_state_dict(path))
    return model
