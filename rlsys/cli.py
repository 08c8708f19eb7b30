"""Command-line configuration: `key=value` overrides (and YAML files) merged onto an experiment dataclass.

    python training/main_async_ppo.py [--config FILE.yaml] [experiment=NAME] [key=value ...] [--help]
    python training/main_async_ppo.py --config_path examples --config_name async-ppo-frozen-lake [key=value ...]

`--config_path DIR --config_name NAME` is Hydra's and ROLL's way to name a file (DIR/NAME.yaml, `.yaml` optional;
`--config-path`/`-cp` and `--config-name`/`-cn` too): it is read first, then `--config` files, then `key=value`.

The experiment's dataclass is the schema (OmegaConf.structured), so every field a subclass adds is a
valid key as is: no Hydra-style `+key=` is needed. `plugins=[...]` is imported before the experiment
is looked up, because a plugin may be what registers it. Every mistake becomes a ConfigError whose
message names the key; omegaconf's own exceptions never reach the user.
"""

import ast
import contextlib
import dataclasses
import difflib
import functools
import inspect
import math
import re
import sys
import textwrap
import types
import typing
from pathlib import Path
from typing import Any, Iterator

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import InterpolationResolutionError, MissingMandatoryValue, OmegaConfBaseException

import experiments  # noqa: F401  (registers the built-in experiments: the command line offers them by name)
from rlsys.api.experiment import EXPERIMENTS
from rlsys.api.registry import close_matches
from rlsys.errors import ConfigError
from rlsys.plugins import import_plugins, plugin_entries
from rlsys.run_privacy import redact_url, write_private

# Keys the command line reads itself; they are not fields of any experiment.
EXPERIMENT_KEY = "experiment"
CONFIG_FILE_KEY = "config"
HELP_FLAGS = ("--help", "-h")
USAGE = "[--config FILE.yaml | --config_path DIR --config_name NAME] [experiment=NAME] [key=value ...] [--help]"


@dataclasses.dataclass(frozen=True)
class FieldInfo:
    """One settable key of an experiment: dotted path, declared type, default and one-line doc."""

    path: str
    type: Any
    default: Any
    is_group: bool  # a nested dataclass: its own fields are the keys, it takes no value itself
    owner: type  # the dataclass that holds it (its doc is read from that class's source)

    @property
    def doc(self) -> str:
        """Read from the source when asked: --help shows docs, a run never does, and parsing every config class's
        source was most of building a config, which the launcher and each role do as they start (BENCHMARKS.md,
        "Start-up: a config built without its docs")."""
        return attribute_docs(self.owner).get(self.path.rpartition(".")[2], "")


# ---------------------------------------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------------------------------------

def parse_config(argv: list[str], default_experiment: str = "async-ppo-math"):
    """The experiment dataclass instance the arguments describe; `--help` prints the keys and exits 0."""
    wants_help, config_files, overrides = split_argv(argv)
    raw, typed = merge_sources(config_files, overrides)
    experiment = pop_experiment_name(raw, default_experiment)
    if "plugins" in raw:
        raw["plugins"] = plugin_entries(raw["plugins"])
    import_plugins(raw.get("plugins", []))  # first: a plugin may be what registers the experiment
    cls = lookup_experiment(experiment)
    if wants_help:
        print(help_text(cls, experiment))
        raise SystemExit(0)
    config = build_config(cls, raw, typed)
    refuse_inactive_settings(config)
    return config


