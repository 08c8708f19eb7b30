"""Trajectory delivery to the learner, over both buses: at least once, consumed once, bad messages set aside."""

import math
import os

import msgpack
import numpy as np
import pytest

from rlsys import protocol
from rlsys.api import Trajectory
from rlsys.api.messages import integer, integers, items, logprob, logprobs
from rlsys.bus import EmbeddedRedis, Step, connect
from rlsys.delivery import MAX_DELIVERIES, InvalidMessage, TrajectoryInbox, group_message
from rlsys.prompt_ledger import PromptLedger
from tests.test_bus import bus, inject_raw_entry, redis_url  # noqa: F401  (fixtures: both buses)
from tests.helpers import no_leaked_servers  # noqa: F401  (a fixture)

pytestmark = pytest.mark.usefixtures("no_leaked_servers")

MB = 2**20


def trajectory(group_id: str, reward: float = 1.0, **changes) -> Trajectory:
    fields = dict(token_ids=[5, 6, 7, 8], loss_mask=[0, 0, 1, 1], logprobs=[0.0, 0.0, -0.5, -0.25],
                  versions=[-1, -1, 3, 3], turn_ends=[4], turn_rewards=[reward], reward=reward,
                  group_id=group_id, stop_reason="stop")
    return Trajectory(**{**fields, **changes})


def ledger(bus) -> PromptLedger:
    return PromptLedger(bus, batch_size=4, max_head_offpolicyness=1)


def send(bus, group_id: str, n: int = 2, admit: bool = True) -> dict:
    if admit:
        ledger(bus).admit(group_id, served_version=10)
    message = group_message(group_id, [trajectory(group_id) for _ in range(n)], max_bytes=MB)
    bus.stream_add(protocol.TRAJECTORIES, message)
    return message


def inbox(bus, name: str = "learner-a", **kwargs) -> TrajectoryInbox:
    return TrajectoryInbox(bus, ledger(bus), name, max_message_bytes=kwargs.pop("max_message_bytes", MB),
                           vocab_size=100, **kwargs)


def dead_letters(bus) -> list[dict]:
    return [e.decode(protocol.DEAD_LETTERS) for e in bus.stream_range(protocol.DEAD_LETTERS, 100)]


def test_a_group_stays_in_the_stream_until_acknowledged(bus):
    message = send(bus, "train-0-1")
    learner = inbox(bus)
    (delivery,) = learner.receive(4, timeout=1)
    assert delivery.group_id == "train-0-1"
    assert [t.to_dict() for t in delivery.trajectories] == message["trajectories"]
    assert bus.stream_pending(protocol.TRAJECTORIES, protocol.LEARNERS) == 1
    assert bus.stream_length(protocol.TRAJECTORIES) == 1  # not trimmed while unacknowledged
    learner.ack([delivery.entry_id])
    assert (bus.stream_length(protocol.TRAJECTORIES) == 0
            and bus.stream_pending(protocol.TRAJECTORIES, protocol.LEARNERS) == 0)


def test_duplicates_are_dropped_by_group_id_and_a_reused_trajectory_id_fails_its_own_prompt(bus):
    message = send(bus, "g1")
    bus.stream_add(protocol.TRAJECTORIES, message)  # the same message sent again
    ledger(bus).admit("g2", served_version=10)
    reused = group_message("g2", [Trajectory.from_dict({**message["trajectories"][0], "group_id": "g2"})],
                           max_bytes=MB)
    bus.stream_add(protocol.TRAJECTORIES, reused)  # a new group id, but a trajectory already delivered
    send(bus, "g3")
    learner = inbox(bus)
    received = learner.receive(10, timeout=1)
    assert [d.group_id for d in received] == ["g1", "g3"]
    assert learner.duplicates == 1 and learner.dead_letters == 1
    assert "delivered before, in another group" in dead_letters(bus)[0]["reason"]
    counts = ledger(bus).counts()  # g2 has its outcome (it would otherwise hold its slot for the rest of the run)
    assert counts["failed"] == {"rejected": 1} and counts["in_flight"] == 2
    assert bus.stream_length(protocol.TRAJECTORIES) == 2  # duplicates acknowledged (deleted), the rest pending


