"""LoRA adapters on the built-in engine over real HTTP (SGLang's /load_lora_adapter,
/unload_lora_adapter and `lora_path`): rows of several adapters in one batch, each checked against
the model's own forward pass under that adapter; unload waits for requests in flight; the prefix
cache never hands one adapter's keys to another; the OpenAI routes name adapters by `model`."""

from __future__ import annotations

import asyncio

import httpx
import pytest
import torch

from services.model.hf_io import load_model
from services.model.llama import token_logprobs
from services.model.lora import LoraSpec, MultiLora, save_adapter
from tests.conftest import EngineThread

PROMPT = [1, 5, 6, 7, 15]


@pytest.fixture(scope="module")
def adapters(tiny_model_dir, tmp_path_factory):
    """Two PEFT adapter directories for the tiny model, each changing its output."""
    root = tmp_path_factory.mktemp("adapters")
    model = load_model(tiny_model_dir)
    lora = MultiLora(model, n_slots=3, max_rank=8)
    out = {}
    for slot, (name, rank) in enumerate((("alpha", 4), ("beta", 8))):
        spec = LoraSpec(rank=rank, alpha=2.0 * rank)
        lora.init_slot(slot, spec, seed=10 + slot)
        with torch.no_grad():
            g = torch.Generator().manual_seed(20 + slot)
            for key in lora.B:
                lora.B[key][slot, :, :rank] = torch.randn(lora.B[key].shape[1], rank, generator=g) * 0.5
        out[name] = save_adapter(lora, slot, root / name)
    spec = LoraSpec(rank=8, alpha=8.0)
    lora.init_slot(2, spec, seed=99)
    out["too-big"] = root / "too-big"
    big = MultiLora(load_model(tiny_model_dir), n_slots=1, max_rank=16)
    big.init_slot(0, LoraSpec(rank=16, alpha=16.0), seed=1)
    save_adapter(big, 0, out["too-big"])
    return out


@pytest.fixture
def lora_engine(tiny_model_dir):
    with EngineThread(tiny_model_dir, max_loras=2, max_lora_rank=8) as e:
        yield e


async def post(engine, path, body, status=200):
    async with httpx.AsyncClient(base_url=engine.url, timeout=60) as c:
        r = await c.post(path, json=body)
    assert r.status_code == status, r.text
    return r.json()


async def until(condition, timeout_s: float = 10.0) -> None:
    """Poll a condition another thread makes true (the engine runs in its own thread)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition not reached"
        await asyncio.sleep(0.01)


def sampled(lora_path, n_new=10):
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": n_new, "temperature": 1.0, "ignore_eos": True},
            "return_logprob": True}  # fmt: skip
    return body | ({"lora_path": lora_path} if lora_path is not None else {})


def reference_logprobs(tiny_model_dir, adapter_dir, prompt, output):
    """The trainer's view: the full forward pass under the adapter (None: the base model)."""
    model = load_model(tiny_model_dir)
    lora = MultiLora(model, n_slots=1, max_rank=8)
    rows = None
    if adapter_dir is not None:
        from services.model.lora import load_adapter

        spec, tensors = load_adapter(adapter_dir)
        lora.set_slot(0, spec, tensors)
        rows = [0]
    seq = torch.tensor([prompt + output])
    with torch.no_grad(), lora.rows(rows):
        lp = token_logprobs(model(seq)[:, :-1], seq[:, 1:])[0, len(prompt) - 1 :]
    return lp.tolist()


