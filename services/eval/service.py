"""Eval service: held-out evaluation off the trainer's critical path, three backends.

Consumes: EvalRequest from EVAL (durable pull consumer "eval"), one point at a time, in order.
Produces: EvalResult on `eval.results` (the trainer logs it with its next step, the launcher
  reports it) and a line in <run_dir>/eval.jsonl.
Backends (docs/services.md, "Evaluation"; EvalSection.backend picks one):
  shared   (default) the rollout engines at the live version: producers stop submitting for the
           eval's duration (in-flight requests finish and are buffered; nothing is aborted).
  fleet    (--eval-num-gpus) engines owned by this service: every point pins them to the point's
           HF snapshot (update_weights_from_disk, weight_version = str(eval/step), read back, one
           retry); an unhealthy fleet skips as `unhealthy`, a pin that does not hold as
           `pin_violation`. Training never pauses for it.
  external (--eval-function-path) a CheckpointEvalFn subclass evaluates the snapshot; EvalSkip
           records a skipped point with its reason.
A snapshot counts only with its `.complete` marker (`ckpt_missing` otherwise); an evaluator that
raises reports `crashed`. Snapshots exported for eval points are retired after their point on
every outcome, keeping the newest --eval-keep-snapshots; other snapshots are never deleted.
Metrics (Miles's names): eval/<dataset>, eval/<dataset>-truncated_ratio, eval/<dataset>-none_reward_ratio,
  eval/<dataset>/response_len/{mean,median,max,min}, eval/<dataset>/weight_version/{mean,median,max,min,
  mixed_version_ratio}, eval/duration_seconds (from dispatch: the time it queued included),
  eval/export_time_seconds, eval/step, eval/skipped_<reason>.
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import shutil
import time
from pathlib import Path

from asyncrl_proto import ControlMsg, EvalRequest, EvalResult, WeightsLive
from asyncrl_proto.messages import Sample, SampleStatus, scalar_reward
from services.common import crash, procs
from services.common.bus import Settle, fetch_some, keep_alive, settle
from services.common.config import AsyncSection, DataSection, EvalSection, RolloutSection, TrainerSection
from services.common.config.view import for_plugins
from services.common.plugins import load_object, maybe_await
from services.common.runtime import Service, wait_event
from services.common.sglang_client import SGLangClient
from services.common.sinks import length_statistics, statistics_of
from services.common.snapshot import is_complete, resolved
from services.common.validate import finite, finite_metrics, model_context_length
from services.common.versions import VersionBound
from services.envs.generate import EngineHandle, generate_function
from services.envs.trajectory import tool_call_metrics
from services.eval.contract import CheckpointEvalFn, EvalSkip
from services.eval.datasets import load_eval_sets
from services.eval.fleet import launch_fleet
from services.model.tokenizer import Tokenizer
from services.rewards import mark_failed, reward_function, score_sample

log = logging.getLogger(__name__)

FLEET_START_TIMEOUT_S = 900.0
HEALTH_TIMEOUT_S = 30.0
PAUSE_RENEW_S = 15.0
"""The shared backend renews its pause of submission this often (producers let it lapse after 60 s)."""


def point_name(req: EvalRequest) -> int:
    """The point's name on Miles's axis: eval/step, and the weight version it is pinned under."""
    return req.rollout_id if req.rollout_id is not None else req.step


class EvalService(Service):
    name = "eval"
    reads = (DataSection, RolloutSection, AsyncSection, TrainerSection, EvalSection)

    def __init__(self, config, bus, **kw):
        super().__init__(config, bus, **kw)
        config = self.config  # its own sections from here on (services.common.config.view)
        self.backend = config.eval.backend
        self.tokenizer = Tokenizer(config.data.hf_checkpoint)
        r = config.rollout
        self.sets = {  # --eval-prompt-data / --eval-config: each set, its rows and its reward
            ds.name: (ds, rows, reward_function(config, ds.rm_type or r.rm_type, r.custom_rm_path))
            for ds, rows in load_eval_sets(config)
        }
        i = config.infra
        urls = [i.rollout_router_url] if i.rollout_router_url else i.rollout_engine_urls
        self.client = SGLangClient(urls, api_key=self.engine_token)  # the shared backend's engines
        self.generate_fn = generate_function(config)  # at start: a connector's missing extra fails here
        self.fleet_client: SGLangClient | None = None
        self.fleet_children = []
        self.evaluator: CheckpointEvalFn | None = None
        if self.backend == "external":
            cls = load_object(config.eval.function_path, "--eval-function-path")
            if not (isinstance(cls, type) and issubclass(cls, CheckpointEvalFn)):
                raise ValueError(
                    f"--eval-function-path {config.eval.function_path} must name a CheckpointEvalFn subclass"
                )
            self.evaluator = cls(for_plugins(config))  # a plugin: the flat config
        path = config.eval.custom_eval_rollout_log_function_path
        self.eval_log_fn = load_object(path, "--custom-eval-rollout-log-function-path") if path else None
        self.live_version: int | None = None
        self._live_changed = asyncio.Event()
        self.exported: collections.deque[Path] = collections.deque()
        self.results: list[dict] = []
        self.busy = False
        self.published = VersionBound(bus)  # the newest weight version the trainer published

    # ---- setup -----------------------------------------------------------------------------
    async def setup(self) -> None:
        s = self.bus.subjects
        await self.bus.subscribe(s.weights_live, self._on_live)  # before the KV read: no gap
        await self._kv_live()
        if self.backend == "fleet":
            await self._start_fleet()
        self._psub = await self.bus.consume(s.consumers(self.config.async_.prompt_ack_wait_s)["eval"])

    async def _kv_live(self) -> None:
        """KV live_version, checked like a message: only a version the trainer published counts
        (a forged 10**9 would have every point evaluated at once on weights not yet live)."""
        if (live := await self.bus.kv_get("live_version", WeightsLive)) is None:
            return
        if await self.published.allows(live.version):
            self.live_version = max(self.live_version or 0, live.version)
        else:
            log.error("KV live_version names v%d, never published: ignored", live.version)

    async def _start_fleet(self) -> None:
        urls = list(self.config.eval.engine_urls)
        if not urls:
            self.fleet_children, urls = launch_fleet(
                self.config, Path(self.config.infra.run_dir) / "logs", self.engine_token
            )
        self.fleet_client = SGLangClient(urls, api_key=self.engine_token)
        deadline = time.monotonic() + FLEET_START_TIMEOUT_S
        for url in urls:
            while not await self.fleet_client.health_generate(url, timeout=5.0):
                if any(c.poll() is not None for c in self.fleet_children):
                    raise RuntimeError(
                        f"an eval fleet engine exited; see {self.config.infra.run_dir}/logs/eval-engine-*.log"
                    )
                if time.monotonic() > deadline:
                    raise RuntimeError(f"eval fleet engine {url} not healthy after {FLEET_START_TIMEOUT_S:.0f}s")
                await asyncio.sleep(0.5)
        log.info("eval fleet ready: %s", urls)

    async def teardown(self) -> None:
        if self.evaluator is not None:
            try:
                await maybe_await(self.evaluator.dispose())
            except Exception as e:  # shutting down anyway: say so, go on
                log.error("%s.dispose raised %s: %s", self.config.eval.function_path, type(e).__name__, e)
        for client in (self.client, self.fleet_client):
            if client is not None:
                await client.close()
        for child in self.fleet_children:
            procs.stop(child)

    async def _on_live(self, msg) -> None:
        if (live := await self.bus.decode_or_dead_letter(msg, WeightsLive)) is None:
            return
        if not await self.published.allows(live.version):
            await self.bus.dead_letter(msg.subject, msg.data, f"live version {live.version} was never published")
            return
        if self.live_version is None or live.version > self.live_version:
            self.live_version = live.version
            self._live_changed.set()

    def loops(self):
        return {"evaluate": self._evaluate_loop}

    # ---- the loop ------------------------------------------------------------------------------
    async def _evaluate_loop(self) -> None:
        while True:
            for msg in await fetch_some(self._psub, 1, 1.0):
                if (req := await self.bus.decode_or_dead_letter(msg, EvalRequest, jetstream=True)) is None:
                    continue
                if (problem := await self._request_problem(req)) is not None:
                    await self.bus.dead_letter_msg(msg, problem)
                    continue
                async with keep_alive(msg):  # a point takes longer than the ack wait; a dead service's does not
                    result = await self._run_point(req, msg)
                await self.bus.publish_durably([(self.bus.subjects.eval_results, result, None)], "an eval result")
                with (Path(self.config.infra.run_dir) / "eval.jsonl").open("a") as f:
                    f.write(json.dumps({"step": result.step, "version": result.version, "final": result.final,
                                        "skipped": result.skipped_reason, **result.metrics}) + "\n")  # fmt: skip
                self._retire(req)
                await settle(msg)

    async def _request_problem(self, req: EvalRequest) -> str | None:
        """An eval point the trainer would never ask for: a step outside the run, a weight version
        nobody published (the shared backend would wait for it forever), a snapshot outside the
        run's own directories."""
        c = self.config
        if not 0 <= req.step <= c.rollout.total_steps:
            return f"eval request for step {req.step}, outside the run's 0..{c.rollout.total_steps}"
        if req.rollout_id is not None and req.rollout_id not in (req.step, req.step - 1) or point_name(req) < 0:
            return f"eval request named rollout {req.rollout_id} for the weights after {req.step} steps"
        if not await self.published.allows(req.version):
            return f"eval request for weight version {req.version}, never published (newest {self.published.value})"
        if req.snapshot_uri and not self._is_run_snapshot(req.snapshot_uri):
            return f"eval snapshot {req.snapshot_uri!r:.200} is outside the run's directories"
        if not finite(req.export_time_s) or req.export_time_s < 0:
            return f"eval request with export time {req.export_time_s}"
        return None

    def _is_run_snapshot(self, uri: str) -> bool:
        c = self.config
        path = resolved(uri)
        roots = [Path(p).resolve() for p in (c.infra.run_dir, c.trainer.save_hf, c.eval.hf_dir) if p]
        return path is not None and (
            path == Path(c.data.hf_checkpoint).resolve() or any(path.is_relative_to(r) for r in roots)
        )

    async def _run_point(self, req: EvalRequest, msg) -> EvalResult:
        t0 = time.perf_counter()
        self.busy = True
        skipped, metrics = None, {}
        try:
            metrics = await {"shared": self._shared, "fleet": self._fleet}.get(self.backend, self._external)(req, msg)
            crash.point("eval", "mid_point")
            metrics, dropped = finite_metrics(metrics)
            if dropped:
                log.warning("eval at step %d: metrics %s are not finite numbers; left out", req.step, dropped)
        except EvalSkip as e:  # the service's own skips too
            skipped = e.reason
        except Exception as e:
            log.exception("eval at step %d crashed: %s", req.step, e)
            skipped = "crashed"
        finally:
            self.busy = False
        duration = time.perf_counter() - t0
        queued = time.time() - req.requested_at  # as Miles: from the point's dispatch, its wait included
        if 0 < req.requested_at and duration <= queued < 7 * 86400:  # (a clock from another host may be off)
            duration = queued
        metrics = {**metrics, "eval/step": point_name(req), "eval/duration_seconds": duration}
        if req.exported:
            metrics["eval/export_time_seconds"] = req.export_time_s
        if skipped:
            metrics[f"eval/skipped_{skipped}"] = 1.0
            log.warning("eval point %d skipped: %s", req.step, skipped)
        else:
            shown = {k: round(v, 4) for k, v in metrics.items() if k.count("/") == 1 and "seconds" not in k}
            log.info("eval at step %d (v%d, %s): %s", req.step, req.version, self.backend, shown)
        self.results.append({"step": req.step, "skipped": skipped, **metrics})
        return EvalResult(step=req.step, version=req.version, metrics=metrics, skipped_reason=skipped,
                          duration_s=duration, final=req.final)  # fmt: skip

    def _retire(self, req: EvalRequest) -> None:
        """Exported snapshots retire on every outcome; the newest --eval-keep-snapshots stay."""
        if not (req.exported and req.snapshot_uri):
            return
        self.exported.append(Path(req.snapshot_uri))
        while len(self.exported) > self.config.eval.keep_snapshots:
            shutil.rmtree(self.exported.popleft(), ignore_errors=True)

    # ---- backends ------------------------------------------------------------------------------
    async def _shared(self, req: EvalRequest, msg) -> dict[str, float]:
        while self.live_version is None or self.live_version < req.version:
            self._live_changed.clear()
            if not await wait_event(self._live_changed, 10.0):
                await self._kv_live()
                await settle(msg, Settle.IN_PROGRESS)
        token = f"eval-{req.step}"  # the same for a redelivered point: it resumes what a killed one paused
        await self._control("pause_submission", token)
        renew = asyncio.ensure_future(self._renew_pause(token))
        try:
            return await self._evaluate_all(self.client, req)
        finally:
            renew.cancel()
            await self._control("resume_submission", token)

    async def _renew_pause(self, token: str) -> None:
        """Producers let a pause lapse unless it is renewed (so a crashed eval service never
        leaves production stopped): renew ours while the point is evaluated."""
        while True:
            await asyncio.sleep(PAUSE_RENEW_S)
            await self._control("pause_submission", token)

    def _snapshot(self, req: EvalRequest) -> str:
        path = resolved(req.snapshot_uri) if req.snapshot_uri else None
        initial = Path(self.config.data.hf_checkpoint).resolve()  # not written by this run: it has no marker
        if path is None or not path.is_dir() or not (is_complete(path) or path.resolve() == initial):
            raise EvalSkip("ckpt_missing")
        return str(path)

    async def _fleet(self, req: EvalRequest, msg) -> dict[str, float]:
        snapshot = self._snapshot(req)
        c = self.fleet_client
        health = await asyncio.gather(*(c.health_generate(u, HEALTH_TIMEOUT_S) for u in c.urls))
        if not all(health):
            raise EvalSkip("unhealthy")
        pinned = await asyncio.gather(*(c.pin(u, snapshot, str(point_name(req))) for u in c.urls))
        if not all(pinned):
            raise EvalSkip("pin_violation")
        return await self._evaluate_all(c, req)

    async def _external(self, req: EvalRequest, msg) -> dict[str, float]:
        snapshot = self._snapshot(req)
        inp = {
            "step": point_name(req),
            "weight_version": str(point_name(req)),
            "trainer_version": req.version,
            "datasets": {name: rows for name, (_, rows, _) in self.sets.items()},
            "n_samples_per_prompt": self.config.eval.n_samples_per_eval_prompt,
            "sampling_params": next(iter(self.sets.values()))[0].sampling_params() if self.sets else {},
            "dataset_settings": {name: {"n_samples_per_eval_prompt": ds.n_samples_per_eval_prompt,
                                        "sampling_params": ds.sampling_params(), "rm_type": ds.rm_type}
                                 for name, (ds, _, _) in self.sets.items()},
        }  # fmt: skip
        out = await maybe_await(self.evaluator.evaluate_checkpoint(snapshot, inp))
        return {(k if k.startswith("eval/") else f"eval/{k}"): float(v) for k, v in (out or {}).items()}

    # ---- generation and scoring ----------------------------------------------------------------
    async def _evaluate_all(self, client: SGLangClient, req: EvalRequest) -> dict[str, float]:
        c, data = for_plugins(self.config), {}
        for name, (ds, rows, reward_fn) in self.sets.items():  # one set after another
            params, n = ds.sampling_params(), ds.n_samples_per_eval_prompt
            data[name] = await generate_dataset(client, self.tokenizer, reward_fn, c, rows, params, n, self.generate_fn)
        if self.eval_log_fn is not None and await self._custom_eval_log(req, data):
            return {}
        return {k: v for name, samples in data.items() for k, v in dataset_metrics(self.config, name, samples).items()}

    async def _custom_eval_log(self, req: EvalRequest, data: dict[str, list[Sample]]) -> bool:
        """Miles's log_eval_rollout_data(rollout_id, args, data, extra_metrics): True skips the
        default eval metrics of the point (the point is still answered, with eval/step)."""
        payload = {
            name: {"rewards": [s.reward for s in samples], "truncated": [s.status == SampleStatus.TRUNCATED
                   for s in samples], "samples": samples}
            for name, samples in data.items()
        }  # fmt: skip
        try:
            out = self.eval_log_fn(point_name(req), for_plugins(self.config), payload, {"eval/step": point_name(req)})
            return bool(await maybe_await(out))
        except Exception as e:  # a logging plugin never loses the point: the default metrics are kept
            log.warning("--custom-eval-rollout-log-function-path raised at eval point %d: %s", point_name(req), e)
            return False

    async def _control(self, command: str, token: str) -> None:
        await self.bus.publish_core(
            self.bus.subjects.control, ControlMsg(command=command, token=token, issued_at=time.time())
        )
        await self.bus.flush()

    def status(self) -> dict:
        return {"backend": self.backend, "busy": self.busy, "live_version": self.live_version,
                "fleet": self.fleet_client.urls if self.fleet_client else [],
                "datasets": {k: len(rows) for k, (_, rows, _) in self.sets.items()},
                "results": self.results[-10:]}  # fmt: skip

    def metric_values(self) -> dict[str, float]:
        return {"eval/busy": float(self.busy), "eval/points_total": len(self.results),
                "eval/points_skipped_total": sum(1 for r in self.results if r["skipped"]),
                "eval/dead_lettered_total": sum(self.bus.dead_lettered.values())}  # fmt: skip


