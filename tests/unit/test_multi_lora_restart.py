"""The multi-LoRA trainer restarted while an adapter is retiring (a DELETE, or its budget, while
it was down): it resumes that adapter from its partition's committed step before the last save,
as it resumes an active one, so the trainer's records, its saved weights and the buffer's
ledger (which records the leases of steps never committed `retired`) agree.

The trainer runs against a stand-in for its service (the buffer's and the registry's answers),
on a small real model and real PEFT directories."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest
import torch

from asyncrl_proto import AdapterControl, AdapterControlReply, BufferCommit, BufferCommitReply, BufferGetReply
from asyncrl_proto.messages import NO_PARTITION_ERROR, AdapterRun, AdapterSpec, AdapterState
from asyncrl_proto.subjects import Subjects
from services.common.config import RunConfig
from services.common.validate import Limits
from services.model.llama import CausalLM, ModelConfig
from services.model.lora import ATTENTION, LoraSpec, MultiLora, load_adapter, save_adapter
from services.trainer.adapter_push import adapter_dir
from services.trainer.loop import TrainLoop
from services.trainer.multi_lora import AdapterTraining
from services.trainer.setup import loss_config
from services.trainer.steps import BufferLink, Records, SampleCheck, SampleRecorder

RID = "0123456789abcdef0123456789abcdef"


class Service:
    """What the trainer asks of its service: config, model, bus, and request/reply."""

    def __init__(self, config, committed_step: int, run: AdapterRun):
        self.config, self.committed_step, self.run = config, committed_step, run
        self.metrics_path = Path(config.infra.run_dir) / "metrics.jsonl"
        self.stopping = False
        self.model = CausalLM(ModelConfig(vocab_size=16, hidden_size=32, intermediate_size=48, num_hidden_layers=1,
                                          num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16))  # fmt: skip
        self.published: list = []
        self.commits: list[int] = []
        self.controls: list[str] = []

        async def publish(subject, msg, msg_id=None):
            self.published.append(msg)

        self.bus = SimpleNamespace(subjects=Subjects(run_id="t"), publish=publish)

    async def _request(self, subject, req, reply_type, what):
        if isinstance(req, BufferCommit):
            self.commits.append(req.step)
            return BufferCommitReply(step=req.step)
        if isinstance(req, AdapterControl):
            self.controls.append(req.op)
            state = {"activate": AdapterState.ACTIVE, "cleanup": AdapterState.CLEANUP,
                     "complete": AdapterState.COMPLETED}[req.op]  # fmt: skip
            self.run = msgspec.structs.replace(self.run, state=state)
            return AdapterControlReply(ok=True, run=self.run)
        return BufferGetReply(step=req.step, error=f"step {req.step} is already committed",
                              committed_step=self.committed_step)  # fmt: skip


class Link(BufferLink):
    """The buffer's and the registry's answers: the stand-in service's."""

    def __init__(self, svc):
        self.svc = svc

    async def request(self, subject, msg, reply_type, what):
        return await self.svc._request(subject, msg, reply_type, what)


def trainer_of(svc) -> AdapterTraining:
    svc.link, svc.records, svc.loss_cfg = Link(svc), Records(svc.metrics_path, None, svc.bus), loss_config(svc.config)
    svc.check, svc.pad_id = SampleCheck(Limits(n=2, vocab_size=16, context_length=16), svc.loss_cfg), 0
    return AdapterTraining(svc)


