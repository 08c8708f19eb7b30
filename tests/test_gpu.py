"""The learner, the transformers engine and the weight paths on a CUDA GPU, checked against the CPU.

Skipped where torch sees no GPU (CI has none). On a GPU machine: `python3 -m pytest tests/test_gpu.py`.
"""

import pytest
import torch

from experiments import AsyncPPOMATHConfig
from experiments.common import InferenceConfig
from rlsys import protocol
from rlsys.algorithms.ppo import gather_logprobs, next_token_logits
from rlsys.api import GenerationConfig, Trajectory
from rlsys.api.messages import parse_published_weights
from rlsys.bus import InProcessBus
from rlsys.distributed import Ranks
from rlsys.engine.generation import GenerationEngine
from rlsys.engine.transformers_engine import TransformersBackend
from rlsys.training_step import PolicyTrainer
from rlsys.weight_checksum import weights_checksum
from rlsys.weight_transport import WeightReceiver, WeightServer, publish
from tests.helpers import save_random_tiny_model

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPT, GOOD, BAD = [4, 7, 8, 78, 9, 10, 86, 1, 5], [10, 12, 1], [11, 11, 1]


class CpuRanks(Ranks):
    """One rank that keeps the learner on the CPU even where a GPU is seen: the reference side."""
    device = "cpu"


def logprobs_of(model, ids: list[int]) -> torch.Tensor:
    """The learner's logprob of each token after the first, on the model's device, returned on the CPU."""
    device = next(model.parameters()).device
    tensor = torch.tensor([ids], device=device)
    with torch.no_grad():
        return gather_logprobs(next_token_logits(model, tensor, torch.ones_like(tensor)), tensor)[0].float().cpu()


def batch(model) -> list[Trajectory]:
    """GOOD rewarded, BAD not, twice each; behaviour logprobs are the model's own."""
    out = []
    for answer, reward in [(GOOD, 1.0), (BAD, 0.0)] * 2:
        behaviour = logprobs_of(model, PROMPT + answer)[-len(answer):]
        n = len(PROMPT)
        out.append(Trajectory(token_ids=PROMPT + answer, loss_mask=[0] * n + [1] * len(answer),
                              logprobs=[0.0] * n + behaviour.tolist(), versions=[-1] * n + [0] * len(answer),
                              turn_ends=[n + len(answer)], turn_rewards=[reward], reward=reward, group_id="g",
                              stop_reason="stop"))
    return out


def config_for(tmp_path, **learner) -> AsyncPPOMATHConfig:
    config = AsyncPPOMATHConfig()
    config.model.path = str(save_random_tiny_model(tmp_path / "model"))
    config.ppo.lr, config.ppo.init_kl_coef = 1e-3, 0.1
    for key, value in learner.items():
        setattr(config.learner, key, value)
    return config


def waits_of_a_step(trainer, trajectories) -> int:
    """How often a train step (after one to warm the kernels and the pinned-memory cache) waits for the GPU, as
    torch's sync debug mode reports: each read back, each copy from pageable memory."""
    import warnings

    trainer.train_step(trajectories)
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            trainer.train_step(trajectories)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in caught)


