"""The transformers engine's decode steps and prefills replayed as CUDA graphs (by default on a GPU;
`inference.enforce_eager`).

A small model's decode step on a GPU is a few hundred kernels of microseconds each, and Python issuing them (HF's
model forward with its mask and cache objects) takes longer than they run: the engine's step is launch-bound, as
vLLM's is without graphs. A graph captured once per (batch size, cache width) issues the whole step as one launch.
A prefill (the prompts of the sequences that join, and of those a weight update interrupted) is the same number of
launches, so it too replays a graph, one per (rows, prompt width) bucket, rows and left padding added.

A graph replays exactly the kernels it recorded, on the addresses it recorded, so everything a step varies lives in
device buffers filled before each replay: the token ids, their positions and the cache column they write, here; the
KV cache and its mask, in the running batch's buffers, which it allocates once at their largest
(`_RunningBatch(fixed_columns=...)`) and rearranges in place. Batch sizes and widths are rounded up to a few
buckets: padding rows attend to their own column only and their logits are dropped, and columns past the width
hold no running sequence's tokens.

Those buffers hold every slot's longest sequence from the start (a 135M-shaped model's 256 sequences of 8,192 tokens
would be 97 GB in float32), so the slots are as many as fit in `inference.gpu_memory_utilization` of the GPU
besides the model, up to `inference.max_num_seqs`, and fewer than one is refused at start-up.

The forward pass calls the decoder's own modules in order, without HF's model forward (its masks and cache objects
are host work on every step): the Llama layout, which Qwen2, Qwen3 and Mistral share; other architectures are
refused by name. Its logits are HF's to float rounding (tests/test_transformers_engine.py).
"""

from collections.abc import Callable

import torch
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from rlsys.cuda_graphs import GRAPH_CAPTURE
from rlsys.engine.kv_cache import kv_bytes_per_token

MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")  # the Llama layout, with Qwen3's per-head norms
MIN_WIDTH = 64  # the narrowest cache width a graph attends over; wider ones double up to the buffers' columns
MIN_PROMPT_WIDTH = 16  # the narrowest prefill a graph runs; wider ones double up to the buffers' columns


def cuda_memory(device: torch.device) -> tuple[int, int, int]:
    """Bytes this process holds on the GPU (the model, so far), bytes free (other processes, a learner sharing the
    GPU, hold the rest) and the GPU's total."""
    free, total = torch.cuda.mem_get_info(device)
    return torch.cuda.memory_reserved(device), free, total


DEVICE_MEMORY: dict[str, Callable[[torch.device], tuple[int, int, int]]] = {"cuda": cuda_memory}  # by device type


