"""Prompt datasets in JSONL: one object per line with at least "prompt" and "answer".

A row may also name the agent that plays it (`agent_name`, as in verl); rows without one use the
experiment's default agent.
"""

import json
from pathlib import Path

REQUIRED_FIELDS = ("prompt", "answer")


class DatasetError(ValueError):
    """A dataset that cannot be used; the message names the file, line and field."""


FORMAT = 'one JSON object per line, with string fields "prompt" and "answer"'


def load_jsonl_dataset(path: str | Path, agent_names: list[str] | None = None) -> list[dict]:
    """The rows of `path`, each checked; with `agent_names`, a row's `agent_name` must be one of them."""
    path = Path(path)
    try:
        lines = path.read_bytes().splitlines()
    except OSError as e:
        raise DatasetError(f"cannot read dataset {path}: {e.strerror}; give a JSONL file ({FORMAT})") from None
    rows = [_parse_row(line, path, number, agent_names) for number, line in enumerate(lines, start=1) if line.strip()]
    if not rows:
        raise DatasetError(f"dataset {path} has no rows; it needs {FORMAT}")
    return rows


def _parse_row(line: bytes, path: Path, number: int, agent_names: list[str] | None) -> dict:
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DatasetError(f"{path}:{number}: not UTF-8 text (byte {e.start} is {line[e.start:e.start + 1]!r}); "
                           f"a dataset is {FORMAT}") from None
    try:
        row = json.loads(text)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}:{number}: not valid JSON ({e.msg} at column {e.colno}); "
                           f"a dataset is {FORMAT}") from None
    if not isinstance(row, dict):
        raise DatasetError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
    for name in REQUIRED_FIELDS:
        if not isinstance(row.get(name), str):
            problem = "missing" if name not in row else f"must be a string, got {type(row[name]).__name__}"
            raise DatasetError(f"{path}:{number}: field {name!r} {problem}")
    if agent_names is not None and "agent_name" in row and row["agent_name"] not in agent_names:
        raise DatasetError(f"{path}:{number}: agent_name {row['agent_name']!r} is not an agent of this experiment; "
                           f"it has {sorted(agent_names)} (override the experiment's `agents` to add one)")
    return row


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tmp.rename(path)  # atomic: a reader never sees half a file
    return path
