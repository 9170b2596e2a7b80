"""The built-in engine's routes, one router per protocol (services.engine.server assembles them,
with OpenAI's from services.engine.openai): SGLang's native generation routes, its information,
control and weight routes, and its LoRA routes. Each handler validates, hands the work to the
scheduler thread and waits; the roles that may call each route are in
services.common.httpauth.ENGINE_SCOPES."""

from __future__ import annotations

import asyncio
import json
import logging
import time

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from services.engine.metrics import engine_metrics
from services.engine.protocol import BadRequest, parse_generate, typed, updated_message
from services.weights.store import SCHEME, WeightStoreError

log = logging.getLogger(__name__)
SGLANG_COMPAT_VERSION = "0.5.16"


async def body_of(request: Request, optional: bool = True) -> dict:
    """The request's JSON object ({} for no body when `optional`); BadRequest if it is not one."""
    raw = await request.body()
    if not raw and optional:
        return {}
    try:
        data = json.loads(raw)
    except ValueError as e:
        raise BadRequest(f"invalid JSON: {e}") from None
    except RecursionError:  # the parser's depth limit: nested deeper than any request needs
        raise BadRequest("invalid JSON: nested too deeply") from None
    if not isinstance(data, dict):
        raise BadRequest("the request body must be a JSON object")
    return data


def refused(message: str) -> JSONResponse:
    return JSONResponse({"success": False, "message": message}, status_code=400)


async def local_copy(server, path: str, adapter: bool = False) -> str:
    """The directory to load: `path`, or a `nats-object://` snapshot (or adapter version) fetched to disk."""
    if not path.startswith(SCHEME):
        return path
    if server.weights is None:
        what = "it" if adapter else "object-store weights"
        raise ValueError(f"{path!r:.120} is in a NATS object store, and this engine was started without "
                         f"--nats-url and --run-id (start it with them to fetch {what})")  # fmt: skip
    return str(await server.weights.local(path, adapter))


def native_routes(server) -> APIRouter:
    """Generation, load and health."""
    r, sched = APIRouter(), server.scheduler

    async def generated(body: dict) -> dict | list:
        """A non-streaming /generate: the response object, or a list of them for a batch."""
        seqs, is_batch = parse_generate(body, server.limits, server.tokenizer)
        outs = [server.generation.output(t) for t in await server.generation.run(seqs)]
        return outs if is_batch else outs[0]

    @r.api_route("/generate", methods=["POST", "PUT"])
    async def generate(request: Request):
        body = await body_of(request)
        if body.get("stream") is True:
            seqs, is_batch = parse_generate(body, server.limits, server.tokenizer)
            server.generation.check_loras(seqs)
            return StreamingResponse(server.generation.stream(seqs, is_batch), media_type="text/event-stream")
        return JSONResponse(await generated(body))

    @r.get("/get_load")
    async def get_load():
        snap = sched.snapshot()
        return [{"dp_rank": 0, "num_reqs": snap["num_running_reqs"] + snap["num_queue_reqs"],
                 "num_waiting_reqs": snap["num_queue_reqs"], "num_tokens": snap["num_used_tokens"]}]  # fmt: skip

    @r.get("/get_weight_version")
    async def get_weight_version():
        return {"weight_version": sched.weight_version}

    @r.get("/health")
    @r.get("/health_generate")
    async def health():
        if not sched.alive:
            return Response(status_code=503)
        if sched.paused_mode or sched.running or sched.waiting:
            # alive and holding work: healthy while steps keep finishing
            return Response(status_code=503 if sched.stalled else 200)
        try:
            probe = {"input_ids": [0], "sampling_params": {"max_new_tokens": 1, "temperature": 0}}
            await asyncio.wait_for(generated(probe), 20)
        except (TimeoutError, ValueError):
            return Response(status_code=503)
        return Response(status_code=200)

    @r.api_route("/release_memory_occupation", methods=["GET", "POST"])
    @r.api_route("/resume_memory_occupation", methods=["GET", "POST"])
    async def memory_occupation():
        return JSONResponse(None)  # nothing to release on the built-in engine

    @r.get("/healthz")
    async def healthz():
        alive = sched.alive
        return PlainTextResponse("ok\n" if alive else "scheduler thread died\n", status_code=200 if alive else 503)

    @r.get("/readyz")
    async def readyz():
        return PlainTextResponse("ready\n" if sched.alive else "not ready\n", status_code=200 if sched.alive else 503)

    return r


