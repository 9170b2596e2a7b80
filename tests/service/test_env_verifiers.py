"""--env verifiers:MODULE:TASK against the real verifiers package (v1 Agent, its interception
server, the subprocess runtime) and the real engine: the sample is the ids the engine saw and
sampled, its reward the task's own."""

from __future__ import annotations

from pathlib import Path

import pytest

vf = pytest.importorskip("verifiers.v1", reason="the verifiers extra: pip install -e '.[verifiers]'")

from asyncrl_proto.messages import Sample, SampleStatus  # noqa: E402
from services.common.config import RunConfig  # noqa: E402
from services.common.sglang_client import SGLangClient  # noqa: E402
from services.envs import vf as connector  # noqa: E402
from services.envs.chat import ChatRecorder, TurnMismatch, assemble  # noqa: E402
from services.envs.generate import EngineHandle, generate_function  # noqa: E402
from services.envs.trajectory import env_reward  # noqa: E402
from services.model.tokenizer import Tokenizer  # noqa: E402
from tests.conftest import EngineThread  # noqa: E402


class ReverseData(vf.TaskData):
    answer: str


class ReverseTask(vf.Task[ReverseData, vf.State, vf.TaskConfig]):
    """Reward: the share of the answer's digits the reply has in place."""

    @vf.reward(weight=1.0)
    async def digits(self, task: ReverseData, trace: vf.Trace) -> float:
        reply = trace.last_reply or ""
        return sum(a == b for a, b in zip(reply, task.answer, strict=False)) / len(task.answer)


class UnscoredTask(vf.Task[ReverseData, vf.State, vf.TaskConfig]):
    """A reward that breaks on every episode."""

    @vf.reward(weight=1.0)
    async def broken(self, task: ReverseData, trace: vf.Trace) -> float:
        raise ZeroDivisionError("no score for this reply")


class CalcTask(vf.Task[ReverseData, vf.State, vf.TaskConfig]):
    """Answer with the sum; the calculator toolset (tests/service/vf_calc.py) is at hand."""

    @classmethod
    def toolsets(cls, config):
        from tests.service.vf_calc import Calc

        return [Calc(vf.ToolsetConfig())]

    @vf.reward(weight=1.0)
    async def right(self, task: ReverseData, trace: vf.Trace) -> float:
        return float((trace.last_reply or "").strip() == task.answer)


NOT_A_TASK = 3
ROOT = str(Path(__file__).resolve().parents[2])


async def test_an_episode_is_the_ids_the_engine_saw_and_sampled(tiny_model_dir):
    config = RunConfig(env=f"verifiers:{__name__}:ReverseTask", rollout_max_response_len=6)
    assert generate_function(config) is connector.generate
    tok = Tokenizer(tiny_model_dir)
    with EngineThread(tiny_model_dir) as engine:
        client = SGLangClient([engine.url])
        handle = EngineHandle(client, tok)
        try:
            samples = []
            for i, digits in enumerate(("123", "4567")):
                s = Sample(index=i, prompt=digits, label=digits[::-1], metadata={"_input_ids": tok.encode(digits)})
                samples.append(await connector.generate(config, s, handle, {"max_new_tokens": 6, "temperature": 1.0,
                                                                            "top_p": 1.0, "top_k": -1}))  # fmt: skip
            recorder = await ChatRecorder.for_engine(handle)
            assert recorder.turns == {}  # every episode's record is dropped when it ends
        finally:
            await recorder.close()
            await client.close()
    for s, digits in zip(samples, ("123", "4567"), strict=True):
        rendered = tok.encode(tok.render_chat([{"role": "user", "content": digits}]), add_special_tokens=False)
        prompt_len = s.metadata["prompt_length"]
        assert s.tokens[:prompt_len] == rendered  # the engine's own rendering of the prompt, not ours
        assert s.loss_mask == [1] * s.response_length and 1 <= s.response_length <= 6
        assert tok.decode(s.tokens[prompt_len:]) == s.response == s.metadata["turns"][0]
        assert len(s.rollout_log_probs) == s.response_length and all(lp <= 0 for lp in s.rollout_log_probs)
        expected = sum(a == b for a, b in zip(s.response, digits[::-1], strict=False)) / len(digits)
        assert s.metadata["env_reward"] == pytest.approx(expected) == await env_reward(config, s)
        assert s.metadata["turn_versions"] == [[0]] and s.weight_versions == [0]
        assert "tool_calls" not in s.metadata  # no tools offered: no rollout/tool_call_ratio


def test_turns_that_do_not_extend_the_conversation_are_refused():
    def turn(prompt, ids):
        return {"prompt_ids": prompt, "ids": ids, "logprobs": [-0.1] * len(ids), "text": "x",
                "meta_info": {"weight_version": "2", "finish_reason": {"type": "stop"}}}  # fmt: skip

    s = assemble(Sample(index=0), [turn([1, 5], [6, 2]), turn([1, 5, 6, 2, 9, 9], [7])], str)
    assert s.tokens == [1, 5, 6, 2, 9, 9, 7] and s.loss_mask == [1, 1, 0, 0, 1]
    assert s.rollout_log_probs == [-0.1, -0.1, 0.0, 0.0, -0.1] and s.metadata["prompt_length"] == 2
    with pytest.raises(TurnMismatch, match="turn 1"):
        assemble(Sample(index=0), [turn([1, 5], [6, 2]), turn([1, 5, 6, 3], [7])], str)
    with pytest.raises(TurnMismatch, match="no model call"):
        assemble(Sample(index=0), [], str)


