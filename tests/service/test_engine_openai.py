"""The built-in engine's OpenAI-compatible routes, driven by the `openai` client over real HTTP:
models, completions (n, logprobs, stop, max_tokens, usage, echo), chat completions with the
model's chat template, streaming for both, and OpenAI-shaped 400s."""

from __future__ import annotations

import pytest

from services.model.tokenizer import Tokenizer
from tests.conftest import EngineThread

openai = pytest.importorskip("openai", reason="openai is in the test extras (pip install -e '.[test]')")


@pytest.fixture
async def client(tiny_model_dir):
    with EngineThread(tiny_model_dir, api_key="secret-key") as e:
        async with openai.AsyncOpenAI(base_url=e.url + "/v1", api_key="secret-key", max_retries=0, timeout=30) as c:
            yield c, e


async def test_models_and_completions(client, tiny_model_dir):
    c, engine = client
    models = await c.models.list()
    assert [m.id for m in models.data] == [engine.server.served_model_name]
    model = models.data[0].id
    r = await c.completions.create(model=model, prompt="123=", max_tokens=4, temperature=0, n=3, logprobs=2)
    assert len(r.choices) == 3 and {ch.index for ch in r.choices} == {0, 1, 2}
    assert len({ch.text for ch in r.choices}) == 1  # greedy: n identical choices
    assert r.usage.prompt_tokens == 5  # <s>123= once, whatever n
    completion = sum(len(ch.logprobs.tokens) for ch in r.choices)
    assert r.usage.completion_tokens == completion and r.usage.total_tokens == 5 + completion
    ch = r.choices[0]
    assert ch.finish_reason in ("stop", "length") and len(ch.logprobs.tokens) <= 4
    for lp, top in zip(ch.logprobs.token_logprobs, ch.logprobs.top_logprobs, strict=True):
        assert len(top) <= 2 and abs(max(top.values()) - lp) < 1e-6  # greedy: the chosen is the best
    # max_tokens and stop strings
    long = await c.completions.create(model=model, prompt="12345=", max_tokens=12, temperature=0,
                                      extra_body={"ignore_eos": True, "skip_special_tokens": False})  # fmt: skip
    assert long.choices[0].finish_reason == "length" and long.usage.completion_tokens == 12
    stop = long.choices[0].text[1:3]
    cut = await c.completions.create(model=model, prompt="12345=", max_tokens=12, temperature=0, stop=[stop],
                                     extra_body={"ignore_eos": True, "skip_special_tokens": False})  # fmt: skip
    assert cut.choices[0].finish_reason == "stop" and cut.choices[0].text == long.choices[0].text[:1]
    # echo with logprobs scores the prompt too (its first token has none)
    echo = await c.completions.create(model=model, prompt="123=", max_tokens=0, echo=True, logprobs=0)
    assert echo.choices[0].text == "123=" and echo.choices[0].logprobs.token_logprobs[0] is None
    assert len(echo.choices[0].logprobs.tokens) == 5


async def test_chat_completions_use_the_chat_template(client, tiny_model_dir):
    c, engine = client
    messages = [{"role": "user", "content": "123"}]
    chat = await c.chat.completions.create(model="any", messages=messages, max_tokens=6, temperature=0,
                                           logprobs=True, top_logprobs=2)  # fmt: skip
    plain = await c.completions.create(model="any", prompt="123=", max_tokens=6, temperature=0)
    msg = chat.choices[0].message
    assert msg.role == "assistant" and msg.content == plain.choices[0].text  # <s>123= either way
    ids = Tokenizer(tiny_model_dir).encode(Tokenizer(tiny_model_dir).render_chat(messages), add_special_tokens=False)
    assert chat.usage.prompt_tokens == len(ids) == 5
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert all(e.top_logprobs[0].token == e.token for e in content)


async def test_return_token_ids_gives_the_ids_the_engine_saw_and_sampled(client, tiny_model_dir):
    """vLLM's return_token_ids: the prompt's ids and each choice's sampled ids, with the weight
    versions that produced them, so a client driving a multi-turn loop over chat can build its
    trajectory token in, token out."""
    c, engine = client
    tok = Tokenizer(tiny_model_dir)
    messages = [{"role": "user", "content": "123"}]
    chat = await c.chat.completions.create(model="any", messages=messages, max_tokens=6, temperature=1.0,
                                           logprobs=True, extra_body={"return_token_ids": True})  # fmt: skip
    body = chat.model_dump()
    assert body["prompt_token_ids"] == tok.encode(tok.render_chat(messages), add_special_tokens=False)
    ch = body["choices"][0]
    assert len(ch["token_ids"]) == chat.usage.completion_tokens == len(ch["logprobs"]["content"])
    assert tok.decode(ch["token_ids"]) == ch["message"]["content"]
    assert ch["meta_info"]["weight_versions"][0]["start"] == 0 and ch["meta_info"]["weight_version"] is not None
    plain = await c.completions.create(model="any", prompt="123=", max_tokens=4, n=2,
                                       extra_body={"return_token_ids": True})  # fmt: skip
    body = plain.model_dump()
    assert body["prompt_token_ids"] == tok.encode("123=") and len(body["choices"]) == 2
    assert all(tok.decode(ch["token_ids"]) == ch["text"] for ch in body["choices"])
    without = (await c.chat.completions.create(model="any", messages=messages, max_tokens=2)).model_dump()
    assert "prompt_token_ids" not in without and "token_ids" not in without["choices"][0]
    with pytest.raises(openai.BadRequestError, match="return_token_ids"):
        await c.chat.completions.create(model="any", messages=messages, max_tokens=2, stream=True,
                                        extra_body={"return_token_ids": True})  # fmt: skip


