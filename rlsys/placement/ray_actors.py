"""Roles as Ray actors (`cluster.backend=ray`), placed by one placement group on a Ray cluster.

Ray is the engine: one placement group reserves a bundle per role process (CPU, the role's GPUs, its
custom resources) with `cluster.ray_placement_strategy`, all or nothing, so a layout the cluster cannot
hold is refused before anything runs. Each role is an actor pinned to its bundle. When a node dies, Ray
moves its bundles to nodes that can hold them; the supervisor sees the actor's death and starts a new
actor in the same bundle, which Ray schedules once the bundle is placed again. An actor Ray has not started
within PLACEMENT_TIMEOUT (no node left can hold its bundle) counts as a role that died, with that reason, rather
than one that runs. Actors are never restarted by Ray itself (max_restarts=0): the supervisor counts restarts the
same way on both backends.
"""

import os
import signal
import socket
import threading
import time

from rlsys.errors import RoleFailed
from rlsys.placement.base import Placement, PlacementError, RoleHandle, learner_rendezvous
from rlsys.placement.cpu_threads import OPENMP_WAIT_SETTINGS, role_environment
from rlsys.placement.process_end import HeldExitHandlers, end_role
from rlsys.placement.signal_mask import blocked_during
from rlsys.preflight import check_reachable
from rlsys.protocol import RENDEZVOUS_LISTEN_FD, role_name

PLACEMENT_TIMEOUT = 120.0  # seconds to wait for the cluster to reserve every bundle
CPUS_PER_ROLE = 1


class RoleActor:
    """A Ray actor that runs one role until it ends; `run` returns the role's exit code."""

    def __init__(self):
        self.rendezvous: socket.socket | None = None  # learner rank 0's listening socket (listen), until its run
        # Blocked by the Ray of the run's own, whose raylet started this worker (sigterm_left_to_the_launcher): a
        # SIGTERM sent to the actor alone ends it as Ray ends a worker
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
        # How OpenMP threads wait, read by libgomp as torch loads (the run's entry imports it, after this): the run's
        # setting, which the launcher sent along (RayPlacement.start); else the node's own, from its `ray start`;
        # else the short spin, as a local role gets it. Decided here, since only this process sees its node's
        # environment; the launcher's short spin overrode the node's own.
        os.environ.update(role_environment())
        # Before the run's arguments bring in the role's modules: the exit handlers they and its plugins register are
        # the role's, run as it ends (end_role), since the launcher kills this process once the run returned
        self.exit_handlers = HeldExitHandlers()

    def listen(self) -> tuple[str, int]:
        """Learner rank 0's rendezvous: a socket bound on this node's address, at a port the kernel picks, which the
        rank's run serves on; returns (address, port) for the other ranks. Bound here, in the process that serves it,
        since a launcher cannot hand a socket to a remote actor: a port picked free and bound by the rank once its
        role had started could be taken meanwhile, and the group failed (every role restarted)."""
        import ray

        host = ray.util.get_node_ip_address()
        self.rendezvous = socket.create_server((host, 0), family=socket.AF_INET6 if ":" in host else socket.AF_INET)
        return host, self.rendezvous.getsockname()[1]

    def ping(self) -> bool:
        return True

    def run(self, workdir: str, grace: float, entry, role: str, index: int, *args) -> int:
        """Runs in `workdir`, the launcher's working directory, as a role on one machine does, so that the config's
        relative paths (plugins=[my_plugin.py], a dataset's file) name what they name for the launcher; on a node
        without that directory they resolve against the node's own, as Ray started it. `grace`:
        cluster.stop_grace_seconds, whose share the role's end waits for its threads at most (rlsys/stop_grace.py)."""
        if os.environ.get("OMP_NUM_THREADS") == "":  # neither the run nor the node set it: not Ray's 1 in its place
            del os.environ["OMP_NUM_THREADS"]
        if self.rendezvous is not None:  # rlsys.distributed.rendezvous_store serves on it
            os.environ[RENDEZVOUS_LISTEN_FD] = str(self.rendezvous.detach())
        if os.path.isdir(workdir):
            os.chdir(workdir)
        else:
            print(f"{role_name(role, index)}: the launcher's directory {workdir} is not on this node; relative paths "
                  f"in the config resolve against {os.getcwd()}", flush=True)
        threads = set(threading.enumerate())
        try:
            return entry(role, index, *args)
        finally:  # before the reply: the launcher kills this process once it has the role's code
            end_role(self.exit_handlers, threads, grace)


