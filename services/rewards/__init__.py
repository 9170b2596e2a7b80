"""Rewards: --custom-rm-path (per sample, or per group with --group-rm), else the reward hub
(hub.py: the bundled tasks' rewards and Miles's rm types, chosen per sample). A reward function
that raises, runs past its time or returns an unusable value marks the sample FAILED, never the
producer."""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

from asyncrl_proto.messages import Sample, SampleStatus
from services.common.plugins import load_object, maybe_await
from services.common.validate import reward_problem

log = logging.getLogger(__name__)


def resolve_reward(config) -> Callable:
    """The run's reward function: --custom-rm-path, else the hub with --rm-type (or the task's
    reward) for the samples whose metadata names no rm_type."""
    return reward_function(config, config.rollout.rm_type, config.rollout.custom_rm_path)


def reward_function(config, rm_type: str | None, custom_rm_path: str | None) -> Callable:
    """A reward function: `custom_rm_path` (module.function), else the hub with `rm_type` (or the
    task's reward) as the default type."""
    if custom_rm_path:
        return load_object(custom_rm_path, "--custom-rm-path")
    from services.rewards.hub import RewardHub
    from services.common.config.rm_types import TASK_RM_TYPE

    default = "env" if config.rollout.env else TASK_RM_TYPE.get(config.data.task, config.data.task)
    return RewardHub(config, rm_type or default)


def mark_failed(sample: Sample, why: str, key: str = "reward_error") -> None:
    """A sample that cannot be trained on: FAILED, no reward, the reason in its metadata."""
    sample.status = SampleStatus.FAILED
    sample.reward = None
    sample.metadata[key] = why[:1000]


async def score_sample(fn: Callable[..., Awaitable[float]], config, sample: Sample) -> bool:
    """Sets sample.reward; a reward function that raises, or returns anything but a finite
    number (or a dict of them holding --reward-key), marks the sample FAILED. Returns success."""
    try:
        reward = await maybe_await(fn(config, sample))
    except Exception as e:  # a user's reward function: contain it, record it
        mark_failed(sample, f"{type(e).__name__}: {e}")
        log.warning("reward function raised on sample %s: %s", sample.index, e)
        return False
    if (problem := reward_problem(reward, config.rollout.reward_key, config.rollout.max_abs_reward)) is not None:
        mark_failed(sample, f"the reward function returned an unusable value: {problem}")
        log.warning("reward function gave sample %s an unusable value: %s", sample.index, problem)
        return False
    sample.reward = reward
    return True


async def score_group(fn, config, group: list[Sample]) -> bool:
    try:
        rewards = await maybe_await(fn(config, group))
        if not isinstance(rewards, (list, tuple)) or len(rewards) != len(group):
            raise ValueError(f"--group-rm function returned {rewards!r:.80} for {len(group)} samples, not a list of "
                             "one reward each")  # fmt: skip
    except Exception as e:
        for s in group:
            mark_failed(s, f"{type(e).__name__}: {e}")
        log.warning("group reward function raised on group %s: %s", group[0].group_index, e)
        return False
    ok = True
    for s, r in zip(group, rewards, strict=True):
        if (problem := reward_problem(r, config.rollout.reward_key, config.rollout.max_abs_reward)) is not None:
            mark_failed(s, f"the group reward function returned an unusable value: {problem}")
            ok = False
        else:
            s.reward = r
    return ok
