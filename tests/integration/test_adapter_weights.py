"""Multi-LoRA adapter versions from the trainer to every engine, over an authenticated broker:
the trainer saves and announces, weight-sync loads each version on every engine without a pause,
records it live, then unloads the one before; a restarted engine gets the live version back."""

from __future__ import annotations

import asyncio
import uuid

import httpx
import nats.errors
import pytest
import torch

from asyncrl_proto import AdapterLive, AdapterPublished, decode
from asyncrl_proto.messages import adapter_engine_name
from services.common.sglang_client import SGLangClient
from services.model.hf_io import load_model
from services.model.lora import LoraSpec, MultiLora
from services.trainer.adapter_push import publish_adapter
from services.weightsync.adapters import AdapterSync, live_key
from tests.conftest import EngineThread, connect_role

PROMPT = [1, 5, 6, 7, 15]


@pytest.fixture(scope="module")
def server(role_server):
    return role_server


def trained(tiny_model_dir, seed: int) -> MultiLora:
    lora = MultiLora(load_model(tiny_model_dir), n_slots=1, max_rank=4)
    lora.init_slot(0, LoraSpec(rank=4, alpha=8.0), seed=seed)
    with torch.no_grad():
        for key in lora.B:
            lora.B[key][0].normal_(0, 0.3, generator=torch.Generator().manual_seed(seed))
    return lora


async def generate(url: str, lora_path: str, status: int = 200) -> dict:
    body = {"input_ids": PROMPT, "lora_path": lora_path, "sampling_params": {"max_new_tokens": 4, "temperature": 0}}
    async with httpx.AsyncClient(timeout=30) as c:
        r = await c.post(f"{url}/generate", json=body)
    assert r.status_code == status, r.text
    return r.json()


async def next_message(sub) -> tuple[AdapterPublished, object]:
    msgs = await sub.fetch(1, timeout=10)
    return decode(msgs[0].data, AdapterPublished), msgs[0]


