"""Multi-LoRA training steps: each adapter steps on its own data only, exactly as if it were
trained alone; the base model and the other adapters never move."""

from __future__ import annotations

import copy

import pytest
import torch

from asyncrl_proto.messages import Sample
from services.model.llama import CausalLM, ModelConfig
from services.model.lora import LoraSpec, MultiLora, SlotAdamW
from services.trainer.adapters import train_adapter_step
from services.trainer.core import LossConfig, make_batch


def base_model() -> CausalLM:
    cfg = ModelConfig(vocab_size=24, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32)  # fmt: skip
    m = CausalLM(cfg)
    m.init_weights(0)
    for p in m.parameters():
        p.requires_grad_(False)
    return m


def batch(seed: int, n: int = 4, advantages=None):
    g = torch.Generator().manual_seed(seed)
    items = []
    for i in range(n):
        tokens = torch.randint(3, 24, (9,), generator=g).tolist()
        s = Sample(tokens=tokens, response_length=5, rollout_log_probs=(-torch.rand(5, generator=g) - 1).tolist())
        adv = advantages[i] if advantages is not None else float(torch.randn(1, generator=g))
        items.append((s, adv))
    return make_batch(items, pad_id=0)


def train_adapters(model, lora, optimizer, per_slot: dict, cfg: LossConfig, clip_grad: float) -> dict:
    """A step for every adapter with a batch, one at a time, as the trainer's adapter mode takes them."""
    steps = sorted(per_slot.items())
    return {slot: train_adapter_step(model, lora, optimizer, slot, batches, cfg, clip_grad) for slot, batches in steps}


def with_adapters(model, n_slots, specs):
    lora = MultiLora(model, n_slots=n_slots, max_rank=8)
    for slot, (spec, seed) in specs.items():
        lora.init_slot(slot, spec, seed)
        with torch.no_grad():  # B non-zero, so that A gets gradients too
            for key in lora.B:
                lora.B[key][slot, :, : spec.rank] = torch.randn(lora.B[key].shape[1], spec.rank,
                                                                generator=torch.Generator().manual_seed(seed)) * 0.1  # fmt: skip
    return lora


SPEC_A, SPEC_B = LoraSpec(rank=4, alpha=8.0), LoraSpec(rank=8, alpha=8.0, target_modules=("q_proj", "down_proj"))


def test_each_adapter_steps_as_if_trained_alone():
    cfg = LossConfig()
    model = base_model()
    base_before = copy.deepcopy(model.state_dict())
    lora = with_adapters(model, 3, {0: (SPEC_A, 1), 2: (SPEC_B, 2)})
    opt = SlotAdamW(lora, lr=1e-2)
    stats = train_adapters(model, lora, opt, {0: [batch(10)], 2: [batch(20), batch(21)]}, cfg, clip_grad=1.0)
    assert set(stats) == {0, 2} and all(s["train/nonfinite_skipped"] == 0 for s in stats.values())
    for slot, spec, seed, data in ((0, SPEC_A, 1, [batch(10)]), (2, SPEC_B, 2, [batch(20), batch(21)])):
        alone_model = base_model()
        alone = with_adapters(alone_model, 1, {0: (spec, seed)})
        train_adapters(alone_model, alone, SlotAdamW(alone, lr=1e-2), {0: data}, cfg, clip_grad=1.0)
        for key in lora.A:
            torch.testing.assert_close(lora.A[key][slot], alone.A[key][0], atol=1e-6, rtol=1e-5)
            torch.testing.assert_close(lora.B[key][slot], alone.B[key][0], atol=1e-6, rtol=1e-5)
    assert all(torch.equal(v, base_before[k]) for k, v in model.state_dict().items()), "the base never moves"
    assert opt.steps == [1, 0, 1]


def test_an_adapter_without_a_complete_batch_is_untouched():
    model = base_model()
    lora = with_adapters(model, 2, {0: (SPEC_A, 1), 1: (SPEC_A, 3)})
    opt = SlotAdamW(lora, lr=1e-2)
    train_adapters(model, lora, opt, {0: [batch(1)]}, LossConfig(), clip_grad=0.0)
    before = {k: v[1].clone() for k, v in lora.state_dict().items() if k != "scale"}
    train_adapters(model, lora, opt, {0: [batch(2)]}, LossConfig(), clip_grad=0.0)
    assert all(torch.equal(lora.state_dict()[k][1], v) for k, v in before.items())
    assert opt.steps == [2, 0] and all(m[1].abs().sum() == 0 for m in opt.m)


def test_a_non_finite_adapter_is_skipped_alone_and_clipping_is_per_adapter():
    model = base_model()
    lora = with_adapters(model, 2, {0: (SPEC_A, 1), 1: (SPEC_A, 3)})
    opt = SlotAdamW(lora, lr=1e-2)
    a_before = {k: v[0].clone() for k, v in lora.A.items()}
    stats = train_adapters(model, lora, opt, {0: [batch(1, advantages=[float("nan")] * 4)], 1: [batch(2)]},
                           LossConfig(), clip_grad=1e-3)  # fmt: skip
    assert stats[0]["train/nonfinite_skipped"] == 1 and stats[1]["train/nonfinite_skipped"] == 0
    assert all(torch.equal(lora.A[k][0], v) for k, v in a_before.items())
    assert opt.steps == [0, 1]
    assert stats[1]["train/grad_norm"] > 1e-3  # reported before clipping; the step used the clipped gradient


def test_the_kl_reference_of_an_adapter_is_the_frozen_base():
    """--kl-coef in multi-LoRA: KL(adapter || base). Zero for an adapter that is still the base
    (B = 0); positive once it differs, and it changes the loss."""
    cfg = LossConfig(kl_coef=0.5)
    model = base_model()
    fresh = MultiLora(model, n_slots=2, max_rank=8)
    fresh.init_slot(1, SPEC_A, seed=1)
    stats = train_adapters(model, fresh, SlotAdamW(fresh, lr=1e-2), {1: [batch(10)]}, cfg, clip_grad=1.0)
    assert stats[1]["train/kl_loss"] == pytest.approx(0.0, abs=1e-7)
    results = {}
    for name, loss_cfg in (("kl", cfg), ("none", LossConfig())):
        model = base_model()
        lora = with_adapters(model, 2, {1: (SPEC_A, 1)})  # the same adapter, B != 0, in both
        results[name] = train_adapters(model, lora, SlotAdamW(lora, lr=1e-2), {1: [batch(10)]}, loss_cfg,
                                       clip_grad=0.0)[1]  # fmt: skip
    assert results["kl"]["train/kl_loss"] > 1e-6
    assert results["kl"]["train/loss"] == pytest.approx(results["none"]["train/loss"] + 0.5 * results["kl"]["train/kl_loss"],
                                                        rel=1e-5)  # fmt: skip
