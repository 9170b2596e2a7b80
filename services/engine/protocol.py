"""`POST /generate` of the built-in engine, checked field by field before anything is queued.

Every request is validated against SGLang's `GenerateReqInput` / `SamplingParams` and against
this engine: types, token ids inside the vocabulary, prompts inside the context, finite sampling
values, at most MAX_N samples per prompt and MAX_SEQUENCES per call. A problem is a `BadRequest`
(HTTP 400) that names the field. An SGLang field the engine does not implement is accepted only
with its neutral value (null, false, 0, ...); any other value is a 400 that names it, so a
client never gets silently different behaviour from what it asked for.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from services.engine.request import SamplingParams

MAX_N = 64
"""Samples per prompt (`n`)."""
MAX_SEQUENCES = 1024
"""Sequences per /generate call (prompts x n)."""
MAX_RID_CHARS = 256


FLOAT32_MAX = 3.4028234663852886e38
"""The largest finite float32: sampling inputs are checked in the dtype they are computed in."""


class BadRequest(ValueError):
    pass


class RequestFailed(RuntimeError):
    """A request the scheduler could not carry out (it failed alone): answered with `status`."""

    def __init__(self, message: str, status: int):
        super().__init__(message)
        self.status = status


def raise_if_failed(requests) -> None:
    """RequestFailed for the first request the scheduler failed on its own (a 400 or 500 in its
    finish reason); aborts and normal ends pass."""
    for r in requests:
        reason = r.finish_reason or {}
        if reason.get("type") == "abort" and reason.get("status_code") in (400, 500):
            raise RequestFailed(str(reason.get("message")), reason["status_code"])


def updated_message(version) -> str:
    """SGLang's answer to a weight update."""
    note = f" Weight version updated to {version}." if version is not None else ""
    return "Succeeded to update model weights." + note


# SGLang 0.5.23 fields this engine does not implement, with the values that ask for nothing
_NEUTRAL = (None, False, 0, [], {}, "")
NOT_IMPLEMENTED_TOP = dict.fromkeys((
    "input_embeds", "token_ids_logprob", "lora_id", "return_routed_experts", "routed_experts_start_len",
    "return_indexer_topk", "return_hidden_states", "return_entropy", "return_sampling_mask", "image_data",
    "video_data", "audio_data", "modalities", "session_params", "session_id", "extra_key", "priority",
    "routed_dp_rank", "routing_key", "custom_logit_processor", "custom_labels", "background", "bootstrap_host",
    "bootstrap_port", "bootstrap_room", "data_parallel_rank", "mm_hashes", "mm_content_hashes", "use_audio_in_video",
    "video_config", "watermark", "sampling_logprobs_mode", "return_flat_raw_top_logprobs",
    "return_flat_raw_output_top_logprobs", "return_flat_raw_top_logprobs_b64", "positional_embed_overrides",
    "bootstrap_pair_key", "decode_tp_size", "disagg_prefill_dp_rank", "conversation_id", "http_worker_ipc",
    "require_reasoning", "max_thinking_tokens", "return_bytes", "external_trace_header", "received_time",
    "need_wait_for_mm_inputs", "num_items_assigned", "encoder_urls", "max_dynamic_patch", "min_dynamic_patch",
    "image_max_dynamic_patch", "video_max_dynamic_patch", "images_config", "mm_processor_kwargs",
    "multi_item_delimiter_indices", "token_indices_to_pool", "cache_salt", "kv_hints",
), _NEUTRAL) | {
    "log_metrics": (None, True, False), "no_logs": (None, True, False),
    # not SGLang's: sglang-router (the model gateway) adds `"model": null` to every /generate it forwards
    "model": (None,),
}  # fmt: skip
CONSTRAINED = ("json_schema", "regex", "ebnf", "structural_tag")
NOT_IMPLEMENTED_SAMPLING = {
    "json_schema": (None, ""), "regex": (None, ""), "ebnf": (None, ""), "structural_tag": (None, ""),
    "custom_params": (None, {}), "beam_width": (None, 1), "watermark": (None, {}),
}  # fmt: skip
SGLANG_INTERNAL_SAMPLING = ("stop_strs", "stop_regex_strs", "stop_str_max_len", "stop_regex_max_len",
                            "is_normalized", "ebnf_full_assistant")  # fmt: skip
