"""After the learner updates, vLLM's logprobs on a fixed sequence equal the learner's own (float32)."""

from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from experiments.common import InferenceConfig
from rlsys import protocol
from rlsys.algorithms.ppo import gather_logprobs, next_token_logits
from rlsys.api import GenerationConfig
from rlsys.bus import EmbeddedRedis, InProcessBus, connect
from rlsys.engine.generation import GenerationEngine
from rlsys.engine.vllm_engine import VLLMBackend
from rlsys.engine.weights import write_weight_update
from rlsys.weight_transport import WeightReceiver, publish
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


def test_engine_logprobs_match_learner_after_updates_over_disk_and_over_the_bus(tmp_path):
    """Version 1 reaches the engine as a file in a shared directory, version 2 as checksummed chunks over a
    real Redis, written into the receiver's own directory: both give the learner's logprobs."""
    with EmbeddedRedis(tmp_path / "redis") as server, connect(server.url) as bus:
        for tied in (True, False):
            check_updates(tmp_path, bus, tied)


def check_updates(tmp_path, bus, tied: bool) -> None:
    receiver = WeightReceiver(bus)
    path = save_random_tiny_model(tmp_path / f"model-tied{tied}", tie_word_embeddings=tied)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert model.config.tie_word_embeddings is tied
    engine = VLLMBackend(str(path), InferenceConfig(), seed=0)
    fresh = torch.tensor(engine.score(SEQUENCE))
    assert (fresh - learner_logprobs(model)).abs().max() < 1e-4

    for version, transport in enumerate(("disk", "bus"), start=1):
        take_optimizer_steps(model)
        expected = learner_logprobs(model)
        stale_gap = (torch.tensor(engine.score(SEQUENCE)) - expected).abs().max()
        assert stale_gap > 1e-2, "the update must change the logprobs, or this test proves nothing"
        publish(bus, model, version, transport, tmp_path / f"tied{tied}-weights")
        directory = receiver.directory(bus.get(protocol.WEIGHTS))
        assert (tmp_path in Path(directory).parents) == (transport == "disk")
        engine.load_weights(directory)
        gap = (torch.tensor(engine.score(SEQUENCE)) - expected).abs().max()
        assert gap < 1e-4, f"tied={tied} {transport}: engine and learner differ by {gap:.2e}"
    assert receiver.received_over_bus == 1
    receiver.close()
    del engine


def test_a_bus_version_changed_while_read_is_skipped_not_loaded(tmp_path):
    """A resumed run republishes a version while a worker reads it: the digest no longer matches, and the
    worker waits for the next pointer instead of loading a mix of two models."""
    model = AutoModelForCausalLM.from_pretrained(save_random_tiny_model(tmp_path / "model"), dtype=torch.float32)
    bus = InProcessBus()
    publish(bus, model, 1, "bus", tmp_path)
    pointer = bus.get(protocol.WEIGHTS)
    take_optimizer_steps(model, steps=1)
    publish(bus, model, 1, "bus", tmp_path)
    receiver = WeightReceiver(bus)
    assert receiver.directory(pointer) is None
    assert receiver.directory(bus.get(protocol.WEIGHTS)) is not None
    receiver.close()


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
    assert engine.update_weights(str(write_weight_update(model, tmp_path / "v1")), version=1) == 2
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
