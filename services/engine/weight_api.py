"""The engine's weights, a component the scheduler holds (`Scheduler.weights`): staging a snapshot
beside the running weights, loading one (from disk, a staged copy, or tensors received from the
trainer) and naming the version. It uses the scheduler's thread hand-off (`call`, `call_chunked`)
and its locks: the torch work runs on the scheduler thread, between decode steps, never under the
lock a step takes (services.engine.scheduler)."""

from __future__ import annotations

import threading
import time

from services.common.snapshot import COMPLETE_MARKER, resolved
from services.model.hf_io import iter_stage_weights, load_weights_into, swap_in


class EngineWeights:
    """It owns the staged copy; the model, its version, the prefix-cache epoch and the work
    condition stay the scheduler's (a step reads them), changed only under its locks."""

    def __init__(self, scheduler):
        self.s = scheduler
        self._staged: tuple[tuple, dict] | None = None
        """The next weights, loaded beside the running ones: ((path, version, marker), tensors)."""
        self._stage_lock = threading.Lock()

    @staticmethod
    def _snapshot_key(model_path: str, weight_version) -> tuple:
        """What names one snapshot exactly: its resolved path, the version, and its marker's
        content (a snapshot rewritten under the same name has another digest)."""
        path = resolved(model_path)
        try:
            marker = (path / COMPLETE_MARKER).read_text() if path is not None else None
        except OSError:
            marker = None
        return (str(path), None if weight_version is None else str(weight_version), marker)

    def stage_weights(self, model_path: str, weight_version) -> float:
        """Load a snapshot beside the running weights while generation goes on (no lock the
        forward pass takes); the next update_weights_from_disk of the same snapshot then only
        swaps it in. Returns the seconds it took. One staged version at a time (the newest)."""
        s = self.s
        with self._stage_lock:
            t0 = time.perf_counter()
            key = self._snapshot_key(model_path, weight_version)
            tensors = s.call_chunked(iter_stage_weights, s.model, model_path)
            with s._work:
                self._staged = (key, tensors)
            s.stats.weight_stage_duration_s = time.perf_counter() - t0
            return s.stats.weight_stage_duration_s

    def update_weights_from_disk(self, model_path: str, weight_version: str | None, timeout_s: float = 600) -> dict:
        """Load a snapshot in place: a staged one (stage_weights) is swapped in, anything else is
        read now. Paused: at once (after the step in flight). Not paused: after in-flight requests
        finish, as SGLang's writer lock does."""
        s = self.s
        with s._work:
            self._wait_quiet(timeout_s)
            staged, self._staged = self._staged, None
        if staged is not None and staged[0] == self._snapshot_key(model_path, weight_version):
            s.stats.num_staged_swaps_total += 1
            return s.call(self._load, lambda: swap_in(s.model, staged[1]), weight_version) | {"staged": True}
        staged = None  # a staged copy of another snapshot (a whole model) is freed before the read
        return s.call(self._load, lambda: load_weights_into(s.model, model_path), weight_version) | {"staged": False}

    def update_weights_from_tensors(self, tensors: dict, weight_version: str | None, timeout_s: float = 600) -> dict:
        """Swap in a whole set of weights received from the trainer (distributed mode): new
        tensors matching the model's parameters; waits for in-flight work as update_weights_from_disk."""
        with self.s._work:
            self._wait_quiet(timeout_s)
        return self.s.call(self._load, lambda: swap_in(self.s.model, tensors), weight_version)

    def _wait_quiet(self, timeout_s: float) -> None:
        """Under `_work`: return once paused, or once no request is in flight (SGLang's writer lock)."""
        s = self.s
        if not s._work.wait_for(lambda: s.paused_mode or not (s.running or s.waiting or s._inbox),
                                timeout_s):  # fmt: skip
            raise TimeoutError("in-flight requests did not finish; pause generation first")

    def _load(self, load, weight_version) -> dict:
        s = self.s
        with s._model_lock:
            t0 = time.perf_counter()
            load()
            s.stats.weight_load_duration_s = time.perf_counter() - t0
            with s._work:
                s.kv_epoch += 1  # every cached prefix was computed with the old weights
                if weight_version is not None:
                    s.weight_version = str(weight_version)
                return {"num_paused_requests": len(s.running) + len(s.waiting)}

    def set_weight_version(self, version: str) -> None:
        with self.s._model_lock, self.s._work:
            self.s.weight_version = str(version)
