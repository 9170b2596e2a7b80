"""The RL math: advantages, token alignment and the PPO-clip loss, checked by hand."""

from __future__ import annotations

import math

import pytest
import torch

from services.api import Sample
from services.model.llama import CausalLM, ModelConfig, token_logprobs
from services.trainer.core import (
    LossConfig,
    assemble_batch,
    build_train_batch,
    group_advantages,
    policy_loss,
)


def test_group_advantages_by_hand():
    adv = group_advantages([1.0, 0.0, 0.0, 1.0], std_normalization=True)
    assert adv == pytest.approx([1.0, -1.0, -1.0, 1.0], abs=1e-5)  # mean 0.5, std 0.5
    assert group_advantages([1.0, 0.0], std_normalization=False) == [0.5, -0.5]
    assert group_advantages([0.3], std_normalization=True) == [0.0]
    assert group_advantages([2.0, 2.0], std_normalization=True) == [0.0, 0.0]


def test_batch_assembly_checks_n_and_sorts_by_index():
    g1 = [Sample(index=4), Sample(index=5)]
    g0 = [Sample(index=0), Sample(index=1)]
    assert assemble_batch([g1, g0], n=2) == [g0, g1]
    with pytest.raises(ValueError, match="expected 2"):
        assemble_batch([[Sample(index=0)]], n=2)


def tiny_model(seed=0) -> CausalLM:
    torch.manual_seed(seed)
    m = CausalLM(ModelConfig(vocab_size=7, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=16))  # fmt: skip
    m.init_weights(seed, std=0.5)
    return m


def test_alignment_masks_and_removed_samples():
    a = Sample(
        index=0,
        tokens=[1, 2, 3, 4, 5],
        response_length=2,
        reward=1.0,
        rollout_log_probs=[-1.0, -2.0],
    )
    b = Sample(
        index=1,
        tokens=[1, 2, 3],
        response_length=1,
        reward=0.0,
        rollout_log_probs=[-3.0],
        remove_sample=True,
    )
    batch = build_train_batch([[a, b]], std_normalization=True, reward_key=None, pad_id=0)
    assert batch.input_ids_bt.tolist() == [[1, 2, 3, 4, 5], [1, 2, 3, 0, 0]]
    # response tokens 4, 5 are predicted at shifted positions 2, 3
    assert batch.response_mask_bt.tolist() == [[0, 0, 1, 1], [0, 0, 0, 0]]
    assert batch.rollout_logprobs_bt[0].tolist() == [0, 0, -1.0, -2.0]
    # the removed sample still counts in the group normalisation
    assert batch.advantages_b.tolist() == pytest.approx([1.0, -1.0], abs=1e-5)


def test_ppo_clip_loss_matches_a_hand_computation():
    model = tiny_model()
    a = Sample(
        index=0,
        tokens=[1, 2, 3, 4, 5],
        response_length=2,
        reward=1.0,
        rollout_log_probs=[-1.2, -2.5],
    )
    b = Sample(index=1, tokens=[1, 2, 6, 3], response_length=1, reward=0.0, rollout_log_probs=[-0.4])
    batch = build_train_batch([[a, b]], std_normalization=True, reward_key=None, pad_id=0)
    cfg = LossConfig(eps_clip=0.2, eps_clip_high=0.3)
    loss, stats = policy_loss(model, batch, cfg)

    # by hand: log p(token) from an unbatched forward pass, then the PPO-clip formula per token
    terms, clipped = [], 0
    for s, adv in ((a, 1.0), (b, -1.0)):
        with torch.no_grad():
            logits = model(torch.tensor([s.tokens]))[0]
        p = len(s.tokens) - s.response_length
        for j in range(s.response_length):
            row = logits[p + j - 1].tolist()
            lse = math.log(sum(math.exp(x) for x in row))
            logp = row[s.tokens[p + j]] - lse
            ratio = math.exp(logp - s.rollout_log_probs[j])
            unclipped, clip = -adv * ratio, -adv * min(max(ratio, 0.8), 1.3)
            terms.append(max(unclipped, clip))
            clipped += clip > unclipped
    assert loss.item() == pytest.approx(sum(terms) / len(terms), rel=1e-5)
    assert stats["train/pg_clipfrac"] == pytest.approx(clipped / len(terms))


