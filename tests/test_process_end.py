"""A role process's end (rlsys/placement/process_end.py): Python's own exit where nothing holds it, an exit
without the threads a plugin left blocked where something does; and the same end for a role a Ray actor runs, whose
process the launcher kills once the role's run returned."""

import atexit
import functools
import logging
import multiprocessing
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from rlsys.placement.local import run_in_process


def run_role_process(entry, tmp_path) -> int:
    context = multiprocessing.get_context("spawn")
    launcher_terminated = context.Value("b", 0)  # held until the child has it
    process = context.Process(target=run_in_process, args=(entry, "rollout", 0, tmp_path),
                              kwargs={"launcher_terminated": launcher_terminated, "grace": 20.0})
    process.start()
    process.join(timeout=120)
    if process.is_alive():
        process.kill()
        process.join()
        raise AssertionError("the role's process did not exit")
    return process.exitcode


@pytest.fixture(scope="module", params=["local", pytest.param("ray", marks=pytest.mark.distributed)])
def run_as_role(request):
    """Runs `entry(role, index, tmp_path, ...)` as a role of the placement, and returns its exit code."""
    if request.param == "local":
        yield run_role_process
        return
    from ray import cloudpickle

    from rlsys.cli import parse_config
    from rlsys.placement.ray_actors import RayPlacement

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import the tests
    placement = RayPlacement(parse_config(["cluster.backend=ray"]), None)

    def run_role_actor(entry, tmp_path) -> int:
        placement.entry = entry
        role = placement.start("rollout", 0, (tmp_path,))
        role.join(120)
        assert role.exitcode is not None, "the role's run did not return"
        return role.exitcode

    try:
        yield run_role_actor
    finally:
        placement.close()
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])


def write(path, line: str) -> None:
    with open(path, "a") as f:
        f.write(line + "\n")


def end_as_plugins_leave_it(role: str, index: int, tmp_path, *env) -> int:
    """A role that leaves a thread finishing its work, an exit handler that expects it to have finished, an idle
    pool's thread (its pool shut down by an exit handler) and a handler it unregistered again (a plugin closed): all
    of it Python's exit ends in its own order."""
    logging.basicConfig(filename=tmp_path / "role.log", level=logging.INFO, force=True)
    order = tmp_path / "order"
    pool = ThreadPoolExecutor(1)
    pool.submit(int).result()
    atexit.register(pool.shutdown)
    threading.Thread(target=lambda: (time.sleep(0.5), write(order, "thread"))).start()
    atexit.register(write, order, "exit handler")
    closed = functools.partial(write, order, "the handler of a plugin closed before")
    atexit.register(closed)
    atexit.unregister(closed)
    return 0


def test_a_role_whose_threads_end_exits_as_python_does(run_as_role, tmp_path):
    """Python's exit joins the threads, then runs the exit handlers: the process end ran the handlers first (one
    that expects the threads' work done did not find it), and took a pool's idle thread, which Python's own exit
    ends, for a thread left behind (5 s more, and an error in the log). Under Ray the actor's process was killed
    once the run returned: the handlers never ran."""
    assert run_as_role(end_as_plugins_leave_it, tmp_path) == 0
    assert (tmp_path / "order").read_text().splitlines() == ["thread", "exit handler"]
    log = (tmp_path / "role.log").read_text() if (tmp_path / "role.log").exists() else ""
    assert "left behind" not in log, log


def end_with_a_thread_blocked_for_ever(role: str, index: int, tmp_path, *env) -> int:
    logging.basicConfig(filename=tmp_path / "role.log", level=logging.INFO, force=True)
    threading.Thread(target=threading.Event().wait, name="blocked-for-ever").start()
    atexit.register((tmp_path / "closed").touch)  # a plugin's close at exit
    return 3


def test_a_role_whose_thread_never_ends_exits_with_its_code_once_its_exit_handlers_ran(run_as_role, tmp_path):
    """Under Ray the thread was killed with the actor's process, unlogged, and the plugin's close never ran."""
    assert run_as_role(end_with_a_thread_blocked_for_ever, tmp_path) == 3
    assert (tmp_path / "closed").exists()
    log = (tmp_path / "role.log").read_text()
    assert "1 threads still run 5 s after the role ended" in log and "blocked-for-ever:" in log, log


def raise_once_a_plugin_started(role: str, index: int, tmp_path, *env) -> int:
    atexit.register((tmp_path / "closed").touch)
    raise RuntimeError("the role failed")


def test_a_role_that_raises_runs_its_exit_handlers(run_as_role, tmp_path):
    assert run_as_role(raise_once_a_plugin_started, tmp_path) != 0
    assert (tmp_path / "closed").exists()
