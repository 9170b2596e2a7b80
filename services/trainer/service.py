"""Trainer service: pulls B groups per step, trains, publishes weight versions.

Consumes: group references from the buffer (`buffer.get`, request/reply, idempotent per step)
  and their payloads from ROLLOUTS (direct get by sequence); EvalResult messages (logged with
  the next step); producer heartbeats (to fail loudly when every producer is gone).
Produces: HF safetensors snapshots under <run_dir>/weights/v<N> and WeightsPublished every
  --update-weights-interval steps; BufferCommit after each step; EvalRequest when due; one
  JSONL record per step in <run_dir>/metrics.jsonl and on `progress`; a final `done` record.
Drivers (docs/architecture.md, "Modes are admission rules"), all one loop with different
  admission rules:
  sync: get(step) releases exactly this step's prompts, and only once the engines run the
    previous step's weights (release_min_version);
  one-step async: prompt release runs one step ahead (lookahead 1); on an update step the next
    batch is fetched (so its generation is complete) before the push;
  fully async: the buffer is fed continuously; the trainer drains B groups per step.
Waits for: the batch (logging "No completed rollout groups for 30.0s" every 30 s); it fails if
  the buffer stops answering or no producer is alive. The torch step runs in a worker thread so
  heartbeats and HTTP keep answering.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import copy
import dataclasses
import inspect
import json
import logging
import time
from pathlib import Path

import torch

from asyncrl_proto import (
    BufferGetReply,
    Heartbeat,
    WeightsPublished,
    decode,
)
from asyncrl_proto.codec import MalformedMessage
from asyncrl_proto.messages import SampleStatus, flatten_group
from services.common import crash, sample_records
from services.common.config import (
    AsyncSection,
    DataSection,
    EvalSection,
    MultiLoraSection,
    RolloutSection,
    TrainerSection,
)
from services.common.plugins import load_object
from services.common.promexport import LATENCY_BUCKETS_S
from services.common.runtime import Service
from services.common.sinks import Sinks, finite_record
from services.common.validate import Limits
from services.common.versions import last_published_version
from services.model.hf_io import load_weights_into, save_model
from services.trainer.checkpoint import ckpt_step, latest_checkpoint, load_checkpoint, save_checkpoint
from services.trainer.core import (
    apply_sample_filter,
    assemble_batch,
    build_step_batches,
    std_normalization,
    train_rollout,
)
from services.trainer.evals import EvalDispatch
from services.trainer.parallel import max_tokens_of
from services.trainer.policy import DriverPolicy
from services.trainer.publish import WeightPublisher
from services.trainer.rollout_stats import rollout_metrics
from services.trainer.setup import TrainerError, build_model, build_optimizer, build_reference, loss_config
from services.trainer.steps import BufferLink, Records, SampleCheck, SampleRecorder, append_trained, keep_lines

log = logging.getLogger(__name__)

FAILED_WINDOW_STEPS = 4
"""--max-failed-ratio is judged over this many recent steps."""
NOT_EXPORTED = frozenset({"step", "rollout/step", "weight_version", "time", "rollout/fully_async/queue_size",
                          "rollout/fully_async/buffer_avg_staleness", "rollout/fully_async/buffer_max_staleness"})  # fmt: skip
"""Step record keys left out of the trainer's /metrics: the step and version are trainer/step and
trainer/weight_version; the buffer's gauges (what it holds now) are the buffer's to export, and
the trainer's copies (what it held when this step's lease completed) would give one name two meanings."""


@dataclasses.dataclass
class Batch:
    groups: list[list]
    metrics: dict
    rollout_time: float
    """Seconds from the step's first get to its complete lease (Miles's perf/rollout_time)."""
    wait_s: float
    """Seconds the loop waited for it (less than rollout_time when it was fetched ahead)."""
    refs: dict = dataclasses.field(default_factory=dict)
    """The lease's GroupRef of each group, by group index (its group id and staleness)."""


class RunFailed(RuntimeError):
    """The run cannot go on, and a restart would not change it (e.g. every reward raises): the
    trainer reports it in its final record and stops; the launcher fails the run with it."""


