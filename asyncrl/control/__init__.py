"""The control side: the controller and what it keeps the books with.

Nothing here touches a model. The controller moves metadata between the replay buffer, the
staleness sampler and the workers' handles; dynamic sampling (refill) is its own object.
"""
