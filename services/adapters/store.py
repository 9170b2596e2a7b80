"""The registry's durable state: KV `adapters` of the run, written compare-and-set.

Every write names the KV revision its writer last read (`Bus.kv_update`), so of two registries
writing at once only one wins; the other gets SequenceConflict, reads the key again and decides
again. Revision 0 means "the key must not exist yet" (or be deleted: an operator may delete it to
start an empty registry).
"""

from __future__ import annotations

from asyncrl_proto import AdapterRegistryState, MalformedMessage, decode, encode
from asyncrl_proto.subjects import ADAPTERS_KV_KEY
from services.common.bus import Bus, BusError


class RegistryStore:
    def __init__(self, bus: Bus, key: str = ADAPTERS_KV_KEY):
        self.bus = bus
        self.key = key

    async def read(self) -> tuple[AdapterRegistryState | None, int]:
        """(the stored state, its KV revision), or (None, 0) when nothing is stored yet. The value
        and the revision come from one read, so a write expecting that revision fails if anyone
        wrote after it."""
        raw, revision = await self.bus.kv_entry(self.key)
        if raw is None:
            return None, 0
        try:
            return decode(raw, AdapterRegistryState), revision
        except MalformedMessage as e:
            raise BusError(
                f"KV {self.key} of bucket {self.bus.subjects.kv_bucket} holds no adapter registry state ({e}); "
                "the registry will not overwrite it: inspect it, then delete the key to start an empty registry"
            ) from None

    async def write(self, state: AdapterRegistryState, last_revision: int) -> int:
        """Store `state` if the key is still at `last_revision`; returns the new revision.
        SequenceConflict when another writer got there first."""
        return await self.bus.kv_update(self.key, encode(state), last_revision)
