"""NeMo Gym resources servers in the loop: `--env nemogym:URL`.

A NeMo Gym environment is a resources server speaking its seed/verify protocol over HTTP, its
episode state kept under a session cookie. Each trajectory is one session:

    POST /seed_session  the task's row, {"responses_create_params": {"input", "tools", ...}, ...}
    -> the model's turn (a chat request to the engine, with the row's tools)
    -> each tool call it makes: POST /<tool name> with the call's arguments (a JSON object); the
       answer's body, whatever its status, is the tool's output the model reads next
    -> ... until a reply calls no tool, or --env-max-turns, or the token budget, or the context
    POST /verify        the row plus "response": the episode as a Responses API object; the
                        answer's "reward" is the episode's reward

The row is the sample's metadata when it holds `responses_create_params` (a NeMo Gym dataset row);
else it is built from the prompt, the row's tools (--tool-key) and the other metadata fields.

The model's turns go through the engine's /v1/chat/completions with `return_token_ids`, and the
sample is built from the ids the engine saw and sampled (services/envs/chat.py's `assemble`): the
model's replies in the loss, the tool outputs out of it. Tool calls arrive as OpenAI `tool_calls`
only from engines that parse them (--sglang-tool-call-parser). A turn the engine aborted ends the
sample there, ABORTED, unverified. The reward is metadata["env_reward"]; the verify answer's other
scalar fields are kept in metadata["env_verify"].
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid

import aiohttp

from asyncrl_proto.messages import Sample, SampleStatus
from services.common.engine_commands import tool_call_parser
from services.common.sglang_client import EngineError
from services.envs.chat import ask_engine, assemble, recorded_turn
from services.envs.trajectory import EnvError, gated

CALL_TIMEOUT_S = 300.0
"""A resources server that takes longer to answer one request fails the episode (its group is retried)."""
MAX_ANSWER_BYTES = 16 * 2**20
ROUTES = frozenset({"seed_session", "verify", "aggregate_metrics", "reverify_mode", "mcp"})
"""A resources server's own routes: never a tool's."""
TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def check(config) -> None:
    """At start-up: the URL is a resources server's HTTP address (the config checked its shape)."""
    base_url(config.rollout.env_spec.url)


def base_url(url: str) -> str:
    url = url.strip().rstrip("/")
    if not url.startswith(("http://", "https://")) or not url.partition("://")[2]:
        raise EnvError(f"--env nemogym:{url}: give the resources server's HTTP address, e.g. nemogym:http://host:8000")
    return url


# ---- the row, and the conversation in the engine's (chat) shape -----------------------------------


def nemogym_row(sample: Sample) -> dict:
    """The NeMo Gym row of a sample (see the module): its metadata when that holds
    responses_create_params, else one built from its prompt, tools and metadata."""
    meta = {k: v for k, v in sample.metadata.items() if not k.startswith("_") and k != "rm_type"}
    if "responses_create_params" in meta:
        if not isinstance(meta["responses_create_params"], dict):
            raise EnvError("metadata.responses_create_params must be an object (a NeMo Gym row's request)")
        return meta
    tools = meta.pop("tools", None)
    if isinstance(sample.prompt, str):
        messages = [{"role": "user", "content": sample.prompt}]
    elif isinstance(sample.prompt, list) and sample.prompt and all(isinstance(m, dict) for m in sample.prompt):
        messages = [dict(m) for m in sample.prompt]
    else:
        raise EnvError("--env nemogym: a row's prompt must be text or chat messages (or its metadata a NeMo Gym row "
                       "with responses_create_params)")  # fmt: skip
    params: dict = {"input": messages}
    if tools:
        params["tools"] = [_responses_tool(t) for t in tools]
    return {**meta, "responses_create_params": params}


