"""A role process's end (rlsys/placement/process_end.py): Python's own exit where nothing holds it, an exit
without the threads a plugin left blocked where something does."""

import atexit
import logging
import multiprocessing
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from rlsys.placement.local import run_in_process

IDLE = ThreadPoolExecutor(1)  # a module's pool, never shut down: Python's exit ends its idle threads


def end_as_plugins_leave_it(role: str, index: int, tmp_path) -> int:
    """A role that leaves a thread finishing its work, an exit handler that expects it to have finished, and an
    idle pool's thread: all of it Python's exit ends in its own order."""
    logging.basicConfig(filename=tmp_path / "role.log", level=logging.INFO, force=True)
    order = tmp_path / "order"

    def finishing():
        time.sleep(0.5)
        with open(order, "a") as f:
            f.write("thread\n")

    def exit_handler():
        with open(order, "a") as f:
            f.write("exit handler\n")

    IDLE.submit(int).result()
    threading.Thread(target=finishing).start()
    atexit.register(exit_handler)
    return 0


def run_role_process(entry, tmp_path) -> multiprocessing.Process:
    context = multiprocessing.get_context("spawn")
    launcher_terminated = context.Value("b", 0)  # held until the child has it
    process = context.Process(target=run_in_process, args=(entry, "rollout", 0, tmp_path),
                              kwargs={"launcher_terminated": launcher_terminated})
    process.start()
    process.join(timeout=120)
    if process.is_alive():
        process.kill()
        process.join()
        raise AssertionError("the role's process did not exit")
    return process


def test_a_role_whose_threads_end_exits_as_python_does(tmp_path):
    """Python's exit joins the threads, then runs the exit handlers: the process end ran the handlers first (one
    that expects the threads' work done did not find it), and took a pool's idle thread, which Python's own exit
    ends, for a thread left behind (5 s more, and an error in the log)."""
    process = run_role_process(end_as_plugins_leave_it, tmp_path)
    assert process.exitcode == 0
    assert (tmp_path / "order").read_text().splitlines() == ["thread", "exit handler"]
    log = (tmp_path / "role.log").read_text() if (tmp_path / "role.log").exists() else ""
    assert "left behind" not in log, log


def end_with_a_thread_blocked_for_ever(role: str, index: int, tmp_path) -> int:
    logging.basicConfig(filename=tmp_path / "role.log", level=logging.INFO, force=True)
    threading.Thread(target=threading.Event().wait, name="blocked-for-ever").start()
    atexit.register((tmp_path / "closed").touch)  # a plugin's close at exit
    return 3


def test_a_role_whose_thread_never_ends_exits_with_its_code_once_its_exit_handlers_ran(tmp_path):
    process = run_role_process(end_with_a_thread_blocked_for_ever, tmp_path)
    assert process.exitcode == 3 and (tmp_path / "closed").exists()
    log = (tmp_path / "role.log").read_text()
    assert "1 threads still run 5 s after the role ended" in log and "blocked-for-ever:" in log, log