def test_on_policy_ratios_are_one():
    model = tiny_model(1)
    s = Sample(index=0, tokens=[1, 2, 3, 4], response_length=2, reward=1.0)
    with torch.no_grad():
        logits = model(torch.tensor([s.tokens]))[0]
        lp = torch.log_softmax(logits, -1)
    s.rollout_log_probs = [lp[1, 3].item(), lp[2, 4].item()]
    t = Sample(index=1, tokens=[1, 2, 3, 5], response_length=2, reward=0.0)
    with torch.no_grad():
        lp2 = torch.log_softmax(model(torch.tensor([t.tokens]))[0], -1)
    t.rollout_log_probs = [lp2[1, 3].item(), lp2[2, 5].item()]
    batch = build_train_batch([[s, t]], True, None, 0)
    _, stats = policy_loss(model, batch, LossConfig())
    assert stats["train/importance_ratio_mean"] == pytest.approx(1.0, abs=1e-5)
    assert stats["train/train_rollout_logprob_abs_diff"] < 1e-5
    assert stats["train/pg_clipfrac"] == 0.0


def test_rollout_sample_filter_may_only_mark_remove_sample():
    from services.trainer.core import apply_sample_filter

    batch = [[Sample(index=0, reward=1.0), Sample(index=1, reward=0.0)], [Sample(index=2), Sample(index=3)]]

    def drop_zero_reward(config, b):
        for g in b:
            for s in g:
                s.remove_sample = s.reward == 0.0

    apply_sample_filter(drop_zero_reward, None, batch, "m.drop_zero_reward")
    assert [s.remove_sample for g in batch for s in g] == [False, True, False, False]

    def shrink(config, b):
        b.pop()

    with pytest.raises(ValueError, match="may only set remove_sample"):
        apply_sample_filter(shrink, None, batch, "m.shrink")

    def edit(config, b):
        b[0][0].reward = 5.0

    with pytest.raises(ValueError, match="m.edit may only set remove_sample"):
        apply_sample_filter(edit, None, batch, "m.edit")

    def boom(config, b):
        raise KeyError("x")

    with pytest.raises(ValueError, match="m.boom raised KeyError"):
        apply_sample_filter(boom, None, batch, "m.boom")


def test_micro_batches_give_the_same_gradient_as_one_batch():
    from services.trainer.core import build_step_batches, train_step

    torch.manual_seed(0)
    groups = []
    for g in range(3):
        grp = []
        for i in range(4):
            plen, rlen = 2 + (i % 2), 1 + (g * 4 + i) % 5
            toks = torch.randint(1, 7, (plen + rlen,)).tolist()
            grp.append(Sample(index=g * 4 + i, tokens=toks, response_length=rlen, reward=float((g + i) % 3),
                              rollout_log_probs=[-1.0] * rlen))  # fmt: skip
        groups.append(grp)
    grads, stats = [], []
    for max_tokens in (None, 12):
        model = tiny_model(3)
        opt = torch.optim.SGD(model.parameters(), lr=0.0)
        (batches,) = build_step_batches(groups, True, None, 0, max_tokens, num_steps=1)
        stats.append(train_step(model, opt, batches, LossConfig(entropy_coef=0.01), clip_grad=0.0))
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    assert stats[0]["train/num_micro_batches"] == 1 and stats[1]["train/num_micro_batches"] > 1
    assert (grads[0] - grads[1]).abs().max().item() < 1e-6
    for k in ("train/loss", "train/pg_clipfrac", "train/entropy", "train/importance_ratio_max"):
        assert stats[0][k] == pytest.approx(stats[1][k], abs=1e-6), k


