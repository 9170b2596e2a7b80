"""The driver's policy: after which steps the trainer pushes weights, saves and evaluates, and
whether it evaluates before it trains (Miles's order; docs/services.md, "The trainer", driver
order), what it asks the buffer for each step and which lease it waits for before which push.
Everything the three drivers do differently is here; the loop (services.trainer.loop) asks. It
reads the run's mode, budget, async, trainer and eval settings, and imports no torch."""

from __future__ import annotations

from asyncrl_proto import BufferGetRequest
from services.common.schedule import periodic_due


class DriverPolicy:
    """When the trainer does what, from the run's config (RunConfig)."""

    def __init__(self, config) -> None:
        self.mode = config.infra.mode
        self.total = config.rollout.total_steps
        self.batch_size = config.rollout.batch_size
        self.per_epoch = config.rollout.num_rollout_per_epoch
        self.update_interval = config.async_.update_weights_interval
        self.save_interval = config.trainer.save_interval
        self.eval_interval = config.eval.interval
        self.skip_baseline_eval = config.eval.skip_eval_before_train
        self.save, self.sentinel = config.trainer.save, config.trainer.save_trigger_sentinel

    def start_warnings(self) -> list[str]:
        """What the run's settings will not do that a user may expect of them."""
        out = []
        if self.mode == "sync" and self.update_interval != 1:
            out.append(f"--update-weights-interval {self.update_interval} is ignored by the synchronous driver "
                       "(train): it is on-policy, so it pushes the weights after every step")  # fmt: skip
        if self.save and not self.save_interval:
            out.append("--save without --save-interval saves no checkpoint (as in Miles; a restart resumes from the "
                       "last pushed weights, without the optimizer state): set --save-interval N")  # fmt: skip
        if self.mode != "sync" and self.total % self.update_interval and not (self.save_interval or self.sentinel):
            out.append(f"the last {self.total % self.update_interval} steps end after the last weight push "
                       f"(--update-weights-interval {self.update_interval}) and nothing saves them: set "
                       "--save-interval to keep the final weights")  # fmt: skip
        return out

    def drains_ahead(self, rollout_id: int) -> bool:
        """Fully async: step r+1's lease drains while step r trains (as Miles's async driver)."""
        return self.mode == "fully_async" and rollout_id + 1 < self.total

    def completes_next_before_push(self, rollout_id: int) -> bool:
        """One-step async, on an update step: step r+1's lease (released a step ahead, generating
        on the old weights) completes before the push, so nothing newer starts on old weights;
        then step r+2 is released, to generate on the new weights while r+1 trains."""
        return self.mode == "one_step" and self.update_due(rollout_id) and rollout_id + 1 < self.total

    def update_due(self, rollout_id: int) -> bool:
        """The weights are pushed after step r: every step in sync (on-policy by definition),
        else iff (r + 1) % --update-weights-interval == 0 (no forced push after the last step)."""
        return self.mode == "sync" or (rollout_id + 1) % self.update_interval == 0

    def save_due(self, rollout_id: int) -> bool:
        """A periodic save after step r (the --save-trigger-sentinel adds more at run time)."""
        return periodic_due(rollout_id, self.save_interval, self.per_epoch, self.total)

    def eval_due(self, rollout_id: int) -> bool:
        """An eval point after step r; the last step forces one in the async drivers only."""
        last = self.total if self.mode != "sync" else None
        return periodic_due(rollout_id, self.eval_interval, self.per_epoch, last)

    def baseline_eval_due(self, start_step: int) -> bool:
        """An eval point before training starts at `start_step` (named by it): before the run's
        first step, and in the synchronous driver before the first step after a resume too, as in
        Miles; never with --skip-eval-before-train or without --eval-interval."""
        if self.eval_interval is None or self.skip_baseline_eval or start_step >= self.total:
            return False
        return start_step == 0 or self.mode == "sync"

    def get_request(self, step: int, version: int, lookahead: int | None = None,
                    wait_s: float = 2.0) -> BufferGetRequest:  # fmt: skip
        """The buffer get for `step` by a trainer at weight `version`: one-step async releases a
        step ahead (but nothing after the last step: it would never be trained)."""
        if lookahead is None:
            lookahead = 1 if self.mode == "one_step" else 0
        if step + 1 >= self.total:
            lookahead = 0
        return BufferGetRequest(
            step=step,
            count=self.batch_size,
            # fully async: staleness is judged against the trainer's version when it asks, the same for
            # every group of a lease, as Miles's get(current_version); a lease drained ahead while the
            # previous step trains may complete after that step's push (its newest groups then read -1)
            current_version=version if self.mode == "fully_async" else None,
            lookahead_steps=lookahead,
            release_min_version=version if self.mode in ("sync", "one_step") else None,
            wait_s=wait_s,
        )
