"""Prompt datasets as users have them, checked row by row: JSON read by Python, the rest by Hugging Face `datasets`.

A dataset is a JSONL, JSON, Parquet or Arrow file, or a directory written by `Dataset.save_to_disk`. Each row
gives a prompt and a reference answer under the keys `RowFormat` names; a dotted key reaches into nested
fields (`reward_model.ground_truth`, as verl writes it). A prompt is a string or a list of chat messages
(`{"role", "content"}`); an answer is a string or a number. Every row comes out in one shape:

    {"prompt": <the user's text, templated>, "answer": <str>, "messages": <chat, when not just the prompt>,
     "given_prompt": <the prompt as the file gave it>, ...the row's other top-level fields (e.g. `agent_name`)}

so agents and environments read `prompt`/`answer` whatever the file called them, and the prompt stream
renders `messages` (system prompt included) with the tokenizer's chat template.
"""

import codecs
import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

PROMPT_PLACEHOLDER = "{prompt}"
GIVEN_PROMPT = "given_prompt"  # a row's prompt before rlsys's template and system prompt (TRL's reward functions)


class DatasetError(ValueError):
    """A dataset that cannot be used; the message names the file, row and field."""


@dataclass(frozen=True)
class RowFormat:
    """Where a row keeps its prompt and answer, and what is added to the prompt."""

    prompt_key: str = "prompt"
    answer_key: str = "answer"
    system_prompt: str = ""  # added as the first message of rows that have no system message
    prompt_template: str = ""  # the user's text is put where "{prompt}" is; empty: the text as it is
    settings: str = "dataset."  # where the config names the keys (dataset.prompt_key), for errors; "": no config


# .arrow: the files `datasets.load_dataset` caches a download in (~/.cache/huggingface/datasets), read where they are
SUFFIXES = {".jsonl": "json", ".json": "json", ".parquet": "parquet", ".arrow": "arrow"}
FORMATS = "a JSONL, JSON, Parquet or Arrow file, or a directory written by Dataset.save_to_disk"


def load_rows(path: str | Path, row_format: RowFormat = RowFormat(),
              agent_names: list[str] | None = None) -> list[dict]:
    """The rows of the dataset at `path`, each checked and in the one shape above; with `agent_names`, a
    row's `agent_name` must be one of them."""
    path = Path(path)
    records = _read(path)
    if not records:
        raise DatasetError(f"dataset {path} has no rows")
    return [_row(record, where, row_format, agent_names) for where, record in records]


def rows_fingerprint(rows: list[dict]) -> str:
    """A digest of the rows, in order. Prompts are named by their row's place (rlsys/data/prompts.py), so a run
    resumed on other rows would skip rows it never trained and train others again: its checkpoint keeps this."""
    digest = hashlib.blake2b(digest_size=16)
    for row in rows:  # GIVEN_PROMPT left out: the formatted prompt follows it, and checkpoints from before it resume
        digest.update(row_text({k: v for k, v in row.items() if k != GIVEN_PROMPT}).encode() + b"\n")
    return digest.hexdigest()


def row_text(row: dict) -> str:
    """A row as text, its keys in order: rows equal in every field (prompt, answer, a game's seed) give one text."""
    return json.dumps(row, sort_keys=True, default=str)


def _read(path: Path) -> list[tuple[str, object]]:
    """Each record of the file, with where errors name it: `file:LINE` for an object a line (blank lines hold no
    row), else `file: row N` (from 1)."""
    if not path.exists():
        raise DatasetError(f"cannot read dataset {path}: no such file; give {FORMATS}")
    builder = SUFFIXES.get(path.suffix)
    if builder is None and not path.is_dir():
        raise DatasetError(f"dataset {path}: unknown suffix {path.suffix!r}; give {FORMATS} "
                           f"(suffixes {sorted(SUFFIXES)})")
    if builder == "json" and not path.is_dir():
        # Python reads JSON, not datasets: its readers change what the file wrote (pyarrow read a column of integers
        # and fractions as floats, an answer 5 beside one of 2.5 coming out "5.0"; the fallback for columns of mixed
        # types read "007" as 7), and pyarrow crashes the process on a file of nulls or rows nested 100,000 deep.
        return _json_rows(path)
    import datasets

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()
    if path.is_dir():
        try:
            loaded = datasets.load_from_disk(str(path))
        except (FileNotFoundError, ValueError) as e:
            raise DatasetError(f"cannot read dataset {path}: {e}; give {FORMATS}") from None
        if isinstance(loaded, datasets.DatasetDict):
            example = "train" if "train" in loaded else sorted(loaded)[0]  # what dataset.path, the first asked, wants
            raise DatasetError(f"dataset {path} holds the splits {sorted(loaded)}; give one of them, "
                               f"e.g. {path / example}")
        return _numbered(path, loaded.to_list())
    try:
        return _numbered(path, datasets.load_dataset(builder, data_files=str(path), split="train").to_list())
    except Exception as e:  # datasets wraps what pyarrow says
        cause = e.__cause__ or e
        raise DatasetError(f"cannot read dataset {path}: {type(cause).__name__}: {str(cause)[:300]}") from None


def _numbered(path: Path, records: list) -> list[tuple[str, object]]:
    return [(f"{path}: row {number}", record) for number, record in enumerate(records, start=1)]