def _hand_logps(model, samples):
    """Per sample, the log-probs of its response tokens from an unbatched forward pass, plus
    the per-token entropies, computed with plain Python floats."""
    out = []
    for s in samples:
        with torch.no_grad():
            logits = model(torch.tensor([s.tokens]))[0]
        p = len(s.tokens) - s.response_length
        rows = [logits[p + j - 1].tolist() for j in range(s.response_length)]
        lps, ents = [], []
        for j, row in enumerate(rows):
            lse = math.log(sum(math.exp(x) for x in row))
            lps.append(row[s.tokens[p + j]] - lse)
            ents.append(-sum(math.exp(x - lse) * (x - lse) for x in row))
        out.append((lps, ents))
    return out


def _two_samples():
    a = Sample(index=0, tokens=[1, 2, 3, 4, 5], response_length=2, reward=1.0, rollout_log_probs=[-1.2, -2.5])
    b = Sample(index=1, tokens=[1, 2, 6, 3], response_length=1, reward=0.0, rollout_log_probs=[-0.4])
    return a, b


@pytest.mark.parametrize("kind", ["k1", "k2", "low_var_kl"])
def test_kl_entropy_tis_and_aggregation_by_hand(kind):
    model, ref = tiny_model(0), tiny_model(5)
    a, b = _two_samples()
    batch = build_train_batch([[a, b]], std_normalization=True, reward_key=None, pad_id=0)
    cfg = LossConfig(use_rollout_logprobs=False, use_tis=True, tis_clip=1.5, tis_clip_low=0.1, kl_coef=0.3,
                     kl_loss_type=kind, entropy_coef=0.05, aggregation="sequence")  # fmt: skip
    with torch.no_grad():
        ref_lp = token_logprobs(ref(batch.input_ids_bt)[:, :-1], batch.input_ids_bt[:, 1:])
    loss, stats = policy_loss(model, batch, cfg, ref_logp_bt=ref_lp)

    kl = {"k1": lambda r: r, "k2": lambda r: 0.5 * r * r, "low_var_kl": lambda r: math.exp(-r) + r - 1}[kind]
    per_seq = []
    for (lps, ents), (rlps, _), s, adv in zip(
        _hand_logps(model, [a, b]), _hand_logps(ref, [a, b]), (a, b), (1.0, -1.0), strict=False
    ):
        terms = []
        for lp, ent, rlp, beh in zip(lps, ents, rlps, s.rollout_log_probs, strict=False):
            pg = -adv * 1.0  # the trainer's own old log-probs: ratio 1, nothing clipped
            tis = min(max(math.exp(lp - beh), 0.1), 1.5)
            terms.append(pg * tis + 0.3 * kl(lp - rlp) - 0.05 * ent)
        per_seq.append(sum(terms) / len(terms))
    assert loss.item() == pytest.approx(sum(per_seq) / 2, rel=1e-5)
    tis_all = [min(max(math.exp(lp - beh), 0.1), 1.5) for (lps, _), s in zip(_hand_logps(model, [a, b]), (a, b), strict=False)
               for lp, beh in zip(lps, s.rollout_log_probs, strict=False)]  # fmt: skip
    assert stats["train/tis_mean"] == pytest.approx(sum(tis_all) / 3, rel=1e-5)


def test_masked_importance_sampling_leaves_out_tokens_outside_the_range_by_hand():
    """--tis-mode mask: a token whose weight exp(logp - logp_engine) lies outside [low, high] is
    left out of the loss (still counted in the denominator); inside, it keeps its weight unclipped."""
    model = tiny_model(4)
    a, b = _two_samples()
    batch = build_train_batch([[a, b]], std_normalization=True, reward_key=None, pad_id=0)
    hand = [(lp, beh, adv) for (lps, _), s, adv in zip(_hand_logps(model, [a, b]), (a, b), (1.0, -1.0), strict=True)
            for lp, beh in zip(lps, s.rollout_log_probs, strict=True)]  # fmt: skip
    weights = sorted(math.exp(lp - beh) for lp, beh, _ in hand)
    low, high = (weights[0] + weights[1]) / 2, (weights[1] + weights[2]) / 2  # only the middle weight is inside
    for mode in ("mask", "truncate"):
        cfg = LossConfig(use_rollout_logprobs=False, use_tis=True, tis_clip=high, tis_clip_low=low, tis_mode=mode)
        loss, stats = policy_loss(model, batch, cfg)
        if mode == "mask":
            kept = [(-adv * math.exp(lp - beh), math.exp(lp - beh)) for lp, beh, adv in hand if low <= math.exp(lp - beh) <= high]
            assert len(kept) == 1 and stats["train/tis_clipfrac"] == pytest.approx(2 / 3)
            assert loss.item() == pytest.approx(kept[0][0] / 3, rel=1e-5)
            assert stats["train/tis_mean"] == pytest.approx(kept[0][1] / 3, rel=1e-5)
        else:  # the same range clips instead: every token counts
            terms = [-adv * min(max(math.exp(lp - beh), low), high) for lp, beh, adv in hand]
            assert loss.item() == pytest.approx(sum(terms) / 3, rel=1e-5)


