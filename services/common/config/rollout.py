from __future__ import annotations

from typing import NamedTuple

from pydantic import Field

from services.common.config.base import Section
from services.common.config.rm_types import rm_type_problem, split_rm_type


class EnvSpec(NamedTuple):
    """--env, parsed: `openenv:URL` or `nemogym:URL` (url), or `verifiers:MODULE:TASK` (module, task)."""

    scheme: str
    url: str = ""
    module: str = ""
    task: str = ""


def parse_env(spec: str) -> EnvSpec:
    """--env's value as an EnvSpec; ValueError says what shape it must have."""
    scheme, _, rest = spec.partition(":")
    if scheme == "openenv" and rest:
        return EnvSpec(scheme, url=rest)
    if scheme == "nemogym" and rest:
        if not rest.startswith(("http://", "https://")) or not rest.partition("://")[2].strip("/"):
            raise ValueError(f"--env {spec!r}: nemogym:URL takes the resources server's HTTP address, "
                             "e.g. nemogym:http://gym-host:8000")  # fmt: skip
        return EnvSpec(scheme, url=rest)
    module, _, task = rest.partition(":")
    if scheme == "verifiers" and module and task:
        return EnvSpec(scheme, module=module, task=task)
    raise ValueError(f"--env {spec!r}: use openenv:URL, nemogym:URL or verifiers:MODULE:TASK")


