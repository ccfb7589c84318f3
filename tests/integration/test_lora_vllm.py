"""LoRA on the vLLM backend (docs/lora.md): a sync loads the adapter alone, by version, into a real
vLLM CPU server started with LoRA enabled; the base is sent once, at its start."""

import copy
import math

import pytest
import torch
from helpers import SMALL, vllm_processes, wait_for_exit

from asyncrl.cli import main
from asyncrl.config import load_config
from asyncrl.data import build_task
from asyncrl.environments.base import environment_class
from asyncrl.generation import SampleRequest, SamplingParams, build_generator
from asyncrl.generation.vllm import max_lora_rank
from asyncrl.generation.vllm_process import ServerError, http_json
from asyncrl.metrics import read_jsonl
from asyncrl.models import build_model, build_tokenizer, token_logprobs
from asyncrl.trainer import PolicyTrainer
from asyncrl.weights.fingerprint import fingerprint
from asyncrl.workers import generator_request_bound

LORA_VLLM = [
    "generation.backend.name=vllm",
    "lora.rank=4",
    "sampler.max_lag=1",
    "trainer.device=cpu",
]  # 3 adapter slots
pytestmark = pytest.mark.xdist_group("vllm")  # one worker sets up the vLLM environment and serves
PROMPTS = ["1+1=", "12+30=", "7*8=", "(3+4)*2="]
PARAMS = SamplingParams(max_new_tokens=12)


def run_bound(config, tokenizer):
    """The request bound the composition root hands the vllm backend (it declares takes_request_bound)."""
    return generator_request_bound(config, build_task(config.data, tokenizer), environment_class(config), tokenizer)


@pytest.fixture(scope="module")
def lora_served(vllm_python, tmp_path_factory):
    """(the trainer, its tokenizer, a vLLM generator with LoRA enabled on the same base), one
    server for the module; no vLLM process it started outlives it."""
    run_dir = tmp_path_factory.mktemp("lora-vllm-run")
    config = load_config(
        None, [*LORA_VLLM, f"logging.output_dir={run_dir}", "generation.backend.options.max_model_len=256"]
    )
    tokenizer = build_tokenizer(config)
    model = build_model(config, tokenizer)
    before = vllm_processes()
    generator = build_generator(
        config, copy.deepcopy(model), tokenizer, run_dir, request_bound=run_bound(config, tokenizer)
    )
    yield PolicyTrainer.from_config(config, model), tokenizer, generator
    generator.close()
    assert not wait_for_exit(lambda: vllm_processes() - before), "vLLM processes outlived the module"


def adapter_of(trainer, version: int) -> dict[str, torch.Tensor]:
    """The trainer's adapter set to random values drawn from ``version``, exported as a sync sends it."""
    generator = torch.Generator().manual_seed(version)
    with torch.no_grad():
        for parameter in trainer.model.parameters():
            if parameter.requires_grad:
                parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=parameter.dtype) * 0.3)
    return trainer.export_weights()[1]


def requests_of(tokenizer) -> list[SampleRequest]:
    return [SampleRequest(prompt_ids=tokenizer.encode(p), seed=index) for index, p in enumerate(PROMPTS)]


def scored(model, prompt_ids, response_ids) -> torch.Tensor:
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logprobs, _ = token_logprobs(model, ids, torch.ones_like(ids))
    return logprobs[0, len(prompt_ids) :].float()


def assert_logprobs_of(trainer, version: int, prompt_ids, response_ids, logprobs) -> None:
    """``logprobs`` are the trainer's for the response under ``version``'s adapter."""
    adapter_of(trainer, version)
    expected = scored(trainer.model, prompt_ids, response_ids)
    torch.testing.assert_close(torch.tensor(logprobs), expected, rtol=0, atol=1e-5)


def served(generator, adapter: str | None, prompt_ids: list[int]) -> dict:
    """One seeded sample of the server naming ``adapter`` as its model."""
    sampling = {"max_tokens": PARAMS.max_new_tokens, "seed": 0, "logprobs": 0, "detokenize": False}
    body = {"token_ids": prompt_ids, "sampling_params": sampling, "model": adapter}
    choice = http_json(f"{generator.url}/inference/v1/generate", body, timeout=60)["choices"][0]
    return {"tokens": choice["token_ids"], "logprobs": [entry["logprob"] for entry in choice["logprobs"]["content"]]}


def test_a_rank_above_what_vllm_serves_is_refused_and_the_server_gets_the_smallest_that_holds_it():
    config = load_config(None, [*LORA_VLLM, "lora.rank=1024"])
    tokenizer = build_tokenizer(config)
    with pytest.raises(ValueError, match="lora.rank: 1024 is above 512, the largest adapter rank vLLM serves"):
        build_generator(config, build_model(config, tokenizer), tokenizer, request_bound=run_bound(config, tokenizer))
    assert [max_lora_rank(rank) for rank in (1, 4, 8, 9, 300, 512)] == [1, 8, 8, 16, 320, 512]


