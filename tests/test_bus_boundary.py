"""Every bus boundary under generated malformed messages: a dead letter or a clear error, never a crash,
never a NaN in the weights.

Hypothesis generates any msgpack value (ints beyond int64, NaN, inf, 1e300, bytes, deep structures), and
good messages with one field replaced by such a value, and throws them at each reader: the learner's
trajectory inbox (both buses), the inference worker's request queue and weights key, the router's reply
queue and the workers' status keys. The learner is trained on whatever its inbox accepts.
"""

import asyncio
import math
import uuid

import msgpack
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rlsys import protocol
from rlsys.algorithms.finite import clip_and_step
from rlsys.api import GenerationConfig, Trajectory
from rlsys.api import Model
from rlsys.api.messages import (INT32_MAX, LOGPROB_TOLERANCE, MAX_REWARD, GenerationReply, InvalidMessage, WorkerStatus,
                                generation_setting, parse_generation_config, parse_generation_reply,
                                parse_published_weights, parse_worker_request, parse_worker_status)
from rlsys.bus import EmbeddedRedis, InProcessBus, RedisBus
from rlsys.delivery import TrajectoryInbox, group_message, read_group_message
from rlsys.prompt_ledger import PromptLedger
from rlsys.workers.inference_worker import InferenceWorker
from rlsys.workers.routing import EpisodeRouter
from tests.helpers import with_field
from tests.scripted_engine import ScriptedEngine
from tests.test_learner import learner_config

MB = 2**20
FEW = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                        HealthCheck.too_slow])

scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1), st.floats(),
                    st.sampled_from([1e300, -1e300, 3.5e38, math.nan, math.inf, 2**63, -1, 0]),
                    st.text(max_size=20), st.binary(max_size=20))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.one_of(st.text(max_size=8), st.integers(-5, 5)), inner, max_size=4),
                      max_leaves=12)


def good_trajectory(group_id: str = "g") -> dict:
    return Trajectory(token_ids=[5, 6, 7, 8], loss_mask=[0, 0, 1, 1], logprobs=[0.0, 0.0, -0.5, -0.25],
                      versions=[-1, -1, 3, 3], turn_ends=[4], turn_rewards=[1.0], reward=1.0, group_id=group_id,
                      stop_reason="stop").to_dict()


TRAJECTORY_PATHS = [(name,) for name in good_trajectory()] + [
    ("token_ids", 2), ("logprobs", 3), ("versions", 2), ("turn_rewards", 0), ("loss_mask", 3), ("turn_ends", 0)]


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    with EmbeddedRedis(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="module")
def learner(tmp_path_factory):
    from rlsys.workers.learner import Learner

    tmp = tmp_path_factory.mktemp("learner")
    return Learner(learner_config(tmp), InProcessBus(), tmp / "run")


def weights_finite(model) -> bool:
    return all(torch.isfinite(p).all() for p in model.parameters())


def inbox_outcome(bus, payload: bytes, vocab_size: int = 100):
    """(accepted groups, dead letters) after one raw entry is put on the trajectory stream."""
    bus.delete(protocol.TRAJECTORIES, protocol.DEAD_LETTERS)
    if isinstance(bus, RedisBus):
        bus._client.xadd(bus._k(protocol.TRAJECTORIES), {b"m": payload})
    else:
        bus._streams[protocol.TRAJECTORIES].entries[bus._streams[protocol.TRAJECTORIES].next_id()] = payload
    inbox = TrajectoryInbox(bus, PromptLedger(bus, 1, 0), "learner", MB, vocab_size)
    accepted = inbox.receive(10, timeout=1)
    letters = [e.decode(protocol.DEAD_LETTERS) for e in bus.stream_range(protocol.DEAD_LETTERS, 10)]
    assert len(accepted) + len(letters) == 1, (accepted, letters)
    for letter in letters:
        assert isinstance(letter["reason"], str) and letter["reason"]
    return accepted, letters


