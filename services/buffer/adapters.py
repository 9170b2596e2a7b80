"""Multi-LoRA's buffer layout: one partition per adapter registration, opened when the registry
(KV `adapters`) holds it and closed once it is COMPLETED, each with its adapter's data, batch size
and step budget, its own ledger subject and its own staleness clock (the adapter's version, as the
trainer names it in its gets: fully async). The one ROLLOUTS consumer's messages go to their
partitions; a group of a closed registration is recorded `put foreign` in its ledger and dropped,
one of a registration the registry never held is dead-lettered. The producers' in-flight cap is
shared by the partitions whose adapter trains. The single-model layout is `OnePartition`
(services/buffer/service.py)."""

from __future__ import annotations

import asyncio
import logging
import math
import time

import msgspec

from asyncrl_proto import AdapterRegistryState, Heartbeat, decode
from asyncrl_proto.codec import MalformedMessage
from asyncrl_proto.messages import AdapterRun, AdapterState
from asyncrl_proto.subjects import ADAPTERS_KV_KEY
from services.buffer.machine import cap_problem
from services.buffer.out import Verdict
from services.buffer.partition import Bound, Partition, QueueSub, drop_dead_lettered
from services.common import crash
from services.common.bus import Settle, next_batch, settle
from services.common.config import ConfigView

log = logging.getLogger(__name__)

REGISTRY_POLL_S = 0.5
"""How often a multi-LoRA buffer reads the registry for registrations to open or close."""
RETRY_MAX_S = 15.0
"""The longest wait between two tries of a partition that failed to build for an unforeseen reason
(well below --buffer-timeout-s, which a trainer waits for a partition before retiring its adapter)."""
OPEN_STATES = (AdapterState.PENDING, AdapterState.ACTIVE, AdapterState.RETIRING, AdapterState.CLEANUP)


def cap_shares(cap: int, states: dict[str, AdapterState | None]) -> dict[str, int]:
    """The producers' in-flight cap (groups) shared by the partitions whose adapter trains
    (ACTIVE): `ceil(cap / active)` each. A pending one gets its share once it is active (its
    prompts would only wait for its first version), a retiring or cleaning-up one none (its
    adapter takes no more steps: what it generated would be dropped)."""
    active = [rid for rid, state in states.items() if state is AdapterState.ACTIVE]
    return {rid: math.ceil(cap / len(active)) if rid in active else 0 for rid in states}


class Backoff:
    """Per key: after the k-th failure in a row, the next try is due `first * 2**k` seconds later
    (at most `most`); a success forgets the key."""

    def __init__(self, first: float, most: float):
        self.first, self.most = first, most
        self._at: dict[str, tuple[int, float]] = {}

    def due(self, key: str, now: float) -> bool:
        return key not in self._at or now >= self._at[key][1]

    def failed(self, key: str, now: float) -> tuple[int, float]:
        """Records a failure; returns (failures in a row, seconds until the next try)."""
        failures = self._at.get(key, (0, 0.0))[0] + 1
        delay = min(self.first * 2.0**failures, self.most)
        self._at[key] = (failures, now + delay)
        return failures, delay

    def ok(self, key: str) -> None:
        self._at.pop(key, None)


def adapter_config(config: ConfigView, run: AdapterRun) -> ConfigView:
    """The buffer's config as one adapter's partition sees it: its data, batch size, group size and
    budget; fully async (its clock is the adapter version the trainer names). Only the sections
    these flags live in are new; the rest are the run's."""
    from services.data.source import adapter_total_steps, load_rows

    spec = run.spec
    rows = len(load_rows(spec.data, config.data.input_key, config.data.label_key, config.data.metadata_key))
    return config.replace(**{
        "prompt_data": spec.data, "data_source_path": None, "rollout_batch_size": spec.rollout_batch_size,
        "n_samples_per_prompt": spec.n_samples_per_prompt, "num_rollout": adapter_total_steps(run, rows),
        "num_epoch": None, "driver": "async", "fully_async": True, "over_sampling_batch_size": None,
        "rollout_all_samples_process_path": None, "async_max_concurrent_samples": None,
    })  # fmt: skip


