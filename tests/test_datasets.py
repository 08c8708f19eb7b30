"""Datasets as users have them: JSONL, JSON, Parquet, Arrow and save_to_disk directories, read with Hugging Face
`datasets`; key mapping (nested too), chat-message prompts, system prompt and template through the chat
template; bad rows named by file, row and field; verl-style GSM8K preprocessing."""

import json
import subprocess
import sys
from pathlib import Path

import datasets
import pytest

from experiments.common import DatasetConfig
from rlsys.data.dataset import DatasetError, RowFormat, load_rows
from rlsys.data.word_problems import generate
from rlsys.model.tokenizer import build_char_tokenizer, row_prompt_ids

ROOT = Path(__file__).resolve().parents[1]
ROWS = [{"question": "1+1=", "reward_model": {"ground_truth": "2", "style": "rule"}, "id": 0},
        {"question": "2+3=", "reward_model": {"ground_truth": "5", "style": "rule"}, "id": 1}]
VERL = RowFormat(prompt_key="question", answer_key="reward_model.ground_truth")


def write(rows: list[dict], path: Path) -> Path:
    """`rows` in the format `path` names, written by `datasets` itself where it writes that format."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    elif path.suffix == ".parquet":
        datasets.Dataset.from_list(rows).to_parquet(str(path))
    elif path.suffix == ".arrow":  # a file of the format `load_dataset` caches a download in (~/.cache/huggingface)
        saved = path.with_suffix(".saved")
        datasets.Dataset.from_list(rows).save_to_disk(str(saved))
        next(saved.glob("*.arrow")).rename(path)
    else:
        datasets.Dataset.from_list(rows).save_to_disk(str(path))
    return path


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.json", "rows.parquet", "rows.arrow", "saved"])
def test_each_format_loads_with_nested_keys_mapped(tmp_path, name):
    rows = load_rows(write(ROWS, tmp_path / name), VERL)
    assert [(r["prompt"], r["answer"], r["id"]) for r in rows] == [("1+1=", "2", 0), ("2+3=", "5", 1)]
    assert all("messages" not in r for r in rows)  # a plain prompt renders as one user message


def test_a_saved_dataset_dict_names_its_splits(tmp_path):
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ROWS), "test": datasets.Dataset.from_list(ROWS)}
                         ).save_to_disk(str(tmp_path / "dd"))
    # the example named is the training split, which dataset.path wants, not the first in order
    with pytest.raises(DatasetError, match=r"holds the splits \['test', 'train'\]; give one of them, e\.g\. .*/train$"):
        load_rows(tmp_path / "dd", VERL)
    assert len(load_rows(tmp_path / "dd" / "train", VERL)) == 2


def test_chat_prompts_system_prompt_and_template_go_through_the_chat_template(tmp_path):
    rows = [{"prompt": [{"role": "user", "content": "2+2="}], "answer": 4},
            {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "3+3="}],
             "answer": "6"},
            {"prompt": "5+5=", "answer": "10"},
            {"prompt": [{"role": "developer", "content": "Be terse."}, {"role": "user", "content": "4+4="}],
             "answer": "8"}]
    fmt = RowFormat(system_prompt="You add.", prompt_template="Q: {prompt} A?")
    loaded = load_rows(write(rows, tmp_path / "chat.jsonl"), fmt)
    assert [r["prompt"] for r in loaded] == ["Q: 2+2= A?", "Q: 3+3= A?", "Q: 5+5= A?", "Q: 4+4= A?"]
    assert loaded[0]["answer"] == "4"  # a number is a reference too
    tokenizer = build_char_tokenizer()
    rendered = [tokenizer.decode(row_prompt_ids(tokenizer, r)) for r in loaded]
    assert rendered == ["<|system|>You add.<|end|><|user|>Q: 2+2= A?<|end|><|assistant|>",
                        "<|system|>Be brief.<|end|><|user|>Q: 3+3= A?<|end|><|assistant|>",  # its own system kept
                        "<|system|>You add.<|end|><|user|>Q: 5+5= A?<|end|><|assistant|>",
                        # a developer message is the row's system message (OpenAI's newer name): no second one
                        "<|system|>Be terse.<|end|><|user|>Q: 4+4= A?<|end|><|assistant|>"]
    plain = load_rows(tmp_path / "chat.jsonl")[2]
    assert tokenizer.decode(row_prompt_ids(tokenizer, plain)) == "<|user|>5+5=<|end|><|assistant|>"


@pytest.mark.parametrize("rows, fmt, message", [
    ([ROWS[0], {"question": "x", "id": 2}], VERL, r"rows.parquet: row 2: field 'reward_model.ground_truth' missing"),
    ([ROWS[0], {**ROWS[1], "question": None}], VERL, r"rows.parquet: row 2: field 'question' missing"),
    ([{"prompt": [{"role": "user"}], "answer": "1"}], RowFormat(),
     r"row 1: field 'prompt': message 0 must be an object"),
    ([{"prompt": [], "answer": "1"}], RowFormat(), r"row 1: field 'prompt' must be a string or a non-empty list"),
    ([{"prompt": "p", "answer": ["1"]}], RowFormat(), r"row 1: field 'answer' must be a string or a number, got list"),
    ([ROWS[0], {**ROWS[1], "question": " \n"}], VERL, r"rows.parquet: row 2: field 'question' is empty$"),
    ([{"prompt": [{"role": "system", "content": ""}, {"role": "user", "content": " "}], "answer": "1"}], RowFormat(),
     r"row 1: field 'prompt' is empty \(every message's content is\)"),
])
def test_a_bad_row_names_file_row_and_field(tmp_path, rows, fmt, message):
    with pytest.raises(DatasetError, match=message):
        load_rows(write(rows, tmp_path / "rows.parquet"), fmt)


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.json"])
def test_json_numbers_come_out_as_the_file_wrote_them(tmp_path, name):
    """pyarrow reads a column of integers and fractions as floats; the rows must not: 5 is not "5.0"."""
    rows = [{"prompt": "2+3=", "answer": 5, "meta": {"id": 12345678901234567891, "weight": 1}},
            {"prompt": "5/2=", "answer": 2.5, "meta": {"id": 7, "weight": 123456.78901234567}}]
    loaded = load_rows(write(rows, tmp_path / name))
    assert [r["answer"] for r in loaded] == ["5", "2.5"]
    assert [r["meta"] for r in loaded] == [row["meta"] for row in rows]


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.json"])
def test_strings_beside_numbers_come_out_as_the_file_wrote_them(tmp_path, name):
    """A column of numbers and strings sends datasets to its fallback reader, which read the strings that look like
    numbers as numbers: "007" came out "7", "1e3" "1000.0"."""
    rows = [{"prompt": "5=", "answer": 5, "code": "0012"}, {"prompt": "7=", "answer": "007", "code": 12},
            {"prompt": "k=", "answer": "1e3", "code": "3.10"}]
    loaded = load_rows(write(rows, tmp_path / name))
    assert [(r["answer"], r["code"]) for r in loaded] == [("5", "0012"), ("007", 12), ("1e3", "3.10")]


def test_a_json_file_of_json_lines_loads_as_datasets_reads_it(tmp_path):
    """datasets reads a .json file that holds an object a line as JSON lines; so must the rest of the reading (the
    numbers as the file wrote them, the line of a bad row), not take it for one document that is not valid JSON."""
    rows = [{"prompt": "5/2=", "answer": 2.5}, {"prompt": "2+2=", "answer": 4, "meta": {"k": "007"}}]
    jsonl = write(rows, tmp_path / "rows.jsonl")
    (tmp_path / "rows.json").write_text(jsonl.read_text())
    assert load_rows(tmp_path / "rows.json") == load_rows(jsonl)
    assert [r["answer"] for r in load_rows(tmp_path / "rows.json")] == ["2.5", "4"]
    (tmp_path / "rows.json").write_text(jsonl.read_text() + '{"prompt": "x", "answer": \n')
    with pytest.raises(DatasetError, match=r"rows.json:3: not valid JSON"):
        load_rows(tmp_path / "rows.json")
    (tmp_path / "rows.json").write_text(jsonl.read_text() + '\n{"prompt": "x", "answer": [1]}\n')
    with pytest.raises(DatasetError, match=r"rows.json:4: field 'answer' must be a string or a number, got list"):
        load_rows(tmp_path / "rows.json")  # the line, as in a .jsonl file; it was "row 3"


def test_a_key_given_twice_in_a_json_list_is_refused(tmp_path):
    path = tmp_path / "rows.json"
    path.write_text('[{"prompt": "1+1=", "answer": "2"}, {"prompt": "2+2=", "answer": "4", "answer": "5"}]')
    with pytest.raises(DatasetError, match=r"rows.json: key 'answer' is given twice in one object; keep one"):
        load_rows(path)  # datasets' reader kept one of them without a word


def test_answers_of_mixed_types_load_beside_a_line_of_spaces(tmp_path):
    """Numbers and strings in one column send datasets to its fallback reader, which took a line of spaces (an
    editor's trailing one) for a row and refused the file naming no line; blank lines hold no row."""
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps({"prompt": "1+1=", "answer": 2}) + "\n  \n"
                    + json.dumps({"prompt": "x=", "answer": "\\frac{1}{2}", "meta": {"k": 1.5}}) + "\n \n")
    rows = load_rows(path)
    assert [(r["prompt"], r["answer"], r.get("meta")) for r in rows] == [("1+1=", "2", None),
                                                                          ("x=", "\\frac{1}{2}", {"k": 1.5})]
    path.write_text(path.read_text() + json.dumps({"prompt": "y=", "answer": [1]}) + "\n")
    with pytest.raises(DatasetError, match=r"rows.jsonl:5: field 'answer' must be a string or a number, got list"):
        load_rows(path)


