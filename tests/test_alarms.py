"""Correctness alarms: the weight checksum after a sync, logprob agreement between inference and learner,
token-prefix continuity of multi-turn episodes, and truncated importance sampling."""

import asyncio
import hashlib
import logging

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from experiments.common import InferenceConfig
from rlsys import cuda_graphs, protocol, weight_checksum
from rlsys.alarms import LogprobCheck, check_logprob_mismatch
from rlsys.token_continuity import PrefixCheck
from rlsys.algorithms.importance import truncated_importance_weights
from rlsys.api import GenerationConfig, GenerationOutput
from rlsys.bus import InProcessBus
from rlsys.engine.generation import GenerationEngine
from rlsys.engine.transformers_engine import TransformersBackend
from rlsys.engine.weights import WEIGHTS_FILE, write_weight_update
from rlsys.impl.agent.model_client import ModelClient
from rlsys.errors import RunCannotGoOn
from rlsys.weight_checksum import WeightChecksumMismatch, weights_checksum
from rlsys.workers.inference_worker import InferenceWorker
from rlsys.workers.learner import Learner
from tests.helpers import ReplayEagerly, save_random_tiny_model
from tests.test_learner import BAD, GOOD, PROMPT, learner_config, trajectory


def publish(bus, model, directory, version, dtype="float32") -> None:
    """What the learner publishes: the file, and the checksum of the weights it trained."""
    write_weight_update(model, directory)
    bus.set(protocol.WEIGHTS, {"version": version, "path": str(directory), "dtype": dtype,
                               "checksum": weights_checksum(model.state_dict(), dtype)})


def test_inference_worker_that_loads_other_weights_than_published_stops_the_run(tmp_path):
    from transformers import AutoModelForCausalLM

    path = save_random_tiny_model(tmp_path / "model")
    model = AutoModelForCausalLM.from_pretrained(path)
    bus = InProcessBus()
    worker = InferenceWorker(GenerationEngine(TransformersBackend(str(path), InferenceConfig(engine="transformers"),
                                                                  0)),
                             bus, 3, max_batch_requests=8)
    with torch.no_grad():
        next(model.parameters()).add_(0.01)
    publish(bus, model, tmp_path / "weights" / "v1", 1)
    worker.load_newest_weights()  # the same weights: verified and counted
    assert worker.engine.version == 1 and bus.get(protocol.WEIGHT_CHECKS) == 1

    with torch.no_grad():
        next(model.parameters()).add_(0.01)
    publish(bus, model, tmp_path / "weights" / "v2", 2)
    file = tmp_path / "weights" / "v2" / WEIGHTS_FILE
    tensors = load_file(file)
    name = sorted(tensors)[-1]
    tensors[name][0] += 1e-3  # one tensor changed on its way to the engine
    save_file(tensors, file)
    with pytest.raises(WeightChecksumMismatch, match="inference worker 3 loaded version 2") as raised:
        worker.load_newest_weights()
    assert isinstance(raised.value, RunCannotGoOn) and raised.value.version == 2
    assert bus.get(protocol.WEIGHT_CHECKS) == 1


def test_checksum_sees_names_shapes_dtypes_and_single_bits():
    tensors = {"a": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(4)}
    reference = weights_checksum(tensors)
    assert weights_checksum(dict(reversed(tensors.items()))) == reference  # order of the dict does not matter
    changed = {**tensors, "b": tensors["b"].clone()}
    changed["b"].view(torch.int32)[2] ^= 1  # one bit of one value
    assert weights_checksum(changed) != reference
    assert weights_checksum({**tensors, "a": tensors["a"].reshape(3, 2)}) != reference
    assert weights_checksum({"c": tensors["a"], "b": tensors["b"]}) != reference
    assert weights_checksum(tensors, "bfloat16") == weights_checksum({k: v.bfloat16() for k, v in tensors.items()})
    assert weights_checksum(tensors, "bfloat16") != reference


def test_checksum_sees_swapped_rows_and_columns_a_transpose_and_a_bit_of_an_odd_length_tensor():
    square = torch.randn(4, 4)
    reference = weights_checksum({"w": square})
    for moved in (square[[1, 0, 2, 3]], square[:, [1, 0, 2, 3]], square.t()):
        assert weights_checksum({"w": moved}) != reference
    odd = torch.randn(7).bfloat16()  # rows of 14 bytes: read as 16-bit words
    flipped = odd.clone()
    flipped.view(torch.int16)[6] ^= 1
    assert weights_checksum({"o": odd}) != weights_checksum({"o": flipped})
    assert weights_checksum({"e": torch.zeros(0, 3)}) != weights_checksum({"e": torch.zeros(3, 0)})


