from __future__ import annotations

from typing import Literal

from pydantic import Field

from services.common.config.base import Section


class AsyncSection(Section):
    """The buffer, the modes and weight updates (buffer, weight-sync, producers, trainer)."""

    max_weight_staleness: int | None = Field(
        None,
        ge=0,
        json_schema_extra={"hint": "leave it unset to disable the staleness filter"},
        description="Reject a group at get() when current version - oldest version > this. Unset: never filter.",
    )
    data_buffer_capacity_factor: float = Field(
        2.0,
        gt=0,
        json_schema_extra={"hint": "the default 2.0 holds two steps of groups"},
        description="Buffer capacity = floor(factor * rollout batch size) stored groups.",
    )
    unused_samples_handler: Literal["drop", "retry"] = Field(
        "drop", description="What happens to aborted and stale groups: drop, or retry the prompt."
    )
    max_concurrent_samples: int | None = Field(
        None, description="In-flight cap in samples (>= n); groups = max(1, this // n). Default B groups."
    )
    rollout_submission_granularity: Literal["sample", "group"] | None = Field(
        None,
        description="sample: a slot frees per finished trajectory; group: per finished group. "
        "Default: sample under --fully-async, group otherwise.",
    )
    update_weights_interval: int = Field(1, ge=1, description="Push weights every this many steps.")
    pause_generation_mode: Literal["retract", "in_place", "abort"] = Field(
        "retract", description="How engines pause for a weight update."
    )
    flush_cache_timeout_s: float = Field(
        60.0,
        gt=0,
        description="A paused engine that refuses /flush_cache is asked again every second for this long (Miles: "
        "60 s); then its weight update is abandoned and it resumes on its old weights (never new weights over an "
        "old cache).",
    )
    update_weight_transfer_mode: Literal["disk", "object-store", "distributed"] = Field(
        "disk",
        description="How weights reach the engines. disk: snapshots under <run_dir>/weights (a shared filesystem); "
        "object-store: the run's NATS Object Store bucket, fetched by each engine (no shared disk; built-in engines); "
        "distributed: SGLang's init_weights_update_group + update_weights_from_distributed, the trainer "
        "broadcasting to every engine (gloo on CPU, NCCL on GPU; no disk or bucket on the way). Multi-LoRA "
        "adapter versions go through the bucket with object-store, and with distributed on built-in engines; by disk "
        "otherwise.",
    )
    update_weight_master_address: str = Field(
        "",
        description="distributed: the trainer's address the engines reach (its transfer group's TCP store and "
        "gloo/NCCL). Default: the node address a Ray placement gives the trainer, else the trainer host's address "
        "on its route to the NATS server (127.0.0.1 with the embedded server).",
    )
    update_weight_buffer_size: int = Field(
        512 * 1024**2,
        ge=4096,
        description="Bytes per transfer unit: object-store chunks are this size, capped at half the NATS server's "
        "max_payload (1 MiB by default, so 512 KiB chunks); distributed updates send this many bytes of tensors per "
        "update_weights_from_distributed call.",
    )
    colocate: bool = Field(
        False,
        description="Miles's shared training/rollout devices. Not supported (training and rollout are separate "
        "processes on separate devices, with no offload between them): rejected with a message.",
    )
    partial_rollout: bool = Field(
        False,
        description="Miles's resumption of aborted samples. Not supported (an aborted group is regenerated "
        "whole, --async-unused-samples-handler retry): rejected with a message.",
    )
    submission_pause_max_s: float = Field(
        600.0,
        gt=0,
        description="A pause of submission sent over NATS (an eval point on the shared engines) ends at most this "
        "long after it began, however often it is renewed; production then resumes while the eval goes on.",
    )
    submission_pause_budget: float = Field(
        0.1,
        ge=0,
        le=1,
        description="Pauses of submission sent over NATS (the eval role's, whatever their tokens) hold production for "
        "at most this share of any --submission-pause-window-s: past it every such pause ends and new ones are refused "
        "until the window has room again (docs/trust.md gives the worst case).",
    )
    submission_pause_window_s: float = Field(
        600.0, gt=0, description="The sliding window over which --submission-pause-budget is counted."
    )
    rollout_health_check_interval: float = Field(
        30.0, ge=0, description="Producers poll every engine's /health_generate this often (0 = never)."
    )
    rollout_health_check_timeout: float = Field(
        30.0, gt=0, description="An engine whose /health_generate takes longer than this is unhealthy."
    )
    prompt_ack_wait_s: float = Field(
        30.0, gt=0, description="A producer that holds a prompt this long without a heartbeat loses it to another."
    )
    prompt_deadline_s: float = Field(
        900.0,
        gt=0,
        description="A released prompt neither answered nor named in work by a live producer's heartbeat for this "
        "long goes back to the prompts (a new attempt, on the ledger): a producer that took it and died or forgot it "
        "cannot hang the run.",
    )
    stall_report_s: float = Field(
        300.0,
        gt=0,
        description="No step progress while the trainer waits for 10 x the run's median step (at least 30 s), and at "
        "most this long: the buffer names the cause in its log, /status (`stalled`) and /healthz (still 200); when "
        "prompts are unanswered and a producer has room, those no live producer names in work go back after this "
        "long.",
    )
    producer_timeout_s: float = Field(
        60.0,
        gt=0,
        description="The trainer fails loudly when no producer heartbeat arrives for this long while it waits.",
    )
    buffer_timeout_s: float = Field(
        60.0, gt=0, description="The trainer fails loudly when the buffer service does not answer for this long."
    )
    rollout_wait_warn_s: float = Field(
        30.0, gt=0, description="Trainer warns 'No completed rollout groups for ...' after this long."
    )
