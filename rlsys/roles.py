"""What a role process runs: the entry each process (or Ray actor) of a run starts in, and the role it becomes.

The launcher plans a run and places its roles (rlsys/placement); each placed process calls `run_role`, which turns
the payload back into the config, sends the process's output to its log file, limits its threads and runs the
learner, an inference worker or a rollout worker until it ends.
"""

import contextlib
import ctypes
import gc
import logging
import os
import sys
from pathlib import Path

from rlsys import protocol
from rlsys.bus import connect
from rlsys.cli import config_from_dict
from rlsys.console import role_output_to_file
from rlsys.errors import RunCannotGoOn
from rlsys.placement.cpu_threads import role_threads
from rlsys.run_files import role_log
from rlsys.run_privacy import PRIVATE_UMASK
from rlsys.supervisor import CANNOT_GO_ON_EXIT

log = logging.getLogger("rlsys")


def run_role(role: str, index: int, payload: dict, bus_url: str, run_dir: str, env: dict) -> int:
    """What every role runs, in a process of its own or a Ray actor (rlsys.placement); returns its exit code."""
    gc.disable()  # until the role is built: freeze_start_up_heap
    os.environ.update(env)  # its GPUs and, for learner ranks, the rendezvous
    os.umask(PRIVATE_UMASK)  # what a role writes (logs, weights, checkpoints) is its user's alone
    name = protocol.role_name(role, index)
    _name_process(name)
    import rlsys.impl.agent  # noqa: F401  (registers the built-in agents and environments)
    import rlsys.impl.env  # noqa: F401
    config = config_from_dict(payload)
    role_output_to_file(role_log(config.logging_dir, name), name)
    limit_threads(role_threads(role, config), role)
    bus = connect(bus_url)
    try:
        _run(role, index, config, bus, run_dir)
    except RunCannotGoOn as e:
        log.error("%s: the run cannot go on: %s", name, e)
        bus.set(protocol.role_stop_reason(name), str(e))
        return CANNOT_GO_ON_EXIT
    finally:
        bus.close()
    return 0


def limit_threads(n: int, role: str = "") -> None:
    """Before any engine or model is built: roles share the machine's cores, and more threads than cores only
    contend. 0 leaves the choice to the engine. A rollout worker runs no torch of its own and does not import it (a
    second of CPU while the other roles start): a plugin of its that does (a reward model) starts with the limit,
    since torch reads OMP_NUM_THREADS when it loads."""
    if not n:
        return
    if role == "rollout" and "torch" not in sys.modules:
        os.environ["OMP_NUM_THREADS"] = str(n)
        return
    import torch

    torch.set_num_threads(n)


def _run(role: str, index: int, config, bus, run_dir: str) -> None:
    if role == "learner":
        from rlsys.distributed import join_ranks, leave_ranks
        from rlsys.workers.learner import Learner, serve_until_stopped

        ranks = join_ranks(index, config.cluster.n_learner_ranks)
        try:
            learner = Learner(config, bus, Path(run_dir), ranks)
            freeze_start_up_heap()
            learner.run()
        except BaseException:
            leave_ranks(ranks, finished=False)
            raise
        server = learner.weight_server
        del learner  # its sharded tensors hold the group, which leave_ranks can end only once they are gone
        leave_ranks(ranks)
        serve_until_stopped(bus, server)  # outside the group: the other ranks need not wait at its barrier
    elif role == "inference":
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # keep the console for the run's own progress
        from rlsys.engine.generation import GenerationEngine
        from rlsys.workers.inference_worker import InferenceWorker

        engine = GenerationEngine(make_backend(config.model.path, config.inference, config.seed + index))
        freeze_start_up_heap()
        try:
            InferenceWorker(engine, bus, index, config.inference.max_batch_requests).run()
        finally:
            engine.backend.close()
    elif role == "rollout":
        from rlsys.cancellation import run_to_the_end
        from rlsys.stop_grace import LOOP_END_SHARE
        from rlsys.workers.rollout_worker import RolloutWorker

        worker = RolloutWorker(config, bus, index, Path(run_dir))
        freeze_start_up_heap()
        # not asyncio.run: an episode left behind would keep the process from exiting
        run_to_the_end(worker.run(), config.cluster.stop_grace_seconds * LOOP_END_SHARE)


def freeze_start_up_heap() -> None:
    """Once a role is built, with Python's collector paused since the role began: what it built, frozen out of every
    later collection, and the collector back on.

    A role's imports, model and engine are hundreds of thousands of objects that live as long as the process, and
    nearly no garbage. Python runs a full collection each time its heap has grown by a quarter, each a walk over all
    of it: ten or more in each role's start-up, seconds of CPU on the cores the roles share (BENCHMARKS.md, "Start-up:
    the collector"). Frozen, that heap is skipped by the collections that come later."""
    gc.collect()  # the build's garbage goes now, so the freeze keeps none of it
    gc.freeze()
    gc.enable()


def make_backend(model_path: str, inference_cfg, seed: int):
    """The generation backend `inference.engine` names."""
    if inference_cfg.engine == "transformers":
        from rlsys.engine.transformers_engine import TransformersBackend

        return TransformersBackend(model_path, inference_cfg, seed)
    from rlsys.engine.vllm_engine import VLLMBackend

    return VLLMBackend(model_path, inference_cfg, seed)


def _name_process(name: str) -> None:
    """Linux: `ps`, `top` and psutil show the role (e.g. inference0) instead of `python`."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # 15 = PR_SET_NAME
