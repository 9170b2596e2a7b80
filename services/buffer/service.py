"""Buffer service: the one place where group-level decisions are made, durably.

Consumes: RolloutGroup messages from ROLLOUTS (durable push consumer "buffer"); `buffer.get`
  and `buffer.commit` requests from the trainer; `weights.live` (the staleness clock); producer
  heartbeats (their in-flight caps, for the fully-async release policy).
Produces: PromptMsg on PROMPTS (releases, recycled prompts first); LedgerBatch on LEDGER (every
  decision); replies with GroupRefs (where the trainer reads each group on ROLLOUTS) and the
  step's get_metrics() snapshot.
Durability: the state (services.buffer.state) is the fold of the ledger. Every decision is
  appended to LEDGER before its effect leaves the process: before a ROLLOUTS message is
  acknowledged, before a lease is handed to the trainer. A prompt is published to PROMPTS (with
  a deterministic Nats-Msg-Id) before its release is recorded. After SIGKILL the service loads
  the last KV snapshot, replays the ledger after it, refills the DataBuffer from ROLLOUTS and
  carries on; redelivered messages are recognised (their group is no longer outstanding).
Backpressure: put() blocks while the buffer is full, so the consumer stops reading ROLLOUTS
  and the release policy stops releasing prompts: producers run dry.
Leases: a repeated get for a step returns the same groups until the trainer commits the step
  (after its checkpoint); a restarted trainer gets exactly the groups it had. A get is answered
  once its lease is durable (on the ledger), never before.
HTTP: /status shows capacity, stored groups, the staleness clock and the ledger counters.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import Any

import msgspec

from asyncrl_proto import (
    BufferCommit,
    BufferCommitReply,
    BufferGetReply,
    BufferGetRequest,
    GroupRef,
    Heartbeat,
    LedgerBatch,
    LedgerEvent,
    RolloutGroup,
    WeightsLive,
    WeightsPublished,
    decode,
    encode,
    group_id,
)
from asyncrl_proto.codec import MalformedMessage
from asyncrl_proto.messages import SampleStatus, flatten_group, oldest_weight_version
from services.buffer.core import DataBuffer, DefaultDataBuffer, staleness
from services.buffer.policy import ReleaseState, release_allowance
from services.buffer.state import (
    BufferState,
    LedgerError,
    StateError,
    apply,
    decode_state,
    encode_state,
    ledger_events,
)
from services.common import crash
from services.common.bus import SequenceConflict, VersionBound, next_batch, settle
from services.common.datasource import PromptSource, load_rows
from services.common.plugins import load_object
from services.common.runtime import Service, wait_event
from services.common.validate import group_problem, limits_from_model_dir

log = logging.getLogger(__name__)

PRODUCER_TIMEOUT_S = 10.0
MAX_PRODUCERS = 1024
"""Producers whose in-flight caps count towards the fully-async release (each at most the
configured cap): what heartbeats can make the buffer release is bounded."""
MAX_RELEASE = 256
"""Prompts released at once at most (the release loop comes back for the rest)."""
SNAPSHOT_EVERY = 500
PURGE_INTERVAL_S = 1.0
"""Trained payloads are purged from ROLLOUTS at most this often (two broker round trips each)."""
LEDGER_BATCH_EVENTS = 256
LEDGER_BATCH_BYTES = 256 * 1024
"""Events and bytes per ledger message at most (a released event carries its prompt; the
broker's message limit is 1 MB by default, and a chunk stays below half of what it says)."""
INLINE_MAX_BYTES = 64 * 1024
"""Groups up to this size travel inline in the get reply (they are in memory anyway), which
saves the trainer a round trip per group; larger ones are read from ROLLOUTS by sequence."""
INLINE_REPLY_MAX_BYTES = 4 * 1024 * 1024


class BufferPluginError(RuntimeError):
    pass


class LedgerConflict(RuntimeError):
    """Another writer appended to the ledger: this buffer's state is no longer the ledger's
    fold. It exits (a crash, restarted), and its restart replays what the other wrote."""


def make_buffer(config, recycle) -> DataBuffer:
    if config.custom_async_data_buffer_path:
        cls = load_object(config.custom_async_data_buffer_path, "--custom-async-data-buffer-path")
        if not (isinstance(cls, type) and issubclass(cls, DataBuffer)):
            raise ValueError(
                f"--custom-async-data-buffer-path {config.custom_async_data_buffer_path} must name a "
                "subclass of services.api.DataBuffer"
            )
        return cls(config, recycle)
    return DefaultDataBuffer(config, recycle)


class BufferService(Service):
    name = "buffer"

    def __init__(self, config, bus, **kw):
        super().__init__(config, bus, **kw)
        if not config.prompt_data:
            raise ValueError("the buffer needs --prompt-data (the launcher sets it to the task's data)")
        self.source = PromptSource(
            config, load_rows(config.prompt_data, config.input_key, config.label_key, config.metadata_key)
        )
        self.buffer = make_buffer(config, self._recycle)
        self._observed = isinstance(self.buffer, DefaultDataBuffer)
        if self._observed:
            self.buffer.on_event = self._on_buffer_event
        self.plugin_path = config.custom_async_data_buffer_path or "services.api.DefaultDataBuffer"
        self.limits = limits_from_model_dir(config.hf_checkpoint, config.n_samples_per_prompt, config.reward_key)
        self.published = VersionBound(bus)  # the newest weight version the trainer published
        self._consumer = bus.subjects.consumers(config.prompt_ack_wait_s)["buffer"]
        self.state = BufferState()
        self.live_version: int | None = None
        self.requested: dict[int, int] = {}  # step -> B, for steps the trainer has asked for
        self.want_step: int | None = None
        self.lookahead = 0
        self.min_version: int | None = None
        self.override_version: int | None = None
        self.producers: dict[str, tuple[float, int]] = {}
        self.gid_of: dict[int, str] = {}
        """group_index -> group id of the group in the DataBuffer (one attempt of a prompt at a
        time: a new attempt is released only once the last one's fate is recorded)."""
        self._conflict: LedgerConflict | None = None
        """Set when an append found another writer's message: no reply, snapshot or append after it."""
        self.ledger_problems: list[str] = []  # entries the replay skipped (undecodable, out of order)
        self._unflushed: list[LedgerEvent] = []
        self._flush_lock = asyncio.Lock()
        self._snapshot_seq = 0
        self._current_put: _Put | None = None
        self._wake_release = asyncio.Event()
        self._wake_pump = asyncio.Event()
        self._stored = asyncio.Event()
        self._lease_done: dict[int, asyncio.Event] = {}
        self._waiting: dict[int, list[_Waiter]] = {}  # step -> get requests waiting for its lease
        self._rollouts = None
        self.raw_of: dict[str, bytes] = {}  # group id -> encoded group, for small groups
        self._purging = False
        self._purged_upto = 0
        self._next_purge = 0.0
        self._releasing: dict[str, asyncio.Event] = {}  # group id -> set once its release is recorded
        self._next_live_read = 0.0

    # ---- setup and recovery ----------------------------------------------------------------
    async def setup(self) -> None:
        s = self.bus.subjects
        await self._recover()
        self._rollouts = await self.bus.consume(self._consumer)
        # subscribe before reading the KV value, so that no update can fall in between
        await self.bus.subscribe(s.weights_published, self._on_published)
        await self.published.refresh()
        await self.bus.subscribe(s.weights_live, self._on_live)
        await self._read_live_version()
        await self.bus.subscribe(s.buffer_get, self._on_get)
        await self.bus.subscribe(s.buffer_commit, self._on_commit)
        await self.bus.subscribe(s.heartbeat("rollout"), self._on_producer_heartbeat)
        log.info(
            "buffer ready: capacity %d groups, %d prompts per epoch, mode %s, %d ledger events, "
            "%d stored, %d outstanding, committed step %d",
            self.config.buffer_capacity, self.source.epoch_size, self.config.mode, self.state.seq,
            len(self.state.stored), len(self.state.outstanding), self.state.committed_step,
        )  # fmt: skip

    async def _recover(self) -> None:
        """Last snapshot + the ledger after it; then the stored groups back into the DataBuffer."""
        raw = await self.bus.kv_get("buffer_snapshot")
        if raw is not None:
            self.state = decode_state(raw)
            self._snapshot_seq = self.state.seq
        stream = self.bus.subjects.ledger_stream
        _, last, _ = await self.bus.stream_bounds(stream) or (1, 0, 0)
        replayed = 0
        for seq in range(self.state.log_stream_seq + 1, last + 1):
            raw = await self.bus.get_msg(stream, seq, direct=True)
            if raw is None:  # a gap (deleted message) is corruption: say so
                raise RuntimeError(f"cannot replay ledger message {seq} of {stream}: it is gone")
            data = raw.data or b""
            try:
                events = ledger_events(data)
            except LedgerError as e:  # not written by a buffer: skip it, say so
                self._ledger_problem(f"ledger message {seq}: {e}; skipped")
                events = []
            for ev in events:
                if ev.seq <= self.state.seq:  # an append retried beyond the dedupe window, or a second writer
                    self._ledger_problem(f"ledger message {seq} repeats event {ev.seq}; skipped")
                    continue
                try:
                    apply(self.state, ev)
                except StateError as e:
                    self._ledger_problem(f"ledger message {seq}: {e}; skipped")
                    continue
                replayed += 1
            self.state.log_stream_seq = seq
        groups = []
        for gid, ref in self.state.stored.items():
            data = await self.bus.get_payload(self.bus.subjects.rollouts_stream, ref.stream_seq)
            rg = decode(data, RolloutGroup)
            self.gid_of[rg.group_index] = gid
            groups.append(rg.samples)
        if groups:
            if self._observed:
                self.buffer.restore(groups)
            else:
                for g in groups:
                    await self._plugin(self.buffer.put(g), "put")
        if raw is not None or replayed:
            log.info("recovered the buffer: snapshot at event %d, %d events replayed, %d groups restored",
                     self._snapshot_seq, replayed, len(groups))  # fmt: skip

    def loops(self):
        return {
            "consume_rollouts": self._consume_rollouts,
            "release_prompts": self._release_prompts,
            "pump_gets": self._pump_gets,
        }

    async def teardown(self) -> None:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._flush(snapshot=True), 5)

    def _ledger_problem(self, text: str) -> None:
        self.ledger_problems.append(text)
        log.error("%s", text)

    # ---- the ledger ----------------------------------------------------------------------------
    def _record(self, kind: str, **fields: Any) -> LedgerEvent:
        ev = LedgerEvent(seq=self.state.seq + 1, kind=kind, ts=time.time(), **fields)
        apply(self.state, ev)
        self._unflushed.append(ev)
        return ev

    async def _flush(self, snapshot: bool = False) -> None:
        """Make every recorded event durable, in order; snapshot the state now and then."""
        async with self._flush_lock:
            if self._conflict is not None:  # its state holds decisions the ledger refused: nothing more leaves
                raise self._conflict
            while self._unflushed:
                crash.point("buffer", "decided_before_append")
                events, self._unflushed = self._unflushed, []
                subject, run = self.bus.subjects.ledger, self.bus.subjects.run_id
                chunks = _chunks(events, min(LEDGER_BATCH_BYTES, self.bus.max_payload // 2))
                try:
                    acks = await self.bus.publish_durably(
                        [(subject, LedgerBatch(events=c), f"{run}-L{c[0].seq}-{c[-1].seq}") for c in chunks],
                        f"{len(events)} ledger events",
                        expected_last_seq=self.state.log_stream_seq,  # one writer: nothing may come in between
                    )
                except SequenceConflict as e:
                    self._conflict = LedgerConflict(
                        f"the ledger holds a message this buffer did not write ({e}): another buffer is running for "
                        "this run, or something else published there; restarting to replay it"
                    )
                    self.fail(self._conflict)  # also from a commit or get handler, where raising ends nothing
                    raise self._conflict from e
                except BaseException:
                    self._unflushed = events + self._unflushed  # not durable: nobody may read it as such
                    raise
                self.state.log_stream_seq = max(self.state.log_stream_seq, acks[-1].seq)
            if snapshot or self.state.seq - self._snapshot_seq >= SNAPSHOT_EVERY:
                # everything up to state.seq is durable now: a consistent snapshot, written
                # off the critical path (a late older snapshot only means a longer replay)
                data, self._snapshot_seq = encode_state(self.state), self.state.seq
                crash.point("buffer", "snapshot_write")
                if snapshot:
                    await self.bus.kv_put("buffer_snapshot", data)
                else:
                    self.background(self.bus.kv_put("buffer_snapshot", data), "the buffer snapshot")

    async def _plugin(self, awaitable, what: str):
        """Calls into the DataBuffer: a plugin that raises fails the service with its path."""
        try:
            return await awaitable
        except Exception as e:
            raise BufferPluginError(f"{self.plugin_path}.{what} raised {type(e).__name__}: {e}") from e

    # ---- put path ----------------------------------------------------------------------------
    async def _consume_rollouts(self) -> None:
        while True:
            msgs = await next_batch(self._rollouts, 64, 1.0)
            done = []  # (message, ack or term): settled once what was decided on it is durable
            for i, msg in enumerate(msgs):
                done.append((msg, await self._put_one(msg, pending=msgs[i:])))
            await self._flush()
            if done:
                crash.point("buffer", "appended_before_ack")
            for msg, how in done:
                await settle(msg, how)
            if done:
                self._wake_release.set()

    async def _put_one(self, msg, pending: list) -> str:
        """Decide one group; returns how to settle its message once the decision is durable:
        "ack", or "term" for a group rejected (dead-lettered, its fate recorded as `rejected`)."""
        seq = msg.metadata.sequence.stream
        try:
            rg, undecodable = decode(msg.data, RolloutGroup), None
        except MalformedMessage as e:
            rg, undecodable = _identity(msg.data), f"undecodable RolloutGroup: {e}"
        gid = group_id(rg.group_index, rg.attempt) if rg is not None else ""
        if (releasing := self._releasing.get(gid)) is not None:
            await releasing.wait()  # its prompt is published, its release about to be recorded
        if (problem := undecodable or await self._group_problem(rg)) is not None:
            await self._reject(msg, rg, problem)
            return "term"
        common = {"group_id": gid, "group_index": rg.group_index, "attempt": rg.attempt}
        if gid not in self.state.outstanding:
            self._record("put", outcome="duplicate", stream_seq=seq, **common)
            return "ack"
        group = rg.samples
        self.gid_of[rg.group_index] = gid
        if len(msg.data) <= INLINE_MAX_BYTES:
            self.raw_of[gid] = msg.data
        self._current_put = cur = _Put(
            **common, stream_seq=seq, oldest_version=oldest_weight_version(group),
            failed=all(s.status == SampleStatus.FAILED for s in flatten_group(group)),
        )  # fmt: skip
        put = asyncio.ensure_future(self._plugin(self.buffer.put(group), "put"))
        await asyncio.wait({put}, timeout=0.05)
        while not put.done():  # a full buffer holds the producers back
            await self._flush()  # what is decided becomes durable meanwhile
            for m in pending:
                await settle(m, "in_progress")  # and the waiting messages stay ours
            await asyncio.wait({put}, timeout=self._consumer.ack_wait_s / 3)
        put.result()
        if not cur.recorded:  # a custom buffer: its decision is not observable
            self._record_put("aborted" if cur.recycled else "accepted", recycled=cur.recycled)
        return "ack"

    def _record_put(self, outcome: str, reason: str = "", recycled: bool = False) -> None:
        """Record the decision on the group being put. Called the moment it is made (from the
        DefaultDataBuffer's event), before any other coroutine can get the stored group."""
        cur = self._current_put
        self._record("put", outcome=outcome, reason=reason, recycled=recycled, **cur.event_fields())
        cur.recorded = True
        if outcome in ("stored", "accepted"):
            self._stored.set()
        else:
            self.raw_of.pop(cur.group_id, None)
            self.gid_of.pop(cur.group_index, None)

    async def _group_problem(self, rg: RolloutGroup) -> str | None:
        """Why this group may not be stored, or None (services.common.validate, plus: its prompt
        was released). A weight version newer than the newest published one we know of makes
        us re-read WEIGHTS once before rejecting (its announcement may still be on the way)."""
        if rg.group_index >= self.state.next_group_index:
            return f"group_index {rg.group_index} was never released (next is {self.state.next_group_index})"
        newest = max((v for s in flatten_group(rg.samples) for v in s.weight_versions), default=0)
        await self.published.allows(newest)  # re-reads the bound if the group names a newer version
        limits = dataclasses.replace(self.limits, max_version=self.published.value)
        return group_problem(rg.group_id, rg.group_index, rg.attempt, rg.samples, limits)

    async def _reject(self, msg, rg, reason: str) -> None:
        """Dead-letter a group that may not be trained, and record its fate: `rejected`, which
        settles its prompt if that was outstanding (the audit names it; nothing waits for it).
        Its message is terminated only once the record is durable (the caller settles it)."""
        gid = group_id(rg.group_index, rg.attempt) if rg is not None else ""
        self._record("put", outcome="rejected", reason=reason[:500], group_id=gid,
                     group_index=rg.group_index if rg is not None else -1, attempt=rg.attempt if rg is not None else 0,
                     stream_seq=msg.metadata.sequence.stream)  # fmt: skip
        await self.bus.dead_letter(msg.subject, msg.data, reason)

    def _on_buffer_event(self, kind: str, group: list, reason: str | None) -> None:
        """The DefaultDataBuffer's decisions, synchronously, as they happen."""
        retry = self.config.async_unused_samples_handler == "retry"
        if kind == "stored":
            self._record_put("stored")
        elif kind == "filtered":
            self._record_put("filtered", reason or "")
        elif kind == "aborted":
            self._record_put("aborted", recycled=retry)
        elif kind == "stale":
            gid = self.gid_of.pop(_group_index(group))
            self.raw_of.pop(gid, None)
            self._record("stale", group_id=gid, group_index=_group_index(group),
                         staleness=staleness(self._clock(), group), recycled=retry)  # fmt: skip

    async def _recycle(self, group: list) -> None:
        """The unused-samples handler gives a prompt back. The DefaultDataBuffer's recycling is
        recorded through its events; a custom buffer's is recorded here."""
        if self._observed:
            return
        gi = _group_index(group)
        gid = self.gid_of.pop(gi, None)
        if gid is None:
            log.warning("%s recycled a group the buffer does not know; ignored", self.plugin_path)
            return
        if gid in self.state.stored:
            self._record("stale", group_id=gid, group_index=gi, recycled=True)
        elif self._current_put is not None:  # during put: an aborted group
            self._current_put.recycled = True

    # ---- prompt release ------------------------------------------------------------------------
    def _inflight_cap(self) -> int:
        now = time.time()
        self.producers = {k: v for k, v in self.producers.items() if now - v[0] < PRODUCER_TIMEOUT_S}
        live = [cap for _, cap in self.producers.values()]
        return sum(live) if live else self.config.inflight_groups

    def _groups_still_needed(self) -> int:
        if self.want_step is None:
            return 0
        need = 0
        for step in range(self.state.committed_step + 1, self.want_step + self.lookahead + 1):
            lease = self.state.leases.get(step)
            need += self.config.rollout_batch_size - (len(lease.refs) if lease else 0)
        return need

    def release_state(self) -> ReleaseState:
        return ReleaseState(
            mode=self.config.mode,
            batch_size=self.config.rollout_batch_size,
            capacity=self.config.buffer_capacity,
            inflight_cap=self._inflight_cap(),
            want_step=self.want_step,
            lookahead=self.lookahead,
            groups_still_needed=self._groups_still_needed(),
            stored=len(self.state.stored),
            outstanding=len(self.state.outstanding),
            live_version=self.live_version,
            min_version=self.min_version,
        )

    async def _release_prompts(self) -> None:
        while True:
            await wait_event(self._wake_release, 1.0)
            self._wake_release.clear()
            if self.live_version is None and time.monotonic() >= self._next_live_read:
                self._next_live_read = time.monotonic() + 1.0  # a broker round trip: once a second at most
                await self._read_live_version()  # weight-sync may have announced before we listened
            k = release_allowance(self.release_state())
            if k > 0:
                await self._release(min(k, MAX_RELEASE))
                if k > MAX_RELEASE:
                    self._wake_release.set()

    async def _release(self, k: int) -> None:
        """Publish k prompts (deterministic ids: a re-release after a crash dedupes), then
        record the releases."""
        s = self.state
        epoch, cursor, nxt = s.epoch, s.cursor, s.next_group_index
        recycled = list(s.recycled)
        planned = []
        for _ in range(k):
            prompt, cur = self.source.next_release(epoch, cursor, nxt, recycled)
            if recycled:
                recycled.pop(0)
            else:
                epoch, cursor, nxt = cur["epoch"], cur["cursor"], cur["next_group_index"]
            planned.append((prompt, cur))
        subject = self.bus.subjects.prompts
        gids = [group_id(p.group_index, p.attempt) for p, _ in planned]
        recorded = asyncio.Event()  # a producer may answer a prompt before its release is recorded
        self._releasing.update(dict.fromkeys(gids, recorded))
        try:
            await self.bus.publish_durably(
                [(subject, p, f"prompt-{gid}") for (p, _), gid in zip(planned, gids, strict=True)], f"{k} prompts"
            )
            for (prompt, cur), gid in zip(planned, gids, strict=True):
                self._record("released", group_id=gid, group_index=prompt.group_index, attempt=prompt.attempt,
                             prompt=prompt, source=cur)  # fmt: skip
            recorded.set()  # (never on a failed publish: the service fails, its waiting puts with it)
        finally:
            for gid in gids:
                self._releasing.pop(gid, None)
        await self._flush()

    # ---- get path ------------------------------------------------------------------------------
    async def _on_get(self, msg) -> None:
        self.background(self._handle_get(msg), "a get request")

    async def _handle_get(self, msg) -> None:
        if (req := await self.bus.decode_or_dead_letter(msg, BufferGetRequest)) is None:
            return
        if req.step <= self.state.committed_step:
            await _respond(msg, encode(BufferGetReply(step=req.step, error=f"step {req.step} is already committed",
                                                      committed_step=self.state.committed_step)))  # fmt: skip
            return
        if (problem := await self._get_problem(req)) is not None:
            await self._dead_letter_core(msg, problem)
            await _respond(msg, encode(BufferGetReply(step=req.step, error=problem)))
            return
        self.requested.setdefault(req.step, req.count)
        self.want_step = req.step if self.want_step is None else max(self.want_step, req.step)
        self.lookahead = req.lookahead_steps
        self.min_version = req.release_min_version
        self.override_version = req.current_version
        self._wake_release.set()
        self._wake_pump.set()
        done = self._lease_done.setdefault(req.step, asyncio.Event())
        if self._lease_complete(req.step):
            done.set()
        if req.wait_s > 0 and not done.is_set():
            waiter = _Waiter(msg)
            self._waiting.setdefault(req.step, []).append(waiter)
            await wait_event(done, req.wait_s)
            with contextlib.suppress(ValueError):
                self._waiting.get(req.step, []).remove(waiter)
            if waiter.answered:
                return
        await self._flush()  # never hand out a lease that is not durable
        await _respond(msg, self._get_reply(req.step))

    async def _get_problem(self, req: BufferGetRequest) -> str | None:
        """A get the trainer would never send: a step outside the window it can be at (the next
        uncommitted one, plus the steps trained since the last checkpoint and one prefetched),
        another batch size, or versions nobody published."""
        c = self.config
        window = c.commit_interval + 2  # steps trained since the last commit, and one asked ahead
        first = self.state.committed_step + 1
        if not first <= req.step < first + window:
            return f"get(step={req.step}) is outside the steps the trainer can ask for ({first}..{first + window - 1})"
        if req.count != c.rollout_batch_size:
            return f"get(count={req.count}) differs from --rollout-batch-size {c.rollout_batch_size}"
        if req.lookahead_steps not in (0, 1):
            return f"get(lookahead_steps={req.lookahead_steps}): only 0 or 1"
        if not 0 <= req.wait_s <= 30:
            return f"get(wait_s={req.wait_s}): at most 30 s"
        for name in ("current_version", "release_min_version"):
            v = getattr(req, name)
            if v is not None and not await self.published.allows(v):
                return f"get({name}={v}): that weight version was never published (newest {self.published.value})"
        return None

    def _get_reply(self, step: int) -> bytes:
        lease = self.state.leases.get(step)
        return encode(
            BufferGetReply(
                step=step,
                refs=self._with_payloads(lease.refs) if lease else [],
                complete=bool(lease and lease.complete),
                metrics=dict(lease.metrics) if lease else {},
                committed_step=self.state.committed_step,
            )
        )

    def _with_payloads(self, refs: list[GroupRef]) -> list[GroupRef]:
        out, budget = [], INLINE_REPLY_MAX_BYTES
        for r in refs:
            raw = self.raw_of.get(r.group_id)
            if raw is not None and len(raw) <= budget:
                budget -= len(raw)
                r = msgspec.structs.replace(r, payload=raw)
            out.append(r)
        return out

    def _lease_complete(self, step: int) -> bool:
        lease = self.state.leases.get(step)
        return bool(lease and lease.complete)

    def _next_step_to_fill(self) -> int | None:
        steps = sorted(s for s in self.requested if s > self.state.committed_step and not self._lease_complete(s))
        return steps[0] if steps else None

    def _clock(self) -> int | None:
        return self.override_version if self.override_version is not None else self.live_version

    async def _pump_gets(self) -> None:
        """Drain the DataBuffer into the lease of the oldest requested step short of groups: the
        one place where leases are decided."""
        while True:
            step = self._next_step_to_fill()
            if step is None:
                await self._wake_pump.wait()
                self._wake_pump.clear()
                continue
            if self._observed and len(self.buffer) == 0:
                # judge staleness when a group is there to judge, not when we started waiting
                self._stored.clear()
                await self._stored.wait()
                continue
            await self._fill(step)

    async def _fill(self, step: int) -> None:
        """Lease one group to `step` if it is short of groups (the buffer's get may wait for
        one); complete its lease at B: make it durable, then answer the waiting gets."""
        count = self.requested.get(step)
        lease = self.state.leases.get(step)
        if count is None or (lease is not None and lease.complete):
            return
        if lease is None or len(lease.refs) < count:
            version = self._clock()
            group = await self._plugin(self.buffer.get(current_version=version, step=step), "get")
            self._lease(step, group, version)
            self._wake_release.set()
        lease = self.state.leases.get(step)
        if lease is not None and len(lease.refs) >= count and not lease.complete:
            metrics = await self._plugin(_sync(self.buffer.get_metrics), "get_metrics")
            self._record("lease_complete", step=step, metrics={k: float(v) for k, v in metrics.items()})
            waiting = self._waiting.pop(step, [])
            await self._flush()
            crash.point("buffer", "lease_decided_before_reply")
            self._lease_done.setdefault(step, asyncio.Event()).set()
            for waiter in waiting:
                waiter.answered = True
            if waiting:
                await _respond_all(waiting, self._get_reply(step))

    def _lease(self, step: int, group: list, version: int | None) -> None:
        gi = _group_index(group)
        gid = self.gid_of.pop(gi, None)  # a custom buffer may hand back a copy: its prompt names it
        if gid is None:
            raise BufferPluginError(
                f"{self.plugin_path}.get returned a group that was never put (group_index {gi}); "
                "a DataBuffer must return the groups it was given"
            )
        if (
            gid not in self.state.stored
            and self._current_put is not None
            and self._current_put.group_id == gid
            and not self._current_put.recorded
        ):
            self._record_put("accepted")  # a custom buffer handed it out before its put() returned
        self._record("leased", group_id=gid, group_index=gi, step=step, staleness=staleness(version, group))

    # ---- commit, live version, producers ------------------------------------------------------
    async def _on_commit(self, msg) -> None:
        if (req := await self.bus.decode_or_dead_letter(msg, BufferCommit)) is None:
            return
        if (problem := self._commit_problem(req)) is not None:
            await self._dead_letter_core(msg, problem)
            await _respond(msg, encode(BufferCommitReply(step=req.step, error=problem)))
            return
        done_refs = [r for s, lease in self.state.leases.items() if s <= req.step for r in lease.refs]
        seqs = [r.stream_seq for r in done_refs]
        for r in done_refs:
            self.raw_of.pop(r.group_id, None)
        if req.step > self.state.committed_step:
            self._record("committed", step=req.step)
        await self._flush()  # also for a repeated commit: its answer says the commit is durable
        for step in [s for s in self.requested if s <= req.step]:
            self.requested.pop(step)
            self._lease_done.pop(step, None)
            self._waiting.pop(step, None)
        await _respond(msg, encode(BufferCommitReply(step=req.step, num_groups_committed=len(seqs))))
        if seqs and not self._purging and time.monotonic() >= self._next_purge:  # trained: payloads no longer needed
            self._purging, self._next_purge = True, time.monotonic() + PURGE_INTERVAL_S
            self.background(self._purge_trained(), "purging trained groups")

    def _commit_problem(self, req: BufferCommit) -> str | None:
        """A commit of a step that was never trained: every step up to it must hold a complete
        lease (a step beyond the last lease never even had its groups)."""
        if req.version < 0:
            return f"commit(version={req.version}) is negative"
        last = max(self.state.leases, default=self.state.committed_step)
        if req.step > last:
            return f"commit(step={req.step}): no step beyond {last} has a lease, so it was never trained"
        for step in range(self.state.committed_step + 1, req.step + 1):  # at most the leases held
            if not self._lease_complete(step):
                return f"commit(step={req.step}): step {step} has no complete lease, so it was never trained"
        return None

    async def _purge_trained(self) -> None:
        """Drop ROLLOUTS messages below the oldest one still needed (stored, leased, or not yet
        acknowledged by this consumer). One purge, not a delete per group: per-message deletes
        in a file store cost the whole pipeline an order of magnitude in throughput."""
        try:
            stream = self.bus.subjects.rollouts_stream
            ack_floor = await self.bus.consumer_ack_floor(stream, "buffer")
            needed = [r.stream_seq for r in self.state.stored.values()]
            needed += [r.stream_seq for lease in self.state.leases.values() for r in lease.refs]
            upto = min([ack_floor + 1, *needed])
            if upto > self._purged_upto + 1:
                await self.bus.purge_below(stream, upto)
                self._purged_upto = upto - 1
        except Exception as e:  # storage hygiene only: never fail the buffer for it
            log.warning("could not purge trained payloads from ROLLOUTS: %s", e)
        finally:
            self._purging = False

    async def _on_live(self, msg) -> None:
        if (live := await self.bus.decode_or_dead_letter(msg, WeightsLive)) is None:
            return
        await self._set_live(live.version, msg)

    async def _read_live_version(self) -> None:
        raw = await self.bus.kv_get("live_version")
        if raw is not None:
            with contextlib.suppress(MalformedMessage):
                await self._set_live(decode(raw, WeightsLive).version)

    async def _set_live(self, version: int, msg=None) -> None:
        """The staleness clock moves forward only, and only to a version the trainer published
        (a forged WeightsLive(10**9) would otherwise make every group stale)."""
        if not await self.published.allows(version):
            reason = f"live version {version} was never published (newest {self.published.value})"
            if msg is not None:
                await self._dead_letter_core(msg, reason)
            else:
                log.error("ignoring the KV live_version: %s", reason)
            return
        if self.live_version is None or version > self.live_version:
            self.live_version = version
            self._wake_release.set()

    async def _on_published(self, msg) -> None:
        with contextlib.suppress(MalformedMessage):  # weight-sync dead-letters bad ones; we only read the number
            self.published.value = max(self.published.value, decode(msg.data, WeightsPublished).version)

    async def _dead_letter_core(self, msg, reason: str) -> None:
        """A core-NATS message (a request, an announcement) that fails validation."""
        await self.bus.dead_letter(msg.subject, msg.data, reason)

    async def _on_producer_heartbeat(self, msg) -> None:
        if (hb := await self.bus.decode_or_dead_letter(msg, Heartbeat)) is None:
            return
        cap = hb.info.get("inflight_groups", self.config.inflight_groups)
        known = hb.instance_id in self.producers
        if not isinstance(cap, int) or isinstance(cap, bool) or not 0 <= cap <= self.config.inflight_groups:
            problem = f"inflight_groups {cap!r:.40} is not a count in [0, {self.config.inflight_groups}]"
        elif not known and len(self.producers) >= MAX_PRODUCERS:
            problem = f"{len(self.producers)} producers are alive already (at most {MAX_PRODUCERS} are counted)"
        else:
            problem = None
        if problem is not None:
            await self._dead_letter_core(msg, f"heartbeat of {hb.instance_id!r:.40}: {problem}")
            return
        if hb.info.get("stopping"):
            self.producers.pop(hb.instance_id, None)
        else:
            self.producers[hb.instance_id] = (time.time(), cap)
        self._wake_release.set()

    # ---- observability -------------------------------------------------------------------------
    def status(self) -> dict:
        rs = self.release_state()
        return {
            "capacity": self.config.buffer_capacity,
            "stored_groups": rs.stored,
            "live_version": self.live_version,
            "mode": self.config.mode,
            "want_step": self.want_step,
            "committed_step": self.state.committed_step,
            "outstanding_prompts": rs.outstanding,
            "producers": len([1 for ts, _ in self.producers.values() if time.time() - ts < PRODUCER_TIMEOUT_S]),
            "data_source": {
                "epoch": self.state.epoch,
                "cursor": self.state.cursor,
                "next_group_index": self.state.next_group_index,
                "recycled_waiting": len(self.state.recycled),
            },  # fmt: skip
            "ledger": {**self.state.counters, "events": self.state.seq},
            "dead_lettered": dict(self.bus.dead_lettered),
            "ledger_problems": self.ledger_problems[-20:],
            "buffer_class": self.plugin_path,
        }

    def metric_values(self) -> dict[str, float]:
        rs = self.release_state()
        out = {
            "rollout/fully_async/queue_size": rs.stored,
            "buffer/capacity": self.config.buffer_capacity,
            "buffer/outstanding_prompts": rs.outstanding,
            "buffer/live_version": self.live_version if self.live_version is not None else -1,
            "buffer/committed_step": self.state.committed_step,
            "buffer/ledger_events": self.state.seq,
            "buffer/ledger/dead_lettered_total": sum(self.bus.dead_lettered.values()),
            "buffer/ledger/replay_skipped_total": len(self.ledger_problems),
        }
        out.update({f"buffer/ledger/{k}_total": v for k, v in self.state.counters.items()})
        if self._observed:
            stored = self.buffer.stored_staleness()
            if stored:
                out["rollout/fully_async/buffer_avg_staleness"] = sum(stored) / len(stored)
                out["rollout/fully_async/buffer_max_staleness"] = max(stored)
        return out


async def _sync(fn):
    return fn()


class _Identity(msgspec.Struct):
    group_id: str = ""
    group_index: int = -1
    attempt: int = 0


def _identity(data: bytes) -> _Identity | None:
    """Which group an undecodable RolloutGroup says it is (so its prompt's fate can be
    recorded), when at least that much of it decodes."""
    try:
        ident = decode(data, _Identity)
    except MalformedMessage:
        return None
    return ident if ident.group_index >= 0 and ident.group_id == group_id(ident.group_index, ident.attempt) else None


def _chunks(events: list[LedgerEvent], max_bytes: int) -> list[list[LedgerEvent]]:
    """Consecutive runs of events, each at most LEDGER_BATCH_EVENTS events and max_bytes
    encoded (an event larger than that travels alone)."""
    chunks: list[list[LedgerEvent]] = []
    size = 0
    for ev in events:
        n = len(encode(ev)) if ev.prompt is not None or ev.metrics else 256
        if not chunks or len(chunks[-1]) >= LEDGER_BATCH_EVENTS or size + n > max_bytes:
            chunks.append([])
            size = 0
        chunks[-1].append(ev)
        size += n
    return chunks


async def _respond(msg, reply: bytes) -> None:
    """Answer a request; a message that asked for no answer (no reply subject) gets none."""
    if msg.reply:
        with contextlib.suppress(Exception):  # the requester may be gone: it asks again
            await msg.respond(reply)


def _group_index(group: list) -> int:
    return flatten_group(group)[0].group_index or 0


@dataclasses.dataclass
class _Put:
    """The group whose put() is in progress (one at a time), and what is known of its fate."""

    group_id: str
    group_index: int
    attempt: int
    stream_seq: int
    oldest_version: int | None
    failed: bool
    recorded: bool = False
    recycled: bool = False

    def event_fields(self) -> dict[str, Any]:
        """What its `put` ledger event records."""
        return {"group_id": self.group_id, "group_index": self.group_index, "attempt": self.attempt,
                "stream_seq": self.stream_seq, "oldest_version": self.oldest_version, "failed": self.failed}  # fmt: skip


@dataclasses.dataclass
class _Waiter:
    """A get request waiting for its step's lease to complete."""

    msg: Any
    answered: bool = False


async def _respond_all(waiters: list[_Waiter], reply: bytes) -> None:
    for waiter in waiters:
        with contextlib.suppress(Exception):  # the requester may be gone: it asks again
            await waiter.msg.respond(reply)
