"""OpenAI-compatible routes of the built-in engine: GET /v1/models, POST /v1/completions and
POST /v1/chat/completions (docs/engine.md, "OpenAI routes").

Each request is validated field by field (an unknown or unimplemented field is a 400 that names
it, in OpenAI's error shape), translated into the engine's sequences (the same sampling as
/generate) and answered as OpenAI does, or streamed as server-sent events (`data: <chunk>` per
step, `data: [DONE]` last). Chat prompts are rendered with the chat template of the model's
tokenizer, `tools` included; with `--tool-call-parser` (services/engine/tool_calls.py) the model's
tool calls come back as OpenAI's `message.tool_calls` (non-streaming answers only).
"""

from __future__ import annotations

import itertools
import time
import uuid
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from services.engine.generate import Tracked, sse, weight_spans
from services.engine.protocol import MAX_SEQUENCES, BadRequest, Sequence, sampling_params, token_ids
from services.engine.routes import body_of
from services.engine.tool_calls import arguments_for_template, parse_tool_calls

MAX_LOGPROBS = 20
_COMMON = {"model", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "stop",
           "presence_penalty", "frequency_penalty", "logit_bias", "seed", "user", "return_token_ids"}  # fmt: skip
_SGLANG_EXTRAS = {"top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids",
                  "skip_special_tokens", "no_stop_trim"}  # fmt: skip
COMPLETION_FIELDS = _COMMON | _SGLANG_EXTRAS | {"prompt", "logprobs", "echo", "best_of", "suffix"}
CHAT_FIELDS = _COMMON | _SGLANG_EXTRAS | {"messages", "max_completion_tokens", "logprobs", "top_logprobs",
                                          "response_format", "tools", "tool_choice", "parallel_tool_calls"}  # fmt: skip
NEUTRAL_ONLY = {"return_hidden_states": (None, False), "continue_final_message": (None, False),
                "separate_reasoning": (None, True, False), "stream_reasoning": (None, True, False)}  # fmt: skip
"""SGLang's fields accepted only with values that ask for nothing here (sglang-router sends their
defaults; with no reasoning parser there is no reasoning to separate or stream)."""
_RENAMED = {"max_tokens": "max_new_tokens", "seed": "sampling_seed", "min_tokens": "min_new_tokens"}
ROLES = ("system", "developer", "user", "assistant", "tool")


