"""The two files at the top of a run's directory that say what the run was: CONFIG_FILE, its config as asked for,
saved by the launcher as the run starts (every run's directory has one; `--config` continues or reruns the run from
it), and SUMMARY_FILE, its result, written by the launcher as the run ends; and where its records are (logs_dir).
Named here, below both the launcher that writes them and the report that reads them, so that the two agree."""

import os
from pathlib import Path

from rlsys.plugins import is_plugin_file

CONFIG_FILE = "config.yaml"
SUMMARY_FILE = "summary.json"
LOGS_DIR = "logs"
# The settings that name a path the run reads or writes, as (group, key); trace.render_save_dir is not one: its
# relative path is in the run's directory, wherever the run starts.
PATH_SETTINGS = (("", "output_dir"), ("", "logging_dir"), ("", "resume_from_checkpoint"), ("model", "path"),
                 ("model", "cache_dir"), ("dataset", "path"), ("dataset", "eval_path"))


def continue_arguments(run_dir: Path) -> str:
    """The arguments that continue the run in `run_dir` from its newest checkpoint (from the start where none was
    saved), as the console says them to a run that stopped or failed."""
    return f"--config {run_dir / CONFIG_FILE} resume_from_checkpoint=auto"


def logs_dir(run_dir: Path, logging_dir: str | Path | None = None) -> Path:
    """The directory of a run's records and role logs: the config's `logging_dir` where set, else <run dir>/logs."""
    return Path(logging_dir) if logging_dir else run_dir / LOGS_DIR


def role_log(logging_dir: str | Path, name: str) -> Path:
    """Where the role process `name` (learner0, rollout1, ...) writes its output: <logging_dir>/<name>.log."""
    return Path(logging_dir) / f"{name}.log"


def with_absolute_paths(config):
    """`config` with each path it was given relative to the current directory made absolute, its plugin files too, so
    that `--config <run dir>/CONFIG_FILE` continues or reruns the run from any directory. A `~` path stays as given
    (it means the same home from anywhere), and so do `auto` and a plugin's module name."""
    for group, key in PATH_SETTINGS:
        holder = getattr(config, group) if group else config
        value = getattr(holder, key)
        if value and value != "auto" and not value.startswith("~"):
            setattr(holder, key, os.path.abspath(value))
    config.plugins = [os.path.abspath(entry) if is_plugin_file(entry) else entry for entry in config.plugins]
    return config
