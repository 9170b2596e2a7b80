"""The buffer's heart: every group-level decision, as a synchronous state machine (no I/O, no
asyncio).

The buffer service decodes messages and calls one event method per thing that happened; each
returns an `Out`: the ledger events it recorded (already applied to `state`, to be appended
before anything else leaves), the replies to send once they are durable, messages to
dead-letter, and how to settle a ROLLOUTS message. The durable state is `state.py`'s fold of
those events; what is held here besides it (the requested steps, the staleness clock, the
producers' caps, waiting requests) is rebuilt by the trainer's and producers' next messages.

    on_restart   the state recovered from the ledger, and the stored groups' payloads
    on_released  prompts planned by plan_release: recorded, before they are published on PROMPTS
                 (a restart publishes the outstanding ones again: same ids, deduplicated)
    on_group     a RolloutGroup from ROLLOUTS: rejected (also one for a prompt never recorded
                 released: a group never makes the buffer release anything), duplicate, or
                 handed to the DataBuffer
    on_decision  the DefaultDataBuffer's decision on a group (stored, filtered, aborted, stale)
    on_recycled  a custom DataBuffer gives a group back (its decisions are not observable)
    on_put_returned  the DataBuffer's put() returned
    on_handed    the DataBuffer's get() handed a group for a step: the lease grows, completes
    on_get / on_get_timeout  the trainer asks for a step's lease
    on_commit    the trainer trained steps up to s
    on_version   the engines run a new weight version (the staleness clock, unless the trainer's
                 get names its own version: fully async)
    on_heartbeat a producer's in-flight cap

One group at a time is in put() (the service awaits it); a DataBuffer may hand it out before its
put() returns, and then its put is recorded first. Which step a group goes to and when a lease
is complete are decided only in on_handed.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable
from typing import Any

import msgspec

from asyncrl_proto import (
    BufferCommit,
    BufferCommitReply,
    BufferGetReply,
    BufferGetRequest,
    GroupRef,
    Heartbeat,
    LedgerEvent,
    PromptMsg,
    RolloutGroup,
    decode,
    group_id,
)
from asyncrl_proto.codec import MalformedMessage
from asyncrl_proto.messages import SampleStatus, flatten_group, oldest_weight_version
from services.buffer.core import staleness
from services.buffer.out import BufferPluginError, GroupState, LeaseState, Out, Put, Verdict
from services.buffer.policy import PRODUCER_TIMEOUT_S, ReleaseState, StepClock, release_allowance, stall_cause
from services.buffer.state import BufferState, apply
from services.data.source import PromptSource
from services.common.validate import Limits, group_problem

log = logging.getLogger(__name__)

MAX_PRODUCERS = 1024
"""Producers whose heartbeats are tracked (each cap at most the configured one)."""
MAX_RELEASE = 256
"""Prompts released at once at most (the release loop comes back for the rest)."""
INLINE_MAX_BYTES = 64 * 1024
"""Groups up to this size travel inline in the get reply (they are in memory anyway), which
saves the trainer a round trip per group; larger ones are read from ROLLOUTS by sequence."""
INLINE_REPLY_MAX_BYTES = 4 * 1024 * 1024


class BufferMachine:
    def __init__(self, config, source: PromptSource, limits: Limits, published: Callable[[], int],
                 metrics: Callable[[], dict], observed: bool, plugin_path: str):  # fmt: skip
        self.config = config
        self.plugin_path = plugin_path
        self.source = source
        self.limits = limits
        self.published = published
        """The newest weight version the trainer published (the service keeps it fresh)."""
        self._metrics = metrics
        self.observed = observed
        """The DataBuffer reports its decisions (on_decision); otherwise puts are `accepted`."""
        self.retry = config.async_.unused_samples_handler == "retry"
        """Aborted and stale groups go back to the data source (else they are dropped)."""
        self.state = BufferState()
        self._events: list[LedgerEvent] = []
        self.live_version: int | None = None
        self.override_version: int | None = None
        self.min_version: int | None = None
        self.requested: dict[int, int] = {}  # step -> B, for uncommitted steps the trainer asked for
        self.want_step: int | None = None
        self.lookahead = 0
        self.producers: dict[str, tuple[float, int]] = {}
        """Producer id -> (its last heartbeat, the in-flight cap it asked for)."""
        self.in_work_of: dict[str, int] = {}
        """Producer id -> how many groups its last heartbeat named in work."""
        self.answered: set[str] = set()
        """Producers that answered a prompt this buffer released: only their caps count."""
        self.waiting: dict[int, list[Any]] = {}  # step -> get requests waiting for its lease
        self.releasing: set[str] = set()
        self.putting: Put | None = None
        self.gid_of: dict[int, str] = {}
        """group_index -> id of its group in the DataBuffer (one attempt of a prompt at a time:
        a new attempt is released only once the last one's fate is recorded)."""
        self.raw_of: dict[str, bytes] = {}  # group id -> encoded group, for small groups
        self.progress_at = time.time()
        """When a step last made progress (a group leased, a lease completed, a commit)."""
        self.step_clock = StepClock(config.async_.stall_report_s)
        self.seen_at: dict[str, float] = {}
        """Outstanding group id -> when it was released or last named in work by a producer."""

    # ---- states ------------------------------------------------------------------------------
    def group_state(self, gid: str) -> GroupState:
        s = self.state
        if gid in self.releasing:
            return GroupState.RELEASING
        if gid in s.outstanding:
            return GroupState.PUTTING if self.putting and self.putting.group_id == gid else GroupState.OUTSTANDING
        if gid in s.stored:
            return GroupState.STORED
        if any(r.group_id == gid for lease in s.leases.values() for r in lease.refs):
            return GroupState.LEASED
        return GroupState.SETTLED

    def lease_state(self, step: int) -> LeaseState:
        if step <= self.state.committed_step:
            return LeaseState.COMMITTED
        lease = self.state.leases.get(step)
        return LeaseState.COMPLETE if lease is not None and lease.complete else LeaseState.OPEN

    def clock(self) -> int | None:
        """The version staleness is judged against: the trainer's, else the engines'."""
        return self.override_version if self.override_version is not None else self.live_version

    # ---- recording ---------------------------------------------------------------------------
    def _record(self, kind: str, **fields: Any) -> None:
        ev = LedgerEvent(seq=self.state.seq + 1, kind=kind, ts=time.time(), **fields)
        apply(self.state, ev)
        self._events.append(ev)

    def _out(self, **kw: Any) -> Out:
        """Everything recorded since the last Out (a DataBuffer's decisions arrive in between)."""
        events, self._events = self._events, []
        return Out(events=events, **kw)

    # ---- restart -----------------------------------------------------------------------------
    def on_restart(self, state: BufferState, stored: list[RolloutGroup]) -> list[list]:
        """The recovered state and the payloads of its stored groups; returns the groups to put
        back into the DataBuffer (they were decided before: no event)."""
        self.state = state
        now = time.time()
        self.seen_at = dict.fromkeys(state.outstanding, now)  # a restart gives each a full deadline again
        self.progress_at = now
        self.gid_of.update({rg.group_index: gid for gid, rg in zip(state.stored, stored, strict=True)})
        return [rg.samples for rg in stored]

    # ---- release -----------------------------------------------------------------------------
    def release_state(self, now: float) -> ReleaseState:
        self.producers = {k: v for k, v in self.producers.items() if now - v[0] < PRODUCER_TIMEOUT_S}
        self.answered &= self.producers.keys()
        self.in_work_of = {k: v for k, v in self.in_work_of.items() if k in self.producers}
        # the in-flight budget: one producer's cap, and the caps of the live producers that have
        # answered a released prompt (a heartbeat alone, under any id, adds nothing)
        caps = [cap for pid, (_, cap) in self.producers.items() if pid in self.answered]
        s = self.state
        steps = range(s.committed_step + 1, self.want_step + self.lookahead + 1) if self.want_step is not None else []
        need = sum(self.config.rollout.batch_size - (len(s.leases[t].refs) if t in s.leases else 0) for t in steps)
        accounted = (s.counters.get("trained", 0) + s.counters.get("failed", 0) + len(s.stored) + len(s.outstanding)
                     + len(self.releasing) + sum(len(lease.refs) for lease in s.leases.values()))  # fmt: skip
        budget = self.config.async_.max_weight_staleness
        head_room = None
        if (self.config.infra.mode == "fully_async" and budget is not None and self.live_version is not None
                and not self.config.multi_lora.n_adapters):  # an adapter's versions are its own clock
            head_room = (self.live_version + budget + 2) * self.config.rollout.batch_size - accounted
        return ReleaseState(
            head_room=head_room,
            groups_left=self.config.rollout.total_steps * self.config.rollout.batch_size - accounted,
            mode=self.config.infra.mode, batch_size=self.config.rollout.batch_size,
            capacity=self.config.buffer_capacity,
            inflight_cap=sum(caps) if caps else self.config.inflight_groups, want_step=self.want_step,
            lookahead=self.lookahead, groups_still_needed=need, stored=len(s.stored),
            outstanding=len(s.outstanding) + len(self.releasing), live_version=self.live_version,
            min_version=self.min_version, over_sampling=self.config.rollout.over_sampling_batch_size,
        )  # fmt: skip

    def plan_release(self, now: float) -> list[tuple[PromptMsg, dict]]:
        """The prompts to release now (at most MAX_RELEASE; recycled ones first), each with the
        data-source cursor after it; on_released records them (nothing more is planned meanwhile),
        and only then are they published."""
        if self.releasing:
            return []
        return self._plan(min(release_allowance(self.release_state(now)), MAX_RELEASE))

    def _plan(self, k: int) -> list[tuple[PromptMsg, dict]]:
        s = self.state
        epoch, cursor, nxt = s.epoch, s.cursor, s.next_group_index
        recycled = list(s.recycled)
        planned = []
        for _ in range(max(k, 0)):
            prompt, cur = self.source.next_release(epoch, cursor, nxt, recycled)
            if recycled:
                recycled = [p for p in recycled if p.group_index != prompt.group_index]
            else:
                epoch, cursor, nxt = cur["epoch"], cur["cursor"], cur["next_group_index"]
            planned.append((prompt, cur))
        self.releasing.update(group_id(p.group_index, p.attempt) for p, _ in planned)
        return planned

    def on_released(self, planned: list[tuple[PromptMsg, dict]]) -> Out:
        for prompt, cur in planned:
            gid = group_id(prompt.group_index, prompt.attempt)
            self.releasing.discard(gid)
            self._record("released", group_id=gid, group_index=prompt.group_index, attempt=prompt.attempt,
                         prompt=prompt, source=cur)  # fmt: skip
            self.seen_at[gid] = time.time()
        return self._out()

    def expire_unanswered(self, now: float) -> Out:
        """Prompts released longer than --prompt-deadline-s ago that no live producer names in
        work and nobody answered: each goes back to the data source as a new attempt (recorded
        `expired`). A producer that acknowledged a prompt and died, or never meant to answer,
        cannot hang the run; its late answer is a duplicate."""
        deadline = self.config.async_.prompt_deadline_s
        stall = self.stall(now)
        spare = any(self.in_work_of.get(pid, 0) < cap for pid, (_, cap) in self.producers.items())
        if stall is not None and stall["kind"] == "unanswered" and spare:
            # the run waits for them, and a live producer has room to take them: nobody works on
            # those no heartbeat names (a prompt still queued behind busy producers is left alone)
            deadline = min(deadline, self.config.async_.stall_report_s)
        self.seen_at = {gid: at for gid, at in self.seen_at.items() if gid in self.state.outstanding}
        for gid, p in list(self.state.outstanding.items()):
            if gid in self.releasing or (self.putting is not None and self.putting.group_id == gid):
                continue
            if now - self.seen_at.setdefault(gid, now) > deadline:
                self.seen_at.pop(gid, None)
                self._record("expired", group_id=gid, group_index=p.group_index, attempt=p.attempt,
                             reason=f"neither answered nor in work for {deadline:.0f}s", recycled=True)  # fmt: skip
        return self._out()

    # ---- put ---------------------------------------------------------------------------------
    def group_problem(self, rg: RolloutGroup) -> str | None:
        """Why this group may not be stored, or None (services.common.validate, plus: its prompt
        was released)."""
        if rg.group_index >= self.state.next_group_index:
            return f"group_index {rg.group_index} was never released (next is {self.state.next_group_index})"
        limits = dataclasses.replace(self.limits, max_version=self.published())
        return group_problem(rg.group_id, rg.group_index, rg.attempt, rg.samples, limits)

    def on_group(self, msg: Any, stream_seq: int, rg: RolloutGroup | None, undecodable: str | None,
                 raw: bytes) -> Out:  # fmt: skip
        """A group read from ROLLOUTS (`rg` None when not even its identity decodes)."""
        gi, attempt = (rg.group_index, rg.attempt) if rg is not None else (-1, 0)
        gid = group_id(gi, attempt) if rg is not None else ""
        state = self.group_state(gid)
        common = {"group_id": gid, "group_index": gi, "attempt": attempt, "stream_seq": stream_seq}
        if (problem := undecodable or self.group_problem(rg)) is not None:
            # its only fault a weight version nobody published: honest work an engine was told a version
            # it does not run (weight-sync brings it back to the live version): not trained, its prompt not lost
            honest = undecodable is None and state is GroupState.OUTSTANDING
            if honest and group_problem(rg.group_id, rg.group_index, rg.attempt, rg.samples, self.limits) is None:
                self._record("put", outcome="aborted", recycled=True, reason=problem[:500], **common)
                return self._out(settle=Verdict.TERM, dead_letters=[(msg, f"{problem}: its prompt goes back")])
            self._record("put", outcome="rejected", reason=problem[:500], **common)
            return self._out(settle=Verdict.TERM, dead_letters=[(msg, problem)])
        if state is not GroupState.OUTSTANDING:
            self._record("put", outcome="duplicate", **common)
            return self._out(settle=Verdict.ACK)
        self.gid_of[rg.group_index] = gid
        if rg.producer_id in self.producers:
            self.answered.add(rg.producer_id)
        if len(raw) <= INLINE_MAX_BYTES:
            self.raw_of[gid] = raw
        samples = flatten_group(rg.samples)
        self.putting = Put(**common, oldest_version=oldest_weight_version(rg.samples),
                           failed=all(s.status == SampleStatus.FAILED for s in samples))  # fmt: skip
        return self._out(settle=Verdict.PUT)

    def on_closed(self) -> Out:
        """The partition's adapter registration completed: its stored groups, and those leased to
        a step its trainer never committed (the lease completed as the adapter was retired), will
        never be trained; each is recorded `retired` (dropped), so that nothing is left in flight
        or to purge around."""
        for gid, ref in list(self.state.stored.items()):
            self._record("retired", group_id=gid, group_index=ref.prompt.group_index, attempt=ref.prompt.attempt,
                         reason="its adapter registration completed")  # fmt: skip
        for lease in list(self.state.leases.values()):
            for r in list(lease.refs):
                self._record("retired", group_id=r.group_id, group_index=r.group_index, step=lease.step,
                             reason="its adapter registration completed while it was leased to this step, "
                             "never committed")  # fmt: skip
        return self._out()

    def on_foreign(self, msg: Any, stream_seq: int, raw: bytes) -> Out:
        """A group that came back after its partition closed (multi-LoRA: its registration was
        retired): an outstanding one is recorded `foreign` and dropped; a repeat is a duplicate;
        one that names nothing released is rejected."""
        ident = group_identity(raw)
        common = msgspec.structs.asdict(ident or GroupIdentity()) | {"stream_seq": stream_seq}
        if ident is not None:
            foreign = ident.group_id in self.state.outstanding
            reason = "its adapter registration is closed" if foreign else ""
            self._record("put", outcome="foreign" if foreign else "duplicate", reason=reason, **common)
            return self._out(settle=Verdict.ACK)
        problem = "undecodable RolloutGroup for a closed adapter registration"
        self._record("put", outcome="rejected", reason=problem, **common)
        return self._out(settle=Verdict.TERM, dead_letters=[(msg, problem)])

    def _record_put(self, outcome: str, reason: str = "", recycled: bool = False) -> None:
        cur = self.putting
        self._record("put", outcome=outcome, reason=reason, recycled=recycled, **cur.event_fields())
        cur.recorded = True
        if outcome not in ("stored", "accepted"):
            self.raw_of.pop(cur.group_id, None)
            self.gid_of.pop(cur.group_index, None)

    def on_decision(self, kind: str, group: list, reason: str | None) -> None:
        """The DefaultDataBuffer's decisions, synchronously as it makes them (before any other
        coroutine can get a stored group); recorded into the next Out."""
        if kind in ("stored", "filtered", "aborted"):
            self._record_put(kind, reason or "", recycled=kind == "aborted" and self.retry)
        elif kind == "stale":
            gi = _group_index(group)
            gid = self.gid_of.pop(gi)
            self.raw_of.pop(gid, None)
            self._record(
                "stale", group_id=gid, group_index=gi, staleness=staleness(self.clock(), group), recycled=self.retry
            )

    def on_recycled(self, group: list) -> None:
        """A custom DataBuffer gave a group to its unused-samples handler: stale if it was stored,
        aborted if it is the one in put(); dropped or recycled as --async-unused-samples-handler
        says, as in Miles. (The DefaultDataBuffer's decisions are on_decision.)"""
        if self.observed:
            return
        gi = _group_index(group)
        gid = self.gid_of.pop(gi, None)
        if gid is None:
            log.warning("%s recycled a group the buffer does not know (group_index %d); ignored", self.plugin_path, gi)
        elif gid in self.state.stored:
            self._record("stale", group_id=gid, group_index=gi, recycled=self.retry)
        elif self.putting is not None and self.putting.group_id == gid:
            self.putting.handed_back = True

    def on_put_returned(self) -> Out:
        cur = self.putting
        if cur is not None and not cur.recorded:  # a custom buffer: its decision is not observable
            self._record_put("aborted" if cur.handed_back else "accepted", recycled=cur.handed_back and self.retry)
        self.putting = None
        return self._out()

    # ---- leases ------------------------------------------------------------------------------
    def step_to_fill(self) -> int | None:
        """The oldest requested step short of a complete lease."""
        return min((s for s in self.requested if self.lease_state(s) is LeaseState.OPEN), default=None)

    def on_handed(self, step: int, group: list, version: int | None) -> Out:
        """The DataBuffer's get() handed `group` for `step`, judged against `version`."""
        gi = _group_index(group)
        gid = self.gid_of.pop(gi, None)  # a custom buffer may hand back a copy: its prompt names it
        if gid is None:
            raise BufferPluginError(f"{self.plugin_path}.get returned a group that was never put (group_index {gi}); "
                                    "a DataBuffer must return the groups it was given")  # fmt: skip
        if self.putting is not None and self.putting.group_id == gid and not self.putting.recorded:
            self._record_put("accepted")  # handed out before its put() returned
        self.progress_at = time.time()
        self._record("leased", group_id=gid, group_index=gi, step=step, staleness=staleness(version, group))
        return self._complete_if_full(step)

    def _complete_if_full(self, step: int) -> Out:
        count, lease = self.requested.get(step), self.state.leases.get(step)
        replies = []
        if count is not None and lease is not None and len(lease.refs) >= count and not lease.complete:
            self._record("lease_complete", step=step, metrics={k: float(v) for k, v in self._metrics().items()})
            replies = [(w, self.get_reply(step)) for w in self.waiting.pop(step, [])]
        return self._out(replies=replies)

    def get_problem(self, req: BufferGetRequest) -> str | None:
        """A get the trainer would never send: a step outside the window it can be at (the next
        uncommitted one, plus the steps trained since the last checkpoint and one prefetched),
        another batch size, or versions nobody published."""
        c = self.config
        window = c.commit_interval + 2
        first = self.state.committed_step + 1
        if not first <= req.step < first + window:
            return f"get(step={req.step}) is outside the steps the trainer can ask for ({first}..{first + window - 1})"
        if req.count != c.rollout.batch_size:
            return f"get(count={req.count}) differs from --rollout-batch-size {c.rollout.batch_size}"
        if req.lookahead_steps not in (0, 1):
            return f"get(lookahead_steps={req.lookahead_steps}): only 0 or 1"
        if not 0 <= req.wait_s <= 30:
            return f"get(wait_s={req.wait_s}): at most 30 s"
        for name in ("current_version", "release_min_version"):
            if (v := getattr(req, name)) is not None and not 0 <= v <= self.published():
                return f"get({name}={v}): that weight version was never published (newest {self.published()})"
        return None

    def on_get(self, msg: Any, req: BufferGetRequest) -> Out:
        if self.lease_state(req.step) is LeaseState.COMMITTED:
            error = f"step {req.step} is already committed"
            return Out(
                replies=[(msg, BufferGetReply(step=req.step, error=error, committed_step=self.state.committed_step))]
            )
        if (problem := self.get_problem(req)) is not None:
            return Out(replies=[(msg, BufferGetReply(step=req.step, error=problem))], dead_letters=[(msg, problem)])
        self.requested.setdefault(req.step, req.count)
        self.want_step = req.step if self.want_step is None else max(self.want_step, req.step)
        self.lookahead = req.lookahead_steps
        self.min_version = req.release_min_version
        self.override_version = req.current_version
        out = self._complete_if_full(req.step)  # after a restart, a full lease may miss its record
        if self.lease_state(req.step) is LeaseState.OPEN and req.wait_s > 0:
            self.waiting.setdefault(req.step, []).append(msg)
            out.waiting = True
        else:
            out.replies.append((msg, self.get_reply(req.step)))
        return out

    def on_get_timeout(self, msg: Any, step: int) -> Out:
        """A waiting get's time is up: answered with the lease as it is (if not answered yet)."""
        waiting = self.waiting.get(step, [])
        if msg not in waiting:
            return Out()
        waiting.remove(msg)
        return Out(replies=[(msg, self.get_reply(step))])

    def get_reply(self, step: int) -> BufferGetReply:
        lease = self.state.leases.get(step)
        refs, budget = [], INLINE_REPLY_MAX_BYTES
        for r in lease.refs if lease else []:
            raw = self.raw_of.get(r.group_id)
            if raw is not None and len(raw) <= budget:
                budget -= len(raw)
                r = msgspec.structs.replace(r, payload=raw)
            refs.append(r)
        return BufferGetReply(step=step, refs=refs, complete=bool(lease and lease.complete),
                              metrics=dict(lease.metrics) if lease else {}, committed_step=self.state.committed_step)  # fmt: skip

    # ---- commit --------------------------------------------------------------------------------
    def commit_problem(self, req: BufferCommit) -> str | None:
        """A commit of a step that was never trained: every step up to it must hold a complete
        lease (a step beyond the last lease never even had its groups)."""
        if req.version < 0:
            return f"commit(version={req.version}) is negative"
        last = max(self.state.leases, default=self.state.committed_step)
        if req.step > last:
            return f"commit(step={req.step}): no step beyond {last} has a lease, so it was never trained"
        for step in range(self.state.committed_step + 1, req.step + 1):  # at most the leases held
            if self.lease_state(step) is not LeaseState.COMPLETE:
                return f"commit(step={req.step}): step {step} has no complete lease, so it was never trained"
        return None

    def on_commit(self, msg: Any, req: BufferCommit) -> Out:
        """A repeated commit is answered too (once what it committed is durable)."""
        if (problem := self.commit_problem(req)) is not None:
            return Out(replies=[(msg, BufferCommitReply(step=req.step, error=problem))], dead_letters=[(msg, problem)])
        done: list[GroupRef] = [r for s, lease in self.state.leases.items() if s <= req.step for r in lease.refs]
        for r in done:
            self.raw_of.pop(r.group_id, None)
        if req.step > self.state.committed_step:
            self.progress_at = time.time()
            self.step_clock.commits.append(self.progress_at)
            self._record("committed", step=req.step)
        replies = [(msg, BufferCommitReply(step=req.step, num_groups_committed=len(done)))]
        for step in [s for s in self.requested if s <= req.step]:
            self.requested.pop(step)
            replies += [(w, self.get_reply(step)) for w in self.waiting.pop(step, [])]  # (an empty lease now)
        return self._out(replies=replies, purge=bool(done))

    def purge_floor(self, ack_floor: int) -> int:
        """ROLLOUTS messages below this are no longer needed (neither stored, leased, nor
        unacknowledged by the buffer's consumer)."""
        needed = [r.stream_seq for r in self.state.stored.values()]
        needed += [r.stream_seq for lease in self.state.leases.values() for r in lease.refs]
        return min([ack_floor + 1, *needed])

    # ---- the clock and producers -------------------------------------------------------------
    def on_version(self, msg: Any, version: int) -> Out:
        """The staleness clock moves forward only, and only to a version the trainer published
        (a forged WeightsLive(10**9) would otherwise make every group stale)."""
        if not 0 <= version <= self.published():
            return Out(dead_letters=[(msg, f"live version {version} was never published (newest {self.published()})")])
        self.live_version = version if self.live_version is None else max(self.live_version, version)
        return Out()

    def on_heartbeat(self, msg: Any, hb: Heartbeat, now: float) -> Out:
        limit = self.config.inflight_groups
        cap = hb.info.get("inflight_groups", limit)
        problem = cap_problem(cap, limit)
        if problem is None and hb.instance_id not in self.producers and len(self.producers) >= MAX_PRODUCERS:
            # make room by forgetting the quietest producer that never answered: heartbeats under
            # made-up ids cannot crowd out the ones that work
            if unproven := [(t, pid) for pid, (t, _) in self.producers.items() if pid not in self.answered]:
                del self.producers[min(unproven)[1]]
            else:
                problem = f"{len(self.producers)} producers answer already (at most {MAX_PRODUCERS})"
        if problem is not None:
            return Out(dead_letters=[(msg, f"heartbeat of {hb.instance_id!r:.40}: {problem}")])
        if hb.info.get("stopping"):
            self.producers.pop(hb.instance_id, None)
        else:
            self.producers[hb.instance_id] = (now, cap)
        in_work = hb.info.get("in_work", [])
        if isinstance(in_work, list):  # group indexes the producer is generating: their prompts are alive
            self.in_work_of[hb.instance_id] = len(in_work)
            by_index = {p.group_index: gid for gid, p in self.state.outstanding.items()}
            for gi in in_work[: 4 * limit + 64]:
                if isinstance(gi, int) and (gid := by_index.get(gi)) is not None:
                    self.seen_at[gid] = now
        return Out()

    # ---- observability -----------------------------------------------------------------------
    def stall(self, now: float) -> dict | None:
        """Why no step has made progress for StepClock.stall_after() seconds while the trainer waits, or None."""
        s, c = self.state, self.config
        idle = now - self.progress_at
        if self.want_step is None or idle < self.step_clock.stall_after():
            return None
        short = [step for step in range(s.committed_step + 1, self.want_step + 1)
                 if self.lease_state(step) is not LeaseState.COMPLETE]  # fmt: skip
        rs = self.release_state(now)
        unseen = [gid for gid in s.outstanding if now - self.seen_at.get(gid, now) >= c.async_.stall_report_s]
        kind, cause = stall_cause(rs, short[0] if short else None, self.want_step, len(self.producers), len(unseen),
                                  c.async_.stall_report_s, c.async_.max_weight_staleness)  # fmt: skip
        return {"step": short[0] if short else self.want_step, "for_s": round(idle, 1), "kind": kind, "cause": cause}

    def status(self, now: float) -> dict:
        rs, s = self.release_state(now), self.state
        return {
            "capacity": self.config.buffer_capacity, "stored_groups": rs.stored, "live_version": self.live_version,
            "mode": self.config.infra.mode, "want_step": self.want_step, "committed_step": s.committed_step,
            "outstanding_prompts": rs.outstanding, "producers": len(self.producers), "inflight_cap": rs.inflight_cap,
            "data_source": {"epoch": s.epoch, "cursor": s.cursor, "next_group_index": s.next_group_index,
                            "recycled_waiting": len(s.recycled)},
            "ledger": {**s.counters, "events": s.seq}, "stalled": self.stall(now),
        }  # fmt: skip


class GroupIdentity(msgspec.Struct):
    """What an undecodable RolloutGroup says it is, when at least that decodes."""

    group_id: str = ""
    group_index: int = -1
    attempt: int = 0


def cap_problem(cap: Any, limit: int) -> str | None:
    """Why a heartbeat's in-flight cap (`inflight_groups`) is not one, or None."""
    if not isinstance(cap, int) or isinstance(cap, bool) or not 0 <= cap <= limit:
        return f"inflight_groups {cap!r:.40} is not a count in [0, {limit}]"
    return None


def group_identity(data: bytes) -> GroupIdentity | None:
    try:
        ident = decode(data, GroupIdentity)
    except MalformedMessage:
        return None
    return ident if ident.group_index >= 0 and ident.group_id == group_id(ident.group_index, ident.attempt) else None


def _group_index(group: list) -> int:
    return flatten_group(group)[0].group_index or 0