def save_config(config, path) -> None:
    """Writes the resolved config as YAML, with its registry name, so `--config PATH` reruns it; owner-only,
    and without the Redis or MLflow password (rlsys.run_privacy)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = config_to_dict(config)
    document = {EXPERIMENT_KEY: payload["experiment"], **payload["config"]}
    for group, key in (("cluster", "redis_url"), ("trace", "mlflow_tracking_uri")):
        if document.get(group, {}).get(key):
            document[group][key] = redact_url(document[group][key])
    write_private(path, yaml.dump(document, Dumper=ConfigDumper, sort_keys=False, default_flow_style=False))


class ConfigDumper(yaml.SafeDumper):
    """Writes each text in quotes where omegaconf, reading the file back, would take it for something else: PyYAML
    leaves `1e5` bare (a float to it needs a dot), which omegaconf reads as 100000.0, so trial_name=1e5's config.yaml
    resumed trial '100000.0', a new directory."""


def represent_text(dumper: yaml.SafeDumper, text: str):
    read_back = OmegaConf.to_container(OmegaConf.create(yaml.safe_dump({"v": text})), resolve=False)["v"]
    return dumper.represent_scalar("tag:yaml.org,2002:str", text, style=None if read_back == text else "'")


ConfigDumper.add_representer(str, represent_text)


def load_config(path, experiment: str | None = None):
    """Reads a config saved by save_config (or any YAML config); `experiment` overrides the file's."""
    argv = ["--config", str(path)]
    if experiment is not None:
        argv.append(f"{EXPERIMENT_KEY}={experiment}")
    return parse_config(argv)


def config_to_dict(config) -> dict:
    """`{"experiment": <registry name>, "config": <plain dict>}`: what worker processes are sent."""
    as_plain = OmegaConf.to_container(OmegaConf.structured(config), resolve=True, enum_to_str=True)
    return {"experiment": registry_name_of(config), "config": as_plain}


def config_from_dict(payload: dict):
    """The dataclass instance back from config_to_dict's output, checked like the command line."""
    config = dict(payload["config"])
    import_plugins(plugin_entries(config.get("plugins")))  # the experiment may come from a plugin
    return build_config(lookup_experiment(payload["experiment"]), config)


def describe_fields(cls: type) -> list[FieldInfo]:
    """Every key of an experiment class, nested ones with dotted paths, in declaration order."""
    return list(_iter_fields(cls, defaults=None, prefix=""))


def help_text(cls: type, experiment: str) -> str:
    lines = [
        f"usage: {Path(sys.argv[0]).name} {USAGE}",
        "",
        f"experiment: {experiment} ({cls.__module__}.{cls.__qualname__})",
        f"registered experiments: {', '.join(EXPERIMENTS.names())}",
        "",
        "Lists use omegaconf syntax (plugins=[a,b]); command-line keys override the --config file's.",
        "",
        "keys (key: type = default):",
    ]
    for info in describe_fields(cls):
        if info.is_group:
            continue
        lines.append(f"  {info.path}: {type_name(info.type)} = {format_default(info.default)}")
        if info.doc:
            lines.append(f"      {info.doc}")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------------------
# Reading the arguments
# ---------------------------------------------------------------------------------------------------------

CONFIG_OPTIONS = {"--config": "config", "--config_path": "config_path", "--config-path": "config_path",
                  "-cp": "config_path", "--config_name": "config_name", "--config-name": "config_name",
                  "-cn": "config_name"}


def split_argv(argv: list[str]) -> tuple[bool, list[str], list[str]]:
    """(wants help, config files in order, `key=value` overrides in order)."""
    wants_help, config_files, overrides, named = False, [], [], {}
    args = iter(argv)
    for arg in args:
        option, _, value = arg.partition("=") if arg.startswith("-") else (arg, "", "")
        if arg in HELP_FLAGS:
            wants_help = True
        elif option in CONFIG_OPTIONS:
            if not _:
                value = next(args, None)
            if not value:
                raise ConfigError(f"{option} needs a value: --config FILE.yaml, "
                                  "or --config_path DIR --config_name NAME")
            if CONFIG_OPTIONS[option] == "config":
                config_files.append(value)
            elif CONFIG_OPTIONS[option] in named:
                raise ConfigError(f"{option} given twice")
            else:
                named[CONFIG_OPTIONS[option]] = value
        elif arg.startswith("-"):
            raise ConfigError(f"unknown option {arg!r}; arguments are key=value (e.g. ppo.lr=1e-5), "
                              f"--config FILE.yaml or --help")
        elif "=" not in arg or arg.startswith("="):
            raise ConfigError(f"expected key=value, got {arg!r} (e.g. ppo.lr=1e-5 or plugins=[my_plugin])")
        elif arg.split("=", 1)[0] == CONFIG_FILE_KEY:
            config_files.append(arg.split("=", 1)[1])
        else:
            overrides.append(arg)
    if named:
        config_files.insert(0, named_config_file(named.get("config_path"), named.get("config_name")))
    return wants_help, config_files, overrides


