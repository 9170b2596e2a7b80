"""Data-parallel training: K ranks with torch.distributed (gloo on CPU, NCCL on GPU).

Rank 0 is the trainer service (it owns the bus and HTTP); ranks 1..K-1 are worker processes
(`python -m services.trainer.worker`) or, with --use-ray, Ray actors in a placement group, which
rank 0 starts and drives (services/trainer/ranks.py). This module is the step all ranks run. Every
step rank 0 broadcasts the step's groups; every rank computes the advantages of all groups, takes
its share of the samples (sorted by length, dealt round-robin), accumulates the gradient of its
share with the loss normalised by the whole step's tokens, and the gradients are summed with
all-reduce. Every rank then applies the same clipped update, so the replicas stay identical and
the update equals the single-process one on the same batch (a test checks it).
"""

from __future__ import annotations

import datetime
import logging

import torch
import torch.distributed as dist

from services.trainer.core import (
    LossConfig,
    accumulate_gradients,
    apply_update,
    chunk_by_tokens,
    finish_stats,
    make_batch,
    merge_stats,
    samples_with_advantages,
    step_denominator,
)

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=300)


def shard_batches(groups, rank: int, world: int, std_norm: bool, reward_key, pad_id: int, max_tokens: int | None):
    """This rank's micro-batches: the samples sorted by length and dealt round-robin."""
    items = samples_with_advantages(groups, std_norm, reward_key)
    items.sort(key=lambda it: len(it[0].tokens))
    mine = items[rank::world]
    if not mine:
        return []
    if not max_tokens:
        return [make_batch(mine, pad_id)]
    return [make_batch(c, pad_id) for c in chunk_by_tokens(mine, max_tokens)]


def step_denominators(batches) -> dict[str, float]:
    """The whole step's loss denominators (token and sequence), summed over the ranks' shares."""
    counts = torch.tensor([step_denominator(batches, a) for a in ("token", "sequence")], dtype=torch.float64)
    dist.all_reduce(counts, op=dist.ReduceOp.SUM)
    return {"token": counts[0].item(), "sequence": counts[1].item()}


def dp_train_step(model, optimizer, groups, cfg: LossConfig, clip_grad: float, *, std_norm: bool, reward_key,
                  pad_id: int, max_tokens: int | None, ref_model=None) -> dict:  # fmt: skip
    """One data-parallel step; call on every rank with the same groups."""
    rank, world = dist.get_rank(), dist.get_world_size()
    batches = shard_batches(groups, rank, world, std_norm, reward_key, pad_id, max_tokens)
    denoms = step_denominators(batches)
    if denoms[cfg.aggregation] == 0:  # every rank sees the same: no update (every group FAILED)
        return {"train/grad_norm": 0.0, "train/num_micro_batches": 0, "train/num_loss_tokens": 0, "train/skipped": 1.0,
                "train/dp_world_size": world}  # fmt: skip
    model.train()
    optimizer.zero_grad(set_to_none=True)
    parts = accumulate_gradients(model, batches, cfg, denoms[cfg.aggregation], ref_model)
    for p in model.parameters():
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
    norm = apply_update(model, optimizer, clip_grad)  # the same summed gradient on every rank: same decision
    gathered: list = [None] * world
    dist.all_gather_object(gathered, parts)
    every = [p for rank_parts in gathered for p in rank_parts]
    stats = finish_stats(merge_stats(every), norm)
    stats["train/num_micro_batches"] = len(every)
    stats["train/num_loss_tokens"] = sum(n for _, n in every)
    stats["train/dp_world_size"] = world
    return stats


def broadcast_state(model, optimizer) -> None:
    """Rank 0's parameters and optimizer state to every rank (at start and after a resume)."""
    for p in model.parameters():
        dist.broadcast(p.data, src=0)
    state = [optimizer.state_dict() if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(state, src=0)
    if dist.get_rank() != 0:
        optimizer.load_state_dict(state[0])


def backend_for(choice: str) -> str:
    if choice != "auto":
        return choice
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_group(rank: int, world: int, addr: str, port: int, backend: str) -> None:
    dist.init_process_group(backend, init_method=f"tcp://{addr}:{port}", rank=rank, world_size=world,
                            timeout=COLLECTIVE_TIMEOUT)  # fmt: skip
