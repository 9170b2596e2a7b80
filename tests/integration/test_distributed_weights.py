"""--update-weight-transfer-mode distributed, over gloo on the CPU: SGLang's
init_weights_update_group / update_weights_from_distributed on the built-in engine against a rank
0 in the test; then the trainer's sender and weight-sync's updater over a real nats-server with
one identity per role, updating two engines at once."""

from __future__ import annotations

import asyncio
import threading
import time

import httpx
import nats.errors
import pytest
import torch

from asyncrl_proto import TransferReply, TransferRequest
from services.common.procs import free_port
from services.common.sglang_client import EngineError, SGLangClient
from services.model.hf_io import hf_state, save_model
from services.model.transfer import TransferGroup, digest, manifest, open_store
from services.trainer.transfer import WeightSender
from services.weightsync.distributed import DistributedUpdater, TransferFailed
from tests.conftest import EngineThread, connect_role, perturbed_model

PROMPT = {"input_ids": [1, 5, 6, 7], "sampling_params": {"max_new_tokens": 6, "temperature": 0}}


class Rank0:
    """The trainer's end, in a thread: joins the group, then broadcasts what it is given."""

    def __init__(self, world: int):
        self.store = open_store("127.0.0.1", 0, world, True)
        self.port = self.store.port
        self.group: TransferGroup | None = None
        self._t = threading.Thread(target=self._join, args=(world,), daemon=True)
        self._t.start()

    def _join(self, world):
        self.group = TransferGroup("g", "gloo", "127.0.0.1", self.port, 0, world, timeout_s=20, store=self.store)

    def joined(self) -> TransferGroup:
        self._t.join(30)
        assert self.group is not None
        return self.group

    async def send(self, tensors):
        await asyncio.to_thread(lambda: [self.group.broadcast(t.contiguous()) for t in tensors])


async def greedy(url: str) -> list[int]:
    async with httpx.AsyncClient(base_url=url, timeout=60) as http:
        r = await http.post("/generate", json=PROMPT)
        assert r.status_code == 200, r.text
        return r.json()["output_ids"]


async def test_the_engine_receives_a_whole_checked_version_by_broadcast(tiny_model_dir, tmp_path):
    new = perturbed_model(tiny_model_dir, 3)
    state = hf_state(new)
    names, dtypes, shapes = manifest(state)
    save_model(new, tmp_path / "v7", tiny_model_dir)
    half = len(names) // 2
    with EngineThread(tiny_model_dir) as eng:
        async with httpx.AsyncClient(base_url=eng.url, timeout=60) as http:
            before = await greedy(eng.url)
            # every field is checked before anything is received
            for bad, why in [({"backend": "nccl"}, "needs a GPU"), ({"rank_offset": 0}, "rank_offset"),
                             ({"master_port": "x"}, "master_port must be")]:  # fmt: skip
                body = {"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2,
                        "group_name": "g", "backend": "gloo", **bad}  # fmt: skip
                r = await http.post("/init_weights_update_group", json=body)
                assert r.status_code == 400 and why in r.text, r.text
            t0 = time.monotonic()  # a dead master: refused at once (it used to take 40 s to answer)
            r = await http.post("/init_weights_update_group", json={
                "master_address": "127.0.0.1", "master_port": free_port(), "rank_offset": 1, "world_size": 2,
                "group_name": "g", "backend": "gloo"})  # fmt: skip
            assert r.status_code == 400 and "cannot reach the group's master" in r.text, r.text
            assert time.monotonic() - t0 < 6
            rank0 = Rank0(world=2)
            r = await http.post("/init_weights_update_group", json={
                "master_address": "127.0.0.1", "master_port": rank0.port, "rank_offset": 1, "world_size": 2,
                "group_name": "g", "backend": "gloo"})  # fmt: skip
            assert r.status_code == 200 and r.json()["success"], r.text
            rank0.joined()
            for bad, why in [({"names": ["nope"] + names[1:]}, "not a parameter"),
                             ({"shapes": [[1]] + shapes[1:]}, "has shape"), ({"dtypes": ["int8"] + dtypes[1:]}, "dtype"),
                             ({"group_name": "other"}, "no weight update group"), ({"names": names[:1]}, "one length")]:  # fmt: skip
                body = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": "g", **bad}
                r = await http.post("/update_weights_from_distributed", json=body)
                assert r.status_code == 400 and why in r.text, (bad, r.text)

            async def bucket(lo, hi, version="7", sha=None, stage=False):
                body = {"names": names[lo:hi], "dtypes": dtypes[lo:hi], "shapes": shapes[lo:hi], "group_name": "g",
                        "weight_version": version, "flush_cache": False, "weight_digest": sha or digest(state),
                        "stage": stage}  # fmt: skip
                r, _ = await asyncio.gather(http.post("/update_weights_from_distributed", json=body),
                                            rank0.send([state[n] for n in names[lo:hi]]))  # fmt: skip
                return r

            await http.post("/pause_generation", json={"mode": "retract"})
            r = await bucket(0, half)
            assert r.status_code == 200 and "still to come" in r.text, r.text
            assert eng.scheduler.weight_version == "0"  # half a version is never swapped in
            r = await bucket(half, len(names))
            await http.post("/continue_generation")
            assert r.status_code == 200 and "Weight version updated to 7" in r.text, r.text
            assert eng.scheduler.weight_version == "7"
            after = await greedy(eng.url)
            # staged: received beside the running weights, swapped in by update_weight_version
            r = await bucket(0, len(names), version="9", stage=True)
            assert r.status_code == 200 and "Staged weight version 9" in r.text, r.text
            assert eng.scheduler.weight_version == "7" and await greedy(eng.url) == after
            r = await http.post("/update_weight_version", json={"new_version": "9", "abort_all_requests": False})
            assert r.status_code == 200 and r.json()["staged"] is True and eng.scheduler.weight_version == "9"
            assert await greedy(eng.url) == after  # the same tensors under a new name
            # tensors that are not the announced ones are received and refused: the weights stay
            r = await bucket(0, len(names), version="8", sha="0" * 64)
            assert r.status_code == 400 and "differs from the announced" in r.text, r.text
            assert eng.scheduler.weight_version == "9" and await greedy(eng.url) == after
            r = await http.post("/destroy_weights_update_group", json={"group_name": "g"})
            assert r.status_code == 200, r.text
            r = await http.post("/destroy_weights_update_group", json={"group_name": "g"})
            assert r.status_code == 400
    with EngineThread(tmp_path / "v7") as fresh:  # exactly the trainer's weights: a fresh load agrees
        assert await greedy(fresh.url) == after
    assert after != before


