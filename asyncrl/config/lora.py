"""The ``lora`` section: train low-rank adapters over a frozen base instead of every weight."""

from __future__ import annotations

from pydantic import Field, model_validator

from asyncrl.config.base import Section

# Qwen2 / Llama / Mistral / Gemma names of the attention and MLP projections.
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


class LoraConfig(Section):
    """LoRA adapters built with peft (docs/lora.md); rank 0 trains every weight."""

    rank: int = Field(
        0,
        ge=0,
        description="adapter rank r; 0 turns LoRA off (full fine-tuning). With r > 0 the base stays frozen in "
        "trainer.dtype, only the adapters train (float32 masters and AdamW state), and a weight sync moves them alone",
    )
    alpha: float = Field(32.0, gt=0.0, description="LoRA alpha: the adapter's output is scaled by alpha / rank")
    dropout: float = Field(
        0.0,
        ge=0.0,
        lt=1.0,
        description="dropout on the adapter's input in the loss forward only (proximal, reference and generator "
        "scores run without it, so on-policy ratios are no longer exactly 1)",
    )
    target_modules: list[str] = Field(
        default_factory=lambda: list(PROJECTIONS),
        description="names of the linear layers that get adapters (the last part of the module name); each must "
        "exist in the model",
    )

    @model_validator(mode="after")
    def _targets_named(self) -> LoraConfig:
        if not self.target_modules:
            raise ValueError("lora.target_modules: name at least one linear layer")
        return self