def setup_run(tmp_path, versions: list[int], complete: set[int], trained_steps: int, reported: int):
    """An adapter retiring after a restart: versions v0.. of it on disk (B = the version number,
    so a save tells which version it holds), its trained.jsonl with steps 0..trained_steps-1."""
    cfg = RunConfig(run_dir=str(tmp_path / "run"), multi_lora_n_adapters=1, multi_lora_max_rank=4,
                    hf_checkpoint=str(tmp_path))  # fmt: skip
    spec = AdapterSpec(data=str(tmp_path / "gone.jsonl"), rank=2, alpha=2.0, rollout_batch_size=2,
                       n_samples_per_prompt=2, save=str(tmp_path / "save"), rm_type="reverse-digits", num_step=9)  # fmt: skip
    run = AdapterRun(name="rev", registration_id=RID, slot=0, state=AdapterState.RETIRING, spec=spec, step=reported)
    svc = Service(cfg, committed_step=1, run=run)
    lora = MultiLora(svc.model, n_slots=1, max_rank=4)
    lora.init_slot(0, LoraSpec(rank=2, alpha=2.0, target_modules=ATTENTION), seed=0)
    for v in versions:
        with torch.no_grad():
            for b in lora.B.values():
                b[0].fill_(float(v))
        out = save_adapter(lora, 0, adapter_dir(cfg.infra.run_dir, "rev", RID, v))
        if v not in complete:
            (out / ".complete").unlink()
    trained = adapter_dir(cfg.infra.run_dir, "rev", RID, 0).parent / "trained.jsonl"
    trained.parent.mkdir(parents=True, exist_ok=True)
    trained.write_text("".join(json.dumps({"step": k, "groups": [f"g{2 * k}-a0", f"g{2 * k + 1}-a0"]}) + "\n"
                               for k in range(trained_steps)))  # fmt: skip
    return svc, trained


def saved_version(path) -> float:
    _, tensors = load_adapter(path)
    return next(v for k, v in tensors.items() if k.endswith("lora_B.weight"))[0, 0].item()


def test_a_step_published_before_the_kill_is_committed_and_kept(tmp_path):
    # step 2 was trained, reported (registry step 3) and published (v3), not committed
    svc, trained = setup_run(tmp_path, [0, 1, 2, 3], {0, 1, 2, 3}, trained_steps=3, reported=3)
    trainer = trainer_of(svc)
    assert not any(p.requires_grad for p in svc.model.parameters()), "the adapter mode freezes the base it trains on"
    asyncio.run(trainer._follow(svc.run))
    assert svc.commits == [2] and svc.controls == ["cleanup", "complete"]
    assert [json.loads(x)["step"] for x in trained.read_text().splitlines()] == [0, 1, 2]
    assert saved_version(tmp_path / "save" / "step_3") == pytest.approx(3.0)  # the weights that step made
    assert svc.published[-1].version == 3  # announced again: a kill may have cut it


def test_a_step_trained_but_never_published_is_dropped(tmp_path):
    # step 2 was trained and recorded, its version v3 never completed: the ledger will retire its
    # groups, so the trainer's records and its last save drop it too
    svc, trained = setup_run(tmp_path, [0, 1, 2, 3], {0, 1, 2}, trained_steps=3, reported=2)
    trainer = trainer_of(svc)
    asyncio.run(trainer._follow(svc.run))
    assert svc.commits == [] and svc.controls == ["cleanup", "complete"]
    assert [json.loads(x)["step"] for x in trained.read_text().splitlines()] == [0, 1]
    assert saved_version(tmp_path / "save" / "step_2") == pytest.approx(2.0)


def test_old_adapter_versions_are_removed_but_those_the_engines_may_be_loading(tmp_path):
    """A long adapter run does not fill the disk: after each commit its versions beyond the
    newest --keep-weight-snapshots go, except the engines' live version of it (a restarted engine
    reloads it), those newer, and the one behind the committed step."""
    from asyncrl_proto import AdapterLive
    from services.trainer.multi_lora import Track

    svc, _ = setup_run(tmp_path, list(range(10)), set(range(10)), trained_steps=9, reported=9)
    live = {"version": 5}

    async def kv_get(key, kind):
        assert key == "adapter_live.rev" and kind is AdapterLive
        return AdapterLive(name="rev", registration_id=RID, version=live["version"], engine_name="x")

    svc.bus.kv_get = kv_get
    trainer = trainer_of(svc)
    t = Track(run=svc.run, total=9, step=9)
    d = adapter_dir(svc.config.infra.run_dir, "rev", RID, 0).parent

    def left() -> list[int]:
        return sorted(int(p.name[1:]) for p in d.glob("v*"))

    asyncio.run(trainer._retain(t))
    assert left() == [5, 6, 7, 8, 9]  # keep 3; v6, newer than the live v5 (weight-sync may be loading it); v5
    live["version"] = 9
    asyncio.run(trainer._retain(t))
    assert left() == [7, 8, 9]


