"""Weight-sync's side of --update-weight-transfer-mode distributed: SGLang's own protocol between
the trainer (rank 0) and every engine (ranks 1..E), driven from here.

Forming the group: `join` to the trainer (`weights.transfer`, request/reply) answers where to
  meet and the manifest; then /destroy_weights_update_group (a leftover) and
  /init_weights_update_group on every engine at once, each returning when all ranks are in.
One update (Miles's order): ask the trainer whether it still has the version (`has`), pause
  every engine, flush unless in_place, then concurrently the trainer's `send` and, on every
  engine, one update_weights_from_distributed per bucket of --update-weight-buffer-size bytes
  (the built-in engine also gets the announced digest, and swaps only a whole, checked version),
  update_weight_version, continue. All engines take part in each broadcast, so all of them
  are paused together and updated together. When every engine stages (built-in engines), the
  broadcast comes first, with `stage: true`, while they generate; the pause then holds only
  update_weight_version, which swaps the staged version in.
Failures: any failure leaves the group (destroy on the engines, `leave` to the trainer) and
  raises; the next attempt forms it again. A version the trainer no longer has (`gone`) is
  skipped: a newer one is next.
"""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time

from asyncrl_proto import TransferReply, TransferRequest
from services.common import crash
from services.common.bus import TransportError
from services.common.sglang_client import EngineError

log = logging.getLogger(__name__)

SEND_TIMEOUT_S = 300.0
"""The trainer answers a send once every engine has every tensor."""


DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8}


def buckets(dtypes: list[str], shapes: list[list[int]], max_bytes: int) -> list[list[int]]:
    """Consecutive manifest indices, each bucket at most `max_bytes` (and at least one tensor):
    one update_weights_from_distributed call per bucket (--update-weight-buffer-size)."""
    out: list[list[int]] = []
    size = max_bytes + 1
    for i, (dt, shape) in enumerate(zip(dtypes, shapes, strict=True)):
        n = math.prod(shape) * DTYPE_BYTES.get(dt, 4)
        if size + n > max_bytes:
            out.append([])
            size = 0
        out[-1].append(i)
        size += n
    return out


class TransferFailed(RuntimeError):
    """The trainer refused or did not answer a weight transfer request."""


class VersionGone(Exception):
    """The trainer no longer has the version asked for."""


