"""The bus against a real nats-server: streams, dedupe, KV, dead letters."""

from __future__ import annotations

import msgpack
import pytest

from asyncrl_proto import DeadLetter, PromptMsg, WeightsLive, decode, encode
from services.common.bus import Bus, fetch_some
from tests.conftest import pull


async def test_streams_are_idempotent_and_publishes_dedupe(nats_server, run_id):
    bus = await Bus.connect(nats_server.url, run_id, "test")
    try:
        await bus.ensure_streams()
        await bus.ensure_streams()
        s = bus.subjects
        a = await bus.publish(s.rollouts, PromptMsg(group_index=1, prompt="x"), msg_id="g1-a0")
        b = await bus.publish(s.rollouts, PromptMsg(group_index=1, prompt="x"), msg_id="g1-a0")
        assert b.duplicate and a.seq == b.seq
        assert decode(await bus.get_payload(s.rollouts_stream, a.seq), PromptMsg).group_index == 1
        await bus.kv_put("k", b"v")
        assert await bus.kv_get("k") == b"v" and await bus.kv_get("missing") is None
    finally:
        await bus.close()


async def test_a_typed_kv_read_takes_a_value_that_does_not_decode_as_absent(nats_server, run_id, caplog):
    """A corrupt or forged KV value (live_version, the adapter registry) is logged and read as
    None by every reader, instead of raising in the one that happened to read it."""
    bus = await Bus.connect(nats_server.url, run_id, "test")
    try:
        await bus.ensure_streams()
        assert await bus.kv_get("live_version", WeightsLive) is None
        await bus.kv_put("live_version", b"\xc1 not msgpack")
        assert await bus.kv_get("live_version", WeightsLive) is None
        assert "KV live_version holds no WeightsLive" in caplog.text
        await bus.kv_put("live_version", encode(WeightsLive(version=3)))
        assert (await bus.kv_get("live_version", WeightsLive)).version == 3
    finally:
        await bus.close()


async def test_work_queue_redelivers_unacked_prompts(nats_server, run_id):
    bus = await Bus.connect(nats_server.url, run_id, "test")
    try:
        await bus.ensure_streams()
        s = bus.subjects
        await bus.publish(s.prompts, PromptMsg(group_index=0, prompt="a"))
        one = await pull(bus, s.prompts_stream, s.prompts, durable="producers", ack_wait_s=0.5)
        got = await fetch_some(one, 1, 2.0)
        assert len(got) == 1  # taken, never acknowledged: the producer "died"
        other = await pull(bus, s.prompts_stream, s.prompts, durable="producers", ack_wait_s=0.5)
        again = await fetch_some(other, 1, 5.0)
        assert len(again) == 1 and decode(again[0].data, PromptMsg).group_index == 0
        await again[0].ack()
    finally:
        await bus.close()


async def test_dead_letter_keeps_subject_and_payload(nats_server, run_id):
    bus = await Bus.connect(nats_server.url, run_id, "test")
    try:
        await bus.ensure_streams()
        s = bus.subjects
        await bus.dead_letter(s.rollouts, b"\x00garbage", "undecodable")
        sub = await pull(bus, s.deadletter_stream, s.deadletter(s.rollouts), durable="t")
        [msg] = await fetch_some(sub, 1, 2.0)
        dl = decode(msg.data, DeadLetter)
        assert dl.original_subject == s.rollouts and dl.data == b"\x00garbage" and dl.service == "test"
        assert msgpack.unpackb(msg.data)["reason"] == "undecodable"
        assert msg.subject == f"asyncrl.{run_id}.deadletter.rollouts"
    finally:
        await bus.close()


async def test_a_dead_letter_is_bounded_in_size_however_it_is_published(nats_server, run_id):
    """Any role may dead-letter, and an 8 MB message published straight to a dead-letter subject
    used to be stored (10,000 of them: about 80 GB). The server now refuses one over 96 KiB; the
    services' own dead letters (64 KB of the message at most) still fit."""
    bus = await Bus.connect(nats_server.url, run_id, "test")
    try:
        await bus.ensure_streams()
        s = bus.subjects
        await bus.dead_letter(s.rollouts, b"x" * 1_000_000, "too big to keep whole")  # truncated: stored
        with pytest.raises(Exception, match="(?i)maximum|size"):
            await bus.js.publish(s.deadletter(s.rollouts), b"y" * 500_000)
        st = (await bus.js.stream_info(s.deadletter_stream)).state
        assert st.messages == 1 and st.bytes < 96 * 1024
    finally:
        await bus.close()


