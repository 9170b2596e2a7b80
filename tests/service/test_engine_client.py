"""The producer's engine client against real built-in engines: least-outstanding spreading,
an engine that dies or hangs mid-request, and aborts of cancelled trajectories."""

from __future__ import annotations

import asyncio

from services.common.sglang_client import SGLangClient
from tests.conftest import EngineThread
from tests.service.test_engine import StepGate, gen_body, until


async def test_requests_spread_over_engines(tiny_model_dir):
    with EngineThread(tiny_model_dir) as a, EngineThread(tiny_model_dir) as b:
        client = SGLangClient([a.url, b.url])
        try:
            await asyncio.gather(*(client.generate(gen_body()) for _ in range(40)))
            served = [e.scheduler.stats.num_requests_total for e in (a, b)]
            assert sum(served) == 40 and min(served) >= 10, served
        finally:
            await client.close()


async def test_a_hung_engine_is_marked_down_and_its_requests_retried_elsewhere(tiny_model_dir):
    with EngineThread(tiny_model_dir) as a, EngineThread(tiny_model_dir) as b:
        gate = StepGate(a.scheduler)  # engine a accepts requests but never steps: hung
        client = SGLangClient([a.url, b.url], retry_delay_s=0.05)
        monitor = asyncio.ensure_future(client.monitor_health(interval_s=0.2, timeout_s=0.5))
        try:
            outs = await asyncio.wait_for(asyncio.gather(*(client.generate(gen_body()) for _ in range(6))), 30)
            assert all(o["meta_info"]["finish_reason"]["type"] in ("stop", "length") for o in outs)
            assert not client.healthy[a.url] and client.healthy[b.url]
            assert client.num_retried >= 1  # the requests that landed on a went to b
            assert b.scheduler.stats.num_requests_total >= 6
        finally:
            gate.open()
            monitor.cancel()
            await client.close()


async def test_a_dead_engine_is_skipped(tiny_model_dir):
    with EngineThread(tiny_model_dir) as b:
        client = SGLangClient(["127.0.0.1:1", b.url], retry_delay_s=0.05)  # nothing listens on :1
        try:
            outs = await asyncio.gather(*(client.generate(gen_body()) for _ in range(4)))
            assert len(outs) == 4 and not client.healthy["http://127.0.0.1:1"]
        finally:
            await client.close()


async def test_a_cancelled_generate_is_aborted_on_its_engine(tiny_model_dir):
    with EngineThread(tiny_model_dir) as a:
        gate = StepGate(a.scheduler)
        client = SGLangClient([a.url])
        try:
            task = asyncio.ensure_future(client.generate(gen_body(max_new_tokens=40, ignore_eos=True)))
            await until(lambda: a.scheduler.snapshot()["num_running_reqs"] == 1)
            task.cancel()
            gate.release(1)  # let the step in flight finish
            await until(lambda: a.scheduler.stats.num_aborted_requests_total == 1)
            assert client.num_aborted == 1 and a.scheduler.snapshot()["num_running_reqs"] == 0
            gate.open()
        finally:
            await client.close()


async def test_an_engine_marked_down_still_serves_when_it_is_the_only_one(tiny_model_dir):
    """Every engine marked down (e.g. a health check timed out under load): requests still go
    to one, and a success marks it healthy again instead of failing at once."""
    with EngineThread(tiny_model_dir) as a:
        client = SGLangClient([a.url], retry_delay_s=0.05)
        try:
            client.mark(a.url, False)
            out = await client.generate(gen_body())
            assert out["meta_info"]["finish_reason"]["type"] in ("stop", "length")
            assert client.healthy[a.url] and client.num_retried == 0
        finally:
            await client.close()


async def test_a_request_on_a_stuck_engine_marked_down_does_not_hang(tiny_model_dir):
    """The only engine is stuck and marked down: requests sent to it (no engine is up) give up
    at its next failed health check instead of waiting forever."""
    import pytest

    from services.common.sglang_client import EngineError

    with EngineThread(tiny_model_dir) as a:
        gate = StepGate(a.scheduler)  # accepts requests, never steps
        a.scheduler.stall_timeout_s = 0.3
        client = SGLangClient([a.url], max_retries=2, retry_delay_s=0.05)
        monitor = asyncio.ensure_future(client.monitor_health(interval_s=0.2, timeout_s=0.3))
        try:
            with pytest.raises(EngineError, match="went down"):
                await asyncio.wait_for(client.generate(gen_body()), 20)
            assert not client.healthy[a.url] and client.num_retried == 3
        finally:
            gate.open()
            monitor.cancel()
            await client.close()


async def test_requests_in_flight_per_engine_are_capped(tiny_model_dir):
    """--sglang-server-concurrency: at most that many /generate calls in flight per engine; the
    others wait for a slot (and all are served)."""
    with EngineThread(tiny_model_dir) as a:
        for cap, expect in ((2, 2), (None, 6)):
            client = SGLangClient([a.url], max_concurrency=cap)
            in_flight, peak = 0, 0
            post = client._post_generate

            async def counted(url, body, post=post):
                nonlocal in_flight, peak
                in_flight += 1
                peak = max(peak, in_flight)
                try:
                    return await post(url, body)
                finally:
                    in_flight -= 1

            client._post_generate = counted
            try:
                results = await asyncio.gather(*(client.generate(gen_body()) for _ in range(6)))
                assert len(results) == 6 and peak == expect, (cap, peak)
            finally:
                await client.close()
