"""The dashboard's HTTP server: read-only pages and JSON routes over a run (services/dashboard/data.py).

Every route but /healthz and /login needs the run token: as `Authorization: Bearer <token>`, or
the session cookie that /login sets after it is given the token (a random session id, kept in
this process only). A page asked for without either sends a browser to /login; a JSON route
answers 401. Nothing here writes to the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import html
import json
import logging
import re
import secrets
import time
from pathlib import Path
from urllib.parse import parse_qs, quote

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import HTMLResponse, JSONResponse, RedirectResponse, Response

from services.common.httpauth import ADMIN, Keys
from services.dashboard import svg
from services.dashboard.data import RunData, downsample, series

log = logging.getLogger(__name__)

COOKIE = "asyncrl_dashboard"
OPEN = ("/healthz", "/readyz", "/login")
SAFE_NEXT = re.compile(r"/(?![/\\])[A-Za-z0-9_./?=&%-]*")
"""Where the login may send a browser back to: a path here (not `//host` or `/\\host`)."""
MAX_SESSIONS = 1000
MAX_FORM_BYTES = 4096
SESSION_S = 12 * 3600.0
"""A browser logs in again after this long."""
REFRESH_S = 2.0
"""A live run's files and streams are read again this often (in the background)."""

CSS = """body{font-family:sans-serif;margin:16px;color:#222;background:#fafafa}h1{font-size:20px}
h2{font-size:16px;margin:18px 0 6px}.panel{display:inline-block;vertical-align:top;margin:6px;padding:8px;
background:#fff;border:1px solid #ddd;border-radius:4px}table{border-collapse:collapse;font-size:13px}
td,th{border-bottom:1px solid #eee;padding:3px 8px;text-align:left}.bad{color:#c00}.ok{color:#070}
.seg{border-radius:2px;padding:0 1px;font-family:monospace}.mask0{text-decoration:underline dotted;opacity:.7}
nav a{margin-right:12px}.facts span{margin-right:18px}code{font-size:12px}"""


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
    """The dashboard's app: the run token checked before every route but OPEN's, then the login,
    JSON and page routes, each group registered by a function of its own."""

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

    _open_routes(app, dash)
    _api_routes(app, dash)
    _page_routes(app, dash)
    return app


def _known(dash: Dashboard, adapter: str) -> str:
    """`adapter` when it names one of the run's partitions ("" is the run's own); else a 404."""
    if adapter not in dash.data.partitions:
        raise HTTPException(404, f"no adapter registration {adapter[:100]!r}: see /api/partitions")
    return adapter


def _open_routes(app: FastAPI, dash: Dashboard) -> None:
    """The routes without the run token (OPEN): health, readiness and the login."""

    @app.get("/healthz")
    async def healthz():
        return {"ok": True}

    @app.get("/readyz")
    async def readyz():
        return {"ok": True, "refreshed_at": dash.refreshed_at}

    @app.get("/login", response_class=HTMLResponse)
    async def login_page(next: str = "/", failed: int = 0):
        msg = '<p class="bad">That is not the run token.</p>' if failed else ""
        return _page(
            "Log in",
            f"""{msg}<form method="post" action="/login">
<p>The run token (in <code>RUN_DIR/secrets/run-token</code>, or your <code>$ASYNCRL_RUN_TOKEN</code>):</p>
<input type="password" name="token" size="50" autofocus><input type="hidden" name="next" value="{html.escape(next)}">
<button type="submit">Open</button></form>""",
            nav=False,
        )

    @app.post("/login")
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


