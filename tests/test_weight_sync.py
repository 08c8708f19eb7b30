"""After the learner updates, vLLM's logprobs on a fixed sequence equal the learner's own (float32)."""

import torch
from transformers import AutoModelForCausalLM

from experiments.common import InferenceConfig
from rlsys.algorithms.ppo import gather_logprobs, next_token_logits
from rlsys.engine.vllm_engine import VLLMBackend
from rlsys.engine.weights import write_weight_update
from tests.helpers import save_random_tiny_model

SEQUENCE = [4, 7, 8, 78, 9, 10, 86, 1, 5, 10, 12, 1]


def learner_logprobs(model) -> torch.Tensor:
    ids = torch.tensor([SEQUENCE])
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
