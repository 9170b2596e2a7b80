"""Every consumer checks meaning, not only shape, against a real nats-server: a forged or broken
message is dead-lettered with its reason, its prompt's fate is written to the ledger, and the
service keeps serving. Buffer (groups, gets, commits, the staleness clock, heartbeats, its own
ledger), weight-sync (versions in order, the run's own complete snapshots), eval (points the
trainer could ask for)."""

from __future__ import annotations

import asyncio

import msgspec

from asyncrl_proto import (
    BufferCommit,
    BufferCommitReply,
    BufferGetRequest,
    DeadLetter,
    EvalRequest,
    Heartbeat,
    RolloutGroup,
    Sample,
    SampleStatus,
    WeightsLive,
    WeightsPublished,
    decode,
    group_id,
)
from services.audit import collect
from services.buffer.service import BufferService
from services.common.bus import Bus, fetch_some
from services.common.versions import VersionBound, last_published_version, publish_weights
from services.model.hf_io import load_model, save_model
from services.weightsync.service import WeightSyncService
from tests.conftest import EngineThread, RunningService, pull, start_service, wait_until, with_test_token
from tests.integration.test_buffer_service import Harness, config


async def dead_letters(bus: Bus) -> list[DeadLetter]:
    sub = await pull(bus, bus.subjects.deadletter_stream, bus.subjects.deadletter(">"), durable="t" + bus.subjects.run_id
    )
    out = []
    while msgs := await fetch_some(sub, 100, 0.5):
        for m in msgs:
            out.append(decode(m.data, DeadLetter))
            await m.ack()
    return out


def group_of(p, **sample_fields) -> RolloutGroup:
    base = dict(group_index=p.group_index, tokens=[1, 5, 15, 5, 2], response_length=2, reward=1.0,
                status=SampleStatus.COMPLETED, weight_versions=[0], rollout_log_probs=[-1.0, -1.0])  # fmt: skip
    samples = [Sample(index=p.group_index * 2 + i, **{**base, **sample_fields}) for i in range(2)]
    return RolloutGroup(group_id=group_id(p.group_index, p.attempt), group_index=p.group_index, attempt=p.attempt,
                        samples=samples)  # fmt: skip


async def test_bad_groups_are_rejected_and_their_prompts_settled(nats_server, run_id, task_data, tiny_model_dir):
    svc = await start_service(BufferService, config(task_data, tiny_model_dir), nats_server.url, run_id)
    h = Harness(await Bus.connect(nats_server.url, run_id, "test"))
    try:
        await h.get(0, wait_s=0.1)
        prompts = await h.prompts(4)
        bad = [
            group_of(prompts[0], tokens=[1, 5, 99999, 5, 2]),  # outside the vocabulary
            group_of(prompts[1], reward=float("nan")),  # a NaN reward
        ]
        for rg in bad:
            await h.bus.publish(h.s.rollouts, rg, msg_id=rg.group_id)
        # tokens of the wrong type: undecodable as a group, but it says which group it is
        raw = msgspec.msgpack.encode(group_of(prompts[2]))
        wrong = msgspec.msgpack.decode(raw)
        wrong["samples"][0]["tokens"] = ["1", "5"]
        await h.bus.js.publish(h.s.rollouts, msgspec.msgpack.encode(wrong))
        # a group for a prompt that was never released (forged ahead to make JetStream dedupe the real one)
        ahead = group_of(prompts[3])
        ahead = msgspec.structs.replace(ahead, group_index=500, group_id=group_id(500, 0),
                                        samples=[msgspec.structs.replace(s, group_index=500) for s in ahead.samples])  # fmt: skip
        await h.bus.publish(h.s.rollouts, ahead, msg_id=ahead.group_id)
        await h.bus.js.publish(h.s.rollouts, b"\x00" * 9)  # garbage
        await h.publish_group(prompts[3])  # the real group of the prompt whose id was forged ahead
        await wait_until(lambda: sum(svc.service.bus.dead_lettered.values()) == 5, what="5 dead letters")

        async def honest_only() -> bool:  # a flood of them must not hold the stream's room: they leave it
            return (await h.bus.js.stream_info(h.s.rollouts_stream)).state.messages == 1

        await wait_until(honest_only, what="ROLLOUTS to hold the honest group only")
        state = svc.service.state
        assert state.counters["rejected"] == 5
        assert all(group_id(p.group_index, 0) not in state.outstanding for p in prompts[:3])  # settled
        reasons = [d.reason for d in await dead_letters(h.bus)]
        assert any("outside the vocabulary" in r for r in reasons) and any("reward is nan" in r for r in reasons)
        assert any("undecodable RolloutGroup" in r for r in reasons) and any("never released" in r for r in reasons)
        await svc.stop()
        report = await collect(nats_server.url, run_id, nats_server.store_dir / "no-run")
        assert report["rejected"] == 3 and report["lost"] == 0 and report["balanced"], report["problems"]
    finally:
        if not svc.task.done():
            await svc.stop()
        await h.bus.close()


