"""Command lines that start an engine: the built-in one or an SGLang server. The launcher (rollout
engines) and the eval service (its fleet) build them here, so both start engines the same way."""

from __future__ import annotations

import sys

TOOL_CALL_PARSERS = ("qwen25", "hermes")
"""The --tool-call-parser names the built-in engine knows (services/engine/tool_calls.py): both are the
<tool_call> JSON blocks of Qwen and Hermes chat templates."""


def tool_call_parser(sglang_args: list[str]) -> str | None:
    """The --tool-call-parser among a run's --sglang-* arguments: its name, "" when the flag has no
    value, None when it is not there."""
    for i, arg in enumerate(sglang_args):
        flag, eq, value = arg.partition("=")
        if flag == "--tool-call-parser":
            return value if eq else (sglang_args[i + 1] if i + 1 < len(sglang_args) else "")
    return None


def builtin_engine_command(model_path: str, port: int, flags: dict[str, str | None]) -> list[str]:
    """`python -m services.engine` serving `model_path` at version 0 on 127.0.0.1:`port`, with
    its own flags (SGLang's names: --max-running-requests, --torch-num-threads, ...)."""
    cmd = [sys.executable, "-m", "services.engine", "--model-path", model_path, "--port", str(port),
           "--weight-version", "0"]  # fmt: skip
    for k, v in flags.items():
        cmd += [k] if v is None else [k, v]
    return cmd


def builtin_engine_flags(config, seed: int, instance: str,
                         lora_rank: tuple[int, int] | None = None) -> dict[str, str | None]:  # fmt: skip
    """The built-in engine settings a run gives every engine it starts; `instance` (engine-0,
    eval-engine-0, ...) and the run id label its /metrics; `lora_rank` (adapters, max rank): a
    multi-LoRA run's engines."""
    flags: dict[str, str | None] = {
        "--max-running-requests": str(config.infra.engine_max_running_requests),
        "--torch-num-threads": str(config.infra.torch_num_threads),
        "--random-seed": str(seed),
        "--instance-id": instance,
    }
    if config.infra.run_id:
        flags["--run-id"] = config.infra.run_id
    if lora_rank and lora_rank[0] > 0:  # two versions of every adapter while one replaces the other
        flags |= {"--enable-lora": None, "--max-loras-per-batch": str(2 * lora_rank[0]),
                  "--max-lora-rank": str(lora_rank[1])}  # fmt: skip
    if parser := tool_call_parser(config.infra.sglang_server_args):  # the built-in engine knows SGLang's flag
        flags["--tool-call-parser"] = parser
    return flags


SGLANG_LAUNCHER_FLAGS = ("--model-path", "--model", "--host", "--port", "--random-seed", "--weight-version")
"""What the launcher sets on every SGLang server it starts, per engine: a --sglang-<flag> naming one
would contradict it (the launcher would wait on a port the server does not listen on)."""


def launcher_flags_problem(sglang_args: list[str], prefix: str, who: str) -> str | None:
    """Why a run's --sglang-* (or --eval-sglang-*: `prefix`) arguments name SGLANG_LAUNCHER_FLAGS
    (`who` sets them itself for each server), or None."""
    if taken := sorted({a.split("=")[0] for a in sglang_args} & set(SGLANG_LAUNCHER_FLAGS)):
        return (f"{prefix}{taken[0][2:]}: {who} sets {', '.join(taken)} for each SGLang server it "
                "starts (its own port, seed and weights); drop the flag")  # fmt: skip
    return None


def sglang_server_command(model_path: str, port: int, seed: int, args: list[str]) -> list[str]:
    """`sglang.launch_server` on 127.0.0.1:`port` with metrics on, then `args` (--sglang-* of the run)."""
    return [sys.executable, "-m", "sglang.launch_server", "--model-path", model_path, "--host", "127.0.0.1",
            "--port", str(port), "--enable-metrics", "--skip-server-warmup", "--random-seed", str(seed),
            *args]  # fmt: skip
