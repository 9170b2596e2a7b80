"""Client for servers speaking the SGLang HTTP protocol (real SGLang, the SGLang router, or the
built-in engine): the same code for all of them.

Data plane: `generate()` picks the engine with the fewest outstanding requests and retries a
failed call on another engine. Control plane: pause / continue / update weights / model_info
go to one engine URL directly, as Miles does.

aiohttp rather than httpx: with a hundred concurrent requests httpx's connection pool costs
several milliseconds per request on the client (measured: 0.7-3.7 s vs 0.16 s for 128 requests
against the built-in engine), which would make the client, not the engine, the bottleneck.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import json
import logging
import time
import uuid
from typing import Any

import aiohttp

log = logging.getLogger(__name__)


class EngineError(RuntimeError):
    def __init__(self, message: str, client_error: bool = False):
        super().__init__(message)
        self.client_error = client_error


class FlushRefused(EngineError):
    """An engine kept refusing /flush_cache while paused: its weight update is abandoned (it
    resumes on its old weights, whose cache matches them), never loaded over a stale cache."""


class _EngineDown(Exception):
    def __init__(self, cause: Exception):
        super().__init__(str(cause))
        self.cause = cause


def normalize_url(addr: str) -> str:
    addr = addr.strip().rstrip("/")
    return addr if addr.startswith(("http://", "https://")) else f"http://{addr}"


class SGLangClient:
    """Engines are picked by fewest outstanding requests among the healthy ones. An engine is
    marked unhealthy when a call to it fails or when `monitor_health` sees /health_generate
    fail; its unfinished requests are then cancelled there and retried on another engine. A
    cancelled generate (e.g. a sibling trajectory failed) is aborted on its engine by rid."""

    def __init__(self, urls: list[str], max_retries: int = 3, retry_delay_s: float = 1.0, api_key: str | None = None,
                 max_concurrency: int | None = None):  # fmt: skip
        """api_key: sent as `Authorization: Bearer <key>` on every call (SGLang's --api-key, the
        built-in engine's run token). max_concurrency: /generate calls in flight per URL at most
        (Miles's --sglang-server-concurrency semaphore); the others wait for a slot."""
        if not urls:
            raise ValueError("no engine URLs: start engines or pass --rollout-external-engine-addrs")
        self.urls = [normalize_url(u) for u in urls]
        self.outstanding = dict.fromkeys(self.urls, 0)
        self.healthy = dict.fromkeys(self.urls, True)
        self.max_retries = max_retries
        self.retry_delay_s = retry_delay_s
        self.num_retried = 0
        self.num_aborted = 0
        self._down: dict[str, asyncio.Event] = {}
        self._aborts: set[asyncio.Task] = set()  # fire-and-forget aborts, referenced until done
        self._headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._slots = {u: asyncio.Semaphore(max_concurrency) for u in self.urls} if max_concurrency else {}
        self._flags: dict[str, dict] = {}  # url -> its /server_info (asyncrl's extension flags)

    @functools.cached_property
    def http(self) -> aiohttp.ClientSession:  # lazily: it must belong to the running event loop
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, keepalive_timeout=120),
            timeout=aiohttp.ClientTimeout(total=None, sock_connect=5.0),
            headers=self._headers,
        )

    async def close(self) -> None:
        if self._aborts:  # aborts of cancelled requests go out before the session closes
            await asyncio.wait(self._aborts, timeout=2.0)
        if "http" in self.__dict__:  # a session was made
            await self.http.close()

    def pick(self, exclude: set[str] = frozenset()) -> str:
        candidates = [u for u in self.urls if u not in exclude]
        candidates = [u for u in candidates if self.healthy[u]] or candidates or self.urls
        return min(candidates, key=lambda u: self.outstanding[u])

    def _down_event(self, url: str) -> asyncio.Event:
        """Set at the next failure of `url` (a failed call or health check): the calls in
        flight there then give up and retry elsewhere."""
        return self._down.setdefault(url, asyncio.Event())

    def mark(self, url: str, healthy: bool) -> None:
        if not healthy:
            if self.healthy[url]:
                log.warning("engine %s is unhealthy: no new requests; its unfinished ones go elsewhere", url)
            self._down_event(url).set()  # every failure, not only the first: a stuck engine
            self._down[url] = asyncio.Event()  # the calls from now on wait for the next one
        elif not self.healthy[url]:
            log.info("engine %s is healthy again", url)
        self.healthy[url] = healthy

    async def monitor_health(self, interval_s: float, timeout_s: float) -> None:
        """Poll /health_generate on every engine, forever (a producer loop)."""
        while True:
            results = await asyncio.gather(*(self.health_generate(u, timeout_s) for u in self.urls))
            for url, ok in zip(self.urls, results, strict=True):
                self.mark(url, ok)
            await asyncio.sleep(interval_s)

    async def generate(self, payload: dict[str, Any]) -> dict:
        base_rid = payload.get("rid") or uuid.uuid4().hex
        tried: set[str] = set()
        last: Exception | None = None
        for attempt in range(self.max_retries + 1):
            url = self.pick(tried)
            body = {**payload, "rid": base_rid if attempt == 0 else f"{base_rid}-r{attempt}"}
            try:
                return await self._generate_on(url, body)
            except _EngineDown as e:
                last = e.cause
                self.mark(url, False)
            except EngineError as e:
                if e.client_error:
                    raise
                last = e
            tried.add(url)
            if len(tried) >= len(self.urls):
                tried = set()
            self.num_retried += 1
            log.warning("generate failed on %s (attempt %d): %s", url, attempt + 1, last)
            await asyncio.sleep(self.retry_delay_s)
        raise EngineError(f"generate failed after {self.max_retries + 1} attempts: {last}")

    async def _generate_on(self, url: str, body: dict) -> dict:
        """One call, raced against the engine being declared down; cancelled -> aborted there."""
        self.outstanding[url] += 1
        call = asyncio.ensure_future(self._post_in_slot(url, body))
        # `pick` may choose an engine marked down (none is up): then a success marks it up again
        down = asyncio.ensure_future(self._down_event(url).wait())
        try:
            await asyncio.wait({call, down}, return_when=asyncio.FIRST_COMPLETED)
            if call.done():
                result = call.result()
                self.mark(url, True)
                return result
            call.cancel()
            raise _EngineDown(EngineError(f"{url} went down during the request"))
        except asyncio.CancelledError:
            call.cancel()
            self.num_aborted += 1
            task = asyncio.ensure_future(self._abort_quietly(url, body["rid"]))
            self._aborts.add(task)
            task.add_done_callback(self._aborts.discard)
            raise
        finally:
            down.cancel()
            self.outstanding[url] -= 1

    async def _post_in_slot(self, url: str, body: dict) -> dict:
        async with self._slots.get(url) or contextlib.nullcontext():
            return await self._post_generate(url, body)

    async def _post_generate(self, url: str, body: dict) -> dict:
        try:
            async with self.http.post(f"{url}/generate", json=body) as r:
                if r.status == 200:
                    return await r.json()
                text = await r.text()
        except (TimeoutError, aiohttp.ClientConnectionError) as e:
            raise _EngineDown(e) from e
        if 400 <= r.status < 500:
            raise EngineError(f"{url}/generate rejected the request ({r.status}): {text[:300]}", client_error=True)
        raise EngineError(f"{url}/generate returned {r.status}: {text[:300]}")

    async def _abort_quietly(self, url: str, rid: str) -> None:
        try:
            await self._call("POST", url, "/abort_request", {"rid": rid}, timeout=5.0)
        except Exception as e:  # the engine is gone, the request finished, or we are closing
            log.debug("abort of %s on %s: %s", rid, url, e)

    # ---- control plane (one engine) ------------------------------------------------------------
    async def _call(self, method: str, url: str, path: str, body: dict | None = None, timeout: float = 600.0) -> Any:
        try:
            async with self.http.request(
                method, f"{url}{path}", json=body, timeout=aiohttp.ClientTimeout(total=timeout)
            ) as r:
                text = await r.text()
                if r.status != 200:
                    raise EngineError(f"{url}{path} returned {r.status}: {text[:300]}")
        except (TimeoutError, aiohttp.ClientConnectionError) as e:
            raise EngineError(f"{url}{path} failed: {type(e).__name__}: {e}") from e
        return json.loads(text) if text.strip().startswith(("{", "[")) else text

    async def _succeeds(self, method: str, url: str, path: str, body: dict | None, timeout: float) -> bool:
        """Whether the call was answered with 200 (False when the engine refused or is away)."""
        try:
            await self._call(method, url, path, body, timeout=timeout)
        except EngineError:
            return False
        return True

    async def chat_completions(self, url: str, body: dict) -> dict:
        """POST /v1/chat/completions on one engine (services/envs/chat.py records its turns)."""
        return await self._call("POST", url, "/v1/chat/completions", body)

    async def pause(self, url: str, mode: str) -> None:
        await self._call("POST", url, "/pause_generation", {"mode": mode})

    async def continue_generation(self, url: str) -> None:
        await self._call("POST", url, "/continue_generation", {})

    async def update_weights_from_disk(
        self, url: str, model_path: str, weight_version: str, flush_cache: bool = True
    ) -> dict:
        body = {"model_path": model_path, "weight_version": weight_version, "flush_cache": flush_cache}
        return await self._call("POST", url, "/update_weights_from_disk", body)

    async def stage_weights(self, url: str, model_path: str, weight_version: str) -> bool:
        """Have a built-in engine load a snapshot beside its running weights while it generates
        (asyncrl's /stage_weights); False for an engine without staged loading (an SGLang server),
        which then loads inside the pause."""
        try:
            if not await self.server_flag(url, "staged_weight_loading"):
                return False
        except EngineError:
            return False  # asked again next time; the update then loads inside the pause
        await self._call("POST", url, "/stage_weights", {"model_path": model_path, "weight_version": weight_version})
        return True

    async def server_info(self, url: str) -> dict:
        """/server_info, read once per engine (asyncrl's extension flags); EngineError when it
        does not answer (asked again next time)."""
        if url not in self._flags:
            info = await self._call("GET", url, "/server_info", timeout=30.0)
            self._flags[url] = info if isinstance(info, dict) else {}
        return self._flags[url]

    async def server_flag(self, url: str, key: str) -> bool:
        """Whether /server_info says `key: true` (an SGLang server has none of asyncrl's)."""
        return (await self.server_info(url)).get(key) is True

    # ---- distributed weight updates (SGLang's NCCL path; gloo on the built-in CPU engine) -------
    async def init_weights_update_group(self, url: str, master_address: str, master_port: int, rank_offset: int,
                                        world_size: int, group_name: str, backend: str) -> None:  # fmt: skip
        body = {"master_address": master_address, "master_port": master_port, "rank_offset": rank_offset,
                "world_size": world_size, "group_name": group_name, "backend": backend}  # fmt: skip
        await self._call("POST", url, "/init_weights_update_group", body, timeout=120.0)

    async def destroy_weights_update_group(self, url: str, group_name: str) -> bool:
        """False when there was no such group (or the engine is away): nothing to tear down."""
        return await self._succeeds("POST", url, "/destroy_weights_update_group", {"group_name": group_name}, 60.0)

    async def update_weights_from_distributed(self, url: str, names: list[str], dtypes: list[str],
                                              shapes: list[list[int]], group_name: str, weight_version: str | None,
                                              digest: str | None = None, stage: bool = False) -> dict:  # fmt: skip
        """One bucket, received while the trainer broadcasts it. `digest` (the whole version's, as
        the trainer announced it) and `stage` (keep the version aside until update_weight_version)
        are asyncrl's extensions: for built-in engines only."""
        body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name, "flush_cache": False}
        extensions = {"weight_version": weight_version, "weight_digest": digest or None, "stage": stage or None}
        body |= {k: v for k, v in extensions.items() if v is not None}
        return await self._call("POST", url, "/update_weights_from_distributed", body)

    async def update_weight_version(self, url: str, version: str) -> dict:
        body = {"new_version": version, "abort_all_requests": False}
        reply = await self._call("POST", url, "/update_weight_version", body)
        return reply if isinstance(reply, dict) else {}

    async def pin(self, url: str, model_path: str, version: str, attempts: int = 2) -> bool:
        """Load a snapshot under `version` and read the version back (one retry);
        True once the engine reports it."""
        for attempt in range(attempts):
            try:
                await self.update_weights_from_disk(url, model_path, version)
                got = (await self.model_info(url)).get("weight_version")
                if str(got) == version:
                    return True
                log.warning("%s reports weight_version %r after loading %s as %s", url, got, model_path, version)
            except EngineError as e:
                log.warning("pinning %s to %s failed (attempt %d): %s", url, model_path, attempt + 1, e)
        return False

    async def flush_cache_within(self, url: str, timeout_s: float, every_s: float = 1.0) -> None:
        """Flush a paused engine's prefix cache, asking again every `every_s` (an SGLang server
        refuses while requests are still resident) for up to `timeout_s`, as Miles does; then
        FlushRefused. Weights must never load over KV computed with the old ones."""
        deadline = time.monotonic() + timeout_s
        for attempts in itertools.count(1):
            if await self._succeeds("POST", url, "/flush_cache", None, 60.0):
                if attempts > 1:
                    log.info("%s flushed its cache at attempt %d", url, attempts)
                return
            if time.monotonic() + every_s > deadline:
                raise FlushRefused(f"engine {url} refused /flush_cache {attempts} times in {timeout_s:.0f}s "
                                   "(--flush-cache-timeout-s) while paused")  # fmt: skip
            await asyncio.sleep(every_s)

    async def load_lora_adapter(self, url: str, name: str, path: str) -> dict:
        """SGLang's /load_lora_adapter: {success, error_message, loaded_adapters}; EngineError on a 400."""
        return await self._call("POST", url, "/load_lora_adapter", {"lora_name": name, "lora_path": path})

    async def unload_lora_adapter(self, url: str, name: str) -> dict:
        """/unload_lora_adapter: returns once the adapter's requests in flight are done."""
        return await self._call("POST", url, "/unload_lora_adapter", {"lora_name": name})

    async def loaded_adapters(self, url: str) -> set[str]:
        """The adapter names an engine serves (its /v1/models cards with a parent)."""
        models = await self._call("GET", url, "/v1/models", timeout=30.0)
        return {m["id"] for m in models.get("data", []) if m.get("parent")} if isinstance(models, dict) else set()

    async def model_info(self, url: str) -> dict:
        return await self._call("GET", url, "/model_info", timeout=30.0)

    async def health_generate(self, url: str, timeout: float = 30.0) -> bool:
        return await self._succeeds("GET", url, "/health_generate", None, timeout)