async def test_adapter_versions_reach_every_engine_without_a_pause(server, tiny_model_dir, tmp_path):
    admin, trainer_bus, sync_bus, producer = [
        await connect_role(server, r) for r in ("admin", "trainer", "weight-sync", "rollout")
    ]
    reg = uuid.uuid4().hex
    try:
        await admin.ensure_streams(partitioned=True)
        await admin.ensure_consumers(60.0)
        sub = await sync_bus.consume(sync_bus.subjects.consumers(60.0)["weight-sync-adapters"])
        with EngineThread(tiny_model_dir, max_loras=2, max_lora_rank=4) as e1, \
                EngineThread(tiny_model_dir, max_loras=2, max_lora_rank=4) as e2:  # fmt: skip
            client = SGLangClient([e1.url, e2.url])
            unloads: list[asyncio.Future] = []

            def spawn(coro, _what):
                unloads.append(asyncio.ensure_future(coro))
                return unloads[-1]

            sync = AdapterSync(sync_bus, client, str(tmp_path), spawn=spawn)
            try:
                await publish_adapter(trainer_bus, trained(tiny_model_dir, 1), 0, tmp_path, "tenant-a", reg, 1)
                pub, msg = await next_message(sub)
                assert await sync.problem(pub) is None
                assert await sync.apply(pub) is True
                await msg.ack()
                v1 = adapter_engine_name("tenant-a", reg, 1)
                live = decode(await producer.kv_get(live_key("tenant-a")), AdapterLive)  # producers may read it
                assert (live.version, live.engine_name) == (1, v1)
                out1 = [await generate(e.url, v1) for e in (e1, e2)]
                assert out1[0]["output_ids"] == out1[1]["output_ids"]
                assert e1.scheduler.stats.num_retracted_requests_total == 0 and not e1.scheduler.paused_mode

                # version 2: loaded everywhere, recorded live, then version 1 unloaded (in the
                # background; a version after it would wait for that unload before loading)
                await publish_adapter(trainer_bus, trained(tiny_model_dir, 2), 0, tmp_path, "tenant-a", reg, 2)
                pub2, msg2 = await next_message(sub)
                assert await sync.apply(pub2) is True
                assert len(unloads) == 1
                await sync._unloads_done("tenant-a", new_registration=False)
                assert unloads[0].done()
                v2 = adapter_engine_name("tenant-a", reg, 2)
                for e in (e1, e2):
                    assert set(e.loras.loaded()) == {v2}
                    await generate(e.url, v1, status=400)
                await generate(e1.url, v2)  # the live version serves
                # a redelivered older version changes nothing
                assert await sync.apply(pub) is False and sync.num_skipped == 1
                # an engine that lost its adapters (restarted) gets the live one back, and a version
                # nobody asks for any more (an unload that failed) is unloaded
                e2.loras.unload({"lora_name": v2})
                e1.loras.load({"lora_name": v1, "lora_path": pub.uri})
                await sync.converge()
                await asyncio.gather(*unloads)
                assert set(e1.loras.loaded()) == set(e2.loras.loaded()) == {v2}
                # a late message of an older registration of the name never replaces the live one
                late = AdapterPublished(name="tenant-a", registration_id=uuid.uuid4().hex, version=5, uri=pub.uri,
                                        created_at=pub.created_at - 60)  # fmt: skip
                assert await sync.apply(late) is False
                # a restarted weight-sync finds the live versions of the registry's adapters again
                from asyncrl_proto import AdapterRegistryState, AdapterRun, AdapterSpec, AdapterState, encode

                spec = AdapterSpec(data="d", rank=4, alpha=8.0, rollout_batch_size=1, n_samples_per_prompt=2,
                                   save="s", rm_type="x", num_step=1)  # fmt: skip
                run = AdapterRun(name="tenant-a", registration_id=reg, slot=0, state=AdapterState.ACTIVE, spec=spec)
                state = AdapterRegistryState(runs=[run])
                await admin.kv_put("adapters", encode(state))
                again = AdapterSync(sync_bus, client, str(tmp_path), spawn=spawn)
                await again.recover()
                e2.loras.unload({"lora_name": v2})
                await again.converge()
                assert set(e2.loras.loaded()) == {v2}
                await msg2.ack()
                # a completed registration frees its engine slots: its live version is unloaded at the
                # next converge (else it holds a slot for good and the next adapter's versions stop
                # loading), never loaded again, and a late message of it is skipped
                import msgspec

                done = AdapterRegistryState(runs=[msgspec.structs.replace(run, state=AdapterState.COMPLETED)])
                await admin.kv_put("adapters", encode(done))
                await again.converge()
                await asyncio.gather(*unloads)
                assert set(e1.loras.loaded()) == set(e2.loras.loaded()) == set() and not again.live
                await again.converge()
                assert set(e1.loras.loaded()) == set(e2.loras.loaded()) == set()
                assert await again.apply(pub2) is False
            finally:
                await client.close()
        # what weight-sync refuses: outside the run's adapters/, not complete, a bad name
        outside = AdapterPublished(name="tenant-a", registration_id=reg, version=3, uri=str(tmp_path.parent))
        assert "not under the run's adapters/tenant-a/" in await sync.problem(outside)
        (tmp_path / "adapters" / "tenant-a" / reg / "v9").mkdir(parents=True)
        half = AdapterPublished(name="tenant-a", registration_id=reg, version=9,
                                uri=str(tmp_path / "adapters" / "tenant-a" / reg / "v9"))  # fmt: skip
        assert "not a complete adapter directory" in await sync.problem(half)
        assert "invalid" in await sync.problem(AdapterPublished(name="../x", registration_id=reg, version=1, uri="/"))
        # only the trainer may announce adapter versions
        with pytest.raises((nats.errors.Error, TimeoutError)):
            await producer.publish(producer.subjects.adapters_published, outside)
    finally:
        for b in (admin, trainer_bus, sync_bus, producer):
            await b.close()


async def test_weight_sync_service_loads_announced_adapters_and_refuses_forged_ones(nats_server, run_id, task_data,
                                                                                   tiny_model_dir, tmp_path):  # fmt: skip
    from services.common.bus import Bus
    from services.weightsync.service import WeightSyncService
    from tests.conftest import start_service, wait_until
    from tests.integration.test_buffer_service import config

    reg = uuid.uuid4().hex
    with EngineThread(tiny_model_dir, max_loras=4, max_lora_rank=4) as engine:
        cfg = config(task_data, tiny_model_dir, run_dir=str(tmp_path), rollout_engine_urls=[engine.url],
                     multi_lora_n_adapters=2)  # fmt: skip
        svc = await start_service(WeightSyncService, cfg, nats_server.url, run_id)
        bus = await Bus.connect(nats_server.url, run_id, "test")
        try:
            forged = AdapterPublished(name="tenant-b", registration_id=reg, version=1, uri=str(tmp_path.parent))
            await bus.publish(bus.subjects.adapters_published, forged)
            pub = await publish_adapter(bus, trained(tiny_model_dir, 3), 0, tmp_path, "tenant-b", reg, 1)
            name = adapter_engine_name("tenant-b", reg, 1)
            await wait_until(lambda: name in engine.loras.loaded(), what="the adapter loaded", timeout=20)
            # recorded live once every engine has it (the KV write follows the loads)
            await wait_until(lambda: svc.service.status()["adapters_live"] == {"tenant-b": name},
                             what="the adapter recorded live", timeout=20)  # fmt: skip
            assert sum(svc.service.bus.dead_lettered.values()) == 1
            assert decode(await bus.kv_get(live_key("tenant-b")), AdapterLive).uri == pub.uri
            await generate(engine.url, name)
        finally:
            await svc.stop()
            await bus.close()
