"""The ``skyrl_gym`` environment: any environment of the SkyRL-Gym library, one instance per episode.

SkyRL-Gym (``pip install 'asyncrl[skyrl-gym]'``) environments are text in, messages out:
``init(chat)`` gives the opening messages, ``step(text)`` the observation messages, a reward and
whether the episode is over. Each asyncrl episode makes one with ``skyrl_gym.make(env, ...)``,
passing the prompt's answer as ``extras.reward_spec.ground_truth`` (the layout its built-in
environments read). A step's rewards add up over the episode, whose reward is the sum once it is
done. The library is imported only when an episode starts, so asyncrl runs without it.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from asyncrl.data.prompts import Prompt
from asyncrl.environments.base import Environment, Message, Turn


def _skyrl_gym():
    try:
        import skyrl_gym
    except ImportError:
        raise ValueError(
            "environment.name: skyrl_gym needs the SkyRL-Gym library; pip install 'asyncrl[skyrl-gym]'"
        ) from None
    return skyrl_gym


class SkyRLGymEnvironment(Environment):
    class Options(BaseModel):
        model_config = ConfigDict(extra="forbid")

        env: str = Field(description="the SkyRL-Gym environment id, e.g. gsm8k or gsm8k_multi_turn")
        env_config: dict[str, Any] = Field(default_factory=dict, description="its env_config")
        extras: dict[str, Any] = Field(
            default_factory=dict, description="more of its extras (max_turns, ...); reward_spec comes from the prompt"
        )

    def __init__(self, options: SkyRLGymEnvironment.Options) -> None:
        registry = _skyrl_gym().registry
        if options.env not in registry:
            raise ValueError(
                f"environment.options.env: SkyRL-Gym has no environment '{options.env}' ({', '.join(registry)})"
            )
        self.env_id, self.env_config, self.extras = options.env, options.env_config, options.extras
        self.env = None
        self.reward = 0.0

    def reset(self, prompt: Prompt) -> list[Message]:
        extras = {**self.extras, "reward_spec": {"method": "rule", "ground_truth": prompt.answer}}
        self.env = _skyrl_gym().make(self.env_id, env_config=self.env_config, extras=extras)
        messages, _ = self.env.init([{"role": "user", "content": prompt.text}])
        return list(messages)

    def step(self, assistant: Message) -> Turn:
        output = self.env.step(assistant["content"])
        self.reward += float(output["reward"])
        if output["done"]:
            self.env.close()
            return Turn([], done=True, reward=self.reward)
        return Turn(list(output["observations"]), done=False)
