"""The tiny model's warm start: its batches in groups of similar length take the whole batch's gradient, and its
schedule is part of the cached model's key."""

import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from experiments.async_ppo_math import AsyncPPOMATHConfig
from experiments.async_ppo_multi_turn import AsyncPPOMathMultiTurnConfig
from experiments.common import ModelConfig
from rlsys.assets import tiny_model_dir, tiny_model_key
from rlsys.model.tiny import _length_groups, _supervised_batch, build_tiny_model, supervised_backward
from rlsys.model.warm_start_examples import TaughtSequence
from rlsys.cli import parse_config
from rlsys.model.tokenizer import build_char_tokenizer


def test_grouping_by_length_gives_the_padded_batch_gradient():
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1), tokenizer, 0)
    rng = random.Random(0)
    examples = []
    for length in [12] * 6 + [15, 40, 90]:  # arithmetic, and a few long retries among them
        ids = [rng.randrange(7, len(tokenizer)) for _ in range(length)]
        examples.append(TaughtSequence(ids, [0] * (length // 2) + [1] * (length - length // 2)))
    assert len(_length_groups(examples)) == 3

    ids, labels = _supervised_batch(tokenizer, examples)
    model(input_ids=ids, labels=labels).loss.backward()
    padded = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    supervised_backward(model, tokenizer, examples)
    for p, expected in zip(model.parameters(), padded):
        assert torch.allclose(p.grad, expected, atol=1e-6, rtol=1e-4)


class Recites:
    """A stand-in model whose greedy answer to every prompt is `answer` (the accuracy check's only caller of it)."""

    device = torch.device("cpu")

    def __init__(self, tokenizer, answer: str):
        self.answer = tokenizer(answer, add_special_tokens=False)["input_ids"]

    def eval(self):
        pass

    train = eval

    def generate(self, ids, max_new_tokens, **_):
        return torch.cat([ids, torch.tensor([self.answer[:max_new_tokens]] * len(ids))], dim=1)


def test_a_right_aligned_working_counts_as_right_when_the_model_writes_it():
    """The long-answer task's working starts with spaces (its first line right-aligned): the check strips both
    sides, where it once stripped only the model's text and so counted every working wrong."""
    from rlsys.model.tiny import greedy_accuracy
    from rlsys.model.warm_start_examples import AnswerCheck

    tokenizer = build_char_tokenizer()
    working = "   46+56+78\n     102+78\n#### 180"
    checks = [AnswerCheck([5, 6, 7], (working,)), AnswerCheck([5, 6, 8], ("#### 181",))]
    assert greedy_accuracy(Recites(tokenizer, working), tokenizer, checks, max_new_tokens=40) == 0.5


def test_a_check_with_a_final_mark_reads_only_the_final_number_and_leaves_room_for_the_working():
    """The long-answer task's warm start is checked as its reward reads an answer: the number after the last
    `#### `, whatever the working before it; the model may still write as many tokens as the reference working."""
    from rlsys.model.tiny import greedy_accuracy
    from rlsys.model.warm_start_examples import AnswerCheck

    tokenizer = build_char_tokenizer()
    reference = "   46+56+78\n     102+78\n#### 180"
    slip = "   46+56+78\n     103+77\n#### 180"  # a wrong line, the right total
    for written, right in ((slip, 1.0), (reference.replace("180", "181"), 0.0), ("180", 1.0)):
        check = AnswerCheck([5, 6, 7], (reference,), final_mark="#### ")
        assert greedy_accuracy(Recites(tokenizer, written), tokenizer, [check]) == right, written
    assert greedy_accuracy(Recites(tokenizer, slip), tokenizer, [AnswerCheck([5, 6, 7], (reference,))]) == 0.0


def test_a_warm_start_prints_a_line_at_most_every_few_seconds_and_no_bars(tmp_path, monkeypatch, capfd):
    """The console of a first run: one line per LOG_EVERY_SECONDS of a warm start, not one per check (a 3-minute
    warm start printed 30), and no third-party progress bar when the model is saved."""
    from rlsys.model import tiny
    from rlsys.model.tiny import prepare_tiny_model
    from rlsys.model.warm_start_examples import AnswerCheck

    taught = [TaughtSequence([5, 6, 7, 8], [0, 0, 1, 1])] * 4
    checks = [AnswerCheck([5, 6], ("#### 1",))]
    cfg = ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1, warm_start_accuracy=1.0,
                      cache_dir=str(tmp_path))
    for seconds, per_check in ((3600, 0), (0, 1)):
        monkeypatch.setattr(tiny, "LOG_EVERY_SECONDS", seconds)
        lines = []
        prepare_tiny_model(cfg, 0, lambda tok: (taught, checks), tmp_path / str(seconds), lines.append,
                           batch_size=2, eval_every=1, max_steps=4)
        # "building ...", the checks' lines, "warm start reached ..."
        assert len(lines) == 2 + 4 * per_check, lines
        assert "at its limit of 4 steps" in lines[-1]
    out, err = capfd.readouterr()
    assert "Writing model shards" not in out + err


class Samples:
    """A stand-in model that answers each row of a batch with the next of `answers`, round and round, and keeps the
    sampling arguments it was called with."""

    device = torch.device("cpu")

    def __init__(self, tokenizer, answers: list[str]):
        self.answers = [tokenizer(a, add_special_tokens=False)["input_ids"] for a in answers]
        self.calls = []

    def eval(self):
        pass

    train = eval

    def generate(self, ids, max_new_tokens, attention_mask, pad_token_id, eos_token_id, **sampling):
        self.calls.append(sampling)
        width = max(map(len, self.answers))
        rows = [(self.answers[i % len(self.answers)] + [0] * width)[:width] for i in range(len(ids))]
        return torch.cat([ids, torch.tensor(rows)], dim=1)


def test_reach_is_the_share_of_problems_with_a_right_answer_in_their_group_of_samples():
    """What a group of rollouts can teach: a problem counts if any of its samples is right; sampled at the run's
    temperature, seeded, and the caller's random generator left where it was."""
    from rlsys.model.tiny import sampled_reach
    from rlsys.model.warm_start_examples import AnswerCheck

    tokenizer = build_char_tokenizer()
    checks = [AnswerCheck([5, 6], ("#### 1",)), AnswerCheck([5, 7], ("#### 2",))]
    model = Samples(tokenizer, ["#### 1", "#### 3", "#### 3", "#### 3"])  # problem 1: its first sample right
    torch.manual_seed(7)
    expected_draw = torch.rand(1)
    torch.manual_seed(7)
    assert sampled_reach(model, tokenizer, checks, samples=2, temperature=0.7, seed=0) == 0.5
    assert torch.rand(1) == expected_draw
    assert model.calls == [{"do_sample": True, "temperature": 0.7, "top_k": 0, "top_p": 1.0}]
    assert sampled_reach(Samples(tokenizer, ["#### 1", "#### 1", "#### 3", "#### 2"]), tokenizer, checks,
                         samples=2, temperature=1.0, seed=0) == 1.0
    assert sampled_reach(model, tokenizer, checks, samples=1, temperature=1.0, seed=0) == 0.5


def test_a_warm_start_with_a_reach_goes_on_until_both_are_met(monkeypatch):
    """Greedy accuracy first (the reach is sampled only once it is met), then the reach: a check with enough greedy
    answers but too few groups holding a right one does not stop the warm start."""
    from rlsys.model import tiny
    from rlsys.model.tiny import WarmStartStop, warm_start

    tokenizer = build_char_tokenizer()
    model = build_tiny_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1), tokenizer, 0)
    greedy, reach = iter([0.1, 0.35, 0.4, 0.5, 0.6]), iter([0.6, 0.7, 0.8, 0.9])
    sampled = []
    monkeypatch.setattr(tiny, "greedy_accuracy", lambda *a, **k: next(greedy))
    monkeypatch.setattr(tiny, "sampled_reach", lambda m, t, e, samples, temperature, seed: sampled.append(
        (samples, temperature)) or next(reach))
    taught = [TaughtSequence([5, 6, 7, 8], [0, 0, 1, 1])] * 4
    stop = WarmStartStop(accuracy=0.3, reach=0.75, samples=8, temperature=0.9)
    assert warm_start(model, tokenizer, taught, [], stop, seed=0, eval_every=1, batch_size=2) == (0.5, 0.8)
    assert sampled == [(8, 0.9)] * 3  # not at the first check, below 30% greedy
    greedy = iter([0.1, 0.35])
    assert warm_start(model, tokenizer, taught, [], WarmStartStop(0.3), seed=0, eval_every=1,
                      batch_size=2) == (0.35, None)