class DistributedUpdater:
    def __init__(self, bus, client, run_id: str, buffer_size: int, pause_mode: str, on_pause=None,
                 flush_timeout_s: float = 60.0):  # fmt: skip
        self.bus, self.client = bus, client
        self.flush_timeout_s = flush_timeout_s
        self.run_id = run_id
        self.group_name = ""
        """The formed group's name: a fresh random one each time, sent only over NATS and the
        authenticated HTTP API, so nobody else can name the group's keys in the trainer's store."""
        self.buffer_size = buffer_size
        self.pause_mode = pause_mode
        self.on_pause = on_pause or (lambda seconds, url: None)
        """Called with each engine's paused seconds."""
        self.join: TransferReply | None = None
        """The formed group: where it met and its manifest (None: form it first)."""
        self.num_groups_formed = 0

    async def _ask(self, req: TransferRequest, timeout: float) -> TransferReply:
        try:
            reply = await self.bus.request(self.bus.subjects.weights_transfer, req, TransferReply, timeout=timeout)
        except (TimeoutError, TransportError) as e:
            raise TransferFailed(f"the trainer did not answer {req.op} ({type(e).__name__}): is it running?") from e
        if reply.gone:
            raise VersionGone(reply.error)
        if not reply.ok:
            raise TransferFailed(f"the trainer refused {req.op}: {reply.error}")
        return reply

    async def _form(self) -> TransferReply:
        urls = self.client.urls
        world = 1 + len(urls)
        # gloo where every engine takes it (built-in engines say so), else NCCL (SGLang servers on GPUs)
        infos = [await self.client.server_info(u) for u in urls]
        backend = "gloo" if all("gloo" in (i.get("weight_update_backends") or ()) for i in infos) else "nccl"
        self.group_name = f"asyncrl-{self.run_id}-{secrets.token_hex(8)}"
        req = TransferRequest(op="join", group_name=self.group_name, world_size=world, backend=backend)
        reply = await self._ask(req, 60.0)
        results = await asyncio.gather(*(
            self.client.init_weights_update_group(u, reply.master_address, reply.master_port, i + 1, world,
                                                  self.group_name, reply.backend)
            for i, u in enumerate(urls)
        ), return_exceptions=True)  # fmt: skip
        if errors := [r for r in results if isinstance(r, BaseException)]:
            raise errors[0]
        self.num_groups_formed += 1
        log.info("weight transfer group formed: trainer %s:%d and %d engines (%s, %d tensors)",
                 reply.master_address, reply.master_port, len(urls), reply.backend, len(reply.names))  # fmt: skip
        return reply

    async def leave(self) -> None:
        """Tear the group down on every end (each may be gone already)."""
        self.join = None
        if self.group_name:
            await asyncio.gather(
                *(self.client.destroy_weights_update_group(u, self.group_name) for u in self.client.urls)
            )
        try:
            await self._ask(TransferRequest(op="leave", group_name=self.group_name), 60.0)
        except (TransferFailed, VersionGone) as e:
            log.info("leaving the weight transfer group: %s", e)

    async def update(self, version: int, digest: str | None) -> bool:
        """Every engine to `version`, by broadcast from the trainer. False when the trainer no
        longer has it. Raises (after leaving the group) on any failure."""
        try:  # the trainer also reads an older version from disk now, before any engine waits for it
            await self._ask(TransferRequest(op="has", group_name=self.group_name, version=version), 300.0)
        except VersionGone as e:
            log.warning("weights v%d: %s", version, e)
            return False
        try:
            if self.join is None:
                self.join = await self._form()
            await self._transfer(self.join, version, digest)
        except (TransferFailed, VersionGone, EngineError, OSError):
            await self.leave()
            raise
        return True

    async def _transfer(self, join: TransferReply, version: int, digest: str | None) -> None:
        """Built-in engines (all of them staging) receive while they generate and pause only to
        swap. Otherwise every engine receives inside the pause, as SGLang servers must. An SGLang
        server loads each bucket as it comes, so it is first named `loading-<N>` (no version: it
        counts as behind) and continued only once the whole version is in: a failed broadcast
        leaves it paused until a later one completes, never generating from half of one version
        under the name of another. (A built-in engine swaps only a whole version in.)"""
        urls = self.client.urls
        # built-in engines check the digest, collect a version whole and stage it (an engine whose
        # /server_info does not answer fails the transfer)
        builtin = {u: await self.client.server_flag(u, "weight_digest_check") for u in urls}
        staged = all(builtin.values()) and all(
            [await self.client.server_flag(u, "staged_weight_loading") for u in urls]
        )
        if staged:
            await self._broadcast(join, version, digest, builtin, stage=True)
        pause_t0: dict[str, float] = {}
        mixed: list[str] = []
        try:
            for u in urls:
                await self.client.pause(u, self.pause_mode)
                pause_t0[u] = time.perf_counter()
            crash.point("weight-sync", "transfer_paused")
            if self.pause_mode != "in_place":  # one refusing engine abandons the broadcast (FlushRefused)
                for u in urls:
                    await self.client.flush_cache_within(u, self.flush_timeout_s)
            if not staged:
                mixed = [u for u in urls if not builtin[u]]
                for u in mixed:
                    await self.client.update_weight_version(u, f"loading-{version}")
                await self._broadcast(join, version, digest, builtin, stage=False)
            for u in urls:  # a staged engine swaps the version in here
                swapped = (await self.client.update_weight_version(u, str(version))).get("staged")
                if staged and swapped is not True:
                    raise EngineError(f"{u} held no staged v{version} to swap in (restarted?)")
            mixed = []
        finally:
            if mixed:
                log.error("engines %s stay paused: they may hold part of v%d; the next complete broadcast "
                          "continues them", mixed, version)  # fmt: skip
            await self._continue({u: t for u, t in pause_t0.items() if u not in mixed})

    async def _continue(self, pause_t0: dict[str, float]) -> None:
        """Continue every paused engine, each whatever the others answer."""
        results = await asyncio.gather(*(self.client.continue_generation(u) for u in pause_t0), return_exceptions=True)
        for u, r in zip(pause_t0, results, strict=True):
            self.on_pause(time.perf_counter() - pause_t0[u], u)
            if isinstance(r, BaseException):
                log.warning("continuing %s failed: %s", u, r)

    async def _broadcast(self, join: TransferReply, version: int, digest: str | None, builtin: dict[str, bool],
                         stage: bool) -> None:  # fmt: skip
        """The trainer's send and every engine's receive, at once."""
        send = asyncio.ensure_future(
            self._ask(TransferRequest(op="send", group_name=self.group_name, version=version), SEND_TIMEOUT_S)
        )
        receives = [asyncio.ensure_future(self._receive(u, join, version, digest, builtin[u], stage))
                    for u in self.client.urls]  # fmt: skip
        tasks = [send, *receives]
        # the first failure ends the transfer: a trainer killed mid-send never answers, and an
        # engine that failed leaves the others waiting for tensors that will not come
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for t in pending:
            t.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        for t in tasks:
            if t in done and t.exception() is not None:
                raise t.exception()
        if digest and send.result().tensor_sha256 != digest:
            raise TransferFailed(f"the trainer sent v{version} with digest {send.result().tensor_sha256[:16]}..., "
                                 f"not the announced {digest[:16]}...")  # fmt: skip

    async def _receive(self, url: str, join: TransferReply, version: int, digest: str | None, builtin: bool,
                       stage: bool) -> None:  # fmt: skip
        """One engine's buckets. A built-in engine gets the version's name and digest and must say
        the last bucket completed it; an SGLang server gets neither (it would take the name at
        its first bucket), its name comes from update_weight_version."""
        reply: dict = {}
        for idx in buckets(join.dtypes, join.shapes, self.buffer_size):
            reply = await self.client.update_weights_from_distributed(
                url, [join.names[i] for i in idx], [join.dtypes[i] for i in idx], [join.shapes[i] for i in idx],
                self.group_name, str(version) if builtin else None, digest if builtin else None, stage=stage,
            )  # fmt: skip
        if builtin and not (isinstance(reply, dict) and reply.get("complete") is True):
            raise EngineError(f"{url} did not receive all of v{version}: {str(reply)[:300]}")
