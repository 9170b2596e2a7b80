"""The long-tail task (services/tasks/reverse_longtail.py): its lengths have a heavy tail, its
held-out prompts are disjoint from training, and its reward reads the whole answer."""

from __future__ import annotations

import asyncio
import json
import math

from asyncrl_proto.messages import Sample
from services.common.config.rm_types import TASK_REWARDS
from services.tasks import reverse_longtail as task


def test_the_lengths_have_a_heavy_tail_within_the_bounds():
    rows = task.make_rows(5000, seed=3)
    lengths = sorted(len(r["label"]) for r in rows)
    median, p99 = lengths[len(lengths) // 2], lengths[math.ceil(0.99 * len(lengths)) - 1]
    assert lengths[0] >= task.MIN_DIGITS and lengths[-1] <= task.MAX_DIGITS
    assert p99 >= 10 * median, (median, p99)
    assert len({r["prompt"] for r in rows}) == len(rows)
    assert all(r["prompt"] == r["label"][::-1] + "=" for r in rows)


def test_held_out_prompts_are_disjoint_from_training(tmp_path):
    train, held = task.write_datasets(tmp_path, seed=1)
    train_p = {json.loads(x)["prompt"] for x in train.read_text().splitlines()}
    held_p = [json.loads(x)["prompt"] for x in held.read_text().splitlines()]
    assert len(held_p) == task.NUM_EVAL_PROMPTS and not train_p & set(held_p)


def test_the_reward_reads_the_whole_answer():
    def score(response: str) -> float:
        return asyncio.run(task.reward(None, Sample(response=response, label="54321")))

    assert score("54321") == 1.0
    assert score("54321" + "0" * 45) == 0.1  # padding after the answer costs reward
    assert score("543") == 0.6
    assert TASK_REWARDS[task.NAME] == "services.tasks.reverse_longtail.reward"


def test_the_model_fits_the_longest_prompt_and_answer():
    assert 1 + task.MAX_DIGITS + 1 + task.MAX_RESPONSE_LEN <= task.CONTEXT
