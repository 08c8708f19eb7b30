"""Where a run starts, and starts again: its directory (made, or refused where an earlier run wrote), the checkpoint
`resume_from_checkpoint=auto` continues, the bus's state before any role starts, and what a resume or a learner's
restart takes back of the steps it trains again. The launcher calls these in its plan (rlsys/launcher.py)."""

import contextlib
import itertools
import logging
import shutil
import time
from pathlib import Path

from rlsys import protocol, run_counters
from rlsys.checkpoint import (CHECKPOINTS_DIR, identity, latest_checkpoint, read_trainer_state, replaced_copies,
                              restore_replaced, saved_in_order)
from rlsys.cli import registry_name_of, save_config
from rlsys.metrics import LEARNER_RECORDS, drop_records_after, mark_restart, records_file, rollout_records_files
from rlsys.preflight import StartupError
from rlsys.prompt_ledger import PromptLedger, settled_prompts
from rlsys.run_files import CONFIG_FILE, SUMMARY_FILE, continue_arguments, logs_dir
from rlsys.run_privacy import make_private
from rlsys.weight_versions import WEIGHTS_DIR, remove_versions_after

log = logging.getLogger("rlsys")


def run_directory(config) -> Path:
    """output_dir/experiment_name/trial_name. A run without a trial_name is named by the second it starts, with a
    suffix where another run took that name first (several started at once): each gets a directory of its own."""
    config.experiment_name = config.experiment_name or registry_name_of(config)
    experiment_dir = Path(config.output_dir) / config.experiment_name
    if not config.trial_name:
        experiment_dir.mkdir(parents=True, exist_ok=True)
        stamp = time.strftime("run-%Y%m%d-%H%M%S")
        for name in (stamp if n == 1 else f"{stamp}-{n}" for n in itertools.count(1)):
            with contextlib.suppress(FileExistsError):
                (experiment_dir / name).mkdir(mode=0o700)  # claims the name: mkdir fails if another run made it
                config.trial_name = name
                break
    return experiment_dir / config.trial_name


def make_run_directories(config) -> tuple[Path, Path, list[Path]]:
    """(run directory, logging directory, those of the two this start made), made, the run directory owner-only;
    StartupError naming the settings where one cannot be made (output_dir or logging_dir is a file, or not writable),
    which roles died on, with tracebacks."""
    named, made = bool(config.trial_name), []
    try:
        run_dir = run_directory(config)  # claims a directory of its own where no trial_name names one
        if not named or not run_dir.exists():
            made.append(run_dir)
        make_private(run_dir)
        if config.logging_dir:  # saved so: the report, run from another directory, finds the metrics
            config.logging_dir = str(Path(config.logging_dir).resolve())
        logging_dir = logs_dir(run_dir, config.logging_dir)
        if not logging_dir.exists():
            made.append(logging_dir)
        logging_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        remove_directories(made)
        raise StartupError(f"cannot make the run's directories (output_dir={config.output_dir!r}, logging_dir="
                           f"{config.logging_dir!r}): {e}") from None
    return run_dir, logging_dir, made


def remove_directories(directories: list[Path]) -> None:
    """What a refused start made, removed: a directory (run-<stamp>/ and its logs/) per attempt otherwise."""
    for directory in directories:
        shutil.rmtree(directory, ignore_errors=True)


def refuse_a_second_start(run_dir: Path, logging_dir: Path) -> None:
    """A fresh start (no resume_from_checkpoint) in a run directory an earlier run wrote to would append to its logs
    and leave both runs' checkpoints side by side: refused, naming the two ways on."""
    checkpoints = run_dir / CHECKPOINTS_DIR
    earlier = [path for path in (records_file(logging_dir, LEARNER_RECORDS), run_dir / SUMMARY_FILE) if path.exists()]
    if checkpoints.is_dir() and any(checkpoints.iterdir()):
        earlier.append(checkpoints)
    if earlier:
        raise StartupError(
            f"{run_dir} holds an earlier run ({', '.join(str(p) for p in earlier)}): a fresh start there would mix "
            f"its logs and checkpoints with that run's. Continue that run with resume_from_checkpoint=auto, or start "
            f"another with trial_name=NEW (an empty trial_name= names it by the time it starts)")


def resolve_resume(config, run_dir: Path) -> bool:
    """`resume_from_checkpoint=auto`: the run directory's newest complete checkpoint, or a fresh start. Returns
    whether it is that fresh start, which takes back what an earlier start of the trial logged
    (`take_back_earlier_start`, once the start's checks passed). Moves nothing: a step whose save crashed between its
    renames counts, its replaced copy (step_N.old) read where it is until `begin_trial` puts it back."""
    if config.resume_from_checkpoint != "auto":
        return False
    latest = latest_checkpoint(run_dir / CHECKPOINTS_DIR, replaced=True)
    config.resume_from_checkpoint = str(latest) if latest else ""
    if not latest:
        print(f"resume_from_checkpoint=auto: no complete checkpoint in {run_dir / CHECKPOINTS_DIR}, so the run starts "
              "from the beginning", flush=True)
    return not latest


