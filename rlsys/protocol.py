"""The names the roles use on the bus: one place, so every role agrees on them. The staleness gate's and the
prompt lifecycle's keys are rlsys.prompt_ledger's own; WEIGHT_CHECKS and DEAD_LETTERS, which a checkpoint records and
a resume restores, are written through rlsys.run_counters (DEAD_LETTERS' entries by rlsys.delivery). Which keys a
start of the roles deletes is said here too, beside them (cleared_at_a_start, KEPT_AT_A_START)."""

TRAJECTORIES = "trajectories"  # stream: finished episodes, one entry per prompt's group, read by LEARNERS
LEARNERS = "learners"  # the consumer group that reads TRAJECTORIES
DEAD_LETTERS = "trajectories:dead"  # stream: trajectory messages the learner could not use, with the reason
DEAD_MESSAGES = "messages:dead"  # stream: {"source", "reason", "size", "head"} of requests/replies a role refused
MAX_QUEUE_MESSAGE_BYTES = 64 * 2**20  # a generation request or reply larger than this is refused unread
MAX_REDIS_VALUE_MB = 512  # Redis takes no larger string in a command (proto-max-bulk-len's default)
# Seconds between an inference worker's status refreshes (its heartbeat); routers count a worker silent for
# cluster.inference_dead_after as dead, which must span several beats. Each beat takes the GIL from the engine loop.
HEARTBEAT_INTERVAL = 0.25
# Seconds between a rollout worker's publications of its running count (rollout_running), each with a new beat: the
# stall watch tells a count its event loop keeps publishing from one a blocked loop left behind.
ROLLOUT_BEAT_INTERVAL = 1.0
WEIGHTS = "weights:latest"  # key: the newest published policy (rlsys.api.messages.PublishedWeights)
DATASET_FINGERPRINT = "dataset:fingerprint"  # key: rlsys.data.dataset.rows_fingerprint of the training rows
WEIGHT_CHECKS = "weights:checks"  # counter: weight updates whose checksum an inference worker verified
LOGPROB_PROBES = "weights:probes"  # queue: each worker's logprobs of the learner's probe sequences, scored at load
LEARNER_DONE = "learner:final_version"  # key: set once the learner published its last version
# Not on the bus: the environment variable that hands learner rank 0 the rendezvous's listening socket (its descriptor)
# where whoever started it bound it (rlsys.placement.local), so that no other process can take the port meanwhile
RENDEZVOUS_LISTEN_FD = "RLSYS_RENDEZVOUS_LISTEN_FD"
STOP = "run:stop"  # key: set by the launcher to end every role
RESUMED_VERSION = "run:resumed_version"  # key: the version of the checkpoint the roles start from; 0 fresh


def replies(rollout_worker: int) -> str:
    """Queue of generation outputs for one rollout worker."""
    return f"act:{rollout_worker}"


def generation_requests(inference_worker: int) -> str:
    """Queue of generation requests for one inference worker (routers choose the worker)."""
    return f"inference:{inference_worker}:requests"


def inference_status(inference_worker: int) -> str:
    """Key: an inference worker's status (rlsys.api.messages.WorkerStatus), refreshed while it lives and
    marked dead by the launcher that saw its process exit (rlsys.workers.inference_status)."""
    return f"inference:{inference_worker}:status"


def inference_epoch(inference_worker: int) -> str:
    """Counter: how many processes have served as this inference worker (each restart adds one). Never reset (see
    KEPT_AT_A_START)."""
    return f"inference:{inference_worker}:epoch"


def eval_result(tag: str) -> str:
    """Key: held-out evaluation result ("initial", "final"), written through rlsys.evaluations."""
    return f"eval:{tag}"


def rollout_episodes(rollout_worker: int) -> str:
    """Set: ids of the training prompts a rollout worker is running; a restarted worker redoes them."""
    return f"rollout:{rollout_worker}:episodes"


def rollout_position(rollout_worker: int) -> str:
    """Counter: prompts a rollout worker took from its training stream; a restarted worker goes on from there."""
    return f"rollout:{rollout_worker}:position"


def rollout_running(rollout_worker: int) -> str:
    """Key: how many episodes a rollout worker's tasks are running now, with its beat
    (rlsys.api.messages.RolloutRunning, published every ROLLOUT_BEAT_INTERVAL s)."""
    return f"rollout:{rollout_worker}:running"


def rollout_done(rollout_worker: int) -> str:
    return f"rollout:{rollout_worker}:done"


def role_name(role: str, index: int) -> str:
    """A role process's name, e.g. "rollout0": its process, its log file and its stop reason's key are named by it."""
    return f"{role}{index}"


def role_stop_reason(role: str) -> str:
    """Key: why role `role` (a role_name, e.g. "rollout0") found that the run cannot go on, before it exited."""
    return f"role:{role}:stop_reason"


# The keys a start of the roles leaves as they are, and why; it deletes every other key named here
# (cleared_at_a_start; tests/test_import_layers.py checks that each key is in one or the other).
KEPT_AT_A_START = {
    "RESUMED_VERSION": "each start sets it",
    "WEIGHT_CHECKS": "rlsys.run_counters': a fresh run clears it, a resume takes it back to its checkpoint's count",
    "DEAD_LETTERS": "rlsys.run_counters': a fresh run clears it, a resume takes it back to its checkpoint's entries",
    # A router tells a restarted worker by a new epoch: counted on from any earlier process's, even of an earlier run
    # on the same Redis, no epoch is ever taken twice (and routers start with the roles, so none holds an old one)
    "inference_epoch": "each process takes the next epoch, never one that an earlier one published",
}


def cleared_at_a_start(n_learner_ranks: int, n_inference_workers: int, n_rollout_workers: int, fresh: bool,
                       keep_initial_eval: bool) -> list[str]:
    """The keys deleted before the roles start (rlsys.run_start), so that none finds what an earlier run, or the
    earlier part of this one, left: `fresh`, a run from no checkpoint, starts without the messages set aside too (a
    resume keeps its earlier part's); `keep_initial_eval`, the start of every role again after the learner died,
    keeps the initial evaluation, which tells rollout worker 0 it is no first start. The evaluations "step-N" are
    left: no role reads them."""
    return [STOP, LEARNER_DONE, WEIGHTS, LOGPROB_PROBES, TRAJECTORIES, DATASET_FINGERPRINT,
            *((DEAD_MESSAGES,) if fresh else ()),
            *(eval_result(tag) for tag in (("final",) if keep_initial_eval else ("initial", "final"))),
            *(role_stop_reason(role_name("learner", rank)) for rank in range(n_learner_ranks)),
            *(key for i in range(n_inference_workers)
              for key in (generation_requests(i), inference_status(i), role_stop_reason(role_name("inference", i)))),
            *(key for i in range(n_rollout_workers)
              for key in (replies(i), rollout_done(i), rollout_episodes(i), rollout_position(i), rollout_running(i),
                          role_stop_reason(role_name("rollout", i))))]
