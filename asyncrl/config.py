"""The run configuration: pydantic models, YAML loading, dotted overrides, cross-field checks.

Every problem is reported as a one-line ``ConfigError`` that names the field, at load time, so a
run never starts with a configuration that would deadlock or silently mean something else.
"""

from __future__ import annotations

import difflib
import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


class ConfigError(ValueError):
    """A configuration problem, always a single line naming the offending field."""


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class ModelConfig(Section):
    path: str | None = Field(None, description="local HF causal LM directory; None builds the tiny model")
    arch: Literal["qwen2", "llama"] = "qwen2"
    hidden_size: int = Field(192, ge=8)
    num_layers: int = Field(4, ge=1)
    num_heads: int = Field(6, ge=1)
    num_kv_heads: int = Field(2, ge=1)
    intermediate_size: int = Field(512, ge=8)
    init_seed: int = 0

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"model.num_heads: {self.num_heads} does not divide hidden_size {self.hidden_size}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model.num_kv_heads: {self.num_kv_heads} does not divide num_heads {self.num_heads}")
        return self


class TokenizerConfig(Section):
    path: str | None = Field(None, description="local HF tokenizer directory; None builds the char tokenizer")


class DataConfig(Section):
    task: str = Field("arithmetic", description="built-in task name, or 'jsonl' / 'parquet' for a local file")
    path: str | None = None
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    chat_template: bool = False
    difficulty: int = Field(1, ge=1)
    shuffle_seed: int = 0


class GenerationConfig(Section):
    backend: Literal["hf"] = "hf"
    max_new_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    top_k: int = Field(0, ge=0, description="0 disables top-k")
    batch_size: int = Field(64, ge=1, description="sequences per generation forward")


class RewardConfig(Section):
    functions: list[str] = Field(default_factory=lambda: ["exact_match"])
    weights: list[float] | None = None
    timeout_s: float = Field(5.0, gt=0.0)

    @model_validator(mode="after")
    def _weights_match(self) -> RewardConfig:
        if self.weights is not None and len(self.weights) != len(self.functions):
            raise ValueError(f"rewards.weights: {len(self.weights)} weights for {len(self.functions)} functions")
        return self


class GRPOConfig(Section):
    prompts_per_step: int = Field(8, ge=1, description="P: prompt groups per optimizer step")
    generations_per_prompt: int = Field(8, ge=1, description="n: samples per prompt")
    step_batch_size: int | None = Field(None, ge=1, description="sequences per step; must equal P*n if given")
    max_steps: int = Field(100, ge=1)
    baseline: Literal["mean", "leave_one_out"] = "mean"
    scale_by_std: bool = True
    filter_zero_variance: bool = False
    min_groups_per_chunk: int = Field(1, ge=1, description="stream a step in chunks of at least this many groups")

    @model_validator(mode="after")
    def _batch_size_consistent(self) -> GRPOConfig:
        expected = self.prompts_per_step * self.generations_per_prompt
        if self.step_batch_size is not None and self.step_batch_size != expected:
            raise ValueError(
                f"grpo.step_batch_size: {self.step_batch_size} != prompts_per_step * generations_per_prompt "
                f"= {self.prompts_per_step} * {self.generations_per_prompt} = {expected}"
            )
        if self.baseline == "leave_one_out" and self.generations_per_prompt < 2:
            raise ValueError("grpo.baseline: leave_one_out needs generations_per_prompt >= 2")
        if self.min_groups_per_chunk > self.prompts_per_step:
            raise ValueError(
                f"grpo.min_groups_per_chunk: {self.min_groups_per_chunk} > prompts_per_step {self.prompts_per_step}"
            )
        return self


