"""One behavioural suite run over both buses: InProcessBus and RedisBus on a real private redis-server."""

import threading
import time
import uuid

import pytest

from rlsys.bus import (Bus, BusDecodeError, BusEncodeError, BusError, EmbeddedRedis, InProcessBus, RedisBus, Step,
                       Undecodable, connect)
from tests.helpers import no_leaked_servers  # noqa: F401  (a fixture)


pytestmark = pytest.mark.usefixtures("no_leaked_servers")


@pytest.fixture(scope="module")
def redis_url(tmp_path_factory):
    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as server:
        yield server.url


@pytest.fixture(params=["inproc", "redis"])
def bus(request) -> Bus:
    if request.param == "inproc":
        b = InProcessBus()
    else:  # a fresh namespace per test keeps tests independent on the shared server
        b = RedisBus.from_url(request.getfixturevalue("redis_url"), namespace=uuid.uuid4().hex)
    yield b
    b.close()


def inject_raw(bus: Bus, queue: str, data: bytes) -> None:
    """Bytes written behind the bus's back, as a foreign or buggy writer would."""
    if isinstance(bus, RedisBus):
        bus._client.rpush(bus._k(queue), data)
    else:
        with bus._cond:
            bus._queues[queue].append(data)


def inject_raw_entry(bus: Bus, stream: str, data: bytes, label: bytes = b"") -> None:
    """A stream entry written behind the bus's back (with `label` in its label field, if given)."""
    if isinstance(bus, RedisBus):
        bus._client.xadd(bus._k(stream), {b"m": data, **({b"l": label} if label else {})})
    else:
        with bus._cond:
            s = bus._streams[stream]
            entry_id = s.next_id()
            s.entries[entry_id] = data
            if label:
                s.labels[entry_id] = label.decode()
            bus._cond.notify_all()


def test_fifo_order_across_put_and_put_many(bus):
    for i in range(5):
        bus.put("q", i)
    bus.put_many("q", list(range(5, 20)))
    bus.put_many("q", [])
    assert bus.qsize("q") == 20
    assert bus.get_many("q", 100, timeout=1) == list(range(20))
    assert bus.qsize("q") == 0


def test_get_many_takes_at_most_max_count(bus):
    bus.put_many("q", list(range(10)))
    assert bus.get_many("q", 3, timeout=1) == [0, 1, 2]
    assert bus.get_many("q", 1, timeout=1) == [3]
    assert bus.qsize("q") == 6
    assert bus.get_many("q", 0, timeout=1) == []


def test_get_many_returns_empty_after_timeout(bus):
    start = time.monotonic()
    assert bus.get_many("empty", 5, timeout=0.2) == []
    assert 0.15 <= time.monotonic() - start < 0.6


def test_get_many_returns_at_once_when_data_is_there(bus):
    bus.put_many("q", ["a", "b"])
    start = time.monotonic()
    assert bus.get_many("q", 10, timeout=30) == ["a", "b"]  # does not wait for more than what is there
    assert time.monotonic() - start < 5  # nor its timeout: a bound a loaded machine's stalls stay far under


def test_get_many_with_zero_timeout_does_not_block(bus):
    start = time.monotonic()
    assert bus.get_many("q", 10, timeout=0) == []
    bus.put("q", 1)
    assert bus.get_many("q", 10, timeout=0) == [1]
    assert time.monotonic() - start < 2  # BLPOP 0 would block for ever; 2 s is far above a loaded machine's stalls


def test_producer_thread_wakes_blocked_consumer(bus):
    def produce():
        time.sleep(0.2)
        bus.put_many("q", [1, 2, 3])

    thread = threading.Thread(target=produce)
    start = time.monotonic()
    thread.start()
    got = bus.get_many("q", 10, timeout=5)
    elapsed = time.monotonic() - start
    thread.join()
    got += bus.get_many("q", 10, timeout=0)
    assert got == [1, 2, 3]
    assert 0.15 <= elapsed < 1.5


