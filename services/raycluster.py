"""Placement over a Ray cluster (--use-ray): where the launcher's engines, producers and trainer run.

The launcher builds every child's command line the same way with or without Ray; only where it
runs differs (docs/services.md, "Ray placement"). It joins $RAY_ADDRESS (unset: a local cluster for
the run) and reserves one SPREAD placement group of two bundles, the trainer side and the rollout
side; each placed child gets a `ChildHost` actor named `<child>` in its side's bundle, which gives
its node's IP and a free port there. The launcher supervises a local attachment (`python -m
services.raycluster attach`) that has the host run the command and exits with its exit code, so an
exit or a failed health check restarts it as any child, in the same host. The trainer's ranks
1..K-1 join its bundle and rendezvous on its node's IP, both from its host's environment
(services/trainer/ranks.py).

What Ray changes: the buffer, weight-sync and eval stay processes of the launcher; a lost Ray node
is not replaced (the restarts of its children fail and the run stops with their error); the host
passes the child's environment (its NATS identity and the run token) as a Ray call argument, so an
untrusted network between nodes needs Ray's TLS. Every node must have asyncrl installed at the
same path, reach the NATS server (give --nats-url with an address the nodes reach; the embedded
server listens on 127.0.0.1) and read --hf-checkpoint; later weights come from the run's object
bucket (object-store, the default with --use-ray) or by broadcast from the trainer's node (distributed).
Outputs: RUN_DIR/ray.json (the cluster, the bundles' nodes, each child's node IP and URL).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

from services.common import procs
from services.supervisor import LaunchError
from services.trainer.worker import NODE_IP_ENV, PLACEMENT_ENV

READY_TIMEOUT_S = 120.0
CALL_TIMEOUT_S = 60.0
POLL_WAIT_S = 1.0
SIDES = ("trainer", "rollout")


def with_ray_defaults(config):
    """--use-ray moves weights through the run's object bucket (engines on other nodes do not see
    the trainer's disk): object-store unless the transfer mode was given (config.py refuses disk)."""
    if config.trainer.use_ray and "update_weight_transfer_mode" not in config.flags_set:
        return config.model_copy(update={"update_weight_transfer_mode": "object-store"})
    return config


def init_ray(address: str | None, namespace: str, num_cpus: int | None = None):
    """Join the cluster at `address`, or start a new local one for this run (never one found on the
    machine), gone with this process. A local one gets Ray's token authentication with a token of
    its own in our environment, which the children inherit (Ray would otherwise write one to ~/.ray)."""
    kw = {}
    if address is None:
        address, kw = "local", {"num_cpus": num_cpus, "include_dashboard": False}
        if "RAY_AUTH_MODE" not in os.environ:
            os.environ |= {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": secrets.token_hex(32)}
    import ray

    ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level=logging.WARNING, **kw)
    return ray


