"""The ``model`` and ``tokenizer`` sections: which policy and tokenizer a run trains."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from asyncrl.config.base import Section, Seed


class ModelConfig(Section):
    """The policy model: a local Hugging Face checkpoint, or the built-in tiny model."""

    path: str | None = Field(None, description="local HF causal LM directory; null builds the tiny model below")
    arch: Literal["qwen2", "llama"] = Field("qwen2", description="tiny model architecture")
    hidden_size: int = Field(128, ge=8, description="tiny model width")
    num_layers: int = Field(2, ge=1, description="tiny model depth")
    num_heads: int = Field(4, ge=1, description="tiny model attention heads; must divide hidden_size")
    num_kv_heads: int = Field(2, ge=1, description="tiny model key/value heads; must divide num_heads")
    intermediate_size: int = Field(512, ge=8, description="tiny model MLP width")
    init_seed: Seed = Field(0, description="seed of the tiny model's initialization")

    @model_validator(mode="after")
    def _heads_divide(self) -> ModelConfig:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"model.num_heads: {self.num_heads} does not divide hidden_size {self.hidden_size}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"model.num_kv_heads: {self.num_kv_heads} does not divide num_heads {self.num_heads}")
        return self


class TokenizerConfig(Section):
    """The tokenizer: a local HF tokenizer, the one saved with model.path, or the char tokenizer."""

    path: str | None = Field(None, description="local HF tokenizer directory; null: model.path, else char-level")