async def test_streaming_completions_and_chat(client):
    c, _ = client
    full = await c.completions.create(model="m", prompt="12345=", max_tokens=10, temperature=0,
                                      extra_body={"ignore_eos": True})  # fmt: skip
    stream = await c.completions.create(model="m", prompt="12345=", max_tokens=10, temperature=0, stream=True,
                                        stream_options={"include_usage": True}, extra_body={"ignore_eos": True})  # fmt: skip
    chunks = [ch async for ch in stream]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert "".join(ch.choices[0].text for ch in chunks[:-1]) == full.choices[0].text
    assert chunks[-2].choices[0].finish_reason == "length"
    assert all(ch.choices[0].finish_reason is None for ch in chunks[:-2])

    messages = [{"role": "user", "content": "45"}]
    whole = await c.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0, n=2)
    stream = await c.chat.completions.create(model="m", messages=messages, max_tokens=8, temperature=0, n=2,
                                             stream=True)  # fmt: skip
    parts: dict[int, list[str]] = {0: [], 1: []}
    finish = {}
    async for ch in stream:
        choice = ch.choices[0]
        if choice.delta.role:
            assert choice.delta.role == "assistant"
        parts[choice.index].append(choice.delta.content or "")
        if choice.finish_reason:
            finish[choice.index] = choice.finish_reason
    assert ["".join(parts[i]) for i in (0, 1)] == [ch.message.content for ch in whole.choices]
    assert finish == {i: ch.finish_reason for i, ch in enumerate(whole.choices)}


async def test_streamed_echo_logprobs_have_the_offsets_of_the_whole_answer(client):
    """Streamed or not, a completion's text_offset is the same: each token's offset is the length
    of the tokens before it, the echoed prompt's included, however the chunks fall (a streamed
    answer's offsets restarted from its text after the first chunk, which has no `<s>`)."""
    c, _ = client
    ask = {"model": "m", "prompt": "12345=", "max_tokens": 10, "temperature": 0, "echo": True, "logprobs": 1,
           "extra_body": {"ignore_eos": True}}  # fmt: skip
    full = (await c.completions.create(**ask)).choices[0].logprobs
    chunks = [ch async for ch in await c.completions.create(**ask, stream=True)]
    tokens = [t for ch in chunks for t in ch.choices[0].logprobs.tokens]
    offsets = [o for ch in chunks for o in ch.choices[0].logprobs.text_offset]
    assert len(chunks) > 1 and tokens == full.tokens and offsets == full.text_offset
    assert offsets == [sum(len(t) for t in tokens[:k]) for k in range(len(tokens))]


async def test_openai_errors_are_400s_that_name_the_field(client, tiny_model_dir):
    c, engine = client
    cases = [
        (lambda: c.completions.create(model="m", prompt="1=", max_tokens=-1), "max_tokens"),
        (lambda: c.completions.create(model="m", prompt="1=", temperature=-1), "temperature"),
        (lambda: c.completions.create(model="m", prompt="1=", logprobs=99), "logprobs"),
        (lambda: c.completions.create(model="m", prompt="1=", extra_body={"bogus": 1}), "bogus"),
        (lambda: c.completions.create(model="m", prompt="1=", extra_body={"regex": "[0-9]"}), "regex"),
        (lambda: c.chat.completions.create(model="m", messages=[], max_tokens=2), "messages"),
        (
            lambda: c.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "1"}], response_format={"type": "json_object"}
            ),
            "response_format",
        ),  # fmt: skip
        (
            lambda: c.chat.completions.create(
                model="m",
                messages=[{"role": "user", "content": "1"}],
                tools=[{"type": "function", "function": {"name": "f"}}],
            ),
            "tools",
        ),  # fmt: skip
    ]
    for call, field in cases:
        with pytest.raises(openai.BadRequestError) as info:
            await call()
        err = info.value.body
        assert info.value.status_code == 400 and field in err["message"] and err["param"] == field, err
        assert err["type"] == "invalid_request_error"
    async with openai.AsyncOpenAI(base_url=engine.url + "/v1", api_key="wrong", max_retries=0) as bad:
        with pytest.raises(openai.AuthenticationError):
            await bad.models.list()


