"""A paused engine that refuses /flush_cache (an SGLang server with retracted requests resident)
never gets new weights over its old cache: weight-sync asks again every second, as Miles does,
and loads only once the flush went through; past --flush-cache-timeout-s the update is abandoned
on that engine, which resumes on its old version. Against a stand-in server speaking SGLang's
HTTP protocol (the routes weight-sync calls), told how often to refuse, and a real nats-server."""

from __future__ import annotations

import contextlib

from aiohttp import web

from asyncrl_proto import WeightsPublished
from services.common.bus import Bus
from services.common.versions import publish_weights
from services.model.hf_io import load_model, save_model
from services.weightsync.service import WeightSyncService
from tests.conftest import start_service, wait_until
from tests.integration.test_buffer_service import config


class RefusingEngine:
    """SGLang's pause / flush / load / continue routes; /flush_cache answers 400 ("Cache not
    flushed", as SGLang) the first `refusals` times it is asked. Records every call, and whether
    weights were loaded over a cache that was not flushed since the pause."""

    def __init__(self, refusals: int):
        self.refusals = refusals
        self.version = "0"
        self.paused = False
        self.flushed_since_pause = False
        self.calls: list[str] = []
        self.loads_over_stale_cache = 0
        self.url = ""
        self._runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_get("/model_info", self.model_info)
        app.router.add_get("/server_info", self.server_info)
        app.router.add_post("/pause_generation", self.pause)
        app.router.add_post("/continue_generation", self.cont)
        app.router.add_post("/flush_cache", self.flush)
        app.router.add_post("/update_weights_from_disk", self.load)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{site._server.sockets[0].getsockname()[1]}"

    async def stop(self) -> None:
        await self._runner.cleanup()

    async def model_info(self, request):
        return web.json_response({"model_path": "m", "weight_version": self.version})

    async def server_info(self, request):
        return web.json_response({"version": "0.5.23"})  # no staged loading: loads inside the pause

    async def pause(self, request):
        self.calls.append("pause")
        self.paused, self.flushed_since_pause = True, False
        return web.json_response({"message": "Generation paused successfully.", "status": "ok"})

    async def cont(self, request):
        self.calls.append("continue")
        self.paused = False
        return web.json_response({"message": "Generation continued successfully.", "status": "ok"})

    async def flush(self, request):
        self.calls.append("flush")
        if self.refusals > 0:
            self.refusals -= 1
            return web.Response(status=400, text="Cache not flushed. Please check backend logs for more details.")
        self.flushed_since_pause = True
        return web.Response(text="Cache flushed.\nPlease check backend logs for more details.")

    async def load(self, request):
        body = await request.json()
        self.calls.append("load")
        if not self.flushed_since_pause:
            self.loads_over_stale_cache += 1
        self.version = str(body["weight_version"])
        return web.json_response({"success": True, "message": "Succeeded to update model weights.",
                                  "num_paused_requests": 0})  # fmt: skip


@contextlib.asynccontextmanager
async def weight_sync_publishing_v1(refusals: int, flush_timeout_s: float, nats_server, run_id, task_data,
                                    tiny_model_dir, tmp_path):  # fmt: skip
    """A stand-in engine refusing `refusals` flushes, weight-sync in front of it, and v1 published."""
    engine = RefusingEngine(refusals)
    await engine.start()
    cfg = config(task_data, tiny_model_dir, run_dir=str(tmp_path), rollout_engine_urls=[engine.url],
                 flush_cache_timeout_s=flush_timeout_s)  # fmt: skip
    svc = await start_service(WeightSyncService, cfg, nats_server.url, run_id)
    bus = await Bus.connect(nats_server.url, run_id, "test")
    try:
        info = save_model(load_model(tiny_model_dir), tmp_path / "weights" / "v1", tiny_model_dir)
        await publish_weights(bus,
            WeightsPublished(version=1, step=0, uri=str(tmp_path / "weights" / "v1"), sha256=info["sha256"])
        )
        yield engine, svc
    finally:
        await svc.stop()
        await bus.close()
        await engine.stop()


async def test_a_refused_flush_is_asked_again_and_the_weights_load_only_after_it(nats_server, run_id, task_data,
                                                                                tiny_model_dir, tmp_path):  # fmt: skip
    async with weight_sync_publishing_v1(2, 30.0, nats_server, run_id, task_data, tiny_model_dir,
                                         tmp_path) as (engine, svc):  # fmt: skip
        await wait_until(lambda: svc.service.live_version == 1, what="v1 live", timeout=30)
        assert engine.version == "1" and not engine.paused
        assert engine.loads_over_stale_cache == 0
        update = engine.calls[engine.calls.index("pause"):]
        assert update == ["pause", "flush", "flush", "flush", "load", "continue"], update


async def test_a_flush_refused_past_the_timeout_abandons_the_update_on_that_engine(nats_server, run_id, task_data,
                                                                                  tiny_model_dir, tmp_path):  # fmt: skip
    async with weight_sync_publishing_v1(10**6, 2.0, nats_server, run_id, task_data, tiny_model_dir,
                                         tmp_path) as (engine, svc):  # fmt: skip
        # asked again for the timeout, then given up on: the engine continues on its old version
        await wait_until(lambda: engine.calls.count("flush") >= 2 and engine.calls[-1] == "continue",
                         what="the update abandoned", timeout=20)  # fmt: skip
        assert engine.version == "0" and not engine.paused
        assert "load" not in engine.calls and engine.loads_over_stale_cache == 0
        update = engine.calls[engine.calls.index("pause"):]
        assert update[-1] == "continue" and set(update[1:-1]) == {"flush"}, update
        await wait_until(lambda: svc.service.num_updates == 0 and svc.service.live_version == 0, what="v0 live")
        assert not svc.task.done()  # weight-sync serves on: a later update (or its convergence) retries
