"""Multi-LoRA on the built-in model: each row its own adapter, checked against the adapter merged
into the base weights; per-slot gradients and AdamW; the PEFT directory format."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from services.model.llama import CausalLM, KVCache, ModelConfig
from services.model.lora import (
    ATTENTION,
    TARGETS,
    LoraError,
    LoraSpec,
    MultiLora,
    SlotAdamW,
    load_adapter,
    peft_key,
    save_adapter,
)


def tiny_model(seed: int = 0) -> CausalLM:
    cfg = ModelConfig(vocab_size=32, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)  # fmt: skip
    m = CausalLM(cfg)
    m.init_weights(seed)
    return m.eval()


def randomize(lora: MultiLora, slot: int, spec: LoraSpec, seed: int) -> None:
    """An adapter with B non-zero too (a fresh one equals the base model)."""
    lora.init_slot(slot, spec, seed)
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for key in lora.B:
            lora.B[key][slot, :, : spec.rank] = torch.randn(lora.B[key].shape[1], spec.rank, generator=g) * 0.3


def merged(model: CausalLM, lora: MultiLora, slot: int) -> CausalLM:
    """A plain copy of the base model with the slot's adapter folded into its weights."""
    out = copy.deepcopy(model)
    for mod in out.modules():
        mod._forward_hooks.clear()  # the copy carries no adapter hooks
    spec = lora.specs[slot]
    with torch.no_grad():
        for i, layer in enumerate(out.model.layers):
            for name in spec.target_modules:
                lin = getattr(layer.self_attn if name in ATTENTION else layer.mlp, name)
                key = f"l{i}_{name}"
                lin.weight += spec.scale * lora.B[key][slot] @ lora.A[key][slot]
    return out


@pytest.fixture
def setup():
    model = tiny_model()
    lora = MultiLora(model, n_slots=3, max_rank=8)
    randomize(lora, 0, LoraSpec(rank=4, alpha=8.0), seed=1)
    randomize(lora, 2, LoraSpec(rank=8, alpha=4.0, target_modules=TARGETS), seed=2)
    return model, lora


def test_each_row_uses_its_own_adapter(setup):
    model, lora = setup
    ids = torch.randint(3, 32, (4, 10), generator=torch.Generator().manual_seed(0))
    rows = [0, -1, 2, 0]
    with torch.no_grad(), lora.rows(rows):
        mixed = model(ids)
    with torch.no_grad():
        plain_base = model(ids)  # outside rows(): the base model
        want = {0: merged(model, lora, 0)(ids), 2: merged(model, lora, 2)(ids), -1: plain_base}
    for i, slot in enumerate(rows):
        torch.testing.assert_close(mixed[i], want[slot][i], atol=1e-5, rtol=1e-5)
    assert not torch.allclose(want[0], plain_base, atol=1e-3), "the adapter must change the output"


