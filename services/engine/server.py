"""The built-in engine's HTTP server: the SGLang HTTP protocol subset an RL producer uses.

Routes (shapes as in SGLang 0.5.16, see docs/engine.md): POST /generate (JSON, or server-sent
events with `stream`: services/engine/generate.py); GET /get_load, /get_weight_version; OpenAI's
GET /v1/models, POST /v1/completions, /v1/chat/completions (services/engine/openai.py); GET /health,
/health_generate; GET|POST /flush_cache; POST /abort_request, /pause_generation,
/continue_generation, /update_weights_from_disk, /update_weight_version, /init_weights_update_group,
/update_weights_from_distributed, /destroy_weights_update_group (services/engine/distributed.py),
/load_lora_adapter, /unload_lora_adapter (services/engine/loras.py); GET /model_info,
/server_info (and their /get_* aliases), /metrics (sglang:* names); plus asyncrl's /healthz,
/readyz, /status and POST /stage_weights. The routes are routers grouped by protocol
(services/engine/routes.py: native, control, weights, LoRA; services/engine/openai.py). The torch
work runs on the scheduler thread; handlers only enqueue and wait.

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

import concurrent.futures
import contextlib
import time
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from services.common.httpauth import ENGINE_SCOPES, Keys, require_token
from services.engine.distributed import DistributedReceiver
from services.engine.generate import Generation
from services.engine.openai import add_openai_routes
from services.engine.protocol import BadRequest, Limits, RequestFailed, parse_generate, raise_if_failed
from services.engine.routes import control_routes, lora_routes, native_routes, weight_routes
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
        tool_call_parser: str | None = None,
    ):
        """weights: an ObjectWeights that fetches `nats-object://` snapshots (None: disk only).
        staged_loading False: no /stage_weights (404), as an SGLang server. loras: the engine's
        EngineLoras (--enable-lora; services/engine/loras.py), None: no LoRA routes."""
        self.scheduler = scheduler
        self.loras = loras
        self.lora_pool = concurrent.futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="engine-lora")
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
        self.tool_call_parser = tool_call_parser
        """--tool-call-parser: chat answers to requests with tools carry the calls the model wrote."""
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
        if self.keys is not None:
            require_token(app, lambda: self.keys, OPEN_ROUTES, ENGINE_SCOPES)

        @app.exception_handler(RequestFailed)
        async def request_failed(request: Request, e: RequestFailed):
            return _error(str(e), e.status)

        @app.exception_handler(BadRequest)
        async def bad_request(request: Request, e: BadRequest):
            return _error(str(e))

        app.include_router(native_routes(self))
        add_openai_routes(app, self)
        app.include_router(control_routes(self))
        app.include_router(weight_routes(self))
        app.include_router(lora_routes(self))
        return app
