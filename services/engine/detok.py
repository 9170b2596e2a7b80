"""Text of a request's output: stop strings and stop regexes, trimming, and the text of streamed
prefixes, as SGLang's detokenizer shows them.

A `TextView` belongs to one request. Its `stop_check` runs on the scheduler thread after every
token: stop strings are looked for in the decoded tail (the last few tokens, enough to hold the
longest stop string), stop regexes in the whole decoded output (a regex has no bounded length);
the first that matches finishes the request with `{"type": "stop", "matched": <the string or the
pattern>}`. `text` is the output as the client sees it: a matched stop token is not decoded and a
matched stop string or regex match is cut off with everything after it, unless `no_stop_trim`.
A streamed prefix holds back a tail that could still become a stop string, and an incomplete
UTF-8 character, so that streamed text never has to be taken back.
"""

from __future__ import annotations

import re

from services.engine.protocol import Sequence

REPLACEMENT = "\ufffd"


class TextView:
    def __init__(self, tokenizer, seq: Sequence):
        self.tokenizer = tokenizer
        self.skip_special = seq.text.skip_special_tokens
        self.no_stop_trim = seq.text.no_stop_trim
        self.stops = list(seq.text.stop)
        self.regexes = [re.compile(r) for r in seq.text.stop_regex]
        longest = max((len(tokenizer.encode(s, add_special_tokens=False)) for s in self.stops), default=0)
        self.tail_tokens = longest + 2

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, self.skip_special) if self.tokenizer is not None else ""

    def stop_check(self, req) -> str | None:
        if self.stops:
            tail = self.decode(req.output_ids[-self.tail_tokens :])
            for s in self.stops:
                if s in tail:
                    return s
        if self.regexes:
            text = self.decode(req.output_ids)
            for rx in self.regexes:
                if rx.search(text):
                    return rx.pattern
        return None

    def text(self, output_ids: list[int], finish_reason: dict | None) -> str:
        """The output text; `finish_reason` None: a streamed prefix of an unfinished request."""
        matched = (finish_reason or {}).get("matched")
        if isinstance(matched, int) and not self.no_stop_trim and output_ids:
            output_ids = output_ids[:-1]  # a matched stop token is not detokenized into text (SGLang)
        text = self.decode(output_ids)
        if isinstance(matched, str):
            return self._cut(text, matched)
        if finish_reason is None:
            return self._hold_back(text)
        return text

    def _cut(self, text: str, matched: str) -> str:
        m = re.search(re.escape(matched) if matched in self.stops else matched, text)
        if m is None:
            return text
        return text[: m.end()] if self.no_stop_trim else text[: m.start()]

    def _hold_back(self, text: str) -> str:
        keep = len(text.rstrip(REPLACEMENT))
        for s in self.stops:
            for k in range(min(len(s), keep), 0, -1):
                if text[keep - k : keep] == s[:k]:
                    keep -= k
                    break
        return text[:keep]

    def token_text(self, token_id: int) -> str:
        """One token's own text, for logprob entries (special tokens shown)."""
        return self.tokenizer.decode([token_id], False) if self.tokenizer is not None else ""
