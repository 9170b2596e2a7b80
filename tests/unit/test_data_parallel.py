"""Data parallel on CPU (gloo): 2 ranks give the same update as 1 rank on the same batch."""

from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp

from services.api import Sample
from services.common.procs import free_port
from services.trainer.core import LossConfig, build_step_batches, train_step
from tests.unit.test_trainer_core import tiny_model


def make_groups():
    g = torch.Generator().manual_seed(7)
    groups = []
    for gi in range(3):
        grp = []
        for i in range(4):
            plen, rlen = 2 + i % 2, 1 + (gi + i) % 4
            toks = torch.randint(1, 7, (plen + rlen,), generator=g).tolist()
            grp.append(Sample(index=gi * 4 + i, group_index=gi, tokens=toks, response_length=rlen,
                              reward=float((gi * i) % 3), rollout_log_probs=[-1.5] * rlen))  # fmt: skip
        groups.append(grp)
    return groups


CFG = LossConfig(entropy_coef=0.01, kl_coef=0.1)


def one_step(model, ref, optimizer, groups, world_rank=None):
    from services.trainer.parallel import dp_train_step

    if world_rank is None:
        (batches,) = build_step_batches(groups, True, None, 0, 12, num_steps=1)
        return train_step(model, optimizer, batches, CFG, 1.0, ref)
    return dp_train_step(model, optimizer, groups, CFG, 1.0, std_norm=True, reward_key=None, pad_id=0,
                         max_tokens=12, ref_model=ref)  # fmt: skip


