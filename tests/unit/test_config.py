"""Configuration: Miles's flag names, precedence, and every validation rule with its message."""

from __future__ import annotations

import argparse
import json

import pytest

from services.api import RunConfig
from services.common.config import ConfigError
from services.common.config_load import add_config_arguments, resolve_config


def parse(argv: list[str]) -> dict:
    p = argparse.ArgumentParser()
    add_config_arguments(p)
    return vars(p.parse_args(argv))


def test_runconfig_accepts_any_subset_of_fields():
    c = RunConfig(rollout_batch_size=4, n_samples_per_prompt=2)
    assert c.rollout.batch_size == 4 and c.async_.max_weight_staleness is None
    assert c.buffer_capacity == 8 and c.inflight_groups == 4


def test_kebab_case_flags_map_to_fields():
    args = parse([
        "--rollout-batch-size", "8", "--n-samples-per-prompt", "4", "--max-weight-staleness", "2",
        "--async-data-buffer-capacity-factor", "1.5", "--update-weights-interval", "3",
        "--pause-generation-mode", "in_place", "--fully-async", "--rollout-stop-token-ids", "5", "6",
    ])  # fmt: skip
    c = resolve_config(args, environ={})
    assert (c.rollout.batch_size, c.rollout.n_samples_per_prompt, c.async_.max_weight_staleness) == (8, 4, 2)
    assert c.buffer_capacity == 12 and c.async_.update_weights_interval == 3
    assert c.async_.pause_generation_mode == "in_place" and c.infra.fully_async and c.rollout.stop_token_ids == [5, 6]