async def test_an_episode_the_task_could_not_score_fails_with_the_reason(tiny_model_dir):
    """Never trained as reward 0: the sample fails (its group is retried) with verifiers' reason."""
    config = RunConfig(env=f"verifiers:{__name__}:UnscoredTask", rollout_max_response_len=4)
    tok = Tokenizer(tiny_model_dir)
    with EngineThread(tiny_model_dir) as engine:
        client = SGLangClient([engine.url])
        handle = EngineHandle(client, tok)
        try:
            s = Sample(index=0, prompt="12", label="21", metadata={"_input_ids": tok.encode("12")})
            with pytest.raises(RuntimeError, match="did not score the episode.*no score for this reply"):
                await connector.generate(config, s, handle, {"max_new_tokens": 4})
        finally:
            await (await ChatRecorder.for_engine(handle)).close()
            await client.close()


def test_the_task_is_checked_when_the_service_starts():
    with pytest.raises(ValueError, match="must name a verifiers.v1 Task class"):
        generate_function(RunConfig(env=f"verifiers:{__name__}:NOT_A_TASK"))
    with pytest.raises(Exception, match="no_such_module"):
        generate_function(RunConfig(env="verifiers:no_such_module:Task"))


def test_multi_lora_refuses_verifiers_whose_chat_calls_carry_no_adapter():
    with pytest.raises(ValueError, match="cannot run --env verifiers"):
        RunConfig(env=f"verifiers:{__name__}:ReverseTask", multi_lora_n_adapters=2)


def test_a_turn_the_engine_aborted_ends_the_sample_aborted():
    def turn(prompt, ids, reason):
        return {"prompt_ids": prompt, "ids": ids, "logprobs": [-0.1] * len(ids), "text": "x",
                "meta_info": {"weight_version": "2", "finish_reason": {"type": reason}}}  # fmt: skip

    s = assemble(Sample(index=0), [turn([1, 5], [6], "abort"), turn([1, 5, 6, 9], [7], "stop")], str)
    assert s.status is SampleStatus.ABORTED and s.tokens == [1, 5, 6] and s.metadata["turns"] == ["x"]


async def test_a_tool_using_episode_runs_the_calls_on_the_toolsets_server(tool_model_dir, monkeypatch):
    """A verifiers Toolset (an MCP server verifiers starts) in the loop: the harness offers its
    tool, the engine (--tool-call-parser qwen25) answers the model's call as tool_calls, the call
    runs on the server, its answer goes back as a tool message, and the model answers. The sample
    is one token sequence: the call and the answer are the model's (loss mask 1), the tool's
    answer is the environment's (loss mask 0), each with the ids the engine saw and sampled."""
    from services.tasks.char_model import encode
    from tests.conftest import TOOL_CALL

    monkeypatch.setenv("PYTHONPATH", ROOT)  # the toolset's process imports tests
    config = RunConfig(env=f"verifiers:{__name__}:CalcTask", rollout_max_response_len=100, env_max_turns=4)
    tok = Tokenizer(tool_model_dir)
    eos = tok.eos_token_id
    with EngineThread(tool_model_dir, tool_call_parser="qwen25") as engine:
        client = SGLangClient([engine.url])
        handle = EngineHandle(client, tok)
        recorder = None
        try:
            s = Sample(index=0, prompt="1+2", label="3", metadata={})
            out = await connector.generate(config, s, handle, {"max_new_tokens": 100, "temperature": 0.0,
                                                               "top_p": 1.0, "top_k": -1})  # fmt: skip
            recorder = await ChatRecorder.for_engine(handle)
        finally:
            if recorder is not None:
                await recorder.close()
            await client.close()
    assert out.status is SampleStatus.COMPLETED, out.metadata
    assert out.metadata["env_reward"] == 1.0 == await env_reward(config, out)
    assert out.metadata["tool_calls"] == 1  # counted for rollout/tool_call_ratio
    prompt_len = out.metadata["prompt_length"]
    rendered = tok.render_chat([{"role": "user", "content": "1+2"}], tools=[{"type": "function",
                               "function": {"name": "calc_add"}}])  # fmt: skip
    assert out.tokens[:prompt_len] == tok.encode(rendered, add_special_tokens=False)
    call, told, answer = encode(TOOL_CALL) + [eos], encode("(3)"), encode("3") + [eos]
    assert out.tokens[prompt_len:] == call + told + answer  # "(3)": what the server computed, as the template renders it
    assert out.loss_mask == [1] * len(call) + [0] * len(told) + [1] * len(answer)
    assert len(out.rollout_log_probs) == out.response_length
    assert [lp for lp, m in zip(out.rollout_log_probs, out.loss_mask, strict=True) if m == 0] == [0.0] * len(told)


def test_a_task_with_tools_needs_engines_that_parse_tool_calls():
    """Checked at start-up: without a parser the model's call would stay text and the episode end there."""
    config = RunConfig(env=f"verifiers:{__name__}:CalcTask")
    with pytest.raises(ValueError, match="--sglang-tool-call-parser qwen25"):
        connector.check(config)
    connector.check(RunConfig(env=f"verifiers:{__name__}:CalcTask", sglang_server_args=["--tool-call-parser", "qwen25"]))
    connector.check(RunConfig(env=f"verifiers:{__name__}:ReverseTask"))  # no tools, no parser needed
