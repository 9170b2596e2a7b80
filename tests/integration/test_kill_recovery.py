"""Zero loss, zero duplicates: a fully-async run (real processes, real broker) in which one
component is killed with SIGKILL at a random moment. The launcher restarts it, the run
finishes, and the ledger balances: every released prompt ends trained once, filtered, dropped,
or still in flight; nothing lost, nothing trained twice; the trainer's own record agrees.

The kill moment is drawn from a seeded RNG; set ASYNCRL_KILL_SEED to replay one.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from services.common.procs import pid_alive
from tests.runs import audited, finish, stopped_at_exit

STEPS, B = 24, 4
SEED = int(os.environ.get("ASYNCRL_KILL_SEED", random.SystemRandom().randrange(10**6)))


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


@pytest.mark.crash  # with the crash points: make test-crash (.ci/run runs it)
@pytest.mark.parametrize("victim", ["buffer", "trainer", "rollout-0", "nats-server"])
def test_sigkill_loses_nothing_and_trains_nothing_twice(tmp_path, victim):
    rng = random.Random(f"{SEED}-{victim}")
    kill_after_step = rng.randint(2, STEPS // 2)
    extra_delay_s = rng.uniform(0.0, 0.4)
    print(f"ASYNCRL_KILL_SEED={SEED}: killing {victim} after step {kill_after_step} + {extra_delay_s:.2f}s")
    run_dir = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "train-async", "--fully-async", "--rollout-batch-size", str(B),
         "--n-samples-per-prompt", "4", "--async-data-buffer-capacity-factor", "1", "--num-rollout", str(STEPS),
         "--save", str(run_dir / "ckpt"), "--save-interval", "4", "--prompt-ack-wait-s", "3",
         "--async-unused-samples-handler", "retry", "--max-weight-staleness", "3", "--run-dir", str(run_dir)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while len(records(run_dir)) < kill_after_step:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the run did not reach the kill step"
            time.sleep(0.05)
        time.sleep(extra_delay_s)  # a random moment within the step, not a synchronisation
        pid = json.loads((run_dir / "pids.json").read_text())[victim]
        os.kill(pid, signal.SIGKILL)
        out = finish(proc)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "restarting" in out, out[-2000:]
    assert not pid_alive(pid)
    steps = [r["step"] for r in records(run_dir)]
    assert steps == list(range(STEPS)), "every step trained exactly once in the final record"
    trained = [json.loads(x) for x in (run_dir / "trained.jsonl").read_text().splitlines()]
    assert sorted(t["step"] for t in trained) == list(range(STEPS))
    report = audited(run_dir, STEPS * B)
    accounted = (report["trained"] + sum(report["filtered"].values()) + report["aborted_dropped"]
                 + report["stale_dropped"] + sum(report["in_flight_at_end"].values()) - report["in_flight_at_end"].get("recycled_waiting", 0))  # fmt: skip
    assert accounted == report["released_prompts"]


def _reaped_or_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.crash
def test_a_trainer_restarted_without_its_disk_resumes_from_the_object_store(tmp_path):
    """object-store weights: the trainer is SIGKILLed and its weight snapshots deleted before the
    launcher restarts it (the launcher frozen meanwhile, so the restart cannot come first), as if
    it came back on another host. It fetches the snapshot it resumes from out of the run's
    bucket, and the run finishes balanced."""
    run_dir = tmp_path / "run"
    steps = 10
    proc = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "train-async", "--fully-async", "--rollout-batch-size", str(B),
         "--n-samples-per-prompt", "4", "--async-data-buffer-capacity-factor", "1", "--num-rollout", str(steps),
         "--update-weight-transfer-mode", "object-store", "--prompt-ack-wait-s", "3", "--run-dir", str(run_dir)],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    with stopped_at_exit(proc):
        deadline = time.monotonic() + 180
        while len(records(run_dir)) < 4:
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the run did not reach step 4"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGSTOP)
        try:
            trainer = json.loads((run_dir / "pids.json").read_text())["trainer"]
            os.kill(trainer, signal.SIGKILL)
            deadline = time.monotonic() + 20
            while not _reaped_or_zombie(trainer):
                assert time.monotonic() < deadline, "the trainer did not die"
                time.sleep(0.01)
            shutil.rmtree(run_dir / "weights")
        finally:
            os.kill(proc.pid, signal.SIGCONT)
        finish(proc)
    log = (run_dir / "logs" / "trainer.log").read_text()
    assert "from the object store into" in log, log[-3000:]
    audited(run_dir, steps * B)