def test_a_fresh_adapter_is_the_base_model_and_the_cached_path_agrees(setup):
    model, lora = setup
    lora.init_slot(1, LoraSpec(rank=2, alpha=2.0), seed=5)
    ids = torch.randint(3, 32, (3, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        base = model(ids)
        with lora.rows([1, 1, 1]):
            torch.testing.assert_close(model(ids), base)
        with lora.rows([2, 0, -1]):
            full = model(ids)
            cache = KVCache(model.cfg, 3, 16)
            slots, start = torch.tensor([0, 1, 2]), torch.zeros(3, dtype=torch.long)
            first = model.forward_cached(ids[:, :5], cache, slots, start)
            rest = model.forward_cached(ids[:, 5:], cache, slots, start + 5)
    torch.testing.assert_close(torch.cat([first, rest], dim=1), full, atol=1e-5, rtol=1e-5)


def test_gradients_reach_only_the_rows_slots_and_adamw_steps_per_slot(setup):
    model, lora = setup
    for p in model.parameters():
        p.requires_grad_(False)
    opt = SlotAdamW(lora, lr=1e-2)
    before = {k: v.detach().clone() for k, v in lora.state_dict().items()}
    ids = torch.randint(3, 32, (2, 6), generator=torch.Generator().manual_seed(2))
    with lora.rows([0, 0]):
        model(ids).logsumexp(-1).mean().backward()
    for p in list(lora.A.values()) + list(lora.B.values()):
        assert p.grad is None or (p.grad[1].abs().sum() == 0 and p.grad[2].abs().sum() == 0)
    assert lora.A["l0_gate_proj"].grad is None, "a module slot 0 does not target does no work for it"
    assert any(p.grad[0].abs().sum() > 0 for p in lora.A.values())
    opt.step([0])
    after = lora.state_dict()
    for k in before:
        if k == "scale":
            continue
        assert torch.equal(after[k][1:], before[k][1:]), f"{k}: other slots must not move"
    assert any(not torch.equal(after[k][0], before[k][0]) for k in before if k != "scale")
    assert opt.steps == [1, 0, 0]
    opt.reset(0)
    assert opt.steps == [0, 0, 0] and all(m[0].abs().sum() == 0 for m in opt.m)


def test_adamw_per_slot_matches_torch_adamw_on_that_slot():
    model = tiny_model()
    lora = MultiLora(model, n_slots=2, max_rank=4, targets=("q_proj",))
    randomize(lora, 1, LoraSpec(rank=4, alpha=4.0, target_modules=("q_proj",)), seed=3)
    ref = {k: torch.nn.Parameter(v.detach()[1].clone()) for k, v in lora.A.items()}
    ref_opt = torch.optim.AdamW(list(ref.values()), lr=1e-2, weight_decay=0.1)
    opt = SlotAdamW(lora, lr=1e-2, weight_decay=0.1)
    g = torch.Generator().manual_seed(4)
    for _ in range(3):
        grads = {k: torch.randn(v.shape[1:], generator=g) for k, v in lora.A.items()}
        for k, p in lora.A.items():
            p.grad = torch.zeros_like(p)
            p.grad[1] = grads[k]
            ref[k].grad = grads[k].clone()
        for p in lora.B.values():
            p.grad = None
        opt.step([1])
        ref_opt.step()
    for k in ref:
        torch.testing.assert_close(lora.A[k][1], ref[k].detach(), atol=1e-6, rtol=1e-5)


def test_peft_directory_round_trip_and_rejections(setup, tmp_path):
    model, lora = setup
    out = save_adapter(lora, 0, tmp_path / "a0", base_model="tiny")
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["r"] == 4 and cfg["lora_alpha"] == 8.0 and cfg["peft_type"] == "LORA"
    assert (out / ".complete").exists()
    spec, tensors = load_adapter(out)
    assert tensors[peft_key(0, "q_proj", "A")].shape == (4, 32)
    other = MultiLora(model, n_slots=2, max_rank=8)
    other.set_slot(1, spec, tensors)
    ids = torch.randint(3, 32, (1, 5), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), lora.rows([0]):
        a = model(ids)
    with torch.no_grad(), other.rows([1]):
        b = model(ids)
    torch.testing.assert_close(a, b)

    bad = dict(tensors)
    bad[peft_key(0, "q_proj", "A")] = torch.full((4, 32), float("nan"))
    with pytest.raises(LoraError, match="non-finite"):
        other.set_slot(0, spec, bad)
    with pytest.raises(LoraError, match="shape"):
        other.set_slot(0, spec, {**tensors, peft_key(0, "q_proj", "A"): torch.zeros(4, 31)})
    with pytest.raises(LoraError, match="max LoRA rank"):
        other.set_slot(0, LoraSpec(rank=16, alpha=1.0), tensors)
    with pytest.raises(LoraError, match="missing"):
        other.set_slot(0, spec, {k: v for k, v in tensors.items() if "layers.1." not in k})
    assert other.specs[0] is None, "a refused adapter leaves the slot as it was"
    with pytest.raises(LoraError, match="target_modules"):
        LoraSpec(rank=2, alpha=1.0, target_modules=("lm_head",))
    (tmp_path / "junk").mkdir()
    with pytest.raises(LoraError, match="not a LoRA adapter directory"):
        load_adapter(tmp_path / "junk")
    with pytest.raises(LoraError, match="slot numbers in"):
        with lora.rows([5]):
            pass


def test_peft_loads_the_adapter_onto_transformers_llama_with_the_same_logits(setup, tmp_path):
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    from services.model.hf_io import save_model

    model, lora = setup
    save_model(model, tmp_path / "base")
    save_adapter(lora, 2, tmp_path / "adapter", base_model=str(tmp_path / "base"))
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "base", dtype=torch.float32).eval()
    hf = peft.PeftModel.from_pretrained(hf, tmp_path / "adapter").eval()
    ids = torch.randint(3, 32, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        theirs = hf(input_ids=ids).logits
        with lora.rows([2, 2]):
            ours = model(ids)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def test_factor_gradients_equal_those_through_the_merged_weights(setup):
    """d loss / d A = scale * B^T dW and d loss / d B = scale * dW A^T, where dW is the gradient
    of the same rows' loss with respect to the merged weight W + scale * B A."""
    model, lora = setup
    for p in model.parameters():
        p.requires_grad_(False)
    ids = torch.randint(3, 32, (3, 6), generator=torch.Generator().manual_seed(7))
    with lora.rows([0, 2, 0]):
        model(ids).logsumexp(-1).sum().backward()
    ref = merged(model, lora, 0)
    lin = ref.model.layers[1].self_attn.v_proj
    lin.weight.requires_grad_(True)
    ref(ids[[0, 2]]).logsumexp(-1).sum().backward()
    spec, key = lora.specs[0], "l1_v_proj"
    a, b = lora.A[key][0, : spec.rank].detach(), lora.B[key][0, :, : spec.rank].detach()
    torch.testing.assert_close(
        lora.A[key].grad[0, : spec.rank], spec.scale * b.t() @ lin.weight.grad, atol=1e-5, rtol=1e-4
    )
    torch.testing.assert_close(
        lora.B[key].grad[0, :, : spec.rank], spec.scale * lin.weight.grad @ a.t(), atol=1e-5, rtol=1e-4
    )
