"""A stand-in NeMo Gym resources server for tests: the seed/verify protocol over real HTTP on
127.0.0.1, in a thread of its own (its own event loop: a route that never answers blocks nothing
of the test's).

Like a NeMo Gym server, it keeps each episode under a session cookie it sets on the first
request and reads back on the others: POST /seed_session stores the row, POST /calc_add (a tool:
{"a", "b"} -> their sum, a JSON number) counts in the session, POST /verify scores the episode's
response: reward 1 when its last assistant message is the row's `expected_answer`, and echoes the
request as NeMo Gym's BaseVerifyResponse does. A row's `fault` makes the server misbehave:
seed_error (HTTP 500), seed_hang (never answers), verify_error (HTTP 503), verify_garbage (an
HTML page), verify_no_reward (a JSON object without a reward)."""

from __future__ import annotations

import asyncio
import socket
import threading
import uuid

from aiohttp import web

COOKIE = "standin_session"


class StandIn:
    def __init__(self):
        self.sessions: dict[str, dict] = {}
        """session id -> {"row": the seeded row, "calls": the tool calls' arguments, "verified": /verify's body}"""
        self.log: list[tuple[str, str | None]] = []
        """(route, session id) of every request, in order."""
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._runner: web.AppRunner | None = None

    @web.middleware
    async def _session(self, request: web.Request, handler):
        """Every answer to a request without the session cookie sets one (NeMo Gym's session middleware)."""
        self.log.append((request.path.lstrip("/"), request.cookies.get(COOKIE)))
        response = await handler(request)
        if COOKIE not in request.cookies and COOKIE not in response.cookies:
            response.set_cookie(COOKIE, uuid.uuid4().hex)
        return response

    async def seed_session(self, request: web.Request) -> web.Response:
        row = await request.json()
        if row.get("fault") == "seed_error":
            return web.Response(status=500, text="Internal Server Error: no such task")
        if row.get("fault") == "seed_hang":
            await asyncio.sleep(3600)
        sid = request.cookies.get(COOKIE) or uuid.uuid4().hex
        self.sessions[sid] = {"row": row, "calls": [], "verified": None}
        response = web.json_response({})
        response.set_cookie(COOKIE, sid)
        return response

    async def calc_add(self, request: web.Request) -> web.Response:
        args = await request.json()
        session = self.sessions.get(request.cookies.get(COOKIE))
        if session is None:
            return web.json_response({"detail": "no session: seed it first"}, status=400)
        if not isinstance(args.get("a"), int) or not isinstance(args.get("b"), int):
            return web.json_response({"detail": [{"msg": "a and b must be integers"}]}, status=422)
        session["calls"].append(args)
        return web.json_response(args["a"] + args["b"])

    async def verify(self, request: web.Request) -> web.Response:
        body = await request.json()
        fault = body.get("fault")
        if fault == "verify_error":
            return web.Response(status=503, text="Service Unavailable")
        if fault == "verify_garbage":
            return web.Response(text="<html>upstream error</html>", content_type="text/html")
        if fault == "verify_no_reward":
            return web.json_response({"accuracy": True})
        session = self.sessions.get(request.cookies.get(COOKIE))
        if session is None:
            return web.json_response({"detail": "no session: seed it first"}, status=400)
        session["verified"] = body
        texts = [c["text"] for item in body["response"]["output"] if item["type"] == "message"
                 for c in item["content"] if c["type"] == "output_text"]  # fmt: skip
        right = bool(texts) and texts[-1].strip() == str(body.get("expected_answer"))
        return web.json_response({**body, "reward": float(right), "accuracy": right,
                                  "tool_calls_made": len(session["calls"])})  # fmt: skip

    # ---- running it ----------------------------------------------------------------------------

    def __enter__(self) -> StandIn:
        started = threading.Event()
        self._loop = asyncio.new_event_loop()

        async def start() -> None:
            app = web.Application(middlewares=[self._session])
            app.router.add_post("/seed_session", self.seed_session)
            app.router.add_post("/calc_add", self.calc_add)
            app.router.add_post("/verify", self.verify)
            self._runner = web.AppRunner(app, access_log=None, handler_cancellation=True, shutdown_timeout=1.0)
            await self._runner.setup()
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            await web.SockSite(self._runner, sock).start()
            self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"

        def run() -> None:
            asyncio.set_event_loop(self._loop)
            self._loop.run_until_complete(start())
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=run, name="nemogym-standin", daemon=True)
        self._thread.start()
        assert started.wait(20), "the stand-in resources server did not start"
        return self

    def __exit__(self, *exc) -> None:
        async def stop() -> None:
            await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
