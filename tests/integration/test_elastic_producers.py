"""Elastic producers: a producer started mid-run raises throughput within a step, with nothing
restarted; the same producer killed with SIGKILL loses nothing (its prompts are redelivered to
the other one). Real processes, real broker, the built-in engine.

Each trajectory is slowed by a plugin generate function (a simulated 0.15 s tool call) and
each producer holds one group in flight, so the producers, not the engine or the trainer, set
the pace - which is what a second producer should change."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from services.common.procs import free_port, pid_alive
from tests.conftest import run_auth, run_env

PLUGIN = """
import asyncio
from services.envs.generate import default_generate

async def slow_generate(config, sample, engine, sampling_params):
    out = await default_generate(config, sample, engine, sampling_params)
    await asyncio.sleep(0.15)  # a tool call
    return out
"""


def records(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def wait_steps(run_dir: Path, k: int, proc, timeout_s: float = 120) -> list[dict]:
    deadline = time.monotonic() + timeout_s
    while len(recs := records(run_dir)) < k:
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, f"fewer than {k} steps after {timeout_s}s"
        time.sleep(0.05)
    return recs


def step_interval(recs: list[dict], first: int, last: int) -> float:
    return (recs[last]["time"] - recs[first]["time"]) / (last - first)


def test_a_producer_joins_and_leaves(tmp_path):
    (tmp_path / "slowplugin.py").write_text(PLUGIN)
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    run_dir = tmp_path / "run"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "services.cli", "train-async", "--fully-async", "--rollout-batch-size", "4",
         "--n-samples-per-prompt", "4", "--async-max-concurrent-samples", "4", "--num-rollout", "30",
         "--async-data-buffer-capacity-factor", "1", "--prompt-ack-wait-s", "3",
         "--custom-generate-function-path", "slowplugin.slow_generate", "--run-dir", str(run_dir)],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    extra = None
    try:
        wait_steps(run_dir, 6, launcher)
        cfg = json.loads((run_dir / "config.json").read_text())
        port = free_port()
        extra = subprocess.Popen(  # joins with the run's producer identity and token, as a user would
            [sys.executable, "-m", "services.rollout", "--nats-url", cfg["nats_url"], "--run-id", cfg["run_id"],
             "--http-port", str(port), "--instance-id", "rollout-extra"],
            cwd=tmp_path, env={**run_env(run_dir), "PYTHONPATH": str(tmp_path)}, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )  # fmt: skip
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline and extra.poll() is None, "the extra producer did not start"
            time.sleep(0.05)
        joined_at = len(records(run_dir))
        before = step_interval(records(run_dir), joined_at - 4, joined_at - 1)
        recs = wait_steps(run_dir, joined_at + 5, launcher)
        after = step_interval(recs, joined_at + 1, joined_at + 4)  # from the step after the join on
        assert after < 0.75 * before, f"step interval {before:.3f}s before the join, {after:.3f}s after"
        # now kill it while it holds prompts: they must be redelivered, nothing lost
        deadline = time.monotonic() + 30
        while (
            httpx.get(f"http://127.0.0.1:{port}/status", headers=run_auth(run_dir), timeout=2).json()[
                "groups_in_flight"
            ]
            == 0
        ):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        os.kill(extra.pid, signal.SIGKILL)
        extra.wait()
        out, _ = launcher.communicate(timeout=180)
    finally:
        for p in (launcher, extra):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
    assert launcher.returncode == 0, out[-3000:]
    assert not pid_alive(extra.pid)
    assert [r["step"] for r in records(run_dir)] == list(range(30))
    audit = subprocess.run([sys.executable, "-m", "services.cli", "audit", str(run_dir), "--json"],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    report = json.loads(audit.stdout)
    assert report["balanced"] and report["lost"] == 0 and report["trained_twice"] == 0, report["problems"]
    assert report["trained"] == 30 * 4
