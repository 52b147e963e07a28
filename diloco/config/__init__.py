"""Typed run configuration: presets, files (TOML or JSON) and `key=value` overrides.

Every config is a frozen pydantic model that forbids unknown fields, so a typo or a
wrong value fails at load time with the dotted name of the field
(``config field 'outer.lr': Input should be greater than 0``). One module per part:
``run`` (the run's sections, ``RunConfig`` and loading), ``model``, ``pipeline`` (a
launch's settings and liveness), ``sim`` (the simulator's), ``presets``, ``base``.
"""

from diloco.config.base import ArchName, ConfigError, Fraction, PositiveFloat, PositiveInt
from diloco.config.cost import CostConfig
from diloco.config.model import LLAMA_FIELDS, ModelConfig
from diloco.config.pipeline import LivenessConfig, PipelineConfig
from diloco.config.presets import PRESETS
from diloco.config.run import (
    BudgetConfig,
    DataConfig,
    InnerConfig,
    MergeName,
    OuterConfig,
    QuantName,
    RunConfig,
    StalenessName,
    TopologyConfig,
    deep_merge,
    load_config,
    parse_override,
    read_config_file,
    validate_config,
)
from diloco.config.sim import Failure, Join, SimConfig, sim_events

__all__ = [
    "LLAMA_FIELDS",
    "PRESETS",
    "ArchName",
    "BudgetConfig",
    "ConfigError",
    "CostConfig",
    "DataConfig",
    "Failure",
    "Fraction",
    "InnerConfig",
    "Join",
    "LivenessConfig",
    "MergeName",
    "ModelConfig",
    "OuterConfig",
    "PipelineConfig",
    "PositiveFloat",
    "PositiveInt",
    "QuantName",
    "RunConfig",
    "SimConfig",
    "StalenessName",
    "TopologyConfig",
    "deep_merge",
    "load_config",
    "parse_override",
    "read_config_file",
    "sim_events",
    "validate_config",
]
