"""Placement: which GPUs each role of a single-machine run sees, and layouts refused with what fits; a role that
would outlive its launcher."""

import contextlib
import os
import signal
import time

import pytest

from experiments.common import ClusterConfig, InferenceConfig
from rlsys.cli import ConfigError, parse_config
from rlsys.placement import PlacementError, open_placement
from rlsys.placement.gpus import gpu_layout


def layout(devices, inference=None, **cluster):
    return gpu_layout(ClusterConfig(**cluster), inference or InferenceConfig(), devices)


def test_on_cpu_nothing_is_assigned_and_gpu_settings_are_refused():
    assert layout([]) == {}
    assert layout([], n_inference_workers=3) == {}
    with pytest.raises(PlacementError, match="no GPU.*cluster.learner_gpus=1"):
        layout([], learner_gpus=1)
    with pytest.raises(PlacementError, match="no GPU.*tensor_parallel_size=2"):
        layout([], InferenceConfig(tensor_parallel_size=2))


def test_default_layout_shares_every_gpu_as_before():
    assert layout(["0", "1"]) == {}


def test_learner_and_workers_get_disjoint_gpus_in_order():
    got = layout([str(i) for i in range(8)], learner_gpus=2, n_learner_ranks=2, gpus_per_inference_worker=2,
                 n_inference_workers=3)
    assert got == {("learner", 0): "0", ("learner", 1): "1", ("inference", 0): "2,3", ("inference", 1): "4,5",
                   ("inference", 2): "6,7"}


def test_gpus_a_learner_rank_would_never_use_are_refused():
    """Each learner rank trains on one device (cuda:0 of those it sees): cluster.learner_gpus=2 with one rank reserved
    a second GPU (locally, out of every other role's reach; on Ray, in its bundle) that sat idle, without a word."""
    with pytest.raises(ConfigError, match=r"cluster.learner_gpus=2 with cluster.n_learner_ranks=1: each learner rank "
                                          r"trains on one GPU"):
        parse_config(["cluster.learner_gpus=2"])
    with pytest.raises(ValueError, match=r"cluster.learner_gpus=4 with cluster.n_learner_ranks=2"):
        ClusterConfig(learner_gpus=4, n_learner_ranks=2)
    assert layout(["0", "1", "2"], learner_gpus=2, n_learner_ranks=2) == {("learner", 0): "0", ("learner", 1): "1"}


def test_gpu_names_follow_the_launcher_s_own_cuda_visible_devices():
    got = layout(["3", "5", "7"], learner_gpus=1, gpus_per_inference_worker=1, n_inference_workers=2)
    assert got == {("learner", 0): "3", ("inference", 0): "5", ("inference", 1): "7"}


def test_under_ray_the_learner_s_settings_are_checked_against_its_bundle_s_device(monkeypatch):
    """Under Ray the learner has a GPU exactly when its bundle has one (a role given none sees none). Its settings were
    checked against the launcher's machine: learner.attn_implementation=flash_attention_2 with learner_gpus=1 was
    refused from a head node without a GPU, and let through with learner_gpus=0 from a GPU one (the rank then died
    at start, restarted until the run gave up)."""
    from rlsys import assets
    from rlsys.launcher import prepare
    from rlsys.preflight import StartupError

    class Checked(Exception):
        """The device checks passed: prepare went on to the model and the dataset."""

    def checked(config):
        raise Checked

    monkeypatch.setattr(assets, "prepare_assets", checked)
    ray = ["cluster.backend=ray", "learner.attn_implementation=flash_attention_2"]
    with pytest.raises(Checked):
        prepare(parse_config([*ray, "cluster.learner_gpus=1"]))
    monkeypatch.setattr("rlsys.config_checks.visible_devices", lambda: ["0"])  # a launcher on a GPU node
    with pytest.raises(StartupError, match="flash_attention_2 needs a GPU"):
        prepare(parse_config(ray))


def test_under_ray_the_inference_settings_are_checked_against_its_bundle_s_device(monkeypatch):
    """Under Ray an inference worker with cluster.gpus_per_inference_worker=0 has no GPU; its settings were not checked
    at all there, so CUDA graphs asked of the transformers engine let the run start, each worker dying as it began."""
    from rlsys.launcher import prepare
    from rlsys.preflight import StartupError

    monkeypatch.setattr("rlsys.config_checks.visible_devices", lambda: ["0"])  # a launcher on a GPU node
    with pytest.raises(StartupError, match="CUDA graphs, which need a GPU"):
        prepare(parse_config(["cluster.backend=ray", "inference.engine=transformers", "inference.enforce_eager=false"]))


