"""The built-in engine over real HTTP: SGLang response shapes, pause modes, weight updates,
version spans, abort, flush, metrics, and the on-policy log-prob match with the trainer."""

from __future__ import annotations

import asyncio
import threading

import httpx
import torch

from services.model.hf_io import load_model, save_model
from services.model.llama import token_logprobs

PROMPT = [1, 5, 6, 7, 15]


def gen_body(ids=PROMPT, **params):
    sp = {"max_new_tokens": 8, "temperature": 1.0}
    sp.update(params)
    return {"input_ids": ids, "sampling_params": sp, "return_logprob": True}


async def post(engine, path, body=None):
    async with httpx.AsyncClient(base_url=engine.url, timeout=30) as c:
        return await c.post(path, json=body or {})


async def test_generate_response_shape(engine):
    r = await post(engine, "/generate", gen_body())
    assert r.status_code == 200
    out = r.json()
    meta = out["meta_info"]
    assert set(out) >= {"text", "output_ids", "meta_info"}
    assert {
        "id",
        "finish_reason",
        "prompt_tokens",
        "completion_tokens",
        "weight_version",
        "cached_tokens",
    } <= set(meta)
    assert meta["prompt_tokens"] == len(PROMPT) and meta["completion_tokens"] == len(out["output_ids"])
    assert [t[1] for t in meta["output_token_logprobs"]] == out["output_ids"]
    assert all(t[2] is None and t[0] <= 0 for t in meta["output_token_logprobs"])
    assert meta["input_token_logprobs"] == [] and meta["weight_version"] == "0"
    assert meta["finish_reason"]["type"] in ("stop", "length")


async def test_finish_reasons_and_zero_tokens(engine):
    out = (await post(engine, "/generate", gen_body(max_new_tokens=1, ignore_eos=True))).json()
    assert out["meta_info"]["finish_reason"] == {"type": "length", "length": 1}
    every = list(range(16))
    out = (await post(engine, "/generate", gen_body(stop_token_ids=every))).json()
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": out["output_ids"][-1]}
    out = (await post(engine, "/generate", gen_body(max_new_tokens=0))).json()
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"] == {
        "type": "length",
        "length": 0,
    }


async def test_greedy_is_deterministic_and_batches_keep_order(engine):
    a = (await post(engine, "/generate", gen_body(temperature=0))).json()
    b = (
        await post(
            engine,
            "/generate",
            {
                "input_ids": [PROMPT, [1, 9, 9, 15]],
                "sampling_params": {"temperature": 0, "max_new_tokens": 8},
            },
        )
    ).json()
    assert isinstance(b, list) and len(b) == 2 and b[0]["output_ids"] == a["output_ids"]
    n3 = (await post(engine, "/generate", gen_body(n=3, temperature=0))).json()
    assert len(n3) == 3 and all(x["output_ids"] == a["output_ids"] for x in n3)


async def test_bad_requests_get_sglang_error_envelopes(engine):
    for body in ({"input_ids": [], "sampling_params": {}}, {"sampling_params": {}},
                 gen_body(bogus_key=1), gen_body(top_p=0.0)):  # fmt: skip
        r = await post(engine, "/generate", body)
        assert r.status_code == 400 and "message" in r.json()["error"]
    long = await post(engine, "/generate", gen_body(ids=[1] * 80))
    assert long.status_code == 400 and "context length" in long.json()["error"]["message"]


async def test_logprobs_match_the_trainer_forward_pass(engine, tiny_model_dir):
    """True on-policy: engine log-probs of sampled tokens == trainer forward on the same weights."""
    bodies = [gen_body(ids=[1, 4 + i % 10, 5 + i % 7, 15], max_new_tokens=10) for i in range(24)]
    outs = await asyncio.gather(*(post(engine, "/generate", b) for b in bodies))
    model = load_model(tiny_model_dir)
    worst = 0.0
    for body, r in zip(bodies, outs, strict=True):
        out = r.json()
        seq = torch.tensor([body["input_ids"] + out["output_ids"]])
        with torch.no_grad():
            lp = token_logprobs(model(seq)[:, :-1], seq[:, 1:])[0, len(body["input_ids"]) - 1 :]
        engine_lp = torch.tensor([t[0] for t in out["meta_info"]["output_token_logprobs"]])
        worst = max(worst, (lp - engine_lp).abs().max().item())
    assert worst < 1e-5


