"""Prompt accounting: every admitted prompt ends in exactly one outcome, and the counts survive a resume."""

import pytest

from rlsys import accounting, protocol
from rlsys.bus import InProcessBus


def test_each_admitted_prompt_is_counted_once_in_one_outcome():
    bus = InProcessBus()
    for qid in ("a", "b", "c", "d", "e"):
        assert accounting.admit(bus, qid)
    assert not accounting.admit(bus, "a")  # already in flight: not admitted twice
    assert accounting.settle(bus, "a", accounting.TRAINED)
    assert not accounting.settle(bus, "a", accounting.failed("agent_error"))  # a second report changes nothing
    assert accounting.settle(bus, "b", accounting.filtered("uniform_reward"))
    assert accounting.settle(bus, "c", accounting.failed("env_timeout"))
    assert not accounting.settle(bus, "never-admitted", accounting.TRAINED)
    counts = accounting.counts(bus)
    assert counts == {"admitted": 5, "trained": 1, "filtered": {"uniform_reward": 1}, "failed": {"env_timeout": 1},
                      "in_flight": 2}
    assert accounting.accounted(counts) == 5
    final = accounting.end_run(bus)  # d and e were still running
    assert final["filtered"] == {"uniform_reward": 1, "run_ended": 2} and final["in_flight"] == 0
    assert accounting.describe(final) == ("prompts: 5 admitted = 1 trained + 3 filtered (run_ended 2, "
                                          "uniform_reward 1) + 1 failed (env_timeout 1)")
    assert accounting.as_metrics(final)["prompts/filtered/run_ended"] == 2


def test_a_prompt_that_will_not_be_trained_gives_its_gate_slot_back_once():
    bus = InProcessBus()
    bus.set(protocol.ADMITTED, 4)
    accounting.admit(bus, "a")
    assert accounting.settle_untrained(bus, "a", accounting.failed("env_error"))
    assert not accounting.settle_untrained(bus, "a", accounting.failed("env_error"))
    assert bus.get(protocol.ADMITTED) == 3


def test_unknown_reasons_are_refused():
    with pytest.raises(ValueError, match="known"):
        accounting.failed("oops")
    with pytest.raises(ValueError, match="run_ended"):
        accounting.filtered("oops")


def test_counts_survive_a_resume_without_the_prompts_then_in_flight():
    bus = InProcessBus()
    for qid in "abcd":
        accounting.admit(bus, qid)
    accounting.settle(bus, "a", accounting.TRAINED)
    accounting.settle(bus, "b", accounting.failed("agent_error"))
    snapshot = accounting.settled_snapshot(bus)  # what a checkpoint keeps; c and d will be admitted again
    assert snapshot == {"admitted": 2, "trained": 1, "filtered": {}, "failed": {"agent_error": 1}, "in_flight": 0}

    resumed = InProcessBus()
    resumed.set_add(protocol.PROMPTS_IN_FLIGHT, "stale")  # left by the crashed run on the same Redis
    accounting.restore(resumed, snapshot)
    for qid in "cd":
        accounting.admit(resumed, qid)
        accounting.settle(resumed, qid, accounting.TRAINED)
    final = accounting.end_run(resumed)
    assert final == {"admitted": 4, "trained": 3, "filtered": {}, "failed": {"agent_error": 1}, "in_flight": 0}
    accounting.restore(resumed, None)  # a fresh run starts from zero
    assert accounting.counts(resumed)["admitted"] == 0
