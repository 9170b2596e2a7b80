"""Rollout producer: turns released prompts into scored groups.

Consumes: PromptMsg from the PROMPTS work queue (durable pull consumer "producers", shared by
  every producer: a new producer joins by starting). Control commands (pause/resume submission).
Produces: RolloutGroup on ROLLOUTS, published with Nats-Msg-Id = group id (retries dedupe); the
  prompt is acknowledged only after its group is durably published, so a producer killed with
  SIGKILL loses nothing: after ack_wait its prompts are redelivered to the others.
Talks to: inference engines over the SGLang HTTP protocol (SGLangClient).
Backpressure: submission credits (services.rollout.core.Credits) cap the trajectories in
  flight; the buffer's release policy caps the prompts available at all.
Shutdown: stop fetching; in-flight groups are cancelled and their prompts nak'ed (redelivered
  to the other producers at once; after ack_wait if the nak is lost).
HTTP: /status (credits, groups in flight, paused), POST /control/pause_submission, /control/resume_submission.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from fastapi import FastAPI

from asyncrl_proto import ControlMsg, PromptMsg, RolloutGroup, Sample, group_id
from asyncrl_proto.messages import SampleStatus, flatten_group
from services.common import crash
from services.common.bus import Settle, fetch_some, keep_alive, settle, until_room
from services.common.config import AsyncSection, DataSection, EvalSection, MultiLoraSection, RolloutSection
from services.common.config.view import for_plugins
from services.common.repeats import Repeats
from services.common.runtime import Service
from services.common.schedule import is_eval_point
from services.common.sglang_client import SGLangClient
from services.common.validate import MAX_ATTEMPT, limits_from_model_dir, sample_problem
from services.envs.generate import EngineHandle, default_generate, generate_function  # noqa: F401 (plugins import them here)
from services.model.tokenizer import Tokenizer
from services.rewards import mark_failed, resolve_reward, score_group, score_sample
from services.rollout.adapters import AdapterMode
from services.rollout.core import Credits, Pauses
from services.rollout.modes import GroupContext, PromptError, Refuse, Requeue, SingleModel

PAUSE_TTL_S = 60.0
"""A pause of submission sent over NATS lapses this long after it was last sent."""
MAX_GROUP_DELIVERIES = 5
"""A group whose generation fails this many times on one producer is published as FAILED."""
RETRY_BACKOFF_S = 1.0
"""A failed group's prompt is redelivered after RETRY_BACKOFF_S * 2^(delivery - 1), at most 30 s."""

log = logging.getLogger(__name__)


