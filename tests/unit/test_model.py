"""The shared Llama implementation: exact against transformers, cache-consistent, HF snapshots."""

from __future__ import annotations

import json

import pytest
import torch

from services.common.snapshot import COMPLETE_MARKER, is_complete
from services.model.hf_io import load_model, save_model
from services.model.llama import CausalLM, KVCache, ModelConfig


def test_logits_match_transformers(tiny_model_dir):
    transformers = pytest.importorskip("transformers")
    ours = load_model(tiny_model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tiny_model_dir), attn_implementation="eager")
    ids = torch.tensor([[1, 5, 6, 7, 15, 9, 8], [1, 4, 15, 6, 6, 2, 0]])
    with torch.no_grad():
        assert (ours(ids) - hf(ids).logits).abs().max().item() < 1e-5


def test_cached_forward_equals_full_forward(tiny_model_dir):
    model = load_model(tiny_model_dir)
    ids = torch.tensor([[1, 5, 6, 7, 15, 9, 8, 10]])
    cache = KVCache(model.cfg, num_slots=3, max_len=32)
    with torch.no_grad():
        full = model(ids)
        a = model.forward_cached(ids[:, :5], cache, torch.tensor([2]), torch.tensor([0]))
        b = model.forward_cached(ids[:, 5:6], cache, torch.tensor([2]), torch.tensor([5]))
        c = model.forward_cached(ids[:, 6:], cache, torch.tensor([2]), torch.tensor([6]))
    assert (torch.cat([a, b, c], 1) - full).abs().max().item() < 1e-5


def test_right_padding_does_not_change_real_positions(tiny_model_dir):
    model = load_model(tiny_model_dir)
    with torch.no_grad():
        alone = model(torch.tensor([[1, 5, 6, 15]]))
        padded = model(torch.tensor([[1, 5, 6, 15, 0, 0]]), torch.tensor([[1, 1, 1, 1, 0, 0]]))
    assert (padded[:, :4] - alone).abs().max().item() < 1e-5


def test_snapshot_round_trip_and_complete_marker(tmp_path):
    cfg = ModelConfig(vocab_size=11, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, model_type="qwen2")  # fmt: skip
    model = CausalLM(cfg)
    model.init_weights(3)
    out = tmp_path / "snap"
    out.mkdir()
    (out / COMPLETE_MARKER).write_text("stale")
    info = save_model(model, out)
    assert is_complete(out) and json.loads((out / COMPLETE_MARKER).read_text())["sha256"] == info["sha256"]
    back = load_model(out)
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        assert torch.equal(model(ids), back(ids))
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]


def test_a_trained_snapshot_loads_in_transformers_with_the_trainers_logits(tiny_model_dir, tmp_path):
    transformers = pytest.importorskip("transformers")
    from services.api import Sample
    from services.trainer.core import LossConfig, build_train_batch, train_step

    model = load_model(tiny_model_dir)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    group = [Sample(index=i, tokens=[1, 5, 6, 15, 6 + i, 2], response_length=2, reward=float(i), rollout_log_probs=[-1.0, -1.0])
             for i in range(4)]  # fmt: skip
    for _ in range(3):
        train_step(model, opt, build_train_batch([group], True, None, 0), LossConfig(), 1.0)
    save_model(model, tmp_path / "snap", tiny_model_dir)
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "snap"), attn_implementation="eager")
    ids = torch.tensor([[1, 5, 6, 7, 15, 9, 8]])
    with torch.no_grad():
        assert (model(ids) - hf(ids).logits).abs().max().item() < 1e-5