def test_a_train_step_on_the_gpu_gives_the_cpus_policy(tmp_path):
    """Compared as the policy (logprobs) and the step's statistics, not parameter by parameter: AdamW's first step
    divides each gradient by its own size, so a parameter whose gradient is near zero moves by a rounding-sized
    amount that differs between devices (measured on an H200: 5e-5 in one parameter, steps of 1e-3)."""
    config = config_for(tmp_path)
    results = {}
    for name, ranks in (("cpu", CpuRanks()), ("gpu", Ranks())):
        trainer = PolicyTrainer(config, ranks, config.model.path)  # seeds torch: both draw the same mini-batches
        assert str(next(trainer.model.parameters()).device).startswith(name.replace("gpu", "cuda"))
        assert trainer.micro_batch_tokens == {"cpu": 2048, "gpu": 16384}[name]  # ppo.max_tokens_per_micro_batch=0
        before = torch.cat([logprobs_of(trainer.model, PROMPT + answer) for answer in (GOOD, BAD)])
        stats = trainer.train_step(batch(trainer.model))
        after = torch.cat([logprobs_of(trainer.model, PROMPT + answer) for answer in (GOOD, BAD)])
        results[name] = (before, after, stats)
    (cpu_before, cpu_after, cpu_stats), (gpu_before, gpu_after, gpu_stats) = results["cpu"], results["gpu"]
    assert (cpu_after - cpu_before).abs().max() > 1e-2, "the step must move the policy, or this test proves nothing"
    assert (cpu_before - gpu_before).abs().max() < 1e-5
    worst = (cpu_after - gpu_after).abs().max().item()
    assert worst < 1e-3, f"after one step the GPU's and the CPU's logprobs differ by {worst:.2e}"
    assert abs(cpu_stats["kl"] - gpu_stats["kl"]) < 1e-5 and cpu_stats["grad_norm"] == pytest.approx(
        gpu_stats["grad_norm"], rel=1e-4)


def test_bfloat16_mixed_precision_trains_toward_the_rewarded_answer(tmp_path):
    config = config_for(tmp_path, dtype="bfloat16")
    trainer = PolicyTrainer(config, Ranks(), config.model.path)
    good, bad = (logprobs_of(trainer.model, PROMPT + GOOD)[-3:].sum(),
                 logprobs_of(trainer.model, PROMPT + BAD)[-3:].sum())
    for _ in range(5):
        stats = trainer.train_step(batch(trainer.model))
    assert next(trainer.model.parameters()).dtype == torch.float32  # master weights stay float32
    assert logprobs_of(trainer.model, PROMPT + GOOD)[-3:].sum() > good + 0.5
    assert logprobs_of(trainer.model, PROMPT + BAD)[-3:].sum() < bad - 0.5
    assert stats["grad_norm"] > 0


@pytest.mark.parametrize("enforce_eager", [True, False], ids=["eager", "cuda-graphs"])
def test_the_gpu_engine_matches_the_gpu_learner_before_and_after_updates_over_disk_and_the_stream(tmp_path,
                                                                                                 enforce_eager):
    """The transformers engine on the GPU scores and generates what the learner on the GPU computes, and after
    each update (a file on disk, then tensors streamed from the learner's weight server) holds the learner's new
    weights, with the checksum computed on the GPU equal to the learner's; its decode graphs replay the new weights.
    The second streamed version loads as it arrives, from pinned memory (one wait for all its copies)."""
    config = config_for(tmp_path)
    trainer = PolicyTrainer(config, Ranks(), config.model.path)
    engine = GenerationEngine(TransformersBackend(
        config.model.path, InferenceConfig(engine="transformers", enforce_eager=enforce_eager), seed=0))
    assert engine.backend.device.type == "cuda"
    sequence = PROMPT + GOOD
    assert engine.backend.loads_from_pinned_memory
    server, bus = WeightServer(), InProcessBus()
    receiver = WeightReceiver(checksum_arrived=False, pinned=True)  # what the inference worker makes for it
    for version, transport in enumerate((None, "disk", "stream", "stream")):
        if transport is not None:
            trainer.train_step(batch(trainer.model))
            publish(bus, trainer.model, version, transport, tmp_path / "weights", server=server)
            received = receiver.receive(parse_published_weights(bus.get(protocol.WEIGHTS)), as_they_arrive=True)
            engine.update_weights(received.weights, version=version)
            received = receiver.settle(received)
            assert weights_checksum(engine.backend.loaded_weights()) == received.checksum
            assert transport == "disk" or received.buffer.is_pinned()
        expected = logprobs_of(trainer.model, sequence)
        scored = torch.tensor(engine.backend.score(sequence))
        assert (scored - expected).abs().max() < 1e-4, f"version {version} ({transport})"
        engine.add_request(f"q{version}", PROMPT, GenerationConfig(n=1, max_new_tokens=6, temperature=0.0))
        out = []
        while not out:
            out = engine.step()
        ids, logprobs, versions = out[0].output_ids[0], out[0].logprobs[0], out[0].versions[0]
        assert versions == [version] * len(ids)
        learner = logprobs_of(trainer.model, PROMPT + ids)[-len(ids):]
        assert (torch.tensor(logprobs) - learner).abs().max() < 1e-4
    assert receiver.received_streamed == 2
    server.close()