@FEW
@given(value=values)
def test_any_value_on_the_trajectory_stream_is_dead_lettered_with_a_reason(value):
    accepted, _ = inbox_outcome(InProcessBus(), msgpack.packb(value, use_bin_type=True))
    assert accepted == []  # no generated value is a whole valid group by chance


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                   HealthCheck.too_slow])
@given(path=st.sampled_from(TRAJECTORY_PATHS), value=values)
def test_a_trajectory_with_any_field_replaced_is_refused_or_trains_to_finite_weights(learner, path, value):
    message = {"group_id": "g", "trajectories": [with_field(good_trajectory(), path, value)]}
    accepted, letters = inbox_outcome(InProcessBus(), msgpack.packb(message, use_bin_type=True),
                                      learner.model.config.vocab_size)
    if accepted:
        learner.train_step(accepted[0].trajectories)
        assert weights_finite(learner.model)


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=values, path=st.sampled_from(TRAJECTORY_PATHS))
def test_the_redis_stream_reader_refuses_the_same_way(redis_server, value, path):
    with RedisBus.from_url(redis_server.url, namespace=uuid.uuid4().hex) as bus:
        inbox_outcome(bus, msgpack.packb(value, use_bin_type=True))
        message = {"group_id": "g", "trajectories": [with_field(good_trajectory(), path, value)]}
        inbox_outcome(bus, msgpack.packb(message, use_bin_type=True))


def test_raw_bytes_deep_nesting_a_missing_payload_field_and_a_huge_entry_are_dead_lettered(redis_server):
    deep = b"\x91" * 100_000 + b"\xc0"  # a list in a list ... 100,000 deep: msgpack's stack limit refuses it
    with RedisBus.from_url(redis_server.url, namespace=uuid.uuid4().hex) as bus:
        for payload, words in [(b"\xc1\xc1\xc1", "undecodable"), (deep, "undecodable")]:
            _, (letter,) = inbox_outcome(bus, payload)
            assert words in letter["reason"]
        bus.delete(protocol.TRAJECTORIES, protocol.DEAD_LETTERS)
        bus._client.xadd(bus._k(protocol.TRAJECTORIES), {b"other": b"x"})
        bus._client.xadd(bus._k(protocol.TRAJECTORIES), {b"m": b"\xc4" + b"x" * 10})  # truncated bin header
        bus._client.xadd(bus._k(protocol.TRAJECTORIES), {b"m": b"\xda\xff\xff" + b"s" * 65535 * 40})  # 2.5 MB
        inbox = TrajectoryInbox(bus, PromptLedger(bus, 1, 0), "learner", MB, 100)
        assert inbox.receive(10, timeout=1) == []
        no_payload, truncated, huge = [e.decode(protocol.DEAD_LETTERS)
                                       for e in bus.stream_range(protocol.DEAD_LETTERS, 10)]
        assert "no payload field" in no_payload["reason"]
        assert "undecodable" in truncated["reason"]
        assert "exceeds the limit of 1.0 MiB" in huge["reason"] and huge["size"] > 2 * MB and huge["payload"] == b""
        assert bus.stream_length(protocol.TRAJECTORIES) == 0


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(logprobs=st.lists(st.floats(-3.4e38, LOGPROB_TOLERANCE), min_size=2, max_size=2),
       rewards=st.lists(st.floats(-MAX_REWARD, MAX_REWARD), min_size=2, max_size=2))
def test_extreme_numbers_the_inbox_accepts_never_put_a_nan_in_the_weights(learner, logprobs, rewards):
    """Numbers finite in float32 can still overflow the loss (exp(3e38)): the step is skipped and counted."""
    group = [Trajectory(**{**good_trajectory(), "logprobs": [0.0, 0.0, *logprobs], "reward": r,
                           "turn_rewards": [r], "traj_id": uuid.uuid4().hex}) for r in rewards]
    before = learner.skipped_updates
    stats = learner.train_step(group)
    assert weights_finite(learner.model)
    assert stats["updates/skipped_non_finite"] >= before


def test_a_behaviour_logprob_of_minus_3e38_trains_a_finite_step(learner):
    """-3e38 is finite in float32, and exp(logp - behaviour) overflowed the PPO ratio: the step was skipped. The
    log-ratio is clamped now (as verl's): the step is taken, its weights finite."""
    group = [Trajectory(**{**good_trajectory(), "logprobs": [0.0, 0.0, -3e38, -3e38], "reward": r, "turn_rewards": [r],
                           "traj_id": uuid.uuid4().hex}) for r in (1.0, -1.0)]
    skipped = learner.skipped_updates
    stats = learner.train_step(group)
    assert stats["updates/skipped_non_finite"] == learner.skipped_updates == skipped
    assert weights_finite(learner.model)


