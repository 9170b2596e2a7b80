"""A math set as people have it: Parquet prompts and held-out set, `--rm-type boxed_math`
(math-verify on the last \\boxed{} answer, in the producers' grader processes), through a whole
CLI run on a character-level tiny model warm-started to answer in a box."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from services.tasks.char_model import build_char_model
from tests.e2e.test_cli_run import SMALL, records


def sums(pairs) -> list[dict]:
    return [{"problem": f"{a}+{b}=", "answer": str(a + b), "meta": {"source": "sums"}} for a, b in pairs]


@pytest.mark.tasks
def test_a_parquet_math_set_trains_with_boxed_math(tmp_path: Path):
    problems = [(a, b) for a in range(50) for b in range(10)]
    held_out, train = problems[::8], [p for i, p in enumerate(problems) if i % 8]
    pq.write_table(pa.Table.from_pylist(sums(train)), tmp_path / "train.parquet")
    pq.write_table(pa.Table.from_pylist(sums(held_out)), tmp_path / "test.parquet")
    model = tmp_path / "model"
    build_char_model(model, [(f"{a}+{b}=", f"\\boxed{{{a + b}}}") for a, b in train], warmup_sft_steps=60,
                     log=lambda *_: None)  # fmt: skip
    run_dir = tmp_path / "run"
    r = subprocess.run(
        [sys.executable, "-m", "services.cli", "train-async", *SMALL, "--num-rollout", "6",
         "--hf-checkpoint", str(model), "--prompt-data", str(tmp_path / "train.parquet"),
         "--input-key", "problem", "--label-key", "answer", "--metadata-key", "meta",
         "--eval-prompt-data", "sums", str(tmp_path / "test.parquet"), "--eval-interval", "6",
         "--rm-type", "boxed_math", "--rollout-max-response-len", "12", "--run-dir", str(run_dir)],
        cwd=tmp_path, capture_output=True, text=True, timeout=240,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    recs = records(run_dir)
    assert [x["step"] for x in recs] == list(range(6))
    means = [x["rollout/reward/mean"] for x in recs]
    # rewards are math-verify's 0/1 on the boxed answer: a warm-started model gets some right
    assert all(0.0 <= m <= 1.0 for m in means) and sum(means) > 0, means
    assert all(x["rollout/reward/max"] in (0.0, 1.0) and x["rollout/reward/min"] in (0.0, 1.0) for x in recs)
    result = json.loads((run_dir / "result.json").read_text())
    assert result["heldout_dataset"] == "sums" and result["heldout_reward_step0"] > 0
    assert result["ledger_balanced"]
