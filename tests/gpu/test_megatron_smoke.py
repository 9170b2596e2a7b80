"""A few fully-async steps with the megatron-core backend on a GPU (NCCL), for a machine with
a GPU and megatron-core installed:

    pip install megatron-core
    python -m pytest -m gpu tests/gpu/test_megatron_smoke.py -q

Never part of the default suite (marker `gpu`); skipped without a GPU or megatron-core.
"""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys

import pytest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(shutil.which("nvidia-smi") is None, reason="no GPU"),
    pytest.mark.skipif(importlib.util.find_spec("megatron") is None, reason="megatron-core is not installed"),
]


def test_fully_async_steps_with_megatron(tmp_path):
    run_dir = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-m", "services.cli", "train-async", "--fully-async", "--train-backend", "megatron",
         "--num-rollout", "6", "--rollout-batch-size", "8", "--n-samples-per-prompt", "4",
         "--async-data-buffer-capacity-factor", "1", "--run-dir", str(run_dir)],
        cwd=tmp_path, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["weight_version"] for x in recs] == list(range(1, 7))
    assert json.loads((run_dir / "audit.json").read_text())["balanced"]
