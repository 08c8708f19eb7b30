"""examples/: one YAML per built-in experiment, read with Hydra's (and ROLL's) `--config_path DIR --config_name NAME`.
Each holds the experiment's defaults for the keys a user changes first; the slow tier runs each for two steps
(tests/test_experiment_defaults.py)."""

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from experiments import EXPERIMENTS
from rlsys.cli import ConfigError, parse_config

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
BUILT_IN = [name for name in EXPERIMENTS.names() if EXPERIMENTS.lookup(name).__module__.startswith("experiments.")]


def leaves(tree: dict, prefix: str = "") -> dict:
    """{"ppo.lr": 3e-05, ...}: a YAML mapping's keys as dotted paths."""
    found = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            found.update(leaves(value, f"{prefix}{key}."))
        else:
            found[f"{prefix}{key}"] = value
    return found


def value_at(config, path: str):
    for part in path.split("."):
        config = getattr(config, part)
    return list(config) if isinstance(config, tuple) else config


def test_every_built_in_experiment_has_an_example_and_every_example_an_experiment():
    assert sorted(p.stem for p in EXAMPLES.glob("*.yaml")) == sorted(BUILT_IN)


@pytest.mark.parametrize("name", BUILT_IN)
def test_each_example_names_its_experiment_and_holds_its_defaults(name, tmp_path):
    config = parse_config(["--config_path", str(EXAMPLES), "--config_name", name])
    defaults = parse_config([f"experiment={name}"])
    assert type(config) is type(defaults) is EXPERIMENTS.lookup(name)
    keys = leaves(OmegaConf.to_container(OmegaConf.load(EXAMPLES / f"{name}.yaml")))
    assert keys.pop("experiment") == name and len(keys) >= 15
    assert {path: value_at(config, path) for path in keys} == {path: value_at(defaults, path) for path in keys} == keys
    # the command line overrides the file's keys
    assert parse_config(["-cp", str(EXAMPLES), "-cn", f"{name}.yaml", "max_steps=3"]).max_steps == 3


def test_config_path_and_name_are_read_in_each_spelling_and_their_mistakes_name_the_fix(tmp_path, monkeypatch):
    (tmp_path / "mine.yaml").write_text("experiment: async-ppo-sokoban\nmax_steps: 7\n")
    (tmp_path / "more.yaml").write_text("max_steps: 9\n")
    monkeypatch.chdir(tmp_path)
    for argv in (["--config_path", ".", "--config_name", "mine"], ["--config-path=.", "--config-name=mine.yaml"],
                 ["-cn", "mine"]):  # no path: the current directory
        config = parse_config(argv)
        assert type(config).__name__ == "AsyncPPOSokobanConfig" and config.max_steps == 7
    # the named file first, then --config files, then key=value
    assert parse_config(["-cn", "mine", "--config", "more.yaml"]).max_steps == 9
    assert parse_config(["-cn", "mine", "--config", "more.yaml", "max_steps=11"]).max_steps == 11
    with pytest.raises(ConfigError, match=r"not found: mien\.yaml .*did you mean: mine\?.*holds: mine, more"):
        parse_config(["--config_path", ".", "--config_name", "mien"])
    with pytest.raises(ConfigError, match="--config_path needs --config_name"):
        parse_config(["--config_path", "."])
    with pytest.raises(ConfigError, match="--config_name given twice"):
        parse_config(["-cn", "mine", "--config_name", "more"])
    with pytest.raises(ConfigError, match="-cn needs a value"):
        parse_config(["-cn"])


