"""The public plugin surface: plugin authors and tests import these names.

- Sample, SampleStatus: one trajectory; a group is a list[Sample] of length n.
- RunConfig: every flag under its snake_case name; RunConfig(**fields) with any subset.
- DataBuffer, DefaultDataBuffer: the buffer contract (put / get / get_metrics) and its default.
- DynamicFilterOutput, check_reward_nonzero_std: dynamic-sampling filter result and built-in filter.
- CheckpointEvalFn, EvalSkip: the external evaluator contract (--eval-function-path).
- DataSource: Miles's data source contract (--data-source-path).
"""

from asyncrl_proto.messages import Sample, SampleStatus
from services.buffer.core import (
    DataBuffer,
    DefaultDataBuffer,
    DynamicFilterOutput,
    check_reward_nonzero_std,
)
from services.common.config import RunConfig
from services.data.source import DataSource
from services.eval.contract import CheckpointEvalFn, EvalSkip

__all__ = [
    "CheckpointEvalFn",
    "DataBuffer",
    "DataSource",
    "DefaultDataBuffer",
    "DynamicFilterOutput",
    "EvalSkip",
    "RunConfig",
    "Sample",
    "SampleStatus",
    "check_reward_nonzero_std",
]
