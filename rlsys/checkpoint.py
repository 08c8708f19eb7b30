"""Checkpoints: the learner's state sharded (torch.distributed.checkpoint), an HF-format export beside it,
and the trainer state needed to continue.

The sharded state (model, optimizer, critic, ...) loads onto any number of ranks, also one with no process
group. Its tensors load with `weights_only=True`, but torch.distributed.checkpoint reads its index (.metadata)
with plain `pickle.load`, which runs whatever a tampered file names; so the index is read first by an
unpickler that resolves only the classes such an index is made of, and a checkpoint naming anything else is
refused before DCP touches it. Its non-tensor values (an optimizer's lr, betas, ...), which DCP loads with
`weights_only=False`, are read with `weights_only=True` first (`_WeightsOnlyValues`).

torch is imported by the functions that write or read tensors: the launcher and the rollout workers read only
trainer states, and importing torch.distributed.checkpoint would cost them a second of CPU at every start.
"""

import json
import pickle
import re
import shutil
import time
from pathlib import Path

TRAINER_STATE = "trainer_state.json"
SHARDED_STATE = "sharded"  # the DCP directory
RNG_STATE = "rng.pt"  # rank 0's torch RNG: it draws the mini-batch order
CHECKPOINTS_DIR = "checkpoints"  # under the run directory: the learner saves there, the launcher resumes from there
STEP_PREFIX = "step_"  # a checkpoint's directory is step_N, N its step: the name every reader below parses


def checkpoint_directory(run_dir: Path, step: int) -> Path:
    """Where the learner saves step `step`'s checkpoint, named as `saved_in_order` and `remove_leftovers` read."""
    return Path(run_dir) / CHECKPOINTS_DIR / f"{STEP_PREFIX}{step}"


def save_checkpoint(directory: Path, ranks, sharded_state: dict, export, trainer_state: dict) -> Path:
    """Writes to a temporary directory first, so a crash never leaves a half checkpoint under `directory`.

    Every rank calls it. `sharded_state` is each rank's part (torch.distributed.checkpoint.state_dict);
    `export(tmp)` writes the HF-format export on rank 0 (it may be collective: every rank calls it).
    `trainer_state` ({"step", "version", "consumed_prompts", ...}) is JSON; it is written last, and a
    directory without it is never taken as a checkpoint. Its `saved_at` (the time) is added here.
    """
    import torch
    import torch.distributed.checkpoint as dcp

    directory = Path(directory)
    tmp = directory.with_name(directory.name + ".tmp")
    replaced = directory.with_name(directory.name + ".old")
    if ranks.main:
        shutil.rmtree(tmp, ignore_errors=True)
        shutil.rmtree(replaced, ignore_errors=True)
        tmp.mkdir(parents=True)
    ranks.barrier()  # nobody writes into the old temporary directory
    dcp.save(sharded_state, checkpoint_id=tmp / SHARDED_STATE)
    export(tmp)
    if ranks.main:
        torch.save(torch.get_rng_state(), tmp / RNG_STATE)
        (tmp / TRAINER_STATE).write_text(json.dumps({**trainer_state, "saved_at": time.time()}))
        # A checkpoint of the same step (the final save after a periodic one, a stop right after a resume) is
        # renamed away, not deleted in place: a crash mid-delete would leave its trainer state without its shards,
        # a checkpoint `auto` picks and cannot load.
        if directory.exists():
            directory.rename(replaced)
        tmp.rename(directory)
        shutil.rmtree(replaced, ignore_errors=True)
    ranks.barrier()  # the checkpoint is there for every rank once save returns
    return directory