async def generate_dataset(
    client, tokenizer, reward_fn, config, rows: list[dict], params: dict, n: int, generate=None
) -> list[Sample]:
    """n scored samples per held-out prompt on `client`'s engines, each produced by the run's
    generate function (services/envs/generate.py; `generate`: it, resolved), as the producer
    produces training samples."""

    generate = generate or generate_function(config)
    engine = EngineHandle(client, tokenizer, model_context_length(config.data.hf_checkpoint))

    async def one(row: dict, index: int) -> list[Sample]:
        ids = tokenizer.prompt_ids(row["prompt"], config.data.apply_chat_template, row.get("tools"))
        meta = dict(row["metadata"], _input_ids=ids)
        s = Sample(index=index, prompt=row["prompt"], label=row["label"], metadata=meta)
        try:
            out = await generate(config, s, engine, params)
        except Exception as e:  # one failed episode (an environment's error) fails its sample, not the point
            s.metadata.pop("_input_ids", None)
            mark_failed(s, f"generation failed: {type(e).__name__}: {e}", "generate_error")
            return [s]
        out = out if isinstance(out, list) else [out]  # a generate function may return a trajectory's samples
        for x in out:
            x.metadata.pop("_input_ids", None)
            await score_sample(reward_fn, config, x)
        return out

    done = await asyncio.gather(*(one(r, i * n + k) for i, r in enumerate(rows) for k in range(n)))
    return [x for samples in done for x in samples]


