"""The built-in engine fails fast and never hangs: every /generate is checked field by field (a
400 that names the field, never a 500), SGLang fields it does not implement are refused unless
neutral, non-finite sampling values and weights are refused, the API key guards every route but
the health and metrics ones, a dead scheduler thread ends the process, SIGTERM ends it in seconds."""

from __future__ import annotations

import asyncio
import json
import math
import signal
import subprocess
import sys
import time

import httpx
import torch

from services.common.procs import free_port, wait_for_port
from services.model.hf_io import load_model, save_model
from tests.conftest import EngineThread, wait_until

PROMPT = [1, 5, 6, 7, 15]


def body(ids=PROMPT, top=None, **params):
    sp = {"max_new_tokens": 4}
    sp.update(params)
    return {"input_ids": ids, "sampling_params": sp, **(top or {})}


BAD = [
    (body(ids=[1, 99999]), "outside the vocabulary"),
    (body(ids=[1, -3]), "outside the vocabulary"),
    (body(ids=[None]), "input_ids must hold integers"),
    (body(ids=[1.5, 2]), "input_ids must hold integers"),
    (body(ids=[True, 2]), "input_ids must hold integers"),
    (body(ids={"a": 1}), "input_ids must be a non-empty list"),
    (body(ids="12"), "input_ids must be a non-empty list"),
    (body(ids=[]), "input_ids must be a non-empty list"),
    (body(ids=[[1, 2], [3, 99999]]), "input_ids[1] holds token id 99999"),
    (body(ids=[1] * 80), "context length"),
    ({"input_ids": PROMPT, "sampling_params": [1, 2]}, "sampling_params has 2 entries for 1 prompts"),
    ({"input_ids": PROMPT, "sampling_params": "hot"}, "sampling_params must be an object"),
    ({"input_ids": PROMPT, "sampling_params": 7}, "sampling_params must be an object"),
    (body(temperature=math.nan), "temperature must be finite"),
    (body(temperature=-1), "temperature must be >= 0"),
    (body(temperature="1"), "temperature must be a number"),
    (body(top_p=math.inf), "top_p must be finite"),
    (body(top_p=0), "top_p must be in (0, 1]"),
    (body(top_k=0), "top_k must be -1"),
    (body(max_new_tokens=-1), "max_new_tokens must be in [0,"),
    (body(max_new_tokens=10**9), "max_new_tokens must be in [0,"),
    (body(max_new_tokens="8"), "max_new_tokens must be an integer"),
    (body(min_new_tokens=9, max_new_tokens=4), "min_new_tokens must be in [0, 4]"),
    (body(n=0), "n must be in [1, 64]"),
    (body(n=10**6), "n must be in [1, 64]"),
    (body(stop_token_ids=[99999]), "stop_token_ids holds token id 99999"),
    (body(ignore_eos="yes"), "ignore_eos must be true or false"),
    (body(bogus=1), "bogus is not a sampling parameter"),
    (body(top={"return_logprob": "yes"}), "return_logprob must be a bool"),
    (body(top={"rid": 5}), "rid must be a str"),
    (body(top={"frobnicate": True}), "frobnicate is not a /generate field"),
    ({"input_ids": [PROMPT] * 20, "sampling_params": {"n": 64}}, "at most 1024 per call"),
    ({"sampling_params": {}}, "Either text or input_ids should be provided."),
    (body(top={"stream": "yes"}), "stream must be true or false"),
    (body(top={"top_logprobs_num": 3}), "top_logprobs_num needs return_logprob"),
    (body(top={"logprob_start_len": 0}), "logprob_start_len needs return_logprob"),
    (body(top={"return_logprob": True, "logprob_start_len": 99}), "logprob_start_len must be in [-1, 5]"),
    (body(logit_bias={"99999": 5.0}), "logit_bias has token id 99999"),
    (body(logit_bias={"3": "high"}), "logit_bias[3] must be a finite number"),
    (body(min_p=1.5), "min_p must be in [0, 1]"),
    (body(repetition_penalty=0), "repetition_penalty must be in (0, 2]"),
    (body(frequency_penalty=2.5), "frequency_penalty must be in [-2, 2]"),
    (body(stop=[""]), "stop must be a string or a list of non-empty strings"),
    (body(stop_regex="(unclosed"), "stop_regex '(unclosed' is not a valid regular expression"),
    (body(sampling_seed=-1), "sampling_seed must be in [0,"),
    # SGLang features this engine does not implement: refused, never silently ignored
    (body(top={"lora_path": "adapter"}), "lora_path: this engine serves no LoRA adapters; start it with --enable-lora"),
    (body(top={"lora_id": "adapter"}), "lora_id is not implemented"),
    (body(regex="[0-9]+"), "regex: constrained decoding is not implemented"),
    (body(json_schema="{}"), "json_schema: constrained decoding is not implemented"),
    (body(beam_width=4), "beam_width is not implemented"),
    (body(stop_strs=["x"]), "stop_strs is internal to SGLang"),
]


