from __future__ import annotations

from typing import Literal

from pydantic import Field

from services.common.config.base import Section


class TrainerSection(Section):
    """The trainer: backend, loss, optimizer, checkpoints."""

    train_backend: Literal["torch", "megatron"] = Field(
        "torch", description="Training backend: plain torch, or megatron-core's GPTModel (pip install megatron-core)."
    )
    num_ranks: int = Field(
        1, ge=1, description="Data-parallel trainer ranks (torch.distributed); rank 0 owns the bus and HTTP."
    )
    use_ray: bool = Field(
        False,
        description="Place the engines, producers and trainer ranks with a placement group over the Ray cluster at "
        "$RAY_ADDRESS (unset: a local one): the trainer's ranks on one node, the engines and producers on another "
        "when the cluster has two. Weights cannot go by disk: implies --update-weight-transfer-mode object-store "
        "(the run's object bucket) unless distributed (a broadcast from the trainer's node) is given.",
    )
    dist_backend: Literal["auto", "gloo", "nccl"] = Field(
        "auto", description="torch.distributed backend of the trainer ranks (auto: NCCL on GPU, gloo on CPU)."
    )
    global_batch_size: int | None = Field(
        None,
        ge=1,
        description="Samples per optimizer step: a rollout batch of B x n samples takes B x n / this optimizer "
        "steps (default: one step per rollout).",
    )
    num_steps_per_rollout: int | None = Field(
        None,
        ge=1,
        description="Optimizer steps per rollout batch: the same as --global-batch-size B x n / this.",
    )
    lr: float = Field(1e-3, gt=0, description="AdamW learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    adam_beta1: float = Field(0.9, ge=0, lt=1, description="AdamW beta1.")
    adam_beta2: float = Field(0.999, ge=0, lt=1, description="AdamW beta2.")
    clip_grad: float = Field(1.0, ge=0, description="Gradient norm clip (0 = off).")
    advantage_estimator: Literal["grpo"] = Field("grpo", description="Advantage estimator.")
    grpo_std_normalization: bool = Field(
        True, description="Divide group advantages by the group std (forced off when n == 1)."
    )
    eps_clip: float = Field(0.2, gt=0, description="PPO clip range (lower, and upper unless --eps-clip-high).")
    eps_clip_high: float | None = Field(None, gt=0, description="Upper PPO clip range.")
    use_rollout_logprobs: bool = Field(True, description="Importance ratios against the engine's behaviour log-probs.")
    keep_old_actor: bool = Field(
        False,
        description="Keep a copy of the weights the engines run (updated at every push) and, without "
        "--use-rollout-logprobs, take the PPO ratio against its log-probs instead of the trainer's own.",
    )
    use_tis: bool = Field(
        False, description="Truncated importance sampling: weight the loss by exp(logp_trainer - logp_engine), clipped."
    )
    tis_clip: float = Field(2.0, gt=0, description="Upper clip of the TIS weight.")
    tis_clip_low: float = Field(0.0, ge=0, description="Lower clip of the TIS weight.")
    tis_mode: Literal["truncate", "mask"] = Field(
        "truncate",
        description="truncate: clip the TIS weight to [--tis-clip-low, --tis-clip]; mask (masked importance sampling, "
        "IcePop's): keep the weight where it lies inside that range and leave every token outside it out of the loss "
        "(weight 0, still counted in the denominator). Mask wants a lower bound, e.g. --tis-clip-low 0.5.",
    )
    use_decoupled_ppo: bool = Field(
        False,
        description="Decoupled PPO (AReaL's): clip the ratio against the proximal policy (the trainer's weights "
        "before the rollout's first optimizer step) and weight each token by the behaviour ratio "
        "exp(logp_proximal - logp_engine), leaving out tokens whose weight exceeds --decoupled-ppo-weight-cap. "
        "Needs the engine's log-probs; replaces --use-tis.",
    )
    decoupled_ppo_weight_cap: float = Field(
        5.0, gt=1, description="Decoupled PPO: a token whose behaviour weight exceeds this is left out of the loss."
    )
    kl_coef: float = Field(0.0, ge=0, description="Weight of the KL penalty to the frozen initial policy (0 = off).")
    kl_loss_type: Literal["k1", "k2", "low_var_kl"] = Field("low_var_kl", description="KL estimator.")
    loss_aggregation: Literal["token", "sequence"] = Field(
        "token", description="token: mean over every loss token of the step; sequence: mean of per-sequence means."
    )
    use_dynamic_batch_size: bool = Field(
        True,
        description="Split each step into micro-batches of similar lengths, at most --max-tokens-per-gpu padded "
        "tokens each (same gradient, far less padding with long-tail lengths).",
    )
    max_tokens_per_gpu: int = Field(
        8192, ge=1, description="Padded tokens per micro-batch with --use-dynamic-batch-size."
    )
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus coefficient.")
    save: str | None = Field(None, description="Directory for training checkpoints.")
    save_interval: int | None = Field(
        None,
        ge=1,
        description="Save (--save checkpoint, --save-hf snapshot) after step r when (r + 1) % this == 0, at "
        "every epoch's end and after the last step. Unset: no save at all, as in Miles.",
    )
    save_trigger_sentinel: str | None = Field(
        None,
        description="A file path: when the file exists after a step, save then (as if due) and delete the file.",
    )
    load: str | None = Field(None, description="Resume from this checkpoint directory.")
    save_hf: str | None = Field(None, description="Directory for periodic HF snapshots.")
    keep_weight_snapshots: int = Field(
        3, ge=1, description="Weight snapshots kept on disk for the engines (older ones are deleted, but those "
        "the engines may still be loading); multi-LoRA: each adapter's versions likewise.",
    )
    keep_sample_records: int = Field(
        10_000, ge=0, description="Trained steps whose samples are kept in RUN_DIR/samples (prompt, response, "
        "reward, advantage, fate, each token span's weight version and loss mask; gzip, about 20 bytes a sample of "
        "the default job, long responses their compressed text) for the dashboard's lineage view; the oldest are "
        "deleted; 0 keeps none.",
    )
    custom_rollout_log_function_path: str | None = Field(
        None,
        description="module.fn: log_rollout_data(rollout_id, config, samples, extra_metrics, rollout_time) -> bool, "
        "called with each step's samples before the default logging; True skips the step's rollout/* and perf/* "
        "rollout metrics (metrics.jsonl keeps the step, its version and train/*).",
    )
    use_tensorboard: bool = Field(
        False,
        description="Also write the metrics as TensorBoard event files: $TENSORBOARD_DIR, else "
        "<run_dir>/tensorboard[/<--tb-project-name>[/<--tb-experiment-name>]] (pip install tensorboard).",
    )
    tb_project_name: str | None = Field(None, description="TensorBoard: a subdirectory for the project.")
    tb_experiment_name: str | None = Field(None, description="TensorBoard: a subdirectory for the experiment.")
    use_wandb: bool = Field(
        False,
        description="Also log the metrics to Weights & Biases (pip install wandb; the key from $WANDB_API_KEY).",
    )
    wandb_mode: Literal["online", "offline", "disabled"] | None = Field(
        None, description="W&B mode (default: $WANDB_MODE, else online); offline keeps everything local."
    )
    wandb_dir: str | None = Field(None, description="W&B files (default: the run directory).")
    wandb_project: str | None = Field(None, description="W&B project (default: asyncrl).")
    wandb_group: str | None = Field(None, description="W&B group.")
    wandb_team: str | None = Field(None, description="W&B entity (team).")
    wandb_run_id: str | None = Field(None, description="W&B run id, to resume a W&B run.")
    wandb_host: str | None = Field(None, description="W&B server URL (self-hosted).")

    @property
    def checkpoints_resume(self) -> bool:
        """A restarted trainer resumes from --save checkpoints (with the optimizer state), and the
        trainer commits a step only once it is checkpointed; otherwise it commits every pushed
        step and resumes from that weight snapshot."""
        return bool(self.save and self.save_interval)

    def problems(self) -> list[str]:
        errs = []
        if self.use_decoupled_ppo and self.use_tis:
            errs.append("--use-decoupled-ppo weights tokens by the behaviour ratio itself: drop --use-tis "
                        "(or --use-decoupled-ppo)")  # fmt: skip
        if self.tis_mode == "mask" and not self.use_tis:
            errs.append("--tis-mode mask sets how --use-tis weights tokens: add --use-tis")
        if self.tis_clip_low >= self.tis_clip:
            errs.append(f"--tis-clip-low ({self.tis_clip_low}) must be below --tis-clip ({self.tis_clip})")
        if self.save_interval is not None and not self.save:
            errs.append("--save-interval needs --save: set --save DIR for the checkpoints")
        if self.save_trigger_sentinel is not None and not self.save:
            errs.append("--save-trigger-sentinel needs --save: set --save DIR for the checkpoints")
        if self.keep_old_actor and (self.num_ranks > 1 or self.train_backend != "torch"):
            errs.append("--keep-old-actor runs on one trainer rank with --train-backend torch in this version")
        if self.train_backend == "megatron" and self.num_ranks > 1:
            errs.append(
                "--train-backend megatron runs one trainer rank in this version (tensor/pipeline parallel sizes 1): "
                "drop --trainer-num-ranks or use --train-backend torch for data parallelism"
            )
        return errs