class LossConfig(Section):
    mode: AggMode = "token-mean"
    norm_constant: float | None = Field(None, gt=0.0, description="C for seq-mean-token-sum-norm")
    clip_low: float = Field(0.2, ge=0.0, lt=1.0)
    clip_high: float = Field(0.28, ge=0.0)
    dual_clip: float | None = Field(3.0, gt=1.0)
    importance_sampling: Literal["auto", "none", "tis", "icepop"] = Field(
        "auto", description="auto: tis whenever the sampler can admit lagged data, else none"
    )
    is_cap: float = Field(2.0, gt=0.0)
    is_low: float = Field(0.5, ge=0.0)
    is_high: float = Field(2.0, gt=0.0)
    kl_coef: float = Field(0.0, ge=0.0)
    kl_log_ratio_clamp: float = Field(20.0, gt=0.0)
    kl_clamp: float = Field(10.0, gt=0.0)
    entropy_coef: float = Field(0.0, ge=0.0)
    track_entropy: bool = Field(True, description="report policy entropy even when entropy_coef is 0")

    @model_validator(mode="after")
    def _mode_constants(self) -> LossConfig:
        if self.mode == "seq-mean-token-sum-norm" and self.norm_constant is None:
            raise ValueError("loss.norm_constant: required when loss.mode is seq-mean-token-sum-norm")
        if self.is_low >= self.is_high:
            raise ValueError(f"loss.is_low: {self.is_low} must be below loss.is_high {self.is_high}")
        return self


class SamplerConfig(Section):
    name: str = Field("in_order", description="in_order, weight_fifo, windowed, or module:Class")
    max_lag: int = Field(1, ge=0, description="how many weight versions behind trained data may be")
    buffer_capacity: int | None = Field(None, ge=1, description="groups; None: the sampler's required capacity")


class TrainerConfig(Section):
    optimizer: Literal["adamw"] = "adamw"
    lr: float = Field(1e-4, gt=0.0)
    weight_decay: float = Field(0.0, ge=0.0)
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0.0)
    lr_schedule: Literal["constant", "cosine"] = "constant"
    warmup_steps: int = Field(0, ge=0)
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="cosine floor as a fraction of lr")
    micro_batch_size: int = Field(16, ge=1, description="sequences per forward/backward")
    max_grad_norm: float | None = Field(1.0, gt=0.0, description="None disables clipping")
    dtype: Literal["float32", "bfloat16", "float64"] = "float32"
    device: Literal["auto", "cpu", "cuda"] = "auto"

    @model_validator(mode="after")
    def _betas_in_range(self) -> TrainerConfig:
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"trainer.betas: {list(self.betas)} must each be in [0, 1)")
        return self


class RuntimeConfig(Section):
    name: Literal["local", "ray"] = "local"
    max_inflight_groups: int | None = Field(None, ge=1, description="None: bounded by buffer capacity only")


class CheckpointConfig(Section):
    every_steps: int | None = Field(None, ge=1, description="None: only at the end")
    keep_last: int = Field(2, ge=1)


class LoggingConfig(Section):
    output_dir: str = "runs/latest"
    eval_every_steps: int | None = Field(10, ge=1)
    tensorboard: bool = True
    wandb: bool = False
    progress: bool = True


