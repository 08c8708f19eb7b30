"""cluster.backend=ray's placement alone (no run): a role's actor gives its bundle back when its run ends."""

import contextlib
import os
import socket
import sys
import time
from pathlib import Path

import pytest

from rlsys.cli import parse_config
from rlsys.protocol import role_name
from tests.helpers import held_port

pytestmark = pytest.mark.distributed


def exit_code_within(handle, seconds: float):
    deadline = time.monotonic() + seconds
    while handle.exitcode is None and time.monotonic() < deadline:
        time.sleep(0.2)
    return handle.exitcode


def test_a_role_started_again_in_its_bundle_runs_once_the_last_one_returned():
    """A role whose run returned (an error exit code, or every role when the learner died and the run restarts)
    is started again in the same one-CPU bundle. Its old actor used to live on, holding the CPU, and Ray never
    scheduled the new one: a restart from the start waited until the stall check stopped the run."""
    from rlsys.placement.ray_actors import RayPlacement

    def raises(role, index, *args):
        raise RuntimeError("a learner rank whose peer died: its collective raised")

    placement = RayPlacement(parse_config(["cluster.backend=ray"]), lambda role, index, *args: 1)
    try:
        assert exit_code_within(placement.start("rollout", 0, ()), 60) == 1
        placement.entry = raises
        assert exit_code_within(placement.start("rollout", 0, ()), 60) == -1
        placement.entry = lambda role, index, *args: 0
        assert exit_code_within(placement.start("rollout", 0, ()), 60) == 0
    finally:
        placement.close()


def test_a_role_runs_in_the_launchers_working_directory(tmp_path, monkeypatch):
    """Relative paths in the config (plugins=[my_plugin.py]) name for every role what they name for the launcher:
    a Ray actor starts where its node's Ray was started, here where the launcher was when it started Ray."""
    from rlsys.placement.ray_actors import RayPlacement

    (tmp_path / "started_ray").mkdir()
    (tmp_path / "launcher").mkdir()
    monkeypatch.chdir(tmp_path / "started_ray")
    placement = RayPlacement(parse_config(["cluster.backend=ray"]), lambda role, index, *args: 1)
    try:
        monkeypatch.chdir(tmp_path / "launcher")
        placement.entry = lambda role, index, *args: 0 if os.path.isfile("here") else 1
        (tmp_path / "launcher" / "here").touch()
        assert exit_code_within(placement.start("rollout", 0, ()), 60) == 0
    finally:
        placement.close()


def test_a_role_ray_cannot_start_in_its_bundle_ends_with_the_reason(monkeypatch):
    """An actor whose bundle no node can hold (its node was lost, and no other has the resources; here its bundle's
    CPU is held) is never started by Ray: it used to count as running for ever, the supervisor waiting on it with
    no error (learner rank 0's start, for its rendezvous address). Past the placement timeout it ends, with a
    reason that names its bundle."""
    from rlsys.errors import RoleFailed
    from rlsys.placement import ray_actors

    def sleeps(role, index, *args):
        time.sleep(600)

    monkeypatch.setattr(ray_actors, "PLACEMENT_TIMEOUT", 10.0)
    placement = ray_actors.RayPlacement(parse_config(["cluster.backend=ray"]), sleeps)
    try:
        holder = placement.start("rollout", 0, ())
        waiting = placement.start("rollout", 0, ())  # the same one-CPU bundle, which `holder` keeps
        assert exit_code_within(waiting, 60) == -1
        assert waiting.exit_reason.startswith("was not started by Ray within 10 s: no node of the cluster can hold "
                                              "its bundle {'CPU': 1")
        assert holder.exitcode is None
        placement.start("learner", 0, ())
        with pytest.raises(RoleFailed, match="learner0 was not started by Ray within 10 s"):
            placement.start("learner", 0, ())  # its rendezvous address would be waited for, for ever
    finally:
        placement.close()