def dataset_metrics(config, name: str, samples: list[Sample]) -> dict[str, float]:
    """Mean reward and the facts of one held-out set, with Miles's names."""
    rewards = [scalar_reward(s, config.rollout.reward_key) for s in samples]
    versions = [min(s.weight_versions) for s in samples if s.weight_versions]
    out = {
        f"eval/{name}": sum(rewards) / len(rewards),  # Miles's names: "<set>-<ratio>", "<set>/<facts>/<stat>"
        f"eval/{name}-truncated_ratio": sum(s.status == SampleStatus.TRUNCATED for s in samples) / len(samples),
        f"eval/{name}-none_reward_ratio": sum(s.reward is None for s in samples) / len(samples),
        **length_statistics(f"eval/{name}/response_len", [s.response_length for s in samples]),
        **tool_call_metrics(f"eval/{name}-tool_call_ratio", samples),
    }
    if versions:
        out.update(statistics_of(f"eval/{name}/weight_version", versions))
        mixed = sum(len(set(s.weight_versions)) > 1 for s in samples)
        out[f"eval/{name}/weight_version/mixed_version_ratio"] = mixed / len(samples)
    return out


async def evaluate_dataset(
    client, tokenizer, reward_fn, config, name: str, rows: list[dict], params: dict, n: int
) -> dict:
    return dataset_metrics(config, name, await generate_dataset(client, tokenizer, reward_fn, config, rows, params, n))
