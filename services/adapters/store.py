"""The registry's durable state: KV `adapters` of the run, written compare-and-set.

Every write names the KV revision its writer last read (JetStream's expected last subject
sequence), so of two registries writing at once only one wins; the other gets SequenceConflict,
reads the key again and decides again. Revision 0 means "the key must not exist yet" (or be
deleted: an operator may delete it to start an empty registry).

It reaches the KV bucket through `Bus.kv()` and recognises the conflict by the server's answer,
because the bus has no revision-aware calls yet; `Bus.kv_entry` / `Bus.kv_update` would be their
natural home (services/common/bus.py), and nothing here imports nats-py.
"""

from __future__ import annotations

from asyncrl_proto import AdapterRegistryState, MalformedMessage, decode, encode
from asyncrl_proto.subjects import ADAPTERS_KV_KEY
from services.common.bus import Bus, BusError, SequenceConflict, TransportError, raise_if_store_full


class RegistryStore:
    def __init__(self, bus: Bus, key: str = ADAPTERS_KV_KEY):
        self.bus = bus
        self.key = key

    async def read(self) -> tuple[AdapterRegistryState | None, int]:
        """(the stored state, its KV revision), or (None, 0) when nothing is stored yet. The value
        and the revision come from one read, so a write expecting that revision fails if anyone
        wrote after it."""
        if await self.bus.kv_get(self.key) is None:
            return None, 0
        entry = await (await self.bus.kv()).get(self.key)
        try:
            return decode(entry.value, AdapterRegistryState), entry.revision
        except MalformedMessage as e:
            raise BusError(
                f"KV {self.key} of bucket {self.bus.subjects.kv_bucket} holds no adapter registry state ({e}); "
                "the registry will not overwrite it: inspect it, then delete the key to start an empty registry"
            ) from None

    async def write(self, state: AdapterRegistryState, last_revision: int) -> int:
        """Store `state` if the key is still at `last_revision`; returns the new revision.
        SequenceConflict when another writer got there first."""
        kv = await self.bus.kv()
        try:
            if last_revision == 0:  # create: also over a deleted key's tombstone
                return await kv.create(self.key, encode(state))
            return await kv.update(self.key, encode(state), last=last_revision)
        except TransportError as e:
            if "wrong last sequence" in str(getattr(e, "description", None) or e).lower():
                raise SequenceConflict(
                    f"KV {self.key} moved past revision {last_revision}: another registry wrote it"
                ) from e
            raise_if_store_full(e, f"KV {self.key}")
            raise
