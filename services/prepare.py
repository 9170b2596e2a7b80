"""Preparing a run before any service starts: its id and directory, the task's data and tiny
model, every dataset read and checked, the run token and the NATS identities of each role.

`prepare_run` is shared by the launcher and `asyncrl init-run` (which prepares a run for
services started elsewhere: docker compose, Kubernetes, Ray); `prepare_launch` adds what the
launcher needs besides (the run token, each role's NATS identity and the embedded server's
authorization), so that the launcher only starts processes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib
import json
import time
import uuid
from pathlib import Path

from asyncrl_proto.subjects import check_run_id
from services.common.config import RunConfig
from services.common.natsauth import ROLES, server_auth_conf
from services.common.secrets import (
    NatsCredentials,
    SecretError,
    keep_or_make_passwords,
    keep_or_make_token,
    load_roles_file,
    run_token_from_env,
)
from services.supervisor import LaunchError

BUNDLED = {
    "reverse-digits": "services.tasks.reverse_digits",
    "reverse-longtail": "services.tasks.reverse_longtail",
    "calculator": "services.tasks.calculator",
}
"""The bundled tasks that write their own data (write_datasets, NAME) and build the digit model
(build_model); the calculator builds the character model itself (build_task_model)."""


def prepare_run(config: RunConfig, log=print) -> RunConfig:
    """Resolve run id and directory, write the task's data and build its model when needed."""
    run_id = check_run_id(config.infra.run_id or time.strftime("run-%Y%m%d-%H%M%S-") + uuid.uuid4().hex[:4])
    run_dir = Path(config.infra.run_dir or Path("runs") / run_id).resolve()
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    updates: dict = {"run_id": run_id, "run_dir": str(run_dir)}
    paths = ("save", "save_hf", "load", "eval_hf_dir", "prompt_data")  # services may run elsewhere
    updates |= {f: str(Path(config.flag(f)).resolve()) for f in paths if config.flag(f)}
    if config.eval.config:  # inlined, with absolute paths: every service reads the same document
        updates.update(inline_eval_config(config))
    d = config.data
    given_eval = bool(config.eval.prompt_data or config.eval.config)
    written = None  # (the held-out set's name, the training file, the held-out file)
    if d.task in BUNDLED and (d.prompt_data is None or not given_eval):
        task = importlib.import_module(BUNDLED[d.task])
        written = (task.NAME, *task.write_datasets(run_dir / "data", seed=d.rollout_seed))
    elif d.task == "reasoning-gym" and (d.prompt_data is None or not given_eval):
        from services.tasks import reasoning_gym

        try:
            train, held_out = reasoning_gym.write_datasets(run_dir / "data", d.rg_dataset, d.rg_options, d.rg_size,
                                                           d.rg_eval_size, d.rollout_seed, d.rg_scoring)  # fmt: skip
        except (reasoning_gym.MissingExtra, ValueError, TypeError, KeyError) as e:
            raise LaunchError(f"--task reasoning-gym --rg-dataset {d.rg_dataset}: {e}") from None
        log(f"reasoning-gym {d.rg_dataset}: {d.rg_size} training and {d.rg_eval_size} held-out prompts")
        written = (d.rg_dataset, train, held_out)
    if written:
        name, train, held_out = written
        if d.prompt_data is None:
            updates["prompt_data"] = str(train)
        if not given_eval:
            updates["eval_prompt_data"] = [name, str(held_out)]
    rows = check_datasets(config.model_copy(update=updates))
    check_sinks(config)
    if config.rollout.num_rollout is None and config.rollout.data_source_path:
        raise LaunchError("--data-source-path needs --num-rollout: a custom data source has no epochs to count")
    if config.rollout.num_rollout is None:
        updates["num_rollout"] = steps_of_epochs(config, rows)
        updates["num_rollout_per_epoch"] = rows // config.rollout.batch_size
        log(f"--num-epoch {config.rollout.num_epoch}: {rows} prompts per epoch -> {updates['num_rollout']} steps")
    if d.hf_checkpoint is None:
        model_dir = run_dir / "model" / "initial"
        if not (model_dir / ".complete").exists():
            build_task_model(config.model_copy(update=updates), model_dir, log)
        updates["hf_checkpoint"] = str(model_dir)
    else:
        updates["hf_checkpoint"] = str(Path(d.hf_checkpoint).resolve())
    return config.model_copy(update=updates)


