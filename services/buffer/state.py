"""The buffer's durable state, as a fold over its ledger events (pure, no I/O).

Every group-level decision of the buffer service is a LedgerEvent appended to LEDGER_<run>
before it takes effect outside the process (before a ROLLOUTS message is acknowledged, a
lease is handed to the trainer, or a prompt's release is counted). The state below is exactly
`fold(apply, events)`, so after a SIGKILL the service rebuilds it from the last snapshot plus
the events after it, and continues where it stopped:

    released  prompt -> outstanding            (the data source cursor moves)
    put       outstanding -> stored | filtered | aborted (-> recycled queue if retry) | rejected
              (a group that failed validation: dead-lettered, its prompt settled) | duplicate
    stale     stored -> dropped | recycled queue
    leased    stored -> lease of a step
    lease_complete   the step's B groups are all leased; its get_metrics() snapshot
    committed leases of steps <= s -> trained

A custom DataBuffer hides its decisions: its puts are recorded as outcome "accepted" (kept in
`stored` so that they can be handed back to a fresh instance after a restart).
"""

from __future__ import annotations

import collections
import contextlib

import msgspec

from asyncrl_proto import GroupRef, LedgerBatch, LedgerEvent, PromptMsg, decode, group_id
from asyncrl_proto.codec import MalformedMessage


class StoredRef(msgspec.Struct, kw_only=True):
    group_id: str
    stream_seq: int
    oldest_version: int | None = None
    prompt: PromptMsg
    failed: bool = False


class LeaseRecord(msgspec.Struct, kw_only=True):
    step: int
    refs: list[GroupRef] = msgspec.field(default_factory=list)
    complete: bool = False
    metrics: dict[str, float] = msgspec.field(default_factory=dict)


class BufferState(msgspec.Struct, kw_only=True):
    seq: int = 0
    """Events applied."""
    log_stream_seq: int = 0
    """Stream sequence of the last applied event (where a replay resumes)."""
    epoch: int = 0
    cursor: int = 0
    next_group_index: int = 0
    recycled: list[PromptMsg] = msgspec.field(default_factory=list)
    outstanding: dict[str, PromptMsg] = msgspec.field(default_factory=dict)
    stored: dict[str, StoredRef] = msgspec.field(default_factory=dict)
    leases: dict[int, LeaseRecord] = msgspec.field(default_factory=dict)
    committed_step: int = -1
    counters: dict[str, int] = msgspec.field(default_factory=dict)

    def count(self, key: str, k: int = 1) -> None:
        self.counters[key] = self.counters.get(key, 0) + k


class StateError(RuntimeError):
    """An event that cannot follow the state: the log is corrupt or out of order."""


class LedgerError(ValueError):
    """A ledger message that is neither a LedgerBatch nor a LedgerEvent."""


def _recycle(state: BufferState, p: PromptMsg) -> None:
    state.recycled.append(msgspec.structs.replace(p, attempt=p.attempt + 1, released_at=0.0))
    state.count("recycled")


def ledger_events(data: bytes) -> list[LedgerEvent]:
    """The events of one LEDGER message: a LedgerBatch, or a single LedgerEvent (ledgers
    written before appends were batched)."""
    with contextlib.suppress(MalformedMessage):
        return decode(data, LedgerBatch).events
    try:
        return [decode(data, LedgerEvent)]
    except MalformedMessage as e:
        raise LedgerError(f"undecodable ({len(data)} bytes): {e}") from None


