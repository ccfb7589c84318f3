"""Hugging Face architectures beyond the tiny model, each a tiny random checkpoint saved as a model
directory: the trainer's logprobs equal the model's own forward, generation scores what the trainer
scores, and context parallelism over two ranks matches a single rank, with sequences longer than
the sliding window of Mistral, Gemma and Phi-3, Gemma 2's attention softcapping, and GPT-2's
learned absolute positions. A planted mistake (a dropped window) must fail the CP check."""

import io
import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
import transformers

from asyncrl.config import ConfigError, load_config
from asyncrl.generation import HFGenerator, SampleRequest, SamplingParams
from asyncrl.models import load_model, token_logprobs
from asyncrl.tools.verify import PACKED_LEAK
from asyncrl.trainer import context_parallel
from asyncrl.trainer.context_parallel import (
    ContextParallel,
    context_parallel_attention,
    enable_context_parallel_attention,
)
from asyncrl.trainer.parallel import launch
from asyncrl.types import TrainBatch

VOCAB, WINDOW, WIDTH = 64, 8, 24  # rows longer than the window
LAYERS = dict(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
MLP = dict(intermediate_size=64, max_position_embeddings=128)
ARCHITECTURES = {
    "llama": lambda: transformers.LlamaConfig(**LAYERS, **MLP),
    "qwen3": lambda: transformers.Qwen3Config(**LAYERS, **MLP, head_dim=8),
    "mistral": lambda: transformers.MistralConfig(**LAYERS, **MLP, sliding_window=WINDOW),
    "gemma2": lambda: transformers.Gemma2Config(
        **LAYERS, **MLP, head_dim=8, sliding_window=WINDOW, attn_logit_softcapping=50.0, final_logit_softcapping=30.0
    ),
    "gemma3": lambda: transformers.Gemma3TextConfig(
        **LAYERS, **MLP, head_dim=8, sliding_window=WINDOW, layer_types=["sliding_attention", "full_attention"]
    ),
    "phi3": lambda: transformers.Phi3Config(**LAYERS, **MLP, sliding_window=WINDOW, pad_token_id=0),
    "gpt2": lambda: transformers.GPT2Config(vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4, n_positions=128),
}
CP_TOLERANCE = 1e-5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("architectures")
    for name, config in ARCHITECTURES.items():
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            transformers.AutoModelForCausalLM.from_config(config()).save_pretrained(root / name)
    return root


def rows(seed: int = 0, *, left: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Two full rows, one left-padded (right-padded with ``left`` False: training rows) and one
    right-padded row, of ``WIDTH`` columns."""
    ids = torch.randint(1, VOCAB, (4, WIDTH), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones_like(ids)
    mask[2, :5] = 0
    if not left:
        mask[2] = mask[2].flip(0)
    mask[3, -6:] = 0
    return ids, mask


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_trainer_logprobs_equal_the_models_own_forward(checkpoints, name):
    model = load_model(checkpoints / name, dtype=torch.float32)
    ids, mask = rows()
    logprobs, _ = token_logprobs(model, ids, mask)
    with torch.no_grad():
        alone = model(input_ids=ids[:2]).logits.log_softmax(-1)[:, :-1].gather(-1, ids[:2, 1:, None]).squeeze(-1)
        left = model(input_ids=ids[2:3, 5:]).logits.log_softmax(-1)[:, :-1].gather(-1, ids[2:3, 6:, None]).squeeze(-1)
    torch.testing.assert_close(logprobs[:2, 1:], alone, rtol=0, atol=1e-5)
    torch.testing.assert_close(logprobs[2:3, 6:], left, rtol=0, atol=1e-5)  # positions count real tokens only


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_packed_rows_score_as_each_row_alone(checkpoints, name, monkeypatch):
    """trainer.packing on one rank: the rows' real tokens in one row, positions restarting and
    attention kept within each (per-segment sdpa, or query blocks of 4 where a window or a softcap
    applies), against the padded rows through the model's own attention."""
    monkeypatch.setattr(context_parallel, "QUERY_BLOCK", 4)
    model = load_model(checkpoints / name, dtype=torch.float32)
    ids, mask = rows()
    expected, _ = token_logprobs(model, ids, mask)
    enable_context_parallel_attention(model)
    packed, _ = token_logprobs(model, ids, mask, packed=True)
    scored = mask.bool() & (mask.cumsum(1) > 1)
    torch.testing.assert_close(packed[scored], expected[scored], rtol=0, atol=CP_TOLERANCE)


def test_a_softcapping_model_loads_with_the_attention_that_applies_its_softcap(checkpoints):
    ids, mask = rows()
    loaded, _ = token_logprobs(load_model(checkpoints / "gemma2", dtype=torch.float32), ids, mask)
    eager, _ = token_logprobs(
        load_model(checkpoints / "gemma2", dtype=torch.float32, attn_implementation="eager"), ids, mask
    )
    torch.testing.assert_close(loaded, eager, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("name", ARCHITECTURES)
def test_generation_scores_what_the_trainer_scores(checkpoints, name):
    model = load_model(checkpoints / name, dtype=torch.float32)
    ids, _ = rows(1)
    requests = [SampleRequest(ids[0, :14].tolist(), seed=1), SampleRequest(ids[1, :5].tolist(), seed=2)]
    generator = HFGenerator(model, stop_token_ids=[0], pad_token_id=0, batch_size=2)
    rollouts = generator.generate(requests, SamplingParams(max_new_tokens=10))
    for rollout in rollouts:
        full = torch.tensor([rollout.prompt_ids + rollout.response_ids])
        expected, _ = token_logprobs(model, full, torch.ones_like(full))
        response = torch.tensor(rollout.logprobs, dtype=torch.float32)
        torch.testing.assert_close(response, expected[0, len(rollout.prompt_ids) :], rtol=0, atol=1e-4)


def _dropped_window(*args, sliding_window=None, **kwargs):
    """The planted mistake: context-parallel attention that ignores the layer's sliding window."""
    return context_parallel_attention(*args, **kwargs)


def _cp_rank(rank: int, world_size: int, root: str) -> bytes:
    """Each architecture's full-row logprobs from this rank's CP shards, gathered, and Mistral's
    with the window dropped; rank 0 returns them. Query blocks of 4 columns, so every chunk spans
    several blocks and a window reaches across them."""
    context_parallel.QUERY_BLOCK = 4
    context = ContextParallel(dist.group.WORLD)
    transformers.AttentionInterface.register("dropped_window", _dropped_window)
    ids, mask = rows(left=False)
    results = {}
    for name in [*ARCHITECTURES, "planted"]:
        model = load_model(f"{root}/{'mistral' if name == 'planted' else name}", dtype=torch.float32)
        enable_context_parallel_attention(model)
        if name == "planted":
            model.set_attn_implementation("dropped_window")
        results[name] = context.full_logprobs(model, _batch(ids, mask))
        results[f"{name}/packed"] = context.full_logprobs(model, _batch(ids, mask), packed=True)
        if name == "planted":
            model.set_attn_implementation(PACKED_LEAK)
            results["packed-leak"] = context.full_logprobs(model, _batch(ids, mask), packed=True)
    buffer = io.BytesIO()
    torch.save(results if rank == 0 else None, buffer)
    return buffer.getvalue()


def _batch(ids: torch.Tensor, mask: torch.Tensor) -> TrainBatch:
    zeros = torch.zeros(ids.shape)
    lengths = torch.full((len(ids),), WIDTH)
    return TrainBatch(ids, mask, zeros, zeros, torch.zeros(len(ids)), lengths)


@pytest.mark.slow
def test_context_parallel_on_two_ranks_matches_a_single_rank_and_a_dropped_window_fails(checkpoints, monkeypatch):
    """Two CP ranks, padded rows and the same rows packed into one, against the plain model (its own
    attention, with a padding mask) and against one rank through the context-parallel attention (no
    mask, query blocks of 4). A dropped window fails, and so does a packed row attended as one
    sequence."""
    ids, mask = rows(left=False)
    real = F.pad(mask[:, 1:], (1, 0)).bool() & mask.bool()  # tokens with a real predecessor
    sharded = torch.load(io.BytesIO(launch(_cp_rank, 2, str(checkpoints))[0]))
    monkeypatch.setattr(context_parallel, "QUERY_BLOCK", 4)
    for name in ARCHITECTURES:
        model = load_model(checkpoints / name, dtype=torch.float32)
        with torch.no_grad():
            plain = model(input_ids=ids, attention_mask=mask).logits.log_softmax(-1)[:, :-1]
        plain = F.pad(plain.gather(-1, ids[:, 1:, None]).squeeze(-1), (1, 0))
        enable_context_parallel_attention(model)
        one_rank = ContextParallel().full_logprobs(model, _batch(ids, mask))
        for expected in (plain, one_rank):
            for layout in (name, f"{name}/packed"):
                error = (sharded[layout] - expected)[real].abs().max().item()
                assert error <= CP_TOLERANCE, (layout, error)
    expected, _ = token_logprobs(load_model(checkpoints / "mistral", dtype=torch.float32), ids, mask)
    for planted in ("planted", "planted/packed", "packed-leak"):
        assert (sharded[planted] - expected)[real].abs().max().item() > 100 * CP_TOLERANCE, planted


def test_context_parallel_refuses_an_architecture_it_was_not_verified_on(checkpoints, tmp_path):
    ray = ["runtime.name=ray", "parallel.cp=2"]
    assert load_config(None, [f"model.path={checkpoints / 'gemma2'}", *ray]).parallel.cp == 2
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "falcon"}))
    assert load_config(None, [f"model.path={tmp_path}"]).parallel.cp == 1
    with pytest.raises(
        ConfigError,
        match=r"^parallel\.cp: model\.path holds a 'falcon' model; context parallelism is verified for gemma2, ",
    ):
        load_config(None, [f"model.path={tmp_path}", *ray])
    with pytest.raises(
        ConfigError, match=r"^trainer\.packing: model\.path holds a 'falcon' model; packing is verified"
    ):
        load_config(None, [f"model.path={tmp_path}", "trainer.packing=true"])