def _api_routes(app: FastAPI, dash: Dashboard) -> None:
    """The JSON routes under /api/ (the run token's)."""

    @app.get("/api/summary")
    async def api_summary():
        return dash.data.summary()

    @app.get("/api/curves")
    async def api_curves(x: str = "step", adapter: str = ""):
        return curves(dash.data, x, _known(dash, adapter))

    @app.get("/api/staleness")
    async def api_staleness(adapter: str = ""):
        columns = staleness_columns(dash.data, adapter=_known(dash, adapter))
        return {"per_step": {str(k): dict(v) for k, v in columns}}

    @app.get("/api/versions")
    async def api_versions():
        return dash.data.version_timeline()

    @app.get("/api/buffer")
    async def api_buffer(adapter: str = ""):
        return buffer_facts(dash.data, _known(dash, adapter))

    @app.get("/api/services")
    async def api_services():
        return dash.data.services()

    @app.get("/api/audit")
    async def api_audit(adapter: str = ""):
        return dash.data.audit(_known(dash, adapter))

    @app.get("/api/errors")
    async def api_errors():
        return {"errors": dash.data.errors(), "streams_error": dash.data.streams_error}

    @app.get("/api/steps")
    async def api_steps(adapter: str = ""):
        key = _known(dash, adapter)
        return {"steps": dash.data.sample_steps(key), "committed_step": dash.data.committed_step(key)}

    @app.get("/api/step/{step}")
    async def api_step(step: int, adapter: str = ""):
        rec = dash.data.step_record(step, _known(dash, adapter))
        if rec is None:
            raise HTTPException(404, f"no sample record for step {step}")
        return rec

    @app.get("/api/prompt/{group_index}")
    async def api_prompt(group_index: int, adapter: str = ""):
        return dash.data.lineage(group_index, _known(dash, adapter))

    @app.get("/api/partitions")
    async def api_partitions():
        return {k: {"name": p.name, "state": p.state} for k, p in dash.data.partitions.items()}


def _page_routes(app: FastAPI, dash: Dashboard) -> None:
    """The HTML pages (the run token's): the overview, a step, a prompt's history."""

    @app.get("/", response_class=HTMLResponse)
    async def overview(x: str = "step", adapter: str = ""):
        return _page(f"asyncrl {dash.data.run_id}" + (f" / {adapter}" if adapter else ""),
                     overview_html(dash, x, _known(dash, adapter)), refresh=dash.live)  # fmt: skip

    @app.get("/step/{step}", response_class=HTMLResponse)
    async def step_page(step: int, adapter: str = ""):
        return _page(f"step {step}" + (f" of {adapter}" if adapter else ""),
                     step_html(dash.data, step, _known(dash, adapter)))  # fmt: skip

    @app.get("/prompt/{group_index}", response_class=HTMLResponse)
    async def prompt_page(group_index: int, adapter: str = ""):
        return _page(f"prompt {group_index}" + (f" of {adapter}" if adapter else ""),
                     prompt_html(dash.data, group_index, _known(dash, adapter)), refresh=dash.live)  # fmt: skip

    @app.get("/step")
    async def step_form(s: int = 0, adapter: str = ""):
        return RedirectResponse(f"/step/{s}" + (f"?adapter={quote(_known(dash, adapter))}" if adapter else ""),
                                status_code=303)  # fmt: skip

    @app.get("/prompt")
    async def prompt_form(g: int = 0, adapter: str = ""):
        return RedirectResponse(f"/prompt/{g}" + (f"?adapter={quote(_known(dash, adapter))}" if adapter else ""),
                                status_code=303)  # fmt: skip

    @app.get("/favicon.ico")
    async def favicon():
        return Response(status_code=204)

# ---- views ---------------------------------------------------------------------------------------
ADAPTER_KEYS = {"reward": "raw_reward_mean", "step_time": "perf/step_time_s", "num_samples": "rollout/num_samples",
                "entropy": "train/entropy", "clipfrac": "train/pg_clipfrac", "kl": "train/ppo_kl"}  # fmt: skip
"""Multi-LoRA: an adapter's own names for the overview's curves (its records' `<name>/...`)."""


