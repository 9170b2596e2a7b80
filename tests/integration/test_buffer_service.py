"""The buffer service against a real nats-server: release policy, leases, commits, staleness
clock, dead letters. The test plays producer (PROMPTS -> ROLLOUTS) and trainer (get/commit)."""

from __future__ import annotations

import asyncio

import httpx
import msgpack
from prometheus_client.parser import text_string_to_metric_families

from asyncrl_proto import (
    BufferCommit,
    BufferCommitReply,
    BufferGetReply,
    BufferGetRequest,
    PromptMsg,
    RolloutGroup,
    Sample,
    SampleStatus,
    WeightsLive,
    WeightsPublished,
    decode,
    group_id,
)
from services.api import RunConfig
from services.audit import collect
from services.buffer.service import BufferService
from services.buffer.state import ledger_events
from services.common.bus import Bus, fetch_some
from tests.conftest import AUTH, pull, start_service, wait_until


def config(task_data, model_dir, **kw) -> RunConfig:
    base = dict(prompt_data=str(task_data[0]), hf_checkpoint=str(model_dir), rollout_batch_size=2, n_samples_per_prompt=2, fully_async=True,
                async_data_buffer_capacity_factor=1.0, run_dir="/tmp")  # fmt: skip
    base.update(kw)
    return RunConfig(**base)


class Harness:
    def __init__(self, bus: Bus):
        self.bus = bus
        self.s = bus.subjects
        self.psub = None

    async def prompts(self, k: int, timeout: float = 5.0) -> list[PromptMsg]:
        if self.psub is None:
            self.psub = await pull(self.bus, self.s.prompts_stream, self.s.prompts, durable="producers")
        out = []
        while len(out) < k:
            msgs = await fetch_some(self.psub, k - len(out), timeout)
            assert msgs, f"expected {k} prompts, got {len(out)}"
            for m in msgs:
                out.append(decode(m.data, PromptMsg))
                await m.ack()
        return out

    async def publish_group(self, p: PromptMsg, versions=(0,), n=2, status=SampleStatus.COMPLETED):
        samples = [Sample(index=p.group_index * 2 + i, group_index=p.group_index, prompt=p.prompt, label=p.label,
                          tokens=[1, 5, 15, 5, 2], response_length=2, reward=float(i), status=status,
                          weight_versions=list(versions), rollout_log_probs=[-1.0, -1.0]) for i in range(n)]  # fmt: skip
        rg = RolloutGroup(
            group_id=group_id(p.group_index, p.attempt),
            group_index=p.group_index,
            attempt=p.attempt,
            samples=samples,
        )
        await self.bus.publish(self.s.rollouts, rg, msg_id=rg.group_id)

    async def published(self, version: int) -> None:
        """The trainer pushed `version`."""
        pub = WeightsPublished(version=version, step=max(0, version - 1), uri=f"/weights/v{version}")
        await self.bus.publish(self.s.weights_published, pub)

    async def live(self, version: int) -> None:
        """The engines run `version`: published by the trainer, then announced by weight-sync."""
        await self.published(version)
        await self.bus.publish(self.s.weights_live, WeightsLive(version=version))

    async def get(self, step: int, **kw) -> BufferGetReply:
        req = BufferGetRequest(step=step, count=2, wait_s=kw.pop("wait_s", 3.0), **kw)
        return await self.bus.request(self.s.buffer_get, req, BufferGetReply, timeout=req.wait_s + 5)

    async def stream_msgs(self, stream: str) -> int:
        return (await self.bus.js.stream_info(stream)).state.messages


async def _setup(nats_server, run_id, cfg):
    svc = await start_service(BufferService, cfg, nats_server.url, run_id)
    bus = await Bus.connect(nats_server.url, run_id, "test")
    return svc, Harness(bus)


async def test_release_waits_for_the_trainer_and_is_bounded(nats_server, run_id, task_data, tiny_model_dir):
    svc, h = await _setup(nats_server, run_id, config(task_data, tiny_model_dir))
    try:
        assert await h.stream_msgs(h.s.prompts_stream) == 0  # nothing before the first get
        reply = await h.get(0, wait_s=0.2)
        assert not reply.complete and reply.refs == []
        # capacity 2 + one producer's in-flight cap 2
        await wait_until(lambda: svc.service.state.counters.get("released") == 4, what="4 releases")
        assert await h.stream_msgs(h.s.prompts_stream) == 4
    finally:
        await svc.stop()
        await h.bus.close()


