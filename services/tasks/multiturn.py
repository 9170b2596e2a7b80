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

from asyncrl_proto.messages import Sample
from services.envs.trajectory import Trajectory
from services.tasks.reverse_digits import score

TOOL_REPLY = "="
NUM_TURNS = 2


async def generate(config, sample: Sample, engine, sampling_params: dict) -> Sample:
    traj = Trajectory(sample, sample.metadata.pop("_input_ids"))
    traj.tool_calls = 0
    for turn in range(NUM_TURNS):
        traj.model_turn(await engine.generate(traj.context, sampling_params, rid=f"s{sample.index}-t{turn}"))
        if traj.aborted or turn == NUM_TURNS - 1:
            break
        traj.env_turn(engine.tokenizer.encode(TOOL_REPLY, add_special_tokens=False), TOOL_REPLY)
        traj.tool_calls += 1
    return traj.finish()


async def reward(config, sample: Sample) -> float:
    turns = sample.metadata.get("turns") or [sample.response]
    return score(turns[-1], str(sample.label))
