"""Pure parts of the producer: submission credits.

Submission credits (SPEC.md section 4): the in-flight cap is `cap_groups * n` sample credits.
A whole group is submitted only when n credits are free. With `sample` granularity a credit
returns as each trajectory finishes, so a new group goes out once n trajectories have finished
from any groups; with `group` granularity the n credits return together when the group, reward
included, is done. Every path (finish, failure, cancellation) returns exactly the credits taken.
"""

from __future__ import annotations

import asyncio


class Credits:
    def __init__(self, cap_groups: int, n: int, granularity: str):
        if granularity not in ("sample", "group"):
            raise ValueError(f"granularity must be sample or group, not {granularity!r}")
        self.n = n
        self.total = cap_groups * n
        self.free = self.total
        self.granularity = granularity
        self._changed = asyncio.Event()

    @property
    def free_groups(self) -> int:
        return self.free // self.n

    @property
    def in_flight(self) -> int:
        return self.total - self.free

    def take_group(self) -> None:
        if self.free < self.n:
            raise RuntimeError("no room for a group: check free_groups first")
        self.free -= self.n

    def _give(self, k: int) -> None:
        self.free += k
        assert self.free <= self.total, "credits returned twice"
        self._changed.set()

    def give_back(self, k: int) -> None:
        """Credits a group will not use (a smaller group than the unit it took)."""
        if not 0 <= k <= self.n:
            raise ValueError(f"a group gives back 0..{self.n} credits, not {k}")
        self._give(k)

    def trajectory_done(self) -> int:
        """Returns the credits given back now (1 under sample granularity)."""
        if self.granularity == "sample":
            self._give(1)
            return 1
        return 0

    def group_done(self, given_back_already: int) -> None:
        """Return whatever the group still holds (all n under group granularity)."""
        self._give(self.n - given_back_already)

    async def wait_changed(self, timeout: float) -> None:
        try:
            async with asyncio.timeout(timeout):
                await self._changed.wait()
        except TimeoutError:
            pass
        self._changed.clear()
