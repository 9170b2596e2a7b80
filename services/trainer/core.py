"""The RL math of one training step, with no I/O: batch assembly, group-normalised advantages,
and the GRPO / PPO-clip loss with importance ratios against the engine's behaviour log-probs.

Token alignment: a sample's tokens are prompt + response; logits at position i predict token
i + 1, so response token j (at absolute position p + j, p = prompt length) is scored by the
logits at p + j - 1. `response_mask_bt` marks, in the shifted [B, T-1] grid, the positions that
score response tokens and are in the sample's loss mask.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec
import torch

from asyncrl_proto.messages import Sample, SampleStatus, flatten_group, scalar_reward
from services.model.llama import CausalLM, token_logprobs


def std_normalization(config) -> bool:
    """--grpo-std-normalization, forced off when n == 1 (a group of one has no spread)."""
    return bool(config.trainer.grpo_std_normalization and config.rollout.n_samples_per_prompt > 1)


def group_advantages(rewards: list[float], std_normalization: bool, eps: float = 1e-6) -> list[float]:
    """GRPO: (r - mean) / (std + eps) within one group (population std); std division is off
    when asked or when the group has one sample."""
    n = len(rewards)
    mean = sum(rewards) / n
    centered = [r - mean for r in rewards]
    if not std_normalization or n == 1:
        return centered
    std = math.sqrt(sum(c * c for c in centered) / n)
    return [c / (std + eps) for c in centered]


def assemble_batch(groups: list[list], n: int) -> list[list]:
    """Every group holds n trajectories; sort by the first sample's index."""
    for g in groups:
        if len(g) != n:
            raise ValueError(f"group {flatten_group(g)[0].group_index} has {len(g)} trajectories, expected {n}")
    return sorted(groups, key=lambda g: flatten_group(g)[0].index or 0)


def apply_sample_filter(fn, config, batch: list[list], path: str) -> None:
    """Run --rollout-sample-filter-path on the batch (a list of groups). It may only mark
    samples' remove_sample; the batch never shrinks and nothing else may change."""

    def snapshot():
        return [
            [msgspec.msgpack.encode(msgspec.structs.replace(s, remove_sample=False)) for s in flatten_group(g)]
            for g in batch
        ]

    before, size = snapshot(), len(batch)
    try:
        fn(config, batch)
    except Exception as e:
        raise ValueError(f"--rollout-sample-filter-path {path} raised {type(e).__name__}: {e}") from e
    if len(batch) != size or snapshot() != before:
        raise ValueError(f"--rollout-sample-filter-path {path} may only set remove_sample; it changed the batch")


@dataclass
class TrainBatch:
    input_ids_bt: torch.Tensor
    attention_mask_bt: torch.Tensor
    response_mask_bt: torch.Tensor  # [B, T-1], float
    rollout_logprobs_bt: torch.Tensor  # [B, T-1]
    advantages_b: torch.Tensor
    num_samples: int
    num_tokens: int
    old_logprobs_bt: torch.Tensor | None = None
    """The PPO ratio's denominator when computed by the trainer before the rollout's first
    optimizer step (several steps per rollout, or --keep-old-actor); None: see policy_loss."""


def samples_with_advantages(
    groups: list[list], std_normalization: bool, reward_key: str | None
) -> list[tuple[Sample, float]]:
    """Advantages are computed per group over every sample, removed ones included; removed
    samples then get a zero loss mask. FAILED samples (a reward function that raised, a generation
    that failed, a sample that failed validation) have no reward to compare: they are left out of
    the advantages and of the batch altogether."""
    out: list[tuple[Sample, float]] = []
    for g in groups:
        if flat := [s for s in flatten_group(g) if s.status != SampleStatus.FAILED]:
            advs = group_advantages([scalar_reward(s, reward_key) for s in flat], std_normalization)
            out += zip(flat, advs, strict=True)
    return out


