"""Multi-LoRA producers: what a prompt of an adapter's partition is generated with.

A prompt on `prompts.<registration>` names an adapter registration. The producer generates it
with that adapter's live version on the engines (KV `adapter_live.<name>`, written by
weight-sync: `lora_path` is its engine name) and scores it with that adapter's reward (its spec's
`rm_type` or `custom_rm_path`, from the registry's KV `adapters`). Every sample is stamped with
the adapter version it was generated under (its `weight_versions`), the clock its partition
judges staleness by.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable

from asyncrl_proto import AdapterLive, AdapterRegistryState, PromptMsg
from asyncrl_proto.messages import AdapterRun, AdapterState, flatten_group
from asyncrl_proto.subjects import ADAPTER_LIVE_KV_PREFIX, ADAPTERS_KV_KEY
from services.rewards import reward_function
from services.rollout.modes import GroupContext, PromptError, Refuse, Requeue

log = logging.getLogger(__name__)

REREAD_S = 0.5
"""A registration not known yet is read again at most this often."""
MAX_NOT_YET_DELIVERIES = 240
"""A prompt whose adapter is not on the engines after this many deliveries (0.5 s apart: two
minutes) settles as a FAILED group rather than coming back forever."""
ADAPTER_RETRY_MAX_S = 2.0
"""The longest a prompt waits before it is tried again while its engine lacks the live adapter."""
ADAPTER_WARN_EVERY = 20
"""A warning each time such a prompt has come back this many more times."""


def rid_of(msg) -> str:
    """The adapter registration of a multi-LoRA prompt: the last token of its subject (prompts.<registration>)."""
    return msg.subject.rsplit(".", 1)[-1]


class NotYet(Exception):
    """The adapter has no version on the engines yet (its trainer is setting it up): try later."""


class Closed(Exception):
    """The registration is not open (retired, or never registered)."""


@dataclasses.dataclass
class AdapterContext(GroupContext):
    """A group of one adapter: generated through its live version, every sample stamped with it."""

    version: int = 0

    def finish(self, group: list) -> None:
        for s in flatten_group(group):  # generated under that adapter version, whatever the base's
            s.weight_versions = [self.version]
            spans: list[list[int]] = []
            for a, b, _ in s.version_spans:  # the same tokens, under the adapter's version
                if spans and spans[-1][1] == a:
                    spans[-1][1] = b
                else:
                    spans.append([a, b, self.version])
            s.version_spans = spans


class AdapterMode:
    """Multi-LoRA: a prompt on `prompts.<registration>` is generated with that adapter's live
    version and reward, in a group of its adapter's size (which the buffer writes into the
    prompt, at most the run's --n-samples-per-prompt: the producers' credit unit), and published
    to `rollouts.<registration>`."""

    partitioned = True

    def __init__(self, config, bus, engine, counters: dict[str, int]):
        self.n = config.rollout.n_samples_per_prompt
        self.bus = bus
        self.config = config
        self.engine = engine
        self.counters = counters
        self.runs: dict[str, AdapterRun] = {}
        self._read_at = 0.0
        self._rewards: dict[str, Callable] = {}

    def group_size(self, prompt: PromptMsg) -> int:
        return prompt.n_samples if 1 <= prompt.n_samples <= self.n else self.n

    def check(self, prompt: PromptMsg) -> None:
        if not 1 <= prompt.n_samples <= self.n:
            raise PromptError(f"n_samples {prompt.n_samples} is outside 1..{self.n} (--n-samples-per-prompt, "
                              "the largest adapter group of this run)")  # fmt: skip

    async def run(self, rid: str) -> AdapterRun:
        stale = rid not in self.runs or self.runs[rid].state is not AdapterState.ACTIVE
        if stale and time.monotonic() - self._read_at >= REREAD_S:
            self._read_at = time.monotonic()
            if (state := await self.bus.kv_get(ADAPTERS_KV_KEY, AdapterRegistryState)) is not None:
                self.runs = {r.registration_id: r for r in state.runs}
        run = self.runs.get(rid)
        if run is None:  # the buffer releases prompts of registrations the registry holds: read it again soon
            raise NotYet(f"adapter registration {rid[:64]!r} is not in the registry read here yet")
        if run.state is AdapterState.COMPLETED:
            raise Closed(f"adapter registration {rid[:64]!r} is completed")
        return run

    async def context(self, msg, prompt: PromptMsg) -> GroupContext:
        rid = rid_of(msg)
        try:
            run = await self.run(rid)
            # the adapter version every engine serves now (read for every group: weight-sync
            # unloads a version soon after the next is live)
            live = await self.bus.kv_get(f"{ADAPTER_LIVE_KV_PREFIX}.{run.name}", AdapterLive)
            if live is None or live.registration_id != run.registration_id:
                raise NotYet(f"adapter {run.name!r} has no version on the engines yet")
            if prompt.n_samples != run.spec.n_samples_per_prompt:
                raise Closed(f"n_samples {prompt.n_samples} differs from the adapter's {run.spec.n_samples_per_prompt}")
            if (reward := self._rewards.get(rid)) is None:  # one per registration (rid is run.registration_id)
                reward = self._rewards[rid] = reward_function(self.config, run.spec.rm_type, run.spec.custom_rm_path)
        except NotYet as e:
            if msg.metadata.num_delivered < MAX_NOT_YET_DELIVERIES:
                raise Requeue(str(e), 0.5) from None
            raise Refuse(f"{e} after {msg.metadata.num_delivered} deliveries") from None
        except (Closed, ValueError) as e:  # ValueError: a reward that does not resolve
            raise Refuse(str(e)) from None
        except Exception as e:  # the broker away, a reward module that fails to import: later
            log.warning("prompt of adapter registration %s: %s; it goes back to the queue", rid[:64], e)
            raise Requeue(str(e), 1.0) from None
        return AdapterContext(self.engine.with_fields(lora_path=live.engine_name), reward, version=live.version)

    def destination(self, msg, gid: str) -> tuple[str, str]:
        rid = rid_of(msg)
        return self.bus.subjects.of(rid).rollouts, f"{rid}-{gid}"

    async def requeue_after(self, msg, error: Exception) -> float | None:
        """The engine lacks the adapter version KV `adapter_live` names (replaced meanwhile, or an
        engine restarted and not reloaded yet): the prompt goes back to the queue, later each time
        it comes back (up to ADAPTER_RETRY_MAX_S), with a warning every ADAPTER_WARN_EVERY
        deliveries so an engine that never gets it is seen, not a silent loop."""
        if "no LoRA adapter" not in str(error):
            return None
        n = msg.metadata.num_delivered
        self.counters["adapter_not_loaded_requeued"] += 1
        if n % ADAPTER_WARN_EVERY == 0:
            log.warning("a prompt of adapter registration %s came back %d times: its engine lacks the live "
                        "adapter (%s); is weight-sync running? (see /status adapter_not_loaded_requeued)",
                        rid_of(msg)[:64], n, str(error)[:200])  # fmt: skip
        return min(ADAPTER_RETRY_MAX_S, 0.1 * n)
