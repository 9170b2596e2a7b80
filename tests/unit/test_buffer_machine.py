"""The buffer's state machine (services.buffer.machine): lease, staleness, commit, release and
put rules, event by event, with no NATS and no asyncio. Every test also checks that the events
the machine returned fold (services.buffer.state) into exactly its state: what a restart
rebuilds is what it decided."""

from __future__ import annotations

import pytest

from asyncrl_proto import BufferCommit, BufferGetRequest, Heartbeat, RolloutGroup, Sample, SampleStatus, group_id
from services.buffer.machine import BufferMachine, BufferPluginError, GroupState, LeaseState
from services.buffer.state import BufferState, encode_state, fold
from services.common.config import RunConfig
from services.data.source import PromptSource
from services.common.validate import Limits


class Run:
    """A machine plus a record of every event it returned (the ledger, as the service appends it)."""

    def __init__(self, observed: bool = True, rows: int = 20, **kw):
        base = dict(
            rollout_batch_size=2, n_samples_per_prompt=2, fully_async=True, async_data_buffer_capacity_factor=1.0
        )
        self.cfg = RunConfig(**{**base, **kw})
        rows_ = [{"prompt": f"q{i}", "label": str(i), "metadata": {}} for i in range(rows)]
        self.published = 0
        self.metrics_calls = 0
        self.m = BufferMachine(self.cfg, PromptSource(self.cfg, rows_), Limits(n=2, vocab_size=64, context_length=32),
                               published=lambda: self.published, metrics=self._metrics, observed=observed,
                               plugin_path="tests.Buffer")  # fmt: skip
        self.ledger = []

    def _metrics(self):
        self.metrics_calls += 1
        return {"rollout/fully_async/queue_size": 0}

    def do(self, out):
        self.ledger.extend(out.events)
        return out

    def release(self, k=None):
        planned = self.m.plan_release(now=0.0)
        if k is not None:
            assert len(planned) >= k
        return [p for p, _ in planned], self.do(self.m.on_released(planned))

    def group(self, p, versions=(0,), status=SampleStatus.COMPLETED, vocab_ok=True) -> RolloutGroup:
        tok = 5 if vocab_ok else 10_000
        samples = [Sample(index=p.group_index * 2 + i, group_index=p.group_index, prompt=p.prompt, label=p.label,
                          tokens=[1, tok, 7, 2], response_length=2, reward=float(i), status=status,
                          weight_versions=list(versions), rollout_log_probs=[-1.0, -1.0]) for i in range(2)]  # fmt: skip
        return RolloutGroup(group_id=group_id(p.group_index, p.attempt), group_index=p.group_index, attempt=p.attempt,
                            samples=samples)  # fmt: skip

    def put(self, rg: RolloutGroup, seq: int, decision="stored", reason=None):
        """The service's put path with a DataBuffer that decides `decision` (None: a custom one)."""
        out = self.do(self.m.on_group(object(), seq, rg, None, b"x" * 10))
        if out.settle != "put":
            return out.settle
        if decision is not None:
            self.m.on_decision(decision, rg.samples, reason)
        self.do(self.m.on_put_returned())
        return "ack"

    def get(self, step, wait_s=1.0, **kw):
        msg = object()
        return msg, self.do(self.m.on_get(msg, BufferGetRequest(step=step, count=2, wait_s=wait_s, **kw)))

    def check_fold(self):
        folded = fold(self.ledger)
        assert encode_state(folded) == encode_state(_without_stream_seq(self.m.state))


def _without_stream_seq(state: BufferState) -> BufferState:
    import msgspec

    return msgspec.structs.replace(state, log_stream_seq=0)


