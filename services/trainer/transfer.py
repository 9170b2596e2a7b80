"""The trainer's end of --update-weight-transfer-mode distributed: rank 0 of the weight transfer
group (services/model/transfer.py), driven by weight-sync over `weights.transfer`.

Consumes: TransferRequest (core request/reply) from weight-sync:
  join  closes any group it had, opens a TCP store on --update-weight-master-address (a port the
        kernel picks) and answers at once with where to meet and the manifest (names, dtypes,
        shapes) every send follows; the group forms in a worker thread while weight-sync calls
        /init_weights_update_group on the engines;
  send  waits for that group, then broadcasts the version's tensors one by one in manifest
        order while weight-sync's update_weights_from_distributed calls receive them; answers
        once all are sent, with their digest;
  has   whether it can still send a version (weight-sync asks before it pauses the engines);
        one it no longer holds is read from its snapshot now, before any engine waits for it;
  leave closes the group.
Holds: the newest pushed version's tensors (a copy taken at the push, so training goes on);
  an older version, or any version after a restart, is read from its snapshot on disk.
Failures: a failed formation or broadcast closes the group and answers ok=false with the cause;
  weight-sync joins again. One request at a time; a broadcast waits at most the group's timeout
  for each tensor.
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path

import torch

from asyncrl_proto import TransferReply, TransferRequest, decode, encode
from asyncrl_proto.codec import MalformedMessage
from services.common import crash
from services.common.snapshot import is_complete
from services.model.hf_io import hf_state, load_state_dict
from services.model.transfer import TransferGroup, digest, manifest, open_store

log = logging.getLogger(__name__)


class WeightSender:
    def __init__(self, model, weights_dir: Path, address: str, backend: str):
        self.model = model
        self.weights_dir = weights_dir
        self.address = address
        self.backend = backend
        self.held: tuple[int, dict[str, torch.Tensor], str] | None = None
        """(version, tensors, digest) of the newest push, in host memory."""
        self.prepared: tuple[int, dict[str, torch.Tensor], str] | None = None
        """An older version read from its snapshot when weight-sync asked `has` (a catch-up)."""
        self._forming: asyncio.Task | None = None
        """The group being formed (or formed): its result is the TransferGroup."""
        self._lock = asyncio.Lock()
        self.num_sends = 0
        self.last_send_s = 0.0

    def hold(self, version: int) -> str:
        """Keep a copy of the weights just pushed as `version` in host memory (a GPU trainer's
        weights are not doubled on the GPU); returns their digest. Blocking (a copy and a hash of
        every tensor): call it from a worker thread."""
        state = {k: v.to("cpu", copy=True) for k, v in hf_state(self.model).items()}
        sha = digest(state)
        self.held = (version, state, sha)
        return sha

    async def on_request(self, msg) -> None:
        try:
            req = decode(msg.data, TransferRequest)
        except MalformedMessage as e:
            await msg.respond(encode(TransferReply(ok=False, error=f"malformed request: {e}")))
            return
        async with self._lock:
            try:
                if req.op == "join":
                    reply = await self._join(req)
                elif req.op == "send":
                    reply = await self._send(req)
                elif req.op == "has":
                    reply = await self._prepare(req.version)
                elif req.op == "leave":
                    await self._close()
                    reply = TransferReply(ok=True)
                else:
                    reply = TransferReply(ok=False, error=f"unknown op {req.op!r:.40}: join, has, send or leave")
            except (ValueError, RuntimeError, OSError, TimeoutError) as e:
                await self._close()
                log.warning("weight transfer %s failed: %s", req.op, e)
                reply = TransferReply(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
        await msg.respond(encode(reply))

    async def _join(self, req: TransferRequest) -> TransferReply:
        if req.world_size < 2:
            raise ValueError(f"a transfer group needs the trainer and at least one engine, not {req.world_size} ranks")
        backend = req.backend or self.backend
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("the engines need an NCCL group and this trainer has no GPU")
        await self._close()
        store = await asyncio.to_thread(open_store, self.address, 0, req.world_size, True)
        self._forming = asyncio.create_task(asyncio.to_thread(
            TransferGroup, req.group_name, backend, self.address, store.port, 0, req.world_size, store=store
        ))  # fmt: skip
        names, dtypes, shapes = manifest(self.held[1] if self.held else hf_state(self.model))
        log.info("weight transfer group: rank 0 of %d on %s:%d (%s)", req.world_size, self.address, store.port,
                 backend)  # fmt: skip
        return TransferReply(ok=True, master_address=self.address, master_port=store.port, backend=backend,
                             names=names, dtypes=dtypes, shapes=shapes)  # fmt: skip

    async def _prepare(self, version: int) -> TransferReply:
        """`has`: whether `version` can be sent; one not held is read from its snapshot now, so
        that no engine waits in the broadcast while the trainer reads the disk."""
        if self._tensors(version) is None and is_complete(self.weights_dir / f"v{version}"):
            state = await asyncio.to_thread(self._from_disk, version)
            self.prepared = (version, state, await asyncio.to_thread(digest, state))
        return TransferReply(ok=True, version=version, gone=self._tensors(version) is None)

    def _tensors(self, version: int) -> tuple[dict[str, torch.Tensor], str] | None:
        return next((kept[1:] for kept in (self.held, self.prepared) if kept is not None and kept[0] == version), None)

    async def _send(self, req: TransferRequest) -> TransferReply:
        if self._forming is None:
            raise RuntimeError("no weight transfer group: join first")
        group = await self._forming  # raises when the engines never joined
        if (kept := self._tensors(req.version)) is None:
            return TransferReply(ok=False, gone=True, version=req.version,
                                 error=f"weights v{req.version} were not prepared (has) or are gone: a newer one is next")  # fmt: skip
        state, sha = kept
        t0 = time.perf_counter()
        await asyncio.to_thread(self._broadcast, group, state)
        self.last_send_s = time.perf_counter() - t0
        self.num_sends += 1
        return TransferReply(ok=True, version=req.version, tensor_sha256=sha)

    def _from_disk(self, version: int) -> dict[str, torch.Tensor]:
        """`version`'s snapshot, in the order of the model's own tensors, in host memory."""
        path = self.weights_dir / f"v{version}"
        on_disk = load_state_dict(path)
        own = hf_state(self.model)
        if missing := sorted(set(own) - set(on_disk)):
            raise ValueError(f"snapshot {path} lacks {missing[:3]}")
        return {n: on_disk[n].to(dtype=t.dtype) for n, t in own.items()}

    @staticmethod
    def _broadcast(group: TransferGroup, state: dict[str, torch.Tensor]) -> None:
        """Every tensor in manifest order, from the group's device (NCCL: the GPU, one tensor
        copied up at a time); returns once all are sent."""
        for i, t in enumerate(state.values()):
            if i == len(state) // 2:
                crash.point("trainer", "mid_broadcast")
            group.broadcast(t.to(group.device).contiguous())
        if group.device.type == "cuda":  # an NCCL broadcast only queues the work on the stream
            torch.cuda.synchronize(group.device)

    async def _close(self) -> None:
        forming, self._forming = self._forming, None
        if forming is None:
            return
        try:
            group = await forming  # a formation still under way ends within the group's timeout
        except (ValueError, RuntimeError, OSError, TimeoutError) as e:
            log.info("the last weight transfer group never formed: %s", e)
            return
        await asyncio.to_thread(group.close)

    async def stop(self) -> None:
        async with self._lock:
            await self._close()

    def status(self) -> dict:
        f = self._forming
        failed = f is not None and f.done() and (f.cancelled() or f.exception() is not None)
        return {
            "held_version": self.held[0] if self.held else None,
            "group": None if f is None else "forming" if not f.done() else "failed" if failed else "formed",
            "num_sends": self.num_sends,
            "last_send_s": self.last_send_s,
        }
