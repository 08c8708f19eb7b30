"""Weight files handed from the learner to inference engines."""

import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

WEIGHTS_FILE = "model.safetensors"


def weight_tensors(model: torch.nn.Module, state_dict: dict | None = None) -> dict[str, torch.Tensor]:
    """Every tensor of `model`'s state dict (or of `state_dict`, e.g. one gathered from the learner's shards) on
    the CPU, each tied one under every name it has.

    `save_pretrained` drops `lm_head.weight` when it is tied to the input embedding. vLLM's in-place
    reload then finds no weight for its output head and keeps the old one (measured: logprob gap of
    about 2 after one update). Copying each tied tensor under every name avoids that.
    """
    state_dict = model.state_dict() if state_dict is None else state_dict
    return {name: t.detach().to("cpu", copy=True).contiguous() for name, t in state_dict.items()}


def write_weight_update(model: torch.nn.Module, directory: Path, state_dict: dict | None = None) -> Path:
    """Writes `weight_tensors(model, state_dict)` into `directory`, which a reader sees whole or not at all."""
    return write_weight_file(directory, lambda path: save_file(weight_tensors(model, state_dict), str(path)))


def write_weight_file(directory: Path, write) -> Path:
    """`directory`/WEIGHTS_FILE written by `write(path)` into a temporary directory, then renamed into place."""
    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)  # left by a killed run
    tmp.mkdir(parents=True)
    write(tmp / WEIGHTS_FILE)
    # A resumed run publishes again versions a killed run had written, with different weights.
    shutil.rmtree(directory, ignore_errors=True)
    tmp.rename(directory)  # a reader sees the whole file or nothing
    return directory
