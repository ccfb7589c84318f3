"""Multi-turn episodes on the real vLLM CPU server: the sampled tokens and their logprobs come back
from the server, each observation is the chat template's delta, masked, and every sampled token
carries the weight version the server reports."""

from functools import partial

import pytest

from asyncrl.cli import main
from asyncrl.data import Prompt
from asyncrl.environments.feedback import FeedbackEnvironment
from asyncrl.environments.search import SearchEnvironment
from asyncrl.generation import SamplingParams
from asyncrl.metrics import read_jsonl
from asyncrl.models.tokenizer import build_char_tokenizer
from asyncrl.rollout.episode import OBSERVATION_VERSION, EpisodeLimits, MultiTurn

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200), pytest.mark.xdist_group("vllm")]


def digit_turns(vllm_generator, environment, turns, prompts, seeds, max_new_tokens):
    """(the chat tokenizer, the episodes of ``prompts`` on the server), each model turn ending at
    its first digit: the untrained model's turns are short and every environment sees an answer."""
    tokenizer = build_char_tokenizer(chat=True)  # the server's vocabulary, then the chat characters
    ids = tokenizer("0123456789", add_special_tokens=False)["input_ids"]
    stops, saved = ids + [tokenizer.eos_token_id], vllm_generator.stop_token_ids
    vllm_generator.stop_token_ids = stops
    make_env = partial(environment, environment.Options())  # its options at their defaults, as a run builds it
    episodes = MultiTurn(vllm_generator, tokenizer, make_env, stop_token_ids=stops, limits=EpisodeLimits(turns, 60))
    try:
        return tokenizer, episodes.run(prompts, seeds, SamplingParams(max_new_tokens=max_new_tokens))
    finally:
        episodes.close()
        vllm_generator.stop_token_ids = saved


def test_episodes_run_on_the_vllm_server_with_masked_template_deltas(vllm_generator):
    prompts = [Prompt(f"p{i}", f"{i}+{i}=", str(2 * i)) for i in range(4)]
    tokenizer, completions = digit_turns(vllm_generator, FeedbackEnvironment, 3, prompts, [1, 2, 3, 4], 12)
    assert max(c.metrics["turns"] for c in completions) > 1
    for completion in completions:
        rollout = completion.rollout
        sampled = [i for i, m in enumerate(rollout.loss_mask) if m]
        observed = [i for i, m in enumerate(rollout.loss_mask) if not m]
        assert all(rollout.logprobs[i] < 0 for i in sampled) and all(rollout.logprobs[i] == 0 for i in observed)
        assert {rollout.versions[i] for i in sampled} == {vllm_generator.version}
        assert {rollout.versions[i] for i in observed} <= {OBSERVATION_VERSION}
        for span in _masked_spans(rollout.response_ids, rollout.loss_mask):
            assert tokenizer.decode(span) in {"U:too high\nA:", "U:too low\nA:", "U:a number?\nA:"}


def test_search_episodes_run_on_the_vllm_server(vllm_generator):
    """The search environment's episodes on the server: every wrong guess is answered, masked,
    and a guess that hits ends the episode with the environment's reward."""
    prompts = [Prompt(f"search/10/{i}", "0-9", str(i % 10)) for i in range(8)]
    tokenizer, completions = digit_turns(vllm_generator, SearchEnvironment, 4, prompts, list(range(8)), 8)
    assert max(c.metrics["turns"] for c in completions) > 1
    for completion in completions:
        rollout = completion.rollout
        assert {rollout.versions[i] for i, m in enumerate(rollout.loss_mask) if m} == {vllm_generator.version}
        for span in _masked_spans(rollout.response_ids, rollout.loss_mask):
            assert tokenizer.decode(span) in {"U:up\nA:", "U:down\nA:", "U:?\nA:"}
        solved = completion.metrics.get("solved") == 1.0  # a turn cut at max_new_tokens is never answered
        assert (completion.reward is not None) == solved and completion.metrics["turns"] <= 4


def test_a_multi_turn_run_sizes_its_server_for_the_templated_opening_and_the_whole_episode(tmp_path, vllm_python):
    """configs/multi-turn.yaml on a server of its own with the default context (no
    generation.backend.options.max_model_len): the opening templates to 11 tokens where the raw prompt has 6, and a
    later turn sends the transcript, so the server holds 11 + environment.max_tokens 48 +
    generation.max_new_tokens 6. Every turn is served: no generation fails."""
    run_dir = tmp_path / "run"
    overrides = ["generation.backend.name=vllm", "step.max_steps=2", "step.prompts_per_step=4", "warm_start.steps=60",
                 "data.eval_size=8", "checkpoint.every_steps=null", "logging.progress=false",
                 "runtime.max_rollout_retries=0"]  # fmt: skip
    assert main(["train", "--config", "configs/multi-turn.yaml", "--output-dir", str(run_dir), *overrides]) == 0
    [log] = (run_dir / "vllm").glob("server-*.log")
    assert "'max_model_len': 65," in log.read_text()  # the server's arguments, as it logs them
    assert max(row["episode/turns"] for row in read_jsonl(run_dir / "metrics.jsonl")) > 1


def _masked_spans(ids: list[int], mask: list[int]) -> list[list[int]]:
    spans, current = [], []
    for token, trained in zip(ids, mask):
        if not trained:
            current.append(token)
        elif current:
            spans, current = [*spans, current], []
    return spans + ([current] if current else [])
