"""`--rm-type remote_rm`: a reward model behind HTTP, as Miles calls it. One POST per sample to
--rm-url with the JSON body {"prompt", "response", "label"}; the JSON answer is the reward (a
number, or a dict read with --reward-key).

- At most --rm-max-concurrency requests in flight per process (and event loop); a connection per
  request, as Miles opens one.
- A connection error, a timeout (--reward-timeout-s) or a 5xx answer is retried with exponential
  backoff, --rm-retries times; then the sample is FAILED with the reason. A 4xx answer is final.
- A bearer token, when the server wants one, comes from the environment ($ASYNCRL_RM_TOKEN),
  never from a flag: it is not on a command line, in the stored config or in a log.
"""

from __future__ import annotations

import asyncio
import os
import random
import weakref
from typing import Any

import aiohttp

from services.common.secrets import RM_TOKEN_ENV


class RewardModelError(RuntimeError):
    """The reward model gave no usable answer for a sample (the sample is FAILED with this)."""


_limits: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""Per event loop: {concurrency: semaphore}, shared by every RemoteRewardModel on that loop."""


class RemoteRewardModel:
    def __init__(self, url: str, timeout_s: float, concurrency: int, retries: int):
        self.url = url
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        self.concurrency = concurrency
        self.retries = retries
        token = os.environ.get(RM_TOKEN_ENV)
        self.headers = {"Authorization": f"Bearer {token}"} if token else {}

    async def score(self, prompt: Any, response: str, label: Any) -> Any:
        body = {"prompt": prompt, "response": response, "label": label}
        limit = _limits.setdefault(asyncio.get_running_loop(), {}).setdefault(
            self.concurrency, asyncio.Semaphore(self.concurrency))  # fmt: skip
        problem = ""
        async with limit:
            for attempt in range(self.retries + 1):
                if attempt:
                    await asyncio.sleep(min(0.25 * 2**attempt, 8.0) * random.uniform(0.5, 1.0))
                try:
                    async with (
                        aiohttp.ClientSession(timeout=self.timeout, headers=self.headers) as session,
                        session.post(self.url, json=body) as resp,
                    ):
                        if resp.status >= 500:
                            problem = f"HTTP {resp.status}"
                            continue
                        if resp.status >= 400:
                            raise RewardModelError(f"the reward model at {self.url} answered HTTP {resp.status}: "
                                                   f"{(await resp.text())[:200]}")  # fmt: skip
                        try:
                            return await resp.json(content_type=None)
                        except ValueError as e:
                            raise RewardModelError(f"the reward model at {self.url} answered no JSON ({e})") from None
                except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, TimeoutError) as e:
                    problem = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
        raise RewardModelError(f"the reward model at {self.url} failed {self.retries + 1} time(s); last: {problem}")
