"""Checkpoints on disk: what `resume_from_checkpoint=auto` picks is always one that loads."""

import itertools
import shutil
import time
from pathlib import Path

import pytest
import torch

from rlsys import checkpoint
from rlsys.checkpoint import (SHARDED_STATE, keep_newest, latest_checkpoint, load_sharded_state, read_trainer_state,
                              save_checkpoint)
from rlsys.distributed import Ranks


def save(directory: Path, step: int, value: float, lineage: list | None = None) -> Path:
    return save_checkpoint(directory, Ranks(), {"model": {"w": torch.full((2,), value)}}, lambda tmp: None,
                           {"step": step, "version": step, "consumed_prompts": [], "lineage": lineage or []})


def names(checkpoints: Path) -> set[str]:
    return {d.name for d in checkpoints.iterdir()}


def test_a_crash_while_a_checkpoint_of_the_same_step_is_replaced_leaves_one_that_loads(tmp_path, monkeypatch):
    """The final save after a periodic one, or a stop right after a resume, writes the same step again: killed while
    the earlier copy is being deleted, the run must not keep a trainer state whose shards are gone."""
    checkpoints = tmp_path / "checkpoints"
    save(checkpoints / "step_2", 2, 1.0)
    real_rmtree = shutil.rmtree

    def killed_mid_delete(path, ignore_errors=False):
        path = Path(path)
        if path.name.startswith("step_2") and not path.name.endswith(".tmp") and path.exists():
            real_rmtree(path / SHARDED_STATE)  # the shards go first, then the process is killed
            raise KeyboardInterrupt
        real_rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed_mid_delete)
    try:
        save(checkpoints / "step_2", 2, 2.0)
    except KeyboardInterrupt:
        pass
    monkeypatch.undo()
    latest = latest_checkpoint(checkpoints)
    assert latest == checkpoints / "step_2" and read_trainer_state(latest)["step"] == 2
    state = {"model": {"w": torch.zeros(2)}}
    load_sharded_state(latest, state)
    assert state["model"]["w"].tolist() == [2.0, 2.0]  # the new copy, whole


def test_auto_takes_only_complete_checkpoints_named_by_their_step(tmp_path):
    checkpoints = tmp_path / "checkpoints"
    save(checkpoints / "step_2", 2, 1.0)
    for leftover in ("step_4.tmp", "step_4.old"):  # a save that was killed, and the copy a save was replacing
        shutil.copytree(checkpoints / "step_2", checkpoints / leftover)
        (checkpoints / leftover / checkpoint.TRAINER_STATE).write_text('{"step": 4}')
    assert latest_checkpoint(checkpoints) == checkpoints / "step_2"


def test_auto_takes_the_checkpoint_saved_last_not_an_abandoned_higher_step(tmp_path, monkeypatch):
    """A run resumed from its own step_4 while step_8 is there saves step_6 again: continuing it (after a crash, or
    the learner's restart) goes on from that step_6, not from the step_8 it turned away from."""
    clock = itertools.count(1)
    monkeypatch.setattr(time, "time", lambda: float(next(clock)))  # saves a second apart, on any machine
    checkpoints = tmp_path / "checkpoints"
    for step in (2, 4, 6, 8):
        save(checkpoints / f"step_{step}", step, 1.0)
    save(checkpoints / "step_6", 6, 2.0)  # resumed from step_4
    assert latest_checkpoint(checkpoints) == checkpoints / "step_6"
    (checkpoints / "step_9").mkdir()  # a checkpoint from before saved_at was kept counts as older
    (checkpoints / "step_9" / checkpoint.TRAINER_STATE).write_text('{"step": 9}')
    assert latest_checkpoint(checkpoints) == checkpoints / "step_6"
    legacy = tmp_path / "legacy"
    for step in (9, 3):  # among those, the highest step is the newest
        (legacy / f"step_{step}").mkdir(parents=True)
        (legacy / f"step_{step}" / checkpoint.TRAINER_STATE).write_text(f'{{"step": {step}}}')
    assert latest_checkpoint(legacy) == legacy / "step_9"


