"""The RL math of multi-LoRA training (no I/O): one optimizer step per adapter whose batch is
complete, on that adapter's factors only, with the same GRPO / PPO loss as full training.

The base model is frozen; each adapter lives in a slot of the model's MultiLora
(services/model/lora.py). An adapter's step runs its micro-batches under `lora.rows` (every row
that adapter), normalises the loss by its own tokens (or sequences), clips the gradient norm of
its slot alone and steps that slot with SlotAdamW: other slots' factors and optimizer moments are
untouched, and a non-finite loss or gradient skips that adapter's update only. With --kl-coef the
KL reference is the frozen base itself (no adapter rows), which a fresh adapter starts as, so no
second copy of the model is held.
"""

from __future__ import annotations

import math

import torch

from services.model.llama import CausalLM
from services.model.lora import MultiLora, SlotAdamW
from services.trainer.core import (
    SKIPPED,
    LossConfig,
    TrainBatch,
    accumulate_gradients,
    finish_stats,
    grad_norm,
    merge_stats,
    step_denominator,
)


def adapter_gradients(model: CausalLM, lora: MultiLora, slot: int, batches: list[TrainBatch], cfg: LossConfig,
                      denom: float) -> list[tuple[dict[str, float], int]]:  # fmt: skip
    """The gradient of one adapter's loss over `batches` (divided by the step's `denom`) in its
    factors' `.grad`, other slots' rows zero; (stats, loss tokens) per micro-batch."""
    model.train()
    lora.zero_grad()

    def base(*args, **kwargs):  # the KL reference: the base model's forward with no adapter rows
        with lora.rows(None):
            return model(*args, **kwargs)

    parts = []
    for b in batches:
        with lora.rows([slot] * b.num_samples):
            parts += accumulate_gradients(model, [b], cfg, denom, base)
    return parts


def apply_adapter_update(lora: MultiLora, optimizer: SlotAdamW, slot: int, parts: list[tuple[dict[str, float], int]],
                         clip_grad: float) -> dict[str, float]:  # fmt: skip
    """Clip the slot's gradient norm and step it, unless the loss or the norm is not finite (that
    adapter's update is skipped); the step's stats (merged from `parts`) with the norm."""
    stats = merge_stats(parts)
    grads = [p.grad[slot] for p in (*lora.A.values(), *lora.B.values()) if p.grad is not None]  # views (clip in place)
    norm = grad_norm(grads) if math.isfinite(stats.get("train/loss", 0.0)) else math.nan
    if math.isfinite(norm):
        if clip_grad > 0 and norm > clip_grad:
            with torch.no_grad():
                for g in grads:
                    g.mul_(clip_grad / (norm + 1e-6))
        optimizer.step([slot])
    lora.zero_grad()
    return finish_stats(stats, norm, parts)


def train_adapter_step(
    model: CausalLM,
    lora: MultiLora,
    optimizer: SlotAdamW,
    slot: int,
    batches: list[TrainBatch],
    cfg: LossConfig,
    clip_grad: float,
) -> dict[str, float]:
    """One optimizer step of one adapter over its micro-batches (the loss normalised by its
    whole step, as train_step); the base model's weights never change."""
    denom = step_denominator(batches, cfg.aggregation)
    if denom == 0:
        return dict(SKIPPED)
    parts = adapter_gradients(model, lora, slot, batches, cfg, denom)
    return apply_adapter_update(lora, optimizer, slot, parts, clip_grad)
