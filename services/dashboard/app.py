"""The dashboard's HTTP server: read-only pages and JSON routes over a run (services/dashboard/data.py),
its routers in services/dashboard/routes.py, its pages' templates in templates/ and the files they
load (uPlot, vendored in static/vendor/uplot/ with its licence, and static/dashboard.js) in static/.

Every route but /healthz and /login needs the run token: as `Authorization: Bearer <token>`, or
the session cookie that /login sets after it is given the token (a random session id, kept in
this process only). A page asked for without either sends a browser to /login; a JSON route
answers 401. Nothing here writes to the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time
from pathlib import Path
from urllib.parse import quote

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, RedirectResponse
from fastapi.staticfiles import StaticFiles

from services.common.httpauth import ADMIN, Keys
from services.dashboard.data import RunData
from services.dashboard.routes import api_routes, open_routes, page_routes

COOKIE = "asyncrl_dashboard"
OPEN = ("/healthz", "/readyz", "/login")
REFRESH_S = 2.0
"""A live run's files and streams are read again this often (in the background)."""

STATIC = Path(__file__).parent / "static"


class Dashboard:
    """The state behind the routes: the run's data, refreshed in the background while it is live."""

    def __init__(self, run_dir: Path, keys: Keys, source=None, live: bool = False):
        self.data = RunData(run_dir)
        self.data.served_live = live
        self.keys = keys
        self.source = source
        self.live = live
        self.sessions: dict[str, float] = {}
        """Session ids of browsers that gave the run token, oldest first, with when they lapse."""
        self.cookie = f"{COOKIE}_{self.data.run_id}"[:120]
        """One cookie name per run: a browser may hold the sessions of several runs' dashboards."""
        self.refreshed_at = 0.0
        self._lock = asyncio.Lock()

    async def refresh(self) -> None:
        async with self._lock:
            # the ledger first, then the files: the trainer writes a step's trained.jsonl line before
            # its commit reaches the ledger, so the files read after hold every step the ledger has
            if self.source is not None:
                try:
                    await self.data.refresh_streams(await self.source.bus())
                    self.data.streams_error = None
                except Exception as e:  # a broker away for a moment: the files still show, the error says why
                    self.data.streams_error = f"{type(e).__name__}: {str(e)[:200]}"
                    await self.source.reset()
            await asyncio.to_thread(self.data.refresh_files)
            self.refreshed_at = time.time()

    async def keep_fresh(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            with contextlib.suppress(Exception):
                await self.refresh()

    def authorized(self, request: Request) -> bool:
        given = request.headers.get("authorization", "")
        scheme, _, value = given.partition(" ")
        if scheme.lower() == "bearer" and self.keys.role_of(value.strip().encode()) == ADMIN:
            return True
        cookie = request.cookies.get(self.cookie, "")
        now = time.time()
        return any(hmac.compare_digest(cookie, s) and until > now for s, until in self.sessions.items()) if cookie else False


def build_app(dash: Dashboard) -> FastAPI:
    """The dashboard's app: the run token checked before every route but OPEN's (the static files
    too), then the routers of services/dashboard/routes.py and /static/."""

    @contextlib.asynccontextmanager
    async def lifespan(app):
        await dash.refresh()
        task = asyncio.ensure_future(dash.keep_fresh()) if dash.live else None
        yield
        if task is not None:
            task.cancel()
        if dash.source is not None:
            await dash.source.close()

    app = FastAPI(title="asyncrl dashboard", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def auth(request: Request, call_next):
        path = request.url.path
        if path in OPEN or dash.authorized(request):
            return await call_next(request)
        if path.startswith("/api/"):
            return JSONResponse({"error": {"message": "missing or wrong run token: send Authorization: Bearer "
                                           "<token> (the run's token is in <run_dir>/secrets/run-token)"}},
                                status_code=401, headers={"WWW-Authenticate": "Bearer"})  # fmt: skip
        return RedirectResponse("/login?next=" + quote(path), status_code=303)

    for router in (open_routes(dash), api_routes(dash), page_routes(dash)):
        app.include_router(router)
    app.mount("/static", StaticFiles(directory=STATIC), name="static")
    return app


__all__ = ["Dashboard", "build_app"]