def test_a_final_save_that_fails_still_frees_the_slot(tmp_path):
    """A save directory the trainer cannot write (a tenant named a file, or the disk is full): the
    adapter completes all the same, its newest version named in the log; the trainer does not
    fail on it again at every restart."""
    svc, _ = setup_run(tmp_path, [0, 1, 2], {0, 1, 2}, trained_steps=2, reported=2)
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    svc.run = msgspec.structs.replace(svc.run, spec=msgspec.structs.replace(svc.run.spec, save=str(blocker)))
    trainer = trainer_of(svc)
    asyncio.run(trainer._follow(svc.run))
    assert svc.controls == ["cleanup", "complete"] and svc.run.state is AdapterState.COMPLETED
    assert blocker.read_text() == "not a directory"


def test_buffer_trouble_restarts_the_trainer_and_never_retires_an_adapter(tmp_path):
    """The buffer away past --buffer-timeout-s is the trainer's trouble, not the adapter's: it
    fails (and is restarted) with the adapter still active."""
    from services.trainer.setup import TrainerError

    svc, _ = setup_run(tmp_path, [0, 1], {0, 1}, trained_steps=1, reported=1)
    svc.run = msgspec.structs.replace(svc.run, state=AdapterState.ACTIVE)

    async def away(subject, req, reply_type, what):
        if isinstance(req, AdapterControl):
            svc.controls.append(req.op)
        raise TrainerError(f"buffer did not answer {what}")

    svc._request = away
    with pytest.raises(TrainerError):
        asyncio.run(trainer_of(svc)._follow(svc.run))
    assert svc.controls == []


def test_a_request_the_registry_could_not_store_is_asked_again_never_retiring_the_adapter(tmp_path, monkeypatch):
    """The registry answers `retry` (its KV write failed: the broker away). The trainer asks
    again; past --buffer-timeout-s it fails (and is restarted), the adapter never retired."""
    from services.trainer import multi_lora
    from services.trainer.setup import TrainerError

    monkeypatch.setattr(multi_lora, "CONTROL_RETRY_S", 0.0)
    svc, _ = setup_run(tmp_path, [0, 1], {0, 1}, trained_steps=1, reported=1)
    svc.run = msgspec.structs.replace(svc.run, state=AdapterState.ACTIVE)
    answers = [AdapterControlReply(ok=False, error="the registry could not store its state", retry=True)] * 2

    async def request(subject, req, reply_type, what):
        svc.controls.append(req.op)
        return answers.pop(0) if answers else AdapterControlReply(ok=True, run=svc.run)

    svc._request = request
    trainer = trainer_of(svc)
    assert asyncio.run(trainer._control("stepped", svc.run, step=2)) == svc.run  # the third answer
    assert svc.controls == ["stepped"] * 3

    svc.config = svc.config.model_copy(update={"buffer_timeout_s": 0.0})
    trainer = trainer_of(svc)
    answers[:] = [AdapterControlReply(ok=False, error="the registry could not store its state", retry=True)] * 100
    with pytest.raises(TrainerError, match="could not store stepped of adapter 'rev'"):
        asyncio.run(trainer._control("stepped", svc.run, step=2))
    # a refusal is not asked again: the adapter's own trouble
    answers[:] = [AdapterControlReply(ok=False, error="only an active adapter takes steps")]
    svc.controls.clear()
    with pytest.raises(multi_lora.MultiLoraError, match="refused stepped"):
        asyncio.run(trainer._control("stepped", svc.run, step=2))
    assert svc.controls == ["stepped"]


