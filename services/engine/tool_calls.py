"""Tool-call parsing for /v1/chat/completions (`--tool-call-parser`, SGLang's flag and names).

A model's calls, in its own syntax, are answered as OpenAI does: `message.tool_calls` (an id, the
function's name, its arguments as a JSON string), the text around them as `content`, and finish
reason `tool_calls`. One syntax is built in: `qwen25` (also `hermes`), the
`<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks of Qwen2.5/Qwen3 and Hermes.

A block whose body is not a JSON object with a string `name` stays in the text: the client sees
what the model wrote, as SGLang does. Parsing never touches the token ids or log-probs
(`return_token_ids` still returns what was sampled)."""

from __future__ import annotations

import json
import uuid

OPEN, CLOSE = "<tool_call>", "</tool_call>"


def _blocks(text: str):
    """(start, end, body) of each <tool_call>...</tool_call> block, in one pass over the text: a
    model's degenerate output (thousands of opening tags and no closing one) costs its length,
    never its length squared (the parse runs on the engine's event loop)."""
    at = 0
    while (start := text.find(OPEN, at)) != -1:
        end = text.find(CLOSE, start + len(OPEN))
        if end == -1:
            return
        inner = text[start + len(OPEN) : end]
        nested = inner.rfind(OPEN)  # "<tool_call> junk <tool_call>{...}</tool_call>": the last opening tag's
        if nested != -1:
            start, inner = start + len(OPEN) + nested, inner[nested + len(OPEN) :]
        yield start, end + len(CLOSE), inner.strip()
        at = end + len(CLOSE)


def _arguments(body: dict) -> str | None:
    """The call's arguments as a JSON string if they are a JSON object (or a string holding one)."""
    args = body.get("arguments", body.get("parameters", {}))
    if isinstance(args, str):  # already a JSON string: keep it as the model wrote it
        try:
            return args if isinstance(json.loads(args), dict) else None
        except (ValueError, RecursionError):
            return None
    return json.dumps(args, ensure_ascii=False) if isinstance(args, dict) else None


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """(the text without its well-formed call blocks, the calls in OpenAI's shape). A block is
    well formed when it holds a JSON object with a non-empty string `name` and arguments that are
    a JSON object; anything else stays text (a client could not send such a call back)."""
    calls, kept, last = [], [], 0
    for start, end, inner in _blocks(text):
        try:
            body = json.loads(inner)
        except (ValueError, RecursionError):  # RecursionError: nested past the parser's depth
            continue
        if not (isinstance(body, dict) and isinstance(body.get("name"), str) and body["name"]):
            continue
        if (arguments := _arguments(body)) is None:
            continue
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": body["name"], "arguments": arguments}})  # fmt: skip
        kept.append(text[last:start])
        last = end
    kept.append(text[last:])
    return ("".join(kept).strip(), calls) if calls else (text, [])


def arguments_for_template(message: dict) -> dict:
    """An assistant message whose tool calls carry OpenAI's JSON-string arguments, with them as
    objects, as chat templates read them (transformers' convention; SGLang and vLLM do the same
    before rendering). Raises ValueError naming the call whose arguments are not a JSON object."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    if not isinstance(calls, list):
        raise ValueError("tool_calls must be a list")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise ValueError(f"tool_calls[{j}] needs a function with a name")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except (ValueError, RecursionError):
                raise ValueError(f"tool_calls[{j}].function.arguments is not JSON") from None
        if not isinstance(args, dict):
            raise ValueError(f"tool_calls[{j}].function.arguments must be a JSON object")
        out.append({**call, "function": {**fn, "arguments": args}})
    return {**message, "tool_calls": out}
