"""asyncrl's tool environments as TRL environments: the episodes of ``--against trl`` when the run
config has an ``environment``.

TRL's GRPOTrainer runs tool episodes itself (``environment_factory``): it parses each model turn
with the tokenizer's ``response_template``, calls the environment's public methods as tools,
appends their results through the chat template and masks them out of the loss. The adapter gives
it asyncrl's episodes: the prompt messages of the environment's ``reset``, one method per tool in
``functions`` that goes through the environment's own ``call_tool`` (its tool box, error
observations and simulated latency, seeded by the prompt as in asyncrl), and a response template
that reads the Hermes calls of asyncrl's chat template. Only tool environments fit: TRL has no
other kind of environment turn.
"""

from __future__ import annotations

import inspect
from typing import Any

from asyncrl.config import ConfigError, RunConfig
from asyncrl.data import Prompt
from asyncrl.environments.base import environment_class
from asyncrl.environments.tool_env import ToolEnvironment
from asyncrl.models.tokenizer import CHAT_TEMPLATE

# How TRL's parse_response reads a turn of CHAT_TEMPLATE: Hermes tool calls, then the answer up to EOS.
RESPONSE_TEMPLATE = {
    "defaults": {"role": "assistant"},
    "start_anchor": "A:",
    "fields": {
        "tool_calls": {
            "open": "<tool_call>",
            "close_pattern": r"</tool_call>",
            "repeats": True,
            "content": "json",
            "transform": {"type": "function", "function": "{content}"},
        },
        "content": {"close_pattern": r"<eos>", "content": "text"},
    },
}
UNMATCHED = {
    "environment.max_turns": "TRL counts tool rounds: max_tool_calling_iterations is max_turns - 1",
    "generation.max_new_tokens": "TRL has one token budget for a whole episode, environment.max_tokens; "
    "asyncrl's turns also stop at max_new_tokens",
    "tool-call parse errors": "TRL reads a turn whose call it cannot parse as the answer; asyncrl answers "
    "it with an error observation and the episode goes on",
    "tool calls at once": "TRL calls the tools of a batch one at a time; asyncrl runs each episode's "
    "environment step on a thread of its own",
}


def require_tool_environment(config: RunConfig) -> type[ToolEnvironment]:
    """The config's environment class, or a one-line error when TRL cannot run its episodes."""
    found = environment_class(config)
    if found is None or not issubclass(found.cls, ToolEnvironment):
        raise ConfigError(
            f"--against trl: environment.name {config.environment.name!r} is not a tool environment; TRL's "
            "GRPOTrainer runs only tool-calling episodes"
        )
    if found.options.parser != "hermes":
        raise ConfigError("--against trl: environment.options.parser: TRL reads only Hermes tool calls here")
    return found.cls


def trl_environment(config: RunConfig) -> type:
    """A TRL environment class: each instance plays asyncrl's environment for one episode at a time."""
    environment = environment_class(config)
    cls = environment.cls

    def reset(self, uid: str, prompt: list, **_: Any) -> None:
        self.env = environment.build()
        self.env.reset(Prompt(uid, prompt[-1]["content"], ""))  # seeds the episode's latencies by its uid

    methods = {"reset": reset, **{fn.__name__: _tool_method(fn) for fn in cls.functions}}
    return type(f"Trl{cls.__name__}", (), methods)


def _tool_method(fn: Any) -> Any:
    """A method with ``fn``'s name, signature and docstring (what TRL shows the model) that calls
    the episode's environment."""
    name, signature = fn.__name__, inspect.signature(fn)

    def method(self, *args: Any, **kwargs: Any) -> str:
        return self.env.call_tool(name, signature.bind(*args, **kwargs).arguments).content

    method.__name__ = method.__qualname__ = name
    method.__doc__ = fn.__doc__
    method.__annotations__ = inspect.get_annotations(fn, eval_str=True)
    self_parameter = inspect.Parameter("self", inspect.Parameter.POSITIONAL_OR_KEYWORD)
    method.__signature__ = signature.replace(parameters=[self_parameter, *signature.parameters.values()])
    return method


def episode_prompts(config: RunConfig, prompts: list[Prompt]) -> list[list[dict]]:
    """Each prompt's opening messages, as the environment's ``reset`` gives them."""
    environment = environment_class(config)
    return [environment.build().reset(prompt) for prompt in prompts]


def use_response_template(tokenizer: Any) -> None:
    """Let TRL read asyncrl's chat template; other templates are left to TRL's own known ones."""
    if tokenizer.chat_template == CHAT_TEMPLATE:
        tokenizer.response_template = RESPONSE_TEMPLATE


def answer_text(completion: list[dict]) -> str:
    """What asyncrl's rewards score in an episode: its last model turn's text."""
    return next((m.get("content") or "" for m in reversed(completion) if m["role"] == "assistant"), "")
