"""The least-privilege bus: one NATS identity per service role, allowed exactly its subjects.

| role | publishes | subscribes to | JetStream |
|---|---|---|---|
| admin (launcher, init-run, audit) | everything | everything | creates the streams and the KV bucket |
| buffer | prompts, ledger, KV buffer_snapshot (and `.<registration>` of each: multi-LoRA) | buffer.get, buffer.commit, weights.live, weights.published, heartbeat.rollout | consumer `buffer` on ROLLOUTS, purges ROLLOUTS and deletes messages from it (the dead-lettered ones), reads LEDGER, ROLLOUTS and the last WEIGHTS message |
| trainer | buffer.get, buffer.commit, weights.published, KV published_version (reads KV adapter_live.*), progress, eval.requests, eval.results, adapters.control (requests) | eval.results, heartbeat.rollout, weights.transfer (answers it) | reads ROLLOUTS, the last WEIGHTS message; writes, reads and purges the weights object bucket |
| rollout | rollouts | control | consumer `producers` on PROMPTS |
| weight-sync | weights.live, KV live_version, weights.transfer (requests) | - | consumer `weight-sync` on WEIGHTS, reads WEIGHTS and the weights object bucket |
| eval | eval.results, control | weights.live | consumer `eval` on EVAL, reads the last WEIGHTS message |
| engine (built-in engine, object-store mode) | - | - | reads the weights object bucket (direct gets only: no consumer, no write) |
| adapters (multi-LoRA registry) | KV adapters | adapters.control (answers it) | reads and writes its KV key only |

Every role may also publish its own heartbeat and dead letters, read the run's config, live
version and published version from KV, look up stream info, and receive replies on its own inbox prefix
(`_INBOX.<run>.<role>`), so no role can read another's replies. Only the buffer, the trainer and
the adapter registry answer requests (`allow_responses`). The admin creates the streams and the durable consumers; a role may only bind
to its own consumer. So a producer's credentials cannot append to the ledger, publish weights,
progress or commits, answer a get, or touch a stream's or a consumer's configuration.

`server_auth_conf` renders this as a nats-server `authorization` block: the launcher writes it
into the embedded server's config with generated passwords, and `asyncrl secrets` writes the
same block for docker compose and Kubernetes.
"""

from __future__ import annotations

import base64
import json
from pathlib import Path
from urllib.parse import quote

from asyncrl_proto.subjects import ADAPTER_LIVE_KV_PREFIX, ADAPTERS_KV_KEY, Subjects, inbox_prefix
from services.common import secrets

ROLES = ("admin", "buffer", "trainer", "rollout", "weight-sync", "eval", "engine", "adapters")
SERVICE_ROLES = ROLES[1:]
JS = "$JS.API"


def _consume(stream: str, durable: str) -> list[str]:
    """A durable consumer of one stream that the admin created: look it up, pull from it,
    acknowledge. Not create or update it: no role changes how its consumer redelivers."""
    return [
        f"{JS}.CONSUMER.INFO.{stream}.{durable}",
        f"{JS}.CONSUMER.MSG.NEXT.{stream}.{durable}",
        f"$JS.ACK.{stream}.{durable}.>",
    ]


def _read(stream: str) -> list[str]:
    """Messages of a stream by sequence or last-by-subject (direct or through the API)."""
    return [f"{JS}.DIRECT.GET.{stream}", f"{JS}.DIRECT.GET.{stream}.>", f"{JS}.STREAM.MSG.GET.{stream}"]


