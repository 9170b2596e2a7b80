"""A second bundled task: repeat a string of 3-5 digits as given ("2817+" -> "2817").

It is reverse-digits' sibling for multi-LoRA runs: the same row format ({"prompt", "label"}),
the same character alphabet (so reverse-digits' tokenizer and tiny model serve both) and the
same soft reward (positions right / max(len(output), len(target))); only the operator differs.
A copy prompt ends in `+` where a reverse prompt ends in `=`, so one model, or one adapter per
task on one base, can tell the two tasks apart from the prompt alone.

No torch: the producer and eval import it.
"""

from __future__ import annotations

from pathlib import Path

from services.tasks.reverse_digits import NUM_EVAL_PROMPTS, NUM_TRAIN_PROMPTS, distinct_rows, write_split
from services.tasks.reverse_digits import reward as reward  # the task's reward (TASK_REWARDS names it)

NAME = "copy-digits"
OPERATOR = "+"
"""Ends every copy prompt (reverse-digits ends its prompts in `=`); both are in its ALPHABET."""


def make_rows(num: int, seed: int, exclude: set[str] = frozenset()) -> list[dict]:
    """`num` distinct prompts, none of whose digit strings is in `exclude`."""
    return distinct_rows(num, seed, exclude, lambda d: {"prompt": f"{d}{OPERATOR}", "label": d})


def write_datasets(data_dir: str | Path, seed: int = 0) -> tuple[Path, Path]:
    """Training and held-out prompt files; held-out prompts are disjoint from the training prompts."""
    eval_rows = make_rows(NUM_EVAL_PROMPTS, seed + 1)
    train_rows = make_rows(NUM_TRAIN_PROMPTS, seed, exclude={r["label"] for r in eval_rows})
    return write_split(data_dir, "copy_digits", train_rows, eval_rows)