def named_config_file(directory: str | None, name: str | None) -> str:
    """DIR/NAME.yaml from Hydra's two options; a missing file names the ones that are there."""
    if name is None:
        raise ConfigError("--config_path needs --config_name too: the file's name in that directory")
    folder = Path(directory or ".")
    path = folder / (name if name.endswith((".yaml", ".yml")) else f"{name}.yaml")
    if not folder.is_dir():
        where = "" if folder.is_absolute() else f" in the current directory {Path.cwd()}"
        raise ConfigError(f"--config_path {folder}: no directory {folder}{where}" + missing_folder_hint(folder))
    if not path.is_file():
        there = sorted(p.stem for p in folder.glob("*.yaml")) if folder.is_dir() else []
        close = difflib.get_close_matches(Path(name).stem, there, n=3)
        raise ConfigError(f"config file not found: {path} (--config_path {folder} --config_name {name})"
                          + (f"; did you mean: {', '.join(close)}?" if close else "")
                          + (f"; {folder} holds: {', '.join(there)}" if there else f"; {folder} holds no .yaml file"))
    return str(path)


def missing_folder_hint(folder: Path) -> str:
    """Where a relative --config_path that is not here is in the repository (its examples/, run from elsewhere), or
    which examples rlsys has (ROLL's guide's examples/qwen2.5-0.5B-agentic is not one)."""
    if folder.is_absolute():
        return ""
    repository = Path(__file__).resolve().parents[1]
    if (repository / folder).is_dir():
        return f"; the {folder} rlsys comes with are in {repository / folder}: --config_path {repository / folder}"
    examples = repository / "examples"
    if folder.parts[0] == "examples" and examples.is_dir():
        return f"; rlsys's examples are in {examples}: {', '.join(sorted(p.stem for p in examples.glob('*.yaml')))}"
    return ": run where it is, or give its full path"


def merge_sources(config_files: list[str], overrides: list[str]) -> tuple[dict, dict[str, str]]:
    """Config files, then overrides, merged into one plain dict; later sources win. Nothing is typed yet. With it, the
    text each dotted key's scalar was typed as, the last source's (for keep_typed_text)."""
    files = [read_yaml_file(path) for path in config_files]
    sources = [loaded for loaded, _ in files] + [parse_override(arg) for arg in overrides]
    merged = OmegaConf.merge(*sources) if sources else OmegaConf.create()
    typed = {key: text for _, texts in files for key, text in texts.items()}
    typed.update(arg.split("=", 1) for arg in overrides)
    return OmegaConf.to_container(merged, resolve=False), typed  # interpolations resolve later, against the schema


def read_yaml_file(path: str):
    """The file's settings, and the text of each scalar as the file has it, by dotted key."""
    if not Path(path).is_file():
        raise ConfigError(f"config file not found: {path}")
    try:
        loaded = OmegaConf.load(path)  # first: it refuses a file whose aliases expand past its limit
        document = yaml.compose(Path(path).read_text(encoding="utf-8"), Loader=yaml.SafeLoader)
    except (yaml.YAMLError, OmegaConfBaseException) as e:
        raise ConfigError(f"cannot read config file {path}: {e}") from None
    if not OmegaConf.is_dict(loaded):
        raise ConfigError(f"config file {path} must hold a mapping of keys to values")
    return (OmegaConf.create(nest_dotted_keys(OmegaConf.to_container(loaded, resolve=False), path)),
            dict(scalar_texts(document)))


def scalar_texts(node: yaml.Node, prefix: str = "") -> Iterator[tuple[str, str]]:
    """(dotted key, text) of each scalar of a YAML mapping, nested or dotted, as written: a file is read as YAML 1.1,
    where `system_prompt: No` is false and `version: 1.10` is 1.1, which keep_typed_text takes back to the text."""
    for key, value in node.value if isinstance(node, yaml.MappingNode) else ():
        path = f"{prefix}{key.value}"
        if isinstance(value, yaml.ScalarNode):
            yield path, value.value
        else:
            yield from scalar_texts(value, f"{path}.")


