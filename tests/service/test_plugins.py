"""Reward and generation plugins: a raising reward marks the sample FAILED (the producer goes
on), group rewards, and the bundled multi-turn generate function against a real engine, with a
weight update between the turns."""

from __future__ import annotations

import pytest

from services.api import RunConfig, Sample, SampleStatus
from services.rewards import score_group, score_sample
from services.common.sglang_client import SGLangClient
from services.model.tokenizer import Tokenizer
from services.envs.generate import EngineHandle
from services.tasks import multiturn
from services.tasks.reverse_digits import score
from tests.service.test_engine import perturbed_snapshot


async def test_a_raising_reward_marks_the_sample_failed():
    async def bad(config, sample):
        raise ZeroDivisionError("no")

    s = Sample(index=0, status=SampleStatus.COMPLETED)
    assert await score_sample(bad, RunConfig(), s) is False
    assert s.status is SampleStatus.FAILED and s.reward is None
    assert s.metadata["reward_error"] == "ZeroDivisionError: no"


@pytest.mark.parametrize("value", [float("nan"), float("inf"), "0.5", None, [1.0], {"acc": float("nan")}, True])
async def test_a_reward_that_is_not_a_finite_number_marks_the_sample_failed(value):
    s = Sample(index=0, status=SampleStatus.COMPLETED)
    assert await score_sample(lambda c, x: value, RunConfig(), s) is False
    assert s.status is SampleStatus.FAILED and s.reward is None
    assert "unusable value" in s.metadata["reward_error"]
    ok = Sample(index=1, status=SampleStatus.COMPLETED)
    assert await score_sample(lambda c, x: {"acc": 1.0}, RunConfig(reward_key="acc"), ok) and ok.reward == {"acc": 1.0}
    missing = Sample(index=2, status=SampleStatus.COMPLETED)
    assert not await score_sample(lambda c, x: {"f1": 1.0}, RunConfig(reward_key="acc"), missing)
    assert "no 'acc' entry" in missing.metadata["reward_error"]


async def test_group_reward_and_its_failures():
    group = [Sample(index=i) for i in range(3)]
    assert await score_group(lambda c, g: [0.1, 0.2, 0.3], RunConfig(), group)
    assert [s.reward for s in group] == [0.1, 0.2, 0.3]
    assert not await score_group(lambda c, g: [1.0], RunConfig(), group)  # wrong length
    assert all(s.status is SampleStatus.FAILED and "for 3 samples" in s.metadata["reward_error"] for s in group)
    group = [Sample(index=i) for i in range(3)]
    assert not await score_group(lambda c, g: [0.1, float("nan"), 0.3], RunConfig(), group)  # one NaN
    assert [s.status is SampleStatus.FAILED for s in group] == [False, True, False] and group[1].reward is None


@pytest.mark.parametrize("update_between_turns", [False, True])
async def test_multiturn_example_masks_tools_and_records_turn_versions(
    engine, tiny_model_dir, tmp_path, update_between_turns
):
    client = SGLangClient([engine.url])
    handle = EngineHandle(client, Tokenizer(tiny_model_dir))
    if update_between_turns:
        perturbed_snapshot(tiny_model_dir, tmp_path / "v1")
        inner = handle.generate
        calls = []

        async def generate_then_update(input_ids, params, **kw):
            out = await inner(input_ids, params, **kw)
            calls.append(1)
            if len(calls) == 1:  # the trainer pushed new weights while the tool ran
                await client.pause(engine.url, "retract")
                await client.update_weights_from_disk(engine.url, str(tmp_path / "v1"), "1")
                await client.continue_generation(engine.url)
            return out

        handle.generate = generate_then_update
    try:
        prompt = [1, 5, 6, 7, 15]
        s = Sample(index=0, group_index=0, prompt="123=", label="321", metadata={"_input_ids": prompt})
        s = await multiturn.generate(RunConfig(), s, handle, {"max_new_tokens": 6, "temperature": 1.0})
        t1, t2 = s.metadata["turns"]
        assert s.response == t1 + multiturn.TOOL_REPLY + t2
        assert len(s.loss_mask) == s.response_length == len(s.rollout_log_probs) == len(s.tokens) - len(prompt)
        n1 = len(s.loss_mask) - s.loss_mask[::-1].index(0) - 1  # position of the tool token
        assert s.loss_mask[n1] == 0 and sum(s.loss_mask) == s.response_length - 1
        expected = [[0], [1]] if update_between_turns else [[0], [0]]
        assert s.metadata["turn_versions"] == expected
        assert s.weight_versions == ([0, 1] if update_between_turns else [0])
        assert await multiturn.reward(RunConfig(), s) == pytest.approx(score(t2, "321"))
    finally:
        await client.close()
