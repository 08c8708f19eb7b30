"""Causal attention over packed rows that costs what the sequences cost, registered with transformers.

A packed row holds several sequences end to end, each with position ids restarting at 0. The stock
sdpa path masks such a row with a dense [L, L] block-diagonal mask and still computes all L^2 scores,
which on CPU costs more than the padding packing saves. Here each sequence is attended to on its
own (sum of n^2), with plain causal sdpa and no mask at all. Rows without restarts (a right-padded
batch) are one causal segment: right padding never precedes a real token, so real tokens are exact.

On a CUDA GPU in half precision (`learner.dtype=bfloat16`) one packed row is one call of torch's
flash-attention varlen kernel instead: on a GPU the per-length sdpa calls are launch-bound.

A row whose segments continue shared prefixes (rlsys/algorithms/packing.py) is attended to segment by segment
too: a continuation's queries see its prefix's keys and its own, causally; segments of similar size are padded
into one masked sdpa call.
"""

import functools
import inspect

import numpy as np
import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import repeat_kv

from rlsys.host_copy import to_device

ATTN_IMPLEMENTATION = "rlsys_varlen"


def segment_starts(position_ids: torch.Tensor) -> list[int]:
    """Start index of every sequence in the row, from where the position ids restart at 0.

    Every layer of one forward pass gets the same position_ids tensor: it is read once (on a GPU each read
    is a synchronisation) and kept, with the tensor, until another one comes; or the caller, which built the
    row on the host, says where they are first (`known_segment_starts`) and nothing is read.
    """
    if _last_read[0] is position_ids:
        return _last_read[1]
    row = position_ids[0]
    if position_ids.shape[0] > 1 and not torch.equal(position_ids, row.expand_as(position_ids)):
        raise ValueError("varlen attention needs one packed row, or rows that share their positions")
    starts = (row == 0).nonzero().flatten().tolist() or [0]
    known_segment_starts(position_ids, starts)
    return starts


def known_segment_starts(position_ids: torch.Tensor, starts: list[int],
                         contexts: list[tuple[int, int]] | None = None) -> None:
    """Where the segments of the packed row `position_ids` start, as the host that built it knows, and the
    (start, length) of the shared prefix each continues (packing.py's MicroBatch.contexts), if any."""
    _last_read[:] = [position_ids, starts, None]
    _shared[:] = [position_ids, contexts if contexts and any(n for _, n in contexts) else None, None]


_last_read: list = [None, None, None]  # [position_ids, segment starts, their bounds on the device (flash varlen)]:
# held, so the identity check is sound
_shared: list = [None, None, None]  # [position_ids, segment contexts, their gather plan on the device]


def varlen_causal_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                            position_ids=None, **kwargs):
    """query [B, H, L, D], key/value [B, H_kv, L, D] -> ([B, L, H, D], None), as transformers expects."""
    if attention_mask is not None or key.shape[2] != query.shape[2]:
        raise ValueError("varlen attention is for training forward passes: no mask, no KV cache")
    if not query.is_cuda and (query.dtype != torch.float32 or torch.is_autocast_enabled("cpu")):
        # torch's CPU attention kernels take longer in bfloat16 than in float32, the backward most of all
        # (BENCHMARKS.md, "A bfloat16 learner on a CPU"): the matmuls around them keep the half precision.
        with torch.autocast("cpu", enabled=False):
            out, _ = varlen_causal_attention(module, query.float(), key.float(), value.float(), None, scaling,
                                             dropout, position_ids, **kwargs)
        return out.to(query.dtype), None
    starts = segment_starts(position_ids) if position_ids is not None else [0]
    lengths = [end - start for start, end in zip(starts, starts[1:] + [query.shape[2]])]
    dropout = dropout if module.training else 0.0
    if _shared[0] is position_ids and _shared[1] is not None:
        if _shared[2] is None:
            _shared[2] = shared_prefix_plan(starts, lengths, _shared[1], query.device)
        return shared_prefix_attention(query, key, value, _shared[2], scaling, dropout), None
    if len(lengths) > 1 and flash_varlen_applies(query, dropout):
        return flash_varlen_attention(query, key, value, starts, max(lengths), scaling), None
    attend = functools.partial(causal_attention, scaling=scaling, dropout=dropout)
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