def test_a_lease_completes_at_b_groups_and_answers_the_waiting_gets_once():
    r = Run()
    msg, out = r.get(0)
    assert out.waiting and not out.replies and r.m.lease_state(0) is LeaseState.OPEN
    prompts, _ = r.release()
    assert len(prompts) == 4  # capacity 2 + one producer's default cap of 2 groups
    for i, p in enumerate(prompts[:2]):
        assert r.put(r.group(p), seq=i + 1) == "ack"
    assert r.m.step_to_fill() == 0
    first = r.do(r.m.on_handed(0, r.group(prompts[0]).samples, version=0))
    assert not first.replies and [e.kind for e in first.events] == ["leased"]
    second = r.do(r.m.on_handed(0, r.group(prompts[1]).samples, version=0))
    assert [e.kind for e in second.events] == ["leased", "lease_complete"]
    assert [(to, reply.complete, len(reply.refs)) for to, reply in second.replies] == [(msg, True, 2)]
    assert r.m.lease_state(0) is LeaseState.COMPLETE and r.m.step_to_fill() is None
    assert r.m.on_get_timeout(msg, 0).replies == []  # answered already: never twice
    _, again = r.get(0)  # a repeated get gets the same lease at once
    assert [reply.refs for _, reply in again.replies] == [second.replies[0][1].refs]
    r.check_fold()


def test_a_get_that_times_out_gets_the_lease_as_it_is():
    r = Run()
    msg, out = r.get(0, wait_s=0.5)
    assert out.waiting
    (to, reply), = r.m.on_get_timeout(msg, 0).replies  # fmt: skip
    assert to is msg and not reply.complete and reply.refs == []
    _, now = r.get(0, wait_s=0)
    assert not now.waiting and len(now.replies) == 1


def test_staleness_is_judged_against_the_trainers_version_then_the_engines():
    r = Run(max_weight_staleness=1)
    r.published = 5
    r.do(r.m.on_version(None, 3))
    assert r.m.clock() == 3
    r.get(0, current_version=5)
    assert r.m.clock() == 5  # the trainer's version wins over the engines'
    prompts, _ = r.release()
    r.put(r.group(prompts[0], versions=(3,)), seq=1)
    r.m.on_decision("stale", r.group(prompts[0], versions=(3,)).samples, None)  # the DefaultDataBuffer's verdict
    out = r.do(r.m.on_put_returned())
    (stale,) = [e for e in out.events if e.kind == "stale"]
    assert stale.staleness == 2 and not stale.recycled
    assert r.m.group_state(stale.group_id) is GroupState.SETTLED
    r.check_fold()


def test_the_clock_moves_forward_only_and_only_to_published_versions():
    r = Run()
    r.published = 4
    assert r.m.on_version(None, 3).dead_letters == [] and r.m.live_version == 3
    r.m.on_version(None, 2)
    assert r.m.live_version == 3
    msg = object()
    (to, reason), = r.m.on_version(msg, 10**9).dead_letters  # fmt: skip
    assert to is msg and "never published" in reason and r.m.live_version == 3


def test_gets_the_trainer_would_never_send_are_refused_and_dead_lettered():
    r = Run()
    for kw, words in [(dict(step=5), "outside the steps"), (dict(step=0, count=3), "--rollout-batch-size"),
                      (dict(step=0, lookahead_steps=2), "only 0 or 1"), (dict(step=0, wait_s=31), "at most 30 s"),
                      (dict(step=0, current_version=1), "never published")]:  # fmt: skip
        msg = object()
        out = r.m.on_get(msg, BufferGetRequest(**{"count": 2, **kw}))
        (to, reply), = out.replies  # fmt: skip
        assert to is msg and words in reply.error and out.dead_letters == [(msg, reply.error)]
    assert r.m.requested == {} and r.m.want_step is None  # nothing of them was taken in


