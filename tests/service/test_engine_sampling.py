"""The built-in engine's /generate features over real HTTP, each checked against what it must do:
SSE streaming, stop strings and regexes, logit_bias, penalties (against a reference greedy decoder
on the model itself), min_p, top logprobs, prompt scoring, /get_load and /get_weight_version."""

from __future__ import annotations

import json

import httpx
import torch

from services.model.hf_io import load_model
from services.model.llama import token_logprobs

PROMPT = [1, 5, 6, 7, 15]  # <s>123=


async def gen(engine, body, status=200):
    async with httpx.AsyncClient(base_url=engine.url, timeout=30) as c:
        r = await c.post("/generate", json=body)
    assert r.status_code == status, r.text
    return r.json()


def greedy(ids=PROMPT, **params):
    sp = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True} | params
    return {"input_ids": ids, "sampling_params": sp, "return_logprob": True}


def reference_greedy(model, prompt, steps, process):
    """Greedy decoding with the full forward pass, `process(logits_v, prompt, output)` first."""
    out = []
    with torch.no_grad():
        for _ in range(steps):
            logits = model(torch.tensor([prompt + out]))[0, -1].float()
            out.append(int(process(logits.clone(), prompt, out).argmax()))
    return out


async def test_generate_streams_cumulative_chunks_then_done(engine):
    body = greedy(max_new_tokens=6) | {"stream": True}
    chunks = []
    async with httpx.AsyncClient(base_url=engine.url, timeout=30) as c:
        async with c.stream("POST", "/generate", json=body) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            async for line in r.aiter_lines():
                if line:
                    assert line.startswith("data: ")
                    chunks.append(line[6:])
    assert chunks[-1] == "[DONE]"
    events = [json.loads(c) for c in chunks[:-1]]
    final = await gen(engine, greedy(max_new_tokens=6))
    assert events[-1]["output_ids"] == final["output_ids"]
    # cumulative: each chunk extends the one before; a reader slower than the engine gets the
    # progress made since its last chunk in one (so at most one chunk per token)
    lengths = [len(e["output_ids"]) for e in events]
    assert 1 <= len(events) <= 6 and lengths == sorted(set(lengths)) and lengths[-1] == 6
    assert all(e["output_ids"] == final["output_ids"][: len(e["output_ids"])] for e in events)
    assert all(e["meta_info"]["finish_reason"] is None for e in events[:-1])
    assert events[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    assert events[-1]["text"] == final["text"]
    assert len(events[-1]["meta_info"]["output_token_logprobs"]) == 6


async def test_stop_strings_and_regex_cut_the_text(engine):
    five = [1, 5, 6, 7, 8, 9, 15]  # <s>12345=

    def seeded(**kw):  # sampled, yet reproducible token by token: sampling_seed
        return greedy(five, temperature=1.0, sampling_seed=chosen, max_new_tokens=20, **kw)

    for chosen in range(40):  # noqa: B007 (seeded() reads the chosen seed)
        base = await gen(engine, seeded())
        if sum(ch.isdigit() for ch in base["text"][:6]) == 6:
            break
    text = base["text"]
    assert text[:6].isdigit(), text
    assert (await gen(engine, seeded()))["output_ids"] == base["output_ids"]
    stop = text[2:4]
    out = await gen(engine, seeded(stop=[stop, "zz"]))
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == text[: text.index(stop)]
    assert out["output_ids"] == base["output_ids"][: len(out["output_ids"])]  # the stop's tokens stay in output_ids
    kept = await gen(engine, seeded(stop=stop, no_stop_trim=True))
    assert kept["text"] == text[: text.index(stop) + len(stop)]
    rx = await gen(engine, seeded(stop_regex=r"[0-9]{3}"))
    assert rx["meta_info"]["finish_reason"] == {"type": "stop", "matched": "[0-9]{3}"}
    assert len(rx["output_ids"]) == 3 and rx["text"] == ""  # the match (the first 3 digits) is cut
    kept = await gen(engine, seeded(stop_regex=r"[0-9]{3}", no_stop_trim=True))
    assert kept["text"] == text[:3]


async def test_logit_bias_forces_a_token_and_min_p_one_is_greedy(engine):
    forced = await gen(engine, greedy(temperature=1.0, logit_bias={"9": 100.0}, max_new_tokens=5))
    assert forced["output_ids"] == [9] * 5  # token 9 is "5"
    assert forced["text"] == "55555"
    plain = await gen(engine, greedy())
    for seed in range(3):
        sampled = await gen(engine, greedy(temperature=1.0, min_p=1.0, sampling_seed=seed))
        assert sampled["output_ids"] == plain["output_ids"]


async def test_penalties_follow_the_reference_semantics(engine, tiny_model_dir):
    model = load_model(tiny_model_dir)
    plain = await gen(engine, greedy(max_new_tokens=16))
    assert len(set(plain["output_ids"])) < len(plain["output_ids"])  # greedy repeats itself here

    def repetition(logits, prompt, out):
        seen = torch.tensor(sorted(set(prompt + out)))
        logits[seen] = torch.where(logits[seen] > 0, logits[seen] / 1.8, logits[seen] * 1.8)
        return logits

    def freq_presence(logits, prompt, out):
        for t in set(out):
            logits[t] -= 0.7 * out.count(t) + 0.4
        return logits

    rep = await gen(engine, greedy(max_new_tokens=16, repetition_penalty=1.8))
    assert rep["output_ids"] != plain["output_ids"]
    assert rep["output_ids"] == reference_greedy(model, PROMPT, 16, repetition)
    fp = await gen(engine, greedy(max_new_tokens=16, frequency_penalty=0.7, presence_penalty=0.4))
    assert fp["output_ids"] != plain["output_ids"]
    assert fp["output_ids"] == reference_greedy(model, PROMPT, 16, freq_presence)


async def test_top_logprobs_and_token_text(engine):
    out = await gen(engine, greedy(max_new_tokens=5) | {"top_logprobs_num": 3, "return_text_in_logprobs": True})
    meta = out["meta_info"]
    tops, chosen = meta["output_top_logprobs"], meta["output_token_logprobs"]
    assert len(tops) == len(out["output_ids"]) == 5 and all(len(row) == 3 for row in tops)
    for row, (lp, tid, text) in zip(tops, chosen, strict=True):
        assert row[0][1] == tid and abs(row[0][0] - lp) < 1e-6  # greedy: the sampled token is the top one
        assert row[0][0] >= row[1][0] >= row[2][0]
        assert isinstance(text, str) and all(isinstance(e[2], str) for e in row)
    assert "".join(t[2] for t in chosen).startswith(out["text"]) and out["text"]


async def test_prompt_scoring_matches_a_direct_forward_pass(engine, tiny_model_dir):
    ids = [1, 5, 6, 7, 8, 15, 8, 7]
    body = {"input_ids": ids, "sampling_params": {"max_new_tokens": 0}, "return_logprob": True,
            "logprob_start_len": 0, "top_logprobs_num": 2}  # fmt: skip
    out = await gen(engine, body)
    assert out["output_ids"] == [] and out["meta_info"]["finish_reason"] == {"type": "length", "length": 0}
    got = out["meta_info"]["input_token_logprobs"]
    assert [t[1] for t in got] == ids and got[0][0] is None  # SGLang: the first prompt token has none
    seq = torch.tensor([ids])
    with torch.no_grad():
        want = token_logprobs(load_model(tiny_model_dir)(seq)[:, :-1], seq[:, 1:])[0]
    assert (torch.tensor([t[0] for t in got[1:]]) - want).abs().max().item() < 1e-4
    tops = out["meta_info"]["input_top_logprobs"]
    assert tops[0] is None and len(tops) == len(ids) and all(len(r) == 2 for r in tops[1:])
    # from a later start, and twice in a row (no prefix cache may hide positions)
    for _ in range(2):
        part = await gen(engine, body | {"logprob_start_len": 3, "top_logprobs_num": 0})
        lps = part["meta_info"]["input_token_logprobs"]
        assert [t[1] for t in lps] == ids[3:] and lps[0][0] is None
        assert (torch.tensor([t[0] for t in lps[1:]]) - want[3:]).abs().max().item() < 1e-4
    # with generation too: the same prompt log-probs, and output tokens as usual
    both = await gen(engine, body | {"sampling_params": {"max_new_tokens": 3, "temperature": 0}})
    assert len(both["output_ids"]) >= 1 and len(both["meta_info"]["input_token_logprobs"]) == len(ids)


async def test_load_weight_version_and_refusals(engine):
    async with httpx.AsyncClient(base_url=engine.url, timeout=30) as c:
        load = (await c.get("/get_load")).json()
        assert load == [{"dp_rank": 0, "num_reqs": 0, "num_waiting_reqs": 0, "num_tokens": 0}]
        assert (await c.get("/get_weight_version")).json() == {"weight_version": "0"}
    for key, value in (("regex", "[0-9]+"), ("json_schema", "{}"), ("ebnf", "root ::= 'a'")):
        err = await gen(engine, greedy(**{key: value}), status=400)
        assert key in err["error"]["message"] and "constrained decoding" in err["error"]["message"]
    err = await gen(engine, greedy() | {"logprob_start_len": 9}, status=400)
    assert "logprob_start_len" in err["error"]["message"]
    err = await gen(engine, greedy() | {"return_logprob": False, "top_logprobs_num": 2}, status=400)
    assert "top_logprobs_num" in err["error"]["message"]
    err = await gen(engine, greedy(stop_regex="("), status=400)
    assert "stop_regex" in err["error"]["message"]


async def test_a_client_that_leaves_a_stream_midway_aborts_its_request(engine):
    """The reader goes away after the first chunk: the engine aborts what it was generating for it
    (SGLang's behaviour) instead of finishing a request nobody reads."""
    import asyncio

    sched = engine.scheduler
    aborted_before = sched.stats.num_aborted_requests_total
    body = greedy(max_new_tokens=40) | {"stream": True}
    async with httpx.AsyncClient(base_url=engine.url, timeout=30) as c:
        async with c.stream("POST", "/generate", json=body) as r:
            async for line in r.aiter_lines():
                if line.startswith("data: "):
                    sched.pause("in_place")  # frozen mid-generation: it cannot finish on its own now
                    break
        # leaving the block closes the connection with the request still held
    deadline = asyncio.get_running_loop().time() + 10
    while sched.running or sched.waiting:
        assert asyncio.get_running_loop().time() < deadline, "the engine kept the abandoned request"
        await asyncio.sleep(0.01)
    sched.resume()
    assert sched.stats.num_aborted_requests_total == aborted_before + 1


async def test_every_special_token_ends_a_tiny_model_answer(engine):
    """The engine's text skips special tokens, so a tiny model that could write <pad>, <s> or <unk>
    inside an answer would pad it with tokens no grader reads; its config makes each one a stop."""
    for special in (0, 1, 2, 3):  # <pad>, <s>, </s>, <unk>
        out = await gen(engine, greedy(ignore_eos=False, logit_bias={str(special): 100.0}))
        assert out["output_ids"] == [special], (special, out["output_ids"])
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": special}


def test_the_character_model_stops_at_every_special_token_too(tmp_path):
    """The reasoning-gym and calculator tasks' model: the same stops, </s> first (the id a reader
    that wants one end token takes)."""
    from services.model.hf_io import read_config
    from services.tasks.char_model import build_char_model

    build_char_model(tmp_path, [], warmup_sft_steps=0, context=64, log=lambda *_: None)
    assert read_config(tmp_path).eos_ids == [2, 0, 1, 3]
