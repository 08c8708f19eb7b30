"""The math verifier pool and the `math-code-single-step` environment, through the real math-verify.

Workers are separate interpreters, so the scripted check below is found by import path inside the worker:
its magic answers hang or crash the worker for real, which is what the hard deadline must handle.
"""

import asyncio
import errno
import os
import subprocess
import sys
import time

import pytest

import rlsys.impl.env  # noqa: F401  (registers the environments)
from rlsys.api import EnvServiceAbstraction, make_env
from rlsys.impl.env.math_answers import check_answer, plain_number_verdict
from rlsys.impl.env.math_verifier import Verdict, VerifierPool, close_shared_pool, shared_pool

HANG, CRASH, RAISE = "<hang>", "<crash>", "<raise>"


def scripted_check(answer: str, reference: str) -> Verdict:
    """Runs in the worker: the real check, except for answers that hang, kill, or raise inside it."""
    if answer == HANG:
        time.sleep(3600)
    if answer == CRASH:
        os._exit(3)
    if answer == RAISE:
        raise ValueError("scripted failure")
    return check_answer(answer, reference)


@pytest.fixture(scope="module")
def pool():
    pool = VerifierPool(size=2, check=f"{__name__}:scripted_check")
    asyncio.run(pool.score(["1", "1"], "1", timeout=30))  # both workers started, so timings below are honest
    yield pool
    pool.close()


def score(pool: VerifierPool, answers: list[str], reference: str = "57", timeout: float = 10.0) -> list[Verdict]:
    return asyncio.run(pool.score(answers, reference, timeout))


def test_right_answers_are_correct(pool):
    verdicts = score(pool, ["57", "\\boxed{57}", "The answer is 57", "$57$", "so we get 57.0"])
    assert verdicts == [Verdict(True, "ok")] * 5


def test_wrong_answers_are_incorrect(pool):
    verdicts = score(pool, ["58", "\\boxed{56}", "-57", "The answer is 5 7/10"])
    assert [v.correct for v in verdicts] == [False] * 4
    assert {v.status for v in verdicts} == {"ok"}


@pytest.mark.parametrize("answer,reference,fast", [
    ("46", "46", True), (" 46 ", "46", True), ("46.0", "46", True), ("046", "46", True), ("45", "46", True),
    ("-46", "46", True), ("0.5", "0.50", True), ("1.25", "1.2", True), ("+46", "46", False), ("100", "1e2", False),
    ("46", "46/1", False), ("4 6", "46", False), ("46.", "46", False), ("\\boxed{46}", "46", False)])
def test_plain_number_fast_path_agrees_with_math_verify(answer, reference, fast):
    verdict = plain_number_verdict(answer, reference)
    assert (verdict is not None) == fast
    if fast:
        assert verdict == check_answer(answer, reference)


def test_malformed_answers_are_incorrect_not_errors(pool):
    malformed = ["", "abc", "é漢字🙂\u200b\x00", "x" * 100_000, "\\boxed{", "}}}{{{$$", "   "]
    verdicts = score(pool, malformed)
    assert [v.correct for v in verdicts] == [False] * len(malformed)
    assert {v.status for v in verdicts} <= {"ok", "unparsable"}


def test_hang_times_out_without_holding_up_other_checks(pool):
    async def timed(answer: str, timeout: float) -> tuple[Verdict, float]:
        verdict = await pool.check(answer, "57", timeout)
        return verdict, time.monotonic() - start

    async def race():
        return await asyncio.gather(timed(HANG, 1.0), timed("57", 10.0))

    start = time.monotonic()
    (hung, hung_after), (normal, normal_after) = asyncio.run(race())
    assert hung.status == "timeout" and not hung.correct
    assert 1.0 <= hung_after < 3.0
    assert normal == Verdict(True, "ok") and normal_after < 1.0
    # the killed worker was replaced
    assert score(pool, ["57", "12"]) == [Verdict(True, "ok"), Verdict(False, "ok")]


def test_crashing_worker_gives_error_and_is_replaced(pool):
    crashed, = score(pool, [CRASH])
    assert crashed.status == "error" and not crashed.correct
    assert "exit code 3" in crashed.reason
    assert score(pool, ["57"]) == [Verdict(True, "ok")]


def test_a_worker_that_cannot_be_started_fails_a_check_and_is_started_again(monkeypatch):
    """Out of processes or descriptors for a moment (fork's EAGAIN, EMFILE): the check that meets it gets an error
    verdict and the pool keeps its size, serving again once the moment passes (the slot was lost, and with it every
    later check hung)."""
    from rlsys.impl.env import math_verifier

    pool = VerifierPool(size=1, check=f"{__name__}:scripted_check")
    try:
        real_popen, failures = subprocess.Popen, iter([OSError(errno.EAGAIN, "Resource temporarily unavailable")])

        def popen(*args, **kwargs):
            for error in failures:  # the next start fails
                raise error
            return real_popen(*args, **kwargs)

        monkeypatch.setattr(math_verifier.subprocess, "Popen", popen)
        crashed, = score(pool, [CRASH])  # and its replacement cannot start
        assert crashed.status == "error" and "exit code 3" in crashed.reason
        unstarted, = score(pool, ["57"])
        assert unstarted.status == "error"
        assert unstarted.reason == \
            "could not start a verifier worker: BlockingIOError: [Errno 11] Resource temporarily unavailable"
        assert score(pool, ["57"]) == [Verdict(True, "ok")]
    finally:
        pool.close()


