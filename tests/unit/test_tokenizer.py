"""Client-side tokenization: plain prompts, token-id prompts, and --apply-chat-template."""

from __future__ import annotations

import json
import shutil

import pytest

from services.model.tokenizer import Tokenizer


def test_plain_and_token_id_prompts(tiny_model_dir):
    tok = Tokenizer(tiny_model_dir)
    assert tok.prompt_ids("12=", chat_template=False) == [1, 5, 6, 15]  # BOS added
    assert tok.prompt_ids([1, 5, 15], chat_template=False) == [1, 5, 15]
    assert tok.decode([7, 8, 2]) == "34" and tok.eos_token_id == 2


def test_chat_template_when_the_tokenizer_has_one(tiny_model_dir, tmp_path):
    pytest.importorskip("transformers")
    d = tmp_path / "chat"
    shutil.copytree(tiny_model_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = "<s>{% for m in messages %}{{ m['content'] }}{% endfor %}="
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer(d)
    assert tok.has_chat_template
    assert tok.prompt_ids("12", chat_template=True) == [1, 5, 6, 15]  # the template carries BOS
    assert tok.prompt_ids([{"role": "user", "content": "9"}], chat_template=True) == [1, 13, 15]


def test_chat_template_flag_without_a_template_says_what_to_do(tiny_model_dir, tmp_path):
    d = tmp_path / "plain"
    shutil.copytree(tiny_model_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    del cfg["chat_template"]
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="has no chat template; drop the flag"):
        Tokenizer(d).prompt_ids("12", chat_template=True)


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ([{"name": "tool_use", "template": "x"}, {"name": "default"}], "no usable chat template"),
        (["not a named template", {"name": "default", "template": 3}], "no usable chat template"),
        ("{% for m in messages %}{{ m['content'] }}", "does not compile \\(TemplateSyntaxError"),
    ],
)
def test_a_malformed_chat_template_is_a_value_error_that_says_so(tiny_model_dir, tmp_path, template, message):
    """What callers catch (a 400 from the engine, a data error from the producer): a named template
    without its text, or one that does not compile, raised KeyError or jinja2's own error before."""
    d = tmp_path / "bad"
    shutil.copytree(tiny_model_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match=message):
        Tokenizer(d).prompt_ids("12", chat_template=True)


def test_template_renders_tools_reads_the_default_of_named_templates(tiny_model_dir, tmp_path):
    """Several named templates: the "default" one is read, and an entry that is not a named template
    is skipped, as rendering skips it (it raised AttributeError, a 500 for a request with tools)."""
    d = tmp_path / "named"
    shutil.copytree(tiny_model_dir, d)
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    for default, renders in ((TOOLS_TEMPLATE, True), ("{{ messages }}", False)):
        cfg["chat_template"] = ["not a named template", {"name": "default", "template": default}]
        (d / "tokenizer_config.json").write_text(json.dumps(cfg))
        assert Tokenizer(d).template_renders_tools is renders


def test_the_bundled_chat_template_renders_as_transformers_renders_it(tiny_model_dir):
    """The engine renders templates with jinja2 alone; transformers (test extra) must agree."""
    transformers = pytest.importorskip("transformers")
    ours = Tokenizer(tiny_model_dir)
    hf = transformers.AutoTokenizer.from_pretrained(str(tiny_model_dir))
    chats = [[{"role": "user", "content": "123"}],
             [{"role": "system", "content": "9"}, {"role": "user", "content": "45"},
              {"role": "assistant", "content": "54"}, {"role": "user", "content": "67"}]]  # fmt: skip
    for messages in chats:
        for gen in (True, False):
            want = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
            assert ours.render_chat(messages, add_generation_prompt=gen) == want
    assert ours.prompt_ids("123", chat_template=True) == [1, 5, 6, 7, 15]  # <s>123=, the task's format


TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
    "{% for m in messages %}{{ m['content'] }}{% endfor %}"
)
"""A template that shows its tools, as Qwen's and Llama 3's do (in their own words)."""


def test_tool_schemas_reach_the_chat_template_as_transformers_passes_them(tmp_path):
    """--tool-key: a row's tools travel with its prompt (PromptMsg.tools) and are rendered by the
    template's own `tools` variable, as transformers' apply_chat_template(tools=...) renders them."""
    from services.data.source import PromptSource, load_rows
    from services.common.config import RunConfig
    from services.tasks.char_model import build_char_tokenizer

    build_char_tokenizer(tmp_path / "m", context=512)
    cfg = json.loads((tmp_path / "m" / "tokenizer_config.json").read_text())
    (tmp_path / "m" / "tokenizer_config.json").write_text(json.dumps({**cfg, "chat_template": TOOLS_TEMPLATE}))
    tools = [{"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}]
    (tmp_path / "d.jsonl").write_text(json.dumps({"prompt": [{"role": "user", "content": "1+2?"}], "tools": tools})
                                      + "\n" + json.dumps({"prompt": "no tools"}) + "\n")  # fmt: skip
    rows = load_rows(tmp_path / "d.jsonl", "prompt", None, None, tool_key="tools")
    assert [r["tools"] for r in rows] == [tools, None]
    msg, _ = PromptSource(RunConfig(), rows).next_release(0, 0, 0, [])
    assert msg.tools == tools
    tok = Tokenizer(tmp_path / "m")
    text = tok.decode(tok.prompt_ids(msg.prompt, chat_template=True, tools=msg.tools))
    assert text == f"<tools>{json.dumps(tools)}</tools>\n1+2?"
    assert tok.decode(tok.prompt_ids("no tools", chat_template=True)) == "no tools"
    transformers = pytest.importorskip("transformers")
    hf = transformers.PreTrainedTokenizerFast(tokenizer_file=str(tmp_path / "m" / "tokenizer.json"), bos_token="<s>")
    assert hf.apply_chat_template(msg.prompt, tools=tools, tokenize=False, chat_template=TOOLS_TEMPLATE) == \
        "<s>" + text  # fmt: skip
    (tmp_path / "bad.jsonl").write_text(json.dumps({"prompt": "x", "tools": {"name": "add"}}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:1: 'tools' must be a list of tool schemas"):
        load_rows(tmp_path / "bad.jsonl", "prompt", None, None, tool_key="tools")
    # a JSON text (a Parquet string column) is read as Miles reads it; the row's metadata keeps them
    (tmp_path / "text.jsonl").write_text(json.dumps({"prompt": "x", "tools": json.dumps(tools)}) + "\n")
    row = load_rows(tmp_path / "text.jsonl", "prompt", None, None, tool_key="tools")[0]
    assert row["tools"] == tools and row["metadata"]["tools"] == tools
