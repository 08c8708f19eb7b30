"""Experiment dataclasses: pick one with `experiment=NAME`, subclass one to add fields."""

from experiments.async_ppo_math import AsyncPPOMATHConfig
from experiments.async_ppo_math_long import AsyncPPOMathLongConfig
from experiments.async_ppo_math_tools import AsyncPPOMATHToolsConfig
from experiments.async_ppo_openai_agent import AsyncPPOOpenAIAgentConfig
from experiments.async_ppo_multi_turn import AsyncPPOFrozenLakeConfig, AsyncPPOMathMultiTurnConfig, \
    AsyncPPOSokobanConfig, AsyncPPOTextGameConfig, AsyncPPOTurnBasedConfig
from experiments.async_ppo_mixed_games import AsyncPPOMixedGamesConfig
from experiments.async_ppo_webshop import AsyncPPOWebShopConfig
from experiments.common import AsyncRLExperimentConfig, PPOMATHConfig
from rlsys.api.experiment import EXPERIMENTS, register_experiment

__all__ = ["AsyncPPOMATHConfig", "AsyncPPOMATHToolsConfig", "AsyncPPOMixedGamesConfig", "AsyncPPOFrozenLakeConfig",
           "AsyncPPOMathLongConfig", "AsyncPPOMathMultiTurnConfig", "AsyncPPOOpenAIAgentConfig",
           "AsyncPPOSokobanConfig", "AsyncPPOTextGameConfig", "AsyncPPOTurnBasedConfig", "AsyncPPOWebShopConfig",
           "AsyncRLExperimentConfig", "PPOMATHConfig", "EXPERIMENTS", "register_experiment"]
