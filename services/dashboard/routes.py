"""The dashboard's routes, one router per concern (services.dashboard.app assembles them behind
the run token): the open ones (health, readiness, the login), the JSON routes under /api/ and
the pages. A page is a Jinja template of templates/ (autoescaped), filled from
services/dashboard/views.py."""

from __future__ import annotations

import re
import secrets
import time
from pathlib import Path
from urllib.parse import parse_qs, quote

import jinja2
from fastapi import APIRouter, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response

from services.common.httpauth import ADMIN
from services.dashboard import views

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


def open_routes(dash) -> APIRouter:
    """The routes without the run token (services.dashboard.app.OPEN): health, readiness, the login."""
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
        return data.audit(_known(dash, adapter))

    @r.get("/errors")
    async def errors():
        return {"errors": data.errors(), "streams_error": data.streams_error}

    @r.get("/steps")
    async def steps(adapter: str = ""):
        key = _known(dash, adapter)
        return {"steps": data.sample_steps(key), "committed_step": data.committed_step(key)}

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