async def test_requests_and_announcements_outside_the_window_are_refused(
    nats_server, run_id, task_data, tiny_model_dir
):
    svc = await start_service(BufferService, config(task_data, tiny_model_dir), nats_server.url, run_id)
    h = Harness(await Bus.connect(nats_server.url, run_id, "test"))
    try:
        huge = await h.get(10**12, wait_s=0.1)
        assert huge.error and "outside the steps the trainer can ask for" in huge.error
        assert "differs from --rollout-batch-size" in (await h.bus.request(
            h.s.buffer_get, BufferGetRequest(step=0, count=10**6), type(huge), timeout=5)).error  # fmt: skip
        assert "never published" in (await h.get(0, wait_s=0.1, current_version=10**9)).error
        never = await h.bus.request(h.s.buffer_commit, BufferCommit(step=3), BufferCommitReply, timeout=5)
        assert never.error and "never trained" in never.error and svc.service.state.committed_step == -1
        await h.bus.publish(h.s.weights_live, WeightsLive(version=10**9))
        hb = Heartbeat(service="rollout", instance_id="forger", info={"inflight_groups": 10**9})
        await h.bus.publish_core(h.s.heartbeat("rollout"), hb)
        await wait_until(lambda: sum(svc.service.bus.dead_lettered.values()) >= 6, what="every refusal dead-lettered")
        assert svc.service.live_version in (None, 0) and "forger" not in svc.service.producers
        # the service still serves: a real step completes
        await h.get(0, wait_s=0.1)
        for p in await h.prompts(2):
            await h.publish_group(p)
        assert (await h.get(0)).complete
    finally:
        await svc.stop()
        await h.bus.close()


async def test_the_get_window_follows_the_checkpoint_cadence(nats_server, run_id, task_data, tiny_model_dir):
    """With --save and --save-interval 10 the trainer commits every 10 steps: the 12 steps after
    the committed one (10 trained since the last checkpoint, one prefetched) are steps it may ask
    for; with --save alone nothing is saved and it commits at every push (here every step)."""
    cfg = config(task_data, tiny_model_dir, save="/tmp/asyncrl-never-written", save_interval=10, num_rollout=20)
    svc = await start_service(BufferService, cfg, nats_server.url, run_id)
    h = Harness(await Bus.connect(nats_server.url, run_id, "test"))
    try:
        assert (await h.get(11, wait_s=0.1)).error is None
        assert "outside the steps" in (await h.get(12, wait_s=0.1)).error
        assert cfg.model_copy(update={"save_interval": None}).commit_interval == 1
    finally:
        await svc.stop()
        await h.bus.close()


