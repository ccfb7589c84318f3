"""What every benchmark result carries: where and with what it ran, written atomically."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import platform
import subprocess
import time
from collections.abc import Callable, Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

from asyncrl.metrics import write_json_atomic

# A --quick run of a command that trains whole runs: a tiny model and small steps, no warm start.
QUICK_RUN = [
    "model.hidden_size=32",
    "model.intermediate_size=64",
    "step.prompts_per_step=4",
    "step.generations_per_prompt=4",
    "generation.max_new_tokens=4",
    "generation.batch_size=8",
    "trainer.micro_batch_size=8",
    "data.eval_size=8",
    "warm_start.steps=0",
]
RESULTS_DIR = Path("bench-results")  # relative: results land where asyncrl bench runs, not inside the package


def environment() -> dict[str, Any]:
    """Machine, versions and commit: enough to tell whether two results can be compared."""
    import torch

    versions = {}
    for package in ("asyncrl", "torch", "transformers", "ray", "trl"):
        try:
            versions[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            versions[package] = None
    return {
        "machine": {
            "cpu": _cpu_model(),
            "cores": os.cpu_count(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
            "platform": platform.platform(),
            "python": platform.python_version(),
        },
        "versions": versions,
        "commit": _commit(),
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


def write_result(
    name: str, settings: dict[str, Any], results: Any, output: Path | None = None, **sections: Any
) -> dict[str, Any]:
    """Print the result as JSON and write it to ``output`` (default: bench-results/<name>.json in the
    working directory); ``sections`` go next to ``results``."""
    payload = {"benchmark": name, **environment(), "settings": settings, "results": results, **sections}
    path = Path(output) if output is not None else RESULTS_DIR / f"{name}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    write_json_atomic(path, payload)
    print(json.dumps(payload, indent=2))
    return payload


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _commit() -> str | None:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=Path(__file__).parent,
            capture_output=True,
            text=True,
            timeout=5,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None


@contextlib.contextmanager
def runtime_session(names: tuple[str, ...]) -> Iterator[None]:
    """One Ray cluster for a whole benchmark when it measures the Ray runtime (runtimes built
    inside leave a cluster they did not start running), shut down at the end. A cluster this
    process is already connected to is used as it is."""
    if "ray" not in names:
        yield
        return
    import ray

    if ray.is_initialized():
        yield
        return
    ray.init(
        address="local",
        num_cpus=max(4, os.cpu_count() or 1),
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.ERROR,
    )
    try:
        yield
    finally:
        ray.shutdown()


def spawn_pair(name: str, trainer: Callable[[], Any], generator: Callable[[], Any]) -> tuple[Any, Any, Any]:
    """(runtime, trainer handle, generator handle) on runtime ``name``, as ``asyncrl.runtime.build_runtime``
    builds it for a run whose ``runtime.name`` is ``name`` (one trainer rank, one rollout worker, a
    torch thread per op in a Ray actor); the factories are picklable, since on Ray they run inside
    the actors."""
    from typing import get_args

    from asyncrl.config import RuntimeConfig, load_config
    from asyncrl.runtime import build_runtime

    if name not in get_args(RuntimeConfig.model_fields["name"].annotation):
        raise ValueError(f"--runtime: unknown runtime '{name}'")
    runtime = build_runtime(load_config(None, [f"runtime.name={name}", "runtime.torch_threads=1"]))
    (trainer_handle,) = runtime.spawn_trainer_ranks(lambda rank, init_method: trainer, 1)
    (generator_handle,) = runtime.spawn_generators(generator, 1)
    runtime.ready()
    return runtime, trainer_handle, generator_handle
