"""The engine's tool-call parser (qwen25 / hermes) and the arguments chat templates read."""

from __future__ import annotations

import json

import pytest

from services.engine.tool_calls import arguments_for_template, parse_tool_calls


def test_call_blocks_become_openai_tool_calls_and_the_rest_stays_text():
    text = ('Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": "x"}}\n</tool_call>'
            '<tool_call>{"name": "now", "arguments": "{}"}</tool_call> done')  # fmt: skip
    content, calls = parse_tool_calls(text)
    assert content == "Let me add.\n done"
    assert [c["function"]["name"] for c in calls] == ["add", "now"]
    assert json.loads(calls[0]["function"]["arguments"]) == {"a": 1, "b": "x"}
    assert calls[1]["function"]["arguments"] == "{}"  # a JSON string stays as the model wrote it
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in calls)
    assert len({c["id"] for c in calls}) == 2


@pytest.mark.parametrize("text", [
    "no call at all",
    "<tool_call>{not json}</tool_call>",
    '<tool_call>["add"]</tool_call>',
    '<tool_call>{"arguments": {}}</tool_call>',
    '<tool_call>{"name": ""}</tool_call>',
    '<tool_call>{"name": "add"',  # cut by max_tokens
    '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',  # arguments must be an object
    '<tool_call>{"name": "add", "arguments": null}</tool_call>',
    '<tool_call>{"name": "add", "arguments": "not json"}</tool_call>',
    "<tool_call>" + "[" * 100_000 + "</tool_call>",  # nested past json's depth
])  # fmt: skip
def test_what_is_not_a_well_formed_call_stays_the_models_text(text):
    assert parse_tool_calls(text) == (text, [])


def test_a_malformed_block_next_to_a_good_one_stays_in_the_text():
    content, calls = parse_tool_calls('<tool_call>{oops}</tool_call><tool_call>{"name": "f"}</tool_call>')
    assert content == "<tool_call>{oops}</tool_call>" and [c["function"]["name"] for c in calls] == ["f"]
    assert calls[0]["function"]["arguments"] == "{}"


def test_templates_get_the_arguments_as_objects():
    m = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": '{"x": [1, 2]}'}},
        {"id": "2", "type": "function", "function": {"name": "g", "arguments": ""}},
        {"id": "3", "type": "function", "function": {"name": "h", "arguments": {"y": 1}}}]}  # fmt: skip
    out = arguments_for_template(m)
    assert [c["function"]["arguments"] for c in out["tool_calls"]] == [{"x": [1, 2]}, {}, {"y": 1}]
    assert m["tool_calls"][0]["function"]["arguments"] == '{"x": [1, 2]}'  # the request is left as it came
    for bad, why in (('{"x": ', "is not JSON"), ("[1]", "must be a JSON object"), ("[" * 100_000, "is not JSON")):
        with pytest.raises(ValueError, match=why):
            arguments_for_template({"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": bad}}]})
    with pytest.raises(ValueError, match="needs a function with a name"):
        arguments_for_template({"role": "assistant", "tool_calls": [{"function": {}}]})


def test_a_degenerate_answer_parses_in_linear_time():
    """Thousands of opening tags and no closing one (or a run of whitespace) cost the text's
    length: the parse runs on the engine's event loop."""
    import time

    for text in ("<tool_call>" * 20_000 + "x" * 200_000, "<tool_call>" + " " * 400_000 + "x"):
        t0 = time.perf_counter()
        assert parse_tool_calls(text) == (text, [])
        assert time.perf_counter() - t0 < 0.5


def test_an_unclosed_opening_tag_before_a_call_stays_text():
    content, calls = parse_tool_calls('<tool_call> oops <tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert content == "<tool_call> oops" and [c["function"]["name"] for c in calls] == ["f"]
