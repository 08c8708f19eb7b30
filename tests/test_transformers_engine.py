"""The transformers backend behind GenerationEngine (float32, CPU): vLLM's greedy tokens and logprobs,
continuous batching, sampling distributions and seeds, and weight updates in the middle of generation; with
`enforce_eager=false`, its decode steps as graphs (replayed eagerly here: the CPU has no CUDA graphs, and
tests/test_gpu.py captures real ones)."""

import random
from collections import Counter, defaultdict

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from experiments.common import InferenceConfig
from rlsys.algorithms.ppo import gather_logprobs, next_token_logits
from rlsys.api import GenerationConfig
from rlsys.engine import decode_graphs
from rlsys.engine.backend import SamplingSettings
from rlsys.engine.generation import GenerationEngine
from rlsys.engine.transformers_engine import SPARE_COLUMNS, TransformersBackend
from rlsys.model.tokenizer import build_char_tokenizer
from tests.helpers import ReplayEagerly, save_random_tiny_model

EOS = 1  # the character tokenizer's <|end|>
FIRST_CHAR, NUM_CHARS = 7, 95  # character token ids follow the special tokens
TOLERANCE = 1e-4


def progression(rng: random.Random, length: int, stride: int | None = None) -> list[int]:
    """Characters in arithmetic progression (cycling through the alphabet): what the test model continues."""
    start, stride = rng.randrange(NUM_CHARS), stride or rng.randint(1, 3)
    return [FIRST_CHAR + (start + stride * i) % NUM_CHARS for i in range(length)]


def train(model, rows, steps: int, lr: float) -> None:
    """Real AdamW steps on next-token loss over sequences from `rows(rng)`."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    rng = random.Random(0)
    for _ in range(steps):
        batch = [rows(rng) for _ in range(32)]
        width = max(map(len, batch))
        ids = torch.tensor([row + [0] * (width - len(row)) for row in batch])
        labels = torch.tensor([row + [-100] * (width - len(row)) for row in batch])
        loss = model(input_ids=ids, labels=labels).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


@pytest.fixture(scope="module")
def model_path(tmp_path_factory):
    """A tiny tied-embedding model trained for a few seconds to continue progressions and end them: its greedy
    outputs vary with the prompt and some end in EOS, where a random model repeats one token forever."""
    directory = save_random_tiny_model(tmp_path_factory.mktemp("model"))
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    train(model, lambda rng: progression(rng, rng.randint(3, 14)) + [EOS], steps=150, lr=3e-3)
    model.save_pretrained(directory)
    return str(directory)


def graphs_on_the_cpu(monkeypatch, held: int = 0, total: int = 2**40, free: int | None = None) -> None:
    """The graph path on the CPU: each graph replayed eagerly, in a device memory of `total` bytes of which this
    process holds `held` and `free` are free (all the rest by default)."""
    monkeypatch.setitem(decode_graphs.GRAPH_CAPTURE, "cpu", ReplayEagerly)
    monkeypatch.setitem(decode_graphs.DEVICE_MEMORY, "cpu",
                        lambda device: (held, total - held if free is None else free, total))


@pytest.fixture(params=["eager", "graphs"])
def decode(request, monkeypatch) -> dict:
    """Both decode paths, as inference settings: HF's forward pass, and the graph path's."""
    if request.param == "graphs":
        graphs_on_the_cpu(monkeypatch)
    return {"enforce_eager": request.param == "eager"}


def load_model(path):
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def transformers_engine(path, **inference) -> GenerationEngine:
    return GenerationEngine(TransformersBackend(path, InferenceConfig(engine="transformers", **inference), seed=0))


def learner_logits(model, prompt: list[int], output: list[int], temperature: float = 1.0) -> torch.Tensor:
    """The learner's logits that predict each of `output`'s tokens."""
    ids = torch.tensor([prompt + output])
    with torch.no_grad():
        return next_token_logits(model, ids, torch.ones_like(ids), temperature)[0, len(prompt) - 1:]


def learner_logprobs(model, prompt: list[int], output: list[int], temperature: float = 1.0) -> torch.Tensor:
    """What the learner recomputes for `output`'s tokens."""
    logits = learner_logits(model, prompt, output, temperature)
    return gather_logprobs(logits[None], torch.tensor([prompt[-1:] + output]))[0]


