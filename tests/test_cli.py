"""Command-line configuration: overrides, YAML files, subclass fields, plugins, errors, --help, round trips."""

import re
import sys
import textwrap
import uuid
from dataclasses import dataclass

import pytest

from experiments import AsyncPPOMATHConfig, register_experiment
from rlsys.cli import (ConfigError, attribute_docs, config_from_dict, config_to_dict, load_config, parse_config,
                       save_config)
from rlsys.plugins import import_plugins, plugin_module_name

SUBCLASS_EXPERIMENT = "test-cli-my-param"


@dataclass
class MyParamConfig(AsyncPPOMATHConfig):
    my_param: float = 1.0
    """A setting only this subclass has."""

    @property
    def agent_args(self) -> dict:
        return {"my_param": self.my_param, **self.agent.args}


register_experiment(SUBCLASS_EXPERIMENT, MyParamConfig)


def test_defaults_are_the_dataclass_defaults():
    config = parse_config([])
    assert type(config) is AsyncPPOMATHConfig
    assert config == AsyncPPOMATHConfig()
    assert config.agent.name == "math-single-step"  # properties work: it is a real instance


def test_nested_override():
    config = parse_config(["ppo.lr=1e-5", "cluster.redis_url=redis://:pw@localhost:6380/0", "model.path="])
    assert config.ppo.lr == 1e-5 and isinstance(config.ppo.lr, float)
    assert config.cluster.redis_url == "redis://:pw@localhost:6380/0"
    assert config.model.path == ""  # an empty value is the empty string, not null
    assert config.ppo.batch_size == 16


def test_list_override():
    assert parse_config(["plugins=[json,os.path]"]).plugins == ["json", "os.path"]


