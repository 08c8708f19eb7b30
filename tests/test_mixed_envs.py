"""Rows that name their environment: FrozenLake and Sokoban groups in one run, evaluation with its own
environment settings, metrics per environment type."""

import json
from pathlib import Path

import pytest

import rlsys.impl.agent  # noqa: F401  (registers the built-in agents and environments)
import rlsys.impl.env  # noqa: F401
from experiments import AsyncPPOMixedGamesConfig
from rlsys.api import Prompt, Trajectory
from rlsys.assets import AssetError, prepare_assets
from rlsys.cli import ConfigError, parse_config
from rlsys.data.dataset import DatasetError
from rlsys.launcher import launch
from rlsys.metrics import read_jsonl_metrics
from rlsys.workers.env_per_row import env_for, run_environments, with_env_type_metrics
from rlsys.training_step import mean_agent_metrics
from tests.helpers import small_run_overrides


def test_rows_choose_their_environment_and_evaluation_sets_it_up_its_own_way():
    config = AsyncPPOMixedGamesConfig(invalid_action_penalty=0.2, eval_invalid_action_penalty=0.0)
    lake, room, plain = (Prompt("q", [1], {"prompt": "x", "env_name": name} if name else {"prompt": "x"})
                         for name in ("frozen-lake", "sokoban", None))
    assert env_for(config, lake, False).name == "frozen-lake" and env_for(config, room, False).name == "sokoban"
    assert env_for(config, plain, False).name == config.env.name == "frozen-lake"
    assert env_for(config, room, False).args["invalid_action_penalty"] == 0.2
    assert env_for(config, room, True).args["invalid_action_penalty"] == 0.0
    assert env_for(config, room, True).args["size"] == 6 and env_for(config, lake, True).args["size"] == 4


def test_every_environment_set_up_a_run_uses_is_warmed_once():
    config = AsyncPPOMixedGamesConfig(invalid_action_penalty=0.2, eval_invalid_action_penalty=0.0)
    envs = run_environments(config)
    # frozen-lake and sokoban, each as trained and as evaluated (another penalty): four set-ups, the default
    # env (frozen-lake, trained) not twice
    assert sorted((e.name, e.args["invalid_action_penalty"]) for e in envs) == [
        ("frozen-lake", 0.0), ("frozen-lake", 0.2), ("sokoban", 0.0), ("sokoban", 0.2)]


def test_metrics_per_environment_type_average_over_that_types_trajectories():
    def trajectory(reward):
        return Trajectory(token_ids=[1, 2], loss_mask=[0, 1], logprobs=[0.0, -1.0], versions=[-1, 0], turn_ends=[2],
                          turn_rewards=[reward], reward=reward, group_id="g", stop_reason="stop",
                          metrics={"success": float(reward == 1.0)})
    batch = with_env_type_metrics([trajectory(1.0), trajectory(0.0)], "frozen-lake") + \
        with_env_type_metrics([trajectory(0.5)] * 2, "sokoban")
    metrics = mean_agent_metrics(batch)
    assert metrics["agent/frozen-lake/reward"] == 0.5 and metrics["agent/sokoban/reward"] == 0.5
    assert metrics["agent/frozen-lake/success"] == 0.5 and metrics["agent/sokoban/success"] == 0.0
    assert metrics["agent/success"] == 0.25  # over the whole batch, as before


def test_a_row_naming_an_unknown_environment_stops_the_run_at_start(tmp_path):
    rows = [{"prompt": "x", "answer": "", "seed": 1, "env_name": "frozen-lake"},
            {"prompt": "x", "answer": "", "seed": 2, "env_name": "sokobam"}]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    config = AsyncPPOMixedGamesConfig()
    config.dataset.path = config.dataset.eval_path = str(path)
    config.model.cache_dir = str(tmp_path / "cache")
    with pytest.raises(AssetError, match=r"rows.jsonl: row 2: env_name 'sokobam' is not an environment of this "
                                         r"experiment; it has \['frozen-lake', 'sokoban'\]"):
        prepare_assets(config)
    assert not (tmp_path / "cache").exists()  # before any model is built


@pytest.mark.parametrize("experiment", ["async-ppo-frozen-lake", "async-ppo-webshop", "async-ppo-mixed-games"])
def test_a_game_row_without_an_integer_seed_stops_the_run_at_start(tmp_path, experiment):
    """Each row's puzzle (or shop task) is rebuilt from its seed: without one every episode failed at reset, and the
    warm start's walks raised a KeyError."""
    train, held_out = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    good = {"prompt": "x", "answer": "", "seed": 1}
    train.write_text(json.dumps({**good, "seed": "1"}) + "\n" + json.dumps({**good, "seed": "2"}) + "\n")
    held_out.write_text(json.dumps(good) + "\n" + json.dumps({"prompt": "x", "answer": ""}) + "\n")
    config = parse_config([f"experiment={experiment}", f"dataset.path={train}", f"dataset.eval_path={held_out}",
                           f"model.cache_dir={tmp_path / 'cache'}"])
    with pytest.raises(DatasetError, match=r"train.jsonl: row 1: field 'seed' must be an integer, the seed its "
                                           r"puzzle or task is rebuilt from; got '1'$"):
        prepare_assets(config)
    train.write_text(json.dumps(good) + "\n")
    with pytest.raises(DatasetError, match=r"eval.jsonl: row 2: field 'seed' must be an integer.*; got nothing$"):
        prepare_assets(config)
    assert not (tmp_path / "cache").exists()  # before any model is built


def test_mixed_games_split_settings_are_checked():
    with pytest.raises(ConfigError, match=r"frozen_lake_share must be in \(0, 1\)"):
        parse_config(["experiment=async-ppo-mixed-games", "frozen_lake_share=1"])


@pytest.mark.slow
def test_a_run_mixing_frozen_lake_and_sokoban_reports_each(cache_dir, tmp_path):
    config = parse_config(small_run_overrides(cache_dir, tmp_path) + [
        "experiment=async-ppo-mixed-games", "model.warm_start_accuracy=0.05", "dataset.num_train=200",
        "dataset.num_eval=40", "max_steps=3", "ppo.batch_size=8", "group_size=4", "eval_steps=0"])
    summary = launch(config)  # 14.3 min on the shared 2-core machine at load average 20-25, warm start included
    rows = [json.loads(line) for line in Path(config.dataset.path).read_text().splitlines()]
    assert {row["env_name"] for row in rows} == {"frozen-lake", "sokoban"}
    steps = read_jsonl_metrics(Path(config.logging_dir) / "learner.jsonl")
    assert [s["step"] for s in steps] == [1, 2, 3]
    for name in ("frozen-lake", "sokoban"):  # both games trained, each reported on its own
        assert any(f"agent/{name}/reward" in s for s in steps), name
        assert all(0 <= s.get(f"agent/{name}/action_is_valid", 0) <= 1 for s in steps)
    evaluations = [r for f in Path(config.logging_dir).glob("rollout*.jsonl") for r in read_jsonl_metrics(f)
                   if "eval/accuracy" in r]
    assert len(evaluations) == 2
    for result in evaluations:
        lake, room = result["eval/frozen-lake/accuracy"], result["eval/sokoban/accuracy"]
        assert result["eval/accuracy"] == pytest.approx((lake + room) / 2)  # 20 held-out rows of each game
        assert min(lake, room) >= 0  # evaluation's own setting: no penalty for an invalid move
    assert summary["prompts_accounted"] and summary["prompts"]["trained"] >= 24