class RunConfig(Section):
    seed: int = 0
    model: ModelConfig = Field(default_factory=ModelConfig)
    tokenizer: TokenizerConfig = Field(default_factory=TokenizerConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    rewards: RewardConfig = Field(default_factory=RewardConfig)
    grpo: GRPOConfig = Field(default_factory=GRPOConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    sampler: SamplerConfig = Field(default_factory=SamplerConfig)
    trainer: TrainerConfig = Field(default_factory=TrainerConfig)
    runtime: RuntimeConfig = Field(default_factory=RuntimeConfig)
    checkpoint: CheckpointConfig = Field(default_factory=CheckpointConfig)
    logging: LoggingConfig = Field(default_factory=LoggingConfig)

    @model_validator(mode="after")
    def _sampler_capacity(self) -> RunConfig:
        sampler = self._sampler()
        required = sampler.required_capacity(self.grpo.prompts_per_step)
        capacity = self.sampler.buffer_capacity
        if capacity is not None and capacity < required:
            why = "prompts_per_step * (max_lag + 1) for a gated sampler; less would deadlock"
            raise ValueError(
                f"sampler.buffer_capacity: {capacity} < {required} groups required by sampler "
                f"'{self.sampler.name}' ({why if sampler.gated else 'one step of groups'})"
            )
        return self

    def _sampler(self):
        from asyncrl.sampler import build_sampler

        return build_sampler(self.sampler.name, self.grpo.prompts_per_step, self.sampler.max_lag)

    @property
    def buffer_capacity(self) -> int:
        """The configured capacity, or the sampler's minimum when none is given."""
        if self.sampler.buffer_capacity is not None:
            return self.sampler.buffer_capacity
        return self._sampler().required_capacity(self.grpo.prompts_per_step)

    @property
    def importance_sampling(self) -> str:
        """The effective importance-sampling mode (``auto`` resolved against the sampler's lag)."""
        if self.loss.importance_sampling != "auto":
            return self.loss.importance_sampling
        return "tis" if self.sampler.max_lag > 0 else "none"


def _unknown_key_error(path: tuple[str, ...], key: str, valid: list[str]) -> ConfigError:
    dotted = ".".join((*path, key))
    close = difflib.get_close_matches(key, valid, n=1, cutoff=0.5)
    hint = f" (did you mean '{'.'.join((*path, close[0]))}'?)" if close else f" (valid keys: {', '.join(valid)})"
    return ConfigError(f"{dotted}: unknown key{hint}")


def _check_keys(model: type[BaseModel], data: Any, path: tuple[str, ...] = ()) -> None:
    """Reject unknown keys anywhere in the tree, suggesting the closest valid one."""
    if not isinstance(data, dict):
        return
    fields = model.model_fields
    for key, value in data.items():
        if key not in fields:
            raise _unknown_key_error(path, str(key), list(fields))
        annotation = fields[key].annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            _check_keys(annotation, value, (*path, key))


_NAMES_ITS_FIELD = re.compile(r"^[a-z_]+(\.[a-z_]+)+: ")


def _format_validation_error(err: ValidationError) -> ConfigError:
    first = err.errors()[0]
    loc = ".".join(str(p) for p in first["loc"])
    message = first["msg"].removeprefix("Value error, ")
    if _NAMES_ITS_FIELD.match(message):
        return ConfigError(message)  # a cross-field check already names its field
    got = "" if isinstance(first["input"], dict) else f" (got {first['input']!r})"
    return ConfigError(f"{loc or 'config'}: {message}{got}")


def _set_dotted(data: dict, override: str) -> None:
    if "=" not in override:
        raise ConfigError(f"override '{override}': expected key=value, e.g. loss.mode=token-mean")
    dotted, raw = override.split("=", 1)
    keys = dotted.strip().split(".")
    if not all(keys):
        raise ConfigError(f"override '{override}': empty key")
    model: type[BaseModel] = RunConfig
    node = data
    for depth, key in enumerate(keys):
        fields = model.model_fields
        if key not in fields:
            raise _unknown_key_error(tuple(keys[:depth]), key, list(fields))
        if depth == len(keys) - 1:
            try:
                node[key] = yaml.safe_load(raw) if raw.strip() else None
            except yaml.YAMLError:
                node[key] = raw
            return
        annotation = fields[key].annotation
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            raise ConfigError(f"{'.'.join(keys[: depth + 1])}: is a value, not a section")
        model = annotation
        child = node.get(key)
        node = node.setdefault(key, {}) if isinstance(child, dict) or child is None else child


def config_from_dict(data: dict[str, Any]) -> RunConfig:
    """Validate a plain mapping into a RunConfig, raising a one-line ConfigError."""
    _check_keys(RunConfig, data)
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise _format_validation_error(err) from None


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> RunConfig:
    """Load YAML (or the defaults when ``path`` is None), then apply ``a.b=value`` overrides."""
    data: Any = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"--config: no such file '{path}'")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            mark = getattr(err, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark is not None else ""
            raise ConfigError(f"--config: '{path}'{where}: invalid YAML") from None
        if not isinstance(data, dict):
            raise ConfigError(f"--config: '{path}' must hold a mapping of sections, got {type(data).__name__}")
    for override in overrides:
        _set_dotted(data, override)
    return config_from_dict(data)


def dump_config(config: RunConfig) -> str:
    """The fully resolved configuration as YAML (written next to every run's outputs)."""
    return yaml.safe_dump(config.model_dump(mode="json"), sort_keys=False)
