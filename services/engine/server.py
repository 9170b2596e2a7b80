"""The built-in engine's HTTP server: the SGLang HTTP protocol subset an RL producer uses (shapes
as in SGLang 0.5.16; the routes are listed in docs/engine.md). The routes are routers grouped by
protocol (services/engine/routes.py: native, info, control, weights, LoRA; services/engine/openai.py).
The torch work runs on the scheduler thread; handlers only enqueue and wait.

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

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from services.common.httpauth import ENGINE_SCOPES, Keys, require_token
from services.engine.distributed import DistributedReceiver
from services.engine.generate import Generation
from services.engine.openai import add_openai_routes
from services.engine.protocol import BadRequest, Limits, RequestFailed
from services.engine.routes import control_routes, info_routes, lora_routes, native_routes, weight_routes
from services.engine.scheduler import Scheduler

OPEN_ROUTES = ("/health", "/health_generate", "/metrics")
"""With an API key set, every other route needs it (SGLang's --api-key semantics)."""


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
        """Who may call the protected routes: one key (api_key, SGLang's --api-key), or the run's roles."""
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
        @app.exception_handler(BadRequest)
        async def refused(request: Request, e: BadRequest | RequestFailed):  # a 400, or the status it failed with
            return JSONResponse({"error": {"message": str(e)}}, status_code=getattr(e, "status", 400))

        for routes in (native_routes, info_routes, control_routes, weight_routes, lora_routes):
            app.include_router(routes(self))
        add_openai_routes(app, self)
        return app