async def test_every_stream_is_bounded_and_stores_only_what_something_consumes(nats_server, run_id):
    """Each stream has a message-size and a message-count limit (at most max_msgs x max_msg_size;
    docs/trust.md lists them), and a single-model run stores only its own subjects: a group on
    `rollouts.zzz` used to be stored though nothing reads it. A partitioned run stores the
    `.<registration>` subjects instead."""
    bus = await Bus.connect(nats_server.url, run_id, "test")
    try:
        await bus.ensure_streams(rollouts_max_msgs=1234)
        s = bus.subjects
        for spec in s.stream_specs():
            cfg = (await bus.js.stream_info(spec["name"])).config
            assert 0 < cfg.max_msg_size <= 8 * 1024 * 1024 and cfg.max_msgs > 0, spec["name"]
        assert (await bus.js.stream_info(s.rollouts_stream)).config.max_msgs == 1234
        await bus.js.publish(s.rollouts, b"ok")
        with pytest.raises(Exception, match="(?i)no response|no responders|no stream|timeout"):
            await bus.js.publish(s.rollouts + ".zzz", b"stored for no one", timeout=1)
        with pytest.raises(Exception, match="(?i)maximum|size"):  # an announcement is small
            await bus.js.publish(s.weights_live, b"w" * 100_000)
        assert (await bus.js.stream_info(s.rollouts_stream)).state.messages == 1
        await bus.ensure_streams(partitioned=True)  # the same run's streams, updated in place
        await bus.js.publish(s.of("a1").rollouts, b"a partition's group")
        with pytest.raises(Exception, match="(?i)no response|no responders|no stream|timeout"):
            await bus.js.publish(s.rollouts, b"no partition", timeout=1)
    finally:
        await bus.close()


async def test_a_full_input_stream_holds_the_publisher_back_and_loses_nothing(nats_server, run_id):
    """ROLLOUTS at its message cap refuses a group with StreamFull (not a fatal StoreFull), and
    until_room (the producer's publish) waits for the buffer to make room, then stores it."""
    import asyncio

    from services.common.bus import StreamFull, until_room

    bus = await Bus.connect(nats_server.url, run_id, "test")
    try:
        await bus.ensure_streams(rollouts_max_msgs=2)
        s = bus.subjects
        for i in range(2):
            await bus.publish(s.rollouts, PromptMsg(group_index=i, prompt="x"), msg_id=f"g{i}")
        with pytest.raises(StreamFull):
            await bus.publish(s.rollouts, PromptMsg(group_index=2, prompt="x"), msg_id="g2")
        refusals = []
        late = asyncio.ensure_future(until_room(
            lambda: bus.publish(s.rollouts, PromptMsg(group_index=2, prompt="x"), msg_id="g2"),
            lambda e, n: refusals.append(n)))  # fmt: skip
        while len(refusals) < 3:  # refused again and again while the stream stays full
            await asyncio.wait({late}, timeout=0.05)
            assert not late.done()
        await bus.js.delete_msg(s.rollouts_stream, 1)  # the buffer read the first group and purged it
        ack = await asyncio.wait_for(late, 10)
        got = decode(await bus.get_payload(s.rollouts_stream, ack.seq), PromptMsg)
        assert got.group_index == 2 and refusals == list(range(1, len(refusals) + 1))
    finally:
        await bus.close()


async def test_closing_a_bus_whose_server_is_gone_does_not_raise(tmp_path, run_id):
    """A client still open when its run ends (the launcher stops nats-server last) closes quietly:
    nats-py's close drained a dead socket and raised ConnectionResetError."""
    from services.common.natsserver import EmbeddedNats
    from tests.conftest import wait_until

    srv = EmbeddedNats(tmp_path / "nats").start()
    bus = await Bus.connect(srv.url, run_id, "weight-sync", connect_timeout_s=5)
    srv.stop()
    await wait_until(lambda: bus.nc.is_reconnecting, what="the client noticed")
    await bus.nc.publish("x", b"y")  # pending, for a server that is gone
    await bus.close()  # raised ConnectionResetError before
    assert bus.closing


async def test_a_stream_never_written_to_reads_as_empty(nats_server, run_id):
    """Its first and last sequence are 0 and there is no message 0: `asyncrl audit` of a run whose
    producers never published (read message by message, a work-queue stream) raised BusError."""
    bus = await Bus.connect(nats_server.url, run_id, "test")
    try:
        await bus.ensure_streams()
        s = bus.subjects
        assert await bus.read_stream(s.rollouts_stream) == []
        assert await bus.read_stream(s.ledger_stream, s.ledger) == []
    finally:
        await bus.close()