def wrapped(value: int, bits: int) -> int:
    """`value` as a signed `bits`-bit integer, wrapped around."""
    return (value + (1 << bits - 1)) % (1 << bits) - (1 << bits - 1)


def checksum_of_each_alone(tensors: dict[str, torch.Tensor]) -> str:
    """rlsys/weight_checksum.py's definition, one tensor at a time in plain Python integers."""
    parts = []
    for name in sorted(tensors):
        t = tensors[name].contiguous()
        rows = t.shape[0] if t.dim() >= 2 else 1
        row_bytes = t.numel() * t.element_size() // rows if t.numel() else 0
        width = next(w for w in (8, 4, 2, 1) if row_bytes % w == 0)
        raw = t.reshape(-1).view(torch.uint8).tolist() if t.numel() else []
        words = [int.from_bytes(bytes(raw[i:i + width]), "little", signed=width > 1) for i in range(0, len(raw), width)]
        per_row = len(words) // rows if rows else 0
        bits = 32 if width == 4 else 64  # 32-bit words are summed in 32 bits within a row or column
        row_sums = [wrapped(sum(words[r * per_row:(r + 1) * per_row]), bits) for r in range(rows)]
        column_sums = [wrapped(sum(words[c::per_row]), bits) for c in range(per_row)] if per_row else []
        sums = [sum(row_sums), sum((r + 1) * v for r, v in enumerate(row_sums)),
                sum((c + 1) * v for c, v in enumerate(column_sums))]
        parts.append((name, f"{t.dtype}|{tuple(t.shape)}", [wrapped(v, 64) for v in sums]))
    digest = hashlib.blake2b("\n".join(f"{name}|{label}" for name, label, _ in parts).encode(), digest_size=16)
    if parts:
        digest.update(np.array([sums for _, _, sums in parts], dtype=np.int64).tobytes())
    return digest.hexdigest()


def test_tensors_read_together_by_shape_give_each_ones_sums_under_its_own_name():
    generator = torch.Generator().manual_seed(0)
    kinds = (("q", (8, 8), torch.bfloat16), ("k", (4, 8), torch.float32), ("norm", (7,), torch.bfloat16),
             ("bias", (), torch.float32))
    tensors = {f"layer{i}.{kind}": torch.randn(shape, generator=generator).to(dtype)
               for i in range(3) for kind, shape, dtype in kinds}
    tensors.update(empty=torch.zeros(0, 3), steps=torch.arange(5), mask=torch.tensor([True, False, True]))
    reference = weights_checksum(tensors)
    assert reference == checksum_of_each_alone(tensors)
    swapped = {**tensors, "layer0.q": tensors["layer2.q"], "layer2.q": tensors["layer0.q"]}  # one shape, two names
    assert weights_checksum(swapped) == checksum_of_each_alone(swapped) != reference
    parts = weight_checksum.ChecksumParts()  # as a transfer adds them: a tied second name read once
    for name, t in tensors.items():
        parts.add(name, t)
    parts.alias("head", "layer1.k")
    assert parts.digest() == weights_checksum({**tensors, "head": tensors["layer1.k"]})


def test_on_a_gpu_the_checksum_is_a_graph_captured_once_per_set_of_tensors_and_replayed(monkeypatch):
    """The graph path on the CPU (each graph replayed eagerly): the same digests, one capture for as long as the
    tensors stay where they are (changed in place, they are read anew), another for another cast or set."""
    generator = torch.Generator().manual_seed(0)
    tensors = {"a": torch.randn(6, 4, generator=generator), "b": torch.randn(5, generator=generator).bfloat16(),
               "c": torch.randn(4, 6, generator=generator), "empty": torch.zeros(0, 3), "steps": torch.arange(3)}
    eager = {dtype: weights_checksum(tensors, dtype) for dtype in (None, "bfloat16")}
    captures = []

    class CountedCapture(ReplayEagerly):
        def __call__(self, fn):
            captures.append(fn)
            return fn

    monkeypatch.setitem(cuda_graphs.GRAPH_CAPTURE, "cpu", CountedCapture)
    monkeypatch.setattr(weight_checksum, "_graphs", {})
    assert [weights_checksum(dict(tensors)) for _ in range(3)] == [eager[None]] * 3
    assert weights_checksum(tensors, "bfloat16") == eager["bfloat16"]
    assert len(captures) == 2
    tensors["a"][2, 1] += 1.0  # in place: the same addresses, read again
    changed = weights_checksum(tensors)
    assert changed not in eager.values() and len(captures) == 2
    tensors["c"] = tensors["c"].clone()  # elsewhere: captured anew, the oldest graph let go
    assert weights_checksum(tensors) == changed and len(captures) == 3
    assert len(weight_checksum._graphs) == weight_checksum.MAX_GRAPHS


