"""Subject, stream and bucket names. Every name carries the run id so that many runs can share
one NATS cluster. Stream specs are plain dicts of JetStream StreamConfig fields (no nats import).
"""

from __future__ import annotations

import re

from msgspec import Struct

_RUN_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
_PARTITION = re.compile(r"^[A-Za-z0-9_-]{1,64}$")

KIB, MIB = 1024, 1024 * 1024
MAX_PAYLOAD_BYTES = 8 * MIB
"""The server's max_payload that the embedded nats-server is started with (docs/trust.md, "What one
role can store")."""
ROLLOUTS_MAX_MSGS = 4096
"""ROLLOUTS' message cap when the run's own is not given (rollouts_max_msgs in the run's config)."""


def check_run_id(run_id: str) -> str:
    if not _RUN_ID.match(run_id):
        raise ValueError(
            f"run id {run_id!r} is not usable in NATS subjects: use 1-64 characters from letters, digits, '_' and '-'"
        )
    return run_id


ADAPTER_LIVE_KV_PREFIX = "adapter_live"
"""KV keys `adapter_live.<name>` of the run's bucket: each adapter's live version (AdapterLive),
written by weight-sync once every engine serves it."""

ADAPTERS_KV_KEY = "adapters"
"""KV key of the run's bucket holding the multi-LoRA registry's state (an AdapterRegistryState),
written by the adapters service only."""


def inbox_prefix(run_id: str, role: str) -> str:
    """Where one role's replies and push deliveries arrive: no other role may subscribe there."""
    return f"_INBOX.{run_id}.{role}"


class ConsumerSpec(Struct, frozen=True):
    """A durable JetStream consumer of the run. The admin (launcher, init-run) creates it; a
    service only binds to it, so no role can change how its consumer redelivers."""

    stream: str
    durable: str
    filter_subject: str
    ack_wait_s: float
    max_ack_pending: int
    deliver_subject: str = ""
    """Set for a push consumer: its deliveries go there (the consuming role's inbox)."""


