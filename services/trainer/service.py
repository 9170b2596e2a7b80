"""Trainer service: pulls leases of groups, trains, publishes weight versions.

Consumes: group references from the buffer (`buffer.get`, request/reply, idempotent per step)
  and their payloads from ROLLOUTS (direct get by sequence); EvalResult messages (logged with
  the next step); producer heartbeats (to fail loudly when every producer is gone).
Produces: HF safetensors snapshots under <run_dir>/weights/v<N> and WeightsPublished every
  --update-weights-interval steps; BufferCommit after each step; EvalRequest when due; one
  JSONL record per step in <run_dir>/metrics.jsonl and on `progress`; a final `done` record.

One loop (services.trainer.loop) trains the mode chosen here: the model under the run's driver
(services.trainer.model_mode), or adapters on a frozen base with --multi-lora-n-adapters
(services.trainer.multi_lora). This service holds what both share.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from pathlib import Path

import torch

from asyncrl_proto import Heartbeat, decode
from asyncrl_proto.codec import MalformedMessage
from services.common.config import (
    AsyncSection,
    DataSection,
    EvalSection,
    MultiLoraSection,
    RolloutSection,
    TrainerSection,
)
from services.common.promexport import LATENCY_BUCKETS_S
from services.common.runtime import Service
from services.common.sinks import Sinks
from services.common.validate import Limits
from services.trainer.loop import TrainLoop
from services.trainer.setup import build_model, loss_config
from services.trainer.steps import BufferLink, Records, SampleCheck, SampleRecorder

log = logging.getLogger(__name__)

NOT_EXPORTED = frozenset({"step", "rollout/step", "weight_version", "time", "rollout/fully_async/queue_size",
                          "rollout/fully_async/buffer_avg_staleness", "rollout/fully_async/buffer_max_staleness"})  # fmt: skip
"""Step record keys left out of the trainer's /metrics: the step and version are trainer/step and
trainer/weight_version; the buffer's gauges (what it holds now) are the buffer's to export, and
the trainer's copies (what it held when this step's lease completed) would give one name two meanings."""


class TrainerService(Service):
    name = "trainer"
    reads = (DataSection, RolloutSection, AsyncSection, TrainerSection, EvalSection, MultiLoraSection)
    histograms = {
        "trainer/step_seconds": ("Seconds per training step, its batch in hand to its records (perf/step_time_s)",
                                 LATENCY_BUCKETS_S),
        "trainer/rollout_wait_seconds": ("Seconds each step waited for its batch (perf/rollout_wait_s)",
                                         LATENCY_BUCKETS_S),
    }  # fmt: skip

    def __init__(self, config, bus, **kw):
        super().__init__(config, bus, **kw)
        config = self.config  # its own sections from here on (services.common.config.view)
        torch.set_num_threads(config.infra.torch_num_threads)
        torch.manual_seed(config.data.seed)
        self.run_dir = Path(config.infra.run_dir)
        self.model = build_model(config)
        self.loss_cfg = loss_config(config)
        self.sinks = Sinks(config, self.run_dir)
        self.records = Records(self.run_dir / "metrics.jsonl", self.sinks, bus)
        self.link = BufferLink(bus, config.async_.buffer_timeout_s)
        self.pad_id = self.model.cfg.pad_token_id if self.model.cfg.pad_token_id is not None else 0
        self.check = SampleCheck(Limits(n=config.rollout.n_samples_per_prompt, vocab_size=self.model.cfg.vocab_size,
                                        context_length=self.model.cfg.max_position_embeddings,
                                        reward_key=config.rollout.reward_key,
                                        max_abs_reward=config.rollout.max_abs_reward),
                                 self.loss_cfg)  # fmt: skip
        self.samples = SampleRecorder(config.data.hf_checkpoint, config.rollout.reward_key,
                                      config.trainer.keep_sample_records)  # fmt: skip
        self.last_producer_seen = time.monotonic()
        self.dp = None
        """--trainer-num-ranks K > 1: ranks 1..K-1 (services.trainer.ranks), once they have joined."""
        if config.multi_lora.n_adapters > 0:  # adapters on the frozen base, their own optimizer
            from services.trainer.multi_lora import AdapterTraining

            self.mode = AdapterTraining(self)
        else:
            from services.trainer.model_mode import ModelTraining

            self.mode = ModelTraining(self)
        self.loop = TrainLoop(self.mode, self.records, self.samples, lifecycle=self)

    async def setup(self) -> None:
        (self.run_dir / "weights").mkdir(parents=True, exist_ok=True)
        await self.mode.setup()
        await self.bus.subscribe(self.bus.subjects.heartbeat("rollout"), self._on_producer_heartbeat)

    async def start_ranks(self, optimizer, ref_model) -> None:
        """--trainer-num-ranks K > 1: ranks 1..K-1 started and joined (services.trainer.ranks)."""
        if self.config.trainer.num_ranks <= 1:
            return
        cfg_file = self.run_dir / "trainer-config.json"
        cfg_file.write_text(json.dumps(self.config.model_dump(mode="json")))
        from services.trainer.ranks import DataParallel

        self.dp = await asyncio.to_thread(DataParallel, self.config, self.model, optimizer, ref_model, self.pad_id,
                                          cfg_file, self.run_dir / "logs")  # fmt: skip
        log.info("data parallel over %d ranks (%s)", self.config.trainer.num_ranks, self.dp.backend)

    def loops(self):
        return {"train": self.loop.run}

    async def teardown(self) -> None:
        self.sinks.close()
        await self.mode.stop()
        if self.dp is not None:
            await asyncio.to_thread(self.dp.stop)

    async def _on_producer_heartbeat(self, msg) -> None:
        with contextlib.suppress(MalformedMessage):
            if not decode(msg.data, Heartbeat).info.get("stopping"):  # a last word is no sign of life
                self.last_producer_seen = time.monotonic()

    def status(self) -> dict:
        return {**self.mode.status(), "last_record": self.records.last}

    def metric_values(self) -> dict[str, float]:
        last = {k: v for k, v in self.records.last.items() if isinstance(v, (int, float)) and k not in NOT_EXPORTED}
        return {"trainer/invalid_samples_total": self.check.num_invalid, **self.mode.metric_values(), **last}
