"""The engine's scheduler runs all torch work on its own thread: work from other threads (weight
loads, staging, checks of received weights) is handed to it, long work one chunk per step."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from services.engine.scheduler import Request, SamplingParams, Scheduler
from services.model.hf_io import load_model, save_model, stage_weights


@pytest.fixture
def sched(tiny_model_dir):
    s = Scheduler(load_model(tiny_model_dir), max_running_requests=4, seed=0)
    s.start()
    yield s
    s.shutdown()


def test_call_runs_on_the_scheduler_thread_and_returns_or_raises(sched):
    assert sched.call(threading.current_thread) is sched._thread
    assert sched.call(lambda a, b: a + b, 2, 3) == 5

    def bad():
        raise ValueError("a bad snapshot")

    with pytest.raises(ValueError, match="a bad snapshot"):
        sched.call(bad)
    assert sched.alive  # the caller's error is the caller's: the loop goes on
    assert sched.call(lambda: "still serving") == "still serving"


def test_long_work_runs_between_steps_for_a_steps_time_while_requests_generate(sched):
    """Long work (a staged weight load, one chunk per tensor) runs between two steps for as long
    as a step took: cheap chunks all go at once however many there are (a load does not stretch
    with its tensor count), and costly ones leave generation going between them."""
    done = threading.Event()
    req = Request(rid="long", input_ids=[1, 5, 6, 7], params=SamplingParams(max_new_tokens=60, ignore_eos=True),
                  on_done=lambda r: done.set())  # fmt: skip
    seen: list[int] = []

    def chunks(n: int, cost_s: float):
        for _ in range(n):
            seen.append(len(req.output_ids))
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < cost_s:  # a chunk's own work
                pass
            yield
        return "staged"

    sched.add_request(req)
    assert sched.call_chunked(chunks, 200, 0.0) == "staged"
    assert seen[-1] - seen[0] <= 2, f"200 cheap chunks took {seen[-1] - seen[0]} steps"
    seen.clear()
    assert sched.call_chunked(chunks, 10, 0.03) == "staged"
    progress = [b - a for a, b in zip(seen, seen[1:], strict=False)]
    assert all(p <= 1 for p in progress) and sum(progress) >= 5, f"generation between costly chunks, saw {seen}"
    assert done.wait(30)


def test_a_pause_nobody_ends_is_ended_after_its_bound(sched):
    """A paused engine still answers its health checks: a pause left by a pauser that died (or
    never meant to continue) ends after pause_max_s, counted, and generation goes on."""
    sched.pause_max_s = 0.3
    sched.pause("retract")
    deadline = time.monotonic() + 10
    while sched.paused_mode is not None:
        assert time.monotonic() < deadline, "the pause was never ended"
        time.sleep(0.05)
    assert sched.stats.num_forgotten_pauses_ended_total == 1
    done = threading.Event()
    req = Request(rid="after", input_ids=[1, 5, 6], params=SamplingParams(max_new_tokens=3), on_done=lambda r: done.set())
    sched.add_request(req)
    assert done.wait(10)  # generating again


def test_staging_a_snapshot_chunk_by_chunk_matches_a_whole_read(sched, tiny_model_dir, tmp_path):
    other = load_model(tiny_model_dir)
    with torch.no_grad():
        for p in other.parameters():
            p.add_(0.5)
    save_model(other, tmp_path / "next")
    sched.weights.stage_weights(str(tmp_path / "next"), 1)
    _, staged = sched.weights._staged
    whole = stage_weights(sched.model, tmp_path / "next")
    assert staged.keys() == whole.keys()
    assert all(torch.equal(staged[n], whole[n]) for n in whole)
    res = sched.weights.update_weights_from_disk(str(tmp_path / "next"), 1)
    assert res["num_paused_requests"] == 0
    assert all(torch.equal(p, whole[n]) for n, p in sched.model.named_parameters())


def test_a_bad_snapshot_fails_its_caller_not_the_scheduler(sched, tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError):
        sched.weights.stage_weights(str(tmp_path / "empty"), 1)
    assert sched.alive


def test_work_handed_to_a_stopped_scheduler_fails_at_once(tiny_model_dir):
    s = Scheduler(load_model(tiny_model_dir), max_running_requests=2)
    s.start()
    s.shutdown()
    with pytest.raises(RuntimeError, match="not running"):
        s.call(lambda: None)


def test_work_queued_when_the_scheduler_dies_fails_instead_of_hanging(tiny_model_dir):
    s = Scheduler(load_model(tiny_model_dir), max_running_requests=2)
    started, release = threading.Event(), threading.Event()

    def boom(self):
        started.set()
        release.wait(10)
        raise RuntimeError("the loop broke")

    s._loop = boom.__get__(s)
    s.start()
    assert started.wait(10)
    result: list[BaseException] = []

    def caller():
        try:
            s.call(lambda: None)
        except RuntimeError as e:
            result.append(e)

    t = threading.Thread(target=caller)
    t.start()
    deadline = time.monotonic() + 10
    while not s._jobs and t.is_alive() and time.monotonic() < deadline:  # queued behind the dying loop
        t.join(0.01)
    assert s._jobs
    release.set()
    t.join(10)
    assert not t.is_alive() and "died" in str(result[0])
