"""What a trainer process builds from the configuration: the policy in its backend, the optimizer,
the frozen KL reference and the loss settings. Rank 0 (the service) and every data-parallel worker
build them here, the same way."""

from __future__ import annotations

import torch

from services.model.hf_io import load_model
from services.trainer.core import LossConfig


class TrainerError(RuntimeError):
    """This step cannot go on (the buffer refused it, a backend is missing): the service ends and
    its supervisor restarts it."""


def build_model(config):
    """The policy in the configured backend; the KL reference always uses the plain model."""
    if config.train_backend == "megatron":
        try:
            from services.trainer.megatron_backend import load_megatron_model
        except ImportError as e:
            raise TrainerError(f"--train-backend megatron needs megatron-core (pip install megatron-core): {e}") from e
        return load_megatron_model(config.hf_checkpoint, config.seed)
    return load_model(config.hf_checkpoint)


def build_optimizer(config, model) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=config.lr, betas=(config.adam_beta1, config.adam_beta2),
                             weight_decay=config.weight_decay)  # fmt: skip


def build_reference(config):
    """The KL reference: the initial policy, frozen (None without --kl-coef, and in multi-LoRA,
    whose reference is the frozen base the adapters hang on: services/trainer/adapters.py)."""
    if not config.kl_coef or config.multi_lora_n_adapters > 0:
        return None
    return load_model(config.hf_checkpoint).eval().requires_grad_(False)


def loss_config(config) -> LossConfig:
    return LossConfig(
        eps_clip=config.eps_clip, eps_clip_high=config.eps_clip_high, entropy_coef=config.entropy_coef,
        use_rollout_logprobs=config.use_rollout_logprobs, use_tis=config.use_tis, tis_clip=config.tis_clip,
        tis_clip_low=config.tis_clip_low, kl_coef=config.kl_coef, kl_loss_type=config.kl_loss_type,
        aggregation=config.loss_aggregation, temperature=config.rollout_temperature,
        use_decoupled_ppo=config.use_decoupled_ppo, decoupled_weight_cap=config.decoupled_ppo_weight_cap,
    )  # fmt: skip