def test_a_resumed_learner_drops_groups_its_checkpoint_consumed(bus):
    send(bus, "trained-before", admit=False)
    send(bus, "new")
    learner = inbox(bus, consumed=["other", "trained-before"])
    assert [d.group_id for d in learner.receive(10, timeout=1)] == ["new"]
    assert learner.duplicates == 1


def test_a_dead_learners_pending_groups_go_to_the_next_one(bus):
    for i in range(3):
        send(bus, f"g{i}")
    dead = inbox(bus, "learner-dead")
    held = dead.receive(2, timeout=1)  # taken, never acknowledged: the learner died in its step
    heir = inbox(bus, "learner-heir")
    received = heir.receive(10, timeout=1)
    assert [d.group_id for d in received] == [d.group_id for d in held]  # the orphans first
    assert [d.group_id for d in heir.receive(10, timeout=1)] == ["g2"]
    heir.ack([d.entry_id for d in received])
    assert bus.stream_length(protocol.TRAJECTORIES) == 1


def test_a_group_whose_learners_keep_dying_is_set_aside_after_max_deliveries(bus):
    send(bus, "poison-pill")
    send(bus, "fine")
    for attempt in range(MAX_DELIVERIES):  # each learner takes it and dies before acknowledging
        assert [d.group_id for d in inbox(bus, f"learner-{attempt}").receive(1, timeout=1)] == ["poison-pill"]
    survivor = inbox(bus, "learner-last")
    assert survivor.receive(10, timeout=1) == []  # it claimed the pill, and set it aside
    assert [d.group_id for d in survivor.receive(10, timeout=1)] == ["fine"]
    (letter,) = dead_letters(bus)
    assert letter["group_id"] == "poison-pill" and letter["deliveries"] == MAX_DELIVERIES + 1
    assert "without an acknowledgement" in letter["reason"]
    assert ledger(bus).counts()["failed"] == {"rejected": 1}


def raw(value) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def good_dict(group_id: str, **changes) -> dict:
    return {**trajectory(group_id).to_dict(), **changes}