def take_back_earlier_start(config, run_dir: Path) -> None:
    """A run killed before its first save left records of steps this start trains again: kept, they mixed with its
    own (learner.jsonl held steps 1-48, then 1-3; the console replayed the old progress lines). Its published weights
    go too."""
    if abandoned := abandon_records_after(config, run_dir, FROM_THE_START["step"], FROM_THE_START["version"]):
        print(f"{abandoned} records of the trial's earlier start moved to *.jsonl.abandoned", flush=True)
    remove_weights_after(run_dir, FROM_THE_START["version"])


def remove_weights_after(run_dir: Path, version: int) -> None:
    """The weights an earlier part of the run published (transport=disk) above the `version` it goes on from: no
    worker loads them (announced anew, each is written again), but they took disk and misled a reader about where the
    run was."""
    if removed := remove_versions_after(run_dir / WEIGHTS_DIR, version):
        log.info("removed the weights published above version %d: %s", version, ", ".join(removed))


def begin_trial(config, requested, run_dir: Path, from_the_beginning: bool) -> None:
    """What starting changes in the trial, done once nothing but the roles is left to start: a start that fails
    before (refused by a check, a placement that cannot be made, a bus that does not start) leaves the trial as it
    found it. A replaced checkpoint copy `auto` may have picked is put back; a continued run's last summary.json goes
    (its last launch's result is not the run's until it ends), or, started from the beginning, what its earlier start
    logged; config.yaml is saved (`requested`: as asked for, see rlsys/launcher.py, run_launched)."""
    for restored in restore_replaced(run_dir / CHECKPOINTS_DIR):
        copy = str(restored.with_name(restored.name + ".old"))  # where the checks read it; the roles find its name
        if config.resume_from_checkpoint == copy:
            config.resume_from_checkpoint = str(restored)
        if config.model.path == copy:  # its own export (rlsys/assets.py, resumed_model_path)
            config.model.path = str(restored)
    if config.resume_from_checkpoint:
        (run_dir / SUMMARY_FILE).unlink(missing_ok=True)
    elif from_the_beginning:
        take_back_earlier_start(config, run_dir)
    save_config(requested, run_dir / CONFIG_FILE)


def resumed_trainer_state(config) -> dict:
    """The trainer state of the checkpoint the run resumes from ({} for a run from the start), once its training rows
    are the ones it was trained on (check_same_dataset)."""
    if not config.resume_from_checkpoint:
        return {}
    trainer_state = read_trainer_state(Path(config.resume_from_checkpoint))
    check_same_dataset(config, trainer_state)
    print(f"resuming from {config.resume_from_checkpoint} (version {trainer_state['version']})", flush=True)
    return trainer_state


def check_same_dataset(config, trainer_state: dict) -> None:
    """A resume reads the training rows its checkpoint was trained on: its prompts are named by their row's place,
    so on other rows it would skip rows never trained and train others again. A checkpoint from before the
    fingerprint was kept is not checked."""
    from rlsys.data.dataset import DatasetError, load_rows, rows_fingerprint

    if not (saved := trainer_state.get("dataset")):
        return
    try:
        now = rows_fingerprint(load_rows(config.dataset.path, config.dataset.row_format()))
    except DatasetError as e:
        raise StartupError(str(e)) from None
    if now != saved:
        raise StartupError(f"{config.resume_from_checkpoint} was trained on other training rows than "
                           f"dataset.path={config.dataset.path} holds now (or the same in another order or format): "
                           "a resume names prompts by their row, so it would skip rows never trained and train others "
                           "again. Resume with the dataset it was trained on, or start a new run (trial_name=NEW)")


def initialize_bus_state(bus, config, trainer_state: dict, keep_initial_eval: bool = False) -> None:
    """Before any role starts: nothing left from an earlier run on the same Redis, and a resumed run
    counts the prompts it already trained as admitted, so it does not admit a burst. The prompt
    accounting continues from the checkpoint's (a fresh run's dead letters are cleared; a resumed
    one keeps those of its earlier part)."""
    cluster = config.cluster
    bus.delete(*protocol.cleared_at_a_start(cluster.n_learner_ranks, cluster.n_inference_workers,
                                            cluster.n_rollout_workers, not trainer_state, keep_initial_eval))
    if not trainer_state:
        run_counters.clear(bus)
    # Read by the inference workers from the bus: they may run where the checkpoint's directory is not
    bus.set(protocol.RESUMED_VERSION, trainer_state.get("version", 0))
    PromptLedger.of(bus, config).start(trainer_state.get("version", 0), trainer_state.get("accounting"),
                                       settled_prompts(trainer_state) if trainer_state else ())