def test_a_role_whose_bundle_has_no_gpu_sees_none(monkeypatch):
    """cluster.learner_gpus=0 under Ray gives the learner no GPU (its docs). Ray 2.60 sets CUDA_VISIBLE_DEVICES only for
    an actor it gave GPUs, so one given none saw every GPU of its node: the learner trained on cuda:0, the GPU Ray had
    given this run's inference worker, and Ray counted it nowhere."""
    from ray.cluster_utils import Cluster

    from rlsys.placement.ray_actors import RayPlacement

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # a node whose GPU every process sees
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "num_gpus": 1, "include_dashboard": False})

    def sees(role, index, *args):
        os.environ.update(args[-1])  # what run_role does first
        return 0 if os.environ.get("CUDA_VISIBLE_DEVICES") == ("0" if role == "inference" else "") else 1

    try:
        placement = RayPlacement(parse_config(["cluster.backend=ray", f"cluster.ray_address={cluster.address}",
                                               "cluster.gpus_per_inference_worker=1"]), sees)
        try:
            roles = [placement.start(role, 0, ()) for role in ("learner", "inference", "rollout")]
            assert [exit_code_within(role, 60) for role in roles] == [0, 0, 0]
        finally:
            placement.close()
    finally:
        cluster.shutdown()


def test_without_a_ray_address_the_run_starts_a_ray_of_its_own_beside_one_that_runs(monkeypatch):
    """An empty cluster.ray_address starts a Ray for this run alone (docs/cluster.md). ray.init joins the cluster that
    RAY_ADDRESS names (or a `ray start` on this machine) by default, and refused the run's CPU count there: a
    ValueError traceback for whoever had a Ray running."""
    import ray
    from ray.cluster_utils import Cluster

    from rlsys.placement.ray_actors import RayPlacement

    # Three bundles (a CPU each) on two nodes: a rollout worker's custom resource names the node it runs on
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"plain": 1},
                                                            "include_dashboard": False})
    monkeypatch.setenv("RAY_ADDRESS", cluster.address)
    try:
        placement = RayPlacement(parse_config(["cluster.backend=ray"]), lambda role, index, *args: 0)
        try:
            assert ray.get_runtime_context().gcs_address != cluster.address
            assert exit_code_within(placement.start("rollout", 0, ()), 60) == 0
        finally:
            placement.close()
    finally:
        cluster.shutdown()


STOPPED_BY_SIGTERM = """
import sys, time
from rlsys.bus import raise_on_sigterm
from rlsys.cli import parse_config
from rlsys.placement import open_placement

with raise_on_sigterm(), open_placement(parse_config(["cluster.backend=ray"]), None):
    try:  # before the print: the test's SIGTERM follows it at once
        print("placed", flush=True)
        time.sleep(600)
    finally:
        time.sleep(5)  # the launcher's stop: every role told to stop, given time to save its checkpoint
        print("stopped", flush=True)
"""


def stopped_by_sigterm_whole(script: str, ray_processes_of) -> None:
    """Runs the launcher `script`, whose Ray's processes `ray_processes_of(launcher)` reads once the launcher has them
    and gets a SIGTERM: the launcher's stop runs whole (exit 143), and leaves no Ray process."""
    import subprocess

    import psutil

    launcher = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                                cwd=Path(__file__).resolve().parents[1])
    try:
        ray_processes = ray_processes_of(launcher)
        assert ray_processes
        assert launcher.stdout.read() == "stopped\n"
        assert launcher.wait(timeout=60) == 143
    finally:
        launcher.kill()
        launcher.wait()
    _, alive = psutil.wait_procs(ray_processes, timeout=30)
    assert [p.cmdline() for p in alive] == []


def test_a_sigterm_to_a_launcher_on_ray_runs_its_whole_stop_and_leaves_no_ray_process():
    """ray.init put its own SIGTERM handling in place of the launcher's: its core worker's crash handler aborted the
    process 3 s after a SIGTERM, in the middle of the stop, which left the roles without their checkpoint and Ray's
    agents running."""
    import signal

    import psutil

    def placed_then_sigterm(launcher):
        assert launcher.stdout.readline() == "placed\n"
        ray_processes = psutil.Process(launcher.pid).children(recursive=True)
        launcher.send_signal(signal.SIGTERM)
        return ray_processes

    stopped_by_sigterm_whole(STOPPED_BY_SIGTERM, placed_then_sigterm)


SIGTERM_DURING_RAY_INIT = """
import os, signal, time
import psutil, ray
from rlsys.bus import raise_on_sigterm
from rlsys.cli import parse_config
from rlsys.placement import open_placement

ray_init = ray.init

def init_as_a_sigterm_comes(*args, **kwargs):
    ray_init(*args, **kwargs)
    print(*(p.pid for p in psutil.Process().children(recursive=True)), flush=True)
    os.kill(os.getpid(), signal.SIGTERM)  # held back where no thread takes it, as one that came during ray.init
    time.sleep(1)  # as ray.init goes on after one in its middle: a thread that takes it has done so

ray.init = init_as_a_sigterm_comes
with raise_on_sigterm():
    try:
        with open_placement(parse_config(["cluster.backend=ray"]), None):
            time.sleep(600)
    finally:
        time.sleep(5)  # the launcher's stop: Ray's crash handler aborted the launcher 3 s after the SIGTERM
        print("stopped", flush=True)
"""


