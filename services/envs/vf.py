"""verifiers environments in the loop: `--env verifiers:MODULE:TASK`.

TASK names a verifiers (>= 0.4, `verifiers.v1`) Task class. Each prompt row becomes one task of
its data type (`TASK.data_type()`), built from the row's prompt and its metadata's `task` object
(a field named `answer` takes the row's label when the object has none). An episode is
`vf.Agent(...).run(task)`, offline: the subprocess runtime and an in-process chat harness
(`asyncrl_chat`: verifiers' stock harnesses install their programs with uv). Every model call goes
through the producer's recording chat endpoint (services/envs/chat.py) to the engines; the sample
is assembled from the ids the engine saw and sampled. The episode's reward is the task's
(`trace.reward`, metadata["env_reward"]; its parts in metadata["env_rewards"]). An episode the
task could not score fails its sample with verifiers' reasons; one whose model turn the engine
aborted ends there, ABORTED, unscored.

Tools: the task's Toolsets are MCP servers (verifiers starts them); the harness offers their tools
to the model, runs each call on its server and sends the result back as a tool message, until a
reply calls nothing or --env-max-turns. The calls arrive as OpenAI `tool_calls` only from an engine
that parses them (`--sglang-tool-call-parser qwen25`). Tool messages are out of the loss.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import types

from asyncrl_proto.messages import Sample, SampleStatus
from services.common.engine_commands import tool_call_parser
from services.common.plugins import load_object
from services.envs.chat import ChatRecorder, assemble

HARNESS_ID = "asyncrl_chat"
KEY_VAR = "ASYNCRL_VF_ENDPOINT_KEY"
"""verifiers reads the upstream API key from an environment variable; the recorder needs none."""


def _verifiers():
    try:
        import verifiers.v1 as vf
    except ImportError as e:
        raise RuntimeError("--env verifiers needs verifiers >= 0.4: pip install 'asyncrl[verifiers]'") from e
    return vf


def _register_harness(vf) -> None:
    """verifiers loads a harness by id, as a module exporting it: ours is built here and registered
    under HARNESS_ID (its loader imports plugin ids as top-level modules)."""
    if HARNESS_ID in sys.modules:
        return
    from openai import AsyncOpenAI
    from verifiers.v1.dialects.chat import message_to_wire
    from verifiers.v1.harnesses.utils.mcp import connect_mcp
    from verifiers.v1.runtimes import ProgramResult

    class ChatHarnessConfig(vf.HarnessConfig):
        id: str = HARNESS_ID

    class ChatHarness(vf.Harness[ChatHarnessConfig]):
        """The chat loop (_chat_loop), in this process, through the interception endpoint."""

        APPENDS_SYSTEM_PROMPT = True
        SUPPORTS_MCP = True
        SUPPORTS_RESUME = True
        EXECUTES_CODE = False
        NEEDS_CONTAINER = False

        async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data, tool_interception_url=None):
            system, prompt = self.resolve_prompt(data)
            messages = [{"role": "system", "content": system}] if system else []
            if isinstance(prompt, str):
                messages.append({"role": "user", "content": prompt})
            elif prompt:
                messages += [message_to_wire(m) for m in prompt]
            async with contextlib.AsyncExitStack() as stack:
                client = await stack.enter_async_context(AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0))
                tools, dispatch, servers = [], {}, {}
                if mcp_urls:
                    config = {"mcpServers": {name: {"url": url} for name, url in mcp_urls.items()}}
                    tools, dispatch, servers = await connect_mcp(config, stack)
                try:
                    await _chat_loop(client, ctx.model, messages, tools, dispatch, servers)
                except Exception as e:  # a limit or a stop condition ends the segment with an HTTP error
                    return ProgramResult(exit_code=0 if trace.stop_condition else 1, stdout="", stderr=repr(e))
            return ProgramResult(exit_code=0, stdout="", stderr="")

    module = types.ModuleType(HARNESS_ID, "asyncrl's in-process chat harness for verifiers (services/envs/vf.py)")
    module.ChatHarness, module.ChatHarnessConfig, module.__all__ = ChatHarness, ChatHarnessConfig, ["ChatHarness"]
    sys.modules[HARNESS_ID] = module


async def _chat_loop(
    client, model: str, messages: list[dict], tools: list[dict], dispatch: dict, servers: dict
) -> None:
    """Ask the model, run the tool calls of its reply on their MCP servers and append what they
    answered, until a reply calls no tool. A call the model got wrong (unknown tool, arguments
    that are not a JSON object) is answered with the error, for the model to see."""
    from verifiers.v1.harnesses.utils.mcp import call_mcp

    while True:
        kwargs = {"tools": tools} if tools else {}
        completion = await client.chat.completions.create(model=model, messages=messages, **kwargs)
        message = completion.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            return
        for call in message.tool_calls:
            name = call.function.name
            try:
                args = json.loads(call.function.arguments or "{}")
            except ValueError as e:
                content = f"error: the arguments are not JSON ({e})"
            else:
                if not isinstance(args, dict):
                    content = f"error: the arguments must be a JSON object, not {type(args).__name__}"
                elif name not in dispatch:
                    content = f"error: no tool {name!r} (tools: {', '.join(sorted(dispatch)) or 'none'})"
                else:
                    content = await call_mcp(servers, dispatch, name, args)
            messages.append({"role": "tool", "tool_call_id": call.id, "name": name, "content": content})


@functools.cache
def _task_class(module: str, name: str):
    vf = _verifiers()
    task_cls = load_object(f"{module}.{name}", "--env verifiers:MODULE:TASK")
    if not (isinstance(task_cls, type) and issubclass(task_cls, vf.Task)):
        raise ValueError(f"--env verifiers:{module}:{name} must name a verifiers.v1 Task class "
                         f"(it is {type(task_cls).__name__})")  # fmt: skip
    return task_cls


def _offers_tools(task_cls) -> bool:
    """The task has toolsets under its default config (False where that config cannot be built:
    the episodes will tell)."""
    try:
        return bool(task_cls.toolsets(task_cls.config_type()()))
    except Exception:
        return False


def check(config) -> None:
    """At start-up: verifiers is installed and TASK is a Task class; a task with tools runs on
    engines that parse tool calls (without a parser a call stays text and the episode ends there)."""
    spec = config.rollout.env_spec
    task_cls = _task_class(spec.module, spec.task)
    parser = tool_call_parser(config.infra.sglang_server_args) is not None
    if not parser and not config.infra.rollout_external_engine_addrs and _offers_tools(task_cls):
        raise ValueError(f"--env verifiers:{spec.module}:{spec.task} offers tools (its toolsets): the engines must "
                         "parse the model's tool calls, add --sglang-tool-call-parser qwen25 (or the parser that "
                         "matches the model's chat template)")  # fmt: skip


async def generate(config, sample: Sample, engine, sampling_params: dict) -> Sample:
    vf = _verifiers()
    _register_harness(vf)
    r, spec = config.rollout, config.rollout.env_spec
    task_cls = _task_class(spec.module, spec.task)
    recorder = await ChatRecorder.for_engine(engine)
    os.environ.setdefault(KEY_VAR, "unused")
    sampling = {"temperature": sampling_params.get("temperature", 1.0), "top_p": sampling_params.get("top_p", 1.0),
                "max_tokens": sampling_params.get("max_new_tokens", r.max_response_len),
                "top_k": sampling_params.get("top_k", -1)}  # fmt: skip
    sample.metadata.pop("_input_ids", None)  # the chat template renders the prompt: the first turn's ids start it
    with recorder.episode() as episode:
        agent = vf.Agent(vf.AgentConfig(
            model=episode, client=vf.EvalClientConfig(base_url=recorder.url + "/v1", api_key_var=KEY_VAR),
            runtime=vf.SubprocessConfig(), harness={"id": HARNESS_ID}, sampling=vf.SamplingConfig(**sampling),
            max_turns=r.env_max_turns))  # fmt: skip
        fields, data_type = dict(sample.metadata.get("task") or {}), task_cls.data_type()  # the row's task
        if "answer" in data_type.model_fields and "answer" not in fields and sample.label is not None:
            fields["answer"] = sample.label
        trace = await agent.run(task_cls(data_type(prompt=sample.prompt, **fields)))
        turns = list(recorder.turns[episode])
    errors = [str(getattr(e, "message", e))[:300] for e in trace.errors or []][:3]
    if not turns:
        raise RuntimeError(f"the verifiers episode made no model call: {errors or 'no error given'}")
    out = assemble(sample, turns, lambda ids: engine.tokenizer.decode(ids, skip_special_tokens=False))
    if out.status is SampleStatus.ABORTED:
        return out  # regenerated, never scored: what the task made of a cut turn means nothing
    if errors or trace.reward is None:
        raise RuntimeError(f"the verifiers task did not score the episode: {errors or 'it gave no reward'}")
    out.metadata["env_reward"] = float(trace.reward)
    out.metadata["env_rewards"] = {k: float(getattr(v, "value", v)) for k, v in (trace.rewards or {}).items()}
    out.metadata["env_stop"] = str(trace.stop_condition)
    return out
