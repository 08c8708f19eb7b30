"""The long-answer task: its generated sums, their working and the reward's reading of it, and its experiment."""

from pathlib import Path

import pytest

from experiments import EXPERIMENTS, AsyncPPOMathLongConfig
from rlsys.cli import ConfigError, parse_config
from rlsys.data.dataset import DatasetError, RowFormat, load_rows
from rlsys.data.worked_sums import generate_worked_sums_dataset, prompt_width, worked_sum
from rlsys.impl.env.math_answers import check_answer, reference_answer
from rlsys.assets import tiny_model_dir, tiny_model_key
from rlsys.model.tokenizer import row_prompt_ids

TERMS = (AsyncPPOMathLongConfig.min_terms, AsyncPPOMathLongConfig.max_terms)  # the experiment's
DIGITS = AsyncPPOMathLongConfig.term_digits


def generated(directory: Path, seed: int = 1) -> tuple[list[dict], list[dict]]:
    train, held_out = generate_worked_sums_dataset(directory, seed, 300, 100, *TERMS, DIGITS)
    return load_rows(train), load_rows(held_out)


def test_the_sums_are_seeded_and_the_splits_disjoint(tmp_path):
    train, held_out = generated(tmp_path / "a")
    assert (train, held_out) == generated(tmp_path / "b")
    assert generated(tmp_path / "c", seed=2)[0] != train
    prompts = [row["prompt"] for row in train + held_out]
    assert (len(train), len(held_out)) == (300, 100) and len(set(prompts)) == len(prompts)


def test_every_working_adds_up_and_its_final_answer_passes_the_reward_check(tmp_path, tokenizer):
    train, held_out = generated(tmp_path)
    for row in train + held_out:
        expression = row["prompt"].removesuffix("=")
        terms = [int(t) for t in expression.split("+")]
        assert TERMS[0] <= len(terms) <= TERMS[1] and all(1 <= t <= 9 for t in terms)
        *lines, final = row["solution"].split("\n")
        for line in lines:  # the first two numbers added, the rest copied, right-aligned as the longest prompt
            terms = [terms[0] + terms[1], *terms[2:]]
            assert line == "+".join(map(str, terms)).rjust(prompt_width(TERMS[1], DIGITS))
        assert len(terms) == 2 and final == f"#### {sum(terms)}"
        assert row["answer"] == str(sum(terms)) == reference_answer(row["solution"])
        ids = tokenizer(row["solution"], add_special_tokens=False)["input_ids"]
        assert 64 <= len(ids) == len(row["solution"]) <= 256  # one token a character
    width = prompt_width(TERMS[1], DIGITS)
    for count in TERMS:  # the shortest and the longest working the experiment can ask for
        assert 64 <= len(worked_sum([1] * count, width)) and len(worked_sum([9] * count, width)) <= 256
    for row in held_out:  # the reward's own check (math-verify: milliseconds each)
        assert check_answer(row["solution"], row["answer"]).correct
        assert not check_answer(row["solution"], str(int(row["answer"]) + 1)).correct


def test_a_sum_needs_at_least_two_terms(tmp_path):
    assert worked_sum([12, 34, 56, 78], prompt_width(4, 2)) == "   46+56+78\n     102+78\n#### 180"
    assert worked_sum([12, 34, 56], prompt_width(4, 2)) == "      46+56\n#### 102"
    assert worked_sum([12, 34], prompt_width(4, 2)) == "#### 46"
    assert worked_sum([6, 8, 1, 2], prompt_width(4, 1)) == " 14+1+2\n   15+2\n#### 17"
    with pytest.raises(ValueError, match="at least 2 terms"):
        generate_worked_sums_dataset(tmp_path, 1, 10, 10, 1, 3, 1)
    with pytest.raises(ValueError, match="at least 1 digit"):
        generate_worked_sums_dataset(tmp_path, 1, 10, 10, 2, 3, 0)


def test_two_digit_sums_are_drawn_from_two_digit_numbers(tmp_path):
    config = parse_config(["experiment=async-ppo-math-long", f"model.cache_dir={tmp_path}", "term_digits=2",
                           "gen.max_new_tokens=160"])
    train, _ = config.generate_dataset(tmp_path / "data")
    assert "x2-" in train.parent.name
    rows = load_rows(train)
    terms = [int(t) for row in rows for t in row["prompt"].removesuffix("=").split("+")]
    assert min(terms) >= 10 and max(terms) <= 99 and {10, 99} <= set(terms)
    assert all(len(row["solution"].split("\n")[0]) == prompt_width(config.max_terms, 2) for row in rows
               if row["prompt"].count("+") >= 2)
    with pytest.raises(ConfigError, match="term_digits=2 takes up to 153 tokens"):
        parse_config(["experiment=async-ppo-math-long", "term_digits=2"])
    with pytest.raises(ConfigError, match="term_digits must be at least 1"):
        parse_config(["experiment=async-ppo-math-long", "term_digits=0"])