def info_routes(server) -> APIRouter:
    """Model and server information, /metrics and asyncrl's /status."""
    r, sched = APIRouter(), server.scheduler

    @r.get("/model_info")
    @r.get("/get_model_info")
    async def model_info():
        cfg = sched.model.cfg
        return {
            "model_path": server.model_path,
            "tokenizer_path": server.model_path if server.tokenizer is not None else None,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": sched.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
            "model_type": cfg.model_type,
            "architectures": cfg.to_hf_dict()["architectures"],
        }

    @r.get("/server_info")
    @r.get("/get_server_info")
    async def server_info():
        return {
            "model_path": server.model_path,
            "served_model_name": server.served_model_name,
            "tp_size": 1,
            "dp_size": 1,
            "pp_size": 1,
            "host": server.host,
            "port": server.port,
            "weight_version": sched.weight_version,
            "enable_metrics": True,
            "context_length": sched.context_length,
            "max_running_requests": sched.cache.num_slots,
            "status": "ready",
            "max_total_num_tokens": sched.snapshot()["max_total_num_tokens"],
            "max_req_input_len": sched.context_length - 1,
            "internal_states": [
                {
                    "last_gen_throughput": sched.stats.gen_throughput,
                    "effective_max_running_requests_per_dp": sched.cache.num_slots,
                }
            ],
            "version": f"asyncrl-builtin (sglang-compatible {SGLANG_COMPAT_VERSION})",
            "staged_weight_loading": server.staged_loading,
            "weight_digest_check": True,
            "weight_update_backends": server.receiver.backends(),
            **(server.loras.info() if server.loras is not None else {"enable_lora": False}),
        }

    @r.get("/metrics")
    async def metrics():
        return PlainTextResponse(engine_metrics(server).text(), media_type="text/plain; version=0.0.4")

    @r.get("/status")
    async def status():
        return {
            "service": "engine",
            "model_path": server.model_path,
            "uptime_s": time.time() - server.started_at,
            **sched.snapshot(),
            "cache_hit_rate": sched.stats.cache_hit_rate,
            "gen_throughput": sched.stats.gen_throughput,
            "weight_load_seconds": sched.stats.weight_load_duration_s,
            "weight_stage_seconds": sched.stats.weight_stage_duration_s,
            "num_staged_weight_swaps": sched.stats.num_staged_swaps_total,
            "num_forgotten_pauses_ended": sched.stats.num_forgotten_pauses_ended_total,
            **server.receiver.status(),
        }

    return r


def control_routes(server) -> APIRouter:
    """Flush, abort, pause and continue."""
    r, sched = APIRouter(), server.scheduler

    @r.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache():
        if await asyncio.to_thread(sched.flush_cache):
            return PlainTextResponse(
                "Cache flushed.\nPlease check backend logs for more details. (When there are "
                "running or waiting requests, the operation will not be performed.)\n"
            )
        return PlainTextResponse("Flush cache failed.\n", status_code=400)

    @r.post("/abort_request")
    async def abort_request(request: Request):
        body = await body_of(request)
        rid, abort_all = typed(body, "rid", str, ""), typed(body, "abort_all", bool, False)
        await asyncio.to_thread(sched.abort, rid, abort_all)
        return Response(status_code=200)

    @r.post("/pause_generation")
    async def pause_generation(request: Request):
        mode = typed(await body_of(request), "mode", str) or "abort"
        if mode not in ("abort", "retract", "in_place"):
            raise BadRequest(f"mode must be abort, retract or in_place, got {mode!r:.40}")
        await asyncio.to_thread(sched.pause, mode)
        return {"message": "Generation paused successfully.", "status": "ok"}

    @r.post("/continue_generation")
    async def continue_generation():
        await asyncio.to_thread(sched.resume)
        return {"message": "Generation continued successfully.", "status": "ok"}

    return r


