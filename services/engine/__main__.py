"""python -m services.engine --model-path DIR --port P: the built-in SGLang-compatible engine."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile

from services.common.engine_commands import TOOL_CALL_PARSERS


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="asyncrl engine", description=__doc__)
    p.add_argument("--model-path", required=True, help="HF checkpoint directory")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--weight-version", default="default", help="initial weight version (SGLang's default is 'default')")
    p.add_argument("--max-running-requests", type=int, default=256)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--random-seed", type=int, default=0)
    p.add_argument("--torch-num-threads", type=int, default=1)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--log-level", default="warning")
    p.add_argument("--tool-call-parser", choices=TOOL_CALL_PARSERS, default=None,
                   help="answer a chat request's tool calls as OpenAI's message.tool_calls (SGLang's flag; qwen25 "
                   "and hermes: <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>)")  # fmt: skip
    p.add_argument(
        "--api-key",
        default=None,
        help="every route but /health, /health_generate and /metrics needs `Authorization: Bearer <key>` "
        "(SGLang's flag; prefer $ASYNCRL_RUN_TOKEN, which keeps the key off the command line)",
    )
    p.add_argument("--disable-staged-weight-loading", action="store_true",
                   help="load new weights only inside update_weights_from_disk, as an SGLang server does (staging "
                   "holds a second copy of the weights beside the running one)")  # fmt: skip
    p.add_argument("--nats-url", default=None,
                   help="with --run-id: fetch nats-object:// weights (--update-weight-transfer-mode object-store) from "
                   "the run's bucket, as the read-only NATS identity `engine` (from $ASYNCRL_NATS_*)")  # fmt: skip
    p.add_argument("--run-id", default=None, help="the run this engine serves: the `run` label on /metrics, and with "
                   "--nats-url the run whose weights bucket to read")  # fmt: skip
    p.add_argument("--instance-id", default=None,
                   help="the `instance` label on /metrics (default: <host name>:<port>)")  # fmt: skip
    p.add_argument("--weights-cache-dir", default=None,
                   help="where fetched object-store weights go (default: a temporary directory, removed at exit)")  # fmt: skip
    lora = p.add_argument_group("LoRA (SGLang's flags; services/engine/loras.py)")
    lora.add_argument("--enable-lora", action="store_true", help="serve LoRA adapters (implied by --lora-paths)")
    lora.add_argument("--max-loras-per-batch", type=int, default=8, help="adapters resident at once, each in a slot")
    lora.add_argument("--max-lora-rank", type=int, default=16, help="the largest adapter rank this engine can load")
    lora.add_argument("--lora-target-modules", nargs="+", default=None,
                      help="modules adapters may target (default: all of q,k,v,o,gate,up,down_proj)")  # fmt: skip
    lora.add_argument("--lora-paths", nargs="+", default=[],
                      help="adapters loaded at start: NAME=PATH, PATH, or {\"lora_name\",\"lora_path\",\"pinned\"}")  # fmt: skip
    args = p.parse_args(argv)
    if args.lora_paths:
        args.enable_lora = True
    if args.enable_lora and (args.max_loras_per_batch < 1 or args.max_lora_rank < 1):
        p.error("--max-loras-per-batch and --max-lora-rank must be at least 1")
    if args.nats_url and not args.run_id:
        p.error("--nats-url needs --run-id (the run whose weights bucket to read)")
    return args


def _die(e: BaseException) -> None:
    """The scheduler thread is gone: exit now, non-zero, so that a supervisor restarts us."""
    logging.getLogger("asyncrl.engine").critical("exiting: the scheduler thread died (%r)", e)
    logging.shutdown()
    os._exit(70)


def main(argv=None) -> None:
    args = parse_args(argv)
    from services.common.procs import apply_cpu_affinity_from_env
    from services.common.secrets import install_log_redaction, run_token_from_env

    apply_cpu_affinity_from_env()
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s [engine] %(message)s")
    install_log_redaction([args.api_key] if args.api_key else [])
    import torch
    import uvicorn

    from services.engine.metrics import engine_metrics
    from services.engine.scheduler import Scheduler
    from services.engine.server import EngineServer
    from services.model.hf_io import load_model
    from services.model.tokenizer import Tokenizer

    # All torch work runs on the scheduler's thread at --torch-num-threads; the model loads here
    # at 1 thread, so no second OpenMP team ever shares the cores with it (services/engine/scheduler.py).
    torch.set_num_threads(1)
    model = load_model(args.model_path)
    try:
        tokenizer = Tokenizer(args.model_path)
    except FileNotFoundError:
        tokenizer = None
    sched = Scheduler(
        model,
        max_running_requests=args.max_running_requests,
        context_length=args.context_length,
        weight_version=args.weight_version,
        seed=args.random_seed,
        on_death=_die,
        torch_threads=args.torch_num_threads,
    )
    loras = None
    if args.enable_lora:
        from services.engine.loras import EngineLoras, parse_lora_paths, parse_target_modules

        try:
            targets, initial = parse_target_modules(args.lora_target_modules), parse_lora_paths(args.lora_paths)
        except ValueError as e:
            raise SystemExit(f"error: {e}") from None
        loras = EngineLoras(sched, args.max_loras_per_batch, args.max_lora_rank, targets)
    sched.start()
    for body in initial if loras is not None else []:
        try:
            loras.load(body)
        except ValueError as e:  # BadRequest: a bad adapter given at start is a bad command line
            sched.shutdown()
            raise SystemExit(f"error: --lora-paths: {e}") from None
    from services.common.httpauth import Keys, keys_from_env

    # --api-key: SGLang's one key for everything; else the run's per-role keys from the environment
    keys = Keys.single(args.api_key) if args.api_key else keys_from_env(run_token_from_env())
    weights, temp_cache = None, None
    if args.nats_url:
        from services.engine.weights import ObjectWeights

        cache = args.weights_cache_dir or (temp_cache := tempfile.mkdtemp(prefix="asyncrl-engine-weights-"))
        weights = ObjectWeights(args.nats_url, args.run_id, cache)
    server = EngineServer(sched, args.model_path, tokenizer, args.served_model_name, args.host, args.port,
                          keys=keys, weights=weights, staged_loading=not args.disable_staged_weight_loading, loras=loras,
                          tool_call_parser=args.tool_call_parser)  # fmt: skip
    engine_metrics(server, run=args.run_id, instance=args.instance_id)  # the run and instance labels
    try:
        uvicorn.run(
            server.app,
            host=args.host,
            port=args.port,
            log_level=args.log_level.lower(),
            access_log=False,
            timeout_keep_alive=300,  # producers hold persistent connections
            timeout_graceful_shutdown=3,  # SIGTERM: requests still generating get 3 s, then we exit
        )
    finally:
        sched.shutdown()
        if temp_cache:
            shutil.rmtree(temp_cache, ignore_errors=True)


if __name__ == "__main__":
    main()