def test_a_layout_that_does_not_fit_says_what_fits():
    with pytest.raises(PlacementError, match=r"needs 8 GPUs .* has 4: the learner's 2 leave 2: "
                                             r"at most 1 inference workers of 2"):
        layout(["0", "1", "2", "3"], learner_gpus=2, n_learner_ranks=2, gpus_per_inference_worker=2,
               n_inference_workers=3)
    with pytest.raises(PlacementError, match="tensor_parallel_size=4 needs at least that many GPUs "
                                             "per inference worker"):
        layout(["0", "1", "2", "3"], InferenceConfig(tensor_parallel_size=4), gpus_per_inference_worker=2)


def test_cluster_settings_are_checked_by_name():
    with pytest.raises(ValueError, match="cluster.backend must be one of"):
        ClusterConfig(backend="slurm")
    with pytest.raises(ValueError, match="cluster.inference_resources must look like NAME:AMOUNT"):
        ClusterConfig(inference_resources="gpu_node")
    with pytest.raises(ValueError, match="cluster.weights_transport must be one of"):
        ClusterConfig(weights_transport="nfs")
    assert ClusterConfig(learner_resources="trainer:1, big:0.5").resources("learner") == {"trainer": 1.0, "big": 0.5}
    with pytest.raises(ValueError, match="tensor_parallel_size=2 needs inference.engine=vllm"):
        InferenceConfig(engine="transformers", tensor_parallel_size=2)


def test_gpus_an_inference_worker_would_never_use_are_refused():
    """vLLM runs on tensor_parallel_size GPUs of those its worker sees: more per worker were reserved (locally, out of
    every other role's reach; on Ray, in its bundle) and sat idle, without a word."""
    with pytest.raises(ConfigError, match=r"cluster.gpus_per_inference_worker=4 gives each inference worker 3 GPUs "
                                          r"its engine never uses: it runs on inference.tensor_parallel_size=1"):
        parse_config(["cluster.gpus_per_inference_worker=4"])
    config = parse_config(["cluster.gpus_per_inference_worker=2", "inference.tensor_parallel_size=2",
                           "cluster.weights_transport=disk"])
    assert layout(["0", "1", "2"], config.inference, learner_gpus=1, gpus_per_inference_worker=2) == {
        ("learner", 0): "0", ("inference", 0): "1,2"}


ORPHANED_ROLE = """
import os, signal, sys, time
from rlsys.cli import ConfigError, parse_config
from rlsys.placement.local import LocalPlacement

def role(*args):
    time.sleep(600)

if __name__ == "__main__":
    print(LocalPlacement(parse_config([]), role).start("rollout", 0, ()).process.pid, flush=True)
    os.kill(os.getpid(), signal.SIGKILL)  # the launcher killed (kill -9, the OOM killer) as its role starts
"""


def test_a_role_whose_launcher_died_as_it_started_does_not_run(tmp_path):
    """A role asks the kernel to kill it when the launcher dies; one whose launcher died before it asked was never
    told, and ran on, orphaned."""
    import subprocess
    import sys
    from pathlib import Path

    from tests.helpers import alive

    script = tmp_path / "launcher.py"
    script.write_text(ORPHANED_ROLE)
    root = Path(__file__).resolve().parents[1]
    with open(tmp_path / "role_pid", "w") as out:  # not a pipe: a role that outlives the launcher would hold it open
        subprocess.run([sys.executable, str(script)], stdout=out, timeout=120,
                       env={**os.environ, "PYTHONPATH": str(root)})
    role = int((tmp_path / "role_pid").read_text())
    try:
        deadline = time.monotonic() + 30
        while alive(role) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(role)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(role, signal.SIGKILL)


THREADS_OF_A_ROLE = """
import glob, signal, sys, threading
from rlsys.cli import parse_config
from rlsys.placement.local import LocalPlacement

# A thread started as the launcher's main module loads, as torch's and a BLAS's start: a role process loads it too
threading.Thread(target=threading.Event().wait, daemon=True).start()

def stop_signals_blocked_per_thread(*args):
    for status in glob.glob("/proc/self/task/*/status"):
        blocked = int(next(line for line in open(status) if line.startswith("SigBlk:")).split()[1], 16)
        print(sorted(s.name for s in (signal.SIGINT, signal.SIGTERM) if blocked >> (s - 1) & 1), flush=True)
    return 0

if __name__ == "__main__":
    role = LocalPlacement(parse_config([]), stop_signals_blocked_per_thread).start("rollout", 0, ())
    role.join(120)
    sys.exit(role.exitcode)
"""