def test_token_aggregation_weights_long_sequences_more():
    model = tiny_model(2)
    a, b = _two_samples()
    batch = build_train_batch([[a, b]], True, None, 0)
    (lps_a, _), (lps_b, _) = _hand_logps(model, [a, b])
    terms = [-1.0 * math.exp(lp - beh) for lp, beh in zip(lps_a, a.rollout_log_probs, strict=False)]
    terms += [1.0 * math.exp(lp - beh) for lp, beh in zip(lps_b, b.rollout_log_probs, strict=False)]
    cfg = LossConfig(eps_clip=10.0)  # no clipping: the plain importance-weighted policy gradient
    tok, _ = policy_loss(model, batch, cfg)
    seq, _ = policy_loss(model, batch, LossConfig(eps_clip=10.0, aggregation="sequence"))
    assert tok.item() == pytest.approx(sum(terms) / 3, rel=1e-5)
    assert seq.item() == pytest.approx((sum(terms[:2]) / 2 + terms[2]) / 2, rel=1e-5)


def test_a_failed_group_trains_nothing_and_breaks_nothing():
    """FAILED samples (the producer gave up, a reward raised) have no reward to compare: they are
    left out of the advantages and of the batch; the other group's batch is unchanged."""
    from asyncrl_proto import SampleStatus

    failed = [Sample(index=i, group_index=0, status=SampleStatus.FAILED) for i in range(2)]
    ok = [Sample(index=2 + i, group_index=1, tokens=[1, 5, 6], response_length=1, reward=float(i),
                 rollout_log_probs=[-1.0]) for i in range(2)]  # fmt: skip
    only_failed = build_train_batch([failed], True, None, 0)
    assert only_failed.num_tokens == 0 and only_failed.num_samples == 0
    both = build_train_batch([failed, ok], True, None, 0)
    assert both.num_tokens == 2 and both.num_samples == 2
    assert both.advantages_b.tolist() == build_train_batch([ok], True, None, 0).advantages_b.tolist()
    # a half-failed group: its advantages come from the samples that have a reward
    half = [failed[0], *ok]
    assert build_train_batch([half], True, None, 0).advantages_b.tolist() == both.advantages_b.tolist()
    # a step of FAILED groups only: no update at all (not a 0/0 that turns the weights into NaN)
    from services.trainer.core import train_step

    model = tiny_model()
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    for aggregation in ("token", "sequence"):
        stats = train_step(model, opt, only_failed, LossConfig(aggregation=aggregation), clip_grad=1.0)
        assert stats["train/skipped"] == 1.0
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_dict_rewards_need_a_reward_key():
    from asyncrl_proto.messages import scalar_reward

    s = Sample(reward={"acc": 1.0, "format": 0.5})
    assert scalar_reward(s, "format") == 0.5
    with pytest.raises(ValueError, match="--reward-key"):
        scalar_reward(s, None)
    assert scalar_reward(Sample(reward=None), None) == 0.0