def ray_processes_printed(launcher) -> list:
    """The processes of its Ray that the launcher SIGTERM_DURING_RAY_INIT runs printed."""
    import psutil

    return [psutil.Process(int(pid)) for pid in launcher.stdout.readline().split()]


def test_a_sigterm_that_comes_during_ray_init_is_the_launchers_not_rays():
    """The SIGTERM the launcher held back during ray.init came as it unblocked it, before it had put its own handler
    back: Ray's crash handler took it and aborted the launcher 3 s later, in the middle of its stop, and left Ray's
    agents running."""
    stopped_by_sigterm_whole(SIGTERM_DURING_RAY_INIT, ray_processes_printed)


def test_a_sigterm_during_ray_init_that_another_thread_of_the_launcher_takes_is_the_launchers_not_rays():
    """A thread the launcher has before ray.init does not block SIGTERM (torch's intra-op threads, which the tiny
    model's warm start leaves): the SIGTERM that came during ray.init went to it at once, not held back, and ran Ray's
    crash handler, which aborted the launcher (SIGABRT) before its stop; with that handler off, Ray's own SIGTERM
    handler ran, whose sys.exit(15) was not the launcher's exit."""
    a_thread_first = ("import threading, time\n"
                      "threading.Thread(target=time.sleep, args=(600,), daemon=True).start()  # SIGTERM unblocked\n")
    stopped_by_sigterm_whole(a_thread_first + SIGTERM_DURING_RAY_INIT, ray_processes_printed)


def test_the_private_redis_of_a_run_on_a_ray_of_its_own_listens_on_loopback_only():
    """Every role of a Ray this run started is on this machine: its bus need not be reachable from the network."""
    from rlsys.placement.ray_actors import RayPlacement

    placement = RayPlacement(parse_config(["cluster.backend=ray"]), lambda role, index, *args: 0)
    try:
        assert placement.bus_host == "127.0.0.1"
    finally:
        placement.close()


def test_a_ray_address_where_no_cluster_answers_is_refused_before_anything_starts(monkeypatch):
    """cluster.ray_address=auto with no Ray running here: ray.init's ConnectionError left the launcher as a traceback
    (exit 1), not the `error:` line and exit 2 of a run that cannot start."""
    import functools

    import ray._private.services

    from rlsys.launcher import placed_roles
    from rlsys.preflight import StartupError

    # a Ray that another test or user runs on this machine is not the one this test looks for
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray._private.services, "_cached_find_gcs_addresses", functools.cache(lambda: frozenset()))
    monkeypatch.setattr(ray._private.services, "find_bootstrap_address", lambda temp_dir: None)
    with pytest.raises(StartupError, match=r"^cluster.ray_address=auto: no Ray cluster answered \(Could not find any "
                                           r"running Ray instance.*\); start one \(`ray start --head`"):
        with placed_roles(parse_config(["cluster.backend=ray", "cluster.ray_address=auto"])):
            pass


PLACED_AT = """
import sys
from rlsys.cli import parse_config
from rlsys.launcher import placed_roles
from rlsys.preflight import StartupError

try:
    with placed_roles(parse_config(["cluster.backend=ray", "cluster.ray_address=" + sys.argv[1]])):
        print("placed", flush=True)
except StartupError as e:
    print(e, flush=True)
"""


def test_a_ray_address_where_nothing_listens_is_refused_within_seconds():
    """cluster.ray_address=HOST:PORT with a wrong port (or a head that was stopped): ray.init tried to reach the
    cluster 20 times, some 40 s each, the launcher silent for about 14 minutes before it said so."""
    import subprocess
    import sys

    with held_port() as port:  # where nothing listens
        address = f"127.0.0.1:{port}"
        started = time.monotonic()
        result = subprocess.run([sys.executable, "-c", PLACED_AT, address], capture_output=True, text=True,
                                timeout=90, cwd=Path(__file__).resolve().parents[1])
    assert result.stdout.startswith(f"cluster.ray_address={address}: no Ray cluster answered (nothing answered at "
                                    f"{address}: Connection refused); start one (`ray start --head`")
    assert time.monotonic() - started < 60


