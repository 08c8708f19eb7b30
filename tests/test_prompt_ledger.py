"""The prompt ledger over the in-process bus, through every path: the gate's slots, admission, each outcome, a
crash, a resume, a too-stale group and the run's end. Every admitted prompt ends in exactly one outcome."""

import pytest

from rlsys.bus import InProcessBus, Step
from rlsys.prompt_ledger import (ADMITTED, CLOSED, FAILURE_REASONS, FILTER_REASONS, GATE_FULL, IN_FLIGHT, PromptLedger,
                                 accounted, as_metrics, describe, failed, filtered, settled_prompts)

BATCH, ETA = 2, 1  # capacity at served version v: (v + 1 + 1) * 2


def ledger(bus=None) -> PromptLedger:
    ledger = PromptLedger(bus or InProcessBus(), BATCH, ETA)
    ledger.start()
    return ledger


def test_the_gate_admits_capacity_prompts_and_opens_as_versions_are_served():
    gate = ledger()
    assert gate.capacity(0) == 4 and gate.capacity(3) == 10
    assert [gate.admit(qid, 0) for qid in "abcde"] == [ADMITTED] * 4 + [GATE_FULL]  # a refused one changes nothing
    assert gate.slots_taken() == 4 and gate.counts()["admitted"] == 4 and gate.in_flight() == list("abcd")
    assert gate.admit("e", 1) == gate.admit("f", 1) == ADMITTED and gate.admit("g", 1) == GATE_FULL


def test_the_callers_own_writes_are_made_with_an_admission_or_a_settlement_and_only_then():
    bus = InProcessBus()
    gate = ledger(bus)
    mine = (Step.incr("position"), Step.add("my-episodes", "a"))
    assert gate.admit("a", 0, mine) == ADMITTED and gate.admit("a", 0, mine) == IN_FLIGHT
    assert bus.get("position") == 1 and bus.set_members("my-episodes") == ["a"]
    gate.hold_slots(4)
    assert gate.admit("b", 0, (Step.incr("position"),)) == GATE_FULL and bus.get("position") == 1
    done = (Step.remove("my-episodes", "a"),)
    assert gate.untrained("a", failed("env_error"), done) and bus.set_members("my-episodes") == []
    bus.change([Step.add("my-episodes", "a")])
    assert not gate.untrained("a", failed("env_error"), done) and bus.set_members("my-episodes") == ["a"]
    assert gate.slots_taken() == 3  # given back once


def test_each_admitted_prompt_is_counted_once_in_one_outcome():
    book = ledger()
    for qid in "abcde":
        assert book.admit(qid, 10) == ADMITTED
    assert book.admit("a", 10) == IN_FLIGHT  # already in flight: not admitted twice, no slot taken
    assert book.slots_taken() == 5
    assert book.trained("a")
    assert not book.untrained("a", failed("agent_error"))  # a second report changes nothing
    assert book.untrained("b", filtered("uniform_reward"))
    assert book.untrained("c", failed("env_timeout"))
    assert not book.trained("never-admitted")
    counts = book.counts()
    assert counts == {"admitted": 5, "trained": 1, "filtered": {"uniform_reward": 1}, "failed": {"env_timeout": 1},
                      "in_flight": 2}
    assert book.slots_taken() == 3  # b and c gave theirs back; a holds its slot: a trained version opens the gate
    assert accounted(counts) == 5
    final = book.end_run()  # d and e were still running
    assert final["filtered"] == {"uniform_reward": 1, "run_ended": 2} and final["in_flight"] == 0
    assert describe(final) == ("prompts: 5 admitted = 1 trained + 3 filtered (run_ended 2, "
                               "uniform_reward 1) + 1 failed (env_timeout 1)")
    assert as_metrics(final)["prompts/filtered/run_ended"] == 2


def test_a_prompt_that_will_not_be_trained_gives_its_gate_slot_back_once():
    book = ledger()
    for qid in "ab":
        book.admit(qid, 0)
    assert book.untrained("a", failed("env_error"))
    assert not book.untrained("a", failed("env_error"))
    assert book.slots_taken() == 1


def test_unknown_reasons_are_refused():
    with pytest.raises(ValueError, match="known"):
        failed("oops")
    with pytest.raises(ValueError, match="run_ended"):
        filtered("oops")