class RolloutSection(Section):
    """Generation and rewards (producers; the buffer reads B and n)."""

    batch_size: int = Field(
        16,
        ge=1,
        description="B: prompt groups per training step. Required on the command line (or in --config), as in "
        "Miles; the default only serves configs built in code.",
    )
    n_samples_per_prompt: int = Field(1, ge=1, description="n: trajectories per prompt group (GRPO wants several).")
    max_response_len: int = Field(8, ge=1, description="max_new_tokens of every generation.")
    temperature: float = Field(1.0, ge=0, description="Sampling temperature.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling p.")
    top_k: int = Field(-1, description="Top-k sampling (-1: whole vocabulary).")
    stop_token_ids: list[int] = Field(default_factory=list, description="Stop token ids in addition to EOS.")
    num_rollout: int | None = Field(None, ge=1, description="Training steps to run (a run needs this or --num-epoch).")
    num_epoch: int | None = Field(
        None, ge=1, description="Epochs over --prompt-data when --num-rollout is unset: (prompts // B) x this steps."
    )
    num_rollout_per_epoch: int | None = Field(
        None,
        ge=1,
        description="Steps per epoch (prompts // B), set by the launcher when --num-epoch gives the run's length: "
        "every epoch's last step is then also a save and eval point, as in Miles.",
    )
    rm_type: str | None = Field(
        None,
        description="Reward for the samples whose metadata names no rm_type: a task's (reverse-digits, copy-digits; "
        "the default: the task's own) or Miles's reward hub: remote_rm (with --rm-url), math, dapo (with "
        "--reward-key score), deepscaler, f1, gpqa, ifbench (pip install 'asyncrl[ifbench]'), random; boxed_<type> "
        "grades the last \\boxed{} answer.",
    )
    reward_key: str | None = Field(None, description="Key to read when a reward is a dict.")
    rm_url: str | None = Field(
        None,
        description="remote_rm: the reward model's URL; each sample is POSTed as JSON {prompt, response, label} and "
        "the JSON answer is its reward. A bearer token, if needed, comes from $ASYNCRL_RM_TOKEN.",
    )
    rm_max_concurrency: int = Field(32, ge=1, description="remote_rm: requests in flight per process at most.")
    rm_retries: int = Field(
        4, ge=0, description="remote_rm: retries of a request that failed to connect, timed out or got a 5xx answer."
    )
    reward_timeout_s: float = Field(
        30.0,
        gt=0,
        description="A built-in grader (math, dapo, deepscaler, f1, gpqa, ifbench) or a remote_rm request that runs "
        "longer fails its sample with the reason (a grader's worker process is killed).",
    )
    reward_num_workers: int = Field(
        2, ge=1, description="Worker processes per producer (and eval service) that run the built-in graders."
    )
    max_abs_reward: float = Field(
        1e6,
        gt=0,
        le=1e30,
        description="Rewards must lie in [-this, this]: a sample whose reward is outside fails (producer) or is "
        "rejected (buffer), so no accepted reward overflows the advantages or the loss.",
    )
    custom_rm_path: str | None = Field(
        None, description="module.fn: async fn(config, sample) -> float (group fn with --group-rm)."
    )
    group_rm: bool = Field(False, description="--custom-rm-path scores a whole group at once.")
    custom_generate_function_path: str | None = Field(
        None, description="module.fn: async fn(config, sample, engine, sampling_params)."
    )
    env: str | None = Field(
        None,
        description="An environment in the loop (services/envs): openenv:URL (an OpenEnv server, over its "
        "WebSocket session; pip install 'asyncrl[openenv]'), nemogym:URL (a NeMo Gym resources server: "
        "/seed_session, its tools as routes, /verify's reward) or verifiers:MODULE:TASK (a verifiers Task class, "
        "run by an in-process chat harness against the engine; pip install 'asyncrl[verifiers]'). The "
        "environment's reward is the sample's unless --rm-type or --custom-rm-path is given.",
    )
    env_max_turns: int = Field(8, ge=1, description="--env: the model's turns per episode at most.")
    env_max_sessions: int = Field(
        32,
        ge=1,
        description="--env openenv and nemogym: episodes one process keeps open at once (an OpenEnv server "
        "refuses sessions past its max_concurrent_envs: allow this times the producers and the eval service).",
    )
    env_action_key: str = Field(
        "message", description="--env openenv: the action field that carries the model's turn text."
    )
    env_observation_key: str | None = Field(
        None,
        description="--env openenv: the observation field shown to the model (unset: its one text field, else "
        "the observation as JSON).",
    )
    sglang_server_concurrency: int = Field(
        512,
        ge=1,
        description="Generate requests a producer keeps in flight per engine at most (Miles's per-server "
        "semaphore; through a router, this times --rollout-num-engines). Ours, never passed to SGLang.",
    )
    function_path: str | None = Field(
        None,
        description="Miles's custom rollout loop. Not supported: the producer owns the loop in every mode, so "
        "it is rejected with what to use instead (--custom-generate-function-path, --custom-rm-path).",
    )
    dynamic_sampling_filter_path: str | None = Field(
        None, description="module.fn: fn(config, group) -> DynamicFilterOutput | bool, applied at put."
    )
    sample_filter_path: str | None = Field(
        None, description="module.fn: fn(config, batch) marking remove_sample, applied per step."
    )
    over_sampling_batch_size: int | None = Field(
        None,
        ge=1,
        description="Sync and one-step drivers: release prompts in multiples of this (>= B) whenever fewer than "
        "the step's B groups are done or in flight, as Miles's rollout over-samples for dynamic filtering. "
        "Leftover groups are trained by the next step (Miles discards them). Unset: exactly what is missing.",
    )
    data_source_path: str | None = Field(
        None,
        description="module.Class: a services.api.DataSource subclass (Miles's get_samples(num_samples)) that "
        "replaces --prompt-data; it must give the same prompts in the same order from a fresh instance (needs "
        "--num-rollout).",
    )
    buffer_filter_path: str | None = Field(
        None,
        description="module.fn: fn(config, rollout_id, buffer, num_samples) -> list[list[Sample]] picks which "
        "recycled prompt group is released next (default: the oldest).",
    )
    all_samples_process_path: str | None = Field(
        None,
        description="module.fn: fn(config, all_samples, data_source) once per step with every group generated for "
        "it, those the dynamic filter dropped included (train and one-step train-async; data_source is None).",
    )
    custom_async_data_buffer_path: str | None = Field(
        None, description="module.Class: a DataBuffer subclass replacing the default buffer."
    )

    def problems(self) -> list[str]:
        errs = []
        if any(t < 0 for t in self.stop_token_ids):
            errs.append(f"--rollout-stop-token-ids must be token ids >= 0 (got {self.stop_token_ids})")
        if self.over_sampling_batch_size is not None and self.over_sampling_batch_size < self.batch_size:
            errs.append(
                f"--over-sampling-batch-size ({self.over_sampling_batch_size}) must be >= --rollout-batch-size "
                f"({self.batch_size})"
            )
        if self.top_k != -1 and self.top_k < 1:
            errs.append(f"--rollout-top-k must be -1 or >= 1 (got {self.top_k})")
        if self.env is not None:
            try:
                parse_env(self.env)
            except ValueError as e:
                errs.append(str(e))
        if self.env is not None and self.custom_generate_function_path:
            errs.append("--env and --custom-generate-function-path both produce the trajectories: give one")
        if self.rm_type is not None and not self.custom_rm_path:
            if (problem := rm_type_problem(self.rm_type, bool(self.rm_url))) is not None:
                errs.append(f"--{problem.replace('rm_type', 'rm-type', 1)}")
            elif split_rm_type(self.rm_type)[1] == "dapo" and self.reward_key != "score":
                errs.append(f"--rm-type {self.rm_type} scores {{score, acc}} (score +1 or -1, as DAPO): set "
                            "--reward-key score")  # fmt: skip
        return errs

    @property
    def env_spec(self) -> EnvSpec | None:
        """--env, parsed (None without one; the config's problems() refuses a malformed one)."""
        return parse_env(self.env) if self.env is not None else None

    @property
    def total_steps(self) -> int:
        if self.num_rollout is not None:
            return self.num_rollout
        return 150  # only a config built in code: the launcher refuses a run that names neither
