"""--env openenv:URL against a real OpenEnv server (openenv-core's FastAPI app, its WebSocket
sessions) and the real engine: every episode is its own session, observations enter the sample
as ids out of the loss, the model's turns are the ids the engine sampled, and the episode's
reward is what the environment gave."""

from __future__ import annotations

import asyncio
import socket
import threading
import time

import pytest

pytest.importorskip("openenv", reason="the openenv extra: pip install -e '.[openenv]'")
pytest.importorskip("websockets", reason="the openenv extra: pip install -e '.[openenv]'")

import uvicorn  # noqa: E402
from openenv.core.env_server.http_server import create_fastapi_app  # noqa: E402
from openenv.core.env_server.interfaces import Environment  # noqa: E402
from openenv.core.env_server.types import Action, Observation, State  # noqa: E402

from asyncrl_proto.messages import Sample, SampleStatus  # noqa: E402
from services.common.config import RunConfig  # noqa: E402
from services.common.sglang_client import SGLangClient  # noqa: E402
from services.envs import openenv as connector  # noqa: E402
from services.envs.generate import EngineHandle, generate_function  # noqa: E402
from services.envs.trajectory import env_reward  # noqa: E402
from services.model.tokenizer import Tokenizer  # noqa: E402
from tests.conftest import EngineThread  # noqa: E402

EPISODES: dict[str, list] = {}
"""episode id -> what the environment saw and answered, for the test to compare."""


class TextAction(Action):
    message: str


class TextObservation(Observation):
    reply: str = ""


