"""The generate-function contract (Miles's --custom-generate-function-path): how one trajectory is
produced from a prompt, given the engines. The producer and the eval service resolve it the same
way, so held-out prompts are answered as training prompts are (a tool task calls its tool in both).

    async def generate(config, sample, engine, sampling_params) -> Sample

`sample.metadata["_input_ids"]` holds the prompt's ids (pop it); `engine` is an EngineHandle.
"""

from __future__ import annotations

import importlib
import uuid

from asyncrl_proto.messages import Sample
from services.common.plugins import load_object
from services.common.responses import apply_response

TASK_GENERATE = {"calculator": "services.tasks.calculator.generate"}
"""Bundled tasks that are multi-turn: their generate function when --task names them."""


class EngineHandle:
    """What a generate function receives as `engine`. `fields`: request fields every request
    through this handle carries (multi-LoRA: the adapter version's `lora_path`). `context_length`:
    the model's positions, where the caller knows them (a multi-turn loop stops there)."""

    def __init__(self, client, tokenizer, context_length: int | None = None, **fields):
        self.client = client
        self.tokenizer = tokenizer
        self.context_length = context_length
        self.fields = fields

    def with_fields(self, **fields) -> EngineHandle:
        return EngineHandle(self.client, self.tokenizer, self.context_length, **self.fields, **fields)

    async def generate(self, input_ids: list[int], sampling_params: dict, **extra) -> dict:
        body = {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": True}
        return await self.client.generate({**body, **extra, **self.fields})


async def default_generate(config, sample: Sample, engine: EngineHandle, sampling_params: dict) -> Sample:
    """One /generate call for one trajectory (the built-in generate function)."""
    input_ids = sample.metadata.pop("_input_ids")
    resp = await engine.generate(input_ids, sampling_params, rid=f"s{sample.index}-{uuid.uuid4().hex[:8]}")
    apply_response(sample, input_ids, resp)
    return sample


ENV_CONNECTORS = {"openenv": "services.envs.openenv", "verifiers": "services.envs.vf",
                  "nemogym": "services.envs.nemogym"}  # fmt: skip
"""--env's connectors, by scheme: modules with `generate` and `check(config)`. check runs when a
producer or the eval service starts, so a missing extra or a wrong task name stops the run there,
not at every episode."""


def generate_function(config):
    """--custom-generate-function-path, else --env's connector (checked), else the task's own
    (TASK_GENERATE), else one /generate call."""
    r = config.rollout
    if r.custom_generate_function_path:
        return load_object(r.custom_generate_function_path, "--custom-generate-function-path")
    if (spec := r.env_spec) is not None:
        connector = importlib.import_module(ENV_CONNECTORS[spec.scheme])
        connector.check(config)
        return connector.generate
    path = TASK_GENERATE.get(config.data.task)
    return load_object(path, "--task") if path else default_generate
