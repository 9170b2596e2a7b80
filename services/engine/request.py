"""A generation request as the built-in engine's scheduler runs it: its sampling parameters, its
tokens so far with each one's log-probability and weight version, its slot and its callbacks."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class SamplingParams:
    max_new_tokens: int = 128
    min_new_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    frequency_penalty: float = 0.0
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    sampling_seed: int | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-6


@dataclass
class Request:
    rid: str
    input_ids: list[int]
    params: SamplingParams
    on_done: Callable[[Request], None]
    output_ids: list[int] = field(default_factory=list)
    output_logprobs: list[float] = field(default_factory=list)
    token_versions: list[int] = field(default_factory=list)
    slot: int | None = None
    kv_len: int = 0
    finish_reason: dict | None = None
    num_retractions: int = 0
    cached_tokens: int = 0
    created_at: float = field(default_factory=time.time)
    finished_at: float = 0.0
    admitted_at: float = 0.0
    """When it first got a slot: its queue time ends (0: never)."""
    first_token_at: float = 0.0
    """When its first output token was sampled (0: none yet)."""
    logprob_start: int | None = None
    """Where the prompt's log-probabilities start (SGLang's logprob_start_len); None: not wanted.
    Such a request prefills its whole prompt itself (no prefix cache) to see every position's logits."""
    top_logprobs_num: int = 0
    input_logprobs: list[float | None] | None = None
    input_top_logprobs: list | None = None
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    on_token: Callable[[Request], None] | None = None
    """Called on the scheduler thread after each token of an unfinished request (streaming)."""
    stop_check: Callable[[Request], str | None] | None = None
    """Called on the scheduler thread after each token: the stop string it matched, or None."""
    lora_slot: int = -1
    """The LoRA slot its rows use (services/engine/loras.py); -1: the base model."""
    lora_uid: int = 0
    """Which load of an adapter it uses: part of its prompt's prefix-cache key."""

    @property
    def prefix_key(self) -> tuple:
        return (self.lora_uid, *self.input_ids)

    @property
    def seq(self) -> list[int]:
        return self.input_ids + self.output_ids