def test_a_checksum_whose_graph_cannot_be_captured_is_computed_eagerly_and_says_so(monkeypatch, caplog):
    """A capture that fails (an operation a CUDA graph cannot hold, on some GPU) costs the checksum its graph, not
    the run: the same digest, computed eagerly, one warning, no capture tried again on that device."""
    tensors = {"a": torch.randn(6, 4), "b": torch.arange(5)}
    eager = weights_checksum(tensors)
    tries = []

    class FailingCapture(ReplayEagerly):
        def __call__(self, fn):
            tries.append(fn)
            raise RuntimeError("operation not permitted when stream is capturing")

    monkeypatch.setitem(cuda_graphs.GRAPH_CAPTURE, "cpu", FailingCapture)
    monkeypatch.setattr(weight_checksum, "_graphs", {})
    monkeypatch.setattr(weight_checksum, "_eager", set())
    with caplog.at_level("WARNING", logger="rlsys.weight_checksum"):
        assert [weights_checksum(tensors) for _ in range(3)] == [eager] * 3
    assert len(tries) == 1 and not weight_checksum._graphs
    assert [r.message for r in caplog.records if "could not be captured" in r.message] == [
        "the weight checksum could not be captured as a CUDA graph on cpu (operation not permitted when stream is "
        "capturing); it runs eagerly from now on"]


@pytest.mark.parametrize("engine_dtype", ["float32", "bfloat16"])
def test_every_step_s_probe_is_scored_by_the_engine_before_it_loads_the_next_version(tmp_path, engine_dtype):
    """The learner sends one of its batch's sequences, scored by the step's first update, with the version that step
    made; a worker that holds the version the step trained from scores it before it loads the new one. The same
    weights in float32 agree to rounding; a bfloat16 engine passes the checksum (it holds exactly the bfloat16
    weights published) yet its logprobs differ, and only the probe shows it. A worker that holds another version
    (it missed one) scores nothing."""
    config = learner_config(tmp_path)
    config.inference.dtype = engine_dtype
    bus = InProcessBus()
    learner = Learner(config, bus, tmp_path / "run")
    worker = InferenceWorker(GenerationEngine(TransformersBackend(
        config.model.path, InferenceConfig(engine="transformers", dtype=engine_dtype), 0)), bus, 0, 8)
    batch = [trajectory(learner.model, answer, reward) for answer, reward in ((GOOD, 1.0), (BAD, 0.0))] * 2
    for loads, version in enumerate((1, 2, 4), start=1):
        learner.version = version - 1  # 3: published while the worker was away
        learner.train_step(batch)
        learner.version = version
        learner.publish_weights()
        worker.load_newest_weights()
        assert worker.engine.version == version and bus.get(protocol.WEIGHT_CHECKS) == loads
        stats = learner.probe_reports()
        if version == 4:
            assert stats == {}
            continue
        assert stats["alarms/probe_tokens"] == len(PROMPT) + 2
        if engine_dtype == "float32":
            assert stats["alarms/probe_abs_diff_max"] < 1e-4
        else:
            assert stats["alarms/probe_abs_diff_mean"] > 1e-4  # bfloat16 rounding, far above float32's
    assert learner.probe_reports() == {}  # each report is read once
    learner.weight_server.close()


class EchoModel:
    """Answers every request of an episode with two fixed tokens; a test double for the inference side."""

    def __init__(self, obs_queue, act_queue):
        self.obs_queue, self.act_queue = obs_queue, act_queue

    async def serve(self):
        while True:
            qid, token_ids, gconfig = await self.obs_queue.get()
            await self.act_queue.put(GenerationOutput(qid=qid, prompt_ids=token_ids, output_ids=[[7, 8]],
                                                      logprobs=[[-1.0, -1.0]], versions=[[0, 0]],
                                                      stop_reasons=["stop"]))


