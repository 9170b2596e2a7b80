from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, SecretStr

from asyncrl_proto.subjects import check_run_id
from services.common.config.base import Section
from services.common.engine_commands import TOOL_CALL_PARSERS, launcher_flags_problem, tool_call_parser


class InfraSection(Section):
    """The run and its infrastructure: ids, the bus, HTTP, engines, processes (launcher, every service)."""

    driver: Literal["sync", "async"] = Field(
        "async",
        description="Set by the command: `train` is the synchronous driver, `train-async` the "
        "one-step / fully-async driver.",
    )
    fully_async: bool = Field(
        False, description="Fully async: producers fill the buffer continuously (train-async only)."
    )
    run_id: Annotated[str, AfterValidator(check_run_id)] | None = Field(
        None, description="Run id used in every NATS name; default: derived from the start time."
    )
    run_dir: str | None = Field(
        None, description="Directory for snapshots, checkpoints, metrics and logs; default runs/<run-id>."
    )
    nats_url: str | None = Field(
        None,
        description="NATS server to use (nats:// or tls://). Unset: start an embedded nats-server with "
        "JetStream on a free port of 127.0.0.1, its store under the run directory, one generated identity "
        "per service role. Credentials in the URL are moved to --nats-user / --nats-password (never stored).",
    )
    nats_user: str | None = Field(
        None,
        exclude=True,
        description="NATS user (with --nats-password) of the launcher and, unless "
        "--nats-roles-file gives each role its own identity, of every service.",
    )
    nats_password: SecretStr | None = Field(
        None,
        exclude=True,
        description="NATS password. Secret: prefer $ASYNCRL_NATS_PASSWORD; never stored, "
        "printed or put on a child's command line.",
    )
    nats_token: SecretStr | None = Field(
        None, exclude=True, description="NATS token. Secret: prefer $ASYNCRL_NATS_TOKEN; never stored or printed."
    )
    nats_creds: str | None = Field(
        None, exclude=True, description="NATS user credentials file (.creds: JWT and NKey seed)."
    )
    nats_nkey: str | None = Field(None, exclude=True, description="NATS NKey seed file.")
    nats_roles_file: str | None = Field(
        None,
        exclude=True,
        description="JSON file with one NATS identity per role for a server with per-role "
        "permissions: {role: {user, password} | {token} | {creds} | {nkey}}, roles admin (launcher), buffer, "
        "trainer, rollout, weight-sync, eval, and adapters with --multi-lora-n-adapters (`asyncrl secrets` writes one, "
        "with the matching server config).",
    )
    nats_tls_ca: str | None = Field(
        None, exclude=True, description="TLS: CA bundle that signs the NATS server's certificate (use a tls:// URL)."
    )
    nats_tls_cert: str | None = Field(None, exclude=True, description="TLS: client certificate (mutual TLS).")
    nats_tls_key: str | None = Field(None, exclude=True, description="TLS: client key (mutual TLS).")
    nats_max_file_store: int | None = Field(
        None,
        gt=0,
        description="Embedded nats-server: cap on its JetStream store, in bytes (unset: the server's "
        "default, most of the disk). A full store stops the run with an error that names it.",
    )
    nats_sync: str | None = Field(
        None,
        description="Embedded nats-server: how often JetStream fsyncs its store, `always` (every write: "
        "nothing acknowledged is lost even when the machine crashes) or an interval like 1s (a machine crash may "
        "lose that much). Unset: the server's default, 2m. A process crash never loses an acknowledged write.",
    )
    nats_cluster: int = Field(
        1,
        ge=1,
        le=7,
        description="Embedded NATS: start this many nats-server nodes joined into one JetStream cluster on "
        "loopback ports (3 survives the loss of any one node; 2 would lose its quorum with either). 1: one server. "
        "Not with --nats-url (a cluster of your own: set --nats-replicas to its size).",
    )
    nats_replicas: int | None = Field(
        None,
        ge=1,
        le=5,
        description="Replicas of every stream and the KV bucket of the run (JetStream's num_replicas). "
        "Unset: 3 on an embedded cluster of 3 or more nodes, else 1. On a NATS cluster of your own (--nats-url), "
        "set it to that cluster's size (at most 5).",
    )
    run_token: SecretStr | None = Field(
        None,
        exclude=True,
        description="The run token: `Authorization: Bearer <token>` on every protected HTTP "
        "route of the services and the built-in engines. Secret: prefer $ASYNCRL_RUN_TOKEN; generated when unset "
        "and kept in <run_dir>/secrets/run-token (mode 0600).",
    )
    http_auth_probes: bool = Field(
        False,
        description="Also require the run token on /metrics, /healthz and /readyz (open by default, for "
        "probes and scrapers).",
    )
    health_restart_s: float = Field(
        60.0,
        ge=0,
        description="The launcher restarts a service or engine whose health check has failed for this "
        "long (0: only when it exits).",
    )
    max_failed_ratio: float = Field(
        0.5,
        ge=0,
        le=1,
        description="Stop the run with the cause when more than this share of the samples of "
        "the last 4 steps FAILED (a reward function that raises, a non-finite reward, a generation that "
        "failed every retry). 1 never stops.",
    )
    engine: Literal["builtin", "sglang"] = Field(
        "builtin", description="Inference engines: asyncrl's built-in CPU/GPU engine or SGLang."
    )
    rollout_num_engines: int = Field(1, ge=0, description="Number of engines the launcher starts.")
    rollout_external_engine_addrs: list[str] = Field(
        default_factory=list, description="Attach to running engines (host:port or URLs) instead of launching any."
    )
    rollout_engine_urls: list[str] = Field(
        default_factory=list,
        description="Resolved engine URLs (set by the launcher from the engines it started or "
        "from --rollout-external-engine-addrs); producers and weight-sync use these.",
    )
    rollout_num_gpus_per_engine: int = Field(
        1,
        ge=1,
        description="SGLang engines: GPUs per engine (its tensor-parallel size unless --sglang-tp-size says otherwise).",
    )
    use_sglang_router: bool = Field(
        False, description="SGLang engines: launch the SGLang router in front of them; producers generate through it."
    )
    sglang_server_args: list[str] = Field(
        default_factory=list,
        description="Extra `sglang.launch_server` arguments, collected from every --sglang-<flag> on the "
        "command line (e.g. --sglang-mem-fraction-static 0.5 -> --mem-fraction-static 0.5).",
    )
    sglang_router_args: list[str] = Field(
        default_factory=list,
        description="Extra router arguments, collected from every --router-<flag> (e.g. --router-policy cache_aware).",
    )
    rollout_router_url: str | None = Field(
        None, description="Resolved router URL (set by the launcher); producers send /generate there when set."
    )
    rollout_num_producers: int = Field(
        1, ge=0, description="Rollout producer processes the launcher starts (more can join at any time)."
    )
    engine_max_running_requests: int = Field(
        256, ge=1, description="Built-in engine: requests decoded together in one running batch."
    )
    http_host: str = Field(
        "127.0.0.1",
        description="Where the launcher's dashboard binds (default: this machine only; 0.0.0.0 to reach it from "
        "elsewhere, behind the run token).",
    )
    dashboard: bool = Field(
        True, description="The launcher serves the run's dashboard (docs/dashboard.md); --no-dashboard: none."
    )
    dashboard_port: int = Field(0, ge=0, le=65535, description="The dashboard's port (0: a free one, printed).")
    service_restarts: int = Field(
        3,
        ge=0,
        description="The launcher restarts a crashed service (or its nats-server) up to this many times "
        "within --restart-window-s.",
    )
    restart_window_s: float = Field(
        600.0, gt=0, description="Restarts older than this no longer count against --service-restarts."
    )
    pin_cpus: bool = Field(
        False,
        description="Pin the built-in engines to the lower half of the CPUs and the trainer to the upper half, "
        "so that generation and training do not take cores from each other (as on separate GPUs).",
    )
    torch_num_threads: int = Field(1, ge=1, description="torch intra-op threads per torch process (engine, trainer).")
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field("INFO", description="Log level.")

    def problems(self) -> list[str]:
        errs = []
        if self.engine == "builtin" and not self.rollout_external_engine_addrs:
            name = tool_call_parser(self.sglang_server_args)
            if name is not None and name not in TOOL_CALL_PARSERS:
                errs.append(f"--sglang-tool-call-parser {name!r}: the built-in engine knows {', '.join(TOOL_CALL_PARSERS)} "
                            "(the <tool_call> JSON blocks of Qwen and Hermes templates); other parsers need "
                            "--engine sglang")  # fmt: skip
        problem = launcher_flags_problem(self.sglang_server_args, "--sglang-", "the launcher")
        if problem and self.engine == "sglang" and not self.rollout_external_engine_addrs:
            errs.append(problem)
        if self.nats_sync is not None and not re.fullmatch(r"always|\d+(ms|s|m|h)", self.nats_sync):
            errs.append(f"--nats-sync must be `always` or an interval like 500ms, 1s, 2m (got {self.nats_sync!r})")
        if self.nats_cluster == 2:
            errs.append("--nats-cluster 2 loses its JetStream quorum when either node stops: use 3 (or 1)")
        if not self.nats_url and self.nats_replicas and self.nats_replicas > self.nats_cluster:
            errs.append(f"--nats-replicas {self.nats_replicas} needs as many NATS nodes: add --nats-cluster "
                        f"{max(3, self.nats_replicas)} (the embedded server is {self.nats_cluster} node(s))")  # fmt: skip
        if self.nats_tls_key and not self.nats_tls_cert:
            errs.append("--nats-tls-key needs --nats-tls-cert (the client certificate it belongs to)")
        if self.fully_async and self.driver == "sync":
            errs.append("--fully-async requires the async driver: run train-async")
        if self.rollout_num_engines < 1 and not self.rollout_external_engine_addrs:
            errs.append("--rollout-num-engines must be >= 1 unless --rollout-external-engine-addrs is set")
        return errs

    @property
    def mode(self) -> Literal["sync", "one_step", "fully_async"]:
        if self.driver == "sync":
            return "sync"
        return "fully_async" if self.fully_async else "one_step"

    @property
    def engines_take_one_key(self) -> bool:
        """SGLang servers (launched or external) take one --api-key for every route: the roles
        that call them send the run token, not their own (services.common.httpauth)."""
        return self.engine == "sglang" or bool(self.rollout_external_engine_addrs)

    @property
    def stream_replicas(self) -> int:
        """Replicas of the run's streams and buckets: --nats-replicas, else 3 on an embedded
        cluster (one node may die), else 1."""
        if self.nats_replicas is not None:
            return self.nats_replicas
        return 3 if self.nats_cluster >= 3 else 1