class Subjects(Struct, frozen=True):
    """All names of one run. With `partition` (multi-LoRA: an adapter registration's id), the
    names of that partition's prompts, rollouts, ledger, gets and commits (`<name>.<partition>`,
    in the same streams); every other name is the run's."""

    run_id: str
    partition: str = ""

    def of(self, partition: str) -> Subjects:
        """The names of one partition of this run."""
        if not _PARTITION.match(partition):
            raise ValueError(f"partition {partition!r} is not usable in NATS subjects")
        return Subjects(run_id=self.run_id, partition=partition)

    def _p(self, tail: str) -> str:
        return self._s(f"{tail}.{self.partition}" if self.partition else tail)

    @property
    def buffer_snapshot_key(self) -> str:
        """KV key of the buffer's snapshot (one per partition)."""
        return f"buffer_snapshot.{self.partition}" if self.partition else "buffer_snapshot"

    # JetStream streams
    @property
    def prompts_stream(self) -> str:
        return f"PROMPTS_{self.run_id}"

    @property
    def rollouts_stream(self) -> str:
        return f"ROLLOUTS_{self.run_id}"

    @property
    def weights_stream(self) -> str:
        return f"WEIGHTS_{self.run_id}"

    @property
    def eval_stream(self) -> str:
        return f"EVAL_{self.run_id}"

    @property
    def progress_stream(self) -> str:
        return f"PROGRESS_{self.run_id}"

    @property
    def deadletter_stream(self) -> str:
        return f"DEADLETTER_{self.run_id}"

    @property
    def ledger_stream(self) -> str:
        return f"LEDGER_{self.run_id}"

    @property
    def kv_bucket(self) -> str:
        return f"ASYNCRL_{self.run_id}"

    @property
    def weights_bucket(self) -> str:
        """The Object Store bucket of weight snapshots (--update-weight-transfer-mode object-store);
        its stream is OBJ_<bucket>."""
        return f"WEIGHTS_{self.run_id}"

    # subjects
    def _s(self, tail: str) -> str:
        return f"asyncrl.{self.run_id}.{tail}"

    @property
    def prompts(self) -> str:
        return self._p("prompts")

    @property
    def rollouts(self) -> str:
        return self._p("rollouts")

    @property
    def weights_published(self) -> str:
        return self._s("weights.published")

    @property
    def weights_live(self) -> str:
        return self._s("weights.live")

    @property
    def adapters_published(self) -> str:
        """Multi-LoRA: the trainer's adapter versions (AdapterPublished), in WEIGHTS."""
        return self._s("weights.adapters")

    @property
    def eval_requests(self) -> str:
        return self._s("eval.requests")

    @property
    def eval_results(self) -> str:
        return self._s("eval.results")

    @property
    def progress(self) -> str:
        return self._s("progress")

    @property
    def ledger(self) -> str:
        return self._p("ledger")

    @property
    def buffer_get(self) -> str:
        return self._p("buffer.get")

    @property
    def buffer_commit(self) -> str:
        return self._p("buffer.commit")

    @property
    def weights_transfer(self) -> str:
        """Core request/reply, weight-sync -> trainer: the distributed weight transfer group."""
        return self._s("weights.transfer")

    @property
    def control(self) -> str:
        return self._s("control")

    @property
    def adapters_control(self) -> str:
        """Core request/reply, trainer -> adapters: the multi-LoRA registry's transitions (AdapterControl)."""
        return self._s("adapters.control")

    def heartbeat(self, service: str) -> str:
        return self._s(f"heartbeat.{service}")

    @property
    def heartbeat_all(self) -> str:
        return self._s("heartbeat.*")

    @property
    def deadletter_all(self) -> str:
        """Every dead letter of the run (a reader's filter)."""
        return self._s("deadletter.>")

    def deadletter(self, subject: str) -> str:
        """Dead letters keep the tail of the subject they failed on."""
        prefix = self._s("")
        tail = subject[len(prefix) :] if subject.startswith(prefix) else subject
        return self._s(f"deadletter.{tail}")

    def consumers(self, prompt_ack_wait_s: float, partitioned: bool = False) -> dict[str, ConsumerSpec]:
        """The run's durable consumers by name; `prompt_ack_wait_s` is --prompt-ack-wait-s. A
        partitioned run (multi-LoRA) has its producers and its buffer read every partition."""
        prompts, rollouts = (self._s("prompts.*"), self._s("rollouts.*")) if partitioned else (self.prompts, self.rollouts)
        return {
            "producers": ConsumerSpec(stream=self.prompts_stream, durable="producers", filter_subject=prompts,
                                      ack_wait_s=prompt_ack_wait_s, max_ack_pending=100_000),
            "buffer": ConsumerSpec(stream=self.rollouts_stream, durable="buffer", filter_subject=rollouts,
                                   ack_wait_s=10.0, max_ack_pending=256,
                                   deliver_subject=inbox_prefix(self.run_id, "buffer") + ".rollouts"),
            "weight-sync": ConsumerSpec(stream=self.weights_stream, durable="weight-sync",
                                        filter_subject=self.weights_published, ack_wait_s=15.0, max_ack_pending=1000),
            "weight-sync-adapters": ConsumerSpec(stream=self.weights_stream, durable="weight-sync-adapters",
                                                 filter_subject=self.adapters_published, ack_wait_s=60.0,
                                                 max_ack_pending=1000),
            "eval": ConsumerSpec(stream=self.eval_stream, durable="eval", filter_subject=self.eval_requests,
                                 ack_wait_s=30.0, max_ack_pending=1000),
        }  # fmt: skip

    # stream specs: StreamConfig fields, applied by services.common.bus
    def stream_specs(self, partitioned: bool = False, rollouts_max_msgs: int = ROLLOUTS_MAX_MSGS) -> list[dict]:
        """Every stream of the run, each bounded in message size and count (docs/trust.md, "What
        one role can store"): no byte limit (JetStream reserves a stream's max_bytes out of the
        server's store up front), so a stream holds at most max_msgs x max_msg_size. A stream that
        must not lose what it holds refuses new messages when full (discard "new"); one that is
        read for its latest messages drops its oldest. Only subjects that something consumes are
        stored: a single-model run's prompts, rollouts and ledger, a partitioned (multi-LoRA) run's
        `.<registration>` ones."""
        own = (lambda tail: [self._s(f"{tail}.*")]) if partitioned else (lambda tail: [self._s(tail)])
        return [
            {  # written by the buffer only, within its release allowance; producers take them
                "name": self.prompts_stream, "subjects": own("prompts"), "retention": "workqueue",
                "storage": "file", "max_msg_size": MAX_PAYLOAD_BYTES, "max_msgs": 65_536, "discard": "new",
                "duplicate_window": 3600.0,  # a restarted buffer publishes the outstanding ones again
            },
            {  # producers' groups; purged once trained (a flood of rejected ones at the next commit)
                "name": self.rollouts_stream, "subjects": own("rollouts"), "retention": "limits",
                "storage": "file", "duplicate_window": 600.0, "allow_direct": True,
                "max_msg_size": MAX_PAYLOAD_BYTES, "max_msgs": rollouts_max_msgs, "discard": "new",
            },
            {  # announcements: the newest matter
                "name": self.weights_stream, "retention": "limits", "storage": "file",
                "subjects": [self.weights_published, self.weights_live, self.adapters_published],
                "max_msg_size": 64 * KIB, "max_msgs": 100_000, "discard": "old",
            },
            {
                "name": self.eval_stream, "subjects": [self.eval_requests, self.eval_results],
                "retention": "limits", "storage": "file", "duplicate_window": 600.0,
                "max_msg_size": 256 * KIB, "max_msgs": 10_000, "discard": "old",
            },
            {
                "name": self.progress_stream, "subjects": [self.progress], "retention": "limits",
                "storage": "file", "max_msg_size": MIB, "max_msgs": 100_000, "discard": "old",
            },
            {  # the durable record: written by the buffer only, never dropped (a full one stops the run)
                "name": self.ledger_stream, "subjects": own("ledger"), "retention": "limits",
                "storage": "file", "duplicate_window": 600.0, "allow_direct": True,
                "max_msg_size": MAX_PAYLOAD_BYTES, "max_msgs": 10_000_000, "discard": "new",
            },
            {  # every role writes here: a dead letter keeps at most 64 KB of its message, and the
               # server refuses anything larger than 96 KiB (published straight to the subject, past
               # the services' truncation); the oldest go first
                "name": self.deadletter_stream, "subjects": [self.deadletter_all],
                "retention": "limits", "storage": "file", "max_msg_size": 96 * KIB, "max_msgs": 10_000,
                "discard": "old",
            },
        ]  # fmt: skip
