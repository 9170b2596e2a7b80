"""OpenEnv environments in the loop: `--env openenv:URL`.

An OpenEnv server (openenv-core) keeps an episode only within a WebSocket session (`URL/ws`; its
HTTP /reset and /step build a fresh environment per call), so each trajectory opens one session:

    reset (the row's metadata.env_reset, if any, as its arguments)
    -> observation (appended as ids out of the loss)
    -> the model's turn (the engine's ids, in the loss) -> step {--env-action-key: its text}
    -> observation ... until the environment says done, or --env-max-turns, or the token budget,
       or the model's context length (the sample is then TRUNCATED, its last observation cut).

Token in, token out: an observation's text is tokenized once, when it is appended. The episode's
reward is the sum of the step rewards (metadata["env_reward"]). A process keeps at most
--env-max-sessions episodes open; the server must allow that many per process (its max_concurrent_envs).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import uuid

from asyncrl_proto.messages import Sample, SampleStatus
from services.envs.trajectory import EnvError, Trajectory, gated

MAX_MESSAGE_BYTES = 16 * 2**20
CALL_TIMEOUT_S = 300.0
"""An environment that takes longer to answer reset or step fails the episode (its group is retried)."""


def _ws_url(url: str) -> str:
    url = re.sub(r"^http(s?)://", r"ws\1://", url.rstrip("/"))
    return url if url.endswith("/ws") else url + "/ws"


def observation_text(observation: dict, key: str | None) -> str:
    """The observation field the model sees: `key`, else its one text field, else it as JSON."""
    if key is not None:
        if key not in observation:
            raise EnvError(f"the observation has no field {key!r} (--env-observation-key); "
                           f"it has {sorted(observation)}")
        return str(observation[key])
    texts = [v for v in observation.values() if isinstance(v, str)]
    return texts[0] if len(texts) == 1 else json.dumps(observation, sort_keys=True)


async def call(ws, kind: str, data: dict | None = None) -> dict:
    """One request of an OpenEnv WebSocket session and its answer (strictly in turn)."""
    await ws.send(json.dumps({"type": kind, "data": data or {}}))
    try:
        answer = json.loads(await asyncio.wait_for(ws.recv(), CALL_TIMEOUT_S))
    except TimeoutError:
        raise EnvError(f"the environment did not answer {kind} within {CALL_TIMEOUT_S:.0f}s") from None
    if answer.get("type") == "error":
        err = answer.get("data") or {}
        raise EnvError(f"the environment answered {kind} with {err.get('code', 'an error')}: "
                       f"{str(err.get('message'))[:300]}")  # fmt: skip
    if answer.get("type") != "observation" or not isinstance(answer.get("data"), dict):
        raise EnvError(f"the environment answered {kind} with {str(answer)[:200]}")
    return answer["data"]


def _connect(url: str):
    try:
        from websockets.asyncio.client import connect
    except ImportError as e:
        raise EnvError("--env openenv needs the websockets client: pip install 'asyncrl[openenv]'") from e
    return connect(_ws_url(url), max_size=MAX_MESSAGE_BYTES, open_timeout=30)


def check(config) -> None:
    """At start-up: the client this connector needs is installed."""
    _connect(config.rollout.env_spec.url)


async def _episode(config, sample: Sample, engine, sampling_params: dict) -> Sample:
    r = config.rollout
    tok = engine.tokenizer
    traj = Trajectory(sample, sample.metadata.pop("_input_ids"))
    budget = int(sampling_params.get("max_new_tokens", r.max_response_len))
    rid = f"s{sample.index}-{uuid.uuid4().hex[:8]}"
    reward, done = 0.0, False
    cut: list[bool] = []  # an observation was cut at the context length

    def observe(data: dict) -> None:
        if text := observation_text(data.get("observation") or {}, r.env_observation_key):
            ids = tok.encode(text, add_special_tokens=False)
            room = max(0, traj.room(engine.context_length))
            if len(ids) > room:  # out of the loss: cut to what the model can see, and the episode ends
                ids, text = ids[:room], tok.decode(ids[:room], skip_special_tokens=False)
                cut.append(True)
            traj.env_turn(ids, text)

    async with _connect(r.env_spec.url) as ws:
        first = await call(ws, "reset", dict(sample.metadata.get("env_reset") or {}))
        observe(first)
        done = bool(first.get("done"))
        for turn in range(r.env_max_turns):
            left = budget * r.env_max_turns - traj.response_tokens  # a turn's budget, and the episode's
            if done or left <= 0:
                break
            if traj.room(engine.context_length) <= 0:
                traj.sample.status = SampleStatus.TRUNCATED  # the context is full: the episode cannot go on
                break
            params = dict(sampling_params, max_new_tokens=min(budget, left, traj.room(engine.context_length)))
            ids = traj.model_turn(await engine.generate(traj.context, params, rid=f"{rid}-t{turn}"))
            if traj.aborted:
                break
            text = tok.decode(ids, skip_special_tokens=True)
            result = await call(ws, "step", {r.env_action_key: text})
            reward += float(result.get("reward") or 0.0)
            done = bool(result.get("done"))
            if not done:
                observe(result)
        with contextlib.suppress(Exception):  # the episode is complete whether or not the server hears this
            await ws.send(json.dumps({"type": "close"}))
    sample.metadata["env_reward"] = reward
    sample.metadata["env_done"] = done
    if cut and not traj.aborted:
        traj.sample.status = SampleStatus.TRUNCATED
    return traj.finish()


generate = gated(_episode)
