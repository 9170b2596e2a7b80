"""Service runtime: named loops under one TaskGroup, an HTTP app, heartbeats, clean shutdown.

Every service subclasses `Service` and provides `loops()` (named coroutines that run until
stop()), `status()` (JSON for /status) and `metric_values()` (numbers for /metrics, typed and
labelled by services.common.promexport). The runtime serves /healthz, /readyz, /metrics, /status
and /config on the service's own port, publishes a heartbeat every 2 s, and turns SIGTERM/SIGINT
into stop(): loops are cancelled, `teardown()` runs, the NATS connection flushes and closes. A
loop that returns while the service is not stopping is a bug and fails the process, so a
supervisor restarts it and unacknowledged messages are redelivered.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import uvicorn
from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import CollectorRegistry, generate_latest

from asyncrl_proto import Heartbeat
from services.common.bus import Bus
from services.common.config import ConfigView, RunConfig
from services.common.config.view import view
from services.common.httpauth import OPEN_PATHS, engine_token_from_env, keys_from_env, require_token
from services.common.promexport import LabelledProcessCollector, ServiceCollector
from services.common.secrets import install_log_redaction, run_token_from_env

log = logging.getLogger(__name__)

HEARTBEAT_INTERVAL_S = 2.0


def setup_logging(level: str, service: str) -> None:
    logging.basicConfig(
        level=getattr(logging, level, logging.INFO),
        format=f"%(asctime)s %(levelname)s [{service}] %(name)s: %(message)s",
        force=True,
    )
    for noisy in ("httpx", "httpcore", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    install_log_redaction()


async def wait_event(event: asyncio.Event, timeout: float) -> bool:
    """Wait for an event up to `timeout`; True if it is set. Uses asyncio.timeout(), because
    Python 3.11's asyncio.wait_for can swallow a cancellation that races with completion,
    which leaves a service unable to stop."""
    with contextlib.suppress(TimeoutError):
        async with asyncio.timeout(timeout):
            await event.wait()
    return event.is_set()


class _QuietServer(uvicorn.Server):
    """uvicorn without its own signal handling: the service owns SIGTERM/SIGINT."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


