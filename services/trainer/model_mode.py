"""The trainer's model mode: the whole model trains, one step's lease at a time, under one of
the three drivers (docs/architecture.md, "Modes are admission rules"), all one loop
(services.trainer.loop) with the driver's DriverPolicy (services.trainer.policy) saying what
differs:

  sync: get(step) releases exactly this step's prompts, and only once the engines run the
    previous step's weights (release_min_version);
  one-step async: prompt release runs one step ahead (lookahead 1); on an update step the next
    batch is fetched (so its generation is complete) before the push;
  fully async: the buffer is fed continuously; the next step's lease drains while this one trains.

Waits for: the batch (logging "No completed rollout groups for 30.0s" every 30 s); it fails if
the buffer stops answering or no producer is alive. The torch step runs in a worker thread so
heartbeats and HTTP keep answering.
"""

from __future__ import annotations

import asyncio
import collections
import copy
import logging
import time
from pathlib import Path

from asyncrl_proto import BufferGetReply, WeightsPublished
from asyncrl_proto.messages import SampleStatus, flatten_group
from services.common import crash
from services.common.config.view import for_plugins
from services.common.plugins import load_object, maybe_await
from services.common.versions import announcements, last_published_version
from services.model.hf_io import load_weights_into, save_model
from services.trainer.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
from services.trainer.core import (
    apply_sample_filter,
    assemble_batch,
    build_step_batches,
    std_normalization,
    train_rollout,
)
from services.trainer.evals import EvalDispatch
from services.trainer.loop import Mode, RunFailed, Work
from services.trainer.parallel import max_tokens_of
from services.trainer.policy import DriverPolicy
from services.trainer.publish import WeightPublisher, master_address
from services.trainer.rollout_stats import rollout_metrics
from services.trainer.setup import TrainerError, build_optimizer, build_reference

log = logging.getLogger(__name__)

FAILED_WINDOW_STEPS = 4
"""--max-failed-ratio is judged over this many recent steps."""