def test_a_prompt_that_failed_before_the_checkpoint_is_not_run_again_after_a_resume_nor_counted_twice():
    """The learner's consumed prompts hold only trained and filtered ones: the checkpoint names the failed ones,
    and keeps naming them through a second resume."""
    book = ledger()
    for qid in "abc":
        book.admit(qid, 0)
    book.trained("a")
    book.untrained("b", failed("env_error"), ())
    trainer_state = {"consumed_prompts": ["a"], "accounting": book.snapshot()}  # c was in flight: it runs again
    assert settled_prompts(trainer_state) == {"a", "b"}
    for _ in range(2):  # resumed, then resumed again from the resumed run's checkpoint
        resumed = PromptLedger(InProcessBus(), BATCH, ETA)
        resumed.start(version=0, snapshot=trainer_state["accounting"])
        trainer_state["accounting"] = resumed.snapshot()
        assert settled_prompts(trainer_state) == {"a", "b"}
    resumed.admit("c", 0)
    resumed.untrained("c", failed("agent_error"))
    final = resumed.end_run()
    assert final == {"admitted": 3, "trained": 1, "filtered": {}, "failed": {"env_error": 1, "agent_error": 1},
                     "in_flight": 0}


def test_a_checkpoint_from_before_failed_prompts_were_named_keeps_its_failure_counts():
    resumed = PromptLedger(InProcessBus(), BATCH, ETA)
    resumed.start(version=1, snapshot={"admitted": 3, "trained": 2, "filtered": {}, "failed": {"env_error": 1},
                                       "in_flight": 0})
    resumed.admit("d", 2)
    resumed.untrained("d", failed("env_error"))
    assert resumed.snapshot()["failed"] == {"env_error": 2} and resumed.snapshot()["admitted"] == 4


def test_a_prompt_in_flight_at_the_checkpoint_is_counted_once_whether_a_resume_admits_it_again_or_not():
    """The checkpoint names its in-flight prompts: one the resumed run admits again is not counted again, one it
    never reaches (it ended first, as a resume at max_steps does) ends as run_ended rather than vanish."""
    book = ledger()
    for qid in "abc":
        book.admit(qid, 0)
    book.trained("a")
    trainer_state = {"consumed_prompts": ["a"], "accounting": book.snapshot()}  # b and c in flight
    assert settled_prompts(trainer_state) == {"a"}  # so a resumed run admits b and c again
    resumed = PromptLedger(InProcessBus(), BATCH, ETA)
    resumed.start(version=0, snapshot=trainer_state["accounting"])
    assert resumed.counts() == {"admitted": 3, "trained": 1, "filtered": {}, "failed": {}, "in_flight": 2}
    again = PromptLedger(InProcessBus(), BATCH, ETA)  # resumed again before either was admitted again
    again.start(version=0, snapshot=resumed.snapshot())
    assert again.admit("b", 0) == ADMITTED and again.admit("b", 0) == IN_FLIGHT and again.trained("b")
    assert again.admit("d", 0) == ADMITTED and again.untrained("d", failed("agent_error"))
    assert again.counts() == {"admitted": 4, "trained": 2, "filtered": {}, "failed": {"agent_error": 1},
                              "in_flight": 1}
    final = again.end_run()  # c was never admitted again
    assert final == {"admitted": 4, "trained": 2, "filtered": {"run_ended": 1}, "failed": {"agent_error": 1},
                     "in_flight": 0}


def test_the_age_bound_refuses_a_group_older_than_max_head_offpolicyness():
    book = ledger()
    assert not book.too_stale([4, 5], training_version=5)
    assert not book.too_stale([4], training_version=5)  # ETA behind: still allowed
    assert book.too_stale([3, 5], training_version=5)  # its oldest token decides
    assert not book.too_stale([], training_version=5)  # nothing generated: nothing stale