def test_a_warm_start_on_fewer_examples_than_its_batch_takes_all_of_them_each_step(monkeypatch):
    """A dataset smaller than the warm start's batch (dataset.num_train=100 against the default run's 128) once
    stopped the run with random.sample's 'Sample larger than population'."""
    from rlsys.model import tiny
    from rlsys.model.tiny import WarmStartStop, warm_start

    tokenizer = build_char_tokenizer()
    model = build_tiny_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1), tokenizer, 0)
    taught = [TaughtSequence([5, 6, 7, 8 + i], [0, 0, 1, 1]) for i in range(3)]
    batches = []
    backward = tiny.supervised_backward
    monkeypatch.setattr(tiny, "supervised_backward", lambda m, t, examples: (batches.append(examples),
                                                                              backward(m, t, examples)))
    monkeypatch.setattr(tiny, "greedy_accuracy", lambda *a, **k: 0.0)
    assert warm_start(model, tokenizer, taught, [], WarmStartStop(0.5), seed=0, max_steps=2, eval_every=1,
                      batch_size=8) == (0.0, None)
    assert [sorted(e.token_ids[-1] for e in batch) for batch in batches] == [[8, 9, 10]] * 2


def test_a_warm_start_that_ends_between_checks_reports_its_last_step_s_model(monkeypatch):
    """max_steps=5 with a check every 2 steps: the model saved is step 5's, and its accuracy is the one returned (it
    was step 4's check)."""
    from rlsys.model import tiny
    from rlsys.model.tiny import WarmStartStop, warm_start

    tokenizer = build_char_tokenizer()
    model = build_tiny_model(ModelConfig(hidden_size=32, num_layers=1, num_heads=2, num_kv_heads=1), tokenizer, 0)
    steps, checked = [], []
    monkeypatch.setattr(tiny, "supervised_backward", lambda m, t, examples: steps.append(len(steps) + 1))
    monkeypatch.setattr(tiny, "greedy_accuracy", lambda *a, **k: checked.append(len(steps)) or len(steps) / 10)
    taught = [TaughtSequence([5, 6, 7, 8], [0, 0, 1, 1])] * 4
    assert warm_start(model, tokenizer, taught, [], WarmStartStop(0.9), seed=0, max_steps=5, eval_every=2,
                      batch_size=2) == (0.5, None)
    assert checked == [2, 4, 5]


