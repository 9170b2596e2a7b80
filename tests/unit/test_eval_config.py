"""Eval flag combinations that cannot work, and the fleet's engine settings."""

from __future__ import annotations

import pytest

from services.cli import _resolve
from services.common.config import ConfigError
from services.common.config_load import resolve_config
from services.eval.fleet import fleet_server_args

RULES = [
    ({"eval_num_gpus": 1, "eval_function_path": "m.C"}, "each select an eval backend: pass one of them"),
    ({"eval_num_gpus": 1, "eval_hf_dir": "/x"}, "Snapshot eval requires --eval-interval."),
    ({"eval_function_path": "m.C", "eval_interval": 5},
     "Snapshot eval requires a snapshot source: set --eval-hf-dir (staging exports) or --save-hf (reuse periodic HF checkpoints)."),
    ({"eval_num_gpus": 1, "eval_interval": 5, "save_hf": "/h", "save": "/s", "save_interval": 2},
     "needs --eval-interval (5) to be a multiple of --save-interval (2)"),
    ({"eval_num_gpus": 1, "eval_interval": 4, "save_hf": "/h"},
     "Snapshot eval from --save-hf checkpoints needs --save-interval (without it nothing is saved)"),
    ({"eval_sglang_args": ["--mem-fraction-static", "0.4"]},
     "--eval-sglang-* configures the dedicated eval fleet, which needs --eval-num-gpus > 0. Got ['--mem-fraction-static'] with --eval-num-gpus 0."),
    ({"eval_num_gpus": 2, "eval_interval": 2, "eval_hf_dir": "/x", "eval_sglang_args": ["--tp-size", "2"]},
     "--eval-sglang-tp-size is not a flag: the eval fleet's tensor-parallel size is --eval-num-gpus-per-engine"),
    ({"eval_max_in_flight": 0}, "--eval-max-in-flight must be >= 1"),
    ({"eval_num_gpus": 3, "eval_num_gpus_per_engine": 2, "eval_interval": 2, "eval_hf_dir": "/x"}, "must be a multiple of --eval-num-gpus-per-engine"),
]  # fmt: skip


@pytest.mark.parametrize(("fields", "message"), RULES)
def test_eval_validation(fields, message):
    with pytest.raises(ConfigError) as e:
        resolve_config(fields, environ={})
    assert message in str(e.value)


def test_backend_selection():
    assert resolve_config({}, environ={}).eval.backend == "shared"
    assert (
        resolve_config({"eval_num_gpus": 2, "eval_interval": 2, "eval_hf_dir": "/x"}, environ={}).eval.backend
        == "fleet"
    )
    cfg = resolve_config({"eval_function_path": "m.C", "eval_interval": 4, "save_hf": "/h", "save": "/s", "save_interval": 2},
                         environ={})  # fmt: skip
    assert cfg.eval.backend == "external"


def test_fleet_inherits_rollout_settings_with_overrides(caplog):
    rollout = ["--mem-fraction-static", "0.8", "--enable-torch-compile", "--dp-size", "2", "--tp-size", "2",
               "--enable-return-routed-experts", "--enable-return-indexer-topk"]  # fmt: skip
    with caplog.at_level("INFO", logger="services.eval.fleet"):
        same_tp = fleet_server_args(rollout, ["--mem-fraction-static", "0.5", "--no-enable-torch-compile"], 2, 2)
    # the replay side channels are off for eval (its samples never feed training); the rest is inherited
    assert same_tp == ["--mem-fraction-static", "0.5", "--dp-size", "2", "--tp-size", "2"]
    assert "Eval tp=" not in caplog.text
    with caplog.at_level("INFO", logger="services.eval.fleet"):
        other_tp = fleet_server_args(rollout + ["--pp-size", "2", "--attn-cp-size", "2"], [], 2, 1)
    assert "--dp-size" not in other_tp and "--pp-size" not in other_tp and "--attn-cp-size" not in other_tp
    assert other_tp[-2:] == ["--tp-size", "1"] and "--enable-torch-compile" in other_tp
    assert "Eval tp=1 != rollout tp=2; dp_size, pp_size, ep_size, attn_cp_size default to 1" in caplog.text
    explicit = fleet_server_args(rollout, ["--dp-size", "3", "--enable-return-routed-experts"], 2, 1)
    assert explicit[explicit.index("--dp-size") + 1] == "3" and "--enable-return-routed-experts" in explicit
    # the rollout's TP is an explicit --sglang-tp-size, else --rollout-num-gpus-per-engine's
    assert fleet_server_args(["--tp-size", "2", "--dp-size", "2"], [], 1, 2) == ["--dp-size", "2", "--tp-size", "2"]


def test_eval_sglang_flags_on_the_command_line():
    c = _resolve("asyncrl train-async", ["--eval-sglang-mem-fraction-static", "0.4", "--no-eval-sglang-enable-torch-compile",
                                          "--sglang-enable-torch-compile", "--eval-num-gpus", "1", "--eval-interval", "2",
                                          "--eval-hf-dir", "/x", "--rollout-batch-size", "4"], sync=False)  # fmt: skip
    assert c.eval.sglang_args == ["--mem-fraction-static", "0.4", "--no-enable-torch-compile"]
    assert c.infra.sglang_server_args == ["--enable-torch-compile"]
