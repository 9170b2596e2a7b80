"""One buffer partition: a BufferMachine with its DataBuffer, its ledger, and the loops that move
bytes between them and the bus. A single-model run has one (the run's names); a multi-LoRA run has
one per adapter registration (`Subjects.of(registration)`: its own prompts, rollouts, ledger,
gets and commits), each the same proven machinery with its adapter's data, batch size and step
budget (services.buffer.service hosts them).

Every decision is the machine's (services.buffer.machine, no I/O); this module decodes, calls
it, appends what it recorded, then sends what it answered: a ROLLOUTS message is acknowledged, a
lease handed out, only once the ledger holds the decision. A prompt's release is recorded before
it is published (deterministic Nats-Msg-Id), so no group can answer a prompt the ledger lacks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

from asyncrl_proto import (
    BufferCommit,
    BufferGetRequest,
    Heartbeat,
    PromptMsg,
    RolloutGroup,
    WeightsLive,
    decode,
    encode,
    group_id,
)
from asyncrl_proto.codec import MalformedMessage
from asyncrl_proto.messages import flatten_group
from asyncrl_proto.subjects import Subjects
from services.buffer.core import DefaultDataBuffer, make_buffer
from services.buffer.ledger import Ledger
from services.buffer.machine import BufferMachine, group_identity
from services.buffer.out import BufferPluginError, Out, Verdict
from services.common import crash
from services.common.bus import Settle, next_batch, settle
from services.common.config.view import for_plugins
from services.common.plugins import load_object
from services.common.runtime import wait_event
from services.common.validate import limits_from_model_dir
from services.common.versions import VersionBound
from services.data.source import make_prompt_source

log = logging.getLogger(__name__)


class Bound(VersionBound):
    """The newest version the trainer may name, re-read with `read` (an adapter's: the registry)."""

    def __init__(self, read: Callable[[], Awaitable[int]], value: int = 0):
        self.value = value
        self._read = read

    async def refresh(self) -> int:
        with contextlib.suppress(Exception):  # a broker that does not answer leaves it where it was
            self.value = max(self.value, await self._read())
        return self.value


class QueueSub(asyncio.Queue):
    """A partition's share of a shared push subscription (next_batch's interface)."""

    pending_msgs = property(asyncio.Queue.qsize)

    async def next_msg(self, timeout: float):
        return await asyncio.wait_for(self.get(), timeout)


def expiry_note(events: list, before: int) -> str | None:
    """The warning for the prompts these events expire, or None when they expire none: an Out
    also carries whatever the DataBuffer decided since the last one, which is no expiry."""
    expired = [ev for ev in events if ev.kind == "expired"]
    if not expired:
        return None
    return (f"{len(expired)} released prompt(s) {expired[0].reason}: released again as a new attempt "
            f"({before + len(expired)} this run)")


async def drop_dead_lettered(bus, seq: int) -> None:
    """A settled ROLLOUTS message whose dead letter is stored (its first 64 KiB, size and digest)
    leaves the stream at once: a flood of them, stored above a group still held, is out of the
    purge's reach and would hold every producer's publish back (the stream's message cap) until
    the run stalls. A redelivery or a duplicate is never dropped: its stream message is a group's."""
    try:
        await bus.delete_msg(bus.subjects.rollouts_stream, seq)
    except Exception as e:  # storage hygiene only: the purge takes it later
        log.warning("could not delete dead-lettered message %d from ROLLOUTS: %s", seq, e)


class Partition:
    """`svc` is the hosting Service (bus, consumer, fail, background, observe); `config` this partition's
    (a multi-LoRA adapter's data, batch size and budget); `published` the bound on the versions
    its groups and gets may name; `rollouts` where its ROLLOUTS messages arrive."""

    def __init__(self, svc, config, subjects: Subjects, published, rollouts):
        self.svc = svc
        self.bus = svc.bus
        self.config = config
        self.s = subjects
        self.name = subjects.partition or "buffer"
        self.log_prefix = f"{subjects.partition}: " if subjects.partition else ""
        self.buffer = make_buffer(config, self._recycle)
        self.plugin_path = config.rollout.custom_async_data_buffer_path or "services.api.DefaultDataBuffer"
        self.published = published
        self.core = BufferMachine(
            config, make_prompt_source(config),
            limits_from_model_dir(config.data.hf_checkpoint, config.rollout.n_samples_per_prompt,
                                  config.rollout.reward_key, config.rollout.max_abs_reward),
            published=lambda: self.published.value, metrics=self._metrics,
            observed=isinstance(self.buffer, DefaultDataBuffer), plugin_path=self.plugin_path,
        )  # fmt: skip
        if isinstance(self.buffer, DefaultDataBuffer):
            self.buffer.on_event = self._on_decision
        path = config.rollout.all_samples_process_path
        self.all_samples_fn = load_object(path, "--rollout-all-samples-process-path") if path else None
        self._step_groups: list[list] = []  # the groups of the step being leased, filtered ones included
        self.ledger = Ledger(self.bus, svc.fail, svc.background, subjects)
        self.rollouts = rollouts
        self._wake_release, self._wake_pump = asyncio.Event(), asyncio.Event()
        self._stall_said: str | None = None
        self.expired_total = 0
        self._answered: dict[int, asyncio.Event] = {}  # id(request message) -> set once answered
        self._dead_lettered: list[int] = []  # ROLLOUTS sequences dead-lettered in this batch
        self._next_live_read = 0.0
        self.reads_live = not subjects.partition
        """The engines' version is the clock of a single-model run; an adapter's is its trainer's."""

    state = property(lambda self: self.core.state)

    async def recover(self, payloads: bool = True) -> None:
        """From the ledger; the stored groups back into the DataBuffer, unless `payloads` is
        False (a closed partition's: only its ledger is needed, its payloads may be purged)."""
        replayed = await self.ledger.recover()
        if not payloads:
            self.core.state = self.ledger.state
            return
        stored = [decode(await self.bus.get_payload(self.s.rollouts_stream, ref.stream_seq), RolloutGroup)
                  for ref in self.ledger.state.stored.values()]  # fmt: skip
        await self._plugin(self.buffer.restore(self.core.on_restart(self.ledger.state, stored)), "restore")
        if outstanding := list(self.ledger.state.outstanding.values()):
            # a crash between a release's record and its publish left them unpublished; those
            # that were published dedupe (a producer may hold them)
            await self._publish_prompts(outstanding)
        if self.ledger.snapshot_seq or replayed:
            log.info("recovered %s: snapshot at event %d, %d events replayed, %d groups restored",
                     self.name, self.ledger.snapshot_seq, replayed, len(stored))  # fmt: skip

    def release_memory(self) -> None:
        """A closed partition keeps its ledger (late groups are recorded in it) and nothing else."""
        self.buffer = None
        self.core.source = None  # its adapter's prompt rows: nothing is released any more
        self.core.raw_of.clear()
        self.core.gid_of.clear()

    def loops(self) -> dict:
        return {"consume_rollouts": self.consume_rollouts, "release_prompts": self.release_prompts,
                "pump_gets": self.pump_gets}  # fmt: skip

    async def apply(self, out: Out, durable: bool = False) -> list:
        """Queue what the machine recorded, then dead-letter and answer what it said; a reply
        (and a completed lease, or `durable`) waits until the ledger holds everything decided
        so far. Other events ride the next append: one per batch of groups, not one per group.
        Returns the messages whose dead letters were stored."""
        self.ledger.add(out.events)  # before any await: the ledger's order is the decisions' order
        self._wake_release.set()
        self._wake_pump.set()
        completes = any(e.kind == "lease_complete" for e in out.events)
        if durable or completes or out.replies:
            await self.ledger.flush()
        if completes:
            crash.point("buffer", "lease_decided_before_reply")
            self._process_all_samples()
        stored = []
        for msg, reason in out.dead_letters:
            if msg is None:
                log.error("ignoring the KV value: %s", reason)
            elif await self.bus.dead_letter(msg.subject, msg.data, reason):
                stored.append(msg)
        for msg, reply in out.replies:
            if (answered := self._answered.pop(id(msg), None)) is not None:
                answered.set()
            if msg.reply:  # a message that asked for no answer gets none
                with contextlib.suppress(Exception):  # the requester may be gone: it asks again
                    await msg.respond(encode(reply))
        return stored

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
    async def consume_rollouts(self) -> None:
        while True:
            msgs = await next_batch(self.rollouts, 64, 1.0)
            done = [(msg, await self._put_one(msg, pending=msgs[i:])) for i, msg in enumerate(msgs)]
            await self.ledger.flush()
            if done:
                crash.point("buffer", "appended_before_ack")
            for msg, how in done:
                await settle(msg, how)
            for seq in self._dead_lettered:  # settled, and their letters stored
                await drop_dead_lettered(self.bus, seq)
            self._dead_lettered.clear()

    async def _put_one(self, msg, pending: list) -> Settle:
        """Returns how to settle the message once what was decided on it is durable."""
        try:
            rg, undecodable = decode(msg.data, RolloutGroup), None
        except MalformedMessage as e:
            rg, undecodable = group_identity(msg.data), f"undecodable RolloutGroup: {e}"
        if undecodable is None:  # a version newer than the bound: re-read it before judging
            await self.published.allows(max((v for s in flatten_group(rg.samples) for v in s.weight_versions), default=0))  # fmt: skip
        seq = msg.metadata.sequence.stream
        out = self.core.on_group(msg, seq, rg, undecodable, msg.data)
        self.ledger.add(out.events)
        for m, reason in out.dead_letters:
            if await self.bus.dead_letter(m.subject, m.data, reason):
                self._dead_lettered.append(seq)
        if out.settle is not Verdict.PUT:
            return Settle(out.settle)
        put = asyncio.ensure_future(self._plugin(self.buffer.put(rg.samples), "put"))
        try:
            await asyncio.wait({put}, timeout=0.05)
            while not put.done():  # a full buffer holds the producers back
                await self.ledger.flush()  # what is decided becomes durable meanwhile
                for m in pending:
                    await settle(m, Settle.IN_PROGRESS)  # and the waiting messages stay ours
                await asyncio.wait({put}, timeout=self.svc.consumer.ack_wait_s / 3)
        finally:
            put.cancel()  # stopping (or a closed partition): nothing is decided after it
        put.result()
        await self.apply(self.core.on_put_returned())
        return Settle.ACK

    # ---- release -----------------------------------------------------------------------------
    async def release_prompts(self) -> None:
        while True:
            await wait_event(self._wake_release, 1.0)
            self._wake_release.clear()
            if (expired := self.core.expire_unanswered(time.time())).events:
                if note := expiry_note(expired.events, self.expired_total):
                    self.expired_total += sum(ev.kind == "expired" for ev in expired.events)
                    log.warning("%s%s", self.log_prefix, note)
                await self.apply(expired, durable=True)  # and the DataBuffer's decisions it carried
            if self.reads_live and self.core.live_version is None and time.monotonic() >= self._next_live_read:
                self._next_live_read = time.monotonic() + 1.0  # a broker round trip: once a second at most
                await self.read_live_version()  # weight-sync may have announced before we listened
            if planned := self.core.plan_release(time.time()):
                # recorded, then published: a group can only ever answer a prompt the ledger holds (a
                # crash in between leaves them recorded and unpublished; recover() publishes them)
                await self.apply(self.core.on_released(planned), durable=True)
                await self._publish_prompts([p for p, _ in planned])
            stall = self.core.stall(time.time())
            if stall is not None and stall["cause"] != self._stall_said:
                log.warning("%sno step progress for %.0f s (step %d): %s", self.log_prefix, stall["for_s"],
                            stall["step"], stall["cause"])  # fmt: skip
            self._stall_said = stall and stall["cause"]

    async def _publish_prompts(self, prompts: list[PromptMsg]) -> None:
        """Deterministic message ids: a prompt published twice within PROMPTS' duplicate window is
        stored once."""
        prefix = f"prompt-{self.s.partition}-" if self.s.partition else "prompt-"
        items = [(self.s.prompts, p, prefix + group_id(p.group_index, p.attempt)) for p in prompts]
        await self.bus.publish_durably(items, f"{len(prompts)} prompts")

    # ---- get path ----------------------------------------------------------------------------
    async def handle_get(self, msg) -> None:
        if (req := await self.bus.decode_or_dead_letter(msg, BufferGetRequest)) is None:
            return
        for v in (req.current_version, req.release_min_version):
            if v is not None:
                await self.published.allows(v)  # re-reads the bound for a version newer than it
        answered = self._answered[id(msg)] = asyncio.Event()
        t0 = time.perf_counter()
        out = self.core.on_get(msg, req)
        await self.apply(out)
        if out.waiting and not await wait_event(answered, req.wait_s):
            await self.apply(self.core.on_get_timeout(msg, req.step))
        elif not out.dead_letters:
            self.svc.observe("buffer/get_wait_seconds", time.perf_counter() - t0)
        self._answered.pop(id(msg), None)

    async def pump_gets(self) -> None:
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
            await self.apply(self.core.on_handed(step, group, version))

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
            self.all_samples_fn(for_plugins(self.config), groups, None)
        except Exception as e:
            log.warning("--rollout-all-samples-process-path raised: %s", e)

    # ---- commit, live version, producers -------------------------------------------------------
    async def handle_commit(self, msg) -> bool:
        """True when trained payloads can be purged from ROLLOUTS."""
        if (req := await self.bus.decode_or_dead_letter(msg, BufferCommit)) is None:
            return False
        out = self.core.on_commit(msg, req)
        await self.apply(out)
        return out.purge

    async def on_live(self, msg, version: int) -> None:
        await self.published.allows(version)
        await self.apply(self.core.on_version(msg, version))

    async def read_live_version(self) -> None:
        if (live := await self.bus.kv_get("live_version", WeightsLive)) is not None:
            await self.on_live(None, live.version)

    async def on_heartbeat(self, msg, hb: Heartbeat) -> None:
        await self.apply(self.core.on_heartbeat(msg, hb, time.time()))

    # ---- observability -------------------------------------------------------------------------
    def status(self) -> dict:
        return {**self.core.status(time.time()), "ledger_problems": self.ledger.problems[-20:],
                "buffer_class": self.plugin_path}  # fmt: skip

    def metric_values(self) -> dict[str, float]:
        now = time.time()
        m, s = self.core, self.core.state
        rs = m.release_state(now)
        out = {
            "rollout/fully_async/queue_size": rs.stored,
            "buffer/capacity": m.config.buffer_capacity,
            "buffer/free_capacity": max(0, m.config.buffer_capacity - rs.stored),  # the producers' HPA metric
            "buffer/outstanding_prompts": rs.outstanding,
            "buffer/live_version": m.live_version if m.live_version is not None else -1,
            "buffer/committed_step": s.committed_step,
            "buffer/ledger_events": s.seq,
            "buffer/stalled_s": (now - m.progress_at) if m.stall(now) else 0.0,
        }
        out.update({f"buffer/ledger/{k}_total": v for k, v in s.counters.items()})
        out["buffer/ledger/replay_skipped_total"] = len(self.ledger.problems)
        if isinstance(self.buffer, DefaultDataBuffer):
            out.update(self.buffer.stored_staleness())
        return out
