"""A bundled multi-turn example of the --custom-generate-function-path contract.

    asyncrl train-async --fully-async \\
        --custom-generate-function-path services.tasks.multiturn.generate \\
        --custom-rm-path services.tasks.multiturn.reward

The model answers the prompt; a "tool" answers with a separator token; the model answers again
with the whole conversation as context. Model turns are in the loss (loss_mask 1), tool tokens
are not (0). Every turn is its own /generate call and records the weight versions that produced
it (metadata["turn_versions"]), so a conversation that spans a weight update says so; the
sample's weight_versions lists them all. The reward scores the last turn only.
"""

from __future__ import annotations

from asyncrl_proto.messages import Sample, SampleStatus
from services.common.responses import apply_response, versions_of
from services.tasks.reverse_digits import score

TOOL_REPLY = "="
NUM_TURNS = 2


async def generate(config, sample: Sample, engine, sampling_params: dict) -> Sample:
    context = sample.metadata.pop("_input_ids")
    prompt_len = len(context)
    mask: list[int] = []
    turns, turn_versions = [], []
    for turn in range(NUM_TURNS):
        tokens_before, text_before = sample.response_length, len(sample.response)
        resp = await engine.generate(context, sampling_params, rid=f"s{sample.index}-t{turn}")
        apply_response(sample, context, resp)
        mask += [1] * (sample.response_length - tokens_before)
        turns.append(sample.response[text_before:])
        turn_versions.append(versions_of(resp.get("meta_info", {})))
        if sample.status is SampleStatus.ABORTED or turn == NUM_TURNS - 1:
            break
        tool = engine.tokenizer.encode(TOOL_REPLY, add_special_tokens=False)
        sample.tokens += tool
        sample.response += TOOL_REPLY
        sample.response_length += len(tool)
        sample.rollout_log_probs += [0.0] * len(tool)
        mask += [0] * len(tool)
        context = list(sample.tokens)
    sample.loss_mask = mask
    sample.metadata["turns"] = turns
    sample.metadata["turn_versions"] = turn_versions
    sample.metadata["prompt_length"] = prompt_len
    return sample


async def reward(config, sample: Sample) -> float:
    turns = sample.metadata.get("turns") or [sample.response]
    return score(turns[-1], str(sample.label))
