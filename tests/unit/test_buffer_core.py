"""DefaultDataBuffer: every rule of the `DataBuffer` contract (services/buffer/core.py), without I/O."""

from __future__ import annotations

import asyncio
import sys
import types

import pytest

from services.api import (
    DataBuffer,
    DefaultDataBuffer,
    DynamicFilterOutput,
    RunConfig,
    Sample,
    SampleStatus,
    check_reward_nonzero_std,
)
from services.common.plugins import load_object

M = "rollout/fully_async/"


def group(gi: int, n: int = 2, versions=(0,), status=SampleStatus.COMPLETED, rewards=None) -> list[Sample]:
    rewards = rewards or [float(i) for i in range(n)]
    return [
        Sample(
            index=gi * n + i,
            group_index=gi,
            prompt=f"p{gi}",
            label="l",
            metadata={"m": gi},
            tokens=[1, 2, 3],
            response="x",
            response_length=1,
            reward=rewards[i],
            status=status,
            weight_versions=list(versions),
            rollout_log_probs=[-0.5],
        )  # fmt: skip
        for i in range(n)
    ]


def make(**kw) -> tuple[DefaultDataBuffer, list]:
    recycled: list = []

    async def recycle(g):
        recycled.append(g)

    cfg = RunConfig(rollout_batch_size=2, n_samples_per_prompt=2, **kw)
    return DefaultDataBuffer(cfg, recycle), recycled


async def test_fifo_and_capacity_backpressure():
    buf, _ = make(async_data_buffer_capacity_factor=1.0)  # capacity 2
    assert buf.capacity == 2
    await buf.put(group(0))
    await buf.put(group(1))
    blocked = asyncio.ensure_future(buf.put(group(2)))
    await asyncio.sleep(0)
    assert not blocked.done(), "a full buffer must hold the producer back"
    first = await buf.get()
    await asyncio.wait_for(blocked, 1.0)
    assert first[0].group_index == 0
    assert [(await buf.get())[0].group_index for _ in range(2)] == [1, 2]


async def test_aborted_group_never_blocks_and_goes_to_the_handler():
    buf, recycled = make(async_data_buffer_capacity_factor=1.0, async_unused_samples_handler="retry")
    await buf.put(group(0))
    await buf.put(group(1))
    g = group(2)
    g[1].status = SampleStatus.ABORTED
    await asyncio.wait_for(buf.put(g), 0.5)  # full, yet returns at once
    assert recycled == [g] and len(buf) == 2
    assert all(s.status is SampleStatus.ABORTED and s.tokens == [] for s in g)  # reset for retry
    assert buf.get_metrics()[M + "aborted_groups_filtered"] == 1


async def test_failed_is_not_aborted():
    buf, recycled = make()
    await buf.put(group(0, status=SampleStatus.FAILED))
    assert len(buf) == 1 and recycled == []


async def test_drop_handler_discards():
    buf, recycled = make(async_unused_samples_handler="drop")
    g = group(0)
    g[0].status = SampleStatus.ABORTED
    await buf.put(g)
    assert recycled == [] and len(buf) == 0


def _install_filters():
    mod = types.ModuleType("tfilters")
    mod.reject_all = lambda config, group: DynamicFilterOutput(keep=False, reason="bad")
    mod.reject_no_reason = lambda config, group: DynamicFilterOutput(keep=False, reason="")
    mod.plain_bool = lambda config, group: group[0].group_index % 2 == 0
    mod.raises = lambda config, group: 1 / 0
    sys.modules["tfilters"] = mod


async def test_dynamic_filter_counts_reason_and_never_recycles():
    _install_filters()
    buf, recycled = make(dynamic_sampling_filter_path="tfilters.reject_all", async_unused_samples_handler="retry")
    await buf.put(group(0))
    await buf.put(group(1))
    m = buf.get_metrics()
    assert m["rollout/dynamic_filter/drop_bad"] == 2 and recycled == [] and len(buf) == 0
    assert "rollout/dynamic_filter/drop_bad" not in buf.get_metrics()  # windowed


async def test_dynamic_filter_empty_reason_and_bool():
    _install_filters()
    buf, _ = make(dynamic_sampling_filter_path="tfilters.reject_no_reason")
    await buf.put(group(0))
    assert not any(k.startswith("rollout/dynamic_filter/") for k in buf.get_metrics())
    buf, _ = make(dynamic_sampling_filter_path="tfilters.plain_bool")
    await buf.put(group(0))
    await buf.put(group(1))
    assert len(buf) == 1


