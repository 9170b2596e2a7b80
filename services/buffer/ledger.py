"""The buffer's ledger on the bus: recovery (the last KV snapshot plus the LEDGER messages after
it, folded by services.buffer.state) and the one ordered writer of new events.

One writer: every append expects the stream's last sequence to be the last one this buffer
wrote or replayed (a partition of a multi-LoRA run, whose ledger is one subject of the shared
stream: the subject's last sequence, one ledger message at a time). A message it did not write in between (a second buffer, a forged publish) is
a conflict: the buffer's state is no longer the ledger's fold, so nothing leaves it afterwards
and the service fails (a crash, restarted; its restart replays what the other wrote).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from asyncrl_proto import LedgerBatch, LedgerEvent, encode
from asyncrl_proto.subjects import Subjects
from services.buffer.state import BufferState, LedgerError, StateError, apply, decode_state, encode_state, ledger_events
from services.common import crash
from services.common.bus import Bus, SequenceConflict

log = logging.getLogger(__name__)

SNAPSHOT_EVERY = 500
LEDGER_BATCH_EVENTS = 256
LEDGER_BATCH_BYTES = 256 * 1024
"""Events and bytes per ledger message at most (a released event carries its prompt; the
broker's message limit is 1 MB by default, and a chunk stays below half of what it says)."""


class LedgerConflict(RuntimeError):
    """Another writer appended to the ledger: this buffer's state is no longer the ledger's
    fold. It exits (a crash, restarted), and its restart replays what the other wrote."""


class Ledger:
    def __init__(self, bus: Bus, fail: Callable[[BaseException], None], background: Callable, subjects: Subjects):
        self.bus = bus
        self.subjects = subjects
        """The ledger subject and the snapshot key are its partition's (multi-LoRA)."""
        self._fail = fail
        self._background = background
        self.state = BufferState()
        self.problems: list[str] = []  # entries the replay skipped (undecodable, out of order)
        self.snapshot_seq = 0
        self._unflushed: list[LedgerEvent] = []
        self._lock = asyncio.Lock()
        self._conflict: LedgerConflict | None = None

    async def recover(self) -> int:
        """Load the last snapshot and replay the ledger after it; returns the events replayed."""
        raw = await self.bus.kv_get(self.subjects.buffer_snapshot_key)
        if raw is not None:
            self.state = decode_state(raw)
            self.snapshot_seq = self.state.seq
        replayed = 0
        async for seq, msg in self._messages():
            try:
                events = ledger_events(msg.data or b"")
            except LedgerError as e:  # not written by a buffer: skip it, say so
                self._problem(f"ledger message {seq}: {e}; skipped")
                events = []
            for ev in events:
                if ev.seq <= self.state.seq:  # an append retried beyond the dedupe window, or a second writer
                    self._problem(f"ledger message {seq} repeats event {ev.seq}; skipped")
                    continue
                try:
                    apply(self.state, ev)
                    replayed += 1
                except StateError as e:
                    self._problem(f"ledger message {seq}: {e}; skipped")
            self.state.log_stream_seq = seq
        return replayed

    async def _messages(self):
        """The ledger's messages after the state's, in order: every one of the stream (a gap is
        corruption), or a partition's, one subject of it."""
        stream, seq = self.subjects.ledger_stream, self.state.log_stream_seq + 1
        if self.subjects.partition:
            while (msg := await self.bus.get_next(stream, self.subjects.ledger, seq)) is not None:
                yield msg.seq, msg
                seq = msg.seq + 1
            return
        _, last, _ = await self.bus.stream_bounds(stream) or (1, 0, 0)
        for seq in range(seq, last + 1):
            msg = await self.bus.get_msg(stream, seq, direct=True)
            if msg is None:  # a gap (deleted message) is corruption: say so
                raise RuntimeError(f"cannot replay ledger message {seq} of {stream}: it is gone")
            yield seq, msg

    def _problem(self, text: str) -> None:
        self.problems.append(text)
        log.error("%s", text)

    def add(self, events: list[LedgerEvent]) -> None:
        """Queue events already applied to the state, in the order they were decided (called
        synchronously right after the decision, so that the order is the state's)."""
        self._unflushed.extend(events)

    async def flush(self, snapshot: bool = False) -> None:
        """Make every queued event durable, in order; snapshot the state now and then."""
        async with self._lock:
            if self._conflict is not None:  # its state holds decisions the ledger refused: nothing more leaves
                raise self._conflict
            while self._unflushed:
                crash.point("buffer", "decided_before_append")
                events, self._unflushed = self._unflushed, []
                subject, run, part = self.subjects.ledger, self.subjects.run_id, self.subjects.partition
                batches = chunks(events, min(LEDGER_BATCH_BYTES, self.bus.max_payload // 2))
                items = [(subject, LedgerBatch(events=c), f"{run}{part}-L{c[0].seq}-{c[-1].seq}") for c in batches]
                expected = "expected_last_subject_seq" if part else "expected_last_seq"
                try:  # one writer: nothing may come in between on the stream (a partition's: on its subject)
                    for group in [[item] for item in items] if part else [items]:
                        n = sum(len(batch.events) for _, batch, _ in group)
                        expect = {expected: self.state.log_stream_seq}
                        acks = await self.bus.publish_durably(group, f"{n} ledger events", **expect)
                        self.state.log_stream_seq = max(self.state.log_stream_seq, acks[-1].seq)
                        events = events[n:]
                except SequenceConflict as e:
                    self._conflict = LedgerConflict(
                        f"the ledger holds a message this buffer did not write ({e}): another buffer is running for "
                        "this run, or something else published there; restarting to replay it"
                    )
                    self._fail(self._conflict)  # also from a commit or get handler, where raising ends nothing
                    raise self._conflict from e
                except BaseException:
                    self._unflushed = events + self._unflushed  # not durable: nobody may read it as such
                    raise
            if snapshot or self.state.seq - self.snapshot_seq >= SNAPSHOT_EVERY:
                # everything up to state.seq is durable now: a consistent snapshot, written off
                # the critical path (a late older snapshot only means a longer replay)
                data, self.snapshot_seq = encode_state(self.state), self.state.seq
                crash.point("buffer", "snapshot_write")
                key = self.subjects.buffer_snapshot_key
                if snapshot:
                    await self.bus.kv_put(key, data)
                else:
                    self._background(self.bus.kv_put(key, data), "the buffer snapshot")


def chunks(events: list[LedgerEvent], max_bytes: int) -> list[list[LedgerEvent]]:
    """Consecutive runs of events, each at most LEDGER_BATCH_EVENTS events and max_bytes
    encoded (an event larger than that travels alone)."""
    out: list[list[LedgerEvent]] = []
    size = 0
    for ev in events:
        n = len(encode(ev)) if ev.prompt is not None or ev.metrics else 256
        if not out or len(out[-1]) >= LEDGER_BATCH_EVENTS or size + n > max_bytes:
            out.append([])
            size = 0
        out[-1].append(ev)
        size += n
    return out
