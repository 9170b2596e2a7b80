"""When a run does its periodic work, from its config alone: after which steps it saves and
evaluates (Miles's rule), so that a service other than the trainer can tell an eval point of the
run from any other step (the producers check a pause of submission against it)."""

from __future__ import annotations


def periodic_due(rollout_id: int, interval: int | None, per_epoch: int | None = None, total: int | None = None) -> bool:
    """Miles's rule for a periodic action (save, eval) after step `rollout_id` (0-based): never
    without an interval; after the last step when `total` is given; else when (r + 1) is a
    multiple of the interval or ends an epoch."""
    if interval is None:
        return False
    if total is not None and rollout_id == total - 1:
        return True
    done = rollout_id + 1
    return done % interval == 0 or (per_epoch is not None and done % per_epoch == 0)


def is_eval_point(steps_done: int, total: int, interval: int | None, per_epoch: int | None, mode: str) -> bool:
    """Whether the trainer asks for an evaluation of the weights after `steps_done` steps of a run
    of `total` (its --eval-interval, steps per epoch and mode): the baseline before the first step,
    every interval and epoch end, the last step; the synchronous driver also evaluates before the
    first step after a resume, which may be any step."""
    if interval is None or not 0 <= steps_done <= total:
        return False
    if steps_done == 0 or mode == "sync":
        return True
    return periodic_due(steps_done - 1, interval, per_epoch, total)