async def test_a_ledger_entry_the_buffer_did_not_write_is_skipped_and_reported(nats_server, run_id, task_data,
                                                                            tiny_model_dir):  # fmt: skip
    cfg = config(task_data, tiny_model_dir)
    svc = await start_service(BufferService, cfg, nats_server.url, run_id)
    h = Harness(await Bus.connect(nats_server.url, run_id, "test"))
    try:
        await h.get(0, wait_s=0.1)
        for p in await h.prompts(2):
            await h.publish_group(p)
        assert (await h.get(0)).complete
        await svc.stop()
        await h.bus.js.publish(h.s.ledger, b"\x01" * 9)  # 9 garbage bytes on the ledger
        await h.bus.kv_put("buffer_snapshot", b"")  # and no snapshot: replay from the start
        again = await start_service(BufferService, cfg, nats_server.url, run_id)
        try:
            assert again.service.state.seq == svc.service.state.seq  # every real event replayed
            assert any("undecodable" in p for p in again.service.ledger_problems)
        finally:
            await again.stop()
        report = await collect(nats_server.url, run_id, nats_server.store_dir / "no-run")
        assert report["ledger_skipped"] and report["balanced"], report
    finally:
        await h.bus.close()


async def test_a_second_ledger_writer_makes_the_buffer_fail_loudly_never_interleave(nats_server, run_id, task_data,
                                                                                   tiny_model_dir):  # fmt: skip
    """Appends expect the ledger to end where this buffer's last append did: a message another
    writer put there in between makes the next append fail (the buffer exits, to be restarted),
    and the restarted buffer's replay reports it. Two writers never interleave."""
    from asyncrl_proto import LedgerBatch, LedgerEvent
    from services.buffer.ledger import LedgerConflict
    from services.buffer.state import decode_state

    cfg = config(task_data, tiny_model_dir)
    svc = await start_service(BufferService, cfg, nats_server.url, run_id)
    h = Harness(await Bus.connect(nats_server.url, run_id, "test"))
    try:
        await h.get(0, wait_s=0.1)
        await wait_until(lambda: svc.service.state.counters.get("released") == 4, what="a first append")
        before = svc.service.state.seq
        # another writer's decision, which this buffer's state does not admit (a group it never stored)
        other = LedgerBatch(events=[LedgerEvent(seq=before + 1, kind="leased", group_id="g999-a0", step=0)])
        await h.bus.publish(h.s.ledger, other)
        for p in await h.prompts(2):  # the buffer's next decisions need an append
            await h.publish_group(p)
        await wait_until(lambda: svc.task.done(), what="the buffer to fail")
        err = svc.task.exception()
        assert any(isinstance(x, LedgerConflict) for x in getattr(err, "exceptions", [err])), err
        # on its way out it snapshotted nothing the ledger refused (a restart would take it as durable)
        raw = await h.bus.kv_get("buffer_snapshot")
        assert raw is None or decode_state(raw).seq <= before
        again = await start_service(BufferService, cfg, nats_server.url, run_id)
        try:
            assert not again.service.state.leases  # the other writer's event was not applied...
            assert any("which is not stored" in p for p in again.service.ledger_problems)  # ...but reported
            # and it carries on: the groups it had not recorded come back from ROLLOUTS once the
            # dead buffer's deliveries time out (the consumer's ack wait, 10 s)
            assert (await h.get(0, wait_s=20.0)).complete
        finally:
            await again.stop()
    finally:
        await h.bus.close()