class Service:
    name = "service"
    reads: tuple[type, ...] = ()
    """The config sections (services.common.config) this service reads besides InfraSection, which the
    runtime reads for every service: `self.config` holds these and no other (services.common.config.view;
    tests/unit/test_config_sections.py checks the code against them too)."""
    counter_keys: frozenset[str] = frozenset()
    """metric_values() keys that are counters although their names do not end in `_total`."""
    histograms: dict[str, tuple[str, tuple[float, ...]]] = {}
    """Distributions this service observes (`observe`): key -> (help, upper bounds in its unit)."""

    def __init__(
        self,
        config: RunConfig | ConfigView,
        bus: Bus,
        *,
        instance_id: str | None = None,
        http_host: str = "127.0.0.1",
        http_port: int = 0,
    ):
        """The run token comes from the environment (services.common.secrets). This service's
        routes answer the admin only (services.common.httpauth); it calls the engines with its
        role's token (`engine_token`). Without a run token, or the keys and token the launcher
        gives, its protected routes refuse everyone."""
        self.config = view(config, self.reads, f"{type(self).__name__}")
        http_token = run_token_from_env()
        self.http_keys = keys_from_env(http_token)
        self.engine_token = engine_token_from_env(self.name, http_token, config.infra.engines_take_one_key)
        """What this service sends to the engines (None: they ask for nothing)."""
        self.bus = bus
        self.instance_id = instance_id or f"{self.name}-{uuid.uuid4().hex[:6]}"
        self.http_host = http_host
        self.http_port = http_port
        self.http_url = ""
        self.ready = False
        self.started_at = time.time()
        self._stop = asyncio.Event()
        self._failure: BaseException | None = None
        self._background: set[asyncio.Task] = set()
        self._tasks: list[asyncio.Task] = []
        self.registry = CollectorRegistry()
        labels = {"run": bus.subjects.run_id, "service": self.name, "instance": self.instance_id}
        self.metrics = ServiceCollector(self.metric_values, labels, self.counter_keys, self.histograms)
        self.registry.register(self.metrics)
        self.registry.register(LabelledProcessCollector(labels))
        self.app = self._build_app()

    # ---- to override ---------------------------------------------------------------------
    def loops(self) -> dict[str, Callable[[], Awaitable[None]]]:
        return {}

    async def setup(self) -> None:
        """Runs before the loops (connect consumers, restore state); the service is ready after it."""

    async def teardown(self) -> None:
        """Runs after the loops stopped, before the NATS connection drains."""

    def status(self) -> dict[str, Any]:
        return {}

    def metric_values(self) -> dict[str, float]:
        """Numbers for /metrics (services.common.promexport types and labels them)."""
        return {}

    def health_note(self) -> str | None:
        """A condition /healthz reports while the service itself is healthy (its answer stays 200:
        a restart would not cure it), e.g. the buffer's stalled run with its cause."""
        return None

    def add_routes(self, app: FastAPI) -> None:
        """Extra control endpoints."""

    def heartbeat_info(self) -> dict[str, Any]:
        return {}

    # ---- lifecycle -------------------------------------------------------------------------
    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def stop(self) -> None:
        if not self._stop.is_set():
            log.info("%s %s stopping", self.name, self.instance_id)
        self._stop.set()

    def observe(self, key: str, value: float) -> None:
        """One observation of a histogram the class declares in `histograms`."""
        self.metrics.observe(key, value)

    def background(self, coro: Awaitable[None], what: str) -> asyncio.Task:
        """A fire-and-forget task, referenced until done (the event loop keeps only weak ones),
        whose exception is logged rather than lost."""
        task = asyncio.ensure_future(coro)
        self._background.add(task)

        def done(t: asyncio.Task) -> None:
            self._background.discard(t)
            if not t.cancelled() and t.exception() is not None:
                log.error("%s failed: %r", what, t.exception(), exc_info=t.exception())

        task.add_done_callback(done)
        return task

    def fail(self, error: BaseException) -> None:
        """End the service with `error`, from where raising reaches no loop (a NATS callback, a
        background task): its loops are cancelled and run() raises it, a crash to restart."""
        if self._failure is None:
            self._failure = error
            log.error("%s %s failing: %s", self.name, self.instance_id, error)
        self._stop.set()

    async def wait_stopped(self, timeout: float) -> bool:
        """Sleep up to `timeout` unless stop() comes first; True when stopping."""
        return await wait_event(self._stop, timeout)

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self.stop)
        sock = socket.create_server((self.http_host, self.http_port), backlog=128)  # SO_REUSEADDR set
        sock.setblocking(False)
        self.http_port = sock.getsockname()[1]
        self.http_url = f"http://{self.http_host}:{self.http_port}"
        server = _QuietServer(uvicorn.Config(self.app, log_level="warning", lifespan="off", access_log=False))
        http_task = asyncio.create_task(server.serve(sockets=[sock]), name=f"{self.name}-http")
        log.info("%s %s serving HTTP on %s", self.name, self.instance_id, self.http_url)
        try:
            await self.setup()
            await self.bus.flush(timeout=10)  # subscriptions are live on the server before we say ready
            self.ready = True
            async with asyncio.TaskGroup() as tg:
                named = {**self.loops(), "heartbeat": self._heartbeat_loop}
                self._tasks = [tg.create_task(self._supervise(n, fn), name=n) for n, fn in named.items()]
                tg.create_task(self._cancel_on_stop(), name="stop-watch")
            if self._failure is not None:
                raise self._failure
        finally:
            self.ready = False
            with contextlib.suppress(Exception):
                await self.teardown()
            if self.stopping and self._failure is None:  # not after a crash: a restarted instance is the same producer
                await self._send_heartbeat()
            server.should_exit = True
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await asyncio.wait_for(http_task, 5)
            await self.bus.close()
            log.info("%s %s stopped", self.name, self.instance_id)

    async def _supervise(self, name: str, fn: Callable[[], Awaitable[None]]) -> None:
        try:
            await fn()
        except asyncio.CancelledError:
            if self.stopping:
                return
            raise
        if not self.stopping:
            raise RuntimeError(f"{self.name}: loop {name!r} ended without stop()")

    async def _cancel_on_stop(self) -> None:
        await self._stop.wait()
        while pending := [t for t in self._tasks if not t.done()]:
            for t in pending:  # repeated: a cancellation swallowed by library code is retried
                t.cancel()
            await asyncio.wait(pending, timeout=1.0)

    async def _send_heartbeat(self) -> None:
        """Best effort (core NATS); the last one, sent on the way out, says `stopping` so that
        peers forget this instance at once instead of after a timeout."""
        info = self.heartbeat_info()
        if self.stopping:
            info["stopping"] = True
        hb = Heartbeat(service=self.name, instance_id=self.instance_id, http_url=self.http_url, pid=os.getpid(),
                       started_at=self.started_at, ts=time.time(), info=info)  # fmt: skip
        with contextlib.suppress(Exception):
            await self.bus.publish_core(self.bus.subjects.heartbeat(self.name), hb)

    async def _heartbeat_loop(self) -> None:
        while not self.stopping:
            await self._send_heartbeat()
            await self.wait_stopped(HEARTBEAT_INTERVAL_S)

    # ---- HTTP ------------------------------------------------------------------------------
    def _build_app(self) -> FastAPI:
        app = FastAPI(title=f"asyncrl {self.name}", docs_url=None, redoc_url=None, openapi_url=None)
        open_paths = () if self.config.infra.http_auth_probes else OPEN_PATHS
        require_token(app, lambda: self.http_keys, open_paths)

        @app.get("/healthz")
        async def healthz() -> Response:
            dead = [t.get_name() for t in self._tasks if t.done()]
            if dead and not self.stopping:
                return PlainTextResponse(f"loops ended: {dead}\n", status_code=503)
            return PlainTextResponse(f"ok: {note}\n" if (note := self.health_note()) else "ok\n")

        @app.get("/readyz")
        async def readyz() -> Response:
            if self.ready and not self.stopping:
                return PlainTextResponse("ready\n")
            return PlainTextResponse("not ready\n", status_code=503)

        @app.get("/metrics")
        async def metrics() -> Response:
            return Response(generate_latest(self.registry), media_type="text/plain; version=0.0.4")

        @app.get("/status")
        async def status() -> JSONResponse:
            base = {
                "service": self.name,
                "instance_id": self.instance_id,
                "run_id": self.bus.subjects.run_id,
                "ready": self.ready,
                "pid": os.getpid(),
                "uptime_s": round(time.time() - self.started_at, 3),
            }
            return JSONResponse({**base, **self.status()})

        @app.get("/config")
        async def config() -> JSONResponse:
            return JSONResponse(self.config.model_dump(mode="json"))

        self.add_routes(app)
        return app
