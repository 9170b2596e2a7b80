"""Bearer-token authentication of the HTTP routes of asyncrl's services and built-in engines,
with one credential per role.

The run token is the admin's (the operator's and the launcher's): it opens every route. Each role
that calls an engine has a token of its own, derived from the run token (`role_token`), and a
route answers it only within the role's scope (`ENGINE_SCOPES`):

| role | built-in engine routes |
|---|---|
| rollout (producers) | generation: /generate, /abort_request, the OpenAI routes, model and load info |
| eval | the same (its pause of submission goes over NATS, under its own eval tokens) |
| weight-sync | pause, continue, flush, weight and adapter loading, weight version, model and server info, /v1/models (the adapters loaded) |
| admin (run token) | every route, every service's and every engine's |

A service's own routes (/status, /config, control) are the admin's only. A process is given its
role's token ($ASYNCRL_HTTP_TOKEN) and the SHA-256 of every role's token ($ASYNCRL_HTTP_KEYS, a
JSON object): it can check a token without holding it, so the launcher gives no child the run
token. Without those variables a process derives both from $ASYNCRL_RUN_TOKEN (docker compose,
Kubernetes). An SGLang server takes one key (`--api-key`): it gets the run token, and so do the
processes that call it (the single-key limit, docs/trust.md).

The services ask for a token on every route but /healthz, /readyz and /metrics (those too with
--http-auth-probes); the built-in engine follows SGLang's --api-key: every route but /health,
/health_generate and /metrics. Tokens are compared in constant time.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import os
from collections.abc import Callable, Mapping

from fastapi import FastAPI
from fastapi.responses import JSONResponse

OPEN_PATHS = ("/healthz", "/readyz", "/metrics")
"""Routes a probe or a scraper reaches without the run token (unless --http-auth-probes)."""

HTTP_TOKEN_ENV = "ASYNCRL_HTTP_TOKEN"
"""This process's role token: what it sends to the engines it calls."""
HTTP_KEYS_ENV = "ASYNCRL_HTTP_KEYS"
"""JSON {role: SHA-256 hex of its token}: who may call this process's routes."""
HTTP_ROLES = ("admin", "rollout", "weight-sync", "eval")
ADMIN = "admin"

_GENERATION = ("/generate", "/abort_request", "/v1/completions", "/v1/chat/completions", "/v1/models",
               "/model_info", "/get_model_info", "/get_load", "/get_weight_version")  # fmt: skip
_WEIGHTS = ("/pause_generation", "/continue_generation", "/flush_cache", "/stage_weights", "/update_weights_from_disk",
            "/init_weights_update_group", "/destroy_weights_update_group", "/update_weights_from_distributed",
            "/update_weight_version", "/load_lora_adapter", "/unload_lora_adapter", "/v1/models", "/model_info",
            "/get_model_info", "/server_info", "/get_server_info", "/get_weight_version")  # fmt: skip
ENGINE_SCOPES: dict[str, frozenset[str]] = {
    path: frozenset(({"rollout", "eval"} if path in _GENERATION else set()) | ({"weight-sync"} if path in _WEIGHTS else set()))
    for path in {*_GENERATION, *_WEIGHTS}
}  # fmt: skip
"""Built-in engine route -> the roles besides the admin that may call it."""


def role_token(run_token: str, role: str) -> str:
    """A role's HTTP token: the run token for the admin, else derived from it (HMAC-SHA256), so
    the run token alone makes every role's and none of them gives it back."""
    if role == ADMIN:
        return run_token
    mac = hmac.new(run_token.encode(), f"asyncrl-http-role:{role}".encode(), hashlib.sha256).digest()
    return base64.urlsafe_b64encode(mac).decode().rstrip("=")


def digest(token: str | bytes) -> str:
    return hashlib.sha256(token.encode() if isinstance(token, str) else token).hexdigest()


