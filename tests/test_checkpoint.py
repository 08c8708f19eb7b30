"""Checkpoints on disk: what `resume_from_checkpoint=auto` picks is always one that loads."""

import shutil
from pathlib import Path

import torch

from rlsys import checkpoint
from rlsys.checkpoint import SHARDED_STATE, latest_checkpoint, load_sharded_state, read_trainer_state, save_checkpoint
from rlsys.distributed import Ranks


def save(directory: Path, step: int, value: float) -> Path:
    return save_checkpoint(directory, Ranks(), {"model": {"w": torch.full((2,), value)}}, lambda tmp: None,
                           {"step": step, "version": step, "consumed_prompts": []})


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
