"""The control side: the controller and what it keeps the books with.

Nothing here touches a model. The controller moves metadata between the replay buffer, the
staleness sampler and the workers' handles; dynamic sampling (refill) is its own object. The
rollout gate (gate.py), which admission and weight syncs share, and ``Changes`` (changes.py), the
one thing every loop waits on, are the controller's too; weights/sync.py drives the gate.
"""
