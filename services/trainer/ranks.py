"""Rank 0's side of data-parallel training: it starts ranks 1..K-1 (worker processes or Ray
actors), joins their process group, and sends them each step (services/trainer/parallel.py)."""

from __future__ import annotations

import json
import logging
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from services.trainer.core import LossConfig, std_normalization
from services.trainer.parallel import backend_for, broadcast_state, dp_train_step, init_group

log = logging.getLogger(__name__)


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
