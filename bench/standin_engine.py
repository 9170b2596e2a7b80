"""A stand-in engine for scaling benchmarks: it speaks the SGLang HTTP subset the producers and
weight-sync use (the same paths, fields and answer shapes as the built-in engine), but models a
GPU instead of computing: a request of L new tokens takes L x --ms-per-token (a sleep), and up to
--max-running requests decode at once (a GPU's batch: each one's time does not grow with the
batch); the rest wait their turn. Token ids are drawn below --vocab-size, each with a log-prob,
and every answer names the engine's weight version. So a benchmark over several of them
measures asyncrl's producers, buffer and broker, not this machine's cores doing matrix products.

    python bench/standin_engine.py --port 31000 [--ms-per-token 20] [--max-running 16] [--vocab-size 32]
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import time

from aiohttp import web


def make_app(ms_per_token: float, max_running: int, vocab_size: int, seed: int) -> web.Application:
    rng = random.Random(seed)
    batch = asyncio.Semaphore(max_running)
    state = {"version": "0", "paused": False, "running": 0, "waiting": 0, "served": 0}
    resumed = asyncio.Event()
    resumed.set()

    async def generate(request: web.Request) -> web.Response:
        body = await request.json()
        ids = body.get("input_ids") or []
        params = body.get("sampling_params") or {}
        n = int(params.get("max_new_tokens", 16))
        if not isinstance(ids, list) or not ids or n < 0:
            return web.json_response({"error": {"message": "input_ids must be a non-empty list"}}, status=400)
        t0 = time.perf_counter()
        state["waiting"] += 1
        try:
            await resumed.wait()
            async with batch:
                state["waiting"] -= 1
                state["running"] += 1
                try:
                    await asyncio.sleep(n * ms_per_token / 1000.0)
                finally:
                    state["running"] -= 1
        except BaseException:
            state["waiting"] = max(0, state["waiting"] - 1)
            raise
        out = [rng.randrange(vocab_size) for _ in range(n)]
        state["served"] += 1
        meta = {
            "id": body.get("rid") or f"standin-{state['served']}",
            "finish_reason": {"type": "length", "length": n},
            "prompt_tokens": len(ids),
            "completion_tokens": n,
            "cached_tokens": 0,
            "weight_version": state["version"],
            "e2e_latency": time.perf_counter() - t0,
        }
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[-math.log(vocab_size), t, None] for t in out]
        return web.json_response({"text": "", "output_ids": out, "meta_info": meta})

    async def model_info(_: web.Request) -> web.Response:
        return web.json_response({"model_path": "standin", "is_generation": True, "weight_version": state["version"]})

    async def ok(_: web.Request) -> web.Response:
        return web.Response(text="")

    async def pause(_: web.Request) -> web.Response:
        state["paused"] = True
        resumed.clear()
        return web.json_response({"success": True})

    async def resume(_: web.Request) -> web.Response:
        state["paused"] = False
        resumed.set()
        return web.json_response({"success": True})

    async def update(request: web.Request) -> web.Response:
        body = await request.json()
        state["version"] = str(body.get("weight_version", state["version"]))
        return web.json_response({"success": True, "message": "stand-in: nothing to load"})

    async def status(_: web.Request) -> web.Response:
        return web.json_response(
            {k: state[k] for k in ("running", "waiting", "served", "paused")} | {"max_running": max_running}
        )

    app = web.Application()
    app.add_routes(
        [
            web.post("/generate", generate),
            web.get("/model_info", model_info),
            web.get("/health", ok),
            web.get("/health_generate", ok),
            web.post("/pause_generation", pause),
            web.post("/continue_generation", resume),
            web.post("/flush_cache", ok),
            web.post("/update_weights_from_disk", update),
            web.get("/standin_status", status),
        ]
    )
    return app


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--ms-per-token", type=float, default=20.0)
    p.add_argument("--max-running", type=int, default=16)
    p.add_argument("--vocab-size", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    web.run_app(make_app(a.ms_per_token, a.max_running, a.vocab_size, a.seed), host=a.host, port=a.port,
                print=None, access_log=None)  # fmt: skip


if __name__ == "__main__":
    main()
