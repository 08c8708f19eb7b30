"""Packed-row attention: a row of sequences end to end gives each sequence's own logits and gradients."""

import pytest
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


def test_sequences_continuing_a_shared_prefix_equal_each_sequence_alone(tmp_path):
    """A row of prefixes, each once, followed by the sequences' own tokens: each token's logits are those of its
    sequence alone, over calls of several sizes (one long group gets an sdpa call of its own)."""
    from rlsys.model.varlen_attention import known_segment_starts, shared_prefix_plan

    path = save_random_tiny_model(tmp_path / "model")
    packed = AutoModelForCausalLM.from_pretrained(path, attn_implementation=ATTN_IMPLEMENTATION)
    alone = AutoModelForCausalLM.from_pretrained(path, attn_implementation="eager")
    generator = torch.Generator().manual_seed(0)
    tokens = lambda n: torch.randint(4, 100, (n,), generator=generator)  # noqa: E731
    groups = [(tokens(6), [tokens(n) for n in (3, 1, 4)]), (tokens(2), [tokens(5)]),
              (tokens(90), [tokens(40), tokens(2)]), (tokens(0), [tokens(7)])]  # the last one shares nothing
    ids, positions, starts, contexts = [], [], [], []
    cursor = 0
    for prefix, continuations in groups:
        k = len(prefix)
        if k:
            ids.append(prefix), positions.append(torch.arange(k)), starts.append(cursor), contexts.append((cursor, 0))
        shared = (cursor, k)
        cursor += k
        for own in continuations:
            ids.append(own), positions.append(torch.arange(k, k + len(own))), starts.append(cursor)
            contexts.append(shared)
            cursor += len(own)
    row, position_ids = torch.cat(ids)[None], torch.cat(positions)[None]
    lengths = [end - start for start, end in zip(starts, starts[1:] + [cursor])]
    assert len(shared_prefix_plan(starts, lengths, contexts, "cpu")) - 1 > 1  # several sdpa calls
    known_segment_starts(position_ids, starts, contexts)
    logits = packed(input_ids=row, position_ids=position_ids, use_cache=False).logits[0]
    at = 0
    for prefix, continuations in groups:
        for i, own in enumerate(continuations):
            whole = alone(input_ids=torch.cat([prefix, own])[None], use_cache=False).logits[0]
            if i == 0 and len(prefix):
                torch.testing.assert_close(logits[at:at + len(prefix)], whole[:len(prefix)], atol=1e-5, rtol=1e-4)
                at += len(prefix)
            torch.testing.assert_close(logits[at:at + len(own)], whole[len(prefix):], atol=1e-5, rtol=1e-4)
            at += len(own)
    assert at == row.shape[1]


def test_grouped_heads_are_repeated_where_the_kernel_would_not_take_them_and_give_the_same_attention(monkeypatch):
    """On CUDA only sdpa's flash kernel takes fewer key/value heads than query heads (half precision, no mask);
    a float32 or masked call gets them repeated, or sdpa falls back to its math path. Either way the same values
    and gradients (checked here on the CPU with the repeat forced)."""
    from types import SimpleNamespace

    from rlsys.model import varlen_attention

    def query(cuda: bool, dtype: torch.dtype, head_size: int = 16):
        return SimpleNamespace(is_cuda=cuda, dtype=dtype, shape=(2, 4, 9, head_size))

    kernel_takes_groups = varlen_attention.kernel_takes_groups
    assert kernel_takes_groups(query(True, torch.bfloat16), masked=False)
    assert not kernel_takes_groups(query(True, torch.float32), masked=False)  # the memory-efficient kernel
    assert not kernel_takes_groups(query(True, torch.bfloat16), masked=True)
    assert not kernel_takes_groups(query(True, torch.bfloat16, head_size=12), masked=False)
    assert kernel_takes_groups(query(False, torch.float32), masked=True)

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 9, 16, generator=generator, requires_grad=True) for h in (4, 2, 2))
    mask = torch.rand(2, 1, 9, 9, generator=generator) > 0.3
    mask[..., 0] = True
    results = []
    for repeated in (False, True):
        monkeypatch.setattr(varlen_attention, "kernel_takes_groups", lambda query, masked: not repeated)
        for kwargs in ({"is_causal": True}, {"attn_mask": mask}):
            out = varlen_attention.grouped_sdpa(q, k, v, scale=0.25, **kwargs)
            grads = torch.autograd.grad(out.square().sum(), (q, k, v))
            results.append((out, *grads))
    for plain, repeated in zip(results[:2], results[2:]):
        for a, b in zip(plain, repeated):
            torch.testing.assert_close(a, b)


FAMILIES = {  # the shapes the learner trains: absolute positions (GPT-2), rotary with grouped heads, scaled rotary
    "gpt2": dict(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64),
    "llama": dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=100, max_position_embeddings=64),
    "llama-linear-rope": dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                              num_key_value_heads=2, vocab_size=100, max_position_embeddings=64,
                              rope_scaling={"rope_type": "linear", "factor": 2.0}),
    "qwen2": dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=1, vocab_size=100, max_position_embeddings=64),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_a_packed_row_gives_the_logits_of_a_padded_hf_forward_in_every_family(family):
    """Each sequence's logits in a packed row (positions restarting at 0, no mask) are those of HF's own sdpa
    attention over the same sequences right-padded with an attention mask."""
    from transformers import AutoConfig

    def model(attention: str):  # a config each: a model built from one sets its attention on the config it shares
        torch.manual_seed(0)
        built = AutoModelForCausalLM.from_config(AutoConfig.for_model(family.split("-")[0], **FAMILIES[family]),
                                                 attn_implementation=attention).eval()
        assert built.config._attn_implementation == attention
        return built

    padded, packed = model("sdpa"), model(ATTN_IMPLEMENTATION)
    assert all(torch.equal(p, q) for p, q in zip(padded.parameters(), packed.parameters()))
    generator = torch.Generator().manual_seed(1)
    sequences = [torch.randint(1, 100, (n,), generator=generator) for n in (5, 9, 3, 12, 9)]
    row = torch.cat(sequences)[None]
    positions = torch.cat([torch.arange(len(s)) for s in sequences])[None]
    ids = torch.nn.utils.rnn.pad_sequence(sequences, batch_first=True)
    mask = torch.nn.utils.rnn.pad_sequence([torch.ones_like(s) for s in sequences], batch_first=True)
    with torch.no_grad():
        logits = packed(input_ids=row, position_ids=positions, use_cache=False).logits[0]
        expected = padded(input_ids=ids, attention_mask=mask, use_cache=False).logits
    torch.testing.assert_close(logits, torch.cat([expected[i, :len(s)] for i, s in enumerate(sequences)]),
                               atol=1e-5, rtol=1e-4)