def test_latest_checkpoint_follows_the_latest_file(tmp_path):
    from services.common.snapshot import COMPLETE_MARKER
    from services.trainer.checkpoint import LATEST, latest_checkpoint

    for step in (3, 7):
        d = tmp_path / f"iter_{step:07d}"
        d.mkdir()
        (d / COMPLETE_MARKER).write_text("{}")
    assert latest_checkpoint(tmp_path) == tmp_path / "iter_0000007"  # no LATEST file: the newest complete
    (tmp_path / LATEST).write_text("3")  # e.g. --load of a run whose later save is not its choice
    assert latest_checkpoint(tmp_path) == tmp_path / "iter_0000003"
    (tmp_path / LATEST).write_text("9")  # names a checkpoint that is not complete: fall back
    assert latest_checkpoint(tmp_path) == tmp_path / "iter_0000007"


def test_a_non_finite_loss_or_gradient_never_reaches_the_weights(tmp_path):
    """A NaN that got into a batch (here a behaviour log-prob) makes the loss NaN: the update is
    skipped, the weights and the optimizer stay as they were, the stats say so in valid JSON."""
    import json
    import math

    from services.model.hf_io import NonFiniteWeights, save_model
    from services.trainer.core import train_step

    model = tiny_model()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    good = [Sample(index=i, group_index=0, tokens=[1, 5, 6], response_length=1, reward=float(i),
                   rollout_log_probs=[-1.0]) for i in range(2)]  # fmt: skip
    train_step(model, opt, build_train_batch([good], True, None, 0), LossConfig(), clip_grad=1.0)  # optimizer state
    before = [p.detach().clone() for p in model.parameters()]
    state_before = {k: v.clone() for k, v in opt.state[next(iter(model.parameters()))].items() if torch.is_tensor(v)}
    poisoned = [Sample(index=i, group_index=0, tokens=[1, 5, 6], response_length=1, reward=float(i),
                       rollout_log_probs=[math.nan]) for i in range(2)]  # fmt: skip
    stats = train_step(model, opt, build_train_batch([poisoned], True, None, 0), LossConfig(), clip_grad=1.0)
    assert stats["train/nonfinite_skipped"] == 1.0 and "train/loss" not in stats
    json.loads(json.dumps(stats, allow_nan=False))  # no NaN in the record
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    after = opt.state[next(iter(model.parameters()))]
    assert all(torch.equal(v, after[k]) for k, v in state_before.items())
    with torch.no_grad():
        next(iter(model.parameters()))[0, 0] = math.inf
    with pytest.raises(NonFiniteWeights, match="non-finite"):
        save_model(model, tmp_path / "v9")
    assert not (tmp_path / "v9").exists()  # nothing written


def test_several_optimizer_steps_per_rollout_as_miles_splits_it():
    """--num-steps-per-rollout K: advantages over whole groups, then the samples in order into K
    global batches, one optimizer step each: the same weights as K train_steps by hand."""
    from services.common.config import RunConfig
    from services.trainer.core import (
        LossConfig,
        build_step_batches,
        micro_batches,
        samples_with_advantages,
        train_rollout,
        train_step,
    )
    from tests.unit.test_data_parallel import make_groups

    groups, cfg = make_groups(), LossConfig()
    steps = build_step_batches(groups, True, None, 0, 12, 2)
    assert len(steps) == 2 and sum(b.num_samples for s in steps for b in s) == 12
    a = tiny_model(0)
    opt_a = torch.optim.AdamW(a.parameters(), lr=1e-2)
    stats = train_rollout(a, opt_a, steps, cfg, 1.0)
    assert stats["train/num_optimizer_steps"] == 2.0 and opt_a.state[next(a.parameters())]["step"] == 2
    b = tiny_model(0)
    opt_b = torch.optim.AdamW(b.parameters(), lr=1e-2)
    items = samples_with_advantages(groups, True, None)  # advantages over the whole groups, then halves
    for half in (items[:6], items[6:]):
        train_step(b, opt_b, micro_batches(half, 0, 12), cfg, 1.0)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))
    one = tiny_model(0)
    train_rollout(one, torch.optim.AdamW(one.parameters(), lr=1e-2), build_step_batches(groups, True, None, 0, 12, 1),
                  cfg, 1.0)  # fmt: skip
    assert not all(torch.equal(p, q) for p, q in zip(a.parameters(), one.parameters(), strict=True))
    # --global-batch-size is the same thing in samples per step
    assert RunConfig(rollout_batch_size=4, n_samples_per_prompt=4, global_batch_size=8).optimizer_steps_per_rollout == 2
    assert RunConfig(num_steps_per_rollout=3).optimizer_steps_per_rollout == 3
    assert RunConfig().optimizer_steps_per_rollout == 1


