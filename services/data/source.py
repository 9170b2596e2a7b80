"""The prompt data source: JSONL or Parquet rows released as prompt groups, recycled prompts first.

Each fresh release gets the next `group_index`; sample indices are group_index * n + position,
so indices are global, unique and increasing. Epochs wrap without stopping (reshuffled per
epoch with --rollout-seed when --rollout-shuffle is set). The cursor (epoch, position, next
index) and the recycled queue live in the buffer's durable state (services.buffer.state); this
class only turns that state into the next prompt, deterministically, so a restarted buffer
releases exactly what it would have released.
"""

from __future__ import annotations

import abc
import json
import math
import random
import time
from collections.abc import Callable
from pathlib import Path

import msgspec

from asyncrl_proto import PromptMsg
from asyncrl_proto.messages import Sample, SampleStatus, flatten_group
from services.common.config import RunConfig
from services.common.config.view import for_plugins
from services.common.plugins import load_object


class DataError(ValueError):
    pass


def load_rows(path: str | Path, input_key: str, label_key: str | None, metadata_key: str | None,
              check: Callable[[dict], str | None] | None = None,
              tool_key: str | None = None) -> list[dict]:  # fmt: skip
    """Parse a prompt file, JSONL (one JSON object a line) or Parquet (`.parquet`, one row a
    record); a malformed row is reported with its file and row number (1-based), as is a row
    that `check` (row -> problem or None) refuses. With `tool_key`, a row's tool schemas (a list
    of objects, or none) are its "tools"."""
    path = Path(path)
    if not path.exists():
        raise DataError(f"--prompt-data {path}: no such file")
    if path.suffix.lower() == ".parquet":
        objects = enumerate((obj for batch in _parquet_batches(path) for obj in batch.to_pylist()), 1)
    else:
        objects = _jsonl_rows(path)
    rows = []
    for n, obj in objects:
        rows.append(row := _row(path, n, obj, input_key, label_key, metadata_key, tool_key))
        if check is not None and (problem := check(row)) is not None:
            raise DataError(f"{path}:{n}: {problem}")
    if not rows:
        raise DataError(f"{path}: no prompts")
    return rows


def data_size(path: str | Path, stop_above: float = float("inf")) -> int:
    """Bytes a prompt file holds once read: a JSONL file's size; a Parquet file's decoded size,
    which compression and dictionary encoding can make far larger than the file. It is counted
    batch by batch (a batch decodes to no more than its rows' own values) and the count stops
    once it passes `stop_above`."""
    path = Path(path)
    if path.suffix.lower() != ".parquet":
        return path.stat().st_size
    total = 0
    for batch in _parquet_batches(path, batch_size=1024):
        total += batch.nbytes
        if total > stop_above:
            break
    return max(total, path.stat().st_size)


def _jsonl_rows(path: Path):
    lineno = 0
    try:
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    yield lineno, json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{path}:{lineno}: not valid JSON ({e.msg})") from None
                except (ValueError, RecursionError) as e:  # a number too long to convert, nesting too deep
                    raise DataError(f"{path}:{lineno}: not a usable JSON row ({type(e).__name__}: "
                                    f"{str(e)[:200]})") from None  # fmt: skip
    except UnicodeDecodeError as e:
        raise DataError(f"{path}:{lineno + 1}: not UTF-8 text ({e.reason})") from None


def _parquet_batches(path: Path, **kwargs):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        yield from pq.ParquetFile(path).iter_batches(**kwargs)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{path}: not a readable Parquet file ({str(e)[:200]})") from None


def _row(path: Path, lineno: int, obj, input_key: str, label_key: str | None, metadata_key: str | None,
         tool_key: str | None = None) -> dict:  # fmt: skip
    if not isinstance(obj, dict):
        raise DataError(f"{path}:{lineno}: a row must be a JSON object")
    if input_key not in obj:
        raise DataError(f"{path}:{lineno}: row has no {input_key!r} key (set --input-key)")
    meta = obj.get(metadata_key) if metadata_key else None
    if meta is not None and not isinstance(meta, dict):
        raise DataError(f"{path}:{lineno}: {metadata_key!r} must be a JSON object")
    row = {"prompt": obj[input_key], "label": obj.get(label_key) if label_key else None, "metadata": meta or {}}
    if tool_key is not None:
        tools = obj.get(tool_key)
        if isinstance(tools, str):  # a JSON text (a Parquet string column), as Miles reads it
            try:
                tools = json.loads(tools)
            except ValueError:
                raise DataError(f"{path}:{lineno}: {tool_key!r} is text but not JSON") from None
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise DataError(f"{path}:{lineno}: {tool_key!r} must be a list of tool schemas (objects)")
        row["tools"] = tools
        if tools is not None:
            row["metadata"] = {**row["metadata"], "tools": tools}  # as Miles: custom rewards read them there
    return row


class DataSource(abc.ABC):
    """Miles's data source contract (--data-source-path names a subclass; `cls(config)`):
    `get_samples(num_samples)` returns that many prompt groups (list[list[Sample]]; the first
    sample of each gives the prompt, label and metadata). The buffer draws one group at a time and
    keeps the position durably; a restarted buffer draws again from a fresh instance up to it, so
    a subclass must give the same prompts in the same order (as a dataset read in order does).
    Recycled prompts stay in the buffer's durable queue: `add_samples`, `save` and `load` are
    never called (they are Miles's way to persist what the ledger persists here)."""

    def __init__(self, config):
        self.config = config

    @abc.abstractmethod
    def get_samples(self, num_samples: int) -> list[list[Sample]]: ...

    def add_samples(self, samples: list[list[Sample]]) -> None:
        raise NotImplementedError("asyncrl recycles prompts in the buffer's own durable queue")

    def save(self, rollout_id) -> None:
        return None

    def load(self, rollout_id=None) -> None:
        return None