def assert_same_outputs(got, expected) -> None:
    for a, b in zip(got, expected, strict=True):
        assert (a.rid, a.output_ids, a.stop_reasons) == (b.rid, b.output_ids, b.stop_reasons)
        for lp_a, lp_b in zip(a.logprobs, b.logprobs, strict=True):
            assert torch.allclose(torch.tensor(lp_a), torch.tensor(lp_b), atol=TOLERANCE, rtol=0), a.rid


def greedy_requests() -> list[tuple[str, list[int], GenerationConfig]]:
    """Prompts of 1-7 tokens, n of 1 or 3, short and long limits, some with a stop token two steps ahead."""
    rng = random.Random(1)
    requests = []
    for i in range(10):
        stride = rng.randint(1, 3)
        prompt = progression(rng, rng.randint(1, 7), stride)
        stop = [FIRST_CHAR + (prompt[-1] - FIRST_CHAR + 2 * stride) % NUM_CHARS] if i % 3 == 0 else []
        requests.append((f"q{i}", prompt, GenerationConfig(n=rng.choice([1, 3]), max_new_tokens=rng.choice([2, 20]),
                                                           temperature=0.0, stop_token_ids=stop)))
    return requests


@pytest.fixture(scope="module")
def vllm_greedy(model_path) -> list:
    from rlsys.engine.vllm_engine import VLLMBackend

    return GenerationEngine(VLLMBackend(model_path, InferenceConfig(), seed=0)).generate(greedy_requests())


def test_greedy_tokens_and_logprobs_equal_vllm(model_path, vllm_greedy, decode):
    requests = greedy_requests()
    # Fewer places than sequences, so most sequences wait, then join a running batch.
    ours = transformers_engine(model_path, max_num_seqs=4, **decode).generate(requests)
    assert_same_outputs(ours, vllm_greedy)

    endings = Counter()
    for (_, _, gconfig), out in zip(requests, ours):
        for ids, reason in zip(out.output_ids, out.stop_reasons):
            endings["eos" if ids[-1] == EOS else "stop token" if ids[-1] in gconfig.stop_token_ids else reason] += 1
    assert endings.keys() == {"eos", "stop token", "length"}, f"the requests must cover every ending: {endings}"


def test_request_added_mid_generation_gives_what_it_gives_alone(model_path, decode):
    early = ("early", [20, 22, 24], GenerationConfig(n=2, max_new_tokens=20, temperature=0.0))
    late = ("late", [50, 51], GenerationConfig(n=3, max_new_tokens=20, temperature=0.0))
    alone = [transformers_engine(model_path, **decode).generate([request])[0] for request in (early, late)]

    engine = transformers_engine(model_path, **decode)
    engine.add_request(*early)
    for _ in range(3):
        assert engine.step() == [], "the early request must still be generating when the late one arrives"
    engine.add_request(*late)
    finished = {}
    while len(finished) < 2:
        finished.update((out.rid, out) for out in engine.step())
    assert_same_outputs([finished["early"], finished["late"]], alone)


def test_aborting_a_request_mid_generation_leaves_the_others_exact(model_path, decode):
    requests = [(f"q{i}", prompt, GenerationConfig(n=2, max_new_tokens=20, temperature=0.0))
                for i, prompt in enumerate([[10, 12], [46, 48], [55, 56]])]  # 13 to 18 greedy tokens
    alone = [transformers_engine(model_path, **decode).generate([request])[0] for request in requests]
    engine = transformers_engine(model_path, **decode)
    for request in requests:
        engine.add_request(*request)
    for _ in range(3):
        assert engine.step() == []
    engine.abort_request("q0")  # a third of the batch: its places are filled by moving the others
    finished = {}
    while engine.in_flight:
        finished.update((out.rid, out) for out in engine.step())
    assert finished.keys() == {"q1", "q2"}
    assert_same_outputs([finished["q1"], finished["q2"]], alone[1:])