"""SamplingParams fields SGLang fills in itself; a request that sends one is refused."""
TOP_FIELDS = {
    "text", "input_ids", "sampling_params", "rid", "return_logprob", "logprob_start_len", "top_logprobs_num",
    "return_text_in_logprobs", "stream", "return_prompt_token_ids", "lora_path",
} | set(NOT_IMPLEMENTED_TOP)  # fmt: skip
SAMPLING_FIELDS = {
    "max_new_tokens", "min_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "ignore_eos", "n",
    "no_stop_trim", "skip_special_tokens", "spaces_between_special_tokens", "min_p", "frequency_penalty",
    "presence_penalty", "repetition_penalty", "logit_bias", "stop", "stop_regex", "sampling_seed", "stream_interval",
} | set(NOT_IMPLEMENTED_SAMPLING) | set(SGLANG_INTERNAL_SAMPLING)  # fmt: skip
MAX_TOP_LOGPROBS = 64
MAX_STOPS = 16


@dataclass
class TextOptions:
    """Detokenization settings of one request (they change `text`, never the tokens)."""

    skip_special_tokens: bool = True
    no_stop_trim: bool = False
    stop: tuple[str, ...] = ()
    stop_regex: tuple[str, ...] = ()
    stream_interval: int = 1
    """Tokens between two streamed chunks."""


@dataclass
class Sequence:
    input_ids: list[int]
    params: SamplingParams
    text: TextOptions
    rid: str | None
    return_logprob: bool
    logprob_start: int | None = None
    """Where input_token_logprobs start (validated logprob_start_len); None: none asked for."""
    top_logprobs_num: int = 0
    return_text_in_logprobs: bool = False
    return_prompt_token_ids: bool = False
    lora: str | None = None
    """The LoRA adapter's name (`lora_path`); None: the base model."""


@dataclass
class Limits:
    vocab_size: int
    context_length: int


def typed(body: dict, key: str, kind: type | tuple, default=None, required: bool = False):
    """A control route's field: `default` when absent or null (a 400 when `required`), else a
    value of `kind` (a bool is not an int); anything else is a 400 naming the field."""
    v = body.get(key, default)
    if v is None:
        if required:
            raise BadRequest(f"{key} is required")
        return None
    if not _is(v, kind):
        names = kind.__name__ if isinstance(kind, type) else " or ".join(k.__name__ for k in kind)
        raise BadRequest(f"{key} must be a {names}, got {type(v).__name__}")
    return v


def _is(v: Any, kind: type | tuple) -> bool:
    """isinstance, but a bool is only a bool (never an int)."""
    return isinstance(v, kind) and (kind is bool or not isinstance(v, bool))


def _number(raw: dict, key: str, default: float, where: str, bounds: str = "", ok: Callable | None = None) -> float:
    """raw[key] as a finite float (`default` when absent or null) that is `ok`, else a 400: it must be `bounds`."""
    v = raw.get(key)
    if v is None:
        v = default
    elif not _is(v, (int, float)):
        raise BadRequest(f"{where}{key} must be a number, got {type(v).__name__}")
    elif not abs(v) <= sys.float_info.max:  # NaN, inf, or an integer too large for a float
        raise BadRequest(f"{where}{key} must be finite, got {v!r:.40}")
    v = float(v)
    if ok is not None and not ok(v):
        raise BadRequest(f"{where}{key} must be {bounds}, got {v}")
    return v


def _integer(raw: dict, key: str, default: int | None, where: str, lo: int, hi: int | None = None) -> int | None:
    v = raw.get(key)
    if v is None:
        return default
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if not _is(v, int):
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
    for key in table.keys() & raw.keys():
        v, neutral = raw[key], table[key]
        if v is not None and not any(v == n and type(v) is type(n) for n in neutral):
            raise BadRequest(f"{where}{key} is not implemented by the built-in engine (got {v!r:.80})")


