"""The `asyncrl` command.

  asyncrl train ...                    synchronous driver
  asyncrl train-async ...              one-step async driver
  asyncrl train-async --fully-async    fully async driver (the default job of the README)
  asyncrl init-run --nats-url URL ...  prepare a run for services started elsewhere (compose, k8s)
  asyncrl service NAME ...             run one service alone against a NATS server
  asyncrl engine ...                   run the built-in SGLang-compatible engine
  asyncrl audit RUN_DIR                balance a run's ledger (exit 0 when balanced)
  asyncrl status RUN_DIR [--watch]     one screen on a live or finished run
  asyncrl dashboard RUN_DIR            a finished run's dashboard (a live run's: the URL it printed)
  asyncrl build-model --out DIR        build the bundled task's tiny model
  asyncrl eval-adapter --hf-checkpoint DIR --adapter DIR ... --prompt-data FILE --rm-type NAME
                                       held-out reward of saved LoRA adapters (and --base)
  asyncrl secrets --run-id ID --out DIR   per-role NATS identities, the server's auth block and a
                                       run token for services started elsewhere (--k8s: Secrets)

Imports stay light until a command runs, so --help is instant.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from functools import partial


def _resolve(prog: str, argv: list[str], sync: bool):
    """Parse and validate a training command line; returns a RunConfig or exits with 2."""
    from services.common.config import ConfigError
    from services.common.config_load import add_config_arguments, resolve_config, split_passthrough

    desc = (
        "Synchronous RL: generate B groups on the current weights, train, push weights, repeat."
        if sync
        else "Asynchronous RL: one-step overlap, or --fully-async with a continuously fed buffer."
    )
    p = argparse.ArgumentParser(prog=prog, description=desc)
    p.add_argument("--config", dest="config_file", default=None, help="YAML, TOML or JSON file of flag values")
    add_config_arguments(p, skip=("driver",))
    argv, passthrough = split_passthrough(argv)
    args = vars(p.parse_args(argv))
    args |= {f: list(args.get(f, [])) + extra for f, extra in passthrough.items() if extra}
    args["driver"] = "sync" if sync else "async"
    try:
        config = resolve_config(args, args.pop("config_file"))
    except (ConfigError, OSError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if "rollout_batch_size" not in config.flags_set:  # as Miles: no default batch size
        print(f"{prog}: error: --rollout-batch-size is required (prompt groups per training step; e.g. "
              "--rollout-batch-size 16, or --config deploy/configs/quickstart.yaml)", file=sys.stderr)  # fmt: skip
        raise SystemExit(2)
    return config


def _init_run_config(argv: list[str]):
    """init-run's config: --driver-sync (a synchronous run's) is its own flag."""
    return _resolve("asyncrl init-run", [a for a in argv if a != "--driver-sync"], "--driver-sync" in argv)


def _init_run(config) -> int:
    from services.prepare import LaunchError, init_run

    try:
        init_run(config)
    except LaunchError as e:
        print(f"asyncrl init-run: error: {e}", file=sys.stderr)
        return 2
    return 0


def _train(prog: str, config) -> int:
    from services.console import Console
    from services.launcher import LaunchError, format_progress, launch

    console = Console(fallback=format_progress)  # on a terminal: one progress line, updated in place
    try:
        result = launch(config, out=console.write, progress=console.step)
    except KeyboardInterrupt:
        print("interrupted: every process of the run was stopped", file=sys.stderr)
        return 130
    except LaunchError as e:
        print(f"{prog}: run failed: {e}", file=sys.stderr)
        return 1
    finally:
        console.close()
    r0, r1 = result["heldout_reward_step0"], result["heldout_reward_final"]
    print(
        f"done in {result['wall_s']:.0f}s: {result['steps']} steps, final weight version {result['final_weight_version']}"
    )
    if r0 is not None and r1 is not None:
        after = result["heldout_reward_final_after_steps"]
        print(f"held-out reward ({result['heldout_dataset']}): before training {r0:.3f} -> after {after} steps "
              f"{r1:.3f} ({r1 - r0:+.3f})")  # fmt: skip
    elif r1 is None:
        print("no held-out evaluation (set --eval-interval N to evaluate every N steps and at the end)")
    # the last line is the run's result.json (written after the audit), so the two never differ
    from pathlib import Path

    saved = json.loads((Path(result["run_dir"]) / "result.json").read_text())
    print(json.dumps({k: v for k, v in saved.items() if k != "evals"}))
    return 0


def _cmd_build_model(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="asyncrl build-model", description="Build the bundled task's tiny model.")
    p.add_argument("--out", dest="out_dir", metavar="OUT", required=True)
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--warmup-sft-steps", type=int, default=20)
    p.add_argument("--max-position-embeddings", type=int, default=64, help="context length of the model")
    a = p.parse_args(argv)
    from services.tasks.reverse_digits import build_model

    build_model(**vars(a))
    return 0


def _cmd_secrets(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="asyncrl secrets",
        description="Secrets of a run whose services start elsewhere: one NATS identity per role "
        "(nats.json, for --nats-roles-file / $ASYNCRL_NATS_ROLES_FILE), the nats-server authorization "
        "block with exactly each role's subjects (auth.conf, included by deploy/nats-server.conf) and a "
        "run token (run-token), each mode 0600. Existing files are kept.",
    )
    p.add_argument("--run-id", required=True)
    g = p.add_mutually_exclusive_group(required=True)
    g.add_argument("--out", help="directory to write them to (mode 0700)")
    g.add_argument("--k8s", action="store_true", help="print them as Kubernetes Secrets (kubectl apply -f -)")
    a = p.parse_args(argv)
    from asyncrl_proto.subjects import check_run_id
    from services.common.natsauth import k8s_secrets, write_deploy_secrets

    try:
        check_run_id(a.run_id)
    except ValueError as e:
        print(f"asyncrl secrets: {e}", file=sys.stderr)
        return 2
    if a.k8s:
        print(k8s_secrets(a.run_id), end="")
    else:
        write_deploy_secrets(a.run_id, a.out)
        print(f"wrote nats.json, auth.conf and run-token to {a.out} (mode 0600)", file=sys.stderr)
    return 0


def _service_args(argv: list[str]) -> tuple[str, list[str]]:
    """`asyncrl service NAME ...`: (NAME, its flags) once its parser took them, or the usage without a NAME."""
    from services.common.entry import SERVICES, service_parser

    if not argv or argv[0] not in SERVICES:
        asked = bool(argv) and argv[0] in ("-h", "--help")
        print(
            f"usage: asyncrl service {{{','.join(SERVICES)}}} --nats-url URL --run-id ID\n\n"
            "Runs one service alone against a NATS server (docker compose, Kubernetes). "
            "`asyncrl service NAME --help` lists its flags.",
            file=sys.stdout if asked else sys.stderr,
        )
        raise SystemExit(0 if asked else 2)
    service_parser(argv[0]).parse_args(argv[1:])  # service_main parses them again: it also runs a service alone
    return argv[0], argv[1:]


COMMANDS = {
    "train": (partial(_resolve, "asyncrl train", sync=True), partial(_train, "asyncrl train")),
    "train-async": (partial(_resolve, "asyncrl train-async", sync=False), partial(_train, "asyncrl train-async")),
    "init-run": (_init_run_config, _init_run),
    "service": (_service_args, lambda a: importlib.import_module("services.common.entry").service_main(*a)),
    "engine": (lambda module: module.parse_args, "services.engine.__main__"),
    "audit": (None, "services.audit"),
    "status": (None, "services.dashboard.status"),
    "dashboard": (lambda module: module.parser().parse_args, "services.dashboard.__main__"),
    "build-model": (None, _cmd_build_model),
    "eval-adapter": (lambda module: module.parser().parse_args, "services.eval.adapter_eval"),
    "secrets": (None, _cmd_secrets),
}
"""Each command: (parse, run). run(parse(argv)) runs it; parse alone (check_argv's) exits on an invalid command line;
None: run parses argv itself. A module's name as run: its main(argv) parses argv and runs it (imported only then), and
parse(module) gives the module's own parse step."""


def check_argv(argv: list[str]) -> None:
    """Parse a command line with the real parsers without running anything (SystemExit on an
    invalid one). Used to check that deploy files only run real commands with valid flags."""
    cmd, rest = argv[0], argv[1:]
    parse, run = COMMANDS.get(cmd, (None, None))
    if cmd == "secrets":  # its parser is _cmd_secrets's own: here only the flag it needs
        if "-h" in rest or "--help" in rest or "--run-id" not in rest:
            raise SystemExit("asyncrl secrets needs --run-id")
    elif parse is None:
        raise SystemExit(f"unknown command {cmd!r}")
    elif isinstance(run, str):  # a module's command: parse(module) is its parse step
        parse(importlib.import_module(run))(rest)
    else:
        parse(rest)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(__doc__.strip())
        return 0
    if argv[0] not in COMMANDS:
        print(f"asyncrl: unknown command {argv[0]!r}; commands: {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    parse, run = COMMANDS[argv[0]]
    if isinstance(run, str):
        return importlib.import_module(run).main(argv[1:]) or 0
    return run(parse(argv[1:]) if parse else argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main())
