"""What a trainable group is (services.common.validate), rule by rule, and the permission model
of the bus (services.common.natsauth) as data."""

from __future__ import annotations

import math

import pytest

from asyncrl_proto import Sample, SampleStatus
from services.common.natsauth import ROLES, role_permissions, server_auth_conf
from services.common.validate import Limits, group_problem, reward_problem, sample_problem

LIMITS = Limits(n=2, vocab_size=16, context_length=10, max_version=3)


def good(**kw) -> Sample:
    base = dict(index=0, group_index=0, tokens=[1, 5, 6, 2], response_length=2, rollout_log_probs=[-0.5, -1.0],
                reward=1.0, status=SampleStatus.COMPLETED, weight_versions=[2, 3])  # fmt: skip
    base.update(kw)
    return Sample(**base)


BAD_SAMPLES = [
    (dict(tokens=[1, 5, 16, 2]), "outside the vocabulary"),
    (dict(tokens=[1, -1, 6, 2]), "outside the vocabulary"),
    (dict(tokens=list(range(1, 12)), response_length=2), "exceed the context length"),
    (dict(response_length=4), "does not fit"),
    (dict(response_length=5), "does not fit"),
    (dict(rollout_log_probs=[-0.5]), "log-probs for 2 response tokens"),
    (dict(rollout_log_probs=[-0.5, math.nan]), "not finite or above 0"),
    (dict(rollout_log_probs=[-0.5, 3.0]), "not finite or above 0"),
    (dict(loss_mask=[1]), "loss_mask must hold 2 values"),
    (dict(loss_mask=[1, 7]), "loss_mask must hold 2 values"),
    (dict(reward=math.nan), "not a finite number"),
    (dict(reward=math.inf), "not a finite number"),
    (dict(reward=None), "not a finite number"),
    (dict(reward={"acc": math.nan}), "not a finite number"),
    (dict(weight_versions=[4]), "weight version 4 was never published"),
    (dict(weight_versions=[-1]), "weight version -1 was never published"),
    (dict(status=SampleStatus.PENDING), "PENDING"),
]


@pytest.mark.parametrize(("fields", "problem"), BAD_SAMPLES)
def test_a_sample_that_cannot_be_trained_on_is_named(fields, problem):
    assert sample_problem(good(), LIMITS) is None
    assert problem in sample_problem(good(**fields), LIMITS)


def test_failed_samples_need_no_tokens_only_a_finite_reward_or_none():
    assert sample_problem(Sample(status=SampleStatus.FAILED, tokens=[99]), LIMITS) is None
    assert sample_problem(Sample(status=SampleStatus.FAILED, reward=math.nan), LIMITS) is not None


def test_reward_rules():
    assert reward_problem(0.5, None) is None and reward_problem(1, None) is None
    assert "not a finite number" in reward_problem("0.5", None)
    assert "not a finite number" in reward_problem(True, None)
    assert "no 'acc' entry" in reward_problem({"f1": 1.0}, "acc")
    assert "empty dict" in reward_problem({}, None)


def test_group_identity_and_width():
    samples = [good(index=0), good(index=1)]
    assert group_problem("g0-a0", 0, 0, samples, LIMITS) is None
    assert "does not match" in group_problem("g1-a0", 0, 0, samples, LIMITS)
    assert "expected n=2" in group_problem("g0-a0", 0, 0, samples[:1], LIMITS)
    assert "names group_index 5" in group_problem("g0-a0", 0, 0, [good(), good(group_index=5)], LIMITS)
    assert "out of range" in group_problem("g-1-a0", -1, 0, samples, LIMITS)
    assert "sample 1: token id 99" in group_problem("g0-a0", 0, 0, [good(), good(index=1, tokens=[1, 2, 99])], LIMITS)


def test_only_the_buffer_writes_the_ledger_only_the_trainer_publishes_weights_progress_and_commits():
    s = "asyncrl.r."
    for role in ROLES[1:]:
        perms = role_permissions("r", role)
        pub = set(perms["publish"]["allow"])
        assert (s + "ledger" in pub) == (role == "buffer")
        for subject in ("weights.published", "progress", "buffer.commit", "buffer.get"):
            assert (s + subject in pub) == (role == "trainer"), (role, subject)
        assert (s + "weights.live" in pub) == (role == "weight-sync")
        assert (s + "rollouts" in pub) == (role == "rollout")
        assert (s + "prompts" in pub) == (role == "buffer")
        assert not any(p in (">", "$JS.API.>") or ".STREAM.CREATE." in p or ".STREAM.DELETE." in p for p in pub)
        assert set(perms["subscribe"]["allow"]) >= {f"_INBOX.r.{role}.>"}
        assert not any(
            x.startswith("_INBOX.") and not x.startswith(f"_INBOX.r.{role}.") for x in perms["subscribe"]["allow"]
        )
        # buffer.get; weights.transfer; adapters.control
        assert ("allow_responses" in perms) == (role in ("buffer", "trainer", "adapters"))
        assert (s + "weights.transfer" in pub) == (role == "weight-sync")  # only weight-sync asks for weights
        assert (s + "weights.transfer" in perms["subscribe"]["allow"]) == (role == "trainer")  # only it answers
    assert role_permissions("r", "admin")["publish"]["allow"] == [">"]


def test_the_auth_block_names_every_role_and_its_password():
    conf = server_auth_conf("r", {r: f"pw-{r}" for r in ROLES})
    assert all(f'user: "{r}", password: "pw-{r}"' in conf for r in ROLES)
    deploy = server_auth_conf("r")
    assert "password: $ASYNCRL_NATS_PASSWORD_WEIGHT_SYNC" in deploy


def test_a_huge_finite_reward_is_refused_where_it_enters_and_cannot_overflow_advantages():
    """A group whose rewards are all 1e308 used to pass: its advantages overflowed to NaN, the
    step's update was skipped, and metrics.jsonl recorded Infinity."""
    import math

    from services.common.sinks import finite_record
    from services.trainer.core import group_advantages

    assert "--max-abs-reward" in reward_problem(1e308, None)
    assert "--max-abs-reward" in reward_problem({"acc": -1e7}, "acc")
    assert reward_problem(1e6, None) is None and reward_problem(-5.0, None, max_abs=5.0) is None
    assert "outside [-5, 5]" in reward_problem(5.5, None, max_abs=5.0)
    # every reward the bound admits gives finite advantages, with or without std normalisation
    for rewards in ([1e6] * 8, [1e6, -1e6] * 4, [1e6] * 7 + [-1e6]):
        for std in (True, False):
            assert all(math.isfinite(a) for a in group_advantages(rewards, std))
    record, bad = finite_record({"rollout/reward/mean": float("inf"), "train/loss": float("nan"), "step": 3})
    assert bad == ["rollout/reward/mean", "train/loss"]
    assert record == {"rollout/reward/mean": None, "train/loss": None, "step": 3}


def test_a_dict_reward_needs_the_key_that_says_what_to_train_on():
    """Without --reward-key nothing says which entry is the reward: the sample fails at once,
    instead of the trainer failing on it later."""
    assert "set --reward-key" in reward_problem({"score": 1.0, "acc": 1.0}, None)
    assert reward_problem({"score": 1.0, "acc": 1.0}, "score") is None
