"""The long-tail job (deploy/configs/longtail.yaml) through the CLI: a short run records the
tail of its answer lengths (p99 against the median, held out and per step), balances its ledger,
and `asyncrl status` names the bound it ran under."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.e2e.test_cli_run import records

ROOT = Path(__file__).resolve().parents[2]
LONGTAIL = ROOT / "deploy" / "configs" / "longtail.yaml"


@pytest.mark.tasks
def test_the_longtail_job_runs_and_records_its_tail(tmp_path, monkeypatch):
    monkeypatch.delenv("ASYNCRL_HF_CHECKPOINT")  # the task's own model, with its longer context
    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "services.cli", "train-async", "--config", str(LONGTAIL),
                        "--num-rollout", "12", "--eval-interval", "12", "--run-dir", str(run_dir)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=400)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    result = json.loads((run_dir / "result.json").read_text())
    assert result["heldout_dataset"] == "reverse-longtail" and result["ledger_balanced"]
    first = json.loads((run_dir / "eval.jsonl").read_text().splitlines()[0])
    median, p99 = first["eval/reverse-longtail/response_len/median"], first["eval/reverse-longtail/response_len/p99"]
    assert p99 >= 10 * median, (median, p99)  # the tail is there at step 0
    recs = records(run_dir)
    assert all(x["rollout/response_len/median"] <= x["rollout/response_len/p99"] <= x["rollout/response_len/max"]
               for x in recs)  # fmt: skip
    status = subprocess.run([sys.executable, "-m", "services.cli", "status", str(run_dir)], cwd=tmp_path,
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert status.returncode == 0 and re.search(r"^diagnosis: \S", status.stdout, re.M), status.stdout
