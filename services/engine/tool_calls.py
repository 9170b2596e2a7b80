"""Tool-call parsing for /v1/chat/completions (`--tool-call-parser`, SGLang's flag and names).

A model that was trained to call tools writes its calls in its own syntax; with a parser the
engine answers them as OpenAI does: `message.tool_calls` (each with an id, the function's name
and its arguments as a JSON string), the text around them as `content`, and finish reason
`tool_calls`. One syntax is built in:

- `qwen25` (also `hermes`): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, the
  syntax of Qwen2.5/Qwen3 and Hermes chat templates.

A block whose body is not a JSON object with a string `name` stays in the text: the client sees
what the model wrote, as SGLang does. Parsing never touches the token ids or log-probs
(`return_token_ids` still returns what was sampled)."""

from __future__ import annotations

import json
import re
import uuid

PARSERS = ("qwen25", "hermes")
_BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str, list[dict]]:
    """(the text without its well-formed call blocks, the calls in OpenAI's shape)."""
    calls, kept, last = [], [], 0
    for m in _BLOCK.finditer(text):
        try:
            body = json.loads(m.group(1))
        except (ValueError, RecursionError):  # RecursionError: nested past the parser's depth
            continue
        if not (isinstance(body, dict) and isinstance(body.get("name"), str) and body["name"]):
            continue
        args = body.get("arguments", body.get("parameters", {}))
        if isinstance(args, str):  # already a JSON string: keep it as the model wrote it
            arguments = args
        else:
            arguments = json.dumps(args, ensure_ascii=False)
        calls.append({"id": "call_" + uuid.uuid4().hex[:24], "type": "function",
                      "function": {"name": body["name"], "arguments": arguments}})  # fmt: skip
        kept.append(text[last : m.start()])
        last = m.end()
    if not calls:
        return text, []
    kept.append(text[last:])
    return "".join(kept).strip(), calls


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
