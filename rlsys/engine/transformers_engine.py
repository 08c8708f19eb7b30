"""The transformers backend: continuous batching on a Hugging Face model, for machines without vLLM.

All running sequences share one left-padded batch and one KV cache, so a step is a single batched
decode forward pass, whatever the number of sequences. Sequences added between steps are prefilled
together (identical prompts, such as a request's n samples, once) and join the running batch in the
same step, in the places that finished or aborted sequences left. Each row has its own position ids,
so left padding moves no token and the logits equal an unpadded forward pass's to float rounding.

Sampling and logprobs follow vLLM with `logprobs_mode="processed_logprobs"`: the logprob of the sampled
token under softmax(logits / temperature) over the whole vocabulary (temperature 1 when greedy, 0.01 for
one between 0 and 0.01, as vLLM raises it), top-k and top-p only restricting which token is drawn; a stop
or end-of-sequence token ends the sequence and is part of its output.
"""

import logging
from dataclasses import dataclass, replace

import numpy as np
import torch
from transformers import AttentionInterface, AutoModelForCausalLM, DynamicCache
from transformers.cache_utils import Cache, DynamicLayer
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

from rlsys.api.generation import GREEDY_BELOW, MIN_TEMPERATURE
from rlsys.engine.backend import GenerationBackend, SamplingSettings, TokenDelta
from rlsys.engine.decode_graphs import DecodeGraphs
from rlsys.model.loading import check_full_attention
from rlsys.model.tokenizer import load_tokenizer

PREFILL_TOKENS = 8192  # padded prompt tokens per prefill forward pass: bounds its activations and mask
SPARE_COLUMNS = 64  # free cache columns kept ahead: decode steps write into them instead of reallocating

log = logging.getLogger(__name__)


@dataclass
class _Sequence:
    seq_id: str
    token_ids: list[int]  # prompt, then generated tokens; the last one is not yet in the KV cache
    sampling: SamplingSettings
    stop_ids: frozenset[int]
    generator: torch.Generator | None  # a seeded sequence draws from its own stream
    arrival: float = 0.0
    generated: int = 0