def test_cuda_graphs_generate_the_learners_logprobs_with_sequences_joining_and_leaving(tmp_path):
    """96 seeded samples of mixed lengths through 32 places with the decode step and the prefills as CUDA graphs:
    every token's logprob is the learner's for the tokens drawn (compared token by token: two kernels' last bits may
    draw another token, which is no error), and a graph is captured once per bucket, not per step."""
    from transformers import AutoModelForCausalLM

    path = str(save_random_tiny_model(tmp_path / "model"))
    requests = [(f"q{i}", list(range(10 + i, 20 + 2 * i)), GenerationConfig(
        n=4, max_new_tokens=10 + 5 * (i % 7), temperature=1.0, seed=i)) for i in range(24)]
    backend = TransformersBackend(path, InferenceConfig(engine="transformers", max_num_seqs=32, enforce_eager=False),
                                  seed=0)
    outputs = GenerationEngine(backend).generate(requests)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).cuda().eval()
    for (_, prompt, gconfig), out in zip(requests, outputs, strict=True):
        for ids, logprobs in zip(out.output_ids, out.logprobs, strict=True):
            assert len(ids) == gconfig.max_new_tokens or ids[-1] == model.config.eos_token_id, out.rid
            learner = logprobs_of(model, prompt + ids)[-len(ids):]
            assert (torch.tensor(logprobs) - learner).abs().max() < 1e-4, out.rid
    graphs = backend.decode_graphs
    assert 1 < graphs.captured <= len(graphs.batch_sizes) * len(graphs.widths)
    assert 1 <= graphs.captured_prefills <= len(graphs.batch_sizes) * len(graphs.prompt_widths)


@pytest.mark.parametrize("autocast", [False, True], ids=["bfloat16", "float32-under-autocast"])
def test_a_packed_row_in_bfloat16_takes_the_flash_varlen_kernel_and_equals_each_sequence_alone(autocast):
    from rlsys.model.varlen_attention import flash_varlen_applies, varlen_causal_attention

    generator = torch.Generator(device="cuda").manual_seed(0)
    lengths = [5, 3, 5, 7, 3, 40, 1]
    heads, kv_heads, size = 4, 2, 16
    shape = lambda h: (1, h, sum(lengths), size)  # noqa: E731
    dtype = torch.float32 if autocast else torch.bfloat16  # under autocast, rotary embeddings hand over float32
    q, k, v = (torch.randn(shape(h), generator=generator, device="cuda", dtype=dtype, requires_grad=True)
               for h in (heads, kv_heads, kv_heads))
    positions = torch.cat([torch.arange(n, device="cuda") for n in lengths])[None]
    module = torch.nn.Module().eval()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        assert flash_varlen_applies(q, 0.0)
        out, _ = varlen_causal_attention(module, q, k, v, None, scaling=size ** -0.5, position_ids=positions)
    assert out.dtype == torch.bfloat16
    out.float().square().sum().backward()

    # Reference: each sequence alone through float32 sdpa.
    q32, k32, v32 = (t.detach().float().requires_grad_() for t in (q, k, v))
    expected = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        *(t[:, :, s:s + n] for t in (q32, k32, v32)), is_causal=True, enable_gqa=True)
        for s, n in zip(torch.tensor([0] + lengths).cumsum(0).tolist(), lengths)], dim=2).transpose(1, 2)
    expected.square().sum().backward()
    torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=2e-2)
    for got, want in ((q, q32), (k, k32), (v, v32)):
        torch.testing.assert_close(got.grad.float(), want.grad, atol=5e-2, rtol=5e-2)


