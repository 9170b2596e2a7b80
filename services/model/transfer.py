"""The weight transfer group of --update-weight-transfer-mode distributed, seen from both ends.

SGLang's protocol (init_weights_update_group + update_weights_from_distributed): the trainer is
rank 0 of a process group whose ranks 1..E are the engines; an update names the tensors
(names, dtypes, shapes) over HTTP and the trainer broadcasts each one, in that order, while the
engines receive them. Here a group is a standalone torch process group (gloo on CPU, NCCL on GPU)
over its own TCP store: it never touches the default group that the trainer's data-parallel ranks
use, and it is closed and formed again whenever one end fails.

The digest (`Digest`) covers every tensor's name, dtype, shape and bytes in manifest order. The
trainer announces it on the bus (WeightsPublished.tensor_sha256), so an engine can tell the
trainer's tensors from anything else that reached its socket.
"""

from __future__ import annotations

import datetime
import hashlib
import logging

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

DTYPES = {str(t).removeprefix("torch."): t for t in (torch.float32, torch.float16, torch.bfloat16, torch.float64)}
"""The dtype names SGLang's update_weights_from_distributed takes (torch's names without `torch.`)."""

BACKENDS = ("gloo", "nccl")
GROUP_TIMEOUT_S = 30.0
"""A rank that waits this long for the others (to join, or inside a broadcast) fails the call."""


def dtype_name(dtype: torch.dtype) -> str:
    if dtype in DTYPES.values():
        return str(dtype).removeprefix("torch.")
    raise ValueError(f"weights of dtype {dtype} cannot be transferred (one of {', '.join(DTYPES)})")


def dtype_of(name: str) -> torch.dtype:
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r:.40}: one of {', '.join(DTYPES)}")
    return DTYPES[name]


def manifest(state: dict[str, torch.Tensor]) -> tuple[list[str], list[str], list[list[int]]]:
    """(names, dtypes, shapes) of a state dict, in its order: what every send follows."""
    names = list(state)
    return names, [dtype_name(state[n].dtype) for n in names], [list(state[n].shape) for n in names]


class Digest:
    """SHA-256 over (name, dtype, shape, bytes) of each tensor, fed in manifest order."""

    def __init__(self) -> None:
        self._h = hashlib.sha256()

    def update(self, name: str, tensor: torch.Tensor) -> None:
        t = tensor.detach()
        self._h.update(f"{name}\0{dtype_name(t.dtype)}\0{list(t.shape)}\0".encode())
        self._h.update(t.cpu().contiguous().reshape(-1).view(torch.uint8).numpy())

    def hexdigest(self) -> str:
        return self._h.hexdigest()


def digest(state: dict[str, torch.Tensor]) -> str:
    d = Digest()
    for name, t in state.items():
        d.update(name, t)
    return d.hexdigest()


class TransferGroup:
    """One member of a weight transfer group; rank 0 hosts the group's TCP store on
    (master_address, master_port). Gloo: creating it blocks until every rank has joined (at most
    `timeout_s`). NCCL: the communicator is made at the first broadcast (as on SGLang's side), so
    a rank that never joins shows there. `broadcast` sends from rank 0 and receives into the
    given tensor elsewhere; an NCCL broadcast is only queued on the stream (synchronize to wait).
    The store listens on every interface and anyone who reaches it can take a rank: the group's
    name (the keys' prefix) is a fresh random one, known only to the ranks, and the engine checks
    the announced digest; the network between trainer and engines should still be a trusted one."""

    def __init__(self, name: str, backend: str, master_address: str, master_port: int, rank: int,
                 world_size: int, timeout_s: float = GROUP_TIMEOUT_S, store=None):  # fmt: skip
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r:.40}")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend nccl needs a GPU, and this process has none: use gloo")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside a group of {world_size}")
        self.name, self.backend, self.rank, self.world_size = name, backend, rank, world_size
        self.store = store or open_store(master_address, master_port, world_size, rank == 0, timeout_s)
        # the store keys of SGLang's init_custom_process_group (its group name) and of torch's
        # process group helper inside it (the group, then the device), so that an SGLang server's
        # rank meets this one
        device = "cuda" if backend == "nccl" else "cpu"
        prefixed = dist.PrefixStore(f"{device}/", dist.PrefixStore(f"{name}/", dist.PrefixStore(name, self.store)))
        group = dist.ProcessGroupGloo if backend == "gloo" else dist.ProcessGroupNCCL
        opts = group._Options() if backend == "gloo" else group.Options()
        opts._timeout = datetime.timedelta(seconds=timeout_s)
        if backend == "gloo":
            opts._devices = [group.create_device(hostname=local_address_towards(master_address))]
        self.pg = group(prefixed, rank, world_size, opts)
        self.device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")

    def broadcast(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        self.pg.broadcast([tensor], opts).wait()

    def close(self) -> None:
        """Drop the group (its peers' next collective fails within the timeout)."""
        pg, self.pg = self.pg, None
        if pg is not None and self.backend == "nccl":
            try:
                pg.abort()
            except (RuntimeError, AttributeError) as e:  # already broken; nothing more to free
                log.info("closing NCCL group %s: %s", self.name, e)
        self.store = None


def local_address_towards(address: str) -> str:
    """This host's address on the route to `address` (the address itself on its own host): the
    address gloo binds, which every other rank connects to."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((address, 9))  # no packet is sent: this only picks the route
        return s.getsockname()[0]


def open_store(address: str, port: int, world_size: int, is_master: bool, timeout_s: float = GROUP_TIMEOUT_S):
    """The group's TCP store: rank 0 listens (without waiting for the others), the rest connect."""
    return dist.TCPStore(address, port, world_size, is_master=is_master,
                         timeout=datetime.timedelta(seconds=timeout_s), wait_for_workers=False)  # fmt: skip