class RayRole(RoleHandle):
    def __init__(self, name: str, actor, done, started, bundle: dict):
        self.name, self.actor, self.done = name, actor, done
        self._code: int | None = None
        self._reason = ""
        self._probe = None  # a ping sent after the actor was out of reach
        # A ping sent before its run, answered once Ray has started the actor (then None); still unanswered at
        # `_place_by` (monotonic), the actor's bundle fits on no node left
        self._started, self._bundle = started, bundle
        self._place_by = time.monotonic() + PLACEMENT_TIMEOUT

    @property
    def exitcode(self) -> int | None:
        import ray

        if self._code is None and self._started is not None:
            if ray.wait([self._started], timeout=0)[0]:
                self._started = None
            elif time.monotonic() > self._place_by:
                self._code, self._reason = -1, not_placed(self._bundle)
                ray.kill(self.actor, no_restart=True)
        waiting_on = self._probe or self.done
        if self._code is None and ray.wait([waiting_on], timeout=0)[0]:
            try:
                code = ray.get(waiting_on)
                if waiting_on is self.done:
                    self._code = code
                else:  # alive, but its run was lost while it was out of reach: it cannot go on
                    self._code, self._reason = -1, "lost its run while it was out of reach"
            except ray.exceptions.ActorUnavailableError:
                # Its node may be dying: ask again until Ray says dead, so that a new actor is not sent to
                # a bundle still placed on the dead node (and the one death counted as two restarts).
                self._probe = self.actor.ping.remote()
            except ray.exceptions.RayError as e:  # its run raised, or the actor died: killed, node lost, memory
                self._code = -1
                self._reason = "died: " + (str(e).strip().splitlines() or [type(e).__name__])[0][:300]
            if self._code is not None:
                # An actor outlives its run (returned or raised) and holds its bundle's CPU: free the bundle for
                # the role's next actor (a restart, or every role after the learner died), which Ray would
                # otherwise never schedule.
                ray.kill(self.actor, no_restart=True)
        return self._code

    @property
    def exit_reason(self) -> str:
        return self._reason if self.exitcode == -1 and self._reason else super().exit_reason

    def join(self, timeout: float) -> None:
        import ray

        ray.wait([self.done], timeout=timeout)

    def kill(self) -> None:
        import ray

        ray.kill(self.actor, no_restart=True)
        ray.wait([self.done], timeout=30)


