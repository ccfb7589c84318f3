"""Shared fixtures: one local Ray cluster, one vLLM server and one model directory at a released
model's tensor sizes for the whole test session, each made on first use. Every test folder sees
them (this file sits at the top of ``tests/``).

A test marked ``gpu`` needs CUDA: where ``torch.cuda.is_available()`` is False it is skipped,
and the skip says so.

Runs on ``runtime.name: ray`` find Ray connected and use this cluster; a runtime never shuts down
a cluster it did not start. At the end of the session the cluster is shut down and no Ray server
process it started may remain.

The suite runs on two pytest-xdist workers (``-n 2 --dist loadgroup``): each worker has its own
session, and so its own cluster, and every test that uses the vLLM server carries the ``vllm``
xdist group, so one worker starts it.
"""

import logging
import os
import uuid
from pathlib import Path

import pytest
from helpers import (
    SESSION_VARIABLE,
    ray_server_processes,
    skip_gpu_tests,
    vllm_processes,
    wait_for_exit,
    wait_until_gone,
)

# Each pytest process (each worker of a parallel run) marks the processes its tests start.
os.environ[SESSION_VARIABLE] = f"{os.getpid()}-{uuid.uuid4().hex}"


def pytest_collection_modifyitems(config, items):
    import torch

    skip_gpu_tests(items, torch.cuda.is_available)


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """A 4-CPU local cluster (logical CPUs: the actors of a run fit, the 2 cores are shared).

    Actors import modules from ``tests/`` (test reward functions) and from the test folders
    (functions a test module defines), and find the file that ``ray_exit_marker`` names in their
    environment."""
    import ray

    before = ray_server_processes()
    marker = tmp_path_factory.mktemp("ray") / "exit-marker"
    tests_dir = Path(__file__).parent
    folders = [tests_dir, tests_dir / "unit", tests_dir / "integration"]
    python_path = os.pathsep.join([*map(str, folders), *filter(None, [os.environ.get("PYTHONPATH")])])
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
    overrides = [
        "generation.backend.name=vllm",
        "generation.backend.options.weight_transfer=collective",
        f"logging.output_dir={run_dir}",
    ]
    overrides.append("generation.backend.options.max_model_len=1024")
    return load_config(None, overrides)


@pytest.fixture(scope="session")
def vllm_generator(vllm_config):
    """One vLLM server for the session, started through the backend's own code; no vLLM process
    may outlive it."""
    from asyncrl.data import build_task
    from asyncrl.environments.base import environment_class
    from asyncrl.generation import build_generator
    from asyncrl.models.factory import build_model, build_tokenizer
    from asyncrl.workers import generator_request_bound

    tokenizer = build_tokenizer(vllm_config)
    task, environment = build_task(vllm_config.data, tokenizer), environment_class(vllm_config)
    bound = generator_request_bound(vllm_config, task, environment, tokenizer)
    generator = build_generator(vllm_config, build_model(vllm_config, tokenizer), tokenizer, request_bound=bound)
    yield generator
    generator.close()
    assert not wait_for_exit(vllm_processes), "vLLM processes outlived the test session"


# SmolLM2-135M's tensor sizes (docs/models.md), with the example checkpoint's 2 layers of its 30
SMOLLM2_SHAPES = dict(
    vocab_size=49_152, hidden_size=576, num_attention_heads=9, num_key_value_heads=3, intermediate_size=1536
)


@pytest.fixture(scope="session")
def real_size_model(tmp_path_factory):
    """A model directory with SmolLM2-135M's tensor sizes (a tied 49,152 x 576 embedding: over
    2**24 elements) but 2 layers, seeded random weights, and the example checkpoint's tokenizer
    of a few hundred tokens, so the embedding has rows past the tokenizer's vocabulary, as a
    padded one has. Every real row gets one shared offset (a random direction of norm 2) and every
    padded row its negative: the untrained model then samples the tokenizer's tokens, nearly
    uniformly, as a trained model never samples its padding, and a group's rewards differ."""
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoTokenizer

    from asyncrl.models.example import write_example_checkpoint

    directory = write_example_checkpoint(tmp_path_factory.mktemp("real-size") / "model", **SMOLLM2_SHAPES)
    real_rows = len(AutoTokenizer.from_pretrained(directory))
    weights = load_file(directory / "model.safetensors")
    embedding = weights["model.embed_tokens.weight"]
    direction = torch.randn(embedding.shape[1], generator=torch.Generator().manual_seed(0))
    offset = (2 * direction / direction.norm()).to(embedding.dtype)
    embedding[:real_rows] += offset
    embedding[real_rows:] = -offset
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    return directory