def test_a_step_whose_loss_is_not_finite_is_skipped_counted_and_changes_no_weight(learner):
    """A model whose forward pass overflows (one diverged in low precision, say) makes the loss NaN: each update is
    skipped and counted, and neither the weights nor the schedule move."""
    head = learner.model.get_output_embeddings().weight
    kept = head.detach().clone()
    with torch.no_grad():
        head.mul_(3e38)  # logits past float32's range: inf - inf in the softmax
    try:
        group = [Trajectory(**{**good_trajectory(), "reward": r, "turn_rewards": [r], "traj_id": uuid.uuid4().hex})
                 for r in (1.0, -1.0)]
        before = [p.detach().clone() for p in learner.model.parameters()]
        skipped, schedule = learner.skipped_updates, (learner.scheduler.last_epoch, learner.scheduler.get_last_lr())
        stats = learner.train_step(group)
        assert stats["updates/skipped_non_finite"] == learner.skipped_updates == skipped + learner.ppo.ppo_epochs
        assert all(torch.equal(a, b) for a, b in zip(before, learner.model.parameters()))
        assert (learner.scheduler.last_epoch, learner.scheduler.get_last_lr()) == schedule, "it counts updates taken"
    finally:
        with torch.no_grad():
            head.copy_(kept)


@FEW
@given(message=st.one_of(values, st.builds(lambda t: {"group_id": "g", "trajectories": [t]}, st.one_of(
    values, st.builds(with_field, st.just(good_trajectory()), st.sampled_from(TRAJECTORY_PATHS), values)))))
def test_the_trajectory_parser_raises_nothing_but_invalid_message_with_a_reason(message):
    try:
        read_group_message(message, vocab_size=100)
    except InvalidMessage as e:
        assert str(e)


@st.composite
def valid_trajectories(draw) -> Trajectory:
    """Any trajectory the learner can train on, its numbers up to the bounds (logprob 1e-3, reward 1e6)."""
    n = draw(st.integers(2, 12))
    mask = [0] + draw(st.lists(st.integers(0, 1), min_size=n - 1, max_size=n - 1).filter(any))
    turn_ends = sorted(draw(st.lists(st.integers(2, n), min_size=1, max_size=3)))
    rewards = st.floats(-MAX_REWARD, MAX_REWARD)
    return Trajectory(token_ids=draw(st.lists(st.integers(0, 99), min_size=n, max_size=n)), loss_mask=mask,
                      logprobs=[draw(st.floats(-3.4e38, LOGPROB_TOLERANCE)) if m else 0.0 for m in mask],
                      versions=[draw(st.integers(0, INT32_MAX)) if m else -1 for m in mask], turn_ends=turn_ends,
                      turn_rewards=[draw(rewards) for _ in turn_ends], reward=draw(rewards), group_id="g",
                      stop_reason=draw(st.sampled_from(["stop", "length", ""])),
                      metrics={"turns": float(len(turn_ends))})


@FEW
@given(trajectories=st.lists(valid_trajectories(), min_size=1, max_size=3))
def test_a_valid_group_round_trips_through_the_trajectory_parser(trajectories):
    message = msgpack.unpackb(msgpack.packb(group_message("g", trajectories, MB), use_bin_type=True), raw=False)
    group_id, parsed = read_group_message(message, vocab_size=100)
    assert group_id == "g" and [t.to_dict() for t in parsed] == [t.to_dict() for t in trajectories]


NON_FINITE = st.sampled_from([math.nan, math.inf, -math.inf])


@FEW
@given(bad=st.one_of(
    st.tuples(st.just(("logprobs", 2)),
              st.one_of(st.floats(min_value=LOGPROB_TOLERANCE, exclude_min=True), NON_FINITE)),
    st.tuples(st.sampled_from([("reward",), ("turn_rewards", 0)]),
              st.one_of(st.floats(min_value=MAX_REWARD, exclude_min=True).flatmap(lambda x: st.sampled_from([x, -x])),
                        NON_FINITE))))