def _responses_tool(tool: dict) -> dict:
    """A tool schema in the Responses API's shape (a chat one, {"type", "function": {...}}, flattened)."""
    spec = tool.get("function") if isinstance(tool.get("function"), dict) else tool
    out = {"type": "function", "name": spec.get("name"), "parameters": spec.get("parameters") or
           {"type": "object", "properties": {}}, "strict": spec.get("strict", False)}  # fmt: skip
    return {**out, "description": spec["description"]} if spec.get("description") else out


def chat_tools(tools) -> list[dict]:
    """responses_create_params.tools as the engine's chat tools; EnvError for what cannot be offered."""
    if not tools:
        return []
    if not isinstance(tools, list):
        raise EnvError("responses_create_params.tools must be a list of tool schemas")
    out = []
    for i, t in enumerate(tools):
        spec = (t.get("function") if isinstance(t.get("function"), dict) else t) if isinstance(t, dict) else None
        if spec is None or t.get("type") != "function":
            raise EnvError(f"responses_create_params.tools[{i}]: only function tools can be offered "
                           f"(got type {t.get('type') if isinstance(t, dict) else t!r:.60})")  # fmt: skip
        name = spec.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise EnvError(f"responses_create_params.tools[{i}]: the name {name!r:.80} is not a tool name "
                           "(letters, digits, _ and -, at most 64: it is the resources server's route)")  # fmt: skip
        if name in ROUTES:
            raise EnvError(f"responses_create_params.tools[{i}]: {name!r} is a resources server's own route, "
                           "not a tool")  # fmt: skip
        fn = {k: spec[k] for k in ("name", "description", "parameters") if spec.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out


def _text(content, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        for part in content:
            if not (isinstance(part, dict) and isinstance(part.get("text"), str)):
                raise EnvError(f"{where}: only text content can reach the model (got "
                               f"{part.get('type') if isinstance(part, dict) else part!r:.60})")  # fmt: skip
        return "".join(part["text"] for part in content)
    raise EnvError(f"{where}: content must be text or a list of text parts")


def chat_messages(params: dict) -> list[dict]:
    """responses_create_params' instructions and input as chat messages: text messages (a
    developer message as a system one), function_call items as an assistant's tool calls,
    function_call_output items as tool messages; reasoning items are dropped."""
    messages = []
    if params.get("instructions"):
        messages.append({"role": "system", "content": _text(params["instructions"], "instructions")})
    items = params.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise EnvError("responses_create_params.input must be text or a non-empty list of items")
    for i, item in enumerate(items):
        where = f"responses_create_params.input[{i}]"
        kind = item.get("type", "message") if isinstance(item, dict) else None
        if kind == "message" and item.get("role") in ("system", "developer", "user", "assistant"):
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append({"role": role, "content": _text(item.get("content"), where)})
        elif kind == "function_call":
            fn = {"name": str(item.get("name")), "arguments": item.get("arguments") or "{}"}
            call = {"id": str(item.get("call_id")), "type": "function", "function": fn}
            if messages and messages[-1]["role"] == "assistant":
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": str(item.get("call_id")),
                             "content": _text(item.get("output"), where)})  # fmt: skip
        elif kind != "reasoning":
            raise EnvError(f"{where}: {kind or item!r:.80} is not an item this connector can send (text messages, "
                           "function_call, function_call_output)")  # fmt: skip
    return messages


def _output_items(message: dict) -> list[dict]:
    """An assistant reply as Responses API output items: its text, then its calls."""
    items = []
    if message.get("content"):
        items.append({"type": "message", "id": f"msg_{uuid.uuid4().hex}", "role": "assistant", "status": "completed",
                      "content": [{"type": "output_text", "text": message["content"], "annotations": []}]})  # fmt: skip
    for call in message.get("tool_calls") or []:
        fn = call.get("function") or {}
        items.append({"type": "function_call", "id": f"fc_{uuid.uuid4().hex}", "call_id": call.get("id"),
                      "name": fn.get("name"), "arguments": fn.get("arguments") or "{}",
                      "status": "completed"})  # fmt: skip
    return items


