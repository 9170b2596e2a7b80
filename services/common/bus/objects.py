"""The object store of one bus connection (`Bus.objects`): put, delete and list the objects of a
JetStream object-store bucket. Its one user is services.weights.store (object-store weights);
the bucket itself is created with the run's streams (`Bus.ensure_streams`). Reading an object goes
by direct gets of its meta and chunks (`Bus.get_last`, `Bus.get_next`), which need no consumer."""

from __future__ import annotations

import contextlib

import nats.js.errors
from nats.js import api

from services.common.bus.errors import through_outage


class ObjectStore:
    """The object-store buckets seen through one connection's JetStream context."""

    def __init__(self, js):
        self.js = js

    async def put(self, bucket: str, name: str, data, chunk_size: int) -> None:
        """Store `data` (bytes or a binary file) as object `name`, in chunks of chunk_size bytes."""
        obs = await self.js.object_store(bucket)
        meta = api.ObjectMeta(name=name, options=api.ObjectMetaOptions(max_chunk_size=chunk_size))
        await obs.put(name, data, meta=meta)

    async def delete(self, bucket: str, name: str) -> None:
        """Delete object `name` (its chunks are purged); nothing when it is not there."""
        obs = await self.js.object_store(bucket)
        with contextlib.suppress(nats.js.errors.ObjectNotFoundError, nats.js.errors.ObjectDeletedError):
            await obs.delete(name)

    async def names(self, bucket: str) -> list[str]:
        """The names of the objects in a bucket (none when the bucket does not exist). Lists by
        an ordered consumer: the admin's right, not a service's."""

        async def names() -> list[str]:
            try:
                obs = await self.js.object_store(bucket)
                infos = await obs.list(ignore_deletes=True)
            except (nats.js.errors.BucketNotFoundError, nats.js.errors.NotFoundError):
                return []
            return [i.name for i in infos if not i.deleted]

        # rides out a cluster whose streams are still electing leaders (an audit just started it)
        return await through_outage(names, bucket, 30.0, "list")