def test_at_most_max_num_seqs_run_at_once_and_waiting_ones_lose_nothing(model_path):
    rng = random.Random(2)
    prompts = [progression(rng, rng.randint(1, 6)) for _ in range(8)]

    def run(max_num_seqs: int) -> tuple[dict[str, list[int]], list[int]]:
        backend = TransformersBackend(model_path, InferenceConfig(max_num_seqs=max_num_seqs), seed=0)
        batch_sizes = []
        forward = backend.model.forward
        backend.model.forward = lambda input_ids, **kw: batch_sizes.append(len(input_ids)) or forward(input_ids, **kw)
        for i, prompt in enumerate(prompts):
            backend.add(f"s{i}", prompt, SamplingSettings(max_tokens=6, temperature=0.0))
        tokens = defaultdict(list)
        while backend.has_unfinished():
            for delta in backend.step():
                tokens[delta.seq_id] += delta.token_ids
        return dict(tokens), batch_sizes

    queued, batch_sizes = run(max_num_seqs=3)
    together, _ = run(max_num_seqs=256)
    assert max(batch_sizes) == 3
    assert queued == together


def test_long_staggered_generation_keeps_every_sequence_exact(tmp_path, monkeypatch, decode):
    """Requests of mixed lengths arrive over 100 steps into 6 places: the running batch refills freed places,
    moves sequences into holes, makes room for a prompt longer than the batch, and runs out of columns (with graphs:
    drops the columns no sequence uses, in place), and prompts are prefilled a few at a time; every sampled token's
    logprob must still be the learner's."""
    import rlsys.engine.transformers_engine as engine_module

    calls = Counter()
    for method in ("_relayout", "_fill_holes", "_mostly_unused"):
        def spied(self, *args, _original=getattr(engine_module._RunningBatch, method), _method=method, **kwargs):
            result = _original(self, *args, **kwargs)
            if result is not False:  # _mostly_unused counts only the times it holds
                calls.update([_method])
            return result

        monkeypatch.setattr(engine_module._RunningBatch, method, spied)
    budget = 30
    monkeypatch.setattr(engine_module, "PREFILL_TOKENS", budget)
    prefilled = []  # (distinct prompts, longest) of each prefill forward pass

    def spied_groups(rows, _groups=engine_module._prefill_groups):
        groups = _groups(rows)
        prefilled.extend((len({tuple(r.token_ids) for r in g}), max(len(r.token_ids) for r in g)) for g in groups)
        return groups

    monkeypatch.setattr(engine_module, "_prefill_groups", spied_groups)
    path = str(save_random_tiny_model(tmp_path / "model"))  # untrained: rarely ends, so sequences run long
    engine = transformers_engine(path, max_num_seqs=6, **decode)
    rng = random.Random(3)
    arrivals = {0: 3, 1: 1, 5: 1, 30: 2, 70: 1}  # step -> requests of n=2
    requests, finished, step = {}, {}, 0
    while step <= max(arrivals) or engine.in_flight:
        for _ in range(arrivals.get(step, 0)):
            rid = f"q{len(requests)}"
            length = 60 if step == 5 else rng.randint(2, 12)
            requests[rid] = (progression(rng, length), GenerationConfig(
                n=2, max_new_tokens=rng.choice([4, 30, 90]), temperature=1.0, seed=len(requests)))
            engine.add_request(rid, *requests[rid])
        finished.update((out.rid, out) for out in engine.step())
        step += 1
    assert calls["_relayout"] >= 2 and calls["_fill_holes"] >= 1, f"the schedule must exercise the batch: {calls}"
    if not decode["enforce_eager"]:
        assert calls["_mostly_unused"] >= 1, f"the schedule must drop unused columns in place: {calls}"
        assert engine.backend.decode_graphs.captured <= 12 < step / 4, "a graph per batch and width bucket, reused"
        assert 1 <= engine.backend.decode_graphs.captured_prefills < len(prefilled), "prefill graphs, reused"
    assert all(count * longest <= budget or count == 1 for count, longest in prefilled)
    assert max(count for count, _ in prefilled) > 1 and len(prefilled) > len(arrivals), prefilled

    model = load_model(path)
    for rid, (prompt, gconfig) in requests.items():
        for ids, logprobs in zip(finished[rid].output_ids, finished[rid].logprobs):
            assert len(ids) == gconfig.max_new_tokens or ids[-1] == EOS
            assert (torch.tensor(logprobs) - learner_logprobs(model, prompt, ids)).abs().max() < TOLERANCE, rid


