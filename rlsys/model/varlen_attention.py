"""Causal attention over packed rows that costs what the sequences cost, registered with transformers.

A packed row holds several sequences end to end, each with position ids restarting at 0. The stock
sdpa path masks such a row with a dense [L, L] block-diagonal mask and still computes all L^2 scores,
which on CPU costs more than the padding packing saves. Here each sequence is attended to on its
own (sum of n^2), with plain causal sdpa and no mask at all. Rows without restarts (a right-padded
batch) are one causal segment: right padding never precedes a real token, so real tokens are exact.
"""

import functools

import torch
from transformers import AttentionInterface

ATTN_IMPLEMENTATION = "rlsys_varlen"


def segment_starts(position_ids: torch.Tensor) -> list[int]:
    """Start index of every sequence in the row, from where the position ids restart at 0."""
    row = position_ids[0]
    if position_ids.shape[0] > 1 and not torch.equal(position_ids, row.expand_as(position_ids)):
        raise ValueError("varlen attention needs one packed row, or rows that share their positions")
    return (row == 0).nonzero().flatten().tolist() or [0]


def varlen_causal_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                            position_ids=None, **kwargs):
    """query [B, H, L, D], key/value [B, H_kv, L, D] -> ([B, L, H, D], None), as transformers expects."""
    if attention_mask is not None or key.shape[2] != query.shape[2]:
        raise ValueError("varlen attention is for training forward passes: no mask, no KV cache")
    starts = segment_starts(position_ids) if position_ids is not None else [0]
    lengths = [end - start for start, end in zip(starts, starts[1:] + [query.shape[2]])]
    attend = functools.partial(causal_attention, scaling=scaling, dropout=dropout if module.training else 0.0,
                               gqa=query.shape[1] != key.shape[1])
    if len(lengths) == 1:
        return attend(query, key, value).transpose(1, 2).contiguous(), None
    # split, not slicing: a slice's backward writes a zero tensor of the whole row per sequence (quadratic in
    # the number of sequences), split's is one concatenation. Sequences of equal length share one sdpa call, so
    # a row of many short sequences (a group's samples) costs a few calls, not one per sequence.
    parts = [t.split(lengths, dim=2) for t in (query, key, value)]
    outputs: list[torch.Tensor | None] = [None] * len(lengths)
    for members in same_length_groups(lengths).values():
        # [len(members) * B, H, length, D]; a length of its own needs no copy
        q, k, v = (p[members[0]] if len(members) == 1 else torch.cat([p[i] for i in members]) for p in parts)
        for i, out in zip(members, attend(q, k, v).split(query.shape[0])):
            outputs[i] = out
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def causal_attention(query, key, value, scaling, dropout: float, gqa: bool) -> torch.Tensor:
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                                            dropout_p=dropout, enable_gqa=gqa)


def same_length_groups(lengths: list[int]) -> dict[int, list[int]]:
    """length -> positions of the sequences that have it, in order."""
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault(n, []).append(i)
    return groups


AttentionInterface.register(ATTN_IMPLEMENTATION, varlen_causal_attention)
