from __future__ import annotations

import json
from typing import Literal

from pydantic import Field

from services.common.config.base import Section


class DataSection(Section):
    """The model and the prompts (launcher, buffer, producers, trainer)."""

    task: Literal["reverse-digits", "reverse-longtail", "reasoning-gym", "calculator"] = Field(
        "reverse-digits",
        description="Bundled verifiable task: supplies prompts, held-out prompts and the reward "
        "when --prompt-data / --rm-type are not given, and the tiny model when --hf-checkpoint is unset. "
        "reasoning-gym: one of its procedural datasets (--rg-dataset; pip install 'asyncrl[reasoning]'). "
        "calculator: sums the model may answer through a calculator call (tool use; "
        "deploy/configs/calculator.yaml). reverse-longtail: reverse-digits with one prompt in ten from a Pareto "
        "tail of 16-192 digits, where a batch waits for its slowest answer (deploy/configs/longtail.yaml).",
    )
    rg_dataset: str = Field(
        "spell_backward", description="--task reasoning-gym: the dataset whose generator makes the prompts."
    )
    rg_config: str | None = Field(
        None,
        description='--task reasoning-gym: the dataset\'s settings as a JSON object, e.g. \'{"max_word_len": 5}\'.',
    )
    rg_scoring: Literal["dataset", "exact"] = Field(
        "dataset",
        description="--task reasoning-gym: dataset: the dataset's own score_answer, partial credit and all; "
        "exact: 1 where that scorer gives full marks, else 0 (a scorer whose partial credit pays for text after "
        "the answer, as spell_backward's does, then cannot be gamed).",
    )
    rg_size: int = Field(20_000, ge=1, description="--task reasoning-gym: training prompts (seed --rollout-seed).")
    rg_eval_size: int = Field(
        256, ge=1, description="--task reasoning-gym: held-out prompts, from a disjoint seed, none also in training."
    )
    hf_checkpoint: str | None = Field(
        None,
        description="Hugging Face model directory (config, safetensors, tokenizer). Unset: build the "
        "task's tiny model locally, no download.",
    )
    warmup_sft_steps: int = Field(
        20,
        ge=0,
        description="Supervised warm-start steps applied when the tiny model is built (0 = none); the "
        "held-out reward after it is reported as step 0.",
    )
    prompt_data: str | None = Field(
        None, description="Prompts: a JSONL file (one JSON object a line) or a Parquet file (.parquet)."
    )
    input_key: str = Field("prompt", description="Key (JSONL) or column (Parquet) of the prompt.")
    label_key: str | None = Field("label", description="Key or column of the label.")
    metadata_key: str | None = Field(
        "metadata", description="Key or column of per-prompt metadata (an object; its rm_type picks the reward)."
    )
    tool_key: str | None = Field(
        None,
        description="Key or column of a row's tool schemas (a list of function specs), passed to the chat template "
        "as `tools`, as Miles does (with --apply-chat-template).",
    )
    apply_chat_template: bool = Field(False, description="Format prompts with the tokenizer's chat template.")
    rollout_shuffle: bool = Field(False, description="Shuffle prompts every epoch.")
    rollout_seed: int = Field(42, ge=0, description="Seed for prompt shuffling and sampling.")
    seed: int = Field(1234, ge=0, description="Seed for model init and the trainer.")

    def problems(self) -> list[str]:
        if self.rg_config is None:
            return []
        try:
            problem = None if isinstance(json.loads(self.rg_config), dict) else "not a JSON object"
        except ValueError as e:
            problem = f"not JSON ({e})"
        return [f"--rg-config {self.rg_config!r:.80}: {problem}; e.g. '{{\"max_word_len\": 5}}'"] if problem else []

    @property
    def rg_options(self) -> dict:
        return json.loads(self.rg_config) if self.rg_config else {}
