"""Tool use through whole CLI runs: the bundled calculator task (its producer reads the model's
calls, appends the calculator's results out of the loss; its eval does the same), and an OpenEnv
environment in the loop (`--env openenv:URL`)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.e2e.test_cli_run import SMALL, records

ROOT = Path(__file__).resolve().parents[2]
CALCULATOR = ROOT / "deploy" / "configs" / "calculator.yaml"


def _run(tmp_path, *args, timeout=300):
    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "services.cli", "train-async", *args, "--run-dir", str(run_dir)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=timeout)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return run_dir


def _eval_points(run_dir) -> list[dict]:
    """The held-out evaluations the run made (eval.jsonl), skipped ones left out."""
    points = [json.loads(line) for line in (run_dir / "eval.jsonl").read_text().splitlines()]
    return [p for p in points if not p.get("skipped")]


def test_the_calculator_task_runs_with_its_tool(tmp_path, monkeypatch):
    """The short version: three steps of the tool task, calls counted in training and held out."""
    monkeypatch.delenv("ASYNCRL_HF_CHECKPOINT")  # the task's own character model
    run_dir = _run(tmp_path, "--config", str(CALCULATOR), *SMALL, "--num-rollout", "3",
                   "--warmup-sft-steps", "20")  # fmt: skip
    recs = records(run_dir)
    assert [x["step"] for x in recs] == [0, 1, 2]
    assert all(0.0 <= x["rollout/tool_call_ratio"] <= 1.0 for x in recs)
    assert any(x["rollout/tool_call_ratio"] > 0 for x in recs)  # the warm start shows calls: some are made
    points = _eval_points(run_dir)
    assert points and all(0.0 <= p["eval/calculator-tool_call_ratio"] <= 1.0 for p in points)
    result = json.loads((run_dir / "result.json").read_text())
    assert result["heldout_dataset"] == "calculator" and result["ledger_balanced"]


@pytest.mark.tasks
def test_the_calculator_task_learns_to_use_its_tool(tmp_path, monkeypatch):
    """150 steps of deploy/configs/calculator.yaml: the model learns to call the calculator and to
    answer with its result (docs/learning.md has the 300-step table over 3 seeds)."""
    monkeypatch.delenv("ASYNCRL_HF_CHECKPOINT")
    run_dir = _run(tmp_path, "--config", str(CALCULATOR), "--num-rollout", "150",
                   "--seed", "1", "--rollout-seed", "1", timeout=600)  # fmt: skip
    points = _eval_points(run_dir)
    first, last = points[0], points[-1]
    assert last["eval/calculator-tool_call_ratio"] >= 0.9
    assert last["eval/calculator"] - first["eval/calculator"] >= 0.1, (first, last)


SERVE_ENV = """
import sys
import uvicorn
from openenv.core.env_server.http_server import create_fastapi_app
from tests.service.test_env_openenv import CountEnv, TextAction, TextObservation
app = create_fastapi_app(CountEnv, TextAction, TextObservation, max_concurrent_envs=128)
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
"""
"""tests/service/test_env_openenv.py's environment (each turn answered with its length; a turn with a 7
rewarded; done after 3), served in its own process."""


@pytest.mark.tasks
def test_an_openenv_environment_trains_in_the_loop(tmp_path):
    pytest.importorskip("openenv", reason="the openenv extra: pip install -e '.[openenv]'")
    import httpx

    rows = [{"prompt": f"{i % 90 + 10}", "metadata": {"env_reset": {"name": f"p{i}", "start": i}}} for i in range(64)]
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([sys.executable, "-c", SERVE_ENV, str(port)], cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while True:  # the server's own readiness answer, polled
            assert server.poll() is None and time.monotonic() < deadline, "the OpenEnv server did not come up"
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.2)
        run_dir = _run(tmp_path, *SMALL, "--num-rollout", "3", "--prompt-data", str(tmp_path / "prompts.jsonl"),
                       "--eval-prompt-data", "echo", str(tmp_path / "prompts.jsonl"),
                       "--eval-interval", "2", "--env", f"openenv:http://127.0.0.1:{port}", "--env-max-turns", "3",
                       "--rollout-max-response-len", "3")  # fmt: skip
    finally:
        server.terminate()
        server.wait(10)
    recs = records(run_dir)
    assert [x["step"] for x in recs] == [0, 1, 2]
    assert all(0.0 <= x["rollout/reward/mean"] <= 3.0 for x in recs)  # up to one per turn
    assert all(x["rollout/failed_ratio"] == 0 for x in recs)
    points = _eval_points(run_dir)
    assert points and all(0.0 <= p["eval/echo"] <= 3.0 for p in points)
    assert json.loads((run_dir / "result.json").read_text())["ledger_balanced"]