class TrainerService(Service):
    name = "trainer"
    reads = (DataSection, RolloutSection, AsyncSection, TrainerSection, EvalSection, MultiLoraSection)
    histograms = {
        "trainer/step_seconds": ("Seconds per training step, its batch in hand to its records (perf/step_time_s)",
                                 LATENCY_BUCKETS_S),
        "trainer/rollout_wait_seconds": ("Seconds each step waited for its batch (perf/rollout_wait_s)",
                                         LATENCY_BUCKETS_S),
    }  # fmt: skip

    def __init__(self, config, bus, **kw):
        super().__init__(config, bus, **kw)
        torch.set_num_threads(config.infra.torch_num_threads)
        torch.manual_seed(config.data.seed)
        self.run_dir = Path(config.infra.run_dir)
        self.weights_dir = self.run_dir / "weights"
        self.metrics_path = self.run_dir / "metrics.jsonl"
        self.model = build_model(config)
        self.loss_cfg = loss_config(config)
        self.policy = DriverPolicy(config)
        self.ref_model = build_reference(config)
        self.old_actor = copy.deepcopy(self.model).eval() if config.trainer.keep_old_actor else None
        """--keep-old-actor: the weights the engines run (the last pushed), the PPO denominator."""
        self.rollout_log_fn = (
            load_object(config.trainer.custom_rollout_log_function_path, "--custom-rollout-log-function-path")
            if config.trainer.custom_rollout_log_function_path
            else None
        )
        self.sinks = Sinks(config, self.run_dir)
        self.records = Records(self.metrics_path, self.sinks, bus)
        self.link = BufferLink(bus, config.async_.buffer_timeout_s)
        self.sample_filter = (
            load_object(config.rollout.rollout_sample_filter_path, "--rollout-sample-filter-path")
            if config.rollout.rollout_sample_filter_path
            else None
        )
        self.pad_id = self.model.cfg.pad_token_id if self.model.cfg.pad_token_id is not None else 0
        self.check = SampleCheck(Limits(n=config.rollout.n_samples_per_prompt, vocab_size=self.model.cfg.vocab_size,
                                        context_length=self.model.cfg.max_position_embeddings,
                                        reward_key=config.rollout.reward_key,
                                        max_abs_reward=config.rollout.max_abs_reward),
                                 self.loss_cfg)  # fmt: skip
        self.num_nonfinite_skipped = 0
        self.recent_failures: collections.deque[tuple[int, int, str]] = collections.deque(maxlen=FAILED_WINDOW_STEPS)
        self.version = 0
        self.committed_version: int | None = None
        """The weight version of the last commit: the snapshot a restart without --save resumes from."""
        self.step = 0
        self.last_producer_seen = time.monotonic()
        self.loop_started = time.perf_counter()
        self.trained_path = self.run_dir / "trained.jsonl"
        self.sample_recorder = SampleRecorder(config.data.hf_checkpoint, config.rollout.reward_key,
                                              config.trainer.keep_sample_records)  # fmt: skip
        self.dp = None
        self.evals = EvalDispatch(config, bus, self.sinks, self.model, trainer_step=lambda: self.step)
        self.weights = WeightPublisher(config, bus, self.model, self.weights_dir)
        """Weight versions: pushes, the bucket (object-store), the broadcast (distributed), retention."""
        self.multi = None
        """--multi-lora-n-adapters: the adapters' loop (services.trainer.multi_lora) instead of the
        model's, with its own optimizer over the adapters' slots (the base's is never built)."""
        self.optimizer = None
        if config.multi_lora.multi_lora_n_adapters > 0:
            from services.trainer.multi_lora import MultiLoraTrainer

            self.multi = MultiLoraTrainer(config, bus, self.model, self.link, self.records, self.check,
                                          self.loss_cfg, self.pad_id, lifecycle=self)  # fmt: skip
        else:
            self.optimizer = build_optimizer(config, self.model)

    async def setup(self) -> None:
        s = self.bus.subjects
        self.weights_dir.mkdir(parents=True, exist_ok=True)
        if self.multi is not None:  # adapters only: the base never changes, nothing to resume here
            await self._start_ranks()
            self.multi.dp = self.dp
            await self.bus.subscribe(s.heartbeat("rollout"), self._on_producer_heartbeat)
            return
        await self._resume()
        if self.step > 0:  # a restart: the points requested before it (up to this step) are not known here
            self.evals.points.resumed_at(self.step)
        self.weights.resumed(self.version)
        if self.old_actor is not None:  # the engines converge to the resumed weights
            self.old_actor.load_state_dict(self.model.state_dict())
        await self._start_ranks()
        await self.bus.subscribe(s.eval_results, self.evals.on_result)
        await self.bus.subscribe(s.heartbeat("rollout"), self._on_producer_heartbeat)
        if self.config.async_.update_weight_transfer_mode == "distributed":
            await self.weights.start_sender(master_address(self.config))

    async def _start_ranks(self) -> None:
        """--trainer-num-ranks K > 1: ranks 1..K-1 started and joined (services.trainer.ranks)."""
        if self.config.trainer.trainer_num_ranks <= 1:
            return
        cfg_file = self.run_dir / "trainer-config.json"
        cfg_file.write_text(json.dumps(self.config.model_dump(mode="json")))
        from services.trainer.ranks import DataParallel

        self.dp = await asyncio.to_thread(
            DataParallel, self.config, self.model, self.optimizer, self.ref_model, self.pad_id, cfg_file,
            self.run_dir / "logs",
        )  # fmt: skip
        log.info("data parallel over %d ranks (%s)", self.config.trainer.trainer_num_ranks, self.dp.backend)

    async def _resume(self) -> None:
        """Continue from the newest complete checkpoint unless the buffer's committed step is
        newer (a checkpoint taken on the sentinel, then commits on weight pushes); then after the
        committed step, from the weight snapshot pushed after it (that snapshot is the checkpoint,
        less the optimizer state). The weight version continues from the newest version ever
        published, so a version number never names two weights."""
        published = await last_published_version(self.bus)
        ckpt = latest_checkpoint(self.config.trainer.load or self.config.trainer.save)
        committed = await self._committed_step()
        if ckpt is None or ckpt_step(ckpt) < committed:
            self.version = published
            await self._resume_from_snapshot(committed)
            return
        info = await asyncio.to_thread(load_checkpoint, ckpt, self.model, self.optimizer)
        self.step = info["step"] + 1
        self.version = max(info["version"], published)
        self._truncate_records(info["step"])
        await self._commit(info["step"])  # in case we died between the checkpoint and its commit
        log.info("resumed from %s: next step %d, weight version %d", ckpt, self.step, self.version)

    async def _committed_step(self) -> int:
        req = self.policy.get_request(0, self.version, lookahead=0, wait_s=0.0)
        reply = await self.link.request(self.bus.subjects.buffer_get, req, BufferGetReply, "question where to resume")
        return reply.committed_step

    async def _resume_from_snapshot(self, committed: int) -> None:
        self._truncate_records(committed)  # the steps after it are trained again
        if committed < 0:
            return
        self.step = committed + 1
        pub = await self._snapshot_of(committed)
        if pub is None:
            log.error("no weight snapshot of step %d is left: resuming from the initial weights; the updates of "
                      "steps 0..%d are lost (--save keeps them)", committed, committed)  # fmt: skip
            return
        await asyncio.to_thread(load_weights_into, self.model, self.weights_dir / f"v{pub.version}")
        self.committed_version = pub.version
        lost = f", and the updates of steps {pub.step + 1}..{committed}" if pub.step < committed else ""
        log.warning("resumed without a checkpoint from the weights v%d pushed after step %d: next step %d, weight "
                    "version %d; the optimizer state is lost%s (--save keeps it)", pub.version, pub.step, self.step,
                    self.version, lost)  # fmt: skip

    async def _snapshot_of(self, step: int) -> WeightsPublished | None:
        """The newest complete weight snapshot pushed after `step` or before it (WEIGHTS, newest first)."""
        s = self.bus.subjects
        first, last, _ = await self.bus.stream_bounds(s.weights_stream) or (1, 0, 0)
        for seq in range(last, first - 1, -1):
            raw = await self.bus.get_msg(s.weights_stream, seq)
            try:
                pub = decode(raw.data, WeightsPublished) if raw and raw.subject == s.weights_published else None
            except MalformedMessage:
                continue
            if pub is not None and pub.step <= step and await self.weights.have_snapshot(pub):
                return pub
        return None

    def _truncate_records(self, last_step: int) -> None:
        """Steps after the checkpoint are trained again: drop their records."""
        for path in (self.metrics_path, self.trained_path):
            keep_lines(path, lambda rec: rec["step"] <= last_step)
        sample_records.drop_after(self.run_dir, last_step)

    def loops(self):
        return {"train": self._train_loop if self.multi is None else self.multi.run}

    async def teardown(self) -> None:
        self.sinks.close()
        await self.weights.stop()
        if self.dp is not None:
            await asyncio.to_thread(self.dp.stop)

    # ---- the loop ------------------------------------------------------------------------------
    async def _train_loop(self) -> None:
        try:
            await self._train()
        except RunFailed as e:
            await self._finish(error=str(e))

    async def _train(self) -> None:
        c = self.config
        total = c.rollout.total_steps
        log.info(
            "training %d steps, mode %s, B=%d n=%d",
            total,
            c.infra.mode,
            c.rollout.rollout_batch_size,
            c.rollout.n_samples_per_prompt,
        )
        if c.infra.mode == "sync" and c.async_.update_weights_interval != 1:
            log.warning("--update-weights-interval %d is ignored by the synchronous driver (train): it is on-policy, "
                        "so it pushes the weights after every step", c.async_.update_weights_interval)  # fmt: skip
        if c.trainer.save and not c.trainer.save_interval:
            log.warning("--save without --save-interval saves no checkpoint (as in Miles; a restart resumes from the "
                        "last pushed weights, without the optimizer state): set --save-interval N")  # fmt: skip
        if (
            c.infra.mode != "sync"
            and total % c.async_.update_weights_interval
            and not (c.trainer.save_interval or c.trainer.save_trigger_sentinel)
        ):
            log.warning("the last %d steps end after the last weight push (--update-weights-interval %d) and nothing "
                        "saves them: set --save-interval to keep the final weights",
                        total % c.async_.update_weights_interval, c.async_.update_weights_interval)  # fmt: skip
        if self.policy.baseline_eval_due(self.step):  # named by the step it precedes
            await self.evals.request(self.step, rollout_id=self.step, version=self.version, start=True)
        self.loop_started = time.perf_counter()
        batch = await self._fetch(self.step) if self.step < total else None  # resumed after the last step?
        prefetch: asyncio.Future | None = None
        try:
            while self.step < total:
                step = self.step
                t_step = time.perf_counter()
                groups = batch.groups
                if c.infra.mode == "fully_async" and step + 1 < total and prefetch is None:
                    # as Miles's async driver: the next batch is drained while this one trains
                    prefetch = asyncio.ensure_future(self._fetch(step + 1))
                trained_from = self.version
                train_stats, train_s = await self._train_on(groups)
                crash.point("trainer", "optimizer_step_before_records")
                if train_stats.get("train/nonfinite_skipped"):
                    self.num_nonfinite_skipped += 1
                    log.error("step %d: the loss or the gradient norm is not finite; the update was skipped "
                              "(weights and optimizer unchanged)", step)  # fmt: skip
                update_due = self.policy.update_due(step)
                next_batch = None
                # fully async pushes at once, while step r+1's lease may still be filling (Miles's
                # driver waits for that rollout first; here that held every update back by the
                # slowest group and kept the engines a version behind). The lease's gets all carry
                # the version they started with, so its groups are judged against one clock.
                if update_due and c.infra.mode == "one_step" and step + 1 < total:
                    # the in-flight batch completes before the push, and nothing newer starts on old weights
                    next_batch = await self._fetch(step + 1, lookahead=0)
                push_s = await self._push_weights(step) if update_due else 0.0
                if next_batch is not None and c.infra.mode == "one_step":
                    await self._release_ahead(step + 1)  # step r+2 generates while r+1 trains, on the new weights
                # the step's records come before its checkpoint and its commit: a trainer killed in
                # between resumes from the checkpoint, drops the records after it and trains those
                # steps again, so a committed step always has its records (the audit checks it)
                append_trained(self.trained_path, step, groups)
                await self.sample_recorder.record(self.run_dir, step, trained_from, groups, batch.refs,
                                                  std_normalization(c))  # fmt: skip
                record = await self._record(step, batch, train_stats, train_s, push_s, time.perf_counter() - t_step)
                await self._emit(step, record)
                crash.point("trainer", "records_before_checkpoint")
                await self._checkpoint_and_commit(step, pushed=update_due)
                crash.point("trainer", "commit_before_next_step")
                self.step = step + 1
                self._check_failures(groups)
                if self.policy.eval_due(step):  # named by the step just trained, on Miles's axis
                    await self.evals.request(step + 1, rollout_id=step, version=self.version)
                if self.step < total:
                    if next_batch is not None:
                        batch = next_batch
                    elif prefetch is not None:
                        t0 = time.monotonic()
                        batch = dataclasses.replace(await prefetch, wait_s=time.monotonic() - t0)  # what it waited
                        prefetch = None
                    else:
                        batch = await self._fetch(self.step)
        finally:
            if prefetch is not None:
                prefetch.cancel()
        await self.evals.drain()
        await self._finish()

    async def _finish(self, error: str | None = None) -> None:
        total = self.config.rollout.total_steps
        if error is None:
            await self.weights.wait_final_broadcast(self.version)
        await self.records.finish(total, error=error, last_eval=self.evals.last)
        if error:
            log.error("the run failed at step %d: %s", self.step, error)
        else:
            log.info("training finished: %d steps, weight version %d", total, self.version)
        self.stop()

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

    async def _train_on(self, groups: list[list]) -> tuple[dict, float]:
        """One optimizer step on the groups of a durable lease."""
        t0 = time.perf_counter()
        c = self.config
        if self.dp is not None:
            stats = await asyncio.to_thread(self.dp.train, groups, self.loss_cfg)
            return stats, time.perf_counter() - t0
        max_tokens = max_tokens_of(c)
        steps = build_step_batches(groups, std_normalization(c), c.rollout.reward_key, self.pad_id, max_tokens,
                                   c.optimizer_steps_per_rollout)  # fmt: skip
        stats = await asyncio.to_thread(
            train_rollout,
            self.model,
            self.optimizer,
            steps,
            self.loss_cfg,
            c.trainer.clip_grad,
            self.ref_model,
            self.old_actor,
        )
        return stats, time.perf_counter() - t0

    # ---- batches -------------------------------------------------------------------------------
    async def _release_ahead(self, step: int) -> None:
        """Ask again for an already complete step, with lookahead: starts the next batch."""
        req = self.policy.get_request(step, self.version, lookahead=1, wait_s=0.0)
        await self.link.request(self.bus.subjects.buffer_get, req, BufferGetReply, "release of the next batch")

    async def _fetch(self, step: int, lookahead: int | None = None) -> Batch:
        """Wait for the step's B groups (a durable lease), with the buffer's metrics."""
        t0 = time.monotonic()
        a, req = self.config.async_, self.policy.get_request(step, self.version, lookahead)
        reply = await self.link.lease(req, lambda: self.last_producer_seen, a.rollout_wait_warn_s, a.producer_timeout_s)
        groups = [await self.link.load_group(ref) for ref in reply.refs]
        groups = assemble_batch(groups, self.config.rollout.n_samples_per_prompt)
        self.check.exclude_invalid(groups, max_version=self.version)
        if self.sample_filter is not None:
            self._apply_sample_filter(groups)
        elapsed = time.monotonic() - t0
        return Batch(groups, reply.metrics, rollout_time=elapsed, wait_s=elapsed,
                     refs={r.group_index: r for r in reply.refs})  # fmt: skip

    def _apply_sample_filter(self, groups: list[list]) -> None:
        try:
            apply_sample_filter(self.sample_filter, self.config, groups, self.config.rollout.rollout_sample_filter_path)
        except ValueError as e:
            raise TrainerError(str(e)) from e

    # ---- weights, commits, evals ---------------------------------------------------------------
    async def _push_weights(self, step: int) -> float:
        t0 = time.perf_counter()
        self.version += 1
        await self.weights.push(self.version, step, self.committed_version)
        if self.old_actor is not None:
            self.old_actor.load_state_dict(self.model.state_dict())
        return time.perf_counter() - t0

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
        if not (resumable or step + 1 == c.rollout.total_steps):
            return
        crash.point("trainer", "checkpoint_before_commit")
        await self._commit(step)

    async def _commit(self, step: int) -> None:
        if error := await self.link.commit(
            self.bus.subjects.buffer_commit, step, self.version, f"commit of step {step}"
        ):
            raise TrainerError(f"buffer refused commit of step {step}: {error}")
        self.committed_version = self.version

    async def _on_producer_heartbeat(self, msg) -> None:
        with contextlib.suppress(MalformedMessage):
            if not decode(msg.data, Heartbeat).info.get("stopping"):  # a last word is no sign of life
                self.last_producer_seen = time.monotonic()

    # ---- records -------------------------------------------------------------------------------
    async def _record(self, step: int, batch: Batch, train_stats: dict, train_s: float, push_s: float,
                      step_s: float) -> dict:  # fmt: skip
        """The step's metrics, with Miles's names on Miles's axis (rollout/step). A
        --custom-rollout-log-function-path that returns True replaces the rollout ones."""
        samples = [s for g in batch.groups for s in flatten_group(g)]
        tokens = sum(s.response_length for s in samples)
        rec = {
            "step": step,
            "rollout/step": step,
            "weight_version": self.version,
            "time": time.time(),
            "perf/rollout_wait_s": batch.wait_s,
            "perf/train_time_s": train_s,
            "perf/weight_push_s": push_s,
            "perf/step_time_s": step_s,
            "perf/elapsed_s": time.perf_counter() - self.loop_started,
            **train_stats,
        }
        custom = self.rollout_log_fn is not None and await self._custom_rollout_log(step, samples, batch)
        if not custom:
            rec.update(rollout_metrics(samples, self.config.rollout.reward_key, [g for g in batch.groups]))
            rec["perf/rollout_time"] = batch.rollout_time
            rec["perf/tokens_per_s"] = tokens / step_s if step_s > 0 else 0.0
            rec.update(batch.metrics)
        rec.update(self.evals.take_answered())
        return rec

    async def _custom_rollout_log(self, step: int, samples: list, batch: Batch) -> bool:
        """Miles's log_rollout_data(rollout_id, args, samples, rollout_extra_metrics, rollout_time)."""
        try:
            out = self.rollout_log_fn(step, self.config, samples, dict(batch.metrics), batch.rollout_time)
            if inspect.isawaitable(out):
                out = await out
            return bool(out)
        except Exception as e:  # a logging plugin never stops training: the default logging runs
            log.warning("--custom-rollout-log-function-path raised at step %d: %s", step, e)
            return False

    async def _emit(self, step: int, record: dict) -> None:
        record, bad = finite_record(record)
        if bad:
            log.error("step %d: %s were not finite; recorded as null", step, ", ".join(bad[:10]))
        self.observe("trainer/step_seconds", record["perf/step_time_s"])
        self.observe("trainer/rollout_wait_seconds", record["perf/rollout_wait_s"])
        await self.records.emit(step, record, "rollout/step")

    def status(self) -> dict:
        return {"step": self.step, "total_steps": self.config.rollout.total_steps, "weight_version": self.version,
                "mode": self.config.infra.mode, "last_record": self.records.last,
                "weight_transfer": self.weights.sender.status() if self.weights.sender is not None else None}  # fmt: skip

    def metric_values(self) -> dict[str, float]:
        out = {"trainer/step": self.step, "trainer/weight_version": self.version,
               "trainer/invalid_samples_total": self.check.num_invalid,
               "trainer/nonfinite_updates_skipped_total": self.num_nonfinite_skipped}  # fmt: skip
        out.update(
            {k: v for k, v in self.records.last.items() if isinstance(v, (int, float)) and k not in NOT_EXPORTED}
        )
        return out


def master_address(config) -> str:
    """Where the engines reach the trainer's weight transfer group: --update-weight-master-address,
    the node's address a Ray placement gave this process, or this host's address on its route to
    the NATS server (an address the other hosts of the run reach; 127.0.0.1 with a local server)."""
    import os
    from urllib.parse import urlsplit

    from services.model.transfer import local_address_towards
    from services.trainer.worker import NODE_IP_ENV

    if config.async_.update_weight_master_address:
        return config.async_.update_weight_master_address
    if os.environ.get(NODE_IP_ENV):
        return os.environ[NODE_IP_ENV]
    host = urlsplit((config.infra.nats_url or "").split(",")[0].strip()).hostname or "127.0.0.1"
    try:
        return local_address_towards(host)
    except OSError:
        return "127.0.0.1"