async def test_get_is_idempotent_per_step_and_commit_retires(nats_server, run_id, task_data, tiny_model_dir):
    svc, h = await _setup(nats_server, run_id, config(task_data, tiny_model_dir))
    try:
        await h.get(0, wait_s=0.1)
        for p in await h.prompts(2):
            await h.publish_group(p)
        reply = await h.get(0)
        assert reply.complete and len(reply.refs) == 2
        assert reply.metrics["rollout/fully_async/queue_size"] == 0
        groups = [decode(await h.bus.get_payload(h.s.rollouts_stream, r.stream_seq), RolloutGroup) for r in reply.refs]
        assert sorted(g.group_index for g in groups) == [0, 1]
        again = await h.get(0)
        assert [r.group_id for r in again.refs] == [r.group_id for r in reply.refs]  # same lease
        done = await h.bus.request(h.s.buffer_commit, BufferCommit(step=0), BufferCommitReply, timeout=5)
        assert done.num_groups_committed == 2 and svc.service.state.counters["trained"] == 2
        late = await h.get(0)
        assert late.error and "already committed" in late.error
    finally:
        await svc.stop()
        await h.bus.close()


async def test_a_waiting_get_is_answered_once_when_its_lease_is_durable(nats_server, run_id, task_data, tiny_model_dir):
    """One answer per get, sent once the lease is on the ledger; a request with the retired
    provisional_ok flag gets the same single, durable answer."""
    svc, h = await _setup(nats_server, run_id, config(task_data, tiny_model_dir))
    try:
        await h.get(0, wait_s=0.1)

        def ask(**kw):
            req = BufferGetRequest(step=0, count=2, wait_s=10.0, **kw)
            return asyncio.ensure_future(h.bus.request(h.s.buffer_get, req, BufferGetReply, timeout=15))

        old, plain = ask(provisional_ok=True), ask()
        for p in await h.prompts(2):
            await h.publish_group(p)
        answers = [await old, await plain]
        assert all(a.complete and a.durable for a in answers)
        assert [r.group_id for r in answers[0].refs] == [r.group_id for r in answers[1].refs]
        assert all(r.payload for r in answers[0].refs)  # small groups travel inline
        events = [e for d in await h.bus.read_stream(h.s.ledger_stream, h.s.ledger) for e in ledger_events(d)]
        assert any(e.kind == "lease_complete" and e.step == 0 for e in events)
    finally:
        await svc.stop()
        await h.bus.close()


async def test_bad_messages_are_dead_lettered_and_the_service_keeps_running(
    nats_server, run_id, task_data, tiny_model_dir
):
    svc, h = await _setup(nats_server, run_id, config(task_data, tiny_model_dir))
    try:
        await h.bus.js.publish(h.s.rollouts, b"\xc1 not msgpack")
        await h.bus.js.publish(h.s.rollouts, msgpack.packb({"group_id": 3}))
        await h.get(0, wait_s=0.1)
        prompts = await h.prompts(3)
        await h.publish_group(prompts[0], n=3)  # wrong number of trajectories
        await wait_until(lambda: svc.service.bus.dead_lettered["rollouts"] == 3, what="3 dead letters")
        assert await h.stream_msgs(h.s.deadletter_stream) == 3
        for p in prompts[1:]:
            await h.publish_group(p)
        assert (await h.get(0)).complete  # still serving
        async with httpx.AsyncClient(base_url=svc.service.http_url, headers=AUTH) as c:
            text = (await c.get("/metrics")).text
            samples = {s.name: s for f in text_string_to_metric_families(text) for s in f.samples}
            assert samples["asyncrl_buffer_ledger_dead_lettered_total"].value == 3
            assert samples["asyncrl_buffer_free_capacity"].value == 2  # the producers' autoscaling metric: all leased
            assert samples["asyncrl_buffer_free_capacity"].labels == {"run": run_id, "service": "buffer",
                                                                      "instance": svc.service.instance_id}  # fmt: skip
            status = (await c.get("/status")).json()
        assert status["capacity"] == 2 and status["dead_lettered"] == {"rollouts": 3}
        assert status["ledger"]["rejected"] == 3  # and each one's fate is on the ledger
    finally:
        await svc.stop()
        await h.bus.close()


