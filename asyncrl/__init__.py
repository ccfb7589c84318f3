"""asyncrl: asynchronous GRPO post-training with a single controller."""

__version__ = "0.1.0"
