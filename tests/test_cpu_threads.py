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


@pytest.mark.parametrize("overrides,cores,learner", [
    (["cluster.colocate=true", "max_head_offpolicyness=0"], 2, 2),  # the phases take turns: each gets every core
    (["cluster.colocate=true", "max_head_offpolicyness=0", "learner.num_threads=1"], 16, 1),
])
def test_colocated_roles_each_get_every_core(overrides, cores, learner):
    config = parse_config(overrides)
    assert role_threads("learner", config, cores) == learner
    assert role_threads("inference", config, cores) == cores
    assert role_threads("rollout", config, cores) == 1


@pytest.mark.parametrize("overrides,reason", [
    (["cluster.colocate=true"], "needs max_head_offpolicyness=0"),  # the default gate (2) would overlap the phases
    (["cluster.colocate=true", "max_head_offpolicyness=0", "inference.num_threads=0"], "leave inference.num_threads"),
    (["cluster.colocate=true", "max_head_offpolicyness=0", "cluster.n_inference_workers=2"], "n_inference_workers=1"),
    (["cluster.colocate=true", "max_head_offpolicyness=0", "cluster.n_learner_ranks=2"], "n_learner_ranks=1"),
])
def test_colocation_that_could_not_take_turns_is_refused(overrides, reason):
    with pytest.raises(ConfigError, match=reason):
        parse_config(overrides)
