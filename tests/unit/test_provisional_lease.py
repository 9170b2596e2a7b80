"""Provisional leases on the trainer's side: the update waits for the durable lease, and a
durable lease that differs from the provisional one leaves the weights untouched."""

from __future__ import annotations

import asyncio

import pytest
import torch

from asyncrl_proto import BufferGetReply, GroupRef, encode
from services.api import Sample
from services.trainer import service as trainer_service
from services.trainer.core import LossConfig, build_train_batch, train_step
from tests.unit.test_trainer_core import tiny_model


def _batch():
    group = [Sample(index=i, group_index=0, tokens=[1, 5, 6, 2], response_length=2, reward=float(i),
                    rollout_log_probs=[-1.0, -1.0]) for i in range(2)]  # fmt: skip
    return build_train_batch([group], True, None, 0)


def test_the_update_waits_for_the_gate_and_a_failing_gate_changes_nothing():
    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    seen = {}

    def refuse():
        seen["grads"] = all(p.grad is not None for p in model.parameters() if p.requires_grad)
        raise trainer_service.LeaseChanged("lease changed")

    with pytest.raises(trainer_service.LeaseChanged):
        train_step(model, opt, _batch(), LossConfig(), clip_grad=1.0, before_update=refuse)
    assert seen["grads"]  # the gate runs after the backward passes ...
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))  # ... before the update
    assert not opt.state
    calls = []
    train_step(model, opt, _batch(), LossConfig(), clip_grad=1.0, before_update=lambda: calls.append(1))
    assert calls == [1] and not all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


class _Inbox:
    def __init__(self):
        self.done_tokens = []

    def done(self, token):
        self.done_tokens.append(token)


def _trainer():
    t = trainer_service.TrainerService.__new__(trainer_service.TrainerService)
    t.inbox = _Inbox()
    return t


def _reply(ids, durable=True):
    refs = [GroupRef(group_id=g, group_index=i, stream_seq=i + 1) for i, g in enumerate(ids)]
    return encode(BufferGetReply(step=3, refs=refs, complete=True, durable=durable))


async def test_confirm_accepts_the_same_lease_and_rejects_another():
    t = _trainer()
    answers = asyncio.Queue()
    answers.put_nowait(_reply(["g1-a0", "g2-a0"]))
    await t._confirm(3, None, "tok", answers, ["g1-a0", "g2-a0"])
    assert t.inbox.done_tokens == ["tok"]
    answers.put_nowait(_reply(["g1-a0", "g7-a0"]))
    with pytest.raises(trainer_service.LeaseChanged, match="step 3"):
        await t._confirm(3, None, "tok2", answers, ["g1-a0", "g2-a0"])


async def test_confirm_asks_again_when_the_durable_answer_never_comes(monkeypatch):
    """The buffer died between its provisional answer and its ledger append: the trainer asks
    the restarted buffer, which answers from its ledger."""
    t = _trainer()
    monkeypatch.setattr(trainer_service, "CONFIRM_WAIT_S", 0.05)
    asked = []

    async def lease(step, lookahead, provisional):
        asked.append((step, provisional))
        return trainer_service.decode(_reply(["g1-a0", "g2-a0"]), BufferGetReply), None

    t._lease = lease
    await t._confirm(3, None, "tok", asyncio.Queue(), ["g1-a0", "g2-a0"])
    assert asked == [(3, False)]
