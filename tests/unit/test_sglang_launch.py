"""--engine sglang without a GPU: the command lines the launcher would run, flag pass-through,
and the error when SGLang is not installed."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from services.cli import _resolve
from services.launcher import sglang_engine_commands


def test_sglang_flags_pass_through_to_each_engine():
    c = _resolve("asyncrl train-async", ["--fully-async", "--engine", "sglang", "--rollout-num-engines", "2", "--rollout-batch-size", "4",
                                          "--rollout-num-gpus-per-engine", "2", "--sglang-mem-fraction-static", "0.5",
                                          "--sglang-enable-deterministic-inference", "--use-sglang-router",
                                          "--router-policy", "cache_aware", "--hf-checkpoint", "/m"], sync=False)  # fmt: skip
    assert c.infra.sglang_server_args == ["--mem-fraction-static", "0.5", "--enable-deterministic-inference"]
    assert c.infra.sglang_router_args == ["--policy", "cache_aware"] and c.infra.use_sglang_router
    (cmd0, env0), (cmd1, env1) = sglang_engine_commands(c, [31000, 31001])
    assert cmd0[1:3] == ["-m", "sglang.launch_server"] and cmd0[cmd0.index("--model-path") + 1] == "/m"
    assert cmd0[cmd0.index("--port") + 1] == "31000" and cmd0[cmd0.index("--weight-version") + 1] == "0"
    assert cmd0[cmd0.index("--tp-size") + 1] == "2" and "--enable-metrics" in cmd0
    assert cmd0[-3:] == ["--mem-fraction-static", "0.5", "--enable-deterministic-inference"]
    assert (env0["CUDA_VISIBLE_DEVICES"], env1["CUDA_VISIBLE_DEVICES"]) == ("0,1", "2,3")


def test_an_explicit_tp_size_wins():
    c = _resolve(
        "asyncrl train-async",
        ["--engine", "sglang", "--sglang-tp-size", "4", "--hf-checkpoint", "/m", "--rollout-batch-size", "4"],
        sync=False,
    )
    [(cmd, _)] = sglang_engine_commands(c, [1])
    assert cmd.count("--tp-size") == 1 and cmd[cmd.index("--tp-size") + 1] == "4"


@pytest.mark.skipif(importlib.util.find_spec("sglang") is not None, reason="SGLang is installed here")
def test_without_sglang_the_error_says_what_to_do(tmp_path):
    r = subprocess.run([sys.executable, "-m", "services.cli", "train-async", "--fully-async", "--engine", "sglang",
                        "--num-rollout", "1", "--rollout-batch-size", "4", "--run-dir", str(tmp_path / "run")],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 1
    assert "needs SGLang installed" in r.stderr and "--rollout-external-engine-addrs" in r.stderr


def test_sglang_server_concurrency_is_ours_never_passed_to_sglang():
    """Miles's --sglang-server-concurrency is the producer's per-engine semaphore, not a flag of
    sglang.launch_server (which would refuse it as unknown)."""
    c = _resolve("asyncrl train-async", ["--engine", "sglang", "--sglang-server-concurrency", "8", "--rollout-batch-size", "4",
                                          "--sglang-mem-fraction-static", "0.5", "--hf-checkpoint", "/m"], sync=False)  # fmt: skip
    assert c.rollout.sglang_server_concurrency == 8
    assert c.infra.sglang_server_args == ["--mem-fraction-static", "0.5"]
