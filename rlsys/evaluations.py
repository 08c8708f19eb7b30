"""The held-out evaluations' results. Rollout worker 0 runs one at each start of the roles (INITIAL), every eval_steps
versions and after the last (FINAL), and logs each to its records at the oldest version that generated a token of it
(VERSION). Inference loads new weights while one runs beside training, so they run one at a time, the next due at the
next multiple of eval_steps after the newest version the last one measured, and FINAL is the last one where that
measured the final weights alone: no two measure the same weights, nor log one version twice. Each is logged (the
console's lines, the report's curve, TensorBoard). INITIAL and FINAL (ON_THE_BUS) also go on the bus
(protocol.eval_result): the learner's checkpoint keeps the run's first, the launcher's summary reports the two as
before and after, and its console and stall watch tell by the initial one whether the run is still starting. The
summary's learning curve, every evaluation, is read back from the records (`curve`), which a resume takes back to its
step as it does the learner's. One owner, so that every reader means the same by "the initial evaluation has ended"
and by an evaluation's figures."""

from pathlib import Path

from rlsys import protocol
from rlsys.metrics import read_jsonl_metrics, records_file, rollout_records

INITIAL, FINAL = "initial", "final"
ON_THE_BUS = (INITIAL, FINAL)
PREFIX = "eval/"  # an evaluation's figures in the records: eval/accuracy, eval/reward_of_ended, eval/version, ...
# An evaluation's figures, named as on the bus (`figures`); rlsys/workers/rollout_worker.py, evaluate, writes them.
# The two figures count different episodes, and are named for them: a failed episode has no reward to average (any
# number given it would be invented: 0 is above a wrong answer's reward where that is negative), while a held-out
# problem it failed on was not solved (left out, failures would raise the accuracy).
ACCURACY = "accuracy"  # the share of its problems solved: the mean score of every episode, a failed one's 0, where
#   each has a score (for most, its success)
REWARD_OF_ENDED = "reward_of_ended"  # the mean reward of the episodes that ended (EPISODES), in every evaluation
VERSION = "version"  # the oldest weight version that generated a token of it, the step its row is logged at
VERSION_MAX = "version_max"  # the newest, only where it is not VERSION (new weights came while it ran)
EPISODES = "episodes"  # its episodes that ended, each with at least one trajectory
FAILED = "failed"  # its episodes that failed (an agent's or environment's error), in ACCURACY as unsolved, not in
#   REWARD_OF_ENDED
# A run's records and checkpoints from before REWARD_OF_ENDED was named so (2026-12-07) hold that figure as "reward":
# read back under today's name, so that a report, console or resume of such a run keeps its held-out reward.
EARLIER_NAMES = {"reward": REWARD_OF_ENDED}


def record(bus, tag: str, result: dict) -> None:
    bus.set(protocol.eval_result(tag), result)


def result(bus, tag: str) -> dict | None:
    """The result of the evaluation `tag`; None until it has ended."""
    return bus.get(protocol.eval_result(tag))


def initial_evaluation_ended(bus) -> bool:
    """Whether this start of the roles' first evaluation (a resumed run's, of its checkpoint's weights) has ended: until
    it has, the run is starting."""
    return bool(result(bus, INITIAL))


def records_path(log_dir: Path) -> Path:
    """Where every evaluation is logged: rollout worker 0's records in `log_dir`."""
    return records_file(log_dir, rollout_records(0))


def figures(row: dict) -> dict:
    """An evaluation's figures in a row of its records, named as the bus names them ({VERSION, ACCURACY,
    REWARD_OF_ENDED, EPISODES, FAILED, ...}); empty where the row is not an evaluation's."""
    return named_now({key.removeprefix(PREFIX): value for key, value in row.items() if key.startswith(PREFIX)})


def named_now(evaluation: dict) -> dict:
    """An evaluation's figures under today's names, one an earlier run wrote under its EARLIER_NAMES renamed."""
    return {EARLIER_NAMES.get(key, key): value for key, value in evaluation.items()}


def headline(evaluation: dict) -> str:
    """Which figure an evaluation is told by: its ACCURACY, or where its episodes have no success to count (rewards
    from a reward model), the mean reward of those that ended, REWARD_OF_ENDED."""
    return ACCURACY if ACCURACY in evaluation else REWARD_OF_ENDED


def curve(log_dir: Path) -> list[dict]:
    """Every evaluation of the run, oldest first, as the bus holds INITIAL and FINAL (`figures`): from its records
    in `log_dir`; empty where it has none."""
    path = records_path(log_dir)
    rows = read_jsonl_metrics(path) if path.exists() else []
    return [evaluation for evaluation in map(figures, rows) if evaluation]