def nest_dotted_keys(document: dict, path: str) -> dict:
    """`ppo.lr: 1e-4`, a key as --help and the command line write it, as `ppo: {lr: 1e-4}`: omegaconf keeps the dotted
    name whole, which the merge then read as no value at all ("invalid value for ppo.lr: expected float, got None")."""
    nested: dict = {}
    for key, value in document.items():
        *groups, leaf = str(key).split(".")
        target = nested
        for group in groups:
            target = target.setdefault(group, {})
            if not isinstance(target, dict):
                raise ConfigError(f"config file {path} gives {group} a value and sets {key} too")
        if isinstance(target.get(leaf), dict) and isinstance(value, dict):
            target[leaf].update(value)
        elif leaf in target:
            raise ConfigError(f"config file {path} sets {key} twice (nested and dotted)")
        else:
            target[leaf] = value
    return nested


def parse_override(arg: str):
    """`a.b=value` as a nested config; the value is read as YAML (numbers, [lists], null), `key=` is ''; a str
    setting gets the text back (keep_typed_text)."""
    key, value = arg.split("=", 1)
    if value == "":
        arg = f"{key}=''"  # omegaconf would read an empty value as null, which no str field accepts
    try:
        return OmegaConf.from_dotlist([arg])
    except (yaml.YAMLError, OmegaConfBaseException, ValueError) as e:
        reason = getattr(e, "problem", None) or first_line(e)  # YAML's first line is only its context
        raise ConfigError(f"cannot parse {arg!r}: {reason} (the value is read as YAML; {quote_text(key)})") from None


def quote_text(key: str) -> str:
    """Text with `: `, `{`, `[` or `#` reads as YAML's mapping, list or comment; in quotes it is text."""
    return f"text holding ': ', '{{', '[' or '#' goes in quotes inside the argument: '{key}=\"...\"'"


def pop_experiment_name(raw: dict, default: str) -> str:
    name = raw.pop(EXPERIMENT_KEY, None)
    if name is None or name == "":
        return default
    if not isinstance(name, (str, int, float)):
        raise ConfigError(f"experiment must be a name, got {name!r}; registered: {EXPERIMENTS.names()}")
    return str(name)


def lookup_experiment(name: str) -> type:
    try:
        return EXPERIMENTS.lookup(name)
    except KeyError as e:
        # the Registry's message lists what is registered
        raise ConfigError(f"{e.args[0]}; an experiment of your own is registered by its file: add "
                          f"plugins=[my_plugin.py] (or plugins=[mypkg.my_plugin])") from None


# ---------------------------------------------------------------------------------------------------------
# Building and checking the config
# ---------------------------------------------------------------------------------------------------------

def build_config(cls: type, raw: dict, typed: dict[str, str] | None = None):
    """The instance of `cls` with `raw` (plain nested dict) merged over its defaults, every key checked; `typed`
    holds the text after `=` of each command-line key."""
    fields = {info.path: info for info in describe_fields(cls)}
    problems = list(key_problems(raw, fields, prefix="", experiment=cls))
    if problems:
        raise ConfigError("\n".join(problems))
    keep_typed_text(raw, typed or {}, fields)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(cls), raw)
    except OmegaConfBaseException as e:
        raise ConfigError(value_error_message(e, raw, fields)) from None
    refuse_nan(merged, fields)
    try:
        return OmegaConf.to_object(merged)
    except MissingMandatoryValue as e:
        raise ConfigError(f"{e.full_key} has no default and must be set: {e.full_key}=...") from None
    except InterpolationResolutionError as e:
        raise ConfigError(f"cannot resolve the value of {e.full_key}: {first_line(e)}") from None
    except OmegaConfBaseException as e:
        raise ConfigError(value_error_message(e, raw, fields)) from None
    except ValueError as e:  # raised by the dataclass's own __post_init__ checks
        raise ConfigError(f"{cls.__qualname__}: {e}") from None


