"""The diagnosis on real runs, each forced into one bound (docs/dashboard.md's rules): the default
job with one group in flight is generation-bound, and with a trainer slowed by one-sample
micro-batches trainer-bound; the long-tail job with a staleness bound of 1 drops the groups of its
long answers, which span more versions than that (the default job's admission control keeps
generation within the bound, so it drops next to nothing). `asyncrl status` must name the forced
bound."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "deploy" / "configs"
FORCED = {
    "generation": ["--config", str(CONFIGS / "quickstart.yaml"), "--async-max-concurrent-samples", "8"],
    "trainer": ["--config", str(CONFIGS / "quickstart.yaml"), "--max-tokens-per-gpu", "16"],
    "staleness": ["--config", str(CONFIGS / "longtail.yaml"), "--max-weight-staleness", "1"],
}


@pytest.mark.tasks
@pytest.mark.parametrize("bound", sorted(FORCED))
def test_status_names_the_bound_a_run_was_forced_into(tmp_path, monkeypatch, bound):
    monkeypatch.delenv("ASYNCRL_HF_CHECKPOINT")
    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "services.cli", "train-async",
                        "--num-rollout", "60", "--eval-interval", "1000", *FORCED[bound], "--run-dir", str(run_dir)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=400)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    status = subprocess.run([sys.executable, "-m", "services.cli", "status", str(run_dir)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    line = next(x for x in status.stdout.splitlines() if x.startswith("diagnosis: "))
    expected = {"generation": "generation-bound", "trainer": "trainer-bound", "staleness": "staleness drops"}[bound]
    assert line.startswith(f"diagnosis: {expected}"), line
