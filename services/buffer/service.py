"""Buffer service: moves bytes between the bus and the buffer's state machine.

Consumes: RolloutGroup messages from ROLLOUTS (durable push consumer "buffer"); `buffer.get`
  and `buffer.commit` requests from the trainer; `weights.live` (the staleness clock); producer
  heartbeats (their in-flight caps, for the fully-async release policy).
Produces: PromptMsg on PROMPTS (releases, recycled prompts first); LedgerBatch on LEDGER (every
  decision); replies with GroupRefs (where the trainer reads each group on ROLLOUTS) and the
  step's get_metrics() snapshot.
Decisions: services.buffer.machine (synchronous, no I/O). This module decodes, calls the
  machine, appends what it recorded, then sends what it answered: a ROLLOUTS message is
  acknowledged, a lease handed out, only once the ledger holds the decision. A prompt is
  published (deterministic Nats-Msg-Id) before its release is recorded.
Recovery: services.buffer.ledger (snapshot + replay); the stored groups go back into the
  DataBuffer from ROLLOUTS; redelivered messages are recognised (no longer outstanding).
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
    BufferCommit,
    BufferGetRequest,
    Heartbeat,
    RolloutGroup,
    WeightsLive,
    WeightsPublished,
    decode,
    encode,
    group_id,
)
from asyncrl_proto.codec import MalformedMessage
from asyncrl_proto.messages import flatten_group
from services.buffer.core import DefaultDataBuffer, make_buffer
from services.buffer.ledger import Ledger
from services.buffer.machine import BufferMachine, BufferPluginError, Out, group_identity
from services.common import crash
from services.common.bus import VersionBound, next_batch, settle
from services.common.config import AsyncSection, DataSection, RolloutSection, TrainerSection
from services.common.datasource import make_prompt_source
from services.common.plugins import load_object
from services.common.promexport import LATENCY_BUCKETS_S
from services.common.runtime import Service, wait_event
from services.common.validate import limits_from_model_dir

log = logging.getLogger(__name__)

PURGE_INTERVAL_S = 1.0
"""Trained payloads are purged from ROLLOUTS at most this often (two broker round trips each)."""


class BufferService(Service):
    name = "buffer"
    reads = (DataSection, RolloutSection, AsyncSection, TrainerSection)  # TrainerSection: commit_interval
    counter_keys = frozenset({"buffer/ledger_events"})
    histograms = {"buffer/get_wait_seconds": ("Seconds from a trainer's buffer.get to its reply, for the gets "
                                              "answered before their wait ran out", LATENCY_BUCKETS_S)}  # fmt: skip

    def __init__(self, config, bus, **kw):
        super().__init__(config, bus, **kw)
        source = make_prompt_source(config)
        self.buffer = make_buffer(config, self._recycle)
        self.plugin_path = config.custom_async_data_buffer_path or "services.api.DefaultDataBuffer"
        self.published = VersionBound(bus)  # the newest weight version the trainer published
        self.core = BufferMachine(
            config, source,
            limits_from_model_dir(config.hf_checkpoint, config.n_samples_per_prompt, config.reward_key),
            published=lambda: self.published.value, metrics=self._metrics,
            observed=isinstance(self.buffer, DefaultDataBuffer), plugin_path=self.plugin_path,
        )  # fmt: skip
        if isinstance(self.buffer, DefaultDataBuffer):
            self.buffer.on_event = self._on_decision
        path = config.rollout_all_samples_process_path
        self.all_samples_fn = load_object(path, "--rollout-all-samples-process-path") if path else None
        self._step_groups: list[list] = []  # the groups of the step being leased, filtered ones included
        self.ledger = Ledger(bus, self.fail, self.background)
        self._consumer = bus.subjects.consumers(config.prompt_ack_wait_s)["buffer"]
        self._rollouts = None
        self._wake_release, self._wake_pump = asyncio.Event(), asyncio.Event()
        self._release_recorded = asyncio.Event()  # replaced by a fresh one after each release is recorded
        self._answered: dict[int, asyncio.Event] = {}  # id(request message) -> set once answered
        self._next_purge = 0.0
        self._purged_upto = 0
        self._next_live_read = 0.0

    # what tests and the status page read
    state = property(lambda self: self.core.state)
    live_version = property(lambda self: self.core.live_version)
    producers = property(lambda self: self.core.producers)
    ledger_problems = property(lambda self: self.ledger.problems)

    async def setup(self) -> None:
        s = self.bus.subjects
        replayed = await self.ledger.recover()
        stored = [decode(await self.bus.get_payload(s.rollouts_stream, ref.stream_seq), RolloutGroup)
                  for ref in self.ledger.state.stored.values()]  # fmt: skip
        await self._plugin(self.buffer.restore(self.core.on_restart(self.ledger.state, stored)), "restore")
        if self.ledger.snapshot_seq or replayed:
            log.info("recovered the buffer: snapshot at event %d, %d events replayed, %d groups restored",
                     self.ledger.snapshot_seq, replayed, len(stored))  # fmt: skip
        self._rollouts = await self.bus.consume(self._consumer)
        await self.bus.subscribe(s.weights_published, self._on_published)  # before the bound's read: nothing missed
        await self.published.refresh()
        await self.bus.subscribe(s.weights_live, self._on_live)
        await self._read_live_version()
        await self.bus.subscribe(s.buffer_get, self._on_get)
        await self.bus.subscribe(s.buffer_commit, self._on_commit)
        await self.bus.subscribe(s.heartbeat("rollout"), self._on_heartbeat)
        log.info("buffer ready: capacity %d groups, %d prompts per epoch, mode %s, %d ledger events, %d stored, "
                 "%d outstanding, committed step %d", self.config.buffer_capacity, self.core.source.epoch_size,
                 self.config.mode, self.state.seq, len(self.state.stored), len(self.state.outstanding),
                 self.state.committed_step)  # fmt: skip

    def loops(self):
        return {"consume_rollouts": self._consume_rollouts, "release_prompts": self._release_prompts,
                "pump_gets": self._pump_gets}  # fmt: skip

    async def teardown(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.ledger.flush(snapshot=True), 5)

    async def _apply(self, out: Out, durable: bool = False) -> None:
        """Queue what the machine recorded, then dead-letter and answer what it said; a reply
        (and a completed lease, or `durable`) waits until the ledger holds everything decided
        so far. Other events ride the next append: one per batch of groups, not one per group."""
        self.ledger.add(out.events)  # before any await: the ledger's order is the decisions' order
        self._wake_release.set()
        self._wake_pump.set()
        completes = any(e.kind == "lease_complete" for e in out.events)
        if durable or completes or out.replies:
            await self.ledger.flush()
        if completes:
            crash.point("buffer", "lease_decided_before_reply")
            self._process_all_samples()
        for msg, reason in out.dead_letters:
            if msg is None:
                log.error("ignoring the KV value: %s", reason)
            else:
                await self.bus.dead_letter(msg.subject, msg.data, reason)
        for msg, reply in out.replies:
            if (answered := self._answered.pop(id(msg), None)) is not None:
                answered.set()
            if msg.reply:  # a message that asked for no answer gets none
                with contextlib.suppress(Exception):  # the requester may be gone: it asks again
                    await msg.respond(encode(reply))

    @contextlib.contextmanager
    def _blame(self, what: str):
        """A DataBuffer method that raises fails the service with the plugin's path."""
        try:
            yield
        except Exception as e:
            raise BufferPluginError(f"{self.plugin_path}.{what} raised {type(e).__name__}: {e}") from e

    async def _plugin(self, awaitable, what: str):
        with self._blame(what):
            return await awaitable

    def _metrics(self) -> dict:
        with self._blame("get_metrics"):
            return self.buffer.get_metrics()

    async def _recycle(self, group: list) -> None:
        self.core.on_recycled(group)

    # ---- put path ----------------------------------------------------------------------------
    async def _consume_rollouts(self) -> None:
        while True:
            msgs = await next_batch(self._rollouts, 64, 1.0)
            done = [(msg, await self._put_one(msg, pending=msgs[i:])) for i, msg in enumerate(msgs)]
            await self.ledger.flush()
            if done:
                crash.point("buffer", "appended_before_ack")
            for msg, how in done:
                await settle(msg, how)

    async def _put_one(self, msg, pending: list) -> str:
        """Returns how to settle the message once what was decided on it is durable."""
        try:
            rg, undecodable = decode(msg.data, RolloutGroup), None
        except MalformedMessage as e:
            rg, undecodable = group_identity(msg.data), f"undecodable RolloutGroup: {e}"
        if undecodable is None:  # a version newer than the bound: re-read WEIGHTS before judging
            await self.published.allows(max((v for s in flatten_group(rg.samples) for v in s.weight_versions), default=0))  # fmt: skip
        seq = msg.metadata.sequence.stream
        while (out := self.core.on_group(msg, seq, rg, undecodable, msg.data)).settle in ("wait", "release"):
            if out.settle == "release":  # its release was published, its record lost in a crash
                await self._release(out.release)
            else:
                await self._release_recorded.wait()  # a release is being recorded
        self.ledger.add(out.events)
        for m, reason in out.dead_letters:
            await self.bus.dead_letter(m.subject, m.data, reason)
        if out.settle != "put":
            return out.settle
        put = asyncio.ensure_future(self._plugin(self.buffer.put(rg.samples), "put"))
        await asyncio.wait({put}, timeout=0.05)
        while not put.done():  # a full buffer holds the producers back
            await self.ledger.flush()  # what is decided becomes durable meanwhile
            for m in pending:
                await settle(m, "in_progress")  # and the waiting messages stay ours
            await asyncio.wait({put}, timeout=self._consumer.ack_wait_s / 3)
        put.result()
        await self._apply(self.core.on_put_returned())
        return "ack"

    # ---- release -----------------------------------------------------------------------------
    async def _release_prompts(self) -> None:
        while True:
            await wait_event(self._wake_release, 1.0)
            self._wake_release.clear()
            if self.core.live_version is None and time.monotonic() >= self._next_live_read:
                self._next_live_read = time.monotonic() + 1.0  # a broker round trip: once a second at most
                await self._read_live_version()  # weight-sync may have announced before we listened
            if planned := self.core.plan_release(time.time()):
                await self._release(planned)

    async def _release(self, planned: list) -> None:
        """Publish prompts (deterministic ids: a re-release after a crash dedupes), then record them."""
        items = [(self.bus.subjects.prompts, p, f"prompt-{group_id(p.group_index, p.attempt)}") for p, _ in planned]
        await self.bus.publish_durably(items, f"{len(planned)} prompts")
        out = self.core.on_released(planned)
        recorded, self._release_recorded = self._release_recorded, asyncio.Event()
        recorded.set()  # the puts waiting for it run once this appends (in order) and yields
        await self._apply(out, durable=True)

    # ---- get path ----------------------------------------------------------------------------
    async def _on_get(self, msg) -> None:
        self.background(self._handle_get(msg), "a get request")  # a waiting get holds no other request up

    async def _handle_get(self, msg) -> None:
        if (req := await self.bus.decode_or_dead_letter(msg, BufferGetRequest)) is None:
            return
        for v in (req.current_version, req.release_min_version):
            if v is not None:
                await self.published.allows(v)  # re-reads the bound for a version newer than it
        answered = self._answered[id(msg)] = asyncio.Event()
        t0 = time.perf_counter()
        out = self.core.on_get(msg, req)
        await self._apply(out)
        if out.waiting and not await wait_event(answered, req.wait_s):
            await self._apply(self.core.on_get_timeout(msg, req.step))
        elif not out.dead_letters:
            self.observe("buffer/get_wait_seconds", time.perf_counter() - t0)
        self._answered.pop(id(msg), None)

    async def _pump_gets(self) -> None:
        """Drain the DataBuffer into the oldest requested step short of groups."""
        while True:
            step = self.core.step_to_fill()
            if step is None or not self.state.stored:  # judge staleness when a group is there to judge
                await self._wake_pump.wait()
                self._wake_pump.clear()
                continue
            version = self.core.clock()
            group = await self._plugin(self.buffer.get(current_version=version, step=step), "get")
            if self.all_samples_fn is not None:
                self._step_groups.append(group)
            await self._apply(self.core.on_handed(step, group, version))

    def _on_decision(self, kind: str, group: list, reason: str | None) -> None:
        if kind == "filtered" and self.all_samples_fn is not None:
            self._step_groups.append(group)
        self.core.on_decision(kind, group, reason)

    def _process_all_samples(self) -> None:
        """Miles's --rollout-all-samples-process-path, fn(config, all_samples, data_source), once
        per completed lease with every group generated for it, those the dynamic filter dropped
        included, sorted by index (data_source: None; recycling is the buffer's own). A hook that
        raises is logged; not durable: a restarted buffer does not call it again."""
        if self.all_samples_fn is None:
            return
        groups, self._step_groups = sorted(self._step_groups, key=lambda g: flatten_group(g)[0].index), []
        try:
            self.all_samples_fn(self.config, groups, None)
        except Exception as e:
            log.warning("--rollout-all-samples-process-path raised: %s", e)

    # ---- commit, live version, producers -------------------------------------------------------
    async def _on_commit(self, msg) -> None:
        if (req := await self.bus.decode_or_dead_letter(msg, BufferCommit)) is None:
            return
        out = self.core.on_commit(msg, req)
        await self._apply(out)
        if out.purge and time.monotonic() >= self._next_purge:
            self._next_purge = time.monotonic() + PURGE_INTERVAL_S
            self.background(self._purge_trained(), "purging trained groups")

    async def _purge_trained(self) -> None:
        """One purge below the oldest message still needed, not a delete per group: per-message
        deletes in a file store cost the whole pipeline an order of magnitude in throughput."""
        try:
            stream = self.bus.subjects.rollouts_stream
            upto = self.core.purge_floor(await self.bus.consumer_ack_floor(stream, "buffer"))
            if upto > self._purged_upto + 1:
                await self.bus.purge_below(stream, upto)
                self._purged_upto = upto - 1
        except Exception as e:  # storage hygiene only: never fail the buffer for it
            log.warning("could not purge trained payloads from ROLLOUTS: %s", e)

    async def _on_live(self, msg) -> None:
        if (live := await self.bus.decode_or_dead_letter(msg, WeightsLive)) is not None:
            await self.published.allows(live.version)
            await self._apply(self.core.on_version(msg, live.version))

    async def _read_live_version(self) -> None:
        raw = await self.bus.kv_get("live_version")
        with contextlib.suppress(MalformedMessage):
            if raw is not None:
                await self.published.allows(version := decode(raw, WeightsLive).version)
                await self._apply(self.core.on_version(None, version))

    async def _on_published(self, msg) -> None:
        with contextlib.suppress(MalformedMessage):  # weight-sync dead-letters bad ones; we only read the number
            self.published.value = max(self.published.value, decode(msg.data, WeightsPublished).version)

    async def _on_heartbeat(self, msg) -> None:
        if (hb := await self.bus.decode_or_dead_letter(msg, Heartbeat)) is not None:
            await self._apply(self.core.on_heartbeat(msg, hb, time.time()))

    # ---- observability -------------------------------------------------------------------------
    def status(self) -> dict:
        return {**self.core.status(time.time()), "dead_lettered": dict(self.bus.dead_lettered),
                "ledger_problems": self.ledger.problems[-20:], "buffer_class": self.plugin_path}  # fmt: skip

    def metric_values(self) -> dict[str, float]:
        out = self.core.metric_values(time.time())
        out["buffer/ledger/dead_lettered_total"] = sum(self.bus.dead_lettered.values())
        out["buffer/ledger/replay_skipped_total"] = len(self.ledger.problems)
        if isinstance(self.buffer, DefaultDataBuffer) and (stored := self.buffer.stored_staleness()):
            out["rollout/fully_async/buffer_avg_staleness"] = sum(stored) / len(stored)
            out["rollout/fully_async/buffer_max_staleness"] = max(stored)
        return out