def curves(data: RunData, x: str = "step", adapter: str = "") -> dict:
    """Every curve of the overview, downsampled, over steps or wall-clock time (x=time); with
    `adapter` (a multi-LoRA partition's key), that adapter registration's, on its own step axis."""
    if adapter:
        part = data.part(adapter)
        rid = adapter.partition("@")[2]
        n = part.name
        rows = [r for r in data.metrics.rows if r.get("adapter") == n and str(r.get("registration", "")).startswith(rid)]
        xk = "time" if x == "time" else f"{n}/step"
        rate = [{xk: b[xk], "v": b.get(f"{n}/{ADAPTER_KEYS['num_samples']}", 0) / (b["time"] - a["time"])}
                for a, b in zip(rows, rows[1:], strict=False) if b.get("time", 0) > a.get("time", 0)]  # fmt: skip
        out = {k: series(rows, f"{n}/{v}", xk) for k, v in ADAPTER_KEYS.items() if k != "num_samples"}
        return {"x": "time" if x == "time" else "step", **out, "heldout": ([], []), "rollout_wait": ([], []),
                "train_time": ([], []), "samples_per_s": series(rate, "v", xk)}  # fmt: skip
    rows = data.metrics.rows
    xk = "time" if x == "time" else "step"
    key = data.heldout_key()
    evals = [e for e in data.evals.rows if key and e.get(key) is not None and not e.get("skipped")]
    if xk == "time":  # an eval point is placed at the time of the step it follows
        at = {r["step"]: r["time"] for r in rows if "step" in r and "time" in r}
        evals = [dict(e, time=at.get(e.get("step", 0) - 1, at.get(0))) for e in evals if at]
        evals = [e for e in evals if e.get("time") is not None]
    rate = []
    for a, b in zip(rows, rows[1:], strict=False):
        if "time" in a and "time" in b and b["time"] > a["time"]:
            rate.append({xk: b[xk], "v": b.get("rollout/num_samples", 0) / (b["time"] - a["time"])})
    return {
        "x": xk,
        "reward": series(rows, "rollout/reward/mean", xk),
        "heldout": series(evals, key, xk) if key else ([], []),
        "step_time": series(rows, "perf/step_time_s", xk),
        "rollout_wait": series(rows, "perf/rollout_wait_s", xk),
        "train_time": series(rows, "perf/train_time_s", xk),
        "samples_per_s": series(rate, "v", xk),
        "entropy": series(rows, "train/entropy", xk),
        "clipfrac": series(rows, "train/pg_clipfrac", xk),
        "kl": series(rows, "train/ppo_kl", xk),
    }


