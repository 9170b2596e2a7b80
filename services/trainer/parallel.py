"""Data-parallel training: K ranks with torch.distributed (gloo on CPU, NCCL on GPU).

Rank 0 is the trainer service (it owns the bus and HTTP); ranks 1..K-1 are worker processes
(`python -m services.trainer.worker`) or, with --use-ray, Ray actors in a placement group, which
rank 0 starts and drives (services/trainer/ranks.py). This module is the step all ranks run. Every
step rank 0 broadcasts the step's groups; every rank computes the advantages of all groups, takes
its share of the samples (sorted by length, dealt round-robin), accumulates the gradient of its
share with the loss normalised by the whole step's tokens, and the gradients are summed with
all-reduce. Every rank then applies the same clipped update, so the replicas stay identical and
the update equals the single-process one on the same batch (a test checks it).

Multi-LoRA (--multi-lora-n-adapters) steps one adapter at a time on the frozen base: rank 0 holds
the adapters and their optimizer (the registry's lifecycle happens there alone), so each adapter
step sends that slot's factors to the ranks first, every rank takes its share of the samples as
above, the slot's gradients are summed on rank 0, and rank 0 clips and steps. The ranks keep no
adapter state between steps, so a slot set up, resumed or freed on rank 0 needs nothing from them.
"""

from __future__ import annotations

import datetime

import torch
import torch.distributed as dist

from services.model.lora import LoraSpec
from services.trainer.adapters import adapter_gradients, apply_adapter_update
from services.trainer.core import (
    SKIPPED,
    LossConfig,
    accumulate_gradients,
    apply_update,
    finish_stats,
    merge_stats,
    micro_batches,
    samples_with_advantages,
    step_denominator,
)

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)
"""The longest one step's collective waits for the other ranks."""
COMMAND_TIMEOUT = datetime.timedelta(days=365)
"""The longest a rank waits for rank 0's next command: rank 0 may idle for long between steps (a
multi-LoRA service waiting for adapters), and gloo ends a waiting broadcast at its group's timeout."""


def max_tokens_of(config) -> int | None:
    """Tokens per micro-batch (--use-dynamic-batch-size --max-tokens-per-gpu), or None: one batch."""
    return config.trainer.max_tokens_per_gpu if config.trainer.use_dynamic_batch_size else None


def shard_step(groups, cfg: LossConfig, std_norm: bool, reward_key, pad_id: int, max_tokens: int | None):
    """This rank, the world size, this rank's micro-batches (the samples sorted by length and dealt
    round-robin) and the whole step's loss denominator (summed over the ranks' shares)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    items = sorted(samples_with_advantages(groups, std_norm, reward_key), key=lambda it: len(it[0].tokens))
    batches = micro_batches(items[rank::world], pad_id, max_tokens)
    denom = torch.tensor([step_denominator(batches, cfg.aggregation)], dtype=torch.float64)
    dist.all_reduce(denom, op=dist.ReduceOp.SUM)
    return rank, world, batches, denom.item()


def dp_train_step(model, optimizer, groups, cfg: LossConfig, clip_grad: float, *, std_norm: bool, reward_key,
                  pad_id: int, max_tokens: int | None, ref_model=None) -> dict:  # fmt: skip
    """One data-parallel step; call on every rank with the same groups."""
    rank, world, batches, denom = shard_step(groups, cfg, std_norm, reward_key, pad_id, max_tokens)
    if denom == 0:  # every rank sees the same: no update (every group FAILED)
        return {**SKIPPED, "train/dp_world_size": world}
    model.train()
    optimizer.zero_grad(set_to_none=True)
    parts = accumulate_gradients(model, batches, cfg, denom, ref_model)
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
    norm = apply_update(model, optimizer, clip_grad)  # the same summed gradient on every rank: same decision
    gathered: list = [None] * world
    dist.all_gather_object(gathered, parts)
    every = [p for rank_parts in gathered for p in rank_parts]
    return {**finish_stats(merge_stats(every), norm, every), "train/dp_world_size": world}


def dp_adapter_step(model, lora, optimizer, slot: int, spec: LoraSpec, groups, cfg: LossConfig, clip_grad: float, *,
                    std_norm: bool, reward_key, pad_id: int, max_tokens: int | None) -> dict:  # fmt: skip
    """One data-parallel step of the adapter in `slot`; call on every rank with the same groups.
    `optimizer` is rank 0's SlotAdamW (None elsewhere); the stats are rank 0's ({} elsewhere)."""
    factors = [*lora.A.values(), *lora.B.values()]
    for p in factors:  # rank 0's adapter, as it is now
        dist.broadcast(p.data[slot], src=0)
    if dist.get_rank() != 0:
        lora.adopt_slot(slot, spec)
    rank, world, batches, denom = shard_step(groups, cfg, std_norm, reward_key, pad_id, max_tokens)
    if denom == 0:  # every rank sees the same: no update
        return {**SKIPPED, "train/dp_world_size": world} if rank == 0 else {}
    parts = adapter_gradients(model, lora, slot, batches, cfg, denom)
    for p in factors:
        g = p.grad[slot].contiguous() if p.grad is not None else torch.zeros_like(p.data[slot])
        dist.reduce(g, dst=0, op=dist.ReduceOp.SUM)
        if rank == 0:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            p.grad[slot].copy_(g)
        else:
            p.grad = None
    gathered: list = [None] * world if rank == 0 else None
    dist.gather_object(parts, gathered, dst=0)
    if rank != 0:
        return {}
    every = [p for rank_parts in gathered for p in rank_parts]
    return {**apply_adapter_update(lora, optimizer, slot, every, clip_grad), "train/dp_world_size": world}


def broadcast_state(model, optimizer) -> None:
    """Rank 0's parameters and optimizer state to every rank (at start and after a resume); no
    optimizer (multi-LoRA: the base is frozen, the adapters' slots are sent with each step) on any rank."""
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    if optimizer is None:
        return
    state = [optimizer.state_dict() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(state, src=0)
    if dist.get_rank() != 0:
        optimizer.load_state_dict(state[0])


def backend_for(choice: str) -> str:
    if choice != "auto":
        return choice
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_group(rank: int, world: int, addr: str, port: int, backend: str):
    """Join the ranks' process group (every step's collectives, COLLECTIVE_TIMEOUT); returns the
    gloo group rank 0 sends its commands on (COMMAND_TIMEOUT: a rank waits there while rank 0 idles)."""
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world,
                            timeout=COLLECTIVE_TIMEOUT)  # fmt: skip
    return dist.new_group(backend="gloo", timeout=COMMAND_TIMEOUT)


def send_command(group, command) -> None:
    """Rank 0: the next command to every rank, on the command group."""
    dist.broadcast_object_list([command], src=0, group=group)


def next_command(group):
    """Ranks 1..K-1: wait for rank 0's next command on the command group."""
    box = [None]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]