def keep_typed_text(raw: dict, typed: dict[str, str], fields: dict[str, FieldInfo]) -> None:
    """A str setting holds the text typed after `=` or in a config file, not what YAML reads it as: `trial_name=007`
    was '7', `trial_name=12:30` '750' (base 60), `dataset.system_prompt=No` 'False'. A number is read as the decimal
    typed: YAML read `seed=0042` as 34 (octal) and `max_steps=1:30` as 90 (base 60), which is refused as no number.
    After key_problems, which refuses YAML's boolean where it means something else (resume_from_checkpoint=false)."""
    for key, text in typed.items():
        *groups, leaf = key.split(".")
        node = value_at(raw, groups, default=None)
        info = fields.get(key)
        if not (info and isinstance(node, dict) and isinstance(node.get(leaf), (bool, int, float))):
            continue
        if info.type is str:
            node[leaf] = text
        elif info.type in (int, float) and not isinstance(node[leaf], bool):
            with contextlib.suppress(ValueError):
                node[leaf] = info.type(text.strip())  # 0042 is 42; 0x10 and .inf stay as YAML reads them
            if ":" in text:
                node[leaf] = text  # YAML's base 60: no number is typed so; the type check names the key


def refuse_nan(merged, fields: dict[str, FieldInfo]) -> None:
    """ConfigError naming the first setting that holds NaN, typed `nan` or `.nan`: every range check passes it (nan < 0
    and nan > 0 are both false), so ppo.lr=nan reached the optimizer, whose learner died and was restarted until the
    run gave up. Before __post_init__ runs (to_object), whose checks it would pass."""
    for path, info in fields.items():
        if info.is_group:
            continue
        value = OmegaConf.select(merged, path, throw_on_missing=False, throw_on_resolution_failure=False)
        values = value if OmegaConf.is_list(value) else [value]
        if any(isinstance(v, float) and math.isnan(v) for v in values):
            raise ConfigError(f"invalid value for {path}: expected {type_name(info.type)}, got nan (not a number)")


def refuse_inactive_settings(config) -> None:
    """What the user asked for that the rest of the config makes do nothing (the experiment's
    `refuse_inactive_settings`), as a ConfigError. Here and not in build_config: the launcher fills in
    dataset.path and model.path before its workers rebuild the config, which is no request of the user's."""
    refuse = getattr(config, "refuse_inactive_settings", None)
    if refuse is None:
        return
    try:
        refuse()
    except ValueError as e:
        raise ConfigError(f"{type(config).__qualname__}: {e}") from None


def key_problems(raw: dict, fields: dict[str, FieldInfo], prefix: str, experiment: type | None = None) -> Iterator[str]:
    """A message for each key in `raw` that is not a field, and each group given a plain value."""
    for key, value in raw.items():
        path = f"{prefix}{key}"
        info = fields.get(path)
        if info is None:
            yield from unknown_key_messages(path, value, fields, experiment)
        elif info.is_group and isinstance(value, dict):
            yield from key_problems(value, fields, prefix=f"{path}.", experiment=experiment)
        elif info.is_group and value is not None:
            example = next(p for p in fields if p.startswith(f"{path}."))
            yield (f"{path} is a group of settings ({type_name(info.type)}), not a value; "
                   f"set its keys instead, e.g. {example}=...")
        elif path == "resume_from_checkpoint" and isinstance(value, bool):  # omegaconf: the path 'False'
            yield f"invalid value for {path}: expected str, got {value} (YAML's boolean); {NO_RESUME}"


# ROLL's `resume_from_checkpoint: False`, which omegaconf would make the path 'False'.
NO_RESUME = "a fresh start is its default, empty: leave it out (or resume_from_checkpoint=); auto continues this trial"

# ROLL's names for what rlsys names otherwise: refused with ours, not read as aliases, so that a setting has one name
# in a config file, in --help, in config.yaml and in the logs.
MIXED_GAMES_SHARE = ("frozen_lake_share", "experiment=async-ppo-mixed-games's share of FrozenLake among its games, "
                                         "or a dataset row's env_name: docs/agents.md, 'Mixed games'")