@pytest.mark.parametrize("dtype,packing", [("float32", "auto"), ("bfloat16", "true"), ("bfloat16", "false")])
def test_a_gpu_step_synchronises_as_often_however_many_micro_batches_it_takes(tmp_path, dtype, packing):
    """Every wait for the GPU (a read back, a copy from pageable memory) that torch's sync debug mode reports is
    counted over a train step: per optimizer step, never per micro-batch. float32 pads (ppo.sequence_packing=auto);
    bfloat16 packs into flash-attention varlen calls or pads (auto measures which is faster)."""
    import random

    from tests.test_learner import mixed_length_batch

    from transformers import AutoModelForCausalLM

    counts = []
    config = config_for(tmp_path, dtype=dtype)
    config.ppo.sequence_packing = packing
    trajectories = mixed_length_batch(AutoModelForCausalLM.from_pretrained(config.model.path), random.Random(0))
    for budget in (16384, 40):
        config.ppo.max_tokens_per_micro_batch = budget
        trainer = PolicyTrainer(config, Ranks(), config.model.path)
        assert trainer.packed == (packing == "true") and not trainer.measures_layout
        passes = len(trainer.micro_batches(trainer.prepare_batch(trajectories)))
        counts.append((passes, waits_of_a_step(trainer, trajectories)))
    (few, few_waits), (many, many_waits) = counts
    assert many > few + 4, "the small budget must split the batch into more passes, or this test proves nothing"
    # Not one more wait for eleven more passes (seen on an H200: 11 waits in one pass, 10 in twelve; the one
    # pass's bigger pinned host buffers are new to the caching allocator, the twelve small ones fit the warm-up's).
    assert many_waits <= few_waits, counts


def test_a_bfloat16_learner_measures_on_its_first_step_whether_packing_or_padding_is_faster(tmp_path):
    """ppo.sequence_packing=auto on a GPU in bfloat16: the first train step times a pass in each layout, logs both and
    keeps the faster; a later step on the same lengths measures nothing."""
    import random

    from transformers import AutoModelForCausalLM

    from tests.test_learner import mixed_length_batch

    config = config_for(tmp_path, dtype="bfloat16")
    trajectories = mixed_length_batch(AutoModelForCausalLM.from_pretrained(config.model.path), random.Random(0))
    trainer = PolicyTrainer(config, Ranks(), config.model.path)
    assert trainer.measures_layout
    stats = trainer.train_step(trajectories)
    packed, padded = stats["layout/packed_seconds"], stats["layout/padded_seconds"]
    assert 0 < min(packed, padded) and trainer.packed == (packed <= padded)
    assert "layout/packed_seconds" not in trainer.train_step(trajectories)


def test_the_warm_start_trains_on_the_gpu_and_saves_a_model_the_cpu_loads(tmp_path):
    """Where there is a GPU the tiny model's warm start runs there (the long-answer task's takes about 2 hours on
    2 CPU cores); the model it saves loads on the CPU and answers what it was taught."""
    from transformers import AutoModelForCausalLM

    from experiments.common import ModelConfig
    from rlsys.data.arithmetic import generate_addition_dataset
    from rlsys.data.dataset import load_rows
    from rlsys.model.tiny import greedy_accuracy, prepare_tiny_model
    from rlsys.model.warm_start_examples import arithmetic_warm_start
    from rlsys.model.tokenizer import build_char_tokenizer

    train, _ = generate_addition_dataset(tmp_path / "data", 1, 200, 50)
    rows = [{**row, "answer": "7"} for row in load_rows(train)]  # one answer for every prompt: learnt in steps
    lines = []
    examples = lambda tokenizer: arithmetic_warm_start(tokenizer, rows, rows[:50])  # noqa: E731
    cfg = ModelConfig(warm_start_accuracy=0.9, cache_dir=str(tmp_path))
    directory = prepare_tiny_model(cfg, 1, examples, tmp_path / "model", log=lines.append, eval_every=10,
                                   max_steps=200)
    assert "on the CUDA" in lines[0] and "reached" in lines[-1]
    model = AutoModelForCausalLM.from_pretrained(directory)
    assert model.device.type == "cpu"
    tokenizer = build_char_tokenizer()
    assert greedy_accuracy(model, tokenizer, examples(tokenizer)[1]) >= 0.9