def test_commit_needs_complete_leases_and_answers_a_repeat():
    r = Run()
    msg, _ = r.get(0)
    out = r.m.on_commit(object(), BufferCommit(step=0))
    assert "never trained" in out.replies[0][1].error and out.dead_letters and not out.events
    prompts, _ = r.release()
    for i, p in enumerate(prompts[:2]):
        r.put(r.group(p), seq=i + 1)
        r.do(r.m.on_handed(0, r.group(p).samples, version=0))
    done = r.do(r.m.on_commit(object(), BufferCommit(step=0)))
    assert [e.kind for e in done.events] == ["committed"] and done.replies[0][1].num_groups_committed == 2
    assert done.purge and r.m.lease_state(0) is LeaseState.COMMITTED and r.m.state.counters["trained"] == 2
    repeat = r.do(r.m.on_commit(object(), BufferCommit(step=0)))
    assert repeat.events == [] and repeat.replies[0][1].error is None
    _, late = r.get(0)
    assert "already committed" in late.replies[0][1].error and not late.dead_letters
    assert r.m.purge_floor(ack_floor=10) == 11  # nothing stored or leased: everything acknowledged can go
    r.put(r.group(prompts[2]), seq=3)
    assert r.m.purge_floor(ack_floor=10) == 3  # a stored group's payload stays
    r.check_fold()


def test_groups_rejected_duplicated_or_early_are_decided_before_any_put():
    r = Run()
    r.get(0)
    planned = r.m.plan_release(now=0.0)
    (p0, _), (p1, _) = planned[:2]
    assert r.m.group_state(group_id(p0.group_index, 0)) is GroupState.RELEASING
    assert r.do(r.m.on_group(object(), 1, r.group(p0), None, b"")).settle == "term"  # not recorded: never released
    r.do(r.m.on_released(planned))
    bad = r.do(r.m.on_group(msg := object(), 2, r.group(p1, vocab_ok=False), None, b""))
    assert bad.settle == "term" and bad.dead_letters[0][0] is msg and "vocab" in bad.dead_letters[0][1]
    assert [e.outcome for e in bad.events] == ["rejected"]
    assert r.put(r.group(p0), seq=3) == "ack"
    assert r.put(r.group(p0), seq=4) == "ack" and r.m.state.counters["duplicate_groups"] == 1
    never = r.group(p0)
    never.group_index, never.group_id = 10_000, group_id(10_000, 0)  # beyond what would be released next
    assert r.put(never, seq=5) == "term"
    junk = r.do(r.m.on_group(object(), 6, None, "undecodable RolloutGroup: junk", b"junk"))
    assert junk.settle == "term" and junk.events[0].group_index == -1
    r.check_fold()


def test_a_custom_buffers_puts_are_accepted_its_recycles_recorded_and_early_hands_ordered():
    r = Run(observed=False, async_unused_samples_handler="retry")
    r.get(0)
    prompts, _ = r.release()
    assert r.put(r.group(prompts[0]), seq=1, decision=None) == "ack"
    assert r.m.state.counters["accepted"] == 1
    # recycled during its put: aborted, its prompt back in the queue as attempt 1
    r.do(r.m.on_group(object(), 2, r.group(prompts[1]), None, b""))
    r.m.on_recycled(r.group(prompts[1]).samples)
    r.do(r.m.on_put_returned())
    assert r.m.state.counters["aborted_recycled"] == 1 and r.m.state.recycled[0].attempt == 1
    # handed out before its put() returned: its put is recorded first, then its lease
    r.do(r.m.on_group(object(), 3, r.group(prompts[2]), None, b""))
    out = r.do(r.m.on_handed(0, r.group(prompts[2]).samples, version=0))
    assert [(e.kind, e.outcome) for e in out.events][:2] == [("put", "accepted"), ("leased", "")]
    assert r.do(r.m.on_put_returned()).events == []
    # a stored group given back: stale, recycled
    r.put(r.group(prompts[3]), seq=4, decision=None)
    r.m.on_recycled(r.group(prompts[3]).samples)
    assert r.do(r.m.on_put_returned()).events[0].kind == "stale"
    with pytest.raises(BufferPluginError, match="tests.Buffer.get returned a group that was never put"):
        r.m.on_handed(0, r.group(prompts[3]).samples, version=0)
    r.check_fold()


