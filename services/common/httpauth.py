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

    @app.middleware("http")
    async def _auth(request, call_next):
        if request.url.path in open_paths:
            return await call_next(request)
        expected = token()
        if not expected:
            return JSONResponse({"error": {"message": "this server has no run token: set $ASYNCRL_RUN_TOKEN"}},
                                status_code=403)  # fmt: skip
        given = request.headers.get("authorization", "")
        scheme, _, value = given.partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(value.strip().encode(), expected.encode()):
            return JSONResponse(
                {"error": {"message": "missing or wrong run token: send Authorization: Bearer <token> "
                                      "(the run's token is in <run_dir>/secrets/run-token)"}},
                status_code=401, headers={"WWW-Authenticate": "Bearer"},
            )  # fmt: skip
        return await call_next(request)
