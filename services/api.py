"""The public plugin surface: plugin authors and tests import these names.

- Sample, SampleStatus: one trajectory; a group is a list[Sample] of length n.
- RunConfig: the run's config, built from flags by their snake_case names (RunConfig(**flags), any
  subset) and read by section (config.rollout.batch_size); FlatConfig(config) reads it flat by
  flag name (config.rollout_batch_size), as a plugin receives it.
- DataBuffer, DefaultDataBuffer: the buffer contract (put / get / get_metrics) and its default.
- DynamicFilterOutput, check_reward_nonzero_std: dynamic-sampling filter result and built-in filter.
- CheckpointEvalFn, EvalSkip: the external evaluator contract (--eval-function-path).
- DataSource: Miles's data source contract (--data-source-path).
"""

from asyncrl_proto.messages import Sample, SampleStatus
from services.buffer.core import DataBuffer, DefaultDataBuffer, DynamicFilterOutput, check_reward_nonzero_std
from services.common.config import FlatConfig, RunConfig
from services.data.source import DataSource
from services.eval.contract import CheckpointEvalFn, EvalSkip

__all__ = [
    "CheckpointEvalFn",
    "DataBuffer",
    "DataSource",
    "DefaultDataBuffer",
    "DynamicFilterOutput",
    "EvalSkip",
    "FlatConfig",
    "RunConfig",
    "Sample",
    "SampleStatus",
    "check_reward_nonzero_std",
]
