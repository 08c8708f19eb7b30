"""The two files at the top of a run's directory that say what the run was: CONFIG_FILE, its config as asked for,
saved by the launcher as the run starts (every run's directory has one; `--config` continues or reruns the run from
it), and SUMMARY_FILE, its result, written by the launcher as the run ends. Named here, below both the launcher that
writes them and the report that reads them, so that the two agree."""

CONFIG_FILE = "config.yaml"
SUMMARY_FILE = "summary.json"