MICRO_BATCH_TOKENS = ("ppo.max_tokens_per_micro_batch", "a pass's token budget: micro-batches are cut by tokens and "
                      "accumulate into one optimizer step per mini-batch, ppo.num_mini_batches a batch")
ROLL_KEYS = {
    "exp_name": ("experiment_name", "the run's name"),
    "pretrain": ("model.path", "the policy's HF checkpoint"),
    "reward_pretrain": ("the reward-model environment's model_path",
                        "an experiment whose env is reward-model: docs/data.md, 'Rewards from a model'"),
    "max_tokens_per_step": ("gen.max_new_tokens", "the most tokens one response (one turn) takes"),
    "rollout_batch_size": ("ppo.batch_size", "prompts (groups) per training step"),
    "num_return_sequences_in_group": ("group_size", "samples per prompt"),
    # The leaves of a ROLL worker's training_args, generating_args and model_args, and of its env managers
    "learning_rate": ("ppo.lr", "the policy's AdamW learning rate"),
    "num_return_sequences": ("group_size", "samples per prompt"),
    "disable_gradient_checkpointing": ("learner.gradient_checkpointing", "true recomputes activations: the inverse"),
    "max_env_num_per_worker": ("max_concurrent_rollouts", "most episodes in flight per rollout worker"),
    "tags": MIXED_GAMES_SHARE,
    "num_groups_partition": MIXED_GAMES_SHARE,
    "num_env_groups": ("ppo.batch_size", "prompts (groups) per training step, each played group_size times"),
    "max_steps_per_traj": ("num_turns", "actions per episode, in the game experiments"),
    "env_type": ("experiment", "experiment=async-ppo-frozen-lake, async-ppo-sokoban, ...: each sets its env up"),
    "env_config": ("an experiment's env property", "register_environment and an experiment of your own: README, "
                                                   "'Writing an agent, an environment and an experiment'"),
    "per_device_train_batch_size": MICRO_BATCH_TOKENS,
    "gradient_accumulation_steps": MICRO_BATCH_TOKENS,
    "strategy_name": ("inference.engine", "vllm or transformers; the learner is torch's, FSDP2 over its ranks"),
    "tp_size": ("inference.tensor_parallel_size", "the GPUs vLLM splits one inference worker's model over"),
}
# ROLL's settings that rlsys has no setting for, by the name at any depth of a path: what rlsys does in their place
ROLL_WITHOUT_COUNTERPART = {
    "model_type": "rlsys trains causal language models only, of the architecture model.path's config.json names "
                  "(any HF causal LM); leave it out",
    "pp_size": "rlsys offers no pipeline parallelism: the learner shards one model over cluster.n_learner_ranks "
               "with FSDP2, and vLLM splits an inference worker's model over inference.tensor_parallel_size GPUs, "
               "which together hold the models rlsys is meant for without a pipeline's idle stages; leave it out",
    "custom_envs": "an environment is a class registered with register_environment, and an experiment's env property "
                   "sets it up (experiment=async-ppo-frozen-lake, async-ppo-sokoban, ..., or one of your own: README, "
                   "'Writing an agent, an environment and an experiment')",
}
# rlsys's own earlier names of a setting, by their whole dotted path: refused with the name it has now, so that a
# config file written before the rename says what to change rather than which keys are near it
RENAMED_KEYS = {
    "max_turns": ("num_turns", "the most turns an episode takes, the seed's name, in every experiment with turns"),
}
# verl's settings a user of its agent loop copies (its docs ask for the first two), by their whole dotted path
VERL_KEYS = {
    "data.return_raw_chat": "rlsys keeps a row's chat messages as the dataset holds them for the agent, which renders "
                            "them with the chat template: leave it out",
    "actor_rollout_ref.rollout.mode": "rlsys's rollouts are always asynchronous: leave it out",
    "actor_rollout_ref.rollout.n": "rlsys's is group_size (samples per prompt)",
}


