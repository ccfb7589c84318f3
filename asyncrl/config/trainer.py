"""The ``trainer``, ``parallel`` and ``warm_start`` sections: how the policy is optimized."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, model_validator

from asyncrl.config.base import Section, Seed

AggMode = Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm"]


class TrainerConfig(Section):
    """Optimizer, schedule and numerics of the policy trainer."""

    optimizer: Literal["adamw"] = Field("adamw", description="optimizer")
    lr: float = Field(3e-4, gt=0.0, description="peak learning rate")
    weight_decay: float = Field(0.0, ge=0.0, description="decoupled weight decay")
    betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas")
    eps: float = Field(1e-8, gt=0.0, description="AdamW epsilon")
    lr_schedule: Literal["constant", "cosine"] = Field("cosine", description="schedule after warmup")
    warmup_steps: int = Field(0, ge=0, description="linear warmup steps")
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0, description="cosine floor as a fraction of lr")
    micro_batch_size: int = Field(
        128, ge=1, description="sequences per forward/backward (the tiny default model takes a whole step at once)"
    )
    max_grad_norm: float | None = Field(1.0, gt=0.0, description="gradient clipping norm; null disables")
    aggregation: AggMode = Field(
        "token-mean",
        description="how the algorithm's per-token loss is summed into the step's loss, the same for every "
        "algorithm (the normalization contract, docs/loss.md)",
    )
    norm_constant: float | None = Field(None, gt=0.0, description="C of aggregation seq-mean-token-sum-norm")
    track_entropy: bool = Field(
        True, description="score and report the policy's entropy even when the algorithm's loss does not use it"
    )
    max_step_retries: int = Field(
        0, ge=0, description="reruns of a train step that raised (after it is aborted) before the run stops"
    )
    max_nonfinite_steps: int = Field(
        3,
        ge=0,
        description="consecutive steps with a non-finite loss or gradient that are skipped (weights untouched) "
        "before the run stops; 0 stops at the first",
    )
    dtype: Literal["float32", "bfloat16", "float64"] = Field(
        "float32",
        description="compute dtype; bfloat16 runs forward and backward in bfloat16 over float32 master parameters and "
        "optimizer state, and the generators get bfloat16 weights",
    )
    activation_checkpointing: bool = Field(
        False, description="recompute each transformer block's activations in the backward pass instead of keeping them"
    )
    logprob_chunk_tokens: Annotated[int, Field(ge=1)] | Literal["auto"] = Field(
        "auto",
        description="tokens whose logits are computed at once when scoring (loss, proximal and reference "
        "logprobs): the [tokens, vocab] logits exist for one chunk at a time and the backward recomputes them; "
        "a chunk's scoring peaks at about 5 float32 [tokens, vocab] tensors (0.4 GB at 128 x 151,936); "
        "auto: 128 on the CPU, where memory is the host's, and 1024 on a GPU, where small chunks leave its "
        "matrix units idle (docs/performance.md)",
    )
    packing: bool = Field(
        False,
        description="score and train each micro-batch's sequences concatenated into one row (positions restarting, "
        "attention kept within each sequence, no mask), so no layer computes padding",
    )
    micro_batch_tokens: int | None = Field(
        None,
        ge=1,
        description="a micro-batch closes before its real tokens would exceed this many (a longer sequence trains "
        "alone), as well as at micro_batch_size sequences; null: by sequence count alone",
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto: cuda when available")

    @model_validator(mode="after")
    def _betas_in_range(self) -> TrainerConfig:
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"trainer.betas: {list(self.betas)} must each be in [0, 1)")
        if self.aggregation == "seq-mean-token-sum-norm" and self.norm_constant is None:
            raise ValueError("trainer.norm_constant: required when trainer.aggregation is seq-mean-token-sum-norm")
        return self


class ParallelConfig(Section):
    """Trainer ranks: data parallel (dp) times context parallel (cp), see docs/parallelism.md."""

    dp: int = Field(1, ge=1, description="data-parallel ranks: each trains its own sequences of the step")
    cp: int = Field(1, ge=1, description="context-parallel ranks per sequence: each holds 2 of its 2*cp chunks")
    wrap: Literal["fsdp", "ddp"] = Field(
        "fsdp", description="fsdp: FSDP2 shards parameters over all dp*cp ranks; ddp: every rank holds them all"
    )
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="collectives; auto: nccl on cuda, gloo on cpu")

    @property
    def world_size(self) -> int:
        return self.dp * self.cp


class WarmStartConfig(Section):
    """A short supervised warm start on the train split, cached on disk, before GRPO begins."""

    steps: int | None = Field(
        None,
        ge=0,
        description="supervised steps; 0 skips the warm start; null: 600 for the built-in tiny model, 0 with model.path "
        "(a pretrained model would lose its own skills to it), so a checkpoint warm-starts only when this is set",
    )
    lr: float = Field(3e-3, gt=0.0, description="warm start learning rate")
    batch_size: int = Field(64, ge=1, description="examples per warm start step")
    seed: Seed = Field(
        0,
        description="seed of the warm start's batch order; independent of the run seed, so every seed of a run starts "
        "from the same warm-started policy, as the seeds of a real run start from one checkpoint",
    )
    cache_dir: str = Field("~/.cache/asyncrl/warm_start", description="where warm-started weights are cached")