def build_task_model(config: RunConfig, model_dir: Path, log) -> None:
    """The task's tiny model: the digit Llama, or for reasoning-gym a character-level one
    warm-started on training (question, answer) pairs, its context fitting the longest pair; for
    the calculator a character-level one warm-started on right answers, some through a call."""
    d = config.data
    if d.task in ("calculator", "reasoning-gym"):
        from services.data.source import load_rows
        from services.tasks.char_model import build_char_model

        rows = load_rows(d.prompt_data, d.input_key, d.label_key, None)
        if d.task == "calculator":
            from services.tasks.calculator import warm_start_pairs

            pairs, context = warm_start_pairs(rows, d.seed), 64
        else:
            pairs = [(str(r["prompt"]), str(r["label"])) for r in rows]
            held_out = [str(r["prompt"]) for f in config.eval.prompt_data[1::2]  # NAME PATH pairs
                        for r in load_rows(f, "prompt", None, None)]  # its prompts must fit too  # fmt: skip
            prompts = [p for p, _ in pairs] + held_out
            longest = max(map(len, prompts)) + max(len(a) for _, a in pairs) + config.rollout.max_response_len
            context = max(128, 1 << (longest + 1).bit_length())  # the least power of two >= longest + 2
        build_char_model(model_dir, pairs, seed=d.seed, warmup_sft_steps=d.warmup_sft_steps, context=context, log=log)
        return
    task = importlib.import_module(BUNDLED[d.task])
    task.build_model(model_dir, seed=d.seed, warmup_sft_steps=d.warmup_sft_steps, log=log)


def steps_of_epochs(config: RunConfig, rows: int) -> int:
    """Miles's step count for --num-epoch: (prompts // B) steps per epoch, times the epochs (a
    partial batch at an epoch's end is not a step). A run names its length: no default."""
    if config.rollout.num_epoch is None:
        raise LaunchError("set the run's length: --num-rollout N (training steps) or --num-epoch E (passes over "
                          "--prompt-data, each of prompts // --rollout-batch-size steps)")  # fmt: skip
    steps = rows // config.rollout.batch_size * config.rollout.num_epoch
    if steps < 1:
        raise LaunchError(f"--num-epoch {config.rollout.num_epoch}: {rows} prompts make no batch of "
                          f"--rollout-batch-size {config.rollout.batch_size}; set --num-rollout or a smaller "
                          "--rollout-batch-size")  # fmt: skip
    return steps


def inline_eval_config(config: RunConfig) -> dict:
    """--eval-config as an inline document with absolute dataset paths, and the pairs it names
    as --eval-prompt-data (as Miles sets them)."""
    import base64

    from services.eval.datasets import dataset_entries, read_document

    try:
        doc = read_document(config.eval.config)
        entries, defaults = dataset_entries(doc)
    except ValueError as e:
        raise LaunchError(str(e)) from None
    entries = [e | {"path": str(Path(e["path"]).resolve())} if "path" in e else e for e in entries]
    text = json.dumps({"eval": {"defaults": defaults, "datasets": entries}})
    return {"eval_config": "base64:" + base64.b64encode(text.encode()).decode(),
            "eval_prompt_data": [x for e in entries for x in (str(e["name"]), e.get("path", ""))]}  # fmt: skip


def check_sinks(config: RunConfig) -> None:
    """A metrics sink asked for whose package is missing fails the launch, not the trainer."""
    import importlib.util

    for flag, wanted, package in (("--use-tensorboard", config.trainer.use_tensorboard, "tensorboard"),
                                  ("--use-wandb", config.trainer.use_wandb, "wandb")):  # fmt: skip
        if wanted and importlib.util.find_spec(package) is None:
            raise LaunchError(f"{flag} needs the {package} package: pip install {package}")


def check_datasets(config: RunConfig) -> int:
    """Read every dataset of the run before any service starts; a bad row is an error naming its
    file and line (not a buffer that crashes three times). Returns the prompts per epoch."""
    from services.common.config.rm_types import row_rm_type_check
    from services.data.source import load_rows
    from services.eval.datasets import load_eval_sets

    r, d = config.rollout, config.data
    check = None if r.custom_rm_path else row_rm_type_check(bool(r.rm_url))  # a custom reward reads rm_type itself
    try:
        rows = load_rows(d.prompt_data, d.input_key, d.label_key, d.metadata_key, check, d.tool_key)
        load_eval_sets(config, check)
    except ValueError as e:
        raise LaunchError(str(e)) from None
    return len(rows)


