"""HF-format checkpoints with the trainer state needed to continue from them."""

import json
import shutil
from pathlib import Path

import torch

TRAINER_STATE = "trainer_state.json"
OPTIMIZER_STATE = "optimizer.pt"


def save_checkpoint(directory: Path, model, tokenizer, optimizer_state: dict, step: int, version: int) -> Path:
    """Writes to a temporary directory first, so a crash never leaves a half checkpoint under `directory`."""
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    torch.save(optimizer_state, tmp / OPTIMIZER_STATE)
    (tmp / TRAINER_STATE).write_text(json.dumps({"step": step, "version": version}))
    shutil.rmtree(directory, ignore_errors=True)
    tmp.rename(directory)
    return directory


def read_trainer_state(directory: Path) -> dict:
    path = Path(directory) / TRAINER_STATE
    if not path.exists():
        raise FileNotFoundError(f"{directory} is not an rlsys checkpoint (no {TRAINER_STATE})")
    return json.loads(path.read_text())
