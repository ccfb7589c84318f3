"""``asyncrl bench roofline``: how close the trainer and the generators come to this CPU's matmul rate.

The roofline is the float32 matmul FLOP/s torch reaches here, with its current thread count: a
model-shaped matmul ([tokens, hidden] x [hidden, intermediate]) and a square one, timed after a
warm-up, the best of a few repeats. Against it, each measured through the code a run uses:

- ``train``: a GRPO step (``PolicyTrainer.from_config``: micro-batches, then the optimizer step),
  full fine-tuning and LoRA. A default step is one mini-batch, whose proximal logprobs are the
  behaviour ones: the trainer runs no scoring forward (``TrainerWorker`` scores first only with
  several mini-batches or epochs, or a reference model), so a step counts forward and backward;
- ``hf``: the transformers generator at the config's ``generation.batch_size``: a call with
  ``max_new_tokens=1`` is the prefill; a full call less that prefill is the decode;
- ``vllm``: the same two calls to the vLLM CPU server, where ``asyncrl vllm-env`` has made its
  environment; skipped, with the reason, where not.

FLOPs follow ``asyncrl.bench.flops`` (PaLM's count) over the real tokens only: a train token
costs 6 N + 12 L H T (LoRA: 4 N_base + 6 N_adapter + 12 L H T), a prefill token 2 N + 4 L H P,
and the j-th decoded token 2 N + 4 L H (P + j), its context so far. The model is
SmolLM2-135M-Instruct where ``asyncrl model get`` has cached it, else a llama of its shape with
random weights (FLOP/s does not depend on the weights' values).
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, replace
from pathlib import Path
from typing import Any

import torch

from asyncrl.bench.flops import forward_flops_per_token, lora_train_flops_per_token, train_flops_per_token
from asyncrl.bench.gpu import Workload

MODEL_NAME = "smollm2-135m-instruct"
GOALS = {"train": 0.7, "generation": 0.5}  # each measured rate over the matmul rate, at least
LORA_RANK = 16
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


SMOLLM2_135M = dict(hidden_size=576, num_layers=30, num_heads=9, num_kv_heads=3, intermediate_size=1536)
FULL = Workload(
    vocab_size=49152,
    model=SMOLLM2_135M,
    rows=4 * 8,
    prompt_len=20,
    response_len=40,
    micro_batch_size=8,
    steps=2,  # timed train steps after a warm-up, and timed calls of each generation length
    repeats=2,  # the matmuls: 2 * repeats + 1 timings of many calls each
)
QUICK = replace(
    FULL,
    vocab_size=1024,
    model=dict(hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128),
    rows=4,
    prompt_len=8,
    response_len=8,
    micro_batch_size=4,
    steps=1,
    repeats=1,
)


def run(workload: Workload, *, cached_model: bool) -> dict[str, Any]:
    """Every measurement; ``cached_model``: SmolLM2-135M-Instruct's weights where they are cached,
    and the vLLM server (a --quick run takes neither)."""
    matmul = _matmul(workload, cached_model)
    rate = matmul["flops_per_s"]
    directory = _cached_model_dir() if cached_model else None
    train = {name: _train(workload, directory, rank, rate) for name, rank in (("full", 0), ("lora", LORA_RANK))}
    hf = _hf(workload, directory, rate)
    vllm = _vllm(workload, directory, rate) if cached_model else {"skipped": "--quick starts no vLLM server"}
    measured = {
        "train_full": train["full"]["over_matmul"],
        "train_lora": train["lora"]["over_matmul"],
        "hf_prefill": hf["prefill"]["over_matmul"],
        "hf_decode": hf["decode"]["over_matmul"],
        **({f"vllm_{p}": vllm[p]["over_matmul"] for p in ("prefill", "decode")} if "skipped" not in vllm else {}),
    }
    goals = {
        name: {"value": value, "goal": f">= {goal:g}", "met": value >= goal}
        for name, value in measured.items()
        for goal in [GOALS["train" if name.startswith("train") else "generation"]]
    }
    return {
        "model": str(directory) if directory is not None else "llama of the workload's shape, random weights",
        "torch_threads": torch.get_num_threads(),
        "matmul": matmul,
        "train": train,
        "hf": hf,
        "vllm": vllm,
        "goals": goals,
    }


def _cached_model_dir() -> Path | None:
    """SmolLM2-135M-Instruct's directory where ``asyncrl model get`` has cached it (never downloaded here)."""
    from asyncrl.pretrained.registry import models_dir

    directory = models_dir() / MODEL_NAME
    return directory if (directory / "config.json").is_file() else None