def role_credentials(config: RunConfig, roles: tuple[str, ...] = ROLES) -> dict[str, NatsCredentials]:
    """The NATS identity of each of `roles` on an external server: from --nats-roles-file, or the
    one identity the launcher was given (--nats-user/--nats-password, --nats-token, --nats-creds,
    --nats-nkey)."""
    tls = (config.infra.nats_tls_ca, config.infra.nats_tls_cert, config.infra.nats_tls_key)
    if config.infra.nats_roles_file:
        try:
            given = load_roles_file(config.infra.nats_roles_file)
        except SecretError as e:
            raise LaunchError(str(e)) from None
        # the engine's identity only matters when engines fetch weights or adapters from the object store
        if missing := [r for r in roles if (r != "engine" or config.engines_read_bucket) and r not in given]:
            raise LaunchError(
                f"--nats-roles-file {config.infra.nats_roles_file} has no identity for {', '.join(missing)}"
            )
        return {r: NatsCredentials(**given[r]).with_tls(*tls) for r in roles if r in given}
    one = NatsCredentials(
        user=config.infra.nats_user,
        password=config.infra.nats_password.get_secret_value() if config.infra.nats_password else None,
        token=config.infra.nats_token.get_secret_value() if config.infra.nats_token else None,
        creds_file=config.infra.nats_creds,
        nkey_file=config.infra.nats_nkey,
    ).with_tls(*tls)
    return dict.fromkeys(roles, one)


@dataclasses.dataclass(frozen=True)
class Prepared:
    """Everything a launched run needs before its first process starts."""

    config: RunConfig
    run_token: str
    creds: dict[str, NatsCredentials]
    """Each role's NATS identity."""
    nats_auth: str | None
    """The embedded NATS server's authorization block (None: the run uses --nats-url's server)."""


def prepare_launch(config: RunConfig, log=print) -> Prepared:
    """The run prepared (prepare_run), its token, and the NATS identities of its roles: the
    operator's (--nats-url: from the flags or --nats-roles-file), or new per-role passwords for
    the embedded server, kept across restarts of the same run directory."""
    from services.raycluster import with_ray_defaults

    config = prepare_run(with_ray_defaults(config), log=log)
    infra = config.infra
    secrets_dir = Path(infra.run_dir) / "secrets"
    # the run token: given (--run-token, $ASYNCRL_RUN_TOKEN or $ASYNCRL_RUN_TOKEN_FILE), kept from an earlier
    # start of the same run directory, or new; always in <run_dir>/secrets/run-token (0600) for the operator
    given = infra.run_token.get_secret_value() if infra.run_token else run_token_from_env()
    token = keep_or_make_token(secrets_dir / "run-token", given)
    if infra.nats_url:
        if infra.nats_cluster > 1:
            raise LaunchError("--nats-cluster starts an embedded cluster; with --nats-url the cluster is yours: "
                              "drop --nats-cluster and set --nats-replicas to its size")  # fmt: skip
        # the registry's identity is needed only with multi-LoRA (older roles files lack it)
        roles = tuple(r for r in ROLES if r != "adapters" or config.multi_lora.n_adapters > 0)
        return Prepared(config, token, role_credentials(config, roles), None)
    # kept across restarts of the same run directory (its store and its services must still match)
    passwords = keep_or_make_passwords(secrets_dir / "nats.json", ROLES)
    creds = {r: NatsCredentials(user=r, password=p) for r, p in passwords.items()}
    return Prepared(config, token, creds, server_auth_conf(infra.run_id, passwords))


async def publish_run_config(config: RunConfig) -> None:
    """Create the run's streams and write its resolved config to KV, for services started
    elsewhere (docker compose, Kubernetes, Ray) with `asyncrl service NAME`."""
    from services.common.bus import Bus

    creds = role_credentials(config, ("admin",))["admin"]
    bus = await Bus.connect(config.infra.nats_url, config.infra.run_id, "init-run", connect_timeout_s=120, creds=creds)
    try:
        await create_streams(bus, config)
    finally:
        await bus.close()


async def create_streams(bus, config: RunConfig) -> None:
    """The run's streams and consumers, and its resolved config in KV, where every service reads it."""
    lora = config.multi_lora.n_adapters > 0
    await bus.ensure_streams(config.infra.stream_replicas, lora, config.rollouts_max_msgs)
    await bus.ensure_consumers(config.async_.prompt_ack_wait_s, lora)
    await bus.kv_put("config", json.dumps(config.model_dump(mode="json")).encode())


def init_run(config: RunConfig, log=print) -> None:
    if not config.infra.nats_url:
        raise LaunchError("init-run needs --nats-url: the services it prepares for read their config from NATS")
    if not config.infra.rollout_engine_urls and not config.infra.rollout_external_engine_addrs:
        raise LaunchError(
            "init-run needs --rollout-engine-urls (or --rollout-external-engine-addrs): where the engines listen"
        )
    config = prepare_run(config, log=log)
    if not config.infra.rollout_engine_urls:
        from services.common.sglang_client import normalize_url

        config = config.model_copy(
            update={"rollout_engine_urls": [normalize_url(a) for a in config.infra.rollout_external_engine_addrs]}
        )
    (Path(config.infra.run_dir) / "config.json").write_text(json.dumps(config.model_dump(mode="json"), indent=2))
    asyncio.run(publish_run_config(config))
    log(f"run {config.infra.run_id} prepared in {config.infra.run_dir}; config published to {config.infra.nats_url}")
