"""Multi-turn episodes: the environment seam (base.py) and the token-in / token-out loop (episode.py)."""

from asyncrl.environments.base import Environment, Message, Turn

__all__ = ["Environment", "Message", "Turn"]
