"""Data-parallel training: K ranks with torch.distributed (gloo on CPU, NCCL on GPU).

Rank 0 is the trainer service (it owns the bus and HTTP); ranks 1..K-1 are worker processes
(`python -m services.trainer.worker`) or, with --use-ray, Ray actors in a placement group. Every
step rank 0 broadcasts the step's groups; every rank computes the advantages of all groups, takes
its share of the samples (sorted by length, dealt round-robin), accumulates the gradient of its
share with the loss normalised by the whole step's tokens, and the gradients are summed with
all-reduce. Every rank then applies the same clipped update, so the replicas stay identical and
the update equals the single-process one on the same batch (a test checks it).
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import sys
from pathlib import Path

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
    std_normalization,
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


class DataParallel:
    """Rank 0's side: starts the other ranks, then drives them one command at a time."""

    def __init__(self, config, model, optimizer, ref_model, pad_id: int, config_file: Path, log_dir: Path):
        self.config = config
        self.model, self.optimizer, self.ref_model, self.pad_id = model, optimizer, ref_model, pad_id
        self.world = config.trainer_num_ranks
        self.procs = []
        self.actors = []
        from services.common import procs

        self.port = procs.free_port()
        self.backend = backend_for(config.dist_backend)
        args = ["--world-size", str(self.world), "--master-addr", "127.0.0.1", "--master-port", str(self.port),
                "--config-file", str(config_file), "--backend", self.backend]  # fmt: skip
        if config.use_ray:
            self.actors = start_ray_workers(self.world, args)
        else:
            for rank in range(1, self.world):
                cmd = [sys.executable, "-m", "services.trainer.worker", "--rank", str(rank), *args]
                self.procs.append(procs.spawn(cmd, log_path=log_dir / f"trainer-rank{rank}.log", env=os.environ.copy()))
        (log_dir.parent / "trainer-ranks.json").write_text(
            json.dumps({"ranks": [p.pid for p in self.procs], "ray_actors": len(self.actors)})
        )
        init_group(0, self.world, "127.0.0.1", self.port, self.backend)
        broadcast_state(model, optimizer)

    def train(self, groups, cfg: LossConfig) -> dict:
        from asyncrl_proto import RolloutGroup, encode

        payload = [encode(RolloutGroup(group_id=f"dp-{i}", group_index=i, samples=g)) for i, g in enumerate(groups)]
        dist.broadcast_object_list([("train", payload)], src=0)
        c = self.config
        return dp_train_step(self.model, self.optimizer, groups, cfg, c.clip_grad, std_norm=std_normalization(c),
                             reward_key=c.reward_key, pad_id=self.pad_id,
                             max_tokens=c.max_tokens_per_gpu if c.use_dynamic_batch_size else None,
                             ref_model=self.ref_model)  # fmt: skip

    def stop(self) -> None:
        from services.common import procs

        try:
            dist.broadcast_object_list([("stop", None)], src=0)
            dist.destroy_process_group()
        except Exception as e:  # the workers may already be gone; they die with us anyway
            log.warning("stopping the data-parallel group: %s", e)
        for p in self.procs:
            procs.stop(p)
        if self.actors:
            import ray

            for a in self.actors:
                ray.kill(a)
            ray.shutdown()  # the local Ray cluster this trainer started


def start_ray_workers(world: int, args: list[str]):
    """Ranks 1..K-1 as Ray actors in a placement group (one bundle per rank)."""
    import ray
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS"), include_dashboard=False, log_to_driver=False)
    gpus = 1 if torch.cuda.is_available() else 0
    pg = placement_group([{"CPU": 1, "GPU": gpus}] * world if gpus else [{"CPU": 1}] * world)
    ray.get(pg.ready())

    @ray.remote
    class Rank:
        def run(self, argv):
            from services.trainer.worker import main

            main(argv)
            return True

    actors = []
    for rank in range(1, world):
        strategy = PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=rank)
        actor = Rank.options(scheduling_strategy=strategy, num_cpus=1, num_gpus=gpus).remote()
        actor.run.remote(["--rank", str(rank), *args])
        actors.append(actor)
    return actors