def sigterm_left_to_the_launcher(init) -> None:
    """Runs `init` (ray.init) so that a SIGTERM stops the run through the launcher's stop alone.

    The SIGTERM handler of the caller (the launcher's, rlsys.bus.raise_on_sigterm) is still in place after it.
    ray.init installs its own, and its core worker a crash handler that reports a SIGTERM, calls the one before it,
    and aborts the process 3 s later: the launcher's stop (every role told to stop, then Ray shut down) would be cut
    short, the roles killed without their checkpoint and Ray's agents left running.

    And the processes a Ray of the run's own starts (its GCS, raylet and agents) start with SIGTERM blocked (a signal
    mask outlives exec), as Ray starts them with SIGINT blocked: they are in the launcher's process group, so a
    SIGTERM to the group (Slurm's scancel, systemd's stop, `kill -TERM -PGID`) stopped them at once, every role with
    them, and the launcher's stop waited on the lost cluster until Ray's client aborted it a minute later (exit 1).
    The launcher's stop shuts that Ray down (SIGKILL after a second each). Its workers are each in a group of their
    own, and a role's actor takes SIGTERM back (RoleActor). The threads ray.init makes in the launcher keep SIGTERM
    blocked too: none starts a process (Ray starts its own from the thread that calls ray.init), and the launcher's
    main thread, unblocked again, takes the signal.

    A thread the launcher had before does not block it (torch's intra-op threads, which the tiny model's warm start
    leaves), and takes a SIGTERM that comes during ray.init at once: Ray's crash handler aborted the launcher there. So
    the launcher's core worker installs none (a crash of the launcher's own prints no C++ stack then; Ray's other
    processes, the roles' among them, keep theirs), and Ray's own SIGTERM handler, whose sys.exit(SIGTERM) the main
    thread then runs, is taken as the launcher's."""
    import ray._private.ray_constants as ray_constants  # read as ray.init makes the core worker

    main = threading.current_thread() is threading.main_thread()  # only the main thread sets handlers
    handler = signal.getsignal(signal.SIGTERM) if main else None
    # Ray's own setting (checked with Ray 2.60); a Ray without it runs as before rather than failing every start
    crash_handler_off = getattr(ray_constants, "RAY_DISABLE_FAILURE_SIGNAL_HANDLER", False)

    def init_then_handler_back() -> None:
        ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = True
        try:
            try:
                init()
            finally:
                ray_constants.RAY_DISABLE_FAILURE_SIGNAL_HANDLER = crash_handler_off
                # While SIGTERM is still blocked: one that came during ray.init and no thread took comes, as it is
                # unblocked, to the launcher's handler
                if handler is not None:
                    signal.signal(signal.SIGTERM, handler)
        except SystemExit as e:  # Ray's SIGTERM handler's, run for one that a thread of the launcher took
            if e.code != signal.SIGTERM or not callable(handler):
                raise
            signal.signal(signal.SIGTERM, handler)  # where the exit came before the handler was put back
            handler(signal.SIGTERM, None)
            raise  # a handler that returns: ray.init was cut short all the same

    blocked_during({signal.SIGTERM}, init_then_handler_back)


def join_or_start_ray(cluster, cpus: int) -> None:
    """ray.init: joins the cluster `cluster.ray_address` names, else starts a Ray for this run alone with `cpus`
    logical CPUs at least (one per role, even on a small machine). PlacementError where no cluster answers."""
    import ray

    if cluster.ray_address:
        try:
            check_reachable(cluster.ray_address)
            ray.init(address=cluster.ray_address, log_to_driver=True)
        except ConnectionError as e:  # nothing started yet: refused as a layout that cannot be placed
            raise PlacementError(
                f"cluster.ray_address={cluster.ray_address}: no Ray cluster answered "
                f"({str(e).splitlines()[0]}); start one (`ray start --head` on its head node), fix the "
                "address, or leave cluster.ray_address empty to start a Ray for this run alone") from None
    else:  # "local": not the cluster RAY_ADDRESS or an earlier `ray start` here names, which ray.init joins by default
        ray.init(address="local", num_cpus=max(os.cpu_count() or 1, cpus), include_dashboard=False)


def not_placed(bundle: dict) -> str:
    import ray

    return (f"was not started by Ray within {PLACEMENT_TIMEOUT:.0f} s: no node of the cluster can hold its bundle "
            f"{bundle} now (a node it needs was lost?); the cluster has free: {ray.available_resources()}")