def staleness_columns(data: RunData, max_columns: int = 300, adapter: str = "") -> list[tuple[int, dict[int, int]]]:
    """The trained groups' staleness per step (from the ledger's leases), binned to at most
    max_columns columns."""
    per_step = data.part(adapter).step_staleness
    steps = sorted(per_step)
    if not steps:
        return []
    per = max(1, -(-len(steps) // max_columns))
    out = []
    for k in range(0, len(steps), per):
        merged: dict[int, int] = {}
        for s in steps[k : k + per]:
            for v, n in per_step[s].items():
                merged[v] = merged.get(v, 0) + n
        out.append((steps[k], merged))
    return out


def buffer_facts(data: RunData, adapter: str = "") -> dict:
    part = data.part(adapter)
    rep = part.audit()
    st = part.auditor.state
    last = data.metrics.rows[-1] if data.metrics.rows and not adapter else {}
    return {
        "queue": len(st.stored), "capacity": data.capacity, "released": rep["released_prompts"],
        "in_flight": len(st.outstanding), "leased_uncommitted": sum(len(x.refs) for x in st.leases.values()),
        "trained": rep["trained"], "failed": rep["failed"], "filtered": rep["filtered"],
        "dropped_aborted": rep["aborted_dropped"], "dropped_stale": rep["stale_dropped"],
        "recycled": rep["recycled"], "rejected": rep["rejected"], "recycled_waiting": len(st.recycled),
        "queue_at_last_step": last.get("rollout/fully_async/queue_size"),
        "dead_letters": data.dead_letters[-50:], "dead_letters_total": len(data.dead_letters),
    }  # fmt: skip


def _pair(xy: tuple[list[float], list[float]], name: str) -> tuple[str, list[float], list[float]]:
    return (name, xy[0], xy[1])


def _table(rows: list[list], head: list[str]) -> str:
    th = "".join(f"<th>{html.escape(h)}</th>" for h in head)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{th}</tr>{body}</table>"


def _num(v, fmt="{:.3f}") -> str:
    return fmt.format(v) if isinstance(v, (int, float)) else "-"


def overview_html(dash: Dashboard, x: str, adapter: str = "") -> str:
    data = dash.data
    s = data.summary()
    cv = curves(data, x, adapter)
    q = f"&adapter={quote(adapter)}" if adapter else ""
    xl = "wall-clock" if cv["x"] == "time" else "step"
    xt = cv["x"] == "time"
    held = s["heldout"]
    facts = (f'<div class="facts"><span>mode <b>{html.escape(str(s["mode"]))}</b></span>'
             f'<span>{"<b class=ok>live</b>" if s["live"] else "finished" if s["finished"] else "stopped"}</span>'
             f'<span>step <b>{s["step"]}/{s["total"] or "?"}</b></span>'
             f'<span>ETA {_num(s["eta_s"] if s["live"] else None, "{:.0f}s")}</span><span>reward {_num(s["reward"])}</span>'
             f'<span>held-out {_num(held[1]) if held else "-"}</span>'
             f'<span>staleness {_num(s["staleness"], "{:.2f}")}</span><span>weights v{s["weight_version"]}</span>'
             f'</div><p class="diagnosis" id="diagnosis">{html.escape(s["diagnosis"])}</p>')  # fmt: skip
    toggle = f'<a href="/?x=step{q}">by step</a> <a href="/?x=time{q}">by wall-clock</a>'
    if len(data.partitions) > 1:  # multi-LoRA: the run's own views, or one adapter registration's
        links = " ".join(
            f'<a href="/{"?adapter=" + quote(k) if k else ""}">{"<b>" if k == adapter else ""}'
            f'{html.escape(k + " (" + p.state + ")" if k else "the run")}{"</b>" if k == adapter else ""}</a>'
            for k, p in data.partitions.items()
        )
        toggle = f'<p id="partitions">views: {links}</p>' + toggle
    charts = [
        svg.lines("rewards", [_pair(cv["reward"], "rollout reward"), _pair(cv["heldout"], "held-out eval")], xl,
                  "reward", xt, markers=False),
        svg.lines("step time", [_pair(cv["step_time"], "step"), _pair(cv["rollout_wait"], "rollout wait"),
                                _pair(cv["train_time"], "train")], xl, "seconds", xt),
        svg.lines("samples per second", [_pair(cv["samples_per_s"], "samples/s")], xl, "samples/s", xt),
        svg.lines("entropy, clip fraction, KL", [_pair(cv["entropy"], "entropy"), _pair(cv["clipfrac"], "clip frac"),
                                                 _pair(cv["kl"], "KL")], xl, "", xt),
    ]  # fmt: skip
    vt = data.version_timeline()
    stale = [
        svg.heatmap("staleness of the trained groups per step", staleness_columns(data, adapter=adapter), "step",
                    "staleness"),
        svg.timeline("weight versions: engines and trainer", vt["engines"], vt["pauses"], vt["trainer"]),
    ]
    b = buffer_facts(data, adapter)
    buf = _table([[html.escape(k), html.escape(json.dumps(v) if isinstance(v, dict) else str(v))]
                  for k, v in b.items() if k not in ("dead_letters",)], ["buffer", ""])  # fmt: skip
    dead = _table([[html.escape(d["subject"]), html.escape(d["service"]), html.escape(d["reason"])]
                   for d in b["dead_letters"][-10:]], ["dead letter", "service", "reason"])  # fmt: skip
    svc = _table([[html.escape(x["name"]), x["pid"] or "-",
                   '<span class="ok">running</span>' if x["running"] else '<span class="bad">not running</span>',
                   x["restarts"], html.escape((x["last_restart"] or {}).get("why", "")),
                   f'<a href="{html.escape(x["url"])}">{html.escape(x["url"])}</a> '
                   f'(<a href="{html.escape(x["metrics"])}">metrics</a>)' if x["url"] else "-"]
                  for x in data.services()], ["process", "pid", "state", "restarts", "last exit cause", "address"])  # fmt: skip
    rep = data.audit(adapter)
    bal = ('<p class="ok">BALANCED</p>' if rep["balanced"] else
           '<p class="bad">NOT BALANCED</p><ul>' + "".join(f"<li>{html.escape(p)}</li>" for p in rep["problems"][:20])
           + "</ul>")  # fmt: skip
    audit = _table([[k, html.escape(str(rep[k]))] for k in ("released_prompts", "trained", "failed", "filtered",
                    "aborted_dropped", "stale_dropped", "rejected", "recycled", "in_flight_at_end", "lost",
                    "trained_twice", "events")], ["ledger", ""])  # fmt: skip
    steps = data.sample_steps(adapter)
    pick = (f'<form action="/step" method="get">step <input name="s" size="6" '
            f'value="{steps[-1] if steps else 0}"> <input type="hidden" name="adapter" value="{html.escape(adapter)}"> '
            "<button>show</button></form>"
            '<form action="/prompt" method="get">prompt (group index) <input name="g" size="6" value="0"> '
            f'<input type="hidden" name="adapter" value="{html.escape(adapter)}">'
            "<button>history</button></form>"
            f"<p>{len(steps)} steps recorded"
            + (f": <a href='/step/{steps[0]}{q.replace('&', '?', 1)}'>{steps[0]}</a> .. "
               f"<a href='/step/{steps[-1]}{q.replace('&', '?', 1)}'>{steps[-1]}</a>"
               if steps else "")
            + "</p>")  # fmt: skip
    errs = data.errors()
    err = (
        ("<ul>" + "".join(f"<li><code>{html.escape(e)}</code></li>" for e in errs) + "</ul>") if errs else "<p>none</p>"
    )
    warn = f'<p class="bad">streams: {html.escape(data.streams_error)}</p>' if data.streams_error else ""
    return f"""{facts}{warn}<h2>Curves</h2><p>{toggle}</p>{"".join(f'<div class="panel">{c}</div>' for c in charts)}
<h2>Staleness</h2>{"".join(f'<div class="panel">{c}</div>' for c in stale)}
<h2>Buffer</h2><div class="panel" id="buffer">{buf}</div><div class="panel" id="dead">{dead}</div>
<h2>Services</h2><div class="panel" id="services">{svc}</div>
<h2>Lineage</h2><div class="panel" id="lineage">{pick}</div><div class="panel" id="audit">{bal}{audit}</div>
<h2>Last errors</h2><div class="panel" id="errors">{err}</div>"""


def _segments(segs: list) -> str:
    out = []
    for text, version, mask in segs:
        hue = (version * 47) % 360 if isinstance(version, int) else 0
        bg = f"hsl({hue},70%,85%)" if isinstance(version, int) else "#eee"
        title = f"weight version {version}" if version is not None else "not generated by the model"
        out.append(f'<span class="seg{" mask0" if not mask else ""}" style="background:{bg}" '
                   f'title="{html.escape(title)}; loss mask {mask}">{html.escape(text) or "&#8203;"}</span>')  # fmt: skip
    return "".join(out)


def step_html(data: RunData, step: int, adapter: str = "") -> str:
    rec = data.step_record(step, adapter)
    q = f"?adapter={quote(adapter)}" if adapter else ""
    nav = (f'<p><a href="/step/{step - 1}{q}">&larr; step {step - 1}</a> '
           f'<a href="/step/{step + 1}{q}">step {step + 1} &rarr;</a></p>')
    if rec is None:
        return (
            nav
            + f"<p>No sample record for step {step} (not trained yet, pruned by --keep-sample-records, or kept off).</p>"
        )
    rows = []
    for g in rec["groups"]:
        for k, smp in enumerate(g["samples"]):
            first = k == 0
            rows.append([
                f'<a href="/prompt/{g["group_index"]}{q}">{g["group_index"]}</a> ({html.escape(str(g["group_id"]))})'
                if first else "",
                str(g["staleness"]) if first else "",
                f"<code>{html.escape(g['prompt'])}</code>" if first else "",
                _segments(smp["segments"]),
                _num(smp["reward"] if isinstance(smp["reward"], (int, float)) else None),
                _num(smp["advantage"]), html.escape(smp["fate"]), html.escape(str(smp["weight_versions"])),
            ])  # fmt: skip
    legend = (
        "<p>Each response is shown in spans: the background says the weight version that generated the "
        "tokens (hover for it), a dotted underline marks tokens out of the loss (loss mask 0).</p>"
    )
    return (f"{nav}<p>trained from weights v{rec['version']}, {len(rec['groups'])} groups</p>{legend}"
            + _table(rows, ["prompt (group)", "staleness", "prompt", "response", "reward", "advantage", "fate",
                            "versions"]))  # fmt: skip


def prompt_html(data: RunData, group_index: int, adapter: str = "") -> str:
    lin = data.lineage(group_index, adapter)
    q = f"?adapter={quote(adapter)}" if adapter else ""
    if not lin["events"]:
        return f"<p>The ledger has no event for prompt {group_index} (not released yet?).</p>"
    rows = []
    for e in lin["events"]:
        what = (
            e["kind"] + (f" ({e['outcome']})" if e.get("outcome") else "") + (" recycled" if e.get("recycled") else "")
        )
        step = e.get("step")
        rows.append([e["seq"], time.strftime("%H:%M:%S", time.localtime(e["at"])) if e.get("at") else "-",
                     html.escape(str(e["group_id"])), html.escape(what),
                     f'<a href="/step/{step}{q}">{step}</a>' if step is not None else "",
                     html.escape(str(e.get("staleness", ""))), html.escape(e.get("reason", ""))])  # fmt: skip
    restarts = "".join(f"<li>{time.strftime('%H:%M:%S', time.localtime(r['at']))} {html.escape(r['name'])}: "
                       f"{html.escape(r['why'])}</li>" for r in lin["restarts"])  # fmt: skip
    trained = lin["trained_step"]
    return (f'<p>fate: <b id="fate">{html.escape(str(lin["fate"]))}</b>'
            + (f' at <a href="/step/{trained}{q}">step {trained}</a>' if trained is not None else "") + "</p>"
            + _table(rows, ["ledger seq", "time", "attempt", "event", "step", "staleness", "reason"])
            + (f"<h2>Restarts meanwhile</h2><ul>{restarts}</ul>" if restarts else ""))  # fmt: skip


def _page(title: str, body: str, refresh: bool = False, nav: bool = True) -> str:
    meta = '<meta http-equiv="refresh" content="5">' if refresh else ""
    links = '<nav><a href="/">overview</a></nav>' if nav else ""
    return (f"<!doctype html><html><head><meta charset='utf-8'>{meta}<title>{html.escape(title)}</title>"
            f"<style>{CSS}</style></head><body>{links}<h1>{html.escape(title)}</h1>{body}</body></html>")  # fmt: skip


__all__ = ["Dashboard", "build_app", "curves", "downsample"]