def shared_prefix_plan(starts: list[int], lengths: list[int], contexts: list[tuple[int, int]], device,
                       waste: float = 2.0) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """For each sdpa call: which row slots are its queries [S, Q] and keys [S, K], and its mask [S, 1, Q, K]
    (True: attend), for S segments padded to the longest; then the slot order of all calls' outputs.

    Segment s's keys are its prefix's slots then its own; query a sees every prefix key and its own keys up to
    itself. Segments are sorted by key count and cut into calls whose padded scores stay within `waste` times
    their own (plus a small floor): one call for a step of short sequences, none quadratic in a long one."""
    segments = sorted(range(len(starts)), key=lambda s: contexts[s][1] + lengths[s])
    calls, current, q, k, own = [], [], 0, 0, 0  # the current call's segments, longest query and key, real scores
    for s in segments:
        n, keys = lengths[s], contexts[s][1] + lengths[s]
        if current and (len(current) + 1) * max(q, n) * max(k, keys) > waste * (own + n * keys) + 4096:
            calls.append(current)
            current, q, k, own = [], 0, 0, 0
        current.append(s)
        q, k, own = max(q, n), max(k, keys), own + n * keys
    calls.append(current)
    plan, slots = [], np.empty(sum(lengths), dtype=np.int64)  # slots: each row slot's place among the outputs
    base = 0
    for call in calls:
        q_len = max(lengths[s] for s in call)
        k_len = max(contexts[s][1] + lengths[s] for s in call)
        queries = np.zeros((len(call), q_len), dtype=np.int64)
        keys = np.zeros((len(call), k_len), dtype=np.int64)
        mask = np.zeros((len(call), 1, q_len, k_len), dtype=bool)
        for row, s in enumerate(call):
            (c_start, c_len), n = contexts[s], lengths[s]
            own = np.arange(starts[s], starts[s] + n)
            queries[row, :n] = own
            keys[row, :c_len + n] = np.concatenate([np.arange(c_start, c_start + c_len), own])
            mask[row, 0, :n, :c_len + n] = np.arange(c_len + n)[None, :] <= c_len + np.arange(n)[:, None]
            mask[row, 0, n:, 0] = True  # padding queries see one key: no empty softmax (NaN); their outputs unused
            slots[own] = base + row * q_len + np.arange(n)
        base += len(call) * q_len
        plan.append(tuple(to_device(a, device) for a in (queries, keys, mask)))
    return plan + [to_device(slots, device)]


def shared_prefix_attention(query, key, value, plan, scaling, dropout: float) -> torch.Tensor:
    """query [1, H, L, D], key/value [1, H_kv, L, D] of a row with shared prefixes -> [1, L, H, D]."""
    *calls, slots = plan
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [L, H, D]
    outputs = []
    for queries, keys, mask in calls:
        out = grouped_sdpa(q[queries].transpose(1, 2), k[keys].transpose(1, 2), v[keys].transpose(1, 2),
                           attn_mask=mask, scale=scaling, dropout_p=dropout)  # [S, H, Q, D]
        outputs.append(out.transpose(1, 2).flatten(0, 1))  # [S * Q, H, D]
    return torch.cat(outputs)[slots][None]


def causal_attention(query, key, value, scaling, dropout: float) -> torch.Tensor:
    return grouped_sdpa(query, key, value, is_causal=True, scale=scaling, dropout_p=dropout)


