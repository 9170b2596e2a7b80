"""Every trained sample, kept: RUN_DIR/samples/<step>.json.gz, one file per trained step.

Written by the trainer before the step's commit (so a committed step always has its record; a
step trained again after a restart writes it again), read by `asyncrl dashboard` and `asyncrl
status`. A record holds the step's groups as the trainer saw them:

    {"step", "version" (the weights it trained from), "written_at",
     "groups": [{"group_index", "group_id", "staleness", "prompt", "label",
                 "samples": [{"index", "reward", "advantage", "status", "fate", "weight_versions",
                              "response_length", "segments": [[text, version, loss_mask], ...]}]}]}

A sample's `segments` split its response where the weight version or the loss mask changes:
each is the text of those tokens, the version that generated them (None for an environment's
or a tool's tokens, or an engine that reports no version) and their loss mask. `fate` is
trained, removed (kept for the advantages, out of the loss) or failed (out of both).
`--keep-sample-records N` keeps the newest N steps (gzip: about 20 bytes a sample of the default
job, so 10,000 steps x 128 samples is about 25 MB; long responses cost their compressed text);
0 keeps none. `version` is the newest weight version published before the step: the weights it
trained from with --update-weights-interval 1.
"""

from __future__ import annotations

import gzip
import itertools
import json
import time
from pathlib import Path
from typing import Any

from asyncrl_proto.messages import SampleStatus, flatten_group
from services.common.procs import replace_file

DIR = "samples"
MAX_TEXT = 20_000
"""Characters of a prompt or a segment kept (a record is for reading, not for replay)."""


def records_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / DIR


def _path(run_dir: str | Path, step: int) -> Path:
    return records_dir(run_dir) / f"{step:08d}.json.gz"


def _text(x: Any) -> str:
    s = x if isinstance(x, str) else json.dumps(x, default=str)
    return s if len(s) <= MAX_TEXT else s[:MAX_TEXT] + f"... ({len(s) - MAX_TEXT} more characters)"


def segments(sample, decode) -> list[list]:
    """[text, version or None, loss mask] runs of a sample's response tokens."""
    n = sample.response_length
    if not n:
        return [[_text(sample.response), None, 1]] if sample.response else []
    ids = sample.tokens[-n:]
    mask = sample.loss_mask if sample.loss_mask is not None and len(sample.loss_mask) == n else [1] * n
    version: list[int | None] = [None] * n
    for start, end, v in sample.version_spans:
        version[max(0, start) : min(n, end)] = [v] * (min(n, end) - max(0, start))
    if not sample.version_spans and len(set(sample.weight_versions)) == 1:  # an engine without spans
        version = [sample.weight_versions[0] if m else None for m in mask]
    runs = [list(r) for _, r in itertools.groupby(range(n), key=lambda i: (version[i], mask[i]))]
    return [[_text(decode(ids[r[0] : r[-1] + 1])), version[r[0]], int(mask[r[0]])] for r in runs]


def step_record(step: int, version: int, groups: list[list], advantages: dict[int, float],
                refs: dict[int, Any], decode) -> dict:  # fmt: skip
    """The record of one step. `advantages`: by id() of each sample; `refs`: the lease's GroupRef
    by group index (its group id and staleness)."""
    out = []
    for g in groups:
        flat = flatten_group(g)
        first = flat[0]
        ref = refs.get(first.group_index)
        out.append({
            "group_index": first.group_index,
            "group_id": getattr(ref, "group_id", None),
            "staleness": getattr(ref, "staleness", None),
            "prompt": _text(first.prompt),
            "label": _text(first.label) if first.label is not None else None,
            "samples": [{
                "index": s.index,
                "reward": s.reward,
                "advantage": advantages.get(id(s)),
                "status": s.status.value,
                "fate": "failed" if s.status == SampleStatus.FAILED else "removed" if s.remove_sample else "trained",
                "weight_versions": list(s.weight_versions),
                "response_length": s.response_length,
                "segments": segments(s, decode),
            } for s in flat],
        })  # fmt: skip
    return {"step": step, "version": version, "written_at": time.time(), "groups": out}


def write(run_dir: str | Path, record: dict, keep: int) -> None:
    """Store one step's record (atomically: a kill leaves the old file or the new one) and delete
    the one that falls out of the newest `keep` steps."""
    if keep <= 0:
        return
    records_dir(run_dir).mkdir(parents=True, exist_ok=True)
    path = _path(run_dir, record["step"])
    replace_file(path, gzip.compress(json.dumps(record, separators=(",", ":")).encode(), compresslevel=5))
    _path(run_dir, record["step"] - keep).unlink(missing_ok=True)


def drop_after(run_dir: str | Path, last_step: int) -> None:
    """Steps after `last_step` are trained again (a restarted trainer): drop their records."""
    for p in records_dir(run_dir).glob("*.json.gz"):
        if int(p.name.split(".")[0]) > last_step:
            p.unlink(missing_ok=True)


def steps(run_dir: str | Path) -> list[int]:
    """The steps that have a record, in order."""
    return sorted(int(p.name.split(".")[0]) for p in records_dir(run_dir).glob("*.json.gz"))


def read(run_dir: str | Path, step: int) -> dict | None:
    """One step's record, or None (never recorded, pruned, or torn)."""
    try:
        return json.loads(gzip.decompress(_path(run_dir, step).read_bytes()))
    except (OSError, EOFError, ValueError):
        return None
