"""The eval service's backends against a real nats-server and real engines: a pinned fleet
point, every skip reason, an external evaluator, snapshot retirement."""

from __future__ import annotations

import contextlib

import pytest

from asyncrl_proto import EvalRequest, EvalResult, WeightsPublished, decode
from services.api import CheckpointEvalFn, EvalSkip, RunConfig
from services.common.bus import Bus, fetch_some
from services.common.snapshot import COMPLETE_MARKER
from services.common.versions import last_published_version
from services.eval.service import EvalService
from services.model.hf_io import load_model, save_model
from tests.conftest import EngineThread, pull, start_service, wait_until


class GoodEval(CheckpointEvalFn):
    def evaluate_checkpoint(self, checkpoint_dir, input):
        return {"custom-set": 0.5, "eval/custom-set/extra": float(input["step"])}


class SkippingEval(CheckpointEvalFn):
    async def evaluate_checkpoint(self, checkpoint_dir, input):
        raise EvalSkip("too_early")


class CrashingEval(CheckpointEvalFn):
    def evaluate_checkpoint(self, checkpoint_dir, input):
        raise RuntimeError("evaluator bug")


def config(task_data, model_dir, run_dir, **kw) -> RunConfig:
    base = dict(hf_checkpoint=str(model_dir), prompt_data=str(task_data[0]), run_dir=str(run_dir),
                eval_prompt_data=["heldout", str(task_data[1])], n_samples_per_eval_prompt=1, eval_interval=1,
                eval_hf_dir=str(run_dir / "evalhf"), rollout_engine_urls=["http://127.0.0.1:1"], eval_keep_snapshots=2)  # fmt: skip
    base.update(kw)
    return RunConfig(**base)


@contextlib.asynccontextmanager
async def running(cfg: RunConfig, nats_server, run_id: str):
    """An eval service on `cfg`, and a bus to send it points; both stopped afterwards."""
    svc = await start_service(EvalService, cfg, nats_server.url, run_id)
    bus = await Bus.connect(nats_server.url, run_id, "test")
    try:
        yield bus
    finally:
        await svc.stop()
        await bus.close()


async def ask(bus: Bus, req: EvalRequest) -> EvalResult:
    s = bus.subjects
    sub = await pull(bus, s.eval_stream, s.eval_results, durable=f"t{req.step}-{id(req)}")
    if req.version > await last_published_version(bus):  # as the trainer: it pushed the version it evaluates
        await bus.publish(s.weights_published, WeightsPublished(version=req.version, step=req.step, uri="/w"))
    await bus.publish(s.eval_requests, req)
    for _ in range(60):
        for m in await fetch_some(sub, 1, 1.0):
            res = decode(m.data, EvalResult)
            await m.ack()
            if res.step == req.step:
                return res
    raise TimeoutError(f"no result for step {req.step}")


def snapshot(model_dir, path, complete=True) -> str:
    save_model(load_model(model_dir), path, model_dir)
    if not complete:
        (path / COMPLETE_MARKER).unlink()
    return str(path)


async def test_fleet_pins_each_point_to_its_snapshot(nats_server, run_id, task_data, tiny_model_dir, tmp_path):
    with EngineThread(tiny_model_dir) as fleet:
        cfg = config(task_data, tiny_model_dir, tmp_path, eval_engine_urls=[fleet.url])
        async with running(cfg, nats_server, run_id) as bus:
            res = await ask(bus, EvalRequest(step=3, version=3, snapshot_uri=snapshot(tiny_model_dir, tmp_path / "s3")))
            m = res.metrics
            assert res.skipped_reason is None and m["eval/step"] == 3 and "eval/heldout" in m
            assert m["eval/heldout/weight_version/mean"] == 3.0  # every sample came from the pinned snapshot
            assert m["eval/heldout/weight_version/mixed_version_ratio"] == 0.0
            # Miles's per-set facts: truncated and no-reward shares, response lengths, version stats
            assert 0 <= m["eval/heldout-truncated_ratio"] <= 1 and m["eval/heldout-none_reward_ratio"] == 0.0
            assert [m[f"eval/heldout/weight_version/{k}"] for k in ("median", "max", "min")] == [3.0, 3.0, 3.0]
            lens = [m[f"eval/heldout/response_len/{k}"] for k in ("min", "median", "max")]
            assert 1 <= lens[0] <= lens[1] <= lens[2] and lens[0] <= m["eval/heldout/response_len/mean"] <= lens[2]
            missing = await ask(
                bus,
                EvalRequest(step=4, version=4, snapshot_uri=snapshot(tiny_model_dir, tmp_path / "s4", complete=False)),
            )
            assert missing.skipped_reason == "ckpt_missing" and missing.metrics["eval/skipped_ckpt_missing"] == 1.0
            # an engine that does not take the version: the pin does not hold
            real = fleet.scheduler.weights.update_weights_from_disk
            fleet.scheduler.weights.update_weights_from_disk = lambda path, version, **kw: real(path, None, **kw)
            pin = await ask(bus, EvalRequest(step=5, version=5, snapshot_uri=snapshot(tiny_model_dir, tmp_path / "s5")))
            assert pin.skipped_reason == "pin_violation"


