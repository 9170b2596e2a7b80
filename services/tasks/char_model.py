"""A tiny Llama that reads and writes printable ASCII, one token a character, for tasks whose
text the digit task's 16-token tokenizer cannot spell (math answers in `\\boxed{}`, reasoning
puzzles). Like the digit task's model it is built locally, no download, and warm-started with
a few supervised steps on (prompt, answer) pairs so that RL starts from a policy that writes the
answer's format.

This module imports torch only inside `build_tiny_model` and `warm_start`.
"""

from __future__ import annotations

import json
import random
import time
from collections.abc import Callable
from pathlib import Path

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, processors

SPECIAL = ["<pad>", "<s>", "</s>", "<unk>"]
PAD_ID, BOS_ID, EOS_ID, UNK_ID = 0, 1, 2, 3
STOP_IDS = [EOS_ID, PAD_ID, BOS_ID, UNK_ID]
"""The tiny models' `eos_token_id`: every special token ends an answer. The engine's text skips
special tokens, so a policy that could write one inside an answer would pad the answer with
tokens no grader reads, for free (the default job learned to run to its length limit that way)."""
ALPHABET = "".join(chr(c) for c in range(32, 127)) + "\n"
"""Printable ASCII and the newline."""

CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}{% endfor %}"
)
"""A chat is its messages' text, one after the other (the model answers right after the user's)."""


def build_char_tokenizer(out_dir: str | Path, context: int, alphabet: str = ALPHABET,
                         chat_template: str = CHAT_TEMPLATE) -> None:  # fmt: skip
    """A fast tokenizer with one token a character of `alphabet` (after SPECIAL), saved with its
    config: BOS added to plain text, the chat template given."""
    vocab = {tok: i for i, tok in enumerate([*SPECIAL, *alphabet])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", BOS_ID)])
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIAL)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "pad_token": "<pad>", "unk_token": "<unk>", "model_max_length": context, "chat_template": chat_template,
    }, indent=2))  # fmt: skip


def encode(text: str, alphabet: str = ALPHABET) -> list[int]:
    """Token ids of `text` (no BOS) in a tokenizer of `alphabet`; a character outside it is <unk>."""
    return [len(SPECIAL) + alphabet.index(c) if c in alphabet else UNK_ID for c in text]


def build_char_model(out_dir: str | Path, pairs: list[tuple[str, str]], seed: int = 1234, warmup_sft_steps: int = 60,
                     context: int = 128, hidden: int = 128, layers: int = 2, log=print) -> dict:  # fmt: skip
    """Build and save (HF format) a character-level Llama warm-started on `pairs` of (prompt,
    answer): teacher-forced cross-entropy on the answer and its end-of-sequence token."""
    ids = [([BOS_ID] + encode(p), encode(a) + [EOS_ID]) for p, a in pairs]
    return build_tiny_model(
        out_dir, alphabet_size=len(ALPHABET), context=context,
        next_pair=(lambda rng: rng.choice(ids)) if ids else None, steps=warmup_sft_steps, seed=seed, lr=2e-3,
        build_tokenizer=lambda out: build_char_tokenizer(out, context), hidden=hidden, layers=layers, log=log,
    )  # fmt: skip


def build_tiny_model(out_dir: str | Path, alphabet_size: int, context: int, next_pair, steps: int, seed: int, lr: float,
                     build_tokenizer: Callable[[Path], None], hidden: int = 128, layers: int = 2,
                     log=print) -> dict:  # fmt: skip
    """A Llama over SPECIAL and `alphabet_size` characters, warm-started (warm_start, at `lr`) for
    `steps` steps on pairs drawn by `next_pair` (None: no warm start), saved in HF format with
    the tokenizer `build_tokenizer` writes. Logs its size with `log`; returns a summary dict."""
    import torch

    from services.model.hf_io import save_model
    from services.model.llama import CausalLM, ModelConfig

    torch.manual_seed(seed)
    cfg = ModelConfig(vocab_size=len(SPECIAL) + alphabet_size, hidden_size=hidden, intermediate_size=4 * hidden,
                      num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                      max_position_embeddings=context, bos_token_id=BOS_ID, eos_token_id=STOP_IDS,
                      pad_token_id=PAD_ID)  # fmt: skip
    model = CausalLM(cfg)
    model.init_weights(seed)
    t0 = time.perf_counter()
    if steps > 0 and next_pair is not None:
        warm_start(model, next_pair, steps, seed, lr=lr)
    out = Path(out_dir)
    build_tokenizer(out)
    info = save_model(model, out)
    n_params = sum(p.numel() for p in model.parameters())
    summary = {"params": n_params, "warmup_sft_steps": steps, "warmup_s": time.perf_counter() - t0, **info}
    log(f"built tiny model: {n_params:,} parameters, {steps} warm-start steps in {summary['warmup_s']:.2f}s")
    return summary


def warm_start(model, next_pair: Callable[[random.Random], tuple[list[int], list[int]]], steps: int, seed: int,
               batch: int = 64, lr: float = 1e-3) -> None:  # fmt: skip
    """Supervised warm start: `steps` AdamW steps of teacher-forced cross-entropy on the answer
    tokens of `batch` (prompt ids, answer ids) pairs each, drawn by `next_pair` from
    Random(seed + 7)."""
    import torch

    rng = random.Random(seed + 7)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for _ in range(steps):
        pairs = [next_pair(rng) for _ in range(batch)]
        seqs = [prompt + answer for prompt, answer in pairs]
        masks = [[0] * len(prompt) + [1] * len(answer) for prompt, answer in pairs]
        width = max(map(len, seqs))
        ids = torch.tensor([s + [PAD_ID] * (width - len(s)) for s in seqs])
        loss_mask = torch.tensor([m + [0] * (width - len(m)) for m in masks], dtype=torch.float32)
        attn = torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in seqs])
        logits = model(ids, attn)[:, :-1]
        nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                                reduction="none")  # fmt: skip
        mask = loss_mask[:, 1:].reshape(-1)
        loss = (nll * mask).sum() / mask.sum()
        opt.zero_grad()
        loss.backward()
        opt.step()
