"""Every registered experiment runs with its defaults, as a new user would start it: from an empty cache
(dataset generated, tiny model built and warm-started), two steps, trained prompts, no error."""

import os

import pytest

import experiments
from experiments import EXPERIMENTS
from rlsys.cli import parse_config
from rlsys.launcher import launch

BUILT_IN = [name for name in EXPERIMENTS.names() if EXPERIMENTS.lookup(name).__module__.startswith("experiments.")]


def test_every_built_in_experiment_is_covered():
    assert set(BUILT_IN) >= {"async-ppo-math", "async-ppo-math-tools", "async-ppo-math-multi-turn",
                             "async-ppo-frozen-lake", "async-ppo-sokoban", "async-ppo-webshop", "async-ppo-mixed-games"}
    assert experiments.__all__  # the package registers them on import


# Off in CI for now: from an empty cache the warm starts of the multi-turn experiments take minutes each on two cores
# (the WebShop and game walks are hundreds of tokens a sequence), so the seven runs do not fit the suite's budget.
@pytest.mark.skipif(not os.environ.get("RLSYS_TEST_EXPERIMENT_DEFAULTS"),
                    reason="set RLSYS_TEST_EXPERIMENT_DEFAULTS=1: each experiment's cold start takes minutes")
@pytest.mark.parametrize("name", BUILT_IN)
def test_each_experiment_trains_two_steps_with_its_defaults(tmp_path, name):
    config = parse_config([f"experiment={name}", f"model.cache_dir={tmp_path / 'cache'}",
                           f"output_dir={tmp_path / 'runs'}", "max_steps=2"])
    summary = launch(config)
    prompts = summary["prompts"]
    assert summary["prompts_accounted"], prompts
    assert prompts["trained"] >= 2 * config.ppo.batch_size, prompts
    assert summary["initial_accuracy"] is not None and summary["final_accuracy"] is not None


def test_a_run_that_cannot_go_on_ends_with_one_error_line(monkeypatch, capsys):
    import importlib.util
    from pathlib import Path

    from rlsys.supervisor import RoleFailed

    entry = Path(__file__).resolve().parents[1] / "training" / "main_async_ppo.py"
    spec = importlib.util.spec_from_file_location("main_async_ppo_entry", entry)
    main = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(main)

    def stops(config):
        raise RoleFailed("rollout0 stopped the run: the last 200 training episodes all failed; ...")

    monkeypatch.setattr(main, "launch", stops)
    with pytest.raises(SystemExit) as exit_:
        main.main(["max_steps=1"])
    assert exit_.value.code == 1
    assert capsys.readouterr().err == "error: rollout0 stopped the run: the last 200 training episodes all failed; ...\n"