FROM_THE_START = {"step": 0, "version": 0, **run_counters.AT_THE_START}  # what a run restarted so takes back


def take_back_abandoned_steps(bus, config, run_dir: Path, trainer_state: dict) -> None:
    """A run resumed from a checkpoint in its own directory (`auto`, or the learner's restart) trains the steps after
    it again: what those steps added before the crash is taken back, so each is counted once, as trained after the
    resume. The learner's and rollout workers' metrics after the checkpoint's step (version), and the trained traces'
    records, move to <file>.jsonl.abandoned, and TensorBoard is told the run restarted there (rlsys/metrics.py); the
    weight-check counter goes back to the checkpoint's count, and the dead letters set aside after it are deleted
    (their prompts, back in flight, are admitted again). A checkpoint from before the counters were kept leaves them
    as they are."""
    step = trainer_state["step"]
    if dropped := abandon_records_after(config, run_dir, step, trainer_state["version"]):
        log.info("resumed at step %d: %d records of the steps after it moved to *.jsonl.abandoned", step, dropped)
    remove_weights_after(run_dir, trainer_state["version"])
    run_counters.take_back(bus, trainer_state)


def abandon_records_after(config, run_dir: Path, step: int, version: int) -> int:
    """The files' part of take_back_abandoned_steps: the learner's records (and trained traces) after `step` and the
    rollout workers' after `version` moved to <file>.jsonl.abandoned, TensorBoard told where each starts again.
    Returns how many records moved."""
    from rlsys.tracing import TRACES_DIR, TRAINED_FILE

    logs = Path(config.logging_dir)
    dropped = drop_records_after(records_file(logs, LEARNER_RECORDS), step) + drop_records_after(
        run_dir / TRACES_DIR / TRAINED_FILE, step)
    mark_restart(logs, LEARNER_RECORDS, step + 1)
    for metrics in rollout_records_files(logs):
        dropped += drop_records_after(metrics, version)
        mark_restart(logs, metrics.stem, version + 1)
    return dropped


def saved_checkpoints(run_dir: Path) -> set[tuple]:
    """(step, saved_at) of each complete checkpoint in the run directory."""
    return {identity(state) for _, state in saved_in_order(run_dir / CHECKPOINTS_DIR)}


def resume_from_latest(config, run_dir: Path, saved_before: set[tuple]) -> dict:
    """After the learner died: every role starts again from the newest checkpoint saved since they last started
    (`saved_before`: `saved_checkpoints` then; a line that a resume from an earlier step abandoned was saved later,
    but it is not this run's), or, if none was, from where they started (from the start if from no checkpoint), so
    the learner's weights, step and dataset position agree with inference's again.

    model.path stays the run's own, as in a run started with resume_from_checkpoint: the learner loads the
    checkpoint's state over it and publishes its version, which inference loads. A role restarted later (the
    supervisor restarts each that dies) builds its engine and tokenizer from model.path, and a rollout worker reads
    the prompts to skip from the bus (PromptLedger.settled_before): save_total_limit deletes the checkpoint once
    newer ones of its line are saved."""
    restore_replaced(run_dir / CHECKPOINTS_DIR)  # every role stopped: no save is under way
    saved = [d for d, state in saved_in_order(run_dir / CHECKPOINTS_DIR) if identity(state) not in saved_before]
    latest = (saved[-1] if saved else None) or config.resume_from_checkpoint
    if latest:
        config.resume_from_checkpoint = str(latest)
    log.warning("restarting every role from %s", latest or "the start (no checkpoint was saved yet)")
    return read_trainer_state(Path(latest)) if latest else {}


def last_checkpoint_note(run_dir: Path) -> str:
    """The checkpoint a failed run continues from, and the command that continues it. A learner that died as it
    saved a step again leaves that step's complete copy as step_N.old, which the resume puts back and goes on from."""
    checkpoints = run_dir / CHECKPOINTS_DIR
    latest = latest_checkpoint(checkpoints, replaced=True)
    if latest is None:
        return "no checkpoint was saved"
    put_back = {old: directory for directory, old in replaced_copies(checkpoints).items()}.get(latest)
    step = f"step {read_trainer_state(latest)['step']}"
    where = f"{latest} ({step})" if put_back is None else \
        f"{put_back} ({step}; {latest.name} until the resume puts it back)"
    return f"the newest checkpoint is {where}; continue with {continue_arguments(run_dir)}"
