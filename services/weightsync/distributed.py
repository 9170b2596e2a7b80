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
import time

from asyncrl_proto import TransferReply, TransferRequest
from services.common import crash
from services.common.bus import TransportError
from services.common.sglang_client import EngineError

log = logging.getLogger(__name__)

SEND_TIMEOUT_S = 300.0
"""The trainer answers a send once every engine has every tensor."""


DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1}


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
    def __init__(self, bus, client, run_id: str, buffer_size: int, pause_mode: str, on_pause=None):
        self.bus, self.client = bus, client
        self.group_name = f"asyncrl-{run_id}"
        self.buffer_size = buffer_size
        self.pause_mode = pause_mode
        self.on_pause = on_pause or (lambda seconds: None)
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
        reply = await self._ask(TransferRequest(op="join", group_name=self.group_name, world_size=world), 60.0)
        await asyncio.gather(*(self.client.destroy_weights_update_group(u, self.group_name) for u in urls))
        await asyncio.gather(*(
            self.client.init_weights_update_group(u, reply.master_address, reply.master_port, i + 1, world,
                                                  self.group_name, reply.backend)
            for i, u in enumerate(urls)
        ))  # fmt: skip
        self.num_groups_formed += 1
        log.info("weight transfer group %s formed: trainer %s:%d and %d engines (%s, %d tensors)", self.group_name,
                 reply.master_address, reply.master_port, len(urls), reply.backend, len(reply.names))  # fmt: skip
        return reply

    async def leave(self) -> None:
        """Tear the group down on every end (each may be gone already)."""
        self.join = None
        await asyncio.gather(*(self.client.destroy_weights_update_group(u, self.group_name) for u in self.client.urls))
        try:
            await self._ask(TransferRequest(op="leave", group_name=self.group_name), 60.0)
        except (TransferFailed, VersionGone) as e:
            log.info("leaving the weight transfer group: %s", e)

    async def update(self, version: int, digest: str | None) -> bool:
        """Every engine to `version`, by broadcast from the trainer. False when the trainer no
        longer has it. Raises (after leaving the group) on any failure."""
        try:
            await self._ask(TransferRequest(op="has", group_name=self.group_name, version=version), 60.0)
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
        swap; otherwise every engine receives inside the pause, as SGLang servers must."""
        urls = self.client.urls
        staged = all([await self.client.server_flag(u, "staged_weight_loading") for u in urls])
        if staged:
            await self._broadcast(join, version, digest, stage=True)
        pause_t0 = {}
        try:
            for u in urls:
                await self.client.pause(u, self.pause_mode)
                pause_t0[u] = time.perf_counter()
            crash.point("weight-sync", "transfer_paused")
            if self.pause_mode != "in_place":
                for u in urls:
                    if not await self.client.flush_cache(u):
                        log.warning("%s refused to flush its cache while paused", u)
            if not staged:
                await self._broadcast(join, version, digest, stage=False)
            for u in urls:  # a staged engine swaps the version in here
                await self.client.update_weight_version(u, str(version))
        finally:
            for u in pause_t0:
                try:
                    await self.client.continue_generation(u)
                finally:
                    self.on_pause(time.perf_counter() - pause_t0[u])

    async def _broadcast(self, join: TransferReply, version: int, digest: str | None, stage: bool) -> None:
        """The trainer's send and every engine's receive, at once."""
        send = asyncio.ensure_future(
            self._ask(TransferRequest(op="send", group_name=self.group_name, version=version), SEND_TIMEOUT_S)
        )
        tasks = [
            send,
            *(asyncio.ensure_future(self._receive(u, join, version, digest, stage)) for u in self.client.urls),
        ]
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

    async def _receive(self, url: str, join: TransferReply, version: int, digest: str | None, stage: bool) -> None:
        for idx in buckets(join.dtypes, join.shapes, self.buffer_size):
            await self.client.update_weights_from_distributed(
                url, [join.names[i] for i in idx], [join.dtypes[i] for i in idx], [join.shapes[i] for i in idx],
                self.group_name, str(version), digest, stage=stage,
            )  # fmt: skip
