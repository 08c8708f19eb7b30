"""Built-in environments; importing this package registers them."""

from rlsys.impl.env import math_code_single_step, math_tools  # noqa: F401
