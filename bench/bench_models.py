"""Models the benchmarks build locally (no download): the quickstart's tiny model, and larger
Llamas with its vocabulary and tokenizer (random weights: the benchmarks time them, they do not
ask them anything)."""

from __future__ import annotations

from pathlib import Path

SIZES = {  # name -> (hidden, intermediate, layers, heads); tiny is the quickstart's own model
    "tiny": None,
    "25m": (512, 1408, 8, 8),
    "100m": (1024, 2816, 8, 16),
}


def build_models(root: Path, sizes: list[str], context: int = 64) -> dict[str, Path]:
    """The named sizes as HF snapshots under `root` (tiny always), each with `context` positions;
    prints each one's parameter count and file size."""
    import torch

    from services.model.hf_io import load_model, read_config, save_model
    from services.model.llama import CausalLM, ModelConfig
    from services.tasks.reverse_digits import build_model

    unknown = [s for s in sizes if s not in SIZES]
    if unknown:
        raise SystemExit(f"unknown sizes {unknown}: use {', '.join(SIZES)}")
    tiny = root / "tiny"
    build_model(tiny, warmup_sft_steps=0, log=lambda *_: None, max_position_embeddings=context)
    out = {"tiny": tiny}
    base = read_config(tiny)
    for name in sizes:
        if SIZES[name] is None:
            continue
        hidden, inter, layers, heads = SIZES[name]
        cfg = ModelConfig(vocab_size=base.vocab_size, hidden_size=hidden, intermediate_size=inter,
                          num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                          max_position_embeddings=context, bos_token_id=base.bos_token_id,
                          eos_token_id=base.eos_token_id, pad_token_id=base.pad_token_id)  # fmt: skip
        torch.manual_seed(0)
        save_model(CausalLM(cfg), root / name, tiny)
        out[name] = root / name
    for name, path in out.items():
        n = sum(p.numel() for p in load_model(path).parameters())
        print(f"model {name}: {n / 1e6:.2f}M parameters, {(path / 'model.safetensors').stat().st_size / 2**20:.1f} MiB",
              flush=True)  # fmt: skip
    return out
