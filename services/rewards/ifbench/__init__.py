"""rm_type `ifbench`: whether a response follows every instruction of its row, as AllenAI's IFBench
grades it strictly (Miles's rm_hub runs IFBench's `test_instruction_following_strict`): 1.0 when
each instruction's checker passes, else 0.0.

The row's metadata names the instructions: `instruction_id_list` (IFBench's ids, e.g.
`count:word_count_range`) and `kwargs`, one dict per instruction (a single dict serves every
instruction; a short list is padded with its last dict; None values are dropped; a JSON string is
read), as Miles reads them. The checkers are this package's own (classic.py: the 25 IFEval ids
IFBench's registry carries; counts.py and formats.py: IFBench's 58), written from IFBench's
definitions and run offline (text.py says what they read text with).

Where IFBench would draw a missing argument at random (a keyword, a count), the grader raises
instead: a random instruction grades nothing. An unknown id, or kwargs an instruction does not
take, raise too. Every id is in CHECKERS; docs/tasks.md lists them."""

from __future__ import annotations

import json
from typing import Any

from services.rewards.ifbench import classic, counts, formats  # noqa: F401 - they fill CHECKERS
from services.rewards.ifbench.text import CHECKERS, MissingResource, bind

__all__ = ["CHECKERS", "MissingResource", "followed"]


def _kwargs_list(raw: Any, n: int) -> list[dict]:
    """One kwargs dict per instruction, as Miles coerces them."""
    if isinstance(raw, str) and raw.strip():
        raw = json.loads(raw)
    if isinstance(raw, dict):  # one dict for every instruction
        raw = [raw]
    out = [dict(e) if isinstance(e, dict) else {} for e in raw] if isinstance(raw, (list, tuple)) else []
    out += [dict(out[-1] if out else {}) for _ in range(n - len(out))]
    return [{k: v for k, v in e.items() if v is not None} for e in out[:n]]


def followed(response: str, metadata: dict) -> list[bool]:
    """Whether the response follows each instruction the row names (an empty response follows
    none); ValueError when it names none, or one that is unknown."""
    raw_ids = metadata.get("instruction_id_list")
    if isinstance(raw_ids, str):
        raw_ids = json.loads(raw_ids) if raw_ids.strip().startswith("[") else [raw_ids]
    ids = [str(i).strip() for i in (raw_ids or []) if i is not None and str(i).strip()]
    if not ids:
        raise ValueError("rm_type ifbench needs metadata.instruction_id_list (IFBench's instruction ids) and "
                         "metadata.kwargs (one dict per instruction)")  # fmt: skip
    if unknown := [i for i in ids if i not in CHECKERS]:
        raise ValueError(f"rm_type ifbench does not know the instruction {', '.join(map(repr, unknown))}: IFBench's "
                         "ids are listed in docs/tasks.md")  # fmt: skip
    out = []
    for instruction_id, kwargs in zip(ids, _kwargs_list(metadata.get("kwargs"), len(ids)), strict=True):
        fn = bind(instruction_id, kwargs)
        out.append(bool(response.strip()) and bool(fn(response, **kwargs)))
    return out