class CountEnv(Environment[TextAction, TextObservation, State]):
    """Answers each turn with its length and `=`; rewards a turn that holds a 7; done after 3."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state = State()

    def reset(self, seed=None, episode_id=None, **kw) -> TextObservation:
        self._state = State(episode_id=episode_id or kw.get("name"), step_count=0)
        EPISODES[self._state.episode_id] = []
        return TextObservation(reply=f"{kw.get('start', 12)}=", done=False, reward=None)

    def step(self, action: TextAction, timeout_s=None, **kw) -> TextObservation:
        self._state.step_count += 1
        reward = 1.0 if "7" in action.message else 0.0
        reply = f"{len(action.message)}="
        EPISODES[self._state.episode_id].append((action.message, reply, reward))
        return TextObservation(reply=reply, done=self._state.step_count >= 3, reward=reward)

    @property
    def state(self) -> State:
        return self._state


@pytest.fixture(scope="module")
def env_url():
    app = create_fastapi_app(CountEnv, TextAction, TextObservation, max_concurrent_envs=8)
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert time.monotonic() < deadline, "the OpenEnv server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    server.should_exit = True
    thread.join(10)
    sock.close()


@pytest.fixture(scope="module")
def engine_url(tiny_model_dir):
    with EngineThread(tiny_model_dir) as engine:
        yield engine.url


async def test_an_episode_is_a_session_and_a_sample_token_in_token_out(env_url, engine_url, tiny_model_dir):
    config = RunConfig(env=f"openenv:{env_url}", env_max_turns=5, rollout_max_response_len=4)
    assert generate_function(config) is connector.generate
    tok = Tokenizer(tiny_model_dir)
    client = SGLangClient([engine_url])
    handle = EngineHandle(client, tok)
    try:
        samples = []
        for i in range(4):
            prompt = tok.encode("55=")
            s = Sample(index=i, prompt="55=", metadata={"_input_ids": prompt,
                                                        "env_reset": {"name": f"ep{i}", "start": 30 + i}})
            params = {"max_new_tokens": 4, "temperature": 1.0, "stop_token_ids": []}
            samples.append((await connector.generate(config, s, handle, params), prompt))
    finally:
        await client.close()
    for i, (s, prompt) in enumerate(samples):
        seen = EPISODES[f"ep{i}"]
        assert 1 <= len(seen) <= 3  # done after 3 steps
        assert s.metadata["env_turns"][0] == f"{30 + i}="  # the reset's observation, with its arguments
        # every observation but the one after the last step (done: nothing more to answer)
        assert s.metadata["env_turns"] == [f"{30 + i}="] + [reply for _, reply, _ in seen][: len(seen) - 1]
        # the model's turns are what the environment received
        sent = [tok.decode(tok.encode(t, add_special_tokens=False)) for t in s.metadata["turns"]]
        assert [m for m, _, _ in seen] == sent
        assert s.metadata["env_reward"] == sum(r for _, _, r in seen) == await env_reward(config, s)
        # ids: the prompt, then observation ids (mask 0) and sampled ids (mask 1), nothing else
        assert s.tokens[: len(prompt)] == prompt
        assert len(s.loss_mask) == s.response_length == len(s.tokens) - len(prompt)
        env_ids = [t for t, m in zip(s.tokens[len(prompt):], s.loss_mask, strict=True) if m == 0]
        assert env_ids == [t for text in s.metadata["env_turns"] for t in tok.encode(text, add_special_tokens=False)]
        assert len(s.rollout_log_probs) == s.response_length
        assert all(lp == 0.0 for lp, m in zip(s.rollout_log_probs, s.loss_mask, strict=True) if m == 0)
        assert len(s.metadata["turn_versions"]) == len(s.metadata["turns"]) == len(seen)


async def test_an_episode_stops_at_the_models_context_length(env_url, engine_url, tiny_model_dir):
    """Never a prompt the engine would refuse: the episode ends TRUNCATED when the context is full,
    its last observation cut to what fits."""
    config = RunConfig(env=f"openenv:{env_url}", env_max_turns=5, rollout_max_response_len=4)
    tok = Tokenizer(tiny_model_dir)
    client = SGLangClient([engine_url])
    prompt = tok.encode("55=")
    limit = len(prompt) + 3 + 6  # the reset's observation ("30=") and room for two short steps at most
    try:
        handle = EngineHandle(client, tok, context_length=limit)
        s = Sample(index=0, prompt="55=", metadata={"_input_ids": prompt, "env_reset": {"name": "full", "start": 30}})
        s = await connector.generate(config, s, handle, {"max_new_tokens": 4, "temperature": 1.0})
    finally:
        await client.close()
    assert s.status is SampleStatus.TRUNCATED and len(s.tokens) == limit
    assert len(EPISODES["full"]) < 3  # cut before the environment said done
    env_ids = [t for t, m in zip(s.tokens[len(prompt):], s.loss_mask, strict=True) if m == 0]
    assert tok.decode(env_ids) == "".join(s.metadata["env_turns"])


async def test_an_environment_error_fails_the_trajectory_with_its_reason(env_url, engine_url, tiny_model_dir):
    config = RunConfig(env=f"openenv:{env_url}", env_action_key="not_a_field")
    tok = Tokenizer(tiny_model_dir)
    client = SGLangClient([engine_url])
    try:
        s = Sample(index=0, prompt="5=", metadata={"_input_ids": tok.encode("5=")})
        with pytest.raises(connector.EnvError, match="step"):
            await connector.generate(config, s, EngineHandle(client, tok), {"max_new_tokens": 2})
    finally:
        await client.close()


async def test_episodes_past_the_servers_capacity_wait_for_a_session(env_url, engine_url, tiny_model_dir):
    """The server takes 8 sessions; 24 trajectories at once, at most 4 open per process, all finish."""
    config = RunConfig(env=f"openenv:{env_url}", env_max_sessions=4, env_max_turns=3)
    tok = Tokenizer(tiny_model_dir)
    client = SGLangClient([engine_url])
    try:
        handle = EngineHandle(client, tok)
        meta = [{"_input_ids": tok.encode("5="), "env_reset": {"name": f"c{i}"}} for i in range(24)]
        samples = [Sample(index=i, prompt="5=", metadata=m) for i, m in enumerate(meta)]
        params = {"max_new_tokens": 2, "temperature": 1.0}
        done = await asyncio.gather(*(connector.generate(config, s, handle, params) for s in samples))
    finally:
        await client.close()
    assert all(s.metadata["env_turns"] for s in done) and all(f"c{i}" in EPISODES for i in range(24))


def test_the_env_flag_is_checked_and_picks_the_reward():
    assert RunConfig(env="openenv:http://x").rollout.env == "openenv:http://x"
    for wrong in ("gym:thing", "openenv:", "verifiers:mytasks"):
        with pytest.raises(ValueError, match="openenv:URL, nemogym:URL or verifiers:MODULE:TASK"):
            RunConfig(env=wrong)
    with pytest.raises(ValueError, match="give one"):
        RunConfig(env="openenv:http://x", custom_generate_function_path="services.tasks.multiturn.generate")
    assert connector.observation_text({"reply": "a", "n": 3}, None) == "a"
    assert connector.observation_text({"a": "x", "b": "y"}, None) == '{"a": "x", "b": "y"}'
    assert connector.observation_text({"a": "x", "b": "y"}, "b") == "y"
    assert connector._ws_url("https://h:1/") == "wss://h:1/ws"
