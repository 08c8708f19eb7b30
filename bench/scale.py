"""Scale-out costs: how long a new weight version takes from publish to being served, over disk and over the bus.

    python3 bench/scale.py [--repeats 3] [--out bench/results/scale.json]

For the tiny default model and for a randomly initialised SmolLM2-135M-shaped model (config only), a learner
publishes a version (`weight_transport.publish`: serialise, write the file or the chunks into a real private
Redis, announce it) and a vLLM engine takes it (`WeightReceiver.directory`, then the engine's in-place
reload). The time measured is from the start of publish to the moment the engine serves the new version,
both sides in this one process, so the inference worker's polling interval (0.1 s) is not in it. Disk and bus
runs alternate so that machine noise hits both alike. Learner trained tokens/s at 1 and 2 ranks come from
bench/learner_ranks.py (the tiny model's shape, 32 sequences of 10..500 tokens). The last line is the headline.
"""

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

sys.path.insert(0, str(Path(__file__).resolve().parent))

from experiments.common import InferenceConfig  # noqa: E402
from learner_ranks import learner_tokens_per_second  # noqa: E402
from learner_throughput import save_model  # noqa: E402
from rlsys import protocol  # noqa: E402
from rlsys.bus import EmbeddedRedis, connect  # noqa: E402
from rlsys.engine.generation import GenerationEngine  # noqa: E402
from rlsys.engine.vllm_engine import VLLMBackend  # noqa: E402
from rlsys.model.tokenizer import build_char_tokenizer  # noqa: E402
from rlsys.weight_transport import WeightReceiver, publish  # noqa: E402

MODELS = {  # name -> (transformers config class, its arguments)
    "tiny (2.4M)": ("Qwen2Config", dict(hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                                        num_attention_heads=4, num_key_value_heads=2)),
    "SmolLM2-135M-shaped": ("LlamaConfig", dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                                num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3)),
}


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


def publish_to_serving(bus, model, engine, receiver, version: int, transport: str, weights_dir: Path) -> float:
    started = time.perf_counter()
    publish(bus, model, version, transport, weights_dir)
    engine.update_weights(receiver.directory(bus.get(protocol.WEIGHTS)), version)
    assert engine.version == version
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", default="bench/results/scale.json")
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp) / "redis") as server, connect(server.url) as bus:
        for name, (config_class, kwargs) in MODELS.items():
            path = Path(tmp) / name.split()[0]
            model = save_random_model(path, config_class, kwargs)
            engine = GenerationEngine(VLLMBackend(str(path), InferenceConfig(), seed=0))
            receiver = WeightReceiver(bus)
            times = {"disk": [], "bus": []}
            version = 0
            for _ in range(args.repeats):
                for transport in times:
                    version += 1
                    times[transport].append(publish_to_serving(bus, model, engine, receiver, version, transport,
                                                               Path(tmp) / "weights"))
            receiver.close()
            del engine
            size_mb = sum(t.numel() * t.element_size() for t in model.state_dict().values()) / 2**20
            rows.append({"model": name, "mb": size_mb, **{f"{t}_s": statistics.median(v) for t, v in times.items()}})
        learner_model = save_model(Path(tmp) / "learner", hidden=256, layers=4)
        ranks = {n: learner_tokens_per_second(n, learner_model, repeats=args.repeats) for n in (1, 2)}
    print(f"{'model':<22} {'MB':>7} {'disk s':>8} {'bus s':>8} {'bus/disk':>9}")
    for row in rows:
        print(f"{row['model']:<22} {row['mb']:>7.1f} {row['disk_s']:>8.3f} {row['bus_s']:>8.3f} "
              f"{row['bus_s'] / row['disk_s']:>9.2f}")
    for n, rate in ranks.items():
        print(f"learner trained tokens/s at {n} rank(s): {rate:.0f}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"args": vars(args), "results": rows, "learner_tokens_per_second": ranks}, indent=2))
    big = rows[-1]
    print(f"ratio: publish-to-serving over the bus / over disk for {big['model']}: {big['bus_s'] / big['disk_s']:.2f} "
          f"({big['bus_s']:.2f} s vs {big['disk_s']:.2f} s, median of {args.repeats})")


if __name__ == "__main__":
    main()
