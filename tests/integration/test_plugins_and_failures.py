"""Plugins inside the buffer service (custom DataBuffer, dynamic-sampling filter) and the
trainer's loud failures, against a real nats-server."""

from __future__ import annotations

import logging

import pytest

from services.api import DataBuffer, RunConfig
from services.buffer.service import BufferService
from services.common.bus import Bus, fetch_some
from tests.conftest import pull, start_service, wait_until
from tests.integration.test_buffer_service import Harness, config


class ListBuffer(DataBuffer):
    """A custom buffer: unbounded FIFO, counts what it saw."""

    def __init__(self, config, recycle):
        super().__init__(config, recycle)
        import asyncio

        self.items = asyncio.Queue()
        self.puts = 0

    async def put(self, group):
        self.puts += 1
        await self.items.put(group)

    async def get(self, current_version=None, **context):
        return await self.items.get()

    def get_metrics(self):
        return {"custom/puts": self.puts}


class ExplodingBuffer(ListBuffer):
    async def put(self, group):
        raise KeyError("boom")


async def test_custom_buffer_takes_over_all_three_methods(nats_server, run_id, task_data, tiny_model_dir):
    cfg = config(task_data, tiny_model_dir, custom_async_data_buffer_path=f"{__name__}.ListBuffer")
    svc = await start_service(BufferService, cfg, nats_server.url, run_id)
    h = Harness(await Bus.connect(nats_server.url, run_id, "test"))
    try:
        assert isinstance(svc.service.buffer, ListBuffer)
        await h.get(0, wait_s=0.1)
        for p in await h.prompts(2):
            await h.publish_group(p)
        reply = await h.get(0)
        assert reply.complete and reply.metrics == {"custom/puts": 2.0}
        assert svc.service.state.counters["accepted"] == 2
    finally:
        await svc.stop()
        await h.bus.close()


async def test_a_raising_custom_buffer_fails_loudly_with_its_path(nats_server, run_id, task_data, tiny_model_dir):
    path = f"{__name__}.ExplodingBuffer"
    svc = await start_service(
        BufferService, config(task_data, tiny_model_dir, custom_async_data_buffer_path=path), nats_server.url, run_id
    )
    h = Harness(await Bus.connect(nats_server.url, run_id, "test"))
    try:
        await h.get(0, wait_s=0.1)
        await h.publish_group((await h.prompts(1))[0])
        await wait_until(lambda: svc.task.done(), timeout=10, what="the service to fail")
        with pytest.raises(BaseException) as e:
            svc.task.result()
        assert f"{path}.put raised KeyError" in str(e.value.exceptions[0])
    finally:
        await h.bus.close()


async def test_dynamic_filter_by_import_path(nats_server, run_id, task_data, tiny_model_dir):
    cfg = config(task_data, tiny_model_dir, dynamic_sampling_filter_path="services.api.check_reward_nonzero_std")
    svc = await start_service(BufferService, cfg, nats_server.url, run_id)
    h = Harness(await Bus.connect(nats_server.url, run_id, "test"))
    try:
        await h.get(0, wait_s=0.1)
        prompts = await h.prompts(4)
        from asyncrl_proto import RolloutGroup, Sample, SampleStatus, group_id

        same = [Sample(index=i, group_index=prompts[0].group_index, reward=1.0, tokens=[1, 2], response_length=1,
                       status=SampleStatus.COMPLETED) for i in range(2)]  # fmt: skip
        rg = RolloutGroup(
            group_id=group_id(prompts[0].group_index, 0), group_index=prompts[0].group_index, samples=same
        )
        await h.bus.publish(h.s.rollouts, rg, msg_id=rg.group_id)
        for p in prompts[1:3]:
            await h.publish_group(p)  # rewards 0 and 1: kept
        reply = await h.get(0)
        assert reply.complete and reply.metrics["rollout/dynamic_filter/drop_zero_std_1.0"] == 1
        assert svc.service.state.counters["filtered/zero_std_1.0"] == 1
    finally:
        await svc.stop()
        await h.bus.close()


async def _trainer_failure(nats_server, run_id, task_data, tiny_model_dir, with_buffer: bool, caplog):
    from services.trainer.service import TrainerService

    cfg = RunConfig(prompt_data=str(task_data[0]), hf_checkpoint=str(tiny_model_dir), rollout_batch_size=2,
                    n_samples_per_prompt=2, fully_async=True, run_dir=str(nats_server.store_dir / run_id),
                    rollout_wait_warn_s=0.5, producer_timeout_s=2.0, buffer_timeout_s=2.0,
                    skip_eval_before_train=True)  # fmt: skip
    buf = (
        await start_service(BufferService, config(task_data, tiny_model_dir), nats_server.url, run_id)
        if with_buffer
        else None
    )
    caplog.set_level(logging.WARNING)
    try:
        trainer = await start_service(TrainerService, cfg, nats_server.url, run_id)
    except BaseException as e:  # it asks the buffer where to resume while it sets up
        if buf:
            await buf.stop()
        return str(e.exceptions[0] if isinstance(e, BaseExceptionGroup) else e)
    try:
        await wait_until(lambda: trainer.task.done(), timeout=30, what="the trainer to fail")
        with pytest.raises(BaseException) as e:
            trainer.task.result()
        return str(e.value.exceptions[0])
    finally:
        if buf:
            await buf.stop()