async def test_staleness_is_judged_against_the_live_version(nats_server, run_id, task_data, tiny_model_dir):
    svc, h = await _setup(nats_server, run_id, config(task_data, tiny_model_dir, max_weight_staleness=1))
    try:
        await h.live(5)
        await wait_until(lambda: svc.service.live_version == 5, what="live version 5")
        await h.get(0, wait_s=0.1)
        prompts = await h.prompts(4)
        await h.publish_group(prompts[0], versions=(3,))  # staleness 2: rejected
        for p in prompts[1:3]:
            await h.publish_group(p, versions=(4, 5))
        reply = await h.get(0)
        assert reply.complete and [r.group_index for r in reply.refs] == [1, 2]
        assert [r.staleness for r in reply.refs] == [1, 1]
        assert reply.metrics["rollout/fully_async/stale_groups_filtered"] == 1
        assert svc.service.state.counters["stale_dropped"] == 1
    finally:
        await svc.stop()
        await h.bus.close()


async def test_a_stale_group_never_leaves_a_get_holding_a_group_for_a_finished_step(
    nats_server, run_id, task_data, tiny_model_dir
):
    """Stored groups that are all stale leave no get() waiting for the next group: the put
    path leases groups too, and a group that such a waiting get took after its step was
    completed and committed would be leased to the committed step (trained by nobody)."""
    svc, h = await _setup(nats_server, run_id, config(task_data, tiny_model_dir, max_weight_staleness=1))
    buf, state = svc.service.buffer, svc.service.state

    async def live(v):
        await h.live(v)
        await wait_until(lambda: svc.service.live_version == v, what=f"live version {v}")

    async def step(s, versions):
        await h.get(s, wait_s=0.1)
        for p in await h.prompts(2):
            await h.publish_group(p, versions=versions)
        reply = await h.get(s)
        assert reply.complete and len(reply.refs) == 2
        await h.bus.request(h.s.buffer_commit, BufferCommit(step=s), BufferCommitReply, timeout=5)

    try:
        await live(5)
        await step(0, (5,))
        (p,) = await h.prompts(1)
        await h.publish_group(p, versions=(5,))  # stored while no step asks for a group
        await wait_until(lambda: len(buf) == 1, what="a stored group")
        await live(7)  # now it is stale (7 - 5 > 1)
        await step(1, (7,))
        assert state.counters["stale_dropped"] == 1
        (p,) = await h.prompts(1)
        await h.publish_group(p, versions=(7,))  # stored again while no step asks
        await wait_until(lambda: len(buf) == 1 or 1 in state.leases, what="the group stored")
        assert 1 not in state.leases and len(buf) == 1
        assert state.counters["trained"] == 4
    finally:
        await svc.stop()
        await h.bus.close()


async def test_sync_mode_releases_one_batch_on_the_right_weights(nats_server, run_id, task_data, tiny_model_dir):
    svc, h = await _setup(nats_server, run_id, config(task_data, tiny_model_dir, fully_async=False, driver="sync"))
    try:
        await h.published(1)  # the trainer pushed v1 and asks for step 0's prompts on it
        await h.get(0, wait_s=0.2, release_min_version=1)
        assert svc.service.state.counters.get("released", 0) == 0  # engines still on version 0
        await h.live(1)
        await wait_until(lambda: svc.service.state.counters.get("released") == 2, what="one batch released")
        await h.get(0, wait_s=0.3, release_min_version=1)
        assert svc.service.state.counters.get("released") == 2  # exactly B, never more
    finally:
        await svc.stop()
        await h.bus.close()


