"""rlsys: asynchronous reinforcement learning for language-model agents."""

__version__ = "0.1.0"
