"""bench/role_profile.py: a py-spy raw profile's samples by role, site, math and waiting."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.role_profile import roles_of, stacks, tally  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
MAIN = "<module> (<string>:8);run_role (rlsys/roles.py:42)"
THREAD = "Thread._bootstrap (threading.py:1002);Thread.run (threading.py:982)"


def line(pid: int, frames: str, samples: int) -> str:
    # a role's command line holds newlines, as a spawned process's does
    return f'process {pid}:"python3 -c \nimport signal\nspawn_main()";{frames} {samples}\n'


PROFILE = "".join([
    line(11, f"{MAIN};Learner.run (rlsys/workers/learner.py:90);accumulate_gradients (rlsys/training_step.py:300);"
             "Tensor.backward (torch/_tensor.py:581);_engine_run_backward (torch/autograd/graph.py:825)", 80),
    line(11, f"{MAIN};Learner.run (rlsys/workers/learner.py:88);RedisBus._fetch (rlsys/bus/redis_bus.py:200);"
             "decode (msgpack/fallback.py:10)", 5),
    line(11, f"{MAIN};_run (rlsys/roles.py:70);_find_and_load (<frozen importlib._bootstrap>:1176)", 40),  # start-up
    line(11, f"{THREAD};_worker (concurrent/futures/thread.py:81)", 30),  # an idle pool thread
    line(12, f"{MAIN};InferenceWorker.run (rlsys/workers/inference_worker.py:74);"
             "VLLMBackend.load_weights (rlsys/engine/vllm_engine.py:209);reload_weights (vllm/reload/inplace.py:9)",
         10),
    line(12, f"{MAIN};InferenceWorker.run (rlsys/workers/inference_worker.py:74);VLLMBackend.step "
             "(rlsys/engine/vllm_engine.py:185);Module._call_impl (torch/nn/modules/module.py:1762)", 30),
    line(13, f"{MAIN};run_to_the_end (rlsys/cancellation.py:20);RolloutWorker.admit "
             "(rlsys/workers/rollout_worker.py:238)", 4),
    # the trace writer's thread, blocked in its SimpleQueue's get: a C call, so no frame below its own line
    line(13, f"{THREAD};TraceWriter._write (rlsys/tracing.py:110)", 50),
    line(14, "main (launcher.py:3)", 7),  # no role's loop: not a role
])


def test_samples_by_role_site_math_and_waiting(tmp_path):
    profile = tmp_path / "run.txt"
    profile.write_text(PROFILE)
    records = list(stacks(profile))
    roles = roles_of(records)
    assert roles == {"11": "learner", "12": "inference", "13": "rollout"}
    sites, totals, waits = tally(records, roles, ROOT)
    assert totals == {"learner": 85, "inference": 40, "rollout": 4}  # the start-up import left out
    assert waits == {"learner": 30, "rollout": 50}  # the pool thread and the trace writer's queue
    assert sites["learner"]["accumulate_gradients (rlsys/training_step.py)"] == [80, 80]
    assert sites["learner"]["RedisBus._fetch (rlsys/bus/redis_bus.py)"] == [5, 0]
    assert sites["inference"]["VLLMBackend.load_weights (rlsys/engine/vllm_engine.py)"] == [10, 0]
    assert sites["inference"]["VLLMBackend.step (rlsys/engine/vllm_engine.py)"] == [30, 30]
    assert sites["rollout"]["RolloutWorker.admit (rlsys/workers/rollout_worker.py)"] == [4, 0]
