"""Which bound a run is under, from its own metrics: one line with the flag to change.

`asyncrl status` and the dashboard show it as the run's diagnosis. A run that makes no step
progress shows why it stopped instead; a moving run shows its bound. The rules read the last
WINDOW steps of metrics.jsonl (the trainer's records) and are applied in this order
(docs/learning.md, "Which mode, and what bounds a run"):

  stalled       live, and no step for max(STALL_STEPS x the median step, STALL_FLOOR_S) seconds, at most
                --stall-report-s (the buffer's own stall limit, services/buffer/policy.py)
  staleness     the staleness filter dropped at least STALE_DROP_SHARE of the groups it was offered
  generation    the trainer waited for its batches at least IDLE_SHARE of the loop; with a long tail
                (the steps' p99 answer at least TAIL_RATIO x their median) under the synchronous or
                one-step driver, the batch waits for its longest answers
  trainer       the trainer waited less than BUSY_SHARE of the loop, or the buffer's queue averaged at
                least QUEUE_FULL_SHARE of its capacity: generation is ahead of training
  balanced      none of these

Beside it, the length guard (`length_guard`): at least TRUNCATED_SHARE of the window's answers ran
to the response limit, and the mean answer grew at least GROWTH x since the run's first steps: the
sign of a reward that pays for padding.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from services.buffer.policy import STALL_FLOOR_S, STALL_STEPS

WINDOW = 50
STALE_DROP_SHARE = 0.10
IDLE_SHARE = 0.20
BUSY_SHARE = 0.05
QUEUE_FULL_SHARE = 0.90
TAIL_RATIO = 10.0
TRUNCATED_SHARE = 0.5
GROWTH = 1.25


@dataclass(frozen=True)
class Diagnosis:
    kind: str
    """stalled, staleness, generation, trainer, balanced, or starting (too few steps to tell)."""
    line: str


def _stalled(rows: list[dict], live: bool, now: float, limit_s: float) -> Diagnosis | None:
    if not live or len(rows) < 2:
        return None
    steps = [b["time"] - a["time"] for a, b in zip(rows, rows[1:], strict=False)]
    limit = min(max(STALL_STEPS * statistics.median(steps), STALL_FLOOR_S), limit_s)
    quiet = now - rows[-1]["time"]
    if quiet < limit:
        return None
    return Diagnosis("stalled", f"stalled: no step for {quiet:.0f} s after step {rows[-1]['step'] + 1} (the median "
                                f"step takes {statistics.median(steps):.2f} s); the buffer's /status and the "
                                f"services' logs name the cause")  # fmt: skip


def window_shares(window: list[dict], batch: int) -> tuple[float, float]:
    """Over a window of metrics records: the share of its seconds (those after its first record)
    the trainer waited for batches, and the share of the groups offered the staleness filter dropped."""
    loop = window[-1]["time"] - window[0]["time"]
    idle = sum(r.get("perf/rollout_wait_s", 0.0) for r in window[1:]) / max(loop, 1e-9)
    dropped = sum(r.get("rollout/fully_async/stale_groups_filtered", 0.0) for r in window)
    return idle, dropped / (dropped + batch * len(window))


def diagnose(rows: list[dict], config: dict, live: bool = False, now: float | None = None) -> Diagnosis:
    """The run's diagnosis from its metrics records (`rows`, oldest first) and its stored config."""
    window = rows[-WINDOW:]
    if len(window) < 5:
        return Diagnosis("starting", f"starting: {len(window)} steps so far, the bound shows after 5")
    if d := _stalled(window, live, time.time() if now is None else now, float(config.get("stall_report_s", 300.0))):
        return d
    batch = int(config.get("rollout_batch_size") or 1)
    idle, stale = window_shares(window, batch)
    if stale >= STALE_DROP_SHARE:
        return Diagnosis("staleness", f"staleness drops {stale:.0%} of groups: raise "
                                      f"--max-weight-staleness (now {config.get('max_weight_staleness')}) or lower "
                                      f"--async-data-buffer-capacity-factor")  # fmt: skip
    fully = bool(config.get("fully_async")) and config.get("driver") != "sync"
    if idle >= IDLE_SHARE:
        med = statistics.median(r.get("rollout/response_len/median", 0.0) for r in window)
        p99 = statistics.median(r.get("rollout/response_len/p99", r.get("rollout/response_len/max", 0.0)) for r in window)
        if not fully and med > 0 and p99 >= TAIL_RATIO * med:
            return Diagnosis("generation", f"generation-bound by a long tail: the trainer waited {idle:.0%} of the "
                                           f"loop while each batch waited for its longest answers (p99 {p99:.0f} "
                                           f"tokens, median {med:.0f}); --fully-async frees a slot per finished answer")  # fmt: skip
        return Diagnosis("generation", f"generation-bound: the trainer waited {idle:.0%} of the loop; add producers "
                                       f"or engines (--rollout-num-producers, --rollout-num-engines) or raise the "
                                       f"in-flight cap (--async-max-concurrent-samples)")  # fmt: skip
    capacity = batch * float(config.get("async_data_buffer_capacity_factor") or 1.0)
    queue = statistics.fmean(r.get("rollout/fully_async/queue_size", 0.0) for r in window)
    if idle < BUSY_SHARE or (fully and queue >= QUEUE_FULL_SHARE * capacity):
        return Diagnosis("trainer", f"trainer-bound: the trainer waited {idle:.0%} of the loop and the queue holds "
                                    f"{queue:.0f} of {capacity:.0f} groups; a faster trainer helps "
                                    f"(--trainer-num-ranks), more generation does not")  # fmt: skip
    return Diagnosis("balanced", f"balanced: the trainer waited {idle:.0%} of the loop, the queue holds {queue:.0f} of "
                                 f"{capacity:.0f} groups")  # fmt: skip


def length_guard(rows: list[dict], config: dict) -> str | None:
    """A warning when answers grew until they run to the response limit: the window's truncated
    share, and how the mean response length moved since the run's first steps; None when they end
    on their own, or were that long from the start."""
    window = rows[-WINDOW:]
    truncated = [r["rollout/truncated_ratio"] for r in window if "rollout/truncated_ratio" in r]
    if len(truncated) < 5 or (share := statistics.fmean(truncated)) < TRUNCATED_SHARE:
        return None
    lengths = [r["rollout/response_length/mean"] for r in rows if "rollout/response_length/mean" in r]
    first, last = statistics.fmean(lengths[:5] or [0.0]), statistics.fmean(lengths[-5:] or [0.0])
    if last < GROWTH * first:
        return None  # answers that were this long from the start: a short limit, not a growth
    return (f"length: {share:.0%} of the answers run to the response limit (--rollout-max-response-len "
            f"{config.get('rollout_max_response_len')}); mean length {first:.0f} -> {last:.0f} tokens. A reward "
            f"that pays for text after the answer teaches padding; check what the grader reads")  # fmt: skip
