"""A data-parallel trainer rank (1..K-1): `python -m services.trainer.worker --rank R ...`.

Started by rank 0 (the trainer service) as a process, or as a Ray actor with --use-ray; it runs
the steps of services/trainer/parallel.py with rank 0 and talks to no service (rank 0 owns the
bus and HTTP). A Ray actor may be on another node: it gets the config's content (--config-json)
and the initial checkpoint's files through Ray's object store, never a path of rank 0's disk,
and it rendezvous on rank 0's node address.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import tempfile
from pathlib import Path

NODE_IP_ENV = "ASYNCRL_NODE_IP"
"""The IP of the Ray node a placed process runs on (its host sets it, services/raycluster.py): the
trainer's rank 0 rendezvous there."""
PLACEMENT_ENV = "ASYNCRL_RAY_PLACEMENT"
"""`<namespace>/<placement group>/<bundle>` of a placed trainer: the bundle its ranks 1..K-1 join."""


def main(argv: list[str] | None = None, checkpoint_files: dict[str, bytes] | None = None) -> None:
    """checkpoint_files: the initial checkpoint's files by name (from rank 0 through Ray's object
    store), written to a directory of this node that replaces --hf-checkpoint."""
    p = argparse.ArgumentParser(prog="python -m services.trainer.worker")
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--master-addr", required=True)
    p.add_argument("--master-port", type=int, required=True)
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--config-file", help="the run's resolved config (JSON)")
    source.add_argument("--config-json", help="the run's resolved config itself (JSON)")
    p.add_argument("--backend", default="gloo")
    a = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s [trainer-rank{a.rank}] %(message)s")
    import torch
    import torch.distributed as dist

    from asyncrl_proto import RolloutGroup, decode
    from services.common.config import RunConfig
    from services.common.procs import apply_cpu_affinity_from_env
    from services.model.lora import MultiLora
    from services.trainer.core import std_normalization
    from services.trainer.parallel import (
        broadcast_state,
        dp_adapter_step,
        dp_train_step,
        init_group,
        max_tokens_of,
        next_command,
    )
    from services.trainer.setup import build_model, build_optimizer, build_reference, loss_config

    apply_cpu_affinity_from_env()
    fields = json.loads(a.config_json if a.config_json else Path(a.config_file).read_text())
    if checkpoint_files is not None:  # this node's copy of the model (Ray: the trainer's disk is not here)
        local = Path(tempfile.mkdtemp(prefix="asyncrl-checkpoint-"))
        for name, data in checkpoint_files.items():
            (local / name).write_bytes(data)
        fields["hf_checkpoint"] = str(local)
    config = RunConfig(**fields)
    torch.set_num_threads(config.infra.torch_num_threads)
    model = build_model(config)
    adapters = config.multi_lora.n_adapters > 0  # adapters on the frozen base: rank 0 sends each step's slot
    ref_model = None if adapters else build_reference(config)
    if checkpoint_files is not None:  # loaded: the model and the reference hold it now
        shutil.rmtree(config.data.hf_checkpoint, ignore_errors=True)
    pad_id = model.cfg.pad_token_id if model.cfg.pad_token_id is not None else 0
    lora = optimizer = None
    if adapters:
        model.requires_grad_(False)
        lora = MultiLora(model, config.multi_lora.n_adapters, config.multi_lora.max_rank)
    else:
        optimizer = build_optimizer(config, model)
    cfg = loss_config(config)
    commands = init_group(a.rank, a.world_size, a.master_addr, a.master_port, a.backend)
    broadcast_state(model, optimizer)
    logging.info("rank %d of %d ready (%s)", a.rank, a.world_size, a.backend)
    shard = {"reward_key": config.rollout.reward_key, "pad_id": pad_id, "max_tokens": max_tokens_of(config)}
    while True:
        kind, payload = next_command(commands)
        if kind == "train":
            groups = [decode(b, RolloutGroup).samples for b in payload]
            dp_train_step(model, optimizer, groups, cfg, config.trainer.clip_grad, std_norm=std_normalization(config),
                          ref_model=ref_model, **shard)  # fmt: skip
        elif kind == "lora":
            slot, spec, std_norm, groups = payload
            groups = [decode(b, RolloutGroup).samples for b in groups]
            dp_adapter_step(model, lora, None, slot, spec, groups, cfg, config.trainer.clip_grad, std_norm=std_norm,
                            **shard)  # fmt: skip
        elif kind == "stop":
            break
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