def test_an_impossible_logprob_or_reward_is_refused_naming_it(bad):
    path, value = bad
    with pytest.raises(InvalidMessage, match=path[0]):
        read_group_message({"group_id": "g", "trajectories": [with_field(good_trajectory(), path, value)]}, 100)


@pytest.mark.parametrize("fused", [False, True], ids=["checked-on-the-host", "fused-told-on-the-device"])
def test_a_non_finite_gradient_skips_the_step_and_leaves_the_weights_alone(fused):
    model = torch.nn.Linear(3, 1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1, fused=fused)
    before = [p.detach().clone() for p in model.parameters()]
    model(torch.tensor([[1.0, math.inf, 0.0]])).sum().backward()
    norm, stepped = clip_and_step(optimizer, 1.0)
    assert not stepped and not math.isfinite(norm)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    if not fused:
        assert all(p.grad is None or not p.grad.any() for p in model.parameters())  # nothing left to accumulate
    for loss in (math.nan, torch.tensor(math.inf)):
        optimizer.zero_grad()
        model(torch.ones(1, 3)).sum().backward()
        assert not clip_and_step(optimizer, 1.0, loss=loss)[1]
        assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    assert not any(state["step"] for state in optimizer.state.values()), "a skipped step is not counted by Adam"
    for loss in (1.0, torch.tensor(1.0)):
        optimizer.zero_grad()
        model(torch.ones(1, 3)).sum().backward()
        assert clip_and_step(optimizer, 1.0, loss=loss)[1]
    assert not any(torch.equal(a, b) for a, b in zip(before, model.parameters()))


# ---- generation requests, replies, statuses and weights

def good_request(rid: str = "r") -> dict:
    return {"rid": rid, "token_ids": [7, 8], "gconfig": GenerationConfig(n=2, max_new_tokens=3).to_dict(),
            "reply_to": "replies"}


REQUEST_PATHS = [(k,) for k in good_request()] + [("gconfig", k) for k in GenerationConfig().to_dict()] + [
    ("token_ids", 0)]


@FEW
@given(bad=st.one_of(values, st.builds(with_field, st.just(good_request("bad")), st.sampled_from(REQUEST_PATHS),
                                         values), st.builds(lambda v: {"abort": v}, values)))
def test_an_inference_worker_sets_aside_any_bad_request_and_serves_the_good_one_beside_it(bad):
    bus = InProcessBus()
    engine = ScriptedEngine(lambda prompt, g, sample: [100 + i for i in range(g.max_new_tokens)], tokens_per_step=1)
    worker = InferenceWorker(engine, bus, 0, max_batch_requests=64)
    bus.put_many(protocol.generation_requests(0), [bad, good_request("good")])
    worker.take_requests(timeout=1)
    try:
        parse_worker_request(bad)  # a request, or the abort of one
    except InvalidMessage:
        assert worker.refused == 1
        (letter,) = [e.decode(protocol.DEAD_MESSAGES) for e in bus.stream_range(protocol.DEAD_MESSAGES, 10)]
        assert letter["source"] == protocol.generation_requests(0) and letter["reason"]
    assert engine.is_running("good")


def test_an_undecodable_request_is_set_aside_too():
    bus = InProcessBus()
    worker = InferenceWorker(ScriptedEngine(lambda *a: [1], tokens_per_step=1), bus, 0, max_batch_requests=64)
    bus._queues[protocol.generation_requests(0)].append(b"\xc1 not msgpack")
    worker.take_requests(timeout=1)
    (letter,) = [e.decode(protocol.DEAD_MESSAGES) for e in bus.stream_range(protocol.DEAD_MESSAGES, 10)]
    assert "undecodable" in letter["reason"] and letter["head"].startswith(b"\xc1")


