"""Shared fixtures: a real nats-server with JetStream (one per test session, free port, temporary
store), unique run ids, the task's tiny model and data, and a built-in engine over real HTTP."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time
import uuid

import pytest

from services.common import procs
from services.common.natsserver import EmbeddedNats


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory):
    srv = EmbeddedNats(tmp_path_factory.mktemp("nats")).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="module")
def role_server(tmp_path_factory):
    """A nats-server with one user per role of one run (the least-privilege bus):
    (server, run_id, passwords by role)."""
    from services.common.natsauth import ROLES, server_auth_conf
    from services.common.secrets import new_secret

    run_id = "a" + uuid.uuid4().hex[:10]
    passwords = {r: new_secret() for r in ROLES}
    srv = EmbeddedNats(tmp_path_factory.mktemp("rolenats"), auth_conf=server_auth_conf(run_id, passwords)).start()
    yield srv, run_id, passwords
    srv.stop()


async def connect_role(role_server, role: str):
    """A Bus of `role_server`'s run, connected with `role`'s identity (admin: as the launcher)."""
    from services.common.bus import Bus
    from services.common.secrets import NatsCredentials

    srv, run_id, pw = role_server
    return await Bus.connect(srv.url, run_id, role if role != "admin" else "launcher",
                             creds=NatsCredentials(user=role, password=pw[role]))  # fmt: skip


def perturbed_model(model_dir, seed: int, scale: float = 0.05):
    """The model at `model_dir` with every weight moved by seeded noise: another weight version."""
    import torch

    from services.model.hf_io import load_model

    model = load_model(model_dir)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=g) * scale)
    return model


@pytest.fixture
def run_id() -> str:
    return "t" + uuid.uuid4().hex[:12]


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    from services.tasks import reverse_digits

    d = tmp_path_factory.mktemp("model") / "tiny"
    reverse_digits.build_model(d, seed=1234, warmup_sft_steps=20, log=lambda *_: None)
    return d


TOOL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}[{% for t in tools %}{{ t['function']['name'] }}{% endfor %}]{% endif %}"
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ m['content'] }}{% for c in m['tool_calls'] or [] %}"
    "<tool_call>{\"name\": \"{{ c['function']['name'] }}\", \"arguments\": {{ c['function']['arguments'] | tojson }}}"
    "</tool_call>{% endfor %}{{ eos_token }}{% elif m['role'] == 'tool' %}({{ m['content'] }}){% else %}"
    "{{ m['content'] }}{% endif %}{% endfor %}"
)
"""A chat template in the Qwen/Hermes manner, short enough for a character model: the tools'
names, the messages' text, an assistant's calls as <tool_call> blocks, a tool's answer in brackets."""
TOOL_CALL = '<tool_call>{"name": "calc_add", "arguments": {"a": 1, "b": 2}}</tool_call>'


@pytest.fixture(scope="session")
def tool_model_dir(tmp_path_factory):
    """A character model warm-started on one tool-using conversation, so that greedy decoding
    replays it: to "1+2", offered the tool calc_add, it calls calc_add(a=1, b=2); given the tool's
    answer "(3)", it answers "3"."""
    import torch

    from services.model.hf_io import save_model
    from services.model.llama import CausalLM, ModelConfig
    from services.model.tokenizer import Tokenizer
    from services.tasks import char_model as cm

    d = tmp_path_factory.mktemp("model") / "tools"
    cm.build_char_tokenizer(d, 256, chat_template=TOOL_TEMPLATE)
    tok = Tokenizer(d)
    tools = [{"type": "function", "function": {"name": "calc_add"}}]
    first = [{"role": "user", "content": "1+2"}]
    call = {"role": "assistant", "content": "", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "calc_add", "arguments": {"a": 1, "b": 2}}}]}  # fmt: skip
    second = [*first, call, {"role": "tool", "tool_call_id": "c", "content": "3"}]
    pairs = [(tok.encode(tok.render_chat(first, tools=tools), add_special_tokens=False), cm.encode(TOOL_CALL) + [cm.EOS_ID]),
             (tok.encode(tok.render_chat(second, tools=tools), add_special_tokens=False), cm.encode("3") + [cm.EOS_ID])]  # fmt: skip
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=len(cm.SPECIAL) + len(cm.ALPHABET), hidden_size=64, intermediate_size=256,
                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=256,
                      bos_token_id=cm.BOS_ID, eos_token_id=cm.EOS_ID, pad_token_id=cm.PAD_ID)  # fmt: skip
    model = CausalLM(cfg)
    model.init_weights(0)
    cm.warm_start(model, lambda rng: rng.choice(pairs), steps=150, seed=0, batch=8, lr=3e-3)
    save_model(model, d)
    return d


@pytest.fixture(scope="session")
def task_data(tmp_path_factory):
    from services.tasks import reverse_digits

    return reverse_digits.write_datasets(tmp_path_factory.mktemp("data"), seed=0)


