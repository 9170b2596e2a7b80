"""Every message that crosses the bus, as msgspec Structs (msgpack maps on the wire).

Rules: fields are added only at the end of a Struct and always with a default; a field is never
renamed, retyped or reused. Golden encodings in tests/unit/test_proto.py keep old messages
readable. Weights never ride the bus: WeightsPublished points at a snapshot on disk.
"""

from __future__ import annotations

import enum
from typing import Any

import msgspec


def group_id(group_index: int, attempt: int) -> str:
    """One id per release attempt of a prompt; producers publish the group under it as its
    Nats-Msg-Id, and the buffer's ledger names the group by it."""
    return f"g{group_index}-a{attempt}"


class SampleStatus(str, enum.Enum):
    """Lifecycle of one trajectory. The engine's finish_reason maps stop -> COMPLETED,
    length -> TRUNCATED, abort -> ABORTED. FAILED (e.g. a reward function raised) is not
    ABORTED: the buffer stores a FAILED group like any other."""

    PENDING = "pending"
    COMPLETED = "completed"
    TRUNCATED = "truncated"
    ABORTED = "aborted"
    FAILED = "failed"


class Sample(msgspec.Struct, kw_only=True):
    """One trajectory of a group. Constructible from keyword arguments,
    every field defaulted; plugins may mutate it (reward, remove_sample, loss_mask)."""

    index: int | None = None
    """Global sample index: unique, increasing; group_index * n + position in the group."""
    group_index: int | None = None
    """Index of the prompt group this sample belongs to (kept across retries)."""
    prompt: Any = ""
    """Text, token ids, or chat messages (a list of {"role", "content"} dicts)."""
    label: Any = None
    tokens: list[int] = msgspec.field(default_factory=list)
    """Prompt token ids followed by response token ids."""
    response: str = ""
    response_length: int = 0
    reward: float | dict[str, float] | None = None
    rollout_log_probs: list[float] = msgspec.field(default_factory=list)
    """Engine log-probs of the response tokens, one per response token (behaviour policy)."""
    loss_mask: list[int] | None = None
    status: SampleStatus = SampleStatus.PENDING
    weight_versions: list[int] = msgspec.field(default_factory=list)
    """Every weight version that generated any token of this sample, in order."""
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)
    remove_sample: bool = False
    """Excluded from the loss, still counted in advantage normalisation."""
    version_spans: list[list[int]] = msgspec.field(default_factory=list)
    """[start, end, version] of each run of response tokens [start, end) that one weight version
    generated (the engine's weight_versions spans; an environment's or tool's tokens are in none).
    Wire version 2: a Sample of an older producer decodes with it empty."""

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    def reset_for_retry(self) -> None:
        """Keep index, group_index, prompt, label and metadata; clear everything generated."""
        self.tokens = []
        self.response = ""
        self.response_length = 0
        self.reward = None
        self.rollout_log_probs = []
        self.loss_mask = None
        self.weight_versions = []
        self.version_spans = []
        self.remove_sample = False
        self.status = SampleStatus.ABORTED


def scalar_reward(sample: Sample, reward_key: str | None = None) -> float:
    """The number a sample's reward stands for: a float as is, a dict's `--reward-key` entry,
    and 0.0 for no reward (a FAILED sample)."""
    r = sample.reward
    if isinstance(r, dict):
        if reward_key is None:
            raise ValueError("rewards are dicts: set --reward-key to choose the entry to train and report on")
        return float(r[reward_key])
    return float(r if r is not None else 0.0)


def flatten_group(group: list[Any]) -> list[Sample]:
    """A trajectory may itself be a list of Samples (multi-agent, compaction): flatten one level."""
    out: list[Sample] = []
    for item in group:
        if isinstance(item, list):
            out.extend(item)
        else:
            out.append(item)
    return out


def oldest_weight_version(group: list[Any]) -> int | None:
    """Min over every sample's versions; None when no sample carries a version."""
    versions = [v for s in flatten_group(group) for v in s.weight_versions]
    return min(versions) if versions else None


