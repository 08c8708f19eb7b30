"""Built-in environments; importing this package registers them."""

from rlsys.impl.env import (frozen_lake, math_code_single_step, math_tools, reward_model, sokoban,  # noqa: F401
                             trl_rewards, webshop)