@pytest.fixture(scope="module")
def server(role_server):
    return role_server


@pytest.mark.parametrize("staged", [True, False], ids=["staged", "in-pause"])
async def test_weight_sync_updates_every_engine_from_the_trainer(server, tiny_model_dir, tmp_path, staged):
    """Staged (built-in engines): received while generating, swapped inside the pause. In-pause
    (engines without staged loading, as SGLang servers): received inside the pause."""
    admin, trainer_bus, sync_bus, producer = [
        await connect_role(server, r) for r in ("admin", "trainer", "weight-sync", "rollout")
    ]
    model = perturbed_model(tiny_model_dir, 11)
    sender = WeightSender(model, tmp_path / "weights", "127.0.0.1", "gloo")
    try:
        await admin.ensure_streams()
        await trainer_bus.subscribe(trainer_bus.subjects.weights_transfer, sender.on_request)
        await trainer_bus.flush()
        # a producer's identity can neither ask the trainer for weights nor see its answers
        with pytest.raises((nats.errors.Error, TimeoutError)):
            await producer.request(producer.subjects.weights_transfer,
                                   TransferRequest(op="join", group_name="x", world_size=2), TransferReply, timeout=1)  # fmt: skip
        sha = await asyncio.to_thread(sender.hold, 1)
        save_model(model, tmp_path / "v1", tiny_model_dir)
        with EngineThread(tiny_model_dir, staged_loading=staged) as e1, \
                EngineThread(tiny_model_dir, staged_loading=staged) as e2:
            client = SGLangClient([e1.url, e2.url])
            pauses = []
            updater = DistributedUpdater(sync_bus, client, "run", 64 * 1024, "retract", on_pause=lambda seconds, url: pauses.append(seconds))
            try:
                assert await updater.update(1, sha) is True
                assert len(pauses) == 2 and updater.num_groups_formed == 1
                assert e1.scheduler.weight_version == e2.scheduler.weight_version == "1"
                assert sender.num_sends == 1
                assert e1.scheduler.stats.num_staged_swaps_total == (1 if staged else 0)
                with EngineThread(tmp_path / "v1") as fresh:
                    expected = await greedy(fresh.url)
                assert await greedy(e1.url) == await greedy(e2.url) == expected
                # the next version rides the same group; one the trainer no longer has is skipped
                with torch.no_grad():
                    next(model.parameters()).add_(0.1)
                sha2 = await asyncio.to_thread(sender.hold, 2)
                assert await updater.update(2, sha2) is True and updater.num_groups_formed == 1
                assert e1.scheduler.weight_version == "2"
                assert await updater.update(1, sha) is False  # neither held nor on disk under weights/
                # an announced digest the trainer's tensors do not have: refused, the group left
                with pytest.raises((TransferFailed, EngineError)):
                    await updater.update(2, "f" * 64)
                assert updater.join is None and e1.scheduler.weight_version == "2"
                assert await updater.update(2, sha2) is True and updater.num_groups_formed == 2  # formed again
                if not staged:
                    await cut_off_mid_broadcast(updater, sender, model, e1, e2)
            finally:
                await updater.leave()
                await client.close()
    finally:
        await sender.stop()
        for b in (admin, trainer_bus, sync_bus, producer):
            await b.close()


async def cut_off_mid_broadcast(updater, sender, model, *engines):
    """Engines that weight-sync takes for SGLang servers (no asyncrl extensions: they load each
    bucket as it comes, inside the pause): a broadcast cut off after half the tensors leaves every
    one paused and named `loading-<N>`, never generating from a mixture under a version's name;
    the next complete broadcast continues them."""
    for e in engines:
        updater.client._flags[e.url]["weight_digest_check"] = False
    with torch.no_grad():
        next(model.parameters()).add_(0.1)
    sha3 = await asyncio.to_thread(sender.hold, 3)
    whole = WeightSender._broadcast

    def half(group, state):
        for t in list(state.values())[: len(state) // 2]:
            group.broadcast(t.contiguous())
        raise RuntimeError("the trainer went away mid-broadcast")

    sender._broadcast = half
    with pytest.raises((TransferFailed, EngineError)):
        await updater.update(3, sha3)
    for e in engines:
        assert e.scheduler.paused_mode is not None and e.scheduler.weight_version == "loading-3"
    sender._broadcast = whole
    assert await updater.update(3, sha3) is True
    for e in engines:
        assert e.scheduler.paused_mode is None and e.scheduler.weight_version == "3"
    assert updater.num_groups_formed == 3  # formed again after the cut-off