def test_the_reach_and_what_it_is_sampled_with_are_part_of_the_cached_model_key(tmp_path):
    from rlsys.assets import warm_start_key

    def key(*overrides):
        config = parse_config(list(overrides))
        return tiny_model_dir(config.model, tiny_model_key(config.model, config.seed, tmp_path,
                                                            warm_start_key(config)))

    assert parse_config([]).model.warm_start_reach == 0.75  # the default experiment's
    assert len({key(), key("model.warm_start_reach=0.5"), key("group_size=4"), key("gen.temperature=0.8")}) == 4
    # Without a reach, neither the group nor the temperature changes the warm start, nor the key.
    assert key("model.warm_start_reach=0", "group_size=4") == key("model.warm_start_reach=0")


def test_a_model_warm_started_on_another_schedule_is_not_reused(tmp_path):
    """The warm start's batch decides how much RL gains from the model (BENCHMARKS.md, "The warm start's batch"), so
    it is part of the cache key: a model cached at another batch, check interval or step limit is built anew."""
    @dataclass
    class Halved(AsyncPPOMATHConfig):
        warm_start_batch_size = AsyncPPOMATHConfig.warm_start_batch_size // 2

    def key(config):
        return tiny_model_dir(config.model, tiny_model_key(config.model, config.seed, tmp_path,
                                                            config.warm_start_settings))

    assert key(AsyncPPOMATHConfig()) == key(AsyncPPOMATHConfig())
    assert key(Halved()) != key(AsyncPPOMATHConfig())
    multi_turn = AsyncPPOMathMultiTurnConfig().warm_start_settings  # a subclass adds to the schedule, keeps it
    assert multi_turn["batch"] == AsyncPPOMATHConfig.warm_start_batch_size and "retry_every" in multi_turn


