"""A bundled task with a long tail of response lengths: reverse a digit string ("28175=" ->
"57182"), most strings as short as reverse-digits' (3-5 digits), one in LONG_SHARE from a Pareto
tail (LONG_MIN digits and up, capped at MAX_DIGITS).

    asyncrl train-async --config deploy/configs/longtail.yaml

It is the workload where a batch waits for its slowest trajectory: the median answer is 5 tokens,
the p99 over a hundred, and most steps of 16 prompts hold a long one (the lengths are recorded
with every run, `rollout/response_len/*` and `eval/<set>/response_len/*`, p99 included). The
short strings are what the tiny model learns (reverse-digits' task); the long ones are the
stragglers. The reward is reverse-digits' own (`reward`): its soft positional score over the whole
response (positions right / max(len(output), len(target))), so a longer or shorter answer than
the label costs reward and the lengths stay the data's. Unlike services/tasks/longtail.py (a throughput
workload that forces lengths with `ignore_eos`), nothing is padded: the model writes every token and stops by itself.

The model is the digit Llama of reverse-digits (same 16-token alphabet and chat format) with a
context that fits the longest prompt and answer, warm-started on pairs of this distribution, so
that at step 0 long prompts already get long answers. No torch outside `build_model`.
"""

from __future__ import annotations

import random
from pathlib import Path

from services.tasks import reverse_digits
from services.tasks.reverse_digits import distinct_rows, reward, write_split  # noqa: F401 (reward: TASK_REWARDS)

NAME = "reverse-longtail"
MIN_DIGITS, SHORT_MAX, LONG_MIN, MAX_DIGITS = 3, 5, 16, 192
LONG_SHARE = 0.1
ALPHA = 1.0
"""Pareto shape of a long string's length: P(length > x) = (LONG_MIN / x) ** ALPHA, capped at MAX_DIGITS."""
NUM_TRAIN_PROMPTS = 20_000
NUM_EVAL_PROMPTS = 128
MAX_RESPONSE_LEN = 208
"""The config's --rollout-max-response-len: the longest answer (192 digits and the end token) and room to overrun."""
CONTEXT = 512
"""The model's positions: prompt (BOS, 192 digits, `=`) plus MAX_RESPONSE_LEN, rounded up."""
WARM_START_DIGITS = 96
"""The warm start's strings are cut to this length: its batches are padded to their longest pair, and
the few longer strings would double its time without changing what it teaches (stop after as many
digits as the prompt had)."""


def digits(rng: random.Random) -> str:
    long = rng.random() < LONG_SHARE
    n = min(MAX_DIGITS, int(LONG_MIN * rng.paretovariate(ALPHA))) if long else rng.randint(MIN_DIGITS, SHORT_MAX)
    return "".join(rng.choice("0123456789") for _ in range(n))


def make_rows(num: int, seed: int, exclude: set[str] = frozenset()) -> list[dict]:
    """`num` rows of distinct digit strings (none in `exclude`), lengths from this task's tail."""
    return distinct_rows(num, seed, exclude, lambda d: {"prompt": f"{d}=", "label": d[::-1]}, digits)


def write_datasets(data_dir: str | Path, seed: int = 0) -> tuple[Path, Path]:
    """Training and held-out prompt files; held-out prompts are disjoint from the training prompts."""
    eval_rows = make_rows(NUM_EVAL_PROMPTS, seed + 1)
    train_rows = make_rows(NUM_TRAIN_PROMPTS, seed, exclude={r["label"][::-1] for r in eval_rows})
    return write_split(data_dir, "reverse_longtail", train_rows, eval_rows)


def build_model(out_dir: str | Path, seed: int = 1234, warmup_sft_steps: int = 20, log=print) -> dict:
    """reverse-digits' tiny Llama with CONTEXT positions, warm-started on this task's pairs."""
    return reverse_digits.build_model(out_dir, seed=seed, warmup_sft_steps=warmup_sft_steps, log=log,
                                      max_position_embeddings=CONTEXT,
                                      digits=lambda rng: digits(rng)[:WARM_START_DIGITS])  # fmt: skip
