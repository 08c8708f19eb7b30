"""The vLLM backend: continuous batching on vLLM's engine, stepped by the inference worker itself.

The worker owns the step loop (`LLMEngine.add_request` / `step` / `abort_request`), so requests that
arrive while others generate join the running batch at the next step, and a weight update can stop
every sequence between two steps, which vLLM's own async front end offers no way to do in place.
"""

import functools
import gc
import logging
import os

import torch

from rlsys.engine.backend import GenerationBackend, SamplingSettings, TokenDelta
from rlsys.engine.kv_cache import kv_bytes_per_token

WARM_UP_TOKENS = 4
DEFAULT_CPU_KV_CACHE_GIB = 1.0  # the most a CPU's KV cache takes by default (kv_cache_bytes)
BLOCK_ROUNDING = 256  # tokens: a sequence's KV cache is whole blocks, 128 tokens each on vLLM-CPU
RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"  # where vLLM's in-place reload logs


def kv_cache_bytes(model_path: str, inference_cfg) -> int | None:
    """The KV cache vLLM allocates (its kv_cache_memory_bytes): inference.kv_cache_gib where set. By default on a GPU,
    None: vLLM's own sizing from inference.gpu_memory_utilization. By default on a CPU, what max_num_seqs sequences
    of max_model_len tokens hold in whole blocks (and one sequence more), at most DEFAULT_CPU_KV_CACHE_GIB: vLLM-CPU
    allocates its cache whole and writes it as the worker starts, a cost by the GiB (BENCHMARKS.md, "Start-up
    (2026-12-03)"), where a small model's sequences fill a fraction of one. Beyond what every sequence can hold at
    once, a larger cache only keeps more finished prefixes for reuse. Never less than one sequence of max_model_len
    tokens: vLLM refuses to start with less (and tells to raise gpu_memory_utilization, which a CPU's cache ignores)."""
    if inference_cfg.kv_cache_gib:
        return int(inference_cfg.kv_cache_gib * 2**30)
    if torch.cuda.is_available():
        return None
    from transformers import AutoConfig

    cap = int(DEFAULT_CPU_KV_CACHE_GIB * 2**30)
    config = AutoConfig.from_pretrained(model_path).get_text_config()
    heads = getattr(config, "num_attention_heads", None)
    layers, positions = getattr(config, "num_hidden_layers", None), getattr(config, "max_position_embeddings", None)
    if not (heads and layers and (positions or inference_cfg.max_model_len)):
        return cap  # a layout this estimate does not know
    dtype = getattr(torch, inference_cfg.dtype, None)
    per_token = kv_bytes_per_token(config, dtype.itemsize if isinstance(dtype, torch.dtype) else 4)
    sequence = -(-(inference_cfg.max_model_len or positions) // BLOCK_ROUNDING) * BLOCK_ROUNDING
    return max(min(cap, (inference_cfg.max_num_seqs + 1) * sequence * per_token), sequence * per_token)


@functools.cache
def vllm_names() -> tuple:
    """What VLLMBackend.add builds a request from. Imported on first use, once vLLM's environment is set
    (configure_cpu_backend); `from vllm import X` resolves X through the package's lazy `__getattr__`, an import
    machinery call each time."""
    from vllm import SamplingParams
    from vllm.exceptions import VLLMClientError
    from vllm.inputs import TokensPrompt
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams, TokensPrompt, RequestOutputKind, VLLMClientError


def configure_cpu_backend(enforce_eager: bool) -> None:
    """vLLM-CPU reads these at import; the engine core stays in this process so weights load in place.

    Eager (inference.enforce_eager; by default on a CPU), vLLM compiles nothing of the model, yet its sampler still
    decorates a few small functions with torch.compile, which inductor builds as C++ on this CPU at the first step:
    most of the worker's start-up on a fresh machine, a few seconds with inductor's cache warm (BENCHMARKS.md,
    "Start-up (2026-12-03)"). With TORCHDYNAMO_DISABLE, read as vLLM's modules are imported, they run as written,
    the same operations eagerly. On a GPU, where they would be Triton kernels, nothing changes."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    if enforce_eager and not torch.cuda.is_available():
        os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")


def stop_packing_input_embeddings(worker) -> None:
    """On vLLM-CPU, keeps each input embedding's matrix out of oneDNN's packing.

    After every load vLLM-CPU packs each vocabulary-sized matrix for oneDNN, the input embedding's too, though only
    the output head multiplies by its matrix: for a tied model, a second pack of its largest matrix on every weight
    update, and the memory to hold it (BENCHMARKS.md, "Weights streamed from the learner's memory"). Where the model
    has an output head of its own, the embeddings' packs are dropped and not redone; where the embedding is the head
    (Gemma's way), nothing changes."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (ParallelLMHead, UnquantizedEmbeddingMethod,
                                                                     VocabParallelEmbedding)
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    layers = list(worker.model_runner.get_model().modules())
    if not any(isinstance(layer, ParallelLMHead) for layer in layers):
        return
    for layer in layers:
        if (isinstance(layer, VocabParallelEmbedding) and not isinstance(layer, ParallelLMHead)
                and isinstance(layer.quant_method, UnquantizedEmbeddingMethod)):
            _unpacked(layer)  # frees the pack: nothing multiplies by an input embedding's
            layer.quant_method.process_weights_after_loading = _unpacked


def _unpacked(layer) -> None:
    """An input embedding's processing after a load: torch's own linear, no pack, should anything multiply by it."""
    import torch.nn.functional as F

    layer.cpu_linear = F.linear


def computed_layers(worker) -> set[str]:
    """The classes of the model's layers that hold buffers and no parameter: what they hold is computed at start (the
    rotary embedding's cos/sin table), so no checkpoint or learner has it to send."""
    return {type(layer).__name__ for layer in worker.model_runner.get_model().modules()
            if next(layer.parameters(recurse=False), None) is None
            and next(layer.buffers(recurse=False), None) is not None}


class NothingToLoad(logging.Filter):
    """vLLM 0.32's in-place reload warns "<layer>: Failed to load weights" for a layer whose only tensors are such
    buffers, and puts them back as they were: on every weight update, a warning about nothing (one line per version in
    the inference log). Only those layers' warnings are dropped: for a layer with parameters it means a weight did
    not arrive."""

    def __init__(self):
        super().__init__()
        self.classes: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        return not (record.msg == "%s: Failed to load weights" and record.args and record.args[0] in self.classes)


NOTHING_TO_LOAD = NothingToLoad()
logging.getLogger(RELOAD_LOGGER).addFilter(NOTHING_TO_LOAD)


class VLLMBackend(GenerationBackend):
    def __init__(self, model_path: str, inference_cfg, seed: int):
        eager = inference_cfg.eager_on("cuda" if torch.cuda.is_available() else "cpu")
        configure_cpu_backend(eager)
        from vllm import LLM

        # vLLM's engine start runs gc.collect() five times, each a walk over every object the imports made
        # (BENCHMARKS.md, "Start-up: the collector"), and freezes them itself once it has started. Frozen now, the
        # walks see only what the engine makes. The imports leave next to no garbage (60 objects) for it to keep.
        gc.freeze()
        self.llm = LLM(
            model=model_path, dtype=inference_cfg.dtype, seed=seed, max_model_len=inference_cfg.max_model_len or None,
            kv_cache_memory_bytes=kv_cache_bytes(model_path, inference_cfg),
            gpu_memory_utilization=inference_cfg.gpu_memory_utilization, max_num_seqs=inference_cfg.max_num_seqs,
            enforce_eager=eager, tensor_parallel_size=inference_cfg.tensor_parallel_size,
            enable_prefix_caching=inference_cfg.enable_prefix_caching,
            scheduling_policy="priority",  # all priorities equal: waiting sequences go in order of arrival time
            # Logprobs after temperature, as the learner recomputes them, so the PPO ratio starts at 1.
            logprobs_mode="processed_logprobs",
        )
        self.engine = self.llm.llm_engine
        self.llm.collective_rpc(stop_packing_input_embeddings)
        NOTHING_TO_LOAD.classes.update(*self.llm.collective_rpc(computed_layers))
        self._running: set[str] = set()
        self._warm_up()

    def _warm_up(self) -> None:
        """One short generation, so the first real batch does not pay for lazy initialisation."""
        self.add("warm-up", [0, 1, 2], SamplingSettings(max_tokens=WARM_UP_TOKENS))
        while self.has_unfinished():
            self.step()

    def add(self, seq_id: str, token_ids: list[int], sampling: SamplingSettings, arrival: float = 0.0) -> None:
        # every sample of every request, and again at each resume after a weight update, passes here
        SamplingParams, TokensPrompt, RequestOutputKind, VLLMClientError = vllm_names()
        try:
            params = SamplingParams(
                n=1, max_tokens=sampling.max_tokens, temperature=sampling.temperature, top_p=sampling.top_p,
                top_k=sampling.top_k, stop_token_ids=list(sampling.stop_token_ids), seed=sampling.seed, logprobs=0,
                output_kind=RequestOutputKind.DELTA,
                detokenize=False,  # the worker sends token ids; text is the agents' business (their tokenizer)
                # made for this one request and never read again here: vLLM may take it as it is; its deep copy was
                # the largest part of what adding a request cost (BENCHMARKS.md, "Adding a request to vLLM")
                skip_clone=True)
            self.engine.add_request(seq_id, TokensPrompt(prompt_token_ids=list(token_ids)), params,
                                    arrival_time=arrival)
        except VLLMClientError as e:  # a prompt too long, a token outside the vocabulary: no ValueError in vLLM 0.32
            raise ValueError(str(e)) from e
        self._running.add(seq_id)

    def step(self) -> list[TokenDelta]:
        deltas = []
        for output in self.engine.step():
            sample = output.outputs[0]
            finish = None
            if output.finished:  # vLLM's reason as it is: "abort" and "error" end a sequence that is no answer
                finish = sample.finish_reason
                self._running.discard(output.request_id)
            ids = list(sample.token_ids)
            logprobs = [step[token].logprob for token, step in zip(ids, sample.logprobs or [])]
            deltas.append(TokenDelta(output.request_id, ids, logprobs, finish))
        return deltas

    def abort(self, seq_ids: list[str]) -> None:
        if seq_ids:
            self.engine.abort_request(list(seq_ids))
            self._running.difference_update(seq_ids)

    def has_unfinished(self) -> bool:
        return bool(self._running)

    loads_as_they_arrive = True  # its reload processes each layer once its last weight is in

    def load_weights(self, weights) -> None:
        # vLLM's in-place reload: it maps the learner's names onto its fused layers and redoes whatever processing
        # its kernels need after loading. Tensors pass in memory: the engine core runs in this process.
        self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights.items())})
        # Cached KV was computed with the old weights. vLLM declines (False) while a request holds cache blocks; the
        # generation engine has taken every sequence out before a load, so a refusal means old-weight KV could be
        # served as the new version's: the worker stops (and is restarted) rather than mix them.
        if not self.llm.reset_prefix_cache():
            raise RuntimeError("vLLM kept its prefix cache after new weights were loaded (a request still holds cache "
                               "blocks): its cached KV of the old weights would be served as the new version's")

    def close(self) -> None:
        # vLLM's one-process group meets through a file in the temp directory that only the group's destruction
        # removes; the role's quick exit skips it, so each engine start left a file there (hundreds on a test machine).
        from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

        destroy_model_parallel()
        destroy_distributed_environment()

    def score(self, token_ids: list[int]) -> list[float]:
        return self.score_all([token_ids])[0]

    def score_all(self, sequences: list[list[int]]) -> list[list[float]]:
        """In one engine run: the probe of every weight update costs one prefill, not one per sequence."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        # vLLM takes a prompt that leaves room for one token more: a sequence that ran to max_model_len (a reply cut
        # there) has its first max_model_len - 1 scored, and the probe compares the logprobs both sides have.
        room = self.llm.llm_engine.model_config.max_model_len - 1
        sequences = [list(ids[:room]) for ids in sequences]
        results = self.llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in sequences], params,
                                    use_tqdm=False)
        return [[step[tok].logprob for tok, step in zip(ids[1:], result.prompt_logprobs[1:])]
                for ids, result in zip(sequences, results)]
