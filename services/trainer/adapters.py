"""The RL math of multi-LoRA training (no I/O): one optimizer step per adapter whose batch is
complete, on that adapter's factors only, with the same GRPO / PPO loss as full training.

The base model is frozen; each adapter lives in a slot of the model's MultiLora
(services/model/lora.py). `train_adapters` takes, per slot, the micro-batches of that adapter's
step, and for each adapter: zeroes the factors' gradients, runs its micro-batches under
`lora.rows` (every row that adapter), normalises the loss by that adapter's own tokens (or
sequences), clips the gradient norm of that slot alone, and steps that slot with SlotAdamW. Other
slots' factors and optimizer moments are untouched; a non-finite loss or gradient skips that
adapter's update only. Stats are per adapter. With --kl-coef the KL reference is the frozen base
itself (the same model with no adapter rows: `BaseReference`), which a fresh adapter starts as,
so no second copy of the model is held.
"""

from __future__ import annotations

import math

import torch

from services.model.llama import CausalLM
from services.model.lora import MultiLora, SlotAdamW
from services.trainer.core import (
    LossConfig,
    TrainBatch,
    accumulate_gradients,
    finish_stats,
    merge_stats,
    step_denominator,
)


def slot_grad_norm(lora: MultiLora, slot: int) -> float:
    norms = [torch.linalg.vector_norm(p.grad[slot]) for p in (*lora.A.values(), *lora.B.values()) if p.grad is not None]
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0


def clip_slot(lora: MultiLora, slot: int, norm: float, max_norm: float) -> None:
    if max_norm > 0 and norm > max_norm:
        scale = max_norm / (norm + 1e-6)
        with torch.no_grad():
            for p in (*lora.A.values(), *lora.B.values()):
                if p.grad is not None:
                    p.grad[slot].mul_(scale)


class BaseReference:
    """The KL reference of an adapter: the base model's forward with no adapter rows."""

    def __init__(self, model: CausalLM, lora: MultiLora):
        self.model, self.lora = model, lora

    def __call__(self, *args, **kwargs):
        with self.lora.rows(None):
            return self.model(*args, **kwargs)


def adapter_gradients(model: CausalLM, lora: MultiLora, slot: int, batches: list[TrainBatch], cfg: LossConfig,
                      denom: float) -> list[tuple[dict[str, float], int]]:  # fmt: skip
    """The gradient of one adapter's loss over `batches` (divided by the step's `denom`) in its
    factors' `.grad`, other slots' rows zero; (stats, loss tokens) per micro-batch."""
    model.train()
    for p in (*lora.A.values(), *lora.B.values()):
        p.grad = None
    ref = BaseReference(model, lora) if cfg.kl_coef else None
    parts = []
    for b in batches:
        with lora.rows([slot] * b.num_samples):
            parts += accumulate_gradients(model, [b], cfg, denom, ref)
    return parts


def apply_adapter_update(lora: MultiLora, optimizer: SlotAdamW, slot: int, stats: dict[str, float],
                         clip_grad: float) -> dict[str, float]:  # fmt: skip
    """Clip the slot's gradient norm and step it, unless the loss or the norm is not finite (that
    adapter's update is skipped); the step's stats with the norm."""
    norm = slot_grad_norm(lora, slot) if math.isfinite(stats.get("train/loss", 0.0)) else float("nan")
    if math.isfinite(norm):
        clip_slot(lora, slot, norm, clip_grad)
        optimizer.step([slot])
    optimizer.zero_grad()
    return finish_stats(stats, norm)


SKIPPED = {"train/grad_norm": 0.0, "train/num_micro_batches": 0, "train/num_loss_tokens": 0, "train/skipped": 1.0}
"""The stats of a step with no loss token (every group FAILED): no update."""


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
    stats = apply_adapter_update(lora, optimizer, slot, merge_stats(parts), clip_grad)
    stats["train/num_micro_batches"] = len(batches)
    stats["train/num_loss_tokens"] = sum(b.num_tokens for b in batches)
    return stats


def train_adapters(
    model: CausalLM,
    lora: MultiLora,
    optimizer: SlotAdamW,
    per_slot: dict[int, list[TrainBatch]],
    cfg: LossConfig,
    clip_grad: float,
) -> dict[int, dict[str, float]]:
    """A step for every adapter whose batch is complete (the keys of `per_slot`), each on its own;
    stats per slot."""
    if any(p.requires_grad for p in model.parameters()):
        raise ValueError("multi-LoRA training needs a frozen base model: requires_grad_(False) on its weights")
    return {slot: train_adapter_step(model, lora, optimizer, slot, batches, cfg, clip_grad)
            for slot, batches in sorted(per_slot.items())}  # fmt: skip
