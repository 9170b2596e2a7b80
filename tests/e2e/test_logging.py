"""Custom log functions and the TensorBoard / W&B sinks, through a whole CLI run (docs/services.md, "Metrics and
sinks")."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest

from tests.e2e.test_cli_run import SMALL, records

LOGGERS = """
import json, os

def rollout(rollout_id, config, samples, extra_metrics, rollout_time):
    with open(os.environ["LOG_CALLS"], "a") as f:
        f.write(json.dumps({"fn": "rollout", "id": rollout_id, "n": len(samples), "run": config.run_id,
                            "extra": sorted(extra_metrics), "time": rollout_time}) + "\\n")
    return rollout_id == 1  # step 1's rollout metrics are ours alone

def evaluation(rollout_id, config, data, extra_metrics):
    with open(os.environ["LOG_CALLS"], "a") as f:
        f.write(json.dumps({"fn": "eval", "id": rollout_id, "sets": {k: len(v["rewards"]) for k, v in data.items()},
                            "truncated": all(len(v["truncated"]) == len(v["samples"]) for v in data.values()),
                            "extra": extra_metrics}) + "\\n")
    return False
"""


def scalars_of(event_dir):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(event_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def wandb_records(path) -> list:
    """The records of an offline W&B run file (a LevelDB-style log of protobuf records: 32 KiB
    blocks, each record chunk behind a 7-byte header crc32 / length / type)."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, chunks, out = path.read_bytes(), 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if 32768 - pos % 32768 < 7:  # a block's tail too short for a header is padding
            pos += 32768 - pos % 32768
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if (length, kind) == (0, 0):
            break
        chunks += data[pos + 7 : pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            rec = pb.Record()
            rec.ParseFromString(chunks)
            out.append(rec)
            chunks = b""
    return out


def wandb_history(run_dir) -> tuple[list[dict], list]:
    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    recs = wandb_records(path)
    rows = [{i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item}
            for r in recs if r.WhichOneof("record_type") == "history"]  # fmt: skip
    return rows, [r.run for r in recs if r.WhichOneof("record_type") == "run"]


def test_custom_log_functions_tensorboard_and_wandb_offline(tmp_path):
    pytest.importorskip("tensorboard")
    pytest.importorskip("wandb")
    (tmp_path / "myloggers.py").write_text(LOGGERS)
    calls = tmp_path / "calls.jsonl"
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "LOG_CALLS": str(calls)}
    env.pop("TENSORBOARD_DIR", None)
    env.pop("WANDB_MODE", None)
    env["WANDB_API_KEY"] = "x" * 40  # never used offline; and never printed
    run_dir = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-m", "services.cli", "train-async", "--fully-async", *SMALL, "--num-rollout", "3",
         "--eval-interval", "2", "--use-tensorboard", "--tb-project-name", "proj", "--use-wandb", "--wandb-mode",
         "offline", "--wandb-project", "myproject", "--wandb-group", "mygroup",
         "--custom-rollout-log-function-path", "myloggers.rollout",
         "--custom-eval-rollout-log-function-path", "myloggers.evaluation", "--num-steps-per-rollout", "2",
         "--run-dir", str(run_dir)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    seen = [json.loads(line) for line in calls.read_text().splitlines()]
    rollout_calls = [c for c in seen if c["fn"] == "rollout"]
    assert [c["id"] for c in rollout_calls] == [0, 1, 2] and all(c["n"] == 16 for c in rollout_calls)
    assert all("rollout/fully_async/queue_size" in c["extra"] and c["time"] >= 0 for c in rollout_calls)
    eval_calls = [c for c in seen if c["fn"] == "eval"]
    assert [c["id"] for c in eval_calls] == [0, 1, 2]  # the baseline, after step 1, the forced last point
    assert all(c["sets"] == {"reverse-digits": c["sets"]["reverse-digits"]} and c["truncated"] for c in eval_calls)
    recs = records(run_dir)
    assert [x["rollout/step"] for x in recs] == [0, 1, 2]
    # True skipped the default rollout metrics of step 1 only; train/* are always recorded
    assert ["rollout/reward/mean" in x for x in recs] == [True, False, True]
    assert all("train/loss" in x and "perf/train_time_s" in x for x in recs)
    assert all(x["train/num_optimizer_steps"] == 2 for x in recs)  # --num-steps-per-rollout 2
    assert "perf/rollout_time" in recs[0] and "rollout/weight_version/median" in recs[0]
    # TensorBoard: every series on its own axis, under the run directory
    tb = scalars_of(run_dir / "tensorboard" / "proj")
    assert [s for s, _ in tb["rollout/reward/mean"]] == [0, 2] and [s for s, _ in tb["train/loss"]] == [0, 1, 2]
    assert [s for s, _ in tb["eval/reverse-digits"]] == [0, 1, 2]  # on eval/step, the rollout id at dispatch
    assert "rollout/step" not in tb and "eval/step" not in tb
    # W&B, offline: nothing leaves the machine; the same series on the same axes, in the run directory
    rows, runs = wandb_history(run_dir)
    assert [(x.project, x.run_group) for x in runs][:1] == [("myproject", "mygroup")]
    assert [x["rollout/step"] for x in rows if "rollout/reward/mean" in x] == [0, 2]
    assert [x["rollout/step"] for x in rows if "train/loss" in x] == [0, 1, 2]
    assert [x["eval/step"] for x in rows if "eval/reverse-digits" in x] == [0, 1, 2]
    logs = r.stdout + r.stderr + "".join(p.read_text(errors="replace") for p in (run_dir / "logs").glob("*.log"))
    assert "x" * 40 not in logs
