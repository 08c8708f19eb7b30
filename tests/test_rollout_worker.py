"""The rollout worker's start: it reads its datasets while the engines start, not after."""

import asyncio
import json

from experiments import AsyncPPOMATHConfig
from rlsys.bus import InProcessBus
from rlsys.impl.env.math_verifier import close_shared_pool
from rlsys.workers.rollout_worker import RolloutWorker
from tests.helpers import save_random_tiny_model


def write_rows(path, answers):
    path.write_text("".join(json.dumps({"prompt": f"{a}+0=", "answer": str(a)}) + "\n" for a in answers))
    return str(path)


def test_the_datasets_are_read_while_no_inference_worker_is_up(tmp_path):
    """Reading a dataset takes about a second (Hugging Face datasets' import and load): done while vLLM starts, the
    first episodes need not wait for it (BENCHMARKS.md, "Start-up")."""
    config = AsyncPPOMATHConfig()
    config.model.path = str(save_random_tiny_model(tmp_path / "model"))
    config.logging_dir = str(tmp_path / "logs")
    config.dataset.path = write_rows(tmp_path / "train.jsonl", [1, 2, 3])
    config.dataset.eval_path = write_rows(tmp_path / "eval.jsonl", [4, 5])
    worker = RolloutWorker(config, InProcessBus(), 0)

    async def start_without_engines():
        running = asyncio.create_task(worker.run())  # no inference worker will ever be live
        try:
            for _ in range(600):
                if worker.eval_rows or running.done():
                    break
                await asyncio.sleep(0.05)
            assert not running.done()  # still waiting for an engine
        finally:
            running.cancel()
            await asyncio.gather(running, return_exceptions=True)

    try:
        asyncio.run(start_without_engines())
    finally:
        close_shared_pool()
    assert [row["answer"] for row in worker.train_rows] == ["1", "2", "3"]
    assert [row["answer"] for row in worker.eval_rows] == ["4", "5"]