@pytest.mark.slow
def test_a_synced_adapter_gives_the_trainers_logprobs_and_older_ones_are_served_until_past_the_bound(lora_served):
    trainer, tokenizer, generator = lora_served
    adapters = generator.adapters
    assert adapters.slots == 3 and generator.server.lora_args()[:3] == ["--enable-lora", "--max-lora-rank", "8"]
    for version in (1, 2):
        adapter = adapter_of(trainer, version)
        generator.load_weights(adapter, version)
        assert generator.fingerprint() == fingerprint(adapter)  # the newest adapter the server lists
        rollouts = generator.generate(requests_of(tokenizer), PARAMS)
        assert sum(len(r.response_ids) for r in rollouts) > 10
        for rollout in rollouts:
            assert rollout.versions == [version] * len(rollout.response_ids)
            assert_logprobs_of(trainer, version, rollout.prompt_ids, rollout.response_ids, rollout.logprobs)
            with trainer.model.disable_adapter():
                base = scored(trainer.model, rollout.prompt_ids, rollout.response_ids)
            assert (torch.tensor(rollout.logprobs) - base).abs().max() > 1e-2
        written = adapters.loaded[version]
        assert written.parent.parent == generator.server.log_path.parent  # <run_dir>/vllm/
        assert sorted(p.name for p in written.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]

    prompt_ids = tokenizer.encode(PROMPTS[1])
    first = adapters.name(1)
    older = served(generator, first, prompt_ids)  # version 1 is within the bound after version 2's sync
    assert_logprobs_of(trainer, 1, prompt_ids, older["tokens"], older["logprobs"])

    first_dir = adapters.loaded[1]
    for version in (3, 4):  # 3 slots: version 4's sync unloads version 1
        generator.load_weights(adapter_of(trainer, version), version)
    assert list(adapters.loaded) == [2, 3, 4] and not first_dir.exists()
    with pytest.raises(ServerError, match="HTTP 404"):
        served(generator, first, prompt_ids)
    served(generator, adapters.name(2), prompt_ids)


@pytest.mark.slow
def test_a_lora_run_on_vllm_finishes_and_syncs_adapter_bytes_only(lora_served, tmp_path):
    """On the module's server (``generation.backend.options.url``: its LoRA-enabled start is the fixture's), under adapter
    names of its own; the run's base is the module's (the same tiny model and seed)."""
    _, _, generator = lora_served
    run_dir = tmp_path / "run"
    model = ["model.hidden_size=128", "model.intermediate_size=512"]
    overrides = [*SMALL, *LORA_VLLM, *model, "step.max_steps=2", "logging.eval_every_steps=null"]
    overrides.append(f"generation.backend.options.url={generator.url}")
    assert main(["train", "--output-dir", str(run_dir), *overrides]) == 0
    metrics = read_jsonl(run_dir / "metrics.jsonl")
    # the module's server holds the same tiny model's adapters: rank 4 over every projection, float32
    shapes = generator.adapters.shapes
    adapter_bytes = 4 * sum(math.prod(shape) for shape in shapes.values())
    assert len(metrics) == 2 and {m["sync_bytes"] for m in metrics} == {adapter_bytes}
    assert all(m["integrity/weights"] == 0 and m["integrity/sampling"] <= 0.01 for m in metrics)
    assert all(".lora_A." in name or ".lora_B." in name for name in shapes)


@pytest.mark.slow
def test_a_killed_server_is_restarted_with_the_base_and_every_adapter_it_held(lora_served):
    """Runs last: the restart costs one server start."""
    trainer, tokenizer, generator = lora_served
    if generator.version == 0:  # run alone: give it adapters to restore
        for version in (1, 2):
            generator.load_weights(adapter_of(trainer, version), version)
    held = dict(generator.adapters.loaded)
    generator.server.process.kill()  # its engine processes follow it down
    generator.server.process.wait(timeout=30)
    rollouts = generator.generate(requests_of(tokenizer), PARAMS)
    assert generator.restarts == 1 and generator.adapters.loaded == held
    for rollout in rollouts:
        assert_logprobs_of(trainer, generator.version, rollout.prompt_ids, rollout.response_ids, rollout.logprobs)
    older, prompt_ids = min(held), tokenizer.encode(PROMPTS[1])
    answer = served(generator, generator.adapters.name(older), prompt_ids)
    assert_logprobs_of(trainer, older, prompt_ids, answer["tokens"], answer["logprobs"])