class PromptMsg(msgspec.Struct, kw_only=True):
    """A released prompt on the PROMPTS work queue. A producer turns it into one group."""

    group_index: int
    prompt: Any
    """Text, token ids, or chat messages (a list of {"role", "content"} dicts)."""
    label: Any = None
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)
    attempt: int = 0
    """0 for a fresh release, +1 for each retry recycle of this group_index."""
    epoch: int = 0
    row: int = 0
    """Row of the dataset this prompt came from (0-based)."""
    n_samples: int = 1
    released_at: float = 0.0
    tools: list[dict] | None = None
    """The row's tool schemas (--tool-key), for the chat template; None: none (added last: an
    older PromptMsg decodes with it None)."""


class RolloutGroup(msgspec.Struct, kw_only=True):
    """A finished prompt group as published by a producer on ROLLOUTS."""

    group_id: str
    """Unique per release attempt: used as Nats-Msg-Id so retried publishes dedupe."""
    group_index: int
    attempt: int = 0
    samples: list[Sample | list[Sample]] = msgspec.field(default_factory=list)
    producer_id: str = ""
    created_at: float = 0.0
    generate_time_s: float = 0.0
    epoch: int = 0
    row: int = 0


class GroupRef(msgspec.Struct, kw_only=True):
    """A consumed group handed to the trainer: where to read it, plus what the buffer decided."""

    group_id: str
    group_index: int
    stream_seq: int = 0
    """Sequence of the RolloutGroup message on ROLLOUTS; 0 when the payload is inline."""
    payload: bytes | None = None
    """The encoded RolloutGroup, inline: groups up to 64 KB (the buffer holds them anyway) and
    groups a custom buffer built itself; larger ones are read from ROLLOUTS by `stream_seq`."""
    staleness: int | None = None
    oldest_version: int | None = None
    failed: bool = False
    """Every sample of the group FAILED: it trains nothing (the audit counts it as failed)."""


class BufferGetRequest(msgspec.Struct, kw_only=True):
    """Trainer -> buffer (request/reply). Idempotent: the reply always lists every group leased
    to `step` so far, so a lost reply or a restarted trainer simply asks again."""

    step: int
    count: int
    current_version: int | None = None
    """Staleness clock override; None means the buffer's live engine version."""
    release_min_version: int | None = None
    """Release no new prompts until the engines run at least this version (sync modes)."""
    lookahead_steps: int = 0
    """Prompt release may run this many steps ahead of `step` (0 sync, 1 one-step async)."""
    wait_s: float = 2.0
    context: dict[str, Any] = msgspec.field(default_factory=dict)
    provisional_ok: bool = False
    """Unused (kept for the wire): the buffer answers a get once, when its lease is durable.
    Provisional answers were measured to gain nothing a step could see (docs/benchmarks.md)."""


class BufferGetReply(msgspec.Struct, kw_only=True):
    step: int
    refs: list[GroupRef] = msgspec.field(default_factory=list)
    complete: bool = False
    metrics: dict[str, float] = msgspec.field(default_factory=dict)
    """get_metrics() taken once, when the step's batch became complete."""
    error: str | None = None
    durable: bool = True
    """Always True (kept for the wire): every answer lists a lease that is on the ledger."""
    committed_step: int = -1
    """The last step the buffer has committed (a trainer that lost its place resumes after it)."""


NO_PARTITION_ERROR = "names no open buffer partition"
"""In a BufferGetReply's or BufferCommitReply's error: the subject names an adapter registration
whose buffer partition is not open (multi-LoRA); the trainer takes it as "not ready yet"."""


class BufferCommit(msgspec.Struct, kw_only=True):
    """Trainer -> buffer: every step <= `step` is trained and checkpointed; its groups are done."""

    step: int
    version: int = 0


class BufferCommitReply(msgspec.Struct, kw_only=True):
    step: int
    num_groups_committed: int = 0
    error: str | None = None