def test_the_arithmetic_warm_start_teaches_and_checks_prompts_as_the_rollout_worker_renders_them(tmp_path):
    """A system prompt (dataset.system_prompt, or a chat row's own) is part of every prompt the run sends: the warm
    start must teach and check answers after it too."""
    from rlsys.data.dataset import RowFormat, load_rows, write_jsonl
    from rlsys.model.tokenizer import row_prompt_ids
    from rlsys.model.warm_start_examples import arithmetic_warm_start

    path = write_jsonl([{"prompt": "1+1=", "answer": "2"},
                        {"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+3="}],
                         "answer": "5"}], tmp_path / "rows.jsonl")
    rows = load_rows(path, RowFormat(system_prompt="You add."))
    tokenizer = build_char_tokenizer()
    taught, checks = arithmetic_warm_start(tokenizer, rows, rows)
    for row, sequence, check in zip(rows, taught, checks, strict=True):
        sent = row_prompt_ids(tokenizer, row)
        assert check.prompt_ids == sent
        assert sequence.token_ids[:len(sent)] == sent and sequence.taught[:len(sent)] == [0] * len(sent)
        assert tokenizer.decode(sequence.token_ids[len(sent):]) == row["answer"] + "<|end|>"


def test_a_model_warm_started_on_other_prompts_is_not_reused(tmp_path, monkeypatch):
    """The cache was keyed by the dataset's folder: a run with a dataset.system_prompt (or another file, prompt key or
    template in that folder) got the model taught on the prompts without it."""
    from rlsys import assets
    from rlsys.model import tiny

    built = []

    def build(cfg, seed, examples, directory, *args, **kwargs):  # no warm start: where the model would go is the test
        built.append(directory)
        directory.mkdir(parents=True)
        (directory / "config.json").write_text("{}")

    monkeypatch.setattr(tiny, "prepare_tiny_model", build)

    def model_path(*overrides):
        config = parse_config([f"model.cache_dir={tmp_path}", *overrides])
        assets.prepare_assets(config, log=lambda *_: None)
        return config.model.path

    plain = model_path()
    assert model_path("dataset.system_prompt=Be brief.") != plain
    assert model_path() == plain and len(built) == 2  # the same rows: the cached model


def test_a_warm_start_that_runs_again_says_what_differs_from_the_nearest_cached_model(tmp_path, monkeypatch):
    """dataset.num_eval=50 changed the generated rows, and with them the cached model's key: the tiny model was
    warm-started again, a minute or more, with no word why."""
    from rlsys import assets
    from rlsys.model import tiny

    def build(cfg, seed, examples, directory, *args, **kwargs):  # no warm start: what the run says is the test
        directory.mkdir(parents=True)
        (directory / "config.json").write_text("{}")

    monkeypatch.setattr(tiny, "prepare_tiny_model", build)
    said = []

    def prepare(*overrides):
        said.clear()
        small = ["dataset.num_train=50", "dataset.num_eval=10"]
        config = parse_config([f"model.cache_dir={tmp_path}", *small, *overrides])
        assets.prepare_assets(config, log=said.append)

    prepare()
    assert said == []  # nothing cached to compare with: the warm start's own lines say what it does
    prepare("dataset.num_eval=12")
    assert len(said) == 1 and "other held-out rows (dataset.num_eval" in said[0] and "other training rows" in said[0]
    assert said[0].startswith("no tiny model is cached for these settings; the nearest cached one")
    prepare("model.hidden_size=64")
    assert "model.hidden_size" in said[0] and "rows" not in said[0]
    prepare("dataset.num_eval=12")
    assert said == []  # cached now


