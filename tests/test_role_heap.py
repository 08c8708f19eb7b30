"""A role's start-up heap: Python's collector paused while the role builds itself, and what it built frozen out of
later collections before its loop runs (rlsys/roles.py, `freeze_start_up_heap`)."""

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from experiments import AsyncPPOMATHConfig
from rlsys.cli import config_to_dict
from tests.helpers import save_random_tiny_model

ROOT = Path(__file__).resolve().parents[1]


def in_a_fresh_interpreter(code: str, tmp_path) -> dict:
    """Runs `code`, which writes a JSON object to the file `out`; a role takes over its process (umask, output,
    collector), so it runs in one of its own."""
    out = tmp_path / "seen.json"
    done = subprocess.run([sys.executable, "-c", f"out = {str(out)!r}\n" + textwrap.dedent(code)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


def test_the_built_heap_is_frozen_without_the_builds_garbage(tmp_path):
    seen = in_a_fresh_interpreter("""
        import gc, json, weakref
        gc.disable()
        import torch  # a heap as large as a role's imports make

        class Node:
            pass

        loop = Node()
        loop.me = loop  # garbage only a collection frees
        left_over = weakref.ref(loop)
        del loop
        from rlsys.roles import freeze_start_up_heap

        freeze_start_up_heap()
        json.dump({"collector_on": gc.isenabled(), "garbage_kept": left_over() is not None,
                   "frozen": gc.get_freeze_count(), "walked_by_a_collection": len(gc.get_objects())}, open(out, "w"))
    """, tmp_path)
    assert seen["collector_on"]
    assert not seen["garbage_kept"]
    assert seen["frozen"] > 100_000
    assert seen["walked_by_a_collection"] < seen["frozen"] / 20


@pytest.mark.parametrize("role,loop", [
    ("rollout", "rlsys.workers.rollout_worker:RolloutWorker.run"),
    ("learner", "rlsys.workers.learner:Learner.run"),
    ("inference", "rlsys.workers.inference_worker:InferenceWorker.run"),
])
def test_each_role_runs_its_loop_with_its_build_frozen_and_the_collector_on(role, loop, tmp_path):
    config = AsyncPPOMATHConfig()
    config.model.path = str(save_random_tiny_model(tmp_path / "model"))
    config.inference.engine = "transformers"  # the same path as vLLM's, in a second
    config.logging_dir = str(tmp_path / "logs")
    module, attribute = loop.split(":")
    owner, method = attribute.split(".")
    seen = in_a_fresh_interpreter(f"""
        import gc, importlib, inspect, json
        import rlsys.roles

        def record(*args, **kwargs):
            json.dump({{"collector_on": gc.isenabled(), "frozen": gc.get_freeze_count()}}, open(out, "w"))
            raise SystemExit(0)

        async def record_async(*args, **kwargs):
            record()

        owner = getattr(importlib.import_module({module!r}), {owner!r})
        replacement = record_async if inspect.iscoroutinefunction(getattr(owner, {method!r})) else record
        setattr(owner, {method!r}, replacement)
        rlsys.roles.run_role({role!r}, 0, {config_to_dict(config)!r}, "inproc://heap", {str(tmp_path)!r}, {{}})
    """, tmp_path)
    assert seen["collector_on"]
    assert seen["frozen"] > 10_000  # the role's modules at least (none are frozen unless the role froze them)


def test_the_rollout_worker_freezes_what_reading_its_datasets_imported(tmp_path):
    """The rollout worker reads its datasets after its build is frozen, beside the engines' start; what that
    imports (Hugging Face datasets and pyarrow for a Parquet file: over 100k objects) lives as long as the role, and
    is frozen too before the first episode, so the full collections of the run do not walk it each time."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = tmp_path / "rows.parquet"  # read with datasets (a JSON file is read by Python alone, importing little)
    pq.write_table(pa.Table.from_pylist([{"prompt": f"{i}+1=", "answer": str(i + 1)} for i in range(20)]), rows)
    config = AsyncPPOMATHConfig()
    config.model.path = str(save_random_tiny_model(tmp_path / "model"))
    config.dataset.path = config.dataset.eval_path = str(rows)
    config.logging_dir = str(tmp_path / "logs")
    seen = in_a_fresh_interpreter(f"""
        import gc, json, sys
        import rlsys.roles
        from rlsys.workers import rollout_worker, routing

        async def up(*args, **kwargs):
            pass

        async def record(worker, *tag_and_label):  # the initial evaluation: the first thing after the datasets are read
            json.dump({{"rows": len(worker.train_rows), "datasets_imported": "datasets" in sys.modules,
                        "walked_by_a_collection": len(gc.get_objects())}}, open(out, "w"))
            raise SystemExit(0)

        routing.EpisodeRouter.live_worker = up
        rollout_worker.RolloutWorker.warm_up_environments = up
        rollout_worker.RolloutWorker.evaluate = record
        rlsys.roles.run_role("rollout", 0, {config_to_dict(config)!r}, "inproc://heap", {str(tmp_path)!r}, {{}})
    """, tmp_path)
    assert seen["rows"] == 20 and seen["datasets_imported"]
    assert seen["walked_by_a_collection"] < 10_000  # 7 here; 64,016 when the datasets' objects were left unfrozen