def test_exception_in_check_gives_error(pool):
    failed, fine = score(pool, [RAISE, "57"])
    assert failed.status == "error" and "ValueError" in failed.reason
    assert fine == Verdict(True, "ok")


def test_close_kills_workers():
    pool = VerifierPool(size=1)
    assert score(pool, ["\\frac{1}{2}"], reference="0.5") == [Verdict(True, "ok")]
    processes = [w.process for w in pool._workers]
    pool.close()
    assert processes and not any(p.poll() is None for p in processes)
    with pytest.raises(RuntimeError):
        score(pool, ["1"])


def test_a_worker_does_not_run_the_programs_entry_script(tmp_path):
    """A multiprocessing child imports the program's entry script again before it runs: the training script's
    torch, transformers and experiments, seconds of CPU at every worker start while the run's roles start on the
    same cores; and a script without the `__main__` guard could not start a worker at all. The script below has no
    guard and counts its own runs."""
    runs = tmp_path / "runs.txt"
    script = tmp_path / "entry.py"
    script.write_text(
        "import asyncio, os\n"
        "from rlsys.impl.env.math_verifier import VerifierPool\n"
        f"with open({str(runs)!r}, 'a') as f:\n"
        "    f.write(f'{os.getpid()}\\n')\n"
        "pool = VerifierPool(size=1)\n"
        "print(asyncio.run(pool.check('\\\\frac{1}{2}', '0.5', 30.0)))\n"
        "pool.close()\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "Verdict(correct=True, status='ok', reason='')"
    assert len(runs.read_text().split()) == 1


def test_a_worker_hung_in_a_check_exits_when_its_parent_is_killed(tmp_path):
    """A parent killed outright (SIGKILL, the OOM killer: no close(), no atexit) while a worker is stuck in a check
    that never ends (sympy on adversarial output): the worker, which sees the parent gone only between checks, ends
    within seconds rather than spinning on for ever, orphaned."""
    (tmp_path / "hanging_check.py").write_text("import time\ndef check(answer, reference):\n    time.sleep(3600)\n")
    script = tmp_path / "parent.py"
    script.write_text(
        "import asyncio, sys, threading, time\n"
        "from rlsys.impl.env.math_verifier import VerifierPool\n"
        "pool = VerifierPool(size=1, check='hanging_check:check')\n"
        "pool.wait_ready()\n"
        "threading.Thread(target=pool.check_blocking, args=('1', '1', 3600.0), daemon=True).start()\n"
        "time.sleep(1)\n"  # the job is on the worker's socket
        "print(next(iter(pool._workers)).process.pid, flush=True)\n"
        "time.sleep(3600)\n")
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=tmp_path,
                              env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), *sys.path])})
    try:
        worker = int(parent.stdout.readline())
    finally:
        parent.kill()
        parent.wait()

    def alive(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/stat") as f:
                return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited: no reaper in some sandboxes
        except FileNotFoundError:
            return False

    deadline = time.monotonic() + 10
    while alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        assert not alive(worker), "the verifier worker outlived its killed parent"
    finally:
        if alive(worker):
            os.kill(worker, 9)


def test_env_from_registry_scores_a_group():
    env = make_env(EnvServiceAbstraction("math-code-single-step", {}))

    async def episode():
        await env.reset(options={"prompt": "What is 50+7?", "answer": "57"})
        return await env.step(("q0", ["\\boxed{57}", "58", ""]))

    try:
        obs, rewards, terminated, truncated, info = asyncio.run(episode())
    finally:
        close_shared_pool()
    assert obs is None and terminated and not truncated
    assert rewards == [1.0, 0.0, 0.0]
    assert info["statuses"] == ["ok", "ok", "unparsable"]


def test_warm_up_starts_every_verifier_worker_before_the_first_check():
    """Started lazily, the pool's start-up (an interpreter and sympy per worker: seconds) fell on the first
    episode that needed a real check, which then finished versions behind the episodes admitted after it."""
    env = make_env(EnvServiceAbstraction("math-code-single-step", {"verifier_workers": 2}))
    try:
        asyncio.run(env.warm_up())
        workers = list(shared_pool(2)._workers)
        assert len(workers) == 2 and all(w.ready and w.process.poll() is None for w in workers)
        assert (score(shared_pool(2), ["\\frac{1}{2}", "\\frac{1}{3}"], reference="0.5")
                == [Verdict(True, "ok"), Verdict(False, "ok")])
    finally:
        close_shared_pool()


def test_env_rejects_misuse():
    env = make_env(EnvServiceAbstraction("math-code-single-step", {"verify_timeout": 1.0}))
    with pytest.raises(RuntimeError):
        asyncio.run(env.step(("q0", ["1"])))
    with pytest.raises(KeyError):
        asyncio.run(env.reset(options={"prompt": "no answer"}))