def test_a_run_on_the_tiny_model_says_at_start_what_its_warm_start_did_not_teach(tmp_path, monkeypatch):
    """The math-tools run on the tiny default model trained nothing: its warm start teaches bare answers, so the model
    never emitted <tool_call> or <answer>, every turn was void and every reward 0, and the run said nothing of it."""
    from rlsys import assets
    from rlsys.model import tiny

    def build(cfg, seed, examples, directory, *args, **kwargs):  # no warm start: what the run says is the test
        directory.mkdir(parents=True, exist_ok=True)
        (directory / "config.json").write_text("{}")

    monkeypatch.setattr(tiny, "prepare_tiny_model", build)
    said = []
    small = [f"model.cache_dir={tmp_path}", "dataset.num_train=50", "dataset.num_eval=10"]
    tools = ["experiment=async-ppo-math-tools", *small, "tools=[calculator]"]  # no sandbox to check for
    assets.prepare_assets(parse_config(tools), log=said.append)
    assert [line for line in said if line.startswith("warning: the tiny default model")] == said
    assert len(said) == 1 and "neither <tool_call> nor <answer>" in said[0] and "model.path=" in said[0]
    said.clear()
    assets.prepare_assets(parse_config(["experiment=async-ppo-math", *small]), log=said.append)
    assert said == []  # taught its answer format
    config = parse_config([*tools, f"model.path={tmp_path}"])
    (tmp_path / "config.json").write_text("{}")
    said.clear()
    assets.prepare_assets(config, log=said.append)
    assert said == []  # a model of the user's: nothing to warn of


def test_the_warm_start_s_time_is_returned_to_be_reported_apart_from_the_run_s(tmp_path, monkeypatch):
    """summary.json's `minutes` and the last line's "in X min" counted a cold first run's warm start (minutes of
    supervised pre-training) as the run's training time."""
    from rlsys import assets
    from rlsys.model import tiny

    def build(cfg, seed, examples, directory, *args, **kwargs):  # a warm start of 0.3 s
        time.sleep(0.3)
        directory.mkdir(parents=True)
        (directory / "config.json").write_text("{}")

    monkeypatch.setattr(tiny, "prepare_tiny_model", build)
    config = parse_config([f"model.cache_dir={tmp_path}"])
    assert assets.prepare_assets(config, log=lambda *_: None) >= 0.3
    assert assets.prepare_assets(parse_config([f"model.cache_dir={tmp_path}"]), log=lambda *_: None) == 0.0  # cached
    assert assets.prepare_assets(parse_config([f"model.cache_dir={tmp_path}", f"model.path={config.model.path}"]),
                                 log=lambda *_: None) == 0.0  # a model given


def test_a_dataset_given_without_a_model_warm_starts_the_tiny_model_on_its_rows(tmp_path, monkeypatch):
    """docs/data.md: with dataset.path and no model.path, the tiny default model is taught the training rows' answers
    and its warm start stops on the held-out rows' (dataset.eval_path); with model.path there is no warm start."""
    from rlsys import assets
    from rlsys.data.dataset import write_jsonl
    from rlsys.model import tiny

    taught = []

    def build(cfg, seed, examples, directory, *args, **kwargs):  # what the warm start would be taught and checked on
        taught.append(examples(build_char_tokenizer()))
        directory.mkdir(parents=True)
        (directory / "config.json").write_text("{}")

    monkeypatch.setattr(tiny, "prepare_tiny_model", build)
    train = write_jsonl([{"prompt": "7+8=", "answer": "15"}, {"prompt": "9+9=", "answer": "18"}], tmp_path / "t.jsonl")
    held_out = write_jsonl([{"prompt": "6+1=", "answer": "7"}], tmp_path / "e.jsonl")
    given = [f"model.cache_dir={tmp_path}", f"dataset.path={train}", f"dataset.eval_path={held_out}"]
    config = parse_config(given)
    assets.prepare_assets(config, log=lambda *_: None)
    ((sequences, checks),) = taught
    tokenizer = build_char_tokenizer()
    assert [tokenizer.decode([t for t, on in zip(s.token_ids, s.taught) if on]) for s in sequences] == \
        ["15<|end|>", "18<|end|>"]
    assert [check.accepted for check in checks] == [("7",)]
    assert config.model.path.startswith(str(tmp_path))  # the run trains that model
    assets.prepare_assets(parse_config([*given, f"model.path={config.model.path}"]), log=lambda *_: None)
    assert len(taught) == 1