def test_the_checksum_on_the_gpu_is_a_graph_replayed_that_gives_the_cpus_digest():
    """The checksum's graph (rlsys/weight_checksum.py) against the CPU's eager checksum of the same bytes, cast or
    not, captured once while the tensors stay where they are and reading their values anew at each replay."""
    from rlsys import weight_checksum

    generator = torch.Generator().manual_seed(0)
    cpu = {"embed": torch.randn(96, 32, generator=generator), "norm": torch.randn(32, generator=generator),
           "odd": torch.randn(7, generator=generator).bfloat16(), "steps": torch.arange(5)}
    gpu = {name: t.cuda() for name, t in cpu.items()}
    weight_checksum._graphs.clear()
    for _ in range(2):
        for dtype in (None, "bfloat16"):
            assert weights_checksum(gpu, dtype) == weights_checksum(cpu, dtype)
    assert len(weight_checksum._graphs) == 2
    for tensors in (cpu, gpu):
        tensors["embed"][3, 5] += 1.0
    assert weights_checksum(gpu) == weights_checksum(cpu) and len(weight_checksum._graphs) == 2


def test_float32_attention_with_grouped_heads_takes_a_fused_kernel_not_sdpas_math_path(tmp_path):
    """A float32 learner pads its rows (ppo.sequence_packing=auto) and attends with plain causal sdpa: the key/value
    heads, fewer than the query's, are repeated for the memory-efficient kernel, which takes no groups."""
    import random

    from transformers import AutoModelForCausalLM

    from tests.test_learner import mixed_length_batch

    config = config_for(tmp_path)
    trajectories = mixed_length_batch(AutoModelForCausalLM.from_pretrained(config.model.path), random.Random(0))
    trainer = PolicyTrainer(config, Ranks(), config.model.path)
    assert trainer.model.config.num_key_value_heads < trainer.model.config.num_attention_heads
    assert not trainer.packed
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        trainer.train_step(trajectories)
    names = {e.name for e in profile.events()}
    assert "aten::_scaled_dot_product_attention_math" not in names
    assert "aten::_scaled_dot_product_efficient_attention" in names


def test_a_gpu_step_synchronises_as_often_however_many_updates_it_takes(tmp_path):
    """An update's figures and whether it was taken stay on the GPU until the train step reads them once (settle):
    four updates a step wait for the GPU no more often than one."""
    import random

    from transformers import AutoModelForCausalLM

    from tests.test_learner import mixed_length_batch

    config = config_for(tmp_path)
    trajectories = mixed_length_batch(AutoModelForCausalLM.from_pretrained(config.model.path), random.Random(0))
    waits = []
    for epochs, mini_batches in ((1, 1), (2, 2)):
        config.ppo.ppo_epochs, config.ppo.num_mini_batches = epochs, mini_batches
        trainer = PolicyTrainer(config, Ranks(), config.model.path)
        waits.append(waits_of_a_step(trainer, trajectories))
    assert waits[1] <= waits[0], waits


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_engine_graphs_masked_grouped_query_attention_takes_a_fused_kernel(dtype):
    """The transformers engine's decode and prefill graphs attend with a mask over fewer key/value heads than query
    heads: stacked along the queries (decode_graphs.grouped_query_attention), no sdpa math path, sdpa's values."""
    from rlsys.engine.decode_graphs import grouped_query_attention

    generator = torch.Generator().manual_seed(0)
    query = torch.randn(8, 4, 1, 64, generator=generator).to("cuda", dtype)
    key, value = (torch.randn(8, 2, 96, 64, generator=generator).to("cuda", dtype) for _ in range(2))
    attend = torch.rand(8, 1, 1, 96, generator=generator).cuda() > 0.3
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        out = grouped_query_attention(query, key, value, attend, 0.125)
    assert "aten::_scaled_dot_product_attention_math" not in {e.name for e in profile.events()}
    expected = torch.nn.functional.scaled_dot_product_attention(query.float(), key.float(), value.float(),
                                                                attn_mask=attend, scale=0.125, enable_gqa=True)
    torch.testing.assert_close(out.float(), expected, atol=2e-2 if dtype == torch.bfloat16 else 1e-5, rtol=1e-2)
