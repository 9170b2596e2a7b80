"""Rank 0's side of data-parallel training: it starts ranks 1..K-1 (worker processes or Ray
actors), joins their process group, and sends them each step (services/trainer/parallel.py).

With --use-ray the ranks are Ray actors. A trainer the launcher placed (services/raycluster.py)
finds its node's IP and its placement-group bundle in its environment: the ranks join that bundle
and rendezvous on that IP. A trainer started on its own joins $RAY_ADDRESS (unset: a local Ray of
its own) with a placement group of its own, and rendezvous on the IP of the node it joined. The
actors get the config's content and the initial checkpoint's files through Ray's object store.
trainer-ranks.json (in the run directory) records the rendezvous address and each rank's node."""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from pathlib import Path

import torch
import torch.distributed as dist

from services.common import procs
from services.trainer.core import LossConfig, std_normalization
from services.trainer.parallel import (
    backend_for,
    broadcast_state,
    dp_adapter_step,
    dp_train_step,
    init_group,
    max_tokens_of,
    send_command,
)
from services.trainer.worker import NODE_IP_ENV, PLACEMENT_ENV

log = logging.getLogger(__name__)
RAY_READY_TIMEOUT_S = 120.0
RANK_WATCH_S = 0.2
"""How often rank 0 looks at the ranks it started while their group forms."""


class DataParallel:
    """Rank 0's side: starts the other ranks, then drives them one command at a time."""

    def __init__(self, config, model, optimizer, ref_model, pad_id: int, config_file: Path, log_dir: Path):
        self.config = config
        self.model, self.optimizer, self.ref_model = model, optimizer, ref_model
        self.shard = {"reward_key": config.rollout.reward_key, "pad_id": pad_id, "max_tokens": max_tokens_of(config)}
        self.world = config.trainer.num_ranks
        self.procs, self.actors, self.runs = [], [], []  # Ray: the actors and each one's run
        self.master_addr = connect_ray(config) if config.trainer.use_ray else "127.0.0.1"
        self.port = procs.free_port(self.master_addr)
        self.backend = backend_for(config.trainer.dist_backend)
        args = ["--world-size", str(self.world), "--master-addr", self.master_addr, "--master-port", str(self.port),
                "--backend", self.backend]  # fmt: skip
        rank_nodes = []
        if config.trainer.use_ray:
            self.actors, rank_nodes, self.runs = start_ray_workers(
                self.world,
                [*args, "--config-json", config_file.read_text()],
                checkpoint_files(config.data.hf_checkpoint),
            )
        else:
            for rank in range(1, self.world):
                cmd = [sys.executable, "-m", "services.trainer.worker", "--rank", str(rank), *args,
                       "--config-file", str(config_file)]  # fmt: skip
                self.procs.append(procs.spawn(cmd, log_path=log_dir / f"trainer-rank{rank}.log", env=os.environ.copy()))
        (log_dir.parent / "trainer-ranks.json").write_text(json.dumps({
            "ranks": [p.pid for p in self.procs], "ray_actors": len(self.actors), "master_addr": self.master_addr,
            "master_port": self.port, "rank_nodes": [self.master_addr, *rank_nodes],
        }))  # fmt: skip
        try:
            self.commands = self._join(log_dir)
        except BaseException:
            self._stop_ranks()
            raise
        broadcast_state(model, optimizer)

    def _join(self, log_dir: Path):
        """Rank 0 joins the group (init_group) while watching the ranks it started: one that
        exits before the group forms (a process, or a Ray actor's run) is an error at once, naming
        its log or its error, rather than the whole rendezvous timeout later."""
        box: dict = {}

        def join() -> None:
            try:
                box["group"] = init_group(0, self.world, self.master_addr, self.port, self.backend)
            except BaseException as e:  # handed to the caller
                box["error"] = e

        t = threading.Thread(target=join, name="dp-rendezvous", daemon=True)  # daemon: never holds the exit
        t.start()
        while t.is_alive():
            t.join(RANK_WATCH_S)
            for rank, p in enumerate(self.procs, 1):
                if p.poll() is not None and t.is_alive():
                    raise RuntimeError(f"trainer rank {rank} exited (code {p.returncode}) before the data-parallel "
                                       f"group formed: see {log_dir / f'trainer-rank{rank}.log'}")  # fmt: skip
            if self.runs and t.is_alive():
                import ray

                ended, _ = ray.wait(self.runs, num_returns=1, timeout=0)
                if ended and t.is_alive():
                    rank = self.runs.index(ended[0]) + 1
                    try:
                        ray.get(ended[0])
                        why = "returned"
                    except Exception as e:  # the actor's error, or its death
                        why = f"failed: {str(e)[-1500:]}"
                    raise RuntimeError(f"trainer rank {rank} (a Ray actor) ended before the data-parallel group "
                                       f"formed: it {why}")  # fmt: skip
        if "error" in box:
            raise box["error"]
        return box["group"]

    def train(self, groups, cfg: LossConfig) -> dict:
        send_command(self.commands, ("train", _encoded(groups)))
        c = self.config
        return dp_train_step(self.model, self.optimizer, groups, cfg, c.trainer.clip_grad,
                             std_norm=std_normalization(c), ref_model=self.ref_model, **self.shard)  # fmt: skip

    def train_adapter(self, lora, optimizer, slot: int, groups, cfg: LossConfig, std_norm: bool) -> dict:
        """One step of the adapter in `slot` over every rank (multi-LoRA); rank 0's stats."""
        spec = lora.specs[slot]
        send_command(self.commands, ("lora", (slot, spec, std_norm, _encoded(groups))))
        return dp_adapter_step(self.model, lora, optimizer, slot, spec, groups, cfg, self.config.trainer.clip_grad,
                               std_norm=std_norm, **self.shard)  # fmt: skip

    def stop(self) -> None:
        try:
            send_command(self.commands, ("stop", None))
            dist.destroy_process_group()
        except Exception as e:  # the workers may already be gone; they die with us anyway
            log.warning("stopping the data-parallel group: %s", e)
        self._stop_ranks()

    def _stop_ranks(self) -> None:
        for p in self.procs:
            procs.stop(p)
        if self.actors:
            import ray

            for a in self.actors:
                ray.kill(a)
            ray.shutdown()  # our driver (and the local Ray cluster, if this trainer started one)


