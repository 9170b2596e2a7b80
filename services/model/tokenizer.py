"""Client-side tokenization, as Miles does it: prompts go to engines as input_ids.

Uses the `tokenizers` library on the checkpoint's tokenizer.json (fast to import, no torch);
transformers is imported only when a chat template is applied.
"""

from __future__ import annotations

import json
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
        self._hf = None

    def _special_id(self, key: str, fallback):
        tok = self._cfg.get(key)
        if isinstance(tok, dict):
            tok = tok.get("content")
        if isinstance(tok, str):
            tid = self._tok.token_to_id(tok)
            if tid is not None:
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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict] | str) -> str:
        if not self.has_chat_template:
            raise ValueError(
                f"--apply-chat-template: the tokenizer in {self.model_dir} has no chat template; "
                "drop the flag or use a checkpoint whose tokenizer_config.json has one"
            )
        if self._hf is None:
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(str(self.model_dir))
        if isinstance(messages, str):
            messages = [{"role": "user", "content": messages}]
        return self._hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def prompt_ids(self, prompt: str | list[int] | list[dict], chat_template: bool) -> list[int]:
        """Token ids of a prompt: ids pass through; a chat prompt is templated (which carries its
        own special tokens, hence add_special_tokens=False), plain text gets BOS as configured."""
        if isinstance(prompt, list) and all(isinstance(x, int) for x in prompt):
            return list(prompt)
        if chat_template:
            return self.encode(self.apply_chat_template(prompt), add_special_tokens=False)
        if not isinstance(prompt, str):
            raise ValueError("a prompt must be text or token ids unless --apply-chat-template is set")
        return self.encode(prompt, add_special_tokens=True)