def test_a_turn_that_breaks_the_token_prefix_is_counted_and_warned(caplog):
    async def episode() -> int:
        obs_queue, act_queue = asyncio.Queue(), asyncio.Queue()
        server = asyncio.create_task(EchoModel(obs_queue, act_queue).serve())
        g = GenerationConfig(n=1)
        async with asyncio.timeout(60), ModelClient(obs_queue, act_queue) as model:
            await model.generate("ep-17/1", [1, 2, 3], g)
            await model.generate("ep-17/2", [1, 2, 3, 7, 8, 4, 5], g)  # history kept, feedback appended: fine
            await model.generate("ep-17/3", [1, 2, 3], g)  # another chain from the start: fine
            await model.generate("ep-17/4", [1, 2, 3, 7, 9, 4, 5], g)  # the response re-tokenized: a break
        server.cancel()
        return model.prefix.breaks, model.prefix.requests

    with caplog.at_level(logging.WARNING):
        assert asyncio.run(episode()) == (1, 4)
    (warning,) = [r for r in caplog.records if "prefix break" in r.getMessage()]
    assert "episode ep-17" in warning.getMessage() and "ep-17/4" in warning.getMessage()


def test_prefix_check_counts_every_break_of_a_longer_episode():
    check = PrefixCheck()
    check.request("e/1", [1, 2])
    check.reply([1, 2], [[3], [4]])  # two samples: either may be continued
    for qid, ids in [("e/2", [1, 2, 4, 9]), ("e/3", [1, 2, 5]), ("e/4", [2, 1, 3])]:
        check.request(qid, ids)
    assert (check.requests, check.breaks) == (4, 2)


def test_logprob_check_compares_only_tokens_of_the_learner_s_version():
    learner = torch.tensor([[-1.0, -2.0, -0.5, -3.0, 0.0]])
    fields = {"behaviour_logprobs": torch.tensor([[-1.1, -1.7, -0.5, -9.0, 0.0]]),
              "loss_mask": torch.tensor([[1.0, 1.0, 1.0, 1.0, 0.0]]), "versions": torch.tensor([[4, 4, 4, 3, -1]])}
    check = LogprobCheck(version=4)
    check.observe(learner, fields)
    check.seal()
    check.observe(learner + 5, fields)  # after an update: ignored
    stats = check.stats()
    diffs = [0.1, 0.3, 0.0]  # the version-3 token is staleness, not a mismatch
    log_r = torch.tensor([0.1, -0.3, 0.0])  # log pi_learner - log pi_inference
    assert stats["alarms/logprob_tokens"] == 3
    assert stats["alarms/logprob_abs_diff_mean"] == pytest.approx(sum(diffs) / 3, abs=1e-6)
    assert stats["alarms/logprob_abs_diff_max"] == pytest.approx(0.3, abs=1e-6)
    assert stats["alarms/logprob_kl"] == pytest.approx((log_r.exp() - 1 - log_r).mean().item(), abs=1e-6)


def test_ranks_merged_logprob_and_step_maxima_are_nan_where_one_rank_s_is_whatever_its_place():
    """One rank's check (or figure) computes the max with torch, which keeps a NaN; merged over ranks, a NaN of a
    later rank was dropped by Python's max, and the logged max was a finite one the single-rank step never reports."""
    from rlsys.training_step import StatsAccumulator

    nan = float("nan")
    parts = [[4, 0.4, 0.2, 0.01], [3, nan, nan, nan]]
    for ordered in (parts, parts[::-1]):
        merged = LogprobCheck.merged(ordered)
        assert np.isnan(merged["alarms/logprob_abs_diff_max"]) and merged["alarms/logprob_tokens"] == 7
        stats = StatsAccumulator.merge([{"importance_weight_max": p[2], "loss": p[1]} for p in ordered])
        assert np.isnan(stats["importance_weight_max"]), stats
    assert LogprobCheck.merged([[4, 0.4, 0.2, 0.01], [3, 0.9, 0.5, 0.0]])["alarms/logprob_abs_diff_max"] == 0.5
    assert StatsAccumulator.merge([{"x_max": 0.2}, {"x_max": 0.5}, {"x_max": 0.1}]) == {"x_max": 0.5}


def test_logprob_mismatch_warns_or_stops_above_the_threshold(caplog):
    stats = {"alarms/logprob_abs_diff_mean": 0.6, "alarms/logprob_abs_diff_max": 2.0, "alarms/logprob_kl": 0.3}
    with caplog.at_level(logging.WARNING):
        check_logprob_mismatch(stats, 7, warn_at=1.0, stop=True)  # under the threshold: quiet
        check_logprob_mismatch(stats, 7, warn_at=0.5, stop=False)
    assert [r.getMessage().split(":")[0] for r in caplog.records] == ["step 7"]
    with pytest.raises(RunCannotGoOn, match="stop_on_logprob_diff"):
        check_logprob_mismatch(stats, 7, warn_at=0.5, stop=True)


