"""The NATS bus: the only coupling between services (docs/architecture.md, "Rooms: who may
import what"), and the only code that imports nats-py.

- client.py `Bus`: one service's connection, bound to one run: typed publish/request with the
  msgpack codec, idempotent stream and KV setup from the names in asyncrl_proto.subjects, pull
  consumers, direct gets and dead-lettering. The connection reconnects forever, so a restarted
  nats-server (file storage) is survived by every service;
- objects.py `ObjectStore` (`Bus.objects`): put, delete and list objects (object-store weights);
- errors.py: what services catch, and `through_outage`;
- consume.py: taking, holding and settling consumed messages.
"""

from services.common.bus.client import Bus
from services.common.bus.consume import Settle, fetch_some, keep_alive, next_batch, settle
from services.common.bus.errors import (
    STORE_DIR_ENV,
    BusAuthError,
    BusError,
    SequenceConflict,
    StoreFull,
    StreamFull,
    StreamSetupError,
    TransportError,
    through_outage,
    until_room,
)

__all__ = [
    "STORE_DIR_ENV", "Bus", "BusAuthError", "BusError", "SequenceConflict", "Settle", "StoreFull", "StreamFull",
    "StreamSetupError", "TransportError", "fetch_some", "keep_alive", "next_batch", "settle", "through_outage",
    "until_room",
]  # fmt: skip