def slots_that_fit(config, dtype: torch.dtype, device: torch.device, slots: int, columns: int,
                   memory_share: float) -> int:
    """The most slots, up to `slots`, whose keys, values and mask of `columns` columns fit in `memory_share` of
    the device's memory less what this process holds already, and in what is free; a ValueError if not one does."""
    per_slot = columns * (kv_bytes_per_token(config, dtype.itemsize) + torch.long.itemsize)  # and the mask
    held, free, total = DEVICE_MEMORY[device.type](device)
    room = min(memory_share * total - held, free)
    fit = int(room // per_slot)
    if fit < 1:
        raise ValueError(
            f"the transformers engine's CUDA graphs keep a KV cache of {columns} columns for each sequence, "
            f"{per_slot / 2**20:.1f} MiB, and inference.gpu_memory_utilization={memory_share} of the GPU's "
            f"{total / 2**30:.1f} GiB ({free / 2**30:.1f} GiB free) leaves {max(room, 0) / 2**20:.1f} MiB besides "
            f"the model: raise it, lower inference.max_model_len, or set inference.enforce_eager=true")
    return min(slots, fit)


class DecodeGraphs:
    """Decode steps of one model over one running batch's buffers, a graph per (batch bucket, width bucket),
    captured the first time a step needs it."""

    def __init__(self, model, device: torch.device, slots: int, columns: int, memory_share: float):
        if device.type not in GRAPH_CAPTURE:
            raise ValueError(f"inference.enforce_eager=false asks the transformers engine for CUDA graphs, which need "
                             f"a GPU; this worker runs on the {device.type}: leave inference.enforce_eager=true")
        model_type = model.config.model_type
        if model_type not in MODEL_TYPES:
            raise ValueError(f"the transformers engine replays decode steps as CUDA graphs for models of types "
                             f"{list(MODEL_TYPES)}; this one is {model_type!r}: set inference.enforce_eager=true")
        rope = str(getattr(model.model.rotary_emb, "rope_type", "default"))
        if "dynamic" in rope or "longrope" in rope:  # they choose their frequencies on the host, from the positions
            raise ValueError(f"the transformers engine's CUDA graphs cannot hold {rope!r} rotary embeddings, which "
                             "change with the sequence length: set inference.enforce_eager=true")
        self.model = model
        self.capture = GRAPH_CAPTURE[device.type]()
        self.slots = slots = slots_that_fit(model.config, model.dtype, device, slots, columns, memory_share)
        self.batch_sizes = _buckets(1, slots)
        self.widths = _buckets(min(MIN_WIDTH, columns), columns)
        self.ids = torch.zeros(slots, 1, dtype=torch.long, device=device)
        self.positions = torch.zeros(slots, 1, dtype=torch.long, device=device)
        self.column = torch.zeros(1, dtype=torch.long, device=device)
        self._graphs: dict[tuple[int, int], Callable[[], torch.Tensor]] = {}
        self._buffers: int | None = None  # the address of the buffers the graphs were captured on
        self.prompt_widths = _buckets(min(MIN_PROMPT_WIDTH, columns), columns)
        # (rows, width, every position's logits) -> that bucket's input ids and mask, and its graph
        self._prefills: dict[tuple[int, int, bool], tuple[torch.Tensor, torch.Tensor, Callable]] = {}

    @property
    def captured(self) -> int:
        """Decode graphs captured so far."""
        return len(self._graphs)

    @property
    def captured_prefills(self) -> int:
        """Prefill graphs captured so far."""
        return len(self._prefills)

    def prefill(self, ids: torch.Tensor, mask: torch.Tensor,
                every_position: bool = False) -> tuple[list, list, torch.Tensor]:
        """`prefill_forward` of left-padded prompts (`ids`, `mask`: [rows, width] on the device), replayed from the
        graph of their (rows, width) bucket: more rows with no token, more columns of left padding. Returns the
        given rows' and columns' keys and values and their logits: views of the graph's outputs, to be read before
        the next replay."""
        rows, width = ids.shape
        batch, columns = _bucket(rows, self.batch_sizes), _bucket(width, self.prompt_widths)
        entry = self._prefills.get((batch, columns, every_position))
        if entry is None:
            ids_in, mask_in = (torch.zeros(batch, columns, dtype=torch.long, device=ids.device) for _ in range(2))
            graph = self.capture(lambda: prefill_forward(self.model, ids_in, mask_in, every_position))
            entry = self._prefills[batch, columns, every_position] = ids_in, mask_in, graph
        ids_in, mask_in, graph = entry
        ids_in.zero_()
        mask_in.zero_()
        ids_in[:rows, columns - width:] = ids
        mask_in[:rows, columns - width:] = mask
        keys, values, logits = graph()
        return ([k[:rows, :, columns - width:] for k in keys], [v[:rows, :, columns - width:] for v in values],
                logits[:rows, columns - width:] if every_position else logits[:rows])

    def decode(self, keys: list[torch.Tensor], values: list[torch.Tensor], mask: torch.Tensor, ids: list[int],
               positions: list[int], column: int) -> torch.Tensor:
        """The next-token logits (float32) of rows 0..len(ids)-1, each fed ids[i] at positions[i], whose keys and
        values go into cache column `column`; `mask` already has that column set for them."""
        if self._buffers != keys[0].data_ptr():  # the running batch allocates once; never replay on freed memory
            self._graphs.clear()
            self._buffers = keys[0].data_ptr()
        rows = len(ids)
        batch, width = _bucket(rows, self.batch_sizes), _bucket(column + 1, self.widths)
        mask[rows:batch, column] = 1  # padding rows attend to their own column: none turns into NaNs
        self.ids[:rows, 0] = torch.tensor(ids)
        self.positions[:rows, 0] = torch.tensor(positions)
        self.column.fill_(column)
        graph = self._graphs.get((batch, width))
        if graph is None:
            graph = self._graphs[batch, width] = self.capture(lambda: decode_forward(
                self.model, self.ids[:batch], self.positions[:batch], self.column,
                [k[:batch] for k in keys], [v[:batch] for v in values], mask[:batch], width))
        return graph()[:rows]


def decode_forward(model, ids: torch.Tensor, positions: torch.Tensor, column: torch.Tensor,
                   keys: list[torch.Tensor], values: list[torch.Tensor], mask: torch.Tensor,
                   width: int) -> torch.Tensor:
    """One decode step of a Llama-layout model: writes each layer's new key and value into `column` of its
    buffers ([rows, kv heads, columns, head dim]) and attends over their first `width` columns where `mask`
    ([rows, columns]) is 1. Only `width` is a host value: a graph captured with it stays right for any contents."""
    inner = model.model
    hidden = inner.embed_tokens(ids)
    cos, sin = inner.rotary_emb(hidden, positions)
    attend = mask[:, None, None, :width].bool()  # one query a row: the same for every head of a group
    for layer, key_buffer, value_buffer in zip(inner.layers, keys, values):
        def attention(query, key, value, scale, key_buffer=key_buffer, value_buffer=value_buffer):
            key_buffer.index_copy_(2, column, key)
            value_buffer.index_copy_(2, column, value)
            return grouped_query_attention(query, key_buffer[:, :, :width], value_buffer[:, :, :width], attend,
                                           scale)

        hidden = _decoder_layer(layer, hidden, cos, sin, attention)
    return model.lm_head(inner.norm(hidden))[:, -1].float()


def prefill_forward(model, ids: torch.Tensor, mask: torch.Tensor,
                    every_position: bool = False) -> tuple[list, list, torch.Tensor]:
    """The prompts' forward pass of a Llama-layout model, as `decode_forward` runs its decode step: the decoder's own
    modules in order, without HF's model forward, whose mask and cache objects cost more host time than a small
    model's kernels take. `ids` and `mask` ([rows, width]) hold left-padded prompts; returns every layer's keys and
    values ([rows, kv heads, width, head dim]) and the logits (float32) that predict each row's next token, or with
    `every_position` those of every position ([rows, width, vocabulary]: scoring a sequence)."""
    inner = model.model
    width = ids.shape[1]
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
    hidden = inner.embed_tokens(ids)
    cos, sin = inner.rotary_emb(hidden, positions)
    # Causal over the row's own tokens; a padding query attends to itself only (its output is never read), so no
    # row of the softmax is empty.
    causal = torch.ones(width, width, dtype=torch.bool, device=ids.device).tril()
    attend = (causal & mask[:, None, None, :].bool()) | torch.eye(width, dtype=torch.bool, device=ids.device)
    groups = model.config.num_attention_heads // model.config.num_key_value_heads
    attend = attend.repeat(1, 1, groups, 1)  # a row of the mask for every query of a group (grouped_query_attention)
    keys, values = [], []

    def attention(query, key, value, scale):
        keys.append(key)
        values.append(value)
        return grouped_query_attention(query, key, value, attend, scale)

    for layer in inner.layers:
        hidden = _decoder_layer(layer, hidden, cos, sin, attention)
    return keys, values, model.lm_head(inner.norm(hidden if every_position else hidden[:, -1])).float()


def grouped_query_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attend: torch.Tensor,
                            scale: float) -> torch.Tensor:
    """Masked sdpa of query heads [rows, heads, tokens, head dim] over fewer key/value heads, as one call with as many
    heads on both sides: each key/value head's group of query heads is stacked along the query length
    ([rows, kv heads, group * tokens, head dim]), and `attend` ([rows, 1, group * tokens or 1, width]) has a row for
    each. On CUDA the kernels that take a mask take no groups, and `enable_gqa` would run sdpa's math path, a dozen
    kernels with a copy of the keys and values for every query head."""
    rows, heads, tokens, dim = query.shape
    stacked = query.reshape(rows, key.shape[1], heads // key.shape[1] * tokens, dim)
    out = torch.nn.functional.scaled_dot_product_attention(stacked, key, value, attn_mask=attend, scale=scale)
    return out.reshape(rows, heads, tokens, dim)


def _decoder_layer(layer, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                   attention: Callable[..., torch.Tensor]) -> torch.Tensor:
    """One Llama-layout decoder layer on `hidden` ([rows, tokens, hidden size]). `attention(query, key, value,
    scale)` gets the rotated heads ([rows, heads, tokens, head dim]) and returns their attention's output, shaped
    like `query`: where the keys and values are kept, and what they attend over, is the caller's."""
    self_attention = layer.self_attn
    rows, tokens = hidden.shape[:2]
    x = layer.input_layernorm(hidden)
    shape = (rows, tokens, -1, self_attention.head_dim)
    query, key = self_attention.q_proj(x).view(shape), self_attention.k_proj(x).view(shape)
    if hasattr(self_attention, "q_norm"):  # Qwen3 normalises each head before the rotation
        query, key = self_attention.q_norm(query), self_attention.k_norm(key)
    query, key = apply_rotary_pos_emb(query.transpose(1, 2), key.transpose(1, 2), cos, sin)
    value = self_attention.v_proj(x).view(shape).transpose(1, 2)
    out = attention(query, key, value, self_attention.scaling)
    hidden = hidden + self_attention.o_proj(out.transpose(1, 2).reshape(rows, tokens, -1))
    return hidden + layer.mlp(layer.post_attention_layernorm(hidden))


def _buckets(smallest: int, largest: int) -> list[int]:
    """Powers of two from `smallest` below `largest`, then `largest`."""
    sizes = [smallest]
    while sizes[-1] * 2 < largest:
        sizes.append(sizes[-1] * 2)
    return sorted(set(sizes + [largest]))


def _bucket(needed: int, sizes: list[int]) -> int:
    return next(size for size in sizes if size >= needed)