def apply(state: BufferState, ev: LedgerEvent) -> None:
    if ev.seq != state.seq + 1:
        raise StateError(f"ledger event {ev.seq} does not follow event {state.seq}")
    state.seq = ev.seq
    kind = ev.kind
    if kind == "released":
        p = ev.prompt
        gid = group_id(p.group_index, p.attempt)
        if p.attempt > 0:  # the queue's head, or the one --buffer-filter-path picked
            at = [i for i, r in enumerate(state.recycled) if group_id(r.group_index, r.attempt) == gid]
            if not at:
                raise StateError(f"re-release of {gid} is not in the recycled queue")
            state.recycled.pop(at[0])
            state.count("rereleased")
        else:
            state.epoch = ev.source.get("epoch", state.epoch)
            state.cursor = ev.source.get("cursor", state.cursor)
            state.next_group_index = ev.source.get("next_group_index", state.next_group_index)
            state.count("released")
        state.outstanding[gid] = p
    elif kind == "put":
        if ev.outcome == "duplicate":
            state.count("duplicate_groups")
            return
        # rejected: also a message that names no outstanding prompt (forged, garbage); foreign
        # (multi-LoRA): its registration ended before it came back
        if ev.outcome in ("rejected", "foreign"):
            state.outstanding.pop(ev.group_id, None)
            state.count(ev.outcome)
            return
        if (p := state.outstanding.pop(ev.group_id, None)) is None:
            raise StateError(f"put of {ev.group_id}, which is not outstanding")
        if ev.outcome in ("stored", "accepted"):
            state.stored[ev.group_id] = StoredRef(
                group_id=ev.group_id,
                stream_seq=ev.stream_seq,
                oldest_version=ev.oldest_version,
                prompt=p,
                failed=ev.failed,
            )
            state.count(ev.outcome)
        elif ev.outcome == "filtered":
            state.count(f"filtered/{ev.reason or 'unspecified'}")
        elif ev.outcome == "aborted":
            state.count("aborted_recycled" if ev.recycled else "aborted_dropped")
            if ev.recycled:
                _recycle(state, p)
        else:
            raise StateError(f"unknown put outcome {ev.outcome!r}")
    elif kind == "expired":  # released, then neither answered nor in work within --prompt-deadline-s
        if (p := state.outstanding.pop(ev.group_id, None)) is None:
            raise StateError(f"expiry of {ev.group_id}, which is not outstanding")
        state.count("expired")
        _recycle(state, p)
    elif kind == "stale":
        if (ref := state.stored.pop(ev.group_id, None)) is None:
            raise StateError(f"stale rejection of {ev.group_id}, which is not stored")
        state.count("stale_recycled" if ev.recycled else "stale_dropped")
        if ev.recycled:
            _recycle(state, ref.prompt)
    elif kind == "retired":  # multi-LoRA: stored, or leased to a step never committed, when its registration completed
        if state.stored.pop(ev.group_id, None) is None and not _unlease(state, ev.group_id):
            raise StateError(f"retirement of {ev.group_id}, which is neither stored nor leased")
        state.count("retired_dropped")
    elif kind == "leased":
        if (ref := state.stored.pop(ev.group_id, None)) is None:
            raise StateError(f"lease of {ev.group_id}, which is not stored")
        lease = state.leases.setdefault(ev.step, LeaseRecord(step=ev.step))
        lease.refs.append(
            GroupRef(
                group_id=ref.group_id,
                group_index=ref.prompt.group_index,
                stream_seq=ref.stream_seq,
                staleness=ev.staleness,
                oldest_version=ref.oldest_version,
                failed=ref.failed,
            )
        )
        state.count("consumed")
    elif kind == "lease_complete":
        lease = state.leases.setdefault(ev.step, LeaseRecord(step=ev.step))
        lease.complete = True
        lease.metrics = dict(ev.metrics)
    elif kind == "committed":
        for step in sorted(s for s in state.leases if s <= ev.step):
            refs = state.leases.pop(step).refs
            state.count("trained", sum(not r.failed for r in refs))
            state.count("failed", sum(r.failed for r in refs))
        state.committed_step = max(state.committed_step, ev.step)
    else:
        raise StateError(f"unknown ledger event kind {kind!r}")


def _unlease(state: BufferState, gid: str) -> bool:
    """Take a group out of the uncommitted lease holding it (a lease left empty goes); False if none does."""
    for step, lease in state.leases.items():
        for i, ref in enumerate(lease.refs):
            if ref.group_id == gid:
                del lease.refs[i]
                if not lease.refs:
                    del state.leases[step]
                return True
    return False


def fold(events, state: BufferState | None = None) -> BufferState:
    state = state or BufferState()
    for ev in events:
        apply(state, ev)
    return state


def encode_state(state: BufferState) -> bytes:
    return msgspec.msgpack.encode(state)


def decode_state(data: bytes) -> BufferState:
    return msgspec.msgpack.decode(data, type=BufferState)


# ---- the audit ---------------------------------------------------------------------------------


def audit(events, remaining_prompts: set[str] | None = None, remaining_rollouts: set[str] | None = None,
          trained_by_trainer: dict[int, list[int]] | None = None) -> dict:  # fmt: skip
    """Check the ledger prompt by prompt and balance it.

    Every released prompt must end as exactly one of: trained (once), failed (committed, but
    every sample FAILED: it trained nothing), filtered (with reason), dropped as aborted or
    stale, rejected (its group failed validation and was dead-lettered),
    or still in flight when the run stopped (outstanding, stored,
    leased to an uncommitted step, or waiting in the recycled queue) - after any number of
    recycles. `remaining_prompts` / `remaining_rollouts` (group ids still on PROMPTS / ROLLOUTS)
    prove that stored groups still exist, and count the outstanding prompts on neither
    (`unpublished_at_end`, among the outstanding: the ledger's release record holds each, and a
    restarted buffer publishes it); `trained_by_trainer` (step ->
    group indices, from the trainer's own record) is cross-checked against the ledger.
    """
    auditor = Auditor()
    auditor.feed(events)
    return auditor.report(remaining_prompts, remaining_rollouts, trained_by_trainer)


