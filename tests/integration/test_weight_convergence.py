"""Weight-sync converges the engines to the newest published version whether or not it consumed
that version's message: a message taken by another consumer with weight-sync's own identity (the
role probe), or acknowledged before weight-sync restarted, cannot leave the engines behind. Against
the stand-in engine of test_flush_refused (SGLang's routes) and a real nats-server."""

from __future__ import annotations

import time

from asyncrl_proto import WeightsPublished
from services.common.bus import Bus, fetch_some, settle
from services.common.versions import publish_weights
from services.model.hf_io import load_model, save_model
from services.weightsync.service import WeightSyncService
from tests.conftest import start_service, wait_until
from tests.integration.test_buffer_service import config
from tests.integration.test_flush_refused import RefusingEngine


async def _publish(bus, tiny_model_dir, tmp_path, version: int) -> None:
    snap = tmp_path / "weights" / f"v{version}"
    info = save_model(load_model(tiny_model_dir), snap, tiny_model_dir)
    await publish_weights(bus, WeightsPublished(version=version, step=version - 1, uri=str(snap), sha256=info["sha256"]))


async def test_stolen_weight_messages_still_reach_the_engines_after_a_restart(nats_server, run_id, task_data,
                                                                              tiny_model_dir, tmp_path):  # fmt: skip
    engine = RefusingEngine(0)
    await engine.start()
    cfg = config(task_data, tiny_model_dir, run_dir=str(tmp_path), rollout_engine_urls=[engine.url])
    bus = await Bus.connect(nats_server.url, run_id, "trainer")
    thief = await Bus.connect(nats_server.url, run_id, "weight-sync")
    svc = await start_service(WeightSyncService, cfg, nats_server.url, run_id)
    try:
        await _publish(bus, tiny_model_dir, tmp_path, 1)
        await wait_until(lambda: svc.service.live_version == 1 and engine.version == "1", what="v1 live", timeout=30)
        await svc.stop()
        # weight-sync away: v2..v4 published, and every message taken from its durable consumer
        for v in (2, 3, 4):
            await _publish(bus, tiny_model_dir, tmp_path, v)
        sub = await thief.consume(thief.subjects.consumers(cfg.async_.prompt_ack_wait_s)["weight-sync"])
        stolen = []
        while len(stolen) < 3:
            for m in await fetch_some(sub, 16, 1.0):
                stolen.append(m)
                await settle(m)
        t0 = time.monotonic()
        svc = await start_service(WeightSyncService, cfg, nats_server.url, run_id)
        await wait_until(lambda: engine.version == "4" and svc.service.live_version == 4, what="v4 live", timeout=10)
        assert time.monotonic() - t0 < 10 and not engine.paused
        # running: a message stolen while weight-sync waits is caught up from WEIGHTS' last message
        for v in (5, 6):
            await _publish(bus, tiny_model_dir, tmp_path, v)
            while engine.version != str(v):  # the thief and weight-sync race for it
                got = await fetch_some(sub, 16, 0.2)
                for m in got:
                    await settle(m)
                if not got:
                    break
        await wait_until(lambda: engine.version == "6" and svc.service.live_version == 6, what="v6 live", timeout=10)
    finally:
        await svc.stop()
        await thief.close()
        await bus.close()
        await engine.stop()
