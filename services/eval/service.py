"""Eval service (shared-engines backend): held-out evaluation off the trainer's critical path.

Consumes: EvalRequest from EVAL (durable pull consumer "eval"), one at a time, in order.
Produces: EvalResult on `eval.results` (the trainer logs it with its next step, the launcher
  reports it) and a line in <run_dir>/eval.jsonl.
Per eval point: wait until the engines run at least the requested weight version; tell the
  producers to stop submitting (in-flight requests finish and are buffered; nothing is aborted);
  generate --n-samples-per-eval-prompt samples per held-out prompt on the rollout engines;
  score them with the task's reward; let the producers resume.
Metrics: eval/<dataset> (mean reward), eval/<dataset>/weight_version/{mean,mixed_version_ratio},
  eval/duration_seconds, eval/step.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from pathlib import Path

from asyncrl_proto import ControlMsg, EvalRequest, EvalResult, Sample, WeightsLive, decode
from asyncrl_proto.codec import DecodeError
from services.buffer.datasource import load_rows
from services.common.bus import fetch_some, settle
from services.common.runtime import Service, wait_event
from services.common.sglang_client import SGLangClient
from services.model.tokenizer import Tokenizer
from services.rollout.core import apply_response
from services.rollout.rewards import resolve_reward, score_sample

log = logging.getLogger(__name__)


def eval_datasets(config) -> list[tuple[str, str]]:
    pairs = config.eval_prompt_data
    return [(pairs[i], pairs[i + 1]) for i in range(0, len(pairs), 2)]


class EvalService(Service):
    name = "eval"

    def __init__(self, config, bus, **kw):
        super().__init__(config, bus, **kw)
        self.client = SGLangClient(
            [config.rollout_router_url] if config.rollout_router_url else config.rollout_engine_urls
        )
        self.tokenizer = Tokenizer(config.hf_checkpoint)
        self.reward_fn = resolve_reward(config)
        self.datasets = {
            name: load_rows(path, config.input_key, config.label_key, config.metadata_key)
            for name, path in eval_datasets(config)
        }
        self.live_version: int | None = None
        self._live_changed = asyncio.Event()
        self.results: list[dict] = []
        self.busy = False
        self._psub = None

    async def setup(self) -> None:
        s = self.bus.subjects
        await self.bus.ensure_streams()
        await self.bus.nc.subscribe(s.weights_live, cb=self._on_live)  # before the KV read: no gap
        raw = await self.bus.kv_get("live_version")
        if raw is not None and self.live_version is None:
            self.live_version = decode(raw, WeightsLive).version
        self._psub = await self.bus.pull(s.eval_stream, s.eval_requests, durable="eval", ack_wait_s=600.0)

    async def teardown(self) -> None:
        await self.client.close()

    async def _on_live(self, msg) -> None:
        try:
            live = decode(msg.data, WeightsLive)
        except DecodeError:
            return
        if self.live_version is None or live.version > self.live_version:
            self.live_version = live.version
            self._live_changed.set()

    def loops(self):
        return {"evaluate": self._evaluate_loop}

    async def _evaluate_loop(self) -> None:
        while True:
            for msg in await fetch_some(self._psub, 1, 1.0):
                try:
                    req = decode(msg.data, EvalRequest)
                except DecodeError as e:
                    await self.bus.dead_letter(msg.subject, msg.data, f"undecodable EvalRequest: {e}")
                    await msg.term()
                    continue
                result = await self._run_point(req, msg)
                await self.bus.publish_durably([(self.bus.subjects.eval_results, result, None)], "an eval result")
                with (Path(self.config.run_dir) / "eval.jsonl").open("a") as f:
                    f.write(json.dumps({"step": result.step, "version": result.version, "final": result.final,
                                        "skipped": result.skipped_reason, **result.metrics}) + "\n")  # fmt: skip
                await settle(msg)

    async def _wait_for_version(self, version: int, msg) -> None:
        while self.live_version is None or self.live_version < version:
            self._live_changed.clear()
            if not await wait_event(self._live_changed, 10.0):
                raw = await self.bus.kv_get("live_version")
                if raw is not None:
                    self.live_version = max(self.live_version or 0, decode(raw, WeightsLive).version)
                await settle(msg, "in_progress")
                log.info(
                    "eval of step waits for weight version %d (engines at %s)",
                    version,
                    self.live_version,
                )

    async def _run_point(self, req: EvalRequest, msg) -> EvalResult:
        await self._wait_for_version(req.version, msg)
        token = f"eval-{req.step}-{uuid.uuid4().hex[:6]}"
        await self._control("pause_submission", token)
        t0 = time.perf_counter()
        self.busy = True
        try:
            metrics: dict[str, float] = {}
            for name, rows in self.datasets.items():
                metrics.update(await self._evaluate_dataset(name, rows))
        finally:
            self.busy = False
            await self._control("resume_submission", token)
        duration = time.perf_counter() - t0
        metrics["eval/duration_seconds"] = duration
        metrics["eval/step"] = req.step
        log.info("eval at step %d (v%d): %s", req.step, req.version,
                 {k: round(v, 4) for k, v in metrics.items() if "/" in k and k.count("/") == 1})  # fmt: skip
        res = EvalResult(
            step=req.step,
            version=req.version,
            metrics=metrics,
            duration_s=duration,
            final=req.final,
        )
        self.results.append({"step": req.step, **metrics})
        return res

    async def _evaluate_dataset(self, name: str, rows: list[dict]) -> dict[str, float]:
        c = self.config
        params = {
            "max_new_tokens": c.rollout_max_response_len,
            "temperature": c.eval_temperature,
            "top_p": c.rollout_top_p,
            "top_k": c.rollout_top_k,
            "stop_token_ids": list(c.rollout_stop_token_ids),
        }

        async def one(row: dict) -> Sample:
            ids = self.tokenizer.prompt_ids(row["prompt"], c.apply_chat_template)
            s = Sample(prompt=row["prompt"], label=row["label"], metadata=dict(row["metadata"]))
            resp = await self.client.generate({"input_ids": ids, "sampling_params": params, "return_logprob": True})
            apply_response(s, ids, resp)
            await score_sample(self.reward_fn, c, s)
            return s

        samples = await asyncio.gather(*(one(r) for r in rows for _ in range(c.n_samples_per_eval_prompt)))
        rewards = [float(s.reward or 0.0) for s in samples]
        versions = [min(s.weight_versions) for s in samples if s.weight_versions]
        out = {f"eval/{name}": sum(rewards) / len(rewards)}
        if versions:
            out[f"eval/{name}/weight_version/mean"] = sum(versions) / len(versions)
            out[f"eval/{name}/weight_version/mixed_version_ratio"] = sum(
                len(set(s.weight_versions)) > 1 for s in samples
            ) / len(samples)
        return out

    async def _control(self, command: str, token: str) -> None:
        await self.bus.publish_core(
            self.bus.subjects.control,
            ControlMsg(command=command, token=token, issued_at=time.time()),
        )
        await self.bus.nc.flush()

    def status(self) -> dict:
        return {"backend": "shared", "busy": self.busy, "live_version": self.live_version,
                "datasets": {k: len(v) for k, v in self.datasets.items()}, "results": self.results[-10:]}  # fmt: skip

    def metric_values(self) -> dict[str, float]:
        return {"eval/busy": float(self.busy), "eval/points_total": len(self.results)}
