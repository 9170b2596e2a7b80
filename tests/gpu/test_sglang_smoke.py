"""A few fully-async steps against real SGLang servers (and the SGLang router), for a machine
with a GPU and SGLang installed:

    pip install 'sglang[all]' sglang-router
    python -m pytest -m gpu tests/gpu -q

Never part of the default suite (marker `gpu`); skipped where there is no GPU or no SGLang. The
producer, weight-sync and eval talk to SGLang with exactly the client code CI exercises against
the built-in engine.
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
    pytest.mark.skipif(importlib.util.find_spec("sglang") is None, reason="SGLang is not installed"),
]


@pytest.mark.parametrize("router", [False, True])
def test_fully_async_steps_on_sglang(tmp_path, router):
    if router and importlib.util.find_spec("sglang_router") is None:
        pytest.skip("sglang-router is not installed")
    run_dir = tmp_path / "run"
    argv = [sys.executable, "-m", "services.cli", "train-async", "--fully-async", "--engine", "sglang",
            "--num-rollout", "6", "--rollout-batch-size", "8", "--n-samples-per-prompt", "4",
            "--async-data-buffer-capacity-factor", "1", "--pause-generation-mode", "retract",
            "--sglang-mem-fraction-static", "0.3", "--eval-interval", "3", "--run-dir", str(run_dir)]  # fmt: skip
    if router:
        argv += ["--use-sglang-router"]
    r = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, timeout=1200)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-4000:]
    recs = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["weight_version"] for x in recs] == list(range(1, 7))
    assert max(x["rollout/weight_version/max"] for x in recs) >= 2  # SGLang reported the new versions
    assert json.loads((run_dir / "audit.json").read_text())["balanced"]