async def test_every_bad_generate_is_a_400_that_names_the_field(engine):
    async with httpx.AsyncClient(base_url=engine.url, timeout=30) as c:
        for bad, message in BAD:  # json.dumps writes NaN and Infinity, as a careless client would
            r = await c.post("/generate", content=json.dumps(bad), headers={"content-type": "application/json"})
            assert r.status_code == 400, (bad, r.status_code, r.text)
            assert message in r.json()["error"]["message"], (bad, r.text)
        for raw in (b"{not json", b"[1, 2]", b'"text"'):
            r = await c.post("/generate", content=raw, headers={"content-type": "application/json"})
            assert r.status_code == 400, r.text
        assert engine.scheduler.alive  # nothing reached the scheduler thread
        assert (await c.post("/generate", json=body())).status_code == 200


async def test_neutral_values_of_unimplemented_fields_are_accepted(engine):
    neutral = body(top={"stream": False, "top_logprobs_num": 0, "lora_path": None, "logprob_start_len": -1},
                   min_p=0.0, repetition_penalty=1.0, logit_bias=None, stop=[], regex=None)  # fmt: skip
    async with httpx.AsyncClient(base_url=engine.url, timeout=30) as c:
        assert (await c.post("/generate", json=neutral)).status_code == 200


async def test_control_routes_check_their_bodies_and_refuse_non_finite_weights(engine, tiny_model_dir, tmp_path):
    model = load_model(tiny_model_dir)
    with torch.no_grad():
        model.lm_head.weight[0, 0] = math.nan
    bad_dir = tmp_path / "nan"
    save_model(load_model(tiny_model_dir), bad_dir, tiny_model_dir)  # a complete snapshot...
    from safetensors.torch import load_file, save_file

    state = load_file(str(bad_dir / "model.safetensors"))
    next(iter(state.values()))[0] = math.nan  # ...whose weights hold a NaN
    save_file(state, str(bad_dir / "model.safetensors"))
    async with httpx.AsyncClient(base_url=engine.url, timeout=30) as c:
        assert (await c.post("/pause_generation", json={"mode": 3})).status_code == 400
        assert (await c.post("/pause_generation", json={"mode": "sleep"})).status_code == 400
        assert (await c.post("/abort_request", json={"rid": ["a"]})).status_code == 400
        assert (await c.post("/update_weights_from_disk", json={"model_path": 5})).status_code == 400
        r = await c.post("/update_weights_from_disk", json={"model_path": str(tmp_path / "nowhere")})
        assert r.status_code == 400 and r.json()["success"] is False
        r = await c.post("/update_weights_from_disk", json={"model_path": str(bad_dir), "weight_version": "9"})
        assert r.status_code == 400 and "non-finite" in r.json()["message"]
        assert (await c.get("/model_info")).json()["weight_version"] == "0"  # nothing was loaded
        assert (await c.post("/generate", json=body())).status_code == 200


