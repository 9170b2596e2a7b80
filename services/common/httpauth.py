"""Bearer-token authentication of the HTTP routes of asyncrl's services and built-in engines.

The services ask for the run token on every route but /healthz, /readyz and /metrics (those too
with --http-auth-probes); the built-in engine follows SGLang's --api-key: every route but
/health, /health_generate and /metrics. Tokens are compared in constant time.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable

from fastapi import FastAPI
from fastapi.responses import JSONResponse

OPEN_PATHS = ("/healthz", "/readyz", "/metrics")
"""Routes a probe or a scraper reaches without the run token (unless --http-auth-probes)."""


def require_token(app: FastAPI, token: Callable[[], str | None], open_paths: tuple[str, ...]) -> None:
    """Every route but `open_paths` answers 401 unless the request carries
    `Authorization: Bearer <token>`; with no token configured, they refuse everyone (403)."""
    app.add_middleware(BearerAuth, token=token, open_paths=open_paths)


class BearerAuth:
    """The check as a plain ASGI middleware: a refused request never reaches the app, an accepted
    one passes through untouched. (Starlette's BaseHTTPMiddleware, `@app.middleware("http")`,
    wraps every response in a stream and spawns tasks per request: measured in a default job, it
    cost the engine's scheduler thread a third of its generation rate through the GIL.)"""

    def __init__(self, app, token: Callable[[], str | None], open_paths: tuple[str, ...]):
        self.app, self.token, self.open_paths = app, token, frozenset(open_paths)

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        refusal = self._refusal(scope)
        if refusal is None:
            await self.app(scope, receive, send)
        else:
            await refusal(scope, receive, send)

    def _refusal(self, scope) -> JSONResponse | None:
        expected = self.token()
        if not expected:
            return JSONResponse({"error": {"message": "this server has no run token: set $ASYNCRL_RUN_TOKEN"}},
                                status_code=403)  # fmt: skip
        given = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
        scheme, _, value = given.partition(b" ")
        if scheme.lower() != b"bearer" or not hmac.compare_digest(value.strip(), expected.encode()):
            return JSONResponse(
                {"error": {"message": "missing or wrong run token: send Authorization: Bearer <token> "
                                      "(the run's token is in <run_dir>/secrets/run-token)"}},
                status_code=401, headers={"WWW-Authenticate": "Bearer"},
            )  # fmt: skip
        return None
