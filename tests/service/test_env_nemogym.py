"""--env nemogym:URL against a stand-in NeMo Gym resources server (tests/service/nemogym_standin.py:
the seed/verify protocol over real HTTP, its session in a cookie) and the real engine: an episode
is one session (/seed_session, the model's tool calls as POST /<tool>, /verify's reward), the
sample is the ids the engine saw and sampled, and a server that errs, answers garbage or never
answers fails the episode with a reason that says so."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest

from asyncrl_proto.messages import Sample, SampleStatus
from services.common.config import RunConfig
from services.common.sglang_client import EngineError, SGLangClient
from services.envs import nemogym as connector
from services.envs.generate import EngineHandle, generate_function
from services.envs.trajectory import env_reward
from services.model.tokenizer import Tokenizer
from tests.conftest import TOOL_CALL, EngineThread
from tests.service.nemogym_standin import StandIn

PARSER = ["--tool-call-parser", "qwen25"]
ADD = {"type": "function", "name": "calc_add", "description": "The sum of two integers.", "strict": True,
       "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                      "required": ["a", "b"], "additionalProperties": False}}  # fmt: skip
"""calc_add as a NeMo Gym row declares it (the Responses API's function tool)."""
GREEDY = {"max_new_tokens": 100, "temperature": 0.0, "top_p": 1.0, "top_k": -1}


def gym_row(**extra) -> dict:
    """A NeMo Gym dataset row, whole: the request and the task's own fields."""
    return {"responses_create_params": {"input": [{"role": "user", "content": "1+2"}], "tools": [ADD]},
            "expected_answer": "3", **extra}  # fmt: skip


@pytest.fixture(scope="module")
def gym():
    with StandIn() as server:
        yield server


@pytest.fixture(scope="module")
def engine_url(tool_model_dir):
    with EngineThread(tool_model_dir, tool_call_parser="qwen25") as engine:
        yield engine.url


async def _run(config, samples, model_dir, engine_url, params=GREEDY):
    client = SGLangClient([engine_url])
    try:
        handle = EngineHandle(client, Tokenizer(model_dir))
        return await asyncio.gather(*(connector.generate(config, s, handle, dict(params)) for s in samples))
    finally:
        await client.close()


async def test_an_episode_is_a_session_its_tool_calls_and_the_verified_reward(gym, engine_url, tool_model_dir):
    """Two episodes at once, one from a whole NeMo Gym row (metadata), one built from an asyncrl
    row (prompt, --tool-key tools, metadata): each is its own session, its tool call runs on the
    server, the tool's answer is out of the loss, and the reward is /verify's."""
    from services.tasks.char_model import encode

    config = RunConfig(env=f"nemogym:{gym.url}", rollout_max_response_len=100, env_max_turns=4,
                       sglang_server_args=PARSER)  # fmt: skip
    assert generate_function(config) is connector.generate
    chat_tool = {"type": "function", "function": {k: v for k, v in ADD.items() if k not in ("type", "strict")}}
    samples = [Sample(index=0, prompt="1+2", metadata={"_input_ids": [1], **gym_row(task_id=7)}),
               Sample(index=1, prompt="1+2", metadata={"tools": [chat_tool], "expected_answer": "3", "rm_type": "env"})]
    before = set(gym.sessions)
    outs = await _run(config, samples, tool_model_dir, engine_url)
    tok = Tokenizer(tool_model_dir)
    rendered = tok.encode(tok.render_chat([{"role": "user", "content": "1+2"}], tools=[chat_tool]),
                          add_special_tokens=False)  # fmt: skip
    call, told, answer = encode(TOOL_CALL) + [tok.eos_token_id], encode("(3)"), encode("3") + [tok.eos_token_id]
    for out in outs:
        assert out.status is SampleStatus.COMPLETED, out.metadata
        assert out.metadata["env_reward"] == 1.0 == await env_reward(config, out)
        assert out.metadata["env_verify"]["accuracy"] is True and out.metadata["env_stop"] == "answered"
        assert out.metadata["tool_calls"] == 1  # counted for rollout/tool_call_ratio
        n = out.metadata["prompt_length"]
        assert out.tokens[:n] == rendered  # the engine's rendering of the row's messages and tools
        assert out.tokens[n:] == call + told + answer  # "(3)": the server's answer, as the template renders it
        assert out.loss_mask == [1] * len(call) + [0] * len(told) + [1] * len(answer)
        assert len(out.rollout_log_probs) == out.response_length
        assert all(lp == 0.0 for lp, m in zip(out.rollout_log_probs, out.loss_mask, strict=True) if m == 0)
        assert "_input_ids" not in out.metadata
    new = {sid: gym.sessions[sid] for sid in set(gym.sessions) - before}
    assert len(new) == 2  # one session per episode
    for sid, session in new.items():
        assert session["calls"] == [{"a": 1, "b": 2}]  # the call the model made, in its own session
        assert [route for route, s in gym.log if s == sid] == ["calc_add", "verify"]  # the cookie came back
        verified = session["verified"]
        assert verified["expected_answer"] == "3" and "rm_type" not in verified and "tools" not in verified
        assert verified["responses_create_params"]["input"] == [{"role": "user", "content": "1+2"}]
        assert verified["responses_create_params"]["tools"][0]["name"] == "calc_add"
        items = verified["response"]["output"]
        assert [i["type"] for i in items] == ["function_call", "function_call_output", "message"]
        assert items[0]["name"] == "calc_add" and json.loads(items[0]["arguments"]) == {"a": 1, "b": 2}
        assert items[1] == {"type": "function_call_output", "call_id": items[0]["call_id"], "output": "3"}
        assert items[2]["content"][0]["text"] == "3"
        _assert_a_responses_object(verified["response"])
    assert any(s["row"].get("task_id") == 7 for s in new.values())  # the whole row reached /seed_session


def _assert_a_responses_object(response: dict) -> None:
    """What /verify receives parses as the Responses API's response (NeMo Gym's NeMoGymResponse
    extends it with function_call_output items, which the plain model does not list)."""
    responses = pytest.importorskip("openai.types.responses")
    plain = {**response, "output": [i for i in response["output"] if i["type"] != "function_call_output"]}
    responses.Response.model_validate(plain)


async def test_a_row_without_tools_is_one_verified_turn(gym, engine_url, tool_model_dir):
    """No tools offered (no parser needed): one turn, all of it the model's, then /verify."""
    config = RunConfig(env=f"nemogym:{gym.url}", rollout_max_response_len=8)
    row = {"responses_create_params": {"input": "1+2", "instructions": "Add."}, "expected_answer": "never"}
    (out,) = await _run(config, [Sample(index=0, prompt="1+2", metadata=dict(row))], tool_model_dir, engine_url,
                        {"max_new_tokens": 8, "temperature": 1.0})  # fmt: skip
    assert out.metadata["env_reward"] == 0.0 and out.metadata["env_stop"] in ("answered", "length")
    cut = out.metadata["env_stop"] == "length"  # the turn ran out of tokens: the sample is TRUNCATED, still verified
    assert out.status is (SampleStatus.TRUNCATED if cut else SampleStatus.COMPLETED)
    assert out.loss_mask == [1] * out.response_length and 1 <= out.response_length <= 8
    assert "tool_calls" not in out.metadata  # no tools offered: no rollout/tool_call_ratio
    (verified,) = [v["verified"] for v in gym.sessions.values() if v["row"] == row]
    assert verified["response"]["status"] == ("incomplete" if cut else "completed")


@pytest.mark.parametrize(("fault", "reason"), [
    ("seed_error", "answered /seed_session with HTTP 500: Internal Server Error: no such task"),
    ("verify_error", "answered /verify with HTTP 503: Service Unavailable"),
    ("verify_garbage", "answered /verify with '<html>upstream error</html>', not a JSON object"),
    ("verify_no_reward", "/verify answered without a finite number as its reward"),
])  # fmt: skip
async def test_a_server_error_or_a_malformed_answer_fails_the_episode_with_the_reason(
    gym, engine_url, tool_model_dir, fault, reason
):
    config = RunConfig(env=f"nemogym:{gym.url}", env_max_turns=2, sglang_server_args=PARSER)
    s = Sample(index=0, prompt="1+2", metadata=gym_row(fault=fault))
    with pytest.raises(connector.EnvError, match=reason.replace("(", r"\(")):
        await asyncio.wait_for(_run(config, [s], tool_model_dir, engine_url), 120)


async def test_a_server_that_never_answers_or_is_not_there_fails_in_time(gym, monkeypatch):
    """Nothing hangs: a request past CALL_TIMEOUT_S fails the episode, as does a closed port."""
    monkeypatch.setattr(connector, "CALL_TIMEOUT_S", 0.5)
    config = RunConfig(env=f"nemogym:{gym.url}")
    s = Sample(index=0, prompt="1+2", metadata={"expected_answer": "3", "fault": "seed_hang"})
    with pytest.raises(connector.EnvError, match=r"did not answer /seed_session within 0.5s"):
        await asyncio.wait_for(connector.generate(config, s, None, {}), 10)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    s = Sample(index=0, prompt="1+2", metadata={"expected_answer": "3"})
    with pytest.raises(connector.EnvError, match=rf"at http://127.0.0.1:{port} could not be reached for /seed_session"):
        await asyncio.wait_for(connector.generate(RunConfig(env=f"nemogym:http://127.0.0.1:{port}/"), s, None, {}), 10)


async def test_tool_calls_are_answered_in_the_session_and_mistakes_never_reach_the_server(gym):
    def call(name, arguments):
        return {"id": "c1", "type": "function", "function": {"name": name, "arguments": arguments}}

    async with connector._client() as http:
        server = connector.Server(gym.url, http)
        await server.call("seed_session", gym_row())
        offered = {"calc_add"}
        assert await server.tool(call("calc_add", '{"a": 4, "b": 5}'), offered) == "9"
        sid = gym.log[-1][1]  # the session cookie /seed_session set, sent back with the call
        assert gym.sessions[sid]["calls"] == [{"a": 4, "b": 5}]
        # the server's own refusal is the tool's output, for the model to read (as NeMo Gym's agent does)
        assert "must be integers" in await server.tool(call("calc_add", '{"a": "x"}'), offered)
        n = len(gym.log)
        assert "no tool 'verify'" in await server.tool(call("verify", "{}"), offered)
        assert "not JSON" in await server.tool(call("calc_add", "{oops"), offered)
        assert "must be a JSON object" in await server.tool(call("calc_add", "[1, 2]"), offered)
        assert len(gym.log) == n  # none of these reached the server


def test_rows_tools_and_messages_in_the_engines_shape():
    row = connector.nemogym_row(Sample(index=0, prompt="ignored", metadata={**gym_row(), "_input_ids": [1],
                                                                             "rm_type": "env"}))  # fmt: skip
    assert row == gym_row()
    built = connector.nemogym_row(Sample(index=0, prompt=[{"role": "user", "content": "hi"}],
                                         metadata={"tools": [{"type": "function", "function": {"name": "f"}}],
                                                   "answer": 2}))  # fmt: skip
    assert built == {"answer": 2, "responses_create_params": {"input": [{"role": "user", "content": "hi"}], "tools": [
        {"type": "function", "name": "f", "parameters": {"type": "object", "properties": {}}, "strict": False}]}}
    params = {"instructions": "Be brief.", "input": [
        {"role": "developer", "content": [{"type": "input_text", "text": "Use tools."}]},
        {"type": "message", "role": "user", "content": "1+2"},
        {"type": "reasoning", "id": "r", "summary": []},
        {"type": "function_call", "call_id": "c", "name": "calc_add", "arguments": '{"a": 1, "b": 2}'},
        {"type": "function_call_output", "call_id": "c", "output": "3"}]}  # fmt: skip
    assert connector.chat_messages(params) == [
        {"role": "system", "content": "Be brief."}, {"role": "system", "content": "Use tools."},
        {"role": "user", "content": "1+2"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c", "type": "function", "function": {"name": "calc_add", "arguments": '{"a": 1, "b": 2}'}}]},
        {"role": "tool", "tool_call_id": "c", "content": "3"}]  # fmt: skip
    with pytest.raises(connector.EnvError, match=r"input\[0\]: only text content"):
        connector.chat_messages({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]})
    with pytest.raises(connector.EnvError, match="must be text or a non-empty list"):
        connector.chat_messages({"input": []})
    assert connector.chat_tools([ADD]) == [{"type": "function", "function": {
        "name": "calc_add", "description": ADD["description"], "parameters": ADD["parameters"]}}]  # fmt: skip
    with pytest.raises(connector.EnvError, match="only function tools"):
        connector.chat_tools([{"type": "web_search"}])
    with pytest.raises(connector.EnvError, match="'verify' is a resources server's own route"):
        connector.chat_tools([{"type": "function", "name": "verify"}])
    with pytest.raises(connector.EnvError, match="is not a tool name"):
        connector.chat_tools([{"type": "function", "name": "../seed_session"}])
    with pytest.raises(connector.EnvError, match="finite number"):
        connector.verified_reward({"reward": float("nan")})
    _assert_a_responses_object(connector.response_object(gym_row()["responses_create_params"], [], "length"))


async def test_the_context_and_the_budget_end_an_episode_that_is_still_verified(gym):
    """An engine that refuses the next turn's prompt for the context length ends the sample
    TRUNCATED (verified on what it holds); a first prompt that does not fit fails the episode."""

    class Engine:
        def __init__(self, refuse_after: int):
            self.asked, self.refuse_after = 0, refuse_after
            self.context = [0, 1, 2]
            self.tokenizer = self
            self.client = self

        def pick(self):
            return "http://engine"

        def decode(self, ids, skip_special_tokens=False):
            return "".join(chr(97 + i % 26) for i in ids)

        async def chat_completions(self, url, body):
            if self.asked >= self.refuse_after:
                raise EngineError(f"{url} returned 400: the input (300 tokens) is longer than the model's context "
                                  "length (256 tokens).")  # fmt: skip
            prompt = self.context + [7] * 4 if self.asked else self.context  # then the tool's answer, 4 ids
            self.asked += 1
            self.context = prompt + [5, 6]
            call = {"id": f"c{self.asked}", "type": "function",
                    "function": {"name": "calc_add", "arguments": '{"a": 1, "b": 2}'}}  # fmt: skip
            return {"prompt_token_ids": prompt, "choices": [{
                "message": {"role": "assistant", "content": None, "tool_calls": [call]}, "finish_reason": "tool_calls",
                "token_ids": [5, 6], "logprobs": {"content": [{"logprob": -0.5}, {"logprob": -0.5}]},
                "meta_info": {"weight_version": "0"}}]}  # fmt: skip

    config = RunConfig(env=f"nemogym:{gym.url}", env_max_turns=5, sglang_server_args=PARSER)
    out = await connector.generate(config, Sample(index=0, prompt="1+2", metadata=gym_row()), Engine(2), {})
    assert out.status is SampleStatus.TRUNCATED and out.metadata["env_stop"] == "context"
    assert out.metadata["env_reward"] == 0.0 and out.metadata["env_verify"]["tool_calls_made"] == 2
    assert out.loss_mask == [1, 1, 0, 0, 0, 0, 1, 1]
    with pytest.raises(connector.EnvError, match="prompt does not fit the model's context length"):
        await connector.generate(config, Sample(index=0, prompt="1+2", metadata=gym_row()), Engine(0), {})
    out = await connector.generate(config, Sample(index=0, prompt="1+2", metadata=gym_row()), Engine(9),
                                   {"max_new_tokens": 2})  # fmt: skip
    assert out.metadata["env_stop"] == "budget" and out.status is SampleStatus.COMPLETED


def test_the_env_flag_is_checked_and_what_it_cannot_run_is_refused():
    assert RunConfig(env="nemogym:http://gym:8000").rollout.env_spec.url == "http://gym:8000"
    connector.check(RunConfig(env="nemogym:https://gym/"))
    for wrong, why in (("nemogym:gym:8000", "nemogym:URL takes the resources server's HTTP address"),
                       ("nemogym:http://", "nemogym:URL takes"), ("nemogym:", "openenv:URL, nemogym:URL or")):
        with pytest.raises(ValueError, match=why):
            RunConfig(env=wrong)
    with pytest.raises(ValueError, match="cannot run --env nemogym"):
        RunConfig(env="nemogym:http://gym:8000", multi_lora_n_adapters=2)


async def test_a_row_with_tools_needs_engines_that_parse_tool_calls():
    """Before any request: without a parser the model's first call would stay text."""
    s = Sample(index=0, prompt="1+2", metadata=gym_row())
    with pytest.raises(connector.EnvError, match="--sglang-tool-call-parser qwen25"):
        await connector.generate(RunConfig(env="nemogym:http://127.0.0.1:9"), s, None, {})
    with pytest.raises(connector.EnvError, match="could not be reached"):  # external engines: their own flags decide
        await connector.generate(RunConfig(env="nemogym:http://127.0.0.1:9",
                                           rollout_external_engine_addrs=["127.0.0.1:1"]), s, None, {})  # fmt: skip
