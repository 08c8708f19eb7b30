"""The two files at the top of a run's directory that say what the run was: CONFIG_FILE, its config as asked for,
saved by the launcher as the run starts (every run's directory has one; `--config` continues or reruns the run from
it), and SUMMARY_FILE, its result, written by the launcher as the run ends; and where its records are (logs_dir).
Named here, below both the launcher that writes them and the report that reads them, so that the two agree."""

from pathlib import Path

CONFIG_FILE = "config.yaml"
SUMMARY_FILE = "summary.json"
LOGS_DIR = "logs"


def logs_dir(run_dir: Path, logging_dir: str | Path | None = None) -> Path:
    """The directory of a run's records and role logs: the config's `logging_dir` where set, else <run dir>/logs."""
    return Path(logging_dir) if logging_dir else run_dir / LOGS_DIR


def role_log(logging_dir: str | Path, name: str) -> Path:
    """Where the role process `name` (learner0, rollout1, ...) writes its output: <logging_dir>/<name>.log."""
    return Path(logging_dir) / f"{name}.log"
