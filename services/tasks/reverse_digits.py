"""The bundled task: reverse a string of 3-5 digits ("2817=" -> "7182").

Chosen from measurements on 2 CPU cores (docs/learnability.md): with a soft, dense reward
(positions right / max(len(output), len(target))) and a short supervised warm start, a 0.5M
parameter Llama learns it visibly within minutes, while harder tasks or strict rewards stall.

This module has two halves: the data and reward (no torch; the producer and eval import them)
and `build_model` (imports torch lazily; the launcher runs it once per run).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from services.tasks import char_model
from services.tasks.char_model import BOS_ID, EOS_ID, build_char_tokenizer, build_tiny_model, encode
from services.tasks.char_model import SPECIAL as SPECIAL  # the tokenizer's special tokens, read from here too

NAME = "reverse-digits"
ALPHABET = "0123456789+="
MIN_DIGITS, MAX_DIGITS = 3, 5
NUM_TRAIN_PROMPTS = 20_000
NUM_EVAL_PROMPTS = 64


CHAT_TEMPLATE = char_model.CHAT_TEMPLATE + "{% if add_generation_prompt %}={% endif %}"
"""The task's prompt format as a chat: the user's digits, then `=` (the model answers after it)."""


def build_tokenizer(out_dir: str | Path) -> None:
    """A character-level fast tokenizer (16 tokens) saved as tokenizer.json + config."""
    build_char_tokenizer(out_dir, 64, ALPHABET, CHAT_TEMPLATE)


def _digits(rng: random.Random) -> str:
    return "".join(rng.choice("0123456789") for _ in range(rng.randint(MIN_DIGITS, MAX_DIGITS)))


def distinct_rows(num: int, seed: int, exclude: set[str], row, digits=_digits) -> list[dict]:
    """`num` rows `row(d)` of distinct digit strings d drawn by `digits(rng)` (this task's 3-5
    digits by default), none of them in `exclude`."""
    rng = random.Random(seed)
    rows, seen = [], set(exclude)
    while len(rows) < num:
        d = digits(rng)
        if d in seen:
            continue
        seen.add(d)
        rows.append(row(d))
    return rows


def make_rows(num: int, seed: int, exclude: set[str] = frozenset()) -> list[dict]:
    return distinct_rows(num, seed, exclude, lambda d: {"prompt": f"{d}=", "label": d[::-1]})


def write_split(data_dir: str | Path, stem: str, train_rows: list[dict], eval_rows: list[dict]) -> tuple[Path, Path]:
    """`<stem>_train.jsonl` and `<stem>_eval.jsonl` under data_dir, one row a line."""
    data_dir = Path(data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    train, held_out = data_dir / f"{stem}_train.jsonl", data_dir / f"{stem}_eval.jsonl"
    for path, rows in ((train, train_rows), (held_out, eval_rows)):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return train, held_out


def write_datasets(data_dir: str | Path, seed: int = 0) -> tuple[Path, Path]:
    """Held-out prompts are disjoint from the training prompts."""
    eval_rows = make_rows(NUM_EVAL_PROMPTS, seed + 1)
    train_rows = make_rows(NUM_TRAIN_PROMPTS, seed, exclude={r["label"][::-1] for r in eval_rows})
    return write_split(data_dir, "reverse_digits", train_rows, eval_rows)


def score(response: str, label: str) -> float:
    """Soft reward: positions right / max(len(output), len(target)), in [0, 1]."""
    out = response.strip()
    if not out or not label:
        return 0.0
    right = sum(a == b for a, b in zip(out, label, strict=False))
    return right / max(len(out), len(label))


async def reward(config, sample) -> float:
    """The task's reward function, with the --custom-rm-path signature."""
    return score(sample.response, str(sample.label))


# ---- the tiny model ------------------------------------------------------------------------


def build_model(out_dir: str | Path, seed: int = 1234, warmup_sft_steps: int = 20, log=print,
                max_position_embeddings: int = 64, digits=_digits) -> dict:  # fmt: skip
    """Build the 0.5M-parameter Llama, warm-start it with a few supervised steps on correct
    answers (digit strings from `digits(rng)`, this task's by default), and save it as an HF
    checkpoint. Returns a summary dict."""

    def pair(rng: random.Random) -> tuple[list[int], list[int]]:  # teacher-forced on the answer tokens
        d = digits(rng)
        return [BOS_ID] + encode(d + "=", ALPHABET), encode(d[::-1], ALPHABET) + [EOS_ID]

    return build_tiny_model(out_dir, alphabet_size=len(ALPHABET), context=max_position_embeddings, next_pair=pair,
                            steps=warmup_sft_steps, seed=seed, lr=1e-3, build_tokenizer=build_tokenizer,
                            log=log)  # fmt: skip