def _encoded(groups) -> list[bytes]:
    from asyncrl_proto import RolloutGroup, encode

    return [encode(RolloutGroup(group_id=f"dp-{i}", group_index=i, samples=g)) for i, g in enumerate(groups)]


def connect_ray(config) -> str:
    """Join the Ray cluster; the rendezvous address: this node's IP (never 127.0.0.1 unless the
    node itself is there)."""
    import ray

    node_ip = os.environ.get(NODE_IP_ENV) or None
    placed = os.environ.get(PLACEMENT_ENV)
    namespace = placed.split("/")[0] if placed else f"asyncrl-{config.infra.run_id}"
    address = os.environ.get("RAY_ADDRESS") or None
    if not ray.is_initialized():
        local = {"include_dashboard": False, "num_cpus": config.trainer.num_ranks} if address is None else {}
        ray.init(address=address or "local", namespace=namespace, log_to_driver=False, logging_level=logging.WARNING,
                 **({"_node_ip_address": node_ip} if node_ip else {}), **local)  # fmt: skip
    return node_ip or ray.util.get_node_ip_address()


def checkpoint_files(path: str | None) -> dict[str, bytes] | None:
    """The initial checkpoint's files, for ranks on nodes that may not see rank 0's disk."""
    if not path or not Path(path).is_dir():
        return None
    return {f.name: f.read_bytes() for f in Path(path).iterdir() if f.is_file()}


def start_ray_workers(world: int, args: list[str], files: dict[str, bytes] | None):
    """Ranks 1..K-1 as Ray actors: in the bundle the launcher placed this trainer in, or in a
    placement group of their own (one bundle per rank). The actors, their nodes' IPs, and the
    references of their runs (one ready early means that rank ended)."""
    import ray
    from ray.util.placement_group import get_placement_group, placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    gpus = 1 if torch.cuda.is_available() else 0
    if placed := os.environ.get(PLACEMENT_ENV):
        _, name, bundle = placed.split("/")
        pg, bundles = get_placement_group(name), [int(bundle)] * world
    else:
        pg = placement_group([{"CPU": 1, "GPU": gpus}] * world if gpus else [{"CPU": 1}] * world)
        bundles = list(range(world))
    try:
        ray.get(pg.ready(), timeout=RAY_READY_TIMEOUT_S)
    except ray.exceptions.GetTimeoutError:
        raise RuntimeError(f"Ray has no room for {world - 1} trainer rank(s) after {RAY_READY_TIMEOUT_S:.0f}s: "
                           f"{pg.bundle_specs} (`ray status` shows the cluster)") from None  # fmt: skip

    @ray.remote
    class Rank:
        def node_ip(self) -> str:
            return ray.util.get_node_ip_address()

        def run(self, argv, files):
            from services.trainer.worker import main

            main(argv, checkpoint_files=files)
            return True

    files_ref = ray.put(files)  # once in the object store, fetched by each rank's node
    strategies = [PlacementGroupSchedulingStrategy(placement_group=pg, placement_group_bundle_index=bundles[rank])
                  for rank in range(1, world)]  # fmt: skip
    actors = [Rank.options(scheduling_strategy=s, num_cpus=1, num_gpus=gpus).remote() for s in strategies]
    nodes = ray.get([a.node_ip.remote() for a in actors], timeout=RAY_READY_TIMEOUT_S)
    runs = [actor.run.remote(["--rank", str(rank), *args], files_ref) for rank, actor in enumerate(actors, start=1)]
    return actors, nodes, runs
