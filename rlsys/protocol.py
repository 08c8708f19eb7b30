"""The names the roles use on the bus: one place, so every role agrees on them."""

OBSERVATIONS = "obs"  # queue: generation requests from rollout workers to inference workers
TRAJECTORIES = "trajectories"  # queue: finished episodes (one message per prompt's group)
WEIGHTS = "weights:latest"  # key: {"version", "path"} of the newest published policy
ADMITTED = "rollout:admitted"  # counter: prompts admitted for training, for the staleness gate
LEARNER_DONE = "learner:final_version"  # key: set once the learner published its last version
STOP = "run:stop"  # key: set by the launcher to end every role


def replies(rollout_worker: int) -> str:
    """Queue of generation outputs for one rollout worker."""
    return f"act:{rollout_worker}"


def inference_version(inference_worker: int) -> str:
    """Key: the weight version an inference worker currently serves."""
    return f"inference:{inference_worker}:version"


def eval_result(tag: str) -> str:
    """Key: held-out evaluation result ("initial", "final", "step-N")."""
    return f"eval:{tag}"


def rollout_done(rollout_worker: int) -> str:
    return f"rollout:{rollout_worker}:done"
