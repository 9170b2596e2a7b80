"""The default job learns: held-out reward rises by at least 0.3 within 5 minutes on 2 cores.

Runs the README's job (deploy/configs/quickstart.yaml) through the CLI. Slow (about 2-3
minutes), so it is marked `slow`: `make test-all` runs it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_quickstart_job_learns_within_five_minutes(tmp_path):
    run_dir = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-m", "services.cli", "train-async", "--config", str(ROOT / "deploy/configs/quickstart.yaml"),
         "--run-dir", str(run_dir)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads((run_dir / "result.json").read_text())
    assert result["wall_s"] < 300
    assert result["heldout_reward_gain"] >= 0.3, result