def test_seeded_sampling_is_reproducible_and_its_logprobs_are_the_learners(model_path, decode):
    temperature = 0.8
    requests = [(f"q{i}", [20 + 3 * i], GenerationConfig(n=4, max_new_tokens=12, temperature=temperature, seed=7))
                for i in range(3)]
    first = transformers_engine(model_path, **decode).generate(requests)
    assert_same_outputs(transformers_engine(model_path, **decode).generate(requests), first)
    reseeded = [(rid, prompt, GenerationConfig(n=4, max_new_tokens=12, temperature=temperature, seed=8))
                for rid, prompt, _ in requests]
    other = transformers_engine(model_path, **decode).generate(reseeded)
    assert [o.output_ids for o in other] != [o.output_ids for o in first], "the seed must matter"

    model = load_model(model_path)
    for out in first:
        for ids, logprobs in zip(out.output_ids, out.logprobs):
            expected = learner_logprobs(model, out.prompt_ids, ids, temperature)
            assert (torch.tensor(logprobs) - expected).abs().max() < TOLERANCE


def test_a_temperature_below_vllms_floor_is_sampled_at_the_floor_as_vllm_does(tmp_path):
    """vLLM raises a temperature in (0, 0.01) to 0.01 and samples there, logprobs at 0.01: only 0 is greedy. So does
    this engine; greedy, its logprobs would be at temperature 1 (about -3.9 on this random model, where vLLM gives
    about 0), and those of 0.004 at 0.004."""
    path = str(save_random_tiny_model(tmp_path / "model"))  # untrained: logits close together
    prompt, model = [4, 7, 8, 20, 21], load_model(path)
    for temperature in (1e-6, 0.004):
        (out,) = transformers_engine(path).generate([("q", prompt, GenerationConfig(
            n=2, max_new_tokens=4, temperature=temperature, seed=3))])
        for ids, logprobs in zip(out.output_ids, out.logprobs):
            expected = learner_logprobs(model, prompt, ids, temperature=0.01)
            assert (torch.tensor(logprobs) - expected).abs().max() < TOLERANCE, temperature
    assert (learner_logprobs(model, prompt, ids) - expected).abs().min() > 1, "greedy logprobs must differ here"


def test_top_k_one_is_greedy(model_path):
    requests = [(f"q{i}", [30 + 5 * i, 31 + 5 * i], GenerationConfig(n=2, max_new_tokens=10, temperature=0.0))
                for i in range(3)]
    top_1 = [(rid, prompt, GenerationConfig(n=2, max_new_tokens=10, temperature=1.0, top_k=1, seed=3))
             for rid, prompt, _ in requests]
    assert_same_outputs(transformers_engine(model_path).generate(top_1),
                        transformers_engine(model_path).generate(requests))


def kept_probabilities(probs: torch.Tensor, top_k: int, top_p: float) -> dict[int, float]:
    """The distribution a sampler with these settings draws from: the k most likely tokens, then the
    most likely ones until their mass reaches top_p, renormalised."""
    values, tokens = probs.sort(descending=True)
    keep = top_k if top_k > 0 else len(values)
    mass_before = values.cumsum(0) - values
    keep = min(keep, int((mass_before < top_p).sum()))
    kept = values[:keep] / values[:keep].sum()
    return dict(zip(tokens[:keep].tolist(), kept.tolist()))