class EngineThread:
    """The built-in engine (scheduler + HTTP server) inside the test process, on a free port."""

    def __init__(self, model_dir, weight_version: str = "0", max_running_requests: int = 64, seed: int = 0,
                 api_key: str | None = None, on_death=None, weights=None, staged_loading: bool = True,
                 max_loras: int = 0, max_lora_rank: int = 8, keys=None, tool_call_parser: str | None = None):  # fmt: skip
        import uvicorn

        from services.engine.scheduler import Scheduler
        from services.engine.server import EngineServer
        from services.model.hf_io import load_model
        from services.model.tokenizer import Tokenizer

        self.model = load_model(model_dir)
        self.scheduler = Scheduler(
            self.model,
            max_running_requests=max_running_requests,
            weight_version=weight_version,
            seed=seed,
            on_death=on_death,
        )
        self.loras = None
        if max_loras:
            from services.engine.loras import EngineLoras

            self.loras = EngineLoras(self.scheduler, max_loras, max_lora_rank)
        self.port = procs.free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = EngineServer(self.scheduler, str(model_dir), Tokenizer(model_dir), port=self.port,
                                   api_key=api_key, keys=keys, weights=weights, staged_loading=staged_loading,
                                   loras=self.loras, tool_call_parser=tool_call_parser)  # fmt: skip
        self._uv = uvicorn.Server(
            uvicorn.Config(
                self.server.app,
                host="127.0.0.1",
                port=self.port,
                log_level="warning",
                lifespan="off",
            )
        )
        self._uv.install_signal_handlers = lambda: None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._uv.serve()), daemon=True)

    def __enter__(self) -> EngineThread:
        self.scheduler.start()
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._uv.started:
            if time.monotonic() > deadline:
                raise TimeoutError("engine did not start")
            time.sleep(0.01)
        return self

    def __exit__(self, *exc) -> None:
        self._uv.should_exit = True
        self._thread.join(timeout=10)
        self.scheduler.shutdown()


@pytest.fixture
def engine(tiny_model_dir):
    with EngineThread(tiny_model_dir) as e:
        yield e


class RunningService:
    """A service object running inside the test's event loop, against the real broker."""

    def __init__(self, service, task):
        self.service = service
        self.task = task

    async def stop(self):
        self.service.stop()
        try:
            await asyncio.wait_for(asyncio.shield(self.task), 20)
        except TimeoutError:
            for t in asyncio.all_tasks():
                t.print_stack(limit=6)
            raise


TEST_TOKEN = "test-run-token"
"""The run token of services a test starts in its own process (start_service)."""
AUTH = {"Authorization": f"Bearer {TEST_TOKEN}"}


@contextlib.contextmanager
def finished_dashboard(run_dir):
    """`asyncrl dashboard RUN_DIR` on a finished run, for the block: its URL (it prints it first)."""
    import re
    import subprocess
    import sys

    dash = subprocess.Popen([sys.executable, "-m", "services.cli", "dashboard", str(run_dir)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)  # fmt: skip
    try:
        line = dash.stdout.readline()
        found = re.search(r"at (http://\S+)/ ", line)
        assert found, f"asyncrl dashboard printed no URL: {line}{dash.stdout.read() if dash.poll() is not None else ''}"
        yield found.group(1)
    finally:
        dash.terminate()
        dash.wait(20)


def run_auth(run_dir) -> dict[str, str]:
    """The Authorization header of a run the launcher started (its secrets directory)."""
    from pathlib import Path

    return {"Authorization": "Bearer " + (Path(run_dir) / "secrets" / "run-token").read_text().strip()}


def run_env(run_dir, role_env: bool = True) -> dict[str, str]:
    """The environment a process needs to join a launcher's run: the run's NATS identities (each
    process takes its role's) and its run token."""
    import os
    from pathlib import Path

    secrets = Path(run_dir) / "secrets"
    return {**os.environ, "ASYNCRL_NATS_ROLES_FILE": str(secrets / "nats.json"),
            "ASYNCRL_RUN_TOKEN_FILE": str(secrets / "run-token")}  # fmt: skip


def with_test_token(cls, config, bus, **kw):
    """A service built as the launcher's children are, its run token (TEST_TOKEN) in its environment."""
    from unittest import mock

    with mock.patch.dict("os.environ", {"ASYNCRL_RUN_TOKEN": TEST_TOKEN}):
        return cls(config, bus, **kw)


async def start_service(cls, config, nats_url: str, run_id: str, **kw) -> RunningService:
    from services.common.bus import Bus

    bus = await Bus.connect(nats_url, run_id, cls.name)
    await bus.ensure_streams()  # what the launcher does before it starts a service
    service = with_test_token(cls, config, bus, **kw)
    task = asyncio.ensure_future(service.run())
    loop = asyncio.get_running_loop()
    deadline = loop.time() + 30
    while not service.ready:
        if task.done():
            task.result()
        if loop.time() > deadline:
            raise TimeoutError(f"{cls.name} did not become ready")
        await asyncio.sleep(0.01)
    return RunningService(service, task)


async def wait_until(pred, timeout: float = 10.0, what: str = "condition"):
    """Poll a condition with a deadline: the tests' only way to wait (no sleep as synchronisation)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while True:
        value = await pred() if asyncio.iscoroutinefunction(pred) else pred()
        if value:
            return value
        if loop.time() > end:
            raise TimeoutError(f"{what} not reached within {timeout}s")
        await asyncio.sleep(0.01)


async def pull(bus, stream: str, subject: str, durable: str, ack_wait_s: float = 30.0, max_deliver: int = -1,
               max_ack_pending: int = 1000, deliver_policy=None):  # fmt: skip
    """A durable pull consumer a test reads a stream with (the services bind to the run's own)."""
    from nats.js import api

    cfg = api.ConsumerConfig(durable_name=durable, ack_policy=api.AckPolicy.EXPLICIT, ack_wait=ack_wait_s,
                             max_deliver=max_deliver, max_ack_pending=max_ack_pending,
                             deliver_policy=deliver_policy or api.DeliverPolicy.ALL, filter_subject=subject)  # fmt: skip
    return await bus.js.pull_subscribe(subject, durable=durable, stream=stream, config=cfg)