async def test_each_row_of_a_batch_uses_its_adapter_and_matches_the_forward_pass(lora_engine, adapters, tiny_model_dir):
    loaded = await post(lora_engine, "/load_lora_adapter", {"lora_name": "alpha", "lora_path": str(adapters["alpha"])})
    assert loaded == {"success": True, "error_message": "", "loaded_adapters": {"alpha": str(adapters["alpha"])}}
    await post(lora_engine, "/load_lora_adapter", {"lora_name": "beta", "lora_path": str(adapters["beta"])})
    body = {"input_ids": [PROMPT] * 3, "lora_path": ["alpha", "beta", None], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 10, "temperature": 1.0, "ignore_eos": True}}  # fmt: skip
    outs = await post(lora_engine, "/generate", body)
    for out, name in zip(outs, ("alpha", "beta", None), strict=True):
        got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
        want = reference_logprobs(tiny_model_dir, adapters[name] if name else None, PROMPT, out["output_ids"])
        assert got == pytest.approx(want, abs=1e-4), name
    # the adapters differ from the base and from each other on the same tokens
    ids = outs[0]["output_ids"]
    base = reference_logprobs(tiny_model_dir, None, PROMPT, ids)
    alpha = reference_logprobs(tiny_model_dir, adapters["alpha"], PROMPT, ids)
    beta = reference_logprobs(tiny_model_dir, adapters["beta"], PROMPT, ids)
    assert max(abs(a - b) for a, b in zip(alpha, base, strict=True)) > 1e-2
    assert max(abs(a - b) for a, b in zip(alpha, beta, strict=True)) > 1e-2
    info = (await asyncio.to_thread(httpx.get, f"{lora_engine.url}/server_info")).json()
    assert info["enable_lora"] and info["max_loras_per_batch"] == 2 and info["max_lora_rank"] == 8


async def test_the_prefix_cache_never_serves_one_adapters_keys_to_another(lora_engine, adapters, tiny_model_dir):
    await post(lora_engine, "/load_lora_adapter", {"lora_name": "alpha", "lora_path": str(adapters["alpha"])})
    first = await post(lora_engine, "/generate", sampled("alpha"))  # its prompt's KV is now cached under alpha
    then = await post(lora_engine, "/generate", sampled(None))
    assert then["meta_info"]["cached_tokens"] == 0, "the base request must not reuse alpha's cached prompt"
    got = [lp for lp, _, _ in then["meta_info"]["output_token_logprobs"]]
    assert got == pytest.approx(reference_logprobs(tiny_model_dir, None, PROMPT, then["output_ids"]), abs=1e-4)
    again = await post(lora_engine, "/generate", sampled("alpha"))
    assert again["meta_info"]["cached_tokens"] == len(PROMPT) - 1, "the same adapter reuses its own prefix"
    assert first["meta_info"]["finish_reason"]["type"] == "length"


async def test_unload_lets_requests_in_flight_finish_and_refuses_new_ones(lora_engine, adapters, tiny_model_dir):
    await post(lora_engine, "/load_lora_adapter", {"lora_name": "alpha", "lora_path": str(adapters["alpha"])})
    sched = lora_engine.scheduler
    sched.pause("in_place")  # the long request waits, holding the adapter, until generation continues
    long = asyncio.create_task(post(lora_engine, "/generate", sampled("alpha", n_new=30)))
    await until(lambda: sched.waiting or sched._inbox)  # the request reached the (paused) engine
    unload = asyncio.create_task(post(lora_engine, "/unload_lora_adapter", {"lora_name": "alpha"}))
    await until(lambda: "alpha" not in lora_engine.loras.loaded())  # marked: new requests are refused
    assert not unload.done(), "unload returns only once the adapter's requests are done"
    refused = await post(lora_engine, "/generate", sampled("alpha"), status=400)
    assert "no LoRA adapter 'alpha' is loaded" in refused["error"]["message"]
    sched.resume()
    out, gone = await long, await unload
    assert gone["loaded_adapters"] == {} and out["meta_info"]["finish_reason"] == {"type": "length", "length": 30}
    got = [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]]
    assert got == pytest.approx(reference_logprobs(tiny_model_dir, adapters["alpha"], PROMPT, out["output_ids"]),
                                abs=1e-4), "the request kept its adapter to the end"  # fmt: skip
    assert lora_engine.loras.lora.specs == [None, None], "the slot is free again"