BAD_MESSAGES = {  # name -> (payload, words the reason must contain)
    "random bytes": (os.urandom(64) + b"\xc1", "undecodable"),
    "trailing garbage": (raw({"group_id": "x"}) + b"\x00", "undecodable"),
    "a list": (raw([1, 2, 3]), "group_id"),
    "no group id": (raw({"trajectories": []}), "group_id"),
    "extra keys": (raw({"group_id": "x", "trajectories": [], "evil": 1}), "expected keys"),
    "no trajectories": (raw({"group_id": "x", "trajectories": []}), "non-empty list"),
    "unknown field": (raw({"group_id": "x", "trajectories": [good_dict("x", extra=1)]}), "unknown Trajectory fields"),
    "missing field": (raw({"group_id": "x", "trajectories": [{"token_ids": [1]}]}), "missing"),
    "length mismatch": (raw({"group_id": "x", "trajectories": [good_dict("x", logprobs=[0.0])]}), "logprobs has 1"),
    "string tokens": (raw({"group_id": "x", "trajectories": [good_dict("x", token_ids=list("abcd"))]}), "token_ids"),
    "token outside vocab": (raw({"group_id": "x", "trajectories": [good_dict("x", token_ids=[5, 6, 7, 10**6])]}),
                            "token_ids[3] (vocabulary of 100) must be an integer in [0, 99], got 1000000"),
    "repeated trajectory": (raw({"group_id": "x", "trajectories": [good_dict("x", traj_id="t")] * 2}), "appears twice"),
    "nan reward": (raw({"group_id": "x", "trajectories": [good_dict("x", reward=math.nan)]}), "reward"),
    "turn end at 1": (raw({"group_id": "x", "trajectories": [good_dict("x", turn_ends=[1])]}),
                      "turn_ends[0] must be an integer in [2, 4], got 1"),
    "inf logprob": (raw({"group_id": "x", "trajectories": [good_dict("x", logprobs=[0, 0, -math.inf, 0])]}),
                    "logprobs"),
    "nothing generated": (raw({"group_id": "x", "trajectories": [good_dict("x", loss_mask=[1, 0, 0, 0])]}),
                          "nothing to train on"),
    "a trained token without a version": (
        raw({"group_id": "x", "trajectories": [good_dict("x", versions=[-1, -1, 3, -1])]}),
        "token 3 is trained (loss_mask 1) but has no version (-1)"),
    "void not a bool": (raw({"group_id": "x", "trajectories": [good_dict("x", void="yes")]}), "void"),
    "version overflows int64": (raw({"group_id": "x", "trajectories": [good_dict("x", versions=[-1, -1, 2**63, 1])]}),
                                "versions[2] must be an integer in [-1, 2147483647]"),
    "reward inf in float32": (raw({"group_id": "x", "trajectories": [good_dict("x", reward=1e300)]}), "reward"),
    "logprob inf in float32": (raw({"group_id": "x", "trajectories": [good_dict("x", logprobs=[0, 0, -1e300, 0])]}),
                               "logprobs"),
    "positive logprob": (raw({"group_id": "x", "trajectories": [good_dict("x", logprobs=[0, 0, 0.5, 0])]}),
                         "logprobs[2] must be a finite number in [-3.40282e+38, 0.001], got 0.5"),
    "logprob 3e38": (raw({"group_id": "x", "trajectories": [good_dict("x", logprobs=[0, 0, 3e38, 0])]}), "logprobs[2]"),
    "reward beyond its range": (raw({"group_id": "x", "trajectories": [good_dict("x", reward=1e7)]}),
                                "reward must be a finite number in [-1e+06, 1e+06], got 10000000.0"),
    "turn reward beyond its range": (raw({"group_id": "x", "trajectories": [good_dict("x", turn_rewards=[-1e7])]}),
                                     "turn_rewards[0] must be a finite number in [-1e+06, 1e+06]"),
    "another prompt's trajectory": (raw({"group_id": "x", "trajectories": [good_dict("x"), good_dict("y")]}),
                                    "trajectory 1: group_id 'y' is not its prompt's id 'x'"),
    "a tuple key": (raw({"group_id": "x", "trajectories": [good_dict("x", metrics={("a", 1): 1.0})]}),
                    "the map at ['trajectories'][0]['metrics'] has a key that is an array"),
    "huge": (raw({"group_id": "x", "trajectories": [good_dict("x", metrics={"blob": 1.0}, stop_reason="s" * 3 * MB)]}),
             "exceeds the limit of 1.0 MiB"),
}


@pytest.mark.parametrize("name", BAD_MESSAGES)
def test_a_bad_message_is_dead_lettered_with_its_reason_and_the_stream_goes_on(bus, name):
    payload, reason = BAD_MESSAGES[name]
    send(bus, "before")
    inject_raw_entry(bus, protocol.TRAJECTORIES, payload)
    send(bus, "after")
    learner = inbox(bus)
    assert [d.group_id for d in learner.receive(10, timeout=1)] == ["before", "after"]
    (letter,) = dead_letters(bus)
    assert reason in letter["reason"], letter["reason"]
    # an entry over the size limit is measured where it is stored and never fetched, so none of it is kept
    kept = b"" if name == "huge" else payload[:64 * 1024]
    assert letter["size"] == len(payload) and letter["payload"] == kept
    assert learner.dead_letters == 1
    assert bus.stream_length(protocol.TRAJECTORIES) == 2  # the bad one acknowledged; the good ones pending


