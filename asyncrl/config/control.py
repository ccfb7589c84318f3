"""The ``sampler``, ``runtime`` and ``sync`` sections: staleness, workers and weight sync."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, model_validator

from asyncrl.config.base import PartSection, Section


class SamplerConfig(PartSection):
    """The staleness contract between the rollout and train loops."""

    kind, at = "sampler", "sampler"

    name: str = Field(
        "in_order", description="in_order, weight_fifo, windowed, or package.module:Class (docs/plugins.md)"
    )
    options: dict[str, Any] = Field(
        default_factory=dict,
        description="settings of a sampler that declares them (its Options model); built-ins take none",
    )
    max_lag: int = Field(1, ge=0, description="how many weight versions behind trained data may be; 0 is synchronous")
    buffer_capacity: int | None = Field(
        None, ge=1, description="replay buffer size in groups; null: the sampler's minimum plus step.max_refill_groups"
    )
    startup_timeout_s: float = Field(
        60.0,
        gt=0.0,
        allow_inf_nan=False,
        description="a user's sampler (package.module:Class) must load within this in the fresh process the config "
        "check resolves it in (a module that blocks at import); past it, exit code 2",
    )


class RuntimeConfig(Section):
    """Where workers run."""

    name: Literal["local", "ray"] = Field("local", description="local: one process, worker threads; ray: actors")
    max_inflight_groups: int | None = Field(None, ge=1, description="dispatched, uncommitted groups; null: capacity")
    max_rollout_retries: int = Field(
        2, ge=0, description="retries of a failed rollout before on_rollout_failure applies"
    )
    on_rollout_failure: Literal["stop", "skip"] = Field(
        "skip",
        description="a prompt whose generation keeps failing: skip it (counted, never trained) and generate the next "
        "prompt in its place, until max_skipped_share is passed; or stop the run at the first such prompt",
    )
    max_skipped_share: float = Field(
        0.1,
        ge=0.0,
        le=1.0,
        description="skip: the run stops once more than this share of the last skipped_share_window prompts were "
        "skipped (a failure that is systematic, not a few bad inputs)",
    )
    skipped_share_window: int = Field(
        100, ge=1, description="skip: how many of the latest finished prompts max_skipped_share is counted over"
    )
    watchdog_s: float | None = Field(
        900.0,
        gt=0.0,
        description="stop the run, naming what each loop waits on, after this long without progress; null disables",
    )
    torch_threads: int | None = Field(
        None,
        ge=1,
        description="CPU threads per torch op; null: cores / 2 on the local runtime, a Ray actor's CPUs (at least 1) on ray",
    )
    address: str | None = Field(
        None, description="ray: null starts a local Ray cluster for the run; auto or host:port joins a running one"
    )
    controller_actor: bool = Field(
        False, description="ray: run the controller inside a CPU actor on the driver's node instead of in the driver"
    )
    generator_cpus: float = Field(1.0, ge=0.0, description="ray: CPUs reserved by each rollout worker actor")
    generator_gpus: float = Field(0.0, ge=0.0, description="ray: GPUs reserved by each rollout worker actor")
    trainer_cpus: float = Field(1.0, ge=0.0, description="ray: CPUs reserved by each trainer rank actor")
    trainer_gpus: float = Field(0.0, ge=0.0, description="ray: GPUs reserved by each trainer rank actor")
    generator_restarts: int = Field(
        3, ge=0, description="ray: times a dead rollout worker actor is restarted (it reloads the latest weights)"
    )

    @model_validator(mode="after")
    def _ray_fields_need_ray(self) -> RuntimeConfig:
        if self.name == "local" and self.address is not None:
            raise ValueError("runtime.address: set, but runtime.name is local; use runtime.name=ray")
        if self.name == "local" and self.controller_actor:
            raise ValueError("runtime.controller_actor: needs runtime.name ray")
        return self


class SyncConfig(Section):
    """Weight sync from the trainer to the generators."""

    mode: Literal["drain", "inflight"] = Field(
        "inflight", description="drain: wait for in-flight rollouts first; inflight: they finish on old weights"
    )
    timeout_s: float = Field(
        600.0,
        gt=0.0,
        description="closing the rollout gate, exporting the weights or loading them into the generators taking "
        "longer than this fails the run; waiting for running generation does not count",
    )
    transport: Literal["auto", "object_store", "broadcast"] = Field(
        "auto",
        description="ray: how weights reach the generators; object_store: rank 0 exports to Ray's object store; "
        "broadcast: a process group of rank 0 and the generators (NCCL when each has a whole GPU, else gloo); auto: "
        "broadcast when that is NCCL, else object_store",
    )