def response_object(params: dict, output: list[dict], stop: str) -> dict:
    """The episode as the Responses API object /verify reads (NeMo Gym's NeMoGymResponse)."""
    incomplete = {"reason": "max_output_tokens"} if stop in ("length", "context", "budget") else None
    return {"id": f"resp_{uuid.uuid4().hex}", "object": "response", "created_at": time.time(),
            "model": str(params.get("model") or "asyncrl"), "output": output,
            "parallel_tool_calls": bool(params.get("parallel_tool_calls", True)),
            "tool_choice": params.get("tool_choice") or "auto", "tools": params.get("tools") or [],
            "status": "incomplete" if incomplete else "completed", "incomplete_details": incomplete}  # fmt: skip


def verified_reward(answer: dict) -> float:
    reward = answer.get("reward")
    if isinstance(reward, bool) or not isinstance(reward, (int, float)) or not math.isfinite(reward):
        raise EnvError(f"/verify answered without a finite number as its reward: {json.dumps(answer)[:300]}")
    return float(reward)


def _scalar(v) -> bool:
    """A verify answer's field worth keeping with the sample (a number, a flag, a short text)."""
    return isinstance(v, (bool, int, float)) or (isinstance(v, str) and len(v) <= 200)


# ---- the resources server ----------------------------------------------------------------------


class Server:
    """One episode's HTTP session with the resources server: its cookie jar carries the server's
    session cookie from /seed_session to every tool call and /verify."""

    def __init__(self, url: str, http: aiohttp.ClientSession):
        self.url = url
        self.http = http

    async def post(self, route: str, body: dict) -> tuple[int, str]:
        try:
            async with self.http.post(f"{self.url}/{route}", json=body,
                                      timeout=aiohttp.ClientTimeout(total=CALL_TIMEOUT_S)) as r:  # fmt: skip
                data = await r.content.read(MAX_ANSWER_BYTES + 1)
                status = r.status
        except TimeoutError:
            raise EnvError(f"the resources server did not answer /{route} within {CALL_TIMEOUT_S:g}s") from None
        except aiohttp.ClientError as e:
            raise EnvError(f"the resources server at {self.url} could not be reached for /{route}: "
                           f"{type(e).__name__}: {e}") from None  # fmt: skip
        if len(data) > MAX_ANSWER_BYTES:
            raise EnvError(f"the resources server's answer to /{route} is over {MAX_ANSWER_BYTES} bytes")
        return status, data.decode("utf-8", errors="replace")

    async def call(self, route: str, body: dict) -> dict:
        """A lifecycle route (seed_session, verify): a JSON object, or EnvError with what came back."""
        status, text = await self.post(route, body)
        if not 200 <= status < 300:
            raise EnvError(f"the resources server answered /{route} with HTTP {status}: {text[:300]}")
        try:
            answer = json.loads(text) if text.strip() else {}
        except ValueError:
            answer = None
        if not isinstance(answer, dict):
            raise EnvError(f"the resources server answered /{route} with {text[:200]!r}, not a JSON object")
        return answer

    async def tool(self, call: dict, offered: set[str]) -> str:
        """Run one of the model's tool calls: POST /<name> with its arguments. What the model got
        wrong (a tool the row does not offer, arguments that are not a JSON object) is answered
        with the error, for the model to read, and never reaches the server."""
        fn = call.get("function") or {}
        name = fn.get("name")
        if name not in offered:
            return json.dumps({"error": f"no tool {name!r:.80} (tools: {', '.join(sorted(offered)) or 'none'})"})
        try:
            args = json.loads(fn.get("arguments") or "{}")
        except ValueError as e:
            return json.dumps({"error": f"the arguments are not JSON: {e}"})
        if not isinstance(args, dict):
            return json.dumps({"error": f"the arguments must be a JSON object, not {type(args).__name__}"})
        return (await self.post(name, args))[1]