async def test_a_release_recorded_but_never_published_is_published_by_the_restarted_buffer(
    nats_server, run_id, task_data, tiny_model_dir
):
    """A release is recorded, then its prompts published: a buffer that dies in between leaves
    prompts the ledger holds and no producer can see. The restarted buffer publishes every
    outstanding prompt again (same ids: one that was out already is not stored twice), and the
    step completes with nothing rejected. A group for a prompt never recorded released (one 200
    ahead) is rejected and releases nothing."""
    cfg = config(task_data, tiny_model_dir)
    svc = await start_service(BufferService, cfg, nats_server.url, run_id)
    h = Harness(await Bus.connect(nats_server.url, run_id, "test"))

    async def crash_before_publishing(prompts):
        raise RuntimeError("killed after recording the release, before publishing its prompts")

    svc.service.part._publish_prompts = crash_before_publishing
    try:
        await h.get(0, wait_s=0.1)
        await wait_until(lambda: svc.task.done(), what="the buffer to die")
        again = await start_service(BufferService, cfg, nats_server.url, run_id)
        try:
            recorded = dict(again.service.state.outstanding)
            assert len(recorded) >= 2
            prompts = await h.prompts(len(recorded))
            assert {group_id(p.group_index, p.attempt) for p in prompts} == set(recorded)
            ghost = prompts[0]
            ghost.group_index = again.service.state.next_group_index + 200
            await h.publish_group(ghost)
            for p in prompts[1:3]:
                await h.publish_group(p)
            reply = await h.get(0)
            assert reply.complete and sorted(r.group_index for r in reply.refs) == sorted(p.group_index for p in prompts[1:3])
            await wait_until(lambda: again.service.state.counters.get("rejected") == 1, what="the ghost rejected")
            assert again.service.state.next_group_index < ghost.group_index  # the ghost released nothing
        finally:
            await again.stop()
    finally:
        await h.bus.close()


async def test_a_prompt_taken_and_never_answered_is_released_again(nats_server, run_id, task_data, tiny_model_dir,
                                                                  tmp_path):  # fmt: skip
    """A consumer on `producers` that acknowledges prompts and publishes nothing used to leave the
    trainer waiting forever with every health check green (the audit then reported them lost).
    Past --prompt-deadline-s such a prompt goes back as a new attempt, recorded `expired` on the
    ledger; the run completes, and the old attempt's late answer is a duplicate, not trained."""
    cfg = config(task_data, tiny_model_dir, prompt_deadline_s=1.0, run_dir=str(tmp_path))
    svc, h = await _setup(nats_server, run_id, cfg)
    try:
        await h.get(0, wait_s=0.1)
        taken = await h.prompts(2)  # acknowledged, never answered
        assert all(p.attempt == 0 for p in taken)
        await wait_until(lambda: svc.service.state.counters.get("expired", 0) >= 2, what="2 expired", timeout=15)
        again = [p for p in await h.prompts(4) if p.attempt == 1]
        assert sorted(p.group_index for p in again) == sorted(p.group_index for p in taken)
        for p in again:
            await h.publish_group(p)
        reply = await h.get(0)
        assert reply.complete and sorted(r.group_index for r in reply.refs) == sorted(p.group_index for p in taken)
        await h.publish_group(taken[0])  # the first attempt answers after all: a duplicate
        await wait_until(lambda: svc.service.state.counters.get("duplicate_groups", 0) == 1, what="a duplicate")
        done = await h.bus.request(h.s.buffer_commit, BufferCommit(step=0), BufferCommitReply, timeout=5)
        assert done.num_groups_committed == 2
    finally:
        await svc.stop()
        await h.bus.close()
    report = await collect(nats_server.url, run_id, tmp_path)
    assert report["lost"] == 0 and report["trained_twice"] == 0 and report["trained"] == 2, report["problems"]
    assert report["recycled"] >= 2


async def test_a_stalled_run_shows_on_healthz_and_status_with_its_cause(nats_server, run_id, task_data,
                                                                       tiny_model_dir):  # fmt: skip
    """The trainer waits for step 0 and no producer is alive: past the stall limit /healthz still
    answers 200 (a restart would not cure it) and names the stall and its cause, as /status does."""
    import httpx

    svc, h = await _setup(nats_server, run_id, config(task_data, tiny_model_dir, stall_report_s=1.0))
    try:
        async with httpx.AsyncClient(base_url=svc.service.http_url, timeout=10) as anon:
            assert (await anon.get("/healthz")).text == "ok\n"
            await h.get(0, wait_s=0.2)

            async def noted() -> str | None:
                r = await anon.get("/healthz")
                assert r.status_code == 200
                return r.text if r.text != "ok\n" else None

            health = await wait_until(noted, what="a stall on /healthz", timeout=15)
        assert health.startswith("ok: stalled for") and "no producer is alive" in health, health
        assert "no producer is alive" in svc.service.status()["stalled"]["cause"]
    finally:
        await svc.stop()
        await h.bus.close()