def test_yaml_file_then_command_line_overrides_it(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("seed: 7\nppo:\n  lr: 1.0e-4\n  batch_size: 4\n")
    config = parse_config(["--config", str(path), "ppo.batch_size=8"])
    assert (config.seed, config.ppo.lr, config.ppo.batch_size) == (7, 1e-4, 8)
    assert parse_config([f"config={path}"]).ppo.batch_size == 4
    assert parse_config(["ppo.batch_size=8", f"--config={path}"]).ppo.batch_size == 8  # order does not matter


def test_a_config_file_takes_dotted_keys_as_help_writes_them(tmp_path):
    """`ppo.lr: 1e-4` in a file was refused as 'invalid value for ppo.lr: expected float, got None'."""
    path = tmp_path / "run.yaml"
    path.write_text("ppo.lr: 1e-4\nppo:\n  batch_size: 3\nmax_steps: 5\n")
    config = parse_config(["--config", str(path)])
    assert (config.ppo.lr, config.ppo.batch_size, config.max_steps) == (1e-4, 3, 5)
    path.write_text("ppo.lrr: 1\n")
    with pytest.raises(ConfigError, match=r"^unknown key 'ppo.lrr'; did you mean 'ppo.lr'\?$"):
        parse_config(["--config", str(path)])
    path.write_text("ppo: 3\nppo.lr: 1\n")
    with pytest.raises(ConfigError, match=r"gives ppo a value and sets ppo.lr too$"):
        parse_config(["--config", str(path)])


def test_yaml_keys_are_checked_like_command_line_keys(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("ppo:\n  lrr: 1.0e-4\n")
    with pytest.raises(ConfigError, match=r"unknown key 'ppo.lrr'; did you mean 'ppo.lr'\?"):
        parse_config(["--config", str(path)])


def test_subclass_field_needs_no_plus_prefix():
    config = parse_config([f"experiment={SUBCLASS_EXPERIMENT}", "my_param=5.0", "group_size=4"])
    assert type(config) is MyParamConfig
    assert config.my_param == 5.0
    assert config.agent_args["my_param"] == 5.0
    assert config.agent.args["gconfig"].n == 4


def test_plugin_file_registers_the_experiment_it_is_run_with(tmp_path, capsys):
    name = f"test-cli-plugin-{uuid.uuid4().hex[:8]}"
    plugin = tmp_path / "my_plugin.py"
    plugin.write_text(textwrap.dedent(f"""
        from dataclasses import dataclass
        from experiments import AsyncPPOMATHConfig, register_experiment

        @dataclass
        class PluginConfig(AsyncPPOMATHConfig):
            temperature_floor: float = 0.1
            \"\"\"Documented in a plugin file.\"\"\"

        register_experiment({name!r}, PluginConfig)
    """))
    config = parse_config([f"plugins=[{plugin}]", f"experiment={name}", "temperature_floor=0.5"])
    assert type(config).__name__ == "PluginConfig" and config.temperature_floor == 0.5
    assert config.plugins == [str(plugin)]
    # Importing again (as a worker's config_from_dict does) must not run it again: it would register twice.
    import_plugins([str(plugin)])
    assert sys.modules[plugin_module_name(plugin)].PluginConfig is type(config)
    assert config_from_dict(config_to_dict(config)) == config
    with pytest.raises(SystemExit):
        parse_config([f"plugins=[{plugin}]", f"experiment={name}", "--help"])
    assert "temperature_floor: float = 0.1\n      Documented in a plugin file." in capsys.readouterr().out


def test_plugin_module_that_does_not_exist():
    with pytest.raises(ConfigError, match="cannot import plugin 'no_such_plugin_module'"):
        parse_config(["plugins=[no_such_plugin_module]"])
    with pytest.raises(ConfigError, match="plugin file not found"):
        parse_config(["plugins=[/no/such/plugin.py]"])
    # a run's config.yaml keeps the path as typed: continued from another directory, the message says where it looked
    with pytest.raises(ConfigError, match=r"plugin file not found: no_such_plugin\.py \(relative to the current "
                                          r"directory .*: run where it is, or give its full path\)$"):
        parse_config(["plugins=[no_such_plugin.py]"])


def test_a_plugin_named_as_a_module_that_is_a_file_here_says_how_to_load_it(tmp_path, monkeypatch):
    # my_plugin.py beside the user, run as python3 training/main_async_ppo.py: the current directory is not searched
    (tmp_path / "newcomer_plugin_here.py").write_text("")
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"newcomer_plugin_here\.py is in the current directory, where imports do "
                                          r"not look: plugins=\[newcomer_plugin_here\.py\], or PYTHONPATH=\."):
        parse_config(["plugins=[newcomer_plugin_here]"])


def test_a_plugin_that_registers_a_taken_name_is_a_config_error_naming_the_plugin(tmp_path, monkeypatch):
    source = textwrap.dedent("""
        from rlsys.api import register_agent
        from rlsys.impl.agent.math_single_step import MathSingleStepAgent

        class Mine(MathSingleStepAgent):
            pass

        register_agent("math-single-step", Mine)
    """)
    (tmp_path / "taken_name_plugin.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    for entry in (str(tmp_path / "taken_name_plugin.py"), "taken_name_plugin"):
        taken = (r"agent 'math-single-step' is already registered "
                 r"\(by rlsys.impl.agent.math_single_step.MathSingleStepAgent\)")
        with pytest.raises(ConfigError, match=rf"^plugin {re.escape(entry)}: {taken}"):
            parse_config([f"plugins=[{entry}]"])
    assert "taken_name_plugin" not in sys.modules  # a failed import leaves nothing half-registered behind to reuse


def test_misspelled_top_level_key_lists_close_matches():
    with pytest.raises(ConfigError, match=r"unknown key 'group_sise'; did you mean 'group_size'\?"):
        parse_config(["group_sise=4"])


def test_misspelled_nested_key_lists_close_matches():
    with pytest.raises(ConfigError, match=r"unknown key 'ppo.lrr'; did you mean 'ppo.lr'\?"):
        parse_config(["ppo.lrr=1e-5"])
    with pytest.raises(ConfigError, match=r"unknown key 'ppp.lr'; did you mean 'ppo.lr'\?"):
        parse_config(["ppp.lr=1e-5"])
    with pytest.raises(ConfigError, match=r"unknown key 'lr'; did you mean 'ppo.lr'\?"):
        parse_config(["lr=1e-5"])


def test_every_unknown_key_is_reported():
    with pytest.raises(ConfigError) as err:
        parse_config(["seeed=3", "ppo.lrr=1"])
    assert "'seeed'" in str(err.value) and "'ppo.lrr'" in str(err.value)


def test_a_key_no_experiment_has_names_how_a_plugins_experiment_is_loaded():
    # the seed's `my_param=5.0` run before its plugin file was given: no experiment registered has the key
    with pytest.raises(ConfigError, match=r"^unknown key 'zz_param'; --help lists every key \(a key of an experiment "
                                          r"of your own .* plugins=\[my_plugin.py\] experiment=NAME\)$"):
        parse_config(["zz_param=5.0"])


def test_subclass_field_is_unknown_to_the_base_experiment_which_names_the_experiment_that_has_it():
    # the seed's `my_param=5.0` without experiment=: the key is right, the experiment is not, and the fix is named
    with pytest.raises(ConfigError, match=r"unknown key 'my_param' for experiment async-ppo-math; it is a key of "
                                          r"experiments? .*'test-cli-my-param'.*: add experiment="):
        parse_config(["my_param=5.0"])
    with pytest.raises(ConfigError, match=r"^unknown key 'turn_discount' for experiment async-ppo-math; it is a key "
                                          r"of experiments .*'async-ppo-math-multi-turn'.*: add experiment= one of "
                                          r"them$"):
        parse_config(["turn_discount=0.5"])
    with pytest.raises(ConfigError, match=r"^unknown key 'frozen_lake_share' for experiment async-ppo-sokoban; .*"
                                          r"add experiment=async-ppo-mixed-games$"):
        parse_config(["experiment=async-ppo-sokoban", "frozen_lake_share=0.5"])


@pytest.mark.parametrize("experiment", ["async-ppo-frozen-lake", "async-ppo-sokoban", "async-ppo-webshop",
                                        "async-ppo-mixed-games", "async-ppo-math-tools"])
def test_the_turn_limit_is_num_turns_in_every_experiment_and_max_turns_is_refused_naming_it(experiment):
    """These experiments called their turn limit max_turns, while their agents, the seed and
    experiment=async-ppo-math-multi-turn call it num_turns: one name now, and the earlier one says what to write."""
    with pytest.raises(ConfigError, match=r"^'max_turns' is now num_turns \(the most turns an episode takes.*\): set "
                                          r"num_turns=5$"):
        parse_config([f"experiment={experiment}", "max_turns=5"])
    assert parse_config([f"experiment={experiment}", "num_turns=5"]).agent.args["num_turns"] == 5


def test_wrong_type_names_key_expected_type_and_value():
    with pytest.raises(ConfigError, match=r"ppo.batch_size: expected int, got 'abc'"):
        parse_config(["ppo.batch_size=abc"])
    with pytest.raises(ConfigError, match=r"ppo is a group of settings"):
        parse_config(["ppo=5"])


def test_a_boolean_resume_from_checkpoint_is_refused_not_read_as_the_path_false(tmp_path):
    # ROLL's `resume_from_checkpoint: False` (no resume) was the path 'False', refused later as a missing model.path
    (tmp_path / "roll.yaml").write_text("resume_from_checkpoint: False\n")
    for argv in (["--config", str(tmp_path / "roll.yaml")], ["resume_from_checkpoint=false"]):
        with pytest.raises(ConfigError, match=r"^invalid value for resume_from_checkpoint: expected str, got False "
                                              r"\(YAML's boolean\); a fresh start is its default, empty: leave it out"):
            parse_config(argv)
    assert parse_config(["resume_from_checkpoint="]).resume_from_checkpoint == ""


def test_argument_without_equals_says_the_expected_form():
    with pytest.raises(ConfigError, match=r"expected key=value, got 'ppo.lr'"):
        parse_config(["ppo.lr"])
    with pytest.raises(ConfigError, match=r"unknown option '--lr'"):
        parse_config(["--lr", "3"])


def test_text_that_yaml_reads_as_something_else_names_the_quotes_that_keep_it_text():
    # docs/data.md's prompt template without its inner quotes, and a system prompt with a colon
    with pytest.raises(ConfigError, match=r"cannot parse 'dataset.prompt_template=\{prompt\} Answer after ####.': .*"
                                          r"goes in quotes inside the argument: 'dataset.prompt_template=\"...\"'\)$"):
        parse_config(["dataset.prompt_template={prompt} Answer after ####."])
    with pytest.raises(ConfigError, match=r"^invalid value for dataset.system_prompt: expected str, got "
                                          r"\{'Say': True\} \(.*'dataset.system_prompt=\"...\"'\)$"):
        parse_config(["dataset.system_prompt=Say: yes"])
    assert parse_config(['dataset.system_prompt="Say: yes"']).dataset.system_prompt == "Say: yes"


def test_a_text_setting_holds_the_text_typed_not_what_yaml_reads_it_as():
    """YAML reads 007 as 7, 12:30 as 750 (base 60), No as false and 1e3 as 1000.0: a str setting held them as '7',
    '750', 'False' and '1000.0'."""
    config = parse_config(["trial_name=007", "experiment_name=12:30", "dataset.system_prompt=No",
                           "dataset.prompt_key=1e3"])
    assert (config.trial_name, config.experiment_name, config.dataset.system_prompt, config.dataset.prompt_key) == (
        "007", "12:30", "No", "1e3")
    assert parse_config(["trial_name=007", "trial_name=x"]).trial_name == "x"  # the last one wins
    assert parse_config(["trial_name=x", "trial_name=007"]).trial_name == "007"
    assert parse_config(["seed=007"]).seed == 7  # a number where a number is asked for
    assert parse_config(["ppo.sequence_packing=false"]).ppo.sequence_packing == "false"


def test_a_number_is_the_decimal_typed_not_yaml_s_octal_or_base_60():
    """YAML 1.1 read seed=0042 as 34 (octal) while seed=08 was 8, and max_steps=1:30 as 90 (base 60)."""
    assert parse_config(["seed=0042"]).seed == 42
    assert parse_config(["seed=010", "ppo.lr=010"]).seed == 10
    assert parse_config(["ppo.lr=010"]).ppo.lr == 10.0
    assert parse_config(["seed=0x10"]).seed == 16  # written as hexadecimal: read so
    with pytest.raises(ConfigError, match=r"^invalid value for max_steps: expected int, got '1:30'$"):
        parse_config(["max_steps=1:30"])
    with pytest.raises(ConfigError, match=r"^invalid value for env_timeout: expected float, got '2:00'$"):
        parse_config(["env_timeout=2:00"])


def test_a_config_file_s_settings_hold_the_text_typed_as_the_command_line_s_do(tmp_path):
    """A config file was read as YAML 1.1: `dataset.system_prompt: No` became 'False', `experiment_name: NO` 'False',
    `trial_name: 1.10` '1.1' and `seed: 0042` 34 (octal), where the command line kept what was typed."""
    path = tmp_path / "run.yaml"
    path.write_text("experiment_name: NO\ntrial_name: 1.10\nseed: 0042\nppo.lr: 1e-4\n"
                    "dataset:\n  system_prompt: No\n  prompt_key: 1e3\n")
    config = parse_config(["--config", str(path)])
    assert (config.experiment_name, config.trial_name, config.dataset.system_prompt, config.dataset.prompt_key) == (
        "NO", "1.10", "No", "1e3")
    assert (config.seed, config.ppo.lr) == (42, 1e-4)
    assert parse_config(["--config", str(path), "trial_name=007"]).trial_name == "007"  # the last source wins
    later = tmp_path / "later.yaml"
    later.write_text("trial_name: 2.50\nseed: 7\n")
    config = parse_config(["--config", str(path), "--config", str(later)])
    assert (config.trial_name, config.seed) == ("2.50", 7)
    later.write_text("trial_name: '2.50'\nmax_steps: 1:30\n")
    with pytest.raises(ConfigError, match=r"^invalid value for max_steps: expected int, got '1:30'$"):
        parse_config(["--config", str(path), "--config", str(later)])


@pytest.mark.parametrize("override, key, expected", [("ppo.lr=nan", "ppo.lr", "float"),
                                                    ("env_timeout=.nan", "env_timeout", "float"),
                                                    ("reward_weights=[1,nan]", "reward_weights", r"list\[float\]")])
def test_nan_is_refused_naming_the_key(override, key, expected):
    """Every range check passes NaN: ppo.lr=nan was taken, and its learner died and was restarted until the run
    gave up, minutes later."""
    with pytest.raises(ConfigError, match=rf"^invalid value for {key}: expected {expected}, got nan \(not a number\)$"):
        parse_config([override])
    assert parse_config(["trial_name=nan"]).trial_name == "nan"  # text, where text is asked for


def test_nan_in_a_config_file_is_refused(tmp_path):
    (tmp_path / "run.yaml").write_text("ppo:\n  lr: .nan\n")
    with pytest.raises(ConfigError, match=r"^invalid value for ppo.lr: expected float, got nan"):
        parse_config(["--config", str(tmp_path / "run.yaml")])


def test_unparseable_value_is_a_config_error():
    with pytest.raises(ConfigError, match=r"cannot parse 'plugins=\[a,'"):
        parse_config(["plugins=[a,"])


def test_unknown_experiment_lists_registered():
    with pytest.raises(ConfigError, match=r"unknown experiment 'async-ppo-mth'.*Registered experiments: .*"
                                          r"'async-ppo-math'.*'test-cli-my-param'"):
        parse_config(["experiment=async-ppo-mth"])
    # a user's experiment asked for without the file that registers it
    with pytest.raises(ConfigError, match=r"unknown experiment 'my-experiment'.*an experiment of your own is "
                                          r"registered by its file: add plugins=\[my_plugin\.py\]"):
        parse_config(["experiment=my-experiment", "my_param=5.0"])


def test_help_lists_every_field_with_type_default_and_doc(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_config(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "ppo.lr: float = 3e-05" in out
    assert "AdamW learning rate" in out
    assert "cluster.redis_url: str = ''" in out
    assert "plugins: list[str] = []" in out


def test_help_shows_a_subclass_fields_doc_even_with_a_bad_key(capsys):
    with pytest.raises(SystemExit):
        parse_config(["-h", f"experiment={SUBCLASS_EXPERIMENT}", "no_such_key=1"])
    out = capsys.readouterr().out
    assert "my_param: float = 1.0\n      A setting only this subclass has." in out
    assert "ppo.lr: float" in out


def test_save_then_load_round_trip(tmp_path):
    config = parse_config([f"experiment={SUBCLASS_EXPERIMENT}", "my_param=2.5", "ppo.lr=1e-5",
                           "plugins=[json]", "trial_name=t1"])
    path = tmp_path / "nested" / "dir" / "config.yaml"
    save_config(config, path)
    assert path.read_text().startswith(f"experiment: {SUBCLASS_EXPERIMENT}\n")
    loaded = load_config(path)
    assert type(loaded) is MyParamConfig and loaded == config
    # The saved file is an ordinary --config file: a rerun can override it.
    assert parse_config(["--config", str(path), "my_param=3.0"]).my_param == 3.0


def test_a_saved_config_gives_back_text_that_omegaconf_reads_as_a_number(tmp_path):
    """config.yaml held trial_name: 1e5 bare (PyYAML's floats need a dot), which omegaconf read back as 100000.0: the
    `--config .../config.yaml resume_from_checkpoint=auto` the README gives resumed trial '100000.0', a new one."""
    config = parse_config(["trial_name=1e5", "dataset.system_prompt=2e-3", "experiment_name=007"])
    save_config(config, tmp_path / "config.yaml")
    assert load_config(tmp_path / "config.yaml") == config


def test_dict_round_trip():
    config = parse_config([f"experiment={SUBCLASS_EXPERIMENT}", "my_param=2.5", "cluster.n_rollout_workers=3"])
    payload = config_to_dict(config)
    assert payload["experiment"] == SUBCLASS_EXPERIMENT
    assert payload["config"]["my_param"] == 2.5 and payload["config"]["cluster"]["n_rollout_workers"] == 3
    assert config_from_dict(payload) == config


def test_a_role_builds_its_config_without_reading_a_class_s_source(monkeypatch):
    """The launcher and every role build the run's config as they start; the docs under each key are --help's and
    the settings' checks', and reading them (every config class's source, parsed) was most of a build's time."""
    payload = config_to_dict(parse_config([f"experiment={SUBCLASS_EXPERIMENT}", "my_param=2.5", "ppo.lr=1e-5"]))

    def read_source(klass):
        raise AssertionError(f"{klass.__qualname__}'s source was read to build a config")

    monkeypatch.setattr("rlsys.cli.class_attribute_docs", read_source)
    attribute_docs.cache_clear()  # what an earlier test read stays read: this process starts as a role does
    built = config_from_dict(payload)
    assert built.my_param == 2.5 and built.ppo.lr == 1e-5
    assert parse_config([f"experiment={SUBCLASS_EXPERIMENT}", "my_param=2.5", "ppo.lr=1e-5"]) == built


def test_unregistered_class_cannot_be_sent_to_workers():
    @dataclass
    class Unregistered(AsyncPPOMATHConfig):
        pass

    with pytest.raises(ConfigError, match="not a registered experiment"):
        config_to_dict(Unregistered())
