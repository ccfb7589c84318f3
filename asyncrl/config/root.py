"""``RunConfig``: one field per section. A new section is a module of its own and one field here;
loading, overrides, the checks on keys and the reference page find it through this model."""

from __future__ import annotations

from pydantic import Field, model_validator

from asyncrl.config.algorithm import AlgorithmConfig, StepConfig
from asyncrl.config.base import Section, Seed
from asyncrl.config.checks import CROSS_FIELD_CHECKS
from asyncrl.config.control import RuntimeConfig, SamplerConfig, SyncConfig
from asyncrl.config.data import DataConfig
from asyncrl.config.derived import DerivedSettings, fill_defaults
from asyncrl.config.environment import EnvironmentConfig
from asyncrl.config.generation import GenerationConfig
from asyncrl.config.integrity import IntegrityConfig
from asyncrl.config.lora import LoraConfig
from asyncrl.config.model import ModelConfig, TokenizerConfig
from asyncrl.config.outputs import CheckpointConfig, FaultsConfig, LoggingConfig
from asyncrl.config.rewards import RewardConfig
from asyncrl.config.trainer import ParallelConfig, TrainerConfig, WarmStartConfig


class RunConfig(Section, DerivedSettings):
    """One asyncrl run."""

    seed: Seed = Field(0, description="run seed: sampling seeds derive from it, the prompt uid and the sample index")
    model: ModelConfig = Field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    rewards: RewardConfig = Field(default_factory=RewardConfig)
    environment: EnvironmentConfig = Field(default_factory=EnvironmentConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    step: StepConfig = Field(default_factory=StepConfig)
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    parallel: ParallelConfig = Field(default_factory=ParallelConfig)
    sync: SyncConfig = Field(default_factory=SyncConfig)
    warm_start: WarmStartConfig = Field(default_factory=WarmStartConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    integrity: IntegrityConfig = Field(default_factory=IntegrityConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    faults: FaultsConfig = Field(default_factory=FaultsConfig)

    @model_validator(mode="after")
    def _across_sections(self) -> RunConfig:
        """The defaults that depend on another section, then every check that spans sections."""
        fill_defaults(self)
        for check in CROSS_FIELD_CHECKS:
            check(self)
        return self
