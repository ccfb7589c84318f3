"""The longest request of a run: with an environment, the templated opening (role markers, tool
list) and the whole episode, then a turn's sampled tokens; not the raw prompt."""

import pytest

from asyncrl.config import load_config
from asyncrl.data import build_task, check_prompt_lengths, longest_prompt
from asyncrl.environments.base import environment_class
from asyncrl.generation.vllm import served_context
from asyncrl.generation.vllm_options import VLLMOptions
from asyncrl.models.factory import build_tokenizer
from asyncrl.rollout.context import first_requests, request_bound


@pytest.mark.parametrize(
    "path, overrides, raw, opening, bound",
    [
        # role markers around the problem: 6 + 5 tokens; 3 turns and 2 replies within 48 tokens, then 6 sampled
        ("configs/multi-turn.yaml", [], 6, 11, 11 + 48 + 6),
        # the tool list opens the transcript (every problem is 3 x 3 digits: a few hundred stand for 64000)
        ("configs/tool-use.yaml", ["data.task.options.num_problems=300"], 8, 32, 32 + 128 + 96),
    ],
)
def test_a_runs_longest_request_is_its_templated_opening_its_episode_and_a_turn(path, overrides, raw, opening, bound):
    config = load_config(path, ["generation.backend.name=vllm", *overrides])
    tokenizer = build_tokenizer(config)
    task = build_task(config.data, tokenizer)
    assert longest_prompt(task, tokenizer) == raw
    longest, budget = request_bound(task, config, environment_class(config), tokenizer)
    assert (longest, longest + budget.tokens) == (opening, bound)
    assert served_context((longest, budget), VLLMOptions(), 1024) == bound
    check_prompt_lengths(first_requests(task, environment_class(config), tokenizer), task, config, bound)
    with pytest.raises(ValueError, match=rf"the templated opening is {opening} tokens, and with environment.max_tok"):
        check_prompt_lengths(first_requests(task, environment_class(config), tokenizer), task, config, bound - 1)
    with pytest.raises(
        ValueError,
        match=rf"^generation.backend.options.max_model_len: {bound - 1} tokens do not hold .* raise it to {bound}",
    ):
        served_context((longest, budget), VLLMOptions(max_model_len=bound - 1), 1024)
