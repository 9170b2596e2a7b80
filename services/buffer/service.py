"""Buffer service: the one place where group-level decisions are made.

Consumes: RolloutGroup messages from ROLLOUTS (durable pull consumer "buffer"), acknowledged
  once put() has decided their fate; `buffer.get` and `buffer.commit` requests from the trainer;
  `weights.live` (the staleness clock); producer heartbeats (their in-flight caps).
Produces: PromptMsg on PROMPTS (the data source's releases, recycled prompts first); replies
  with GroupRefs (where the trainer reads each group on ROLLOUTS) and the step's get_metrics().
Backpressure: put() blocks while the buffer is full, so the consumer stops reading ROLLOUTS and
  the release policy (services.buffer.policy) stops releasing prompts: producers run dry.
Leases: every group handed out belongs to a step; a repeated get for that step returns the same
  groups (idempotent), until the trainer commits the step, which retires them.
Shutdown: SIGTERM stops the loops; unacknowledged messages are redelivered on restart.
HTTP: /status shows capacity, stored groups, the staleness clock and the ledger counters.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import Any

from asyncrl_proto import (
    BufferCommit,
    BufferCommitReply,
    BufferGetReply,
    BufferGetRequest,
    GroupRef,
    Heartbeat,
    PromptMsg,
    RolloutGroup,
    WeightsLive,
    decode,
    encode,
)
from asyncrl_proto.codec import DecodeError
from asyncrl_proto.messages import flatten_group, oldest_weight_version

from services.buffer.core import DataBuffer, DefaultDataBuffer, load_object, staleness
from services.buffer.datasource import PromptSource, load_rows
from services.buffer.policy import ReleaseState, release_allowance
from services.common.bus import fetch_some
from services.common.runtime import Service, wait_event

log = logging.getLogger(__name__)

PRODUCER_TIMEOUT_S = 10.0


@dataclass
class GroupMeta:
    group_id: str
    group_index: int
    attempt: int
    epoch: int
    row: int
    stream_seq: int
    prompt: Any
    label: Any
    metadata: dict
    group: list


@dataclass
class Lease:
    step: int
    count: int
    refs: list[GroupRef] = field(default_factory=list)
    metrics: dict[str, float] = field(default_factory=dict)
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def complete(self) -> bool:
        return self.done.is_set()


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
            raise ValueError(
                "the buffer needs --prompt-data (the launcher sets it to the task's data)"
            )
        self.source = PromptSource(
            config,
            load_rows(config.prompt_data, config.input_key, config.label_key, config.metadata_key),
        )
        self.buffer = make_buffer(config, self._recycle)
        self._observed = isinstance(self.buffer, DefaultDataBuffer)
        if self._observed:
            self.buffer.on_event = self._on_buffer_event
        self.live_version: int | None = None
        self.leases: dict[int, Lease] = {}
        self.committed_step = -1
        self.meta: dict[int, GroupMeta] = {}
        self.seen_group_ids: set[str] = set()
        self.want_step: int | None = None
        self.lookahead = 0
        self.min_version: int | None = None
        self.producers: dict[str, tuple[float, int]] = {}
        self.num_released = 0
        self.num_resolved = 0
        self.ledger: collections.Counter[str] = collections.Counter()
        self._wake_release = asyncio.Event()
        self._wake_pump = asyncio.Event()
        self._stored = asyncio.Event()
        self._rollouts = None

    # ---- setup -----------------------------------------------------------------------------
    async def setup(self) -> None:
        s = self.bus.subjects
        await self.bus.ensure_streams()
        self._rollouts = await self.bus.pull(
            s.rollouts_stream, s.rollouts, durable="buffer", ack_wait_s=30.0, max_ack_pending=64
        )
        # subscribe before reading the KV value, so that no update can fall in between
        await self.bus.nc.subscribe(s.weights_live, cb=self._on_live)
        await self._read_live_version()
        await self.bus.nc.subscribe(s.buffer_get, cb=self._on_get)
        await self.bus.nc.subscribe(s.buffer_commit, cb=self._on_commit)
        await self.bus.nc.subscribe(s.heartbeat("rollout"), cb=self._on_producer_heartbeat)
        log.info(
            "buffer ready: capacity %d groups, %d prompts per epoch, mode %s",
            self.config.buffer_capacity,
            self.source.epoch_size,
            self.config.mode,
        )

    def loops(self):
        return {
            "consume_rollouts": self._consume_rollouts,
            "release_prompts": self._release_prompts,
            "pump_gets": self._pump_gets,
        }

    # ---- put path ----------------------------------------------------------------------------
    async def _consume_rollouts(self) -> None:
        while True:
            for msg in await fetch_some(self._rollouts, 8, 1.0):
                await self._put_one(msg)

    async def _put_one(self, msg) -> None:
        subject = self.bus.subjects.rollouts
        try:
            rg = decode(msg.data, RolloutGroup)
        except DecodeError as e:
            self.ledger["dead_lettered"] += 1
            await self.bus.dead_letter(subject, msg.data, f"undecodable RolloutGroup: {e}")
            await msg.term()
            return
        n = self.config.n_samples_per_prompt
        if len(rg.samples) != n:
            self.ledger["dead_lettered"] += 1
            await self.bus.dead_letter(
                subject,
                msg.data,
                f"group {rg.group_id} has {len(rg.samples)} trajectories, expected n={n}",
            )
            await msg.term()
            return
        if rg.group_id in self.seen_group_ids:
            self.ledger["duplicate_groups"] += 1
            await msg.ack()
            return
        self.seen_group_ids.add(rg.group_id)
        first = flatten_group(rg.samples)[0]
        self.meta[id(rg.samples)] = GroupMeta(
            group_id=rg.group_id, group_index=rg.group_index, attempt=rg.attempt, epoch=rg.epoch,
            row=rg.row, stream_seq=msg.metadata.sequence.stream, prompt=first.prompt,
            label=first.label, metadata=dict(first.metadata), group=rg.samples,
        )  # fmt: skip
        put = asyncio.ensure_future(self.buffer.put(rg.samples))
        while not put.done():
            done, _ = await asyncio.wait({put}, timeout=10.0)
            if not done:
                await msg.in_progress()  # blocked by a full buffer: keep the message ours
        put.result()
        self.num_resolved += 1
        if not self._observed:
            self.ledger["put"] += 1  # a custom buffer: its decision is not observable
        await msg.ack()
        self._wake_release.set()

    def _on_buffer_event(self, kind: str, group: list, reason: str | None) -> None:
        """Ledger bookkeeping from the DefaultDataBuffer's decisions."""
        handler_retries = self.config.async_unused_samples_handler == "retry"
        if kind == "filtered":
            self.ledger[f"filtered/{reason or 'unspecified'}"] += 1
            self.meta.pop(id(group), None)
        elif kind in ("aborted", "stale"):
            self.ledger[f"{kind}_{'recycled' if handler_retries else 'dropped'}"] += 1
            if not handler_retries:
                self.meta.pop(id(group), None)
        elif kind == "stored":
            self.ledger["stored"] += 1
            self._stored.set()

    async def _recycle(self, group: list) -> None:
        meta = self.meta.pop(id(group), None)
        first = flatten_group(group)[0]
        if meta is None:
            log.warning(
                "recycling a group the buffer does not know (group_index %s)", first.group_index
            )
            self.source.recycle(
                first.group_index, first.prompt, first.label, dict(first.metadata), 0, 0, 0
            )
        else:
            self.source.recycle(
                meta.group_index,
                meta.prompt,
                meta.label,
                meta.metadata,
                meta.attempt,
                meta.epoch,
                meta.row,
            )
        self.ledger["recycled"] += 1
        self._wake_release.set()

    # ---- prompt release ------------------------------------------------------------------------
    def _inflight_cap(self) -> int:
        now = time.time()
        live = [cap for ts, cap in self.producers.values() if now - ts < PRODUCER_TIMEOUT_S]
        return sum(live) if live else self.config.inflight_groups

    def _groups_still_needed(self) -> int:
        if self.want_step is None:
            return 0
        first = self.committed_step + 1
        need = 0
        for step in range(first, self.want_step + self.lookahead + 1):
            lease = self.leases.get(step)
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
            stored=len(self.buffer) if hasattr(self.buffer, "__len__") else 0,
            outstanding=self.num_released - self.num_resolved,
            live_version=self.live_version,
            min_version=self.min_version,
        )

    async def _release_prompts(self) -> None:
        subject = self.bus.subjects.prompts
        while True:
            await wait_event(self._wake_release, 1.0)
            self._wake_release.clear()
            if self.live_version is None:
                await self._read_live_version()  # weight-sync may have announced before we listened
            for _ in range(release_allowance(self.release_state())):
                msg: PromptMsg = self.source.next_prompt()
                await self.bus.publish(
                    subject, msg, msg_id=f"prompt-{msg.group_index}-{msg.attempt}"
                )
                self.num_released += 1
                self.ledger["released"] += 1 if msg.attempt == 0 else 0
                self.ledger["rereleased"] += 1 if msg.attempt > 0 else 0

    # ---- get path ------------------------------------------------------------------------------
    async def _on_get(self, msg) -> None:
        asyncio.ensure_future(self._handle_get(msg))

    async def _handle_get(self, msg) -> None:
        try:
            req = decode(msg.data, BufferGetRequest)
        except DecodeError as e:
            await self.bus.dead_letter(msg.subject, msg.data, f"undecodable BufferGetRequest: {e}")
            return
        if req.step <= self.committed_step:
            await msg.respond(
                encode(BufferGetReply(step=req.step, error=f"step {req.step} is already committed"))
            )
            return
        lease = self.leases.get(req.step)
        if lease is None:
            lease = self.leases[req.step] = Lease(step=req.step, count=req.count)
        self.want_step = req.step if self.want_step is None else max(self.want_step, req.step)
        self.lookahead = req.lookahead_steps
        self.min_version = req.release_min_version
        self._override_version = req.current_version
        self._wake_release.set()
        self._wake_pump.set()
        if req.wait_s > 0:
            await wait_event(lease.done, req.wait_s)
        reply = BufferGetReply(
            step=req.step, refs=list(lease.refs), complete=lease.complete, metrics=lease.metrics
        )
        await msg.respond(encode(reply))

    def _next_incomplete_lease(self) -> Lease | None:
        pending = [lease for s, lease in sorted(self.leases.items()) if not lease.complete]
        return pending[0] if pending else None

    async def _pump_gets(self) -> None:
        """Drain the DataBuffer into the lease of the oldest step still short of groups."""
        self._override_version = None
        while True:
            lease = self._next_incomplete_lease()
            if lease is None:
                await self._wake_pump.wait()
                self._wake_pump.clear()
                continue
            if self._observed:
                # judge staleness when a group is there to judge, not when we started waiting
                while len(self.buffer) == 0:
                    self._stored.clear()
                    await self._stored.wait()
            version = (
                self._override_version if self._override_version is not None else self.live_version
            )
            group = await self.buffer.get(current_version=version)
            lease.refs.append(self._ref_for(group, version))
            self.ledger["consumed"] += 1
            self._wake_release.set()
            if len(lease.refs) >= lease.count:
                lease.metrics = {k: float(v) for k, v in self.buffer.get_metrics().items()}
                lease.done.set()

    def _ref_for(self, group: list, version: int | None) -> GroupRef:
        meta = self.meta.pop(id(group), None)
        st = staleness(version, group)
        oldest = oldest_weight_version(group)
        if meta is not None:
            return GroupRef(group_id=meta.group_id, group_index=meta.group_index, stream_seq=meta.stream_seq,
                            staleness=st, oldest_version=oldest)  # fmt: skip
        # a custom buffer built this group itself: ship it inline
        first = flatten_group(group)[0]
        rg = RolloutGroup(group_id=f"inline-{first.group_index}-{time.time_ns()}", group_index=first.group_index or 0,
                          samples=group)  # fmt: skip
        return GroupRef(group_id=rg.group_id, group_index=rg.group_index, payload=encode(rg), staleness=st,
                        oldest_version=oldest)  # fmt: skip

    # ---- commit, live version, producers ------------------------------------------------------
    async def _on_commit(self, msg) -> None:
        try:
            req = decode(msg.data, BufferCommit)
        except DecodeError as e:
            await self.bus.dead_letter(msg.subject, msg.data, f"undecodable BufferCommit: {e}")
            return
        num = 0
        for step in sorted(s for s in self.leases if s <= req.step):
            lease = self.leases.pop(step)
            num += len(lease.refs)
            for ref in lease.refs:
                if ref.stream_seq:
                    with contextlib.suppress(Exception):
                        await self.bus.js.delete_msg(
                            self.bus.subjects.rollouts_stream, ref.stream_seq
                        )
        self.ledger["trained"] += num
        self.committed_step = max(self.committed_step, req.step)
        await msg.respond(encode(BufferCommitReply(step=req.step, num_groups_committed=num)))

    async def _on_live(self, msg) -> None:
        try:
            self._set_live(decode(msg.data, WeightsLive).version)
        except DecodeError:
            return

    async def _read_live_version(self) -> None:
        raw = await self.bus.kv_get("live_version")
        if raw is not None:
            self._set_live(decode(raw, WeightsLive).version)

    def _set_live(self, version: int) -> None:
        if self.live_version is None or version > self.live_version:
            self.live_version = version
            self._wake_release.set()

    async def _on_producer_heartbeat(self, msg) -> None:
        try:
            hb = decode(msg.data, Heartbeat)
        except DecodeError:
            return
        cap = int(hb.info.get("inflight_groups", self.config.inflight_groups))
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
            "committed_step": self.committed_step,
            "released": self.num_released,
            "outstanding": rs.outstanding,
            "producers": len(
                [1 for ts, _ in self.producers.values() if time.time() - ts < PRODUCER_TIMEOUT_S]
            ),
            "data_source": {
                "epoch": self.source.epoch,
                "cursor": self.source.cursor,
                "next_group_index": self.source.next_group_index,
                "recycled_waiting": len(self.source.recycled),
            },  # fmt: skip
            "ledger": dict(self.ledger),
        }

    def metric_values(self) -> dict[str, float]:
        rs = self.release_state()
        out = {
            "rollout/fully_async/queue_size": rs.stored,
            "buffer/capacity": self.config.buffer_capacity,
            "buffer/outstanding_prompts": rs.outstanding,
            "buffer/live_version": self.live_version if self.live_version is not None else -1,
            "buffer/committed_step": self.committed_step,
        }
        out.update({f"buffer/ledger/{k}_total": v for k, v in self.ledger.items()})
        if hasattr(self.buffer, "stored_staleness"):
            stored = self.buffer.stored_staleness()
            if stored:
                out["rollout/fully_async/buffer_avg_staleness"] = sum(stored) / len(stored)
                out["rollout/fully_async/buffer_max_staleness"] = max(stored)
        return out
