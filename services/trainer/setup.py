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
    if config.trainer.train_backend == "megatron":
        try:
            from services.trainer.megatron_backend import load_megatron_model
        except ImportError as e:
            raise TrainerError(f"--train-backend megatron needs megatron-core (pip install megatron-core): {e}") from e
        return load_megatron_model(config.data.hf_checkpoint, config.data.seed)
    return load_model(config.data.hf_checkpoint)


def build_optimizer(config, model) -> torch.optim.Optimizer:
    t = config.trainer
    betas = (t.adam_beta1, t.adam_beta2)
    return torch.optim.AdamW(model.parameters(), lr=t.lr, betas=betas, weight_decay=t.weight_decay)


def build_reference(config):
    """The model's KL reference: the initial policy, frozen (None without --kl-coef). Multi-LoRA
    builds none: its reference is the frozen base the adapters hang on (services/trainer/adapters.py)."""
    if not config.trainer.kl_coef:
        return None
    return load_model(config.data.hf_checkpoint).eval().requires_grad_(False)


def loss_config(config) -> LossConfig:
    t = config.trainer
    return LossConfig(
        eps_clip=t.eps_clip, eps_clip_high=t.eps_clip_high, entropy_coef=t.entropy_coef,
        use_rollout_logprobs=t.use_rollout_logprobs, use_tis=t.use_tis, tis_clip=t.tis_clip,
        tis_clip_low=t.tis_clip_low, tis_mode=t.tis_mode, kl_coef=t.kl_coef, kl_loss_type=t.kl_loss_type,
        aggregation=t.loss_aggregation, temperature=config.rollout.temperature,
        use_decoupled_ppo=t.use_decoupled_ppo, decoupled_weight_cap=t.decoupled_ppo_weight_cap,
    )  # fmt: skip