async def test_an_unhealthy_fleet_skips(nats_server, run_id, task_data, tiny_model_dir, tmp_path):
    fleet = EngineThread(tiny_model_dir).__enter__()
    cfg = config(task_data, tiny_model_dir, tmp_path, eval_engine_urls=[fleet.url])
    async with running(cfg, nats_server, run_id) as bus:
        fleet.__exit__(None, None, None)  # the fleet engine goes away after start-up
        res = await ask(bus, EvalRequest(step=2, version=2, snapshot_uri=snapshot(tiny_model_dir, tmp_path / "s2")))
        assert res.skipped_reason == "unhealthy" and res.metrics["eval/skipped_unhealthy"] == 1.0


@pytest.mark.parametrize(
    ("cls", "expect"), [("GoodEval", None), ("SkippingEval", "too_early"), ("CrashingEval", "crashed")]
)
async def test_external_evaluator(nats_server, run_id, task_data, tiny_model_dir, tmp_path, cls, expect):
    cfg = config(task_data, tiny_model_dir, tmp_path, eval_function_path=f"{__name__}.{cls}")
    async with running(cfg, nats_server, run_id) as bus:
        res = await ask(bus, EvalRequest(step=1, version=1, snapshot_uri=snapshot(tiny_model_dir, tmp_path / "s1")))
        assert res.skipped_reason == expect
        if expect is None:
            assert res.metrics["eval/custom-set"] == 0.5 and res.metrics["eval/custom-set/extra"] == 1.0
        else:
            assert res.metrics[f"eval/skipped_{expect}"] == 1.0


async def test_exported_snapshots_retire_and_others_stay(nats_server, run_id, task_data, tiny_model_dir, tmp_path):
    cfg = config(task_data, tiny_model_dir, tmp_path, eval_function_path=f"{__name__}.GoodEval")
    async with running(cfg, nats_server, run_id) as bus:
        ours = [snapshot(tiny_model_dir, tmp_path / "evalhf" / f"step_{i}") for i in range(4)]
        theirs = snapshot(tiny_model_dir, tmp_path / "users-checkpoint")
        for i, path in enumerate(ours):
            await ask(bus, EvalRequest(step=i, version=i, snapshot_uri=path, exported=True, export_time_s=0.1))
        await ask(bus, EvalRequest(step=9, version=9, snapshot_uri=theirs))
        assert [p.name for p in sorted((tmp_path / "evalhf").iterdir())] == ["step_2", "step_3"]
        assert (tmp_path / "users-checkpoint" / COMPLETE_MARKER).exists()


async def test_keeping_no_eval_snapshot_deletes_each_once_evaluated(nats_server, run_id, task_data, tiny_model_dir,
                                                                     tmp_path):  # fmt: skip
    """--eval-keep-snapshots 0, as in Miles: an exported snapshot is deleted once evaluated."""
    cfg = config(task_data, tiny_model_dir, tmp_path, eval_function_path=f"{__name__}.GoodEval", eval_keep_snapshots=0)
    async with running(cfg, nats_server, run_id) as bus:
        for i in range(2):
            path = snapshot(tiny_model_dir, tmp_path / "evalhf" / f"step_{i}")
            res = await ask(bus, EvalRequest(step=i, version=i, snapshot_uri=path, exported=True, export_time_s=0.1))
            assert not res.skipped_reason
            # the service retires the snapshot right after it publishes the result, not before
            gone = tmp_path / "evalhf" / f"step_{i}"
            await wait_until(lambda gone=gone: not gone.exists(), timeout=10, what=f"{gone.name} deleted")


async def test_eval_duration_counts_from_dispatch(nats_server, run_id, task_data, tiny_model_dir, tmp_path):
    """eval/duration_seconds includes the time the point waited in the queue, as in Miles."""
    import time

    cfg = config(task_data, tiny_model_dir, tmp_path, eval_function_path=f"{__name__}.GoodEval")
    async with running(cfg, nats_server, run_id) as bus:
        path = snapshot(tiny_model_dir, tmp_path / "evalhf" / "step_1")
        res = await ask(bus, EvalRequest(step=1, version=1, snapshot_uri=path, requested_at=time.time() - 30))
        assert res.metrics["eval/duration_seconds"] >= 30