def test_the_ppo_denominator_without_the_engines_log_probs():
    """--no-use-rollout-logprobs: with one step per rollout the ratio is 1; with several, the
    ratio of the later steps is against the weights before the rollout's first step (as Miles
    recomputes log_probs once per rollout), not 1; --keep-old-actor takes it from the old actor."""
    from services.trainer.core import LossConfig, build_step_batches, train_rollout
    from tests.unit.test_data_parallel import make_groups

    cfg = LossConfig(use_rollout_logprobs=False)
    model = tiny_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-2)
    one = train_rollout(model, opt, build_step_batches(make_groups(), True, None, 0, 12, 1), cfg, 1.0)
    assert one["train/importance_ratio_min"] == one["train/importance_ratio_max"] == 1.0
    model = tiny_model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=5e-2)
    steps = build_step_batches(make_groups(), True, None, 0, 12, 2)
    two = train_rollout(model, opt, steps, cfg, 1.0)
    assert two["train/importance_ratio_max"] > 1.0 or two["train/importance_ratio_min"] < 1.0  # step 2 moved
    old = tiny_model(1)  # another policy: the weights the engines ran
    model = tiny_model(0)
    steps = build_step_batches(make_groups(), True, None, 0, 12, 1)
    kept = train_rollout(model, torch.optim.AdamW(model.parameters(), lr=5e-2), steps, cfg, 1.0, old_actor=old)
    assert kept["train/importance_ratio_max"] > 1.0 and kept["train/importance_ratio_min"] < 1.0  # one step, yet


def test_decoupled_ppo_terms_by_hand():
    """--use-decoupled-ppo: ratio against the proximal policy (clipped), times the behaviour
    weight exp(prox - behav) per token, a token whose weight passes the cap left out."""
    model, prox_model = tiny_model(0), tiny_model(7)
    a, b = _two_samples()
    a.rollout_log_probs = [-1.2, -9.0]  # the second token: a behaviour far below the proximal -> capped
    batch = build_train_batch([[a, b]], std_normalization=True, reward_key=None, pad_id=0)
    with torch.no_grad():
        batch.old_logprobs_bt = token_logprobs(prox_model(batch.input_ids_bt)[:, :-1], batch.input_ids_bt[:, 1:])
    cap = 5.0
    cfg = LossConfig(use_decoupled_ppo=True, decoupled_weight_cap=cap, eps_clip=0.2)
    loss, stats = policy_loss(model, batch, cfg)

    terms, weights, capped = [], [], 0
    for (lps, _), (plps, _), s, adv in zip(_hand_logps(model, [a, b]), _hand_logps(prox_model, [a, b]), (a, b),
                                           (1.0, -1.0), strict=True):  # fmt: skip
        for lp, plp, beh in zip(lps, plps, s.rollout_log_probs, strict=True):
            ratio = math.exp(lp - plp)
            pg = max(-adv * ratio, -adv * min(max(ratio, 0.8), 1.2))
            w = math.exp(plp - beh)
            weights.append(w)
            capped += w > cap
            terms.append(pg * w if w <= cap else 0.0)
    assert capped == 1
    assert loss.item() == pytest.approx(sum(terms) / 3, rel=1e-5)
    kept = [w for w in weights if w <= cap]  # the mean is over the tokens kept (a capped weight may be inf)
    assert stats["train/behave_imp_weight_mean"] == pytest.approx(sum(kept) / len(kept), rel=1e-5)
    assert stats["train/behave_imp_weight_capped_frac"] == pytest.approx(1 / 3)