async def test_prefix_cache_shares_a_group_prompt(engine):
    outs = (await post(engine, "/generate", gen_body(n=4))).json()
    cached = [o["meta_info"]["cached_tokens"] for o in outs]
    assert sorted(cached) == [0, len(PROMPT) - 1, len(PROMPT) - 1, len(PROMPT) - 1]
    metrics = (await httpx.AsyncClient(base_url=engine.url).get("/metrics")).text
    for name in ("sglang:num_running_reqs", "sglang:num_queue_reqs", "sglang:gen_throughput",
                 "sglang:cache_hit_rate", "sglang:prompt_tokens_total", "sglang:generation_tokens_total"):  # fmt: skip
        assert name in metrics


class StepGate:
    """Makes the scheduler run one forward pass per `release()`, so tests control time."""

    def __init__(self, scheduler):
        self.sem = threading.Semaphore(0)
        self.steps = 0
        inner = scheduler._forward

        def gated(plan):
            self.sem.acquire()
            self.steps += 1
            return inner(plan)

        scheduler._forward = gated

    def release(self, n=1):
        for _ in range(n):
            self.sem.release()

    def open(self):
        self.release(10_000)


async def until(pred, timeout=10.0):
    """Wait for a condition with a deadline (no sleep as synchronisation)."""
    loop = asyncio.get_running_loop()
    end = loop.time() + timeout
    while not pred():
        if loop.time() > end:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.005)


def perturbed_snapshot(src_dir, dst_dir):
    model = load_model(src_dir)
    with torch.no_grad():
        model.lm_head.weight.mul_(1.5)
    save_model(model, dst_dir, src_dir)
    return model


async def _tokens_generated(engine, gate, k):
    task = asyncio.ensure_future(post(engine, "/generate", gen_body(max_new_tokens=40, ignore_eos=True)))
    await until(lambda: engine.scheduler.snapshot()["num_running_reqs"] == 1)  # admitted, held at the gate
    gate.release(k)
    await until(lambda: bool(engine.scheduler.running) and len(engine.scheduler.running[0].output_ids) == k)
    return task


async def test_retract_recomputes_under_new_weights(engine, tiny_model_dir, tmp_path):
    gate = StepGate(engine.scheduler)
    task = await _tokens_generated(engine, gate, 3)
    assert (await post(engine, "/pause_generation", {"mode": "retract"})).json()["status"] == "ok"
    gate.release(1)  # the step already in flight finishes; its result is void for a retracted request
    snap = engine.scheduler.snapshot()
    assert snap["num_running_reqs"] == 0 and snap["num_queue_reqs"] == 1
    new_model = perturbed_snapshot(tiny_model_dir, tmp_path / "v1")
    r = await post(
        engine,
        "/update_weights_from_disk",
        {"model_path": str(tmp_path / "v1"), "weight_version": "1"},
    )
    assert r.json()["success"] and "Weight version updated to 1" in r.json()["message"]
    async with httpx.AsyncClient(base_url=engine.url) as c:
        assert (await c.get("/model_info")).json()["weight_version"] == "1"
    await post(engine, "/continue_generation")
    gate.open()
    out = (await task).json()
    meta = out["meta_info"]
    assert meta["num_retractions"] == 1 and meta["weight_version"] == "1"
    assert meta["weight_versions"] == [
        {"version": 0, "start": 0, "end": 3},
        {"version": 1, "start": 3, "end": 40},
    ]
    # tokens after the update were sampled from the new weights with a recomputed cache
    seq = torch.tensor([PROMPT + out["output_ids"]])
    with torch.no_grad():
        lp = token_logprobs(new_model(seq)[:, :-1], seq[:, 1:])[0, len(PROMPT) - 1 :]
    engine_lp = torch.tensor([t[0] for t in meta["output_token_logprobs"]])
    assert (lp[3:] - engine_lp[3:]).abs().max().item() < 1e-5


