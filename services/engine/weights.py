"""The built-in engine's fetcher of object-store weights (--update-weight-transfer-mode
object-store): `nats-object://<bucket>/v<N>` snapshots of its own run, downloaded once into a local
cache directory with the read-only `engine` NATS identity, digests checked, the newest few kept;
and multi-LoRA adapter versions (`nats-object://<bucket>/adapters/<name>/<registration>/v<N>`,
for /load_lora_adapter), the newest few of each registration kept."""

from __future__ import annotations

import asyncio
import logging
import shutil
from pathlib import Path

from services.common.snapshot import is_complete, numbered
from services.weights.store import WeightStore, adapter_key, parse_adapter_uri, parse_uri

log = logging.getLogger(__name__)
KEEP = 3


class ObjectWeights:
    def __init__(self, nats_url: str, run_id: str, cache_dir: str | Path):
        self.nats_url, self.run_id = nats_url, run_id
        self.cache_dir = Path(cache_dir)
        self.bus = None
        self._lock = asyncio.Lock()

    async def local(self, uri: str, adapter: bool = False) -> Path:
        """The local copy of a snapshot (adapter: an adapter version) of this run's bucket,
        fetched unless already here; of the `v<N>` directories beside it, the newest KEEP stay (an
        adapter version's files are in memory once loaded: a pruned one loads again by fetching)."""
        parsed = parse_adapter_uri(uri) if adapter else parse_uri(uri)
        if parsed is None:
            form = "adapters/<name>/<registration>/v<N>" if adapter else "v<N>"
            raise ValueError(f"{uri!r:.120} is not a nats-object://<bucket>/{form} URI")
        bucket, *key = parsed
        async with self._lock:
            if self.bus is None:  # connected at the first fetch
                from services.common.bus import Bus

                self.bus = await Bus.connect(self.nats_url, self.run_id, "engine", connect_timeout_s=10)
            store = WeightStore(self.bus)
            if bucket != store.bucket:
                raise ValueError(f"{uri!r:.120} is not in this run's weights bucket {store.bucket}")
            dest = self.cache_dir / (adapter_key(*key) if adapter else f"v{key[0]}")
            if not is_complete(dest):
                await (store.fetch_adapter(*key, dest) if adapter else store.fetch(key[0], dest))
                log.info("fetched %s from the object store into %s", uri, dest)
            for _, old in numbered(dest.parent.glob("v*"))[:-KEEP]:
                if old != dest:  # and `dest` itself
                    shutil.rmtree(old, ignore_errors=True)
            return dest

    async def close(self) -> None:
        if self.bus is not None:
            await self.bus.close()