def test_a_rejected_group_of_an_admitted_prompt_counts_as_failed_and_gives_its_slot_back(bus):
    ledger(bus).hold_slots(7)
    ledger(bus).admit("train-0-3", served_version=10)
    inject_raw_entry(bus, protocol.TRAJECTORIES, raw({"group_id": "train-0-3", "trajectories": ["junk"]}))
    inject_raw_entry(bus, protocol.TRAJECTORIES, raw({"group_id": "never-admitted", "trajectories": []}))
    send(bus, "train-0-3", admit=False)  # a later copy of the rejected prompt's group
    learner = inbox(bus)
    assert learner.receive(10, timeout=1) == []
    assert learner.dead_letters == 2 and learner.duplicates == 1
    counts = ledger(bus).counts()
    assert counts["failed"] == {"rejected": 1} and counts["admitted"] == 1 and counts["in_flight"] == 0
    assert ledger(bus).slots_taken() == 7  # the admitted prompt took one and gave it back; nothing else did


def test_a_message_set_aside_unread_settles_the_prompt_its_label_names(bus):
    """An entry over the size limit is not fetched, and an undecodable one cannot be read: their group id is in their
    label, so their prompts are counted failed and give their slots back instead of holding them for the run."""
    ledger(bus).hold_slots(7)
    for group_id in ("train-0-1", "train-0-2", "train-0-3"):
        ledger(bus).admit(group_id, served_version=10)
    huge = {"group_id": "train-0-1", "trajectories": [good_dict("train-0-1", stop_reason="s" * 2 * MB)]}
    bus.change([Step.append(protocol.TRAJECTORIES, huge, "train-0-1")])  # as the rollout worker appends
    inject_raw_entry(bus, protocol.TRAJECTORIES, os.urandom(64) + b"\xc1", label=b"train-0-2")
    inject_raw_entry(bus, protocol.TRAJECTORIES, raw(group_message("train-0-3", [trajectory("train-0-3")], MB)),
                     label=b"train-0-1")  # a label that is not its group id is refused, with the payload's group
    bus.stream_add(protocol.TRAJECTORIES, {"group_id": "x"} | {"pad": "p" * 2 * MB}, label="never-admitted")
    learner = inbox(bus)
    assert learner.receive(10, timeout=1) == []
    letters = dead_letters(bus)
    assert [letter["group_id"] for letter in letters] == ["train-0-1", "train-0-2", "train-0-3", "never-admitted"]
    assert "exceeds the limit" in letters[0]["reason"] and "undecodable" in letters[1]["reason"]
    assert "labelled 'train-0-1', not with its group id" in letters[2]["reason"]
    counts = ledger(bus).counts()
    assert counts["failed"] == {"rejected": 3} and counts["in_flight"] == 0
    assert ledger(bus).slots_taken() == 7
    assert bus.stream_length(protocol.TRAJECTORIES) == 0
    with pytest.raises(TypeError, match="at most 256 bytes"):
        bus.stream_add(protocol.TRAJECTORIES, {}, label="x" * 257)


def test_the_rollout_side_refuses_what_the_learner_would_reject():
    with pytest.raises(InvalidMessage, match="non-empty list"):
        group_message("g", [], max_bytes=MB)
    with pytest.raises(InvalidMessage, match="list of Trajectory"):
        group_message("g", [{"token_ids": [1]}], max_bytes=MB)
    with pytest.raises(InvalidMessage, match="list of Trajectory"):
        group_message("g", None, max_bytes=MB)
    with pytest.raises(InvalidMessage, match=r"turn_rewards\[0\] must be a finite number.*got inf"):
        group_message("g", [trajectory("g", reward=math.inf)], max_bytes=MB)
    with pytest.raises(InvalidMessage, match="exceeds the limit"):
        group_message("g", [trajectory("g", stop_reason="x" * 2 * MB)], max_bytes=MB)
    with pytest.raises(InvalidMessage, match="not msgpack-serializable.*float32"):
        group_message("g", [trajectory("g", metrics={"score": np.float32(1.0)})], max_bytes=MB)
    with pytest.raises(InvalidMessage, match="group_id '' is not its prompt's id 'g'"):  # pooled with others
        group_message("g", [trajectory("g"), trajectory("")], max_bytes=MB)
    assert group_message("g", [trajectory("g")], max_bytes=MB)["group_id"] == "g"


