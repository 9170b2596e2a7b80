"""megatron-core on CPU (gloo): exact HF <-> Megatron round trips, Megatron's forward against the
HF model's logits, and one training step through the trainer's loss."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("megatron.core")

from services.api import Sample  # noqa: E402
from services.model.llama import CausalLM, ModelConfig  # noqa: E402
from services.trainer.core import LossConfig, build_train_batch, train_step  # noqa: E402
from services.trainer.megatron_backend import MegatronCausalLM, hf_to_megatron, init_megatron, megatron_to_hf  # noqa: E402

CONFIGS = {
    "llama-gqa": ModelConfig(vocab_size=16, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32),
    "qwen2": ModelConfig(vocab_size=16, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32, model_type="qwen2"),
    "llama-tied": ModelConfig(vocab_size=16, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                              num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32,
                              tie_word_embeddings=True),
}  # fmt: skip


def hf_model(cfg: ModelConfig, seed: int = 0) -> CausalLM:
    m = CausalLM(cfg)
    m.init_weights(seed, std=0.3)
    return m


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_hf_megatron_hf_round_trip_is_exact(name):
    cfg = CONFIGS[name]
    hf = {
        k: v for k, v in hf_model(cfg).state_dict().items() if not (cfg.tie_word_embeddings and k == "lm_head.weight")
    }
    back = megatron_to_hf(hf_to_megatron(hf, cfg), cfg)
    assert set(back) == set(hf) and all(torch.equal(back[k], hf[k]) for k in hf)


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_megatron_forward_matches_the_hf_logits(name):
    init_megatron()
    cfg = CONFIGS[name]
    ref = hf_model(cfg, seed=3)
    mg = MegatronCausalLM(cfg)
    mg.load_hf_state_dict(ref.state_dict())
    ids = torch.tensor([[1, 5, 6, 7, 15, 9, 8], [1, 4, 15, 6, 6, 0, 0]])
    attn = torch.tensor([[1] * 7, [1] * 5 + [0] * 2])
    with torch.no_grad():
        want, got = ref(ids, attn), mg(ids, attn)
    assert (want[0] - got[0]).abs().max().item() < 1e-4
    assert (want[1, :5] - got[1, :5]).abs().max().item() < 1e-4  # padded positions are ignored
    exported = mg.hf_state_dict()
    assert all(torch.equal(exported[k], v) for k, v in ref.state_dict().items() if k in exported)


def test_megatron_matches_transformers_on_the_task_model(tiny_model_dir):
    transformers = pytest.importorskip("transformers")
    from services.trainer.megatron_backend import load_megatron_model

    mg = load_megatron_model(tiny_model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), attn_implementation="eager")
    ids = torch.tensor([[1, 5, 6, 7, 15, 9, 8]])
    with torch.no_grad():
        assert (mg(ids) - hf(ids).logits).abs().max().item() < 1e-4


def test_a_training_step_through_megatron_equals_the_plain_model():
    init_megatron()
    cfg = CONFIGS["llama-gqa"]
    plain = hf_model(cfg, seed=5)
    mg = MegatronCausalLM(cfg)
    mg.load_hf_state_dict(plain.state_dict())
    group = [Sample(index=i, tokens=[1, 5, 6, 15, 6 + i, 2], response_length=2, reward=float(i % 2),
                    rollout_log_probs=[-1.0, -1.2]) for i in range(4)]  # fmt: skip
    for m in (plain, mg):
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        train_step(m, opt, build_train_batch([group], True, None, 0), LossConfig(), clip_grad=0.0)
    after = mg.hf_state_dict()
    worst = max((after[k] - v).abs().max().item() for k, v in plain.state_dict().items())
    assert worst < 1e-4


@pytest.mark.parametrize("name", ["llama-gqa", "qwen2"])
def test_multi_lora_on_megatron_equals_the_plain_model_row_by_row(name):
    """The same adapters in both backends' MultiLora (Megatron's fused QKV and gate/up take the
    q, k, v and gate, up deltas in their layouts): the same logits row by row (each row its own
    adapter, or none), the same factor gradients, and the same PEFT tensors to save."""
    from services.model.lora import TARGETS, LoraSpec, MultiLora

    init_megatron()
    cfg = CONFIGS[name]
    plain = hf_model(cfg, seed=7)
    mg = MegatronCausalLM(cfg)
    mg.load_hf_state_dict(plain.state_dict())
    specs = [LoraSpec(rank=4, alpha=8.0, target_modules=TARGETS), LoraSpec(rank=2, alpha=3.0, target_modules=("k_proj", "up_proj"))]
    loras = []
    for model in (plain, mg):
        model.requires_grad_(False)
        lora = MultiLora(model, n_slots=2, max_rank=4)
        for slot, spec in enumerate(specs):
            lora.init_slot(slot, spec, seed=slot)
            with torch.no_grad():
                g = torch.Generator().manual_seed(10 + slot)
                for key in lora.B:
                    lora.B[key][slot].normal_(0, 0.2, generator=g)
        loras.append(lora)
    assert all(torch.equal(loras[0].slot_tensors(s)[k], v) for s in (0, 1) for k, v in loras[1].slot_tensors(s).items())
    ids = torch.tensor([[1, 5, 6, 7, 15, 9], [1, 4, 15, 6, 6, 3], [1, 5, 6, 7, 15, 9], [2, 8, 3, 3, 1, 0]])
    attn = torch.tensor([[1] * 6, [1] * 6, [1] * 6, [1] * 5 + [0]])
    logits = []
    for model, lora in zip((plain, mg), loras, strict=True):
        with lora.rows([0, 1, -1, 0]):
            out = model(ids, attn)
        out[:, :5].logsumexp(-1).sum().backward()
        logits.append(out.detach())
    want, got = logits
    assert (want[:, :5] - got[:, :5]).abs().max().item() < 1e-4
    assert (want[0] - want[2]).abs().max().item() > 1e-2  # the adapter changes the output it is checked on
    for key in loras[0].A:
        for p, q in ((loras[0].A[key], loras[1].A[key]), (loras[0].B[key], loras[1].B[key])):
            assert (p.grad - q.grad).abs().max().item() < 1e-4 * max(1.0, p.grad.abs().max().item()), key
