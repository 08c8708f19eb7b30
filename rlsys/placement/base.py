"""The small interface both placements implement: start a role, watch it, stop it."""

import abc
import contextlib
import signal


class PlacementError(RuntimeError):
    """The roles' layout does not fit the machine or cluster; the message says what fits."""


class RoleHandle(abc.ABC):
    """One running role (a process or an actor), as the supervisor watches it."""

    name: str

    @property
    @abc.abstractmethod
    def exitcode(self) -> int | None:
        """None while it runs; 0 when it finished its part; anything else when it died or gave up."""

    @property
    def exit_reason(self) -> str:
        return f"exited with code {self.exitcode}"

    def is_alive(self) -> bool:
        return self.exitcode is None

    @abc.abstractmethod
    def join(self, timeout: float) -> None:
        """Wait up to `timeout` seconds for it to end."""

    @abc.abstractmethod
    def kill(self) -> None:
        """End it now and wait until it is gone."""


class Placement(abc.ABC):
    """Starts roles somewhere. `bus_host`: the address a private Redis must listen on so every role reaches it."""

    bus_host: str = "127.0.0.1"

    @abc.abstractmethod
    def start(self, role: str, index: int, args: tuple) -> RoleHandle:
        """Runs `entry(role, index, *args, env)` (env: variables for that role, e.g. its GPUs and rank)."""

    @abc.abstractmethod
    def close(self) -> None:
        """Every role started here is gone; resources taken for the run are given back."""


def process_exit(code: int) -> str:
    """How a process ended, from its exit code: a negative code is the signal that ended it (-6: SIGABRT)."""
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"exited with code {code} ({signal.Signals(-code).name})"
    return f"exited with code {code}"


def learner_rendezvous(index: int, world_size: int, address: str, port: int) -> dict[str, str]:
    """torch.distributed's env:// rendezvous for learner rank `index` (rank 0 listens at address:port)."""
    return {"RANK": str(index), "WORLD_SIZE": str(world_size), "MASTER_ADDR": address, "MASTER_PORT": str(port)}
