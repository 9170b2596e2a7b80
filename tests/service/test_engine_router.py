"""sglang-router (the SGLang model gateway, PyPI `sglang-router`) in front of two built-in engines,
over real HTTP: /generate and /v1/completions are routed, worker loads come from the engines'
/get_load, and /flush_cache fans out to both."""

from __future__ import annotations

import os
import subprocess
import sys

import httpx
import pytest

from services.common import procs
from tests.conftest import EngineThread, wait_until

pytest.importorskip("sglang_router", reason="sglang-router is in the test extras (pip install -e '.[test]')")


def _start_router(urls: list[str], port: int, log_path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1", "--port", str(port),
           "--worker-urls", *urls, "--policy", "round_robin", "--log-level", "warn",
           "--prometheus-host", "127.0.0.1", "--prometheus-port", str(procs.free_port())]  # fmt: skip
    with open(log_path, "wb") as log:  # the child keeps its own descriptor
        return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "NO_PROXY": "*"})


@pytest.fixture
async def routed(tiny_model_dir, tmp_path):
    with EngineThread(tiny_model_dir) as a, EngineThread(tiny_model_dir) as b:
        port = procs.free_port()
        proc = _start_router([a.url, b.url], port, tmp_path / "router.log")
        url = f"http://127.0.0.1:{port}"
        try:
            async with httpx.AsyncClient(base_url=url, timeout=30) as c:

                async def both_routable():
                    if proc.poll() is not None:
                        raise RuntimeError(f"the router exited: {(tmp_path / 'router.log').read_text()[-2000:]}")
                    try:
                        workers = (await c.get("/workers")).json().get("workers", [])
                    except httpx.HTTPError:
                        return False
                    return sum(bool(w.get("is_healthy")) for w in workers) == 2

                await wait_until(both_routable, timeout=60, what="the router has both engines healthy")
                yield c, (a, b)
        finally:
            proc.terminate()
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=10)


async def test_router_routes_generate_and_completions_and_fans_out_flush(routed):
    c, engines = routed
    body = {"input_ids": [1, 5, 6, 7, 15], "sampling_params": {"max_new_tokens": 4, "temperature": 0},
            "return_logprob": True}  # fmt: skip
    outs = [(await c.post("/generate", json=body)).json() for _ in range(4)]
    assert "output_ids" in outs[0], outs[0]
    assert all(o["output_ids"] == outs[0]["output_ids"] for o in outs)
    assert all(len(o["meta_info"]["output_token_logprobs"]) == len(o["output_ids"]) for o in outs)
    served = [e.scheduler.stats.num_requests_total for e in engines]
    assert all(n >= 1 for n in served), served  # round robin reached both engines

    r = await c.post("/v1/completions", json={"model": "tiny", "prompt": "123=", "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] in ("stop", "length") and r.json()["usage"]["prompt_tokens"] == 5

    r = await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "45"}], "max_tokens": 3})
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant"

    loads = (await c.get("/get_loads")).json()
    assert {w["worker"] for w in loads["workers"]} == {e.url for e in engines}
    assert all(w["load"] >= 0 for w in loads["workers"])  # each engine's /get_load answered

    epochs = [e.scheduler.kv_epoch for e in engines]
    flush = await c.post("/flush_cache")
    assert flush.status_code == 200, flush.text
    assert flush.json()["workers_flushed"] == 2 and flush.json()["status"] == "success"
    assert [e.scheduler.kv_epoch for e in engines] == [n + 1 for n in epochs]  # each engine dropped its cache
