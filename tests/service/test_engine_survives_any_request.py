"""No request can stop the built-in engine. Sampling inputs are checked in the dtype they are
computed in (float32); a request that still fails inside the scheduler fails alone, with a 400
or 500 of its own, while the scheduler thread and every other request carry on; bodies nested
too deeply are a 400. A property test throws generated sampling parameters at a live engine and
checks, after each, that it still serves a normal request."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.conftest import EngineThread

PROMPT = [1, 5, 6, 7, 13]
NORMAL = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, "temperature": 1.0}}


@pytest.fixture(scope="module")
def live_engine(tiny_model_dir):
    with EngineThread(tiny_model_dir) as e:
        yield e


def generate(engine, body: dict, timeout: float = 30) -> httpx.Response:
    return httpx.post(engine.url + "/generate", json=body, timeout=timeout)


def assert_serves(engine) -> None:
    assert engine.scheduler.alive, "the scheduler thread died"
    r = generate(engine, NORMAL)
    assert r.status_code == 200, r.text
    assert len(r.json()["output_ids"]) >= 1


@pytest.mark.parametrize("params", [
    {"logit_bias": {"5": 1e308}},  # finite as a Python float, inf in float32
    {"logit_bias": {str(t): -1e308 for t in range(16)}},  # every token ruled out
    {"logit_bias": {"5": 1e36}, "temperature": 1e-5},  # finite in float32, inf once divided by T
    {"logit_bias": {str(t): -3e38 for t in range(16)}, "temperature": 1e-6},
], ids=["1e308", "all-minus-1e308", "1e36-at-T-1e-5", "all-minus-3e38-tiny-T"])  # fmt: skip
def test_an_overflowing_sampling_input_fails_alone_with_a_400(live_engine, params):
    r = generate(live_engine, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, **params}})
    assert r.status_code == 400, r.text
    assert "float32" in r.json()["error"]["message"]
    assert_serves(live_engine)


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "frequency_penalty", "repetition_penalty"])
def test_an_integer_too_large_for_a_float_is_a_400_naming_its_field(live_engine, field):
    r = generate(live_engine, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4, field: 10**400}})
    assert r.status_code == 400, r.text[:300]
    assert f"sampling_params.{field} must be finite" in r.json()["error"]["message"]
    assert len(r.json()["error"]["message"]) < 200
    assert_serves(live_engine)


def test_a_request_that_breaks_the_forward_pass_fails_alone_and_the_batch_goes_on(tiny_model_dir, monkeypatch):
    """A request whose forward pass raises (here: a prefill holding token 11 raises, as a bug in
    a kernel would) gets a 500; the requests batched with it are answered normally."""
    with EngineThread(tiny_model_dir) as engine:
        model = engine.scheduler.model
        real = model.forward_cached

        def fragile(ids, *args, **kw):
            if ids.shape[1] > 1 and bool((ids == 11).any()):  # a prefill with token 11
                raise RuntimeError("kernel failure on token 11")
            return real(ids, *args, **kw)

        monkeypatch.setattr(model, "forward_cached", fragile)

        async def burst():
            async with httpx.AsyncClient(timeout=30) as http:
                bodies = [NORMAL] * 6 + [{"input_ids": [1, 11, 5, 13], "sampling_params": {"max_new_tokens": 4}}]
                return await asyncio.gather(*(http.post(engine.url + "/generate", json=b) for b in bodies))

        answers = asyncio.run(burst())
        assert [a.status_code for a in answers] == [200] * 6 + [500], [a.text for a in answers]
        assert "kernel failure on token 11" in answers[-1].json()["error"]["message"]
        assert_serves(engine)


@pytest.mark.parametrize("path", ["/generate", "/v1/completions", "/v1/chat/completions", "/update_weights_from_disk",
                                  "/pause_generation", "/abort_request"])  # fmt: skip
def test_a_body_nested_too_deeply_is_a_400(live_engine, path):
    r = httpx.post(live_engine.url + path, content=b"[" * 200_000 + b"]" * 200_000,
                   headers={"content-type": "application/json"}, timeout=30)  # fmt: skip
    assert r.status_code == 400, (path, r.status_code, r.text[:300])
    assert_serves(live_engine)


@pytest.mark.parametrize("calls", [
    [{"type": "function", "function": {"name": "f", "arguments": "[" * 100_000}}],  # nested past json's depth
    [{"type": "function", "function": {"name": "f", "arguments": "{oops"}}],
    [{"type": "function", "function": {"name": "f", "arguments": "[1]"}}],
    ["not a call"], "not a list", [{"type": "function"}],
], ids=["nested-arguments", "bad-json", "not-an-object", "not-a-dict", "not-a-list", "no-function"])  # fmt: skip
def test_an_assistant_tool_call_that_is_not_well_formed_is_a_400(live_engine, calls):
    chat = [{"role": "user", "content": "12"}, {"role": "assistant", "content": "", "tool_calls": calls},
            {"role": "tool", "content": "3", "tool_call_id": "c"}]  # fmt: skip
    r = httpx.post(live_engine.url + "/v1/chat/completions", json={"model": "m", "messages": chat, "max_tokens": 1},
                   timeout=30)  # fmt: skip
    assert r.status_code == 400 and "messages[1]" in r.json()["error"]["message"], r.text[:300]
    assert_serves(live_engine)


extreme = st.one_of(
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from([0.0, -0.0, 1e-45, 1e-38, 1e-7, 1e-6, 1e-5, 3.4e38, -3.4e38, 3.5e38, 1e308, -1e308]),
    st.integers(min_value=-(2**70), max_value=2**70),
)
sampling = st.fixed_dictionaries(
    {},
    optional={
        "temperature": extreme,
        "top_p": extreme,
        "top_k": st.one_of(st.integers(min_value=-5, max_value=40), extreme),
        "min_p": extreme,
        "frequency_penalty": extreme,
        "presence_penalty": extreme,
        "repetition_penalty": extreme,
        "logit_bias": st.dictionaries(st.integers(min_value=0, max_value=15).map(str), extreme, max_size=16),
        "max_new_tokens": st.integers(min_value=0, max_value=8),
        "min_new_tokens": st.integers(min_value=0, max_value=8),
        "n": st.integers(min_value=1, max_value=3),
        "sampling_seed": st.integers(min_value=0, max_value=2**63 - 1),
        "ignore_eos": st.booleans(),
        "skip_special_tokens": st.booleans(),
        "no_stop_trim": st.booleans(),
    },
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(params=sampling, logprobs=st.booleans(), top=st.integers(min_value=0, max_value=20))
def test_any_sampling_parameters_leave_the_engine_serving(live_engine, params, logprobs, top):
    body = {"input_ids": PROMPT, "sampling_params": params, "return_logprob": logprobs, "top_logprobs_num": top}
    r = generate(live_engine, body)
    assert r.status_code in (200, 400), (params, r.status_code, r.text[:500])
    if r.status_code == 200:
        for out in r.json() if isinstance(r.json(), list) else [r.json()]:
            for lp, _, _ in out["meta_info"].get("output_token_logprobs", []):
                assert lp is None or not math.isnan(lp)
    assert_serves(live_engine)
