"""Client-side tokenization, as Miles does it: prompts go to engines as input_ids.

Uses the `tokenizers` library on the checkpoint's tokenizer.json (fast to import, no torch).
Chat templates (tokenizer_config.json's `chat_template`) are rendered with jinja2 as transformers
renders them (a sandboxed environment with trim_blocks and lstrip_blocks, the special tokens,
`raise_exception`, `strftime_now` and a `tojson` filter), so transformers is never needed.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        path = self.model_dir / "tokenizer.json"
        if not path.exists():
            raise FileNotFoundError(f"{path} not found: the checkpoint needs a fast tokenizer (tokenizer.json)")
        self._tok = _HFTokenizer.from_file(str(path))
        cfg_path = self.model_dir / "tokenizer_config.json"
        self._cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        model_cfg_path = self.model_dir / "config.json"
        model_cfg = json.loads(model_cfg_path.read_text()) if model_cfg_path.exists() else {}
        self.eos_token_id = self._special_id("eos_token", model_cfg.get("eos_token_id"))
        self.bos_token_id = self._special_id("bos_token", model_cfg.get("bos_token_id"))
        self.pad_token_id = self._special_id("pad_token", model_cfg.get("pad_token_id"))
        self._template = None

    def _special_id(self, key: str, fallback):
        tok = self._cfg.get(key)
        if isinstance(tok, dict):
            tok = tok.get("content")
        if isinstance(tok, str) and (tid := self._tok.token_to_id(tok)) is not None:
            return tid
        if isinstance(fallback, list):
            return fallback[0] if fallback else None
        return fallback

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    @property
    def has_chat_template(self) -> bool:
        return bool(self._cfg.get("chat_template"))

    @property
    def template_renders_tools(self) -> bool:
        """The chat template reads a `tools` variable (transformers' convention for tool schemas)."""
        source = self._cfg.get("chat_template")
        if isinstance(source, list):
            source = next(
                (t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None
            )
        return isinstance(source, str) and re.search(r"\btools\b", source) is not None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict] | str, tools: list[dict] | None = None) -> str:
        if not self.has_chat_template:
            raise ValueError(f"--apply-chat-template: the tokenizer in {self.model_dir} has no chat template; drop the "
                             "flag or use a checkpoint whose tokenizer_config.json has one")  # fmt: skip
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        return self.render_chat(messages, add_generation_prompt=True, tools=tools)

    def render_chat(self, messages: list[dict], add_generation_prompt: bool = True,
                    tools: list[dict] | None = None) -> str:  # fmt: skip
        """The chat template applied to `messages` (text, not token ids), with `tools` (the
        template's own variable, as transformers passes it; None: no tools). ValueError if the
        template fails or calls raise_exception."""
        if self._template is None:
            self._template = _compile_template(self._cfg.get("chat_template"))
        specials = {key: tok.get("content") if isinstance(tok := self._cfg.get(key), dict) else tok
                    for key in ("bos_token", "eos_token", "pad_token", "unk_token")}  # fmt: skip
        try:
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                                         **specials)  # fmt: skip
        except ValueError:
            raise
        except Exception as e:  # jinja2's TemplateError and whatever the template's own code raises
            raise ValueError(f"{type(e).__name__}: {e}") from None

    def prompt_ids(self, prompt: str | list[int] | list[dict], chat_template: bool,
                   tools: list[dict] | None = None) -> list[int]:  # fmt: skip
        """Token ids of a prompt: ids pass through; a chat prompt is templated with its `tools`
        (which carries its own special tokens, hence add_special_tokens=False), plain text gets
        BOS as configured."""
        if isinstance(prompt, list) and all(isinstance(x, int) for x in prompt):
            return list(prompt)
        if chat_template:
            return self.encode(self.apply_chat_template(prompt, tools), add_special_tokens=False)
        if not isinstance(prompt, str):
            raise ValueError("a prompt must be text or token ids unless --apply-chat-template is set")
        return self.encode(prompt, add_special_tokens=True)


def _compile_template(source):
    import datetime

    from jinja2.sandbox import ImmutableSandboxedEnvironment

    if isinstance(source, list):  # several named templates: transformers takes "default"
        source = next((t.get("template") for t in source if isinstance(t, dict) and t.get("name") == "default"), None)
    if not isinstance(source, str) or not source:
        raise ValueError("the tokenizer has no usable chat template")

    def raise_exception(message):
        raise ValueError(message)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, sort_keys=False: json.dumps(
        x, indent=indent, ensure_ascii=ensure_ascii, sort_keys=sort_keys
    )
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except Exception as e:  # jinja2's TemplateSyntaxError: a request cannot fix it, the checkpoint can
        raise ValueError(f"the tokenizer's chat template does not compile ({type(e).__name__}: {e})") from None