def test_decoupled_ppo_survives_a_behaviour_weight_that_overflows():
    a, b = _two_samples()
    a.rollout_log_probs = [-1.2, -1e4]  # finite, valid, and exp(prox - behav) overflows to inf
    batch = build_train_batch([[a, b]], std_normalization=True, reward_key=None, pad_id=0)
    loss, stats = policy_loss(tiny_model(0), batch, LossConfig(use_decoupled_ppo=True))
    assert math.isfinite(loss.item()) and stats["train/behave_imp_weight_capped_frac"] == pytest.approx(1 / 3)


def test_decoupled_ppo_first_step_is_the_behaviour_weighted_policy_gradient():
    """At a rollout's first step the proximal policy is the model itself: the ratio is 1, and the
    gradient is that of -A * w * log p with w = exp(logp - behav) held constant."""
    a, b = _two_samples()
    batch = build_train_batch([[a, b]], std_normalization=True, reward_key=None, pad_id=0)
    model = tiny_model(0)
    loss, stats = policy_loss(model, batch, LossConfig(use_decoupled_ppo=True, decoupled_weight_cap=1e9))
    loss.backward()
    got = [p.grad.clone() for p in model.parameters()]
    ref = tiny_model(0)
    logp = token_logprobs(ref(batch.input_ids_bt)[:, :-1], batch.input_ids_bt[:, 1:])
    w = torch.exp(logp.detach() - batch.rollout_logprobs_bt)
    mask = batch.response_mask_bt
    hand = (-(batch.advantages_b[:, None] * w * logp) * mask).sum() / mask.sum()
    hand.backward()
    assert loss.item() == pytest.approx(
        (-(batch.advantages_b[:, None] * w) * mask).sum().item() / mask.sum().item(), rel=1e-5
    )
    for g, p in zip(got, ref.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, atol=1e-6, rtol=1e-5)
    assert stats["train/pg_clipfrac"] == 0.0 and stats["train/importance_ratio_mean"] == pytest.approx(1.0)


def test_decoupled_ppo_takes_the_proximal_policy_before_the_rollouts_first_step():
    from services.trainer.core import build_step_batches, train_rollout
    from tests.unit.test_data_parallel import make_groups

    steps = build_step_batches(make_groups(), True, None, 0, 12, 2)
    model = tiny_model(0)
    before = tiny_model(0)
    train_rollout(model, torch.optim.AdamW(model.parameters(), lr=1e-2), steps,
                  LossConfig(use_decoupled_ppo=True), 1.0)  # fmt: skip
    for b in (b for s in steps for b in s):
        with torch.no_grad():
            want = token_logprobs(before(b.input_ids_bt, b.attention_mask_bt)[:, :-1], b.input_ids_bt[:, 1:])
        torch.testing.assert_close(b.old_logprobs_bt, want)


def test_entropy_and_advantage_magnitude_are_logged_without_an_entropy_bonus():
    model = tiny_model(0)
    a, b = _two_samples()
    batch = build_train_batch([[a, b]], std_normalization=True, reward_key=None, pad_id=0)
    _, stats = policy_loss(model, batch, LossConfig())
    ents = [e for _, es in _hand_logps(model, [a, b]) for e in es]
    assert stats["train/entropy"] == pytest.approx(sum(ents) / 3, rel=1e-5)
    assert stats["train/advantage_abs_mean"] == pytest.approx(1.0, rel=1e-5)  # +1, +1, -1 on the three tokens


def test_a_sample_without_engine_log_probs_is_refused_where_the_loss_needs_them():
    from services.trainer.core import missing_logprobs

    bare = Sample(index=0, tokens=[1, 2, 3, 4], response_length=2, reward=1.0)
    assert "--use-rollout-logprobs" in missing_logprobs(bare, LossConfig())
    assert "--use-decoupled-ppo" in missing_logprobs(
        bare, LossConfig(use_rollout_logprobs=False, use_decoupled_ppo=True)
    )
    assert missing_logprobs(bare, LossConfig(use_rollout_logprobs=False)) is None  # the trainer's own log-probs
    a, _ = _two_samples()
    assert missing_logprobs(a, LossConfig(use_tis=True)) is None
