"""Prompt datasets in JSONL: one object per line with at least "prompt" and "answer"."""

import json
from pathlib import Path

REQUIRED_FIELDS = ("prompt", "answer")


class DatasetError(ValueError):
    """A dataset that cannot be used; the message names the file, line and field."""


def load_jsonl_dataset(path: str | Path) -> list[dict]:
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except OSError as e:
        raise DatasetError(f"cannot read dataset {path}: {e.strerror}") from None
    rows = [_parse_row(line, path, number) for number, line in enumerate(lines, start=1) if line.strip()]
    if not rows:
        raise DatasetError(f"dataset {path} has no rows")
    return rows


def _parse_row(line: str, path: Path, number: int) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{path}:{number}: not valid JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise DatasetError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
    for name in REQUIRED_FIELDS:
        if not isinstance(row.get(name), str):
            problem = "missing" if name not in row else f"must be a string, got {type(row[name]).__name__}"
            raise DatasetError(f"{path}:{number}: field {name!r} {problem}")
    return row
