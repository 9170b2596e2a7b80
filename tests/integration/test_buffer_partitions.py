"""Multi-LoRA buffer partitions on a real broker: each registration's ledger is one subject of
the run's LEDGER stream, written by one writer and replayed alone; a closed partition's stored
groups (stored, or leased to a step never committed) are recorded retired and its late groups
foreign, and the audit balances it."""

from __future__ import annotations

import pytest

from asyncrl_proto import LedgerBatch, LedgerEvent, PromptMsg, RolloutGroup, Sample, encode, group_id
from services.buffer.ledger import Ledger, LedgerConflict
from services.buffer.machine import BufferMachine
from services.buffer.state import apply, audit
from services.common.bus import Bus


def _event(state, kind: str, **kw) -> LedgerEvent:
    ev = LedgerEvent(seq=state.seq + 1, kind=kind, **kw)
    apply(state, ev)
    return ev


def _released(state, gi: int) -> LedgerEvent:
    p = PromptMsg(group_index=gi, prompt="1+2", n_samples=1)
    return _event(state, "released", group_id=group_id(gi, 0), group_index=gi, prompt=p,
                  source={"epoch": 0, "cursor": gi + 1, "next_group_index": gi + 1})  # fmt: skip


async def test_partition_ledgers_share_a_stream_and_replay_apart(nats_server, run_id):
    bus = await Bus.connect(nats_server.url, run_id, "test")
    await bus.ensure_streams(partitioned=True)
    failures = []
    try:
        a, b = bus.subjects.of("aaaa"), bus.subjects.of("bbbb")
        la = Ledger(bus, failures.append, lambda coro, what: None, a)
        lb = Ledger(bus, failures.append, lambda coro, what: None, b)
        for gi in range(3):  # interleaved appends of two writers on one stream: no conflict
            la.add([_released(la.state, gi)])
            await la.flush()
            lb.add([_released(lb.state, gi)])
            lb.add([_released(lb.state, gi + 10)])
            await lb.flush()
        assert not failures
        again_a, again_b = Ledger(bus, failures.append, None, a), Ledger(bus, failures.append, None, b)
        assert await again_a.recover() == 3 and await again_b.recover() == 6
        assert set(again_a.state.outstanding) == {group_id(i, 0) for i in range(3)}
        assert len(again_b.state.outstanding) == 6 and not again_a.problems and not again_b.problems
        # a message another writer put on a's subject: a's next append fails loudly, b's does not
        await bus.publish(a.ledger, LedgerBatch(events=[LedgerEvent(seq=99, kind="committed", step=0)]))
        la.add([_released(la.state, 7)])
        with pytest.raises(LedgerConflict):
            await la.flush()
        lb.add([_released(lb.state, 7)])
        await lb.flush()
        assert len(failures) == 1
    finally:
        await bus.close()


def test_a_closed_partition_drops_its_stored_groups_as_retired_and_late_ones_as_foreign(task_data, tiny_model_dir):
    from services.common.config import RunConfig
    from services.data.source import make_prompt_source
    from services.common.validate import limits_from_model_dir

    train, _ = task_data
    cfg = RunConfig(prompt_data=str(train), hf_checkpoint=str(tiny_model_dir), rollout_batch_size=2,
                    n_samples_per_prompt=1, driver="async", fully_async=True, num_rollout=3)  # fmt: skip
    m = BufferMachine(cfg, make_prompt_source(cfg), limits_from_model_dir(cfg.data.hf_checkpoint, 1, None),
                      published=lambda: 0, metrics=lambda: {}, observed=True, plugin_path="default")  # fmt: skip
    events = m.on_released(m._plan(3)).events
    for gi, seq in ((0, 4), (2, 5)):
        stored = RolloutGroup(group_id=group_id(gi, 0), group_index=gi,
                              samples=[Sample(index=gi, group_index=gi, tokens=[1, 2], response_length=1, reward=1.0,
                                              status="completed", weight_versions=[0])])  # fmt: skip
        out = m.on_group(None, seq, stored, None, encode(stored))
        assert out.settle == "put"
        m.on_decision("stored", stored.samples, None)
        events += out.events + m.on_put_returned().events
    events += m.on_handed(0, stored.samples, 0).events  # g2 leased to step 0, which is never committed
    closed = m.on_closed().events  # g0 was stored, g2 leased: both retired
    assert [(e.kind, e.group_id) for e in closed] == [("retired", group_id(0, 0)), ("retired", group_id(2, 0))]
    events += closed
    assert not m.state.leases and not m.state.stored
    late = encode(RolloutGroup(group_id=group_id(1, 0), group_index=1, samples=[]))
    out = m.on_foreign(None, 6, late)  # g1 was outstanding: foreign
    assert out.settle == "ack"
    events += out.events
    again = m.on_foreign(None, 7, late)  # a redelivery of it: a duplicate
    assert again.settle == "ack" and again.events[0].outcome == "duplicate"
    events += again.events
    garbage = m.on_foreign(None, 8, b"\xc1")
    assert garbage.settle == "term" and garbage.dead_letters
    events += garbage.events
    report = audit(events)
    assert report["balanced"], report["problems"]
    assert (report["retired_dropped"], report["foreign_dropped"], report["released_prompts"]) == (2, 1, 3)
    assert not any(report["in_flight_at_end"].values()), report["in_flight_at_end"]  # nothing left leased
