"""What a producer generates a released prompt with, one object per kind of run.

A producer asks its mode four things about each prompt, and nothing else about the run's shape:
- `group_size(prompt)`: how many trajectories (and `check` refuses a prompt whose size is wrong);
- `context(msg, prompt)`: the engine handle, reward and stamping of the group; it raises
  `Requeue` (try the prompt later) or `Refuse` (settle it as a FAILED group, with the reason);
- `destination(msg, group_id)`: the subject and message id the group is published under;
- `requeue_after(msg, error)`: whether a failed generation is the mode's own transient case
  (the prompt goes back to the queue after the returned delay) rather than a failure.

`SingleModel` is every run of one model; `services.rollout.adapters.AdapterMode` is multi-LoRA.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from asyncrl_proto import PromptMsg


class PromptError(ValueError):
    """A released prompt that cannot be generated from (its group is published as FAILED)."""


class Requeue(Exception):
    """The prompt cannot be generated yet: it goes back to the queue after `delay` seconds."""

    def __init__(self, reason: str, delay: float):
        super().__init__(reason)
        self.delay = delay


class Refuse(Exception):
    """The prompt will never be generated here: its group is published as FAILED with the reason."""


@dataclasses.dataclass
class GroupContext:
    """What one group is generated with: the engine handle and the reward; `group_rm`: the reward
    scores the whole group at once (--group-rm with --custom-rm-path)."""

    engine: Any
    reward_fn: Callable
    group_rm: bool = False

    def finish(self, group: list) -> None:
        """Anything the mode stamps on a generated group before it is checked and published."""


class SingleModel:
    """A run of one model: every prompt on `prompts`, its group of --n-samples-per-prompt on `rollouts`."""

    partitioned = False

    def __init__(self, config, subjects, engine, reward_fn: Callable):
        r = config.rollout
        self.n = r.n_samples_per_prompt
        self.subjects = subjects
        self._context = GroupContext(engine, reward_fn, group_rm=bool(r.group_rm and r.custom_rm_path))

    def group_size(self, prompt: PromptMsg) -> int:
        return self.n

    def check(self, prompt: PromptMsg) -> None:
        if prompt.n_samples != self.n:
            raise PromptError(f"n_samples {prompt.n_samples} differs from --n-samples-per-prompt {self.n}")

    async def context(self, msg, prompt: PromptMsg) -> GroupContext:
        return self._context

    def destination(self, msg, gid: str) -> tuple[str, str]:
        return self.subjects.rollouts, gid

    async def requeue_after(self, msg, error: Exception) -> float | None:
        return None
