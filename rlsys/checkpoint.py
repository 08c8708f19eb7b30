"""HF-format checkpoints with the trainer state needed to continue from them."""

import json
import shutil
from pathlib import Path

import torch

TRAINER_STATE = "trainer_state.json"
OPTIMIZER_STATE = "optimizer.pt"


def save_checkpoint(directory: Path, model, tokenizer, optimizer_state: dict, trainer_state: dict,
                    extra_models: dict | None = None) -> Path:
    """Writes to a temporary directory first, so a crash never leaves a half checkpoint under `directory`.

    `trainer_state` ({"step", "version", "consumed_prompts", ...}) is JSON; it is written last, and a
    directory without it is never taken as a checkpoint. `extra_models` (name -> model or None, e.g. the
    critic) are saved in HF format in subdirectories.
    """
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    for name, extra in (extra_models or {}).items():
        if extra is not None:
            extra.save_pretrained(tmp / name)
    torch.save(optimizer_state, tmp / OPTIMIZER_STATE)
    (tmp / TRAINER_STATE).write_text(json.dumps(trainer_state))
    shutil.rmtree(directory, ignore_errors=True)
    tmp.rename(directory)
    return directory


def read_optimizer_state(directory: Path, device) -> dict:
    """The optimizer, scheduler and RNG state saved beside the model. `weights_only=True`: tensors and plain
    containers only, so a tampered checkpoint cannot run code in the learner (full unpickling could)."""
    return torch.load(Path(directory) / OPTIMIZER_STATE, map_location=device, weights_only=True)


def read_trainer_state(directory: Path) -> dict:
    path = Path(directory) / TRAINER_STATE
    if not path.exists():
        raise FileNotFoundError(f"{directory} is not an rlsys checkpoint (no {TRAINER_STATE})")
    return json.loads(path.read_text())


def latest_checkpoint(checkpoints_dir: Path) -> Path | None:
    """The complete checkpoint with the highest step, or None; half-written `.tmp` directories never count."""
    complete = [d for d in Path(checkpoints_dir).glob("step_*")
                if not d.name.endswith(".tmp") and (d / TRAINER_STATE).exists()]
    return max(complete, key=lambda d: read_trainer_state(d)["step"], default=None)