def test_every_generation_setting_has_its_bounds_and_a_default_config_is_within_them():
    fields = GenerationConfig().to_dict()
    assert parse_generation_config(fields) == GenerationConfig()
    for name, value in fields.items():
        assert generation_setting(name, value, name) == value  # a field without a check raises KeyError
    for name, bad in [("n", 0), ("n", True), ("max_new_tokens", -5), ("temperature", math.nan), ("temperature", -1),
                      ("top_p", 0), ("top_p", 7), ("seed", 2**70), ("stop_token_ids", [-1])]:
        with pytest.raises(InvalidMessage, match=name):
            generation_setting(name, bad, name)


@pytest.mark.parametrize("gconfig", [GenerationConfig(seed=2**70), GenerationConfig(top_p=0.0),
                                     GenerationConfig(n=10**6), GenerationConfig(temperature=math.nan)])
def test_a_request_a_worker_would_refuse_fails_its_episode_at_once_and_is_never_sent(gconfig):
    """Put on the queue by an agent of its own, or through Model: the router checks it with the worker's parser
    (a seed of 2**70 would make msgpack raise in the router, the others would be set aside unanswered)."""
    async def raw_queue_agent(obs_queue, act_queue):
        await obs_queue.put(("q", [7, 8], gconfig))
        return await act_queue.get()

    async def model_agent(obs_queue, act_queue):
        async with Model(obs_queue, act_queue) as model:
            return await model.generate([7, 8], gconfig)

    async def main(agent):
        bus = InProcessBus()
        router = EpisodeRouter(bus, "replies", n_inference_workers=1)
        bus.set(protocol.inference_status(0), WorkerStatus(1, 1, 0, 0).to_message())
        router.workers.refresh()
        obs_queue, act_queue = asyncio.Queue(), asyncio.Queue()
        with pytest.raises(InvalidMessage, match=r"gconfig\.(seed|top_p|n|temperature) must be"):
            await asyncio.wait_for(router.serve(agent(obs_queue, act_queue), obs_queue, act_queue), 10)
        return bus.qsize(protocol.generation_requests(0)), router.waiting

    for agent in (raw_queue_agent, model_agent):
        assert asyncio.run(main(agent)) == (0, {})


def good_reply(rid: str) -> dict:
    return GenerationReply(rid, [7, 8], [[1, 2], [3]], [[-0.5, -0.25], [-1.0]], [[0, 0], [0]],
                           ["length", "stop"]).to_message()


def test_a_reply_names_its_request_by_rid_only():
    """The bus carries request ids; an agent's qid never crosses it (the router maps one to the other)."""
    assert parse_generation_reply(good_reply("r")).rid == "r"
    message = good_reply("r")
    message["qid"] = message.pop("rid")
    with pytest.raises(InvalidMessage, match="expected keys"):
        parse_generation_reply(message)


REPLY_PATHS = [(k,) for k in good_reply("q")] + [("output_ids", 0), ("logprobs", 1), ("versions", 0),
                                                  ("stop_reasons", 1), ("logprobs", 0, 1), ("versions", 0, 0)]


@FEW
@given(bad=st.one_of(values, st.builds(with_field, st.just(good_reply("bad")), st.sampled_from(REPLY_PATHS), values)))
def test_a_router_sets_aside_any_bad_reply_and_the_episode_gets_its_good_one(bad):
    async def main():
        bus = InProcessBus()
        router = EpisodeRouter(bus, "replies", n_inference_workers=1)
        obs_queue, act_queue = asyncio.Queue(), asyncio.Queue()
        bus.set(protocol.inference_status(0), WorkerStatus(1, 1, 0, 0).to_message())
        router.workers.refresh()
        forward = asyncio.create_task(router.forward(obs_queue, act_queue))
        dispatch = asyncio.create_task(router.dispatch_replies())
        await obs_queue.put(("my-qid", [7, 8], GenerationConfig(n=2)))
        (request,) = await asyncio.to_thread(bus.get_many, protocol.generation_requests(0), 1, 10)
        bus.put_many("replies", [bad, good_reply(request["rid"])])
        output = await asyncio.wait_for(act_queue.get(), 30)
        forward.cancel(), dispatch.cancel()
        return output, router.stats.refused, bus

    output, refused, bus = asyncio.run(main())
    assert output.qid == "my-qid" and output.output_ids == [[1, 2], [3]]
    try:
        parse_generation_reply(bad)
    except InvalidMessage:
        assert refused == 1 and bus.stream_length(protocol.DEAD_MESSAGES) == 1