def unknown_key_messages(path: str, value, fields: dict[str, FieldInfo], experiment: type | None = None
                         ) -> Iterator[str]:
    if path in VERL_KEYS:
        yield f"{path!r} is verl's setting; {VERL_KEYS[path]}"
        return
    if path in RENAMED_KEYS:
        ours, meaning = RENAMED_KEYS[path]
        yield f"{path!r} is now {ours} ({meaning}): set {ours}={value}"
        return
    leaf = path.rpartition(".")[2]
    if leaf in ROLL_KEYS:
        ours, meaning = ROLL_KEYS[leaf]
        yield f"{path!r} is ROLL's name; rlsys's is {ours} ({meaning})"
        return
    roll_name = next((name for name in path.split(".") if name in ROLL_WITHOUT_COUNTERPART), None)
    if roll_name is not None and not (isinstance(value, dict) and value):  # a group's inner names may be ROLL_KEYS
        yield f"{path!r} is ROLL's setting; rlsys has none: {ROLL_WITHOUT_COUNTERPART[roll_name]}"
        return
    # An unknown group (`ppp: {lr: 1}`) is reported leaf by leaf: `ppp.lr` finds `ppo.lr`, `ppp` alone may not.
    if isinstance(value, dict) and value:
        for key, inner in value.items():
            yield from unknown_key_messages(f"{path}.{key}", inner, fields, experiment)
        return
    settable = [p for p, info in fields.items() if not info.is_group]  # a group takes no value itself
    hints = suggest_keys(path, settable)
    owners = experiments_with_key(path, besides=experiment)
    if owners:  # the key is right, the experiment is not: a plugin's `my_param=5.0` without experiment=my-experiment
        name = registry_name_of_class(experiment)
        which = (f"experiment {owners[0]!r}: add experiment={owners[0]}" if len(owners) == 1 else
                 f"experiments {', '.join(repr(o) for o in owners)}: add experiment= one of them")
        yield (f"unknown key {path!r} for experiment {name}; it is a key of {which}"
               + (f" (or did you mean {' or '.join(repr(h) for h in hints)}?)" if hints else ""))
    elif hints:
        yield f"unknown key {path!r}; did you mean {' or '.join(repr(h) for h in hints)}?"
    else:
        yield (f"unknown key {path!r}; --help lists every key (a key of an experiment of your own is known once "
               "its file is loaded and it is chosen: plugins=[my_plugin.py] experiment=NAME)")


def experiments_with_key(path: str, besides: type | None) -> list[str]:
    """The registered experiments, other than `besides`, that have `path` as a settable key."""
    return [name for name in EXPERIMENTS.names() if (cls := EXPERIMENTS.lookup(name)) is not besides
            and any(info.path == path and not info.is_group for info in describe_fields(cls))]


def registry_name_of_class(cls: type | None) -> str:
    names = [name for name in EXPERIMENTS.names() if EXPERIMENTS.lookup(name) is cls]
    return names[0] if names else (cls.__qualname__ if cls is not None else "?")


def suggest_keys(path: str, known: list[str]) -> list[str]:
    """Close matches on the last name among its siblings, then the same last name in another group
    (`lr` -> `ppo.lr`); on the whole dotted path only when the group itself is misspelled (`ppp.lr`).

    Whole paths of a known group share their prefix, which alone makes `ppo.lrr` look like `ppo.lambd`.
    """
    parent, _, leaf = path.rpartition(".")
    siblings = [p.rpartition(".")[2] for p in known if p.rpartition(".")[0] == parent]
    group_is_known = not parent or bool(siblings)
    by_path = [] if group_is_known else close_matches(path, known)
    by_leaf = [f"{parent}.{name}" if parent else name for name in close_matches(leaf, siblings)]
    same_leaf = [p for p in known if p.rpartition(".")[2] == leaf]
    return list(dict.fromkeys(by_path + by_leaf + same_leaf))[:4]


def value_error_message(e: OmegaConfBaseException, raw: dict, fields: dict[str, FieldInfo]) -> str:
    """`invalid value for KEY: expected TYPE, got VALUE` from an omegaconf validation error."""
    key = e.full_key
    if not key:
        return f"invalid configuration: {first_line(e)}"
    field_path = re.sub(r"\[\d+\]", "", key)  # `plugins[0]` -> the `plugins` field
    info = fields.get(field_path)
    given = value_at(raw, field_path.split("."), default=getattr(e, "value", None))
    expected = type_name(info.type) if info else "a different type"
    quote = f" ({quote_text(key)})" if info and info.type is str and isinstance(given, (dict, list)) else ""
    return f"invalid value for {key}: expected {expected}, got {given!r}{quote}"