async def test_bad_loads_and_names_are_clear_400s(lora_engine, adapters, tmp_path):
    ok = {"lora_name": "alpha", "lora_path": str(adapters["alpha"])}
    await post(lora_engine, "/load_lora_adapter", ok)
    cases = [
        (ok, "already loaded"),
        ({"lora_name": "x", "lora_path": str(tmp_path)}, "not a LoRA adapter directory"),
        ({"lora_name": "big", "lora_path": str(adapters["too-big"])}, "max LoRA rank"),
        ({"lora_name": "../x", "lora_path": str(adapters["beta"])}, "lora_name must be"),
        ({"lora_path": str(adapters["beta"])}, "lora_name"),
    ]
    for body, message in cases:
        res = await post(lora_engine, "/load_lora_adapter", body, status=400)
        assert message in (res.get("error_message") or res.get("error", {}).get("message", "")), (body, res)
    corrupt = tmp_path / "corrupt"
    corrupt.mkdir()
    (corrupt / "adapter_config.json").write_text((adapters["beta"] / "adapter_config.json").read_text())
    (corrupt / "adapter_model.safetensors").write_bytes(
        (adapters["beta"] / "adapter_model.safetensors").read_bytes()[:100]
    )
    res = await post(lora_engine, "/load_lora_adapter", {"lora_name": "beta", "lora_path": str(corrupt)}, status=400)
    assert "cannot read adapter_model.safetensors" in res["error_message"]
    # the failed load left neither the name nor the slot taken
    await post(lora_engine, "/load_lora_adapter", {"lora_name": "beta", "lora_path": str(adapters["beta"])})
    full = await post(lora_engine, "/load_lora_adapter", {"lora_name": "b2", "lora_path": str(adapters["beta"])},
                      status=400)  # fmt: skip
    assert "all 2 LoRA slots are in use" in full["error_message"]
    assert set(full["loaded_adapters"]) == {"alpha", "beta"}
    res = await post(lora_engine, "/unload_lora_adapter", {"lora_name": "nope"}, status=400)
    assert "no LoRA adapter 'nope'" in res["error_message"]
    res = await post(lora_engine, "/generate", sampled("gamma"), status=400)
    assert "lora_path: no LoRA adapter 'gamma'" in res["error"]["message"]
    res = await post(lora_engine, "/generate", sampled(["alpha"]) | {"input_ids": [PROMPT, PROMPT]}, status=400)
    assert "lora_path must be" in res["error"]["message"]


async def test_an_engine_without_lora_refuses_adapters_clearly(engine, adapters):
    res = await post(engine, "/generate", sampled("alpha"), status=400)
    assert "--enable-lora" in res["error"]["message"]
    res = await post(engine, "/load_lora_adapter", {"lora_name": "a", "lora_path": str(adapters["alpha"])}, status=400)
    assert "--enable-lora" in res["error_message"]


async def test_openai_routes_name_adapters_by_model(lora_engine, adapters):
    from openai import AsyncOpenAI, BadRequestError

    await post(lora_engine, "/load_lora_adapter", {"lora_name": "alpha", "lora_path": str(adapters["alpha"])})
    client = AsyncOpenAI(base_url=f"{lora_engine.url}/v1", api_key="unused")
    served = lora_engine.server.served_model_name
    models = await client.models.list()
    assert [m.id for m in models.data] == [served, "alpha"]

    def greedy(lora_path):
        body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 8, "temperature": 0}}
        return post(lora_engine, "/generate", body | ({"lora_path": lora_path} if lora_path else {}))

    want = {None: (await greedy(None))["text"], "alpha": (await greedy("alpha"))["text"]}
    for model, adapter in ((served, None), ("alpha", "alpha"), (f"{served}:alpha", "alpha"), ("any-name", None)):
        c = await client.completions.create(model=model, prompt=[PROMPT], max_tokens=8, temperature=0)
        assert c.choices[0].text == want[adapter], model
    with pytest.raises(BadRequestError, match="no LoRA adapter 'zeta'"):
        await client.completions.create(model=f"{served}:zeta", prompt=[PROMPT], max_tokens=2)
    await client.close()