def one_held_and_replies_lost(bus, group_ids: list[str], lost: int):
    """The learner's inbox after the groups were sent, it took the first, and a read handed out the next `lost`
    entries in a reply that never reached it (the server ran the read; the connection dropped)."""
    for group_id in group_ids:
        send(bus, group_id)
    learner = inbox(bus)
    (held,) = learner.receive(1, timeout=1)
    bus.stream_read(protocol.TRAJECTORIES, protocol.LEARNERS, learner.consumer, lost, 1)  # the reply that never came
    return learner, held


def restart(server) -> None:
    server.process.terminate()
    server.process.wait(10)
    server.restart()


def test_an_entry_whose_reply_was_lost_without_a_server_restart_is_taken_again(bus):
    """A connection that drops while a read's reply is on its way (the server ran the read; the client reconnects and
    reads again) leaves entries pending for the learner that it never saw, with the same server: they were never
    delivered, and their prompts held their gate slots until the run ended."""
    learner, held = one_held_and_replies_lost(bus, ["held", "lost", "later"], lost=1)
    taken = [d.group_id for _ in range(3) for d in learner.receive(10, timeout=0.1)]
    assert sorted(taken) == ["later", "lost"] and learner.duplicates == 0
    learner.ack([held.entry_id])
    assert bus.stream_pending(protocol.TRAJECTORIES, protocol.LEARNERS) == 2  # "lost" and "later", held now


def test_after_a_bus_server_restart_the_learner_takes_again_what_never_arrived_and_only_that(tmp_path):
    """A server that dies right after handing an entry out never sends it: the entry is pending for the
    learner, which never saw it. The learner takes it again after the restart, not the entries it holds."""
    with EmbeddedRedis(tmp_path) as server:
        bus = connect(server.url)
        learner, held = one_held_and_replies_lost(bus, ["held", "lost", "later"], lost=1)
        restart(server)
        assert [d.group_id for d in learner.receive(10, timeout=1)] == ["lost"]
        assert [d.group_id for d in learner.receive(10, timeout=1)] == ["later"]
        assert learner.duplicates == 0
        learner.ack([held.entry_id])
        assert bus.stream_pending(protocol.TRAJECTORIES, protocol.LEARNERS) == 2  # "lost" and "later", held now
        bus.close()


def test_a_pass_reads_the_stop_with_the_server_s_id_in_one_round_trip_and_a_stop_reads_nothing(bus, monkeypatch):
    """The learner's wait asked the bus for STOP, then for the server's id (a restart may have lost entries), then read
    the stream: three round trips a pass. The first two are one now; a stop still ends the wait and takes no entry."""
    send(bus, "g1")
    send(bus, "g2")
    learner = inbox(bus)
    calls = []
    for name in ("get", "get_keys", "server_id", "server_id_and_keys", "stream_read"):
        monkeypatch.setattr(bus, name, lambda *a, real=getattr(bus, name), name=name, **k: calls.append(name)
                            or real(*a, **k))
    assert [d.group_id for d in learner.receive(1, timeout=1, unless=protocol.STOP)] == ["g1"]
    assert calls == ["server_id_and_keys", "stream_read"]
    bus.set(protocol.STOP, 1)
    assert learner.receive(1, timeout=1, unless=protocol.STOP) is None
    assert bus.stream_pending(protocol.TRAJECTORIES, protocol.LEARNERS) == 1  # g2 was not read
    bus.delete(protocol.STOP)
    assert [d.group_id for d in learner.receive(1, timeout=1, unless=protocol.STOP)] == ["g2"]