def test_sync_release_waits_for_the_engines_and_releases_one_batch():
    r = Run(fully_async=False, driver="sync")
    assert r.m.plan_release(now=0.0) == []  # nothing before the trainer's first get
    r.published = 1
    r.get(0, wait_s=0, release_min_version=1)
    assert r.m.plan_release(now=0.0) == []  # engines still on version 0
    r.do(r.m.on_version(None, 1))
    prompts, _ = r.release()
    assert len(prompts) == 2 and r.m.plan_release(now=0.0) == []  # exactly B, never more
    r.check_fold()


def test_fully_async_release_counts_the_caps_of_live_producers_that_answered():
    """The in-flight budget comes from what was released and what came back: a heartbeat adds a
    producer's cap only once that producer has answered a released prompt, so 1024 heartbeats
    under made-up ids release nothing beyond one producer's cap."""
    r = Run(rows=64)
    r.get(0, wait_s=0)

    def beat(pid, cap=2, now=0.0):
        return r.m.on_heartbeat(object(), Heartbeat(instance_id=pid, service="rollout", info={"inflight_groups": cap}), now)

    for i in range(1024):
        assert not beat(f"forged-{i}").dead_letters
    bad = beat("c", cap=10**6)
    assert "not a count" in bad.dead_letters[0][1]
    first = [p for p, _ in r.m.plan_release(now=1.0)]
    assert len(first) == 2 + 2  # capacity + the configured cap of one producer: heartbeats add nothing
    r.do(r.m.on_released([(p, {"epoch": 0, "cursor": p.group_index + 1, "next_group_index": p.group_index + 1})
                          for p in first]))  # fmt: skip
    for pid, p in zip(("a", "b"), first, strict=False):
        beat(pid, now=1.0)
        rg = r.group(p)
        rg.producer_id = pid
        r.put(rg, seq=p.group_index + 1)
    assert r.m.release_state(now=2.0).inflight_cap == 2 + 2  # a and b answered: their caps count
    assert r.m.release_state(now=100.0).inflight_cap == 2  # both gone quiet: the configured cap
    r.check_fold()


def test_a_restart_takes_the_folded_state_and_puts_the_stored_groups_back():
    r = Run()
    r.get(0)
    prompts, _ = r.release()
    for i, p in enumerate(prompts[:3]):
        r.put(r.group(p), seq=i + 1)
    r.do(r.m.on_handed(0, r.group(prompts[0]).samples, version=0))
    again = Run()
    stored = [r.group(p) for p in prompts[1:3]]
    groups = again.m.on_restart(fold(r.ledger), stored)
    assert [g[0].group_index for g in groups] == [1, 2]
    msg, out = again.get(0)  # the lease continues where it was
    assert out.waiting and len(again.m.state.leases[0].refs) == 1
    again.ledger = list(r.ledger)
    out = again.do(again.m.on_handed(0, stored[0].samples, version=0))
    assert out.replies[0][0] is msg and [e.seq for e in out.events] == [r.m.state.seq + 1, r.m.state.seq + 2]
    again.check_fold()


def test_a_group_never_makes_the_buffer_release_prompts():
    """A release is recorded before its prompts are published, so a group for any prompt the
    ledger does not hold (the next one, or one 255 ahead) is rejected, and releases nothing."""
    r = Run(rows=512)
    r.get(0)
    planned = r.m.plan_release(now=0.0)
    head = max(p.group_index for p, _ in planned)
    for ahead in (head, head + 1, head + 255):  # planned but unrecorded, and beyond
        ghost = r.group(r.m.source.next_release(0, ahead, ahead, [])[0])
        out = r.do(r.m.on_group(object(), 1, ghost, None, b""))
        assert out.settle == "term" and "never released" in out.dead_letters[0][1]
    assert r.m.state.next_group_index == 0 and not r.m.state.outstanding
    r.do(r.m.on_released(planned))  # the recorded release: now its groups are taken
    assert r.put(r.group(planned[0][0]), seq=2) == "ack" and r.m.state.counters["stored"] == 1
    assert r.m.plan_release(now=0.0) == []  # nothing more: capacity and cap are taken
    r.check_fold()


