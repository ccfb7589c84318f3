"""The rollout wing, beside ``trainer/``: what turns prompts into scored groups.

- ``worker``: ``RolloutWorker``, prompts -> episodes -> rewards -> ``RolloutGroup``;
- ``episode``: the episode engine, one response (``SingleTurn``) or token-in / token-out turns
  against an environment (``MultiTurn``), observations as template deltas;
- ``context``: how long a run's requests can be (a server's context, the prompt-length check).

The environments themselves, the seam users write to and the built-ins, stay in ``environments/``.
"""

from asyncrl.rollout.worker import RolloutWorker

__all__ = ["RolloutWorker"]