class Placement:
    """The run's placement group and its children's hosts (the launcher's side)."""

    def __init__(self, config, run_dir: Path):
        self.run_dir = run_dir
        self.namespace = f"asyncrl-{config.infra.run_id}"
        self.pg_name = f"{self.namespace}-placement"
        engines = 0 if config.infra.rollout_external_engine_addrs else config.infra.rollout_num_engines
        sizes = {"trainer": config.trainer.num_ranks, "rollout": engines + config.infra.rollout_num_producers}
        self.ray = ray = init_ray(os.environ.get("RAY_ADDRESS") or None, self.namespace, num_cpus=sum(sizes.values()))
        from ray.util.placement_group import placement_group

        self.address = ray.get_runtime_context().gcs_address
        self.gpus = 1 if ray.cluster_resources().get("GPU", 0) > 0 else 0
        gpus = {"trainer": config.trainer.num_ranks * self.gpus, "rollout": engines * self.gpus}
        self.bundles = {side: i for i, side in enumerate(s for s in SIDES if sizes[s])}
        self.pg = placement_group([{"CPU": sizes[s], **({"GPU": gpus[s]} if gpus[s] else {})} for s in self.bundles],
                                  strategy="SPREAD", name=self.pg_name)  # fmt: skip
        try:
            ray.get(self.pg.ready(), timeout=READY_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            raise LaunchError(f"the Ray cluster at {self.address} has no room for the bundles "
                               f"{self.pg.bundle_specs} after {READY_TIMEOUT_S:.0f}s (`ray status` shows it)") from None  # fmt: skip
        self.hosts: dict[str, object] = {}
        self.children: dict[str, dict] = {}
        self.record()

    def host(self, name: str, side: str) -> tuple[str, int]:
        """A host for child `name` in `side`'s bundle: its node's IP and a free port there."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle = self.bundles[side]
        if name not in self.hosts:
            strategy = PlacementGroupSchedulingStrategy(placement_group=self.pg, placement_group_bundle_index=bundle)
            gpus = self.gpus if name.startswith(("engine-", "trainer")) else 0
            self.hosts[name] = self.ray.remote(ChildHost).options(
                name=name, scheduling_strategy=strategy, num_cpus=1, num_gpus=gpus, max_concurrency=4
            ).remote(f"{self.namespace}/{self.pg_name}/{bundle}", self.address)  # fmt: skip
        ip, port = self.ray.get(self.hosts[name].address.remote(), timeout=READY_TIMEOUT_S)
        self.children[name] = {"side": side, "bundle": bundle, "node_ip": ip, "url": f"http://{ip}:{port}"}
        self.record()
        return ip, port

    def wrap(self, name: str, cmd: list[str]) -> list[str]:
        """The local attachment that runs `cmd` in `name`'s host."""
        return [sys.executable, "-m", "services.raycluster", "attach", "--actor", name, "--namespace", self.namespace,
                "--address", self.address, "--", *cmd]  # fmt: skip

    def record(self) -> None:
        """RUN_DIR/ray.json, replaced whole."""
        info = {"address": self.address, "namespace": self.namespace, "placement_group": self.pg_name,
                "strategy": "SPREAD", "bundles": {s: {"index": i, **self.pg.bundle_specs[i]} for s, i in self.bundles.items()},
                "children": self.children}  # fmt: skip
        procs.replace_file(self.run_dir / "ray.json", json.dumps(info, indent=2))

    def close(self) -> None:
        """The hosts and the placement group go (their subprocesses die with them), then our driver."""
        from ray.util.placement_group import remove_placement_group

        for h in self.hosts.values():
            with contextlib.suppress(self.ray.exceptions.RayError):
                self.ray.get(h.close.remote(), timeout=CALL_TIMEOUT_S)
            self.ray.kill(h)
        remove_placement_group(self.pg)
        self.ray.shutdown()


class ChildHost:
    """A Ray actor that runs one child's command on its node: started by `start`, its output read
    by `poll` (from a node-local log), stopped by `stop`; started again by the next `start`."""

    def __init__(self, placement: str, address: str):
        import ray

        self.placement, self.ray_address = placement, address
        self.node_ip = ray.util.get_node_ip_address()
        self.proc = None
        self.log = Path(tempfile.mkdtemp(prefix="asyncrl-child-")) / "out.log"
        self.lock = threading.Lock()

    def address(self) -> tuple[str, int]:
        return self.node_ip, procs.free_port(self.node_ip)

    def start(self, cmd: list[str], env: dict[str, str], cwd: str) -> None:
        """Run `cmd` here (a previous run of it stopped first), told its node and placement."""
        with self.lock:
            if self.proc is not None:
                procs.stop(self.proc)
            env = {**env, NODE_IP_ENV: self.node_ip, PLACEMENT_ENV: self.placement, "RAY_ADDRESS": self.ray_address}
            if "CUDA_VISIBLE_DEVICES" in os.environ:  # the GPUs Ray gave this host
                env["CUDA_VISIBLE_DEVICES"] = os.environ["CUDA_VISIBLE_DEVICES"]
            self.log.write_bytes(b"")
            self.proc = procs.spawn(cmd, log_path=self.log, env=env, cwd=cwd if Path(cwd).is_dir() else None)

    def poll(self, offset: int, wait_s: float) -> tuple[bytes, int | None]:
        """Output after `offset` and the exit code (None while it runs); waits up to wait_s for either."""
        deadline = time.monotonic() + wait_s
        while True:
            code = self.proc.poll()
            with open(self.log, "rb") as f:
                f.seek(offset)
                data = f.read(1 << 20)
            if data or code is not None or time.monotonic() >= deadline:
                return data, code
            time.sleep(0.1)

    def stop(self, timeout_s: float) -> int | None:
        with self.lock:
            return procs.stop(self.proc, timeout_s=timeout_s) if self.proc is not None else None

    def close(self) -> None:
        """Stop the command and remove its node-local log (before the actor is killed)."""
        self.stop(10.0)
        shutil.rmtree(self.log.parent, ignore_errors=True)


def attach(argv: list[str]) -> int:
    """The launcher's local child for a placed one: runs the command in its host, relays the
    output, exits with its exit code; SIGTERM stops the remote command first."""
    p = argparse.ArgumentParser(prog="python -m services.raycluster attach")
    for flag in ("--actor", "--namespace", "--address"):
        p.add_argument(flag, required=True)
    p.add_argument("cmd", nargs=argparse.REMAINDER)
    a = p.parse_args(argv)
    cmd = a.cmd[1:] if a.cmd[:1] == ["--"] else a.cmd
    stopping = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    ray = init_ray(a.address, a.namespace)
    host = ray.get_actor(a.actor)
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    ray.get(host.start.remote(cmd, env, os.getcwd()), timeout=CALL_TIMEOUT_S)
    out, offset = sys.stdout.buffer, 0
    while True:
        if stopping.is_set():
            ray.get(host.stop.remote(10.0), timeout=CALL_TIMEOUT_S)
        data, code = ray.get(
            host.poll.remote(offset, 0.0 if stopping.is_set() else POLL_WAIT_S), timeout=CALL_TIMEOUT_S
        )
        out.write(data)
        out.flush()
        offset += len(data)
        if code is not None and not data:
            return code


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] != ["attach"]:
        raise SystemExit(
            "usage: python -m services.raycluster attach --actor NAME --namespace NS --address ADDR -- CMD..."
        )
    code = attach(argv[1:])
    os._exit(code if code >= 0 else 128 - code)  # a signal's death as a shell reports it; no Ray teardown wait


if __name__ == "__main__":
    main()