class StandInWarmStarts:
    """Runs of `prepare_assets` in forked processes whose warm start is a stand-in: each records its build in
    `builds`, sets `building` and waits for `release()` before it saves the model. Who builds, and who waits, is the
    test. Each run's log lines come back on `said` as (name, line), and last its model's path. The release is a file,
    not an Event: a process killed as it waits on an Event leaves the Event's lock held."""

    def __init__(self, tmp_path, monkeypatch):
        import multiprocessing

        from rlsys.model import tiny

        context = multiprocessing.get_context("fork")  # the children keep this stand-in for the warm start
        self.context, self.tmp_path = context, tmp_path
        self.building, self.said = context.Event(), context.Queue()
        self.builds, self.released = tmp_path / "builds", tmp_path / "released"
        monkeypatch.setattr(tiny, "prepare_tiny_model", self.build)

    def build(self, cfg, seed, examples, directory, *args, **kwargs):
        with open(self.builds, "a") as builds:
            builds.write(f"{directory}\n")
        self.building.set()
        deadline = time.monotonic() + 60
        while not self.released.exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        directory.mkdir(parents=True)
        (directory / "config.json").write_text("{}")

    def release(self) -> None:
        self.released.touch()

    def start(self, name: str):
        process = self.context.Process(target=self.run, args=(name,))
        process.start()
        return process

    def run(self, name: str) -> None:
        from rlsys import assets

        config = parse_config([f"model.cache_dir={self.tmp_path}", "dataset.num_train=50", "dataset.num_eval=10"])
        assets.prepare_assets(config, log=lambda line: self.said.put((name, line)))
        self.said.put((name, f"model {config.model.path}"))

    def second_waits(self) -> str:
        """Starts "first", and "second" once the first builds: the model's path, once the second said it waits."""
        self.first = self.start("first")
        assert self.building.wait(60)
        model = self.builds.read_text().strip()
        self.second = self.start("second")
        waiting = f"another run is warm-starting this tiny model ({model}): waiting for it"
        assert self.said.get(timeout=60) == ("second", waiting)
        return model


def test_runs_started_together_warm_start_the_tiny_model_once(tmp_path, monkeypatch):
    """A sweep started at once (`... ppo.lr=1e-5 & ... ppo.lr=3e-5 &`) warm-started the same tiny model in each run,
    every one on the same cores, and the runs wrote and renamed one `.tmp` folder: now the first builds it, the others
    say they wait and train the model it built."""
    runs = StandInWarmStarts(tmp_path, monkeypatch)
    model = runs.second_waits()
    runs.release()
    runs.first.join(60), runs.second.join(60)
    assert runs.first.exitcode == runs.second.exitcode == 0
    assert dict(runs.said.get(timeout=5) for _ in range(2)) == {"first": f"model {model}", "second": f"model {model}"}
    assert runs.builds.read_text() == f"{model}\n"  # built once


def test_a_run_killed_warm_starting_the_tiny_model_leaves_the_build_to_the_run_waiting(tmp_path, monkeypatch):
    """The run that builds is killed (Ctrl-C, out of memory) before it saved the model: its lock goes with it, and
    the run that waited builds the model itself rather than waiting for ever or taking a folder that is not there."""
    runs = StandInWarmStarts(tmp_path, monkeypatch)
    model = runs.second_waits()
    runs.first.kill()
    runs.first.join(60)
    runs.release()
    runs.second.join(60)
    assert runs.second.exitcode == 0
    assert runs.said.get(timeout=5) == ("second", f"model {model}")
    assert runs.builds.read_text() == f"{model}\n{model}\n"  # the second built it too
    assert (Path(model) / "config.json").exists()