def pooled_total_variation(counts: Counter, expected: dict[int, float]) -> float:
    """Total variation between sampled frequencies and `expected`, tokens under 1% pooled into one bucket,
    so that the sampling noise of a hundred rare tokens does not swamp the comparison."""
    samples = sum(counts.values())
    common = [t for t, p in expected.items() if p >= 0.01]
    gaps = [counts[t] / samples - expected[t] for t in common]
    gaps.append(sum(gaps) * -1)  # the rare bucket's gap: frequencies and probabilities both sum to 1
    return sum(map(abs, gaps)) / 2


@pytest.mark.parametrize("temperature, top_k, top_p", [(1.5, -1, 1.0), (1.0, 2, 1.0), (1.5, -1, 0.7)])
def test_sampled_first_tokens_follow_the_distribution(model_path, temperature, top_k, top_p):
    prompt, samples = [20], 3000
    gconfig = GenerationConfig(n=samples, max_new_tokens=1, temperature=temperature, top_k=top_k, top_p=top_p)
    out = transformers_engine(model_path, max_num_seqs=samples).generate([("q", prompt, gconfig)])[0]
    counts = Counter(ids[0] for ids in out.output_ids)

    with torch.no_grad():
        logits = load_model(model_path)(torch.tensor([prompt])).logits[0, -1]
    expected = kept_probabilities(torch.softmax(logits / temperature, dim=-1), top_k, top_p)
    assert set(counts) <= set(expected), f"drew tokens outside the top-k/top-p set {sorted(expected)}"
    tv = pooled_total_variation(counts, expected)
    assert tv < 0.03, f"sampled frequencies are {tv:.3f} (total variation) from the model's distribution"


def test_weight_update_mid_generation_tags_each_token_with_the_weights_that_made_it(model_path, decode):
    engine = transformers_engine(model_path, **decode)
    requests = [("greedy", [20, 22, 24], GenerationConfig(n=2, max_new_tokens=10, temperature=0.0)),
                ("sampled", [60, 61], GenerationConfig(n=1, max_new_tokens=10, temperature=1.0, seed=5))]
    for request in requests:
        engine.add_request(*request)
    before = 4
    for _ in range(before):
        assert engine.step() == []

    old, new = load_model(model_path), load_model(model_path)
    train(new, lambda rng: progression(rng, 8, stride=-1) + [EOS], steps=5, lr=1e-2)  # now counts down
    assert engine.update_weights(new.state_dict(), version=1) == (3, [])
    finished = {}
    while len(finished) < 2:
        finished.update((out.rid, out) for out in engine.step())

    changed = 0.0
    for rid, prompt, gconfig in requests:
        out = finished[rid]
        for ids, logprobs, versions in zip(out.output_ids, out.logprobs, out.versions):
            assert versions == [0] * before + [1] * (len(ids) - before)
            assert len(ids) == gconfig.max_new_tokens or ids[-1] == EOS, "tokens were lost or generated twice"
            old_logprobs, new_logprobs = learner_logprobs(old, prompt, ids), learner_logprobs(new, prompt, ids)
            logprobs = torch.tensor(logprobs)
            assert (logprobs[:before] - old_logprobs[:before]).abs().max() < TOLERANCE
            assert (logprobs[before:] - new_logprobs[before:]).abs().max() < TOLERANCE
            changed = max(changed, (old_logprobs[before:] - new_logprobs[before:]).abs().max().item())
            if gconfig.temperature == 0:  # greedy under the weights of the moment
                assert ids[:before] == learner_logits(old, prompt, ids)[:before].argmax(-1).tolist()
                assert ids[before:] == learner_logits(new, prompt, ids)[before:].argmax(-1).tolist()
    assert changed > 1e-2, "the update must change the logprobs, or this test proves nothing"