def weight_routes(server) -> APIRouter:
    """Staging and loading weights (disk, object store, distributed broadcast) and naming the
    weight version."""
    r, sched = APIRouter(), server.scheduler

    @r.post("/stage_weights")
    @r.post("/update_weights_from_disk")
    async def from_disk(request: Request):
        """Stage (/stage_weights) or load the snapshot at `model_path`: a directory or a `nats-object://` URI."""
        stage = request.url.path.endswith("/stage_weights")
        if stage and not server.staged_loading:
            return JSONResponse({"detail": "Not Found"}, status_code=404)
        body = await body_of(request)
        path = typed(body, "model_path", str)
        if not path:
            return refused("model_path is required")
        version = typed(body, "weight_version", (str, int))
        if not stage:
            typed(body, "flush_cache", bool)
        try:  # a TimeoutError (no pause, requests still in flight) is an OSError
            local = await local_copy(server, path)
            if stage:
                seconds = await asyncio.to_thread(sched.weights.stage_weights, local, version)
                return {"success": True, "message": f"Staged {path} in {seconds:.3f}s.", "stage_seconds": seconds}
            if typed(body, "abort_all_requests", bool):
                await asyncio.to_thread(sched.abort, "", True)
            res = await asyncio.to_thread(sched.weights.update_weights_from_disk, local, version)
        except (OSError, ValueError, WeightStoreError) as e:
            return refused(f"Failed to {'stage' if stage else 'update'} weights: {e}")
        server.model_path = path
        return {"success": True, "message": updated_message(version),
                "num_paused_requests": res["num_paused_requests"], "staged": res["staged"]}  # fmt: skip

    @r.post("/init_weights_update_group")
    async def init_weights_update_group(request: Request):
        body = await body_of(request)
        try:
            return await asyncio.to_thread(server.receiver.init_group, body)
        except (RuntimeError, ValueError, OSError) as e:  # the others never joined, or a bad address
            return refused(f"Failed to init group: {e}")

    @r.post("/destroy_weights_update_group")
    async def destroy_weights_update_group(request: Request):
        res = await asyncio.to_thread(server.receiver.destroy_group, await body_of(request))
        return JSONResponse(res, status_code=200 if res["success"] else 400)

    @r.post("/update_weights_from_distributed")
    async def update_weights_from_distributed(request: Request):
        body = await body_of(request)
        try:
            return await asyncio.to_thread(server.receiver.update, body)
        except (ValueError, TimeoutError) as e:
            return refused(f"Failed to update weights: {e}")

    @r.post("/update_weight_version")
    async def update_weight_version(request: Request):
        body = await body_of(request)
        if typed(body, "new_version", (str, int)) is None:
            return refused("new_version is required")
        if typed(body, "abort_all_requests", bool, True):
            await asyncio.to_thread(sched.abort, "", True)
        v = str(body["new_version"])
        rec = server.receiver
        if (problem := relabel_problem(sched.weight_version, v, rec.staged_version(), rec.received_since_loading())) is not None:
            log.warning("refused a weight version claim (role %s): %s", request.scope.get("asyncrl_role", "?"), problem)
            return refused(problem)
        if v.startswith("loading-"):
            rec.mark_loading()
        try:  # a version staged by broadcast (stage: true) is swapped in; otherwise only the name changes
            swapped = await asyncio.to_thread(server.receiver.set_version, v)
        except TimeoutError as e:
            return refused(f"Failed to update weights: {e}")
        if not swapped:
            await asyncio.to_thread(sched.weights.set_weight_version, v)
        return {"success": True, "message": f"Weight version updated to {v}", "new_version": v, "staged": swapped}

    return r


def relabel_problem(current: str, new: str, staged: str | None, received: bool = False) -> str | None:
    """Why /update_weight_version may not name the weights `new`, or None. A name says which
    weights generated a token (the buffer judges staleness by it), so the route only names weights
    that a broadcast brought: `loading-<N>` while one is under way, then `N` for the weights it
    loaded (current `loading-N` and a whole version `received` since, or already `N`: the
    broadcast named them) or staged (`staged`). Relabelling the running weights as another
    version would make honest samples claim weights they were not generated by."""
    if new.startswith("loading-") and new[len("loading-"):].isdigit():
        return None
    if new in (staged, current) or (received and current.startswith("loading-") and current[len("loading-"):] == new):
        return None
    return (f"new_version {new!r:.40} names no weights a broadcast brought (the engine runs {current!r:.40}): "
            "this route names the weights of a broadcast (loading-<N>, then N); load weights with "
            "/update_weights_from_disk or a broadcast")


def lora_routes(server) -> APIRouter:
    """SGLang's /load_lora_adapter and /unload_lora_adapter (services.engine.loras)."""
    r = APIRouter()

    @r.post("/load_lora_adapter")
    @r.post("/unload_lora_adapter")
    async def lora_call(request: Request):
        """SGLang's LoRA answer: {success, error_message, loaded_adapters}, a 400 on failure."""
        load, body = request.url.path.endswith("/load_lora_adapter"), await body_of(request)

        def failed(message: str) -> JSONResponse:
            loaded = server.loras.loaded() if server.loras is not None else {}
            return JSONResponse({"success": False, "error_message": message, "loaded_adapters": loaded}, 400)

        if server.loras is None:
            return failed("LoRA is not enabled on this engine: start it with --enable-lora")
        path = body.get("lora_path") if load else None
        try:  # an object-store version is fetched first
            if isinstance(path, str):
                body = {**body, "lora_path": await local_copy(server, path, adapter=True)}
        except (ValueError, WeightStoreError) as e:  # not one, or not (any more) in the bucket: never loads
            return failed(f"Failed to load LoRA adapter: {e}")
        except (OSError, TimeoutError) as e:  # the broker away: asked again
            return failed(f"could not fetch {path!r:.200}: {e}")
        try:  # their own threads: an unload waiting for its requests never takes one from pause/continue
            fn = server.loras.load if load else server.loras.unload
            return await asyncio.get_running_loop().run_in_executor(server.lora_pool, fn, body)
        except (BadRequest, TimeoutError) as e:
            return failed(str(e))

    return r
