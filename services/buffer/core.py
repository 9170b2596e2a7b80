"""The data buffer: `put` / `get` / `get_metrics`, exactly as `DataBuffer` below states them
(docs/architecture.md, "A group's path", steps 3 and 4).

Pure asyncio, no I/O: the buffer service feeds it groups decoded from ROLLOUTS and drains it for
the trainer. A group is a `list[Sample]` (a trajectory may itself be a list of Samples).

State machine of one group: put() -> {aborted: handed to the unused-samples handler |
filtered: dropped with a reason | stored} ; stored -> get() -> {stale: handed to the handler |
returned to the trainer}. One asyncio.Condition guards the FIFO; put() waits while `capacity`
groups are stored (backpressure), get() waits while none is.
"""

from __future__ import annotations

import asyncio
import collections
import math
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from asyncrl_proto.messages import SampleStatus, flatten_group, oldest_weight_version, scalar_reward
from services.common.config import RunConfig
from services.common.config.view import for_plugins
from services.common.plugins import load_object

Group = list[Any]
Recycle = Callable[[Group], Awaitable[None]]
M = "rollout/fully_async/"


@dataclass
class DynamicFilterOutput:
    """What a dynamic-sampling filter returns: keep the group, or drop it for `reason`."""

    keep: bool
    reason: str | None = None


def staleness(current_version: int | None, group: Group) -> int | None:
    oldest = oldest_weight_version(group)
    return None if current_version is None or oldest is None else current_version - oldest


class DataBuffer:
    """The buffer interface. A `--custom-async-data-buffer-path` class subclasses this and
    implements all three methods; it is constructed as `cls(config, recycle)`, where `recycle`
    is an async callable that gives a group's prompt back to the data source."""

    def __init__(self, config: RunConfig, recycle: Recycle):
        self.config = config
        self.recycle = recycle

    async def put(self, group: Group) -> None:
        raise NotImplementedError

    async def get(self, current_version: int | None = None, **context: Any) -> Group:
        raise NotImplementedError

    def get_metrics(self) -> dict[str, float]:
        raise NotImplementedError

    async def restore(self, groups: list[Group]) -> None:
        """Refill after a restart with the groups stored before it (by default: put them back)."""
        for group in groups:
            await self.put(group)


def make_buffer(config: RunConfig, recycle: Recycle) -> DataBuffer:
    """The default buffer, or the --custom-async-data-buffer-path class."""
    if not config.rollout.custom_async_data_buffer_path:
        return DefaultDataBuffer(config, recycle)
    cls = load_object(config.rollout.custom_async_data_buffer_path, "--custom-async-data-buffer-path")
    if not (isinstance(cls, type) and issubclass(cls, DataBuffer)):
        raise ValueError(f"--custom-async-data-buffer-path {config.rollout.custom_async_data_buffer_path} must name a "
                         "subclass of services.api.DataBuffer")  # fmt: skip
    return cls(for_plugins(config), recycle)  # a plugin: the flat config (a partition's values in multi-LoRA)


