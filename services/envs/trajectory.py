"""A multi-turn sample built token in, token out.

A trajectory is the prompt's token ids, then turns: the model's (the ids the engine sampled, with
their log-probs, in the loss) and the environment's or a tool's (ids appended by the producer,
out of the loss, log-prob 0). Nothing is re-tokenized: every id in the sample is one the engine
saw or sampled, so the trainer scores exactly what was generated. Every model turn records the
weight versions that produced it (metadata["turn_versions"]); the sample's weight_versions lists
them all.
"""

from __future__ import annotations

import asyncio

from asyncrl_proto.messages import Sample, SampleStatus
from services.common.responses import apply_response, versions_of


class Trajectory:
    def __init__(self, sample: Sample, prompt_ids: list[int]):
        self.sample = sample
        self.prompt_ids = list(prompt_ids)
        self.mask: list[int] = []
        self.turns: list[str] = []
        """The model's turns, as text (metadata["turns"])."""
        self.env_turns: list[str] = []
        """What the environment or tool answered between them (metadata["env_turns"])."""
        self.turn_versions: list[list[int]] = []
        self.tool_calls: int | None = None
        """Tool calls answered, for a loop that counts them (set it to 0, then add): metadata["tool_calls"],
        rollout/tool_call_ratio, eval/<set>-tool_call_ratio. None: not a tool loop, no metric."""

    @property
    def context(self) -> list[int]:
        """Every id so far: what the engine sees next."""
        return list(self.sample.tokens) or list(self.prompt_ids)

    @property
    def response_tokens(self) -> int:
        return self.sample.response_length

    def room(self, context_length: int | None) -> int:
        """Positions left before `context_length` (the engine refuses a prompt that fills it);
        unbounded when it is None."""
        return context_length - len(self.context) if context_length is not None else 2**31

    @property
    def aborted(self) -> bool:
        return self.sample.status is SampleStatus.ABORTED

    def model_turn(self, resp: dict) -> list[int]:
        """Append one /generate answer (the engine's own ids and log-probs); returns its ids.
        A tool call is read from these ids, not from the text (which an engine may trim)."""
        before, text_before = len(self.context), len(self.sample.response)
        apply_response(self.sample, self.context, resp)
        ids = self.sample.tokens[before:]
        self.mask += [1] * len(ids)
        self.turns.append(self.sample.response[text_before:])
        self.turn_versions.append(versions_of(resp.get("meta_info", {})))
        return ids

    def env_turn(self, ids: list[int], text: str) -> None:
        """Append ids the model did not write (a tool's answer, an environment's observation)."""
        if not self.sample.tokens:
            self.sample.tokens = list(self.prompt_ids)
        self.sample.tokens += ids
        self.sample.response += text
        self.sample.response_length += len(ids)
        self.sample.rollout_log_probs += [0.0] * len(ids)
        self.mask += [0] * len(ids)
        self.env_turns.append(text)

    def finish(self) -> Sample:
        s = self.sample
        if s.response_length and len(s.rollout_log_probs) != s.response_length:
            s.rollout_log_probs = []  # an engine without log-probs: none at all, never a partial list
        s.loss_mask = self.mask
        s.metadata.update(turns=self.turns, env_turns=self.env_turns)
        if self.tool_calls is not None:
            s.metadata["tool_calls"] = self.tool_calls
        s.metadata.update(turn_versions=self.turn_versions, prompt_length=len(self.prompt_ids))
        return s


def tool_call_metrics(name: str, samples: list) -> dict[str, float]:
    """The share of samples that called a tool at least once, where a multi-turn generate function
    counts its calls (metadata["tool_calls"], services/envs/trajectory.py); else nothing."""
    counted = [s.metadata["tool_calls"] for s in samples if isinstance(s.metadata.get("tool_calls"), int)]
    return {name: sum(c > 0 for c in counted) / len(counted)} if counted else {}


def gated(episode):
    """`episode` as a connector's generate function whose open episodes are held at
    --env-max-sessions: one semaphore per event loop (one per process in a service) and limit."""
    sessions: dict[tuple[asyncio.AbstractEventLoop, int], asyncio.Semaphore] = {}

    async def generate(config, sample: Sample, engine, sampling_params: dict) -> Sample:
        limit = config.rollout.env_max_sessions
        async with sessions.setdefault((asyncio.get_running_loop(), limit), asyncio.Semaphore(limit)):
            return await episode(config, sample, engine, sampling_params)

    return generate


class EnvError(RuntimeError):
    """The environment refused or broke an episode, or the row cannot be run: the sample fails
    with this reason."""


async def env_reward(config, sample: Sample) -> float:
    """The reward an environment gave the episode (metadata["env_reward"]): the default reward
    with --env (rm_type "env")."""
    if "env_reward" not in sample.metadata:
        raise ValueError("rm_type env: the sample has no metadata.env_reward (it did not come from --env)")
    return sample.metadata["env_reward"]
