"""Prompt release: the three Miles modes as admission rules (docs/architecture.md, "Modes are
admission rules"). Pure functions of counters, unit-tested without I/O.

- sync: release the prompts of the step the trainer waits for, and only once the engines run
  the weights of the previous step (`min_version`).
- one_step: the same, one step ahead (`lookahead` 1): step r+1's batch is generated while step
  r trains.
- fully_async: keep `capacity` stored groups plus every producer's in-flight cap released; a
  full buffer leaves nothing to release, which holds the producers back. With
  --max-weight-staleness S, admission also keeps generation within that budget (AReaL's max
  head off-policyness): a prompt is released only while the groups released so far stay below
  (live version + S + 2) x B, so that a group generated on the engines' live version v is
  leased for a step whose gets carry a version at most v + S. Generation waits only when it
  runs ahead of the trainer by more than the budget, and the staleness filter then has almost
  nothing to drop.
Nothing is released before the trainer's first get (the producer starts with the first step),
and nothing beyond what the run's --num-rollout steps can train.
"""

from __future__ import annotations

import collections
import statistics
from dataclasses import dataclass

PRODUCER_TIMEOUT_S = 10.0
"""A producer is live while its heartbeats are at most this old."""
STALL_STEPS, STALL_FLOOR_S = 10, 30.0
"""A run is stalled after STALL_STEPS x its median step without progress, at least STALL_FLOOR_S."""


@dataclass
class ReleaseState:
    mode: str
    batch_size: int
    capacity: int
    inflight_cap: int
    """Sum of the in-flight caps (groups) of live producers."""
    want_step: int | None
    lookahead: int
    groups_still_needed: int
    """For sync modes: groups missing from the leases of the uncommitted steps up to
    want_step + lookahead."""
    stored: int
    outstanding: int
    """Released prompts not yet resolved by a put (in the queue, generating, or unread)."""
    live_version: int | None
    min_version: int | None
    groups_left: int | None = None
    """Groups the run still needs: --num-rollout x B less those trained, leased, stored or in
    flight (None: no limit). Nothing is released beyond it, in any mode."""
    head_room: int | None = None
    """fully_async with --max-weight-staleness: groups that may still be released before
    generation runs ahead of the staleness budget (None: no budget)."""
    over_sampling: int | None = None
    """--over-sampling-batch-size (sync modes): prompts are released in multiples of it, as
    Miles's rollout fetches them whenever fewer than B groups are done or in flight."""


class StepClock:
    """When the last steps were committed: the run's own step time, which the stall report
    scales with."""

    def __init__(self, limit_s: float):
        self.limit_s = limit_s
        self.commits: collections.deque[float] = collections.deque(maxlen=51)

    def stall_after(self) -> float:
        """Seconds without step progress that make a stall: STALL_STEPS x the run's median step
        (over its last 50 commits, at least STALL_FLOOR_S), at most `limit_s` (--stall-report-s);
        `limit_s` until the run has five step times."""
        t = list(self.commits)
        if len(t) < 6:
            return self.limit_s
        median = statistics.median(b - a for a, b in zip(t, t[1:], strict=False))
        return min(self.limit_s, max(STALL_STEPS * median, STALL_FLOOR_S))


def release_allowance(s: ReleaseState) -> int:
    if s.want_step is None:
        return 0
    if s.mode == "fully_async":
        k = s.capacity + s.inflight_cap - s.stored - s.outstanding
        if s.head_room is not None:
            k = min(k, s.head_room)
    elif s.min_version is not None and (s.live_version is None or s.live_version < s.min_version):
        return 0
    else:
        k = s.groups_still_needed - s.stored - s.outstanding
        if k > 0 and s.over_sampling:
            k = -(-k // s.over_sampling) * s.over_sampling
    return max(0, k if s.groups_left is None else min(k, s.groups_left))


def stall_cause(rs: ReleaseState, short_step: int | None, want_step: int, producers: int, unseen: int, stall_s: float,
                staleness_budget: int | None) -> tuple[str, str]:
    """Why no step makes progress while the trainer waits for step `want_step`: (kind, cause),
    from the release counters, the first step whose lease is short (None: all complete), the live
    producers, and the released prompts no live producer has named in work for `stall_s`."""
    if short_step is None:
        return "trainer", (f"every lease up to step {want_step} is complete and none was committed: the trainer is "
                           "slow or stuck (see its /status)")
    if not producers:
        return "no_producer", f"no producer is alive (none sent a heartbeat for {PRODUCER_TIMEOUT_S:.0f} s): start one"
    if rs.outstanding:
        return "unanswered", (f"{rs.outstanding} released prompts are unanswered, {unseen} of them named in work by no "
                              f"live producer for {stall_s:.0f} s (those go back now if a producer has room); "
                              f"producers alive: {producers}; see their /status and the engines'")
    if release_allowance(rs) > 0:
        return "release", "prompts may be released and none are: the buffer's release loop is behind (see its log)"
    if rs.min_version is not None and (rs.live_version is None or rs.live_version < rs.min_version):
        return "engines_behind", (f"the release waits for the engines to run version {rs.min_version} "
                                  f"(live: {rs.live_version}): see weight-sync's /status")
    if rs.head_room is not None and rs.head_room <= 0:
        return "staleness_budget", (f"generation is at its staleness budget (live version {rs.live_version}, "
                                    f"--max-weight-staleness {staleness_budget}): the engines' version must advance; "
                                    "see weight-sync's /status")
    if rs.stored >= rs.capacity:
        return "buffer_full", (f"the buffer is full ({rs.stored}/{rs.capacity} groups) and step {short_step}'s lease "
                               "is short: the DataBuffer hands out none of them")
    return "done", "the run needs no more groups, and its leases are short"