class OpenAIError(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


def _error(e: OpenAIError) -> JSONResponse:
    body = {"error": {"message": str(e), "type": "invalid_request_error", "param": e.param, "code": None}}
    return JSONResponse(body, status_code=400)


def _check(cond: bool, message: str, param: str) -> None:
    if not cond:
        raise OpenAIError(message, param)


def _flag(body: dict, key: str) -> bool:
    want = body.get(key) or False
    _check(isinstance(want, bool), f"{key} must be true or false", key)
    return want


def _token_ids_flag(body: dict) -> bool:
    """vLLM's `return_token_ids`: the prompt's ids and each choice's sampled ids in the answer
    (with the weight versions that produced them), so a multi-turn client can build its trajectory
    token in, token out. Not streamed."""
    want = _flag(body, "return_token_ids")
    _check(not (want and body.get("stream")), "return_token_ids is for answers that are not streamed",
           "return_token_ids")  # fmt: skip
    return want


def _logprobs_count(body: dict, key: str) -> int | None:
    """How many alternatives per token a request asks for in `key` (logprobs, top_logprobs)."""
    k = body.get(key)
    _check(k is None or (type(k) is int and 0 <= k <= MAX_LOGPROBS), f"{key} must be in [0, {MAX_LOGPROBS}]", key)
    return k


class OpenAIRoutes:
    def __init__(self, server):
        self.server = server
        self.generation = server.generation

    # ---- requests ---------------------------------------------------------------------------
    def _common(self, body: dict, fields: set[str]) -> dict:
        unknown = sorted(set(body) - fields - set(NEUTRAL_ONLY))
        _check(not unknown, f"{unknown[0] if unknown else ''} is not a field the built-in engine implements",
               unknown[0] if unknown else None)  # fmt: skip
        for key, neutral in NEUTRAL_ONLY.items():
            _check(body.get(key) in neutral, f"{key} is not implemented by the built-in engine", key)
        # one model is served: like SGLang, any name reaches it (routers fill in names of their own)
        for key in ("model", "user"):
            _check(body.get(key) is None or isinstance(body[key], str), f"{key} must be a string", key)
        opts = body.get("stream_options")
        _check(opts is None or (isinstance(opts, dict) and set(opts) <= {"include_usage"}),
               "stream_options may hold only include_usage", "stream_options")  # fmt: skip
        raw = {_RENAMED.get(k, k): v for k, v in body.items() if k in _RENAMED or k in _SGLANG_EXTRAS}
        raw.update({k: body.get(k) for k in ("temperature", "top_p", "n", "stop", "presence_penalty",
                                             "frequency_penalty", "logit_bias")})  # fmt: skip
        return {k: v for k, v in raw.items() if v is not None}

    def _sampling(self, raw: dict, body: dict):
        try:
            return sampling_params(raw, self.server.limits, "", self.server.tokenizer)
        except BadRequest as e:
            msg = str(e)
            for ours, theirs in _RENAMED.items():
                msg = msg.replace(theirs, ours)
            raise OpenAIError(msg, next((k for k in body if msg.startswith(k)), None)) from None

    def completion_seqs(self, body: dict) -> tuple[list[Sequence], list[list[int]], dict]:
        raw = self._common(body, COMPLETION_FIELDS)
        for key, neutral in (("suffix", (None, "")), ("best_of", (None, body.get("n") or 1))):
            _check(body.get(key) in neutral, f"{key} is not implemented by the built-in engine", key)
        echo = _flag(body, "echo")
        k = _logprobs_count(body, "logprobs")
        raw.setdefault("max_new_tokens", 16)
        params, text, n = self._sampling(raw, body)
        prompts = self._prompts(body.get("prompt"))
        _check(len(prompts) * n <= MAX_SEQUENCES, f"at most {MAX_SEQUENCES} choices per call", "n")
        rid = "cmpl-" + uuid.uuid4().hex
        seqs = [Sequence(ids, params, text, f"{rid}-{i * n + j}", k is not None, 0 if echo and k is not None else None,
                         k or 0) for i, ids in enumerate(prompts) for j in range(n)]  # fmt: skip
        return seqs, prompts, {"id": rid, "echo": echo, "n": n, "token_ids": _token_ids_flag(body)}

    def _prompts(self, prompt: Any) -> list[list[int]]:
        limits, tok = self.server.limits, self.server.tokenizer
        try:
            if isinstance(prompt, str) or (isinstance(prompt, list) and prompt and isinstance(prompt[0], str)):
                texts = [prompt] if isinstance(prompt, str) else prompt
                _check(tok is not None, "this engine has no tokenizer: send token ids", "prompt")
                _check(all(isinstance(t, str) for t in texts), "prompt must be strings or token ids", "prompt")
                return [token_ids(tok.encode(t), "prompt", limits) for t in texts]
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
                return [token_ids(p, "prompt", limits) for p in prompt]
            return [token_ids(prompt, "prompt", limits)]
        except BadRequest as e:
            raise OpenAIError(str(e), "prompt") from None

    def chat_seqs(self, body: dict) -> tuple[list[Sequence], list[list[int]], dict]:
        raw = self._common(body, CHAT_FIELDS)
        if body.get("max_completion_tokens") is not None:
            raw["max_new_tokens"] = body["max_completion_tokens"]
        fmt = body.get("response_format")
        _check(fmt is None or fmt == {"type": "text"},
               "response_format other than text: constrained decoding is not implemented", "response_format")  # fmt: skip
        tools = body.get("tools") or None
        if tools is not None:
            _check(isinstance(tools, list) and all(isinstance(t, dict) and t.get("type") == "function"
                                                   and isinstance(t.get("function"), dict) for t in tools),
                   "tools must be a list of {\"type\": \"function\", \"function\": {...}}", "tools")  # fmt: skip
            tok = self.server.tokenizer
            _check(tok is not None and tok.template_renders_tools,
                   "tools: the model's chat template does not render tools", "tools")  # fmt: skip
        _check(body.get("tool_choice") in (None, "none", "auto"),
               "tool_choice: only none and auto (the model decides in its text; no call is forced)",
               "tool_choice")  # fmt: skip
        _check(body.get("parallel_tool_calls") in (None, True, False), "parallel_tool_calls must be true or false",
               "parallel_tool_calls")  # fmt: skip
        want = _flag(body, "logprobs")
        k = _logprobs_count(body, "top_logprobs")
        _check(k is None or want, "top_logprobs needs logprobs: true", "top_logprobs")
        offered = tools if body.get("tool_choice") != "none" else None
        parse = bool(offered) and self.server.tool_call_parser is not None
        _check(not (parse and body.get("stream")), "stream with tools: this engine parses tool calls "
               "(--tool-call-parser) in whole answers only; send stream: false", "stream")  # fmt: skip
        ids = self._chat_prompt(body.get("messages"), offered)
        raw.setdefault("max_new_tokens", self.server.limits.context_length - len(ids))
        params, text, n = self._sampling(raw, body)
        rid = "chatcmpl-" + uuid.uuid4().hex
        seqs = [Sequence(ids, params, text, f"{rid}-{j}", want, None, k or 0) for j in range(n)]
        return seqs, [ids], {"id": rid, "n": n, "token_ids": _token_ids_flag(body), "tool_calls": parse}

    def _chat_prompt(self, messages: Any, tools: list[dict] | None = None) -> list[int]:
        tok = self.server.tokenizer
        _check(isinstance(messages, list) and bool(messages), "messages must be a non-empty list", "messages")
        clean = []
        for i, m in enumerate(messages):
            where = f"messages[{i}]"
            _check(isinstance(m, dict) and m.get("role") in ROLES, f"{where} needs a role in {ROLES}", where)
            content = m.get("content")
            if isinstance(content, list):
                _check(all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                           for p in content), f"{where}.content: only text parts are implemented", where)  # fmt: skip
                content = "".join(p["text"] for p in content)
            _check(content is None or isinstance(content, str), f"{where}.content must be text", where)
            _check(set(m) <= {"role", "content", "name", "tool_calls", "tool_call_id"},
                   f"{where}: only role, content, name, tool_calls and tool_call_id are implemented",
                   where)  # fmt: skip
            if m.get("tool_calls") is not None:
                try:
                    m = arguments_for_template(m)
                except ValueError as e:
                    raise OpenAIError(f"{where}: {e}", where) from None
            clean.append({**m, "content": content or ""})
        _check(tok is not None and tok.has_chat_template, "the model's tokenizer has no chat template", "messages")
        try:
            rendered = tok.render_chat(clean, add_generation_prompt=True, tools=tools)
            return token_ids(tok.encode(rendered, add_special_tokens=False), "messages", self.server.limits)
        except BadRequest as e:  # the prompt does not fit
            raise OpenAIError(str(e), "messages") from None
        except ValueError as e:
            raise OpenAIError(f"the chat template failed: {e}", "messages") from None

    # ---- responses --------------------------------------------------------------------------
    @staticmethod
    def _usage(tracked: list[Tracked], prompts: list[list[int]]) -> dict:
        prompt = sum(map(len, prompts))
        completion = sum(len(t.req.output_ids) for t in tracked)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    @staticmethod
    def _finish(t: Tracked) -> tuple[str | None, Any]:
        reason = t.req.finish_reason or {}
        return reason.get("type"), reason.get("matched")

    def _logprobs(self, t: Tracked, lo: int, hi: int, offset: int, echo: bool, chat: bool) -> dict | None:
        """The log-probs of output tokens lo..hi (from lo 0 with `echo`: the prompt's first), in
        OpenAI's chat or completion shape; None unless the request asked for them."""
        view, req = t.view, t.req
        if not t.seq.return_logprob:
            return None
        entries = []
        if echo and lo == 0 and req.input_logprobs is not None:
            tops = req.input_top_logprobs or [None] * len(req.input_ids)
            entries += list(zip(req.input_ids, req.input_logprobs, tops, strict=True))
        tops = req.output_top_logprobs[lo:hi] if t.seq.top_logprobs_num else [None] * (hi - lo)
        entries += list(zip(req.output_ids[lo:hi], req.output_logprobs[lo:hi], tops, strict=True))
        if chat:

            def entry(tid, lp):
                piece = view.token_text(tid)
                return {"token": piece, "logprob": lp, "bytes": list(piece.encode())}

            return {"content": [entry(tid, lp) | {"top_logprobs": [entry(i, v) for v, i in top or []]}
                                for tid, lp, top in entries]}  # fmt: skip
        text = view.token_text
        pieces = [text(tid) for tid, _, _ in entries]
        tops = [None if top is None else {text(i): v for v, i in top} for _, _, top in entries]
        offsets = itertools.accumulate(map(len, pieces), initial=offset)  # where each piece starts
        return {"tokens": pieces, "token_logprobs": [lp for _, lp, _ in entries],
                "top_logprobs": tops, "text_offset": list(offsets)[:-1]}  # fmt: skip

    def _ids(self, t: Tracked, meta: dict) -> dict:
        """With return_token_ids: the choice's sampled ids and, in SGLang's meta_info shape, the
        weight versions that produced them."""
        if not meta["token_ids"]:
            return {}
        req = t.req
        return {"token_ids": list(req.output_ids),
                "meta_info": {"weight_version": self.server.scheduler.weight_version,
                              "weight_versions": weight_spans(req, len(req.output_ids))}}  # fmt: skip

    def body(self, tracked: list[Tracked], prompts: list[list[int]], meta: dict, chat: bool) -> dict:
        """The whole answer: a chat.completion (chat) or a text_completion."""
        choices = []
        for t in tracked:
            req = t.req
            reason, matched = self._finish(t)
            text = t.view.text(req.output_ids, req.finish_reason)
            if chat:
                choice = {"index": t.index, "message": {"role": "assistant", "content": text}}
                if meta["tool_calls"]:
                    content, calls = parse_tool_calls(text)
                    if calls:
                        choice["message"] = {"role": "assistant", "content": content or None, "tool_calls": calls}
                        reason = "tool_calls" if reason == "stop" else reason
            else:
                choice = {"index": t.index, "text": (t.view.decode(req.input_ids) if meta["echo"] else "") + text}
            lp = self._logprobs(t, 0, len(req.output_ids), 0, meta.get("echo", False), chat)
            choice |= {"logprobs": lp, "finish_reason": reason, "matched_stop": matched}
            choices.append(choice | self._ids(t, meta))
        kind = "chat.completion" if chat else "text_completion"
        ids = {"prompt_token_ids": prompts[0] if len(prompts) == 1 else prompts} if meta["token_ids"] else {}
        return {"id": meta["id"], "object": kind, "created": int(time.time()), "model": self.server.served_model_name,
                "choices": choices, "usage": self._usage(tracked, prompts), **ids}  # fmt: skip

    async def stream(self, seqs, prompts, meta, chat: bool, include_usage: bool):
        """OpenAI chunks: each carries one choice's new text (and its new tokens' logprobs)."""
        tracked, queue = self.generation.submit(seqs)
        kind = "chat.completion.chunk" if chat else "text_completion"
        head = {"id": meta["id"], "object": kind, "created": int(time.time()), "model": self.server.served_model_name}
        sent_text, sent_tokens, offsets = [0] * len(tracked), [0] * len(tracked), [0] * len(tracked)
        echoed = [t.view.decode(t.req.input_ids) if not chat and meta["echo"] else "" for t in tracked]

        def chunk(choices: list[dict], **usage) -> bytes:
            return sse(head | {"choices": choices, **usage})

        if chat:
            for t in tracked:
                yield chunk([{"index": t.index, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                              "finish_reason": None}])  # fmt: skip
        async for t, n in self.generation.progress(tracked, queue):
            i, req = t.index, t.req
            text = echoed[i] + t.view.text(req.output_ids[:n], req.finish_reason if t.done else None)
            delta, sent_text[i] = text[sent_text[i] :], max(sent_text[i], len(text))
            lp = self._logprobs(t, sent_tokens[i], n, offsets[i], meta.get("echo", False), chat)
            sent_tokens[i] = n
            offsets[i] += sum(map(len, lp["tokens"])) if lp is not None and not chat else 0  # as the whole answer's
            reason, matched = self._finish(t) if t.done else (None, None)
            text = {"delta": {"content": delta} if delta else {}} if chat else {"text": delta}
            yield chunk([{"index": i, **text, "logprobs": lp, "finish_reason": reason, "matched_stop": matched}])
        if include_usage:
            yield chunk([], usage=self._usage(tracked, prompts))
        yield b"data: [DONE]\n\n"

    async def answer(self, request: Request, chat: bool):
        try:
            body = await body_of(request, optional=False)
            seqs, prompts, meta = self.chat_seqs(body) if chat else self.completion_seqs(body)
            stream, include_usage = _flag(body, "stream"), bool((body.get("stream_options") or {}).get("include_usage"))
            adapter = self._adapter(body.get("model"))
        except BadRequest as e:  # the body: not JSON, or not an object
            return _error(OpenAIError(str(e)))
        except OpenAIError as e:
            return _error(e)
        for seq in seqs:
            seq.lora = adapter
        if stream:
            return StreamingResponse(self.stream(seqs, prompts, meta, chat, include_usage),
                                     media_type="text/event-stream")  # fmt: skip
        return self.body(await self.generation.run(seqs), prompts, meta, chat)

    def _adapter(self, model: str | None) -> str | None:
        """The LoRA adapter a `model` names, as SGLang: "<adapter>" or "<served-model>:<adapter>";
        None for the base model (any other name reaches it, as routers fill in names of their own)."""
        loras = self.server.loras
        if loras is None or model is None:
            return None
        loaded = loras.loaded()
        if model in loaded:
            return model
        base, sep, adapter = model.partition(":")
        if "@" in model:  # an adapter version's name: never the base
            adapter = model
        elif not (sep and base == self.server.served_model_name):
            return None
        _check(adapter in loaded, f"no LoRA adapter {adapter!r:.120} is loaded (loaded: "
               f"{', '.join(sorted(loaded)) or 'none'})", "model")  # fmt: skip
        return adapter

    def models(self) -> dict:
        card = {"id": self.server.served_model_name, "object": "model", "created": int(self.server.started_at),
                "owned_by": "asyncrl", "root": self.server.model_path,
                "max_model_len": self.server.limits.context_length}  # fmt: skip
        cards = [card]
        if self.server.loras is not None:  # each loaded adapter is a model of its own, parented by the base
            cards += [card | {"id": name, "root": path, "parent": self.server.served_model_name}
                      for name, path in sorted(self.server.loras.loaded().items())]  # fmt: skip
        return {"object": "list", "data": cards}


def add_openai_routes(app: FastAPI, server) -> None:
    routes = OpenAIRoutes(server)

    @app.get("/v1/models")
    async def models():
        return routes.models()

    @app.post("/v1/completions")
    @app.post("/v1/chat/completions")
    async def completions(request: Request):
        return await routes.answer(request, chat=request.url.path.endswith("/chat/completions"))