def test_keep_newest_keeps_the_line_continued_before_an_abandoned_one(tmp_path, monkeypatch):
    """save_total_limit: the newest by the time they were saved, as `auto` picks; of a run resumed from its own
    step_4 while step_6 and step_8 are there, those two (a line it turned away from) go first."""
    clock = itertools.count(1)
    monkeypatch.setattr(time, "time", lambda: float(next(clock)))
    checkpoints = tmp_path / "checkpoints"
    lineage = []
    for step in (2, 4, 6, 8):
        saved = save(checkpoints / f"step_{step}", step, 1.0, lineage)
        lineage = [*lineage, [step, read_trainer_state(saved)["saved_at"]]]
    assert keep_newest(checkpoints, 0) == [] and keep_newest(checkpoints, 4) == []
    resumed = read_trainer_state(checkpoints / "step_4")
    save(checkpoints / "step_5", 5, 2.0, [*resumed["lineage"], [4, resumed["saved_at"]]])
    assert keep_newest(checkpoints, 3) == [checkpoints / "step_8", checkpoints / "step_6"]
    assert names(checkpoints) == {"step_2", "step_4", "step_5"}
    assert keep_newest(checkpoints, 2) == [checkpoints / "step_2"]
    assert names(checkpoints) == {"step_4", "step_5"} and latest_checkpoint(checkpoints) == checkpoints / "step_5"
    assert keep_newest(checkpoints, 1) == [checkpoints / "step_4"]  # the one resumed from, once a newer one is there


def test_a_crash_while_an_old_checkpoint_is_deleted_leaves_none_that_auto_picks_and_cannot_load(tmp_path, monkeypatch):
    checkpoints = tmp_path / "checkpoints"
    for step in (2, 4):
        save(checkpoints / f"step_{step}", step, float(step))
    real_rmtree = shutil.rmtree

    def killed_mid_delete(path, ignore_errors=False):
        path = Path(path)
        if path.name.startswith("step_2") and path.exists():
            real_rmtree(path / SHARDED_STATE)  # the shards go first, then the process is killed
            raise KeyboardInterrupt
        real_rmtree(path, ignore_errors=ignore_errors)

    monkeypatch.setattr(checkpoint.shutil, "rmtree", killed_mid_delete)
    try:
        keep_newest(checkpoints, 1)
    except KeyboardInterrupt:
        pass
    monkeypatch.undo()
    assert [d.name for d, _ in checkpoint.saved_in_order(checkpoints)] == ["step_4"]
    state = {"model": {"w": torch.zeros(2)}}
    load_sharded_state(latest_checkpoint(checkpoints), state)
    assert state["model"]["w"].tolist() == [4.0, 4.0]


def test_a_crash_between_the_renames_of_a_replaced_step_leaves_it_for_auto_and_the_learner(tmp_path, monkeypatch):
    """A save of a step saved before renames the old copy to step_N.old, then the new one in: killed between the
    two, there is no step_N; `auto` must not go back to an earlier step, nor the learner's start delete the copy."""
    from types import SimpleNamespace

    from rlsys.run_start import resolve_resume

    clock = itertools.count(1)
    monkeypatch.setattr(time, "time", lambda: float(next(clock)))
    checkpoints = tmp_path / "checkpoints"
    for step in (2, 4):
        save(checkpoints / f"step_{step}", step, float(step))
    real_rename = Path.rename

    def killed_before_the_new_copy_is_in(self, target):
        if self.name == "step_4.tmp":
            raise KeyboardInterrupt
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", killed_before_the_new_copy_is_in)
    try:
        save(checkpoints / "step_4", 4, 5.0)  # the final save after a periodic one
    except KeyboardInterrupt:
        pass
    monkeypatch.undo()
    assert names(checkpoints) == {"step_2", "step_4.old", "step_4.tmp"}
    config = SimpleNamespace(resume_from_checkpoint="auto")
    resolve_resume(config, tmp_path)  # picked where it is: put back only once the start can no longer fail
    assert config.resume_from_checkpoint == str(checkpoints / "step_4.old")
    assert checkpoint.restore_replaced(checkpoints) == [checkpoints / "step_4"]  # as the launcher's begin_trial does
    state = {"model": {"w": torch.zeros(2)}}
    load_sharded_state(checkpoints / "step_4", state)
    assert state["model"]["w"].tolist() == [4.0, 4.0]  # the copy that was complete before the save
    real_rename(checkpoints / "step_4", checkpoints / "step_4.old")  # as the learner's start finds it
    assert checkpoint.remove_leftovers(checkpoints) == [checkpoints / "step_4.tmp"]
    assert names(checkpoints) == {"step_2", "step_4"}