class DefaultDataBuffer(DataBuffer):
    """FIFO buffer with capacity backpressure, the dynamic-sampling filter at put, the staleness
    filter at get, and drop/retry handling of aborted and stale groups."""

    def __init__(self, config: RunConfig, recycle: Recycle):
        super().__init__(config, recycle)
        self.capacity = config.buffer_capacity
        if config.async_.data_buffer_capacity_factor <= 0 or self.capacity < 1:
            raise ValueError(
                f"buffer capacity floor({config.async_.data_buffer_capacity_factor} * "
                f"{config.rollout.batch_size}) = {self.capacity}: it must hold at least one group"
            )
        path = config.rollout.dynamic_sampling_filter_path
        self._filter = load_object(path, "--dynamic-sampling-filter-path") if path else None
        self._groups: collections.deque[Group] = collections.deque()
        self._cond = asyncio.Condition()
        self._latest_version: int | None = None
        # windowed counters, reset by get_metrics()
        self._aborted = self._stale = 0
        self._drops: collections.Counter[str] = collections.Counter()
        self._consumed_staleness: list[int] = []
        self.on_event: Callable[[str, Group, str | None], None] | None = None
        """Optional observer of every decision: (kind, group, reason) with kind one of aborted,
        filtered, stored, stale, consumed. The buffer service keeps its ledger with it."""

    def _emit(self, kind: str, group: Group, reason: str | None = None) -> None:
        if self.on_event is not None:
            self.on_event(kind, group, reason)

    def __len__(self) -> int:
        return len(self._groups)

    async def restore(self, groups: list[Group]) -> None:
        """Refill after a restart with groups that were already stored: no filter, no capacity
        wait, no events (they were decided before)."""
        self._groups.extend(groups)

    async def put(self, group: Group) -> None:
        if any(s.status == SampleStatus.ABORTED for s in flatten_group(group)):
            self._aborted += 1
            self._emit("aborted", group)
            await self._handle_unused(group)
            return
        if self._filter is not None:
            keep, reason = self._apply_filter(group)
            if not keep:
                if reason:
                    self._drops[reason] += 1
                self._emit("filtered", group, reason)
                return
        async with self._cond:
            await self._cond.wait_for(lambda: len(self._groups) < self.capacity)
            self._groups.append(group)
            self._cond.notify_all()
        self._emit("stored", group)

    def _apply_filter(self, group: Group) -> tuple[bool, str | None]:
        try:
            out = self._filter(for_plugins(self.config), group)
        except Exception as e:
            raise RuntimeError(
                f"--dynamic-sampling-filter-path {self.config.rollout.dynamic_sampling_filter_path} raised "
                f"{type(e).__name__}: {e}"
            ) from e
        if hasattr(out, "keep"):  # a DynamicFilterOutput, or alike
            return bool(out.keep), getattr(out, "reason", None)
        return bool(out), None

    async def get(self, current_version: int | None = None, **context: Any) -> Group:
        if current_version is not None and (self._latest_version is None or current_version > self._latest_version):
            self._latest_version = current_version
        while True:
            async with self._cond:
                await self._cond.wait_for(lambda: len(self._groups) > 0)
                group = self._groups.popleft()
                self._cond.notify_all()
            st = staleness(current_version, group)
            limit = self.config.async_.max_weight_staleness
            if limit is not None and st is not None and st > limit:  # stale at consumption: to the handler
                self._stale += 1
                self._emit("stale", group)
                await self._handle_unused(group)
                continue
            if st is not None:
                self._consumed_staleness.append(st)
            self._emit("consumed", group)
            return group

    async def _handle_unused(self, group: Group) -> None:
        if self.config.async_.unused_samples_handler == "retry":
            for s in flatten_group(group):
                s.reset_for_retry()
            await self.recycle(group)

    def stored_staleness(self) -> dict[str, float]:
        """The stored groups' staleness gauges (none while no group has a version)."""
        stored = [s for g in self._groups if (s := staleness(self._latest_version, g)) is not None]
        if not stored:
            return {}
        return {M + "buffer_avg_staleness": sum(stored) / len(stored), M + "buffer_max_staleness": max(stored)}

    def get_metrics(self) -> dict[str, float]:
        m: dict[str, float] = {
            M + "queue_size": len(self._groups),
            M + "aborted_groups_filtered": self._aborted,
            M + "stale_groups_filtered": self._stale,
        }
        if self._consumed_staleness:
            m[M + "avg_staleness"] = sum(self._consumed_staleness) / len(self._consumed_staleness)
            m[M + "max_staleness"] = max(self._consumed_staleness)
        m.update(self.stored_staleness())
        m.update({f"rollout/dynamic_filter/drop_{reason}": count for reason, count in self._drops.items()})
        self._aborted = self._stale = 0
        self._drops.clear()
        self._consumed_staleness = []
        return m


def check_reward_nonzero_std(config: RunConfig, group: Group) -> DynamicFilterOutput:
    """Built-in dynamic-sampling filter: keep a group iff its rewards are not all equal."""
    rewards = [scalar_reward(s, config.rollout.reward_key) for s in flatten_group(group)]
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))
    if std > 1e-8:
        return DynamicFilterOutput(keep=True)
    return DynamicFilterOutput(keep=False, reason=f"zero_std_{round(rewards[0], 1)}")
