"""The wire contract: round trips, plain-msgpack interop, golden encodings, no heavy imports."""

from __future__ import annotations

import ast
import pathlib

import msgpack
import msgspec
import pytest

from asyncrl_proto import (
    BufferGetRequest,
    EngineSwitch,
    GroupRef,
    PromptMsg,
    RolloutGroup,
    Sample,
    SampleStatus,
    WeightsLive,
    WeightsPublished,
    decode,
    encode,
)
from asyncrl_proto.messages import flatten_group, oldest_weight_version

PROTO_DIR = pathlib.Path(__file__).resolve().parents[2] / "proto"


def test_sample_defaults_and_kwargs():
    s = Sample(index=3, group_index=0, prompt="12=", weight_versions=[1, 2])
    assert s.status is SampleStatus.PENDING
    assert s.tokens == [] and s.loss_mask is None and s.remove_sample is False
    assert Sample().metadata is not Sample().metadata  # no shared mutable defaults


def test_rollout_group_round_trip_and_plain_msgpack_interop():
    s = Sample(index=1, group_index=0, prompt="12=", label="21", tokens=[1, 5, 6, 15, 6, 5, 2],
               response="21", response_length=3, reward=0.5, rollout_log_probs=[-0.1, -0.2, -0.3],
               status=SampleStatus.COMPLETED, weight_versions=[3, 4], metadata={"k": [1, 2]})  # fmt: skip
    g = RolloutGroup(group_id="g0-a0", group_index=0, samples=[s, [s, s]])
    data = encode(g)
    back = decode(data, RolloutGroup)
    assert back == g
    plain = msgpack.unpackb(data)
    assert plain["group_id"] == "g0-a0"
    assert plain["samples"][0]["status"] == "completed"
    assert plain["samples"][1][0]["weight_versions"] == [3, 4]


def test_malformed_message_is_rejected_at_decode():
    with pytest.raises(msgspec.ValidationError):
        decode(msgpack.packb({"group_id": 5}), RolloutGroup)
    with pytest.raises(msgspec.DecodeError):
        decode(b"\xc1not msgpack", RolloutGroup)


# Golden encodings: these bytes were produced by the first version of each message. A change
# that breaks them breaks every message already stored on a stream.
GOLDEN = {
    "PromptMsg": (
        PromptMsg(
            group_index=7,
            prompt="12=",
            label="21",
            attempt=1,
            epoch=0,
            row=3,
            n_samples=8,
            released_at=1.5,
        ),
        "8aab67726f75705f696e64657807a670726f6d7074a331323da56c6162656ca23231a86d65746164617461"
        "80a7617474656d707401a565706f636800a3726f7703a96e5f73616d706c657308ab72656c65617365645f"
        "6174cb3ff8000000000000a5746f6f6c73c0",
    ),
    "WeightsPublished": (
        WeightsPublished(version=2, step=1, uri="/w/v2", sha256="ab", num_bytes=10, created_at=2.0),
        "86a776657273696f6e02a473746570"
        "01a3757269a52f772f7632a6736861323536a26162a96e756d5f6279746573"
        "0aaa637265617465645f6174cb4000000000000000",
    ),
}


@pytest.mark.parametrize("name", sorted(GOLDEN))
def test_golden_encodings_stay_readable(name):
    msg, hexdata = GOLDEN[name]
    assert decode(bytes.fromhex(hexdata), type(msg)) == msg
    assert encode(msg).hex() == hexdata


PROMPT_BEFORE_TOOLS = (
    "89ab67726f75705f696e64657807a670726f6d7074a331323da56c6162656ca23231a86d65746164617461"
    "80a7617474656d707401a565706f636800a3726f7703a96e5f73616d706c657308ab72656c65617365645f"
    "6174cb3ff8000000000000"
)
"""PromptMsg's golden encoding before `tools` (--tool-key) was added last."""


def test_a_prompt_released_before_tools_existed_still_reads():
    assert decode(bytes.fromhex(PROMPT_BEFORE_TOOLS), PromptMsg) == GOLDEN["PromptMsg"][0]


def test_new_fields_only_at_the_end_with_defaults():
    # an old message without the optional fields decodes with defaults
    old = msgpack.packb({"step": 3, "count": 16})
    req = decode(old, BufferGetRequest)
    assert req.wait_s == 2.0 and req.context == {} and req.lookahead_steps == 0
    ref = decode(msgpack.packb({"group_id": "g", "group_index": 1}), GroupRef)
    assert ref.payload is None and ref.stream_seq == 0


def test_group_helpers():
    a = Sample(weight_versions=[3, 5])
    b = Sample(weight_versions=[])
    assert oldest_weight_version([a, [b, Sample(weight_versions=[2])]]) == 2
    assert oldest_weight_version([b]) is None
    assert len(flatten_group([a, [a, b]])) == 3


def test_reset_for_retry_keeps_identity_fields_only():
    s = Sample(index=4, group_index=1, prompt="p", label="l", metadata={"m": 1}, tokens=[1, 2], response="x",
               response_length=1, reward=1.0, rollout_log_probs=[-1.0], loss_mask=[1],
               status=SampleStatus.COMPLETED, weight_versions=[2], remove_sample=True)  # fmt: skip
    s.reset_for_retry()
    assert (s.index, s.group_index, s.prompt, s.label, s.metadata) == (4, 1, "p", "l", {"m": 1})
    assert s.tokens == [] and s.response == "" and s.response_length == 0 and s.reward is None
    assert s.rollout_log_probs == [] and s.loss_mask is None and s.weight_versions == []
    assert s.status is SampleStatus.ABORTED


def test_proto_imports_no_torch_ray_or_nats():
    forbidden = {"torch", "ray", "nats", "services"}
    for path in PROTO_DIR.glob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module]
            for n in names:
                assert n.split(".")[0] not in forbidden, f"{path.name} imports {n}"


def test_a_sample_and_a_live_version_from_before_wire_version_2_still_read():
    """Sample.version_spans and WeightsLive.switched were added last (wire version 2): what an
    older producer or weight-sync wrote decodes with them empty."""
    old_sample = msgpack.packb({"index": 3, "group_index": 0, "prompt": "1=", "label": None, "tokens": [1, 2, 3],
                                "response": "2", "response_length": 1, "reward": 0.5, "rollout_log_probs": [-0.1],
                                "loss_mask": None, "status": "completed", "weight_versions": [4], "metadata": {},
                                "remove_sample": False})  # fmt: skip
    s = decode(old_sample, Sample)
    assert s.version_spans == [] and s.weight_versions == [4] and s.tokens == [1, 2, 3]
    old_live = msgpack.packb({"version": 5, "engines": ["http://e"], "updated_at": 1.0, "pause_mode": "retract",
                              "duration_s": 0.1, "pause_s": 0.05, "tensor_sha256": ""})  # fmt: skip
    live = decode(old_live, WeightsLive)
    assert live.version == 5 and live.switched == []
    new = WeightsLive(version=6, switched=[EngineSwitch(engine="http://e", paused_at=1.0, resumed_at=1.2)])
    assert decode(encode(new), WeightsLive) == new