def test_a_config_path_that_is_no_directory_here_says_so_and_where_the_examples_are(tmp_path, monkeypatch):
    # The README's `--config_path examples`, run from a directory of one's own: there is no examples/ there
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as error:
        parse_config(["--config_path", "examples", "--config_name", "async-ppo-sokoban"])
    said = str(error.value)
    assert f"no directory examples in the current directory {tmp_path}" in said
    assert f"the examples rlsys comes with are in {EXAMPLES}: --config_path {EXAMPLES}" in said
    assert "holds no .yaml file" not in said
    with pytest.raises(ConfigError, match=r"no directory mine in the current directory .*: run where it is, or "
                                          r"give its full path$"):
        parse_config(["--config_path", "mine", "--config_name", "x"])
    # ROLL's guide's own example, typed in the repository: rlsys's examples are named instead
    monkeypatch.chdir(EXAMPLES.parent)
    with pytest.raises(ConfigError, match=rf"no directory examples/qwen2.5-0.5B-agentic in the current directory "
                                          rf".*; rlsys's examples are in {EXAMPLES}: "
                                          r"async-ppo-frozen-lake, .*async-ppo-webshop$"):
        parse_config(["--config_path", "examples/qwen2.5-0.5B-agentic", "--config_name", "agent_val_frozen_lake"])


@pytest.mark.parametrize("key,ours", [("exp_name", "experiment_name"), ("pretrain", "model.path"),
                                      ("max_tokens_per_step", "gen.max_new_tokens"),
                                      ("rollout_batch_size", "ppo.batch_size"),
                                      ("reward_pretrain", "reward-model environment"),
                                      # the names of a ROLL worker's and environment manager's sections
                                      ("actor_train.training_args.learning_rate", "ppo.lr"),
                                      ("actor_infer.generating_args.num_return_sequences", "group_size"),
                                      ("disable_gradient_checkpointing", "learner.gradient_checkpointing"),
                                      ("train_env_manager.max_env_num_per_worker", "max_concurrent_rollouts"),
                                      ("train_env_manager.tags", "frozen_lake_share"),
                                      ("num_groups_partition", "frozen_lake_share"),
                                      # the rest of the names ROLL's agentic pipeline guide lists
                                      ("train_env_manager.num_env_groups", "ppo.batch_size"),
                                      ("custom_envs.FrozenLake.max_steps_per_traj", "num_turns"),
                                      ("custom_envs.FrozenLake.env_type", "experiment"),
                                      ("custom_envs.FrozenLake.env_config", "register_environment"),
                                      ("actor_train.training_args.per_device_train_batch_size",
                                       "ppo.max_tokens_per_micro_batch"),
                                      ("actor_train.training_args.gradient_accumulation_steps",
                                       "ppo.max_tokens_per_micro_batch"),
                                      ("actor_infer.strategy_args.strategy_name", "inference.engine"),
                                      ("actor_infer.strategy_args.tp_size", "inference.tensor_parallel_size")])
def test_rolls_names_are_refused_naming_ours(key, ours):
    """A ROLL config's keys, where rlsys names the setting otherwise: one name per setting, so refused, not aliased."""
    with pytest.raises(ConfigError, match=f"'{key}' is ROLL's name; rlsys's is .*{ours}"):
        parse_config([f"{key}=x"])


@pytest.mark.parametrize("key,says", [("actor_train.model_args.model_type", "causal language models"),
                                      ("actor_infer.strategy_args.pp_size", "no pipeline parallelism"),
                                      ("custom_envs", "register_environment"),
                                      ("custom_envs.FrozenLake.max_actions", "register_environment")])
def test_rolls_names_without_a_counterpart_say_what_rlsys_does_instead(key, says):
    """ROLL's settings that rlsys has no setting for are refused saying what it does in their place, not as unknown."""
    with pytest.raises(ConfigError, match=f"'{key}' is ROLL's setting; rlsys has none: .*{says}"):
        parse_config([f"{key}=x"])


@pytest.mark.parametrize("key,says", [("data.return_raw_chat", "keeps a row's chat messages"),
                                      ("actor_rollout_ref.rollout.mode", "always asynchronous"),
                                      ("actor_rollout_ref.rollout.n", "group_size")])
def test_verls_agent_loop_settings_are_refused_saying_what_rlsys_does_instead(key, says):
    """The two settings verl's agent loop asks for, and its samples per prompt: copied from verl's guide, each is
    refused with what rlsys does in its place, not only an unknown key."""
    with pytest.raises(ConfigError, match=f"'{key}' is verl's setting; .*{says}"):
        parse_config([f"{key}=true"])
