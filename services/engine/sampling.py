"""One decoding step's token choice for the built-in engine, with SGLang's semantics.

Order, as SGLang applies it: penalties on the raw logits (repetition: CTRL-style, a logit > 0
divided by the penalty and one <= 0 multiplied by it, over every token of prompt + output;
frequency and presence: minus `penalty * count` and minus `penalty * (count > 0)` over output
tokens), then `logit_bias` is added, then the temperature divides. The reported log-probability
(and the top log-probabilities) are those of this processed distribution, softmax(logits / T),
the quantity the trainer recomputes when no penalty is set. top-k, top-p and min-p only restrict
what can be drawn; they do not change the reported log-probabilities. Greedy (T < 1e-6) takes
the argmax of the processed logits.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from services.engine.request import SamplingParams


@dataclass
class StepOutput:
    """What one forward pass decided, row by row."""

    tokens: list[int]
    logprobs: list[float]
    top: list[list[tuple[float, int]] | None]
    """The k most likely tokens per row (top_logprobs_num > 0), as (logprob, token id)."""
    prompt: list[tuple[list[float | None], list | None] | None]
    """Prompt log-probabilities of a row that asked for them: (values, top per position)."""
    errors: list[tuple[int, str] | None] | None = None
    """Per row: (HTTP status, why) when its request cannot go on (its processed logits hold NaN
    or +inf, or rule out every token: 400), else None. Such a row fails alone."""


def _penalize(logits_nv: torch.Tensor, params: list[SamplingParams], history: list[tuple[list[int], list[int]]]):
    vocab = logits_nv.shape[-1]
    for i, (p, (prompt, output)) in enumerate(zip(params, history, strict=True)):
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(prompt) | set(output)), dtype=torch.long)
            row = logits_nv[i, seen]
            logits_nv[i, seen] = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
        if output and (p.frequency_penalty or p.presence_penalty):
            counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=vocab).float()
            logits_nv[i] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).float()
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias), dtype=torch.long)
            logits_nv[i, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits_nv.dtype)


def _restrict(scaled_nv: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """-inf on every token top-k, top-p or min-p rules out."""
    if not any(p.top_k > 0 or p.top_p < 1.0 or p.min_p > 0 for p in params):
        return scaled_nv
    filtered = scaled_nv.clone()
    for i, p in enumerate(params):
        if 0 < p.top_k < filtered.shape[-1]:
            kth = torch.topk(filtered[i], p.top_k).values[-1]
            filtered[i][filtered[i] < kth] = float("-inf")
        if p.top_p < 1.0:
            sorted_logits, order = torch.sort(filtered[i], descending=True)
            probs = torch.softmax(sorted_logits, -1)
            drop = probs.cumsum(-1) - probs > p.top_p
            filtered[i][order[drop]] = float("-inf")
        if p.min_p > 0:
            probs = torch.softmax(filtered[i], -1)
            filtered[i][probs < p.min_p * probs.max()] = float("-inf")
    return filtered


def sample(
    logits_nv: torch.Tensor,
    params: list[SamplingParams],
    history: list[tuple[list[int], list[int]]],
    generator: torch.Generator,
    top_logprobs_num: list[int],
) -> StepOutput:
    """One token per row. history: (prompt ids, output ids so far) per row."""
    if any(p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty or p.logit_bias for p in params):
        logits_nv = logits_nv.clone()
        _penalize(logits_nv, params, history)
    temps = torch.tensor([1.0 if p.greedy else p.temperature for p in params])
    scaled = logits_nv / temps[:, None]
    # checked in the dtype they are computed in: a bias or a temperature that is finite as a
    # Python float can still overflow float32 here; that row fails alone, never the step
    # (a row's max is not finite when it holds NaN or +inf, or rules out every token: one pass)
    bad = ~torch.isfinite(scaled.amax(-1))
    errors: list[tuple[int, str] | None] | None = None
    if bool(bad.any()):
        why = "sampling produced non-finite logits (NaN or inf in float32): lower logit_bias or raise temperature"
        errors = [(400, why) if b else None for b in bad.tolist()]
        scaled = torch.where(bad[:, None], torch.zeros_like(scaled), scaled)
    logprobs_nv = torch.log_softmax(scaled, dim=-1)
    probs = torch.softmax(_restrict(scaled, params), dim=-1)
    sampled = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    for i, (p, (_, output)) in enumerate(zip(params, history, strict=True)):
        if p.sampling_seed is not None and not p.greedy:  # reproducible per request and position
            g = torch.Generator().manual_seed((p.sampling_seed * 1_000_003 + len(output)) % (2**63))
            sampled[i] = torch.multinomial(probs[i], 1, generator=g)[0]
    greedy = torch.tensor([p.greedy for p in params])
    tokens = torch.where(greedy, scaled.argmax(-1), sampled)
    chosen = logprobs_nv.gather(-1, tokens[:, None]).squeeze(1)
    top = [top_k(logprobs_nv[i], k) if k > 0 else None for i, k in enumerate(top_logprobs_num)]
    return StepOutput(tokens.tolist(), chosen.tolist(), top, [None] * len(params), errors)


def top_k(logprobs_v: torch.Tensor, k: int) -> list[tuple[float, int]]:
    values, ids = torch.topk(logprobs_v, min(k, logprobs_v.shape[-1]))
    return list(zip(values.tolist(), ids.tolist(), strict=True))


def prompt_logprobs(
    logits_tv: torch.Tensor, prompt: list[int], start: int, k: int
) -> tuple[list[float | None], list | None]:
    """SGLang's input_token_logprobs from `start`: one value per prompt token prompt[start:], the
    first always None (as SGLang reports it), then log p(prompt[j] | prompt[:j]) for j > start.
    With k > 0 also the top k per position: None first, then those of positions start..n-2."""
    n = len(prompt)
    logprobs_tv = torch.log_softmax(logits_tv[: n - 1].float(), dim=-1)
    targets = torch.tensor(prompt[1:], dtype=torch.long)
    values = logprobs_tv.gather(-1, targets[:, None]).squeeze(-1)[start:].tolist()
    top = [None] + [top_k(logprobs_tv[j], k) for j in range(start, n - 1)] if k > 0 else None
    return [None, *values], top
