"""Each role's torch threads and how its OpenMP threads wait: roles start with threads that sleep soon, and the
learner gets the cores the run's other roles leave."""

import json
import os

import pytest

from rlsys.cli import ConfigError, parse_config
from rlsys.placement.cpu_threads import OPENMP_WAIT_SETTINGS, role_environment, role_threads, warm_start_threads
from rlsys.placement.local import LocalPlacement



@pytest.mark.parametrize("overrides,cores,learner", [
    ([], 2, 1),  # the default run on a 2-core machine: inference and rollout take one core each
    ([], 16, 14),
    (["cluster.n_learner_ranks=2"], 16, 7),
    (["cluster.n_inference_workers=2", "inference.num_threads=3"], 16, 9),
    (["inference.num_threads=0"], 16, 1),  # the engine's choice: about one thread per core, none left
    (["learner.num_threads=2"], 2, 2),  # set by hand: taken as it is
])
def test_the_learner_gets_the_cores_left_by_the_other_roles(overrides, cores, learner):
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


def test_the_users_own_wait_setting_wins():
    assert role_environment({}) == {"GOMP_SPINCOUNT": "1000"}
    assert role_environment({"OMP_WAIT_POLICY": "ACTIVE"}) == {}
    assert role_environment({"GOMP_SPINCOUNT": "50000"}) == {}


def test_the_warm_start_takes_every_core_unless_the_learner_has_a_setting(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2})
    assert warm_start_threads(parse_config([])) == 3  # it runs before any role: nothing else wants the cores
    assert warm_start_threads(parse_config(["learner.num_threads=1"])) == 1


TORCH_OF_THE_WARM_START = """
import json, os, sys
from rlsys.assets import prepare_assets
from rlsys.cli import parse_config

def as_torch_loads(event, args):  # libgomp reads how its threads wait as torch loads it
    if event == "import" and args[0] == "torch":
        print(json.dumps({name: os.environ.get(name) for name in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}), flush=True)
        os._exit(0)

sys.addaudithook(as_torch_loads)
prepare_assets(parse_config(sys.argv[1:]), log=lambda line: None)
print("torch was not loaded", flush=True)
"""


@pytest.mark.parametrize("users,loaded_with", [
    ({}, {"GOMP_SPINCOUNT": "1000", "OMP_WAIT_POLICY": None}),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": None, "OMP_WAIT_POLICY": "ACTIVE"}),
])
def test_the_warm_start_s_threads_wait_as_a_role_s_do(users, loaded_with, tmp_path):
    """The launcher loaded torch for the tiny model's warm start with libgomp's default spin: beside two busy
    processes on 2 cores, its threads spun while the one they waited for needed the core, and a warm start of a few
    minutes took over 15."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    environment = {name: value for name, value in os.environ.items() if name not in OPENMP_WAIT_SETTINGS}
    loading = subprocess.run([sys.executable, "-c", TORCH_OF_THE_WARM_START, f"model.cache_dir={tmp_path / 'cache'}",
                              f"output_dir={tmp_path / 'out'}"], capture_output=True, text=True, timeout=300,
                             cwd=tmp_path, env={**environment, **users, "PYTHONPATH": str(root)})
    assert loading.returncode == 0, loading.stderr
    assert json.loads(loading.stdout) == loaded_with


def report_environment(role, index, path, env):
    """A role entry that writes what its process started with (the OpenMP settings) and the launcher's `env`."""
    with open(path, "w") as f:
        json.dump({"GOMP_SPINCOUNT": os.environ.get("GOMP_SPINCOUNT"),
                   "OMP_WAIT_POLICY": os.environ.get("OMP_WAIT_POLICY"), "env": env}, f)
    return 0


@pytest.mark.parametrize("users,started_with", [
    ({}, {"GOMP_SPINCOUNT": "1000", "OMP_WAIT_POLICY": None}),
    ({"OMP_WAIT_POLICY": "ACTIVE"}, {"GOMP_SPINCOUNT": None, "OMP_WAIT_POLICY": "ACTIVE"}),
])
def test_a_local_role_starts_with_the_wait_setting_and_the_launcher_keeps_its_own(users, started_with, tmp_path,
                                                                                    monkeypatch):
    for name in OPENMP_WAIT_SETTINGS:
        monkeypatch.delenv(name, raising=False)
    for name, value in users.items():
        monkeypatch.setenv(name, value)
    before = dict(os.environ)
    placement = LocalPlacement(parse_config([]), report_environment)
    role = placement.start("rollout", 0, (str(tmp_path / "env.json"),))
    role.join(60)
    assert role.exitcode == 0
    seen = json.loads((tmp_path / "env.json").read_text())
    assert {k: seen[k] for k in started_with} == started_with
    assert dict(os.environ) == before  # the launcher's own environment is as it was
