"""The built-in engine's scheduler: continuous batching over a slot-indexed KV cache.

Consumes: requests added by the HTTP layer (any thread). Produces: finished requests, delivered
through each request's `on_done` callback. Waits for: work while idle, `continue` while paused.

One scheduler thread runs the loop. A step admits waiting requests into free slots
(reusing a cached prompt prefix when one is resident), runs one forward pass for every running
request (new requests feed their uncached tokens, running ones their last sampled token), samples
one token each, and finishes requests that hit a stop token, max_new_tokens or the context limit.
Requests join and leave between steps, so long and short generations share the batch.
Sampling (penalties, logit_bias, top-k/p, min-p, top log-probs) is services/engine/sampling.py. A
request that wants its prompt's log-probs (`logprob_start`) prefills its whole prompt itself,
never from the prefix cache, so that every position's logits are seen; with max_new_tokens 0
it finishes after that prefill without sampling (prompt scoring).

Locks: `_work` guards all scheduling state and is held only to plan and to apply a step, never
during the forward pass, so HTTP handlers and control calls never wait behind the model.
`_model_lock` is held during the forward pass and while weights load; the weight version and
the prefix-cache epoch change only under it, so each step knows exactly which weights it ran.

One thread for all torch work: the forward pass, weight loads, staging and the checks of received
weights all run on the scheduler's thread (`call`, `call_chunked`), between steps. A second thread
running parallel torch ops would start a second OpenMP team on the same cores, and libgomp then
throttles both teams' spinning: measured, a step at batch 32 on the 25m model took 70-90 ms
instead of 37 ms. Staging runs one tensor per step, so generation goes on while it loads.

Pause modes follow SGLang: `retract` puts running requests back in the waiting queue and drops
their KV (recomputed under the new weights after continue); `in_place` freezes them with their
cache; `abort` finishes everything with finish_reason abort and partial output. Requests that
arrive while paused wait. Every output token records the weight version that sampled it.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Generator
from dataclasses import dataclass

import torch

from services.common import crash
from services.common.snapshot import version_number
from services.engine.metrics import EngineStats
from services.engine.request import Request, SamplingParams
from services.engine.sampling import StepOutput, prompt_logprobs, sample
from services.engine.weight_api import EngineWeights
from services.model.hf_io import run_to_end
from services.model.llama import CausalLM, KVCache

log = logging.getLogger(__name__)


CHUNK_MIN_S = 0.005
"""Long work (call_chunked) runs at least this long between two steps."""


@dataclass
class _Planned:
    reqs: list[Request]
    feeds: list[list[int]]
    slots: list[int]


PADDING_WASTE = 2.0
"""A decode batch gathers every request's keys up to the batch's longest: a batch is cut where
its padded keys would exceed this many times its real ones."""


def length_buckets(decodes: list[Request]) -> list[list[Request]]:
    """Consecutive runs of decodes sorted by length, each padded to at most PADDING_WASTE x its
    real keys: with a long tail of lengths, one batch would make every short request's attention
    read (and copy) as many cached positions as the longest one's. Uniform lengths: one batch."""
    out: list[list[Request]] = []
    real = 0
    for r in decodes:
        keys = r.kv_len + 1
        if out and (len(out[-1]) + 1) * keys <= PADDING_WASTE * (real + keys):
            out[-1].append(r)
            real += keys
        else:
            out.append([r])
            real = keys
    return out


