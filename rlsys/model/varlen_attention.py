"""Causal attention over packed rows that costs what the sequences cost, registered with transformers.

A packed row holds several sequences end to end, each with position ids restarting at 0. The stock
sdpa path masks such a row with a dense [L, L] block-diagonal mask and still computes all L^2 scores,
which on CPU costs more than the padding packing saves. Here each sequence is attended to on its
own (sum of n^2), with plain causal sdpa and no mask at all. Rows without restarts (a right-padded
batch) are one causal segment: right padding never precedes a real token, so real tokens are exact.
"""

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
    bounds = list(zip(starts, starts[1:] + [query.shape[2]]))
    gqa = query.shape[1] != key.shape[1]
    outputs = [
        torch.nn.functional.scaled_dot_product_attention(
            query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], is_causal=True, scale=scaling,
            dropout_p=dropout if module.training else 0.0, enable_gqa=gqa)
        for s, e in bounds
    ]
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


AttentionInterface.register(ATTN_IMPLEMENTATION, varlen_causal_attention)
