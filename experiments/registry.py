"""Experiments by name, so `experiment=NAME` picks one on the command line."""

from rlsys.api.registry import Registry

EXPERIMENTS: Registry = Registry("experiment")


def register_experiment(name: str, cls: type) -> None:
    EXPERIMENTS.register(name, cls)
