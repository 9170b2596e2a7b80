"""Start one service alone: `asyncrl service <name> --nats-url URL --run-id ID`.

The resolved run config is read from the run's KV bucket (the launcher writes it), or from
`--config-file`. The service's NATS identity and the run token come from its environment
(services.common.secrets), never from its command line. Heavy imports happen after argument
parsing so that --help is instant.

Exit codes: 0 stopped; 78 (EXIT_FATAL) for what no restart can fix (refused credentials, a TLS
failure, an invalid configuration or secret, a full disk), with the reason on the last log line;
anything else is a crash, and the launcher restarts the service.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib
import json
import logging
import sys
import time

from services.common.procs import EXIT_FATAL, apply_cpu_affinity_from_env  # light: the standard library only

SERVICES = {
    "buffer": "services.buffer.service:BufferService",
    "rollout": "services.rollout.service:RolloutService",
    "trainer": "services.trainer.service:TrainerService",
    "weight-sync": "services.weightsync.service:WeightSyncService",
    "eval": "services.eval.service:EvalService",
    "adapters": "services.adapters.service:AdapterService",
}

log = logging.getLogger("asyncrl.entry")


def service_parser(name: str | None = None) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"asyncrl service {name or '<name>'}")
    p.add_argument("--nats-url", required=True, help="NATS server URL")
    p.add_argument("--run-id", required=True, help="run id (NATS names carry it)")
    p.add_argument("--http-host", default="127.0.0.1", help="address for this service's HTTP endpoints")
    p.add_argument("--http-port", type=int, default=0, help="port for HTTP (0: any free port)")
    p.add_argument("--instance-id", default=None, help="unique id of this replica")
    p.add_argument("--config-file", default=None, help="resolved run config (default: read from the run's KV)")
    p.add_argument("--config-wait-s", type=float, default=60.0, help="how long to wait for the run config in KV")
    return p


async def _load_config(bus, args):
    from services.common.bus import BusError
    from services.common.config import RunConfig
    from services.common.config_load import read_config_file

    if args.config_file:
        return RunConfig(**read_config_file(args.config_file))
    deadline = time.monotonic() + args.config_wait_s
    while True:
        try:
            raw = await bus.kv_get("config")
        except BusError:  # the run is not prepared yet (init-run creates its bucket)
            raw = None
        if raw is not None:
            return RunConfig(**json.loads(raw))
        if time.monotonic() > deadline:
            raise SystemExit(
                f"no run config in KV bucket {bus.subjects.kv_bucket} after {args.config_wait_s:.0f}s: "
                "start the run with `asyncrl train-async ...` or pass --config-file"
            )
        log.info("waiting for the run config in KV bucket %s", bus.subjects.kv_bucket)
        await asyncio.sleep(1.0)


async def _run(name: str, args) -> None:
    from services.common.bus import Bus
    from services.common.runtime import setup_logging

    bus = await Bus.connect(args.nats_url, args.run_id, name)
    config = await _load_config(bus, args)
    setup_logging(config.infra.log_level, name)
    module_name, cls_name = SERVICES[name].split(":")
    cls = getattr(importlib.import_module(module_name), cls_name)
    await cls(config, bus, instance_id=args.instance_id, http_host=args.http_host, http_port=args.http_port).run()


def service_main(name: str, argv: list[str] | None = None) -> None:
    if name not in SERVICES:
        raise SystemExit(f"unknown service {name!r}: choose one of {', '.join(SERVICES)}")
    args = service_parser(name).parse_args(argv)
    from asyncrl_proto.subjects import check_run_id
    from services.common.secrets import install_log_redaction

    apply_cpu_affinity_from_env()
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s %(levelname)s [{name}] %(message)s")
    check_run_id(args.run_id)
    install_log_redaction()
    try:  # uvloop where installed: its cheaper loop and sockets shorten each hop of the services' small messages
        from uvloop import run
    except ImportError:
        run = asyncio.run
    try:
        run(_run(name, args))
    except KeyboardInterrupt:
        pass
    except Exception as e:
        if (reason := fatal_reason(e)) is None:
            raise
        log.error("%s cannot run: %s", name, reason)
        sys.exit(EXIT_FATAL)
    sys.exit(0)


def fatal_reason(e: BaseException) -> str | None:
    """What no restart can fix, as one line; None for anything else (a crash: restart it)."""
    import errno

    from pydantic import ValidationError

    from services.common.bus import BusAuthError, StoreFull
    from services.common.config import ConfigError
    from services.common.secrets import SecretError

    if isinstance(e, BaseExceptionGroup):  # from the service's TaskGroup
        return next((r for sub in e.exceptions if (r := fatal_reason(sub))), None)
    if isinstance(e, (BusAuthError, StoreFull, SecretError, ConfigError, ValidationError)):
        return str(e)
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return f"no space left on the device writing {e.filename or 'a file'}: {e}"
    cause = e.__cause__ or e.__context__
    return fatal_reason(cause) if cause is not None and cause is not e else None