def _rank(rank: int, world: int, port: int, out_dir: str):
    torch.set_num_threads(1)
    from services.trainer.parallel import broadcast_state, init_group

    init_group(rank, world, "127.0.0.1", port, "gloo")
    model, ref = tiny_model(0), tiny_model(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    broadcast_state(model, opt)
    stats = one_step(model, ref, opt, make_groups(), world_rank=rank)
    torch.save({"params": [p.detach().clone() for p in model.parameters()], "stats": stats},
               os.path.join(out_dir, f"rank{rank}.pt"))  # fmt: skip
    import torch.distributed as dist

    dist.barrier()  # both ranks done before either tears down (rank 0 hosts the store; an early exit aborted it once)
    dist.destroy_process_group()


def test_two_ranks_equal_one_rank(tmp_path):
    model, ref = tiny_model(0), tiny_model(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    single = one_step(model, ref, opt, make_groups())
    mp.start_processes(_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    for p, a, b in zip(model.parameters(), r0["params"], r1["params"], strict=True):
        assert torch.equal(a, b), "the replicas diverged"
        assert (p.detach() - a).abs().max().item() < 1e-6
    for k in ("train/loss", "train/pg_clipfrac", "train/kl_loss", "train/entropy", "train/grad_norm"):
        assert r0["stats"][k] == pytest.approx(single[k], abs=1e-5), k
    assert r0["stats"]["train/dp_world_size"] == 2


# ---- multi-LoRA: one adapter's step over 2 ranks -------------------------------------------------------
SPEC_KW = {"rank": 2, "alpha": 4.0, "target_modules": ("q_proj", "v_proj", "up_proj")}


def adapter_setup(with_adapter: bool):
    """The frozen tiny base with 3 slots; rank 0 (and the single-process run) puts an adapter with
    non-zero B in slot 1, the other rank has none: the step's broadcast must bring it."""
    from services.model.lora import LoraSpec, MultiLora, SlotAdamW

    model = tiny_model(0).requires_grad_(False)
    lora = MultiLora(model, n_slots=3, max_rank=4)
    if with_adapter:
        spec = LoraSpec(**SPEC_KW)
        lora.init_slot(1, spec, seed=3)
        g = torch.Generator().manual_seed(5)
        with torch.no_grad():
            for p in lora.B.values():
                p[1].copy_(torch.randn(p[1].shape, generator=g) * 0.3)
    return model, lora, SlotAdamW(lora, lr=1e-2)


def _adapter_rank(rank: int, world: int, port: int, out_dir: str):
    torch.set_num_threads(1)
    from services.model.lora import LoraSpec
    from services.trainer.parallel import dp_adapter_step, init_group

    init_group(rank, world, "127.0.0.1", port, "gloo")
    model, lora, opt = adapter_setup(with_adapter=rank == 0)
    stats = [dp_adapter_step(model, lora, opt if rank == 0 else None, 1, LoraSpec(**SPEC_KW), make_groups(),
                             LossConfig(entropy_coef=0.01), 1.0, std_norm=True, reward_key=None, pad_id=0,
                             max_tokens=None) for _ in range(2)]  # fmt: skip
    # rank 1 keeps the factors rank 0 sent at the start of the second step: rank 0's after the first
    torch.save({"slot": lora.slot_tensors(1), "stats": stats}, os.path.join(out_dir, f"rank{rank}.pt"))
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def test_two_ranks_step_an_adapter_as_one_rank(tmp_path):
    from services.trainer.adapters import train_adapter_step
    from services.trainer.core import build_step_batches

    model, lora, opt = adapter_setup(with_adapter=True)
    before = lora.slot_tensors(1)
    single, between = [], None
    for _ in range(2):  # two steps: the second starts from the first's update (and moments)
        between = lora.slot_tensors(1)
        (batches,) = build_step_batches(make_groups(), True, None, 0, None, 1)
        single.append(train_adapter_step(model, lora, opt, 1, batches, LossConfig(entropy_coef=0.01), 1.0))
    mp.start_processes(_adapter_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1))
    after = lora.slot_tensors(1)
    assert any((after[k] - before[k]).abs().max() > 1e-4 for k in after), "the adapter did not move"
    for k, v in after.items():
        assert (r0["slot"][k] - v).abs().max().item() < 1e-6, k
    for ours, theirs in zip(r0["stats"], single, strict=True):
        for k in ("train/loss", "train/pg_clipfrac", "train/entropy", "train/grad_norm", "train/num_loss_tokens"):
            assert ours[k] == pytest.approx(theirs[k], abs=1e-5), k
        assert ours["train/dp_world_size"] == 2
    assert r1["stats"] == [{}, {}]
    for k, v in between.items():  # it adopted rank 0's adapter as sent for the second step
        assert (r1["slot"][k] - v).abs().max().item() < 1e-6, k
    assert any((between[k] - after[k]).abs().max() > 1e-4 for k in after)


def _idle_rank(rank: int, world: int, port: int, out_dir: str):
    import datetime
    import time

    from services.trainer import parallel

    parallel.COLLECTIVE_TIMEOUT = datetime.timedelta(seconds=2)  # a step's collectives: short here
    commands = parallel.init_group(rank, world, "127.0.0.1", port, "gloo")
    if rank == 0:
        time.sleep(5)  # rank 0 idles past the step timeout (a multi-LoRA service waiting for adapters)
        parallel.send_command(commands, ("train", [b"x"]))
    else:
        torch.save(parallel.next_command(commands), os.path.join(out_dir, "command.pt"))
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()


def test_a_rank_waits_for_the_next_command_while_rank_0_idles(tmp_path):
    """gloo ends a waiting broadcast at its group's timeout: commands go on a group of their own
    with a long one, so the ranks outlive a trainer that has nothing to train for a while."""
    mp.start_processes(_idle_rank, args=(2, free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    assert torch.load(tmp_path / "command.pt") == ("train", [b"x"])


def test_a_rank_that_dies_before_the_group_forms_fails_rank_0_at_once(tmp_path):
    """Rank 1 exits at start (here: its config file does not parse). Rank 0 says so, naming its
    log, within seconds: not after the 300 s rendezvous timeout. Run in a child process, whose
    rendezvous thread may stay blocked until that timeout."""
    import subprocess
    import sys
    import time

    script = rank_dies_script(tmp_path, "")
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))  # fmt: skip
    assert "ERROR: trainer rank 1 exited (code 1) before the data-parallel group formed" in out.stdout, out.stderr[-2000:]
    assert "trainer-rank1.log" in out.stdout
    assert time.monotonic() - t0 < 60


def rank_dies_script(tmp_path, config_kw: str) -> str:
    """A child process's script: rank 0 (DataParallel, RunConfig(trainer_num_ranks=2, <config_kw>))
    whose rank 1 fails at start (its config file does not parse); it prints "ERROR: <the error>"."""
    return f"""
import torch
from pathlib import Path
from services.common.config import RunConfig
from services.trainer.ranks import DataParallel
from tests.unit.test_trainer_core import tiny_model
model = tiny_model()
bad = Path({str(tmp_path)!r}) / "trainer-config.json"
bad.write_text("not json")
(Path({str(tmp_path)!r}) / "logs").mkdir()
try:
    DataParallel(RunConfig(trainer_num_ranks=2, {config_kw}), model, torch.optim.AdamW(model.parameters()), None, 0,
                 bad, Path({str(tmp_path)!r}) / "logs")
except RuntimeError as e:
    print("ERROR:", e, flush=True)
"""
