"""Commands beside training, each a check or a conversion a user runs on its own:

- ``verify``: ``asyncrl verify``, a split or parallel train step against the monolithic one;
- ``plants``: the planted mistakes ``verify --plant`` must catch;
- ``merge``: ``asyncrl merge``, a LoRA checkpoint's adapter added into its base.

(The tools a model calls in an episode are ``environments/tools.py``.)
"""