def test_a_custom_buffers_hand_backs_follow_the_unused_samples_handler():
    """As in Miles, the handler a custom buffer is given is the one --async-unused-samples-handler
    selects: under `drop` (the default) what it hands back is dropped, never retried."""
    r = Run(observed=False)
    r.get(0)
    prompts, _ = r.release()
    r.do(r.m.on_group(object(), 1, r.group(prompts[0]), None, b""))
    r.m.on_recycled(r.group(prompts[0]).samples)  # aborted during its put
    r.do(r.m.on_put_returned())
    r.put(r.group(prompts[1]), seq=2, decision=None)
    r.m.on_recycled(r.group(prompts[1]).samples)  # stored, then handed back as stale
    r.do(r.m.on_put_returned())
    c = r.m.state.counters
    assert c["aborted_dropped"] == 1 and c["stale_dropped"] == 1 and r.m.state.recycled == []
    r.check_fold()


def test_nothing_is_released_beyond_what_the_run_can_train():
    """--num-rollout x B groups accounted (trained, leased, stored or in flight): no more
    releases, in any mode; a group dropped as stale is replaced."""
    r = Run(num_rollout=2, max_weight_staleness=0)  # 2 steps x B=2: 4 groups in all
    r.get(0)
    r.m.on_heartbeat(object(), Heartbeat(instance_id="p", service="rollout", info={"inflight_groups": 2}), 0.0)
    prompts, _ = r.release()
    assert len(prompts) == 4  # capacity 2 + cap 2 would allow 4 anyway
    for i, p in enumerate(prompts):
        r.put(r.group(p), seq=i + 1)
    for p in prompts[:2]:
        r.do(r.m.on_handed(0, r.group(p).samples, version=0))
    r.do(r.m.on_commit(object(), BufferCommit(step=0)))
    assert r.m.plan_release(now=0.0) == []  # 2 trained + 2 stored: the run needs nothing more
    r.m.on_decision("stale", r.group(prompts[2]).samples, None)
    r.do(r.m.on_put_returned())
    (again, _), = r.m.plan_release(now=0.0)  # fmt: skip
    assert again.group_index == 4  # one replacement for the dropped group, no more


def pick_last(config, rollout_id, buffer, num_samples):
    """A --buffer-filter-path: the newest recycled groups first."""
    return buffer[-num_samples:]


def test_the_buffer_filter_picks_which_recycled_prompt_goes_next():
    r = Run(async_unused_samples_handler="retry", buffer_filter_path=f"{__name__}.pick_last")
    r.get(0)
    prompts, _ = r.release()
    for seq, p in enumerate(prompts[:2], 1):
        r.put(r.group(p, status=SampleStatus.ABORTED), seq=seq, decision="aborted")
    assert [p.group_index for p in r.m.state.recycled] == [prompts[0].group_index, prompts[1].group_index]
    again, _ = r.release()
    assert [(p.group_index, p.attempt) for p in again] == [(prompts[1].group_index, 1), (prompts[0].group_index, 1)]
    r.check_fold()  # a re-release that is not the queue's head folds too


def test_a_partition_that_fails_to_build_is_tried_again_less_and_less_often():
    """Multi-LoRA: a registration whose partition fails for an unforeseen reason is not retried
    at every registry read (twice a second, a warning each) but after 1, 2, 4 ... s, at most 15 s
    apart; a success resets it."""
    from services.buffer.adapters import Backoff

    b = Backoff(0.5, 15.0)
    assert b.due("r", 0.0)
    assert b.failed("r", 0.0) == (1, 1.0)
    assert not b.due("r", 0.9) and b.due("r", 1.0) and b.due("other", 0.0)
    assert b.failed("r", 1.0) == (2, 2.0) and not b.due("r", 2.9)
    for _ in range(10):
        failures, delay = b.failed("r", 0.0)
    assert (failures, delay) == (12, 15.0)
    b.ok("r")
    assert b.due("r", 0.0) and b.failed("r", 0.0) == (1, 1.0)


