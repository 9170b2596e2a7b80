"""A step's rollout metrics, as Miles computes them (miles/ray/rollout/metrics.py)."""

from __future__ import annotations

import pytest

from asyncrl_proto import Sample, SampleStatus
from services.common.sinks import axis_of, scalars


def sample(versions, status=SampleStatus.COMPLETED, length=3, reward=1.0):
    return Sample(weight_versions=versions, status=status, response_length=length, reward=reward)


def test_weight_version_statistics_are_over_each_samples_oldest_version():
    pytest.importorskip("torch")
    from services.trainer.rollout_stats import rollout_metrics

    samples = [sample([1, 3]), sample([2]), sample([4], status=SampleStatus.TRUNCATED, length=8), sample([])]
    m = rollout_metrics(samples, None, [samples])
    # oldest versions 1, 2, 4 (a sample without versions has none): max is 4, not the newest 3 of [1, 3]
    assert [m[f"rollout/weight_version/{k}"] for k in ("mean", "median", "max", "min")] == [7 / 3, 2.0, 4.0, 1.0]
    assert m["rollout/weight_version/mixed_version_ratio"] == 0.25
    assert [m[f"rollout/response_len/{k}"] for k in ("mean", "median", "max", "min")] == [4.25, 3.0, 8.0, 3.0]
    assert m["rollout/truncated_ratio"] == 0.25


def test_every_series_has_its_step_axis():
    assert axis_of("eval/reverse-digits") == "eval/step"
    assert axis_of("rollout/reward/mean") == axis_of("train/loss") == axis_of("perf/rollout_time") == "rollout/step"
    assert scalars({"rollout/step": 3, "a": 1, "b": True, "c": float("nan"), "d": "x"}) == {"a": 1.0, "b": 1.0}


def test_zero_std_groups_are_counted_per_reward_as_miles_names_them():
    from services.trainer.rollout_stats import rollout_metrics

    def group(*rewards, failed=()):
        return [Sample(index=i, reward=r, status=SampleStatus.FAILED if i in failed else SampleStatus.COMPLETED)
                for i, r in enumerate(rewards)]  # fmt: skip

    groups = [group(1.0, 1.0), group(0.0, 0.0), group(1.0, 0.0), group(0.0, 0.0), group(0.5, 0.0, failed=(1,))]
    rec = rollout_metrics([s for g in groups for s in g], None, groups)
    assert rec["rollout/zero_std/count_1.0"] == 1 and rec["rollout/zero_std/count_0.0"] == 2
    assert rec["rollout/zero_std/count_0.5"] == 1  # its FAILED sample has no reward to compare
    assert rec["rollout/zero_std/all_zero_percentage"] == pytest.approx(2 / 5)
    assert rec["rollout/zero_std/all_one_percentage"] == pytest.approx(1 / 5)
