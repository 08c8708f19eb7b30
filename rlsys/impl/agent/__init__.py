"""Built-in agents; importing this package registers them."""

from rlsys.impl.agent import math_multi_turn, math_single_step, openai_agent, text_game, tool_calling  # noqa: F401