def token_ids(v: Any, field: str, limits: Limits, prompt: bool = True) -> list[int]:
    if not isinstance(v, list) or not v:
        raise BadRequest(f"{field} must be a non-empty list of token ids")
    for t in v:
        if not _is(t, int):
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
    raw: Any, limits: Limits, where: str = "sampling_params.", tokenizer=None
) -> tuple[SamplingParams, TextOptions, int]:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequest(f"{where.rstrip('.')} must be an object, got {type(raw).__name__}")
    unknown = sorted(set(raw) - SAMPLING_FIELDS)
    if unknown:
        raise BadRequest(f"{where}{unknown[0]} is not a sampling parameter SGLang knows")
    internal = [k for k in SGLANG_INTERNAL_SAMPLING if k in raw]
    if internal:
        raise BadRequest(f"{where}{internal[0]} is internal to SGLang's server, not a request field")
    for key in CONSTRAINED:
        if raw.get(key) not in (None, ""):
            raise BadRequest(f"{where}{key}: constrained decoding is not implemented by the built-in engine")
    _unimplemented(raw, NOT_IMPLEMENTED_SAMPLING, where)
    n = _integer(raw, "n", 1, where, 1, MAX_N)
    max_new = _integer(raw, "max_new_tokens", 128, where, 0, limits.context_length)
    min_new = _integer(raw, "min_new_tokens", 0, where, 0, max_new)
    temperature = _number(raw, "temperature", 1.0, where, ">= 0", lambda v: v >= 0)
    top_p = _number(raw, "top_p", 1.0, where, "in (0, 1]", lambda v: 0 < v <= 1)
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
    min_p = _number(raw, "min_p", 0.0, where, "in [0, 1]", lambda v: 0 <= v <= 1)
    penalties = {k: _number(raw, k, 0.0, where) for k in ("frequency_penalty", "presence_penalty")}
    for k, v in penalties.items():  # both are numbers before either is out of range
        if not -2 <= v <= 2:
            raise BadRequest(f"{where}{k} must be in [-2, 2], got {v}")
    repetition = _number(raw, "repetition_penalty", 1.0, where, "in (0, 2]", lambda v: 0 < v <= 2)
    seed = _integer(raw, "sampling_seed", None, where, 0, 2**63 - 1)
    stop, stop_regex = _strings(raw, "stop", where), _strings(raw, "stop_regex", where)
    if (stop or stop_regex) and tokenizer is None:
        raise BadRequest(f"{where}stop and stop_regex need a tokenizer, and this engine has none")
    for pattern in stop_regex:
        try:
            re.compile(pattern)
        except (re.error, RecursionError) as e:
            raise BadRequest(f"{where}stop_regex {pattern!r:.80} is not a valid regular expression: {e}") from None
    params = SamplingParams(
        max_new_tokens=max_new, min_new_tokens=min_new, temperature=temperature, top_p=top_p, top_k=top_k,
        stop_token_ids=stop_ids, ignore_eos=_boolean(raw, "ignore_eos", False, where), min_p=min_p,
        repetition_penalty=repetition, logit_bias=_logit_bias(raw.get("logit_bias"), limits, where),
        sampling_seed=seed, **penalties,
    )  # fmt: skip
    text = TextOptions(skip_special_tokens=skip_special, no_stop_trim=_boolean(raw, "no_stop_trim", False, where),
                       stop=stop, stop_regex=stop_regex,
                       stream_interval=_integer(raw, "stream_interval", 1, where, 1, limits.context_length))  # fmt: skip
    return params, text, n


def _strings(raw: dict, key: str, where: str) -> tuple[str, ...]:
    v = raw.get(key)
    if v is None or v == "":
        return ()
    items = [v] if isinstance(v, str) else v
    if not isinstance(items, list) or not all(isinstance(x, str) and x for x in items):
        raise BadRequest(f"{where}{key} must be a string or a list of non-empty strings")
    if len(items) > MAX_STOPS or any(len(x) > 256 for x in items):
        raise BadRequest(f"{where}{key}: at most {MAX_STOPS} entries of at most 256 characters")
    return tuple(items)


