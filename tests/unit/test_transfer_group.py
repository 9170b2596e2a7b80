"""The weight transfer group meets a rank that joins the way an SGLang server does
(init_custom_process_group: a tcp:// rendezvous, the store prefixed with the group name, then
torch's process group helper), so the trainer's broadcast reaches a real SGLang server's ranks;
and the digest covers names, dtypes, shapes and bytes."""

from __future__ import annotations

import subprocess
import sys
import threading

import torch

from services.model.transfer import TransferGroup, digest, open_store

# How an SGLang server joins (python/sglang/srt/utils: init_custom_process_group), in a process
# of its own: torch's process-group registry is global.
SGLANG_RANK = r"""
import datetime, inspect, sys
import torch
from torch.distributed.distributed_c10d import Backend, PrefixStore, _new_process_group_helper, _world, rendezvous

address, port, name = sys.argv[1], int(sys.argv[2]), sys.argv[3]
timeout = datetime.timedelta(seconds=30)
store, rank, world = next(rendezvous(f"tcp://{address}:{port}", 1, 2, timeout=timeout))
store.set_timeout(timeout)
store = PrefixStore(name, store)
options = "backend_options" if "backend_options" in inspect.signature(_new_process_group_helper).parameters else "pg_options"
pg, _ = _new_process_group_helper(world, rank, [], Backend("gloo"), store, group_name=name, timeout=timeout,
                                  **{options: None})
_world.pg_group_ranks[pg] = {i: i for i in range(world)}
t = torch.empty(4)
torch.distributed.broadcast(t, src=0, group=pg)
print(t.tolist(), flush=True)
# gloo's threads must end before the interpreter does: a group still alive at exit can abort it
# ("terminate called without an active exception", exit -6), more often on a busy machine. Even a
# destroyed group leaves gloo's C++ threads to the interpreter's teardown, which still aborted on
# a loaded machine: the rank leaves at once, once its answer is out.
torch.distributed.destroy_process_group(pg)
sys.stdout.flush()
import os
os._exit(0)
"""


def test_a_rank_joining_as_sglang_does_receives_the_broadcast():
    store = open_store("127.0.0.1", 0, 2, True)
    proc = subprocess.Popen([sys.executable, "-c", SGLANG_RANK, "127.0.0.1", str(store.port), "weight-group"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
    holder: dict = {}
    t = threading.Thread(target=lambda: holder.update(
        g=TransferGroup("weight-group", "gloo", "127.0.0.1", store.port, 0, 2, timeout_s=30, store=store)))  # fmt: skip
    t.start()
    t.join(60)
    assert "g" in holder, "the group did not form"
    try:
        holder["g"].broadcast(torch.tensor([1.0, 2.0, 3.0, 4.0]))
        out, err = proc.communicate(timeout=60)
    finally:
        holder["g"].close()
    assert proc.returncode == 0, err[-3000:]
    assert out.strip() == "[1.0, 2.0, 3.0, 4.0]"


def test_the_digest_covers_names_shapes_dtypes_and_values():
    a = {"w": torch.ones(2, 3), "b": torch.zeros(3)}
    base = digest(a)
    assert digest({"w": torch.ones(2, 3), "b": torch.zeros(3)}) == base
    assert digest({"w": torch.ones(3, 2), "b": torch.zeros(3)}) != base  # same bytes, another shape
    assert digest({"v": torch.ones(2, 3), "b": torch.zeros(3)}) != base
    assert digest({"w": torch.ones(2, 3).double(), "b": torch.zeros(3)}) != base
    assert digest({"b": torch.zeros(3), "w": torch.ones(2, 3)}) != base  # the order is the manifest's
    changed = {"w": torch.ones(2, 3), "b": torch.tensor([0.0, 0.0, 1e-7])}
    assert digest(changed) != base
