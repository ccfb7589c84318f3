"""``asyncrl bench gpu``: one line and exit 0 without a GPU; its measurements, run on the CPU with a
tiny model so that the code a GPU runs is exercised here too. No timing is asserted."""

import pytest
import torch

from asyncrl.bench import gpu
from asyncrl.cli import main

TINY = gpu.Workload(
    vocab_size=64,
    model=dict(hidden_size=32, num_layers=2, num_heads=2, num_kv_heads=1, intermediate_size=64),
    rows=4,
    prompt_len=4,
    response_len=8,
    micro_batch_size=3,
    steps=2,
    repeats=2,
    long_context_lens=(32, 64),
)


def test_without_a_gpu_it_prints_one_line_and_exits_0(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "gpu"]) == 0
    assert capsys.readouterr().out == "skipped: no CUDA GPU\n"
    assert not (tmp_path / "bench-results").exists()


@pytest.mark.parametrize(
    ("name", "peak"),
    [("NVIDIA H200", 989.4), ("NVIDIA H100 PCIe", 756.0), ("NVIDIA H100 80GB HBM3", 989.4), ("NVIDIA L4", 121.0)],
)
def test_the_peak_is_looked_up_by_the_longest_matching_name(name, peak):
    assert gpu.peak_tflops(name) == peak


def test_an_unknown_device_has_no_peak():
    assert gpu.peak_tflops("Some Future GPU") is None


def test_flops_per_token_count_six_per_parameter_and_the_attention_scores():
    layers, hidden, seq_len = TINY.model["num_layers"], TINY.model["hidden_size"], TINY.seq_len
    assert gpu.flops_per_token(1000, TINY) == 6 * 1000 + 12 * layers * hidden * seq_len


def test_every_measurement_runs_on_the_cpu_with_a_tiny_model():
    result = gpu.run(TINY, device="cpu", peak=2.0)
    model = gpu._model(TINY, "cpu")
    assert result["parameters"] == sum(p.numel() for p in model.parameters())
    for row in (result["train"], result["train_packed"], result["fsdp2"]):
        assert row["tokens_per_step"] == TINY.rows * TINY.seq_len
        assert row["micro_batches_per_step"] == 2
        assert row["tokens_per_s"] == pytest.approx(row["tokens_per_step"] / row["step_s"])
        assert row["mfu"] == pytest.approx(row["tokens_per_s"] * result["flops_per_token"] / 2e12)
    weights = result["weights"]
    # bfloat16 copies of the float32 masters, the tied output embedding exported under its own name too
    assert weights["bytes"] == 2 * sum(t.numel() for t in model.state_dict().values())
    assert weights["export_to_cpu_gb_per_s"] > 0 and weights["load_from_cpu_gb_per_s"] > 0
    assert result["fsdp2"]["sharded"] and result["fsdp2"]["backend"] == "gloo"
    assert result["fsdp2"]["export_gb_per_s"] > 0
    assert result["vllm"] == {"skipped": "the vLLM GPU backend needs a CUDA device"}
    long_context = result["long_context"]
    assert long_context["stopped"] == []
    steps = [(r["layout"], r["seq_len"], r["rows"]) for r in long_context["rows"]]
    assert steps == [
        ("equal", 32, [16, 16]), ("equal", 64, [32, 32]),
        ("ragged", 32, [19, 13]), ("ragged", 64, [38, 26]),
        ("packed", 32, [19, 13]), ("packed", 64, [38, 26]),
    ]  # fmt: skip
    assert all(r["tokens_per_s"] == pytest.approx(r["seq_len"] / r["step_seconds"]) for r in long_context["rows"])
