"""Requests in flight between the HTTP handlers and the scheduler, and SGLang's /generate output.

`Generation.submit` turns validated sequences into scheduler requests whose progress (a new token,
the end) is posted from the scheduler thread into one asyncio queue; `progress` reads that queue
(merging a burst of tokens into one event, and aborting what is left if the reader goes away:
a client that disconnects from a stream aborts its requests, as SGLang). /generate answers with
`output` (SGLang 0.5.16's response object) once everything is finished, or with `stream`:
server-sent events, each `data: <the cumulative response so far>` (finish_reason null until the
last one; a batch's chunks carry `index`), then `data: [DONE]`. The OpenAI routes
(services/engine/openai.py) read the same progress events.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from services.engine.detok import TextView
from services.engine.protocol import BadRequest, Sequence, raise_if_failed
from services.engine.request import Request as EngineRequest
from services.engine.scheduler import Scheduler

WAITING_ABORT = "Abort in waiting queue"


@dataclass
class Tracked:
    """One sequence in flight."""

    index: int
    seq: Sequence
    req: EngineRequest
    view: TextView
    done: bool = False


class Generation:
    def __init__(self, scheduler: Scheduler, tokenizer, loras=None):
        """loras: the engine's EngineLoras (None: LoRA not enabled, and `lora_path` is refused)."""
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self.loras = loras

    def check_loras(self, seqs: list[Sequence]) -> list[tuple[int, int]]:
        """(slot, uid) of each sequence's adapter, (-1, 0) for the base model; BadRequest if one
        names an adapter not loaded (called alone: before a stream starts)."""
        if self.loras is None:
            if any(seq.lora is not None for seq in seqs):
                raise BadRequest("lora_path: this engine serves no LoRA adapters; start it with --enable-lora")
            return [(-1, 0)] * len(seqs)
        with self.loras.lock:
            return [self.loras.resolve(seq.lora) for seq in seqs]

    def submit(self, seqs: list[Sequence], tokens: bool = True) -> tuple[list[Tracked], asyncio.Queue]:
        """Queue every sequence; the queue their progress arrives on (`progress` reads it) is returned
        with them: (index, tokens so far), and (index, None) when the request is finished. tokens False:
        only the ends arrive (a caller that waits for the whole answer wakes once per request, not per token)."""
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()
        tracked = []
        for i, seq in enumerate(seqs):
            view = TextView(self.tokenizer, seq)

            def post(req, i=i, every=seq.text.stream_interval):
                n = len(req.output_ids)
                if req.finish_reason is not None:
                    loop.call_soon_threadsafe(queue.put_nowait, (i, None))
                elif n % every == 0:
                    loop.call_soon_threadsafe(queue.put_nowait, (i, n))

            req = EngineRequest(rid=seq.rid or self.scheduler.new_rid(), input_ids=seq.input_ids, params=seq.params,
                                on_done=post, on_token=post if tokens else None, logprob_start=seq.logprob_start,
                                top_logprobs_num=seq.top_logprobs_num,
                                stop_check=view.stop_check if view.stops or view.regexes else None)  # fmt: skip
            tracked.append(Tracked(i, seq, req, view))
        lock = self.loras.lock if self.loras is not None else contextlib.nullcontext()
        with lock:  # resolved and queued together: an unload never misses these requests
            for t, (slot, uid) in zip(tracked, self.check_loras(seqs), strict=True):
                t.req.lora_slot, t.req.lora_uid = slot, uid
                self.scheduler.add_request(t.req)
        return tracked, queue

    async def progress(self, tracked: list[Tracked], queue: asyncio.Queue) -> AsyncIterator[tuple[Tracked, int]]:
        """(sequence, tokens to show) at each step of progress, until all are finished; a
        finished one is marked done. Unfinished requests are aborted if the reader stops."""
        try:
            while not all(t.done for t in tracked):
                items = [await queue.get()]  # every request ends: the scheduler answers each, even when it dies
                while not queue.empty():
                    items.append(queue.get_nowait())
                latest: dict[int, int | None] = {}
                for i, n in items:
                    latest[i] = None if n is None or latest.get(i, 0) is None else max(n, latest.get(i, 0))
                for i, n in latest.items():
                    t = tracked[i]
                    if t.done:
                        continue
                    t.done = n is None
                    yield t, len(t.req.output_ids) if n is None else n
        finally:
            for t in tracked:
                if not t.done:
                    self.scheduler.abort(rid=t.req.rid)

    async def run(self, seqs: list[Sequence]) -> list[Tracked]:
        """Submit and wait until every sequence is finished; RequestFailed (a 400 or 500) for a
        request the scheduler failed alone."""
        tracked, queue = self.submit(seqs, tokens=False)
        async for _ in self.progress(tracked, queue):
            pass
        raise_if_failed(t.req for t in tracked)
        return tracked

    # ---- SGLang's /generate --------------------------------------------------------------------
    def output(self, t: Tracked, n: int | None = None) -> dict:
        """The response object of one sequence: final, or (n given, not done) its first n tokens."""
        req, seq, final = t.req, t.seq, t.done
        n = len(req.output_ids) if final else n
        ids, reason = req.output_ids[:n], req.finish_reason if final else None
        meta: dict[str, Any] = {"id": req.rid, "finish_reason": reason, "weight_version": self.scheduler.weight_version,
                                "completion_tokens": n}  # fmt: skip
        if final:
            meta["e2e_latency"] = req.finished_at - req.created_at
        if not (final and reason.get("type") == "abort" and reason.get("message") == WAITING_ABORT):
            meta.update(prompt_tokens=len(req.input_ids), cached_tokens=req.cached_tokens, reasoning_tokens=0,
                        num_retractions=req.num_retractions, weight_versions=weight_spans(req, n))  # fmt: skip
        if seq.return_logprob:
            self._logprobs(t, n, meta)
        meta["response_sent_to_client_ts"] = time.time()
        out = {"text": t.view.text(ids, reason), "output_ids": list(ids), "meta_info": meta}
        if seq.return_prompt_token_ids:
            out["prompt_token_ids"] = list(req.input_ids)
        return out

    def _logprobs(self, t: Tracked, n: int, meta: dict) -> None:
        req, seq = t.req, t.seq

        def text(tid):
            return t.view.token_text(tid) if seq.return_text_in_logprobs else None

        def tops(rows):
            return [None if row is None else [[lp, tid, text(tid)] for lp, tid in row] for row in rows]

        ids, lps = req.output_ids[:n], req.output_logprobs[:n]
        meta["output_token_logprobs"] = [[lp, tid, text(tid)] for lp, tid in zip(lps, ids, strict=True)]
        meta["output_token_logprobs_length"] = n
        prompt = req.input_ids[seq.logprob_start :] if seq.logprob_start is not None else []
        values = req.input_logprobs or []
        meta["input_token_logprobs"] = [[lp, tid, text(tid)] for lp, tid in zip(values, prompt, strict=False)]
        if seq.top_logprobs_num:
            meta["output_top_logprobs"] = tops(req.output_top_logprobs[:n])
            meta["input_top_logprobs"] = tops(req.input_top_logprobs or [])

    async def stream(self, seqs: list[Sequence], is_batch: bool) -> AsyncIterator[bytes]:
        tracked, queue = self.submit(seqs)
        async for t, n in self.progress(tracked, queue):
            chunk = self.output(t, n)
            if is_batch:
                chunk["index"] = t.index
            yield sse(chunk)
        yield b"data: [DONE]\n\n"


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


def weight_spans(req: EngineRequest, n: int) -> list[dict]:
    """The weight versions that produced the first n output tokens: [{version, start, end}] over
    output-token positions (end exclusive), as SGLang 0.5.23."""
    versions = req.token_versions[:n]
    starts = [pos for pos, v in enumerate(versions) if pos == 0 or v != versions[pos - 1]]
    return [{"version": versions[start], "start": start, "end": end}  # a span ends where the next starts
            for start, end in itertools.pairwise([*starts, len(versions)])]  # fmt: skip