async def test_the_api_key_guards_every_route_but_health_and_metrics(tiny_model_dir):
    with EngineThread(tiny_model_dir, api_key="k3y-for-test") as e:
        async with httpx.AsyncClient(base_url=e.url, timeout=30) as c:
            for method, path in (("POST", "/generate"), ("GET", "/model_info"), ("POST", "/pause_generation"),
                                 ("POST", "/update_weights_from_disk"), ("POST", "/abort_request"),
                                 ("GET", "/server_info"), ("GET", "/status"), ("POST", "/flush_cache")):  # fmt: skip
                r = await c.request(method, path, json=body())
                assert r.status_code == 401, (path, r.status_code)
                r = await c.request(method, path, json=body(), headers={"Authorization": "Bearer wrong"})
                assert r.status_code == 401, path
            for path in ("/health", "/health_generate", "/metrics"):
                assert (await c.get(path)).status_code == 200, path
            ok = await c.post("/generate", json=body(), headers={"Authorization": "Bearer k3y-for-test"})
            assert ok.status_code == 200


async def test_each_role_token_opens_only_its_routes(tiny_model_dir):
    """Least privilege over HTTP: one run token used to open every route to every role. Now a
    producer's token generates and cannot pause or load weights; weight-sync's pauses and loads
    and cannot generate; eval's generates; the run token (admin) does everything. The engine
    holds only the tokens' SHA-256, never a token."""
    from services.common.httpauth import Keys, role_token

    run = "the-run-token"
    keys = Keys.of_run(run)
    assert run not in str(keys.hashes) and all(len(h) == 64 for h in keys.hashes.values())
    allowed = {"rollout": {"/generate", "/v1/models", "/model_info", "/abort_request"},
               "eval": {"/generate", "/v1/models", "/model_info", "/abort_request"},
               "weight-sync": {"/pause_generation", "/continue_generation", "/flush_cache", "/update_weight_version",
                               "/server_info", "/model_info", "/init_weights_update_group", "/v1/models"}}  # fmt: skip
    routes = [("POST", "/generate"), ("GET", "/v1/models"), ("GET", "/model_info"), ("POST", "/abort_request"),
              ("POST", "/pause_generation"), ("POST", "/continue_generation"), ("POST", "/flush_cache"),
              ("POST", "/update_weight_version"), ("GET", "/server_info"), ("POST", "/init_weights_update_group"),
              ("POST", "/release_memory_occupation"), ("GET", "/status")]  # fmt: skip
    with EngineThread(tiny_model_dir, keys=keys) as e:
        async with httpx.AsyncClient(base_url=e.url, timeout=30) as c:
            for role, ok in allowed.items():
                auth = {"Authorization": f"Bearer {role_token(run, role)}"}
                for method, path in routes:
                    payload = body() if path == "/generate" else {}
                    r = await c.request(method, path, json=payload, headers=auth)
                    if path in ok:
                        assert r.status_code not in (401, 403), (role, path, r.status_code, r.text)
                    else:
                        assert r.status_code == 403 and f"the {role} credential may not call" in r.text, (role, path)
            admin = {"Authorization": f"Bearer {run}"}
            assert (await c.get("/status", headers=admin)).status_code == 200
            assert (await c.post("/generate", json=body(), headers=admin)).status_code == 200
            forged = {"Authorization": f"Bearer {role_token('another-run', 'weight-sync')}"}
            assert (await c.post("/pause_generation", json={}, headers=forged)).status_code == 401


async def test_a_version_claim_names_only_the_weights_a_broadcast_brought(tiny_model_dir):
    """POST /update_weight_version {"new_version": "999"} with weight-sync's key used to relabel the
    running weights, so honest samples claimed v999 and the buffer refused them. It names only what
    a broadcast brought (loading-<N>, then N); anything else is a 400 and the label stays."""
    from services.engine.routes import relabel_problem

    with EngineThread(tiny_model_dir) as e:
        async with httpx.AsyncClient(base_url=e.url, timeout=30) as c:
            r = await c.post("/update_weight_version", json={"new_version": "999", "abort_all_requests": False})
            assert r.status_code == 400 and "names no weights a broadcast brought" in r.text
            assert e.scheduler.weight_version == "0"
            out = (await c.post("/generate", json=body())).json()
            assert out["meta_info"]["weight_version"] == "0"  # honest samples keep their weights' name
            r = await c.post("/update_weight_version", json={"new_version": "loading-999", "abort_all_requests": False})
            assert r.status_code == 200 and e.scheduler.weight_version == "loading-999"  # a broadcast begins
            r = await c.post("/update_weight_version", json={"new_version": "999", "abort_all_requests": False})
            assert r.status_code == 400, "named v999 though no broadcast brought it"  # two steps to the same claim
            assert e.scheduler.weight_version == "loading-999"  # weight-sync's converge loop reloads the live one
    assert relabel_problem("loading-3", "3", staged=None, received=True) is None  # a broadcast's names, in order
    assert relabel_problem("loading-3", "3", staged=None, received=False) is not None
    assert relabel_problem("7", "9", staged="9") is None  # a staged broadcast is swapped in under its name
    assert relabel_problem("loading-4", "5", staged=None) is not None


