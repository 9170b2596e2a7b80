"""The prompt data source: JSONL rows released as prompt groups, recycled prompts first.

Each release gets the next `group_index`; sample indices are group_index * n + position, so
indices are global, unique and increasing. Epochs wrap without stopping (reshuffled per epoch
with --rollout-seed when --rollout-shuffle is set). The whole state (epoch, cursor, next index,
recycled prompts) is a small dict that the buffer service persists.
"""

from __future__ import annotations

import collections
import json
import random
import time
from pathlib import Path
from typing import Any

from asyncrl_proto import PromptMsg

from services.common.config import RunConfig


class DataError(ValueError):
    pass


def load_rows(
    path: str | Path, input_key: str, label_key: str | None, metadata_key: str | None
) -> list[dict]:
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
        self.epoch = 0
        self.cursor = 0
        self.next_group_index = 0
        self.recycled: collections.deque[PromptMsg] = collections.deque()
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        if self.config.rollout_shuffle:
            random.Random(self.config.rollout_seed + epoch).shuffle(order)
        return order

    def next_prompt(self) -> PromptMsg:
        """Recycled prompts first, with their original group_index; then fresh rows."""
        if self.recycled:
            msg = self.recycled.popleft()
            msg.released_at = time.time()
            return msg
        if self.cursor >= len(self._order):
            self.epoch += 1
            self.cursor = 0
            self._order = self._epoch_order(self.epoch)
        row_id = self._order[self.cursor]
        row = self.rows[row_id]
        self.cursor += 1
        gi = self.next_group_index
        self.next_group_index += 1
        return PromptMsg(
            group_index=gi,
            prompt=row["prompt"],
            label=row["label"],
            metadata=dict(row["metadata"]),
            attempt=0,
            epoch=self.epoch,
            row=row_id,
            n_samples=self.n,
            released_at=time.time(),
        )

    def recycle(
        self,
        group_index: int,
        prompt: Any,
        label: Any,
        metadata: dict,
        attempt: int,
        epoch: int,
        row: int,
    ) -> PromptMsg:
        msg = PromptMsg(
            group_index=group_index,
            prompt=prompt,
            label=label,
            metadata=metadata,
            attempt=attempt + 1,
            epoch=epoch,
            row=row,
            n_samples=self.n,
        )
        self.recycled.append(msg)
        return msg

    @property
    def epoch_size(self) -> int:
        return len(self.rows)

    def state_dict(self) -> dict:
        from asyncrl_proto import encode

        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "next_group_index": self.next_group_index,
            "recycled": [encode(m) for m in self.recycled],
        }

    def load_state_dict(self, state: dict) -> None:
        from asyncrl_proto import decode

        self.epoch = state["epoch"]
        self.cursor = state["cursor"]
        self.next_group_index = state["next_group_index"]
        self.recycled = collections.deque(decode(b, PromptMsg) for b in state["recycled"])
        self._order = self._epoch_order(self.epoch)