def _client() -> aiohttp.ClientSession:
    # unsafe: keep cookies from a server addressed by IP (aiohttp drops them otherwise)
    return aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True))


# ---- the episode -------------------------------------------------------------------------------


async def _episode(config, sample: Sample, engine, sampling_params: dict) -> Sample:
    r = config.rollout
    row = nemogym_row(sample)
    params = row["responses_create_params"]
    messages, tools = chat_messages(params), chat_tools(params.get("tools"))
    infra = config.infra  # external engines: their own flags decide
    parses = tool_call_parser(infra.sglang_server_args) is not None or bool(infra.rollout_external_engine_addrs)
    if tools and not parses:  # without a parser a call stays text, and the episode would end at the first one
        raise EnvError("the row offers tools: the engines must parse the model's tool calls, add "
                       "--sglang-tool-call-parser qwen25 (or the parser that matches the model's chat "
                       "template)")  # fmt: skip
    sample.metadata.pop("_input_ids", None)  # the engine renders the conversation: its first prompt starts the sample
    budget = int(sampling_params.get("max_new_tokens", r.max_response_len))
    chat = {"temperature": sampling_params.get("temperature", 1.0), "top_p": sampling_params.get("top_p", 1.0),
            "top_k": sampling_params.get("top_k", -1), "logprobs": True, "return_token_ids": True}  # fmt: skip
    if sampling_params.get("stop_token_ids"):
        chat["stop_token_ids"] = list(sampling_params["stop_token_ids"])
    if tools:
        chat["tools"] = tools
    offered = {t["function"]["name"] for t in tools}
    turns: list[dict] = []
    output: list[dict] = []
    stop = "max_turns"
    async with _client() as http:
        server = Server(base_url(r.env_spec.url), http)
        await server.call("seed_session", row)
        for _ in range(r.env_max_turns):
            spent = len(turns[-1]["prompt_ids"]) + len(turns[-1]["ids"]) - len(turns[0]["prompt_ids"]) if turns else 0
            left = budget * r.env_max_turns - spent  # a turn's budget, and the episode's
            if left <= 0:
                stop = "budget"
                break
            body = {**chat, "messages": messages, "max_tokens": min(budget, left)}
            try:
                answer = await ask_engine(engine.client, body, "nemogym")
            except EngineError as e:  # "context length": the conversation no longer fits the model's context
                if "context length" not in str(e):
                    raise
                if not turns:
                    raise EnvError("the row's prompt does not fit the model's context length") from None
                stop = "context"
                break
            turns.append(recorded_turn(answer, bool(tools)))
            choice = answer["choices"][0]
            if choice.get("finish_reason") == "abort":
                break
            message = choice["message"]
            calls = message.get("tool_calls") or []
            messages.append({"role": "assistant", "content": message.get("content") or "",
                             **({"tool_calls": calls} if calls else {})})  # fmt: skip
            output += _output_items(message)
            if choice.get("finish_reason") == "length" or not calls:
                stop = "length" if choice.get("finish_reason") == "length" else "answered"
                break
            for call in calls:
                text = await server.tool(call, offered)
                output.append({"type": "function_call_output", "call_id": call.get("id"), "output": text})
                messages.append({"role": "tool", "tool_call_id": call.get("id"), "content": text})
        out = assemble(sample, turns, lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=False))
        if out.status is SampleStatus.ABORTED:
            return out  # regenerated, never verified: what the server made of a cut turn means nothing
        verdict = await server.call("verify", {**row, "response": response_object(params, output, stop)})
    out.metadata["env_reward"] = verified_reward(verdict)
    out.metadata["env_verify"] = {k: v for k, v in verdict.items() if k != "reward" and _scalar(v)}
    out.metadata["env_stop"] = stop
    if stop == "context":
        out.status = SampleStatus.TRUNCATED
    return out


generate = gated(_episode)
