"""Submission credits (docs/services.md, "Producers and engines") and response parsing."""

from __future__ import annotations

import pytest

from services.api import Sample, SampleStatus
from services.common.responses import apply_response
from services.rollout.core import Credits


def test_sample_granularity_frees_a_slot_per_trajectory():
    c = Credits(cap_groups=2, n=4, granularity="sample")
    c.take_group()
    c.take_group()
    assert c.free_groups == 0
    for _ in range(3):
        c.trajectory_done()
    assert c.free_groups == 0
    c.trajectory_done()  # 4 trajectories finished, from any groups: a new group may go out
    assert c.free_groups == 1
    c.group_done(given_back_already=4)
    assert c.free == 4


def test_group_granularity_holds_the_slot_until_the_group_is_done():
    c = Credits(cap_groups=1, n=2, granularity="group")
    c.take_group()
    assert c.trajectory_done() == 0 and c.trajectory_done() == 0 and c.free_groups == 0
    c.group_done(0)
    assert c.free_groups == 1


def test_credits_are_conserved_on_failure():
    c = Credits(cap_groups=1, n=3, granularity="sample")
    c.take_group()
    c.trajectory_done()  # one finished, then its siblings failed / were cancelled
    c.group_done(given_back_already=1)
    assert c.free == c.total
    with pytest.raises(AssertionError):
        c.group_done(0)  # returning twice is a bug


@pytest.mark.parametrize("granularity", ["sample", "group"])
def test_a_smaller_group_gives_its_spare_credits_back_at_once(granularity):
    """A multi-LoRA adapter's group of 2 under a run's unit of 4: 2 credits come back when its
    prompt is read, the rest as usual; the total is conserved either way."""
    c = Credits(cap_groups=1, n=4, granularity=granularity)
    c.take_group()
    c.give_back(2)
    given = 2
    assert c.free == 2 and c.free_groups == 0
    given += c.trajectory_done() + c.trajectory_done()
    c.group_done(given_back_already=given)
    assert c.free == c.total
    with pytest.raises(ValueError):
        c.give_back(5)


def test_apply_response_reads_sglang_shapes():
    s = Sample()
    resp = {
        "text": "21",
        "output_ids": [6, 5, 2],
        "meta_info": {
            "finish_reason": {"type": "stop", "matched": 2},
            "weight_version": "7",
            "weight_versions": [
                {"version": 6, "start": 0, "end": 1},
                {"version": 7, "start": 1, "end": 3},
            ],
            "output_token_logprobs": [[-0.1, 6, None], [-0.2, 5, None], [-0.3, 2, None]],
        },
    }
    apply_response(s, [1, 5, 6, 15], resp)
    assert s.tokens == [1, 5, 6, 15, 6, 5, 2] and s.response_length == 3 and s.response == "21"
    assert s.rollout_log_probs == [-0.1, -0.2, -0.3] and s.status is SampleStatus.COMPLETED
    assert s.weight_versions == [6, 7]


@pytest.mark.parametrize(("reason", "status"), [("length", SampleStatus.TRUNCATED), ("abort", SampleStatus.ABORTED)])
def test_finish_reason_mapping(reason, status):
    s = Sample()
    apply_response(
        s,
        [1],
        {
            "text": "",
            "output_ids": [],
            "meta_info": {"finish_reason": {"type": reason}, "weight_version": "default"},
        },
    )
    assert s.status is status and s.weight_versions == []  # "default" is an unknown version


async def test_a_prompt_whose_engine_lacks_the_live_adapter_comes_back_later_each_time_and_is_reported(caplog):
    """Multi-LoRA: the engine answers "no LoRA adapter" (its version replaced meanwhile, or an
    engine not reloaded yet). The prompt is naked with a delay growing with its deliveries, capped,
    counted, and warned about every ADAPTER_WARN_EVERY deliveries: never a silent 0.1 s loop."""
    from types import SimpleNamespace

    from services.rollout import adapters as rollout

    naks = []

    class Msg:
        subject = "asyncrl.run.prompts.abc123"

        def __init__(self, delivered):
            self.metadata = SimpleNamespace(num_delivered=delivered)

    me = SimpleNamespace(counters={"adapter_not_loaded_requeued": 0})
    error = RuntimeError("lora_path: no LoRA adapter 'a@v3' is loaded")
    with caplog.at_level("WARNING", logger=rollout.log.name):
        for delivered in (1, 5, rollout.ADAPTER_WARN_EVERY, 399):
            naks.append(await rollout.AdapterMode.requeue_after(me, Msg(delivered), error))
    assert naks == pytest.approx([0.1, 0.5, min(rollout.ADAPTER_RETRY_MAX_S, 0.1 * rollout.ADAPTER_WARN_EVERY),
                                  rollout.ADAPTER_RETRY_MAX_S])  # fmt: skip
    assert me.counters["adapter_not_loaded_requeued"] == 4
    assert await rollout.AdapterMode.requeue_after(me, Msg(1), RuntimeError("engine away")) is None
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 1 and "abc123" in warned[0] and "is weight-sync running" in warned[0]


