"""How many CPU threads each role's torch gets, and how its OpenMP threads wait, so roles on one machine share it.

torch computes with OpenMP (libgomp), whose threads spin while they wait for each other, by default for about
300,000 turns of a loop before they sleep. Roles that spin steal cores from each other: on a machine with few
cores, 2 learner threads beside the inference worker made a run slower than 1 thread, much slower under load
(BENCHMARKS.md, "Learner threads"), because a thread that waits spins on the core the thread it waits for needs.
So every role starts with `GOMP_SPINCOUNT=1000` (libgomp reads it once, when torch loads, so the launcher puts it in
each role's environment before the process starts): a waiting thread spins a thousand turns, then sleeps. Unless
the user set `GOMP_SPINCOUNT` or `OMP_WAIT_POLICY` for the run: theirs win. A Ray actor gets the run's where it has
one; else its node's own, from that node's `ray start`; else the short spin (rlsys/placement/ray_actors.py).

The learner gets the cores the run's other roles do not claim, and never fewer than one:

    learner threads per rank = max(1, (cores - inference threads - rollout workers) // learner ranks)

where each inference worker claims its `inference.num_threads` (0, the engine's choice, claims every core), and each
rollout worker one core: on 2 cores, 1. Until the learner computed each group's prompt once it took every core when
threads slept soon, since its second thread found the others' idle moments; with that step about halved, the
inference and rollout workers need their core, and 1 learner thread trained 1.14-1.19x the samples/s of 2
(BENCHMARKS.md, "Learner threads"). Under `cluster.backend=ray` the roles may be on other nodes and `cores` is the
learner's node's; the rule still counts the other roles there, which errs on the side of too few threads: set
`learner.num_threads` there. A Ray actor's OMP_NUM_THREADS (read by torch as it loads, and by the processes a role
starts) is the run's, the launcher's, where it has one (a local role inherits it); else its node's own, from that
node's `ray start`; else none, as for a local role, not the 1 Ray sets for an actor of one CPU
(rlsys/placement/ray_actors.py).

Colocated (`cluster.colocate=true`) the roles take turns instead: the synchronous gate keeps inference idle
while the learner trains and the learner idle while inference generates, so each gets every core (unless its
own `num_threads` says otherwise).
"""

import contextlib
import os

INFERENCE = "inference"
LEARNER = "learner"


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, e.g. under taskset or a container's cpuset)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


SHORT_SPIN = 1000  # turns of libgomp's wait loop before a thread sleeps (its default is 300,000)
ROLE_ENVIRONMENT = {"GOMP_SPINCOUNT": str(SHORT_SPIN)}
OPENMP_WAIT_SETTINGS = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")


def role_environment(environ=os.environ) -> dict[str, str]:
    """What the launcher adds to each role's environment: the short spin, unless the user chose how threads wait."""
    return {} if any(name in environ for name in OPENMP_WAIT_SETTINGS) else dict(ROLE_ENVIRONMENT)


@contextlib.contextmanager
def role_environment_applied():
    """os.environ with role_environment() added for a moment: while a role process is spawned, or while the launcher
    loads torch for the tiny model's warm start (libgomp reads the setting as it loads, and only then): the warm
    start's threads spun out libgomp's default while the one they waited for needed the core, and beside other busy
    processes it crawled."""
    added = role_environment()
    saved = {name: os.environ.get(name) for name in added}
    os.environ.update(added)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def torch_loaded_with_the_roles_spin() -> None:
    """Load torch in this process (if it is not yet) as a role loads it, with the short spin: libgomp reads how its
    threads wait as torch loads, and only then. For the launcher's warm start and pytest, which load torch in their
    own process rather than in a role's."""
    with role_environment_applied():
        __import__("torch")  # as an import statement loads it, its "import" audit event included


def role_threads(role: str, config, cores: int | None = None) -> int:
    """torch threads for a process of `role`; 0 leaves the choice to the engine (inference.num_threads=0)."""
    colocated = config.cluster.colocate
    if role == INFERENCE:
        return cores or available_cores() if colocated else config.inference.num_threads
    if role == LEARNER and hasattr(config, "learner"):
        if config.learner.num_threads:
            return config.learner.num_threads
        if colocated:
            return cores or available_cores()
        return auto_learner_threads(config, cores or available_cores())
    return 1  # rollout workers (asyncio: agents wait on queues) and anything else


def auto_learner_threads(config, cores: int) -> int:
    """The cores the other roles of the run do not claim, split over the learner's ranks; at least 1."""
    cluster = config.cluster
    per_inference_worker = config.inference.num_threads or cores
    claimed = cluster.n_inference_workers * per_inference_worker + cluster.n_rollout_workers
    return max(1, (cores - claimed) // cluster.n_learner_ranks)


def warm_start_threads(config) -> int:
    """The tiny model's warm start's threads: `learner.num_threads` if set, else every core, since it runs alone,
    before any role starts (on 2 cores 1.4-1.8x faster a step than 1 thread; BENCHMARKS.md, "Cold starts"), with the
    roles' short spin (role_environment_applied, where the launcher has not loaded torch before). A thread count
    changes the order of float sums, so the model's bits: a cached model is kept whatever built it."""
    if hasattr(config, "learner") and config.learner.num_threads:
        return config.learner.num_threads
    return available_cores()