async def test_a_model_without_a_chat_template_refuses_chat(tiny_model_dir, tmp_path):
    import json
    import shutil

    d = tmp_path / "plain"
    shutil.copytree(tiny_model_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with EngineThread(d) as e:
        async with openai.AsyncOpenAI(base_url=e.url + "/v1", api_key="x", max_retries=0) as c:
            with pytest.raises(openai.BadRequestError, match="no chat template"):
                await c.chat.completions.create(model="m", messages=[{"role": "user", "content": "1"}])


async def test_tools_reach_a_chat_template_that_renders_them(tiny_model_dir, tmp_path):
    """`tools` go to the template's `tools` variable (this one writes how many there are, in the
    tiny model's digits); tool_choice none leaves them out; a forced call is refused."""
    import json
    import shutil

    d = tmp_path / "tools"
    shutil.copytree(tiny_model_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = ("{{ bos_token }}{% if tools %}{{ tools | length }}{% endif %}"
                            "{% for m in messages %}{{ m['content'] }}{% endfor %}=")  # fmt: skip
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tools = [{"type": "function", "function": {"name": f"f{i}", "parameters": {"type": "object"}}} for i in range(2)]
    chat = [{"role": "user", "content": "12"}, {"role": "assistant", "content": "3", "tool_calls": []},
            {"role": "tool", "content": "4", "tool_call_id": "call-0"}]  # fmt: skip
    with EngineThread(d) as e:
        async with openai.AsyncOpenAI(base_url=e.url + "/v1", api_key="x", max_retries=0) as c:
            plain = await c.chat.completions.create(model="m", messages=chat, max_tokens=1)
            with_tools = await c.chat.completions.create(model="m", messages=chat, max_tokens=1, tools=tools)
            assert with_tools.usage.prompt_tokens == plain.usage.prompt_tokens + 1  # "<s>2" + "1234="
            none = await c.chat.completions.create(model="m", messages=chat, max_tokens=1, tools=tools,
                                                   tool_choice="none")  # fmt: skip
            assert none.usage.prompt_tokens == plain.usage.prompt_tokens
            with pytest.raises(openai.BadRequestError, match="tool_choice"):
                await c.chat.completions.create(model="m", messages=chat, tools=tools, tool_choice="required")
            with pytest.raises(openai.BadRequestError, match="tools must be a list"):
                await c.chat.completions.create(model="m", messages=chat, tools=[{"name": "f"}])


async def test_the_tool_call_parser_answers_the_calls_the_model_wrote(tool_model_dir):
    """--tool-call-parser qwen25: the call the model wrote comes back as message.tool_calls with
    finish reason tool_calls; sent back with the tool's answer it renders as the model wrote it,
    so the next prompt extends the first one's ids and the sampled ids (one token sequence).
    Without the parser the call is the answer's text; a stream with tools is refused."""
    import json

    from tests.conftest import TOOL_CALL

    tok = Tokenizer(tool_model_dir)
    tools = [{"type": "function", "function": {"name": "calc_add", "parameters": {"type": "object"}}}]
    chat = [{"role": "user", "content": "1+2"}]
    ask = {"model": "m", "tools": tools, "temperature": 0, "max_tokens": 100, "extra_body": {"return_token_ids": True}}
    with EngineThread(tool_model_dir, tool_call_parser="qwen25") as e:
        async with openai.AsyncOpenAI(base_url=e.url + "/v1", api_key="x", max_retries=0) as c:
            first = await c.chat.completions.create(messages=chat, **ask)
            choice = first.choices[0]
            assert choice.finish_reason == "tool_calls" and choice.message.content is None
            [call] = choice.message.tool_calls
            assert call.type == "function" and call.function.name == "calc_add"
            assert json.loads(call.function.arguments) == {"a": 1, "b": 2}
            sampled = choice.model_extra["token_ids"]
            assert tok.decode(sampled) == TOOL_CALL
            chat += [choice.message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "3"}]
            second = await c.chat.completions.create(messages=chat, **ask)
            assert second.choices[0].message.content == "3" and second.choices[0].finish_reason == "stop"
            assert second.choices[0].message.tool_calls is None
            before = first.model_extra["prompt_token_ids"] + sampled
            assert second.model_extra["prompt_token_ids"][: len(before)] == before
            with pytest.raises(openai.BadRequestError, match="stream"):
                await c.chat.completions.create(messages=chat, stream=True, **ask)
            bad = [*chat[:1], {**chat[1], "tool_calls": [{**chat[1]["tool_calls"][0], "function": {
                "name": "calc_add", "arguments": "{not json"}}]}, chat[2]]  # fmt: skip
            with pytest.raises(openai.BadRequestError, match=r"messages\[1\]: tool_calls\[0\].function.arguments"):
                await c.chat.completions.create(messages=bad, **ask)
    with EngineThread(tool_model_dir) as e:  # no parser: the model's text, as SGLang without one
        async with openai.AsyncOpenAI(base_url=e.url + "/v1", api_key="x", max_retries=0) as c:
            plain = await c.chat.completions.create(messages=chat[:1], **ask)
            assert plain.choices[0].message.content == TOOL_CALL and plain.choices[0].finish_reason == "stop"
