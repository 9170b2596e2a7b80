"""Crash consistency at every named point (services.common.crash.POINTS): for each, a short
default-style job (fully async, no --save) whose service SIGKILLs itself at that point; the
launcher restarts it, and the run must finish with the ledger balanced (0 lost, 0 trained twice,
0 failed), trained.jsonl equal to the ledger, every step trained once with weight versions that
never go back, no engine left paused, and the final evaluation done. A point declared later is
covered here without a change.

The points only a multi-LoRA run passes (MULTI_LORA_POINTS) crash a two-adapter job instead,
which must end with every adapter completed and its partition balanced.

Marked `crash` (make test-crash; .ci/run runs it). All points share one prepared model.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from services.common.crash import ENV, MULTI_LORA_POINTS, POINTS

pytestmark = pytest.mark.crash

NTH = {"decided_before_append": 30, "appended_before_ack": 10, "snapshot_write": 1, "generated_before_publish": 5,
       "published_before_ack": 5, "mid_step": 60, "mid_point": 2}  # fmt: skip
"""Which pass of the point crashes (default 3): late enough to be mid-run."""
STEPS = {"snapshot_write": 45}
"""Steps of the run (default 10): the buffer snapshots every 500 ledger events."""
BOUNDED = ["--max-weight-staleness", "1"]
EXTRA = {"weights_stored": ["--update-weight-transfer-mode", "object-store"],
         "mid_broadcast": ["--update-weight-transfer-mode", "distributed", *BOUNDED],
         "transfer_paused": ["--update-weight-transfer-mode", "distributed", *BOUNDED]}  # fmt: skip
"""Flags a point needs to be on the run's path (weights_stored: object-store weights; the
broadcast points: distributed weights). Weight-sync sends only the newest version, so on a busy
machine a 10-step run may take fewer than 3 transfers; under a staleness bound of 1 the engines'
version must pass 1, 4 and 7 for steps 3, 6 and 9 to be released: 3 transfers at least."""
CASES = [(service, point) for service, points in POINTS.items() for point in points]


def crashed_run(tmp_path, at: str, args: list[str]) -> None:
    """`asyncrl train-async ARGS` with the crash point `at` (service:point:nth) armed: it must
    reach the point, have the service restarted, and finish with exit code 0."""
    r = subprocess.run([sys.executable, "-m", "services.cli", "train-async", *args], cwd=tmp_path,
                       env={**os.environ, ENV: at}, capture_output=True, text=True, timeout=400)  # fmt: skip
    out = r.stdout + r.stderr
    assert r.returncode == 0, out[-4000:]
    run_dir = Path(args[args.index("--run-dir") + 1])
    logs = "\n".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("*.log"))
    assert f"crash point {at} reached" in logs, "the point was never reached"
    assert "restarting" in out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from services.tasks import reverse_digits

    d = tmp_path_factory.mktemp("crash") / "model"
    reverse_digits.build_model(d, seed=1234, warmup_sft_steps=20, log=lambda *_: None)
    return d


@pytest.mark.parametrize(("service", "point"), CASES, ids=[f"{s}:{p}" for s, p in CASES])
def test_a_crash_at_every_point_loses_nothing(tmp_path, model_dir, service, point):
    steps, nth = STEPS.get(point, 10), NTH.get(point, 3)
    run_dir = tmp_path / "run"
    crashed_run(tmp_path, f"{service}:{point}:{nth}",
                ["--fully-async", "--rollout-batch-size", "4", "--n-samples-per-prompt", "4",
                 "--async-data-buffer-capacity-factor", "1", "--num-rollout", str(steps), "--eval-interval", "5",
                 "--prompt-ack-wait-s", "3", "--hf-checkpoint", str(model_dir), "--run-dir", str(run_dir),
                 *EXTRA.get(point, [])])  # fmt: skip
    audit = json.loads((run_dir / "audit.json").read_text())
    assert audit["balanced"], audit["problems"]
    assert audit["lost"] == 0 and audit["trained_twice"] == 0 and audit["failed"] == 0
    assert audit["trained"] == steps * 4 and audit["in_flight_at_end"].get("leased_uncommitted", 0) == 0
    trained = [json.loads(x) for x in (run_dir / "trained.jsonl").read_text().splitlines()]
    assert [t["step"] for t in trained] == list(range(steps))  # trained.jsonl is the ledger's, step by step
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in records] == list(range(steps))
    versions = [x["weight_version"] for x in records]
    assert versions == sorted(versions) and len(set(versions)) == steps  # a push per step, never back
    result = json.loads((run_dir / "result.json").read_text())
    assert result["heldout_reward_final"] is not None  # the final evaluation ran
    assert result["engines_paused_at_end"] == []


ML_NTH = {"adapter_saved_before_complete": 1}
"""Which pass of a multi-LoRA point crashes (default 3: mid-run; the final save happens once per adapter)."""
ML_CASES = [(service, point) for service, points in MULTI_LORA_POINTS.items() for point in points]
ML_STEPS = 4


@pytest.mark.parametrize(("service", "point"), ML_CASES, ids=[f"{s}:{p}" for s, p in ML_CASES])
def test_a_crash_at_every_multi_lora_point_loses_nothing(tmp_path, model_dir, service, point):
    """Two adapters (different tasks) trained at once, a service SIGKILLed at the point: the
    launcher restarts it, and each adapter still completes its budget, every step trained and
    recorded once on its own axis, its final save written, its partition's ledger balanced."""
    from services.tasks import copy_digits, reverse_digits
    from tests.e2e.test_multi_lora_run import SMALL, adapter_yaml

    nth = ML_NTH.get(point, 3)
    run_dir = tmp_path / "run"
    names = {"rev": reverse_digits, "copy": copy_digits}
    adapters = [x for name, task in names.items()
                for x in ("--multi-lora-adapter", name, str(adapter_yaml(tmp_path, name, task, ML_STEPS)))]  # fmt: skip
    crashed_run(tmp_path, f"{service}:{point}:{nth}",
                [*SMALL, "--multi-lora-n-adapters", "2", *adapters, "--prompt-ack-wait-s", "3",
                 "--hf-checkpoint", str(model_dir), "--run-dir", str(run_dir)])  # fmt: skip
    records = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    audit = json.loads((run_dir / "audit.json").read_text())
    assert audit["balanced"], audit["problems"]
    assert sorted(k.split("@")[0] for k in audit["adapters"]) == sorted(names)
    for part in audit["adapters"].values():
        assert part["balanced"] and part["state"] == "completed", part
        assert part["lost"] == 0 and part["trained_twice"] == 0 and part["failed"] == 0
        assert part["trained"] == ML_STEPS * 4  # its steps x --rollout-batch-size groups, each once
    axis = [x["step"] for x in records]
    assert axis == sorted(set(axis)), axis  # the records' own axis never repeats a step, across the restart
    for name in names:
        steps = [x[f"{name}/step"] for x in records if x.get("adapter") == name]
        assert steps == list(range(ML_STEPS)), (name, steps)  # every step recorded once, in order
        assert (tmp_path / f"save_{name}" / f"step_{ML_STEPS}" / "adapter_config.json").exists()
