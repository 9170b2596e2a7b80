"""The built-in engine's HTTP server: the SGLang HTTP protocol subset an RL producer uses.

Routes (shapes as in SGLang 0.5.16, see docs/engine.md): POST /generate (JSON, or server-sent
events with `stream`: services/engine/generate.py); GET /get_load, /get_weight_version; OpenAI's
GET /v1/models, POST /v1/completions, /v1/chat/completions (services/engine/openai.py); GET /health,
/health_generate; GET|POST /flush_cache; POST /abort_request, /pause_generation,
/continue_generation, /update_weights_from_disk, /update_weight_version, /init_weights_update_group,
/update_weights_from_distributed, /destroy_weights_update_group (services/engine/distributed.py),
/load_lora_adapter, /unload_lora_adapter (services/engine/loras.py); GET /model_info,
/server_info (and their /get_* aliases), /metrics (sglang:* names); plus asyncrl's /healthz,
/readyz, /status and POST /stage_weights. The torch work runs on the scheduler thread; handlers
only enqueue and wait.

Staged loading (asyncrl's extension; /server_info says `"staged_weight_loading": true`):
POST /stage_weights {model_path, weight_version} loads a snapshot beside the running weights while
generation goes on; the update_weights_from_disk of the same snapshot that follows only swaps it
in, so the pause around it does not grow with the model. A model_path `nats-object://<bucket>/v<N>`
(--update-weight-transfer-mode object-store) is fetched from the run's weights bucket first
(--nats-url, --run-id, and the read-only `engine` NATS identity): no shared disk.

Trust: every request is validated before anything is queued (services.engine.protocol: a 400
that names the field, never a 500); with an API key (--api-key, as SGLang) or the run's keys
($ASYNCRL_HTTP_KEYS or $ASYNCRL_RUN_TOKEN), every route but /health, /health_generate and
/metrics needs `Authorization: Bearer <token>`, and a role's token opens only its routes
(services.common.httpauth: producers generate, weight-sync loads weights, the admin does all).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from services.common.httpauth import ENGINE_SCOPES, Keys, require_token
from services.common.weightstore import SCHEME, WeightStoreError
from services.engine.distributed import DistributedReceiver
from services.engine.generate import Generation
from services.engine.openai import add_openai_routes
from services.engine.protocol import BadRequest, Limits, RequestFailed, parse_generate, raise_if_failed, typed
from services.engine.scheduler import Scheduler

SGLANG_COMPAT_VERSION = "0.5.16"
OPEN_ROUTES = ("/health", "/health_generate", "/metrics")
"""With an API key set, every other route needs it (SGLang's --api-key semantics)."""


def _error(message: str, code: int = 400) -> JSONResponse:
    return JSONResponse({"error": {"message": message}}, status_code=code)


class EngineServer:
    def __init__(
        self,
        scheduler: Scheduler,
        model_path: str,
        tokenizer=None,
        served_model_name: str | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
        api_key: str | None = None,
        keys: Keys | None = None,
        weights=None,
        staged_loading: bool = True,
        loras=None,
    ):
        """weights: an ObjectWeights that fetches `nats-object://` snapshots (None: disk only).
        staged_loading False: no /stage_weights (404), as an SGLang server. loras: the engine's
        EngineLoras (--enable-lora; services/engine/loras.py), None: no LoRA routes."""
        self.scheduler = scheduler
        self.loras = loras
        self._lora_pool = concurrent.futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="engine-lora")
        self.receiver = DistributedReceiver(scheduler, staged_loading)
        self.weights = weights
        self.staged_loading = staged_loading
        self.keys = Keys.single(api_key) if api_key else keys
        """Who may call the protected routes (services.common.httpauth): one key for everything
        (api_key, SGLang's --api-key), or the run's roles, each within ENGINE_SCOPES."""
        cfg = scheduler.model.cfg
        self.limits = Limits(vocab_size=cfg.vocab_size, context_length=scheduler.context_length)
        self.model_path = model_path
        self.tokenizer = tokenizer
        self.served_model_name = served_model_name or Path(model_path).name
        self.host, self.port = host, port
        self.started_at = time.time()
        self.generation = Generation(scheduler, tokenizer, loras)
        self.app = self._build()

    # ---- generate --------------------------------------------------------------------------
    async def generate(self, body: Any) -> Any:
        """A non-streaming /generate: the response object, or a list of them for a batch."""
        seqs, is_batch = parse_generate(body, self.limits, self.tokenizer)
        tracked = await self.generation.run(seqs)
        raise_if_failed(t.req for t in tracked)
        outs = [self.generation.output(t) for t in tracked]
        return outs if is_batch else outs[0]

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
            "staged_weight_loading": self.staged_loading,
            "weight_digest_check": True,
            "weight_update_backends": self.receiver.backends(),
            **(self.loras.info() if self.loras is not None else {"enable_lora": False}),
        }

    def metrics_text(self) -> str:
        from services.engine.metrics import engine_metrics

        return engine_metrics(self).text()

    # ---- routes ------------------------------------------------------------------------------
    def _build(self) -> FastAPI:
        @contextlib.asynccontextmanager
        async def lifespan(app):
            yield
            if self.weights is not None:  # its NATS connection
                await self.weights.close()

        app = FastAPI(title="asyncrl built-in engine", docs_url=None, redoc_url=None, openapi_url=None,
                      lifespan=lifespan)  # fmt: skip
        sched = self.scheduler
        if self.keys is not None:
            require_token(app, lambda: self.keys, OPEN_ROUTES, ENGINE_SCOPES)

        @app.exception_handler(RequestFailed)
        async def request_failed(request: Request, e: RequestFailed):
            return _error(str(e), e.status)

        @app.exception_handler(BadRequest)
        async def bad_request(request: Request, e: BadRequest):
            return _error(str(e))

        async def body_of(request: Request) -> dict:
            raw = await request.body()
            if not raw:
                return {}
            try:
                data = json.loads(raw)
            except ValueError as e:
                raise BadRequest(f"invalid JSON: {e}") from None
            except RecursionError:  # the parser's depth limit: nested deeper than any request needs
                raise BadRequest("invalid JSON: nested too deeply") from None
            if not isinstance(data, dict):
                raise BadRequest("the request body must be a JSON object")
            return data

        @app.api_route("/generate", methods=["POST", "PUT"])
        async def generate(request: Request):
            body = await body_of(request)
            if body.get("stream") is True:
                seqs, is_batch = parse_generate(body, self.limits, self.tokenizer)
                self.generation.check_loras(seqs)
                return StreamingResponse(self.generation.stream(seqs, is_batch), media_type="text/event-stream")
            return JSONResponse(await self.generate(body))

        add_openai_routes(app, self)

        @app.get("/get_load")
        async def get_load():
            snap = sched.snapshot()
            return [{"dp_rank": 0, "num_reqs": snap["num_running_reqs"] + snap["num_queue_reqs"],
                     "num_waiting_reqs": snap["num_queue_reqs"], "num_tokens": snap["num_used_tokens"]}]  # fmt: skip

        @app.get("/get_weight_version")
        async def get_weight_version():
            return {"weight_version": sched.weight_version}

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
            rid, abort_all = typed(body, "rid", str, ""), typed(body, "abort_all", bool, False)
            await asyncio.to_thread(sched.abort, rid, abort_all)
            return Response(status_code=200)

        @app.post("/pause_generation")
        async def pause_generation(request: Request):
            mode = typed(await body_of(request), "mode", str) or "abort"
            if mode not in ("abort", "retract", "in_place"):
                raise BadRequest(f"mode must be abort, retract or in_place, got {mode!r:.40}")
            await asyncio.to_thread(sched.pause, mode)
            return {"message": "Generation paused successfully.", "status": "ok"}

        @app.post("/continue_generation")
        async def continue_generation():
            await asyncio.to_thread(sched.resume)
            return {"message": "Generation continued successfully.", "status": "ok"}

        async def local_snapshot(path: str, version) -> str:
            """The directory to load: `path`, or a `nats-object://` snapshot fetched to local disk."""
            if not path.startswith(SCHEME):
                return path
            if self.weights is None:
                raise ValueError(f"{path!r:.120} is in a NATS object store, and this engine was started without "
                                 "--nats-url and --run-id (start it with them to fetch object-store weights)")  # fmt: skip
            return str(await self.weights.local_path(path))

        @app.post("/stage_weights")
        async def stage_weights(request: Request):
            if not self.staged_loading:
                return JSONResponse({"detail": "Not Found"}, status_code=404)
            body = await body_of(request)
            path = typed(body, "model_path", str)
            if not path:
                return JSONResponse({"success": False, "message": "model_path is required"}, status_code=400)
            version = typed(body, "weight_version", (str, int))
            try:
                local = await local_snapshot(path, version)
                seconds = await asyncio.to_thread(sched.stage_weights, local, version)
            except (OSError, ValueError, WeightStoreError) as e:
                return JSONResponse({"success": False, "message": f"Failed to stage weights: {e}"}, status_code=400)
            return {"success": True, "message": f"Staged {path} in {seconds:.3f}s.", "stage_seconds": seconds}

        @app.post("/update_weights_from_disk")
        async def update_weights_from_disk(request: Request):
            body = await body_of(request)
            path = typed(body, "model_path", str)
            if not path:
                return JSONResponse({"success": False, "message": "model_path is required"}, status_code=400)
            version = typed(body, "weight_version", (str, int))
            typed(body, "flush_cache", bool)
            try:
                local = await local_snapshot(path, version)
                if typed(body, "abort_all_requests", bool):
                    await asyncio.to_thread(sched.abort, "", True)
                res = await asyncio.to_thread(sched.update_weights_from_disk, local, version)
            except (OSError, ValueError, TimeoutError, WeightStoreError) as e:
                return JSONResponse({"success": False, "message": f"Failed to update weights: {e}"}, status_code=400)
            self.model_path = path
            msg = "Succeeded to update model weights."
            if version is not None:
                msg += f" Weight version updated to {version}."
            return {
                "success": True,
                "message": msg,
                "num_paused_requests": res["num_paused_requests"],
                "staged": res["staged"],
            }

        @app.post("/init_weights_update_group")
        async def init_weights_update_group(request: Request):
            body = await body_of(request)
            try:
                return await asyncio.to_thread(self.receiver.init_group, body)
            except (RuntimeError, ValueError, OSError) as e:  # the others never joined, or a bad address
                return JSONResponse({"success": False, "message": f"Failed to init group: {e}"}, status_code=400)

        @app.post("/destroy_weights_update_group")
        async def destroy_weights_update_group(request: Request):
            res = await asyncio.to_thread(self.receiver.destroy_group, await body_of(request))
            return JSONResponse(res, status_code=200 if res["success"] else 400)

        @app.post("/update_weights_from_distributed")
        async def update_weights_from_distributed(request: Request):
            body = await body_of(request)
            try:
                return await asyncio.to_thread(self.receiver.update, body)
            except (ValueError, TimeoutError) as e:
                return JSONResponse({"success": False, "message": f"Failed to update weights: {e}"}, status_code=400)

        @app.post("/update_weight_version")
        async def update_weight_version(request: Request):
            body = await body_of(request)
            if typed(body, "new_version", (str, int)) is None:
                return JSONResponse({"success": False, "message": "new_version is required"}, status_code=400)
            if typed(body, "abort_all_requests", bool, True):
                await asyncio.to_thread(sched.abort, "", True)
            v = str(body["new_version"])
            try:  # a version staged by broadcast (stage: true) is swapped in; otherwise only the name changes
                swapped = await asyncio.to_thread(self.receiver.set_version, v)
            except TimeoutError as e:
                return JSONResponse({"success": False, "message": f"Failed to update weights: {e}"}, status_code=400)
            if not swapped:
                await asyncio.to_thread(sched.set_weight_version, v)
            return {"success": True, "message": f"Weight version updated to {v}", "new_version": v, "staged": swapped}

        @app.post("/load_lora_adapter")
        async def load_lora_adapter(request: Request):
            return await lora_call("load", await body_of(request))

        @app.post("/unload_lora_adapter")
        async def unload_lora_adapter(request: Request):
            return await lora_call("unload", await body_of(request))

        async def lora_call(op: str, body: dict):
            """SGLang's LoRA answer: {success, error_message, loaded_adapters}, a 400 on failure."""
            if self.loras is None:
                return JSONResponse({"success": False, "error_message": "LoRA is not enabled on this engine: "
                                     "start it with --enable-lora", "loaded_adapters": {}}, status_code=400)  # fmt: skip
            path = body.get("lora_path") if op == "load" else None
            if isinstance(path, str) and path.startswith(SCHEME):  # an object-store version: fetched first
                try:
                    if self.weights is None:
                        raise ValueError(f"{path!r:.120} is in a NATS object store, and this engine was started "
                                         "without --nats-url and --run-id (start it with them to fetch it)")  # fmt: skip
                    body = {**body, "lora_path": str(await self.weights.local_adapter(path))}
                except (ValueError, WeightStoreError) as e:  # not one, or not (any more) in the bucket: never loads
                    return JSONResponse({"success": False, "error_message": f"Failed to load LoRA adapter: {e}",
                                         "loaded_adapters": self.loras.loaded()}, status_code=400)  # fmt: skip
                except (OSError, TimeoutError) as e:  # the broker away: asked again
                    return JSONResponse({"success": False, "error_message": f"could not fetch {path!r:.200}: {e}",
                                         "loaded_adapters": self.loras.loaded()}, status_code=400)  # fmt: skip
            try:  # their own threads: an unload waiting for its requests never takes one from pause/continue
                fn = self.loras.load if op == "load" else self.loras.unload
                return await asyncio.get_running_loop().run_in_executor(self._lora_pool, fn, body)
            except (BadRequest, TimeoutError) as e:
                return JSONResponse({"success": False, "error_message": str(e),
                                     "loaded_adapters": self.loras.loaded()}, status_code=400)  # fmt: skip

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
                "weight_load_seconds": sched.stats.weight_load_duration_s,
                "weight_stage_seconds": sched.stats.weight_stage_duration_s,
                "num_staged_weight_swaps": sched.stats.num_staged_swaps_total,
                "num_forgotten_pauses_ended": sched.stats.num_forgotten_pauses_ended_total,
                **self.receiver.status(),
            }

        return app