class PromptSource:
    def __init__(self, config: RunConfig, rows: list[dict]):
        self.config = config
        self.rows = rows
        self.epoch_size = len(rows)  # 0 for a custom source: unknown
        self.n = config.rollout.n_samples_per_prompt
        self._orders: dict[int, list[int]] = {}
        path = config.rollout.buffer_filter_path
        self.buffer_filter = load_object(path, "--buffer-filter-path") if path else None

    def next_release(self, epoch: int, cursor: int, next_group_index: int, recycled: list[PromptMsg]):
        """The next prompt and the cursor after it: a recycled prompt (original group_index,
        attempt + 1) if any, the queue's head or the one --buffer-filter-path picks, else the next
        row. Pure: nothing is mutated."""
        if recycled:
            return msgspec.structs.replace(recycled[self.pick_recycled(recycled)], released_at=time.time()), {}
        epoch, cursor, row_id, row = self._row(epoch, cursor)
        msg = PromptMsg(group_index=next_group_index, prompt=row["prompt"], label=row["label"],
                        metadata=dict(row["metadata"]), tools=row.get("tools"), attempt=0, epoch=epoch, row=row_id,
                        n_samples=self.n, released_at=time.time())  # fmt: skip
        return msg, {"epoch": epoch, "cursor": cursor + 1, "next_group_index": next_group_index + 1}

    def _row(self, epoch: int, cursor: int) -> tuple[int, int, int, dict]:
        if cursor >= len(self.rows):
            epoch, cursor = epoch + 1, 0
        if epoch not in self._orders:
            order = list(range(len(self.rows)))
            if self.config.data.rollout_shuffle:
                random.Random(self.config.data.rollout_seed + epoch).shuffle(order)
            self._orders = {epoch: order}  # one epoch at a time is all we ever need
        row_id = self._orders[epoch][cursor]
        return epoch, cursor, row_id, self.rows[row_id]

    def pick_recycled(self, recycled: list[PromptMsg]) -> int:
        """Which recycled prompt goes next: Miles's buffer filter, `fn(config, rollout_id,
        buffer, num_samples) -> list[list[Sample]]`, given the queue as reset groups (pop_first,
        the head, without one). It must decide from what it is given: the buffer asks again after
        a restart."""
        if self.buffer_filter is None:
            return 0
        groups = [[Sample(index=p.group_index * p.n_samples + i, group_index=p.group_index, prompt=p.prompt,
                          label=p.label, metadata=dict(p.metadata), status=SampleStatus.ABORTED)
                   for i in range(p.n_samples)] for p in recycled]  # fmt: skip
        try:
            picked = self.buffer_filter(for_plugins(self.config), None, groups, 1)
            gi = flatten_group(picked[0])[0].group_index
            return next(i for i, p in enumerate(recycled) if p.group_index == gi)
        except Exception as e:
            raise DataError(f"--buffer-filter-path {self.config.rollout.buffer_filter_path} must return one of the "
                            f"groups it is given ({type(e).__name__}: {e})") from e  # fmt: skip


class CustomPromptSource(PromptSource):
    """Prompts from a --data-source-path DataSource, by position (see DataSource): the cursor
    counts the groups drawn, in one endless epoch."""

    def __init__(self, config: RunConfig, source: DataSource):
        super().__init__(config, [])
        self.source = source
        self.drawn: list[dict] = []

    def _row(self, epoch: int, cursor: int) -> tuple[int, int, int, dict]:
        path = self.config.rollout.data_source_path
        while len(self.drawn) <= cursor:
            groups = self.source.get_samples(1)
            if not groups or not flatten_group(groups[0]):
                raise DataError(f"--data-source-path {path}: get_samples(1) returned no group: the source is exhausted")
            s = flatten_group(groups[0])[0]
            ids = isinstance(s.prompt, list) and all(isinstance(t, int) for t in s.prompt)
            if not (isinstance(s.prompt, str) or ids):
                raise DataError(f"--data-source-path {path}: a sample's prompt must be text or token ids")
            self.drawn.append({"prompt": s.prompt, "label": s.label, "metadata": dict(s.metadata or {})})
        return 0, cursor, cursor, self.drawn[cursor]


def make_prompt_source(config: RunConfig) -> PromptSource:
    if config.rollout.data_source_path:
        cls = load_object(config.rollout.data_source_path, "--data-source-path")
        if not callable(getattr(cls, "get_samples", None)):
            raise DataError(f"--data-source-path {config.rollout.data_source_path} must name a DataSource subclass "
                            "(get_samples(num_samples) -> list[list[Sample]])")  # fmt: skip
        return CustomPromptSource(config, cls(for_plugins(config)))
    if not config.data.prompt_data:
        raise DataError("the buffer needs --prompt-data (the launcher sets it to the task's data)")
    d = config.data
    return PromptSource(config, load_rows(d.prompt_data, d.input_key, d.label_key, d.metadata_key, tool_key=d.tool_key))


def adapter_total_steps(run, rows: int) -> int:
    """A multi-LoRA adapter's step budget (an AdapterRun's spec): num_step, or num_epoch passes
    over its `rows` prompts."""
    if run.spec.num_step is not None:
        return run.spec.num_step
    return max(1, math.ceil((run.spec.num_epoch or 1) * rows / run.spec.rollout_batch_size))
