"""The built-in engine's end of SGLang's distributed weight update (--update-weight-transfer-mode
distributed): /init_weights_update_group, /update_weights_from_distributed and
/destroy_weights_update_group, with SGLang's request fields (docs: reference SGLang HTTP API §5.3).

The engine is rank `rank_offset` of the group whose rank 0 is the trainer. Each
update_weights_from_distributed call names a bucket of tensors (names, dtypes, shapes) and
receives them by broadcast, in that order, beside the running weights. Where SGLang loads each
bucket as it arrives, this engine swaps a weight version in only once every parameter has arrived,
checked (shapes, finite values and, when weight-sync passes it, the `weight_digest` the trainer
announced): the model never runs half of one version and half of another, nor tensors that did
not come from the trainer. Every answer says whether the version is now `complete`. One group at
a time: a new /init_weights_update_group replaces any group left over.

Staged loading (asyncrl's extension, `"stage": true`; /server_info says `staged_weight_loading`):
the whole version is received and checked while the engine keeps generating, and kept aside; the
/update_weight_version to that version, inside the pause, then only swaps it in.

Every field is checked before anything is received; a bad request is a 400 naming the field.
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass, field

import torch

from services.engine.protocol import BadRequest, typed, updated_message
from services.model.hf_io import check_finite
from services.model.transfer import GROUP_TIMEOUT_S, Digest, TransferGroup, dtype_of

DEFAULT_GROUP = "weight_update_group"


@dataclass
class _Incoming:
    """The buckets of one version received so far."""

    key: tuple[str, str | None]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)
    digest: Digest = field(default_factory=Digest)


def _checked(received: dict[str, torch.Tensor], params: dict[str, torch.nn.Parameter]) -> dict[str, torch.Tensor]:
    """The received tensors in the model's devices and dtypes; ValueError (NonFiniteWeights) if any is not finite."""
    check_finite(received, "received weights")
    return {n: received[n].to(device=p.device, dtype=p.dtype).contiguous() for n, p in params.items()}