def test_interrupted_samples_keep_their_place_ahead_of_newer_requests(model_path):
    """One place in the batch: the old request, interrupted by an update, resumes before the newer one that
    was waiting; queued behind it, the oldest rollout would become the stalest."""
    engine = transformers_engine(model_path, max_num_seqs=1)
    engine.add_request("old", [20, 22, 24], GenerationConfig(max_new_tokens=10, temperature=0.0))
    engine.step()
    engine.add_request("new", [30, 32, 34], GenerationConfig(max_new_tokens=10, temperature=0.0))
    engine.update_weights(load_model(model_path).state_dict(), version=1)
    order = []
    while len(order) < 2:
        order += [out.rid for out in engine.step()]
    assert order == ["old", "new"]


def save_random_model(directory, model_type: str) -> str:
    """A random two-layer model of another architecture the graph path takes, on the character tokenizer."""
    tokenizer = build_char_tokenizer()
    config = AutoConfig.for_model(
        model_type, vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.eos_token_id)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return str(directory)


@pytest.mark.parametrize("model_type", ["llama", "qwen3"])
def test_the_graph_path_generates_what_hfs_forward_does_for_llama_and_qwen3(tmp_path, monkeypatch, model_type):
    """The default model is a Qwen2; the graph path's forward also runs Llama's layout and Qwen3's per-head norms."""
    path = save_random_model(tmp_path / model_type, model_type)
    requests = [(f"q{i}", progression(random.Random(i), 3 + 4 * i), GenerationConfig(
        n=3, max_new_tokens=12, temperature=1.0 if i % 2 else 0.0, seed=i)) for i in range(4)]
    eager = transformers_engine(path).generate(requests)
    graphs_on_the_cpu(monkeypatch)
    assert_same_outputs(transformers_engine(path, enforce_eager=False).generate(requests), eager)


@pytest.mark.parametrize("tokens", [1, 5], ids=["decode", "prefill"])
def test_grouped_query_heads_stacked_along_the_queries_attend_as_sdpa_with_groups(tokens):
    """The graphs' attention (decode_graphs.grouped_query_attention) stacks each key/value head's query heads along
    the query length, the mask repeated for each: the same outputs as sdpa taking the groups, padding included."""
    generator = torch.Generator().manual_seed(0)
    rows, heads, kv_heads, width, dim = 3, 6, 2, 7, 8
    query = torch.randn(rows, tokens, heads, dim, generator=generator).transpose(1, 2)  # as the layer hands it over
    key, value = (torch.randn(rows, kv_heads, width, dim, generator=generator) for _ in range(2))
    attend = torch.rand(rows, 1, tokens, width, generator=generator) > 0.4
    attend[..., -1] = True  # no row without a key
    expected = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=attend, scale=0.3,
                                                                enable_gqa=True)
    stacked = attend if tokens == 1 else attend.repeat(1, 1, heads // kv_heads, 1)
    got = decode_graphs.grouped_query_attention(query, key, value, stacked, 0.3)
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-6, rtol=1e-5)


def test_the_graphs_run_as_many_sequences_as_their_cache_fits_in_the_memory_given(model_path, monkeypatch, caplog):
    """The graphs' KV cache is allocated whole, for every sequence's longest, so it is sized to
    inference.gpu_memory_utilization: where half the device less what the process holds fits 3.5 sequences' cache,
    the engine keeps 3 (the same outputs as eager), says so; where what is free fits 2.5, 2; where not one fits it
    refuses to start."""
    config = AutoConfig.from_pretrained(model_path)
    head_dim = config.hidden_size // config.num_attention_heads
    columns = transformers_engine(model_path).backend.max_model_len + SPARE_COLUMNS
    per_sequence = columns * (2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4 + 8)
    held = 10 * 2**20
    requests = [(f"q{i}", progression(random.Random(i), 3 + i), GenerationConfig(
        n=2, max_new_tokens=10, temperature=1.0 if i % 2 else 0.0, seed=i)) for i in range(4)]
    eager = transformers_engine(model_path, max_num_seqs=8).generate(requests)

    graphs_on_the_cpu(monkeypatch, held=held, total=int(2 * (held + 3.5 * per_sequence)))
    engine = transformers_engine(model_path, enforce_eager=False, max_num_seqs=8, gpu_memory_utilization=0.5)
    assert engine.backend.max_num_seqs == 3
    assert "running at most 3 at once, not inference.max_num_seqs=8" in caplog.text
    assert_same_outputs(engine.generate(requests), eager)
    assert engine.backend._running.keys[0].shape[0] == 3, "the cache holds the sequences that fit, no more"

    graphs_on_the_cpu(monkeypatch, held=held, total=2**40, free=int(2.5 * per_sequence))  # a learner holds the rest
    assert transformers_engine(model_path, enforce_eager=False, gpu_memory_utilization=0.5).backend.max_num_seqs == 2

    graphs_on_the_cpu(monkeypatch, held=held, total=int(2 * (held + 0.9 * per_sequence)))
    with pytest.raises(ValueError, match="raise it, lower inference.max_model_len, or set inference.enforce_eager"):
        transformers_engine(model_path, enforce_eager=False, gpu_memory_utilization=0.5)