def prompt_of(ev) -> int:
    """The prompt (group index) an event is about; -1 for a step's (lease_complete, committed)."""
    return ev.prompt.group_index if ev.kind == "released" and ev.prompt is not None else ev.group_index


def ledger_counts(r: dict) -> dict:
    """An audit report's counts, as result.json and the console show them."""
    return {
        "released": r["released_prompts"],
        "trained": r["trained"],
        "failed": r["failed"],
        "filtered": sum(r["filtered"].values()),
        "dropped": r["aborted_dropped"] + r["stale_dropped"] + r.get("foreign_dropped", 0) + r.get("retired_dropped", 0),
        "rejected": r["rejected"],
        "in_flight_at_end": sum(r["in_flight_at_end"].values()),
        "lost": r["lost"],
        "trained_twice": r["trained_twice"],
    }


def lineage_entry(ev) -> dict:
    """One event in a prompt's history (`asyncrl audit --prompt`, the dashboard's lineage view)."""
    rec = {"seq": ev.seq, "kind": ev.kind, "at": ev.ts}
    if ev.kind == "released" and ev.prompt is not None:
        rec["attempt"], rec["group_id"] = ev.prompt.attempt, f"g{ev.prompt.group_index}-a{ev.prompt.attempt}"
    else:  # the group id names the attempt (g<index>-a<attempt>); not every event fills `attempt`
        tail = ev.group_id.rpartition("-a")[2]
        rec["attempt"], rec["group_id"] = int(tail) if tail.isdigit() else ev.attempt, ev.group_id
    fields = {k: getattr(ev, k) for k in ("step", "outcome", "reason", "staleness")}
    rec.update({k: v for k, v in fields.items() if v not in (None, "", -1)})
    if ev.recycled:
        rec["recycled"] = True
    return rec


