"""Metric sinks beside the JSONL file: TensorBoard event files and Weights & Biases.

The trainer is their one writer. As in Miles, every series is on its own step axis: a training
step's record (rollout/*, perf/*, train/*, the buffer's metrics) on `rollout/step`, an eval
point's metrics on `eval/step` (the rollout id the point was dispatched at), so eval points land
at the step they evaluate, whenever they finish.

`--use-tensorboard` and `--use-wandb` (one W&B run, set by the --wandb-* flags) turn them on; their
flags' help says where each writes. W&B's API key comes from $WANDB_API_KEY, never from a flag;
`--wandb-mode offline` keeps everything local (`wandb sync` uploads it later).
"""

from __future__ import annotations

import logging
import math
import os
import statistics
from pathlib import Path

log = logging.getLogger(__name__)

EVAL_AXIS = "eval/step"
DEFAULT_AXIS = "rollout/step"


class SinkError(RuntimeError):
    """A sink asked for cannot start (its package is missing); the message says what to install."""


def statistics_of(prefix: str, values: list) -> dict[str, float]:
    """Miles's compute_statistics: <prefix>/{mean,median,max,min}."""
    return {f"{prefix}/mean": sum(values) / len(values), f"{prefix}/median": float(statistics.median(values)),
            f"{prefix}/max": float(max(values)), f"{prefix}/min": float(min(values))}  # fmt: skip


def length_statistics(prefix: str, lengths: list) -> dict[str, float]:
    """statistics_of, plus <prefix>/p99 (the 99th percentile, nearest rank): a long tail of
    response lengths shows as p99 far above the median."""
    ranked = sorted(lengths)
    p99 = ranked[min(len(ranked) - 1, math.ceil(0.99 * len(ranked)) - 1)]
    return {**statistics_of(prefix, lengths), f"{prefix}/p99": float(p99)}


def axis_of(key: str) -> str:
    return EVAL_AXIS if key.startswith("eval/") else DEFAULT_AXIS


def scalars(record: dict) -> dict[str, float]:
    """The finite numbers of a record (booleans as 0/1), without the axes themselves."""
    axes = (DEFAULT_AXIS, EVAL_AXIS)
    return {
        k: float(v) for k, v in record.items() if isinstance(v, (int, float)) and math.isfinite(v) and k not in axes
    }


class TensorBoardSink:
    def __init__(self, config, run_dir: Path):
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as e:
            raise SinkError(f"--use-tensorboard needs the tensorboard package: pip install tensorboard ({e})") from e
        parts = [p for p in (config.trainer.tb_project_name, config.trainer.tb_experiment_name) if p]
        self.dir = Path(os.environ.get("TENSORBOARD_DIR") or run_dir.joinpath("tensorboard", *parts))
        self.dir.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(str(self.dir))
        log.info("TensorBoard event files in %s", self.dir)

    def log(self, values: dict[str, float], axis: str, step: int) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class WandbSink:
    def __init__(self, config, run_dir: Path):
        try:
            import wandb
        except ImportError as e:
            raise SinkError(f"--use-wandb needs the wandb package: pip install wandb ({e})") from e
        if config.trainer.wandb_host:
            os.environ["WANDB_BASE_URL"] = config.trainer.wandb_host
        directory = Path(config.trainer.wandb_dir or run_dir)
        directory.mkdir(parents=True, exist_ok=True)
        self.run = wandb.init(
            project=config.trainer.wandb_project or "asyncrl",
            group=config.trainer.wandb_group,
            entity=config.trainer.wandb_team,
            name=config.infra.run_id,
            id=config.trainer.wandb_run_id,
            resume="allow" if config.trainer.wandb_run_id else None,
            mode=config.trainer.wandb_mode,
            dir=str(directory),
            config=config.model_dump(mode="json"),  # secrets are excluded from the dump
        )
        for axis in (DEFAULT_AXIS, EVAL_AXIS):
            self.run.define_metric(axis)
        self.run.define_metric("eval/*", step_metric=EVAL_AXIS)
        for prefix in ("rollout/*", "perf/*", "train/*"):
            self.run.define_metric(prefix, step_metric=DEFAULT_AXIS)
        log.info("W&B run %s (%s mode) in %s", self.run.id, config.trainer.wandb_mode or "online", directory)

    def log(self, values: dict[str, float], axis: str, step: int) -> None:
        self.run.log({**values, axis: step})

    def close(self) -> None:
        self.run.finish()


def finite_record(record: dict) -> tuple[dict, list[str]]:
    """The record with every non-finite number (NaN, inf) replaced by None, and their keys:
    metrics never record a non-finite value (JSON has none, and a curve would hide it)."""
    bad = [k for k, v in record.items() if isinstance(v, float) and not math.isfinite(v)]
    return ({**record, **dict.fromkeys(bad)} if bad else record), bad


class Sinks:
    """The sinks the config asks for; `log(record, axis)` writes a record's numbers at the
    record's own value of `axis`."""

    def __init__(self, config, run_dir: Path):
        wanted = {TensorBoardSink: config.trainer.use_tensorboard, WandbSink: config.trainer.use_wandb}
        self.sinks = [sink(config, run_dir) for sink, on in wanted.items() if on]

    def log(self, record: dict, axis: str) -> None:
        """The record's series that live on `axis` (a step record also carries the eval
        metrics that arrived since the last step: those were logged on eval/step already)."""
        values = {k: v for k, v in scalars(record).items() if axis_of(k) == axis}
        step = int(record[axis])
        for sink in self.sinks:
            try:
                sink.log(values, axis, step)
            except Exception as e:  # a sink's hiccup never stops training; the JSONL file has it all
                log.warning("%s: logging step %d failed: %s", type(sink).__name__, step, e)

    def close(self) -> None:
        for sink in self.sinks:
            try:
                sink.close()
            except Exception as e:
                log.warning("%s: close failed: %s", type(sink).__name__, e)
        self.sinks = []
