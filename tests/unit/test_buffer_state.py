"""The buffer's durable state: a fold over ledger events, snapshot + replay equal to full
replay, and the audit that balances the ledger prompt by prompt."""

from __future__ import annotations

import random

import pytest

from asyncrl_proto import LedgerEvent, PromptMsg, group_id
from services.buffer.state import BufferState, StateError, apply, audit, decode_state, encode_state, fold


class Log:
    def __init__(self):
        self.events: list[LedgerEvent] = []
        self.state = BufferState()

    def add(self, kind, **kw) -> None:
        ev = LedgerEvent(seq=len(self.events) + 1, kind=kind, **kw)
        apply(self.state, ev)
        self.events.append(ev)

    def release(self, gi, attempt=0):
        p = PromptMsg(group_index=gi, prompt=f"p{gi}", attempt=attempt)
        src = {} if attempt else {"epoch": 0, "cursor": gi + 1, "next_group_index": gi + 1}
        self.add("released", group_id=group_id(gi, attempt), group_index=gi, attempt=attempt, prompt=p, source=src)

    def put(self, gi, outcome="stored", attempt=0, **kw):
        self.add("put", group_id=group_id(gi, attempt), group_index=gi, attempt=attempt, outcome=outcome,
                 stream_seq=100 + gi, **kw)  # fmt: skip


def test_lifecycle_of_groups():
    log = Log()
    for gi in range(5):
        log.release(gi)
    log.put(0)
    log.put(1)
    log.put(2, "filtered", reason="zero_std_1.0")
    log.put(3, "aborted", recycled=True)
    log.put(4, "aborted", recycled=False)
    s = log.state
    assert list(s.stored) == ["g0-a0", "g1-a0"] and s.outstanding == {}
    assert [p.group_index for p in s.recycled] == [3] and s.recycled[0].attempt == 1
    log.release(3, attempt=1)  # recycled prompts keep their group index
    assert "g3-a1" in s.outstanding and s.recycled == []
    log.add("leased", group_id="g0-a0", group_index=0, step=0, staleness=1)
    log.add("stale", group_id="g1-a0", group_index=1, recycled=False)
    log.put(3, "stored", attempt=1)
    log.add("leased", group_id="g3-a1", group_index=3, step=0)
    log.add("lease_complete", step=0, metrics={"m": 1.0})
    log.add("committed", step=0)
    assert s.committed_step == 0 and s.leases == {} and s.counters["trained"] == 2
    report = audit(log.events)
    assert report["balanced"], report["problems"]
    assert report["released_prompts"] == 5 and report["trained"] == 2
    assert report["filtered"] == {"zero_std_1.0": 1} and report["aborted_dropped"] == 1 and report["stale_dropped"] == 1
    assert report["recycled"] == 1 and report["lost"] == 0 and report["trained_twice"] == 0


def test_duplicates_and_impossible_events():
    log = Log()
    log.release(0)
    log.put(0)
    log.add("put", group_id="g0-a0", group_index=0, outcome="duplicate")
    assert log.state.counters["duplicate_groups"] == 1
    with pytest.raises(StateError, match="not outstanding"):
        apply(log.state, LedgerEvent(seq=log.state.seq + 1, kind="put", group_id="g9-a0", outcome="stored"))
    with pytest.raises(StateError, match="does not follow"):
        apply(log.state, LedgerEvent(seq=log.state.seq + 5, kind="committed", step=0))


def random_log(seed: int, n: int = 200) -> Log:
    rng = random.Random(seed)
    log = Log()
    gi, step = 0, 0
    for _ in range(n):
        s = log.state
        choice = rng.random()
        if choice < 0.3:
            if s.recycled:
                log.release(s.recycled[0].group_index, s.recycled[0].attempt)
            else:
                log.release(gi)
                gi += 1
        elif choice < 0.6 and s.outstanding:
            gid = rng.choice(list(s.outstanding))
            p = s.outstanding[gid]
            outcome = rng.choice(["stored", "stored", "stored", "filtered", "aborted"])
            log.put(p.group_index, outcome, attempt=p.attempt, recycled=rng.random() < 0.5)
        elif choice < 0.8 and s.stored:
            gid = next(iter(s.stored))
            gi_ = s.stored[gid].prompt.group_index
            if rng.random() < 0.2:
                log.add("stale", group_id=gid, group_index=gi_, recycled=rng.random() < 0.5)
            else:
                log.add("leased", group_id=gid, group_index=gi_, step=step)
        elif s.leases:
            log.add("committed", step=step)
            step += 1
    return log