def make_batch(items: list[tuple[Sample, float]], pad_id: int) -> TrainBatch:
    """Right-padded tensors for (sample, advantage) pairs."""
    width = max([2, *(len(s.tokens) for s, _ in items)])  # 2: a sample may have no tokens
    b = len(items)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    resp_mask = torch.zeros((b, width - 1))
    old_lp = torch.zeros((b, width - 1))
    for i, (s, _) in enumerate(items):
        length = len(s.tokens)
        ids[i, :length] = torch.tensor(s.tokens)
        attn[i, :length] = 1
        p = length - s.response_length
        if s.remove_sample or s.response_length == 0:
            continue
        mask = torch.ones(s.response_length) if s.loss_mask is None else torch.tensor(s.loss_mask, dtype=torch.float32)
        resp_mask[i, p - 1 : length - 1] = mask
        if s.rollout_log_probs:
            old_lp[i, p - 1 : length - 1] = torch.tensor(s.rollout_log_probs)
    return TrainBatch(
        input_ids_bt=ids,
        attention_mask_bt=attn,
        response_mask_bt=resp_mask,
        rollout_logprobs_bt=old_lp,
        advantages_b=torch.tensor([a for _, a in items], dtype=torch.float32),
        num_samples=b,
        num_tokens=int(resp_mask.sum().item()),
    )


def build_train_batch(groups: list[list], std_normalization: bool, reward_key: str | None, pad_id: int) -> TrainBatch:
    """The whole step as one padded batch."""
    return make_batch(samples_with_advantages(groups, std_normalization, reward_key), pad_id)


def micro_batches(items: list[tuple[Sample, float]], pad_id: int, max_tokens: int | None) -> list[TrainBatch]:
    """Micro-batches of similar lengths, each at most `max_tokens` padded tokens (one sample at
    least): with a long tail of lengths, padding every sample to the longest one would multiply
    the work. Same loss and gradient as one batch (see train_step)."""
    if not max_tokens:
        return [make_batch(items, pad_id)] if items else []
    chunks: list[list[tuple[Sample, float]]] = [[]]
    for it in sorted(items, key=lambda it: len(it[0].tokens)):  # the newcomer is the longest in its chunk
        if chunks[-1] and (len(chunks[-1]) + 1) * len(it[0].tokens) > max_tokens:
            chunks.append([])
        chunks[-1].append(it)
    return [make_batch(c, pad_id) for c in chunks if c]


