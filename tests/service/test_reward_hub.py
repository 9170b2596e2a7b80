"""The reward hub as a producer runs it: graders in worker processes (a hung one is killed at
--reward-timeout-s, an exploding one fails its sample, and the next sample grades normally), a
sample's metadata.rm_type over --rm-type, and remote_rm against a real HTTP reward server
(bearer token from the environment, retries of 5xx and refused connections, bounded
concurrency, unusable answers)."""

from __future__ import annotations

import asyncio
import socket

import pytest
from aiohttp import web

from services.api import RunConfig, Sample, SampleStatus
from services.rewards import resolve_reward, score_sample
from services.rewards.remote import RM_TOKEN_ENV


def sample(response: str, label, **metadata) -> Sample:
    return Sample(index=0, status=SampleStatus.COMPLETED, prompt="q", response=response, label=label,
                  metadata=dict(metadata))  # fmt: skip


async def scored(config: RunConfig, s: Sample):
    ok = await score_sample(resolve_reward(config), config, s)
    return s.reward if ok else s.metadata["reward_error"]


async def test_graders_run_in_workers_and_a_hung_one_costs_only_its_sample():
    config = RunConfig(rm_type="boxed_math", reward_timeout_s=2.0, reward_num_workers=1)
    assert await scored(config, sample("so \\boxed{0.5}", "\\frac{1}{2}")) == 1.0
    # math-verify works on this for 5 s (its own limit): the worker is killed at 2 s instead
    hung = sample("\\boxed{\\sin(x)^{999}}", "\\cos(x)^{999}")
    assert "ran past --reward-timeout-s 2s" in await scored(config, hung)
    assert hung.status is SampleStatus.FAILED and hung.reward is None
    # an exploding grader (DAPO's labels are integers) fails its sample with the reason
    assert "ValueError" in await scored(config, sample("Answer: 3", "three", rm_type="dapo"))
    # the pool goes on: a new worker grades the next samples, each by its own rm_type
    assert await scored(config, sample("\\boxed{1/3}", "2/6")) == 1.0
    assert await scored(config, sample("The answer is B", "B", rm_type="gpqa")) == 1.0
    assert await scored(config, sample("12", "21", rm_type="reverse-digits")) == 0.0
    assert "unknown" in await scored(config, sample("x", "y", rm_type="nope"))
    assert await scored(config, sample("anything", None, rm_type="random")) in (0.0, 1.0)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RewardServer:
    """A reward model over HTTP: 1.0 when the response equals the label; its behaviour is set
    per test (failures before success, a token to demand, an answer to give)."""

    def __init__(self):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}/score"
        self.fail_first = 0
        self.status = 503
        self.token: str | None = None
        self.answer = None
        self.calls = 0
        self.in_flight = self.max_in_flight = 0
        self.bodies: list = []

    async def handle(self, request: web.Request) -> web.Response:
        self.calls += 1
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(0.02)  # the model's work: lets concurrent requests overlap
            if self.token and request.headers.get("Authorization") != f"Bearer {self.token}":
                return web.json_response({"error": "unauthorized"}, status=401)
            if self.fail_first > 0:
                self.fail_first -= 1
                return web.Response(status=self.status, text="busy")
            body = await request.json()
            self.bodies.append(body)
            if self.answer is not None:
                return web.Response(text=self.answer, content_type="application/json")
            return web.json_response(1.0 if body["response"] == body["label"] else 0.0)
        finally:
            self.in_flight -= 1


@pytest.fixture
async def rm_server():
    server = RewardServer()
    app = web.Application()
    app.router.add_post("/score", server.handle)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", server.port).start()
    yield server
    await runner.cleanup()


def rm_config(url: str, **kw) -> RunConfig:
    return RunConfig(**{"rm_type": "remote_rm", "rm_url": url, "rm_retries": 2, "reward_timeout_s": 5, **kw})


async def test_remote_rm_posts_prompt_response_and_label(rm_server):
    config = rm_config(rm_server.url)
    assert await scored(config, sample("12", "12")) == 1.0
    assert await scored(config, sample("13", "12")) == 0.0
    assert rm_server.bodies[0] == {"prompt": "q", "response": "12", "label": "12"}
    # boxed_remote_rm sends the response as it is, as Miles does
    assert await scored(rm_config(rm_server.url).model_copy(update={"rm_type": "boxed_remote_rm"}),
                        sample("\\boxed{1}", "\\boxed{1}")) == 1.0  # fmt: skip
    # a dict answer, read with --reward-key
    rm_server.answer = '{"score": 0.25, "acc": 0.0}'
    assert await scored(rm_config(rm_server.url, reward_key="score"), sample("a", "b")) == {"score": 0.25, "acc": 0.0}


async def test_the_bearer_token_comes_from_the_environment(rm_server, monkeypatch):
    rm_server.token = "s3cret"
    monkeypatch.delenv(RM_TOKEN_ENV, raising=False)
    refused = await scored(rm_config(rm_server.url, rm_type="boxed_remote_rm"), sample("1", "1"))
    assert "HTTP 401" in refused and "s3cret" not in refused
    monkeypatch.setenv(RM_TOKEN_ENV, "s3cret")
    assert await scored(rm_config(rm_server.url), sample("1", "1")) == 1.0
    assert "s3cret" not in rm_config(rm_server.url).model_dump_json()


async def test_5xx_and_refused_connections_are_retried_then_the_sample_fails(rm_server):
    rm_server.fail_first = 2  # two 503s, then an answer: within --rm-retries 2
    assert await scored(rm_config(rm_server.url), sample("1", "1")) == 1.0
    assert rm_server.calls == 3
    rm_server.fail_first, rm_server.status, rm_server.calls = 10, 500, 0
    failed = sample("1", "1")
    why = await scored(rm_config(rm_server.url), failed)
    assert "failed 3 time(s)" in why and "HTTP 500" in why and rm_server.calls == 3
    assert failed.status is SampleStatus.FAILED
    closed = f"http://127.0.0.1:{free_port()}/score"  # nothing listens there
    assert "failed 3 time(s)" in await scored(rm_config(closed), sample("1", "1"))


@pytest.mark.parametrize("answer", ['"0.5"', "NaN", '{"x": "y"}', "[1.0]", "not json"])
async def test_an_unusable_answer_fails_the_sample(rm_server, answer):
    rm_server.answer = answer
    why = await scored(rm_config(rm_server.url), sample("1", "1"))
    assert "unusable value" in why or "no JSON" in why


async def test_remote_calls_are_bounded_per_process(rm_server):
    config = rm_config(rm_server.url, rm_max_concurrency=3)
    fn = resolve_reward(config)
    samples = [sample(str(i), str(i)) for i in range(12)]
    assert all(await asyncio.gather(*(score_sample(fn, config, s) for s in samples)))
    assert rm_server.max_in_flight == 3 and all(s.reward == 1.0 for s in samples)