class Auditor:
    """The audit as a fold: `read` ledger messages (or `feed` events) as they come (a live
    dashboard), `report` at any time."""

    def __init__(self):
        self.state = BufferState()
        self.problems: list[str] = []
        """Problems met while folding (the report adds those of the end state)."""
        self.terminal: dict[int, str] = {}
        self.trained_steps: dict[int, int] = {}
        self.first_release: set[int] = set()
        self.broken = False
        """An event could not follow the state: the rest of the ledger is not folded."""
        self.read_up_to = 0
        """The last ledger event `read` took (its seq)."""
        self.skipped: list[str] = []
        """What `read` skipped: ledger messages that are not the buffer's, events appended twice."""

    def read(self, messages) -> list:
        """Fold ledger messages, `(where, data)` pairs: their events after those read before, in
        order, each once. A message that is not the buffer's is said in `skipped` (`ledger message
        <where>`), and so is an event appended twice (an append retried beyond the dedupe window:
        the first is kept). Returns the events folded."""
        events = []
        for where, data in messages:
            try:
                events += ledger_events(data)
            except LedgerError as e:
                self.skipped.append(f"ledger message {where}: {e}")
        fresh = []
        for ev in sorted(events, key=lambda e: e.seq):
            if ev.seq <= self.read_up_to:
                self.skipped.append(f"ledger event {ev.seq} appears more than once (kept the first)")
                continue
            fresh.append(ev)
            self.read_up_to = ev.seq
        self.feed(fresh)
        return fresh

    def feed(self, events) -> None:
        for ev in events:
            if self.broken:
                return
            try:
                self._apply(ev)
            except StateError as e:
                self.problems.append(str(e))
                self.broken = True

    def fate(self, group_index: int) -> str | None:
        """How a prompt ended (trained, failed, filtered/<reason>, aborted_dropped, stale_dropped,
        rejected, ...), "in flight" while it has not, None if never released."""
        return self.terminal.get(group_index) or ("in flight" if group_index in self.first_release else None)

    def report(self, remaining_prompts: set[str] | None = None, remaining_rollouts: set[str] | None = None,
               trained_by_trainer: dict[int, list[int]] | None = None) -> dict:  # fmt: skip
        state, terminal, trained_steps = self.state, self.terminal, self.trained_steps
        problems = list(self.problems)
        in_flight = collections.Counter()
        unpublished = 0
        for gid in state.outstanding:
            in_flight["outstanding"] += 1
            if remaining_prompts is not None and remaining_rollouts is not None:
                if gid not in remaining_prompts and gid not in remaining_rollouts:
                    # a release is recorded before its prompt is published (the record holds the
                    # prompt): a run stopped in between (a full store, a kill) left it unpublished,
                    # and a restarted buffer publishes every outstanding prompt again from the ledger
                    unpublished += 1
        for gid in state.stored:
            in_flight["stored"] += 1
            if remaining_rollouts is not None and gid not in remaining_rollouts:
                problems.append(f"{gid} is stored but its payload is gone from ROLLOUTS: lost")
        for lease in state.leases.values():
            in_flight["leased_uncommitted"] += len(lease.refs)
        in_flight["recycled_waiting"] = len(state.recycled)
        leased = {r.group_index for lease in state.leases.values() for r in lease.refs}
        accounted = set(terminal) | leased | {p.group_index for p in [*state.outstanding.values(), *state.recycled]}
        accounted |= {r.prompt.group_index for r in state.stored.values()}
        lost = sorted(self.first_release - accounted)
        problems += [f"prompt {gi} was released and has no outcome: lost" for gi in lost[:20]]
        twice = sorted(gi for gi, n in trained_steps.items() if n > 1)
        problems += [f"prompt {gi} was trained {trained_steps[gi]} times" for gi in twice[:20]]
        if trained_by_trainer is not None:
            # the trainer records a step before committing it: a step it trained whose commit the
            # run did not see (stopped in between) is still leased, and will be trained again
            by_trainer = collections.Counter(gi for gis in trained_by_trainer.values() for gi in gis)
            ledger_trained = {gi for gi, t in terminal.items() if t in ("trained", "failed")}
            if not ledger_trained <= set(by_trainer) or not set(by_trainer) <= ledger_trained | leased:
                diff = sorted((ledger_trained - set(by_trainer)) | (set(by_trainer) - ledger_trained - leased))[:10]
                problems.append(f"trainer and ledger disagree on trained prompts, e.g. {diff}")
            problems += [f"the trainer recorded prompt {gi} {n} times" for gi, n in by_trainer.items() if n > 1]
        outcomes = collections.Counter(terminal.values())
        return {
            "released_prompts": len(self.first_release),
            "trained": outcomes.get("trained", 0),
            "failed": outcomes.get("failed", 0),
            "filtered": {k.removeprefix("filtered/"): v for k, v in outcomes.items() if k.startswith("filtered/")},
            "aborted_dropped": outcomes.get("aborted_dropped", 0),
            "stale_dropped": outcomes.get("stale_dropped", 0),
            "rejected": outcomes.get("rejected", 0),
            "foreign_dropped": outcomes.get("foreign", 0),
            "retired_dropped": outcomes.get("retired_dropped", 0),
            "rejected_messages": state.counters.get("rejected", 0),
            "recycled": state.counters.get("recycled", 0),
            "duplicates_ignored": state.counters.get("duplicate_groups", 0),
            "in_flight_at_end": dict(in_flight),
            "unpublished_at_end": unpublished,
            "lost": len(lost),
            "trained_twice": len(twice),
            "events": state.seq,
            "problems": problems,
            "balanced": not problems,
        }

    def _apply(self, ev) -> None:
        """apply() plus the per-prompt bookkeeping of the audit."""
        state, terminal = self.state, self.terminal
        if ev.kind == "released" and ev.prompt.attempt == 0:
            if ev.prompt.group_index in self.first_release:
                self.problems.append(f"prompt {ev.prompt.group_index} was released twice as a fresh prompt")
            self.first_release.add(ev.prompt.group_index)
        if ev.kind == "put" and ev.outcome in ("rejected", "foreign") and ev.group_id in state.outstanding:
            terminal[ev.group_index] = ev.outcome
        if ev.kind == "committed":
            for ref in [r for s, lease in state.leases.items() if s <= ev.step for r in lease.refs]:
                self.trained_steps[ref.group_index] = self.trained_steps.get(ref.group_index, 0) + 1
                terminal[ref.group_index] = "failed" if ref.failed else "trained"
        apply(state, ev)
        gi = ev.group_index
        if ev.kind == "put" and ev.outcome == "filtered":
            terminal[gi] = f"filtered/{ev.reason or 'unspecified'}"
        elif ev.kind == "put" and ev.outcome == "aborted" and not ev.recycled:
            terminal[gi] = "aborted_dropped"
        elif ev.kind == "stale" and not ev.recycled:
            terminal[gi] = "stale_dropped"
        elif ev.kind == "retired":
            terminal[gi] = "retired_dropped"
