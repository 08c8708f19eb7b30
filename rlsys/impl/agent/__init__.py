"""Built-in agents; importing this package registers them."""

from rlsys.impl.agent import math_single_step, tool_calling  # noqa: F401