class RayPlacement(Placement):
    def __init__(self, config, entry):
        import ray
        from ray.util.placement_group import placement_group

        cluster = config.cluster
        self.config, self.entry = config, entry
        self.bundles = {}  # (role, index) -> (bundle index, actor options)
        bundles = []
        for role, count, gpus in (("learner", cluster.n_learner_ranks, cluster.learner_gpus // cluster.n_learner_ranks),
                                  ("inference", cluster.n_inference_workers, cluster.gpus_per_inference_worker),
                                  ("rollout", cluster.n_rollout_workers, 0)):
            custom = cluster.resources(role)
            for index in range(count):
                options = dict(num_cpus=CPUS_PER_ROLE, num_gpus=gpus, resources=custom)
                self.bundles[(role, index)] = (len(bundles), options)
                bundles.append({"CPU": CPUS_PER_ROLE, **({"GPU": gpus} if gpus else {}), **custom})
        tp = config.inference.tensor_parallel_size
        if tp > max(cluster.gpus_per_inference_worker, 1):
            raise PlacementError(f"inference.tensor_parallel_size={tp} on Ray needs "
                                 f"cluster.gpus_per_inference_worker >= {tp} (it is "
                                 f"{cluster.gpus_per_inference_worker}): an actor sees only the GPUs it asked for")
        if cluster.ray_address.startswith("ray://") and not cluster.redis_url:
            raise PlacementError("cluster.ray_address=ray://... runs this launcher off the cluster, where a private "
                                 "Redis is out of the nodes' reach: set cluster.redis_url to a Redis every node "
                                 "reaches, or run the command on a node of the cluster with cluster.ray_address=auto")
        sigterm_left_to_the_launcher(lambda: join_or_start_ray(cluster, CPUS_PER_ROLE * len(bundles)))
        # other nodes reach a private Redis on this node's address; a Ray of this run's own has only this machine
        self.bus_host = ray.util.get_node_ip_address() if cluster.ray_address else "127.0.0.1"
        self.group = placement_group(bundles, strategy=cluster.ray_placement_strategy, name="")
        if not self.group.wait(PLACEMENT_TIMEOUT):
            available = ray.available_resources()
            self.close()
            raise PlacementError(f"the Ray cluster could not hold the run's roles within {PLACEMENT_TIMEOUT:.0f}s "
                                 f"(strategy {cluster.ray_placement_strategy}); they need, one bundle each: {bundles}; "
                                 f"the cluster has free: {available}. Fewer workers, fewer GPUs or resources per role, "
                                 "or another cluster.ray_placement_strategy would fit")
        self.actor_class = ray.remote(max_restarts=0)(RoleActor)
        self.roles: list[RayRole] = []
        self.master = ("", 0)

    def start(self, role: str, index: int, args: tuple) -> RoleHandle:
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        bundle, options = self.bundles[(role, index)]
        # Read by libgomp as torch loads: set before the actor's process starts. Where OMP_NUM_THREADS is not set,
        # Ray sets it to the actor's CPUs, 1: the role's torch (an inference worker left to the engine's choice)
        # and every process it starts would have one thread, where a role on one machine gets its cores. So the
        # run's own setting, the launcher's, goes along (a local role inherits it); without one, the node's own
        # (its `ray start` environment, a node with fewer cores, say), which Ray puts for "${...}" as it starts the
        # worker; without either, "", which the actor removes before the role imports torch: the role's threads are
        # then counted from its node's cores (cpu_threads.role_threads runs in the role).
        # How OpenMP threads wait goes along where the run set it; the actor decides the rest (RoleActor).
        added = {**{name: os.environ[name] for name in OPENMP_WAIT_SETTINGS if name in os.environ},
                 "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "${OMP_NUM_THREADS}")}
        actor = self.actor_class.options(
            scheduling_strategy=PlacementGroupSchedulingStrategy(placement_group=self.group,
                                                                 placement_group_bundle_index=bundle),
            runtime_env={"env_vars": added}, **options).remote()
        started = actor.ping.remote()  # before the run: an actor answers in the order it was asked
        # Ray sets CUDA_VISIBLE_DEVICES only for an actor given GPUs: one given none would see every GPU of its node,
        # those Ray gave other actors included, and its torch would compute on them
        env = {} if options["num_gpus"] else {"CUDA_VISIBLE_DEVICES": ""}
        if role == "learner":
            import ray

            if index == 0:  # rank 0 hosts the rendezvous of a new group of ranks, on a port it holds from here
                address = actor.listen.remote()
                if not ray.wait([address], timeout=PLACEMENT_TIMEOUT)[0]:
                    ray.kill(actor, no_restart=True)
                    raise RoleFailed(f"learner0 {not_placed(self.group.bundle_specs[bundle])}")
                self.master = ray.get(address)
            env.update(learner_rendezvous(index, self.config.cluster.n_learner_ranks, *self.master))
        running = actor.run.remote(os.getcwd(), self.config.cluster.stop_grace_seconds, self.entry, role, index, *args,
                                   env)
        handle = RayRole(role_name(role, index), actor, running, started, self.group.bundle_specs[bundle])
        self.roles.append(handle)
        return handle

    def close(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for handle in getattr(self, "roles", []):
            ray.kill(handle.actor, no_restart=True)
        if getattr(self, "group", None) is not None:
            remove_placement_group(self.group)
            self.group = None
        ray.shutdown()  # disconnects; a Ray started for this run stops with it