def test_a_pause_over_nats_is_bounded_in_total_however_often_it_is_renewed():
    """One renewal every 30 s used to hold production at zero for as long as they kept coming."""
    from services.rollout.core import Pauses

    p = Pauses(ttl_s=60.0, max_s=300.0, valid_step=lambda step: 0 <= step <= 600 and step % 50 == 0)
    assert p.pause_over_nats("eval-50", now=0.0) is None and p.paused
    for t in range(30, 300, 30):  # renewed every 30 s: it holds, but never past 300 s after it began
        assert p.pause_over_nats("eval-50", now=float(t)) is None
        assert p.lapse(now=float(t)) == [] and p.paused
    assert p.lapse(now=300.0) == ["eval-50"] and not p.paused
    assert "cannot begin again" in p.pause_over_nats("eval-50", now=301.0) and not p.paused
    # not renewed: it lapses after the TTL
    assert p.pause_over_nats("eval-100", now=400.0) is None
    assert p.lapse(now=459.0) == [] and p.lapse(now=460.0) == ["eval-100"]
    # only an eval point of the run may pause it over NATS; the admin's HTTP pause holds until resumed
    assert "not an eval point" in p.pause_over_nats("zzz", now=500.0)
    assert "not an eval point" in p.pause_over_nats("eval-601", now=500.0)
    assert "not an eval point" in p.pause_over_nats("eval-51", now=500.0)  # no eval point after 51 steps
    assert not p.paused
    p.pause_by_admin("http")
    assert p.lapse(now=10**9) == [] and p.paused
    p.resume("http")
    assert not p.paused


def test_the_eval_roles_pauses_share_one_budget_whatever_their_tokens():
    """Cycling tokens (eval-50, eval-100, ...) used to restart every bound: together the NATS pauses
    hold production at most budget_s of any window_s; past it they end and new ones are refused
    until the window has room again. The admin's HTTP pause is not counted."""
    from services.rollout.core import Pauses

    p = Pauses(ttl_s=60.0, max_s=300.0, valid_step=lambda step: step % 50 == 0, budget_s=60.0, window_s=600.0)
    assert p.pause_over_nats("eval-50", now=0.0) is None
    assert p.pause_over_nats("eval-100", now=30.0) is None  # a second token: the same budget
    assert p.lapse(now=59.0) == [] and p.spent(59.0) == 59.0
    assert sorted(p.lapse(now=60.0)) == ["eval-100", "eval-50"] and not p.paused  # the budget is spent
    refused = p.pause_over_nats("eval-150", now=61.0)
    assert "budget" in refused and not p.paused
    # the window slides: 60 s of pause fall out of it after 600 s, and a new eval point may pause again
    assert p.pause_over_nats("eval-200", now=660.0) is None and p.paused
    p.pause_by_admin("http")  # the admin's pause holds, outside the budget
    assert p.lapse(now=720.0) == ["eval-200"] and p.paused
    p.resume("http", now=721.0)
    assert not p.paused and p.spent(721.0) == 60.0


def test_only_the_runs_eval_points_name_a_pause():
    from services.common.schedule import is_eval_point

    assert [s for s in range(0, 130) if is_eval_point(s, 120, 50, None, "fully_async")] == [0, 50, 100, 120]
    assert [s for s in range(0, 130) if is_eval_point(s, 120, 50, 30, "one_step")] == [0, 30, 50, 60, 90, 100, 120]
    assert not any(is_eval_point(s, 120, None, None, "fully_async") for s in range(130))
    assert all(is_eval_point(s, 120, 50, None, "sync") for s in range(121))  # a resume's baseline: any step
