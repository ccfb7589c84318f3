"""Shared fixtures: one local Ray cluster for the whole test session, started on first use.

Runs on ``runtime.name: ray`` find Ray connected and use this cluster; a runtime never shuts down
a cluster it did not start. At the end of the session the cluster is shut down and no Ray server
process it started may remain.
"""

import logging
import os
import time
from pathlib import Path

import pytest

RAY_SERVERS = ("raylet", "gcs_server")


def ray_server_processes() -> set[int]:
    """Process ids of Ray's server processes (raylet, gcs_server) on this machine."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if (entry / "comm").read_text().strip() in RAY_SERVERS:
                    pids.add(int(entry.name))
            except OSError:  # the process ended while we looked
                pass
    return pids


def dashboard_command_lines() -> list[list[str]]:
    """The command lines of Ray's dashboard processes on this machine."""
    lines = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().decode(errors="replace").split("\0")
            except OSError:
                continue
            if any(arg.endswith("dashboard/dashboard.py") for arg in argv):
                lines.append(argv)
    return lines


def wait_until_gone(pids: set[int], timeout_s: float = 20.0) -> set[int]:
    """Those of ``pids`` still running after up to ``timeout_s`` (servers take a moment to exit)."""
    deadline = time.monotonic() + timeout_s
    while (left := pids & ray_server_processes()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """A 4-CPU local cluster (logical CPUs: the actors of a run fit, the 2 cores are shared).

    Actors import modules from ``tests/`` (test reward functions), and find the file that
    ``ray_exit_marker`` names in their environment."""
    import ray

    before = ray_server_processes()
    marker = tmp_path_factory.mktemp("ray") / "exit-marker"
    tests_dir = str(Path(__file__).parent)
    python_path = os.pathsep.join(p for p in (tests_dir, os.environ.get("PYTHONPATH")) if p)
    ray.init(
        num_cpus=4,
        include_dashboard=False,
        log_to_driver=False,
        logging_level=logging.ERROR,
        runtime_env={"env_vars": {"PYTHONPATH": python_path, "ASYNCRL_TEST_EXIT_MARKER": str(marker)}},
    )
    started = ray_server_processes() - before
    yield marker
    ray.shutdown()
    assert not wait_until_gone(started), "Ray server processes outlived the test session"


def vllm_processes() -> set[int]:
    """Process ids of vLLM servers asyncrl started, and of their engine and worker processes."""
    pids = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                argv = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if "vllm_server.py" in argv or argv.startswith("VLLM::"):
                pids.add(int(entry.name))
    return pids


@pytest.fixture(scope="session")
def vllm_python():
    """The vLLM environment's interpreter, set up by the project's own code when it is missing."""
    from asyncrl.generation.vllm_env import ensure_env

    return ensure_env()


@pytest.fixture(scope="session")
def vllm_config(vllm_python, tmp_path_factory):
    """A run config on the vLLM backend with the default tiny model (head size 32, tied head),
    whose weights go to the server over a gloo group (the collective transfer), served with the
    model's whole context (tests send prompts and responses longer than the task's)."""
    from asyncrl.config import load_config

    run_dir = tmp_path_factory.mktemp("vllm-run")
    overrides = ["generation.backend=vllm", "vllm.weight_transfer=collective", f"logging.output_dir={run_dir}"]
    overrides.append("vllm.max_model_len=1024")
    return load_config(None, overrides)


@pytest.fixture(scope="session")
def vllm_generator(vllm_config):
    """One vLLM server for the session, started through the backend's own code; no vLLM process
    may outlive it."""
    from asyncrl.generation import build_generator
    from asyncrl.models.factory import build_model, build_tokenizer

    tokenizer = build_tokenizer(vllm_config)
    generator = build_generator(vllm_config, build_model(vllm_config, tokenizer), tokenizer)
    yield generator
    generator.close()
    assert not wait_for_exit(vllm_processes), "vLLM processes outlived the test session"


def wait_for_exit(find, timeout_s: float = 20.0) -> set[int]:
    """What ``find()`` still returns after up to ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while (left := find()) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left
