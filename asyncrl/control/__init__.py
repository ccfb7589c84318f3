"""The control side: the controller and the components it drives.

Nothing here touches a model. The controller (controller.py) runs the train loop and moves
metadata between the replay buffer, the staleness sampler and the workers' handles; the rollout
loop (rollout_loop.py), the weight sync (weight_sync.py) and dynamic sampling (refill.py) are each
a component of their own. The rollout gate (gate.py), which admission and weight syncs share, and
``Changes`` (changes.py), the one thing every loop waits on, sit below them all.
"""