def test_deeply_nested_json_is_a_clear_error_not_a_recursion_error(tmp_path):
    good = json.dumps({"prompt": "1+1=", "answer": "2"})
    path = tmp_path / "deep.jsonl"
    path.write_text(good + "\n" + '{"prompt": "x", "answer": "1", "extra": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    with pytest.raises(DatasetError, match=r"deep.jsonl:2: JSON nested too deeply"):
        load_rows(path)  # pyarrow's reader crashed the process on this row (stack overflow)
    extra = json.loads("[" * 70 + "]" * 70)  # Python reads what pyarrow could not (it was refused past 64 levels)
    path.write_text(good + "\n" + json.dumps({"prompt": "x", "answer": "1", "extra": extra}))
    assert load_rows(path)[1]["extra"] == extra


def test_unknown_suffix_and_bad_config_are_refused(tmp_path):
    (tmp_path / "rows.csv").write_text("prompt,answer\n")
    with pytest.raises(DatasetError, match=r"unknown suffix '.csv'"):
        load_rows(tmp_path / "rows.csv")
    with pytest.raises(ValueError, match=r"dataset.prompt_template must contain \{prompt\}"):
        DatasetConfig(prompt_template="Solve it.")
    with pytest.raises(ValueError, match=r"dataset.answer_key must name a field"):
        DatasetConfig(answer_key="reward_model.")


def test_a_template_with_braces_is_set_from_the_command_line():
    from rlsys.cli import parse_config

    assert parse_config(['dataset.prompt_template="Q: {prompt} A:"']).dataset.prompt_template == "Q: {prompt} A:"


def test_gsm8k_preprocessing_writes_rows_that_load(tmp_path):
    train, _ = generate(tmp_path / "gsm", num_train=20, num_test=5, seed=3)
    out = tmp_path / "train.parquet"
    done = subprocess.run([sys.executable, str(ROOT / "scripts/preprocess_gsm8k.py"), str(train), str(out),
                           "--agent-name", "math-single-step"], capture_output=True, text=True, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    source = [json.loads(line) for line in train.read_text().splitlines()]
    for fmt in (RowFormat(), RowFormat(answer_key="reward_model.ground_truth")):
        rows = load_rows(out, fmt, agent_names=["math-single-step"])
        assert [r["answer"] for r in rows] == [s["answer"].rsplit("#### ", 1)[1] for s in source]
        assert all(r["agent_name"] == "math-single-step" and r["prompt"].startswith(s["question"])
                   and r["prompt"].endswith('after "####".') for r, s in zip(rows, source))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "q", "answer": "no final line"}) + "\n")
    done = subprocess.run([sys.executable, str(ROOT / "scripts/preprocess_gsm8k.py"), str(bad), str(out)],
                          capture_output=True, text=True)
    assert done.returncode == 2 and "bad.jsonl: row 1: field 'answer' has no '#### <answer>' line" in done.stderr
