"""The run's counters on the bus that a checkpoint keeps: how many weight updates an inference worker verified
(protocol.WEIGHT_CHECKS) and how many trajectory messages the learner set aside (protocol.DEAD_LETTERS, whose entries
rlsys.delivery writes). The learner's checkpoint records what they held (`held`); a run resumed from it takes back
what the steps after it added (`take_back`), and a fresh run starts them at zero (`clear`). Kept together, so that
what a checkpoint records and what a resume restores stay the same count."""

from rlsys import protocol

AT_THE_START = {"weight_checks": 0, "dead_letters": 0}  # what `held` reads on a fresh run's bus


def count_weight_check(bus) -> None:
    """One more weight update whose checksum an inference worker verified."""
    bus.incr(protocol.WEIGHT_CHECKS)


def held(bus) -> dict:
    """What the counters hold now, under the names a trainer state and the run's summary keep them by."""
    return {"weight_checks": bus.get(protocol.WEIGHT_CHECKS) or 0,
            "dead_letters": bus.stream_length(protocol.DEAD_LETTERS)}


def clear(bus) -> None:
    """A fresh run's counters: nothing from an earlier run on the same Redis."""
    bus.delete(protocol.WEIGHT_CHECKS, protocol.DEAD_LETTERS)


def take_back(bus, trainer_state: dict) -> None:
    """The counters back to what `held` read when the checkpoint of `trainer_state` was saved: the weight checks to its
    count, the dead letters set aside after it deleted (their prompts, back in flight, are admitted again). A
    checkpoint from before the counters were kept leaves them as they are."""
    if (checks := trainer_state.get("weight_checks")) is not None:
        bus.delete(protocol.WEIGHT_CHECKS)
        if checks:
            bus.incr(protocol.WEIGHT_CHECKS, checks)
    if (kept := trainer_state.get("dead_letters")) is not None:
        bus.stream_delete(protocol.DEAD_LETTERS, [entry.id for entry in bus.stream_range(protocol.DEAD_LETTERS, 2**31)
                                                  [kept:]])