def test_after_a_crash_a_resume_counts_what_was_settled_and_holds_the_trained_versions_slots():
    bus = InProcessBus()
    book = ledger(bus)
    for qid in "abcd":
        book.admit(qid, 0)
    book.trained("a")
    book.untrained("b", failed("agent_error"))
    snapshot = book.snapshot()  # what a checkpoint keeps; c and d will be admitted again
    assert snapshot == {"admitted": 4, "trained": 1, "filtered": {}, "failed": {"agent_error": 1}, "in_flight": 2,
                        "failed_prompts": {"b": "agent_error"}, "in_flight_prompts": ["c", "d"]}
    # the run crashes here with c and d in flight; a resume from the checkpoint (1 version trained) on the same bus
    resumed = PromptLedger(bus, BATCH, ETA)
    resumed.start(version=1, snapshot=snapshot)
    assert resumed.in_flight() == []  # no episode of the crashed run's goes on: c and d wait to be admitted again
    assert resumed.slots_taken() == BATCH  # the trained version's prompts hold their slots: no burst
    for qid in "cd":
        assert resumed.admit(qid, 1) == ADMITTED and resumed.trained(qid)
    final = resumed.end_run()
    assert final == {"admitted": 4, "trained": 3, "filtered": {}, "failed": {"agent_error": 1}, "in_flight": 0}
    resumed.start()  # a fresh run starts from zero
    assert resumed.counts()["admitted"] == 0 and resumed.slots_taken() == 0


def test_a_step_s_groups_are_recorded_trained_in_one_change_or_one_by_one_where_a_guard_does_not_hold(monkeypatch):
    """The learner records a step's groups trained in one atomic change (one round trip to the bus, not one a group).
    Where one is not in flight (settled already, or twice in the list) or the ledger is closed, each is recorded or
    not as `trained` would: every admitted prompt still ends in exactly one outcome."""
    bus = InProcessBus()
    book = ledger(bus)
    for qid in "abcdefg":
        assert book.admit(qid, 10) == ADMITTED
    changes = []
    change = bus.change
    monkeypatch.setattr(bus, "change", lambda steps: changes.append(steps) or change(steps))
    book.trained_all(["a", "b", "c"])
    assert len(changes) == 1 and book.counts()["trained"] == 3 and book.in_flight() == list("defg")
    assert book.untrained("d", failed("agent_error"))
    book.trained_all(["d", "e"])  # d failed meanwhile: e alone is trained
    book.trained_all(["f", "f"])
    book.trained_all([])
    counts = book.counts()
    assert counts["trained"] == 5 and counts["failed"] == {"agent_error": 1} and book.in_flight() == ["g"]
    book.close()
    book.trained_all(["g"])
    assert book.end_run() == {"admitted": 7, "trained": 5, "filtered": {"run_ended": 1}, "failed": {"agent_error": 1},
                              "in_flight": 0}


def test_the_counts_read_every_outcome_s_counter_in_one_round_trip(monkeypatch):
    """The learner reads the counts every step, on its own thread (its delivery metrics): the outcome counters in one
    read of the bus, not a round trip each, then the two sets in flight. Each outcome is still counted as it is."""
    bus = InProcessBus()
    book = ledger(bus)
    outcomes = [filtered(r) for r in FILTER_REASONS] + [failed(r) for r in FAILURE_REASONS]
    for i in range(len(outcomes) + 3):
        assert book.admit(f"p{i}", 100) == ADMITTED
    assert book.trained("p0")
    for i, outcome in enumerate(outcomes, start=1):
        assert book.untrained(f"p{i}", outcome)
    reads = []
    for name in ("get", "get_keys", "set_size"):
        monkeypatch.setattr(bus, name, lambda *a, real=getattr(bus, name), name=name: reads.append(name) or real(*a))
    assert book.counts() == {"admitted": len(outcomes) + 3, "trained": 1, "filtered": dict.fromkeys(FILTER_REASONS, 1),
                             "failed": dict.fromkeys(FAILURE_REASONS, 1), "in_flight": 2}
    assert reads == ["get_keys", "set_size", "set_size"]


def test_a_closed_ledger_admits_and_settles_nothing_so_the_last_snapshot_is_the_run_s_books():
    """Closed for the learner's final save: a prompt admitted or an episode ended after it would be in the run's
    summary and not in that checkpoint. What is in flight then ends as run_ended; a restart's `start` opens it."""
    book = ledger()
    for qid in "abc":
        book.admit(qid, 0)
    book.trained("a")
    book.close()
    snapshot = book.snapshot()
    assert book.admit("d", 0) == CLOSED and not book.untrained("b", failed("agent_error")) and not book.trained("c")
    assert book.snapshot() == snapshot
    assert book.end_run() == {"admitted": 3, "trained": 1, "filtered": {"run_ended": 2}, "failed": {}, "in_flight": 0}
    book.start()
    assert book.admit("d", 0) == ADMITTED