class Scheduler:
    def __init__(
        self,
        model: CausalLM,
        *,
        max_running_requests: int = 256,
        context_length: int | None = None,
        weight_version: str = "default",
        seed: int = 0,
        on_death: Callable[[BaseException], None] | None = None,
        torch_threads: int | None = None,
    ):
        """on_death: called (on the scheduler thread) if the loop ever raises; the engine's
        process exits there, because an engine whose scheduler is gone would hang every request.
        torch_threads: set on the scheduler's thread as it starts (the process should have done
        its own torch work, such as loading the model, at 1 thread, so no other OpenMP team exists)."""
        self.model = model.eval()
        self.on_death = on_death
        self.context_length = context_length or model.cfg.max_position_embeddings
        self.cache = KVCache(model.cfg, max_running_requests, self.context_length)
        self.eos_token_ids = model.cfg.eos_ids
        self.weight_version = weight_version
        self.paused_mode: str | None = None
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: list[Request] = []
        self.free_slots = list(range(max_running_requests))
        # prefix cache: which slot holds a prompt's KV, and under which weights (epoch) it was computed
        self.slot_prompt: dict[int, tuple[int, ...]] = {}
        """slot -> the prefix key (adapter load, *prompt) whose KV it holds."""
        self.slot_kv_epoch: dict[int, int] = {}
        self.kv_epoch = 0
        self.stats = EngineStats()
        self._inbox: collections.deque[Request] = collections.deque()
        self._work = threading.Condition()
        self._model_lock = threading.Lock()
        self._gen = torch.Generator().manual_seed(seed)
        self.weights = EngineWeights(self)
        self.last_progress = time.monotonic()
        """When the loop last started work or finished a step (for /health_generate)."""
        self.stall_timeout_s = 20.0
        """Holding work with no step for this long reads as stuck."""
        self.pause_max_s = 300.0
        """A pause held this long with no weight load under way is ended (a pauser that died)."""
        self.paused_at = 0.0
        self._shutdown = False
        self.lora = None
        """The model's MultiLora when LoRA is enabled (services/engine/loras.py sets it)."""
        self.torch_threads = torch_threads
        self._jobs: collections.deque[tuple[Callable, tuple, concurrent.futures.Future]] = collections.deque()
        """Torch work from other threads, run on the scheduler's thread before the next step."""
        self._chunked: collections.deque[tuple[Generator, concurrent.futures.Future]] = collections.deque()
        """Long torch work run one chunk per step (between steps), so generation goes on."""
        self._last_step_s = 0.0
        """How long the last step's forward passes took (the time long work may take after it)."""
        self._thread = threading.Thread(target=self._run, name="engine-scheduler", daemon=True)
        self._rid_counter = itertools.count()

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def shutdown(self) -> None:
        with self._work:
            self._shutdown = True
            self._work.notify_all()
        self._thread.join(timeout=10)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def stalled(self) -> bool:
        """Work is held and running, but no step has finished for stall_timeout_s."""
        busy = not self.paused_mode and (self.running or self.waiting)
        return bool(busy) and time.monotonic() - self.last_progress > self.stall_timeout_s

    def _run(self) -> None:
        try:
            if self.torch_threads:
                torch.set_num_threads(self.torch_threads)
            self._loop()
            self._fail_jobs(RuntimeError("the engine's scheduler has shut down"))
        except BaseException as e:
            self._fail_jobs(RuntimeError(f"the engine's scheduler died: {e!r}"))
            log.critical("the engine's scheduler thread died: %r", e, exc_info=e)
            with self._work:  # nothing will ever run them: answer every request now
                self._drain_inbox()
                victims, self.running = list(self.waiting) + self.running, []
                self.waiting.clear()
                for r in victims:
                    self._finish(r, {"type": "abort", "message": f"the engine's scheduler died: {e!r}",
                                     "status_code": 503, "err_type": "ServiceUnavailable"})  # fmt: skip
            if self.on_death is not None:
                self.on_death(e)

    def _loop(self) -> None:
        while True:
            with self._work:
                while True:
                    if self._shutdown:
                        return
                    self._drain_inbox()
                    self._end_a_forgotten_pause()
                    steppable = not self.paused_mode and (self.waiting or self.running)
                    if steppable or self._jobs or self._chunked:
                        break
                    self._work.wait(timeout=1.0 if self.paused_mode else None)
                    self.last_progress = time.monotonic()  # woken: idle time is not a stall
                job = self._jobs.popleft() if self._jobs else None
                plan = self._plan() if job is None and steppable else []
            if job is not None:
                fn, args, fut = job
                try:
                    fut.set_result(fn(*args))
                except BaseException as e:  # the caller learns of it; only an Exception is the caller's alone
                    fut.set_exception(e)
                    if not isinstance(e, Exception):
                        raise
                continue
            if plan:
                t_step = time.perf_counter()
                with self._model_lock:
                    version, epoch = version_number(self.weight_version), self.kv_epoch
                    outputs = [self._forward_each(p) for p in plan]
                self._last_step_s = time.perf_counter() - t_step
                crash.point("engine", "mid_step")
                with self._work:
                    for p, out in zip(plan, outputs, strict=True):
                        self._apply(p, out, version, epoch)
                    self.last_progress = time.monotonic()
                    self._work.notify_all()
            # long work between two steps, for as long as the step took (at least CHUNK_MIN_S):
            # generation goes at least half speed meanwhile, and the work takes at most about
            # twice its own time, however many chunks it has (one per tensor for a weight load)
            budget_end = time.perf_counter() + max(self._last_step_s if plan else 0.0, CHUNK_MIN_S)
            while self._chunked:
                gen, fut = self._chunked[0]
                try:
                    next(gen)
                except StopIteration as done:
                    self._chunked.popleft()
                    fut.set_result(done.value)
                except BaseException as e:  # a bad snapshot is the caller's error, not the loop's
                    self._chunked.popleft()
                    fut.set_exception(e)
                    if not isinstance(e, Exception):
                        raise
                if time.perf_counter() >= budget_end:
                    break

    # ---- torch work from other threads ------------------------------------------------------
    def call(self, fn: Callable, *args):
        """fn(*args) on the scheduler's thread, before its next step; its result, or what it raised."""
        return self._submit(lambda fut: self._jobs.append((fn, args, fut)), lambda: fn(*args))

    def call_chunked(self, gen_fn: Callable[..., Generator], *args):
        """gen_fn(*args) is a generator: run on the scheduler's thread one `next` per step
        (back to back while idle); its return value, or what it raised."""
        return self._submit(lambda fut: self._chunked.append((gen_fn(*args), fut)), lambda: run_to_end(gen_fn(*args)))

    def _submit(self, enqueue: Callable[[concurrent.futures.Future], None], inline: Callable[[], object]):
        if threading.current_thread() is self._thread or self._thread.ident is None:
            return inline()  # on the loop already, or not started (a test's bare scheduler)
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._work:
            if self._shutdown or not self._thread.is_alive():
                raise RuntimeError("the engine's scheduler is not running")
            enqueue(fut)
            self._work.notify_all()
        return fut.result()

    def _fail_jobs(self, error: BaseException) -> None:
        with self._work:
            self._shutdown = True  # nothing more will run: refuse new work from here on
            pending = [fut for _, _, fut in self._jobs] + [fut for _, fut in self._chunked]
            self._jobs.clear()
            self._chunked.clear()
        for fut in pending:
            if not fut.done():
                fut.set_exception(error)

    # ---- requests ------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Thread-safe and cheap: the request waits in an inbox for the next step."""
        if not req.input_ids:
            raise ValueError("input_ids must not be empty")
        if len(req.input_ids) >= self.context_length:
            raise ValueError(
                f"The input ({len(req.input_ids)} tokens) is longer than the model's context length "
                f"({self.context_length} tokens)."
            )
        self._inbox.append(req)
        with self._work:
            self._work.notify_all()

    def _drain_inbox(self) -> None:
        while self._inbox:
            req = self._inbox.popleft()
            self.stats.num_requests_total += 1
            if req.params.max_new_tokens == 0 and req.logprob_start is None:  # nothing to compute
                self.stats.prompt_tokens_total += len(req.input_ids)
                self._finish(req, {"type": "length", "length": 0})
            else:
                self.waiting.append(req)

    def new_rid(self) -> str:
        return f"req-{next(self._rid_counter)}-{time.monotonic_ns() % 10**9}"

    def abort(self, rid: str = "", abort_all: bool = False) -> int:
        with self._work:
            self._drain_inbox()
            victims = [r for r in list(self.waiting) + self.running if abort_all or r.rid == rid]
            for r in victims:
                self._abort(r)
            self._work.notify_all()  # a wait for these requests to end (an unload) re-checks now
            return len(victims)

    def _abort(self, req: Request) -> None:
        self.stats.num_aborted_requests_total += 1
        if req in self.running:
            reason = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
            self._finish(req, reason, running=True)
        else:
            self.waiting.remove(req)
            self._finish(req, {"type": "abort", "message": "Abort in waiting queue"})

    # ---- pause / continue / weights ----------------------------------------------------------
    def pause(self, mode: str) -> None:
        if mode not in ("abort", "retract", "in_place"):
            raise ValueError(f"unknown pause mode {mode!r}: use abort, retract or in_place")
        with self._work:
            self._drain_inbox()
            if mode == "abort":
                for r in list(self.running) + list(self.waiting):
                    self._abort(r)
            elif mode == "retract":
                for r in reversed(self.running):
                    self._release_slot(r)
                    r.kv_len = 0
                    r.num_retractions += 1
                    self.stats.num_retracted_requests_total += 1
                    self.waiting.appendleft(r)
                self.running = []
            self.paused_mode = mode
            self.paused_at = time.monotonic()
            self._work.notify_all()

    def _end_a_forgotten_pause(self) -> None:
        """Under `_work`: a pause held longer than pause_max_s with no weight load under way (its
        pauser died, or never meant to continue) ends, loudly: a paused engine still answers its
        health checks, so nothing else would notice a run that stopped generating."""
        if not self.paused_mode or time.monotonic() - self.paused_at <= self.pause_max_s or self._model_lock.locked():
            return
        log.warning("paused (%s) for %.0fs with no weight update under way: continuing generation",
                    self.paused_mode, time.monotonic() - self.paused_at)  # fmt: skip
        self.stats.num_forgotten_pauses_ended_total += 1
        self.paused_mode = None

    def resume(self) -> None:
        with self._work:
            self.paused_mode = None
            self._work.notify_all()

    def wait_lora_idle(self, lora_slot: int, timeout_s: float) -> None:
        """Return once no request queued, waiting or running uses the LoRA slot."""

        def idle() -> bool:
            self._drain_inbox()
            return all(r.lora_slot != lora_slot for r in (*self.running, *self.waiting))

        with self._work:
            if not self._work.wait_for(idle, timeout_s):
                raise TimeoutError("requests using the adapter did not finish; abort them first")

    # ---- planning ------------------------------------------------------------------------------
    def flush_cache(self) -> bool:
        """Drop the prefix cache. Like SGLang, refuses while requests are running or waiting."""
        with self._work:
            if self.running or (self.waiting and not self.paused_mode):
                return False
            self.kv_epoch += 1
            self.slot_prompt.clear()
            return True

    def _take_slot(self) -> int:
        # prefer a slot that caches nothing, else the least recently freed one
        s = next((s for s in self.free_slots if s not in self.slot_prompt), self.free_slots[0])
        self.free_slots.remove(s)
        self.slot_prompt.pop(s, None)
        return s

    def _release_slot(self, req: Request) -> None:
        if req.slot is not None:
            self.free_slots.append(req.slot)
            req.slot = None

    def _prefix_source(self, prompt: tuple[int, ...]) -> int | None:
        resident = (s for s, cached in self.slot_prompt.items() if cached == prompt)
        return next((s for s in resident if self.slot_kv_epoch.get(s) == self.kv_epoch), None)

    def _admit(self) -> None:
        """Move waiting requests into free slots. A fresh request whose prompt is resident in
        another slot copies that prefix instead of prefilling it; one whose prompt is being
        prefilled right now waits a step for it (a group's n samples share one prefill)."""
        being_prefilled = {r.prefix_key for r in self.running if r.kv_len < len(r.input_ids)}
        deferred: list[Request] = []
        while self.waiting and self.free_slots:
            req = self.waiting.popleft()
            prompt = req.prefix_key
            fresh = req.kv_len == 0 and not req.output_ids
            reusable = fresh and len(req.input_ids) > 1 and req.logprob_start is None
            src = self._prefix_source(prompt) if reusable else None
            if fresh and src is None and prompt in being_prefilled:
                deferred.append(req)
                continue
            req.slot = self._take_slot()
            if not req.admitted_at:  # its first slot
                req.admitted_at = time.time()
                self.stats.prompt_tokens_total += len(req.input_ids)
            req.kv_len = 0
            if src is not None and src != req.slot:
                reuse = len(req.input_ids) - 1
                self.cache.copy_prefix(src, req.slot, reuse)
                req.kv_len = req.cached_tokens = reuse
                self.stats.cached_tokens_total += reuse
            elif fresh:
                being_prefilled.add(prompt)
            self.running.append(req)
        self.waiting.extendleft(reversed(deferred))

    def _plan(self) -> list[_Planned]:
        """Admit, then one batch of prefills (several new tokens) and the decodes (one each), in
        batches of similar lengths (length_buckets)."""
        self._admit()
        prefill = [r for r in self.running if len(r.seq) - r.kv_len > 1]
        decode = sorted((r for r in self.running if len(r.seq) - r.kv_len == 1), key=lambda r: r.kv_len)
        batches = [sorted(b, key=lambda r: r.lora_slot) for b in (prefill, *length_buckets(decode)) if b]
        return [  # each adapter's rows side by side
            _Planned(reqs=b, feeds=[r.seq[r.kv_len :] for r in b], slots=[r.slot for r in b]) for b in batches
        ]

    # ---- the step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def _forward(self, p: _Planned) -> StepOutput:
        width = max(map(len, p.feeds))
        ids = torch.tensor([f + [0] * (width - len(f)) for f in p.feeds], dtype=torch.long)
        start = torch.tensor([r.kv_len for r in p.reqs], dtype=torch.long)
        rows = self.lora.rows([r.lora_slot for r in p.reqs]) if self.lora is not None else contextlib.nullcontext()
        with rows:
            logits_ntv = self.model.forward_cached(ids, self.cache, torch.tensor(p.slots), start)
        last = torch.tensor([len(f) - 1 for f in p.feeds])
        logits_nv = logits_ntv[torch.arange(len(p.reqs)), last].float()
        history = [(r.input_ids, r.output_ids) for r in p.reqs]
        out = sample(logits_nv, [r.params for r in p.reqs], history, self._gen, [r.top_logprobs_num for r in p.reqs])
        for i, r in enumerate(p.reqs):
            if r.logprob_start is not None and r.input_logprobs is None and r.kv_len == 0:
                out.prompt[i] = prompt_logprobs(logits_ntv[i], r.input_ids, r.logprob_start, r.top_logprobs_num)
        return out

    def _forward_each(self, p: _Planned) -> StepOutput:
        """The batch's forward pass; if it raises, each request again on its own, and one that
        still raises fails alone (500), so that no request can take the step or the thread down.
        Unless the engine itself fails: then a one-token probe in that request's slot fails too,
        and the error stands (the thread dies, the process exits and is restarted)."""
        try:
            return self._forward(p)
        except Exception as e:
            if len(p.reqs) == 1:
                self._probe(p.slots[0], e)
                log.warning("request %s failed inside the scheduler: %r", p.reqs[0].rid, e)
                return StepOutput([0], [0.0], [None], [None], [(500, f"the engine failed on this request: {e!r:.300}")])
        parts = [self._forward_each(_Planned([r], [f], [slot])) for r, f, slot in zip(p.reqs, p.feeds, p.slots, strict=True)]
        merged = {n: [x for o in parts for x in getattr(o, n)] for n in ("tokens", "logprobs", "top", "prompt")}
        return StepOutput(**merged, errors=[(o.errors or [None])[0] for o in parts])

    def _probe(self, slot: int, error: Exception) -> None:
        """Raise `error` unless a one-token forward pass in `slot` (the failing request's: it is
        released with it) works: the request is at fault, not the engine."""
        self.slot_prompt.pop(slot, None)  # the probe overwrites the slot's first position
        bos = self.model.cfg.bos_token_id if self.model.cfg.bos_token_id is not None else 0
        probe = Request(rid="probe", input_ids=[bos], params=SamplingParams(max_new_tokens=1), on_done=lambda r: None)
        try:
            self._forward(_Planned([probe], [[bos]], [slot]))
        except Exception:
            raise error from None

    def _apply(self, p: _Planned, out: StepOutput, version: int, epoch: int) -> None:
        running = set(map(id, self.running))
        generated = 0
        for i, (r, f, slot) in enumerate(zip(p.reqs, p.feeds, p.slots, strict=True)):
            if id(r) not in running or r.slot != slot:
                continue  # retracted or aborted while this step ran: its result is void
            if out.errors is not None and out.errors[i] is not None:
                status, why = out.errors[i]
                err = "BadRequestError" if status == 400 else "InternalServerError"
                self._finish(r, {"type": "abort", "message": why, "status_code": status, "err_type": err}, running=True)
                continue
            r.kv_len += len(f)
            if len(f) > 1 and r.kv_len >= len(r.input_ids):
                self.slot_prompt[slot] = r.prefix_key  # now a prefix source
                self.slot_kv_epoch[slot] = epoch
            if out.prompt[i] is not None:
                r.input_logprobs, r.input_top_logprobs = out.prompt[i]
            if r.params.max_new_tokens == 0:  # prompt scoring: the prompt's log-probs, no token
                self._finish(r, {"type": "length", "length": 0}, running=True)
                continue
            if not r.output_ids:
                r.first_token_at = time.time()
            r.output_ids.append(out.tokens[i])
            r.output_logprobs.append(out.logprobs[i])
            if out.top[i] is not None:
                r.output_top_logprobs.append(out.top[i])
            r.token_versions.append(version)
            generated += 1
            self._maybe_finish(r, out.tokens[i])
            if r.finish_reason is None and r.on_token is not None:
                r.on_token(r)
        self.stats.record_generated(generated)

    def _maybe_finish(self, req: Request, tok: int) -> None:
        p, n = req.params, len(req.output_ids)
        if n >= p.min_new_tokens and (tok in p.stop_token_ids or (not p.ignore_eos and tok in self.eos_token_ids)):
            self._finish(req, {"type": "stop", "matched": tok}, running=True)
        elif n >= p.min_new_tokens and req.stop_check is not None and (matched := req.stop_check(req)) is not None:
            self._finish(req, {"type": "stop", "matched": matched}, running=True)
        elif n >= p.max_new_tokens or len(req.seq) >= self.context_length:
            self._finish(req, {"type": "length", "length": n}, running=True)

    def _finish(self, req: Request, reason: dict, running: bool = False) -> None:
        """Under `_work`; running: the request is in `running` (it leaves, its slot is freed)."""
        if running:
            self.running.remove(req)
            self._release_slot(req)
        req.finish_reason = reason
        req.finished_at = time.time()
        self.stats.latency.observe(req)
        req.on_done(req)

    # ---- introspection ---------------------------------------------------------------------
    def snapshot(self) -> dict:
        with self._work:
            used = sum(r.kv_len for r in self.running)
            queued = len(self.waiting) + len(self._inbox)
            return {
                "num_running_reqs": len(self.running),
                "num_queue_reqs": queued,
                "num_paused_reqs": (len(self.running) + queued) if self.paused_mode else 0,
                "paused": self.paused_mode,
                "token_usage": used / (self.cache.num_slots * self.cache.max_len),
                "num_used_tokens": used,
                "max_total_num_tokens": self.cache.num_slots * self.cache.max_len,
                "weight_version": self.weight_version,
            }