class ModelTraining(Mode):
    """Built on its service (services.trainer.service.TrainerService: the config, bus, model and
    the pieces both modes share), whose weight versions, evals and checkpoints it owns."""

    def __init__(self, svc) -> None:
        self.svc = svc
        c = self.config = svc.config
        self.bus = svc.bus
        self.model = svc.model
        self.optimizer = build_optimizer(c, self.model)
        self.ref_model = build_reference(c)
        self.old_actor = copy.deepcopy(self.model).eval() if c.trainer.keep_old_actor else None
        """--keep-old-actor: the weights the engines run (the last pushed), the PPO denominator."""
        self.policy = DriverPolicy(c)
        self.run_dir = Path(c.infra.run_dir)
        log_fn, sample_filter = c.trainer.custom_rollout_log_function_path, c.rollout.sample_filter_path
        self.rollout_log_fn = load_object(log_fn, "--custom-rollout-log-function-path") if log_fn else None
        self.sample_filter = load_object(sample_filter, "--rollout-sample-filter-path") if sample_filter else None
        self.num_nonfinite_skipped = 0
        self.recent_failures: collections.deque[tuple[int, int, str]] = collections.deque(maxlen=FAILED_WINDOW_STEPS)
        self.version = 0
        self.committed_version: int | None = None
        """The weight version of the last commit: the snapshot a restart without --save resumes from."""
        self.step = 0
        self.loop_started = time.perf_counter()
        self.evals = EvalDispatch(c, svc.bus, svc.sinks, self.model, trainer_step=lambda: self.step)
        self.weights = WeightPublisher(c, svc.bus, self.model, self.run_dir / "weights")
        """Weight versions: pushes, the bucket (object-store), the broadcast (distributed), retention."""
        self.ahead: Work | None = None
        """one-step: the next lease, completed before an update step's push."""
        self.prefetch: asyncio.Future | None = None
        """fully async: the next lease, drained while this step trains."""

    # ---- start-up and resume ---------------------------------------------------------------------
    async def setup(self) -> None:
        await self._resume()
        if self.step > 0:  # a restart: the points requested before it (up to this step) are not known here
            self.evals.points.resumed_at(self.step)
        self.weights.resumed(self.version)
        if self.old_actor is not None:  # the engines converge to the resumed weights
            self.old_actor.load_state_dict(self.model.state_dict())
        await self.svc.start_ranks(self.optimizer, self.ref_model)
        await self.bus.subscribe(self.bus.subjects.eval_results, self.evals.on_result)
        if self.config.async_.update_weight_transfer_mode == "distributed":
            await self.weights.start_sender(master_address(self.config))

    async def _resume(self) -> None:
        """Continue from the newest complete checkpoint unless the buffer's committed step is
        newer (a checkpoint taken on the sentinel, then commits on weight pushes); then after the
        committed step, from the weight snapshot pushed after it (that snapshot is the checkpoint,
        less the optimizer state). The weight version continues from the newest version ever
        published, so a version number never names two weights."""
        published = await last_published_version(self.bus)
        ckpt = latest_checkpoint(self.config.trainer.load or self.config.trainer.save)
        req = self.policy.get_request(0, self.version, lookahead=0, wait_s=0.0)
        reply = await self.svc.link.request(self.bus.subjects.buffer_get, req, BufferGetReply,
                                            "question where to resume")  # fmt: skip
        committed = reply.committed_step
        if ckpt is not None and int(ckpt.name.removeprefix("iter_")) >= committed:  # iter_<N>: after step <N>
            info = await asyncio.to_thread(load_checkpoint, ckpt, self.model, self.optimizer)
            self.step = info["step"] + 1
            self.version = max(info["version"], published)
            self.svc.records.drop_after(self.run_dir, info["step"])
            await self._commit(info["step"])  # in case we died between the checkpoint and its commit
            log.info("resumed from %s: next step %d, weight version %d", ckpt, self.step, self.version)
            return
        self.version = published
        self.svc.records.drop_after(self.run_dir, committed)  # the steps after it are trained again
        if committed < 0:
            return
        self.step = committed + 1
        pub = await self._snapshot_of(committed)
        if pub is None:
            log.error("no weight snapshot of step %d is left: resuming from the initial weights; the updates of "
                      "steps 0..%d are lost (--save keeps them)", committed, committed)  # fmt: skip
            return
        await asyncio.to_thread(load_weights_into, self.model, self.weights.weights_dir / f"v{pub.version}")
        self.committed_version = pub.version
        lost = f", and the updates of steps {pub.step + 1}..{committed}" if pub.step < committed else ""
        log.warning("resumed without a checkpoint from the weights v%d pushed after step %d: next step %d, weight "
                    "version %d; the optimizer state is lost%s (--save keeps it)", pub.version, pub.step, self.step,
                    self.version, lost)  # fmt: skip

    async def _snapshot_of(self, step: int) -> WeightsPublished | None:
        """The newest complete weight snapshot pushed after `step` or before it (WEIGHTS, newest first)."""
        first, last, _ = await self.bus.stream_bounds(self.bus.subjects.weights_stream) or (1, 0, 0)
        async for pub in announcements(self.bus, last - first + 1):  # back to the first message
            if pub.step <= step and await self.weights.have_snapshot(pub):
                return pub
        return None

    # ---- the loop's steps (services.trainer.loop) ----------------------------------------------
    async def start(self) -> None:
        c = self.config
        log.info("training %d steps, mode %s, B=%d n=%d", c.rollout.total_steps, c.infra.mode,
                 c.rollout.batch_size, c.rollout.n_samples_per_prompt)  # fmt: skip
        for warning in self.policy.start_warnings():
            log.warning(warning)
        if self.policy.baseline_eval_due(self.step):  # named by the step it precedes
            await self.evals.request(self.step, rollout_id=self.step, version=self.version, start=True)
        self.loop_started = time.perf_counter()

    async def next(self) -> list[Work] | None:
        if self.step >= self.config.rollout.total_steps:
            return None
        if self.ahead is not None:
            w, self.ahead = self.ahead, None
        elif self.prefetch is not None:
            t0 = time.monotonic()
            w = await self.prefetch
            w.wait_s, self.prefetch = time.monotonic() - t0, None  # what it waited
        else:
            w = await self._fetch(self.step)
        if self.policy.drains_ahead(w.step):  # as Miles's async driver: the next lease drains while this one trains
            self.prefetch = asyncio.ensure_future(self._fetch(w.step + 1))
        return [w]

    def cancel(self) -> None:
        if self.prefetch is not None:
            self.prefetch.cancel()
        self.prefetch = self.ahead = None

    async def train(self, w: Work) -> None:
        """One optimizer step on the groups of a durable lease."""
        c = self.config
        w.version = self.version  # the weights it trains from
        if self.svc.dp is not None:
            w.stats = await asyncio.to_thread(self.svc.dp.train, w.groups, self.svc.loss_cfg)
        else:
            steps = build_step_batches(w.groups, w.std, c.rollout.reward_key, self.svc.pad_id, max_tokens_of(c),
                                       c.optimizer_steps_per_rollout)  # fmt: skip
            w.stats = await asyncio.to_thread(train_rollout, self.model, self.optimizer, steps, self.svc.loss_cfg,
                                              c.trainer.clip_grad, self.ref_model, self.old_actor)  # fmt: skip
        crash.point("trainer", "optimizer_step_before_records")
        if w.stats.get("train/nonfinite_skipped"):
            self.num_nonfinite_skipped += 1
            log.error("step %d: the loss or the gradient norm is not finite; the update was skipped "
                      "(weights and optimizer unchanged)", w.step)  # fmt: skip

    async def before_records(self, w: Work) -> None:
        """The push, when due. Fully async pushes at once, while the next lease may still be
        filling (Miles's driver waits for that rollout first; here that held every update back by
        the slowest group and kept the engines a version behind): the lease's gets all carry the
        version they started with, so its groups are judged against one clock. One-step completes
        the in-flight lease first, so nothing newer starts on old weights, then releases the step
        after it, which generates on the new weights while the next one trains."""
        if not self.policy.update_due(w.step):
            return
        if self.policy.completes_next_before_push(w.step):
            self.ahead = await self._fetch(w.step + 1, lookahead=0)
        t0 = time.perf_counter()
        self.version += 1
        await self.weights.push(self.version, w.step, self.committed_version)
        if self.old_actor is not None:
            self.old_actor.load_state_dict(self.model.state_dict())
        w.push_s = time.perf_counter() - t0
        if self.ahead is not None:
            req = self.policy.get_request(w.step + 1, self.version, lookahead=1, wait_s=0.0)
            await self.svc.link.request(self.bus.subjects.buffer_get, req, BufferGetReply,
                                        "release of the next batch")  # fmt: skip

    async def after_records(self, w: Work, record: dict) -> None:
        self.svc.observe("trainer/step_seconds", record["perf/step_time_s"])
        self.svc.observe("trainer/rollout_wait_seconds", record["perf/rollout_wait_s"])
        crash.point("trainer", "records_before_checkpoint")
        await self._checkpoint_and_commit(w.step, pushed=self.policy.update_due(w.step))
        crash.point("trainer", "commit_before_next_step")
        self.step = w.step + 1
        self._check_failures(w.groups)
        if self.policy.eval_due(w.step):  # named by the step just trained, on Miles's axis
            await self.evals.request(w.step + 1, rollout_id=w.step, version=self.version)

    async def finish(self, error: str | None = None) -> None:
        total = self.config.rollout.total_steps
        if error is None:
            await self.evals.drain()
            await self.weights.wait_final_broadcast(self.version)
        await self.svc.records.finish(total, error=error, last_eval=self.evals.last)
        if error:
            log.error("the run failed at step %d: %s", self.step, error)
        else:
            log.info("training finished: %d steps, weight version %d", total, self.version)
        self.svc.stop()

    def _check_failures(self, groups: list[list]) -> None:
        """RunFailed when more than --max-failed-ratio of the samples of the last steps FAILED,
        quoting the latest cause (a reward plugin that always raises would otherwise train
        nothing for the whole run and end with exit 0)."""
        samples = [s for g in groups for s in flatten_group(g)]
        failed = [s for s in samples if s.status == SampleStatus.FAILED]
        cause = next((str(s.metadata.get("reward_error") or s.metadata.get("error") or "") for s in failed), "")
        self.recent_failures.append((len(failed), len(samples), cause))
        c = self.config
        judged = (
            len(self.recent_failures) >= min(FAILED_WINDOW_STEPS, c.rollout.total_steps)
            or self.step >= c.rollout.total_steps
        )
        num_failed = sum(f for f, _, _ in self.recent_failures)
        num = sum(n for _, n, _ in self.recent_failures)
        if judged and c.infra.max_failed_ratio < 1 and num and num_failed / num > c.infra.max_failed_ratio:
            latest = next((why for _, _, why in reversed(self.recent_failures) if why), "no cause recorded")
            raise RunFailed(
                f"{num_failed} of {num} samples of the last {len(self.recent_failures)} steps FAILED (more than "
                f"--max-failed-ratio {c.infra.max_failed_ratio}); the latest cause: {latest[:500]}"
            )

    # ---- leases --------------------------------------------------------------------------------
    async def _fetch(self, step: int, lookahead: int | None = None) -> Work:
        """Wait for the step's B groups (a durable lease), with the buffer's metrics."""
        t0 = time.monotonic()
        a, req = self.config.async_, self.policy.get_request(step, self.version, lookahead)
        reply = await self.svc.link.lease(req, lambda: self.svc.last_producer_seen, a.rollout_wait_warn_s,
                                          a.producer_timeout_s)  # fmt: skip
        groups = [await self.svc.link.load_group(ref) for ref in reply.refs]
        groups = assemble_batch(groups, self.config.rollout.n_samples_per_prompt)
        self.svc.check.exclude_invalid(groups, max_version=self.version)
        if self.sample_filter is not None:
            try:
                apply_sample_filter(self.sample_filter, for_plugins(self.config), groups,
                                    self.config.rollout.sample_filter_path)  # fmt: skip
            except ValueError as e:
                raise TrainerError(str(e)) from e
        elapsed = time.monotonic() - t0
        return Work(step=step, version=self.version, records_dir=self.run_dir, axis="rollout/step",
                    std=std_normalization(self.config), groups=groups, refs={r.group_index: r for r in reply.refs},
                    metrics=reply.metrics, rollout_time=elapsed, wait_s=elapsed)  # fmt: skip

    # ---- commits -------------------------------------------------------------------------------
    async def _checkpoint_and_commit(self, step: int, pushed: bool) -> None:
        """Save after step r when due (DriverPolicy.save_due: --save-interval, epoch ends, the last
        step; never without --save-interval) or when the --save-trigger-sentinel file exists
        (then deleted): a --save checkpoint and a --save-hf snapshot `step_<r + 1>` (`.complete`
        last). The buffer learns a step is done (commit) only once it can be resumed from: with
        --save and --save-interval, its checkpoint; otherwise the weight snapshot pushed after it
        (TrainerSection.checkpoints_resume). A restarted trainer gets the later steps' groups again."""
        c = self.config
        sentinel = Path(c.trainer.save_trigger_sentinel) if c.trainer.save_trigger_sentinel else None
        triggered = sentinel is not None and sentinel.exists()
        saved = triggered or self.policy.save_due(step)
        if saved and c.trainer.save_hf:
            path = Path(c.trainer.save_hf) / f"step_{step + 1}"
            await asyncio.to_thread(save_model, self.model, path, c.data.hf_checkpoint)
        if saved and c.trainer.save:
            await asyncio.to_thread(
                save_checkpoint, c.trainer.save, step, self.model, self.optimizer, self.version, c.data.hf_checkpoint
            )
        if triggered:
            log.info("step %d saved on %s (--save-trigger-sentinel), which is now deleted", step, sentinel)
            sentinel.unlink(missing_ok=True)
        resumable = bool(saved and c.trainer.save) if c.trainer.checkpoints_resume else pushed
        if resumable or step + 1 == c.rollout.total_steps:
            crash.point("trainer", "checkpoint_before_commit")
            await self._commit(step)

    async def _commit(self, step: int) -> None:
        await self.svc.link.commit(self.bus.subjects.buffer_commit, step, self.version, f"commit of step {step}")
        self.committed_version = self.version

    # ---- records -------------------------------------------------------------------------------
    async def record(self, w: Work) -> dict:
        """The step's metrics, with Miles's names on Miles's axis (rollout/step). A
        --custom-rollout-log-function-path that returns True replaces the rollout ones."""
        samples = [s for g in w.groups for s in flatten_group(g)]
        step_s = time.perf_counter() - w.started
        rec = {
            "step": w.step,
            "rollout/step": w.step,
            "weight_version": self.version,
            "time": time.time(),
            "perf/rollout_wait_s": w.wait_s,
            "perf/train_time_s": w.train_s,
            "perf/weight_push_s": w.push_s,
            "perf/step_time_s": step_s,
            "perf/elapsed_s": time.perf_counter() - self.loop_started,
            **w.stats,
        }
        if not (self.rollout_log_fn is not None and await self._custom_rollout_log(w, samples)):
            rec.update(rollout_metrics(samples, self.config.rollout.reward_key, list(w.groups)))
            rec["perf/rollout_time"] = w.rollout_time
            rec["perf/tokens_per_s"] = sum(s.response_length for s in samples) / step_s if step_s > 0 else 0.0
            rec.update(w.metrics)
        rec.update(self.evals.take_answered())
        return rec

    async def _custom_rollout_log(self, w: Work, samples: list) -> bool:
        """Miles's log_rollout_data(rollout_id, args, samples, rollout_extra_metrics, rollout_time)."""
        try:
            out = self.rollout_log_fn(w.step, for_plugins(self.config), samples, dict(w.metrics), w.rollout_time)
            return bool(await maybe_await(out))
        except Exception as e:  # a logging plugin never stops training: the default logging runs
            log.warning("--custom-rollout-log-function-path raised at step %d: %s", w.step, e)
            return False

    def status(self) -> dict:
        return {"step": self.step, "total_steps": self.config.rollout.total_steps, "weight_version": self.version,
                "mode": self.config.infra.mode,
                "weight_transfer": self.weights.sender.status() if self.weights.sender is not None else None}  # fmt: skip

    def metric_values(self) -> dict[str, float]:
        return {"trainer/step": self.step, "trainer/weight_version": self.version,
                "trainer/nonfinite_updates_skipped_total": self.num_nonfinite_skipped}  # fmt: skip

    async def stop(self) -> None:
        await self.weights.stop()