class DistributedReceiver:
    def __init__(self, scheduler, staged_loading: bool = True):
        self.scheduler = scheduler
        self.staged_loading = staged_loading
        self.groups: dict[str, TransferGroup] = {}
        self._lock = threading.Lock()
        """One group operation or receive at a time (a receive holds it for the whole bucket)."""
        self._incoming: _Incoming | None = None
        self.staged: tuple[str, dict[str, torch.Tensor]] | None = None
        """(version, tensors) received with stage=true, swapped in by set_version."""
        self.num_updates = 0

    # ---- groups --------------------------------------------------------------------------------
    def init_group(self, body: dict) -> dict:
        """Blocking: returns once every rank has joined (at most the group's timeout)."""
        address = typed(body, "master_address", str, required=True)
        port, rank, world = (typed(body, key, int, required=True)
                             for key in ("master_port", "rank_offset", "world_size"))  # fmt: skip
        name = typed(body, "group_name", str, default=DEFAULT_GROUP)
        backend = typed(body, "backend", str, default="nccl")
        if not 0 < port < 65536:
            raise BadRequest(f"master_port must be a TCP port, got {port}")
        if not 0 < rank < world:
            raise BadRequest(f"rank_offset must be in 1..world_size-1 (rank 0 is the trainer), got {rank} of {world}")
        if backend not in ("gloo", "nccl"):
            raise BadRequest(f"backend must be gloo or nccl, got {backend!r:.40}")
        if backend == "nccl" and not torch.cuda.is_available():
            raise BadRequest("backend nccl needs a GPU and this engine runs on the CPU: use gloo")
        reach_master(address, port)
        with self._lock:
            for old in self.groups.values():  # one group at a time: a new one replaces any left over
                old.close()
            self.groups.clear()
            self._incoming = None  # what an earlier group delivered of a version is not counted again
            self.groups[name] = TransferGroup(name, backend, address, port, rank, world, GROUP_TIMEOUT_S)
        return {"success": True, "message": f"Initialized weight update group {name} (rank {rank} of {world})."}

    def destroy_group(self, body: dict) -> dict:
        name = typed(body, "group_name", str, default=DEFAULT_GROUP)
        with self._lock:
            group = self.groups.pop(name, None)
            if group is not None:
                group.close()
        if group is None:
            return {"success": False, "message": f"no weight update group {name!r:.80}"}
        return {"success": True, "message": f"Destroyed weight update group {name}."}

    # ---- updates -------------------------------------------------------------------------------
    def update(self, body: dict) -> dict:
        """Receive one bucket; once the version is whole and checked, swap it in."""
        names, dtypes, shapes = (typed(body, key, list, required=True)
                                 for key in ("names", "dtypes", "shapes"))  # fmt: skip
        name = typed(body, "group_name", str, default=DEFAULT_GROUP)
        version = typed(body, "weight_version", (str, int))
        expected = typed(body, "weight_digest", str)
        typed(body, "flush_cache", bool)  # the pause flushed already (weight-sync); nothing else to flush
        abort_all = typed(body, "abort_all_requests", bool, default=False)
        stage = typed(body, "stage", bool, default=False)
        if stage and not self.staged_loading:
            raise BadRequest("stage: this engine was started with --disable-staged-weight-loading")
        if stage and version is None:
            raise BadRequest("stage needs the weight_version that /update_weight_version will swap in")
        if body.get("load_format") is not None:
            raise BadRequest("load_format is not supported by the built-in engine: leave it unset")
        plan = self._plan(names, dtypes, shapes)
        version = None if version is None else str(version)
        with self._lock:
            group = self.groups.get(name)
            if group is None:
                raise BadRequest(f"no weight update group {name!r:.80}: call /init_weights_update_group first")
            key = (name, version)
            if self._incoming is None or self._incoming.key != key:
                self._incoming = _Incoming(key)
            inc = self._incoming
            try:
                for pname, dtype, shape in plan:
                    t = torch.empty(shape, dtype=dtype, device=group.device)
                    group.broadcast(t)
                    inc.tensors[pname] = t
                    inc.digest.update(pname, t)
            except RuntimeError as e:  # a peer left mid-broadcast: this group is finished
                self._incoming = None
                self.groups.pop(name, None)
                group.close()
                raise ValueError(f"the broadcast failed ({e}); the group {name} is closed: initialize it again") from e
            params = dict(self.scheduler.model.named_parameters())
            if missing := [n for n in params if n not in inc.tensors]:
                return {"success": True, "complete": False, "message": f"Received {len(plan)} tensors; "
                        f"{len(missing)} of {len(params)} still to come for weight version {version}."}  # fmt: skip
            self._incoming = None
        got = inc.digest.hexdigest()
        if expected is not None and got != expected:
            raise ValueError(f"the received weights' digest {got[:16]}... differs from the announced "
                             f"{expected[:16]}...: not loaded")  # fmt: skip
        tensors = self.scheduler.call(_checked, inc.tensors, params)  # torch work on the engine's one thread
        if stage:
            with self._lock:
                self.staged = (version, tensors)
            return {"success": True, "complete": True,
                    "message": f"Staged weight version {version}: /update_weight_version swaps it in."}  # fmt: skip
        if abort_all:
            self.scheduler.abort("", True)
        res = self.scheduler.weights.update_weights_from_tensors(tensors, version)
        self.num_updates += 1
        return {"success": True, "complete": True, "message": updated_message(version),
                "num_paused_requests": res["num_paused_requests"]}  # fmt: skip

    def staged_version(self) -> str | None:
        """The name of the version a broadcast staged, waiting for its swap (None: none)."""
        with self._lock:
            return self.staged[0] if self.staged is not None else None

    def mark_loading(self) -> None:
        """The engine was named `loading-<N>`: a broadcast is under way (an SGLang server's flow)."""
        self._loading_from = self.num_updates

    def received_since_loading(self) -> bool:
        """Whether a whole version arrived by broadcast since the engine was named `loading-<N>`:
        only then may it be named N (else the name would claim weights it never received)."""
        return self.num_updates > getattr(self, "_loading_from", self.num_updates)

    def set_version(self, version: str) -> bool:
        """/update_weight_version: swap in the version staged under that name, if any (True).
        Blocking: waits like a weight update for the pause or for in-flight requests."""
        with self._lock:
            if self.staged is None or self.staged[0] != version:
                return False  # another version stays staged for its own swap
            staged, self.staged = self.staged, None
        self.scheduler.weights.update_weights_from_tensors(staged[1], version)
        self.scheduler.stats.num_staged_swaps_total += 1
        self.num_updates += 1
        return True

    def _plan(self, names: list, dtypes: list, shapes: list) -> list[tuple[str, torch.dtype, list[int]]]:
        if not (len(names) == len(dtypes) == len(shapes)) or not names:
            raise BadRequest(f"names, dtypes and shapes must be non-empty lists of one length, got "
                             f"{len(names)}, {len(dtypes)} and {len(shapes)}")  # fmt: skip
        params = dict(self.scheduler.model.named_parameters())
        if len(set(map(str, names))) != len(names):
            raise BadRequest("names holds a name twice")
        plan = []
        for n, dt, shape in zip(names, dtypes, shapes, strict=True):
            if not isinstance(n, str) or n not in params:
                raise BadRequest(f"names: {n!r:.80} is not a parameter of this model")
            if not isinstance(dt, str):
                raise BadRequest(f"dtypes: {dt!r:.40} is not a dtype name")
            try:
                dtype = dtype_of(dt)
            except ValueError as e:
                raise BadRequest(f"dtypes: {e}") from None
            if not isinstance(shape, list) or not all(type(d) is int for d in shape) or list(params[n].shape) != shape:
                raise BadRequest(f"shapes: {n} has shape {list(params[n].shape)}, got {shape!r:.80}")
            plan.append((n, dtype, shape))
        return plan

    @staticmethod
    def backends() -> list[str]:
        """The groups this engine can join (/server_info `weight_update_backends`)."""
        return ["gloo", "nccl"] if torch.cuda.is_available() else ["gloo"]

    def status(self) -> dict:
        return {"groups": sorted(self.groups), "num_distributed_updates": self.num_updates}


MASTER_CONNECT_TIMEOUT_S = 5.0


def reach_master(address: str, port: int) -> None:
    """Rank 0 listens before the engines are asked to join: a master that refuses or does not
    answer within MASTER_CONNECT_TIMEOUT_S is a 400 now, not a store that retries for the group's
    whole timeout."""
    try:
        socket.create_connection((address, port), timeout=MASTER_CONNECT_TIMEOUT_S).close()
    except OSError as e:
        raise BadRequest(f"cannot reach the group's master {address}:{port} within {MASTER_CONNECT_TIMEOUT_S:.0f}s: {e}") from None
