"""The vLLM engine's start on a CPU, in a process of its own as the inference worker has it."""

import json
import os
import subprocess
import sys

from tests.helpers import save_random_tiny_model

GENERATE = """
import sys
from experiments.common import InferenceConfig
from rlsys.api import GenerationConfig
from rlsys.engine.generation import GenerationEngine
from rlsys.engine.vllm_engine import VLLMBackend

engine = GenerationEngine(VLLMBackend(sys.argv[1], InferenceConfig(), seed=0))
replies = engine.generate([("greedy", [4, 7, 8], GenerationConfig(n=2, max_new_tokens=4, temperature=0.0)),
                           ("sampled", [4, 7, 9], GenerationConfig(n=2, max_new_tokens=4, seed=1))])
print([[len(ids) for ids in reply.output_ids] for reply in replies])
"""


def test_the_engine_on_a_cpu_compiles_nothing_to_start_and_generate(tmp_path):
    """Eager (the default), vLLM compiles nothing of the model, but its sampler's torch.compile'd functions were built
    by inductor, C++ compiled on the CPU, at the first step: most of the inference worker's start on a fresh machine
    (BENCHMARKS.md, "Start-up"). With a fresh inductor cache, a greedy and a sampled generation leave it empty."""
    model_path = save_random_tiny_model(tmp_path / "model")
    cache = tmp_path / "inductor"
    done = subprocess.run([sys.executable, "-c", GENERATE, str(model_path)], capture_output=True, text=True,
                          timeout=300, env={**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(cache),
                                            "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr[-3000:]
    lengths = json.loads(done.stdout.strip().splitlines()[-1])  # tokens of each sample: 4, or fewer up to an EOS
    assert len(lengths) == 2 and all(len(samples) == 2 and all(1 <= n <= 4 for n in samples) for samples in lengths)
    assert not cache.exists() or not any(cache.rglob("*")), sorted(cache.rglob("*"))[:5]