async def test_trainer_warns_then_fails_when_no_producer_is_alive(
    nats_server, run_id, task_data, tiny_model_dir, caplog
):
    msg = await _trainer_failure(nats_server, run_id, task_data, tiny_model_dir, True, caplog)
    assert "no rollout producer has been alive for 2s" in msg
    assert any("No completed rollout groups for 0.5s" in r.getMessage() for r in caplog.records)


async def test_trainer_fails_when_the_buffer_does_not_answer(nats_server, run_id, task_data, tiny_model_dir, caplog):
    msg = await _trainer_failure(nats_server, run_id, task_data, tiny_model_dir, False, caplog)
    assert "the buffer service has not answered" in msg and "is it running?" in msg


async def test_a_prompt_that_always_fails_ends_as_a_failed_group(nats_server, run_id, task_data, tiny_model_dir,
                                                                 monkeypatch):  # fmt: skip
    """An engine that rejects every request (SGLang answers 400 to a prompt that is too long):
    the prompt is retried with a growing delay, then published as a FAILED group, so the buffer
    and its ledger account for it instead of it looping forever."""
    from aiohttp import web

    from asyncrl_proto import PromptMsg, RolloutGroup, SampleStatus, decode
    from services.common import procs
    from services.rollout import service as rollout_service

    monkeypatch.setattr(rollout_service, "RETRY_BACKOFF_S", 0.05)
    calls = []

    async def generate(request):
        calls.append(await request.json())
        return web.Response(status=400, text="the input is longer than the context length")

    async def healthy(request):
        return web.Response(text="ok")

    app = web.Application()
    app.add_routes([web.post("/generate", generate), web.get("/health_generate", healthy)])
    runner = web.AppRunner(app)
    await runner.setup()
    port = procs.free_port()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    cfg = RunConfig(prompt_data=str(task_data[0]), hf_checkpoint=str(tiny_model_dir), rollout_batch_size=2,
                    n_samples_per_prompt=2, fully_async=True, run_dir=str(nats_server.store_dir / run_id),
                    rollout_engine_urls=[f"http://127.0.0.1:{port}"])  # fmt: skip
    bus = await Bus.connect(nats_server.url, run_id, "test")
    await bus.ensure_streams()
    rollouts = await pull(bus, bus.subjects.rollouts_stream, bus.subjects.rollouts, durable="test")
    producer = await start_service(rollout_service.RolloutService, cfg, nats_server.url, run_id)
    try:
        await bus.publish(bus.subjects.prompts, PromptMsg(group_index=7, prompt="12345", label="54321", n_samples=2))
        msgs = []

        async def published() -> bool:
            msgs.extend(await fetch_some(rollouts, 1, 0.2))
            return bool(msgs)

        await wait_until(published, timeout=20, what="the failed group")
        rg = decode(msgs[0].data, RolloutGroup)
        assert rg.group_index == 7 and len(rg.samples) == 2
        assert all(s.status is SampleStatus.FAILED and s.response_length == 0 for s in rg.samples)
        assert "longer than the context length" in rg.samples[0].metadata["error"]
        assert producer.service.counters["group_failures"] == rollout_service.MAX_GROUP_DELIVERIES
        assert len(calls) >= rollout_service.MAX_GROUP_DELIVERIES

        async def settled() -> bool:
            return (await bus.js.stream_info(bus.subjects.prompts_stream)).state.messages == 0

        await wait_until(settled, what="the prompt acknowledged")
    finally:
        await producer.stop()
        await bus.close()
        await runner.cleanup()


async def test_a_producer_that_stops_is_forgotten_at_once(nats_server, run_id, task_data, tiny_model_dir, engine):
    """A producer's last heartbeat says it is stopping: the buffer stops counting its in-flight
    capacity at once instead of after the heartbeat timeout."""
    from services.rollout.service import RolloutService

    cfg = config(task_data, tiny_model_dir, hf_checkpoint=str(tiny_model_dir), rollout_engine_urls=[engine.url])
    buf = await start_service(BufferService, cfg, nats_server.url, run_id)
    producer = await start_service(RolloutService, cfg, nats_server.url, run_id)
    try:
        pid = producer.service.instance_id
        await wait_until(lambda: pid in buf.service.producers, what="the producer's first heartbeat")
        await producer.stop()
        await wait_until(lambda: pid not in buf.service.producers, timeout=3, what="the producer forgotten")
    finally:
        await producer.stop()
        await buf.stop()
