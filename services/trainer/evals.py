"""The trainer's side of evaluation (docs/services.md, "Evaluation"): eval points dispatched to
the eval service as the loop passes them, their answers taken into the next step's record, and
the run's end held until every point is answered. Training never waits for an evaluation, except for the
--eval-max-in-flight backpressure.
"""

from __future__ import annotations

import asyncio
import logging
import shutil
import time
from collections.abc import Callable
from pathlib import Path

from asyncrl_proto import EvalRequest, EvalResult
from services.common.runtime import wait_event
from services.common.validate import EvalPoints, eval_result_problem, finite_metrics
from services.model.hf_io import save_model

log = logging.getLogger(__name__)

EVAL_WAIT_WARN_S = 60.0
EVAL_DRAIN_TIMEOUT_S = 600.0


class EvalDispatch:
    """`pending`: eval points requested and not yet answered; `last`: the last point dispatched
    (the launcher waits for it); `answered`: results not yet in a step's record. `trainer_step()`:
    the trainer's step now (a result's eval/lag_steps)."""

    def __init__(self, config, bus, sinks, model, trainer_step: Callable[[], int]):
        self.config = config
        self.bus = bus
        self.sinks = sinks
        self.model = model
        self.trainer_step = trainer_step
        self.pending: set[int] = set()
        self.last: int | None = None
        self.answered: list[dict] = []
        self.points = EvalPoints()
        """The points requested and answered: a result is taken only for one of them, once."""
        self._done = asyncio.Event()

    async def request(self, step: int, rollout_id: int, version: int, start: bool = False) -> None:
        """Dispatch the eval point of the weights after `step` steps (weight `version`), named
        `rollout_id` on Miles's axis (eval/step: the step just trained, or the one a baseline
        point precedes): at most --eval-max-in-flight pending, then wait for the oldest
        (backpressure) or skip as `busy` (never the last step's point); snapshot backends get
        --hf-checkpoint itself before any training, else a fresh export in --eval-hf-dir or the
        --save-hf checkpoint of the step."""
        c = self.config
        final = step == c.rollout.total_steps
        self.last = step
        while len(self.pending) >= c.eval.max_in_flight:
            if c.eval.overflow_policy == "skip" and not final:
                await self._skip(step, rollout_id, version, "busy")
                return
            self._done.clear()
            if not await wait_event(self._done, EVAL_WAIT_WARN_S):
                log.warning("eval backpressure: waiting for eval points %s (--eval-max-in-flight %d) before "
                            "dispatching step %d; is the eval service running?", sorted(self.pending),
                            c.eval.max_in_flight, step)  # fmt: skip
        uri, exported, export_s = "", False, 0.0
        if c.eval.backend != "shared":
            if step == 0:
                uri = c.data.hf_checkpoint  # the initial weights themselves: nothing to export
            elif c.eval.hf_dir:
                path = Path(c.eval.hf_dir) / f"step_{step}"
                t0 = time.perf_counter()
                try:
                    await asyncio.to_thread(save_model, self.model, path, c.data.hf_checkpoint)
                except Exception as e:
                    log.error("exporting the eval snapshot of step %d to %s failed: %s", step, path, e)
                    await asyncio.to_thread(shutil.rmtree, path, True)  # a failed export leaves nothing behind
                    await self._skip(step, rollout_id, version, "export_failed")
                    return
                uri, exported, export_s = str(path), True, time.perf_counter() - t0  # paths are absolute (launcher)
            else:
                uri = str(Path(c.trainer.save_hf) / f"step_{step}")
        req = EvalRequest(step=step, rollout_id=rollout_id, version=version, snapshot_uri=uri, final=final,
                          requested_at=time.time(), exported=exported, export_time_s=export_s)  # fmt: skip
        self.pending.add(step)
        self.points.request(step, version)
        # one request per eval point, even when a resumed trainer passes the point again; a
        # duplicate was answered before the restart (or will be, and the answer clears it anyway;
        # a retry whose first ack was lost also reads as one: the count is then one short until
        # the next answer, which clears every point up to its own, since evals run in order)
        # (a sync resume's baseline point evaluates the weights of the point before it again, as Miles)
        msg_id = f"eval-{step}-start" if start and step > 0 else f"eval-{step}"
        (ack,) = await self.bus.publish_durably([(self.bus.subjects.eval_requests, req, msg_id)], f"eval request {step}")
        if ack.duplicate:
            self.pending.discard(step)

    async def _skip(self, step: int, rollout_id: int, version: int, reason: str) -> None:
        res = EvalResult(step=step, version=version, skipped_reason=reason,
                         metrics={f"eval/skipped_{reason}": 1.0, "eval/step": rollout_id})  # fmt: skip
        log.warning("eval point %d skipped: %s", step, reason)
        self.points.request(step, version)
        await self.bus.publish_durably([(self.bus.subjects.eval_results, res, None)], f"eval skip {step}")

    async def on_result(self, msg) -> None:
        """An eval result (or skip): logged on its eval/step now, and into the next step's record."""
        if (res := await self.bus.decode_or_dead_letter(msg, EvalResult)) is None:
            return
        problem = eval_result_problem(res.step, self.config.rollout.total_steps) or self.points.problem(res.step,
                                                                                                         res.version)  # fmt: skip
        if problem is not None:
            await self.bus.dead_letter(msg.subject, msg.data, problem)
            return
        metrics, dropped = finite_metrics(res.metrics)  # the point is answered even if some are not
        if dropped:
            log.warning("eval result of step %d: metrics %s are not finite numbers; left out", res.step, dropped)
        metrics["eval/lag_steps"] = self.trainer_step() - res.step
        self.answered.append(metrics)
        if "eval/step" in metrics:
            self.sinks.log(metrics, "eval/step")
        if res.step in self.pending:  # the eval service answers its requests in order
            self.pending -= {s for s in self.pending if s <= res.step}
        self._done.set()

    def take_answered(self) -> dict:
        """The results answered since the last step's record, merged oldest first."""
        out = {k: v for metrics in self.answered for k, v in metrics.items()}
        self.answered.clear()
        return out

    async def drain(self) -> None:
        """As Miles's driver drains its eval dispatcher: the run ends once its eval points are
        answered, so every result reaches the sinks on its eval/step (a dead eval fleet is
        given up on after EVAL_DRAIN_TIMEOUT_S, loudly)."""
        deadline = time.monotonic() + EVAL_DRAIN_TIMEOUT_S
        while self.pending and time.monotonic() < deadline:
            self._done.clear()
            if not await wait_event(self._done, EVAL_WAIT_WARN_S):
                log.warning("waiting for eval points %s before finishing; is the eval service running?",
                            sorted(self.pending))  # fmt: skip
        if self.pending:
            log.error("eval points %s were not answered within %.0fs: finishing without them",
                      sorted(self.pending), EVAL_DRAIN_TIMEOUT_S)  # fmt: skip
