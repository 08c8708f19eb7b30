"""How many CPU threads each role's torch gets, so the roles on one machine share its cores without contending.

torch computes with OpenMP, whose threads spin while they wait for each other: a role with more threads than
the cores left to it does not slow down gracefully, it stalls whenever one of its threads is descheduled. On
the 2-core machine the benchmarks run on, the learner's step took 0.86-1.19 s with 1 thread and 1.0-3.2 s with
2 beside other work (BENCHMARKS.md, "Learner threads"). So the learner gets by default the cores the other
roles of a local run do not claim, and never fewer than one:

    learner threads per rank = max(1, (cores - inference threads - rollout workers) // learner ranks)

where each inference worker claims its `inference.num_threads` (0, the engine's choice, claims every core),
and each rollout worker one core (its agents, environments and reward checks run on it). Under
`cluster.backend=ray` the roles may be on other nodes; the rule still counts them all on the learner's node,
which errs on the side of too few threads: set `learner.num_threads` there.

Colocated (`cluster.colocate=true`) the roles take turns instead: the synchronous gate keeps inference idle
while the learner trains and the learner idle while inference generates, so each gets every core (unless its
own `num_threads` says otherwise).
"""

import os

INFERENCE = "inference"
LEARNER = "learner"


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, e.g. under taskset or a container's cpuset)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def role_threads(role: str, config, cores: int | None = None) -> int:
    """torch threads for a process of `role`; 0 leaves the choice to the engine (inference.num_threads=0)."""
    colocated = config.cluster.colocate
    if role == INFERENCE:
        return cores or available_cores() if colocated else config.inference.num_threads
    if role == LEARNER and hasattr(config, "learner"):
        if config.learner.num_threads:
            return config.learner.num_threads
        return cores or available_cores() if colocated else auto_learner_threads(config, cores or available_cores())
    return 1  # rollout workers (asyncio: agents wait on queues) and anything else


def auto_learner_threads(config, cores: int) -> int:
    """The cores the other roles of the run do not claim, split over the learner's ranks; at least 1."""
    cluster = config.cluster
    per_inference_worker = config.inference.num_threads or cores
    claimed = cluster.n_inference_workers * per_inference_worker + cluster.n_rollout_workers
    return max(1, (cores - claimed) // cluster.n_learner_ranks)
