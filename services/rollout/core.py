"""Pure parts of the producer: submission credits.

Submission credits (docs/services.md, "Producers and engines"): the in-flight cap is
`cap_groups * n` sample credits. A whole group is submitted only when n credits are free. With
`sample` granularity a credit returns as each trajectory finishes, so a new group goes out once
n trajectories have finished from any groups; with `group` granularity the n credits return
together when the group, reward included, is done. Every path (finish, failure, cancellation)
returns exactly the credits taken.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import re
import time
from collections.abc import Callable


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
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._changed.wait()
        self._changed.clear()


EVAL_PAUSE = re.compile(r"eval-(\d{1,12})")
"""The tokens a pause of submission sent over NATS may carry: an eval point's (its step)."""


class Pauses:
    """Who holds submission paused, and until when. A pause sent over NATS (the eval role) lapses
    `ttl_s` after it was last renewed, and ends at most `max_s` after it first began however often
    it is renewed; a token that has ended cannot pause again, and only `eval-<step>` tokens for
    an eval point of the run (`valid_step`) are taken. Together, the NATS pauses hold production for
    at most `budget_s` of any `window_s` (the role's budget, whatever its tokens): past it they end
    and new ones are refused until the window has room. So one role's messages hold production for
    a bounded time, not for as long as they keep coming. A pause through the admin's HTTP route
    holds until resumed."""

    def __init__(self, ttl_s: float, max_s: float, valid_step: Callable[[int], bool], budget_s: float = math.inf,
                 window_s: float = 600.0):  # fmt: skip
        self.ttl_s, self.max_s, self.valid_step = ttl_s, max_s, valid_step
        self.budget_s, self.window_s = budget_s, window_s
        self.until: dict[str, float] = {}
        self.began: dict[str, float] = {}
        self.ended: set[str] = set()
        self.held: list[list[float]] = []
        """[start, end] of each span in which a NATS pause held production (the last open: end inf)."""

    @property
    def paused(self) -> bool:
        return bool(self.until)

    def _nats_tokens(self) -> list[str]:
        return [t for t, until in self.until.items() if until != math.inf]

    def spent(self, now: float) -> float:
        """Seconds NATS pauses held production in the last window_s."""
        start = now - self.window_s
        self.held = [h for h in self.held if h[1] > start]
        return sum(min(end, now) - max(begin, start) for begin, end in self.held)

    def _track(self, now: float) -> None:
        """Open a span when a NATS pause holds and none was open; close it when none holds."""
        holding = bool(self._nats_tokens())
        open_span = bool(self.held) and self.held[-1][1] == math.inf
        if holding and not open_span:
            self.held.append([now, math.inf])
        elif open_span and not holding:
            self.held[-1][1] = now

    def pause_over_nats(self, token: str, now: float) -> str | None:
        """Pause (or renew) under `token`; the reason it is refused, or None."""
        m = EVAL_PAUSE.fullmatch(token)
        if m is None or not self.valid_step(int(m.group(1))):
            return f"a pause of submission names {token!r:.60}, not an eval point of this run (eval-<step>)"
        if token in self.ended:
            return f"the pause {token} has ended: it cannot begin again"
        if (spent := self.spent(now)) >= self.budget_s:
            self._end(self._nats_tokens(), now)
            return (f"the pause {token} is refused: pauses over NATS held production {spent:.0f}s of the last "
                    f"{self.window_s:.0f}s, their budget (--submission-pause-budget)")  # fmt: skip
        began = self.began.setdefault(token, now)
        end = began + self.max_s
        if now >= end:
            self.resume(token, now)
            return f"the pause {token} began {now - began:.0f}s ago: it is held for at most {self.max_s:.0f}s"
        self.until[token] = min(now + self.ttl_s, end)
        self._track(now)
        return None

    def _end(self, tokens: list[str], now: float) -> list[str]:
        for t in tokens:
            self.resume(t, now)
        return tokens

    def pause_by_admin(self, token: str) -> None:
        self.until[token] = math.inf

    def resume(self, token: str, now: float | None = None) -> None:
        if self.until.pop(token, None) is not None and token in self.began:
            self.ended.add(token)
        self._track(time.monotonic() if now is None else now)

    def lapse(self, now: float) -> list[str]:
        """End the pauses whose time is up, and every NATS pause once their budget is spent; their tokens."""
        gone = self._end([t for t, until in self.until.items() if until <= now], now)
        if self.spent(now) >= self.budget_s:
            gone += self._end(self._nats_tokens(), now)
        return gone
