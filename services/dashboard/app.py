"""The dashboard's HTTP server: read-only pages and JSON routes over a run (services/dashboard/data.py),
one router per concern (the open ones: health, readiness, the login; the JSON routes under /api/;
the pages: Jinja templates of templates/, autoescaped, filled from services/dashboard/views.py),
and the files the pages load (uPlot, vendored in static/vendor/uplot/ with its licence, and
static/dashboard.js) in static/.

Every route but /healthz and /login needs the run token: as `Authorization: Bearer <token>`, or
the session cookie that /login sets after it is given the token (a random session id, kept in
this process only). A page asked for without either sends a browser to /login; a JSON route
answers 401. Nothing here writes to the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import re
import secrets
import time
from pathlib import Path
from urllib.parse import parse_qs, quote

import jinja2
from fastapi import APIRouter, FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response
from fastapi.staticfiles import StaticFiles

from services.common.httpauth import ADMIN, Keys
from services.dashboard import views
from services.dashboard.data import RunData

COOKIE = "asyncrl_dashboard"
OPEN = ("/healthz", "/readyz", "/login")
REFRESH_S = 2.0
"""A live run's files and streams are read again this often (in the background)."""

STATIC = Path(__file__).parent / "static"
SAFE_NEXT = re.compile(r"/(?![/\\])[A-Za-z0-9_./?=&%-]*")
"""Where the login may send a browser back to: a path here (not `//host` or `/\\host`)."""
MAX_SESSIONS = 1000
MAX_FORM_BYTES = 4096
SESSION_S = 12 * 3600.0
"""A browser logs in again after this long."""
LIVE_REFRESH_S = 5
"""A live run's page reads itself again this often (static/dashboard.js), keeping a chart's zoom."""

TEMPLATES = jinja2.Environment(loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
                               autoescape=True, trim_blocks=True, lstrip_blocks=True)  # fmt: skip
TEMPLATES.filters.update(readable=views.readable, num=views.num, clock=views.clock)


def page(template: str, title: str, **context) -> HTMLResponse:
    return HTMLResponse(TEMPLATES.get_template(template).render(title=title, **context))


def _known(dash, adapter: str) -> str:
    """`adapter` when it names one of the run's partitions ("" is the run's own); else a 404."""
    if adapter not in dash.data.partitions:
        raise HTTPException(404, f"no adapter registration {adapter[:100]!r}: see /api/partitions")
    return adapter


def _of(adapter: str) -> str:
    return f" of {adapter}" if adapter else ""


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
        scheme, _, value = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() == "bearer" and self.keys.role_of(value.strip().encode()) == ADMIN:
            return True
        cookie = request.cookies.get(self.cookie, "")
        now = time.time()
        return bool(cookie) and any(
            hmac.compare_digest(cookie, s) and until > now for s, until in self.sessions.items()
        )


def open_routes(dash) -> APIRouter:
    """The routes without the run token (OPEN): health, readiness, the login."""
    r = APIRouter()

    @r.get("/healthz")
    async def healthz():
        return {"ok": True}

    @r.get("/readyz")
    async def readyz():
        return {"ok": True, "refreshed_at": dash.refreshed_at}

    @r.get("/login", response_class=HTMLResponse)
    async def login_page(next: str = "/", failed: int = 0):
        return page("login.html", "Log in", next=next, failed=failed, nav=False)

    @r.post("/login")
    async def login(request: Request):
        # the form's two fields, read by hand: FastAPI's Form() needs python-multipart, not a dependency
        body = b""
        async for chunk in request.stream():  # never more than a login form's worth in memory
            body += chunk
            if len(body) > MAX_FORM_BYTES:
                return JSONResponse({"error": {"message": "a login form is a token, not this"}}, status_code=413)
        form = parse_qs(body.decode("utf-8", "replace"))
        token, back = (form.get("token") or [""])[0], (form.get("next") or ["/"])[0]
        if dash.keys.role_of(token.strip().encode()) != ADMIN:
            return RedirectResponse("/login?failed=1&next=" + quote(back), status_code=303)
        session = secrets.token_urlsafe(32)
        if len(dash.sessions) >= MAX_SESSIONS:  # the oldest logins lapse (they log in again)
            dash.sessions.pop(next(iter(dash.sessions)))
        dash.sessions[session] = time.time() + SESSION_S
        target = back if SAFE_NEXT.fullmatch(back) else "/"  # a path of this server, never another site
        resp = RedirectResponse(target, status_code=303)
        resp.set_cookie(dash.cookie, session, httponly=True, samesite="strict", max_age=int(SESSION_S))
        return resp

    return r


