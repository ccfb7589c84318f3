"""``asyncrl bench backends``: the transformers and vLLM generation backends on the same model.

Per backend: generation tokens/s for short responses (the default task's 16 tokens) and long ones
(256 tokens), seconds per weight update, and the mean step time of a short ``asyncrl train`` run.
Both backends get the same requests (same prompts and seeds) and the same weights; the vLLM
server is started once and the training runs use it through ``generation.backend.options.url``.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path

from asyncrl.config import load_config
from asyncrl.data import build_task
from asyncrl.environments.base import environment_class
from asyncrl.generation import SampleRequest, SamplingParams, build_generator, sample_seed
from asyncrl.metrics import read_jsonl
from asyncrl.models.factory import build_model, build_tokenizer
from asyncrl.run import train
from asyncrl.workers import generator_request_bound

SETTINGS = {"short": 16, "long": 256}  # max_new_tokens of each generation setting


def run(*, requests: int, updates: int, train_steps: int) -> list[dict]:
    config = load_config(None, ["generation.backend.name=vllm"])
    tokenizer = build_tokenizer(config)
    model = build_model(config, tokenizer)
    batch = [SampleRequest(tokenizer.encode(f"{i}+{i % 7}="), sample_seed(0, str(i), 0)) for i in range(requests)]
    task, environment = build_task(config.data, tokenizer), environment_class(config)
    rows = []
    for backend in ("hf", "vllm"):
        backend_config = load_config(None, [f"generation.backend.name={backend}"])
        bound = generator_request_bound(backend_config, task, environment, tokenizer)
        generator = build_generator(backend_config, build_model(config, tokenizer), tokenizer, request_bound=bound)
        try:
            row = {"backend": backend}
            for name, length in SETTINGS.items():
                generator.generate(batch[:4], SamplingParams(length))  # warm-up
                start = time.perf_counter()
                rollouts = generator.generate(batch, SamplingParams(length))
                seconds = time.perf_counter() - start
                tokens = sum(len(r.response_ids) for r in rollouts)
                row[f"{name}_tokens_per_s"] = tokens / seconds
                row[f"{name}_tokens"] = tokens
            weights = model.state_dict()
            times = []
            for version in range(1, updates + 1):
                start = time.perf_counter()
                generator.load_weights(weights, version)
                times.append(time.perf_counter() - start)
            row["sync_s_median"] = statistics.median(times)
            url = getattr(generator, "url", None)
            row["step_s_mean"] = _train_step_s(backend, url, train_steps)
        finally:
            close = getattr(generator, "close", None)
            if close is not None:
                close()
        rows.append(row)
    return rows


def _train_step_s(backend: str, url: str | None, steps: int) -> float:
    """Mean ``time/step_s`` of a short run on the default task (no warm start), past its first step."""
    with tempfile.TemporaryDirectory() as run_dir:
        overrides = [
            f"generation.backend.name={backend}",
            f"step.max_steps={steps}",
            "warm_start.steps=0",
            "logging.progress=false",
            "logging.tensorboard=false",
            "checkpoint.every_steps=null",
            f"logging.eval_every_steps={steps}",
        ]
        if url is not None:
            overrides.append(f"generation.backend.options.url={url}")
        train(load_config(None, overrides), output_dir=Path(run_dir))
        return statistics.mean(m["time/step_s"] for m in read_jsonl(Path(run_dir) / "metrics.jsonl")[1:])
