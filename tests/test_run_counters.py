"""rlsys/run_counters.py: what a checkpoint records of the run's counters is what a resume from it restores."""

from rlsys import protocol, run_counters
from rlsys.bus import InProcessBus


def test_a_resume_takes_the_counters_back_to_what_its_checkpoint_recorded_and_a_fresh_run_to_zero():
    bus = InProcessBus()
    assert run_counters.held(bus) == run_counters.AT_THE_START
    for _ in range(3):
        run_counters.count_weight_check(bus)
    bus.stream_add(protocol.DEAD_LETTERS, {"reason": "before the checkpoint"})
    recorded = run_counters.held(bus)  # as the learner's checkpoint keeps it
    assert recorded == {"weight_checks": 3, "dead_letters": 1}
    run_counters.count_weight_check(bus)
    bus.stream_add(protocol.DEAD_LETTERS, {"reason": "after it"})
    run_counters.take_back(bus, {"step": 2, **recorded})
    assert run_counters.held(bus) == recorded
    assert [e.decode(protocol.DEAD_LETTERS)["reason"] for e in bus.stream_range(protocol.DEAD_LETTERS, 10)] == \
        ["before the checkpoint"]
    run_counters.take_back(bus, {"step": 2})  # a checkpoint from before the counters were kept leaves them
    assert run_counters.held(bus) == recorded
    run_counters.clear(bus)
    assert run_counters.held(bus) == run_counters.AT_THE_START