class WeightsPublished(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Trainer -> weight-sync, eval: a new weight version exists as an HF snapshot at `uri`.
    Fields left at their defaults are not encoded, so a message without the later fields
    (tensor_sha256) has the same bytes as before them."""

    version: int
    step: int
    uri: str
    sha256: str = ""
    num_bytes: int = 0
    created_at: float = 0.0
    tensor_sha256: str = ""
    """--update-weight-transfer-mode distributed: the digest of the tensors as the trainer
    broadcasts them (services/model/transfer.py `digest`), which the built-in engine checks."""


class TransferRequest(msgspec.Struct, kw_only=True):
    """Weight-sync -> trainer (core request/reply on `weights.transfer`, distributed mode):
    join: open a new weight transfer group as its rank 0 (the engines are ranks 1..world_size-1);
    has: can it still send `version`; send: broadcast `version`'s tensors to the group, in
    manifest order; leave: close the group."""

    op: str
    group_name: str
    world_size: int = 0
    version: int = 0
    backend: str = ""
    """join: gloo or nccl, as the engines need (empty: the trainer's own choice)."""


class TransferReply(msgspec.Struct, kw_only=True):
    """Trainer -> weight-sync. join: where the group meets and the manifest every send follows;
    send: the version sent and its tensors' digest."""

    ok: bool
    error: str = ""
    master_address: str = ""
    master_port: int = 0
    backend: str = ""
    names: list[str] = msgspec.field(default_factory=list)
    dtypes: list[str] = msgspec.field(default_factory=list)
    shapes: list[list[int]] = msgspec.field(default_factory=list)
    version: int = 0
    tensor_sha256: str = ""
    gone: bool = False
    """has, send: the trainer no longer has that version (neither held nor on disk): a newer one is next."""


class EngineSwitch(msgspec.Struct, kw_only=True):
    """One engine's move to a WeightsLive version: when its generation paused and when it
    continued (wall clock, seconds since the epoch)."""

    engine: str
    paused_at: float = 0.0
    resumed_at: float = 0.0


class WeightsLive(msgspec.Struct, kw_only=True):
    """Weight-sync -> everyone: the rollout engines now run `version` (the staleness clock)."""

    version: int
    engines: list[str] = msgspec.field(default_factory=list)
    updated_at: float = 0.0
    pause_mode: str = ""
    duration_s: float = 0.0
    """Publish to live: staging, pauses and read-backs on every engine."""
    pause_s: float = 0.0
    """The longest time any engine spent paused for this update (generation stopped)."""
    tensor_sha256: str = ""
    """distributed: the live version's tensor digest (a restarted weight-sync checks a catch-up with it)."""
    switched: list[EngineSwitch] = msgspec.field(default_factory=list)
    """The engines that run `version` now, each with its pause (wire version 2: empty from an
    older weight-sync, and on a restart's re-announcement, which paused nothing)."""


class ControlMsg(msgspec.Struct, kw_only=True):
    """Small control-plane commands (core NATS)."""

    command: str
    """pause_submission | resume_submission (producers; a shared-engine eval sends them)"""
    reason: str = ""
    token: str = ""
    issued_at: float = 0.0


class Heartbeat(msgspec.Struct, kw_only=True):
    service: str
    instance_id: str
    http_url: str = ""
    pid: int = 0
    started_at: float = 0.0
    ts: float = 0.0
    info: dict[str, Any] = msgspec.field(default_factory=dict)


class ProgressRecord(msgspec.Struct, kw_only=True):
    """Trainer -> launcher and dashboards: one per step (the JSONL record), plus a final one."""

    step: int
    record: dict[str, Any] = msgspec.field(default_factory=dict)
    done: bool = False
    error: str | None = None
    last_eval: int | None = None
    """On the final record: the last eval point the trainer dispatched (steps trained before it)."""


class EvalRequest(msgspec.Struct, kw_only=True):
    """Trainer -> eval: evaluate the policy after `step` steps. Snapshot backends get the HF
    snapshot to pin (`snapshot_uri`); the shared-engines backend uses the live engines."""

    step: int
    version: int
    rollout_id: int | None = None
    """The point's name on Miles's axis (eval/step): the step just trained (step - 1), or for a
    baseline point the step it precedes (step). None: `step`."""
    snapshot_uri: str = ""
    final: bool = False
    requested_at: float = 0.0
    exported: bool = False
    """The snapshot was exported for this point (so the eval service may retire it)."""
    export_time_s: float = 0.0


class EvalResult(msgspec.Struct, kw_only=True):
    step: int
    version: int
    metrics: dict[str, float] = msgspec.field(default_factory=dict)
    skipped_reason: str | None = None
    duration_s: float = 0.0
    final: bool = False


class DeadLetter(msgspec.Struct, kw_only=True):
    original_subject: str
    reason: str
    data: bytes = b""
    """The message, or its first 64 KB (see num_bytes)."""
    service: str = ""
    ts: float = 0.0
    num_bytes: int = 0
    """The whole message's size."""
    sha256: str = ""
    """The whole message's digest."""


class LedgerEvent(msgspec.Struct, kw_only=True):
    """One decision of the buffer, appended to LEDGER_<run>. The log is both the buffer's
    write-ahead log (its state is the fold of these events) and the audit ledger of the run.

    kinds: released (prompt), put (outcome stored|filtered|aborted|duplicate|accepted|rejected|foreign),
    leased (group -> step), stale (rejected at get), expired (released, then neither answered nor
    in work within --prompt-deadline-s: its prompt goes back as a new attempt), retired (stored, or leased to a step never
    committed, when its multi-LoRA adapter registration completed: dropped), lease_complete (step, metrics), committed (step).
    `recycled` marks an aborted/stale group whose prompt went back to the data source."""

    seq: int
    """Position in the log, from 1; also the Nats-Msg-Id suffix so a retried append dedupes."""
    kind: str
    group_id: str = ""
    group_index: int = -1
    attempt: int = 0
    step: int = -1
    stream_seq: int = 0
    outcome: str = ""
    reason: str = ""
    recycled: bool = False
    staleness: int | None = None
    oldest_version: int | None = None
    prompt: PromptMsg | None = None
    source: dict[str, int] = msgspec.field(default_factory=dict)
    """For `released`: the data source cursor after the release (epoch, cursor, next_group_index)."""
    metrics: dict[str, float] = msgspec.field(default_factory=dict)
    ts: float = 0.0
    failed: bool = False
    """For `put`: every sample of the group FAILED (a generation or a reward that always failed)."""


class LedgerBatch(msgspec.Struct, kw_only=True):
    """One message on LEDGER_<run>: the events of one append, in log order. The buffer appends
    what it has decided since its last append as one message (one broker round trip and one
    stored message however many events), with Nats-Msg-Id `<run>-L<first seq>-<last seq>`, so a
    retried append dedupes."""

    events: list[LedgerEvent]


class SampleView(msgspec.Struct, kw_only=True):
    """A Sample decoded without its token-level payload (tokens, response text, log-probs, loss
    mask): msgspec skips those bytes without building Python objects. Everything the buffer
    decides on is here. Decodes any encoded Sample."""

    index: int | None = None
    group_index: int | None = None
    prompt: Any = ""
    label: Any = None
    response_length: int = 0
    reward: float | dict[str, float] | None = None
    status: SampleStatus = SampleStatus.PENDING
    weight_versions: list[int] = msgspec.field(default_factory=list)
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)
    remove_sample: bool = False

    def reset_for_retry(self) -> None:
        self.reward = None
        self.response_length = 0
        self.weight_versions = []
        self.remove_sample = False
        self.status = SampleStatus.ABORTED


class RolloutGroupView(msgspec.Struct, kw_only=True):
    """A RolloutGroup decoded as SampleViews (see SampleView)."""

    group_id: str
    group_index: int
    attempt: int = 0
    samples: list[SampleView | list[SampleView]] = msgspec.field(default_factory=list)
    producer_id: str = ""


# ---- multi-LoRA: the adapter registry (services/adapters) --------------------------------------

LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
"""The projections an adapter may wrap."""
DEFAULT_LORA_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MAX_LORA_SCALE = 1000.0
"""The largest alpha / rank an adapter may have: beyond it the delta overflows the model's dtype
(a scale of 1e300 does not fit a float) or drowns the base in NaN logits."""
"""An adapter's target modules when its spec names none: every attention projection."""


class AdapterState(str, enum.Enum):
    """An adapter's lifecycle: PENDING (registered, holds a slot, the trainer sets it up) ->
    ACTIVE (training) -> RETIRING (asked to stop: DELETE, or the trainer reached its budget) ->
    CLEANUP (its final save is running) -> COMPLETED (saved; its slot is free). A PENDING adapter
    retired goes straight to CLEANUP."""

    PENDING = "pending"
    ACTIVE = "active"
    RETIRING = "retiring"
    CLEANUP = "cleanup"
    COMPLETED = "completed"


class AdapterSpec(msgspec.Struct, kw_only=True):
    """One tenant's LoRA adapter on the run's base model (a YAML file of --multi-lora-adapter, or
    the body of POST /adapter_runs). The registry checks what a tenant sends (unknown fields
    included: services/adapters/registry.py `parse_spec`); decoding from KV ignores fields it
    does not know, so that a newer registry's state stays readable."""

    data: str
    """JSONL prompt file of this adapter."""
    rank: int
    alpha: float
    rollout_batch_size: int
    """Groups per optimizer step of this adapter."""
    n_samples_per_prompt: int
    save: str
    """Directory of this adapter's saves (its final save included)."""
    target_modules: list[str] = msgspec.field(default_factory=lambda: list(DEFAULT_LORA_TARGET_MODULES))
    rm_type: str | None = None
    """A built-in reward (exactly one of rm_type and custom_rm_path)."""
    custom_rm_path: str | None = None
    """module.fn of a reward function."""
    num_step: int | None = None
    """The budget: this many optimizer steps (exactly one of num_step and num_epoch)."""
    num_epoch: int | None = None
    """The budget: this many passes over `data`."""
    metadata: dict[str, Any] = msgspec.field(default_factory=dict)


class AdapterRun(msgspec.Struct, kw_only=True):
    """One registration of an adapter: the registry keeps every one (COMPLETED ones as history)."""

    name: str
    registration_id: str
    """uuid4 hex, one per registration (a name registered again gets a new one)."""
    slot: int
    """The trainer's adapter slot it holds (0 .. --multi-lora-n-adapters - 1); freed once COMPLETED."""
    state: AdapterState
    spec: AdapterSpec
    created_at: float = 0.0
    updated_at: float = 0.0
    step: int = 0
    """Optimizer steps this adapter has taken (the trainer reports them)."""
    slot_version: int = 0
    """slot_versions[slot] after this adapter's last step (its weights' version in the slot)."""
    message: str = ""
    """Why it is where it is (who retired it, and when)."""


class AdapterRegistryState(msgspec.Struct, kw_only=True):
    """The registry's whole state: KV `adapters` of the run (asyncrl_proto.subjects.ADAPTERS_KV_KEY),
    written by the adapters service only, compare-and-set on the KV revision it last read."""

    runs: list[AdapterRun] = msgspec.field(default_factory=list)
    """Every registration, oldest first."""
    slot_versions: list[int] = msgspec.field(default_factory=list)
    """Per slot, a counter that grows with every step any of its adapters takes and never resets,
    so (slot, slot_version) names one set of adapter weights for the whole run."""
    revision: int = 0
    """The registry's own change counter (+1 per change)."""
    updated_at: float = 0.0


class AdapterControl(msgspec.Struct, kw_only=True):
    """Trainer -> adapters (core request/reply on `adapters.control`): op activate | stepped |
    retire | cleanup | complete on adapter `name`. With `registration_id`, the request is refused
    unless it names the adapter's current registration (a name registered again is another run)."""

    op: str
    name: str
    registration_id: str = ""
    step: int = 0
    """stepped: the adapter's optimizer steps so far."""
    reason: str = ""


class AdapterControlReply(msgspec.Struct, kw_only=True):
    ok: bool
    error: str = ""
    run: AdapterRun | None = None
    revision: int = 0
    """The registry's revision after the request."""
    retry: bool = False
    """Not refused: the registry could not store its state (its broker away). Ask again."""


class AdapterPublished(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Trainer -> weight-sync (WEIGHTS, `weights.adapters`): version `version` of adapter `name`
    (registration `registration_id`) is a complete PEFT directory at `uri`
    (`<run_dir>/adapters/<name>/<registration>/v<version>`). Weight-sync loads it on every engine
    under its engine name (`adapter_engine_name`), without pausing generation."""

    name: str
    registration_id: str
    version: int
    uri: str
    num_bytes: int = 0
    created_at: float = 0.0


class AdapterLive(msgspec.Struct, kw_only=True):
    """Weight-sync -> producers (KV `adapter_live.<name>`): the adapter version every engine
    serves, and the name requests give it (`lora_path`)."""

    name: str
    registration_id: str
    version: int
    engine_name: str
    uri: str = ""
    engines: list[str] = msgspec.field(default_factory=list)
    created_at: float = 0.0
    """When the trainer announced this version: an older registration's late message never replaces it."""
    updated_at: float = 0.0


def adapter_engine_name(name: str, registration_id: str, version: int) -> str:
    """The name an engine serves one adapter version under (`lora_path`): a name registered again
    is another adapter, so its registration is part of it."""
    return f"{name}@{registration_id[:12]}.v{version}"