class RolloutService(Service):
    name = "rollout"
    reads = (DataSection, RolloutSection, AsyncSection, MultiLoraSection, EvalSection)

    def __init__(self, config, bus, **kw):
        super().__init__(config, bus, **kw)
        config = self.config  # its own sections from here on (services.common.config.view)
        a, r = config.async_, config.rollout
        self.n = r.n_samples_per_prompt
        self.credits = Credits(config.inflight_groups, self.n, config.submission_granularity)
        self.tokenizer = Tokenizer(config.data.hf_checkpoint)
        self.limits = limits_from_model_dir(config.data.hf_checkpoint, self.n, r.reward_key, r.max_abs_reward)
        self.reward_fn = resolve_reward(config)
        self.generate_fn = generate_function(config)
        routed = bool(config.infra.rollout_router_url)  # a router spreads over every engine: their slots together
        self.client = SGLangClient(
            [config.infra.rollout_router_url] if routed else config.infra.rollout_engine_urls,
            api_key=self.engine_token,
            max_concurrency=r.sglang_server_concurrency * (max(1, config.infra.rollout_num_engines) if routed else 1),
        )
        self.engine = EngineHandle(self.client, self.tokenizer, self.limits.context_length)
        self.submission_open = asyncio.Event()
        self.submission_open.set()
        points = (r.total_steps, config.eval.interval, r.num_rollout_per_epoch, config.infra.mode)
        self.repeats = Repeats(log)
        self.pauses = Pauses(PAUSE_TTL_S, a.submission_pause_max_s, lambda step: is_eval_point(step, *points),
                             a.submission_pause_budget * a.submission_pause_window_s, a.submission_pause_window_s)  # fmt: skip
        self.groups_in_flight: dict[int, tuple[object, float, int]] = {}
        """id(msg) -> (msg, when it started, the group index it generates: named in heartbeats)."""
        self.failures: dict[str, int] = {}  # group id -> generation failures seen here
        self.counters = dict.fromkeys(
            ("groups_published", "samples_generated", "reward_failures", "group_failures", "bad_prompts",
             "adapter_not_loaded_requeued", "input_full"),
            0,
        )  # fmt: skip
        self._input_full_from: int | None = None
        """The input_full count when the buffer's input stream last filled (None: it has room)."""
        self.mode = (AdapterMode(config, bus, self.engine, self.counters) if config.multi_lora.n_adapters > 0
                     else SingleModel(config, bus.subjects, self.engine, self.reward_fn))  # fmt: skip

    def sampling_params(self) -> dict:
        c = self.config
        return {
            "max_new_tokens": c.rollout.max_response_len,
            "temperature": c.rollout.temperature,
            "top_p": c.rollout.top_p,
            "top_k": c.rollout.top_k,
            "stop_token_ids": list(c.rollout.stop_token_ids),
            "no_stop_trim": True,
            "skip_special_tokens": True,
        }

    async def setup(self) -> None:
        s = self.bus.subjects
        self._psub = await self.bus.consume(
            s.consumers(self.config.async_.prompt_ack_wait_s, self.mode.partitioned)["producers"]
        )
        await self.bus.subscribe(s.control, self._on_control)
        log.info(
            "producer %s ready: %d groups in flight max, %s granularity, engines %s",
            self.instance_id,
            self.config.inflight_groups,
            self.credits.granularity,
            self.client.urls,
        )

    async def teardown(self) -> None:
        await self.client.close()

    def loops(self):
        loops = {"submit": self._submit_loop, "pauses": self._lapse_pauses}
        if (a := self.config.async_).rollout_health_check_interval > 0:
            loops["engine_health"] = lambda: self.client.monitor_health(
                a.rollout_health_check_interval, a.rollout_health_check_timeout
            )
        return loops

    # ---- submission --------------------------------------------------------------------------
    async def _submit_loop(self) -> None:
        tasks: set[asyncio.Task] = set()
        try:
            while True:
                await self.submission_open.wait()
                free = self.credits.free_groups
                if free == 0:
                    await self.credits.wait_changed(1.0)
                    continue
                for msg in await fetch_some(self._psub, free, 1.0):
                    # a fetch can also return late messages of an earlier, expired fetch: never go
                    # over the cap, and never hold a prompt while submission is paused
                    if not self.submission_open.is_set() or self.credits.free_groups == 0:
                        await settle(msg, Settle.NAK)
                        continue
                    self.credits.take_group()
                    t = asyncio.create_task(self._run_group(msg))
                    tasks.add(t)
                    t.add_done_callback(tasks.discard)
        finally:  # shutting down: in-flight groups are cancelled and their prompts given back
            for t in tasks:
                t.cancel()
            if tasks:  # the runtime re-cancels this loop every second: the naks are sent by then
                with contextlib.suppress(asyncio.CancelledError):
                    await asyncio.wait(tasks, timeout=1.0)

    async def _run_group(self, msg) -> None:
        if (prompt := await self.bus.decode_or_dead_letter(msg, PromptMsg, jetstream=True)) is None:
            self.counters["bad_prompts"] += 1
            self.credits.group_done(0)
            return
        try:
            input_ids = self._prompt_ids(prompt)
        except PromptError as e:
            # a prompt we cannot generate from: settled as a FAILED group with the reason, so
            # its fate is on the ledger (an identity that does not hold is only dead-lettered)
            self.counters["bad_prompts"] += 1
            self.credits.group_done(0)
            if prompt.group_index < 0 or not 0 <= prompt.attempt <= MAX_ATTEMPT:
                await self.bus.dead_letter_msg(msg, f"PromptMsg: {e}")
            else:
                await self._publish_failed(msg, prompt, time.time(), f"invalid prompt: {e}")
            return
        started = time.time()
        try:
            ctx = await self.mode.context(msg, prompt)
        except Requeue as e:
            self.credits.group_done(0)
            await settle(msg, Settle.NAK, delay=e.delay)
            return
        except Refuse as e:
            self.credits.group_done(0)
            await self._publish_failed(msg, prompt, started, str(e))
            return
        self.groups_in_flight[id(msg)] = (msg, started, prompt.group_index)
        given_back = [0]  # credits this group already returned, trajectory by trajectory
        if (spare := self.n - self.mode.group_size(prompt)) > 0:  # a smaller group: its spare credits now
            self.credits.give_back(spare)
            given_back[0] = spare
        async with keep_alive(msg, max(0.5, self.config.async_.prompt_ack_wait_s / 3)):  # only the dead lose prompts
            try:
                try:
                    rg = await self._generate_group(prompt, input_ids, started, given_back, ctx)
                except asyncio.CancelledError:
                    # stopping: the prompt goes back to the queue now rather than after ack_wait
                    # (a nak is one buffered publish, sent at the latest when the connection closes)
                    with contextlib.suppress(BaseException):
                        await asyncio.wait_for(settle(msg, Settle.NAK), 2.0)
                    raise
                except Exception as e:
                    if (delay := await self.mode.requeue_after(msg, e)) is not None:
                        await settle(msg, Settle.NAK, delay=delay)
                        return
                    await self._group_failed(msg, prompt, started, e)
                    return
                self.failures.pop(rg.group_id, None)
                crash.point("rollout", "generated_before_publish")
                try:
                    await self._publish_group(msg, rg)
                except Exception as e:  # the broker is away: the finished work is not a failure
                    log.warning("publishing group %s failed (%s); its prompt goes back to the queue", rg.group_id, e)
                    await settle(msg, Settle.NAK, delay=1.0)
                    return
                crash.point("rollout", "published_before_ack")
                await settle(msg)
                self.counters["groups_published"] += 1
                self.counters["samples_generated"] += len(rg.samples)
            finally:
                self.groups_in_flight.pop(id(msg), None)
                self.credits.group_done(given_back[0])

    async def _publish_group(self, msg, rg: RolloutGroup) -> None:
        """Publish a finished group, holding its prompt: while the buffer's input stream holds its
        message cap (the buffer is behind, or a flood filled it), wait and try again, counted
        (rollout/producer/input_full_total): the work is never dropped. Logged when the stream
        fills and when it has room again, with the count between, not once per refusal."""

        def full(error: Exception, refusals: int) -> None:
            self.counters["input_full"] += 1
            if self._input_full_from is None:
                self._input_full_from = self.counters["input_full"] - 1
                log.warning("the buffer's input stream is full (%s): finished groups wait for room", error)

        subject, msg_id = self.mode.destination(msg, rg.group_id)
        async with keep_alive(msg):
            await until_room(lambda: self.bus.publish(subject, rg, msg_id=msg_id), full)
        if self._input_full_from is not None:
            log.warning("the buffer's input stream has room again (%d publishes waited for it)",
                        self.counters["input_full"] - self._input_full_from)  # fmt: skip
            self._input_full_from = None

    async def _generate_group(
        self, prompt: PromptMsg, input_ids: list[int], started: float, given_back: list[int], ctx: GroupContext
    ) -> RolloutGroup:
        samples = [self._new_sample(prompt, i, _input_ids=input_ids) for i in range(self.mode.group_size(prompt))]
        tasks = [asyncio.create_task(self._run_trajectory(s, given_back, ctx)) for s in samples]
        try:
            group = await asyncio.gather(*tasks)
        except BaseException:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)  # all settle before the group fails
            raise
        ctx.finish(group)
        if ctx.group_rm:
            if not await score_group(ctx.reward_fn, for_plugins(self.config), group):
                self.counters["reward_failures"] += len(group)
        self._check_samples(group)
        return self._group(prompt, group, started)

    async def _group_failed(self, msg, prompt: PromptMsg, started: float, error: Exception) -> None:
        """Generation failed (every retry on every engine): back to the queue with a growing
        delay; the MAX_GROUP_DELIVERIES-th failure seen here publishes the group as FAILED."""
        self.counters["group_failures"] += 1
        gid = group_id(prompt.group_index, prompt.attempt)
        failures = self.failures[gid] = self.failures.get(gid, 0) + 1
        if failures < MAX_GROUP_DELIVERIES:
            delay = min(RETRY_BACKOFF_S * 2.0 ** (failures - 1), 30.0)
            log.error("group %s failed (%d of %d), its prompt goes back to the queue in %.1fs: %s",
                      gid, failures, MAX_GROUP_DELIVERIES, delay, error)  # fmt: skip
            await settle(msg, Settle.NAK, delay=delay)
            return
        # settled as a FAILED group: the buffer and the ledger account for it (zero loss, it
        # trains nothing), and a prompt that can never succeed does not loop forever
        log.error("group %s failed %d times; published as FAILED: %s", gid, failures, error)
        await self._publish_failed(msg, prompt, started, f"{type(error).__name__}: {error}")

    async def _publish_failed(self, msg, prompt: PromptMsg, started: float, reason: str) -> None:
        samples = [self._new_sample(prompt, i, SampleStatus.FAILED, error=reason[:1000])
                   for i in range(self.mode.group_size(prompt))]  # fmt: skip
        rg = self._group(prompt, samples, started)
        try:
            await self._publish_group(msg, rg)
        except Exception as e:  # the broker is away: the prompt comes back and fails once more
            log.error("publishing failed group %s: %s", rg.group_id, e)
            await settle(msg, Settle.NAK, delay=1.0)
            return
        self.failures.pop(rg.group_id, None)
        await settle(msg)

    def _prompt_ids(self, prompt: PromptMsg) -> list[int]:
        """The token ids to generate from; PromptError when a released prompt cannot be used."""
        if prompt.group_index < 0 or not 0 <= prompt.attempt <= MAX_ATTEMPT:
            raise PromptError(f"group_index {prompt.group_index} / attempt {prompt.attempt} out of range")
        self.mode.check(prompt)
        try:
            ids = self.tokenizer.prompt_ids(prompt.prompt, self.config.data.apply_chat_template, prompt.tools)
        except Exception as e:  # a prompt of the wrong shape, a template that fails on it
            raise PromptError(f"cannot tokenize the prompt: {type(e).__name__}: {e}") from None
        lim = self.limits
        if not ids or min(ids) < 0 or max(ids) >= lim.vocab_size:
            raise PromptError(f"the prompt's token ids are empty or outside the vocabulary [0, {lim.vocab_size})")
        if len(ids) >= lim.context_length:
            raise PromptError(f"the prompt ({len(ids)} tokens) does not fit the context length {lim.context_length}")
        return ids

    def _check_samples(self, samples: list[Sample]) -> None:
        """What a generate or reward function produced that cannot be trained on (ids outside
        the vocabulary, a sample longer than the context, mismatched log-probs...) is marked
        FAILED with the reason and stripped of its tokens, so that the group, valid as a whole,
        still settles its prompt."""
        for s in flatten_group(samples):
            if s.status != SampleStatus.FAILED and (problem := sample_problem(s, self.limits)) is not None:
                log.warning("sample %s cannot be trained on: %s", s.index, problem)
                mark_failed(s, problem, key="error")
                s.tokens, s.response_length, s.rollout_log_probs, s.loss_mask = [], 0, [], None

    def _group(self, prompt: PromptMsg, samples: list[Sample], started: float) -> RolloutGroup:
        return RolloutGroup(
            group_id=group_id(prompt.group_index, prompt.attempt),
            group_index=prompt.group_index,
            attempt=prompt.attempt,
            samples=samples,
            producer_id=self.instance_id,
            created_at=time.time(),
            generate_time_s=time.time() - started,
            epoch=prompt.epoch,
            row=prompt.row,
        )

    def _new_sample(self, prompt: PromptMsg, i: int, status=SampleStatus.PENDING, **metadata) -> Sample:
        """Trajectory i of the prompt's group: its prompt, label and metadata, plus `metadata`."""
        return Sample(
            index=prompt.group_index * self.mode.group_size(prompt) + i,
            group_index=prompt.group_index,
            prompt=prompt.prompt,
            label=prompt.label,
            metadata={**prompt.metadata, **metadata},
            status=status,
        )

    async def _run_trajectory(self, sample: Sample, given_back: list[int], ctx: GroupContext):
        out = await self.generate_fn(for_plugins(self.config), sample, ctx.engine, self.sampling_params())
        sample.metadata.pop("_input_ids", None)
        trajectory = out if isinstance(out, list) else [out]
        if not ctx.group_rm:
            for s in trajectory:
                if s.status != SampleStatus.ABORTED and not await score_sample(ctx.reward_fn, for_plugins(self.config), s):
                    self.counters["reward_failures"] += 1
        given_back[0] += self.credits.trajectory_done()
        return out

    # ---- control ---------------------------------------------------------------------------------
    async def _on_control(self, msg) -> None:
        if (ctl := await self.bus.decode_or_dead_letter(msg, ControlMsg)) is None:
            return
        token = ctl.token or ctl.reason
        if ctl.command not in ("pause_submission", "resume_submission") or len(token) > 200:
            await self.bus.dead_letter(msg.subject, msg.data, f"unknown control command {ctl.command!r:.60}")
            return
        if ctl.command == "pause_submission":
            was = self.pauses.paused
            if (refused := self.pauses.pause_over_nats(token, time.monotonic())) is not None:
                self.repeats.say("pause refused", f"refused: {refused}", kind=refused.replace(token, "<token>").split(":")[0])
                await self.bus.dead_letter(msg.subject, msg.data, refused)
            elif not was:
                log.info("submission paused (%s)", token)
        else:
            self.pauses.resume(token)
        self._gate()

    def _gate(self) -> None:
        """Submission is open exactly while no pause holds."""
        if self.pauses.paused:
            self.submission_open.clear()
        elif not self.submission_open.is_set():
            self.submission_open.set()
            log.info("submission resumed")

    async def _lapse_pauses(self) -> None:
        while True:
            await asyncio.sleep(1.0)
            for token in self.pauses.lapse(time.monotonic()):
                log.warning("the pause %r lapsed (not renewed for %.0fs, or held for its longest, %.0fs)", token,
                            PAUSE_TTL_S, self.pauses.max_s)  # fmt: skip
            self._gate()

    def add_routes(self, app: FastAPI) -> None:
        @app.post("/control/pause_submission")
        async def pause_submission():  # the admin's: a pause that holds until resumed
            self.pauses.pause_by_admin("http")
            self._gate()
            return {"paused": True}

        @app.post("/control/resume_submission")
        async def resume_submission():
            self.pauses.resume("http")
            self._gate()
            return {"paused": not self.submission_open.is_set()}

    def heartbeat_info(self) -> dict:
        """The cap, and the groups this producer is generating (their prompts are in work)."""
        in_work = sorted(gi for _, _, gi in self.groups_in_flight.values())
        return {"inflight_groups": self.config.inflight_groups, "in_work": in_work}

    def status(self) -> dict:
        c = self.client
        return {
            "granularity": self.credits.granularity,
            "credits_free": self.credits.free,
            "credits_total": self.credits.total,
            "groups_in_flight": len(self.groups_in_flight),
            "submission_paused": not self.submission_open.is_set(),
            "engines": {u: {"outstanding": c.outstanding[u], "healthy": c.healthy[u]} for u in c.urls},
            "generate_retries": c.num_retried,
            "generate_aborted": c.num_aborted,
            **self.counters,
        }

    def metric_values(self) -> dict[str, float]:
        return {
            "rollout/producer/in_flight_samples": self.credits.in_flight,
            "rollout/producer/groups_in_flight": len(self.groups_in_flight),
            "rollout/producer/submission_paused": float(not self.submission_open.is_set()),
            **{f"rollout/producer/{k}_total": v for k, v in self.counters.items()},
        }
