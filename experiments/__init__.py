"""Experiment dataclasses: pick one with `experiment=NAME`, subclass one to add fields."""

from experiments.async_ppo_math import AsyncPPOMATHConfig
from experiments.common import AsyncRLExperimentConfig, PPOMATHConfig
from experiments.registry import EXPERIMENTS, register_experiment

__all__ = ["AsyncPPOMATHConfig", "AsyncRLExperimentConfig", "PPOMATHConfig", "EXPERIMENTS", "register_experiment"]
