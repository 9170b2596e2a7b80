"""`POST /generate` of the built-in engine, checked field by field before anything is queued.

Every request is validated against SGLang's `GenerateReqInput` / `SamplingParams` and against
this engine: types, token ids inside the vocabulary, prompts inside the context, finite sampling
values, at most MAX_N samples per prompt and MAX_SEQUENCES per call. A problem is a `BadRequest`
(HTTP 400) that names the field. An SGLang field the engine does not implement is accepted only
with its neutral value (null, false, 0, ...); any other value is a 400 that names it, so a
client never gets silently different behaviour from what it asked for.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from services.engine.scheduler import SamplingParams

MAX_N = 64
"""Samples per prompt (`n`)."""
MAX_SEQUENCES = 1024
"""Sequences per /generate call (prompts x n)."""
MAX_RID_CHARS = 256


class BadRequest(ValueError):
    pass


# SGLang fields this engine does not implement, with the values that ask for nothing
_NEUTRAL = (None, False, 0, [], {}, "")
NOT_IMPLEMENTED_TOP = {
    "input_embeds": _NEUTRAL, "top_logprobs_num": _NEUTRAL, "token_ids_logprob": _NEUTRAL,
    "return_text_in_logprobs": _NEUTRAL, "stream": _NEUTRAL, "lora_path": _NEUTRAL, "lora_id": _NEUTRAL,
    "return_routed_experts": _NEUTRAL, "routed_experts_start_len": _NEUTRAL, "return_indexer_topk": _NEUTRAL,
    "return_hidden_states": _NEUTRAL, "return_prompt_token_ids": _NEUTRAL, "return_entropy": _NEUTRAL,
    "return_sampling_mask": _NEUTRAL, "image_data": _NEUTRAL, "video_data": _NEUTRAL, "audio_data": _NEUTRAL,
    "modalities": _NEUTRAL, "session_params": _NEUTRAL, "session_id": _NEUTRAL, "extra_key": _NEUTRAL,
    "priority": _NEUTRAL, "routed_dp_rank": _NEUTRAL, "routing_key": _NEUTRAL, "custom_logit_processor": _NEUTRAL,
    "custom_labels": _NEUTRAL, "background": _NEUTRAL, "bootstrap_host": _NEUTRAL, "bootstrap_port": _NEUTRAL,
    "bootstrap_room": _NEUTRAL, "data_parallel_rank": _NEUTRAL, "logprob_start_len": (None, -1),
    "log_metrics": (None, True, False), "no_logs": (None, True, False),
}  # fmt: skip
NOT_IMPLEMENTED_SAMPLING = {
    "min_p": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0), "presence_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0), "logit_bias": (None, {}), "json_schema": (None, ""),
    "regex": (None, ""), "ebnf": (None, ""), "structural_tag": (None, ""), "stop": (None, "", []),
    "stop_regex": (None, "", []), "custom_params": (None, {}), "stream_interval": (None,),
    "sampling_seed": (None,),
}  # fmt: skip
TOP_FIELDS = {"text", "input_ids", "sampling_params", "rid", "return_logprob"} | set(NOT_IMPLEMENTED_TOP)
SAMPLING_FIELDS = {
    "max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "ignore_eos", "n",
    "no_stop_trim", "skip_special_tokens", "spaces_between_special_tokens",
} | set(NOT_IMPLEMENTED_SAMPLING)  # fmt: skip


@dataclass
class TextOptions:
    """Detokenization settings of one request (they change `text`, never the tokens)."""

    skip_special_tokens: bool = True
    no_stop_trim: bool = False


@dataclass
class Sequence:
    input_ids: list[int]
    params: SamplingParams
    text: TextOptions
    rid: str | None
    return_logprob: bool


@dataclass
class Limits:
    vocab_size: int
    context_length: int


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(raw: dict, key: str, default: float, where: str) -> float:
    v = raw.get(key)
    if v is None:
        return default
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise BadRequest(f"{where}{key} must be a number, got {type(v).__name__}")
    v = float(v)
    if not math.isfinite(v):
        raise BadRequest(f"{where}{key} must be finite, got {v}")
    return v


def _integer(raw: dict, key: str, default: int, where: str, lo: int, hi: int | None = None) -> int:
    v = raw.get(key)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not _is_int(v):
        raise BadRequest(f"{where}{key} must be an integer, got {type(v).__name__}")
    if v < lo or (hi is not None and v > hi):
        raise BadRequest(f"{where}{key} must be in [{lo}, {hi if hi is not None else 'inf'}], got {v}")
    return v


def _boolean(raw: dict, key: str, default: bool, where: str) -> bool:
    v = raw.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise BadRequest(f"{where}{key} must be true or false, got {type(v).__name__}")
    return v


def _unimplemented(raw: dict, table: dict, where: str) -> None:
    for key, neutral in table.items():
        v = raw.get(key)
        if v is not None and not any(v == n and type(v) is type(n) for n in neutral):
            raise BadRequest(f"{where}{key} is not implemented by the built-in engine (got {v!r:.80})")


def token_ids(v: Any, field: str, limits: Limits, prompt: bool = True) -> list[int]:
    if not isinstance(v, list) or not v:
        raise BadRequest(f"{field} must be a non-empty list of token ids")
    for t in v:
        if not _is_int(t):
            raise BadRequest(f"{field} must hold integers, got {type(t).__name__}")
        if not 0 <= t < limits.vocab_size:
            raise BadRequest(f"{field} holds token id {t}, outside the vocabulary [0, {limits.vocab_size})")
    if prompt and len(v) >= limits.context_length:
        raise BadRequest(
            f"{field}: the input ({len(v)} tokens) is longer than the model's context length "
            f"({limits.context_length} tokens)."
        )
    return list(v)


def sampling_params(
    raw: Any, limits: Limits, where: str = "sampling_params."
) -> tuple[SamplingParams, TextOptions, int]:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequest(f"{where.rstrip('.')} must be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - SAMPLING_FIELDS)
    if unknown:
        raise BadRequest(f"{where}{unknown[0]} is not a sampling parameter SGLang knows")
    _unimplemented(raw, NOT_IMPLEMENTED_SAMPLING, where)
    n = _integer(raw, "n", 1, where, 1, MAX_N)
    max_new = _integer(raw, "max_new_tokens", 128, where, 0, limits.context_length)
    min_new = _integer(raw, "min_new_tokens", 0, where, 0, max_new)
    temperature = _number(raw, "temperature", 1.0, where)
    if temperature < 0:
        raise BadRequest(f"{where}temperature must be >= 0, got {temperature}")
    top_p = _number(raw, "top_p", 1.0, where)
    if not 0 < top_p <= 1:
        raise BadRequest(f"{where}top_p must be in (0, 1], got {top_p}")
    top_k = _integer(raw, "top_k", -1, where, -1)
    if top_k == 0:
        raise BadRequest(f"{where}top_k must be -1 (whole vocabulary) or >= 1, got 0")
    stop_ids = raw.get("stop_token_ids")
    stop_ids = token_ids(stop_ids, f"{where}stop_token_ids", limits, prompt=False) if stop_ids not in (None, []) else []
    skip_special = _boolean(raw, "skip_special_tokens", True, where)
    if not _boolean(raw, "spaces_between_special_tokens", True, where) and not skip_special:
        raise BadRequest(
            f"{where}spaces_between_special_tokens false is not implemented by the built-in engine "
            "unless skip_special_tokens is true"
        )
    params = SamplingParams(
        max_new_tokens=max_new, min_new_tokens=min_new, temperature=temperature, top_p=top_p, top_k=top_k,
        stop_token_ids=stop_ids, ignore_eos=_boolean(raw, "ignore_eos", False, where),
    )  # fmt: skip
    text = TextOptions(skip_special_tokens=skip_special, no_stop_trim=_boolean(raw, "no_stop_trim", False, where))
    return params, text, n


def parse_generate(body: Any, limits: Limits, tokenizer=None) -> tuple[list[Sequence], bool]:
    """The sequences a /generate body asks for, and whether the answer is a list (a batch, or
    n > 1). BadRequest names the first field that is wrong."""
    if not isinstance(body, dict):
        raise BadRequest("the request body must be a JSON object")
    unknown = sorted(set(body) - TOP_FIELDS)
    if unknown:
        raise BadRequest(f"{unknown[0]} is not a /generate field SGLang knows")
    _unimplemented(body, NOT_IMPLEMENTED_TOP, "")
    prompts, is_batch = _prompts(body, limits, tokenizer)
    raw_params = body.get("sampling_params")
    if isinstance(raw_params, list):
        if len(raw_params) != len(prompts):
            raise BadRequest(f"sampling_params has {len(raw_params)} entries for {len(prompts)} prompts")
        parsed = [sampling_params(p, limits, f"sampling_params[{i}].") for i, p in enumerate(raw_params)]
    else:
        parsed = [sampling_params(raw_params, limits)] * len(prompts)
    rids = _per_prompt(body.get("rid"), "rid", len(prompts), str)
    logprob = _per_prompt(body.get("return_logprob"), "return_logprob", len(prompts), bool)
    total = sum(n for _, _, n in parsed)
    if total > MAX_SEQUENCES:
        raise BadRequest(f"the request asks for {total} sequences; at most {MAX_SEQUENCES} per call")
    is_batch = is_batch or any(n > 1 for _, _, n in parsed)
    seqs = []
    for i, (ids, (params, text, n)) in enumerate(zip(prompts, parsed, strict=True)):
        for j in range(n):
            rid = rids[i]
            if rid is not None and isinstance(body.get("rid"), str) and is_batch:
                rid = f"{rid}-{i}-{j}"  # one string names a batch: a prefix of per-item ids
            seqs.append(Sequence(ids, params, text, rid, bool(logprob[i])))
    return seqs, is_batch


def _prompts(body: dict, limits: Limits, tokenizer) -> tuple[list[list[int]], bool]:
    ids = body.get("input_ids")
    if ids is not None:
        if isinstance(ids, list) and ids and isinstance(ids[0], list):
            if len(ids) > MAX_SEQUENCES:
                raise BadRequest(f"input_ids holds {len(ids)} prompts; at most {MAX_SEQUENCES} per call")
            return [token_ids(x, f"input_ids[{i}]", limits) for i, x in enumerate(ids)], True
        return [token_ids(ids, "input_ids", limits)], False
    text = body.get("text")
    if text is not None:
        if tokenizer is None:
            raise BadRequest("this engine has no tokenizer: send input_ids")
        texts = text if isinstance(text, list) else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise BadRequest("text must be a string or a non-empty list of strings")
        if len(texts) > MAX_SEQUENCES:
            raise BadRequest(f"text holds {len(texts)} prompts; at most {MAX_SEQUENCES} per call")
        return [token_ids(tokenizer.encode(t), "text", limits) for t in texts], isinstance(text, list)
    raise BadRequest("Either text or input_ids should be provided.")


def _per_prompt(v: Any, field: str, count: int, kind: type) -> list:
    if v is None:
        return [None] * count
    if isinstance(v, list):
        if len(v) != count or not all(isinstance(x, kind) for x in v):
            raise BadRequest(f"{field} must be one {kind.__name__} or a list of {count}")
        items = v
    elif isinstance(v, kind):
        items = [v] * count
    else:
        raise BadRequest(f"{field} must be a {kind.__name__}, got {type(v).__name__}")
    if kind is str and any(len(x) > MAX_RID_CHARS for x in items):
        raise BadRequest(f"{field} is longer than {MAX_RID_CHARS} characters")
    return items