class Keys:
    """Which role a presented token is, from the SHA-256 of each role's token."""

    def __init__(self, hashes: Mapping[str, str]):
        self.hashes = dict(hashes)

    @classmethod
    def single(cls, key: str) -> Keys:
        """One key that opens everything (SGLang's --api-key)."""
        return cls({ADMIN: digest(key)})

    @classmethod
    def of_run(cls, run_token: str) -> Keys:
        return cls({role: digest(role_token(run_token, role)) for role in HTTP_ROLES})

    def role_of(self, token: bytes) -> str | None:
        h = digest(token)  # compared with every role's: no early exit to time
        found = [role for role, expected in self.hashes.items() if hmac.compare_digest(h, expected)]
        return found[-1] if found else None

    def env(self) -> dict[str, str]:
        return {HTTP_KEYS_ENV: json.dumps(self.hashes, sort_keys=True)}


def keys_from_env(run_token: str | None, environ: Mapping[str, str] = os.environ) -> Keys | None:
    """This process's verifier: $ASYNCRL_HTTP_KEYS, else every role's derived from the run token,
    else None (its protected routes refuse everyone)."""
    if raw := environ.get(HTTP_KEYS_ENV):
        try:
            hashes = json.loads(raw)
        except ValueError:
            hashes = None
        if not isinstance(hashes, dict) or not all(isinstance(v, str) for v in hashes.values()):
            raise ValueError(f"${HTTP_KEYS_ENV} must be a JSON object of role -> SHA-256 hex")
        return Keys(hashes)
    return Keys.of_run(run_token) if run_token else None


def engine_token_from_env(role: str, run_token: str | None, single_key_engines: bool) -> str | None:
    """The token this process sends to the engines: $ASYNCRL_HTTP_TOKEN, else derived from the run
    token (the run token itself for engines that take one key: SGLang's)."""
    if token := os.environ.get(HTTP_TOKEN_ENV):
        return token
    return engine_token(run_token, role, single_key_engines) if run_token else None


def engine_token(run_token: str, role: str, single_key_engines: bool) -> str:
    """What a role sends to the engines: its own token, or the run token to engines that take
    one key for everything (SGLang's --api-key)."""
    return run_token if single_key_engines else role_token(run_token, role)


def require_token(app: FastAPI, keys: Callable[[], Keys | None], open_paths: tuple[str, ...],
                  scopes: Mapping[str, frozenset[str]] | None = None) -> None:  # fmt: skip
    """Every route but `open_paths` answers 401 unless the request carries
    `Authorization: Bearer <token>` of the admin, or of a role whose scope holds the route (403
    otherwise); with no keys configured, they refuse everyone (403)."""
    app.add_middleware(BearerAuth, keys=keys, open_paths=open_paths, scopes=scopes or {})


class BearerAuth:
    """The check as a plain ASGI middleware: a refused request never reaches the app, an accepted
    one passes through untouched. (Starlette's BaseHTTPMiddleware, `@app.middleware("http")`,
    wraps every response in a stream and spawns tasks per request: measured in a default job, it
    cost the engine's scheduler thread a third of its generation rate through the GIL.)"""

    def __init__(self, app, keys: Callable[[], Keys | None], open_paths: tuple[str, ...],
                 scopes: Mapping[str, frozenset[str]]):  # fmt: skip
        self.app, self.keys, self.open_paths, self.scopes = app, keys, frozenset(open_paths), scopes

    async def __call__(self, scope, receive, send) -> None:
        refusal = None if scope["type"] != "http" or scope["path"] in self.open_paths else self._refusal(scope)
        await (self.app if refusal is None else refusal)(scope, receive, send)

    def _refusal(self, scope) -> JSONResponse | None:
        keys = self.keys()
        if keys is None:
            return JSONResponse({"error": {"message": "this server has no run token: set $ASYNCRL_RUN_TOKEN"}},
                                status_code=403)  # fmt: skip
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, value = given.partition(b" ")
        role = keys.role_of(value.strip()) if scheme.lower() == b"bearer" else None
        if role is None:
            return JSONResponse(
                {"error": {"message": "missing or wrong run token: send Authorization: Bearer <token> "
                                      "(the run's token is in <run_dir>/secrets/run-token)"}},
                status_code=401, headers={"WWW-Authenticate": "Bearer"},
            )  # fmt: skip
        path = scope["path"]
        if role != ADMIN and role not in self.scopes.get(path, ()):
            return JSONResponse({"error": {"message": f"the {role} credential may not call {path[:100]}"}},
                                status_code=403)  # fmt: skip
        scope["asyncrl_role"] = role  # a route that refuses a claim names who made it
        return None
