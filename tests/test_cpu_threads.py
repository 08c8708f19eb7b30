"""Each role's torch threads: the learner gets the cores the run's other roles leave, unless told otherwise."""

import pytest

from rlsys.cli import ConfigError, parse_config
from rlsys.placement.cpu_threads import role_threads


@pytest.mark.parametrize("overrides,cores,learner", [
    ([], 2, 1),  # the default run on a 2-core machine: inference and rollout take one core each
    ([], 16, 14),
    (["cluster.n_inference_workers=2", "inference.num_threads=3"], 16, 9),
    (["inference.num_threads=0"], 16, 1),  # the engine's choice: about one thread per core, none left
    (["learner.num_threads=2"], 2, 2),  # set by hand: taken as it is
])
def test_learner_threads_are_the_cores_left_by_the_other_roles(overrides, cores, learner):
    config = parse_config(overrides)
    assert role_threads("learner", config, cores) == learner
    assert role_threads("inference", config, cores) == config.inference.num_threads
    assert role_threads("rollout", config, cores) == 1


def test_a_negative_thread_count_is_refused():
    with pytest.raises(ConfigError, match="learner.num_threads must be at least 0"):
        parse_config(["learner.num_threads=-1"])
