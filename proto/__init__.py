"""asyncrl's wire contract: every message that crosses NATS, and every subject and stream name.

Installed under the import name ``asyncrl_proto`` (the folder is ``proto/``) so that it never
collides with PyPI's ``proto-plus``, which owns ``import proto``. This package imports msgspec and
the standard library only: no torch, ray or nats (a unit test enforces it).
"""

from asyncrl_proto.codec import MalformedMessage, decode, encode
from asyncrl_proto.messages import (
    BufferCommit,
    BufferCommitReply,
    BufferGetReply,
    BufferGetRequest,
    ControlMsg,
    DeadLetter,
    EvalRequest,
    EvalResult,
    GroupRef,
    Heartbeat,
    LedgerBatch,
    LedgerEvent,
    ProgressRecord,
    PromptMsg,
    RolloutGroup,
    RolloutGroupView,
    Sample,
    SampleStatus,
    TransferReply,
    TransferRequest,
    WeightsLive,
    WeightsPublished,
    group_id,
)

__all__ = [
    "BufferCommit",
    "BufferCommitReply",
    "BufferGetReply",
    "BufferGetRequest",
    "ControlMsg",
    "DeadLetter",
    "EvalRequest",
    "EvalResult",
    "GroupRef",
    "Heartbeat",
    "LedgerBatch",
    "LedgerEvent",
    "MalformedMessage",
    "ProgressRecord",
    "PromptMsg",
    "RolloutGroup",
    "RolloutGroupView",
    "Sample",
    "SampleStatus",
    "TransferReply",
    "TransferRequest",
    "WeightsLive",
    "WeightsPublished",
    "group_id",
    "decode",
    "encode",
]