def test_fully_async_admission_keeps_generation_within_the_staleness_budget():
    """With --max-weight-staleness S, prompts go out only while the groups released stay below
    (live version + S + 2) x B: a group generated on the live version v is leased for a step
    whose gets carry at most v + S. Without it, capacity and in-flight caps alone decide."""
    free = Run(async_data_buffer_capacity_factor=4.0)  # B = 2: capacity 8, in flight 2
    free.get(0, wait_s=0)
    free.m.on_version(object(), 0)
    assert len(free.m.plan_release(now=0.0)) == 10
    r = Run(async_data_buffer_capacity_factor=4.0, max_weight_staleness=1)
    r.get(0, wait_s=0)
    assert not r.m.on_version(object(), 0).dead_letters
    prompts, _ = r.release()
    assert len(prompts) == (0 + 1 + 2) * 2  # the budget, not the 10 the buffer has room for
    assert r.m.plan_release(now=0.0) == []  # generation waits: it is ahead of the budget
    r.published = 1
    r.m.on_version(object(), 1)  # the engines move on: two more groups may start
    more, _ = r.release()
    assert len(more) == 2
    r.check_fold()


def test_a_run_without_step_progress_is_diagnosed_and_unworked_prompts_go_back_early():
    """No step progress for --stall-report-s while the trainer waits: the cause is named (in the
    log and /status), and released prompts that no live producer names in work go back then,
    not at the 900 s prompt deadline, once a producer has room to take them (one queued behind
    producers at their caps is left alone)."""
    import time

    r = Run(stall_report_s=60.0)
    t = time.time()
    assert r.m.stall(t + 1000) is None  # the trainer asked for nothing: no one waits
    r.get(0)
    assert r.m.stall(t + 10) is None  # not yet
    assert "no producer is alive" in r.m.stall(t + 61)["cause"]
    r.m.on_heartbeat(object(), Heartbeat(instance_id="p", service="rollout", info={"inflight_groups": 2}), t + 61)
    prompts, _ = r.release()
    for gid in r.m.seen_at:
        r.m.seen_at[gid] = t
    r.m.on_heartbeat(object(), Heartbeat(instance_id="p", service="rollout",
                                         info={"inflight_groups": 2, "in_work": [prompts[0].group_index]}), t + 65)  # fmt: skip
    stall = r.m.stall(t + 65)
    assert stall["step"] == 0 and f"{len(prompts)} released prompts are unanswered" in stall["cause"]
    assert r.m.status(t + 65)["stalled"] == stall and stall["kind"] == "unanswered"
    busy = [p.group_index for p in prompts[:2]]  # the producer at its cap: the rest may only be queued
    r.m.on_heartbeat(object(), Heartbeat(instance_id="p", service="rollout",
                                         info={"inflight_groups": 2, "in_work": busy}), t + 65)  # fmt: skip
    assert not r.m.expire_unanswered(t + 65).events
    r.m.seen_at[group_id(prompts[1].group_index, 0)] = t  # it finished that one
    r.m.on_heartbeat(object(), Heartbeat(instance_id="p", service="rollout",
                                         info={"inflight_groups": 2, "in_work": busy[:1]}), t + 65)  # fmt: skip
    expired = r.do(r.m.expire_unanswered(t + 65))
    assert sorted(e.group_index for e in expired.events) == sorted(p.group_index for p in prompts[1:])  # one in work
    r.put(r.group(prompts[0]), seq=1)  # the one in work is answered and leased: progress
    r.do(r.m.on_handed(0, r.group(prompts[0]).samples, version=0))
    assert r.m.stall(r.m.progress_at + 59) is None
    r.check_fold()