def value_at(raw: dict, keys: list[str], default):
    node = raw
    for key in keys:
        if not isinstance(node, dict) or key not in node:
            return default
        node = node[key]
    return node


def first_line(e: BaseException) -> str:
    # a KeyError's str() is its message quoted
    message = getattr(e, "msg", None) or (e.args[0] if isinstance(e, KeyError) and e.args else str(e))
    return message.splitlines()[0] if message else type(e).__name__


def registry_name_of(config) -> str:
    for name in EXPERIMENTS.names():
        if EXPERIMENTS.lookup(name) is type(config):
            return name
    raise ConfigError(f"{type(config).__qualname__} is not a registered experiment; register it with "
                      f"register_experiment(name, cls) so worker processes can rebuild it")


# ---------------------------------------------------------------------------------------------------------
# The schema: fields, types, defaults and attribute docstrings
# ---------------------------------------------------------------------------------------------------------

def _iter_fields(cls: type, defaults, prefix: str) -> Iterator[FieldInfo]:
    """`defaults` is the instance a parent's default_factory made, so a subclass's overridden group
    defaults show up; None reads each field's own default."""
    hints = type_hints(cls)
    for f in dataclasses.fields(cls):
        path = f"{prefix}{f.name}"
        declared = hints.get(f.name, f.type)
        default = getattr(defaults, f.name) if defaults is not None else field_default(f)
        group = nested_dataclass(declared, default)
        yield FieldInfo(path, declared, default, is_group=group is not None, owner=cls)
        if group is not None:
            group_defaults = default if dataclasses.is_dataclass(default) else None
            yield from _iter_fields(group, group_defaults, prefix=f"{path}.")


def field_default(f: dataclasses.Field):
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return dataclasses.MISSING


def nested_dataclass(declared, default) -> type | None:
    """The dataclass a field holds (also through Optional[...]), or None for a plain value."""
    if dataclasses.is_dataclass(default) and not isinstance(default, type):
        return type(default)
    if typing.get_origin(declared) in (typing.Union, types.UnionType):
        candidates = [arg for arg in typing.get_args(declared) if arg is not type(None)]
    else:
        candidates = [declared]
    for candidate in candidates:
        if isinstance(candidate, type) and dataclasses.is_dataclass(candidate):
            return candidate
    return None


def type_hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except Exception:  # an unresolvable forward reference: fall back to the raw annotations
        return {}


@functools.lru_cache(maxsize=None)
def attribute_docs(cls: type) -> dict[str, str]:
    """Field name -> first paragraph of the string literal right after it, over the MRO (subclass wins)."""
    docs: dict[str, str] = {}
    for klass in cls.__mro__:
        if klass is object:
            continue
        for name, doc in class_attribute_docs(klass).items():
            docs.setdefault(name, doc)
    return docs


def class_attribute_docs(klass: type) -> dict[str, str]:
    try:
        source = textwrap.dedent(inspect.getsource(klass))
        tree = ast.parse(source)
    except (OSError, TypeError, SyntaxError):  # built in a REPL, by exec or make_dataclass: no source
        return {}
    class_def = next((node for node in tree.body if isinstance(node, ast.ClassDef)), None)
    if class_def is None:
        return {}
    docs = {}
    for statement, following in zip(class_def.body, class_def.body[1:]):
        if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            docs[statement.target.id] = one_line(following.value.value)
    return docs


def one_line(docstring: str) -> str:
    first_paragraph = inspect.cleandoc(docstring).split("\n\n")[0]
    return " ".join(first_paragraph.split())


def type_name(declared) -> str:
    if isinstance(declared, str):
        return declared  # an annotation left as text
    if isinstance(declared, type) and not typing.get_args(declared):
        return declared.__name__
    return str(declared).replace("typing.", "")


def format_default(default) -> str:
    return "(required)" if default is dataclasses.MISSING else repr(default)
