"""The run configuration, one module per job:

- ``base``: ``ConfigError``, the strict ``Section`` base every section model extends, and
  ``PartSection``, the base of the sections that name a part (``name`` and ``options``);
- ``model``, ``data``, ``generation``, ``rewards``, ``environment``, ``algorithm``, ``trainer``, ``control``,
  ``outputs``: the sections, each with the checks that stay inside it;
- ``root``: ``RunConfig``, one field per section; ``checks``: the checks that span sections;
  ``derived``: defaults that depend on another section and the effective settings (``auto``
  resolved);
- ``loading``: YAML, dotted overrides and validation (``load_config``); ``safe_yaml``: the YAML
  reader's limits; ``messages``: one-line errors; ``moved``: keys of an earlier layout;
  ``reference``: docs/configuration.md.

Every problem is reported at load time as a one-line ``ConfigError`` that names the field. Nothing
here imports torch, so ``asyncrl config`` stays fast.
"""

from asyncrl.config.algorithm import AlgorithmConfig, StepConfig
from asyncrl.config.base import ConfigError, Section
from asyncrl.config.control import RuntimeConfig, SamplerConfig, SyncConfig
from asyncrl.config.data import DataConfig, TaskConfig
from asyncrl.config.environment import EnvironmentConfig
from asyncrl.config.generation import MIN_TEMPERATURE, BackendConfig, GenerationConfig
from asyncrl.config.integrity import PROMISES, IntegrityConfig
from asyncrl.config.loading import config_from_dict, dump_config, load_config, parse_options
from asyncrl.config.lora import LoraConfig
from asyncrl.config.model import ModelConfig, TokenizerConfig
from asyncrl.config.outputs import CheckpointConfig, FaultsConfig, LoggingConfig
from asyncrl.config.reference import config_keys, config_reference
from asyncrl.config.rewards import RewardConfig
from asyncrl.config.root import RunConfig
from asyncrl.config.trainer import AggMode, ParallelConfig, TrainerConfig, WarmStartConfig

__all__ = [
    "MIN_TEMPERATURE",
    "PROMISES",
    "AggMode",
    "AlgorithmConfig",
    "CheckpointConfig",
    "ConfigError",
    "DataConfig",
    "TaskConfig",
    "EnvironmentConfig",
    "FaultsConfig",
    "GenerationConfig",
    "BackendConfig",
    "IntegrityConfig",
    "LoggingConfig",
    "LoraConfig",
    "ModelConfig",
    "ParallelConfig",
    "RewardConfig",
    "RunConfig",
    "RuntimeConfig",
    "SamplerConfig",
    "Section",
    "StepConfig",
    "SyncConfig",
    "TokenizerConfig",
    "TrainerConfig",
    "WarmStartConfig",
    "config_from_dict",
    "config_keys",
    "config_reference",
    "dump_config",
    "load_config",
    "parse_options",
]