def role_permissions(run_id: str, role: str) -> dict:
    """The nats-server `permissions` of one role in one run."""
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}: one of {', '.join(ROLES)}")
    if role == "admin":
        return {"publish": {"allow": [">"]}, "subscribe": {"allow": [">"]}}
    s = Subjects(run_id=run_id)
    bucket, kv_stream = s.kv_bucket, f"KV_{s.kv_bucket}"
    obj_stream = f"OBJ_{s.weights_bucket}"

    def kv_get(*keys: str) -> list[str]:
        return [f"{JS}.DIRECT.GET.{kv_stream}.$KV.{bucket}.{k}" for k in keys]

    streams = [spec["name"] for spec in s.stream_specs()] + [kv_stream]
    pub = [s.heartbeat(role), s._s("deadletter.>"), *(f"{JS}.STREAM.INFO.{n}" for n in streams)]
    pub += kv_get("config", "live_version", "published_version")
    sub = [f"{inbox_prefix(run_id, role)}.>"]
    responses = None
    if role == "buffer":
        pub += [s.prompts, s.ledger, f"$KV.{bucket}.buffer_snapshot", *kv_get("buffer_snapshot")]
        # multi-LoRA: one partition per adapter registration, and the registry that opens them
        pub += [s.prompts + ".*", s.ledger + ".*", f"$KV.{bucket}.buffer_snapshot.*", *kv_get("buffer_snapshot.*")]
        pub += kv_get(ADAPTERS_KV_KEY)
        sub += [s.buffer_get + ".*", s.buffer_commit + ".*"]
        pub += _consume(s.rollouts_stream, "buffer") + _read(s.rollouts_stream) + _read(s.ledger_stream)
        pub += _read(s.weights_stream)
        pub += [f"{JS}.STREAM.PURGE.{s.rollouts_stream}", f"{JS}.STREAM.MSG.DELETE.{s.rollouts_stream}"]
        sub += [s.buffer_get, s.buffer_commit, s.weights_live, s.weights_published, s.heartbeat("rollout")]
        responses = {"max": 4, "expires": "2m"}  # one answer per request; headroom
    elif role == "trainer":
        pub += [s.buffer_get, s.buffer_commit, s.weights_published, s.progress, s.eval_requests, s.eval_results]
        pub += [s.buffer_get + ".*", s.buffer_commit + ".*"]  # multi-LoRA partitions
        pub += [f"$KV.{bucket}.published_version"]
        pub += _read(s.rollouts_stream) + _read(s.weights_stream)
        pub += [f"$O.{s.weights_bucket}.>", f"{JS}.STREAM.PURGE.{obj_stream}", f"{JS}.STREAM.INFO.{obj_stream}"]
        pub += _read(obj_stream)
        pub += [s.adapters_control, *kv_get(ADAPTERS_KV_KEY)]  # multi-LoRA: the registry's transitions and state
        pub += kv_get(f"{ADAPTER_LIVE_KV_PREFIX}.>")  # multi-LoRA: the engines' version of an adapter (its retention)
        pub += [s.adapters_published]  # multi-LoRA: adapter versions for weight-sync
        sub += [s.eval_results, s.heartbeat("rollout"), s.weights_transfer]
        responses = {"max": 16, "expires": "5m"}  # a send's answer comes once its broadcast is done
    elif role == "rollout":
        pub += [s.rollouts] + _consume(s.prompts_stream, "producers")
        pub += kv_get(f"{ADAPTER_LIVE_KV_PREFIX}.>", ADAPTERS_KV_KEY)  # multi-LoRA: which adapter version, its reward
        pub += [s.rollouts + ".*"]  # multi-LoRA partitions
        sub += [s.control]
    elif role == "weight-sync":
        pub += [s.weights_live, s.weights_transfer, f"$KV.{bucket}.live_version"]
        pub += _consume(s.weights_stream, "weight-sync") + _consume(s.weights_stream, "weight-sync-adapters")
        pub += [f"$KV.{bucket}.{ADAPTER_LIVE_KV_PREFIX}.>", *kv_get(f"{ADAPTER_LIVE_KV_PREFIX}.>", ADAPTERS_KV_KEY)]
        pub += _read(s.weights_stream) + _read(obj_stream)
    elif role == "eval":
        pub += [s.eval_results, s.control] + _consume(s.eval_stream, "eval") + _read(s.weights_stream)
        sub += [s.weights_live]
    elif role == "adapters":  # the multi-LoRA registry: its KV key, and it answers adapters.control
        pub += [f"$KV.{bucket}.{ADAPTERS_KV_KEY}", *kv_get(ADAPTERS_KV_KEY)]
        sub += [s.adapters_control]
        responses = {"max": 1, "expires": "1m"}
    elif role == "engine":  # nothing else: not even heartbeats or dead letters
        pub = _read(obj_stream)
    perms: dict = {"publish": {"allow": pub}, "subscribe": {"allow": sub}}
    if responses:
        perms["allow_responses"] = responses
    return perms