async def test_filter_that_raises_fails_loudly_with_its_path():
    _install_filters()
    buf, _ = make(dynamic_sampling_filter_path="tfilters.raises")
    with pytest.raises(RuntimeError, match="tfilters.raises"):
        await buf.put(group(0))


async def test_aborted_check_comes_before_the_filter():
    _install_filters()
    buf, _ = make(dynamic_sampling_filter_path="tfilters.reject_all")
    g = group(0)
    g[0].status = SampleStatus.ABORTED
    await buf.put(g)
    m = buf.get_metrics()
    assert m[M + "aborted_groups_filtered"] == 1 and "rollout/dynamic_filter/drop_bad" not in m


async def test_staleness_is_strict_and_judged_at_get():
    buf, recycled = make(max_weight_staleness=2, async_unused_samples_handler="retry")
    await buf.put(group(0, versions=(3,)))  # staleness 5 - 3 = 2: kept
    await buf.put(group(1, versions=(2, 4)))  # oldest 2 -> 3: rejected
    await buf.put(group(2, versions=(5,)))
    got = await buf.get(current_version=5, unknown_context_key=True)
    assert got[0].group_index == 0
    got = await buf.get(current_version=5)
    assert got[0].group_index == 2 and len(recycled) == 1 and recycled[0][0].group_index == 1
    m = buf.get_metrics()
    assert m[M + "stale_groups_filtered"] == 1
    assert m[M + "avg_staleness"] == 1.0 and m[M + "max_staleness"] == 2  # consumed groups only


async def test_unknown_versions_are_never_filtered_nor_counted():
    buf, _ = make(max_weight_staleness=0)
    await buf.put(group(0, versions=()))
    await buf.put(group(1, versions=(0,)))
    assert (await buf.get(current_version=9))[0].group_index == 0
    assert (await buf.get(current_version=None))[0].group_index == 1
    m = buf.get_metrics()
    assert m[M + "stale_groups_filtered"] == 0
    assert M + "avg_staleness" not in m and M + "max_staleness" not in m


async def test_metrics_keys_windows_and_presence():
    buf, _ = make(async_data_buffer_capacity_factor=3.0)
    m = buf.get_metrics()
    assert m == {
        M + "queue_size": 0,
        M + "aborted_groups_filtered": 0,
        M + "stale_groups_filtered": 0,
    }
    await buf.put(group(0, versions=(1,)))
    await buf.put(group(1, versions=(3,)))
    await buf.get(current_version=4)
    m = buf.get_metrics()
    assert m[M + "queue_size"] == 1
    assert m[M + "avg_staleness"] == 3 and m[M + "max_staleness"] == 3
    assert m[M + "buffer_avg_staleness"] == 1 and m[M + "buffer_max_staleness"] == 1  # vs latest seen (4)
    m = buf.get_metrics()
    assert M + "avg_staleness" not in m and m[M + "buffer_max_staleness"] == 1


def test_capacity_validation():
    cfg = RunConfig(rollout_batch_size=2).model_copy(update={"async_data_buffer_capacity_factor": 0.1})  # unvalidated
    with pytest.raises(ValueError, match="at least one group"):
        DefaultDataBuffer(cfg, None)


def test_check_reward_nonzero_std():
    cfg = RunConfig()
    assert check_reward_nonzero_std(cfg, group(0, rewards=[0.0, 1.0])).keep
    out = check_reward_nonzero_std(cfg, group(0, rewards=[1.0, 1.0]))
    assert not out.keep and out.reason == "zero_std_1.0"
    assert check_reward_nonzero_std(cfg, group(0, rewards=[0.04, 0.04])).reason == "zero_std_0.0"
    assert load_object("services.api.check_reward_nonzero_std", "x") is check_reward_nonzero_std


def test_databuffer_is_the_plugin_base():
    assert issubclass(DefaultDataBuffer, DataBuffer)


def test_the_producers_cap_is_shared_by_the_partitions_whose_adapter_trains():
    """Multi-LoRA: ceil(cap / active) to each ACTIVE partition, none to one pending, retiring or
    cleaning up (its groups would wait for a first version, or be dropped)."""
    from asyncrl_proto.messages import AdapterState as S
    from services.buffer.adapters import cap_shares

    states = {"a": S.ACTIVE, "b": S.ACTIVE, "p": S.PENDING, "r": S.RETIRING, "c": S.CLEANUP, "gone": None}
    assert cap_shares(5, states) == {"a": 3, "b": 3, "p": 0, "r": 0, "c": 0, "gone": 0}
    assert cap_shares(4, {"a": S.ACTIVE}) == {"a": 4}
    assert cap_shares(4, {"r": S.RETIRING}) == {"r": 0}
