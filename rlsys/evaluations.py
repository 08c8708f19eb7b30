"""The held-out evaluations' results on the bus (protocol.eval_result): rollout worker 0 records each, INITIAL at each
start of the roles, "step-N" every eval_interval versions and FINAL after the last; the learner's checkpoint keeps the
run's first, the launcher's summary reports them, and its console and stall watch tell by the initial one whether the
run is still starting. One owner, so that every reader means the same by "the initial evaluation has ended"."""

from rlsys import protocol

INITIAL, FINAL = "initial", "final"


def record(bus, tag: str, result: dict) -> None:
    bus.set(protocol.eval_result(tag), result)


def result(bus, tag: str) -> dict | None:
    """The result of the evaluation `tag`; None until it has ended."""
    return bus.get(protocol.eval_result(tag))


def initial_evaluation_ended(bus) -> bool:
    """Whether this start of the roles' first evaluation (a resumed run's, of its checkpoint's weights) has ended: until
    it has, the run is starting."""
    return bool(result(bus, INITIAL))