def torch_threads(role, index, *args):
    """A role's entry that limits its threads as run_role does, then exits with its torch thread count, doubled, plus
    1 if OMP_NUM_THREADS is in its environment (which its child processes' OpenMP would read)."""
    import torch

    from rlsys.placement.cpu_threads import role_threads
    from rlsys.roles import limit_threads

    limit_threads(role_threads(role, parse_config(["inference.num_threads=0"])), role)
    return 2 * torch.get_num_threads() + ("OMP_NUM_THREADS" in os.environ)


def test_a_role_gets_the_same_threads_under_ray_as_on_one_machine(monkeypatch):
    """Ray sets OMP_NUM_THREADS to an actor's CPUs (1) where it is not set: an inference worker left to the engine's
    choice (inference.num_threads=0) had one torch thread under Ray and every core on one machine, and the processes
    it started inherited the 1. A role starts with the launcher's OMP_NUM_THREADS, or none, as a local one does."""
    from ray import cloudpickle

    from rlsys.placement.local import LocalPlacement
    from rlsys.placement.ray_actors import RayPlacement

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import the tests
    codes = {}
    try:
        for backend, placement_class in (("local", LocalPlacement), ("ray", RayPlacement)):
            placement = placement_class(parse_config([f"cluster.backend={backend}"]), torch_threads)
            try:
                codes[backend] = [exit_code_within(placement.start(role, 0, ()), 120)
                                  for role in ("learner", "inference")]
            finally:
                placement.close()
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    assert codes["ray"] == codes["local"] and all(code % 2 == 0 for code in codes["local"]), codes


def test_learner_rank_0_holds_its_rendezvous_port_from_the_moment_the_other_ranks_are_told_it(tmp_path):
    """Rank 0's actor picked a port free on its node and the rank bound it seconds later, once its role had started:
    another process taking it meanwhile failed the group, and every role restarted from the checkpoint. Rank 0's
    actor binds the port (the kernel picks it) before any rank is told it, and its run serves on that socket; a rank
    0 started again (the run restarted after a learner died) binds its own."""
    import tests.helpers
    from ray import cloudpickle

    from rlsys.placement.ray_actors import RayPlacement
    from tests.helpers import summing_rank

    cloudpickle.register_pickle_by_value(tests.helpers)  # Ray's workers cannot import the tests
    placement = RayPlacement(parse_config(["cluster.backend=ray", "cluster.n_learner_ranks=2"]), summing_rank)
    try:
        for group in ("first", "restarted"):
            out = tmp_path / group
            out.mkdir()
            rank0 = placement.start("learner", 0, (str(out),))
            squatter = None
            with contextlib.suppress(OSError):  # another process on the node, as soon as the port is known
                squatter = socket.create_server(placement.master)
            try:
                rank1 = placement.start("learner", 1, (str(out),))
                assert [exit_code_within(rank, 120) for rank in (rank0, rank1)] == [0, 0], group
            finally:
                if squatter is not None:
                    squatter.close()
            assert squatter is None, group
            assert [(out / role_name("learner", i)).read_text() for i in range(2)] == ["3.0", "3.0"]
    finally:
        placement.close()
        cloudpickle.unregister_pickle_by_value(tests.helpers)


def omp_num_threads(role, index, *args):
    """A role's entry that exits with the OMP_NUM_THREADS it started with, 0 for none."""
    return int(os.environ.get("OMP_NUM_THREADS") or 0)


def test_a_role_s_omp_num_threads_is_the_run_s_else_its_node_s_own(monkeypatch):
    """Every actor started with the launcher's OMP_NUM_THREADS, or none: the one a node's own `ray start` had set (a
    node with fewer cores, say) was overridden. The run's setting wins; without one, the node's own holds."""
    from ray import cloudpickle
    from ray.cluster_utils import Cluster

    from rlsys.placement.ray_actors import RayPlacement

    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the node's own, as its `ray start` had it
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 3, "include_dashboard": False})
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import the tests
    codes = {}
    try:
        for run_setting in ("", "2"):
            if run_setting:
                monkeypatch.setenv("OMP_NUM_THREADS", run_setting)
            else:
                monkeypatch.delenv("OMP_NUM_THREADS")
            placement = RayPlacement(parse_config(["cluster.backend=ray", f"cluster.ray_address={cluster.address}"]),
                                     omp_num_threads)
            try:
                codes[run_setting] = exit_code_within(placement.start("inference", 0, ()), 60)
            finally:
                placement.close()
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        cluster.shutdown()
    assert codes == {"": 3, "2": 2}


