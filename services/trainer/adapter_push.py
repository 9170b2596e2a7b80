"""Multi-LoRA: an adapter version from the trainer to weight-sync.

The adapter in a MultiLora slot is written as a PEFT directory (its `.complete` marker last) at
`<run_dir>/adapters/<name>/<registration>/v<version>`, then announced on WEIGHTS
(`weights.adapters`, an AdapterPublished, deduplicated by its id), for weight-sync to load on
every engine (services/weightsync/adapters.py). Disk mode: the engines read the run directory;
object-store mode: the directory is uploaded to the run's weights bucket first and announced by
its `nats-object://` URI (services/weights/store.py), which the built-in engines fetch.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

from asyncrl_proto import AdapterPublished
from services.model.lora import MultiLora, save_adapter
from services.weights.store import WeightStore, adapter_uri


def adapter_dir(run_dir: str | Path, name: str, registration_id: str, version: int) -> Path:
    return Path(run_dir) / "adapters" / name / registration_id / f"v{version}"


async def publish_adapter(bus, lora: MultiLora, slot: int, run_dir: str | Path, name: str, registration_id: str,
                          version: int, base_model: str = "", store: WeightStore | None = None) -> AdapterPublished:  # fmt: skip
    """Save the slot's adapter as version `version` (and upload it, object-store mode) and
    announce it; the announcement."""
    out = adapter_dir(run_dir, name, registration_id, version)
    await asyncio.to_thread(save_adapter, lora, slot, out, base_model)
    return await announce_adapter(bus, run_dir, name, registration_id, version, store)


async def announce_adapter(bus, run_dir: str | Path, name: str, registration_id: str, version: int,
                           store: WeightStore | None = None) -> AdapterPublished:  # fmt: skip
    """Announce a saved version, uploaded first in object-store mode (again: a restarted trainer
    re-announces the version it resumes from, whose announcement a kill may have cut; weight-sync
    skips a version it has live, the message id dedupes a recent repeat, an upload is idempotent)."""
    out = adapter_dir(run_dir, name, registration_id, version)
    size = sum(f.stat().st_size for f in out.iterdir() if f.is_file())
    uri = str(out)
    if store is not None:
        await store.upload_adapter(name, registration_id, version, out)
        uri = adapter_uri(store.bucket, name, registration_id, version)
    pub = AdapterPublished(name=name, registration_id=registration_id, version=version, uri=uri,
                           num_bytes=size, created_at=time.time())  # fmt: skip
    await bus.publish(bus.subjects.adapters_published, pub, msg_id=f"adapter-{name}-{registration_id}-v{version}")
    return pub