def test_concurrent_producers_and_consumers_lose_nothing(bus):
    producers, per_producer, received, lock = 4, 200, [], threading.Lock()

    def produce(p):
        for i in range(0, per_producer, 10):
            bus.put_many("q", [[p, j] for j in range(i, i + 10)])

    def consume():
        while True:
            batch = bus.get_many("q", 7, timeout=0.3)
            if not batch:
                return
            with lock:
                received.extend(batch)

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(producers)]
    threads += [threading.Thread(target=consume) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(received) == sorted([p, j] for p in range(producers) for j in range(per_producer))


def test_counters(bus):
    assert bus.incr("c") == 1
    assert bus.incr("c", 5) == 6
    assert bus.incr("c", -2) == 4
    assert bus.get("c") == 4 and isinstance(bus.get("c"), int)
    bus.set("admitted", 0)  # what the launcher does before a resumed run
    assert bus.incr("admitted", 12) == 12
    bus.set("big", -(2**40))
    assert bus.get("big") == -(2**40)

    threads = [threading.Thread(target=lambda: [bus.incr("shared") for _ in range(100)]) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert bus.get("shared") == 800


def test_incr_of_a_non_integer_fails_clearly(bus):
    bus.set("k", {"version": 1})
    with pytest.raises(BusError, match="integer"):
        bus.incr("k")


def test_both_buses_refuse_a_count_that_is_not_an_int_and_a_set_member_that_is_not_a_str_and_change_nothing(bus):
    # Redis refuses these (INCRBY 1.5, redis-py's True) or stores them as their text (5 and b"x" as "5" and "x"); the
    # in-process bus used to take them: a float made the key unreadable, and 5 and "5" were two members
    for amount in (1.5, True, "2", None):
        with pytest.raises(TypeError, match="incr of key 'c': the amount must be an int"):
            bus.incr("c", amount)
        with pytest.raises(TypeError, match="incr on key 'c': the amount must be an int"):
            bus.change([Step.add("s", "a"), Step.incr("c", amount)])
    for member in (5, b"x", None):
        for step in (Step.add, Step.remove, Step.absent, Step.present):
            with pytest.raises(TypeError, match=f"{step.__name__} on set 's': the member must be a str"):
                bus.change([Step.add("s", "a"), step("s", member)])
    assert bus.get("c") is None and bus.set_size("s") == 0


def test_set_get_delete_nested_values(bus):
    value = {"version": 3, "path": "/ckpt/3", "stats": [1.5, None, True, {"deep": ["x", -7]}], "t": (1, 2)}
    bus.set("k", value)
    assert bus.get("k") == {**value, "t": [1, 2]}  # msgpack has no tuples
    for v in (True, False, None, 0.5, "7", 48, 57, 45, "", [], {}):  # the edge cases of the int encoding
        bus.set("v", v)
        got = bus.get("v", default="unset")
        assert got == v and type(got) is type(v)
    assert bus.get("missing") is None
    assert bus.get("missing", default=5) == 5
    bus.put("q", 1)
    bus.delete("k", "v", "q", "never-existed")
    bus.delete()
    assert bus.get("k") is None and bus.get("v") is None and bus.qsize("q") == 0


def test_get_keys_gives_each_key_s_value_in_order_as_get_does(bus):
    bus.set("a", {"x": [1, 2]})
    bus.set("n", 7)
    bus.incr("c", 3)
    bus.set("f", False)
    bus.put("q", 1)  # a queue, a set and a stream hold no value
    bus.change([Step.add("s", "m")])
    bus.stream_add("st", 1)
    keys = ["n", "missing", "a", "f", "c", "q", "s", "st", "n"]
    assert bus.get_keys(keys) == [7, None, {"x": [1, 2]}, False, 3, None, None, None, 7]
    assert bus.get_keys(keys, default="unset") == [7, "unset", {"x": [1, 2]}, False, 3, "unset", "unset", "unset", 7]
    values = ["n", "missing", "a", "f", "c"]
    assert bus.get_keys(values, "unset") == [bus.get(key, "unset") for key in values]


def test_server_id_and_keys_gives_the_server_s_id_and_the_keys_values_as_get_keys_does(bus):
    """The learner's inbox reads its STOP key with the server's id before each read of the stream, in one round trip."""
    bus.set("n", 7)
    bus.set("f", False)
    bus.put("q", 1)  # a queue holds no value
    keys = ["n", "missing", "f", "q"]
    assert bus.server_id_and_keys(keys) == (bus.server_id(), [7, None, False, None]) == (bus.server_id(),
                                                                                          bus.get_keys(keys))
    assert bus.server_id_and_keys(keys, default="unset") == (bus.server_id(), [7, "unset", False, "unset"])
    assert bus.server_id_and_keys([]) == (bus.server_id(), [])
    assert bus.get_keys([]) == []


def test_bytes_round_trip(bus):
    blob = bytes(range(256)) * 40
    bus.put("q", {"token_ids": [1, 2], "raw": blob, "text": "héllo"})
    (got,) = bus.get_many("q", 1, timeout=1)
    assert got["raw"] == blob and isinstance(got["raw"], bytes) and got["text"] == "héllo"
    bus.set("blob", blob)
    assert bus.get("blob") == blob


def test_non_serializable_message_fails_on_put_and_sends_nothing(bus):
    with pytest.raises(TypeError, match="queue q"):
        bus.put("q", {"obj": object()})
    with pytest.raises(TypeError):
        bus.put_many("q", [1, {2, 3}])
    with pytest.raises(TypeError, match="key k"):
        bus.set("k", lambda: None)
    assert bus.qsize("q") == 0


def test_garbage_in_a_queue_comes_back_as_undecodable_in_its_place_and_loses_nothing_beside_it(bus):
    bus.put("obs", "before")
    inject_raw(bus, "obs", b"\xc1\xc1 definitely not msgpack")
    inject_raw(bus, "obs", b"\x01\x02")  # a valid value followed by trailing bytes
    bus.put("obs", "a" * 2000)
    bus.put("obs", "after")
    before, garbage, trailing, big, after = bus.get_many("obs", 10, timeout=1, max_bytes=1000)
    assert (before, after) == ("before", "after")
    assert isinstance(garbage, Undecodable) and "queue obs" in garbage.reason and garbage.head.startswith(b"\xc1")
    assert isinstance(trailing, Undecodable) and "ExtraData" in trailing.reason
    assert isinstance(big, Undecodable) and "exceeds the limit" in big.reason and big.size > 2000 and big.head


def test_a_map_key_no_reader_can_hold_is_named_with_its_map_s_path_and_loses_nothing_beside_it(bus):
    """A tuple key encodes (as an array), and decodes into a list, which cannot be a key: the reader's reason says
    which map held it, so the writer's bug is found, where checking every message on the writer's side would cost
    as much as encoding it again."""
    bus.put_many("obs", ["before", {"rid": "r", "meta": [1, {"ok": 1, ("a", 1): 2}]}, "after"])
    before, bad, after = bus.get_many("obs", 10, timeout=1)
    assert (before, after) == ("before", "after")
    assert isinstance(bad, Undecodable) and "queue obs" in bad.reason, bad
    assert "the map at ['meta'][1] has a key that is an array" in bad.reason, bad.reason
    assert "not msgpack written by a Bus" not in bad.reason
    bus.stream_add("st", {(1, 2): "x"})
    (entry,) = bus.stream_read("st", "g", "c", 10, timeout=1)
    with pytest.raises(BusDecodeError, match=rf"stream st entry {entry.id}.*the map at the top has a key that is an "
                                             r"array"):
        entry.decode("st")
    bus.set("k", {"x": {(1,): 2}})
    with pytest.raises(BusDecodeError, match=r"key k.*the map at \['x'\] has a key that is an array"):
        bus.get("k")


def test_connect_dispatch(redis_url):
    name = uuid.uuid4().hex
    a = connect(f"inproc://{name}")
    assert isinstance(a, InProcessBus) and a is connect(f"inproc://{name}")
    assert a is not connect(f"inproc://{name}-other")
    a.put("q", "hello")
    assert connect(f"inproc://{name}").get_many("q", 1, timeout=1) == ["hello"]

    first, second = connect(redis_url + "?namespace=run1"), connect(redis_url + "?namespace=run2")
    assert isinstance(first, RedisBus)
    first.set("shared-name", 1)
    assert second.get("shared-name") is None and first.get("shared-name") == 1
    first.delete("shared-name")
    first.close()
    second.close()
    with pytest.raises(ValueError, match="unsupported bus url"):
        connect("ftp://example.com")


def test_a_redis_url_with_a_namespace_passes_the_start_up_check(redis_url):
    """`cluster.redis_url=redis://...?namespace=NAME`, which `connect` takes: redis-py refused the namespace as an
    unknown argument (a TypeError out of the launcher)."""
    from rlsys.preflight import StartupError, check_redis_url

    check_redis_url(redis_url + "?namespace=run1")
    wrong = redis_url.replace("redis://:", "redis://:wrong", 1) + "?namespace=run1"
    with pytest.raises(StartupError, match="refused the credentials"):
        check_redis_url(wrong)


def test_a_change_makes_every_write_when_its_guards_hold_and_none_when_one_does_not(bus):
    admit = [Step.absent("s", "a"), Step.at_most("n", 2), Step.incr("n"), Step.add("s", "a"),
             Step.append("st", {"id": "a"})]
    assert bus.change(admit) is None
    assert bus.set_members("s") == ["a"] and bus.get("n") == 1 and bus.stream_length("st") == 1
    assert bus.change(admit) == Step.absent("s", "a")  # the first guard that does not hold, nothing written
    assert bus.get("n") == 1 and bus.stream_length("st") == 1
    bus.set("n", 2)  # the limit counts this change's increment: 2 + 1 > 2
    assert bus.change([Step.at_most("n", 2), Step.incr("n"), Step.add("s", "b")]) == Step.at_most("n", 2)
    assert bus.get("n") == 2 and bus.set_members("s") == ["a"]
    assert bus.change([Step.present("s", "a"), Step.remove("s", "a"), Step.incr("n", -2), Step.incr("m", 5)]) is None
    assert bus.set_size("s") == 0 and bus.get("n") == 0 and bus.get("m") == 5
    bus.change([Step.add("s", "c-é"), Step.add("s", "b"), Step.add("s", "b")])
    assert bus.set_members("s") == ["b", "c-é"] and bus.set_size("s") == 2 and bus.set_members("unset") == []
    assert bus.change([Step.present("s", "a"), Step.incr("m")]) == Step.present("s", "a") and bus.get("m") == 5
    [entry] = bus.stream_read("st", "g", "c", 1, timeout=0)
    assert entry.decode("st") == {"id": "a"}

    bus.change([Step.add("race", str(i)) for i in range(50)])
    results = []

    def remove_all():
        results.extend(bus.change([Step.present("race", str(i)), Step.remove("race", str(i)),
                                   Step.incr("race-removed")]) is None for i in range(50))

    threads = [threading.Thread(target=remove_all) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(results) == 50 and bus.get("race-removed") == 50  # each member counted by exactly one remover
    assert bus.set_size("race") == 0


def test_a_change_that_counts_a_key_holding_something_else_changes_nothing(bus):
    bus.set("not-a-counter", {"x": 1})
    for counted in (Step.incr("not-a-counter"), Step.at_most("not-a-counter", 5)):
        with pytest.raises(BusError, match="not-a-counter"):
            bus.change([Step.add("s", "a"), Step.incr("n"), counted])
        assert bus.set_size("s") == 0 and bus.get("n") is None
    with pytest.raises(BusEncodeError):
        bus.change([Step.add("s", "a"), Step.append("st", object())])
    assert bus.set_size("s") == 0 and bus.stream_length("st") == 0


def test_stream_hands_each_entry_to_one_consumer_of_a_group(bus):
    ids = [bus.stream_add("st", {"n": i}) for i in range(5)]
    assert ids == sorted(ids, key=lambda i: tuple(map(int, i.split("-"))))
    first = bus.stream_read("st", "g", "c1", 3, timeout=1)
    second = bus.stream_read("st", "g", "c2", 10, timeout=1)
    assert [e.decode("st") for e in first + second] == [{"n": i} for i in range(5)]
    assert [e.id for e in first + second] == ids and {e.deliveries for e in first + second} == {1}
    assert bus.stream_read("st", "g", "c1", 10, timeout=0) == []
    assert bus.stream_pending("st", "g") == 5 and bus.stream_length("st") == 5
    other_group = bus.stream_read("st", "other", "c1", 10, timeout=0)  # a group starts at the stream's start
    assert [e.id for e in other_group] == ids


def test_stream_ack_deletes_only_what_is_acknowledged(bus):
    ids = [bus.stream_add("st", i) for i in range(6)]
    entries = bus.stream_read("st", "g", "c", 4, timeout=1)
    assert bus.stream_ack("st", "g", [entries[0].id, entries[2].id]) == 2
    assert bus.stream_ack("st", "g", [entries[0].id]) == 0  # already acknowledged
    assert bus.stream_ack("st", "g", []) == 0
    assert bus.stream_pending("st", "g") == 2
    # the unacknowledged and the unread entries are all still there
    assert [e.id for e in bus.stream_range("st", 100)] == [ids[1], ids[3], ids[4], ids[5]]
    assert bus.stream_length("st") == 4
    assert [e.decode("st") for e in bus.stream_read("st", "g", "c", 10, timeout=0)] == [4, 5]


def test_stream_read_waits_for_a_producer_and_times_out(bus):
    start = time.monotonic()
    assert bus.stream_read("st", "g", "c", 5, timeout=0.2) == []
    assert 0.15 <= time.monotonic() - start < 0.8

    def produce():
        time.sleep(0.2)
        bus.stream_add("st", "late")

    thread = threading.Thread(target=produce)
    start = time.monotonic()
    thread.start()
    got = bus.stream_read("st", "g", "c", 5, timeout=5)
    thread.join()
    assert [e.decode("st") for e in got] == ["late"] and 0.15 <= time.monotonic() - start < 1.5


def test_claim_takes_over_the_entries_of_a_dead_consumer(bus):
    for i in range(3):
        bus.stream_add("st", i)
    held = bus.stream_read("st", "g", "dead", 10, timeout=1)
    # not idle long enough (an hour: however slow the machine, the entries cannot have idled that long)
    assert bus.stream_claim("st", "g", "heir", min_idle=3600, max_count=10) == []
    time.sleep(0.35)
    assert bus.stream_claim("st", "g", "dead", min_idle=0.3, max_count=10) == []  # never its own entries
    claimed = bus.stream_claim("st", "g", "heir", min_idle=0.3, max_count=2)
    assert [e.id for e in claimed] == [e.id for e in held[:2]]
    assert [e.payload for e in claimed] == [e.payload for e in held[:2]] and {e.deliveries for e in claimed} == {2}
    rest = bus.stream_claim("st", "g", "heir", min_idle=0.3, max_count=10)
    assert [e.id for e in rest] == [held[2].id]
    assert bus.stream_claim("st", "g", "third", min_idle=0, max_count=10)[0].deliveries == 3
    bus.stream_ack("st", "g", [e.id for e in held])
    assert bus.stream_pending("st", "g") == 0 and bus.stream_length("st") == 0
    assert bus.stream_claim("st", "nogroup", "x", min_idle=0, max_count=10) == []


def test_a_claim_that_takes_back_what_never_failed_keeps_the_delivery_counts(bus):
    """A reader taking back what a server restart or a lost reply kept from it (counted=False) is no delivery that
    failed: the counts stay, and the next counted claim adds one to them."""
    for i in range(2):
        bus.stream_add("st", i)
    held = bus.stream_read("st", "g", "reader", 10, timeout=1)
    assert [e.deliveries for e in bus.stream_claim("st", "g", "reader-2", min_idle=0, max_count=10)] == [2, 2]
    for name in ("reader-3", "reader-4"):
        taken = bus.stream_claim("st", "g", name, min_idle=0, max_count=10, counted=False)
        assert [e.id for e in taken] == [e.id for e in held] and [e.deliveries for e in taken] == [2, 2]
        assert [e.decode("st") for e in taken] == [0, 1]
    assert [e.deliveries for e in bus.stream_claim("st", "g", "heir", min_idle=0, max_count=10)] == [3, 3]


def test_concurrent_consumers_of_a_group_get_every_entry_exactly_once(bus):
    expected = [[p, i] for p in range(3) for i in range(100)]
    received, lock = [], threading.Lock()

    def produce(p):
        for i in range(100):
            bus.stream_add("st", [p, i])

    def consume(name):
        while True:
            entries = bus.stream_read("st", "g", name, 7, timeout=0.3)
            if not entries:
                return
            with lock:
                received.extend(e.decode("st") for e in entries)
            bus.stream_ack("st", "g", [e.id for e in entries])

    threads = [threading.Thread(target=produce, args=(p,)) for p in range(3)]
    threads += [threading.Thread(target=consume, args=(f"c{c}",)) for c in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(received) == sorted(expected)
    assert bus.stream_length("st") == 0 and bus.stream_pending("st", "g") == 0


def test_stream_entries_keep_raw_bytes_and_decode_errors_name_the_entry(bus):
    inject_raw_entry(bus, "st", b"\xc1 not msgpack")
    bus.stream_add("st", {"blob": bytes(range(256))})
    bad, good = bus.stream_read("st", "g", "c", 10, timeout=1)
    assert bad.payload == b"\xc1 not msgpack"
    with pytest.raises(BusDecodeError, match=f"stream st entry {bad.id}"):
        bad.decode("st")
    assert good.decode("st") == {"blob": bytes(range(256))}
    with pytest.raises(TypeError, match="stream st"):
        bus.stream_add("st", {"obj": object()})
    assert bus.stream_length("st") == 2


def test_a_stream_entry_s_label_comes_back_wherever_its_payload_does_not(bus):
    bus.stream_add("st", {"x": "y" * 1000}, label="g-1")
    bus.change([Step.append("st", "small", "g-2")])
    bus.stream_add("st", "unlabelled")
    entries = bus.stream_read("st", "g", "dead", 10, timeout=1, max_bytes=100)
    assert [(e.label, e.problem is not None) for e in entries] == [("g-1", True), ("g-2", False), ("", False)]
    assert [e.label for e in bus.stream_claim("st", "g", "heir", 0, 10, max_bytes=100)] == ["g-1", "g-2", ""]
    assert [e.label for e in bus.stream_range("st", 10)] == ["g-1", "g-2", ""]
    bus.stream_ack("st", "g", [entries[0].id])
    assert [e.label for e in bus.stream_range("st", 10)] == ["g-2", ""]
    if isinstance(bus, RedisBus):  # a foreign writer's label over the limit is not read: it would bypass max_bytes
        inject_raw_entry(bus, "st", b"\xc1", label=b"x" * 257)
        assert [e.label for e in bus.stream_read("st", "g", "c", 10, timeout=1, max_bytes=100)] == [""]
        assert [e.label for e in bus.stream_range("st", 10)] == ["g-2", "", ""]
    with pytest.raises(TypeError, match="label of an entry of stream 'st' must be a str of at most 256 bytes"):
        Step.append("st", "m", "é" * 129)


def test_delete_removes_sets_and_streams(bus):
    bus.change([Step.add("s", "a")])
    bus.stream_add("st", 1)
    bus.stream_read("st", "g", "c", 1, timeout=0)
    bus.delete("s", "st")
    assert bus.set_size("s") == 0 and bus.stream_length("st") == 0 and bus.stream_pending("st", "g") == 0


def test_a_count_below_one_takes_nothing_on_both_buses(bus):
    # the in-process stream_range sliced to it (-1: all but the newest) where Redis refused it
    bus.put("q", 1)
    bus.stream_add("st", 1)
    bus.stream_add("st", 2)
    for stream in ("st", "absent"):
        for count in (0, -1):
            assert bus.stream_range(stream, count) == [] and bus.get_many("q", count, 0) == []
            assert bus.stream_read(stream, "g", "c", count, 0) == []
    assert bus.qsize("q") == 1 and bus.stream_length("st") == 2


def test_stream_delete_deletes_the_entries_named_and_only_them(bus):
    ids = [bus.stream_add("dead", {"n": n}) for n in range(3)]
    assert bus.stream_delete("dead", ids[1:] + ["9999999999999-0"]) == 2 and bus.stream_delete("dead", []) == 0
    assert [entry.decode("dead") for entry in bus.stream_range("dead", 10)] == [{"n": 0}]
