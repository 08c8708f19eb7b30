"""After the learner updates, vLLM's logprobs on a fixed sequence equal the learner's own (float32)."""

import torch
from transformers import AutoModelForCausalLM

from experiments.common import InferenceConfig
from rlsys.algorithms.ppo import gather_logprobs, next_token_logits
from rlsys.api import GenerationConfig
from rlsys.engine.generation import GenerationEngine
from rlsys.engine.vllm_engine import VLLMBackend
from rlsys.engine.weights import write_weight_update
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


def test_engine_logprobs_match_learner_after_updates(tmp_path):
    for tied in (True, False):
        path = save_random_tiny_model(tmp_path / f"model-tied{tied}", tie_word_embeddings=tied)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        assert model.config.tie_word_embeddings is tied
        engine = VLLMBackend(str(path), InferenceConfig(), seed=0)
        fresh = torch.tensor(engine.score(SEQUENCE))
        assert (fresh - learner_logprobs(model)).abs().max() < 1e-4

        for version in (1, 2):
            take_optimizer_steps(model)
            expected = learner_logprobs(model)
            stale_gap = (torch.tensor(engine.score(SEQUENCE)) - expected).abs().max()
            assert stale_gap > 1e-2, "the update must change the logprobs, or this test proves nothing"
            engine.load_weights(write_weight_update(model, tmp_path / f"tied{tied}-v{version}"))
            gap = (torch.tensor(engine.score(SEQUENCE)) - expected).abs().max()
            assert gap < 1e-4, f"tied={tied} version {version}: engine and learner differ by {gap:.2e}"
        del engine


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
