"""A reference CheckpointEvalFn: evaluate each snapshot on any server that speaks the SGLang
HTTP protocol (a real SGLang server, the SGLang router, or asyncrl's built-in engine).

    --eval-function-path services.eval.reference.SGLangServerEval
    ASYNCRL_EVAL_SERVER_URL=http://host:port   (the server to attach to)

Per snapshot: load it on the server (update_weights_from_disk, weight_version = str(step)),
read the version back (one retry, else an error: the point is recorded as `crashed`, as Miles's
evaluator fails), generate the held-out prompts and score them with the run's reward. A server
that is not healthy skips as "unhealthy".
"""

from __future__ import annotations

import os

from services.common.config.view import for_plugins
from services.common.sglang_client import SGLangClient
from services.eval.contract import CheckpointEvalFn, EvalSkip
from services.model.tokenizer import Tokenizer
from services.rewards import resolve_reward

SERVER_ENV = "ASYNCRL_EVAL_SERVER_URL"


class SGLangServerEval(CheckpointEvalFn):
    def __init__(self, config):
        super().__init__(config)
        self.url = os.environ.get(SERVER_ENV)
        if not self.url:
            raise ValueError(f"{type(self).__name__} needs {SERVER_ENV}=http://host:port: the server to evaluate on")
        self.tokenizer = Tokenizer(config.data.hf_checkpoint)
        self.reward_fn = resolve_reward(config)

    async def evaluate_checkpoint(self, checkpoint_dir: str, input: dict) -> dict[str, float]:  # noqa: A002
        from services.eval.service import evaluate_dataset

        client = SGLangClient([self.url])
        try:
            if not await client.health_generate(client.urls[0], timeout=30.0):
                raise EvalSkip("unhealthy")
            if not await client.pin(client.urls[0], checkpoint_dir, input["weight_version"]):
                raise RuntimeError(f"{client.urls[0]} did not take weight version {input['weight_version']} of "
                                   f"{checkpoint_dir}: its answers would not be this snapshot's")  # fmt: skip
            metrics: dict[str, float] = {}
            for name, rows in input["datasets"].items():
                settings = input.get("dataset_settings", {}).get(name, {})
                params = settings.get("sampling_params", input["sampling_params"])
                n = settings.get("n_samples_per_eval_prompt", input["n_samples_per_prompt"])
                metrics.update(await evaluate_dataset(client, self.tokenizer, self.reward_fn, for_plugins(self.config),
                                                      name, rows, params, n))  # fmt: skip
            return metrics
        finally:
            await client.close()
