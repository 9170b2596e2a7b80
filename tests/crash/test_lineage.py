"""The dashboard's lineage view of a prompt whose producer was SIGKILLed mid-group: the prompt
expires on the ledger, goes back as a new attempt, and is trained; every fate and event the
dashboard shows is what `asyncrl audit` says, and the producer's restart sits between them.
Marked `crash` (make test-crash)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from services.common.crash import ENV
from tests.conftest import finished_dashboard, run_auth

pytestmark = pytest.mark.crash


def test_lineage_follows_a_crash_recycled_prompt_to_the_step_that_trained_it(tmp_path, tiny_model_dir):
    run_dir = tmp_path / "run"
    # the producer dies holding finished groups; the buffer's deadline (4 s) hands their prompts
    # back as new attempts long before JetStream would redeliver them (60 s)
    r = subprocess.run(
        [sys.executable, "-m", "services.cli", "train-async", "--fully-async", "--rollout-batch-size", "4",
         "--n-samples-per-prompt", "4", "--num-rollout", "12", "--prompt-deadline-s", "4", "--prompt-ack-wait-s", "60",
         "--hf-checkpoint", str(tiny_model_dir), "--run-dir", str(run_dir)],
        cwd=tmp_path, env={**os.environ, ENV: "rollout:generated_before_publish:5"}, capture_output=True, text=True,
        timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, (r.stdout + r.stderr)[-3000:]
    (restart,) = [json.loads(x) for x in (run_dir / "restarts.jsonl").read_text().splitlines()]
    assert restart["name"] == "rollout-0" and restart["why"] == "exited with code -9"
    trained = {}
    for line in (run_dir / "trained.jsonl").read_text().splitlines():
        rec = json.loads(line)
        trained[rec["step"]] = rec["groups"]

    with finished_dashboard(run_dir) as url:
        with httpx.Client(timeout=30, headers=run_auth(run_dir)) as http:
            board = http.get(url + "/api/audit").json()
            lineages = [http.get(f"{url}/api/prompt/{g}").json() for g in range(board["released_prompts"])]
            recycled = [x for x in lineages if any(e["kind"] == "expired" for e in x["events"])]
            assert recycled, "no prompt went back to the data source after the producer's death"
            pages = {x["group_index"]: http.get(f"{url}/prompt/{x['group_index']}").text for x in recycled}

    audit = json.loads(subprocess.run([sys.executable, "-m", "services.cli", "audit", str(run_dir), "--json"],
                                      capture_output=True, text=True, timeout=120).stdout)  # fmt: skip
    for k in ("released_prompts", "trained", "failed", "recycled", "lost", "trained_twice", "balanced"):
        assert board[k] == audit[k], k
    fates = [x["fate"] for x in lineages]
    assert fates.count("trained") == audit["trained"] and set(fates) == {"trained"}
    for x in recycled:
        g = x["group_index"]
        one = json.loads(subprocess.run([sys.executable, "-m", "services.cli", "audit", str(run_dir), "--json",
                                         "--prompt", str(g)], capture_output=True, text=True, timeout=120).stdout)  # fmt: skip
        assert x["fate"] == one["prompt"]["fate"] == "trained"
        assert x["events"] == one["prompt"]["events"]  # every event shown is the audit's
        kinds = [(e["kind"], e["attempt"]) for e in x["events"]]
        assert kinds[:3] == [("released", 0), ("expired", 0), ("released", 1)], kinds
        assert ("leased", 1) in kinds and g in trained[x["trained_step"]]
        assert x["restarts"] == [restart]  # the producer's death, between its release and its training
        assert "exited with code -9" in pages[g] and f"/step/{x['trained_step']}" in pages[g]
