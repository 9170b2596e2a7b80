"""A run's directory as other tools find it after (or beside) the launcher: its config, its admin
NATS identity, and a nats-server on its stopped store (`asyncrl audit`, `asyncrl dashboard`)."""

from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path

from asyncrl_proto import AdapterRegistryState

_REGISTRATION_ID = re.compile(r"[0-9a-f]{32}")
"""A registration id (the registry's uuid4 hex): what a directory under RUN_DIR/adapters/<name>/ must be named."""


def admin_credentials(run_dir: Path):
    """The admin identity of a run whose embedded server the launcher started (its secrets
    directory), else whatever the environment gives (ASYNCRL_NATS_*)."""
    from services.common.secrets import NatsCredentials, load_roles_file

    path = run_dir / "secrets" / "nats.json"
    admin = load_roles_file(path).get("admin") if path.exists() else None
    return NatsCredentials(**admin) if admin else NatsCredentials.from_env("admin")


def run_config(run_dir: Path) -> dict:
    cfg_path = run_dir / "config.json"
    if not cfg_path.exists():
        raise FileNotFoundError(f"{cfg_path} not found: is {run_dir} a run directory?")
    return json.loads(cfg_path.read_text())


@contextlib.contextmanager
def store_server(run_dir: Path, store: Path | None = None, log_name: str = "audit-nats-server",
                 log_dir: Path | None = None):  # fmt: skip
    """A nats-server on a stopped run's store (RUN_DIR/nats, or `store`: a copy of it; its log in
    `log_dir`, by default RUN_DIR/logs), behind the run's own users (its secrets directory), on
    free ports: the same server or cluster the launcher ran (a cluster's nodes find each other again)."""
    cfg = run_config(run_dir)
    url, run_id = cfg.get("nats_url"), cfg["run_id"]
    store = store or run_dir / "nats"
    if not ((store / "jetstream").exists() or (store / "node-0" / "jetstream").exists()):
        raise RuntimeError(f"the run's NATS server at {url} does not answer and {store} holds no store")
    from services.common.natsauth import server_auth_conf
    from services.common.natsserver import local_nats
    from services.common.secrets import load_roles_file

    auth = ""
    if (roles := run_dir / "secrets" / "nats.json").exists():
        auth = server_auth_conf(run_id, {r: e["password"] for r, e in load_roles_file(roles).items()})
    with local_nats(store, log_dir or run_dir / "logs", auth, nodes=cfg.get("nats_cluster", 1), run_id=run_id,
                    max_file_store=cfg.get("nats_max_file_store"), log_name=log_name) as srv:  # fmt: skip
        yield srv


def registrations(registry: AdapterRegistryState, run_dir: Path) -> list[tuple[str, str, str]]:
    """(name, registration id, state) of every registration to audit: those the registry holds,
    and those it pruned (its oldest completed ones) that the trainer kept a directory for
    (RUN_DIR/adapters/<name>/<registration>), as "completed (pruned from the registry)"."""
    out = [(r.name, r.registration_id, r.state.value) for r in registry.runs]
    known = {rid for _, rid, _ in out}
    return out + [(d.parent.name, d.name, "completed (pruned from the registry)")
                  for d in sorted((run_dir / "adapters").glob("*/*"))
                  if d.is_dir() and _REGISTRATION_ID.fullmatch(d.name) and d.name not in known]  # fmt: skip


def num(v, fmt: str = "{:.3f}") -> str:
    """A run record's figure as text, or "-" where the record has no number."""
    return fmt.format(v) if isinstance(v, (int, float)) else "-"