def load_sharded_state(directory: Path, state: dict) -> None:
    """Fills `state` (this rank's state dict, of the shapes to load into) from the checkpoint, resharded."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    check_sharded_index(Path(directory) / SHARDED_STATE / ".metadata")
    planner = _weights_only_values()
    try:
        dcp.load(state, checkpoint_id=Path(directory) / SHARDED_STATE, planner=planner)
    except CheckpointException:
        if planner.refused:  # DCP wraps whatever its reading raised
            raise ValueError(f"{directory} is not a checkpoint rlsys will load: {planner.refused}") from None
        raise


def _weights_only_values():
    """DCP's load planner, but a non-tensor value that `torch.load(weights_only=True)` refuses (it names code) is
    refused before DCP's own `weights_only=False` load runs it."""
    import torch
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class _WeightsOnlyValues(DefaultLoadPlanner):
        refused = ""

        def load_bytes(self, read_item, value) -> None:
            try:
                torch.load(value, weights_only=True)
            except pickle.UnpicklingError as e:
                unsupported = re.search(r"Unsupported global: (.*?)(?: was not|$)", str(e), re.MULTILINE)
                self.refused = (f"its value {read_item.dest_index.fqn} names "
                                f"{unsupported.group(1) if unsupported else e}, where plain values belong")
                raise
            value.seek(0)  # the same bytes, found to name no code
            super().load_bytes(read_item, value)

    return _WeightsOnlyValues()


_INDEX_CLASSES = {("torch.distributed.checkpoint.metadata", name) for name in (
    "Metadata", "StorageMeta", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata",
    "TensorProperties", "_MEM_FORMAT_ENCODING")} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
    ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath")}


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        import torch

        is_dtype = module == "torch" and isinstance(getattr(torch, name, None), torch.dtype)
        if (module, name) in _INDEX_CLASSES or is_dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"{module}.{name}")


def check_sharded_index(path: Path) -> None:
    """ValueError if the DCP index at `path` names anything but DCP's own metadata classes, torch dtypes and sizes."""
    try:
        with open(path, "rb") as f:
            _IndexUnpickler(f).load()
    except (pickle.UnpicklingError, EOFError, AttributeError, ValueError, TypeError) as e:
        raise ValueError(f"{path} is not a checkpoint index rlsys will load (it names or holds {e}); "
                         "a checkpoint written by rlsys holds only metadata classes, dtypes and sizes") from None


def load_rng_state(directory: Path):
    """Rank 0's torch RNG state, a tensor."""
    import torch

    return torch.load(Path(directory) / RNG_STATE, weights_only=True)


def read_trainer_state(directory: Path) -> dict:
    path = Path(directory) / TRAINER_STATE
    if not path.exists():
        raise FileNotFoundError(f"{directory} is not an rlsys checkpoint (no {TRAINER_STATE})")
    return json.loads(path.read_text())


DELETING = ".deleting"  # a checkpoint being deleted: renamed first, so a crash mid-delete leaves no step_N half gone


def saved_in_order(checkpoints_dir: Path, replaced: bool = False) -> list[tuple[Path, dict]]:
    """The complete checkpoints and their trainer states, the one saved first first; half-written `.tmp`, replaced
    `.old` and `.deleting` directories never count. `replaced`: with the replaced copies `restore_replaced` would put
    back, each where it is now (step_N.old).

    Saved last, not of the highest step: a run resumed from an earlier checkpoint of its own directory saves lower
    steps than the ones it left behind, and continuing it must not jump back to those. Checkpoints from before
    `saved_at` was kept count as saved before any that has it, the highest step last."""
    complete = [d for d in Path(checkpoints_dir).glob(f"{STEP_PREFIX}*")
                if d.name.removeprefix(STEP_PREFIX).isdigit() and (d / TRAINER_STATE).exists()]
    if replaced:
        complete += replaced_copies(checkpoints_dir).values()
    states = {d: read_trainer_state(d) for d in complete}
    return sorted(((d, states[d]) for d in complete), key=lambda item: (item[1].get("saved_at", 0.0), item[1]["step"]))


def identity(state: dict) -> tuple:
    """A checkpoint's identity from its trainer state: (step, saved_at). A step alone is not one: a run resumed from
    an earlier step saves that step again, on another line. `lineage` lists the identities a state descends from."""
    return state["step"], state.get("saved_at")


