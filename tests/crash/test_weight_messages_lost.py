"""A window in which weight-sync's messages are taken by someone else (the role probe: another
consumer with weight-sync's own identity takes every announcement off its durable consumer), in a
whole run at staleness bound 1, where engines left behind would leave the buffer nothing to
release: weight-sync converges the engines to the newest published version from WEIGHTS, the run
finishes every step and its ledger balances."""

from __future__ import annotations

import asyncio
import json
import time

import pytest

from services.common.bus import Bus, fetch_some, settle
from services.common.secrets import NatsCredentials, load_roles_file
from tests.e2e.test_cli_run import records, start_run

STEPS = 80


async def steal_weights(run_dir, seconds: float) -> int:
    """Take and acknowledge every weight announcement for `seconds`, as weight-sync's identity."""
    config = json.loads((run_dir / "config.json").read_text())
    role = load_roles_file(run_dir / "secrets" / "nats.json")["weight-sync"]
    bus = await Bus.connect(config["nats_url"], config["run_id"], "weight-sync", creds=NatsCredentials(**role))
    taken = 0
    try:
        sub = await bus.consume(bus.subjects.consumers(config["prompt_ack_wait_s"])["weight-sync"])
        end = time.monotonic() + seconds
        while time.monotonic() < end:
            for m in await fetch_some(sub, 64, 0.2):
                await settle(m)
                taken += 1
    finally:
        await bus.close()
    return taken


@pytest.mark.crash
def test_weight_messages_taken_for_a_window_never_stop_the_run(tmp_path):
    run_dir = tmp_path / "run"
    proc = start_run(tmp_path, "--num-rollout", str(STEPS), "--max-weight-staleness", "1", "--eval-interval", "1000",
                     "--run-dir", str(run_dir))  # fmt: skip
    try:
        deadline = time.monotonic() + 180
        while not ((run_dir / "metrics.jsonl").exists() and len(records(run_dir)) >= 10):
            assert proc.poll() is None and time.monotonic() < deadline, "the run did not reach step 10"
            time.sleep(0.2)
        taken = asyncio.run(steal_weights(run_dir, 8.0))
        out, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, out[-3000:]
    assert taken > 0, "the window took no announcement: it tested nothing"
    result = json.loads((run_dir / "result.json").read_text())
    assert result["steps"] == STEPS and result["final_weight_version"] == STEPS and result["ledger_balanced"], result