def server_auth_conf(run_id: str, passwords: dict[str, str] | None = None) -> str:
    """A nats-server `authorization { users = [...] }` block: one user per role, named after it,
    with its permissions. Passwords are given, or (None) read by the server from the environment
    variables ASYNCRL_NATS_PASSWORD_<ROLE> (docker compose, Kubernetes)."""
    users = []
    for role in ROLES:
        from_env = "$ASYNCRL_NATS_PASSWORD_" + role.upper().replace("-", "_")
        password = from_env if passwords is None else json.dumps(passwords[role])
        perms = json.dumps(role_permissions(run_id, role), indent=None)
        users.append(f"    {{user: {json.dumps(role)}, password: {password}, permissions: {perms}}}")
    return "authorization {\n  users = [\n" + "\n".join(users) + "\n  ]\n}\n"


COMPOSE_ROUTES = [f"nats-{i}:6222" for i in range(3)]
"""The 3-node cluster of deploy/compose.nats-cluster.yml (service names on the compose network)."""
K8S_ROUTES = [f"nats-{i}.nats:6222" for i in range(3)]
"""The 3-node StatefulSet of deploy/k8s/asyncrl.yaml (pod names under its headless Service)."""


def routes_conf(password: str, routes: list[str]) -> str:
    """What goes inside a nats-server `cluster { }` block besides its name and listen address:
    the route user its peers must present, and the routes to them with that user (nats-server
    takes a route's credentials from its URL only). A node's route to itself is ignored."""
    pw = json.dumps(quote(password, safe=""))[1:-1]
    urls = ", ".join(f'"nats-route://route:{pw}@{r}"' for r in routes)
    return f"authorization {{ user: route, password: {json.dumps(password)} }}\nroutes: [{urls}]\n"


def write_deploy_secrets(run_id: str, out_dir) -> dict[str, str]:
    """The secrets of a run whose services start elsewhere (docker compose, Kubernetes), each
    mode 0600, kept if they exist (a restart changes nothing):
      nats.json, run-token     every identity and the run token (the operator's copy)
      auth.conf                the server's authorization block (deploy/nats-server.conf includes it)
      routes.conf              a 3-node cluster's route user and routes (deploy/nats-cluster.conf)
      roles/<role>/            what one service may see: its own identity (nats.json) and the
                               run token (roles/engine/: the read-only weights identity)."""
    out = Path(out_dir)
    passwords = secrets.keep_or_make_passwords(out / "nats.json", ROLES)
    token = secrets.keep_or_make_token(out / "run-token")
    secrets.write_secret_file(out / "auth.conf", server_auth_conf(run_id, passwords))
    route_password = secrets.keep_or_make_token(out / "route-password")
    secrets.write_secret_file(out / "routes.conf", routes_conf(route_password, COMPOSE_ROUTES))
    for role in ROLES:
        secrets.write_roles_file(out / "roles" / role / "nats.json", {role: passwords[role]})
        secrets.write_secret_file(out / "roles" / role / "run-token", token)
    return passwords


def k8s_secrets(run_id: str) -> str:
    """Kubernetes Secrets for a run (`asyncrl secrets --run-id ID --k8s | kubectl apply -f -`):
    asyncrl-nats-auth (auth.conf for the nats pod), asyncrl-run-token, and one
    asyncrl-nats-<role> per role holding only that role's password. New secrets every call: apply
    it once per run (applying it again rotates every password; restart nats and the pods then)."""

    def secret(name: str, data: dict[str, str]) -> str:
        items = "\n".join(f"  {k}: {base64.b64encode(v.encode()).decode()}" for k, v in data.items())
        return f"apiVersion: v1\nkind: Secret\nmetadata: {{name: {name}}}\ntype: Opaque\ndata:\n{items}\n"

    passwords = {r: secrets.new_secret() for r in ROLES}
    routes = routes_conf(secrets.new_secret(), K8S_ROUTES)
    docs = [secret("asyncrl-nats-auth", {"auth.conf": server_auth_conf(run_id, passwords), "routes.conf": routes}),
            secret("asyncrl-run-token", {"run-token": secrets.new_secret()})]  # fmt: skip
    docs += [secret(f"asyncrl-nats-{r}", {"user": r, "password": passwords[r]}) for r in ROLES]
    return "---\n".join(docs)
