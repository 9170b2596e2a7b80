"""The reward hub: one sample's reward by its rm type, as Miles's rm_hub routes it.

The type is the sample's `metadata["rm_type"]` when it has one (one dataset may mix tasks), else
--rm-type, else the task's own reward. names.py lists the types; graders.py grades `math`,
`dapo`, `deepscaler`, `f1`, `gpqa`, `reasoning_gym` and `ifbench` (and their `boxed_` forms) in worker processes
(--reward-num-workers, shared by every hub of the process): one that runs past
--reward-timeout-s is killed and its sample FAILED with the reason, as is one whose grader
raises or whose process dies. `remote_rm` calls --rm-url (remote.py); `random` is 0 or 1.
"""

from __future__ import annotations

import asyncio
import atexit
import concurrent.futures
import multiprocessing
import random
from typing import Any

from services.common.plugins import load_object, maybe_await
from services.rewards.graders import grade, warm_up
from services.common.config.rm_types import TASK_REWARDS, rm_type_problem, split_rm_type
from services.rewards.remote import RemoteRewardModel


class RewardTimeout(TimeoutError):
    pass


class GraderPool:
    """Worker processes for the graders (pebble: a task past its timeout kills its worker, which
    concurrent.futures cannot do). Started at the first graded sample, with the spawn method:
    a service's threads and event loop do not cross into the workers."""

    def __init__(self, workers: int):
        self.workers = workers
        self._pool = None

    def schedule(self, timeout_s: float, *args) -> concurrent.futures.Future:
        if self._pool is None:
            from pebble import ProcessPool

            self._pool = ProcessPool(max_workers=self.workers, context=multiprocessing.get_context("spawn"),
                                     initializer=warm_up)  # fmt: skip
            atexit.register(self.close)
        return self._pool.schedule(grade, args=args, timeout=timeout_s)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.stop()
            self._pool.join()
            self._pool = None


_pools: dict[int, GraderPool] = {}


class RewardHub:
    """A reward function (the --custom-rm-path signature, `await hub(config, sample)`) that routes
    each sample by its rm type; `default`: the type of samples that name none."""

    def __init__(self, config, default: str):
        r = config.rollout
        self.default = default
        self.timeout_s = r.reward_timeout_s
        self.pool = _pools.setdefault(r.reward_num_workers, GraderPool(r.reward_num_workers))
        self.remote = RemoteRewardModel(r.rm_url, r.reward_timeout_s, r.rm_max_concurrency, r.rm_retries) \
            if r.rm_url else None
        self._task_rewards: dict[str, Any] = {}

    async def __call__(self, config, sample) -> Any:
        meta = sample.metadata if isinstance(sample.metadata, dict) else {}
        name = meta.get("rm_type") or self.default
        if not isinstance(name, str) or (problem := rm_type_problem(name, self.remote is not None)) is not None:
            raise ValueError(problem if isinstance(name, str) else f"metadata.rm_type {name!r:.60} is not a name")
        boxed, base = split_rm_type(name)
        if base in TASK_REWARDS:
            fn = self._task_rewards.get(base) or self._task_rewards.setdefault(
                base, load_object(TASK_REWARDS[base], "--rm-type"))  # fmt: skip
            return await maybe_await(fn(config, sample))
        if base == "random":
            return float(random.randint(0, 1))
        if base == "remote_rm":  # the response as it is, as Miles sends it (boxed_ or not)
            return await self.remote.score(sample.prompt, sample.response, sample.label)
        future = self.pool.schedule(self.timeout_s, base, boxed, sample.response, sample.label, meta, sample.prompt)
        try:
            return await asyncio.wrap_future(future)
        except concurrent.futures.TimeoutError:
            raise RewardTimeout(f"the {name} grader ran past --reward-timeout-s {self.timeout_s:g}s and was "
                                "stopped") from None  # fmt: skip
        finally:
            future.cancel()