def test_the_long_experiment_is_registered_and_resolves(tmp_path, tokenizer):
    assert EXPERIMENTS.lookup("async-ppo-math-long") is AsyncPPOMathLongConfig
    config = parse_config(["experiment=async-ppo-math-long", f"model.cache_dir={tmp_path}", "max_terms=7"])
    default = parse_config([f"model.cache_dir={tmp_path}"])
    assert (config.agent.name, config.env.name) == (default.agent.name, default.env.name)
    assert (config.model.warm_start_accuracy, default.model.warm_start_accuracy) == (0.35, 0.3)  # each its own stop
    train, held_out = config.generate_dataset(tmp_path / "data")
    assert "worked-sums-6to7x1" in str(train.parent)
    longest = max(len(row["solution"]) for row in load_rows(train))
    assert longest < config.gen.max_new_tokens  # room for the working and the end of sequence
    own = tiny_model_dir(config.model, tiny_model_key(config.model, config.seed, train.parent,
                                                     config.warm_start_settings))
    data = default.generate_dataset(tmp_path / "data")[0].parent
    assert own != tiny_model_dir(default.model, tiny_model_key(default.model, default.seed, data,
                                                               default.warm_start_settings))
    taught, checks = config.warm_start_examples(tokenizer, load_rows(train)[:3], load_rows(held_out)[:3])
    first = taught[0]
    answer = [t for t, m in zip(first.token_ids, first.taught) if m]
    assert tokenizer.decode(answer, skip_special_tokens=True) == load_rows(train)[0]["solution"]
    assert checks[0].accepted == (load_rows(held_out)[0]["solution"],)
    # A dataset.system_prompt is in the prompts the run sends: the warm start teaches and checks those prompts
    with_system = RowFormat(system_prompt="Show your working.")
    taught, checks = config.warm_start_examples(tokenizer, load_rows(train, with_system)[:1],
                                                load_rows(held_out, with_system)[:1])
    sent = row_prompt_ids(tokenizer, load_rows(held_out, with_system)[0])
    assert "Show your working." in tokenizer.decode(sent) and checks[0].prompt_ids == sent
    sent = row_prompt_ids(tokenizer, load_rows(train, with_system)[0])
    assert taught[0].token_ids[:len(sent)] == sent
    # rows of the user's without a working, whichever row it is: named by file, row and field, a DatasetError (the
    # launcher's StartupError), not a KeyError (or a ValueError) out of the warm start
    config.dataset.path, config.dataset.eval_path = "mine.jsonl", "held.jsonl"
    rows = load_rows(train)[:3]
    for lacking in (0, 2):
        bare = [{k: v for k, v in row.items() if k != "solution" or i != lacking} for i, row in enumerate(rows)]
        with pytest.raises(DatasetError, match=rf"^held.jsonl: row {lacking + 1}: field 'solution' missing"):
            config.warm_start_examples(tokenizer, rows, bare)
        with pytest.raises(DatasetError, match=rf"^mine.jsonl: row {lacking + 1}: field 'solution' missing"):
            config.warm_start_examples(tokenizer, bare, rows)
    with pytest.raises(ConfigError, match="min_terms must be at least 2 and at most max_terms"):
        parse_config(["experiment=async-ppo-math-long", "min_terms=9"])
    with pytest.raises(ConfigError, match="gen.max_new_tokens=128 would cut it short: set gen.max_new_tokens="):
        parse_config(["experiment=async-ppo-math-long", "max_terms=12"])
    # docs/data.md's two-digit task: the message names the length to ask for, and that length is accepted
    with pytest.raises(ConfigError, match=r"takes up to 153 tokens; gen.max_new_tokens=128 would cut it short: set "
                                          r"gen.max_new_tokens=153 or more"):
        parse_config(["experiment=async-ppo-math-long", "term_digits=2"])
    assert parse_config(["experiment=async-ppo-math-long", "term_digits=2", "gen.max_new_tokens=160"]).term_digits == 2
