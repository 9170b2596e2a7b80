"""The built-in engine's HTTP server: the SGLang HTTP protocol subset an RL producer uses.

Routes (shapes as in SGLang 0.5.16, see docs/engine.md): POST /generate; GET /health,
/health_generate; GET|POST /flush_cache; POST /abort_request, /pause_generation,
/continue_generation, /update_weights_from_disk, /update_weight_version; GET /model_info,
/server_info (and their /get_* aliases), /metrics (sglang:* names); plus asyncrl's /healthz,
/readyz and /status. The torch work runs on the scheduler thread; handlers only enqueue and wait.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from services.engine.scheduler import Request as EngineRequest
from services.engine.scheduler import SamplingParams, Scheduler

SGLANG_COMPAT_VERSION = "0.5.16"
_SAMPLING_KEYS = {
    "max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids",
    "ignore_eos", "sampling_seed", "n", "stop", "no_stop_trim", "skip_special_tokens",
    "spaces_between_special_tokens", "min_p", "frequency_penalty", "presence_penalty",
    "repetition_penalty", "logit_bias", "json_schema", "regex", "ebnf", "stream_interval",
    "custom_params", "stop_regex", "structural_tag",
}  # fmt: skip


class BadRequest(ValueError):
    pass


def _error(message: str, code: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=code)


def parse_sampling_params(raw: dict | None) -> tuple[SamplingParams, int]:
    raw = dict(raw or {})
    unknown = set(raw) - _SAMPLING_KEYS
    if unknown:
        raise BadRequest(f"unknown sampling_params keys: {sorted(unknown)}")
    n = int(raw.get("n") or 1)

    def get(key, default):
        v = raw.get(key)
        return default if v is None else v

    p = SamplingParams(
        max_new_tokens=int(get("max_new_tokens", 128)),
        min_new_tokens=int(get("min_new_tokens", 0)),
        temperature=float(get("temperature", 1.0)),
        top_p=float(get("top_p", 1.0)),
        top_k=int(get("top_k", -1)),
        stop_token_ids=[int(t) for t in get("stop_token_ids", [])],
        ignore_eos=bool(get("ignore_eos", False)),
        sampling_seed=raw.get("sampling_seed"),
    )
    if p.max_new_tokens < 0:
        raise BadRequest("max_new_tokens must be >= 0")
    if p.min_new_tokens > p.max_new_tokens:
        raise BadRequest("min_new_tokens must be <= max_new_tokens")
    if p.temperature < 0:
        raise BadRequest("temperature must be >= 0")
    if not 0 < p.top_p <= 1:
        raise BadRequest("top_p must be in (0, 1]")
    if p.top_k != -1 and p.top_k < 1:
        raise BadRequest("top_k must be -1 (whole vocabulary) or >= 1")
    if raw.get("stop"):
        raise BadRequest("stop strings are not supported by the built-in engine: use stop_token_ids")
    return p, n


class EngineServer:
    def __init__(
        self,
        scheduler: Scheduler,
        model_path: str,
        tokenizer=None,
        served_model_name: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ):
        self.scheduler = scheduler
        self.model_path = model_path
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name or Path(model_path).name
        self.host, self.port = host, port
        self.started_at = time.time()
        self.app = self._build()

    # ---- generate --------------------------------------------------------------------------
    def _prompts(self, body: dict) -> tuple[list[list[int]], bool]:
        if "input_ids" in body and body["input_ids"] is not None:
            ids = body["input_ids"]
            if not ids:
                raise BadRequest("input_ids must not be empty")
            if isinstance(ids[0], list):
                return [list(map(int, x)) for x in ids], True
            return [list(map(int, ids))], False
        if "text" in body and body["text"] is not None:
            if self.tokenizer is None:
                raise BadRequest("this engine has no tokenizer: send input_ids")
            texts = body["text"]
            if isinstance(texts, list):
                return [self.tokenizer.encode(t) for t in texts], True
            return [self.tokenizer.encode(texts)], False
        raise BadRequest("Either text or input_ids should be provided.")

    async def generate(self, body: dict) -> Any:
        if body.get("stream"):
            raise BadRequest("streaming is not supported by the built-in engine")
        prompts, is_batch = self._prompts(body)
        raw_params = body.get("sampling_params")
        params_list = raw_params if isinstance(raw_params, list) else [raw_params] * len(prompts)
        if len(params_list) != len(prompts):
            raise BadRequest("sampling_params list must match the batch size")
        rid = body.get("rid")
        return_logprob = body.get("return_logprob", False)
        loop = asyncio.get_running_loop()
        futures, reqs = [], []
        for i, (ids, raw) in enumerate(zip(prompts, params_list, strict=True)):
            params, n = parse_sampling_params(raw)
            if n > 1:
                is_batch = True
            for j in range(n):
                if isinstance(rid, list):
                    this_rid = rid[i]
                elif rid and (is_batch or n > 1):
                    this_rid = f"{rid}-{i}-{j}"
                else:
                    this_rid = rid or self.scheduler.new_rid()
                fut = loop.create_future()

                def done(req, fut=fut):
                    loop.call_soon_threadsafe(lambda: fut.done() or fut.set_result(req))

                req = EngineRequest(rid=this_rid, input_ids=ids, params=params, on_done=done)
                self.scheduler.add_request(req)
                futures.append(fut)
                reqs.append(req)
        try:
            finished = await asyncio.gather(*futures)
        except asyncio.CancelledError:
            for r in reqs:
                self.scheduler.abort(rid=r.rid)
            raise
        rl = return_logprob if isinstance(return_logprob, list) else [return_logprob] * len(finished)
        outs = [self._response(r, bool(rl[min(k, len(rl) - 1)])) for k, r in enumerate(finished)]
        return outs if is_batch else outs[0]

    def _response(self, req: EngineRequest, return_logprob: bool) -> dict:
        reason = req.finish_reason or {}
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": reason,
            "weight_version": self.scheduler.weight_version,
            "completion_tokens": len(req.output_ids),
            "e2e_latency": req.finished_at - req.created_at,
        }
        waiting_abort = reason.get("type") == "abort" and reason.get("message") == "Abort in waiting queue"
        if not waiting_abort:
            meta.update(
                prompt_tokens=len(req.input_ids),
                cached_tokens=req.cached_tokens,
                reasoning_tokens=0,
                num_retractions=req.num_retractions,
                weight_versions=req.version_spans(),
            )
        if return_logprob:
            meta["output_token_logprobs"] = [
                [lp, tid, None] for lp, tid in zip(req.output_logprobs, req.output_ids, strict=True)
            ]
            meta["output_token_logprobs_length"] = len(req.output_ids)
            meta["input_token_logprobs"] = []
        meta["response_sent_to_client_ts"] = time.time()
        text = self.tokenizer.decode(req.output_ids) if self.tokenizer is not None else ""
        return {"text": text, "output_ids": list(req.output_ids), "meta_info": meta}

    # ---- info --------------------------------------------------------------------------------
    def model_info(self) -> dict:
        cfg = self.scheduler.model.cfg
        return {
            "model_path": self.model_path,
            "tokenizer_path": self.model_path if self.tokenizer is not None else None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": self.scheduler.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": cfg.model_type,
            "architectures": cfg.to_hf_dict()["architectures"],
        }

    def server_info(self) -> dict:
        snap = self.scheduler.snapshot()
        return {
            "model_path": self.model_path,
            "served_model_name": self.served_model_name,
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "host": self.host,
            "port": self.port,
            "weight_version": self.scheduler.weight_version,
            "enable_metrics": True,
            "context_length": self.scheduler.context_length,
            "max_running_requests": self.scheduler.cache.num_slots,
            "status": "ready",
            "max_total_num_tokens": snap["max_total_num_tokens"],
            "max_req_input_len": self.scheduler.context_length - 1,
            "internal_states": [
                {
                    "last_gen_throughput": self.scheduler.stats.gen_throughput,
                    "effective_max_running_requests_per_dp": self.scheduler.cache.num_slots,
                }
            ],
            "version": f"asyncrl-builtin (sglang-compatible {SGLANG_COMPAT_VERSION})",
        }

    def metrics_text(self) -> str:
        snap = self.scheduler.snapshot()
        st = self.scheduler.stats
        labels = f'{{model_name="{self.served_model_name}",engine_type="unified",tp_rank="0",pp_rank="0"}}'
        gauges = {
            "num_running_reqs": snap["num_running_reqs"],
            "num_queue_reqs": snap["num_queue_reqs"],
            "num_paused_reqs": snap["num_paused_reqs"],
            "num_used_tokens": snap["num_used_tokens"],
            "max_total_num_tokens": snap["max_total_num_tokens"],
            "token_usage": snap["token_usage"],
            "cache_hit_rate": st.cache_hit_rate,
            "gen_throughput": st.gen_throughput,
            "weight_load_duration_seconds": st.weight_load_duration_s,
        }
        counters = {
            "prompt_tokens_total": st.prompt_tokens_total,
            "generation_tokens_total": st.generation_tokens_total,
            "cached_tokens_total": st.cached_tokens_total,
            "num_requests_total": st.num_requests_total,
            "num_aborted_requests_total": st.num_aborted_requests_total,
            "num_retracted_requests_total": st.num_retracted_requests_total,
        }
        lines = []
        for name, value in gauges.items():
            lines += [f"# TYPE sglang:{name} gauge", f"sglang:{name}{labels} {float(value)}"]
        for name, value in counters.items():
            lines += [f"# TYPE sglang:{name} counter", f"sglang:{name}{labels} {float(value)}"]
        return "\n".join(lines) + "\n"

    # ---- routes ------------------------------------------------------------------------------
    def _build(self) -> FastAPI:
        app = FastAPI(title="asyncrl built-in engine", docs_url=None, redoc_url=None)
        sched = self.scheduler

        async def body_of(request: Request) -> dict:
            raw = await request.body()
            if not raw:
                return {}
            import json

            try:
                data = json.loads(raw)
            except ValueError as e:
                raise BadRequest(f"invalid JSON: {e}") from None
            if not isinstance(data, dict):
                raise BadRequest("the request body must be a JSON object")
            return data

        @app.api_route("/generate", methods=["POST", "PUT"])
        async def generate(request: Request):
            try:
                return JSONResponse(await self.generate(await body_of(request)))
            except (BadRequest, ValueError) as e:
                return _error(str(e))

        @app.get("/health")
        @app.get("/health_generate")
        async def health():
            if not sched.alive:
                return Response(status_code=503)
            if sched.paused_mode or sched.running or sched.waiting:
                # alive and holding work: healthy while steps keep finishing
                return Response(status_code=503 if sched.stalled else 200)
            try:
                await asyncio.wait_for(
                    self.generate(
                        {
                            "input_ids": [0],
                            "sampling_params": {"max_new_tokens": 1, "temperature": 0},
                        }
                    ),
                    20,
                )
            except (TimeoutError, ValueError):
                return Response(status_code=503)
            return Response(status_code=200)

        @app.api_route("/flush_cache", methods=["GET", "POST"])
        async def flush_cache():
            ok = await asyncio.to_thread(sched.flush_cache)
            if ok:
                return PlainTextResponse(
                    "Cache flushed.\nPlease check backend logs for more details. (When there are "
                    "running or waiting requests, the operation will not be performed.)\n"
                )
            return PlainTextResponse("Flush cache failed.\n", status_code=400)

        @app.post("/abort_request")
        async def abort_request(request: Request):
            body = await body_of(request)
            await asyncio.to_thread(sched.abort, str(body.get("rid") or ""), bool(body.get("abort_all", False)))
            return Response(status_code=200)

        @app.post("/pause_generation")
        async def pause_generation(request: Request):
            body = await body_of(request)
            try:
                await asyncio.to_thread(sched.pause, body.get("mode") or "abort")
            except ValueError as e:
                return _error(str(e))
            return {"message": "Generation paused successfully.", "status": "ok"}

        @app.post("/continue_generation")
        async def continue_generation():
            await asyncio.to_thread(sched.resume)
            return {"message": "Generation continued successfully.", "status": "ok"}

        @app.post("/update_weights_from_disk")
        async def update_weights_from_disk(request: Request):
            body = await body_of(request)
            path = body.get("model_path")
            if not path:
                return JSONResponse({"success": False, "message": "model_path is required"}, status_code=400)
            version = body.get("weight_version")
            try:
                if body.get("abort_all_requests"):
                    await asyncio.to_thread(sched.abort, "", True)
                res = await asyncio.to_thread(sched.update_weights_from_disk, path, version)
            except (OSError, ValueError, TimeoutError) as e:
                return JSONResponse({"success": False, "message": f"Failed to update weights: {e}"}, status_code=400)
            self.model_path = path
            msg = "Succeeded to update model weights."
            if version is not None:
                msg += f" Weight version updated to {version}."
            return {
                "success": True,
                "message": msg,
                "num_paused_requests": res["num_paused_requests"],
            }

        @app.post("/update_weight_version")
        async def update_weight_version(request: Request):
            body = await body_of(request)
            if "new_version" not in body:
                return JSONResponse({"success": False, "message": "new_version is required"}, status_code=400)
            if body.get("abort_all_requests", True):
                await asyncio.to_thread(sched.abort, "", True)
            await asyncio.to_thread(sched.set_weight_version, str(body["new_version"]))
            v = str(body["new_version"])
            return {"success": True, "message": f"Weight version updated to {v}", "new_version": v}

        @app.get("/model_info")
        @app.get("/get_model_info")
        async def model_info():
            return self.model_info()

        @app.get("/server_info")
        @app.get("/get_server_info")
        async def server_info():
            return self.server_info()

        @app.get("/metrics")
        async def metrics():
            return PlainTextResponse(self.metrics_text(), media_type="text/plain; version=0.0.4")

        @app.api_route("/release_memory_occupation", methods=["GET", "POST"])
        @app.api_route("/resume_memory_occupation", methods=["GET", "POST"])
        async def memory_occupation():
            return JSONResponse(None)  # nothing to release on the built-in engine

        @app.get("/healthz")
        async def healthz():
            return PlainTextResponse(
                "ok\n" if sched.alive else "scheduler thread died\n",
                status_code=200 if sched.alive else 503,
            )

        @app.get("/readyz")
        async def readyz():
            return PlainTextResponse(
                "ready\n" if sched.alive else "not ready\n", status_code=200 if sched.alive else 503
            )

        @app.get("/status")
        async def status():
            return {
                "service": "engine",
                "model_path": self.model_path,
                "uptime_s": time.time() - self.started_at,
                **sched.snapshot(),
                "cache_hit_rate": sched.stats.cache_hit_rate,
                "gen_throughput": sched.stats.gen_throughput,
            }

        return app