async def test_in_place_keeps_the_request_running(engine, tiny_model_dir, tmp_path):
    gate = StepGate(engine.scheduler)
    task = await _tokens_generated(engine, gate, 2)
    await post(engine, "/pause_generation", {"mode": "in_place"})
    gate.release(1)  # the step in flight completes and counts: in_place keeps the request
    await until(lambda: len(engine.scheduler.running[0].output_ids) == 3)
    assert engine.scheduler.snapshot()["num_running_reqs"] == 1  # frozen with its cache
    perturbed_snapshot(tiny_model_dir, tmp_path / "v1")
    await post(
        engine,
        "/update_weights_from_disk",
        {"model_path": str(tmp_path / "v1"), "weight_version": "1", "flush_cache": False},
    )
    await post(engine, "/continue_generation")
    gate.open()
    meta = (await task).json()["meta_info"]
    assert meta["num_retractions"] == 0
    assert meta["weight_versions"][0] == {"version": 0, "start": 0, "end": 3}
    assert [s["version"] for s in meta["weight_versions"]] == [0, 1]


async def test_abort_mode_returns_partial_output(engine):
    gate = StepGate(engine.scheduler)
    task = await _tokens_generated(engine, gate, 2)
    await post(engine, "/pause_generation", {"mode": "abort"})
    out = (await task).json()
    assert out["meta_info"]["finish_reason"]["type"] == "abort" and len(out["output_ids"]) == 2
    await post(engine, "/continue_generation")
    gate.open()


async def test_requests_arriving_while_paused_wait(engine):
    await post(engine, "/pause_generation", {"mode": "in_place"})
    task = asyncio.ensure_future(post(engine, "/generate", gen_body()))
    await until(lambda: engine.scheduler.snapshot()["num_queue_reqs"] == 1)
    assert not task.done() and engine.scheduler.snapshot()["num_running_reqs"] == 0
    await post(engine, "/continue_generation")
    assert (await task).status_code == 200


async def test_abort_request_by_rid_and_flush_cache(engine):
    gate = StepGate(engine.scheduler)
    body = gen_body(max_new_tokens=40, ignore_eos=True)
    body["rid"] = "victim"
    task = asyncio.ensure_future(post(engine, "/generate", body))
    await until(lambda: engine.scheduler.snapshot()["num_running_reqs"] == 1)
    gate.release(1)
    await until(lambda: bool(engine.scheduler.running))
    assert (await post(engine, "/flush_cache")).status_code == 400  # busy
    assert (await post(engine, "/abort_request", {"rid": "victim"})).status_code == 200
    out = (await task).json()
    assert out["meta_info"]["id"] == "victim" and out["meta_info"]["finish_reason"]["type"] == "abort"
    gate.open()
    r = await post(engine, "/flush_cache")
    assert r.status_code == 200 and r.text.startswith("Cache flushed.")


async def test_info_and_health_endpoints(engine):
    async with httpx.AsyncClient(base_url=engine.url, timeout=30) as c:
        info = (await c.get("/model_info")).json()
        assert info["weight_version"] == "0" and info["architectures"] == ["LlamaForCausalLM"]
        assert (await c.get("/get_model_info")).json() == info
        server = (await c.get("/server_info")).json()
        assert {
            "model_path",
            "tp_size",
            "dp_size",
            "version",
            "weight_version",
            "max_total_num_tokens",
        } <= set(server)
        assert (await c.get("/health_generate")).status_code == 200
        assert (await c.get("/health")).status_code == 200