def killed_run_records(tmp_path, learner_steps: int, rollout: list[tuple[int, dict]]):
    """The logging directory a killed run left: the learner's steps 1 to `learner_steps`, and a rollout worker's
    records (step, metrics)."""
    from rlsys.metrics import MetricsLogger

    logs = tmp_path / "logs"
    learner, worker = MetricsLogger(logs, "learner"), MetricsLogger(logs, "rollout0")
    for step in range(1, learner_steps + 1):
        learner.log(step, {"reward": 0.0})
    for step, metrics in rollout:
        worker.log(step, metrics)
    learner.close(), worker.close()
    return logs


def test_auto_without_a_checkpoint_takes_back_what_the_earlier_start_logged(tmp_path):
    """A run killed before its first save, continued with resume_from_checkpoint=auto, starts from the beginning: its
    records went on after the killed run's in the same files (learner.jsonl: steps 1-3, then 1, 2, ...)."""
    from types import SimpleNamespace

    from rlsys.run_start import resolve_resume, take_back_earlier_start
    from rlsys.metrics import read_jsonl_metrics

    logs = killed_run_records(tmp_path, learner_steps=3, rollout=[(0, {"eval/accuracy": 0.2}), (2, {"reward": 0.5})])
    config = SimpleNamespace(resume_from_checkpoint="auto", logging_dir=str(logs))
    assert resolve_resume(config, tmp_path)  # from the beginning: what was logged is taken back once the checks pass
    assert config.resume_from_checkpoint == ""
    take_back_earlier_start(config, tmp_path)
    assert read_jsonl_metrics(logs / "learner.jsonl") == []
    assert [r["step"] for r in read_jsonl_metrics(logs / "rollout0.jsonl")] == [0]  # the evaluation before step 1
    assert len((logs / "learner.jsonl.abandoned").read_text().splitlines()) == 3