def test_unset_enforce_eager_means_graphs_on_a_gpu_and_eager_where_they_cannot_run(model_path, monkeypatch, caplog):
    """inference.enforce_eager unset (the default): eager on a CPU, CUDA graphs on a GPU, as vLLM does there. Where the
    graphs cannot run (here: not one sequence's cache fits) the engine says why and decodes eagerly; false refuses."""
    unset = InferenceConfig()
    assert unset.eager_on("cpu") and not unset.eager_on("cuda") and not unset.eager_on(torch.device("cuda", 0))
    assert InferenceConfig(enforce_eager=True).eager_on("cuda")
    assert not InferenceConfig(enforce_eager=False).eager_on("cpu")
    requests = [(f"q{i}", progression(random.Random(i), 3 + i), GenerationConfig(
        n=2, max_new_tokens=10, temperature=1.0 if i % 2 else 0.0, seed=i)) for i in range(3)]
    engine = transformers_engine(model_path)
    assert engine.backend.decode_graphs is None  # this CPU
    eager = engine.generate(requests)

    # This device taken for a GPU: unset means graphs.
    monkeypatch.setattr(InferenceConfig, "eager_on", lambda self, device: bool(self.enforce_eager))
    graphs_on_the_cpu(monkeypatch)
    engine = transformers_engine(model_path)
    assert engine.backend.decode_graphs is not None
    assert_same_outputs(engine.generate(requests), eager)
    assert engine.backend.decode_graphs.captured > 0

    graphs_on_the_cpu(monkeypatch, total=2**10)  # not one sequence's cache fits
    engine = transformers_engine(model_path)
    assert engine.backend.decode_graphs is None
    assert "decoding eagerly, without CUDA graphs" in caplog.text and "gpu_memory_utilization" in caplog.text
    assert_same_outputs(engine.generate(requests), eager)
    with pytest.raises(ValueError, match="raise it, lower inference.max_model_len"):
        transformers_engine(model_path, enforce_eager=False)


def test_graphs_are_refused_without_a_gpu_and_for_other_architectures(model_path):
    with pytest.raises(ValueError, match="need a GPU; this worker runs on the cpu: leave inference.enforce_eager=true"):
        transformers_engine(model_path, enforce_eager=False)
    gpt2 = AutoModelForCausalLM.from_config(AutoConfig.for_model("gpt2", n_layer=1, n_embd=8, n_head=2, vocab_size=16))
    with pytest.raises(ValueError, match="this one is 'gpt2': set inference.enforce_eager=true"):
        decode_graphs.DecodeGraphs(gpt2, torch.device("cuda"), slots=4, columns=64, memory_share=0.5)


