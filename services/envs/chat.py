"""A chat endpoint for libraries that drive the model through an OpenAI client (verifiers), with
every turn recorded token in, token out.

The producer serves `/v1/chat/completions` on a local port (one per producer, started with the
first episode). Each request names its episode in `model` and goes on to an engine with
`return_token_ids` and `logprobs`; the answer is recorded under that episode before the client
sees it. `assemble` builds the sample from the recorded turns: turn k's prompt must begin with
everything before it; what it adds is the environment's (loss mask 0), what the engine sampled
the model's (loss mask 1). Nothing is re-tokenized: a template that re-renders an earlier turn
differently breaks that prefix, and the sample fails with that reason. `recorded_turn` and
`assemble` also serve --env nemogym, which asks the engine directly.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import uuid

from aiohttp import web

from asyncrl_proto.messages import Sample
from services.envs.trajectory import EnvError, Trajectory

EPISODE_PREFIX = "episode-"


class TurnMismatch(ValueError):
    """A recorded conversation that is not one token sequence."""


class ChatRecorder:
    """The recording chat endpoint; `episode()` names one episode's requests and collects them."""

    _shared: dict = {}
    """engine client -> the task starting its recorder (one per client, however many episodes ask at once)."""

    def __init__(self, client):
        self.client = client
        self.turns: dict[str, list[dict]] = {}
        self.url = ""
        self._runner: web.AppRunner | None = None

    @classmethod
    async def for_engine(cls, engine) -> ChatRecorder:
        """One recorder per engine client in this process, started on first use."""
        if engine.client not in cls._shared:
            cls._shared[engine.client] = asyncio.ensure_future(cls(engine.client).start())
        return await asyncio.shield(cls._shared[engine.client])

    async def start(self) -> ChatRecorder:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))  # a free port, ours before anyone else can take it
        await web.SockSite(self._runner, sock).start()
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        return self

    async def close(self) -> None:
        self._shared.pop(self.client, None)
        if self._runner is not None:
            await self._runner.cleanup()

    @contextlib.contextmanager
    def episode(self):
        """A fresh episode name (the `model` its client sends) and, after it, its turns."""
        name = EPISODE_PREFIX + uuid.uuid4().hex
        self.turns[name] = []
        try:
            yield name
        finally:
            self.turns.pop(name, None)

    async def _chat(self, request: web.Request) -> web.Response:
        body = await request.json()
        name = body.get("model")
        if name not in self.turns:
            return web.json_response({"error": {"message": f"unknown episode {str(name)[:80]!r}"}}, status=404)
        if body.get("stream"):
            return web.json_response({"error": {"message": "stream: this endpoint answers whole turns"}},
                                     status=400)  # fmt: skip
        body = {**body, "model": None, "return_token_ids": True, "logprobs": True, "top_logprobs": None}
        body = {k: v for k, v in body.items() if v is not None}
        try:
            answer = await ask_engine(self.client, body, "verifiers")
        except Exception as e:  # the client sees the engine's refusal (or an answer without ids) as an HTTP error
            return web.json_response({"error": {"message": str(e)[:500]}}, status=502)
        self.turns[name].append(recorded_turn(answer, bool(body.get("tools"))))
        return web.json_response(answer)


async def ask_engine(client, body: dict, env: str) -> dict:
    """One chat request on an engine; EnvError unless it answers with `return_token_ids` (the
    prompt's and the sampled ids)."""
    answer = await client.chat_completions(client.pick(), body)
    if "prompt_token_ids" not in answer or "token_ids" not in (answer.get("choices") or [{}])[0]:
        raise EnvError(f"the engine did not return token ids: --env {env} needs an engine that answers "
                       "return_token_ids (the built-in one)")  # fmt: skip
    return answer


def recorded_turn(answer: dict, tools_offered: bool) -> dict:
    """One chat answer with token ids (ask_engine) as the turn `assemble` reads: the prompt's
    and the sampled ids, their log-probs, the weight versions and the finish reason, the reply's
    text (None for a reply of tool calls: it is decoded from its ids) and, where tools were
    offered, how many calls the reply made."""
    choice = answer["choices"][0]
    return {
        "prompt_ids": list(answer["prompt_token_ids"]),
        "ids": list(choice["token_ids"]),
        "logprobs": [float(e["logprob"]) for e in (choice.get("logprobs") or {}).get("content") or []],
        "meta_info": {**choice.get("meta_info", {}), "finish_reason": {"type": choice.get("finish_reason")}},
        "text": None if choice["message"].get("tool_calls") else choice["message"].get("content") or "",
        "tool_calls": len(choice["message"].get("tool_calls") or []) if tools_offered else None,
    }  # fmt: skip


def assemble(sample: Sample, turns: list[dict], decode) -> Sample:
    """The sample of a recorded conversation (see the module), from its first turn's prompt on;
    `decode`: ids -> text, for the record."""
    if not turns:
        raise TurnMismatch("the episode made no model call")
    traj = Trajectory(sample, turns[0]["prompt_ids"])
    offered = [turn["tool_calls"] for turn in turns if turn.get("tool_calls") is not None]
    if offered:  # an episode that had tools counts its calls (rollout/tool_call_ratio); one without has no metric
        traj.tool_calls = sum(offered)
    for k, turn in enumerate(turns):
        context = traj.context
        if turn["prompt_ids"][: len(context)] != context:
            raise TurnMismatch(f"turn {k}'s prompt does not begin with the conversation so far (the chat template "
                               "renders an earlier turn differently): not one token sequence")  # fmt: skip
        if added := turn["prompt_ids"][len(context) :]:
            traj.env_turn(added, decode(added))
        pairs = [[lp, t, None] for lp, t in zip(turn["logprobs"], turn["ids"], strict=True)]
        text = turn["text"] if turn["text"] is not None else decode(turn["ids"])  # a reply of tool calls: as written
        resp = {"text": text, "meta_info": {**turn["meta_info"], "output_token_logprobs": pairs}}
        traj.model_turn(resp)
        if traj.aborted:  # the engine cut this turn (a weight update's pause): the sample ends ABORTED
            break
    return traj.finish()