def test_a_resume_takes_back_the_metrics_and_counts_of_the_steps_after_its_checkpoint(tmp_path):
    """Killed at step 6 after its checkpoint at step 4, the run trains steps 5 and 6 again once resumed."""
    from types import SimpleNamespace

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from rlsys import protocol
    from rlsys.bus import InProcessBus
    from rlsys.run_start import take_back_abandoned_steps
    from rlsys.metrics import MetricsLogger, read_jsonl_metrics

    logs = killed_run_records(tmp_path, learner_steps=6,
                              rollout=[(0, {"eval/accuracy": 0.2}), (6, {"eval/accuracy": 0.3})])
    bus = InProcessBus()
    for reason in ("before the checkpoint", "after it", "after it too"):
        bus.stream_add(protocol.DEAD_LETTERS, {"reason": reason})
    bus.incr(protocol.WEIGHT_CHECKS, 6)
    trained = tmp_path / "traces" / "trained.jsonl"
    trained.parent.mkdir()
    trained.write_text("".join(f'{{"traj_id": "t{step}", "step": {step}}}\n' for step in (4, 5)))
    # TensorBoard reads event files in the order of their names: the second each was made, then a per-process
    # counter compared as text ("100" before "99" once a test session has made 100 writers). In a run the killed
    # part's files are seconds older than the resume's marker, and the resumed learner's seconds newer.
    time.sleep(1.1)
    take_back_abandoned_steps(bus, SimpleNamespace(logging_dir=str(logs)), tmp_path,
                              {"step": 4, "version": 4, "weight_checks": 4, "dead_letters": 1})
    time.sleep(1.1)
    resumed = MetricsLogger(logs, "learner")
    for step in (5, 6):
        resumed.log(step, {"reward": 1.0})
    resumed.close()
    assert [(r["step"], r["reward"]) for r in read_jsonl_metrics(logs / "learner.jsonl")] == \
        [(1, 0.0), (2, 0.0), (3, 0.0), (4, 0.0), (5, 1.0), (6, 1.0)]
    assert [r["step"] for r in read_jsonl_metrics(logs / "learner.jsonl.abandoned")] == [5, 6]
    assert [r["step"] for r in read_jsonl_metrics(logs / "rollout0.jsonl")] == [0]
    assert [r["traj_id"] for r in read_jsonl_metrics(trained)] == ["t4"]  # t5's training was abandoned
    (marker,) = (logs / "tensorboard" / "learner").glob("*.resumed")
    assert marker.stat().st_mode & 0o777 == 0o600
    events = EventAccumulator(str(logs / "tensorboard" / "learner"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("reward")] == \
        [(1, 0.0), (2, 0.0), (3, 0.0), (4, 0.0), (5, 1.0), (6, 1.0)]
    assert bus.get(protocol.WEIGHT_CHECKS) == 4
    assert [e.decode(protocol.DEAD_LETTERS)["reason"] for e in bus.stream_range(protocol.DEAD_LETTERS, 10)] == \
        ["before the checkpoint"]


class _RunsCode:
    def __reduce__(self):
        return (print, ("a tampered checkpoint ran code",))


def test_a_checkpoint_whose_saved_values_name_other_code_is_refused_before_they_run(tmp_path, capsys):
    """DCP keeps each non-tensor value (an optimizer's lr, betas, ...) as a pickle beside the tensors, and loads it
    with `torch.load(weights_only=False)`: a tampered value would run code though the index passes the check."""
    directory = save_checkpoint(tmp_path / "step_1", Ranks(), {"optimizer": {"lr": _RunsCode()}}, lambda tmp: None,
                                {"step": 1, "version": 1, "consumed_prompts": []})
    with pytest.raises(ValueError, match="its value optimizer.lr names GLOBAL print"):
        load_sharded_state(directory, {"optimizer": {"lr": 1e-3}})
    assert "ran code" not in capsys.readouterr().out
    save_checkpoint(directory, Ranks(), {"optimizer": {"lr": 2e-3, "betas": (0.9, 0.99)}}, lambda tmp: None,
                    {"step": 1, "version": 1, "consumed_prompts": []})
    state = {"optimizer": {"lr": 1e-3, "betas": (0.0, 0.0)}}
    load_sharded_state(directory, state)  # what rlsys writes still loads
    assert state == {"optimizer": {"lr": 2e-3, "betas": (0.9, 0.99)}}


def test_a_role_restarted_once_save_total_limit_deleted_the_checkpoint_the_run_restarted_from_finds_its_model(
        tmp_path):
    """After the learner died every role restarts from the newest checkpoint; the run goes on, and save_total_limit
    deletes that checkpoint once newer ones of its line are saved. An inference or rollout worker that dies after
    that is restarted with the run's config and builds its engine and tokenizer from config.model.path."""
    from experiments import AsyncPPOMATHConfig
    from rlsys.run_start import resume_from_latest
    from rlsys.model.tokenizer import load_tokenizer
    from tests.helpers import save_random_tiny_model

    config = AsyncPPOMATHConfig()
    config.model.path = str(save_random_tiny_model(tmp_path / "model"))
    run, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"

    def save_with_export(step: int, lineage: list) -> Path:  # the HF export a checkpoint holds beside its shards
        return save_checkpoint(checkpoints / f"step_{step}", Ranks(), {"model": {"w": torch.zeros(2)}},
                               lambda tmp: shutil.copytree(config.model.path, tmp, dirs_exist_ok=True),
                               {"step": step, "version": step, "consumed_prompts": [], "lineage": lineage})

    save_with_export(2, [])
    assert resume_from_latest(config, run, set())["step"] == 2
    assert config.resume_from_checkpoint == str(checkpoints / "step_2")
    lineage = [[2, read_trainer_state(checkpoints / "step_2")["saved_at"]]]
    save_with_export(4, lineage)
    assert keep_newest(checkpoints, 1) == [checkpoints / "step_2"]
    assert load_tokenizer(config.model.path).vocab_size > 0  # what a restarted rollout worker loads first


def test_a_role_restarted_once_save_total_limit_deleted_the_checkpoint_a_run_resumed_from_finds_its_model(tmp_path):
    """resume_from_checkpoint=step_2 with save_total_limit=1: step_2 goes once step_4 is saved, and an inference or
    rollout worker restarted after that builds its engine and tokenizer from config.model.path. The roles build from
    the model the run started from (their weights are the checkpoint's, loaded over it) while it is there and has the
    checkpoint's shape; from the checkpoint's own export when it is not."""
    from experiments import AsyncPPOMATHConfig
    from rlsys.assets import prepare_assets
    from rlsys.model.tokenizer import load_tokenizer
    from tests.helpers import save_random_tiny_model

    initial = save_random_tiny_model(tmp_path / "model")
    checkpoints = tmp_path / "run" / "checkpoints"
    step_2 = save_checkpoint(checkpoints / "step_2", Ranks(), {"model": {"w": torch.zeros(2)}},
                             lambda tmp: shutil.copytree(initial, tmp, dirs_exist_ok=True),
                             {"step": 2, "version": 2, "consumed_prompts": [], "lineage": [],
                              "initial_model_path": str(initial)})

    def resumed_model_path() -> str:
        config = AsyncPPOMATHConfig(resume_from_checkpoint=str(step_2))
        config.model.cache_dir = str(tmp_path / "cache")
        prepare_assets(config, log=lambda *_: None)
        return config.model.path

    assert resumed_model_path() == str(initial)
    save(checkpoints / "step_4", 4, 1.0, [[2, read_trainer_state(step_2)["saved_at"]]])
    assert keep_newest(checkpoints, 1) == [step_2]
    assert load_tokenizer(str(initial)).vocab_size > 0  # what a restarted rollout worker loads first
    step_2 = save_checkpoint(checkpoints / "step_2", Ranks(), {"model": {"w": torch.zeros(2)}},
                             lambda tmp: shutil.copytree(initial, tmp, dirs_exist_ok=True),
                             {"step": 2, "version": 2, "consumed_prompts": [], "lineage": [],
                              "initial_model_path": str(initial)})
    save_random_tiny_model(initial, tie_word_embeddings=False)  # another shape there now
    assert resumed_model_path() == str(step_2)
    shutil.rmtree(initial)
    assert resumed_model_path() == str(step_2)


def test_a_learner_that_dies_restarts_the_run_on_the_line_it_continues_not_on_one_it_abandoned(tmp_path, monkeypatch):
    """Resumed from its own step_4 while step_6 and step_8 (saved later) are there, a run whose learner died before
    it saved went on from step_8: the weights, counters and dataset position of the line the user turned away from."""
    from experiments import AsyncPPOMATHConfig
    from rlsys.run_start import resume_from_latest, saved_checkpoints

    clock = itertools.count(1)
    monkeypatch.setattr(time, "time", lambda: float(next(clock)))
    run, checkpoints = tmp_path / "run", tmp_path / "run" / "checkpoints"
    lineage = []
    for step in (4, 6, 8):
        saved = save(checkpoints / f"step_{step}", step, 1.0, lineage)
        lineage = [*lineage, [step, read_trainer_state(saved)["saved_at"]]]
    config = AsyncPPOMATHConfig()
    config.resume_from_checkpoint = str(checkpoints / "step_4")
    saved_before = saved_checkpoints(run)  # as the roles start
    assert resume_from_latest(config, run, saved_before)["step"] == 4  # died before it saved
    assert config.resume_from_checkpoint == str(checkpoints / "step_4")
    save(checkpoints / "step_5", 5, 2.0, [[4, read_trainer_state(checkpoints / "step_4")["saved_at"]]])
    assert resume_from_latest(config, run, saved_before)["step"] == 5
    assert config.resume_from_checkpoint == str(checkpoints / "step_5")
    config.resume_from_checkpoint = ""  # a run that started from no checkpoint and saved none restarts from the start
    assert resume_from_latest(config, tmp_path / "another run", set()) == {} and config.resume_from_checkpoint == ""
