"""Packed-row attention: a row of sequences end to end gives each sequence's own logits and gradients."""

import torch
from transformers import AutoModelForCausalLM

from rlsys.model.varlen_attention import ATTN_IMPLEMENTATION
from tests.helpers import save_random_tiny_model


def test_a_packed_row_equals_each_sequence_alone(tmp_path):
    path = save_random_tiny_model(tmp_path / "model")
    packed = AutoModelForCausalLM.from_pretrained(path, attn_implementation=ATTN_IMPLEMENTATION)
    alone = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    generator = torch.Generator().manual_seed(0)
    # Repeated lengths share an attention call; their order in the row is mixed on purpose.
    sequences = [torch.randint(4, 100, (n,), generator=generator) for n in (5, 3, 5, 7, 3, 5, 1)]
    row = torch.cat(sequences)[None]
    positions = torch.cat([torch.arange(len(s)) for s in sequences])[None]
    logits = packed(input_ids=row, position_ids=positions, use_cache=False).logits[0]
    (logits.square().mean()).backward()

    expected = []
    for s in sequences:
        expected.append(alone(input_ids=s[None], use_cache=False).logits[0])
    torch.testing.assert_close(logits, torch.cat(expected), atol=1e-5, rtol=1e-4)
    (torch.cat(expected).square().mean()).backward()
    for (name, p), q in zip(packed.named_parameters(), alone.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-6, rtol=1e-4, msg=name)
