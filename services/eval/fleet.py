"""The dedicated eval fleet: engines owned by the eval service, pinned to a snapshot per point.

Fleet engines inherit every engine setting of the rollout engines, as Miles's: the replay side
channels (--enable-return-routed-experts, --enable-return-indexer-topk) are turned off, since
eval samples never feed training; when the fleet's tensor-parallel size
(--eval-num-gpus-per-engine) differs from the rollout's (--rollout-num-gpus-per-engine), the
data/pipeline/expert/attention-context parallel sizes are not inherited (they default to 1: an
engine with the rollout's layout at another TP does not boot), and the log says so; then
`--eval-sglang-<flag> V` overrides one setting (`--no-eval-sglang-<flag>` turns a boolean off).
"""

from __future__ import annotations

import logging
import subprocess
from pathlib import Path

from services.common import procs
from services.common.engine_commands import builtin_engine_command, builtin_engine_flags, sglang_server_command
from services.common.httpauth import Keys
from services.common.secrets import without_identity

log = logging.getLogger(__name__)

TP_FLAGS = ("--tp-size", "--tp", "--tensor-parallel-size")
NOT_INHERITED_ACROSS_TP = ("--dp-size", "--dp", "--pp-size", "--pp", "--ep-size", "--ep", "--attn-cp-size")
OFF_FOR_EVAL = ("--enable-return-routed-experts", "--enable-return-indexer-topk")


def parse_flags(args: list[str]) -> dict[str, str | None]:
    """['--a', '1', '--b', '--c=2'] -> {'--a': '1', '--b': None, '--c': '2'} (order kept)."""
    out: dict[str, str | None] = {}
    rest = list(args)
    while rest:
        k, eq, v = rest.pop(0).partition("=")
        out[k] = v if eq else rest.pop(0) if rest and not rest[0].startswith("--") else None
    return out


def fleet_server_args(rollout_args: list[str], overrides: list[str], rollout_tp: int, eval_tp: int) -> list[str]:
    """The fleet's engine arguments: the rollout's, less what eval does not inherit (see the
    module), then the eval overrides; the TP size is --eval-num-gpus-per-engine's (the rollout's
    is an explicit --sglang-tp-size, else --rollout-num-gpus-per-engine)."""
    flags = parse_flags(rollout_args)
    rollout_tp = next((int(flags[k]) for k in TP_FLAGS if flags.get(k) is not None), rollout_tp)
    dropped = TP_FLAGS + OFF_FOR_EVAL + (NOT_INHERITED_ACROSS_TP if eval_tp != rollout_tp else ())
    flags = {k: v for k, v in flags.items() if k not in dropped}
    if eval_tp != rollout_tp:
        log.info("Eval tp=%d != rollout tp=%d; dp_size, pp_size, ep_size, attn_cp_size default to 1. Override with "
                 "--eval-sglang-*.", eval_tp, rollout_tp)  # fmt: skip
    for k, v in parse_flags(overrides).items():
        if k.startswith("--no-"):
            flags.pop("--" + k[len("--no-") :], None)
        else:
            flags[k] = v
    flags["--tp-size"] = str(eval_tp)
    return [x for k, v in flags.items() for x in ([k] if v is None else [k, v])]


# the built-in engine's own flags (a subset of SGLang's names) that a fleet engine inherits
BUILTIN_FLAGS = ("--max-running-requests", "--context-length", "--random-seed", "--torch-num-threads")


def launch_fleet(config, log_dir: Path, token: str | None) -> tuple[list[subprocess.Popen], list[str]]:
    """Start the fleet's engines (children of the eval service: they die with it). `token`, the
    eval's own, is the fleet engines' only key: the eval loads weights on them and serves
    generation from them; no other role reaches them."""
    env = without_identity()
    if token:
        env.update(Keys.single(token).env())
    i_, e_, model = config.infra, config.eval, config.data.hf_checkpoint
    if i_.engine == "sglang":
        args = fleet_server_args(list(i_.sglang_server_args), list(e_.sglang_args),
                                 i_.rollout_num_gpus_per_engine, e_.num_gpus_per_engine)  # fmt: skip
        args += ["--api-key", token] if token else []  # SGLang takes its key on its command line only
    extra = {k: v for k, v in parse_flags(list(e_.sglang_args)).items() if k in BUILTIN_FLAGS}
    children, urls = [], []
    for i in range(e_.num_gpus // max(e_.num_gpus_per_engine, 1)):
        port, seed = procs.free_port(), config.data.seed + 100 + i
        if i_.engine == "sglang":
            cmd = sglang_server_command(model, port, seed, args)
        else:
            cmd = builtin_engine_command(model, port, builtin_engine_flags(config, seed, f"eval-engine-{i}") | extra)
        children.append(procs.spawn(cmd, log_path=log_dir / f"eval-engine-{i}.log", env=env))
        urls.append(f"http://127.0.0.1:{port}")
    return children, urls