@FEW
@given(status=values)
def test_a_bad_status_key_is_set_aside_and_the_worker_is_not_taken_for_alive(status):
    bus = InProcessBus()
    bus.set(protocol.inference_status(0), status)
    router = EpisodeRouter(bus, "replies", n_inference_workers=1)
    router.workers.refresh()
    try:
        parse_worker_status(status)
    except InvalidMessage:
        assert not router.workers.is_alive(0)
        assert bus.stream_length(protocol.DEAD_MESSAGES) == (status is not None)  # a None value reads as no key


@FEW
@given(weights=st.one_of(values, st.builds(with_field, st.just({"version": 1, "path": "/w"}),
                                           st.sampled_from([("version",), ("path",)]), values)))
def test_a_bad_weights_message_is_set_aside_and_the_worker_keeps_its_weights(weights):
    bus = InProcessBus()
    engine = ScriptedEngine(lambda *a: [1], tokens_per_step=1)
    worker = InferenceWorker(engine, bus, 0, max_batch_requests=64)
    bus.set(protocol.WEIGHTS, weights)
    worker.load_newest_weights()
    try:
        published = parse_published_weights(weights)
    except InvalidMessage:
        assert engine.version == 0 and bus.stream_length(protocol.DEAD_MESSAGES) == (weights is not None)
    else:
        # a sound announcement is not set aside; no weights are at its path, so the worker keeps serving its own
        # (and says so: rlsys/weight_transport.py), at whatever version it names
        assert engine.version == 0 and bus.stream_length(protocol.DEAD_MESSAGES) == 0, published


def test_a_bad_weights_message_is_set_aside_once_and_left_for_the_next_version_to_replace():
    """The worker deleted the key, which races the learner's next announcement (deleted unread, that version was
    skipped); left in place, it is not set aside again at each check."""
    bus = InProcessBus()
    engine = ScriptedEngine(lambda *a: [1], tokens_per_step=1)
    worker = InferenceWorker(engine, bus, 0, max_batch_requests=64)
    bus.set(protocol.WEIGHTS, {"version": "three", "path": "/w"})
    worker.load_newest_weights()
    worker.load_newest_weights()
    assert bus.get(protocol.WEIGHTS) == {"version": "three", "path": "/w"}
    assert bus.stream_length(protocol.DEAD_MESSAGES) == 1 and engine.version == 0


def test_published_weights_carry_their_checksum_and_dtype_together_or_not_at_all():
    check = {"checksum": "0123456789abcdef" * 2, "dtype": "bfloat16"}
    probe = {"probe": {"version": 2, "token_ids": [[1, 2, 3]], "logprobs": [[-0.5, -1.0]]}}
    for where in ({"path": "/w/v3"}, {"address": "127.0.0.1:5000", "token": "ab" * 16}):
        message = {"version": 3, **where, **check, **probe}
        assert parse_published_weights(message).to_message() == message
        assert parse_published_weights({"version": 3, **where}).checksum == ""
    for bad in ({"checksum": check["checksum"]}, {"dtype": "float32"}, {**check, "dtype": "int8"},
                {**check, "checksum": "xyz"}, {**check, "checksum": check["checksum"] + "00"},
                {"address": "127.0.0.1:5000", "token": "ab" * 16},  # a path and an address
                {"probe": {"version": 2, "token_ids": [[1, 2, 3]], "logprobs": [[-0.5]]}},  # one logprob short
                {"probe": {"version": 2, "token_ids": [[1, 2]], "logprobs": [[0.5]]}},  # a positive logprob
                {"probe": {"version": 3, "token_ids": [[1, 2]], "logprobs": [[-0.5]]}},  # not of an older version
                {"probe": {"token_ids": [[1, 2]], "logprobs": [[-0.5]]}}):  # of no version
        with pytest.raises(InvalidMessage):
            parse_published_weights({"version": 3, "path": "/w/v3", **bad})
    with pytest.raises(InvalidMessage):
        parse_published_weights({"version": 3, "address": "127.0.0.1:5000"})  # no token