@pytest.mark.parametrize("tied", [True, False])
def test_load_weights_replaces_every_weight_tied_output_head_included(tmp_path, tied, decode):
    """Scored (the weight-sync probe) before and after: with graphs, by the prefill's graph."""
    path = str(save_random_tiny_model(tmp_path / "model", tie_word_embeddings=tied))
    backend = TransformersBackend(path, InferenceConfig(**decode), seed=0)
    model = load_model(path)
    sequence = [4, 7, 8, 78, 9, 10, 86, 1, 5, 10, 12, 1]
    train(model, lambda rng: sequence, steps=3, lr=1e-2)
    expected = learner_logprobs(model, sequence[:1], sequence[1:])
    assert (torch.tensor(backend.score(sequence)) - expected).abs().max() > 1e-2, "the update must change the scores"

    backend.load_weights(model.state_dict())
    assert (torch.tensor(backend.score(sequence)) - expected).abs().max() < TOLERANCE
    if not decode["enforce_eager"]:
        assert backend.decode_graphs.captured_prefills == 1, "one graph for the sequence's width, replayed"


def test_weights_for_another_model_are_refused_by_name(model_path):
    """Tensors arrive one by one and each is copied as it comes; a name the model lacks, a shape it has otherwise or
    a name left out is refused, as load_state_dict's strict mode would."""
    backend = TransformersBackend(model_path, InferenceConfig(), seed=0)
    state = {name: t.clone() for name, t in backend.model.state_dict().items()}
    name = next(name for name, t in state.items() if t.dim() == 2)
    with pytest.raises(RuntimeError, match="lack .* another model"):
        backend.load_weights({k: t for k, t in state.items() if k != name})
    with pytest.raises(RuntimeError, match="'extra.weight' .* does not have"):
        backend.load_weights({**state, "extra.weight": torch.ones(2)})
    with pytest.raises(RuntimeError, match=f"{name!r} of shape \\({state[name].shape[1]},\\), which this model has as"):
        backend.load_weights({**state, name: torch.ones(state[name].shape[1])})  # copy_ alone would broadcast it


def test_bad_input_and_the_context_limit(model_path):
    positions = load_model(model_path).config.max_position_embeddings
    with pytest.raises(ValueError, match=f"max_position_embeddings={positions}"):
        TransformersBackend(model_path, InferenceConfig(max_model_len=positions + 1), seed=0)
    assert TransformersBackend(model_path, InferenceConfig(max_model_len=0), seed=0).max_model_len == positions
    backend = TransformersBackend(model_path, InferenceConfig(max_model_len=8), seed=0)
    with pytest.raises(ValueError, match="max_model_len=8"):
        backend.add("long", list(range(10, 18)), SamplingSettings(max_tokens=4))
    with pytest.raises(ValueError, match="at least 1"):
        backend.add("empty", [], SamplingSettings(max_tokens=4))

    backend.add("s", [40, 41, 42, 43, 44], SamplingSettings(max_tokens=10, temperature=0.0))
    (delta,) = backend.step()
    tokens = delta.token_ids
    with pytest.raises(RuntimeError, match="finished or aborted"):
        backend.load_weights(load_model(model_path).state_dict())
    while backend.has_unfinished():
        (delta,) = backend.step()
        tokens += delta.token_ids
    assert tokens == [45, 46, 47] and delta.finish_reason == "length", "prompt + output stop at max_model_len"


def test_a_token_outside_the_vocabulary_is_refused_at_add_and_the_batch_generates_on(model_path):
    """As vLLM refuses it in add_request: the worker answers that request with the reason, and the others run on.
    Accepted, it would fail the whole batch's next step (an embedding index out of range)."""
    backend = TransformersBackend(model_path, InferenceConfig(engine="transformers"), seed=0)
    vocab = backend.model.get_input_embeddings().num_embeddings
    backend.add("good", [40, 41, 42], SamplingSettings(max_tokens=3, temperature=0.0))
    with pytest.raises(ValueError, match=f"token id {vocab}, outside the model.s vocabulary of {vocab}"):
        backend.add("bad", [40, vocab, 42], SamplingSettings(max_tokens=3, temperature=0.0))
    tokens = []
    while backend.has_unfinished():
        (delta,) = backend.step()
        tokens += delta.token_ids
    assert len(tokens) == 3 and delta.seq_id == "good"
