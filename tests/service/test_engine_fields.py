"""Every field of SGLang's /generate request is implemented by the built-in engine or refused with
a 400 that names it: none is silently ignored.

The field names are those of SGLang 0.5.23 (the newest release read, from its wheel):
`GenerateReqInput` in python/sglang/srt/managers/io_struct.py and `SamplingParams` in
python/sglang/srt/sampling/sampling_params.py.
"""

from __future__ import annotations

import httpx
import pytest

from tests.conftest import EngineThread

GENERATE_REQ_INPUT_0_5_23 = [
    "rid", "session_id", "text", "input_ids", "input_embeds", "image_data", "video_data", "audio_data", "mm_hashes",
    "mm_content_hashes", "use_audio_in_video", "video_config", "sampling_params", "watermark", "return_logprob",
    "logprob_start_len", "top_logprobs_num", "token_ids_logprob", "return_sampling_mask", "sampling_logprobs_mode",
    "return_text_in_logprobs", "return_flat_raw_top_logprobs", "return_flat_raw_output_top_logprobs",
    "return_flat_raw_top_logprobs_b64", "stream", "log_metrics", "return_hidden_states", "return_routed_experts",
    "routed_experts_start_len", "return_indexer_topk", "modalities", "session_params", "lora_path", "lora_id",
    "custom_logit_processor", "positional_embed_overrides", "bootstrap_host", "bootstrap_port", "bootstrap_room",
    "bootstrap_pair_key", "decode_tp_size", "routed_dp_rank", "data_parallel_rank", "disagg_prefill_dp_rank",
    "routing_key", "conversation_id", "http_worker_ipc", "background", "require_reasoning", "max_thinking_tokens",
    "priority", "extra_key", "no_logs", "custom_labels", "return_bytes", "return_entropy", "return_prompt_token_ids",
    "external_trace_header", "received_time", "need_wait_for_mm_inputs", "num_items_assigned", "encoder_urls",
    "max_dynamic_patch", "min_dynamic_patch", "image_max_dynamic_patch", "video_max_dynamic_patch", "images_config",
    "mm_processor_kwargs", "multi_item_delimiter_indices", "token_indices_to_pool", "cache_salt", "kv_hints",
]  # fmt: skip
SAMPLING_PARAMS_0_5_23 = [
    "max_new_tokens", "stop", "stop_token_ids", "stop_regex", "temperature", "top_p", "top_k", "min_p",
    "frequency_penalty", "presence_penalty", "repetition_penalty", "min_new_tokens", "n", "beam_width", "json_schema",
    "regex", "ebnf", "structural_tag", "ignore_eos", "skip_special_tokens", "spaces_between_special_tokens",
    "no_stop_trim", "stream_interval", "logit_bias", "sampling_seed", "custom_params", "watermark", "stop_strs",
    "stop_regex_strs", "stop_str_max_len", "stop_regex_max_len", "is_normalized", "ebnf_full_assistant",
]  # fmt: skip

# a value that asks for something, per implemented field (with what the field needs beside it)
IMPLEMENTED_TOP = {
    "rid": ("r-1", {}), "text": ("12=", {"input_ids": None}), "input_ids": ([1, 5, 15], {}),
    "sampling_params": ({"max_new_tokens": 2}, {}), "return_logprob": (True, {}),
    "logprob_start_len": (1, {"return_logprob": True}), "top_logprobs_num": (2, {"return_logprob": True}),
    "return_text_in_logprobs": (True, {"return_logprob": True}), "stream": (True, {}),
    "log_metrics": (False, {}), "no_logs": (True, {}), "return_prompt_token_ids": (True, {}),
}  # fmt: skip
IMPLEMENTED_SAMPLING = {
    "max_new_tokens": 3, "stop": "1", "stop_token_ids": [5], "stop_regex": "[0-9]", "temperature": 0.5, "top_p": 0.9,
    "top_k": 3, "min_p": 0.1, "frequency_penalty": 0.5, "presence_penalty": 0.5, "repetition_penalty": 1.3,
    "min_new_tokens": 1, "n": 2, "ignore_eos": True, "skip_special_tokens": False,
    "spaces_between_special_tokens": False, "no_stop_trim": True, "stream_interval": 2, "logit_bias": {"5": 2.0},
    "sampling_seed": 7,
}  # fmt: skip
_ASKING = ("x", 2, True, ["x"], {"x": 1}, [[1]], 0.5)


@pytest.fixture(scope="module")
def engine(tiny_model_dir):
    """One engine for the whole module: every request here is independent."""
    with EngineThread(tiny_model_dir) as e:
        yield e


async def _post(engine, body) -> httpx.Response:
    async with httpx.AsyncClient(base_url=engine.url, timeout=30) as c:
        return await c.post("/generate", json=body)


def base(**extra) -> dict:
    body = {"input_ids": [1, 5, 6, 15], "sampling_params": {"max_new_tokens": 2}} | extra
    return {k: v for k, v in body.items() if v is not None}


@pytest.mark.parametrize("field", GENERATE_REQ_INPUT_0_5_23)
async def test_every_generate_field_is_implemented_or_refused_by_name(engine, field):
    if field in IMPLEMENTED_TOP:
        value, beside = IMPLEMENTED_TOP[field]
        r = await _post(engine, base(**beside, **{field: value}))
        assert r.status_code == 200, (field, r.text)
        return
    for value in _ASKING:
        r = await _post(engine, base(**{field: value}))
        assert r.status_code == 400 and field in r.json()["error"]["message"], (field, value, r.text)


@pytest.mark.parametrize("field", SAMPLING_PARAMS_0_5_23)
async def test_every_sampling_param_is_implemented_or_refused_by_name(engine, field):
    if field in IMPLEMENTED_SAMPLING:
        body = base(sampling_params={"max_new_tokens": 4, field: IMPLEMENTED_SAMPLING[field]})
        r = await _post(engine, body)
        assert r.status_code == 200, (field, r.text)
        return
    for value in _ASKING:
        r = await _post(engine, base(sampling_params={"max_new_tokens": 2, field: value}))
        assert r.status_code == 400 and field in r.json()["error"]["message"], (field, value, r.text)


def test_the_lists_cover_what_the_engine_declares():
    from services.engine import protocol

    top = set(GENERATE_REQ_INPUT_0_5_23)
    assert top <= protocol.TOP_FIELDS and protocol.TOP_FIELDS - top == {"model"}  # the router's null `model`
    assert set(SAMPLING_PARAMS_0_5_23) == protocol.SAMPLING_FIELDS
