"""Reward resolution: --custom-rm-path (per sample, or per group with --group-rm) or the task's
built-in reward. A reward function that raises marks the sample FAILED, never the producer."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Awaitable, Callable

from asyncrl_proto.messages import Sample, SampleStatus
from services.buffer.core import load_object
from services.common.config import RunConfig

log = logging.getLogger(__name__)

BUILTIN_RM = {"reverse-digits": "services.tasks.reverse_digits.reward"}


def resolve_reward(config: RunConfig) -> Callable:
    if config.custom_rm_path:
        return load_object(config.custom_rm_path, "--custom-rm-path")
    name = config.rm_type or config.task
    if name not in BUILTIN_RM:
        raise ValueError(f"--rm-type {name!r} is unknown: choose one of {sorted(BUILTIN_RM)} or set --custom-rm-path")
    return load_object(BUILTIN_RM[name], "--rm-type")


async def _maybe_await(x):
    return await x if inspect.isawaitable(x) else x


async def score_sample(fn: Callable[..., Awaitable[float]], config: RunConfig, sample: Sample) -> bool:
    """Sets sample.reward; on an exception marks the sample FAILED. Returns success."""
    try:
        sample.reward = await _maybe_await(fn(config, sample))
        return True
    except Exception as e:  # a user's reward function: contain it, record it
        sample.status = SampleStatus.FAILED
        sample.reward = 0.0
        sample.metadata["reward_error"] = f"{type(e).__name__}: {e}"
        log.warning("reward function raised on sample %s: %s", sample.index, e)
        return False


async def score_group(fn, config: RunConfig, group: list[Sample]) -> bool:
    try:
        rewards = await _maybe_await(fn(config, group))
        if len(rewards) != len(group):
            raise ValueError(f"--group-rm function returned {len(rewards)} rewards for {len(group)} samples")
        for s, r in zip(group, rewards, strict=True):
            s.reward = r
        return True
    except Exception as e:
        for s in group:
            s.status = SampleStatus.FAILED
            s.reward = 0.0
            s.metadata["reward_error"] = f"{type(e).__name__}: {e}"
        log.warning("group reward function raised on group %s: %s", group[0].group_index, e)
        return False