def _model(workload: Workload, directory: Path | None):
    """A float32 model: the one in ``directory``, else a random llama of the workload's shape."""
    from asyncrl.models import build_tiny_model
    from asyncrl.models.hf import load_model

    if directory is not None:
        return load_model(directory, dtype=torch.float32)
    return build_tiny_model(
        workload.vocab_size, seed=0, arch="llama", max_position_embeddings=workload.seq_len, **workload.model
    )


def _matmul(workload: Workload, full_size: bool) -> dict[str, Any]:
    """The best float32 matmul FLOP/s of a model-shaped and a square product; the faster is the roofline."""
    tokens, hidden = workload.rows * workload.seq_len, workload.model["hidden_size"]
    side = 1024 if full_size else 128
    shapes = {"model": (tokens, hidden, workload.model["intermediate_size"]), "square": (side, side, side)}
    rates = {name: _matmul_rate(*shape, repeats=2 * workload.repeats + 1) for name, shape in shapes.items()}
    return {"shapes_m_k_n": shapes, **{f"{name}_flops_per_s": r for name, r in rates.items()},
            "flops_per_s": max(rates.values())}  # fmt: skip


def _matmul_rate(m: int, k: int, n: int, repeats: int, seconds: float = 0.2) -> float:
    """FLOP/s of the best of ``repeats`` timings, each of enough calls to take about ``seconds``."""
    gen = torch.Generator().manual_seed(0)
    a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
    start = time.perf_counter()
    torch.mm(a, b)  # warm-up, and the length of one call
    calls = max(1, math.ceil(seconds / (time.perf_counter() - start)))
    best = math.inf
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            torch.mm(a, b)
        best = min(best, (time.perf_counter() - start) / calls)
    return 2 * m * k * n / best


def _config(workload: Workload, lora_rank: int, *extra: str):
    from asyncrl.config import load_config

    return load_config(
        None,
        [
            f"lora.rank={lora_rank}",
            f"lora.target_modules=[{','.join(LORA_TARGETS)}]",
            "trainer.dtype=float32",
            "trainer.device=cpu",
            f"trainer.micro_batch_size={workload.micro_batch_size}",
            *extra,
        ],
    )


def _train(workload: Workload, directory: Path | None, lora_rank: int, matmul_rate: float) -> dict[str, Any]:
    """The best of ``steps`` split steps after a warm-up (AdamW's moments, first touches)."""
    from asyncrl.bench.gpu import _batch
    from asyncrl.trainer.policy import PolicyTrainer

    trainer = PolicyTrainer.from_config(_config(workload, lora_rank), _model(workload, directory))
    seconds, tokens = math.inf, 0
    for step in range(workload.steps + 1):
        batch = _batch(workload, seed=step)
        start = time.perf_counter()
        trainer.begin_train_step()
        for micro in batch.micro_batches(workload.micro_batch_size):
            trainer.train_microbatch(micro)
        trainer.finish_train_step()
        if step:
            seconds = min(seconds, time.perf_counter() - start)
        tokens = int(batch.attention_mask.sum())
    trainable = sum(p.numel() for p in trainer.params)
    parameters = sum(p.numel() for p in trainer.model.parameters())
    shape = (workload.model["num_layers"], workload.model["hidden_size"], workload.seq_len)
    if lora_rank:
        per_token = lora_train_flops_per_token(parameters - trainable, trainable, *shape)
    else:
        per_token = train_flops_per_token(parameters, *shape)
    return {
        "parameters": parameters,
        "trainable_parameters": trainable,
        "tokens": tokens,
        "flops_per_token": per_token,
        **_rates(tokens, tokens * per_token, seconds, matmul_rate),
    }


