"""The run configuration (services/common/config/run.py's RunConfig), one module per section;
loading it from defaults, a file, the environment and the command line is config_load.py."""

from services.common.config.async_ import AsyncSection
from services.common.config.base import ConfigError, Section
from services.common.config.data import DataSection
from services.common.config.eval import EvalSection
from services.common.config.infra import InfraSection
from services.common.config.multi_lora import MultiLoraSection, adapter_name_problem, adapter_pairs
from services.common.config.rollout import RolloutSection
from services.common.config.run import FLAGS, SECTION_NAMES, SECTIONS, RunConfig
from services.common.config.trainer import TrainerSection
from services.common.config.view import ConfigView, FlatConfig

__all__ = [
    "FLAGS", "SECTIONS", "SECTION_NAMES", "AsyncSection", "ConfigError", "ConfigView", "FlatConfig", "DataSection",
    "EvalSection", "InfraSection", "MultiLoraSection", "RolloutSection", "RunConfig", "Section", "TrainerSection",
    "adapter_name_problem", "adapter_pairs",
]  # fmt: skip
