"""The run's diagnosis (services/dashboard/diagnosis.py): each rule on metrics records shaped as
the trainer writes them, and the order the rules are applied in."""

from __future__ import annotations

from services.dashboard.diagnosis import STALL_FLOOR_S, WINDOW, diagnose

FULLY = {"fully_async": True, "driver": "async", "rollout_batch_size": 16, "async_data_buffer_capacity_factor": 1.0,
         "max_weight_staleness": 1}  # fmt: skip
ONE_STEP = {**FULLY, "fully_async": False}


def rows(n=60, step_s=0.2, wait_s=0.0, queue=0.0, stale=0.0, median_len=8.0, p99_len=8.0, t0=1000.0) -> list[dict]:
    return [{"step": i, "time": t0 + i * step_s, "perf/step_time_s": step_s, "perf/rollout_wait_s": wait_s,
             "rollout/fully_async/queue_size": queue, "rollout/fully_async/stale_groups_filtered": stale,
             "rollout/response_len/median": median_len, "rollout/response_len/p99": p99_len}
            for i in range(n)]  # fmt: skip


def test_too_few_steps_say_so():
    d = diagnose(rows(3), FULLY)
    assert d.kind == "starting" and "3 steps" in d.line


def test_a_trainer_that_waits_names_generation_and_the_flags_that_add_it():
    d = diagnose(rows(wait_s=0.1), FULLY)  # half of every 0.2 s step
    assert d.kind == "generation" and "waited 50%" in d.line and "--rollout-num-producers" in d.line


def test_a_long_tail_under_one_step_advises_fully_async():
    d = diagnose(rows(wait_s=0.1, median_len=6, p99_len=190), ONE_STEP)
    assert d.kind == "generation" and "long tail" in d.line and "--fully-async" in d.line and "p99 190" in d.line
    # fully async already frees a slot per answer: the advice is more generation
    assert "--rollout-num-producers" in diagnose(rows(wait_s=0.1, median_len=6, p99_len=190), FULLY).line


def test_a_full_queue_or_a_trainer_that_never_waits_is_trainer_bound():
    d = diagnose(rows(wait_s=0.02, queue=16), FULLY)  # 10% idle, but the queue sits at capacity
    assert d.kind == "trainer" and "16 of 16" in d.line and "--trainer-num-ranks" in d.line
    assert diagnose(rows(wait_s=0.0), ONE_STEP).kind == "trainer"


def test_staleness_drops_come_first_and_name_both_flags():
    d = diagnose(rows(wait_s=0.1, stale=4), FULLY)  # 4 dropped per 16 kept: 20% of the groups offered
    assert d.kind == "staleness" and "20%" in d.line
    assert "--max-weight-staleness (now 1)" in d.line and "--async-data-buffer-capacity-factor" in d.line
    assert diagnose(rows(wait_s=0.1, stale=1), FULLY).kind == "generation"  # 6%: under the threshold


def test_a_live_run_without_steps_is_stalled_and_a_finished_one_is_not():
    rs = rows(step_s=0.2)
    now = rs[-1]["time"] + STALL_FLOOR_S + 1
    d = diagnose(rs, FULLY, live=True, now=now)
    assert d.kind == "stalled" and f"after step {len(rs)}" in d.line
    assert diagnose(rs, FULLY, live=False, now=now).kind != "stalled"
    # a slow run's limit is its own median step times the factor, not the floor
    slow = rows(step_s=10.0)
    assert diagnose(slow, FULLY, live=True, now=slow[-1]["time"] + 60).kind != "stalled"
    assert diagnose(slow, FULLY, live=True, now=slow[-1]["time"] + 101).kind == "stalled"


def test_only_the_last_window_counts():
    early = rows(200, wait_s=0.15)
    late = rows(WINDOW, wait_s=0.0, t0=early[-1]["time"] + 0.2)
    assert diagnose(early + late, FULLY).kind == "trainer"


def test_the_middle_ground_is_balanced():
    d = diagnose(rows(wait_s=0.02, queue=4), FULLY)
    assert d.kind == "balanced" and "waited 10%" in d.line


def test_the_length_guard_speaks_when_answers_run_to_the_limit():
    from services.dashboard.diagnosis import length_guard

    config = {**FULLY, "rollout_max_response_len": 8}
    padded = [r | {"rollout/truncated_ratio": 0.98, "rollout/response_length/mean": 3.0 + min(i, 5)}
              for i, r in enumerate(rows())]  # fmt: skip
    line = length_guard(padded, config)
    assert line.startswith("length: 98% of the answers run to the response limit (--rollout-max-response-len 8)")
    assert "mean length 5 -> 8 tokens" in line
    ending = [r | {"rollout/truncated_ratio": 0.05, "rollout/response_length/mean": 5.0} for r in rows()]
    assert length_guard(ending, config) is None and length_guard(padded[:3], config) is None
    short = [r | {"rollout/truncated_ratio": 0.6, "rollout/response_length/mean": 7.0} for r in rows()]
    assert length_guard(short, config) is None  # that long from the start: a short limit, not padding