def build_step_batches(
    groups: list[list],
    std_normalization: bool,
    reward_key: str | None,
    pad_id: int,
    max_tokens: int | None,
    num_steps: int,
) -> list[list[TrainBatch]]:
    """A rollout batch as `num_steps` optimizer steps, as Miles splits it (--num-steps-per-rollout,
    --global-batch-size): advantages over whole groups first, then the samples in order into
    num_steps consecutive global batches of (nearly) equal size, each cut into micro-batches."""
    items = samples_with_advantages(groups, std_normalization, reward_key)
    bounds = [len(items) * i // num_steps for i in range(num_steps + 1)]
    return [micro_batches(items[a:b], pad_id, max_tokens) for a, b in zip(bounds, bounds[1:], strict=False)]


@dataclass
class LossConfig:
    eps_clip: float = 0.2
    eps_clip_high: float | None = None
    entropy_coef: float = 0.0
    use_rollout_logprobs: bool = True
    use_tis: bool = False
    tis_clip: float = 2.0
    tis_clip_low: float = 0.0
    tis_mode: str = "truncate"
    kl_coef: float = 0.0
    kl_loss_type: str = "low_var_kl"
    aggregation: str = "token"
    temperature: float = 1.0
    use_decoupled_ppo: bool = False
    decoupled_weight_cap: float = 5.0


def token_entropy(logits_tv: torch.Tensor, temperature: float) -> torch.Tensor:
    """The policy's entropy at each position (over the last dimension)."""
    logp = torch.log_softmax(logits_tv.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


def missing_logprobs(sample: Sample, cfg: LossConfig) -> str | None:
    """Why a sample cannot be trained under `cfg`: it has response tokens but no engine log-probs,
    which the ratio (--use-rollout-logprobs), TIS or decoupled PPO's behaviour weight need (as
    zeros they would read as certainty). None when it can."""
    needs = [flag for flag, on in (("--use-rollout-logprobs", cfg.use_rollout_logprobs), ("--use-tis", cfg.use_tis),
                                   ("--use-decoupled-ppo", cfg.use_decoupled_ppo)) if on]  # fmt: skip
    if needs and sample.response_length and not sample.rollout_log_probs:
        return f"no engine log-probs, which {' and '.join(needs)} need"
    return None


def kl_per_token(logp_bt: torch.Tensor, ref_logp_bt: torch.Tensor, kind: str) -> torch.Tensor:
    """KL(policy || reference) estimators on sampled tokens: k1 = log r, k2 = (log r)^2 / 2,
    low_var_kl (k3) = exp(-log r) + log r - 1, with log r = logp - ref_logp."""
    log_r = logp_bt - ref_logp_bt
    if kind == "k1":
        return log_r
    if kind == "k2":
        return 0.5 * log_r**2
    if kind == "low_var_kl":
        return torch.exp(-log_r) + log_r - 1.0
    raise ValueError(f"--kl-loss-type {kind!r}: use k1, k2 or low_var_kl")


def _aggregate(per_token_bt: torch.Tensor, mask: torch.Tensor, how: str, denom: float) -> torch.Tensor:
    """token: sum over loss tokens / denom (tokens of the step); sequence: sum over sequences of
    each one's token mean / denom (sequences of the step)."""
    if how == "token":
        return (per_token_bt * mask).sum() / denom
    seq_tokens = mask.sum(1)
    per_seq = (per_token_bt * mask).sum(1) / seq_tokens.clamp(min=1.0)
    return per_seq[seq_tokens > 0].sum() / denom


def policy_loss(
    model: CausalLM,
    batch: TrainBatch,
    cfg: LossConfig,
    denom: float | None = None,
    ref_logp_bt: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """GRPO / PPO-clip on token log-probs.

    ratio = exp(logp - old), old = the engine's behaviour log-probs (--use-rollout-logprobs) or
    the trainer's own (then the ratio is 1 and --use-tis corrects the engine/trainer mismatch
    with exp(logp_trainer - logp_engine) clipped to [tis_clip_low, tis_clip], or with --tis-mode mask
    kept as is inside that range and 0 outside it: masked importance sampling, IcePop's);
    per token: max(-A ratio, -A clip(ratio, 1 - eps, 1 + eps_high)) [* tis]
               + kl_coef * KL(policy || reference) - entropy_coef * entropy;
    aggregated per token or per sequence over `denom` (default: this batch's tokens or sequences).

    Decoupled PPO (--use-decoupled-ppo, AReaL's): old = the proximal policy, the trainer's weights
    before the rollout's first optimizer step (`old_logprobs_bt`, or the model's own log-probs at
    that first step), so the clip bounds how far one rollout's steps move the policy; the
    behaviour policy (the engine's log-probs) enters only as the weight w = exp(prox - behav)
    on each token's term, and a token whose w exceeds --decoupled-ppo-weight-cap is left out
    (weight 0, still counted in the denominator).
    """
    logits_btv = model(batch.input_ids_bt, batch.attention_mask_bt)[:, :-1]
    targets_bt = batch.input_ids_bt[:, 1:]
    logp_bt = token_logprobs(logits_btv, targets_bt, cfg.temperature)
    mask = batch.response_mask_bt
    own = mask.sum().clamp(min=1.0)
    if denom is None:
        denom = own.item() if cfg.aggregation == "token" else float((mask.sum(1) > 0).sum().clamp(min=1).item())
    if batch.old_logprobs_bt is not None:
        old_bt = batch.old_logprobs_bt
    elif cfg.use_decoupled_ppo:
        old_bt = logp_bt.detach()  # the proximal policy is the model itself at a rollout's first step
    else:
        old_bt = batch.rollout_logprobs_bt if cfg.use_rollout_logprobs else logp_bt.detach()
    log_ratio = (logp_bt - old_bt) * mask
    ratio = torch.exp(log_ratio)
    adv_bt = batch.advantages_b[:, None].expand_as(ratio)
    hi = cfg.eps_clip_high if cfg.eps_clip_high is not None else cfg.eps_clip
    pg1 = -adv_bt * ratio
    pg2 = -adv_bt * ratio.clamp(1.0 - cfg.eps_clip, 1.0 + hi)
    pg_bt = torch.maximum(pg1, pg2)
    stats: dict[str, float] = {}
    if cfg.use_decoupled_ppo:
        behave_bt = torch.exp(old_bt - batch.rollout_logprobs_bt) * mask  # proximal / behaviour, a constant
        kept = (behave_bt <= cfg.decoupled_weight_cap).float() * mask
        pg_bt = torch.where(kept > 0, pg_bt * behave_bt, torch.zeros_like(pg_bt))  # never inf * 0
        stats["train/behave_imp_weight_mean"] = ((behave_bt * kept).sum() / kept.sum().clamp(min=1.0)).item()
        stats["train/behave_imp_weight_capped_frac"] = ((mask - kept).sum() / own).item()
    if cfg.use_tis:
        weight_bt = torch.exp(logp_bt.detach() - batch.rollout_logprobs_bt)
        if cfg.tis_mode == "mask":  # outside [low, high] a token is left out, inside it keeps its weight
            outside = ((weight_bt < cfg.tis_clip_low) | (weight_bt > cfg.tis_clip)).float() * mask
            tis_bt = torch.where(outside > 0, torch.zeros_like(weight_bt), weight_bt)
            stats["train/tis_clipfrac"] = (outside.sum() / own).item()
        else:
            tis_bt = weight_bt.clamp(cfg.tis_clip_low, cfg.tis_clip)
            stats["train/tis_clipfrac"] = (((tis_bt >= cfg.tis_clip).float() * mask).sum() / own).item()
        pg_bt = torch.where(tis_bt > 0, pg_bt * tis_bt, torch.zeros_like(pg_bt))  # never inf * 0
        stats["train/tis_mean"] = ((tis_bt * mask).sum() / own).item()
    loss = _aggregate(pg_bt, mask, cfg.aggregation, denom)
    stats["train/pg_loss"] = loss.item()
    if cfg.kl_coef:
        if ref_logp_bt is None:
            raise ValueError("--kl-coef needs the reference model's log-probs")
        kl_bt = kl_per_token(logp_bt, ref_logp_bt, cfg.kl_loss_type)
        kl = _aggregate(kl_bt, mask, cfg.aggregation, denom)
        loss = loss + cfg.kl_coef * kl
        stats["train/kl_loss"] = kl.item()
    if cfg.entropy_coef:
        entropy_bt = token_entropy(logits_btv, cfg.temperature)
        loss = loss - cfg.entropy_coef * _aggregate(entropy_bt, mask, cfg.aggregation, denom)
    else:  # logged always: a collapsing entropy tells a stall apart
        with torch.no_grad():
            entropy_bt = torch.stack([token_entropy(row, cfg.temperature) for row in logits_btv])  # a row at a time
    stats["train/entropy"] = ((entropy_bt.detach() * mask).sum() / own).item()
    with torch.no_grad():
        ratios = ratio[mask > 0]
        stats.update({
            "train/pg_clipfrac": (((pg2 > pg1).float() * mask).sum() / own).item(),
            "train/ppo_kl": ((-log_ratio) * mask).sum().item() / own.item(),
            "train/train_rollout_logprob_abs_diff": (((logp_bt - batch.rollout_logprobs_bt).abs() * mask).sum() / own).item(),
            "train/importance_ratio_mean": ratios.mean().item() if ratios.numel() else 1.0,
            "train/importance_ratio_max": ratios.max().item() if ratios.numel() else 1.0,
            "train/importance_ratio_min": ratios.min().item() if ratios.numel() else 1.0,
            "train/advantage_abs_mean": ((adv_bt.abs() * mask).sum() / own).item(),
        })  # fmt: skip
    stats["train/loss"] = loss.item()
    return loss, stats


SKIPPED = {"train/grad_norm": 0.0, "train/num_micro_batches": 0, "train/num_loss_tokens": 0, "train/skipped": 1.0}
"""The stats of a step with no loss token (every group FAILED): no update."""


def step_denominator(batches: list[TrainBatch], aggregation: str) -> float:
    if aggregation == "token":
        return float(sum(b.num_tokens for b in batches))
    return float(sum(int((b.response_mask_bt.sum(1) > 0).sum()) for b in batches))


def accumulate_gradients(
    model: CausalLM, batches: list[TrainBatch], cfg: LossConfig, denom: float, ref_model: CausalLM | None = None
) -> list[tuple[dict[str, float], int]]:
    """Backward on each micro-batch, the loss divided by the step's `denom`; returns (stats,
    loss tokens) per micro-batch for `merge_stats`."""
    parts = []
    for b in batches:
        ref = None
        if cfg.kl_coef and ref_model is not None:
            with torch.no_grad():
                logits = ref_model(b.input_ids_bt, b.attention_mask_bt)[:, :-1]
                ref = token_logprobs(logits, b.input_ids_bt[:, 1:], cfg.temperature)
        loss, s = policy_loss(model, b, cfg, denom=denom, ref_logp_bt=ref)
        loss.backward()
        parts.append((s, b.num_tokens))
    return parts


def merge_stats(parts: list[tuple[dict[str, float], int]]) -> dict[str, float]:
    """Per-micro-batch stats -> the step's: losses add up (each is already divided by the
    step's denominator), extremes take the extreme, the rest are token-weighted means."""
    total = sum(n for _, n in parts)
    stats: dict[str, float] = {}
    for s, n in parts:
        w = n / max(total, 1)
        for k, v in s.items():
            if k in ("train/loss", "train/pg_loss", "train/kl_loss"):
                stats[k] = stats.get(k, 0.0) + v
            elif k.endswith("_max"):
                stats[k] = max(stats.get(k, v), v)
            elif k.endswith("_min"):
                stats[k] = min(stats.get(k, v), v)
            else:
                stats[k] = stats.get(k, 0.0) + w * v
    return stats


def grad_norm(grads: list[torch.Tensor]) -> float:
    """The global L2 norm of `grads` (0 for none)."""
    norms = [torch.linalg.vector_norm(g.detach()) for g in grads]
    return float(torch.linalg.vector_norm(torch.stack(norms))) if norms else 0.0


def apply_update(model: CausalLM, optimizer: torch.optim.Optimizer, clip_grad: float, loss: float = 0.0) -> float:
    """Clip (when clip_grad > 0), step; returns the gradient norm before clipping. A loss or a
    gradient that is not finite is never applied: the step is skipped (weights and optimizer
    untouched) and the norm returned as is (NaN for a non-finite loss), for the caller to report."""
    norm = grad_norm([p.grad for p in model.parameters() if p.grad is not None]) if math.isfinite(loss) else math.nan
    if not math.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        return norm
    if clip_grad > 0:
        torch.nn.utils.clip_grad_norm_(model.parameters(), clip_grad)
    optimizer.step()
    return norm


def finish_stats(stats: dict[str, float], norm: float, parts: list[tuple[dict[str, float], int]]) -> dict[str, float]:
    """The step's stats with its gradient norm; `train/nonfinite_skipped` 1 (and the non-finite
    values left out, JSON has no NaN) when the loss or the gradient was not finite; then the
    counts of the micro-batches and loss tokens of `parts` (accumulate_gradients')."""
    bad = not math.isfinite(norm) or not all(math.isfinite(v) for v in stats.values())
    out = {k: v for k, v in stats.items() if math.isfinite(v)}
    if math.isfinite(norm):
        out["train/grad_norm"] = norm
    return out | {"train/nonfinite_skipped": float(bad), "train/num_micro_batches": len(parts),
                  "train/num_loss_tokens": sum(n for _, n in parts)}  # fmt: skip


def set_old_logprobs(model: CausalLM, step_batches: list[list[TrainBatch]], temperature: float) -> None:
    """Every batch's PPO denominator from `model`, before any optimizer step of the rollout."""
    with torch.no_grad():
        for b in (b for batches in step_batches for b in batches):
            logits_btv = model(b.input_ids_bt, b.attention_mask_bt)[:, :-1]
            b.old_logprobs_bt = token_logprobs(logits_btv, b.input_ids_bt[:, 1:], temperature)


def train_rollout(
    model: CausalLM,
    optimizer: torch.optim.Optimizer,
    step_batches: list[list[TrainBatch]],
    cfg: LossConfig,
    clip_grad: float,
    ref_model: CausalLM | None = None,
    old_actor: CausalLM | None = None,
) -> dict[str, float]:
    """One optimizer step per global batch of the rollout; the stats are their means (counts
    add up, a skipped update in any of them is reported), plus train/num_optimizer_steps.
    Without the engine's log-probs (--no-use-rollout-logprobs) the ratio's denominator is the
    trainer's: `old_actor`'s (--keep-old-actor: the weights the engines ran), else the model's
    own before the first step (with one step per rollout, a ratio of 1)."""
    if cfg.use_decoupled_ppo:  # the proximal policy: the weights before this rollout's first step
        if len(step_batches) > 1:
            set_old_logprobs(model, step_batches, cfg.temperature)
    elif not cfg.use_rollout_logprobs and (old_actor is not None or len(step_batches) > 1):
        set_old_logprobs(old_actor or model, step_batches, cfg.temperature)
    parts = [train_step(model, optimizer, b, cfg, clip_grad, ref_model) for b in step_batches]
    if len(parts) == 1:
        return parts[0]
    stats: dict[str, float] = {}
    for key in {k for p in parts for k in p}:
        values = [p[key] for p in parts if key in p]
        if key in ("train/num_micro_batches", "train/num_loss_tokens"):
            stats[key] = float(sum(values))
        elif key in ("train/nonfinite_skipped", "train/skipped") or key.endswith("_max"):
            stats[key] = max(values)
        elif key.endswith("_min"):
            stats[key] = min(values)
        else:
            stats[key] = sum(values) / len(values)
    stats["train/num_optimizer_steps"] = float(len(parts))
    return stats


def train_step(
    model: CausalLM,
    optimizer: torch.optim.Optimizer,
    batches: TrainBatch | list[TrainBatch],
    cfg: LossConfig,
    clip_grad: float,
    ref_model: CausalLM | None = None,
) -> dict[str, float]:
    """One optimizer step over the micro-batches of a training step, the loss normalised by
    the whole step's tokens (or sequences) so that the gradient equals that of one big batch."""
    batches = batches if isinstance(batches, list) else [batches]
    model.train()
    optimizer.zero_grad(set_to_none=True)
    denom = step_denominator(batches, cfg.aggregation)
    if denom == 0:  # nothing to learn from (every group FAILED): no update, not a 0/0
        return dict(SKIPPED)
    parts = accumulate_gradients(model, batches, cfg, denom, ref_model)
    stats = merge_stats(parts)
    return finish_stats(stats, apply_update(model, optimizer, clip_grad, stats.get("train/loss", 0.0)), parts)