def latest_checkpoint(checkpoints_dir: Path, replaced: bool = False) -> Path | None:
    """The complete checkpoint saved last (`saved_in_order`), or None."""
    ordered = saved_in_order(checkpoints_dir, replaced)
    return ordered[-1][0] if ordered else None


def delete_checkpoint(directory: Path) -> None:
    """Renamed out of what `latest_checkpoint` reads first, then deleted: a crash mid-delete leaves a `.deleting`
    directory (removed by `remove_leftovers`), never a trainer state without its shards."""
    doomed = directory.with_name(directory.name + DELETING)
    shutil.rmtree(doomed, ignore_errors=True)
    directory.rename(doomed)
    shutil.rmtree(doomed, ignore_errors=True)


LEFTOVERS = (".tmp", ".old", DELETING)


def replaced_copies(checkpoints_dir: Path) -> dict[Path, Path]:
    """{step_N: step_N.old} for each `step_N.old` whose `step_N` is missing: a save of a step saved before crashed
    between its two renames (the old copy away, the new one not yet in), so the old copy, complete, is the step's only
    checkpoint. Only where no save is under way in `checkpoints_dir`: mid-save, the step is missing for a moment."""
    copies = {}
    for old in Path(checkpoints_dir).glob(f"{STEP_PREFIX}*.old"):
        directory = old.with_suffix("")
        if (directory.name.removeprefix(STEP_PREFIX).isdigit() and not directory.exists()
                and (old / TRAINER_STATE).exists()):
            copies[directory] = old
    return copies


def restore_replaced(checkpoints_dir: Path) -> list[Path]:
    """Puts back each of the `replaced_copies`; returns the restored. Where no save is under way (the launcher once
    its start can no longer fail, and after the learner died; the learner as it starts)."""
    restored = []
    for directory, old in replaced_copies(checkpoints_dir).items():
        old.rename(directory)
        restored.append(directory)
    return restored


def remove_leftovers(checkpoints_dir: Path, keep: Path | None = None) -> list[Path]:
    """Deletes what crashed saves and deletions left (`step_N.tmp`, `.old`, `.deleting`), but `keep`; returns them.
    A `.old` that is its step's only copy is restored first (`restore_replaced`). Only where no save is under way in
    `checkpoints_dir`: the learner calls it as it starts, before its first."""
    restore_replaced(checkpoints_dir)
    leftovers = [d for d in Path(checkpoints_dir).glob(f"{STEP_PREFIX}*")
                 if d.suffix in LEFTOVERS and d.stem.removeprefix(STEP_PREFIX).isdigit() and d.is_dir()
                 and (keep is None or d.resolve() != Path(keep).resolve())]
    for directory in leftovers:
        shutil.rmtree(directory, ignore_errors=True)
    return leftovers


def keep_newest(checkpoints_dir: Path, limit: int) -> list[Path]:
    """Deletes all but `limit` checkpoints once a new one is complete (`save_total_limit`); returns those deleted.

    The one saved last (the new one) is always kept. Kept first are those of the line it continues: itself and its
    ancestors (its trainer state's `lineage`: the checkpoints it was resumed from, and the earlier saves of its
    runs), newest first; then the others (a line abandoned by a resume from an earlier step, checkpoints from before
    the lineage was kept), newest first. So the checkpoint a run resumed from goes only once a newer one of its own
    line is there, and an abandoned line goes before any of the one continued."""
    ordered = saved_in_order(checkpoints_dir)
    if not limit or len(ordered) <= limit:
        return []
    newest = ordered[-1][1]
    line = {tuple(ancestor) for ancestor in newest.get("lineage", [])} | {identity(newest)}
    on_line = [d for d, state in reversed(ordered) if identity(state) in line]
    off_line = [d for d, _ in reversed(ordered) if d not in on_line]
    doomed = (on_line + off_line)[limit:]
    for directory in doomed:
        delete_checkpoint(directory)
    return doomed
