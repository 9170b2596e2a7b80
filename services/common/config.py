"""The run configuration: one typed model holding every flag under its snake_case name.

Flags use Miles's names in kebab case on the command line (`--rollout-batch-size`). Precedence:
defaults < config file (YAML/JSON/TOML) < environment (`ASYNCRL_<NAME>`) < command line. The
resolved config is stored in the run's KV bucket so that every service reads the same one.
This module imports no torch.
"""

from __future__ import annotations

import math
import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from asyncrl_proto.subjects import check_run_id


class ConfigError(ValueError):
    """A flag combination that cannot work; the message says what to set instead."""


class Section(BaseModel):
    """A group of flags, typed, each with its description; its cross-flag rules are its
    `problems()` (they may read flags of other sections: every rule runs on the whole RunConfig).
    A one-flag rule is a bound on the field itself (ge / gt / le, and a `hint` that says what to do)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=False, allow_inf_nan=False)

    def problems(self) -> list[str]:
        return []


class InfraSection(Section):
    """The run and its infrastructure: ids, the bus, HTTP, engines, processes (launcher, every service)."""

    driver: Literal["sync", "async"] = Field(
        "async",
        description="Set by the command: `train` is the synchronous driver, `train-async` the "
        "one-step / fully-async driver.",
    )
    fully_async: bool = Field(
        False, description="Fully async: producers fill the buffer continuously (train-async only)."
    )
    run_id: str | None = Field(
        None, description="Run id used in every NATS name; default: derived from the start time."
    )
    run_dir: str | None = Field(
        None,
        description="Directory for snapshots, checkpoints, metrics and logs; default runs/<run-id>.",
    )
    nats_url: str | None = Field(
        None,
        description="NATS server to use (nats:// or tls://). Unset: start an embedded nats-server with "
        "JetStream on a free port of 127.0.0.1, its store under the run directory, one generated identity "
        "per service role. Credentials in the URL are moved to --nats-user / --nats-password (never stored).",
    )
    nats_user: str | None = Field(
        None,
        exclude=True,
        description="NATS user (with --nats-password) of the launcher and, unless "
        "--nats-roles-file gives each role its own identity, of every service.",
    )
    nats_password: SecretStr | None = Field(
        None,
        exclude=True,
        description="NATS password. Secret: prefer $ASYNCRL_NATS_PASSWORD; never stored, "
        "printed or put on a child's command line.",
    )
    nats_token: SecretStr | None = Field(
        None,
        exclude=True,
        description="NATS token. Secret: prefer $ASYNCRL_NATS_TOKEN; never stored or printed.",
    )
    nats_creds: str | None = Field(
        None, exclude=True, description="NATS user credentials file (.creds: JWT and NKey seed)."
    )
    nats_nkey: str | None = Field(None, exclude=True, description="NATS NKey seed file.")
    nats_roles_file: str | None = Field(
        None,
        exclude=True,
        description="JSON file with one NATS identity per role for a server with per-role "
        "permissions: {role: {user, password} | {token} | {creds} | {nkey}}, roles admin (launcher), buffer, "
        "trainer, rollout, weight-sync, eval, and adapters with --multi-lora-n-adapters (`asyncrl secrets` writes one, "
        "with the matching server config).",
    )
    nats_tls_ca: str | None = Field(
        None, exclude=True, description="TLS: CA bundle that signs the NATS server's certificate (use a tls:// URL)."
    )
    nats_tls_cert: str | None = Field(None, exclude=True, description="TLS: client certificate (mutual TLS).")
    nats_tls_key: str | None = Field(None, exclude=True, description="TLS: client key (mutual TLS).")
    nats_max_file_store: int | None = Field(
        None,
        gt=0,
        description="Embedded nats-server: cap on its JetStream store, in bytes (unset: the server's "
        "default, most of the disk). A full store stops the run with an error that names it.",
    )
    nats_sync: str | None = Field(
        None,
        description="Embedded nats-server: how often JetStream fsyncs its store, `always` (every write: "
        "nothing acknowledged is lost even when the machine crashes) or an interval like 1s (a machine crash may "
        "lose that much). Unset: the server's default, 2m. A process crash never loses an acknowledged write.",
    )
    nats_cluster: int = Field(
        1,
        ge=1,
        le=7,
        description="Embedded NATS: start this many nats-server nodes joined into one JetStream cluster on "
        "loopback ports (3 survives the loss of any one node; 2 would lose its quorum with either). 1: one server. "
        "Not with --nats-url (a cluster of your own: set --nats-replicas to its size).",
    )
    nats_replicas: int | None = Field(
        None,
        ge=1,
        le=5,
        description="Replicas of every stream and the KV bucket of the run (JetStream's num_replicas). "
        "Unset: 3 on an embedded cluster of 3 or more nodes, else 1. On a NATS cluster of your own (--nats-url), "
        "set it to that cluster's size (at most 5).",
    )
    run_token: SecretStr | None = Field(
        None,
        exclude=True,
        description="The run token: `Authorization: Bearer <token>` on every protected HTTP "
        "route of the services and the built-in engines. Secret: prefer $ASYNCRL_RUN_TOKEN; generated when unset "
        "and kept in <run_dir>/secrets/run-token (mode 0600).",
    )
    http_auth_probes: bool = Field(
        False,
        description="Also require the run token on /metrics, /healthz and /readyz (open by default, for "
        "probes and scrapers).",
    )
    health_restart_s: float = Field(
        60.0,
        ge=0,
        description="The launcher restarts a service or engine whose health check has failed for this "
        "long (0: only when it exits).",
    )
    max_failed_ratio: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Stop the run with the cause when more than this share of the samples of "
        "the last 4 steps FAILED (a reward function that raises, a non-finite reward, a generation that "
        "failed every retry). 1 never stops.",
    )
    engine: Literal["builtin", "sglang"] = Field(
        "builtin", description="Inference engines: asyncrl's built-in CPU/GPU engine or SGLang."
    )
    rollout_num_engines: int = Field(1, ge=0, description="Number of engines the launcher starts.")
    rollout_external_engine_addrs: list[str] = Field(
        default_factory=list,
        description="Attach to running engines (host:port or URLs) instead of launching any.",
    )
    rollout_engine_urls: list[str] = Field(
        default_factory=list,
        description="Resolved engine URLs (set by the launcher from the engines it started or "
        "from --rollout-external-engine-addrs); producers and weight-sync use these.",
    )
    rollout_num_gpus_per_engine: int = Field(
        1,
        ge=1,
        description="SGLang engines: GPUs per engine (its tensor-parallel size unless --sglang-tp-size says otherwise).",
    )
    use_sglang_router: bool = Field(
        False, description="SGLang engines: launch the SGLang router in front of them; producers generate through it."
    )
    sglang_server_args: list[str] = Field(
        default_factory=list,
        description="Extra `sglang.launch_server` arguments, collected from every --sglang-<flag> on the "
        "command line (e.g. --sglang-mem-fraction-static 0.5 -> --mem-fraction-static 0.5).",
    )
    sglang_router_args: list[str] = Field(
        default_factory=list,
        description="Extra router arguments, collected from every --router-<flag> (e.g. --router-policy cache_aware).",
    )
    rollout_router_url: str | None = Field(
        None, description="Resolved router URL (set by the launcher); producers send /generate there when set."
    )
    rollout_num_producers: int = Field(
        1, ge=0, description="Rollout producer processes the launcher starts (more can join at any time)."
    )
    engine_max_running_requests: int = Field(
        256, ge=1, description="Built-in engine: requests decoded together in one running batch."
    )
    service_restarts: int = Field(
        3,
        ge=0,
        description="The launcher restarts a crashed service (or its nats-server) up to this many times "
        "within --restart-window-s.",
    )
    restart_window_s: float = Field(
        600.0, gt=0, description="Restarts older than this no longer count against --service-restarts."
    )
    pin_cpus: bool = Field(
        False,
        description="Pin the built-in engines to the lower half of the CPUs and the trainer to the upper half, "
        "so that generation and training do not take cores from each other (as on separate GPUs).",
    )
    torch_num_threads: int = Field(1, ge=1, description="torch intra-op threads per torch process (engine, trainer).")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Log level.")

    def problems(self) -> list[str]:
        errs = []
        if self.nats_sync is not None and not re.fullmatch(r"always|\d+(ms|s|m|h)", self.nats_sync):
            errs.append(f"--nats-sync must be `always` or an interval like 500ms, 1s, 2m (got {self.nats_sync!r})")
        if self.nats_cluster == 2:
            errs.append("--nats-cluster 2 loses its JetStream quorum when either node stops: use 3 (or 1)")
        if not self.nats_url and self.nats_replicas and self.nats_replicas > self.nats_cluster:
            errs.append(f"--nats-replicas {self.nats_replicas} needs as many NATS nodes: add --nats-cluster "
                        f"{max(3, self.nats_replicas)} (the embedded server is {self.nats_cluster} node(s))")  # fmt: skip
        if self.nats_tls_key and not self.nats_tls_cert:
            errs.append("--nats-tls-key needs --nats-tls-cert (the client certificate it belongs to)")
        if self.rollout_num_engines < 1 and not self.rollout_external_engine_addrs:
            errs.append("--rollout-num-engines must be >= 1 unless --rollout-external-engine-addrs is set")
        return errs

    @property
    def stream_replicas(self) -> int:
        """Replicas of the run's streams and buckets: --nats-replicas, else 3 on an embedded
        cluster (one node may die), else 1."""
        if self.nats_replicas is not None:
            return self.nats_replicas
        return 3 if self.nats_cluster >= 3 else 1


class DataSection(Section):
    """The model and the prompts (launcher, buffer, producers, trainer)."""

    task: Literal["reverse-digits"] = Field(
        "reverse-digits",
        description="Bundled verifiable task: supplies prompts, held-out prompts and the reward "
        "when --prompt-data / --rm-type are not given, and the tiny model when --hf-checkpoint is unset.",
    )
    hf_checkpoint: str | None = Field(
        None,
        description="Hugging Face model directory (config, safetensors, tokenizer). Unset: build the "
        "task's tiny model locally, no download.",
    )
    warmup_sft_steps: int = Field(
        20,
        ge=0,
        description="Supervised warm-start steps applied when the tiny model is built (0 = none); the "
        "held-out reward after it is reported as step 0.",
    )
    prompt_data: str | None = Field(None, description="JSONL file of prompts.")
    input_key: str = Field("prompt", description="JSONL key of the prompt.")
    label_key: str | None = Field("label", description="JSONL key of the label.")
    metadata_key: str | None = Field("metadata", description="JSONL key of per-prompt metadata.")
    apply_chat_template: bool = Field(False, description="Format prompts with the tokenizer's chat template.")
    rollout_shuffle: bool = Field(False, description="Shuffle prompts every epoch.")
    rollout_seed: int = Field(42, ge=0, description="Seed for prompt shuffling and sampling.")
    seed: int = Field(1234, ge=0, description="Seed for model init and the trainer.")


class RolloutSection(Section):
    """Generation and rewards (producers; the buffer reads B and n)."""

    rollout_batch_size: int = Field(
        16,
        ge=1,
        description="B: prompt groups per training step. Required on the command line (or in --config), as in "
        "Miles; the default only serves configs built in code.",
    )
    n_samples_per_prompt: int = Field(1, ge=1, description="n: trajectories per prompt group (GRPO wants several).")
    rollout_max_response_len: int = Field(8, ge=1, description="max_new_tokens of every generation.")
    rollout_temperature: float = Field(1.0, ge=0, description="Sampling temperature.")
    rollout_top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling p.")
    rollout_top_k: int = Field(-1, description="Top-k sampling (-1: whole vocabulary).")
    rollout_stop_token_ids: list[int] = Field(default_factory=list, description="Stop token ids in addition to EOS.")
    num_rollout: int | None = Field(None, ge=1, description="Training steps to run (a run needs this or --num-epoch).")
    num_epoch: int | None = Field(
        None,
        ge=1,
        description="Epochs over --prompt-data when --num-rollout is unset: (prompts // B) x this steps.",
    )
    num_rollout_per_epoch: int | None = Field(
        None,
        ge=1,
        description="Steps per epoch (prompts // B), set by the launcher when --num-epoch gives the run's length: "
        "every epoch's last step is then also a save and eval point, as in Miles.",
    )
    rm_type: str | None = Field(None, description="Built-in reward; default: the task's reward (reverse-digits).")
    reward_key: str | None = Field(None, description="Key to read when a reward is a dict.")
    max_abs_reward: float = Field(
        1e6,
        gt=0,
        le=1e30,
        description="Rewards must lie in [-this, this]: a sample whose reward is outside fails (producer) or is "
        "rejected (buffer), so no accepted reward overflows the advantages or the loss.",
    )
    custom_rm_path: str | None = Field(
        None, description="module.fn: async fn(config, sample) -> float (group fn with --group-rm)."
    )
    group_rm: bool = Field(False, description="--custom-rm-path scores a whole group at once.")
    custom_generate_function_path: str | None = Field(
        None, description="module.fn: async fn(config, sample, engine, sampling_params)."
    )
    sglang_server_concurrency: int = Field(
        512,
        ge=1,
        description="Generate requests a producer keeps in flight per engine at most (Miles's per-server "
        "semaphore; through a router, this times --rollout-num-engines). Ours, never passed to SGLang.",
    )
    rollout_function_path: str | None = Field(
        None,
        description="Miles's custom rollout loop. Not supported: the producer owns the loop in every mode, so "
        "it is rejected with what to use instead (--custom-generate-function-path, --custom-rm-path).",
    )
    dynamic_sampling_filter_path: str | None = Field(
        None,
        description="module.fn: fn(config, group) -> DynamicFilterOutput | bool, applied at put.",
    )
    rollout_sample_filter_path: str | None = Field(
        None, description="module.fn: fn(config, batch) marking remove_sample, applied per step."
    )
    over_sampling_batch_size: int | None = Field(
        None,
        ge=1,
        description="Sync and one-step drivers: release prompts in multiples of this (>= B) whenever fewer than "
        "the step's B groups are done or in flight, as Miles's rollout over-samples for dynamic filtering. "
        "Leftover groups are trained by the next step (Miles discards them). Unset: exactly what is missing.",
    )
    data_source_path: str | None = Field(
        None,
        description="module.Class: a services.api.DataSource subclass (Miles's get_samples(num_samples)) that "
        "replaces --prompt-data; it must give the same prompts in the same order from a fresh instance (needs "
        "--num-rollout).",
    )
    buffer_filter_path: str | None = Field(
        None,
        description="module.fn: fn(config, rollout_id, buffer, num_samples) -> list[list[Sample]] picks which "
        "recycled prompt group is released next (default: the oldest).",
    )
    rollout_all_samples_process_path: str | None = Field(
        None,
        description="module.fn: fn(config, all_samples, data_source) once per step with every group generated for "
        "it, those the dynamic filter dropped included (train and one-step train-async; data_source is None).",
    )
    custom_async_data_buffer_path: str | None = Field(
        None, description="module.Class: a DataBuffer subclass replacing the default buffer."
    )

    def problems(self) -> list[str]:
        errs = []
        if any(t < 0 for t in self.rollout_stop_token_ids):
            errs.append(f"--rollout-stop-token-ids must be token ids >= 0 (got {self.rollout_stop_token_ids})")
        if self.over_sampling_batch_size is not None and self.over_sampling_batch_size < self.rollout_batch_size:
            errs.append(
                f"--over-sampling-batch-size ({self.over_sampling_batch_size}) must be >= --rollout-batch-size "
                f"({self.rollout_batch_size})"
            )
        if self.rollout_all_samples_process_path is not None and self.fully_async:
            errs.append("--fully-async does not support --rollout-all-samples-process-path")
        if self.over_sampling_batch_size is not None and self.fully_async:
            errs.append(
                "--over-sampling-batch-size applies to the train and one-step train-async drivers: under "
                "--fully-async the producers keep the buffer full instead; drop it"
            )
        if self.rollout_top_k != -1 and self.rollout_top_k < 1:
            errs.append(f"--rollout-top-k must be -1 or >= 1 (got {self.rollout_top_k})")
        return errs


class AsyncSection(Section):
    """The buffer, the modes and weight updates (buffer, weight-sync, producers, trainer)."""

    max_weight_staleness: int | None = Field(
        None,
        ge=0,
        json_schema_extra={"hint": "leave it unset to disable the staleness filter"},
        description="Reject a group at get() when current version - oldest version > this. Unset: never filter.",
    )
    async_data_buffer_capacity_factor: float = Field(
        2.0,
        gt=0,
        json_schema_extra={"hint": "the default 2.0 holds two steps of groups"},
        description="Buffer capacity = floor(factor * rollout batch size) stored groups.",
    )
    async_unused_samples_handler: Literal["drop", "retry"] = Field(
        "drop", description="What happens to aborted and stale groups: drop, or retry the prompt."
    )
    async_max_concurrent_samples: int | None = Field(
        None,
        description="In-flight cap in samples (>= n); groups = max(1, this // n). Default B groups.",
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
    rollout_health_check_interval: float = Field(
        30.0, ge=0, description="Producers poll every engine's /health_generate this often (0 = never)."
    )
    rollout_health_check_timeout: float = Field(
        30.0, gt=0, description="An engine whose /health_generate takes longer than this is unhealthy."
    )
    prompt_ack_wait_s: float = Field(
        30.0,
        gt=0,
        description="A producer that holds a prompt this long without a heartbeat loses it to another.",
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
        description="No step progress for this long while the trainer waits: the buffer names the cause in its log "
        "and /status (`stalled`); when prompts are unanswered and a producer has room, those no live producer names in "
        "work go back then.",
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

    def problems(self) -> list[str]:
        errs = []
        if self.update_weight_transfer_mode == "object-store" and getattr(self, "engine", "builtin") == "sglang":
            errs.append(
                "--update-weight-transfer-mode object-store needs the built-in engine, which fetches weights from the "
                "bucket itself; an SGLang server loads from disk only: use --update-weight-transfer-mode disk"
            )
        if self.fully_async and self.driver == "sync":
            errs.append("--fully-async requires the async driver: run train-async")
        if self.fully_async:
            if self.pause_generation_mode == "abort":
                errs.append(
                    "--fully-async cannot use --pause-generation-mode abort: generation is always in "
                    "flight, so every weight update would kill it and force a full regeneration"
                )
            if self.colocate:
                errs.append(
                    "--fully-async cannot be combined with --colocate: training and rollout must run "
                    "on separate devices so that generation never stops; drop --colocate"
                )
            if self.partial_rollout:
                errs.append(
                    "--fully-async cannot be combined with --partial-rollout: the fully-async producer "
                    "recycles aborted groups itself; drop --partial-rollout"
                )
            if self.rollout_function_path:
                errs.append(
                    "--fully-async cannot be combined with a custom rollout function "
                    "(--rollout-function-path): the fully-async producer owns the rollout loop; use "
                    "--custom-generate-function-path to customise generation instead"
                )
        else:  # accepted by Miles outside fully async; asyncrl has neither, so it says so
            if self.colocate:
                errs.append(
                    "--colocate is not supported: training and rollout run as separate processes on separate "
                    "devices, with no offload between them; drop --colocate"
                )
            if self.partial_rollout:
                errs.append(
                    "--partial-rollout is not supported: an aborted group is regenerated whole (set "
                    "--async-unused-samples-handler retry to retry it); drop --partial-rollout"
                )
            if self.rollout_function_path:
                errs.append(
                    "--rollout-function-path is not supported: the producer owns the rollout loop; customise "
                    "generation with --custom-generate-function-path and rewards with --custom-rm-path"
                )
        capacity = self.buffer_capacity
        if capacity < 1:
            errs.append(
                f"buffer capacity floor({self.async_data_buffer_capacity_factor} * "
                f"{self.rollout_batch_size}) = {capacity} holds no group: raise "
                "--async-data-buffer-capacity-factor or --rollout-batch-size so that it is at least 1"
            )
        cap, n = self.async_max_concurrent_samples, self.n_samples_per_prompt
        if cap is not None and cap < n:
            errs.append(
                f"--async-max-concurrent-samples ({cap}) must be >= --n-samples-per-prompt ({n}): whole prompt "
                "groups are submitted, so a smaller cap could never submit one"
            )
        return errs


class TrainerSection(Section):
    """The trainer: backend, loss, optimizer, checkpoints."""

    train_backend: Literal["torch", "megatron"] = Field(
        "torch", description="Training backend: plain torch, or megatron-core's GPTModel (pip install megatron-core)."
    )
    trainer_num_ranks: int = Field(
        1, ge=1, description="Data-parallel trainer ranks (torch.distributed); rank 0 owns the bus and HTTP."
    )
    use_ray: bool = Field(
        False,
        description="Place the engines, producers and trainer ranks with a placement group over the Ray cluster at "
        "$RAY_ADDRESS (unset: a local one): the trainer's ranks on one node, the engines and producers on another "
        "when the cluster has two. Weights cannot go by disk: implies --update-weight-transfer-mode object-store "
        "(the run's object bucket) unless distributed (a broadcast from the trainer's node) is given.",
    )
    dist_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="torch.distributed backend of the trainer ranks (auto: NCCL on GPU, gloo on CPU)."
    )
    global_batch_size: int | None = Field(
        None,
        ge=1,
        description="Samples per optimizer step: a rollout batch of B x n samples takes B x n / this optimizer "
        "steps (default: one step per rollout).",
    )
    num_steps_per_rollout: int | None = Field(
        None,
        ge=1,
        description="Optimizer steps per rollout batch: the same as --global-batch-size B x n / this.",
    )
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="AdamW beta2.")
    clip_grad: float = Field(1.0, ge=0, description="Gradient norm clip (0 = off).")
    advantage_estimator: Literal["grpo"] = Field("grpo", description="Advantage estimator.")
    grpo_std_normalization: bool = Field(
        True, description="Divide group advantages by the group std (forced off when n == 1)."
    )
    eps_clip: float = Field(0.2, gt=0, description="PPO clip range (lower, and upper unless --eps-clip-high).")
    eps_clip_high: float | None = Field(None, gt=0, description="Upper PPO clip range.")
    use_rollout_logprobs: bool = Field(True, description="Importance ratios against the engine's behaviour log-probs.")
    keep_old_actor: bool = Field(
        False,
        description="Keep a copy of the weights the engines run (updated at every push) and, without "
        "--use-rollout-logprobs, take the PPO ratio against its log-probs instead of the trainer's own.",
    )
    use_tis: bool = Field(
        False, description="Truncated importance sampling: weight the loss by exp(logp_trainer - logp_engine), clipped."
    )
    tis_clip: float = Field(2.0, gt=0, description="Upper clip of the TIS weight.")
    tis_clip_low: float = Field(0.0, ge=0, description="Lower clip of the TIS weight.")
    use_decoupled_ppo: bool = Field(
        False,
        description="Decoupled PPO (AReaL's): clip the ratio against the proximal policy (the trainer's weights "
        "before the rollout's first optimizer step) and weight each token by the behaviour ratio "
        "exp(logp_proximal - logp_engine), leaving out tokens whose weight exceeds --decoupled-ppo-weight-cap. "
        "Needs the engine's log-probs; replaces --use-tis.",
    )
    decoupled_ppo_weight_cap: float = Field(
        5.0, gt=1, description="Decoupled PPO: a token whose behaviour weight exceeds this is left out of the loss."
    )
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL penalty to the frozen initial policy (0 = off).")
    kl_loss_type: Literal["k1", "k2", "low_var_kl"] = Field("low_var_kl", description="KL estimator.")
    loss_aggregation: Literal["token", "sequence"] = Field(
        "token", description="token: mean over every loss token of the step; sequence: mean of per-sequence means."
    )
    use_dynamic_batch_size: bool = Field(
        True,
        description="Split each step into micro-batches of similar lengths, at most --max-tokens-per-gpu padded "
        "tokens each (same gradient, far less padding with long-tail lengths).",
    )
    max_tokens_per_gpu: int = Field(
        8192, ge=1, description="Padded tokens per micro-batch with --use-dynamic-batch-size."
    )
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus coefficient.")
    save: str | None = Field(None, description="Directory for training checkpoints.")
    save_interval: int | None = Field(
        None,
        ge=1,
        description="Save (--save checkpoint, --save-hf snapshot) after step r when (r + 1) % this == 0, at "
        "every epoch's end and after the last step. Unset: no save at all, as in Miles.",
    )
    save_trigger_sentinel: str | None = Field(
        None,
        description="A file path: when the file exists after a step, save then (as if due) and delete the file.",
    )
    load: str | None = Field(None, description="Resume from this checkpoint directory.")
    save_hf: str | None = Field(None, description="Directory for periodic HF snapshots.")
    keep_weight_snapshots: int = Field(
        3, ge=1, description="Weight snapshots kept on disk for the engines (older ones are deleted, but those "
        "the engines may still be loading); multi-LoRA: each adapter's versions likewise.",
    )
    custom_rollout_log_function_path: str | None = Field(
        None,
        description="module.fn: log_rollout_data(rollout_id, config, samples, extra_metrics, rollout_time) -> bool, "
        "called with each step's samples before the default logging; True skips the step's rollout/* and perf/* "
        "rollout metrics (metrics.jsonl keeps the step, its version and train/*).",
    )
    use_tensorboard: bool = Field(
        False,
        description="Also write the metrics as TensorBoard event files: $TENSORBOARD_DIR, else "
        "<run_dir>/tensorboard[/<--tb-project-name>[/<--tb-experiment-name>]] (pip install tensorboard).",
    )
    tb_project_name: str | None = Field(None, description="TensorBoard: a subdirectory for the project.")
    tb_experiment_name: str | None = Field(None, description="TensorBoard: a subdirectory for the experiment.")
    use_wandb: bool = Field(
        False,
        description="Also log the metrics to Weights & Biases (pip install wandb; the key from $WANDB_API_KEY).",
    )
    wandb_mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="W&B mode (default: $WANDB_MODE, else online); offline keeps everything local."
    )
    wandb_dir: str | None = Field(None, description="W&B files (default: the run directory).")
    wandb_project: str | None = Field(None, description="W&B project (default: asyncrl).")
    wandb_group: str | None = Field(None, description="W&B group.")
    wandb_team: str | None = Field(None, description="W&B entity (team).")
    wandb_run_id: str | None = Field(None, description="W&B run id, to resume a W&B run.")
    wandb_host: str | None = Field(None, description="W&B server URL (self-hosted).")

    def problems(self) -> list[str]:
        errs = []
        if self.use_decoupled_ppo and self.use_tis:
            errs.append("--use-decoupled-ppo weights tokens by the behaviour ratio itself: drop --use-tis "
                        "(or --use-decoupled-ppo)")  # fmt: skip
        if self.save_interval is not None and not self.save:
            errs.append("--save-interval needs --save: set --save DIR for the checkpoints")
        if self.save_trigger_sentinel is not None and not self.save:
            errs.append("--save-trigger-sentinel needs --save: set --save DIR for the checkpoints")
        samples = self.rollout_batch_size * self.n_samples_per_prompt
        if self.num_steps_per_rollout is not None and self.global_batch_size is not None:
            if self.global_batch_size != samples // self.num_steps_per_rollout:
                errs.append(
                    f"--global-batch-size {self.global_batch_size} is not equal to --rollout-batch-size "
                    f"{self.rollout_batch_size} * --n-samples-per-prompt {self.n_samples_per_prompt} // "
                    f"--num-steps-per-rollout {self.num_steps_per_rollout}: set one of them"
                )
        elif (
            self.global_batch_size is not None
            and not getattr(self, "multi_lora_n_adapters", 0)  # multi-LoRA: the target of a coalesced batch
            and (samples % self.global_batch_size or self.global_batch_size > samples)
        ):
            errs.append(
                f"--global-batch-size {self.global_batch_size} must divide the rollout's {samples} samples "
                f"(--rollout-batch-size x --n-samples-per-prompt)"
            )
        elif self.num_steps_per_rollout is not None and self.num_steps_per_rollout > samples:
            errs.append(f"--num-steps-per-rollout {self.num_steps_per_rollout} exceeds the rollout's {samples} samples")
        if self.keep_old_actor and (self.trainer_num_ranks > 1 or self.train_backend != "torch"):
            errs.append("--keep-old-actor runs on one trainer rank with --train-backend torch in this version")
        if self.optimizer_steps_per_rollout > 1 and self.trainer_num_ranks > 1:
            errs.append(
                "several optimizer steps per rollout (--num-steps-per-rollout, --global-batch-size) run on one "
                "trainer rank in this version: drop --trainer-num-ranks or train one step per rollout"
            )
        if self.use_ray and "update_weight_transfer_mode" in self.model_fields_set:
            if self.update_weight_transfer_mode == "disk":
                errs.append(
                    "--use-ray places engines on nodes that do not see the trainer's disk: use "
                    "--update-weight-transfer-mode object-store (the default with --use-ray) or distributed"
                )
        if self.train_backend == "megatron" and self.trainer_num_ranks > 1:
            errs.append(
                "--train-backend megatron runs one trainer rank in this version (tensor/pipeline parallel sizes 1): "
                "drop --trainer-num-ranks or use --train-backend torch for data parallelism"
            )
        return errs


class EvalSection(Section):
    """Evaluation: when, on what, and which backend (eval service, trainer)."""

    eval_interval: int | None = Field(None, ge=1, description="Evaluate every this many steps.")
    eval_prompt_data: list[str] = Field(
        default_factory=list,
        description="NAME PATH pairs of held-out JSONL sets; default: the task's held-out set.",
    )
    eval_config: str | None = Field(
        None,
        description="Miles's eval dataset file (YAML/JSON, or base64:<payload>): eval.datasets with per-set "
        "path, n_samples_per_eval_prompt, temperature, top_p, top_k, max_response_len, rm_type, keys and "
        "metadata_overrides, and eval.defaults; replaces --eval-prompt-data.",
    )
    n_samples_per_eval_prompt: int = Field(4, ge=1, description="Samples per held-out prompt.")
    eval_temperature: float = Field(1.0, ge=0, description="Sampling temperature for evaluation.")
    skip_eval_before_train: bool = Field(False, description="No evaluation at step 0.")
    eval_max_response_len: int | None = Field(
        None, ge=1, description="max_new_tokens for evaluation (default: the rollout's)."
    )
    eval_top_p: float | None = Field(None, gt=0, le=1, description="top_p for evaluation (default: the rollout's).")
    eval_num_gpus: int = Field(
        0,
        ge=0,
        description="Dedicated eval fleet: this many engines' worth of devices owned by the eval service (0 = none).",
    )
    eval_num_gpus_per_engine: int = Field(1, ge=1, description="Devices per eval-fleet engine.")
    eval_function_path: str | None = Field(
        None, description="module.Class: a services.api.CheckpointEvalFn subclass that evaluates each snapshot."
    )
    eval_hf_dir: str | None = Field(
        None, description="Export a fresh HF snapshot per eval point here (snapshot backends)."
    )
    eval_max_in_flight: int = Field(2, ge=1, description="Eval points that may be pending at once.")
    eval_overflow_policy: Literal["backpressure", "skip"] = Field(
        "backpressure",
        description="When --eval-max-in-flight points are pending: wait for the oldest, or skip as busy.",
    )
    eval_keep_snapshots: int = Field(
        2,
        ge=0,
        description="Exported eval snapshots kept after their evaluation (0: none, each is deleted once evaluated).",
    )
    eval_engine_urls: list[str] = Field(
        default_factory=list,
        description="Attach the eval fleet to these running engines instead of launching --eval-num-gpus of them.",
    )
    custom_eval_rollout_log_function_path: str | None = Field(
        None,
        description="module.fn: log_eval_rollout_data(rollout_id, config, data, extra_metrics) -> bool, called "
        "per eval point with data = {dataset: {rewards, truncated, samples}}; True skips the default eval metrics.",
    )
    eval_sglang_args: list[str] = Field(
        default_factory=list,
        description="Overrides of the fleet engines' settings, collected from every --eval-sglang-<flag> "
        "(and --no-eval-sglang-<flag>) on the command line.",
    )

    def problems(self) -> list[str]:
        """SPEC.md section 7: every eval combination that cannot work, with what to set."""
        errs = []
        fleet = self.eval_num_gpus > 0 or bool(self.eval_engine_urls)
        if fleet and self.eval_function_path:
            errs.append(
                "--eval-num-gpus (a dedicated eval fleet) and --eval-function-path (an external evaluator) each "
                "select an eval backend: pass one of them"
            )
        if self.eval_num_gpus % self.eval_num_gpus_per_engine:
            errs.append(
                f"--eval-num-gpus ({self.eval_num_gpus}) must be a multiple of --eval-num-gpus-per-engine "
                f"({self.eval_num_gpus_per_engine})"
            )
        if fleet or self.eval_function_path:
            if self.eval_interval is None:
                errs.append("Snapshot eval requires --eval-interval.")
            if not self.eval_hf_dir and not self.save_hf:
                errs.append(
                    "Snapshot eval requires a snapshot source: set --eval-hf-dir (staging exports) or --save-hf "
                    "(reuse periodic HF checkpoints)."
                )
            if not self.eval_hf_dir and self.save_hf and self.eval_interval and self.save_interval is None:
                errs.append(
                    "Snapshot eval from --save-hf checkpoints needs --save-interval (without it nothing is saved): "
                    "set --save-interval, or --eval-hf-dir to export a snapshot per eval point"
                )
            elif not self.eval_hf_dir and self.save_hf and self.eval_interval:
                save_every = self.save_interval
                if self.eval_interval % save_every:
                    errs.append(
                        f"Snapshot eval from --save-hf checkpoints needs --eval-interval ({self.eval_interval}) to be "
                        f"a multiple of --save-interval ({save_every}): set --eval-interval "
                        f"{save_every * max(1, self.eval_interval // save_every)} or --eval-hf-dir to export a "
                        "snapshot per eval point"
                    )
        if self.eval_sglang_args and self.eval_num_gpus == 0:
            given = sorted({a for a in self.eval_sglang_args if a.startswith("--")})
            errs.append(
                "--eval-sglang-* configures the dedicated eval fleet, which needs --eval-num-gpus > 0. "
                f"Got {given} with --eval-num-gpus 0."
            )
        tp = [a for a in self.eval_sglang_args if a.split("=")[0] in ("--tp-size", "--tp", "--tensor-parallel-size")]
        if tp:
            errs.append(
                f"--eval-sglang{tp[0].split('=')[0][1:]} is not a flag: the eval fleet's tensor-parallel size is "
                "--eval-num-gpus-per-engine"
            )
        if len(self.eval_prompt_data) % 2:
            errs.append("--eval-prompt-data takes NAME PATH pairs, e.g. --eval-prompt-data aime aime.jsonl")
        return errs


ADAPTER_NAME = re.compile(r"[A-Za-z0-9_-]([A-Za-z0-9._-]{0,94}[A-Za-z0-9_-])?")
"""An adapter's name: 1-96 letters, digits, '.', '_' and '-', neither starting nor ending with '.' (it
names files and KV keys, and the engines serve its versions as `<name>@<registration>.v<k>`)."""


def adapter_name_problem(name: str) -> str | None:
    """Why `name` cannot name an adapter, or None."""
    if not isinstance(name, str) or not ADAPTER_NAME.fullmatch(name):
        return (f"adapter name {name!r:.140} is invalid: use 1-96 characters from letters, digits, '.', '_' "
                "and '-', not starting or ending with '.'")  # fmt: skip
    return None


def adapter_pairs(entries: list[str]) -> tuple[list[tuple[str, str]], list[str]]:
    """--multi-lora-adapter's values as (name, yaml path) pairs, and what is wrong with them. Each
    adapter is NAME YAML (two values) or NAME=YAML (one)."""
    pairs, errs, i = [], [], 0
    while i < len(entries):
        entry = entries[i]
        if "=" in entry:
            name, _, path = entry.partition("=")
            i += 1
        elif i + 1 < len(entries):
            name, path = entry, entries[i + 1]
            i += 2
        else:
            errs.append(f"--multi-lora-adapter {entry!r} has no YAML file: give NAME YAML (or NAME=YAML)")
            break
        if (problem := adapter_name_problem(name)) is not None:
            errs.append(f"--multi-lora-adapter: {problem}")
        elif not path:
            errs.append(f"--multi-lora-adapter {name!r} has no YAML file: give NAME YAML (or NAME=YAML)")
        elif name in dict(pairs):
            errs.append(f"--multi-lora-adapter names {name!r} twice: give each adapter once")
        else:
            pairs.append((name, path))
    return pairs, errs


class MultiLoraSection(Section):
    """Multi-LoRA async (Miles's train_multi_lora_async.py): tenants register LoRA adapters on the
    one base model, each trained in a slot of the trainer until its own budget, saved, and its slot
    freed for the next (launcher, adapters service; services/adapters)."""

    multi_lora_n_adapters: int = Field(
        0,
        ge=0,
        le=64,
        description="Multi-LoRA async: the trainer's adapter slots, i.e. the most adapters trained at once "
        "(0: multi-LoRA off). With it the launcher starts the adapter registry (`asyncrl service adapters`).",
    )
    multi_lora_adapter: list[str] = Field(
        default_factory=list,
        json_schema_extra={"repeatable": True},
        description="Multi-LoRA: an adapter registered at start, as NAME YAML (repeat the flag for more: "
        "--multi-lora-adapter a a.yaml --multi-lora-adapter b b.yaml) or NAME=YAML; the YAML holds its spec "
        "(data, rank, alpha, target_modules, rollout_batch_size, n_samples_per_prompt, save, rm_type or "
        "custom_rm_path, num_step or num_epoch, metadata). Registered once: a restarted registry skips a name it has.",
    )
    multi_lora_max_rank: int = Field(
        16,
        ge=1,
        le=1024,
        description="Multi-LoRA: the largest adapter rank the engines can load (SGLang's --max-lora-rank; the built-in "
        "engines are started with it).",
    )
    multi_lora_max_coalesce_wait_s: float = Field(
        0.0,
        ge=0,
        description="Multi-LoRA: once one adapter's batch (a step's rollout_batch_size groups) is ready, keep "
        "collecting other adapters' batches into the same training batch while each arrives within this many "
        "seconds of the last, up to --global-batch-size samples (default: --rollout-batch-size x "
        "--n-samples-per-prompt); only the adapters in the batch step, and a registry change (a DELETE, a new "
        "adapter) waits for the batch to ship. 0: train what is ready at once (the trainer runs each adapter's "
        "forward on its own rows, so waiting buys no speed, only Miles's batch shape).",
    )
    multi_lora_max_empty_wait_s: float = Field(
        30.0,
        gt=0,
        description="Multi-LoRA: with adapters active but no batch ready for this long, warn (naming the step "
        "each adapter waits for) and keep waiting.",
    )
    multi_lora_idle_poll_s: float = Field(
        2.0, gt=0, description="Multi-LoRA: while no adapter is training, look for new ones this often."
    )
    multi_lora_service_mode: bool = Field(
        False,
        description="Multi-LoRA: run as a service: when no adapter is left, wait for new registrations "
        "indefinitely instead of ending the run.",
    )
    multi_lora_custom_rm_paths: list[str] = Field(
        default_factory=list,
        json_schema_extra={"repeatable": True},
        description="Multi-LoRA: the reward functions (module.fn) an adapter registered over HTTP may name as "
        "custom_rm_path; any other is refused (importing it would run a tenant's choice of code in the producers). "
        "Adapters from --multi-lora-adapter YAML files may name any.",
    )
    multi_lora_max_data_mb: float = Field(
        256.0,
        gt=0,
        description="Multi-LoRA: the largest prompt file an adapter may name (its rows are held by the buffer and "
        "read by the trainer and producers).",
    )

    @property
    def multi_lora_adapter_pairs(self) -> list[tuple[str, str]]:
        """--multi-lora-adapter as (name, yaml path) pairs."""
        return adapter_pairs(self.multi_lora_adapter)[0]

    def problems(self) -> list[str]:
        errs = adapter_pairs(self.multi_lora_adapter)[1]
        if self.multi_lora_adapter and self.multi_lora_n_adapters == 0:
            errs.append("--multi-lora-adapter registers adapters for multi-LoRA, which is off: set "
                        "--multi-lora-n-adapters to the number of adapter slots")  # fmt: skip
        if self.multi_lora_n_adapters > 0 and getattr(self, "use_ray", False) and \
                getattr(self, "adapter_transfer_mode", "object-store") == "disk":
            errs.append("Multi-LoRA with --use-ray: adapter versions would reach these engines by disk, which Ray's "
                        "nodes do not share (SGLang servers and external engines load adapters from a path): use the "
                        "built-in engines, which fetch them from the run's object bucket")  # fmt: skip
        if self.multi_lora_n_adapters > 0 and self.eval_interval is not None:
            errs.append("Multi-LoRA async (--multi-lora-n-adapters) does not support in-loop evaluation: unset "
                        "--eval-interval (evaluate each adapter from its saves)")  # fmt: skip
        if self.multi_lora_n_adapters > 0:
            errs += [f"Multi-LoRA async (--multi-lora-n-adapters) {why}: {fix}"
                     for flag, why, fix in MULTI_LORA_IGNORES if getattr(self, flag, None)]  # fmt: skip
            if getattr(self, "update_weights_interval", 1) > 1:
                errs.append("Multi-LoRA async (--multi-lora-n-adapters) pushes every adapter version it trains (its "
                            "staleness is counted in its own steps): drop --update-weights-interval")  # fmt: skip
        return errs


MULTI_LORA_IGNORES = [
    ("num_steps_per_rollout", "takes one optimizer step per adapter batch",
     "drop --num-steps-per-rollout (--global-batch-size sets how many samples a batch coalesces)"),
    ("keep_old_actor", "trains adapters on a frozen base, with no old actor to keep", "drop --keep-old-actor"),
    ("save_interval", "saves each adapter in its own `save` directory (its YAML) when it retires; the base never "
     "changes", "drop --save-interval"),
    ("save_hf", "saves adapters as PEFT directories in their `save` directories", "drop --save-hf"),
    ("save_trigger_sentinel", "saves each adapter when it retires (DELETE /adapter_runs/{name} retires one now)",
     "drop --save-trigger-sentinel"),
    ("load", "resumes each adapter from the newest save in its `save` directory", "drop --load"),
    ("custom_rollout_log_function_path", "records each adapter's steps on its own axis and does not call a "
     "rollout log function", "drop --custom-rollout-log-function-path"),
]
"""Flags of the single-model run that multi-LoRA would silently ignore: (field, why, what to do)."""


class RunConfig(MultiLoraSection, EvalSection, TrainerSection, AsyncSection, RolloutSection, DataSection, InfraSection):
    """Every flag under its snake_case name (the sections' fields, in their order), what is
    derived from them, and every rule: one-flag bounds on the fields, cross-flag rules in each
    section's problems()."""

    @property
    def mode(self) -> Literal["sync", "one_step", "fully_async"]:
        if self.driver == "sync":
            return "sync"
        return "fully_async" if self.fully_async else "one_step"

    @property
    def adapter_transfer_mode(self) -> Literal["disk", "object-store"]:
        """How multi-LoRA adapter versions reach the engines: through the run's weights bucket with
        --update-weight-transfer-mode object-store, and with distributed when the launcher starts
        built-in engines (they fetch from the bucket, so no node needs the trainer's disk; the base
        never changes in this mode, and LoRA over a broadcast group is not in upstream SGLang);
        by disk otherwise (SGLang servers and external engines load a path they must see)."""
        mode = self.update_weight_transfer_mode
        if mode == "object-store" or (mode == "distributed" and self.engine == "builtin"
                                      and not self.rollout_external_engine_addrs):  # fmt: skip
            return "object-store"
        return "disk"

    @property
    def engines_read_bucket(self) -> bool:
        """The built-in engines fetch `nats-object://` weights or adapters (they get the run's NATS
        URL and a read-only identity)."""
        if self.update_weight_transfer_mode == "object-store":
            return True
        return self.multi_lora_n_adapters > 0 and self.adapter_transfer_mode == "object-store"

    @property
    def buffer_capacity(self) -> int:
        return math.floor(self.async_data_buffer_capacity_factor * self.rollout_batch_size)

    @property
    def engines_take_one_key(self) -> bool:
        """SGLang servers (launched or external) take one --api-key for every route: the roles
        that call them send the run token, not their own (services.common.httpauth)."""
        return self.engine == "sglang" or bool(self.rollout_external_engine_addrs)

    @property
    def rollouts_max_msgs(self) -> int:
        """ROLLOUTS' message cap: four times what a run holds there at once (stored, in flight
        on every producer the launcher starts, and two steps' leases), per adapter, plus 1024.
        Past it a producer's publish is refused until the buffer's next purge."""
        held = self.buffer_capacity + self.inflight_groups * max(1, self.rollout_num_producers) + 2 * self.rollout_batch_size
        return 4 * held * max(1, self.multi_lora_n_adapters) + 1024

    @property
    def inflight_groups(self) -> int:
        """In-flight cap of one producer, in groups (SPEC.md section 4)."""
        if self.async_max_concurrent_samples is not None:
            return max(1, self.async_max_concurrent_samples // self.n_samples_per_prompt)
        return self.rollout_batch_size

    @property
    def submission_granularity(self) -> Literal["sample", "group"]:
        if self.rollout_submission_granularity is not None:
            return self.rollout_submission_granularity
        return "sample" if self.mode == "fully_async" else "group"

    @property
    def optimizer_steps_per_rollout(self) -> int:
        if self.num_steps_per_rollout is not None:
            return self.num_steps_per_rollout
        if self.global_batch_size is not None:
            return max(1, self.rollout_batch_size * self.n_samples_per_prompt // self.global_batch_size)
        return 1

    @property
    def total_steps(self) -> int:
        if self.num_rollout is not None:
            return self.num_rollout
        return 150  # only a config built in code: the launcher refuses a run that names neither

    def update_due(self, rollout_id: int) -> bool:
        """The weights are pushed after step r: every step in sync (on-policy by definition),
        else iff (r + 1) % --update-weights-interval == 0 (no forced push after the last step)."""
        return self.mode == "sync" or (rollout_id + 1) % self.update_weights_interval == 0

    def save_due(self, rollout_id: int) -> bool:
        """A periodic save after step r (the --save-trigger-sentinel adds more at run time)."""
        return periodic_due(rollout_id, self.save_interval, self.num_rollout_per_epoch, self.total_steps)

    def eval_due(self, rollout_id: int) -> bool:
        """An eval point after step r; the last step forces one in the async drivers only."""
        last = self.total_steps if self.mode != "sync" else None
        return periodic_due(rollout_id, self.eval_interval, self.num_rollout_per_epoch, last)

    def baseline_eval_due(self, start_step: int) -> bool:
        """An eval point before training starts at `start_step` (named by it): before the run's
        first step, and in the synchronous driver before the first step after a resume too, as in
        Miles; never with --skip-eval-before-train or without --eval-interval."""
        if self.eval_interval is None or self.skip_eval_before_train or start_step >= self.total_steps:
            return False
        return start_step == 0 or self.mode == "sync"

    @property
    def checkpoints_resume(self) -> bool:
        """A restarted trainer resumes from --save checkpoints (with the optimizer state), and the
        trainer commits a step only once it is checkpointed; otherwise it commits every pushed
        step and resumes from that weight snapshot."""
        return bool(self.save and self.save_interval)

    @property
    def commit_interval(self) -> int:
        """The most steps between two commits (a save at an epoch's end or on the sentinel only
        adds commits): the buffer's window of steps the trainer may ask for."""
        if self.checkpoints_resume:
            return self.save_interval
        return 1 if self.mode == "sync" else self.update_weights_interval

    @field_validator("run_id")
    @classmethod
    def _run_id_pattern(cls, v: str | None) -> str | None:
        return v if v is None else check_run_id(v)

    @model_validator(mode="before")
    @classmethod
    def _credentials_out_of_the_url(cls, data):
        """nats://user:password@host -> nats_url nats://host, nats_user, nats_password (a lone
        user part is a token): a secret in the URL would be stored and put on command lines."""
        if isinstance(data, dict) and data.get("nats_url"):
            from services.common.secrets import url_credentials

            url, found = url_credentials(str(data["nats_url"]))
            if found:
                data = dict(data, nats_url=url)
                for key, value in found.items():
                    data.setdefault(f"nats_{key}", value)
        return data

    @model_validator(mode="after")
    def _validate(self) -> RunConfig:
        """Every section's rules, all of them reported at once, with what to set instead."""
        errs = [e for cls in reversed(type(self).__mro__) if "problems" in cls.__dict__ for e in cls.problems(self)]
        if errs:
            raise ConfigError("\n".join(errs))
        return self


def periodic_due(rollout_id: int, interval: int | None, per_epoch: int | None = None, total: int | None = None) -> bool:
    """Miles's rule for a periodic action (save, eval) after step `rollout_id` (0-based): never
    without an interval; after the last step when `total` is given; else when (r + 1) is a
    multiple of the interval or ends an epoch."""
    if interval is None:
        return False
    if total is not None and rollout_id == total - 1:
        return True
    done = rollout_id + 1
    return done % interval == 0 or (per_epoch is not None and done % per_epoch == 0)


def eval_backend(c: RunConfig) -> str:
    if c.eval_num_gpus > 0 or c.eval_engine_urls:
        return "fleet"
    if c.eval_function_path:
        return "external"
    return "shared"


SECTIONS: tuple[type[Section], ...] = (
    InfraSection, DataSection, RolloutSection, AsyncSection, TrainerSection, EvalSection, MultiLoraSection
)  # fmt: skip
"""The configuration's sections, in the order --help shows them."""


def section_of(field: str) -> type[Section]:
    """The section that declares a RunConfig field."""
    return next(s for s in SECTIONS if field in s.model_fields)
