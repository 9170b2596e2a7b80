"""Buffer service: hosts the run's buffer partitions (services.buffer.partition) on the bus.

How many partitions, and what feeds them, is its layout, chosen once at start-up: a single-model
run has one partition under the run's own names (`OnePartition`); a multi-LoRA run
(--multi-lora-n-adapters) has one per adapter registration, following the registry
(services/buffer/adapters.py, `AdapterPartitions`).

Consumes: RolloutGroup messages from ROLLOUTS (durable push consumer "buffer"; a multi-LoRA run's
  reads every partition and hands each message to its partition); `buffer.get` and
  `buffer.commit` requests from the trainer (`.<registration>` for a partition); `weights.live`
  (the staleness clock of a single-model run); producer heartbeats (their in-flight caps, for the
  fully-async release policy, shared round-robin by the partitions).
Produces: PromptMsg on PROMPTS (releases, recycled prompts first); LedgerBatch on LEDGER (every
  decision); replies with GroupRefs (where the trainer reads each group on ROLLOUTS) and the
  step's get_metrics() snapshot.
Foreign groups: a group of a registration whose partition is closed (retired, and its name
  registered again) is recorded `put foreign` in that registration's ledger and dropped; one of a
  registration the registry never held is rejected and dead-lettered.
Recovery: services.buffer.ledger (snapshot + replay), per partition; the stored groups go back
  into the DataBuffer from ROLLOUTS; redelivered messages are recognised (no longer outstanding).
Backpressure: the DataBuffer's put() blocks while it is full, so the consumer stops reading
  ROLLOUTS and the release policy stops releasing prompts: producers run dry.
HTTP: /status shows capacity, stored groups, the staleness clock and the ledger counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from asyncrl_proto import (
    BufferCommitReply,
    BufferGetReply,
    Heartbeat,
    WeightsLive,
    WeightsPublished,
    decode,
    encode,
)
from asyncrl_proto.codec import MalformedMessage
from asyncrl_proto.messages import NO_PARTITION_ERROR
from services.buffer.adapters import AdapterPartitions
from services.buffer.partition import Partition
from services.common.config import (
    AsyncSection,
    DataSection,
    MultiLoraSection,
    RolloutSection,
    TrainerSection,
)
from services.common.promexport import LATENCY_BUCKETS_S
from services.common.runtime import Service
from services.common.versions import VersionBound

log = logging.getLogger(__name__)

PURGE_INTERVAL_S = 1.0
"""Trained payloads are purged from ROLLOUTS at most this often (two broker round trips each)."""


class OnePartition(Partition):
    """A single-model run's buffer layout: one partition under the run's own names, its clock the
    engines' live version (the multi-LoRA layout is services/buffer/adapters.py)."""

    def __init__(self, svc) -> None:
        super().__init__(svc, svc.config, svc.bus.subjects, svc.published, None)
        self.parts = {"": self}

    async def setup(self) -> None:
        bus, s = self.svc.bus, self.svc.bus.subjects
        await self.recover()
        self.svc.rollouts = self.rollouts = await bus.consume(self.svc.consumer)
        await bus.subscribe(s.weights_published, self.svc.on_published)  # before the bound's read: nothing missed
        await self.svc.published.refresh()
        await bus.subscribe(s.weights_live, self._on_live)
        await self.read_live_version()
        await bus.subscribe(s.buffer_get, self.svc.on_get)
        await bus.subscribe(s.buffer_commit, self.svc.on_commit)

    def stop(self) -> list[Partition]:
        return [self]

    async def part_of(self, subject: str, base: str) -> Partition:
        return self

    async def _on_live(self, msg) -> None:
        if (live := await self.svc.bus.decode_or_dead_letter(msg, WeightsLive)) is not None:
            await self.on_live(msg, live.version)