def api_routes(dash) -> APIRouter:
    """The JSON routes under /api/ (the run token's): each panel's data."""
    r, data = APIRouter(prefix="/api"), dash.data

    @r.get("/summary")
    async def summary():
        return data.summary()

    @r.get("/curves")
    async def curves(x: str = "step", adapter: str = ""):
        return views.curves(data, x, _known(dash, adapter))

    @r.get("/staleness")
    async def staleness(adapter: str = ""):
        columns = views.staleness_columns(data, adapter=_known(dash, adapter))
        return {"per_step": {str(k): dict(v) for k, v in columns}}

    @r.get("/versions")
    async def versions():
        return data.version_timeline()

    @r.get("/buffer")
    async def buffer(adapter: str = ""):
        return views.buffer_facts(data, _known(dash, adapter))

    @r.get("/services")
    async def services():
        return data.services()

    @r.get("/audit")
    async def audit(adapter: str = ""):
        return data.part(_known(dash, adapter)).audit()

    @r.get("/errors")
    async def errors():
        return {"errors": data.errors(), "streams_error": data.streams_error}

    @r.get("/steps")
    async def steps(adapter: str = ""):
        key = _known(dash, adapter)
        return {"steps": data.sample_steps(key), "committed_step": data.part(key).auditor.state.committed_step}

    @r.get("/step/{step}")
    async def step(step: int, adapter: str = ""):
        rec = data.step_record(step, _known(dash, adapter))
        if rec is None:
            raise HTTPException(404, f"no sample record for step {step}")
        return rec

    @r.get("/prompt/{group_index}")
    async def prompt(group_index: int, adapter: str = ""):
        return data.lineage(group_index, _known(dash, adapter))

    @r.get("/partitions")
    async def partitions():
        return {k: {"name": p.name, "state": p.state} for k, p in data.partitions.items()}

    return r


def page_routes(dash) -> APIRouter:
    """The HTML pages (the run token's): the overview, a step's samples, a prompt's history. A live
    run's overview and prompt pages refresh themselves (LIVE_REFRESH_S)."""
    r, data = APIRouter(), dash.data
    live = LIVE_REFRESH_S if dash.live else 0

    @r.get("/", response_class=HTMLResponse)
    async def overview(x: str = "step", adapter: str = ""):
        title = f"asyncrl {data.run_id}" + (f" / {adapter}" if adapter else "")
        return page("overview.html", title, refresh_s=live, **views.overview(data, x, _known(dash, adapter)))

    @r.get("/step/{step}", response_class=HTMLResponse)
    async def step_page(step: int, adapter: str = ""):
        rec = data.step_record(step, _known(dash, adapter))
        return page("step.html", f"step {step}{_of(adapter)}", step=step, rec=rec, adapter=adapter)

    @r.get("/prompt/{group_index}", response_class=HTMLResponse)
    async def prompt_page(group_index: int, adapter: str = ""):
        lin = data.lineage(group_index, _known(dash, adapter))
        return page("prompt.html", f"prompt {group_index}{_of(adapter)}", lin=lin, adapter=adapter, refresh_s=live)

    @r.get("/step")
    async def step_form(s: int = 0, adapter: str = ""):
        return RedirectResponse(f"/step/{s}" + (f"?adapter={quote(_known(dash, adapter))}" if adapter else ""),
                                status_code=303)  # fmt: skip

    @r.get("/prompt")
    async def prompt_form(g: int = 0, adapter: str = ""):
        return RedirectResponse(f"/prompt/{g}" + (f"?adapter={quote(_known(dash, adapter))}" if adapter else ""),
                                status_code=303)  # fmt: skip

    @r.get("/favicon.ico")
    async def favicon():
        return Response(status_code=204)

    return r


def build_app(dash: Dashboard) -> FastAPI:
    """The dashboard's app: the run token checked before every route but OPEN's (the static files
    too), then the routers above and /static/."""

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
