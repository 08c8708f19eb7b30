"""The names of the learner's figures in its records (learner.jsonl, rlsys/metrics.py) that modules other than their
writers read: the console's progress lines, the run report and the benchmarks. The writers (the learner's loop, its
learning step, the logprob alarms) import torch, which the console and the report must not, so the names have this
owner, which imports nothing: a figure renamed here is renamed for its readers too."""

# The batch's mean reward, the training curve of the console's lines and the report
BATCH_REWARD = "reward"

# Where a step's time went, in the order the report shows them: waiting for its batch, the update, publishing the
# weights, saving a checkpoint
WAIT_DATA = "time/wait_data"
COMPUTE = "time/compute"
PUBLISH = "time/publish"
SAVE = "time/save"
TIME_KEYS = (WAIT_DATA, COMPUTE, PUBLISH, SAVE)

# How many versions behind the learner the batch's generated tokens were when it was consumed (AReaL's eta bounds
# the max)
STALENESS_MEAN = "staleness_mean"
STALENESS_MAX = "staleness_max"

# The two logprob comparisons (rlsys/alarms.py), the prefixes of their figures (<prefix>_abs_diff_mean,
# _abs_diff_max, _kl, _tokens): tokens sampled by the learner's own version, and the probe
LOGPROB_ALARM = "alarms/logprob"
PROBE_ALARM = "alarms/probe"

# The agents' own metrics of a trajectory (Trajectory.metrics, named by the agent that writes them: multi_turn's
# TURNS, token_continuity's PREFIX_BREAKS), each the batch's mean under this prefix, so that none shadows the
# learner's own
AGENT_PREFIX = "agent/"


def agent_figure(metric: str) -> str:
    """The name of the learner's figure of the agents' `metric`."""
    return f"{AGENT_PREFIX}{metric}"


def label(key: str) -> str:
    """The name of a figure of a group ("time/...", "alarms/...") without the group, as the report labels it."""
    return key.partition("/")[2]
