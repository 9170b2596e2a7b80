"""The trainer's weight versions: each push is a snapshot `weights/v<N>` (in the run's bucket too
with --update-weight-transfer-mode object-store; held for weight-sync's broadcast with
`distributed`), announced on `weights.published`, and kept while anything may still need it:
the newest --keep-weight-snapshots, the one behind the committed step (a restart without --save
resumes from it), and those newer than the engines' live version (weight-sync may be loading one).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from pathlib import Path
from urllib.parse import urlsplit

from asyncrl_proto import WeightsLive, WeightsPublished
from services.common import crash
from services.common.snapshot import is_complete, numbered, remove_snapshot, snapshots_to_remove
from services.common.versions import publish_weights
from services.model.hf_io import save_model
from services.model.transfer import local_address_towards
from services.trainer.worker import NODE_IP_ENV
from services.weights.store import WeightStore, WeightStoreError

log = logging.getLogger(__name__)

FINAL_BROADCAST_TIMEOUT_S = 120.0
"""Distributed mode: how long the trainer stays after its last step for the engines to take the
final weights by broadcast (only it holds them)."""


class WeightPublisher:
    """`store`: the run's weights bucket (object-store); `stored`: the versions that may still be
    in it; `sender`: rank 0 of the weight transfer group (distributed)."""

    def __init__(self, config, bus, model, weights_dir: Path):
        self.config = config
        self.bus = bus
        self.model = model
        self.weights_dir = weights_dir
        self.snapshots: list[Path] = [p for _, p in numbered(weights_dir.glob("v*"))]
        self.store: WeightStore | None = None
        if config.async_.update_weight_transfer_mode == "object-store":
            self.store = WeightStore(bus, chunk_size=config.async_.update_weight_buffer_size)
        self.stored: set[int] = set()
        self.sender = None

    def resumed(self, version: int) -> None:
        """A trainer resumed at `version`: any version so far may still be in the bucket (each
        older one is looked up once and retired as retention passes it)."""
        if self.store is not None:
            self.stored = set(range(1, version + 1))

    async def start_sender(self, master_address: str) -> None:
        """--update-weight-transfer-mode distributed: weight-sync asks for each version by broadcast."""
        from services.trainer.parallel import backend_for
        from services.trainer.transfer import WeightSender

        self.sender = WeightSender(
            self.model, self.weights_dir, master_address, backend_for(self.config.trainer.dist_backend)
        )
        await self.bus.subscribe(self.bus.subjects.weights_transfer, self.sender.on_request)

    async def push(self, version: int, step: int, committed_version: int | None) -> None:
        """Version `version`, the weights after `step`: exported, stored, announced, then retained."""
        path = self.weights_dir / f"v{version}"
        info = await asyncio.to_thread(save_model, self.model, path, self.config.data.hf_checkpoint)
        uri = str(path.resolve())
        if self.store is not None:  # every engine, on any host, fetches it from the bucket
            await self.store.upload(version, path)
            crash.point("trainer", "weights_stored")  # stored, not yet announced
            uri = self.store.uri(version)
            self.stored.add(version)
        # distributed: weight-sync asks for these tensors by broadcast; the snapshot stays for a restart
        tensor_sha = await asyncio.to_thread(self.sender.hold, version) if self.sender is not None else ""
        pub = WeightsPublished(
            version=version, step=step, uri=uri, sha256=info["sha256"],
            num_bytes=info["num_bytes"], created_at=time.time(), tensor_sha256=tensor_sha,
        )  # fmt: skip
        await publish_weights(self.bus, pub)
        if path not in self.snapshots:  # re-pushed under the same number after a crash
            self.snapshots.append(path)
        await self.retain(version, committed_version)

    async def retain(self, version: int, committed_version: int | None) -> None:
        """Keep the newest --keep-weight-snapshots snapshots, and always the one behind the
        committed step: without --save, a restarted trainer resumes from it. In object-store
        mode the bucket keeps the same versions (after a restart, every older version is looked
        up once and retired)."""
        keep = max(1, self.config.trainer.keep_weight_snapshots)
        backing = self.weights_dir / f"v{committed_version}" if committed_version is not None else None
        # a version newer than the engines' live one may be loading right now: deleting it under
        # weight-sync loses that whole update (the engines stay behind a cycle longer), so those
        # stay too, up to SNAPSHOT_LAG_FACTOR x --keep-weight-snapshots (engines that are away)
        try:
            live = await self.bus.kv_get("live_version", WeightsLive)
            # the engines' version, never beyond what this trainer pushed (a forged value would let it
            # delete the live snapshot)
            live = min(live.version, version) if live is not None else 0
        except Exception:  # a broker away: retain as before (a value that does not decode reads as none)
            live = version
        for old in snapshots_to_remove(self.snapshots, keep, backing, live):
            self.snapshots.remove(old)
            remove_snapshot(old)
        if self.store is not None:  # the same versions, by number
            stored = [self.weights_dir / f"v{v}" for v in sorted(self.stored)]
            for v in [int(p.name[1:]) for p in snapshots_to_remove(stored, keep, backing, live)]:
                await self.store.retire(v)
                self.stored.discard(v)

    async def have_snapshot(self, pub: WeightsPublished) -> bool:
        """The snapshot of `pub` is on local disk, or (object-store) fetched from the bucket now:
        a trainer restarted on another host resumes from the newest stored version."""
        local = self.weights_dir / f"v{pub.version}"
        if is_complete(local):
            return True
        if self.store is None:
            return False
        try:
            await self.store.fetch(pub.version, local, expect_sha256=pub.sha256)
        except WeightStoreError as e:
            log.info("weights v%d are not usable from the object store: %s", pub.version, e)
            return False
        log.info("fetched the weights v%d from the object store into %s", pub.version, local)
        return True

    async def wait_final_broadcast(self, version: int) -> None:
        """Distributed mode: only the trainer holds the newest weights, so it stays (answering
        weight-sync's broadcasts) until they are live, or FINAL_BROADCAST_TIMEOUT_S has passed."""
        if self.sender is None:
            return
        deadline = time.monotonic() + FINAL_BROADCAST_TIMEOUT_S
        while time.monotonic() < deadline:
            live = await self.bus.kv_get("live_version", WeightsLive)
            if live is not None and live.version >= version:
                return
            await asyncio.sleep(0.2)
        log.error("weights v%d were not live within %.0fs of the last step: the engines keep an older version",
                  version, FINAL_BROADCAST_TIMEOUT_S)  # fmt: skip

    async def stop(self) -> None:
        if self.sender is not None:
            await self.sender.stop()


def master_address(config) -> str:
    """Where the engines reach the trainer's weight transfer group: --update-weight-master-address,
    the node's address a Ray placement gave this process, or this host's address on its route to
    the NATS server (an address the other hosts of the run reach; 127.0.0.1 with a local server)."""
    if given := config.async_.update_weight_master_address or os.environ.get(NODE_IP_ENV):
        return given
    host = urlsplit((config.infra.nats_url or "").split(",")[0].strip()).hostname or "127.0.0.1"
    try:
        return local_address_towards(host)
    except OSError:
        return "127.0.0.1"
