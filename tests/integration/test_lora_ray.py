"""LoRA on the Ray runtime: the adapter alone moves, through the object store and over the
broadcast group, and the generator samples the trainer's policy after each sync."""

import json

import pytest
from helpers import SMALL, deterministic, run
from safetensors.torch import load_file

from asyncrl.config import load_config
from asyncrl.models import build_model, build_tokenizer
from asyncrl.models.lora import base_sha256

# max_lag 0: step 2's groups come from the weights of the sync after step 1
LORA = ("trainer.device=cpu", "lora.rank=4", "step.max_steps=2", "sampler.max_lag=0", "runtime.name=ray")


DIGITS = "rewards.functions=[reward_functions:digits]"


@pytest.fixture(scope="module")
def local_metrics(tmp_path_factory):
    """The same run on the local runtime: the reference an in_order Ray run repeats exactly."""
    _, metrics, _ = run(tmp_path_factory.mktemp("local"), "run", *LORA, DIGITS, "runtime.name=local")
    return [{k: v for k, v in m.items() if k != "sync_transport"} for m in deterministic(metrics)]


@pytest.mark.slow
@pytest.mark.parametrize("transport", ["object_store", "broadcast"])
def test_a_lora_run_on_ray_syncs_the_adapter_alone_and_leaves_the_base_untouched(
    ray_cluster, tmp_path, transport, local_metrics
):
    summary, metrics, groups = run(tmp_path, "ray", *LORA, DIGITS, f"sync.transport={transport}")
    checkpoint = tmp_path / "ray" / "checkpoints" / "step-000002"
    adapter = load_file(checkpoint / "adapter_model.safetensors")
    assert summary["steps"] == 2 and [m["sync_transport"] for m in metrics] == [transport] * 2
    assert {m["sync_bytes"] for m in metrics} == {sum(t.numel() * t.element_size() for t in adapter.values())}
    # The generator's adapter and base after the sync are the trainer's: it sampled step 2's groups
    # with the logprobs the trainer gives them (a stale or damaged adapter: a KL of ~1e-3).
    assert {g["start_version"] for g in groups if g["step"] == 2} == {1} and metrics[1]["grad_norm"] > 0
    assert all(m["mismatch_kl"] < 1e-9 for m in metrics)
    assert all(m["integrity/weights"] == 0 and m["integrity/sampling"] < 1e-6 for m in metrics)
    # the adapters start from the run's seeds, not from where each process's global RNG stood
    assert [{k: v for k, v in m.items() if k != "sync_transport"} for m in deterministic(metrics)] == local_metrics
    config = load_config(None, [*SMALL, *LORA])
    untouched = build_model(config, build_tokenizer(config)).state_dict()
    assert json.loads((checkpoint / "lora_base.json").read_text())["sha256"] == base_sha256(untouched)