class AdapterPartitions:
    """The partitions of a multi-LoRA run's buffer service (`svc`), following the registry."""

    def __init__(self, svc) -> None:
        self.svc = svc
        self.parts: dict[str, Partition] = {}
        """Open partitions by registration id."""
        self.closed: dict[str, Partition] = {}
        """Closed partitions a late group came back for (its foreign drop is recorded in its ledger)."""
        self.adapters = AdapterRegistryState()
        self._registry_revision = -1
        self._registry_lock = asyncio.Lock()
        self.broken: dict[str, str] = {}
        """Registrations whose partition cannot be built, and why (said once)."""
        self._retry = Backoff(REGISTRY_POLL_S, RETRY_MAX_S)
        """Registrations whose partition failed to build for an unforeseen reason."""
        self._part_tasks: dict[str, list[asyncio.Task]] = {}

    async def setup(self) -> None:
        await self._read_registry()
        self.svc.rollouts = await self.svc.bus.consume(self.svc.consumer)
        s = self.svc.bus.subjects
        await self.svc.bus.subscribe(s.buffer_get + ".*", self.svc.on_get)
        await self.svc.bus.subscribe(s.buffer_commit + ".*", self.svc.on_commit)

    def loops(self) -> dict:
        return {"dispatch_rollouts": self._dispatch_rollouts, "watch_registry": self._watch_registry}

    def stop(self) -> list[Partition]:
        """Cancels every partition's loops; the partitions whose ledgers to flush."""
        for tasks in self._part_tasks.values():
            for t in tasks:
                t.cancel()
        return [*self.parts.values(), *self.closed.values()]

    async def part_of(self, subject: str, base: str) -> Partition | None:
        rid = subject[len(base) + 1 :] if subject.startswith(base + ".") else ""
        if rid not in self.parts:  # registered a moment ago: the registry says so already
            await self._read_registry()
        return self.parts.get(rid)

    async def on_heartbeat(self, msg, hb: Heartbeat) -> None:
        limit = self.svc.config.inflight_groups
        cap = hb.info.get("inflight_groups", limit)
        if (problem := cap_problem(cap, limit)) is not None:
            await self.svc.bus.dead_letter(msg.subject, msg.data, problem)
            return
        states = {r.registration_id: r.state for r in self.adapters.runs}
        for rid, share in cap_shares(cap, {rid: states.get(rid) for rid in self.parts}).items():
            part = self.parts[rid]
            share = min(part.config.inflight_groups, share)
            await part.on_heartbeat(msg, msgspec.structs.replace(hb, info={**hb.info, "inflight_groups": share}))

    def status(self) -> dict:
        runs = {r.registration_id: r.name for r in self.adapters.runs}
        return {"partitions": {rid: {"adapter": runs.get(rid, ""), **p.status()} for rid, p in self.parts.items()}}

    def metric_values(self) -> dict[str, float]:
        runs = {r.registration_id: r.name for r in self.adapters.runs}
        out = {f"{runs.get(rid, rid)}/{k}": v for rid, p in self.parts.items() for k, v in p.metric_values().items()}
        out["perf/fully_async/queue_length"] = sum(len(p.state.stored) for p in self.parts.values())
        out["buffer/partitions"] = len(self.parts)
        return out

    async def _read_registry(self) -> None:
        """Open a partition (recovered from its ledger, its loops started) for every registration
        the registry holds open, and close those it completed (also one completed while this
        buffer was down: its stored groups are recorded retired). A registration whose partition
        cannot be built (its data unreadable) is left unopened and said once; a broker that does
        not answer leaves the rest for the next read."""
        async with self._registry_lock:
            try:
                raw, revision = await self.svc.bus.kv_entry(ADAPTERS_KV_KEY)
            except Exception as e:  # the broker is away: the next poll reads it again
                log.warning("could not read the adapter registry (%s); reading it again soon", type(e).__name__)
                return
            if raw is None or revision == self._registry_revision:
                return
            try:
                self.adapters = decode(raw, AdapterRegistryState)
            except MalformedMessage as e:
                log.error("ignoring the registry's KV value: %s", e)
                return
            done = True
            for run in self.adapters.runs:
                rid = run.registration_id
                if not self._retry.due(rid, time.monotonic()):
                    done = False  # backing off: tried again at a later read
                    continue
                try:
                    if run.state in OPEN_STATES and rid not in self.parts and rid not in self.broken:
                        part = self._partition(run)
                        await part.recover()
                        self.parts[rid] = part
                        self._start(rid)
                    elif run.state is AdapterState.COMPLETED and rid in self.parts:
                        await self._close(rid)
                    elif run.state is AdapterState.COMPLETED and rid not in self.closed:
                        await self._closed_partition(run)
                except (TimeoutError, ConnectionError) as e:  # the broker: the next read tries again
                    done = False
                    log.warning("partition of registration %s: %s; trying again at the next read", rid, e)
                except (ValueError, OSError) as e:  # DataError, a spec that does not fit: not a broker's
                    self.broken[rid] = str(e)
                    log.error("adapter %s (registration %s) has no buffer partition: %s", run.name, rid, e)
                except Exception as e:  # unforeseen: tried again, less and less often (at most every minute)
                    done = False
                    failures, delay = self._retry.failed(rid, time.monotonic())
                    log.warning("partition of registration %s: %s: %s (failure %d); trying again in %.0f s", rid,
                                type(e).__name__, e, failures, delay)  # fmt: skip
                else:
                    self._retry.ok(rid)
            if done:
                self._registry_revision = revision

    def _partition(self, run: AdapterRun) -> Partition:
        bound = Bound(lambda rid=run.registration_id: self._adapter_version(rid), run.step)
        log.info("buffer partition of adapter %s (registration %s)", run.name, run.registration_id)
        return Partition(self.svc, adapter_config(self.svc.config, run), self.svc.bus.subjects.of(run.registration_id), bound,
                         QueueSub())  # fmt: skip

    async def _adapter_version(self, rid: str) -> int:
        """The newest version of a registration's adapter: the steps the registry says it took
        (read only: a partition's own loop may ask, and must never close itself)."""
        reg = await self.svc.bus.kv_get(ADAPTERS_KV_KEY, AdapterRegistryState) or AdapterRegistryState()
        return max((r.step for r in reg.runs if r.registration_id == rid), default=0)

    def _start(self, rid: str) -> None:
        def done(t: asyncio.Task) -> None:
            if not t.cancelled() and t.exception() is not None:
                self.svc.fail(t.exception())

        loops = self.parts[rid].loops()
        self._part_tasks[rid] = [asyncio.create_task(fn(), name=f"{name}-{rid[:8]}") for name, fn in loops.items()]
        for t in self._part_tasks[rid]:
            t.add_done_callback(done)

    async def _close(self, rid: str) -> None:
        """Its loops stop; its stored groups are recorded dropped (`retired`) and its ledger
        snapshotted. It stays known here, for the groups that still come back for it (foreign)."""
        part = self.parts.pop(rid)
        tasks = self._part_tasks.pop(rid, [])
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self.closed[rid] = part
        await part.apply(part.core.on_closed(), durable=True)
        await part.ledger.flush(snapshot=True)
        part.release_memory()
        log.info("closed the buffer partition of registration %s", rid)

    async def _closed_partition(self, run: AdapterRun) -> Partition:
        """The partition of a completed registration this buffer did not have open: its ledger
        alone (its payloads may be purged), its stored groups recorded retired."""
        part = self._partition(run)
        await part.recover(payloads=False)
        await part.apply(part.core.on_closed(), durable=True)
        part.release_memory()
        self.closed[run.registration_id] = part
        return part

    async def _watch_registry(self) -> None:
        while True:
            await self.svc.wait_stopped(REGISTRY_POLL_S)
            await self._read_registry()

    async def _dispatch_rollouts(self) -> None:
        """Every partition's ROLLOUTS messages from the one consumer, to their partitions."""
        prefix = self.svc.bus.subjects.rollouts + "."
        while True:
            for msg in await next_batch(self.svc.rollouts, 64, 1.0):
                rid = msg.subject[len(prefix) :] if msg.subject.startswith(prefix) else ""
                if rid not in self.parts and rid not in self.closed:  # opened since the last read?
                    await self._read_registry()
                if (part := self.parts.get(rid)) is not None:
                    part.rollouts.put_nowait(msg)
                    continue
                try:
                    await self._foreign(rid, msg)
                except Exception as e:  # a broker away: the message comes back
                    log.warning("group for registration %s: %s; it is delivered again", rid[:64], e)
                    await settle(msg, Settle.NAK, delay=1.0)

    async def _foreign(self, rid: str, msg) -> None:
        """A group of a closed registration is recorded `foreign` in its ledger and dropped; one
        of a registration the registry never held is dead-lettered."""
        run = next((r for r in self.adapters.runs if r.registration_id == rid), None)
        if run is None or (rid in self.broken and rid not in self.closed):
            why = self.broken.get(rid) or "no such registration in this run"
            if await self.svc.bus.dead_letter_msg(msg, f"adapter registration {rid[:64]!r}: {why}"):
                await drop_dead_lettered(self.svc.bus, msg.metadata.sequence.stream)
            return
        if run.state is not AdapterState.COMPLETED:  # open, its partition not built yet: later
            await settle(msg, Settle.NAK, delay=1.0)
            return
        if (part := self.closed.get(rid)) is None:
            part = await self._closed_partition(run)
        out = part.core.on_foreign(msg, msg.metadata.sequence.stream, msg.data)
        stored = await part.apply(out, durable=True)
        crash.point("buffer", "appended_before_ack")
        await settle(msg, Settle(out.settle or Verdict.ACK))
        if any(m is msg for m in stored):  # undecodable: its letter is on DEADLETTER
            await drop_dead_lettered(self.svc.bus, msg.metadata.sequence.stream)