def test_a_negative_logprob_diff_threshold_is_refused_not_warned_at_every_step():
    """alarms.logprob_diff_warn=-0.5 was taken: every step's mean |diff| exceeds it, so the alarm warned at each."""
    from rlsys.cli import ConfigError, parse_config

    with pytest.raises(ConfigError, match=r"alarms.logprob_diff_warn must be >= 0 \(0: never warn\), got -0.5"):
        parse_config(["alarms.logprob_diff_warn=-0.5"])
    assert parse_config(["alarms.logprob_diff_warn=0"]).alarms.logprob_diff_warn == 0


@pytest.mark.parametrize("shift", [0.0, 0.4])
def test_learner_reports_the_mismatch_of_what_inference_sampled(tmp_path, shift):
    config = learner_config(tmp_path)
    learner = Learner(config, InProcessBus(), tmp_path / "run")
    # Behaviour logprobs as the learner computes them, shifted: an engine that scores every token 0.4 lower.
    stats = learner.train_step([trajectory(learner.model, GOOD, 1.0, shift),
                                trajectory(learner.model, BAD, 0.0, shift)])
    assert stats["alarms/logprob_tokens"] == len(GOOD) + len(BAD)
    assert stats["alarms/logprob_abs_diff_mean"] == pytest.approx(shift, abs=1e-4)
    assert stats["alarms/logprob_abs_diff_max"] == pytest.approx(shift, abs=1e-4)


def test_a_step_with_no_token_of_the_learner_s_version_computes_no_check(tmp_path, monkeypatch):
    """In an asynchronous run most steps train on tokens one or two versions old: their check is sealed from the start,
    so no pass computes it or gathers the tokens' versions."""
    learner = Learner(learner_config(tmp_path), InProcessBus(), tmp_path / "run")
    observed = []
    observe = LogprobCheck.observe
    monkeypatch.setattr(LogprobCheck, "observe", lambda check, *a: (observed.append(check.sealed), observe(check, *a)))
    old = [trajectory(learner.model, answer, reward, version=0) for answer, reward in ((GOOD, 1.0), (BAD, 0.0))]
    learner.version = 1
    stats = learner.train_step(old)
    assert stats["alarms/logprob_tokens"] == 0 and set(observed) == {True}
    assert "versions" not in learner.pass_fields()
    learner.version = 0
    assert learner.train_step(old)["alarms/logprob_tokens"] == len(GOOD) + len(BAD)


def test_truncated_importance_weights_match_a_plain_loop():
    torch.manual_seed(0)
    learner, inference = torch.randn(3, 7), torch.randn(3, 7)
    mask = (torch.rand(3, 7) > 0.3).float()
    weights = truncated_importance_weights(learner, inference, mask, cap=2.0)
    import math
    for i in range(3):
        for j in range(7):
            expected = min(math.exp(learner[i, j] - inference[i, j]), 2.0) if mask[i, j] else 0.0
            assert weights[i, j].item() == pytest.approx(expected, rel=1e-6)
    with pytest.raises(ValueError):
        truncated_importance_weights(learner, inference, mask, cap=1.0)


def test_tis_cap_weights_the_learner_s_loss(tmp_path):
    config = learner_config(tmp_path)
    config.ppo.tis_cap = 1.2
    learner = Learner(config, InProcessBus(), tmp_path / "run")
    # learner/inference = exp(0.5) = 1.65 on every generated token: truncated to the cap
    batch = learner.prepare_batch([trajectory(learner.model, GOOD, 1.0, 0.5), trajectory(learner.model, BAD, 0.0, 0.5)])
    plain = learner_config(tmp_path / "plain")
    reference = Learner(plain, InProcessBus(), tmp_path / "run2")
    reference.model.load_state_dict(learner.model.state_dict())
    learner.mini_batch_gradients(batch)
    reference.mini_batch_gradients(reference.prepare_batch(
        [trajectory(learner.model, GOOD, 1.0, 0.0), trajectory(learner.model, BAD, 0.0, 0.0)]))
    # At the recomputed logprobs the PPO ratio is 1 in both; every token's gradient is then times the cap.
    for (name, p), q in zip(learner.model.named_parameters(), reference.model.parameters()):
        assert torch.allclose(p.grad, 1.2 * q.grad, rtol=1e-4, atol=1e-7), name