def _logit_bias(v: Any, limits: Limits, where: str) -> dict[int, float]:
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise BadRequest(f"{where}logit_bias must be an object of token id -> bias, got {type(v).__name__}")
    out = {}
    for key, bias in v.items():
        try:
            tid = int(key)
        except ValueError:
            raise BadRequest(f"{where}logit_bias has key {key!r:.40}, not a token id") from None
        if not 0 <= tid < limits.vocab_size:
            raise BadRequest(f"{where}logit_bias has token id {tid}, outside the vocabulary [0, {limits.vocab_size})")
        if not _is(bias, (int, float)) or not abs(bias) <= FLOAT32_MAX:
            raise BadRequest(f"{where}logit_bias[{key}] must be a finite number (in float32, the dtype it is added "
                             "in: |bias| <= 3.4e38)")  # fmt: skip
        out[tid] = float(bias)
    return out


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
        parsed = [sampling_params(p, limits, f"sampling_params[{i}].", tokenizer) for i, p in enumerate(raw_params)]
    else:
        parsed = [sampling_params(raw_params, limits, tokenizer=tokenizer)] * len(prompts)
    rids = _per_prompt(body.get("rid"), "rid", len(prompts), str)
    logprob = _per_prompt(body.get("return_logprob"), "return_logprob", len(prompts), bool)
    starts = _per_prompt(body.get("logprob_start_len"), "logprob_start_len", len(prompts), int)
    tops = _per_prompt(body.get("top_logprobs_num"), "top_logprobs_num", len(prompts), int)
    loras = _loras(body.get("lora_path"), len(prompts))
    flags = {k: _boolean(body, k, False, "") for k in ("return_text_in_logprobs", "return_prompt_token_ids", "stream")}
    total = sum(n for _, _, n in parsed)
    if total > MAX_SEQUENCES:
        raise BadRequest(f"the request asks for {total} sequences; at most {MAX_SEQUENCES} per call")
    is_batch = is_batch or any(n > 1 for _, _, n in parsed)
    seqs = []
    for i, (ids, (params, text, n)) in enumerate(zip(prompts, parsed, strict=True)):
        start, top = _logprob_options(ids, bool(logprob[i]), starts[i], tops[i], flags["return_text_in_logprobs"])
        for j in range(n):
            rid = rids[i]
            if rid is not None and isinstance(body.get("rid"), str) and is_batch:
                rid = f"{rid}-{i}-{j}"  # one string names a batch: a prefix of per-item ids
            seqs.append(Sequence(ids, params, text, rid, bool(logprob[i]), start, top,
                                 flags["return_text_in_logprobs"], flags["return_prompt_token_ids"], loras[i]))  # fmt: skip
    return seqs, is_batch


def _logprob_options(
    ids: list[int], return_logprob: bool, start: int | None, top: int | None, with_text: bool
) -> tuple[int | None, int]:
    """(where prompt log-probs start or None, top_logprobs_num); what needs return_logprob says so."""
    start = -1 if start is None else start
    top = 0 if top is None else top
    if not return_logprob:
        asked = [k for k, v in (("logprob_start_len", start != -1), ("top_logprobs_num", top != 0),
                                ("return_text_in_logprobs", with_text)) if v]  # fmt: skip
        if asked:
            raise BadRequest(f"{asked[0]} needs return_logprob: true")
        return None, 0
    if not -1 <= start <= len(ids):
        raise BadRequest(f"logprob_start_len must be in [-1, {len(ids)}] (the prompt's length), got {start}")
    if not 0 <= top <= MAX_TOP_LOGPROBS:
        raise BadRequest(f"top_logprobs_num must be in [0, {MAX_TOP_LOGPROBS}], got {top}")
    return (None if start in (-1, len(ids)) else start), top


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


def _loras(v: Any, count: int) -> list[str | None]:
    """lora_path: one adapter name for every prompt, or a list with one name (or null) per prompt."""
    items = v if isinstance(v, list) else [v] * count
    if len(items) != count or not all(x is None or (isinstance(x, str) and 0 < len(x) <= MAX_RID_CHARS) for x in items):
        raise BadRequest(f"lora_path must be an adapter name, or a list of {count} names (null for the base model)")
    return items


def _per_prompt(v: Any, field: str, count: int, kind: type) -> list:
    if v is None:
        return [None] * count
    if isinstance(v, list):
        if len(v) != count or not all(_is(x, kind) for x in v):
            raise BadRequest(f"{field} must be one {kind.__name__} or a list of {count}")
        items = v
    elif _is(v, kind):
        items = [v] * count
    else:
        raise BadRequest(f"{field} must be a {kind.__name__}, got {type(v).__name__}")
    if kind is str and any(len(x) > MAX_RID_CHARS for x in items):
        raise BadRequest(f"{field} is longer than {MAX_RID_CHARS} characters")
    return items