def gomp_spincount(role, index, *args):
    """A role's entry that exits with the GOMP_SPINCOUNT it started with, 0 for none."""
    return int(os.environ.get("GOMP_SPINCOUNT") or 0)


def test_a_role_s_openmp_wait_is_the_run_s_else_its_node_s_own_else_the_short_spin(monkeypatch):
    """As for OMP_NUM_THREADS: every actor started with rlsys's GOMP_SPINCOUNT=1000 where the launcher had no OpenMP
    wait setting, overriding the one a node's own `ray start` had set, and with none (libgomp's long spin) where the
    launcher had one, which stayed on the launcher's machine. The run's setting wins; without one, the node's own
    holds; without either, the short spin."""
    from ray import cloudpickle
    from ray.cluster_utils import Cluster

    from rlsys.placement.ray_actors import RayPlacement

    for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY"):
        monkeypatch.delenv(name, raising=False)
    # Three bundles (a CPU each) on two nodes: a rollout worker's custom resource names the node it runs on
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {"plain": 1},
                                                            "include_dashboard": False})
    monkeypatch.setenv("GOMP_SPINCOUNT", "50")  # the node's own, as its `ray start` had it
    cluster.add_node(num_cpus=1, resources={"spinning": 1})
    monkeypatch.delenv("GOMP_SPINCOUNT")
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import the tests
    codes = {}
    try:
        for node, run_setting in (("plain", {}), ("spinning", {}), ("spinning", {"GOMP_SPINCOUNT": "7"}),
                                  ("plain", {"OMP_WAIT_POLICY": "PASSIVE"})):
            for name, value in run_setting.items():
                monkeypatch.setenv(name, value)
            placement = RayPlacement(parse_config(["cluster.backend=ray", f"cluster.ray_address={cluster.address}",
                                                   f"cluster.rollout_resources={node}:1"]), gomp_spincount)
            try:
                codes[node, *run_setting.values()] = exit_code_within(placement.start("rollout", 0, ()), 60)
            finally:
                placement.close()
            for name in run_setting:
                monkeypatch.delenv(name)
    finally:
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
        cluster.shutdown()
    assert codes == {("plain",): 1000, ("spinning",): 50, ("spinning", "7"): 7, ("plain", "PASSIVE"): 0}


SAVE_SECONDS = 3  # a role's save once told to stop: past the second Ray's shutdown gives each of its own processes


def saves_once_stopped(role, index, stop_file, saved_file, env):
    """A role's entry that, told to stop (`stop_file` there), takes SAVE_SECONDS to save, as a learner saves its
    checkpoint, then returns."""
    while not os.path.exists(stop_file):
        time.sleep(0.05)
    time.sleep(SAVE_SECONDS)
    Path(saved_file).write_text("saved")
    return 0


def test_a_role_told_to_stop_has_the_stops_grace_to_save_not_the_second_a_ray_process_gets(tmp_path):
    """A Ray of the run's own is shut down with a SIGTERM to each of its processes (which they block) and a SIGKILL a
    second later. A role's actor is not among them: the stop waits cluster.stop_grace_seconds for each role's run,
    and the placement (its actors, then that Ray) is closed only after, so a save that takes longer than the second
    is not cut off."""
    from ray import cloudpickle

    from rlsys.bus.inproc import InProcessBus
    from rlsys.placement.ray_actors import RayPlacement
    from rlsys.supervisor import stop_processes

    stop, saved = tmp_path / "stop", tmp_path / "saved"
    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray's workers cannot import the tests
    placement = RayPlacement(parse_config(["cluster.backend=ray"]), saves_once_stopped)
    try:
        role = placement.start("rollout", 0, (str(stop), str(saved)))
        stop.touch()  # the run's stop, as the bus's STOP tells a role
        unclean = stop_processes(InProcessBus(), [role], grace=60)
    finally:
        placement.close()
        cloudpickle.unregister_pickle_by_value(sys.modules[__name__])
    assert unclean == {} and role.exitcode == 0 and saved.read_text() == "saved"