async def test_a_dead_scheduler_answers_what_it_held_and_says_so(tiny_model_dir):
    deaths = []
    with EngineThread(tiny_model_dir, on_death=deaths.append) as e:

        def explode(plan):
            raise RuntimeError("probability tensor contains either inf, nan or element < 0")

        e.scheduler._forward = explode
        async with httpx.AsyncClient(base_url=e.url, timeout=30) as c:
            r = await asyncio.wait_for(c.post("/generate", json=body()), 20)  # answered, not hung
            assert r.json()["meta_info"]["finish_reason"]["type"] == "abort"
            await wait_until(lambda: deaths, what="on_death called")  # right after the answers
            assert "probability tensor" in str(deaths[0])
            assert (await c.get("/health_generate")).status_code == 503


def _engine(model_dir, port: int, broken_forward: bool = False) -> subprocess.Popen:
    """The real engine process (`python -m services.engine`); with broken_forward its forward
    pass raises, as a CUDA error or a sampling error on non-finite logits would."""
    boot = "import sys; from services.engine.__main__ import main; main(sys.argv[1:])"
    if broken_forward:
        boot = ("import services.engine.scheduler as s\n"
                "def boom(self, plan): raise RuntimeError('CUDA error: an illegal memory access')\n"
                "s.Scheduler._forward = boom\n" + boot)  # fmt: skip
    return subprocess.Popen([sys.executable, "-c", boot, "--model-path", str(model_dir), "--port", str(port),
                             "--weight-version", "0", "--log-level", "error"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)  # fmt: skip


def test_an_engine_whose_scheduler_dies_exits_non_zero_at_once(tiny_model_dir):
    """The process must exit (a supervisor restarts it), not stay up answering nothing."""
    port = free_port()
    proc = _engine(tiny_model_dir, port, broken_forward=True)
    try:
        wait_for_port("127.0.0.1", port, 60, proc)
        try:  # answered as aborted, or the connection dies with the process: never a hang
            r = httpx.post(f"http://127.0.0.1:{port}/generate", json=body(), timeout=30)
            assert r.json()["meta_info"]["finish_reason"]["type"] == "abort"
        except httpx.HTTPError:
            pass
        assert proc.wait(timeout=20) == 70
        assert b"the scheduler thread died" in proc.stdout.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_sigterm_ends_an_engine_with_a_request_waiting_within_seconds(tiny_model_dir):
    port = free_port()
    proc = _engine(tiny_model_dir, port)
    try:
        wait_for_port("127.0.0.1", port, 60, proc)
        url = f"http://127.0.0.1:{port}"
        httpx.post(url + "/pause_generation", json={"mode": "in_place"}, timeout=10)
        waiting = subprocess.Popen([sys.executable, "-c", f"import httpx; httpx.post('{url}/generate', "
                                    f"json={body()!r}, timeout=60)"])  # fmt: skip
        deadline = time.monotonic() + 20
        while httpx.get(url + "/status", timeout=5).json()["num_queue_reqs"] == 0:
            assert time.monotonic() < deadline, "the request never arrived"
            time.sleep(0.05)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)
        assert time.monotonic() - t0 < 8
        waiting.wait(timeout=30)
    finally:
        for p in (proc,):
            if p.poll() is None:
                p.kill()
                p.wait()
