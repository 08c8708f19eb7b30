"""The vLLM engine's start on a CPU: what it compiles (in a process of its own, as the inference worker has it) and
the KV cache it allocates."""

import json
import os
import subprocess
import sys

import pytest
from transformers import Qwen2Config

from experiments.common import InferenceConfig
from rlsys.engine.vllm_engine import VLLMBackend, kv_cache_bytes
from tests.helpers import save_random_tiny_model

GENERATE = """
import sys
from experiments.common import InferenceConfig
from rlsys.api import GenerationConfig
from rlsys.engine.generation import GenerationEngine
from rlsys.engine.vllm_engine import VLLMBackend

backend = VLLMBackend(sys.argv[1], InferenceConfig(), seed=0)
engine = GenerationEngine(backend)
replies = engine.generate([("greedy", [4, 7, 8], GenerationConfig(n=2, max_new_tokens=4, temperature=0.0)),
                           ("sampled", [4, 7, 9], GenerationConfig(n=2, max_new_tokens=4, seed=1))])
cache = backend.llm.llm_engine.vllm_config.cache_config
print(cache.num_gpu_blocks * cache.block_size)
print([[len(ids) for ids in reply.output_ids] for reply in replies])
"""


def test_the_engine_on_a_cpu_compiles_nothing_to_start_and_generate(tmp_path):
    """Eager (the default), vLLM compiles nothing of the model, but its sampler's torch.compile'd functions were built
    by inductor, C++ compiled on the CPU, at the first step: most of the inference worker's start on a fresh machine
    (BENCHMARKS.md, "Start-up (2026-12-03)"). With a fresh inductor cache, a greedy and a sampled generation leave it
    empty."""
    model_path = save_random_tiny_model(tmp_path / "model")
    cache = tmp_path / "inductor"
    done = subprocess.run([sys.executable, "-c", GENERATE, str(model_path)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache),
                                            "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr[-3000:]
    lengths = json.loads(done.stdout.strip().splitlines()[-1])  # tokens of each sample: 4, or fewer up to an EOS
    assert len(lengths) == 2 and all(len(samples) == 2 and all(1 <= n <= 4 for n in samples) for samples in lengths)
    assert not cache.exists() or not any(cache.rglob("*")), sorted(cache.rglob("*"))[:5]
    # Its KV cache, sized by default: 256 sequences of the model's 512 positions, and one more, not a whole GiB
    # (per token: 2 layers x 1 key/value head x 32 dimensions x 2 (keys, values) x 4 bytes).
    tokens = int(done.stdout.strip().splitlines()[-2])
    assert 256 * 512 <= tokens <= 257 * 512 < 2**30 // 512


def cpu_kv_cache(tmp_path, monkeypatch, config: Qwen2Config, **settings) -> float:
    """kv_cache_bytes on a CPU for a model of `config`, in GiB."""
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    config.save_pretrained(tmp_path)
    return kv_cache_bytes(str(tmp_path), InferenceConfig(**settings)) / 2**30


def test_the_cpu_kv_cache_holds_every_sequence_at_most_a_gib_or_what_is_asked(tmp_path, monkeypatch):
    small = Qwen2Config(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                        max_position_embeddings=512)  # the default task's model: 4 KiB a token in float32
    assert cpu_kv_cache(tmp_path, monkeypatch, small) == 257 * 512 * 4096 / 2**30
    assert cpu_kv_cache(tmp_path, monkeypatch, small, dtype="bfloat16") == 257 * 512 * 2048 / 2**30
    # a sequence is whole blocks of the engine's: 100 tokens are rounded up to 256
    assert cpu_kv_cache(tmp_path, monkeypatch, small, max_model_len=100, max_num_seqs=4) == 5 * 256 * 4096 / 2**30
    large = Qwen2Config(hidden_size=576, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                        max_position_embeddings=8192)  # SmolLM2-135M's: 256 of its sequences take 94 GB
    assert cpu_kv_cache(tmp_path, monkeypatch, large) == 1.0
    assert cpu_kv_cache(tmp_path, monkeypatch, large, kv_cache_gib=2.5) == 2.5
    # one sequence over the GiB (Llama-3.2-1B's shape, 131,072 positions, 64 KiB a token): vLLM starts only with a
    # cache that holds one, so that is the default
    long_context = Qwen2Config(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                               max_position_embeddings=131072)
    assert cpu_kv_cache(tmp_path, monkeypatch, long_context) == 8.0
    assert cpu_kv_cache(tmp_path, monkeypatch, long_context, max_model_len=4096) == 1.0
    assert cpu_kv_cache(tmp_path, monkeypatch, small, kv_cache_gib=0.25) == 0.25


def test_on_a_gpu_the_kv_cache_is_vllms_own_unless_asked(tmp_path, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: True)
    assert kv_cache_bytes(str(tmp_path), InferenceConfig()) is None  # from inference.gpu_memory_utilization
    assert kv_cache_bytes(str(tmp_path), InferenceConfig(kv_cache_gib=8)) == 8 * 2**30


@pytest.fixture(scope="module")
def short_vllm(tmp_path_factory):
    """vLLM on the tiny model, sequences of at most 8 tokens."""
    from rlsys.engine.vllm_engine import VLLMBackend

    model_path = save_random_tiny_model(tmp_path_factory.mktemp("model"))
    return VLLMBackend(str(model_path), InferenceConfig(max_model_len=8, max_num_seqs=4), seed=0)


def test_a_request_vllm_refuses_is_answered_with_its_reason_and_the_worker_serves_on(short_vllm):
    """vLLM refuses a prompt that leaves no room within max_model_len, or a token outside the vocabulary, with its own
    VLLMValidationError, no ValueError: the backend hands it on as the ValueError the worker answers with a refusal,
    where the worker would die on it, and its restarted successor on the same request re-sent."""
    from rlsys import protocol
    from rlsys.api import GenerationConfig
    from rlsys.api.messages import GenerationRequest, parse_reply
    from rlsys.bus import InProcessBus
    from rlsys.engine.generation import GenerationEngine
    from rlsys.workers.inference_worker import InferenceWorker

    engine = GenerationEngine(short_vllm)
    bus = InProcessBus()
    worker = InferenceWorker(engine, bus, 0, max_batch_requests=8)
    greedy = GenerationConfig(n=1, max_new_tokens=2, temperature=0.0)
    bus.put_many(protocol.generation_requests(0), [
        GenerationRequest(rid, ids, greedy, "replies").to_message()
        for rid, ids in [("long", list(range(10, 18))), ("good", [4, 7]), ("unknown", [4, 10**6])]])
    worker.take_requests(timeout=1)
    refusals = {reply.rid: reply.refused for reply in map(parse_reply, bus.get_many("replies", 8, 1))}
    assert sorted(refusals) == ["long", "unknown"] and "out of vocabulary" in refusals["unknown"], refusals
    assert "maximum model length of 8" in refusals["long"], refusals
    while engine.in_flight:
        worker.reply(engine.step())
    (reply,) = map(parse_reply, bus.get_many("replies", 8, 1))
    assert reply.rid == "good" and len(reply.output_ids[0]) == 2


def test_a_probe_as_long_as_the_model_s_context_is_scored_where_vllm_can(short_vllm):
    """The learner's probe is a trained sequence's first PROBE_TOKENS tokens: one that ran to max_model_len (a reply cut
    at the length limit) has max_model_len tokens, where vLLM scores only prompts that leave room for one more. Its
    first max_model_len - 1 are scored (the probe compares the logprobs both sides have), not the weight update
    failed: that would stop every worker holding the probe's version at once."""
    full, short = list(range(10, 18)), [4, 7, 8]
    scored = short_vllm.score_all([full, short])
    assert [len(s) for s in scored] == [6, 2]
    assert scored[0] == pytest.approx(short_vllm.score(full[:7]), abs=1e-5)


def test_vllm_takes_each_sample_s_parameters_as_they_are_not_a_deep_copy(short_vllm, monkeypatch):
    """Each sample, and each resume after a weight update, is a vLLM request with sampling parameters made for it
    alone, so vLLM may take them as they are (skip_clone). Its deep copy of them was the largest part of what adding a
    request cost (BENCHMARKS.md, "Adding a request to vLLM"). Each request keeps its own settings."""
    import copy

    from vllm import SamplingParams

    from rlsys.api import GenerationConfig
    from rlsys.engine.generation import GenerationEngine

    copied, deepcopy = [], copy.deepcopy
    monkeypatch.setattr(copy, "deepcopy", lambda x, *args: copied.append(type(x)) or deepcopy(x, *args))
    replies = GenerationEngine(short_vllm).generate([
        ("two", [4, 7], GenerationConfig(n=2, max_new_tokens=3, temperature=0.0)),
        ("one", [4, 8], GenerationConfig(n=1, max_new_tokens=1, seed=3))])
    lengths = [[len(ids) for ids in reply.output_ids] for reply in replies]
    assert len(lengths[0]) == 2 and all(1 <= n <= 3 for n in lengths[0]) and lengths[1] == [1], lengths
    assert SamplingParams not in copied


class _LLMStandIn:
    """vLLM's LLM at a weight load, its prefix-cache reset answering `resets` (the load's one piece under test)."""

    def __init__(self, resets: bool):
        self.resets, self.loaded = resets, None

    def collective_rpc(self, method, kwargs):
        self.loaded = (method, dict(kwargs["weights_iterator"]))

    def reset_prefix_cache(self) -> bool:
        return self.resets


@pytest.mark.parametrize("resets", [True, False])
def test_a_weight_load_whose_prefix_cache_stays_stops_the_worker_rather_than_serve_old_kv(resets):
    """vLLM declines to reset its prefix cache while a request holds blocks; KV computed with the old weights would
    then be served as the new version's, so the load raises instead of going on."""
    backend = VLLMBackend.__new__(VLLMBackend)
    backend.llm = _LLMStandIn(resets)
    if resets:
        backend.load_weights({"w": 1})
    else:
        with pytest.raises(RuntimeError, match="prefix cache"):
            backend.load_weights({"w": 1})
    assert backend.llm.loaded == ("reload_weights", {"w": 1})



class _StepStandIn:
    """vLLM's engine at a step, giving `outputs` (vLLM's own RequestOutput objects): the step's one piece under test."""

    def __init__(self, outputs):
        self.outputs = outputs

    def step(self):
        return self.outputs


def test_a_sequence_vllm_ended_for_any_reason_but_a_stop_or_the_length_says_that_reason():
    """vLLM ends a request with "abort" (an engine shutdown or pause) or "error" (a request-level failure) as well as
    "stop" and "length": each is handed on as it is. An aborted or failed generation was handed on as "stop", a reply
    like any other, and a client read it as the model's finished answer."""
    from vllm.logprobs import Logprob
    from vllm.outputs import CompletionOutput, RequestOutput

    def output(rid: str, reason: str | None) -> RequestOutput:
        sample = CompletionOutput(0, "", [5], None, [{5: Logprob(-0.5)}], finish_reason=reason)
        return RequestOutput(rid, None, [4], None, [sample], finished=reason is not None)

    backend = VLLMBackend.__new__(VLLMBackend)
    reasons = {"a": "stop", "b": "length", "c": "abort", "d": "error", "e": None}
    backend.engine, backend._running = _StepStandIn([output(rid, r) for rid, r in reasons.items()]), set(reasons)
    deltas = backend.step()
    assert {d.seq_id: d.finish_reason for d in deltas} == reasons
    assert [(d.token_ids, d.logprobs) for d in deltas] == [([5], [-0.5])] * 5
    assert backend._running == {"e"}