def test_precedence_defaults_file_env_cli(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("rollout-batch-size: 4\nlr: 0.5\nn_samples_per_prompt: 2\n")
    env = {"ASYNCRL_LR": "0.25", "ASYNCRL_N_SAMPLES_PER_PROMPT": "6"}
    c = resolve_config({"n_samples_per_prompt": 3}, config_file=str(f), environ=env)
    assert c.rollout.batch_size == 4  # file over default
    assert c.trainer.lr == 0.25  # environment over file
    assert c.rollout.n_samples_per_prompt == 3  # command line over environment


def test_unknown_setting_in_file_is_an_error(tmp_path):
    f = tmp_path / "run.json"
    f.write_text('{"rollout_batchsize": 4}')
    with pytest.raises(ConfigError, match="unknown settings: --rollout-batchsize"):
        resolve_config({}, config_file=str(f), environ={})


RULES = [
    ({"driver": "sync", "fully_async": True}, "--fully-async requires the async driver: run train-async"),
    ({"fully_async": True, "pause_generation_mode": "abort"},
     "--fully-async cannot use --pause-generation-mode abort: generation is always in flight, so every "
     "weight update would kill it and force a full regeneration"),
    ({"fully_async": True, "colocate": True}, "--fully-async cannot be combined with --colocate"),
    ({"fully_async": True, "partial_rollout": True}, "--fully-async cannot be combined with --partial-rollout"),
    ({"fully_async": True, "rollout_function_path": "m.f"}, "--fully-async cannot be combined with a custom rollout function"),
    ({"colocate": True}, "--colocate is not supported"),  # accepted and ignored before: nothing decorative
    ({"driver": "sync", "partial_rollout": True}, "--partial-rollout is not supported"),
    ({"rollout_function_path": "m.f"}, "--rollout-function-path is not supported"),
    ({"async_data_buffer_capacity_factor": 0}, "--async-data-buffer-capacity-factor must be > 0"),
    ({"async_data_buffer_capacity_factor": 0.01, "rollout_batch_size": 4}, "holds no group"),
    ({"async_max_concurrent_samples": 4, "n_samples_per_prompt": 8}, "must be >= --n-samples-per-prompt"),
    ({"update_weights_interval": 0}, "--update-weights-interval must be >= 1"),
    ({"max_weight_staleness": -1}, "--max-weight-staleness must be >= 0"),
    ({"save_interval": 5}, "--save-interval needs --save"),
    ({"save_trigger_sentinel": "/tmp/x"}, "--save-trigger-sentinel needs --save"),
    ({"rollout_batch_size": 4, "n_samples_per_prompt": 4, "global_batch_size": 8, "num_steps_per_rollout": 4},
     "--global-batch-size 8 is not equal to --rollout-batch-size 4 * --n-samples-per-prompt 4 // --num-steps-per-rollout 4"),
    ({"rollout_batch_size": 4, "n_samples_per_prompt": 4, "global_batch_size": 6}, "--global-batch-size 6 must divide"),
    ({"num_steps_per_rollout": 2, "trainer_num_ranks": 2}, "run on one trainer rank in this version"),
    ({"eval_prompt_data": ["only-a-name"]}, "NAME PATH pairs"),
    ({"nats_cluster": 2}, "--nats-cluster 2 loses its JetStream quorum when either node stops: use 3 (or 1)"),
    ({"nats_replicas": 3}, "--nats-replicas 3 needs as many NATS nodes: add --nats-cluster 3"),
    ({"sglang_server_args": ["--tool-call-parser", "qwen3_coder"]}, "--sglang-tool-call-parser 'qwen3_coder': the built-in engine knows qwen25, hermes"),
    ({"sglang_server_args": ["--tool-call-parser"]}, "--sglang-tool-call-parser '': the built-in engine knows"),
    ({"engine": "sglang", "sglang_server_args": ["--port", "30000"]}, "--sglang-port: the launcher sets --port for each SGLang server"),
    ({"engine": "sglang", "sglang_server_args": ["--mem-fraction-static", "0.5", "--random-seed=3"]}, "the launcher sets --random-seed"),
    ({"eval_num_gpus": 1, "eval_sglang_args": ["--port", "31000"]}, "--eval-sglang-port: the eval fleet sets --port"),
    ({"tis_mode": "mask"}, "--tis-mode mask sets how --use-tis weights tokens: add --use-tis"),
    ({"use_tis": True, "tis_clip_low": 2.0}, "--tis-clip-low (2.0) must be below --tis-clip (2.0)"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "message"), RULES)
def test_validation_rules(fields, message):
    with pytest.raises(ConfigError) as e:
        resolve_config(fields, environ={})
    assert message in str(e.value)
    with pytest.raises(ValueError, match="validation error"):
        RunConfig(**fields)  # the public constructor validates too


def test_fully_async_defaults():
    c = RunConfig(fully_async=True)
    assert c.infra.mode == "fully_async" and c.submission_granularity == "sample"
    assert RunConfig().infra.mode == "one_step" and RunConfig().submission_granularity == "group"
    assert RunConfig(driver="sync").infra.mode == "sync"
    assert RunConfig(async_max_concurrent_samples=20, n_samples_per_prompt=8).inflight_groups == 2


def test_stream_replicas_follow_the_cluster():
    assert RunConfig().infra.stream_replicas == 1
    assert RunConfig(nats_cluster=3).infra.stream_replicas == 3 and RunConfig(nats_cluster=5).infra.stream_replicas == 3
    assert RunConfig(nats_cluster=5, nats_replicas=5).infra.stream_replicas == 5
    assert RunConfig(nats_url="nats://h:4222", nats_replicas=3).infra.stream_replicas == 3  # a cluster of one's own


def test_num_epoch_is_miles_step_count_and_a_run_must_name_its_length():
    from services.prepare import LaunchError, steps_of_epochs

    assert steps_of_epochs(RunConfig(rollout_batch_size=3, num_epoch=2), rows=10) == 6  # (10 // 3) x 2, not 7
    with pytest.raises(LaunchError, match="--num-rollout N .* or --num-epoch E"):
        steps_of_epochs(RunConfig(rollout_batch_size=3), rows=10)
    with pytest.raises(LaunchError, match="make no batch"):
        steps_of_epochs(RunConfig(rollout_batch_size=16, num_epoch=3), rows=10)


def test_periodic_actions_follow_miles():
    """should_run_periodic_action: never without an interval (no save at all without
    --save-interval, no eval without --eval-interval), the last step when told, every interval,
    every epoch's end."""
    from services.common.schedule import periodic_due

    assert not any(periodic_due(r, None, 3, 10) for r in range(10))
    assert [r for r in range(10) if periodic_due(r, 4)] == [3, 7]
    assert [r for r in range(10) if periodic_due(r, 4, total=10)] == [3, 7, 9]
    assert [r for r in range(10) if periodic_due(r, 4, per_epoch=3, total=10)] == [2, 3, 5, 7, 8, 9]


def test_driver_rules_for_pushes_saves_and_evals():
    from services.trainer.policy import DriverPolicy

    one_step = RunConfig(driver="async", num_rollout=5, update_weights_interval=2, save="/s", save_interval=2,
                         eval_interval=2)  # fmt: skip
    assert [r for r in range(5) if DriverPolicy(one_step).update_due(r)] == [1, 3]  # no forced push after the last step
    assert [r for r in range(5) if DriverPolicy(one_step).save_due(r)] == [1, 3, 4]  # the last step saves
    assert [r for r in range(5) if DriverPolicy(one_step).eval_due(r)] == [
        1,
        3,
        4,
    ]  # ... and evaluates, in the async drivers
    sync = one_step.model_copy(update={"driver": "sync"})
    assert [r for r in range(5) if DriverPolicy(sync).update_due(r)] == [0, 1, 2, 3, 4]  # on-policy: after every step
    assert [r for r in range(5) if DriverPolicy(sync).eval_due(r)] == [
        1,
        3,
    ]  # no forced eval after the last step in sync
    assert one_step.trainer.checkpoints_resume and one_step.commit_interval == 2
    no_interval = RunConfig(num_rollout=5, save="/s", update_weights_interval=3)
    assert not any(DriverPolicy(no_interval).save_due(r) for r in range(5))  # --save alone saves nothing, as in Miles
    assert not no_interval.trainer.checkpoints_resume and no_interval.commit_interval == 3  # commits follow the pushes
    assert not any(DriverPolicy(no_interval).eval_due(r) for r in range(5))


def test_the_baseline_eval_point():
    """Before the run's first step; a synchronous run resumed at step 3 evaluates again before
    step 3 (Miles's train.py), the async drivers do not; never without --eval-interval."""
    from services.trainer.policy import DriverPolicy

    sync = RunConfig(driver="sync", num_rollout=5, eval_interval=2)
    assert (
        DriverPolicy(sync).baseline_eval_due(0)
        and DriverPolicy(sync).baseline_eval_due(3)
        and not DriverPolicy(sync).baseline_eval_due(5)
    )
    one_step = sync.model_copy(update={"driver": "async"})
    assert DriverPolicy(one_step).baseline_eval_due(0) and not DriverPolicy(one_step).baseline_eval_due(3)
    assert not DriverPolicy(sync.model_copy(update={"skip_eval_before_train": True})).baseline_eval_due(0)
    assert not DriverPolicy(RunConfig(driver="sync", num_rollout=5)).baseline_eval_due(0)


def test_what_each_driver_waits_for_before_which_push():
    """The drivers' differences in the trainer's one loop: fully async drains step r+1's lease
    while r trains; one-step completes r+1's lease before an update step's push; sync does
    neither. Nothing is fetched ahead past the last step."""
    from services.trainer.policy import DriverPolicy

    base = RunConfig(num_rollout=5, update_weights_interval=2)
    fully = DriverPolicy(base.model_copy(update={"driver": "async", "fully_async": True}))
    one_step = DriverPolicy(base.model_copy(update={"driver": "async", "fully_async": False}))
    sync = DriverPolicy(base.model_copy(update={"driver": "sync"}))
    assert (fully.mode, one_step.mode, sync.mode) == ("fully_async", "one_step", "sync")
    assert [r for r in range(5) if fully.drains_ahead(r)] == [0, 1, 2, 3]
    assert not any(p.drains_ahead(r) for p in (one_step, sync) for r in range(5))
    assert [r for r in range(5) if one_step.completes_next_before_push(r)] == [1, 3]  # the update steps
    assert not any(p.completes_next_before_push(r) for p in (fully, sync) for r in range(5))


def test_the_drivers_start_up_warnings():
    from services.trainer.policy import DriverPolicy

    warnings = DriverPolicy(RunConfig(driver="sync", num_rollout=5, update_weights_interval=2)).start_warnings()
    assert len(warnings) == 1 and "ignored by the synchronous driver" in warnings[0]
    warnings = DriverPolicy(
        RunConfig(driver="async", num_rollout=5, update_weights_interval=2, save="/s")
    ).start_warnings()
    assert len(warnings) == 2 and "--save-interval" in warnings[0] and "the last 1 steps" in warnings[1]
    assert (
        DriverPolicy(RunConfig(num_rollout=6, update_weights_interval=2, save="/s", save_interval=3)).start_warnings()
        == []
    )


def test_bare_command_line_defaults_are_miless(capsys, tmp_path):
    """--rollout-batch-size is required (from the command line, the environment or a file);
    --n-samples-per-prompt defaults to 1."""
    from services.cli import _resolve

    with pytest.raises(SystemExit) as e:
        _resolve("asyncrl train-async", ["--num-rollout", "3"], sync=False)
    assert e.value.code == 2 and "--rollout-batch-size is required" in capsys.readouterr().err
    c = _resolve("asyncrl train-async", ["--rollout-batch-size", "4"], sync=False)
    assert (c.rollout.batch_size, c.rollout.n_samples_per_prompt) == (4, 1)
    (tmp_path / "c.yaml").write_text("rollout-batch-size: 5\n")
    assert _resolve("asyncrl train", ["--config", str(tmp_path / "c.yaml")], sync=True).rollout.batch_size == 5


def test_num_epoch_makes_every_epochs_end_a_save_and_eval_point(tmp_path):
    """--num-epoch: the launcher counts the steps (10 rows, B 3, 2 epochs: 6) and the steps per
    epoch (3), so the end of each epoch is a periodic point too, as in Miles."""
    from services.prepare import prepare_run
    from services.trainer.policy import DriverPolicy

    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{i}=", "label": str(i)}) + "\n" for i in range(10)))
    model = tmp_path / "m"
    model.mkdir()
    c = prepare_run(RunConfig(num_epoch=2, rollout_batch_size=3, prompt_data=str(data), eval_prompt_data=["h", str(data)],
                              hf_checkpoint=str(model), eval_interval=100, save="/s", save_interval=4,
                              run_dir=str(tmp_path / "run")), log=lambda *_: None)  # fmt: skip
    assert (c.rollout.num_rollout, c.rollout.num_rollout_per_epoch) == (6, 3)
    assert [r for r in range(6) if DriverPolicy(c).eval_due(r)] == [2, 5]  # each epoch's end (the last step too)
    assert [r for r in range(6) if DriverPolicy(c).save_due(r)] == [2, 3, 5]  # and every --save-interval
    given = prepare_run(RunConfig(num_rollout=6, num_epoch=2, rollout_batch_size=3, prompt_data=str(data),
                                  eval_prompt_data=["h", str(data)], hf_checkpoint=str(model),
                                  run_dir=str(tmp_path / "run2")), log=lambda *_: None)  # fmt: skip
    assert given.rollout.num_rollout_per_epoch is None  # --num-rollout given: no epoch points (as Miles)
