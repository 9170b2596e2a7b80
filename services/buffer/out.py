"""What the buffer's machine (machine.py) says: the states it names groups and leases by, the
group in put(), and `Out`, what each event leaves for the partition (services/buffer/partition.py)
to do: append the ledger events, then send the replies, dead-letter, settle the message."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any

from asyncrl_proto import LedgerEvent


class BufferPluginError(RuntimeError):
    pass


class GroupState(enum.Enum):
    RELEASING = "releasing"  # planned, its release not yet recorded (nor its prompt published)
    OUTSTANDING = "outstanding"  # released: queued, generating, or its group not yet read
    PUTTING = "putting"  # in the DataBuffer's put()
    STORED = "stored"
    LEASED = "leased"  # in the lease of an uncommitted step
    SETTLED = "settled"  # trained, dropped, filtered, rejected, recycled as a new attempt, or unknown


class Verdict(str, enum.Enum):
    """The machine's word on a ROLLOUTS message; an ACK or TERM settles it as the bus's `Settle` of that value."""

    ACK = "ack"  # decided (stored elsewhere, a duplicate, foreign): acknowledge it
    TERM = "term"  # rejected: never redelivered
    PUT = "put"  # call the DataBuffer's put, then on_put_returned; then acknowledge


class LeaseState(enum.Enum):
    OPEN = "open"  # asked for or being filled, short of B groups or not yet recorded complete
    COMPLETE = "complete"  # B groups, durable before any get is answered with it
    COMMITTED = "committed"


@dataclasses.dataclass
class Put:
    """The group in put(), and what is known of its fate."""

    group_id: str
    group_index: int
    attempt: int
    stream_seq: int
    oldest_version: int | None
    failed: bool
    recorded: bool = False
    handed_back: bool = False
    """A custom DataBuffer gave it to its unused-samples handler during put() (aborted)."""

    def event_fields(self) -> dict[str, Any]:
        return {"group_id": self.group_id, "group_index": self.group_index, "attempt": self.attempt,
                "stream_seq": self.stream_seq, "oldest_version": self.oldest_version, "failed": self.failed}  # fmt: skip


@dataclasses.dataclass
class Out:
    events: list[LedgerEvent] = dataclasses.field(default_factory=list)
    """Recorded and applied; the service appends them before anything below leaves."""
    replies: list[tuple[Any, Any]] = dataclasses.field(default_factory=list)
    """(request handle, reply struct)."""
    dead_letters: list[tuple[Any, str]] = dataclasses.field(default_factory=list)
    """(message handle, reason)."""
    settle: Verdict | None = None
    """For a ROLLOUTS message: what becomes of it (Verdict)."""
    waiting: bool = False
    """on_get: the request waits for its step's lease (answered by a later Out, or on_get_timeout)."""
    purge: bool = False
    """on_commit: trained payloads can be purged from ROLLOUTS."""