def test_no_thread_of_a_role_process_keeps_the_stop_signals_blocked(tmp_path):
    """A role process started with SIGINT and SIGTERM blocked, and unblocked them only in its main thread, as it ran
    the role: a thread made before (by its imports) kept them blocked for its life, and so did a process such a
    thread started (a redis-server that outlived its owner, deaf to the parent-death SIGTERM)."""
    import subprocess
    import sys
    from pathlib import Path

    script = tmp_path / "launcher.py"
    script.write_text(THREADS_OF_A_ROLE)
    root = Path(__file__).resolve().parents[1]
    role = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=180,
                          env={**os.environ, "PYTHONPATH": str(root)})
    assert role.returncode == 0, role.stderr
    threads = role.stdout.splitlines()
    assert len(threads) >= 2 and set(threads) == {"[]"}, threads


def wait_for_the_stop(*args):
    time.sleep(120)  # a role the stop did not reach: it runs on


def test_a_stop_signal_handled_as_a_role_starts_leaves_the_launchers_thread_unblocked(monkeypatch):
    """Python runs the handlers of signals that came meanwhile inside pthread_sigmask, once it has set the mask: a
    Ctrl-C that came as the launcher blocked SIGINT and SIGTERM to start a role raised KeyboardInterrupt out of that
    call, and the launcher's thread kept both blocked for life, as did every process it started after."""
    import multiprocessing.resource_tracker

    from rlsys.placement.local import STOP_SIGNALS, LocalPlacement

    setting = signal.pthread_sigmask

    def ctrl_c_handled_within(how, mask):
        previous = setting(how, mask)
        if how == signal.SIG_BLOCK and set(mask) == STOP_SIGNALS:
            raise KeyboardInterrupt  # from the call, as Python's handler of a Ctrl-C that came meanwhile raises it
        return previous

    placement = LocalPlacement(parse_config([]), wait_for_the_stop)
    multiprocessing.resource_tracker.ensure_running()  # it blocks both as it starts, and unblocks them after
    monkeypatch.setattr(signal, "pthread_sigmask", ctrl_c_handled_within)
    before = setting(signal.SIG_BLOCK, ())
    try:
        with pytest.raises(KeyboardInterrupt):
            placement.start("rollout", 0, ())
        after = setting(signal.SIG_BLOCK, ())
    finally:
        setting(signal.SIG_SETMASK, before)  # the tests after this one run with the mask it found
        placement.close()
    assert after == before == set()


def test_closing_a_local_placement_ends_every_role_it_started_that_still_runs():
    """The supervisor's stop ends a run's roles; those it did not reach (a second Ctrl-C during its grace period, an
    error while the roles were being started) ran on, and the launcher's exit waited for them (multiprocessing joins
    its children), however long they took."""
    started = time.monotonic()
    with pytest.raises(KeyboardInterrupt):
        with open_placement(parse_config([]), wait_for_the_stop) as placement:
            roles = [placement.start("rollout", 0, ()), placement.start("inference", 0, ())]
            raise KeyboardInterrupt
    assert [role.is_alive() for role in roles] == [False, False]
    assert time.monotonic() - started < 60


def test_a_sigterm_to_one_role_alone_ends_it_and_one_the_launcher_also_got_is_left_to_the_launcher():
    """A role left every SIGTERM to its launcher while that lived, so the group's (scancel, systemd) stops the run
    through the bus and the learner saves its checkpoint; but one sent to the role alone (kill PID, a cluster agent)
    was ignored. The role now ends by it unless the launcher got one within a moment; the supervisor then restarts
    it as after a crash."""
    from rlsys.bus import raise_on_sigterm
    from rlsys.placement.local import SIGTERM_ALONE_SECONDS, LocalPlacement

    with raise_on_sigterm():  # the launcher's own handling of SIGTERM
        placement = LocalPlacement(parse_config([]), wait_for_the_stop)
        try:
            alone, with_the_launcher = placement.start("rollout", 0, ()), placement.start("rollout", 1, ())
            os.kill(alone.process.pid, signal.SIGTERM)
            alone.join(SIGTERM_ALONE_SECONDS + 30)
            assert alone.exitcode == -signal.SIGTERM
            with pytest.raises(SystemExit):
                os.kill(with_the_launcher.process.pid, signal.SIGTERM)
                os.kill(os.getpid(), signal.SIGTERM)  # the process group's: the launcher got it too
                time.sleep(5)
            with_the_launcher.join(SIGTERM_ALONE_SECONDS + 2)
            assert with_the_launcher.exitcode is None  # the launcher's stop ends it, through the bus
        finally:
            placement.close()