def grouped_sdpa(query, key, value, **kwargs) -> torch.Tensor:
    """torch's sdpa, with fewer key/value heads than query heads (grouped-query attention) passed as they are where
    the kernel torch picks takes them, and repeated to the query's heads where it does not: on CUDA only the flash
    kernel takes them (half precision, no mask), and a float32 or masked call, which the memory-efficient kernel
    serves, would fall back to sdpa's math path, a dozen kernels a call (each a launch, and its backward more).
    torch's CPU kernel takes them."""
    grouped = query.shape[1] != key.shape[1]
    if grouped and not kernel_takes_groups(query, kwargs.get("attn_mask") is not None):
        key, value = (repeat_kv(t, query.shape[1] // t.shape[1]) for t in (key, value))
        grouped = False
    return torch.nn.functional.scaled_dot_product_attention(query, key, value, enable_gqa=grouped, **kwargs)


def kernel_takes_groups(query: torch.Tensor, masked: bool) -> bool:
    """Whether sdpa's kernel for this call takes fewer key/value heads than query heads (see grouped_sdpa)."""
    if not query.is_cuda:
        return True
    return not masked and half_precision(query) is not None and query.shape[-1] % 8 == 0 and query.shape[-1] <= 256


def flash_varlen_applies(query: torch.Tensor, dropout: float) -> bool:
    """torch's flash varlen kernel: CUDA, half precision (or autocast to it), one row, head size a multiple of 8,
    no dropout."""
    return (query.is_cuda and half_precision(query) is not None and query.shape[0] == 1
            and query.shape[-1] % 8 == 0 and not dropout and _varlen_attn() is not None)


def half_precision(query: torch.Tensor) -> torch.dtype | None:
    """The half dtype the kernel runs in: the query's own, or autocast's (rotary embeddings hand over float32
    queries under autocast, as the residual stream stays float32)."""
    if query.dtype in (torch.float16, torch.bfloat16):
        return query.dtype
    if torch.is_autocast_enabled("cuda") and torch.get_autocast_dtype("cuda") in (torch.float16, torch.bfloat16):
        return torch.get_autocast_dtype("cuda")
    return None


@functools.cache
def _varlen_attn():
    """torch's varlen_attn with causal masking bound (its argument changed name in torch 2.11), or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:  # torch < 2.10
        return None
    parameters = inspect.signature(varlen_attn).parameters
    if "scale" not in parameters:
        return None
    causal = {"window_size": (-1, 0)} if "window_size" in parameters else {"is_causal": True}
    return functools.partial(varlen_attn, **causal), "enable_gqa" in parameters


def flash_varlen_attention(query, key, value, starts: list[int], longest: int, scaling) -> torch.Tensor:
    """[1, H, L, D] q/k/v of one packed row -> [1, L, H, D]: one kernel call for all its sequences."""
    attend, has_gqa = _varlen_attn()
    dtype = half_precision(query)
    q, k, v = (t[0].transpose(0, 1).to(dtype) for t in (query, key, value))  # [L, H, D]
    gqa = q.shape[1] != k.shape[1]
    if gqa and not has_gqa:  # torch 2.10's kernel wants as many key/value heads as query heads
        k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    if _last_read[1] is starts and _last_read[2] is not None:  # every layer of the forward pass: one copy
        bounds = _last_read[2]
    else:
        bounds = to_device(starts + [q.shape[0]], q.device, np.int32)
        if _last_read[1] is starts:
            _last_read[2] = bounds
    extra = {"enable_gqa": True} if gqa and has_gqa else {}
    return attend(q, k, v, bounds, bounds, longest, longest, scale=scaling, **extra)[None]


def same_length_groups(lengths: list[int]) -> dict[int, list[int]]:
    """length -> positions of the sequences that have it, in order."""
    groups: dict[int, list[int]] = {}
    for i, n in enumerate(lengths):
        groups.setdefault(n, []).append(i)
    return groups


AttentionInterface.register(ATTN_IMPLEMENTATION, varlen_causal_attention)