SEEN: list = []


class RecordingEval(CheckpointEvalFn):
    def evaluate_checkpoint(self, checkpoint_dir, input):
        SEEN.append(("evaluate", input["weight_version"], input["trainer_version"]))
        return {"x": 1.0}

    async def dispose(self):
        SEEN.append(("dispose",))


async def test_an_external_evaluator_gets_the_step_as_weight_version_and_is_disposed(
    nats_server, run_id, task_data, tiny_model_dir, tmp_path
):
    """As in Miles: weight_version == str(eval/step) of the point (the step just trained, not the
    trainer's push counter), and dispose() once at shutdown."""
    SEEN.clear()
    cfg = config(task_data, tiny_model_dir, tmp_path, eval_function_path=f"{__name__}.RecordingEval")
    async with running(cfg, nats_server, run_id) as bus:
        snap = snapshot(tiny_model_dir, tmp_path / "s4")
        res = await ask(bus, EvalRequest(step=4, rollout_id=3, version=2, snapshot_uri=snap))
        assert SEEN == [("evaluate", "3", 2)] and res.metrics["eval/step"] == 3
    assert SEEN == [("evaluate", "3", 2), ("dispose",)]


async def test_the_reference_evaluators_pin_failure_is_a_crash(nats_server, run_id, task_data, tiny_model_dir,
                                                                tmp_path, monkeypatch):  # fmt: skip
    """A server that does not take the point's weights: the reference evaluator fails (recorded
    as `crashed`, as Miles's does), it does not skip quietly."""
    with EngineThread(tiny_model_dir) as server:
        monkeypatch.setenv("ASYNCRL_EVAL_SERVER_URL", server.url)
        cfg = config(task_data, tiny_model_dir, tmp_path, eval_function_path="services.eval.reference.SGLangServerEval")
        async with running(cfg, nats_server, run_id) as bus:
            real = server.scheduler.weights.update_weights_from_disk
            server.scheduler.weights.update_weights_from_disk = lambda path, version, **kw: real(path, None, **kw)
            res = await ask(bus, EvalRequest(step=2, version=2, snapshot_uri=snapshot(tiny_model_dir, tmp_path / "s2")))
            assert res.skipped_reason == "crashed" and res.metrics["eval/skipped_crashed"] == 1.0


EVAL_LOGS: list = []


def record_eval_data(rollout_id, config, data, extra_metrics):
    EVAL_LOGS.append((rollout_id, {k: v["samples"] for k, v in data.items()}, extra_metrics))
    return False


async def test_eval_config_sets_each_datasets_settings(nats_server, run_id, task_data, tiny_model_dir, tmp_path):
    """--eval-config as Miles reads it: per-set n, max_response_len and metadata overrides over
    the defaults over the flags; the custom eval log function sees each set's samples."""
    EVAL_LOGS.clear()
    doc = tmp_path / "eval.yaml"
    doc.write_text(f"""eval:
  defaults: {{n_samples_per_eval_prompt: 2}}
  datasets:
    short: {{path: {task_data[1]}, max_response_len: 1, metadata_overrides: {{tag: s}}}}
    long: {{path: {task_data[1]}, n_samples_per_eval_prompt: 3}}
""")
    rows = len(task_data[1].read_text().splitlines())
    with EngineThread(tiny_model_dir) as fleet:
        cfg = config(task_data, tiny_model_dir, tmp_path, eval_engine_urls=[fleet.url], eval_config=str(doc),
                     custom_eval_rollout_log_function_path=f"{__name__}.record_eval_data")  # fmt: skip
        async with running(cfg, nats_server, run_id) as bus:
            res = await ask(bus, EvalRequest(step=2, rollout_id=1, version=2,
                                             snapshot_uri=snapshot(tiny_model_dir, tmp_path / "s2")))  # fmt: skip
    m = res.metrics
    assert res.skipped_reason is None and "eval/heldout" not in m
    assert m["eval/short/response_len/max"] == 1.0 and m["eval/long/response_len/max"] <= cfg.rollout.max_response_len
    ((rollout_id, samples, extra),) = EVAL_LOGS
    assert rollout_id == 1 and extra == {"eval/step": 1}
    assert (len(samples["short"]), len(samples["long"])) == (2 * rows, 3 * rows)
    assert all(s.metadata["tag"] == "s" for s in samples["short"]) and "tag" not in samples["long"][0].metadata