def test_a_stall_is_reported_after_ten_of_the_runs_own_steps_not_only_after_the_fixed_limit():
    """Once the run has a step time (six commits), no progress for 10 x its median step (at least
    30 s, at most --stall-report-s) is a stall, with its cause."""
    from services.buffer.policy import STALL_FLOOR_S, STALL_STEPS

    r = Run(stall_report_s=300.0)
    r.get(0)
    t = r.m.progress_at
    assert r.m.step_clock.stall_after() == 300.0 and r.m.stall(t + 100) is None  # no step time yet: the fixed limit
    r.m.step_clock.commits.extend(t - 6 * 5.0 + 5.0 * i for i in range(6))  # a step every 5 s
    assert r.m.step_clock.stall_after() == STALL_STEPS * 5.0
    assert r.m.stall(t + STALL_STEPS * 5.0 - 1) is None
    assert "no producer is alive" in r.m.stall(t + STALL_STEPS * 5.0 + 1)["cause"]
    r.m.step_clock.commits.clear()
    r.m.step_clock.commits.extend(t - 6 * 0.1 + 0.1 * i for i in range(6))  # fast steps: the floor
    assert r.m.step_clock.stall_after() == STALL_FLOOR_S and r.m.stall(t + STALL_FLOOR_S - 1) is None
    r.m.step_clock.commits.clear()
    r.m.step_clock.commits.extend(t - 600 + 100.0 * i for i in range(6))  # slow steps: at most the fixed limit
    assert r.m.step_clock.stall_after() == 300.0


def test_the_expiry_warning_counts_expired_prompts_not_the_decisions_that_ride_along():
    """An Out carries whatever the DataBuffer decided since the last one: a tick that expires
    nothing while groups go stale says nothing, and a real expiry is counted with the run's total."""
    import time

    from services.buffer.partition import expiry_note

    r = Run(prompt_deadline_s=30.0)
    r.get(0)
    r.m.on_heartbeat(object(), Heartbeat(instance_id="p", service="rollout", info={"inflight_groups": 4}), time.time())
    prompts, _ = r.release()
    r.put(r.group(prompts[0]), seq=1)
    r.m.on_decision("stale", r.group(prompts[0]).samples, None)  # the DataBuffer, between two Outs
    now = max(r.m.seen_at.values())
    riding = r.do(r.m.expire_unanswered(now + 1))
    assert [ev.kind for ev in riding.events] == ["stale"]
    assert expiry_note(riding.events, before=0) is None  # the old warning said "1 ... released again"
    expired = r.do(r.m.expire_unanswered(now + 31))
    n = len(prompts) - 1  # every released prompt but the answered one
    assert n > 0 and [ev.kind for ev in expired.events] == ["expired"] * n
    note = expiry_note(expired.events, before=3)
    assert note.startswith(f"{n} released prompt(s) neither answered nor in work for 30s") and f"({n + 3} this run)" in note
    r.check_fold()


def test_a_version_nobody_published_sends_honest_work_back_not_to_the_rejected():
    """An engine named v999 through its HTTP API (a role's key on an SGLang server) stamps honest
    samples with it: the group is not trained, and its prompt goes back as a new attempt instead
    of being lost; a group with any other fault is still rejected."""
    r = Run()
    r.get(0)
    prompts, _ = r.release(k=2)
    claimed = r.do(r.m.on_group(msg := object(), 1, r.group(prompts[0], versions=(999,)), None, b""))
    assert claimed.settle == "term" and claimed.dead_letters[0][0] is msg
    assert "was never published" in claimed.dead_letters[0][1] and "goes back" in claimed.dead_letters[0][1]
    assert [(e.outcome, e.recycled) for e in claimed.events] == [("aborted", True)]
    assert [p.group_index for p in r.m.state.recycled] == [prompts[0].group_index]  # released again next
    both = r.do(r.m.on_group(object(), 2, r.group(prompts[1], versions=(999,), vocab_ok=False), None, b""))
    assert [e.outcome for e in both.events] == ["rejected"]
    r.check_fold()
