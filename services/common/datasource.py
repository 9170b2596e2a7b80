"""The prompt data source: JSONL rows released as prompt groups, recycled prompts first.

Each fresh release gets the next `group_index`; sample indices are group_index * n + position,
so indices are global, unique and increasing. Epochs wrap without stopping (reshuffled per
epoch with --rollout-seed when --rollout-shuffle is set). The cursor (epoch, position, next
index) and the recycled queue live in the buffer's durable state (services.buffer.state); this
class only turns that state into the next prompt, deterministically, so a restarted buffer
releases exactly what it would have released.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import msgspec

from asyncrl_proto import PromptMsg
from services.common.config import RunConfig


class DataError(ValueError):
    pass


def load_rows(path: str | Path, input_key: str, label_key: str | None, metadata_key: str | None) -> list[dict]:
    """Parse a JSONL prompt file; a malformed row is reported with its file and line number."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"--prompt-data {path}: no such file")
    rows: list[dict] = []
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise DataError(f"{path}:{lineno}: a row must be a JSON object")
            if input_key not in obj:
                raise DataError(f"{path}:{lineno}: row has no {input_key!r} key (set --input-key)")
            meta = obj.get(metadata_key) if metadata_key else None
            if meta is not None and not isinstance(meta, dict):
                raise DataError(f"{path}:{lineno}: {metadata_key!r} must be a JSON object")
            rows.append(
                {
                    "prompt": obj[input_key],
                    "label": obj.get(label_key) if label_key else None,
                    "metadata": meta or {},
                }
            )
    if not rows:
        raise DataError(f"{path}: no prompts")
    return rows


class PromptSource:
    def __init__(self, config: RunConfig, rows: list[dict]):
        self.config = config
        self.rows = rows
        self.n = config.n_samples_per_prompt
        self._orders: dict[int, list[int]] = {}

    @property
    def epoch_size(self) -> int:
        return len(self.rows)

    def order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.rows)))
            if self.config.rollout_shuffle:
                random.Random(self.config.rollout_seed + epoch).shuffle(order)
            self._orders = {epoch: order}  # one epoch at a time is all we ever need
        return self._orders[epoch]

    def next_release(self, epoch: int, cursor: int, next_group_index: int, recycled: list[PromptMsg]):
        """The next prompt and the cursor after it: the head of the recycled queue (original
        group_index, attempt + 1) if any, else the next row. Pure: nothing is mutated."""
        if recycled:
            return msgspec.structs.replace(recycled[0], released_at=time.time()), {}
        if cursor >= len(self.rows):
            epoch, cursor = epoch + 1, 0
        row_id = self.order(epoch)[cursor]
        row = self.rows[row_id]
        msg = PromptMsg(
            group_index=next_group_index,
            prompt=row["prompt"],
            label=row["label"],
            metadata=dict(row["metadata"]),
            attempt=0,
            epoch=epoch,
            row=row_id,
            n_samples=self.n,
            released_at=time.time(),
        )
        return msg, {"epoch": epoch, "cursor": cursor + 1, "next_group_index": next_group_index + 1}