def test_a_name_registered_again_continues_the_step_count_of_the_save_it_starts_from(tmp_path):
    """An earlier registration of the name saved step_5. The new one starts from it, trains 2
    steps and saves step_7: its newest save is the one with the most steps even when it trains
    fewer steps than the earlier one did (a save named step_2 would have lost to step_5)."""
    from services.trainer.multi_lora import _latest_save

    svc, _ = setup_run(tmp_path, [], set(), trained_steps=0, reported=0)
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"p{i}", "label": "x"}) + "\n" for i in range(8)))
    spec = msgspec.structs.replace(svc.run.spec, data=str(data))
    svc.run = msgspec.structs.replace(svc.run, state=AdapterState.PENDING, spec=spec, step=0)
    earlier = MultiLora(svc.model, n_slots=1, max_rank=4)
    earlier.init_slot(0, LoraSpec(rank=2, alpha=2.0, target_modules=ATTENTION), seed=0)
    save_adapter(earlier, 0, tmp_path / "save" / "step_5")

    trainer = trainer_of(svc)
    asyncio.run(trainer._activate(svc.run))
    t = trainer.tracks[RID]
    assert (t.base, t.step, svc.controls) == (5, 0, ["activate"])
    assert trainer_of(svc)._track(svc.run, 0).base == 5  # a restarted trainer finds it again
    t.step = 2
    svc.run = msgspec.structs.replace(svc.run, state=AdapterState.RETIRING)
    asyncio.run(trainer._retire(svc.run))
    assert _latest_save(tmp_path / "save") == tmp_path / "save" / "step_7"
    assert svc.run.state is AdapterState.COMPLETED


def test_a_retiring_adapter_whose_partition_never_opens_saves_under_its_full_step_count(tmp_path):
    """A name registered again from its save step_5 trained 2 versions; the trainer restarts and
    finds it retiring with its partition unopenable: its final save is step_7 (base + step), not
    step_2, which would lose to step_5 as the name's newest save."""
    from services.trainer.multi_lora import _latest_save

    svc, _ = setup_run(tmp_path, [0, 1, 2], {0, 1, 2}, trained_steps=2, reported=2)
    (adapter_dir(svc.config.infra.run_dir, "rev", RID, 0).parent / "base_step").write_text("5\n")
    svc.config = svc.config.model_copy(update={"buffer_timeout_s": 0.0})
    answer = svc._request

    async def no_partition(subject, req, reply_type, what):
        if isinstance(req, AdapterControl):
            return await answer(subject, req, reply_type, what)
        return BufferGetReply(step=req.step, error=f"adapter {RID} {NO_PARTITION_ERROR}")

    svc._request = no_partition
    asyncio.run(trainer_of(svc)._retire(svc.run))
    assert _latest_save(tmp_path / "save") == tmp_path / "save" / "step_7"
    assert saved_version(tmp_path / "save" / "step_7") == 2.0  # its newest version
    assert svc.controls == ["cleanup", "complete"]


@pytest.mark.parametrize("service_mode", [True, False])
def test_every_adapter_completed_ends_the_run_unless_in_service_mode(tmp_path, service_mode):
    """--multi-lora-service-mode: with every adapter completed the trainer keeps polling the
    registry (--multi-lora-idle-poll-s) for the next one; without it, the run ends."""
    from asyncrl_proto import AdapterRegistryState

    svc, _ = setup_run(tmp_path, [], set(), trained_steps=0, reported=0)
    svc.config = svc.config.model_copy(update={"multi_lora_service_mode": service_mode, "multi_lora_idle_poll_s": 7.0})
    trainer = trainer_of(svc)
    done = msgspec.structs.replace(svc.run, state=AdapterState.COMPLETED)
    reads, waits, finished = [], [], []

    async def read_registry():
        reads.append(1)
        svc.stopping = len(reads) >= 3
        return AdapterRegistryState(runs=[done])

    async def wait_stopped(s):
        waits.append(s)

    async def finish(error=None):
        finished.append(1)

    trainer._read_registry, svc.wait_stopped, trainer.finish = read_registry, wait_stopped, finish
    asyncio.run(TrainLoop(trainer, svc.records, SampleRecorder(str(tmp_path), None, keep=0), lifecycle=svc).run())
    if service_mode:
        assert (len(reads), waits, finished) == (3, [7.0] * 3, [])
    else:
        assert (len(reads), waits, finished) == (1, [], [1])