async def test_weight_sync_applies_only_what_the_trainer_published(nats_server, run_id, task_data, tiny_model_dir,
                                                                  tmp_path):  # fmt: skip
    with EngineThread(tiny_model_dir) as engine:
        cfg = config(task_data, tiny_model_dir, run_dir=str(tmp_path), rollout_engine_urls=[engine.url])
        svc = await start_service(WeightSyncService, cfg, nats_server.url, run_id)
        bus = await Bus.connect(nats_server.url, run_id, "test")
        s = bus.subjects
        try:
            info = save_model(load_model(tiny_model_dir), tmp_path / "weights" / "v1", tiny_model_dir)
            elsewhere = save_model(load_model(tiny_model_dir), tmp_path / "elsewhere", tiny_model_dir)
            forged = [
                WeightsPublished(version=10**9, step=0, uri=str(tmp_path / "weights" / "v1"), sha256=info["sha256"]),
                WeightsPublished(version=1, step=0, uri=str(tmp_path / "elsewhere"), sha256=elsewhere["sha256"]),
                WeightsPublished(version=1, step=0, uri=str(tmp_path / "weights" / "v1"), sha256="0" * 64),
            ]
            for pub in forged:
                await bus.publish(s.weights_published, pub)
            await wait_until(lambda: sum(svc.service.bus.dead_lettered.values()) == 3, what="3 rejected", timeout=20)
            assert engine.scheduler.weight_version == "0" and svc.service.live_version == 0
            good = WeightsPublished(version=1, step=0, uri=str(tmp_path / "weights" / "v1"), sha256=info["sha256"])
            await bus.publish(s.weights_published, good)
            await wait_until(lambda: svc.service.live_version == 1, what="v1 live", timeout=20)
            assert engine.scheduler.weight_version == "1"
            reasons = [d.reason for d in await dead_letters(bus)]
            assert sum("not the run's" in r for r in reasons) == 2  # v1000000000 at v1's path; v1 elsewhere
            assert sum("digest differs" in r for r in reasons) == 1
        finally:
            await svc.stop()
            await bus.close()


async def test_eval_refuses_points_the_trainer_could_not_have_asked_for(nats_server, run_id, task_data,
                                                                       tiny_model_dir, tmp_path):  # fmt: skip
    from services.eval.service import EvalService
    from tests.integration.test_eval_service import config as eval_config

    cfg = eval_config(
        task_data, tiny_model_dir, tmp_path, eval_function_path="tests.integration.test_eval_service.GoodEval"
    )
    svc = await start_service(EvalService, cfg, nats_server.url, run_id)
    bus = await Bus.connect(nats_server.url, run_id, "test")
    try:
        for req in (EvalRequest(step=1, version=10**9), EvalRequest(step=10**6, version=0),
                    EvalRequest(step=1, version=0, snapshot_uri="/etc")):  # fmt: skip
            await bus.publish(bus.subjects.eval_requests, req)
        await wait_until(lambda: sum(svc.service.bus.dead_lettered.values()) == 3, what="3 refused points")
        assert svc.service.results == []  # nothing evaluated, nothing answered
    finally:
        await svc.stop()
        await bus.close()


async def test_stray_messages_on_weights_cannot_hide_the_newest_version(nats_server, run_id):
    """A burst of stray messages on WEIGHTS after the trainer's last push (garbage, and
    well-formed ones naming older versions, more than a scan of the stream reads): a service
    that starts afterwards still allows the newest version. Found by the fuzz suite: a buffer
    restarted after such a burst took the live version for one never published, released
    nothing, and the run stalled."""
    trainer = await Bus.connect(nats_server.url, run_id, "trainer")
    fresh = None
    try:
        await trainer.ensure_streams()
        for v in (1, 2, 3):
            await publish_weights(trainer, WeightsPublished(version=v, step=v - 1, uri=f"/weights/v{v}"))
        s = trainer.subjects
        older = WeightsPublished(version=2, step=1, uri="/weights/v2")
        for i in range(150):
            data = msgspec.msgpack.encode(older) if i % 3 == 0 else b"\x00 not a message"
            await trainer.js.publish(s.weights_live if i % 2 else s.weights_published, data)
        fresh = await Bus.connect(nats_server.url, run_id, "buffer")
        bound = VersionBound(fresh)
        assert await bound.allows(3)
        assert not await bound.allows(4)
        assert await last_published_version(fresh) == 3
    finally:
        await trainer.close()
        if fresh is not None:
            await fresh.close()