def test_a_restart_seen_with_a_stop_is_acted_on_before_the_inbox_stops_reading(tmp_path):
    """The server's id comes with STOP: a restart seen in the same round trip as a stop is not lost with it (each
    restart is seen once), so a learner that goes on reading takes again at once what never arrived."""
    with EmbeddedRedis(tmp_path) as server:
        bus = connect(server.url)
        learner, held = one_held_and_replies_lost(bus, ["held", "lost", "later"], lost=1)
        restart(server)
        bus.set(protocol.STOP, 1)
        assert learner.receive(10, timeout=1, unless=protocol.STOP) is None
        bus.delete(protocol.STOP)
        assert [d.group_id for d in learner.receive(10, timeout=1, unless=protocol.STOP)] == ["lost"]
        assert [d.group_id for d in learner.receive(10, timeout=1, unless=protocol.STOP)] == ["later"]
        assert learner.duplicates == 0
        bus.close()


def test_entries_still_waiting_to_be_taken_again_when_the_server_restarts_again_are_taken_once(tmp_path):
    """What the learner had yet to take again after one restart was claimed again at the next and queued a second
    time: its second copy was dropped as a duplicate and acknowledged, deleting the entry the learner held."""
    with EmbeddedRedis(tmp_path) as server:
        bus = connect(server.url)
        learner, _ = one_held_and_replies_lost(bus, ["held", "lost-1", "lost-2"], lost=2)
        for taken in (["lost-1"], ["lost-2"]):
            restart(server)
            assert [d.group_id for d in learner.receive(1 if taken == ["lost-1"] else 10, timeout=1)] == taken
        assert learner.receive(10, timeout=0.1) == []
        assert learner.duplicates == 0
        assert bus.stream_pending(protocol.TRAJECTORIES, protocol.LEARNERS) == 3  # all three held, none acknowledged
        bus.close()


def test_an_entry_taken_back_after_each_of_several_server_restarts_is_no_poison_pill(tmp_path):
    """A server restart keeps no reader from an entry by failing on it: taken back after three restarts, a good entry
    was set aside as delivered four times without an acknowledgement, and its prompt counted failed."""
    with EmbeddedRedis(tmp_path) as server:
        bus = connect(server.url)
        lost = [f"lost-{i}" for i in range(MAX_DELIVERIES)]
        learner, _ = one_held_and_replies_lost(bus, ["held", *lost], lost=len(lost))
        for group_id in lost:  # each restart leaves the rest waiting to be taken again
            restart(server)
            assert [d.group_id for d in learner.receive(1, timeout=1)] == [group_id]
        assert dead_letters(bus) == [] and learner.dead_letters == 0 and ledger(bus).counts()["failed"] == {}
        bus.close()


def outcome(check):
    """(what `check()` returned, None) or (None, the InvalidMessage's text)."""
    try:
        return check(), None
    except InvalidMessage as e:
        return None, str(e)


@pytest.mark.parametrize("values", [[0, 5, 99], [], [0, 100], [-1, 3], [1, True], [1, 2.0], [1, "2"], [2**31]])
def test_the_one_pass_integer_check_agrees_with_the_per_item_one(values):
    assert outcome(lambda: integers(values, "ids", high=99)) == outcome(
        lambda: items(values, "ids", lambda x, at: integer(x, at, high=99)))


@pytest.mark.parametrize("values", [[-0.5, 0.0], [], [0.5], [-math.inf], [math.nan, -1.0], [-1, -0.5], [-3.5e38],
                                    [-3e38, -3e38], [-1e308, -1e308], [1e-4], [-1.0, None]])
def test_the_one_pass_logprob_check_agrees_with_the_per_item_one(values):
    """Two -1e308s sum to -inf though each is finite: the one-pass check then asks each in turn."""
    assert outcome(lambda: logprobs(values, "lp")) == outcome(lambda: items(values, "lp", logprob))