class TransformersBackend(GenerationBackend):
    def __init__(self, model_path: str, inference_cfg, seed: int):
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = AutoModelForCausalLM.from_pretrained(
            model_path, dtype=getattr(torch, inference_cfg.dtype),
            attn_implementation=CPU_ATTENTION if self.device.type == "cpu" else "sdpa")
        self.model.to(self.device).eval()
        self.loads_from_pinned_memory = self.device.type == "cuda"
        self.max_num_seqs = inference_cfg.max_num_seqs
        self.max_model_len = _max_model_len(inference_cfg.max_model_len, self.model.config)
        # left padding shifts columns, so a sliding window would cover the wrong tokens of padded rows
        check_full_attention(self.model.config, self.max_model_len, "the transformers engine",
                             "use inference.engine=vllm")
        self.eos_token_ids = _eos_token_ids(self.model, load_tokenizer(model_path))
        self.vocab_size = self.model.get_input_embeddings().num_embeddings
        self.generator = torch.Generator(self.device).manual_seed(seed)  # for sequences without a seed
        self._waiting: dict[str, _Sequence] = {}
        # Graphs hold the cache's addresses, so their buffers are allocated once, for the longest sequences: as many
        # as fit in the memory given.
        columns = self.max_model_len + SPARE_COLUMNS
        self.decode_graphs = None
        if not inference_cfg.eager_on(self.device):
            try:
                self.decode_graphs = DecodeGraphs(self.model, self.device, self.max_num_seqs, columns,
                                                  inference_cfg.gpu_memory_utilization)
            except ValueError as e:
                if inference_cfg.enforce_eager is False:  # asked for: refused with the reason
                    raise
                log.warning("decoding eagerly, without CUDA graphs: %s", e)  # unset: graphs where they can be
        if self.decode_graphs is not None:
            if self.decode_graphs.slots < self.max_num_seqs:
                log.warning("the KV cache of %d sequences of %d tokens fits in inference.gpu_memory_utilization=%s: "
                            "running at most %d at once, not inference.max_num_seqs=%d", self.decode_graphs.slots,
                            columns, inference_cfg.gpu_memory_utilization, self.decode_graphs.slots,
                            self.max_num_seqs)
                self.max_num_seqs = self.decode_graphs.slots
        self._running = _RunningBatch(self.max_num_seqs, fixed_columns=0 if self.decode_graphs is None else columns)

    def add(self, seq_id: str, token_ids: list[int], sampling: SamplingSettings, arrival: float = 0.0) -> None:
        if seq_id in self._waiting or any(row.seq_id == seq_id for row in self._running.sequences()):
            raise ValueError(f"sequence {seq_id!r} is already running")
        if not 0 < len(token_ids) < self.max_model_len:
            raise ValueError(f"sequence {seq_id!r} has a prompt of {len(token_ids)} tokens; it must have at least "
                             f"1 and leave room for one more within max_model_len={self.max_model_len}")
        if max(token_ids) >= self.vocab_size:  # as vLLM refuses it: in the batch, it would fail every sequence's step
            raise ValueError(f"sequence {seq_id!r} holds token id {max(token_ids)}, outside the model's vocabulary of "
                             f"{self.vocab_size}")
        if sampling.max_tokens < 1:
            raise ValueError(f"sequence {seq_id!r} asks for max_tokens={sampling.max_tokens}; it must be at least 1")
        if 0 < sampling.temperature < MIN_TEMPERATURE:  # sampled at vLLM's floor, not greedily, as vLLM does
            sampling = replace(sampling, temperature=MIN_TEMPERATURE)
        generator = None
        if sampling.seed is not None:
            generator = torch.Generator(self.device).manual_seed(sampling.seed)
        stop_ids = frozenset(sampling.stop_token_ids) | self.eos_token_ids
        self._waiting[seq_id] = _Sequence(seq_id, list(token_ids), sampling, stop_ids, generator, arrival)

    @torch.inference_mode()
    def step(self) -> list[TokenDelta]:
        deltas = []
        if self._running.count:
            deltas = self._advance(*self._decode())
            # Places that finishing sequences free go to waiting ones in this same step.
            self._running.leave(_finished_ids(deltas))
        for rows in _prefill_groups(self._admit(self._running.count)):
            keys, values, mask, cache_rows, logits = self._prefill(rows)
            joined = self._advance(rows, logits)
            deltas += joined
            done = _finished_ids(joined)
            self._running.join([(row, cache_row) for row, cache_row in zip(rows, cache_rows)
                                if row.seq_id not in done], keys, values, mask)
        return deltas

    def abort(self, seq_ids: list[str]) -> None:
        for seq_id in seq_ids:
            self._waiting.pop(seq_id, None)
        self._running.leave(set(seq_ids))

    def has_unfinished(self) -> bool:
        return bool(self._waiting or self._running.count)

    loads_as_they_arrive = True  # each tensor is copied into its parameter as it arrives

    @torch.no_grad()
    def load_weights(self, weights) -> None:
        if self.has_unfinished():
            raise RuntimeError("load_weights needs every sequence finished or aborted: their KV cache would mix "
                               "two sets of weights")
        # Strict: a version holds every name of the state dict, tied output head included, so a missing or
        # unexpected name means it is for another model.
        own, loaded, waits = self.model.state_dict(), set(), False
        for name, tensor in weights.items():
            if name not in own:
                raise RuntimeError(f"the weights hold {name!r} of shape {tuple(tensor.shape)}, which this model does "
                                   "not have: they are for another model")
            if own[name].shape != tensor.shape:
                raise RuntimeError(f"the weights hold {name!r} of shape {tuple(tensor.shape)}, which this model has "
                                   f"as {tuple(own[name].shape)}: they are for another model")
            # From pinned memory without a wait each; the one wait below, before the buffer is written again.
            pinned = self.loads_from_pinned_memory and tensor.is_pinned()
            own[name].copy_(tensor, non_blocking=pinned)
            waits |= pinned
            loaded.add(name)
        if waits:
            torch.cuda.current_stream(self.device).synchronize()
        if missing := sorted(set(own) - loaded):
            raise RuntimeError(f"the weights lack {missing[:5]}{' ...' if len(missing) > 5 else ''}: they are for "
                               "another model")

    def loaded_weights(self) -> dict:
        return self.model.state_dict()  # what it holds, not the file: a failed or partial load shows

    @torch.inference_mode()
    def score(self, token_ids: list[int]) -> list[float]:
        ids = torch.tensor([token_ids], device=self.device)
        if self.decode_graphs is not None:  # a graph of the prefill's forward pass, every position's logits
            logits = self.decode_graphs.prefill(ids, torch.ones_like(ids), every_position=True)[2][0, :-1]
        else:
            logits = self.model(input_ids=ids, use_cache=False).logits[0, :-1].float()
        return torch.log_softmax(logits, dim=-1).gather(-1, ids[0, 1:, None])[:, 0].tolist()

    def _admit(self, running: int) -> list[_Sequence]:
        """Waiting sequences, in arrival order, for the places `running` sequences leave free."""
        by_arrival = sorted(self._waiting.values(), key=lambda s: s.arrival)  # stable: ties keep the order added
        return [self._waiting.pop(s.seq_id) for s in by_arrival[:max(self.max_num_seqs - running, 0)]]

    def _decode(self) -> tuple[list[_Sequence], torch.Tensor]:
        """Feeds every running sequence its last token; returns them and their next-token logits."""
        running = self._running
        column = running.next_column()  # may move sequences to other slots
        slots = running.slots
        last = [row.token_ids[-1] if row else 0 for row in slots]
        positions = [len(row.token_ids) - 1 if row else 0 for row in slots]
        if self.decode_graphs is not None:
            logits = self.decode_graphs.decode(running.keys, running.values, running.mask, last, positions, column)
        else:
            cache = Cache(layers=[_ColumnLayer(k, v, len(slots), column) for k, v in zip(running.keys, running.values)])
            logits = self.model(input_ids=torch.tensor(last, device=self.device)[:, None],
                                attention_mask=running.mask[:len(slots), :column + 1],
                                position_ids=torch.tensor(positions, device=self.device)[:, None],
                                past_key_values=cache, use_cache=True).logits[:, -1].float()
        occupied = [i for i, row in enumerate(slots) if row]
        return [slots[i] for i in occupied], logits[_index(occupied, self.device)]

    def _prefill(self, rows: list[_Sequence]) -> tuple[list, list, torch.Tensor, list[int], torch.Tensor]:
        """The KV cache of `rows`' prompts, each distinct prompt computed once and left-padded: every layer's keys
        and values, their mask, each row's cache row, and the logits that predict each row's first token. With
        CUDA graphs, by the graph path's own forward pass (prefill_forward), without HF's."""
        prompts: dict[tuple[int, ...], int] = {}
        cache_rows = [prompts.setdefault(tuple(row.token_ids), len(prompts)) for row in rows]
        width = max(map(len, prompts))
        ids = np.zeros((len(prompts), width), dtype=np.int64)
        mask = np.zeros((len(prompts), width), dtype=np.int64)
        for i, prompt in enumerate(prompts):
            ids[i, width - len(prompt):] = prompt
            mask[i, width - len(prompt):] = 1
        ids, mask = torch.from_numpy(ids).to(self.device), torch.from_numpy(mask).to(self.device)
        if self.decode_graphs is not None:
            keys, values, logits = self.decode_graphs.prefill(ids, mask)
            return keys, values, mask, cache_rows, logits[cache_rows]
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                         past_key_values=DynamicCache(), use_cache=True, logits_to_keep=1)
        cache = out.past_key_values
        return ([layer.keys for layer in cache.layers], [layer.values for layer in cache.layers], mask, cache_rows,
                out.logits[cache_rows, -1].float())

    def _advance(self, rows: list[_Sequence], logits: torch.Tensor) -> list[TokenDelta]:
        """Samples one token per row, appends it, and reports it."""
        tokens, logprobs = self._sample(rows, logits)
        deltas = []
        for row, token, logprob in zip(rows, tokens.tolist(), logprobs.tolist()):
            row.token_ids.append(token)
            row.generated += 1
            deltas.append(TokenDelta(row.seq_id, [token], [logprob], _finish_reason(row, self.max_model_len)))
        return deltas

    def _sample(self, rows: list[_Sequence], logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # Which rows are greedy is decided on the host, from their settings: reading it back from the device would
        # wait for the decode step on a GPU.
        greedy = [row.sampling.temperature < GREEDY_BELOW for row in rows]
        temperature = [1.0 if g else row.sampling.temperature for g, row in zip(greedy, rows)]
        logprobs = torch.log_softmax(logits / torch.tensor(temperature, device=self.device)[:, None], dim=-1)
        tokens = logits.argmax(dim=-1)
        if not all(greedy):
            drawn = self._draw(rows, _top_k_top_p(rows, logprobs))
            tokens = torch.where(torch.tensor(greedy, device=self.device), tokens, drawn)
        return tokens, logprobs.gather(-1, tokens[:, None])[:, 0]

    def _draw(self, rows: list[_Sequence], logprobs: torch.Tensor) -> torch.Tensor:
        """One token per row from exp(logprobs): argmax of p / q with q ~ Exp(1) is a draw from p."""
        noise = torch.empty_like(logprobs).exponential_(generator=self.generator)
        for i, row in enumerate(rows):
            if row.generator is not None:
                noise[i].exponential_(generator=row.generator)
        return (logprobs.exp() / noise).argmax(dim=-1)


def _prefill_groups(rows: list[_Sequence]) -> list[list[_Sequence]]:
    """`rows` in groups whose distinct prompts, left-padded to the longest, fill at most PREFILL_TOKENS (or
    hold one prompt); shortest first, so that prompts of like length share a group and little padding."""
    by_prompt: dict[tuple[int, ...], list[_Sequence]] = {}
    for row in rows:
        by_prompt.setdefault(tuple(row.token_ids), []).append(row)
    groups: list[list[tuple[int, ...]]] = []
    for prompt in sorted(by_prompt, key=len):
        if not groups or (len(groups[-1]) + 1) * len(prompt) > PREFILL_TOKENS:
            groups.append([])
        groups[-1].append(prompt)
    return [[row for prompt in group for row in by_prompt[prompt]] for group in groups]


def _finished_ids(deltas: list[TokenDelta]) -> set[str]:
    return {delta.seq_id for delta in deltas if delta.finish_reason is not None}


def _finish_reason(row: _Sequence, max_model_len: int) -> str | None:
    """vLLM's order: a stop token wins over the length limits it may also reach."""
    if row.token_ids[-1] in row.stop_ids:
        return "stop"
    if row.generated >= row.sampling.max_tokens or len(row.token_ids) >= max_model_len:
        return "length"
    return None


def _top_k_top_p(rows: list[_Sequence], logprobs: torch.Tensor) -> torch.Tensor:
    """logprobs with -inf outside each row's top-k and top-p sets (ties with the k-th token stay in)."""
    vocab = logprobs.shape[-1]
    top_k = [row.sampling.top_k if 0 < row.sampling.top_k < vocab else vocab for row in rows]
    top_p = [row.sampling.top_p for row in rows]
    if all(k == vocab for k in top_k) and all(p >= 1 for p in top_p):
        return logprobs
    top_k = torch.tensor(top_k, device=logprobs.device)
    top_p = torch.tensor(top_p, device=logprobs.device, dtype=logprobs.dtype)
    ascending, order = logprobs.sort(dim=-1)
    kth = ascending.gather(-1, (vocab - top_k)[:, None])
    drop = ascending < kth
    # Top-p over what top-k kept: drop the smallest tokens while their total stays within 1 - p.
    ascending = ascending.masked_fill(drop, float("-inf"))
    drop |= ascending.softmax(dim=-1).cumsum(dim=-1) <= (1 - top_p)[:, None]
    drop[:, -1] = False  # the most likely token always stays
    return logprobs.masked_fill(drop.scatter(-1, order, drop), float("-inf"))


class _RunningBatch:
    """The running sequences and their KV cache: one slot (row) per sequence, in buffers with spare slots
    and columns. Rows are right-aligned: each sequence's next token goes into column `end`.

    A decode step writes that one column in place (DynamicCache would concatenate, copying the whole
    cache every step); a joining sequence's prompt is copied into a free slot, ending at `end`; a finished
    one frees its slot, and when a quarter of the slots a decode step would run are free, the last
    sequences move into the holes first.
    The buffers are copied whole only when they run out of columns (dropping the leading columns no
    sequence uses any more) or slots, or when a joining prompt is longer than `end`.

    With `fixed_columns` (for CUDA graphs, which hold the buffers' addresses) the buffers have every slot and that
    many columns from the start, and those copies happen in place; the leading columns no sequence uses are also
    dropped once they are half of `end`, so that decode steps attend over no more than twice the columns in use.
    """

    def __init__(self, max_slots: int, fixed_columns: int = 0):
        self.max_slots = max_slots
        self.fixed_columns = fixed_columns
        self.slots: list[_Sequence | None] = []  # up to the last occupied slot
        self.keys: list[torch.Tensor] = []  # per layer: [slot capacity, kv heads, column capacity, head dim]
        self.values: list[torch.Tensor] = []
        self.mask: torch.Tensor | None = None  # [slot capacity, column capacity], 1 where a slot holds a token
        self.end = 0

    @property
    def count(self) -> int:
        return sum(row is not None for row in self.slots)

    def sequences(self) -> list[_Sequence]:
        return [row for row in self.slots if row is not None]

    def next_column(self) -> int:
        """Makes room for a decode step over the slots in use and returns the column it fills; the mask has it."""
        if 4 * (len(self.slots) - self.count) > len(self.slots):
            self._fill_holes()
        if self.end == self.mask.shape[1] or self.fixed_columns and self._mostly_unused():
            self._relayout(len(self.mask))
        # Free slots attend to their own column too: a row that attends to nothing could turn into NaNs.
        self.mask[:len(self.slots), self.end] = 1
        self.end += 1
        return self.end - 1

    def join(self, rows: list[tuple[_Sequence, int]], keys: list[torch.Tensor], values: list[torch.Tensor],
             prefill_mask: torch.Tensor) -> None:
        """Adds sequences whose prompts are in rows `cache_row` of a prefill's keys and values (per layer), into
        free slots."""
        if not rows:
            return
        width = prefill_mask.shape[1]
        free = [i for i, row in enumerate(self.slots) if row is None]
        free += range(len(self.slots), len(self.slots) + len(rows) - len(free))
        if not self.keys:
            capacity = self.max_slots if self.fixed_columns else min(max(len(rows), 8), self.max_slots)
            self._allocate(keys[0], len(keys), slots=capacity, columns=self.fixed_columns or width + SPARE_COLUMNS)
            self.end = width
        elif free[-1] >= len(self.mask) or width > self.end:
            self._relayout(max(free[-1] + 1, min(2 * len(self.mask), self.max_slots)), min_end=width)
        slots = _index(free[:len(rows)], self.mask.device)
        cache_rows = _index([cache_row for _, cache_row in rows], self.mask.device)
        columns = slice(self.end - width, self.end)
        for mine, theirs in zip(self.keys + self.values, keys + values):
            mine[slots, :, columns] = theirs[cache_rows]
        self.mask[slots] = 0
        self.mask[slots, columns] = prefill_mask[cache_rows]
        for slot, (row, _) in zip(free, rows):
            if slot == len(self.slots):
                self.slots.append(None)
            self.slots[slot] = row

    def leave(self, seq_ids: set[str]) -> None:
        self.slots = [None if row is not None and row.seq_id in seq_ids else row for row in self.slots]
        while self.slots and self.slots[-1] is None:
            self.slots.pop()

    def _fill_holes(self) -> None:
        """Moves the last sequences into the free slots before them."""
        holes = [i for i, row in enumerate(self.slots) if row is None]
        movers = [i for i in reversed(range(len(self.slots))) if self.slots[i] is not None]
        pairs = [(hole, mover) for hole, mover in zip(holes, movers) if hole < mover]
        to = _index([hole for hole, _ in pairs], self.mask.device)
        frm = _index([mover for _, mover in pairs], self.mask.device)
        for buffer in self.keys + self.values + [self.mask]:
            buffer[to] = buffer[frm]
        for hole, mover in pairs:
            self.slots[hole], self.slots[mover] = self.slots[mover], None
        while self.slots and self.slots[-1] is None:
            self.slots.pop()

    def _allocate(self, like: torch.Tensor, layers: int, slots: int, columns: int) -> None:
        """Buffers of `layers` layers' keys and values of `like`'s kv heads, head size and dtype."""
        self.keys = [like.new_zeros(slots, like.shape[1], columns, like.shape[3]) for _ in range(layers)]
        self.values = [like.new_zeros(slots, like.shape[1], columns, like.shape[3]) for _ in range(layers)]
        self.mask = like.new_zeros(slots, columns, dtype=torch.long)

    def _mostly_unused(self) -> bool:
        """Whether the columns before every running sequence are half of those before `end`, SPARE_COLUMNS or more."""
        start = self._start()
        return start >= SPARE_COLUMNS and 2 * start >= self.end

    def _start(self) -> int:
        """The first column a running sequence uses (`end` when none runs): all but its last token are cached."""
        return self.end - max((len(row.token_ids) - 1 for row in self.slots if row is not None), default=0)

    def _relayout(self, slots: int, min_end: int = 0) -> None:
        """Copies the columns in use into new buffers of `slots` slots (fixed columns: to the left of the same
        buffers), ending at column `min_end` or later (room on the left for a longer prompt), followed by
        SPARE_COLUMNS free columns (fixed columns: by the rest)."""
        rows = len(self.slots)
        start = self._start()  # free slots lose their columns before it
        width = self.end - start
        shift = max(min_end - width, 0)
        if self.fixed_columns:
            for buffer in self.keys + self.values:
                buffer[:rows, :, shift:shift + width] = buffer[:rows, :, start:self.end].clone()
            used = self.mask[:rows, start:self.end].clone()
            self.mask.zero_()
            self.mask[:rows, shift:shift + width] = used
            self.end = shift + width
            return
        old_keys, old_values, old_mask = self.keys, self.values, self.mask
        columns = shift + width + SPARE_COLUMNS
        self.keys = [k.new_zeros(slots, k.shape[1], columns, k.shape[3]) for k in old_keys]
        self.values = [v.new_zeros(slots, v.shape[1], columns, v.shape[3]) for v in old_values]
        self.mask = old_mask.new_zeros(slots, columns)
        for new, old in zip(self.keys + self.values, old_keys + old_values):
            new[:rows, :, shift:shift + width] = old[:rows, :, start:self.end]
        self.mask[:rows, shift:shift + width] = old_mask[:rows, start:self.end]
        self.end = shift + width


class _ColumnLayer(DynamicLayer):
    """One layer of `_RunningBatch`'s cache for one decode step: keys and values are views of its buffers'
    first `rows` slots and `length` columns, and the step's new column is written into them in place."""

    def __init__(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor, rows: int, length: int):
        super().__init__()
        self.lazy_initialization(key_buffer, value_buffer)
        self.key_buffer, self.value_buffer = key_buffer[:rows], value_buffer[:rows]
        self.keys, self.values = self.key_buffer[:, :, :length], self.value_buffer[:, :, :length]

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        start = self.keys.shape[2]
        end = start + key_states.shape[2]
        self.key_buffer[:, :, start:end] = key_states
        self.value_buffer[:, :, start:end] = value_states
        self.keys, self.values = self.key_buffer[:, :, :end], self.value_buffer[:, :, :end]
        return self.keys, self.values


def _index(positions: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor(positions, dtype=torch.long, device=device)


def _eos_token_ids(model, tokenizer) -> frozenset[int]:
    """The tokenizer's end-of-sequence token and the generation config's, where vLLM stops too."""
    ids = {tokenizer.eos_token_id}
    entry = model.generation_config.eos_token_id  # from the model config when there is no generation config
    ids.update(entry if isinstance(entry, list) else [entry])
    return frozenset(ids - {None})


def _max_model_len(configured: int, config) -> int:
    """The configured limit, or the model's own (max_position_embeddings) when it is 0, as in vLLM."""
    positions = getattr(config, "max_position_embeddings", None)
    if configured and positions is not None and configured > positions:
        raise ValueError(f"inference.max_model_len={configured} is longer than the model's "
                         f"max_position_embeddings={positions}")
    if not configured and positions is None:
        raise ValueError("inference.max_model_len=0 means the model's own limit, but its config has no "
                         "max_position_embeddings; set inference.max_model_len")
    return configured or positions


def _grouped_query_sdpa(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """transformers' sdpa attention, minus one copy: with a mask, it repeats the key/value heads of
    grouped-query attention for every layer and step (copying the whole cache), where torch's CPU kernel
    takes the groups as they are, several times faster for a wide decode step."""
    causal = query.shape[2] > 1 and attention_mask is None and getattr(module, "is_causal", True)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attention_mask,
                                                           scale=scaling, is_causal=causal, enable_gqa=True)
    return out.transpose(1, 2).contiguous(), None


CPU_ATTENTION = "rlsys_grouped_query_sdpa"  # on GPUs the kernels that take a mask want the heads repeated
AttentionInterface.register(CPU_ATTENTION, _grouped_query_sdpa)
AttentionMaskInterface.register(CPU_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