@pytest.mark.parametrize("seed", range(5))
def test_snapshot_plus_replay_equals_full_replay(seed):
    log = random_log(seed)
    cut = len(log.events) // 2
    snap = encode_state(fold(log.events[:cut]))
    resumed = fold(log.events[cut:], decode_state(snap))
    assert encode_state(resumed) == encode_state(log.state)
    report = audit(log.events)
    assert report["balanced"], report["problems"]


def test_audit_catches_loss_and_double_training():
    log = Log()
    log.release(0)
    log.put(0)
    # the payload of a stored group is gone from ROLLOUTS: lost
    report = audit(log.events, remaining_prompts=set(), remaining_rollouts=set())
    assert not report["balanced"] and "lost" in report["problems"][0]
    # the trainer's own record disagrees with the ledger
    log.add("leased", group_id="g0-a0", group_index=0, step=0)
    log.add("committed", step=0)
    report = audit(log.events, trained_by_trainer={0: [0], 1: [0]})
    assert not report["balanced"]
    assert any("recorded prompt 0 2 times" in p for p in report["problems"])
    assert audit(log.events, trained_by_trainer={0: [0]})["balanced"]


def test_a_release_recorded_but_never_published_is_in_flight_not_lost():
    """The buffer records a release before it publishes the prompt (the record holds it): a run
    stopped in between (a full store) leaves the prompt on neither stream, and a restarted buffer
    publishes it again from the ledger. The audit counts it as unpublished, and balances."""
    log = Log()
    log.release(0)
    log.release(1)
    report = audit(log.events, remaining_prompts={"g1-a0"}, remaining_rollouts=set())
    assert report["balanced"], report["problems"]
    assert report["in_flight_at_end"]["outstanding"] == 2 and report["unpublished_at_end"] == 1


def test_the_trainer_records_a_step_before_its_commit():
    """A step the trainer recorded whose commit the run did not see is still leased (it will be
    trained again): consistent. A committed step the trainer has no record of is not."""
    log = Log()
    for gi in (0, 1):
        log.release(gi)
        log.put(gi)
    log.add("leased", group_id="g0-a0", group_index=0, step=0)
    log.add("committed", step=0)
    log.add("leased", group_id="g1-a0", group_index=1, step=1)
    assert audit(log.events, trained_by_trainer={0: [0], 1: [1]})["balanced"]  # stopped before commit 1
    missing = audit(log.events, trained_by_trainer={1: [1]})
    assert not missing["balanced"] and "disagree on trained prompts, e.g. [0]" in missing["problems"][0]
    stray = audit(log.events, trained_by_trainer={0: [0], 1: [1, 5]})
    assert not stray["balanced"] and "e.g. [5]" in stray["problems"][0]


def test_ledger_messages_are_batches_bounded_in_events_and_bytes_and_old_ledgers_still_read():
    from asyncrl_proto import LedgerBatch, encode
    from services.buffer.ledger import LEDGER_BATCH_EVENTS
    from services.buffer.ledger import chunks as _chunks
    from services.buffer.state import ledger_events

    prompt = PromptMsg(group_index=0, prompt="x" * 1000)
    events = [LedgerEvent(seq=i + 1, kind="released", prompt=prompt) for i in range(40)]
    chunks = _chunks(events, max_bytes=8 * 1024)
    assert [ev for c in chunks for ev in c] == events  # in order, nothing lost
    assert all(len(encode(LedgerBatch(events=c))) <= 8 * 1024 + 64 for c in chunks) and len(chunks) > 1
    small = [LedgerEvent(seq=i + 1, kind="committed", step=i) for i in range(LEDGER_BATCH_EVENTS + 3)]
    assert [len(c) for c in _chunks(small, max_bytes=1 << 30)] == [LEDGER_BATCH_EVENTS, 3]
    assert ledger_events(encode(LedgerBatch(events=events[:2]))) == events[:2]
    assert ledger_events(encode(events[5])) == [events[5]]  # one event per message, as before batching
