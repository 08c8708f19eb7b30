"""The tiny model's warm start: its batches in groups of similar length take the whole batch's gradient."""

import random

import torch

from experiments.common import ModelConfig
from rlsys.model.tiny import TaughtSequence, _length_groups, _supervised_batch, build_tiny_model, supervised_backward
from rlsys.model.tokenizer import build_char_tokenizer


def test_grouping_by_length_gives_the_padded_batch_gradient():
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1), tokenizer, 0)
    rng = random.Random(0)
    examples = []
    for length in [12] * 6 + [15, 40, 90]:  # arithmetic, and a few long retries among them
        ids = [rng.randrange(7, len(tokenizer)) for _ in range(length)]
        examples.append(TaughtSequence(ids, [0] * (length // 2) + [1] * (length - length // 2)))
    assert len(_length_groups(examples)) == 3

    ids, labels = _supervised_batch(tokenizer, examples)
    model(input_ids=ids, labels=labels).loss.backward()
    padded = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    supervised_backward(model, tokenizer, examples)
    for p, expected in zip(model.parameters(), padded):
        assert torch.allclose(p.grad, expected, atol=1e-6, rtol=1e-4)