def _json_rows(path: Path) -> list[tuple[str, dict]]:
    """The rows of a JSON file (a list of objects) or a JSONL file (an object a line; blank lines hold none), as the
    file wrote them, each with where it is; DatasetError naming the line at fault: not UTF-8, not JSON, not an object,
    a key given twice."""
    data = path.read_bytes().removeprefix(codecs.BOM_UTF8)
    one_per_line = _is_json_lines(path, data)
    rows = []
    for number, line in enumerate(data.splitlines() if one_per_line else [data], start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}" if one_per_line else str(path)
        value = _json_value(line, where)
        if one_per_line and isinstance(value, dict):
            rows.append((where, value))
        elif not one_per_line and isinstance(value, list) and all(isinstance(v, dict) for v in value):
            rows = _numbered(path, value)
        else:
            shape = "a JSON object" if one_per_line else "a list of JSON objects (or one object per line, .jsonl)"
            raise DatasetError(f"{where}: expected {shape}, got {type(value).__name__}")
    return rows


def _json_value(line: bytes, where: str):
    def unique(pairs: list[tuple]) -> dict:
        keys = [key for key, _ in pairs]
        if twice := next((key for key in keys if keys.count(key) > 1), None):
            raise DatasetError(f"{where}: key {twice!r} is given twice in one object; keep one")
        return dict(pairs)

    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DatasetError(f"{where}: not UTF-8 text (byte {e.start} is {line[e.start:e.start + 1]!r})") from None
    try:
        return json.loads(text, object_pairs_hook=unique)
    except json.JSONDecodeError as e:
        raise DatasetError(f"{where}: not valid JSON ({e.msg} at column {e.colno})") from None
    except RecursionError:
        raise DatasetError(f"{where}: JSON nested too deeply to read") from None


def _is_json_lines(path: Path, data: bytes) -> bool:
    """Whether the file holds a JSON object a line, as datasets reads it: a .jsonl file, or a .json file that starts
    with an object (a JSON document is a list of them)."""
    return path.suffix == ".jsonl" or data.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"{")


def _field(record: dict, key: str, where: str, setting: str):
    """`record[key]`, where a dotted key reaches into nested objects; `setting` is the config key naming it, if any."""
    value = record
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value or value[part] is None:
            present = sorted(k for k, v in record.items() if v is not None)
            hint = f"; {setting}=FIELD reads another, dots reaching into nested ones" if setting else ""
            raise DatasetError(f"{where}: field {key!r} missing (the row has {present}{hint})")
        value = value[part]
    return value


def _row(record, where: str, row_format: RowFormat, agent_names: list[str] | None) -> dict:
    if not isinstance(record, dict):
        raise DatasetError(f"{where}: expected an object, got {type(record).__name__}")
    settings = row_format.settings
    prompt = _field(record, row_format.prompt_key, where, settings and f"{settings}prompt_key")
    answer = _field(record, row_format.answer_key, where, settings and f"{settings}answer_key")
    if isinstance(answer, (int, float)) and not isinstance(answer, bool):
        answer = str(answer)
    if not isinstance(answer, str):
        raise DatasetError(f"{where}: field {row_format.answer_key!r} must be a string or a number, "
                           f"got {type(answer).__name__}")
    given = _chat(prompt, f"{where}: field {row_format.prompt_key!r}")
    messages = _formatted(given, row_format)
    row = {key: value for key, value in record.items() if value is not None}
    user = [m for m in messages if m["role"] == "user"]
    row.update(prompt=user[-1]["content"] if user else messages[-1]["content"], answer=answer)
    row[GIVEN_PROMPT] = prompt if isinstance(prompt, str) else given
    if len(messages) > 1 or messages[0]["role"] != "user":
        row["messages"] = messages
    else:
        row.pop("messages", None)
    if agent_names is not None and "agent_name" in row and row["agent_name"] not in agent_names:
        raise DatasetError(f"{where}: agent_name {row['agent_name']!r} is not an agent of this "
                           f"experiment; it has {sorted(agent_names)} (override the experiment's `agents` to add one)")
    return row


def _chat(prompt, where: str) -> list[dict]:
    """The chat messages a prompt field gives: a string is one user message."""
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list) and prompt:
        messages = []
        for i, message in enumerate(prompt):
            if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                    and isinstance(message.get("content"), str)):
                raise DatasetError(f"{where}: message {i} must be an object with string 'role' and 'content', "
                                   f"got {str(message)[:80]}")
            # a column of messages gets every key any message has, None where a message lacks it
            messages.append({k: v for k, v in message.items() if v is not None})
    else:
        raise DatasetError(f"{where} must be a string or a non-empty list of chat messages, "
                           f"got {type(prompt).__name__}")
    if not any(message["content"].strip() for message in messages):  # the model would be asked nothing
        raise DatasetError(f"{where} is empty" + ("" if isinstance(prompt, str) else " (every message's content is)"))
    return messages


def _formatted(given: list[dict], row_format: RowFormat) -> list[dict]:
    """The chat the prompt stands for: system prompt first, the template applied to the last user message."""
    messages = list(given)
    if row_format.prompt_template:
        last_user = max((i for i, m in enumerate(messages) if m["role"] == "user"), default=None)
        if last_user is not None:
            content = row_format.prompt_template.replace(PROMPT_PLACEHOLDER, messages[last_user]["content"])
            messages[last_user] = {**messages[last_user], "content": content}
    # a row's own system message, under its name or OpenAI's newer one (developer), stands in for the system prompt
    if row_format.system_prompt and messages[0]["role"] not in ("system", "developer"):
        messages.insert(0, {"role": "system", "content": row_format.system_prompt})
    return messages


def write_jsonl(rows: list[dict], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    # This process's own name: runs generating the file at once each rename a whole one (with one name for all, one
    # renamed it from under another).
    tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
    tmp.write_text("".join(json.dumps(row) + "\n" for row in rows))
    tmp.rename(path)  # atomic: a reader never sees half a file
    return path