def _rates(tokens: int, flops: float, seconds: float, matmul_rate: float) -> dict[str, float]:
    flops_per_s = flops / seconds
    return {"seconds": seconds, "tokens_per_s": tokens / seconds, "flops_per_s": flops_per_s,
            "over_matmul": flops_per_s / matmul_rate}  # fmt: skip


def _requests(workload: Workload):
    from asyncrl.generation import SampleRequest

    gen = torch.Generator().manual_seed(0)
    return [
        SampleRequest(torch.randint(1, workload.vocab_size, (workload.prompt_len,), generator=gen).tolist(), seed)
        for seed in range(workload.rows)
    ]


def _generation(generator, workload: Workload, parameters: int, matmul_rate: float) -> dict[str, Any]:
    """Prefill (a one-token call) and decode (a full call less the prefill), best of ``steps`` each."""
    from asyncrl.generation import SamplingParams

    requests = _requests(workload)
    layers, hidden = workload.model["num_layers"], workload.model["hidden_size"]
    best = {}
    for name, new_tokens in (("prefill", 1), ("full", workload.response_len)):
        generator.generate(requests, SamplingParams(new_tokens))  # warm-up
        best[name] = math.inf
        for _ in range(workload.steps):
            start = time.perf_counter()
            rollouts = generator.generate(requests, SamplingParams(new_tokens))
            best[name] = min(best[name], time.perf_counter() - start)
    prefill_tokens = len(requests) * workload.prompt_len
    prefill_flops = prefill_tokens * forward_flops_per_token(parameters, layers, hidden, workload.prompt_len)
    decoded = [len(r.response_ids) - 1 for r in rollouts]  # the first token came out of the prefill
    decode_flops = sum(
        forward_flops_per_token(parameters, layers, hidden, workload.prompt_len + j)
        for count in decoded
        for j in range(1, count + 1)
    )
    return {
        "batch": len(requests),
        "prefill": _rates(prefill_tokens, prefill_flops, best["prefill"], matmul_rate),
        "decode": _rates(sum(decoded), decode_flops, best["full"] - best["prefill"], matmul_rate),
    }


def _hf(workload: Workload, directory: Path | None, matmul_rate: float) -> dict[str, Any]:
    from asyncrl.generation.hf import build_hf_generator
    from asyncrl.models import build_tokenizer

    config = _config(workload, 0)
    model = _model(workload, directory)
    generator = build_hf_generator(config, model, build_tokenizer(config), stop_token_ids=[0])
    parameters = sum(p.numel() for p in model.parameters())
    return {"generation_batch_size": config.generation.batch_size,
            **_generation(generator, workload, parameters, matmul_rate)}  # fmt: skip


def _vllm(workload: Workload, directory: Path | None, matmul_rate: float) -> dict[str, Any]:
    """The vLLM CPU server on the same model and requests; skipped without its environment."""
    from asyncrl.data import build_task
    from asyncrl.environments.base import environment_class
    from asyncrl.generation.vllm import build_vllm_generator
    from asyncrl.generation.vllm_env import VLLMEnvError, checked_python
    from asyncrl.generation.vllm_options import VLLMOptions
    from asyncrl.models import build_tokenizer
    from asyncrl.workers import generator_request_bound

    try:
        checked_python(None, "cpu")
    except VLLMEnvError as err:
        return {"skipped": str(err)}
    config = _config(
        workload, 0, "generation.backend.name=vllm", f"generation.backend.options.max_model_len={workload.seq_len}"
    )
    model = _model(workload, directory)
    tokenizer = build_tokenizer(config)
    bound = generator_request_bound(config, build_task(config.data, tokenizer), environment_class(config), tokenizer)
    options = VLLMOptions.model_validate(config.generation.backend.options)
    generator = build_vllm_generator(config, model, tokenizer, [], options, request_bound=bound)
    try:
        return _generation(generator, workload, sum(p.numel() for p in model.parameters()), matmul_rate)
    finally:
        generator.close()


def settings(workload: Workload) -> dict[str, Any]:
    return {**{k: v for k, v in asdict(workload).items() if k != "long_context_lens"}, "dtype": "float32", "device": "cpu", "lora_rank": LORA_RANK,
            "lora_targets": list(LORA_TARGETS)}  # fmt: skip
