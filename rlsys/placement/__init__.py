"""Where a run's roles run: processes on this machine, or Ray actors on a Ray cluster (`cluster.backend`).

The launcher and the supervisor see only `Placement.start(role, index, args) -> RoleHandle`; which
implementation runs the roles is chosen here, once.
"""

import contextlib

from rlsys.placement.base import Placement, PlacementError, RoleHandle


@contextlib.contextmanager
def open_placement(config, entry):
    """The placement `config.cluster.backend` names, running `entry(role, index, *args, env)` for each role;
    closed (every role it started gone) on every way out. PlacementError if the layout cannot be placed."""
    if config.cluster.backend == "ray":
        from rlsys.placement.ray_actors import RayPlacement

        placement = RayPlacement(config, entry)
    else:
        from rlsys.placement.local import LocalPlacement

        placement = LocalPlacement(config, entry)
    try:
        yield placement
    finally:
        placement.close()


__all__ = ["Placement", "PlacementError", "RoleHandle", "open_placement"]
