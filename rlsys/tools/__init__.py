"""Tools for agents: the code sandbox, the tool-call format and the built-in tools (registered on import)."""

from rlsys.tools import calculator, python_interpreter  # noqa: F401
