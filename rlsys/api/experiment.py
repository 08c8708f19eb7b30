"""Experiments by name, so `experiment=NAME` picks one on the command line and a worker process rebuilds the
same one. An experiment is a dataclass of settings (experiments/common.py holds the built-in groups); the
built-in experiments and a user's plugins register here, in the library, as agents and environments do."""

from rlsys.api.registry import Registry

EXPERIMENTS: Registry = Registry("experiment")


def register_experiment(name: str, cls: type) -> None:
    EXPERIMENTS.register(name, cls)