async def test_weight_sync_ignores_a_live_version_in_kv_that_was_never_published(nats_server, run_id, task_data,
                                                                                tiny_model_dir, tmp_path):  # fmt: skip
    """Derived state is checked like messages: a KV `live_version` of 10**9 (forged, or left by a
    bug) used to make a restarted weight-sync skip every real version as applied already and
    leave the run frozen with every health check green."""
    from asyncrl_proto import encode

    with EngineThread(tiny_model_dir) as engine:
        cfg = config(task_data, tiny_model_dir, run_dir=str(tmp_path), rollout_engine_urls=[engine.url])
        bus = await Bus.connect(nats_server.url, run_id, "test")
        await bus.ensure_streams()
        await bus.kv_put("live_version", encode(WeightsLive(version=10**9, engines=[], updated_at=0.0)))
        svc = await start_service(WeightSyncService, cfg, nats_server.url, run_id)
        try:
            assert svc.service.live_version == 0  # the engines' own version, not the forged one
            info = save_model(load_model(tiny_model_dir), tmp_path / "weights" / "v1", tiny_model_dir)
            await publish_weights(bus, WeightsPublished(version=1, step=0, uri=str(tmp_path / "weights" / "v1"),
                                                       sha256=info["sha256"]))  # fmt: skip
            await wait_until(lambda: svc.service.live_version == 1, what="v1 live", timeout=20)
            assert engine.scheduler.weight_version == "1"
        finally:
            await svc.stop()
            await bus.close()


async def test_multi_lora_junk_for_no_registration_is_dead_lettered_and_leaves_the_stream(
    nats_server, run_id, task_data, tiny_model_dir
):
    """A multi-LoRA buffer: groups under a registration the registry never held are dead-lettered,
    and leave ROLLOUTS once settled (a flood of them would otherwise fill the stream's cap)."""
    bus = await Bus.connect(nats_server.url, run_id, "buffer")
    await bus.ensure_streams(partitioned=True)  # what the launcher does for a multi-LoRA run
    service = with_test_token(BufferService, config(task_data, tiny_model_dir, multi_lora_n_adapters=2), bus)
    svc = RunningService(service, asyncio.ensure_future(service.run()))
    h = await Bus.connect(nats_server.url, run_id, "test")
    try:
        await wait_until(lambda: service.ready or svc.task.done(), 30, "the buffer ready")
        for i in range(5):
            await h.js.publish(h.subjects.rollouts + ".nosuchregistration", b"junk %d" % i)
        await wait_until(lambda: sum(service.bus.dead_lettered.values()) == 5, what="5 dead letters")

        async def emptied() -> bool:
            return (await h.js.stream_info(h.subjects.rollouts_stream)).state.messages == 0

        await wait_until(emptied, what="ROLLOUTS emptied of the junk")
        reasons = [d.reason for d in await dead_letters(h)]
        assert sum("no such registration in this run" in r for r in reasons) == 5, reasons
    finally:
        await svc.stop()
        await h.close()


async def test_an_adapter_registry_that_does_not_decode_fails_the_audit(nats_server, run_id, tmp_path):
    """The audit finds each adapter's ledger through the registry: a KV value that does not decode
    leaves nothing that says those ledgers balance, so the report says so (it raised before; a
    typed read would have taken it as a single-model run, balanced)."""
    from asyncrl_proto.subjects import ADAPTERS_KV_KEY

    bus = await Bus.connect(nats_server.url, run_id, "test")
    try:
        await bus.ensure_streams()
        await bus.kv_put(ADAPTERS_KV_KEY, b"\xc1 not msgpack")
    finally:
        await bus.close()
    report = await collect(nats_server.url, run_id, tmp_path)
    assert not report["balanced"] and report["adapters"] == {}
    assert any(f"the adapter registry (KV {ADAPTERS_KV_KEY}) does not decode" in p for p in report["problems"])