class BufferService(Service):
    name = "buffer"
    reads = (DataSection, RolloutSection, AsyncSection, TrainerSection, MultiLoraSection)  # TrainerSection: commit_interval
    counter_keys = frozenset({"buffer/ledger_events"})
    histograms = {"buffer/get_wait_seconds": ("Seconds from a trainer's buffer.get to its reply, for the gets "
                                              "answered before their wait ran out", LATENCY_BUCKETS_S)}  # fmt: skip

    def __init__(self, config, bus, **kw):
        super().__init__(config, bus, **kw)
        config = self.config  # its own sections from here on (services.common.config.view)
        partitioned = config.multi_lora.n_adapters > 0
        self.consumer = bus.subjects.consumers(config.async_.prompt_ack_wait_s, partitioned)["buffer"]
        self.rollouts = None
        self._next_purge = 0.0
        self._purged_upto = 0
        self.published = VersionBound(bus)  # the newest weight version the trainer published
        self.layout = AdapterPartitions(self) if partitioned else OnePartition(self)

    # what tests and the status page read (a single-model run's partition)
    parts = property(lambda self: self.layout.parts)
    part = property(lambda self: self.parts[""])
    buffer = property(lambda self: self.part.buffer)
    state = property(lambda self: self.part.core.state)
    live_version = property(lambda self: self.part.core.live_version)
    producers = property(lambda self: self.part.core.producers)
    ledger_problems = property(lambda self: [p for part in self.parts.values() for p in part.ledger.problems])

    async def setup(self) -> None:
        await self.layout.setup()
        await self.bus.subscribe(self.bus.subjects.heartbeat("rollout"), self._on_heartbeat)
        for rid, part in self.parts.items():
            st = part.state
            log.info("buffer %s ready: capacity %d groups, %d prompts per epoch, mode %s, %d ledger events, "
                     "%d stored, %d outstanding, committed step %d", rid or "", part.config.buffer_capacity,
                     part.core.source.epoch_size, part.config.infra.mode, st.seq, len(st.stored), len(st.outstanding),
                     st.committed_step)  # fmt: skip

    def loops(self):
        return self.layout.loops()

    async def teardown(self) -> None:
        for part in self.layout.stop():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(part.ledger.flush(snapshot=True), 5)

    # ---- requests ------------------------------------------------------------------------------
    async def on_get(self, msg) -> None:
        if (part := await self._part_of(msg, self.bus.subjects.buffer_get, BufferGetReply)) is not None:
            self.background(part.handle_get(msg), "a get request")  # a waiting get holds no other request up

    async def on_commit(self, msg) -> None:
        part = await self._part_of(msg, self.bus.subjects.buffer_commit, BufferCommitReply)
        if part is not None and await part.handle_commit(msg) and time.monotonic() >= self._next_purge:
            self._next_purge = time.monotonic() + PURGE_INTERVAL_S
            self.background(self._purge_trained(), "purging trained groups")

    async def _part_of(self, msg, base: str, reply) -> Partition | None:
        """The request's partition; a request for none the registry holds open is answered with an error."""
        if (part := await self.layout.part_of(msg.subject, base)) is None and msg.reply:
            error = f"{msg.subject} {NO_PARTITION_ERROR} (an adapter registration the registry does not hold open)"
            with contextlib.suppress(Exception):  # the requester may be gone
                await msg.respond(encode(reply(step=-1, error=error)))
        return part

    async def _purge_trained(self) -> None:
        """One purge below the oldest message still needed, not a delete per group: per-message
        deletes in a file store cost the whole pipeline an order of magnitude in throughput."""
        try:
            stream = self.bus.subjects.rollouts_stream
            floor = await self.bus.consumer_ack_floor(stream, "buffer")
            upto = min(part.core.purge_floor(floor) for part in self.parts.values()) if self.parts else floor
            if upto > self._purged_upto + 1:
                await self.bus.purge_below(stream, upto)
                self._purged_upto = upto - 1
        except Exception as e:  # storage hygiene only: never fail the buffer for it
            log.warning("could not purge trained payloads from ROLLOUTS: %s", e)

    async def on_published(self, msg) -> None:
        with contextlib.suppress(MalformedMessage):  # weight-sync dead-letters bad ones; we only read the number
            self.published.value = max(self.published.value, decode(msg.data, WeightsPublished).version)

    async def _on_heartbeat(self, msg) -> None:
        if (hb := await self.bus.decode_or_dead_letter(msg, Heartbeat)) is not None:
            await self.layout.on_heartbeat(msg, hb)

    # ---- observability -------------------------------------------------------------------------
    def status(self) -> dict:
        return {**self.layout.status(), "dead_lettered": dict(self.bus.dead_lettered)}

    def health_note(self) -> str | None:
        """The run's stall, with its cause (every partition's, multi-LoRA)."""
        now = time.time()
        stalls = [(name and f"partition {name}: ", st) for name, p in self.parts.items() if (st := p.core.stall(now))]
        return "; ".join(f"{label}stalled for {st['for_s']:.0f} s at step {st['step']}: {st['cause']}"
                         for label, st in stalls) or None  # fmt: skip

    def metric_values(self) -> dict[str, float]:
        out = self.layout.metric_values()
        out["buffer/ledger/dead_lettered_total"] = sum(self.bus.dead_lettered.values())
        return out
