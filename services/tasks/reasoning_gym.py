"""`--task reasoning-gym`: any of reasoning-gym's procedural datasets as a task, offline.

Prompts come from the dataset's generator (training: seed --rollout-seed, --rg-size of them;
held-out: seed + HELD_OUT_SEED_OFFSET, --rg-eval-size, none whose question is also in training:
reasoning-gym seeds item i with seed + i, so nearby seeds share items), labels are
its answers, and each row's metadata is the entry's (its `source_dataset` names the scorer) with
`rm_type: reasoning_gym`: the reward is the dataset's own `score_answer`, run by the reward hub's
graders (services/rewards/graders.py, `reasoning_gym_score`), or with --rg-scoring exact 1 for its
full marks and 0 otherwise. Without --hf-checkpoint the launcher builds a
character-level tiny model (services/tasks/char_model.py) warm-started on training pairs.

reasoning-gym is an optional extra (`pip install 'asyncrl[reasoning]'`; its pycosat dependency
builds from source, so it needs a C compiler).
"""

from __future__ import annotations

import json
from pathlib import Path

from services.tasks.reverse_digits import write_split

NAME = "reasoning-gym"
RM_TYPE = "reasoning_gym"
HELD_OUT_SEED_OFFSET = 1_000_003


class MissingExtra(RuntimeError):
    pass


def _row(entry: dict, origin: dict, scoring: str) -> dict:
    """A row of `entry`; its metadata says where the entry came from (`rg_origin`: dataset size,
    seed and settings), so that the scorer gets the entry itself back, exact types and all (JSON
    and msgpack turn tuples into lists, and some scorers compare tuples)."""
    meta = json.loads(json.dumps(entry.get("metadata") or {}, default=str))
    return {"prompt": entry["question"], "label": str(entry["answer"]),
            "metadata": {**meta, "rm_type": RM_TYPE, "rg_origin": origin, "rg_scoring": scoring}}  # fmt: skip


def make_rows(dataset: str, options: dict, size: int, seed: int, exclude: set[str] | None = None,
              scoring: str = "dataset") -> list[dict]:  # fmt: skip
    """`size` rows of `dataset`'s generator with `seed`; with `exclude`, distinct questions none of
    which is in it (drawn from 4x as many entries). `scoring` (--rg-scoring) rides in each row's
    metadata for the grader."""
    try:
        import reasoning_gym as rg
    except ImportError:
        raise MissingExtra("--task reasoning-gym needs the reasoning extra: pip install 'asyncrl[reasoning]' "
                           "(reasoning-gym; a C compiler builds its pycosat dependency)") from None  # fmt: skip
    if exclude is None:
        origin = {"size": size, "seed": seed, "options": options}
        return [_row(e, origin, scoring) for e in rg.create_dataset(dataset, size=size, seed=seed, **options)]
    rows, seen = [], set(exclude)
    origin = {"size": 4 * size, "seed": seed, "options": options}
    for entry in rg.create_dataset(dataset, size=4 * size, seed=seed, **options):
        if entry["question"] not in seen:
            seen.add(entry["question"])
            rows.append(_row(entry, origin, scoring))
            if len(rows) == size:
                return rows
    raise ValueError(f"reasoning-gym {dataset} {options}: fewer than {size} held-out questions that are not "
                     "training questions; lower --rg-eval-size or --rg-size, or widen the dataset's "
                     "settings")  # fmt: skip


def write_datasets(data_dir: str | Path, dataset: str, options: dict, size: int, eval_size: int,
                   seed: int, scoring: str = "dataset") -> tuple[Path, Path]:  # fmt: skip
    """The training and held-out JSONL files (held-out from a distant seed, disjoint questions)."""
    train_rows = make_rows(dataset, options, size, seed, scoring=scoring)
    held_rows = make_rows(dataset, options, eval_size, seed + HELD_OUT_SEED_OFFSET,
                          exclude={r["prompt"] for r in train_rows}, scoring=scoring)  # fmt: skip
    return write_split(data_dir, dataset, train_rows, held_rows)
