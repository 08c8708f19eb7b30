"""The run's plan: build what it needs, start its roles as processes joined by the bus (each runs rlsys/roles.py),
watch them, summarise, and always clean up."""

import contextlib
import copy
import dataclasses
import functools
import itertools
import json
import logging
import shutil
import signal
import sys
import time
from pathlib import Path

from rlsys import evaluations, protocol, run_counters
from rlsys.bus import EmbeddedRedis, EmbeddedRedisError, connect, raise_on_sigterm
from rlsys.checkpoint import (CHECKPOINTS_DIR, identity, latest_checkpoint, read_trainer_state, restore_replaced,
                              saved_in_order)
from rlsys.cli import config_to_dict, describe_fields, first_line, registry_name_of, save_config
from rlsys.console import ProgressReporter
from rlsys.metrics import (LEARNER_RECORDS, drop_records_after, mark_restart, records_file, rollout_records,
                           rollout_records_files)
from rlsys.placement import PlacementError, open_placement
from rlsys.placement.gpus import gpu_layout, visible_devices
from rlsys.placement.local import STOP_SIGNALS
from rlsys.preflight import StartupError, check_extras, check_message_bus, check_mlflow_server
from rlsys.prompt_ledger import ADMITTED, NO_PROMPTS, PromptLedger, accounted, as_ended, describe, settled_prompts
from rlsys.run_files import CONFIG_FILE, SUMMARY_FILE, logs_dir
from rlsys.run_privacy import make_private, redact_url, write_private
from rlsys.roles import run_role
from rlsys.stall import StallWatch
from rlsys.errors import LearnerFailed, RoleFailed
from rlsys.supervisor import Supervisor
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
    logged; config.yaml is saved (`requested`: as asked for, see run_launched)."""
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


@contextlib.contextmanager
def message_bus(config, run_dir: Path, host: str = "127.0.0.1"):
    """(url, embedded server or None): the configured Redis, or a private server in the run directory
    listening on `host`, stopped on every way out."""
    if config.cluster.redis_url:
        yield config.cluster.redis_url, None
        return
    server = EmbeddedRedis(run_dir / "redis", config.cluster.redis_port, host)
    try:
        server.start()
    except EmbeddedRedisError as e:
        raise StartupError(str(e)) from None
    with server:
        yield server.url, server


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


def held_out_summary(bus, started_from: dict, logging_dir: Path) -> dict:
    """The summary's held-out figures. The evaluation on the bus as "initial" is the one at the launch's start: a
    fresh run's first, before any step; a resumed run's, of its checkpoint's weights. Resumed, the "initial" figures
    are the run's first, which its checkpoints keep (from before they were kept: that evaluation at the resumed step,
    as before), and the one at the resumed step is `resumed` ({"step", "accuracy", "reward"}). `held_out_curve`: every
    evaluation of the run, its launches before a resume included, oldest first."""
    start, final = (evaluations.result(bus, tag) or {} for tag in (evaluations.INITIAL, evaluations.FINAL))
    initial = (started_from.get("initial_eval") or start) if started_from else start
    figures = {
        # None where the run did not evaluate, or its episodes have no success to count (rlsys/workers/
        # rollout_worker.py, evaluate); the mean reward is there whenever it evaluated
        "initial_accuracy": initial.get("accuracy"),
        "final_accuracy": final.get("accuracy"),
        "initial_reward": initial.get("reward"),
        "final_reward": final.get("reward"),
        "held_out_curve": evaluations.curve(logging_dir),
    }
    if started_from:
        figures["resumed"] = {"step": started_from["step"], "accuracy": start.get("accuracy"),
                              "reward": start.get("reward")}
    return figures


def prepare(config) -> float:
    """Dataset and model ready, or a StartupError that names what is wrong with them; returns the seconds a warm
    start of the tiny model took (0.0 if none ran)."""
    from rlsys.assets import AssetError, prepare_assets
    from rlsys.data.dataset import DatasetError

    check_message_bus(config.cluster)  # first: it takes a second, preparing the assets may take minutes
    check_extras(config)
    check_mlflow_server(config.trace)
    devices = visible_devices()
    if config.cluster.backend == "local":
        try:
            gpu_layout(config.cluster, config.inference, devices)
        except PlacementError as e:
            raise StartupError(str(e)) from None
        if config.cluster.colocate and devices:
            raise StartupError("cluster.colocate=true takes turns on CPU cores; on GPUs it would need vLLM's sleep "
                               "mode and in-memory weight hand-over, which rlsys does not have yet: leave it false")
    # Refused here rather than by a role that would die and be restarted.
    device = "cuda" if devices else "cpu"
    # Under Ray a role has a GPU where its bundle has (a role given none sees none), whatever this machine has
    on_ray = config.cluster.backend == "ray"
    learner_device = "cuda" if config.cluster.learner_gpus else "cpu" if on_ray else device
    inference_device = "cuda" if config.cluster.gpus_per_inference_worker else "cpu" if on_ray else device
    try:
        if hasattr(config, "learner"):
            config.learner.check_device(learner_device, config.cluster.n_learner_ranks)
        config.inference.check_device(inference_device)
    except ValueError as e:
        raise StartupError(str(e)) from None
    try:
        warm_start_seconds = prepare_assets(config)
    except (AssetError, DatasetError) as e:
        raise StartupError(str(e)) from None
    check_plugins(config)
    return warm_start_seconds


def check_plugins(config) -> None:
    """The run's agents built once and its environments' arguments bound to their constructors, here: a name,
    an argument or a value they refuse stops the run with their message, not a rollout worker restarted until it
    gives up, the reason in its log. Environments are not built here: some load a model (reward-model); their
    `check_args` refuses what they could never run with."""
    import rlsys.impl.agent  # noqa: F401  (registers the built-in agents and environments, as the roles do)
    import rlsys.impl.env  # noqa: F401
    from rlsys.api import ENVIRONMENTS, make_agent
    from rlsys.workers.env_per_row import run_environments

    for abstraction in {repr(a): a for a in [config.agent, *config.agents.values()]}.values():
        try:
            make_agent(abstraction)
        except Exception as e:  # a plugin's constructor may raise anything
            raise StartupError(f"agent {abstraction.name!r} cannot be built: {first_line(e)}") from None
    for abstraction in run_environments(config):
        try:
            cls = ENVIRONMENTS.check(abstraction.name, abstraction.args)
        except (KeyError, TypeError) as e:
            raise StartupError(first_line(e)) from None
        try:
            getattr(cls, "check_args", lambda **_: None)(**abstraction.args)
        except ValueError as e:
            set_by = "".join(f" (the run sets its {arg} from {key})"
                             for arg, key in settings_behind(config, abstraction.name).items())
            raise StartupError(f"environment {abstraction.name!r}: {first_line(e)}{set_by}") from None


def settings_behind(config, env_name: str) -> dict[str, str]:
    """{argument of the environment `env_name`: the setting it takes its value from}, for string settings. An
    experiment hands its own settings to an environment under the environment's names (reward_model_path as
    model_path): an error in those names alone sends the user looking for a key they never set. Found by giving each
    setting a value of its own, in a copy of the config, and seeing which argument takes it."""
    from rlsys.workers.env_per_row import run_environments

    found = {}
    for field in describe_fields(type(config)):
        *parents, name = field.path.split(".")
        if field.is_group or not isinstance(getattr(functools.reduce(getattr, parents, config), name), str):
            continue
        probe, marker = copy.deepcopy(config), f"<{field.path}>"
        setattr(functools.reduce(getattr, parents, probe), name, marker)
        with contextlib.suppress(Exception):  # an experiment's property that cannot take the marker feeds nothing
            for abstraction in run_environments(probe):
                if abstraction.name == env_name:
                    found.update({arg: field.path for arg, value in abstraction.args.items() if value == marker})
    return found


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
    latest = latest_checkpoint(run_dir / CHECKPOINTS_DIR)
    if latest is None:
        return "no checkpoint was saved"
    return (f"the newest checkpoint is {latest} (step {read_trainer_state(latest)['step']}); continue with "
            f"--config {run_dir / CONFIG_FILE} resume_from_checkpoint=auto")


@contextlib.contextmanager
def placed_roles(config):
    """The placement `cluster.backend` names; StartupError if the layout cannot be placed."""
    try:
        with open_placement(config, run_role) as placement:
            yield placement
    except PlacementError as e:
        raise StartupError(str(e)) from None


def finish_observability(config, run_dir: Path) -> None:
    """The run report, and the MLflow export if asked for; neither failing loses the run's result."""
    from rlsys.report import build_report

    try:
        frames = run_dir / config.trace.render_save_dir if config.trace.render_save_dir else None
        print(f"report: {build_report(run_dir, frames)}", flush=True)
        if config.trace.mlflow:
            from rlsys.mlflow_export import default_tracking_uri, export_run

            uri = config.trace.mlflow_tracking_uri or default_tracking_uri(run_dir)
            # said first: the export may take minutes (many traces, or a server that stopped answering mid-run)
            print(f"exporting the traces and learner metrics to MLflow at {redact_url(uri)}", flush=True)
            export_run(run_dir, uri, Path(config.logging_dir))
            print(f"traces in MLflow: mlflow ui --backend-store-uri {redact_url(uri)}", flush=True)
    except Exception:
        log.warning("could not write the run report or export the traces", exc_info=True)


@dataclasses.dataclass
class Part:
    """What the summary needs of the launch: when it started, its warm start's seconds, the checkpoint it started
    from, and how the roles of its last part ended (None until they are stopped)."""
    started: float
    warm_start_seconds: float
    started_from: dict
    unclean: dict[str, str] | None = None


STOP_EXIT_CODES = {128 + signal.SIGTERM: "SIGTERM"}  # SystemExit codes of a stop (rlsys.bus.raise_on_sigterm's)


def stop_signal(e: BaseException) -> str | None:
    """The signal that stopped the launcher by `e`, or None where `e` is no stop's."""
    if isinstance(e, KeyboardInterrupt):
        return "SIGINT"
    return STOP_EXIT_CODES.get(e.code) if isinstance(e, SystemExit) else None


@contextlib.contextmanager
def stop_signals_deferred():
    """A Ctrl-C or SIGTERM within the block is noted, and handled as the block ends, where it would have been handled
    (the first of them: the second a run gets kills its roles anyway). A signal mask would not do: it holds a signal
    back from one thread, and any other thread of the process takes it (Python then raises it in the main thread at
    once). Main thread only."""
    came: list[int] = []
    previous = {signum: signal.signal(signum, lambda signum, frame: came.append(signum)) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        if came:
            signal.raise_signal(came[0])


@dataclasses.dataclass
class AtTheStop:
    """Where a stopped run stands against its newest checkpoint, where `resume_from_checkpoint=auto` goes on (None
    where none was saved: a resume starts from the beginning)."""
    checkpoint: Path | None
    steps: int  # the checkpoint's
    trained: int  # the steps whose weights the learner published: those past `steps` are lost to a resume
    loses_nothing: bool  # a resume from the checkpoint holds the run as it stopped


def stopped_steps(bus, run_dir: Path, prompts: dict) -> AtTheStop:
    """A stopped run against its newest checkpoint. A resume from it loses nothing where its step is the last trained
    and its books are the run's final `prompts`: as the learner's save at the stop leaves it, or a stop as a
    restart set the books from it (with no checkpoint: nothing trained, nothing admitted). A learner killed after the
    grace, or that crashed saving, saved nothing at the stop: the newest checkpoint is older, and `prompts` (the
    bus's) count outcomes it does not. A step is counted trained once its weights are published: one the learner was
    computing, or had computed and not yet published, when it was killed left nothing (no weights, no records, its
    prompts in flight), and neither its records nor the bus tell it."""
    latest = latest_checkpoint(run_dir / CHECKPOINTS_DIR)
    state = read_trainer_state(latest) if latest else {"step": 0, "version": 0, "accounting": NO_PROMPTS}
    published = (bus.get(protocol.WEIGHTS) or {}).get("version", state["version"])  # step and version rise together
    trained = state["step"] + max(0, published - state["version"])
    loses_nothing = trained == state["step"] and as_ended(state.get("accounting")) == prompts
    return AtTheStop(latest, state["step"], trained, loses_nothing)


def unsaved_stop_note(summary: dict) -> str:
    """What a resume from a stopped run's newest checkpoint loses (its learner did not save at the stop)."""
    checkpoint, lost = summary["resume_from"], summary["steps_trained"] - summary["steps"]
    where = (f"from {checkpoint} (step {summary['steps']})" if checkpoint
             else "from the beginning (no checkpoint was saved)")
    return (f"the learner did not save at the stop: a resume goes on {where}, {lost} steps trained after it are lost; "
            "the summary's prompts count what the run recorded, beyond what a resume holds")


def run_summary(bus, config, run_dir: Path, supervisor: Supervisor, ledger: PromptLedger, part: Part,
                stopped: str | None = None) -> dict:
    """The run's summary, once every role stopped: its held-out figures, its steps (a stopped run's: its newest
    checkpoint's, where a resume goes on, and `stopped_steps`' steps trained and whether it saved at the stop), where
    its prompts ended, its restarts and counters; `stopped`: the signal that stopped it before max_steps, None for a
    run that ended."""
    prompts, counters = ledger.end_run(), run_counters.held(bus)
    at_stop = stopped_steps(bus, run_dir, prompts) if stopped else None
    return {
        **held_out_summary(bus, part.started_from, Path(config.logging_dir)),
        "steps": at_stop.steps if at_stop else config.max_steps,
        "steps_trained": at_stop.trained if at_stop else config.max_steps,
        "stopped": stopped,
        # None for a run that ended
        "resume_loses_nothing": at_stop.loses_nothing if at_stop else None,
        "resume_from": str(at_stop.checkpoint) if at_stop and at_stop.checkpoint else None,
        # the run's own time apart from a warm start's, which a first run on a cold cache spends for minutes
        "minutes": (time.monotonic() - part.started - part.warm_start_seconds) / 60,
        "warm_start_minutes": part.warm_start_seconds / 60,
        "run_dir": str(run_dir),
        "prompts": prompts,
        "prompts_accounted": accounted(prompts) == prompts[ADMITTED],
        "dead_letters": counters["dead_letters"],
        "messages_set_aside": bus.stream_length(protocol.DEAD_MESSAGES),  # requests and replies a role refused
        "restarts": dict(supervisor.restarts),
        "unclean_exits": part.unclean,  # role name -> how it ended, for each that did not end cleanly at the stop
        "weight_checks": counters["weight_checks"],
    }


def write_summary(summary: dict, run_dir: Path) -> None:
    if not summary["prompts_accounted"]:
        log.error("the prompt accounting does not add up: %s", describe(summary["prompts"]))
    write_private(run_dir / SUMMARY_FILE, json.dumps(summary, indent=2))


def write_stopped_summary(bus, config, run_dir: Path, supervisor: Supervisor, ledger: PromptLedger, part: Part,
                          why: str) -> None:
    """A run stopped by the signal `why`: its summary, once every role stopped. Where the supervisor's stop did not
    end (a second Ctrl-C or SIGTERM during it, which means "stop now") or had not begun (a stop as the roles start),
    what still runs is killed first, so that nothing changes the books as they are read; the learner saved nothing
    then, and the summary says so. Written with further stop signals held back: it takes a moment, and is the run's
    last word."""
    with stop_signals_deferred():
        if part.unclean is None:
            part.unclean = supervisor.kill()
        summary = run_summary(bus, config, run_dir, supervisor, ledger, part, why)
        write_summary(summary, run_dir)
        if not summary["resume_loses_nothing"]:
            print(unsaved_stop_note(summary), file=sys.stderr, flush=True)
        print(f"summary of the stopped run: {run_dir / SUMMARY_FILE}", file=sys.stderr, flush=True)


def launch(config) -> dict:
    """Runs a whole experiment; returns (and writes to <run dir>/summary.json) its held-out accuracy and mean
    reward before and after, and where its prompts ended. StartupError, before any process starts, if it cannot
    run: then the directories it made are gone again, and a trial's directory that was there holds what it held."""
    started = time.monotonic()
    run_dir, logging_dir, made = make_run_directories(config)
    try:
        return run_launched(config, run_dir, logging_dir, started)
    except StartupError:
        remove_directories(made)
        raise


def run_launched(config, run_dir: Path, logging_dir: Path, started: float) -> dict:
    """launch's part once the run's directories are made."""
    if not config.resume_from_checkpoint:
        refuse_a_second_start(run_dir, logging_dir)
    # Before the logs' directory, the checkpoint `auto` names, and the generated dataset's and tiny model's paths are
    # filled in: the file is what was asked for, so `--config` continues it (resume_from_checkpoint=auto) or reruns it
    # (trial_name=) from the same caches, without paths of this trial that would send a rerun's logs into it. Saved
    # by begin_trial: a start that fails leaves the trial's config.yaml as its own run wrote it.
    requested = copy.deepcopy(config)
    config.logging_dir = str(logging_dir)
    from_the_beginning = resolve_resume(config, run_dir)
    warm_start_seconds = prepare(config)
    print(f"run directory: {run_dir} (each role's full output: {config.logging_dir}/<role>.log)", flush=True)
    trainer_state = {}
    if config.resume_from_checkpoint:
        trainer_state = read_trainer_state(Path(config.resume_from_checkpoint))
        check_same_dataset(config, trainer_state)
        print(f"resuming from {config.resume_from_checkpoint} (version {trainer_state['version']})", flush=True)
    with raise_on_sigterm(), placed_roles(config) as placement, \
            message_bus(config, run_dir, placement.bus_host) as (bus_url, server):
        bus = connect(bus_url, wait_out_restarts=server is None)  # it restarts the server it owns: never waits for it
        begin_trial(config, requested, run_dir, from_the_beginning)
        supervisor = Supervisor(
            config, lambda role, index: placement.start(role, index, (config_to_dict(config), bus_url, str(run_dir))), server)
        ledger = PromptLedger.of(bus, config)
        report = ProgressReporter(records_file(config.logging_dir, LEARNER_RECORDS), config.logging_steps,
                                  config.max_steps, bus, ledger,
                                  evaluations_file=records_file(config.logging_dir, rollout_records(0)),
                                  resumed=(trainer_state.get("step", 0), trainer_state.get("version", 0)))
        stall = StallWatch(config, ledger)
        restarted, part = False, Part(started, warm_start_seconds, trainer_state)
        try:
            while True:
                part.unclean = {}  # no role of this part runs yet: a stop now finds none, not the last part's ends
                # A stop that came as the books are set (again, after a restart) would find them half set: it comes
                # once they are whole, as the checkpoint's, and the summary counts them so
                with stop_signals_deferred():
                    initialize_bus_state(bus, config, trainer_state, keep_initial_eval=restarted)
                    if trainer_state or restarted:  # a restart with no checkpoint yet trains from the start again
                        take_back_abandoned_steps(bus, config, run_dir, trainer_state or FROM_THE_START)
                saved_before = saved_checkpoints(run_dir)
                part.unclean = None  # until this part's roles are stopped
                supervisor.start()
                stall.state = None  # a new part of the run starts its own clock
                try:
                    supervisor.watch(bus, lambda: (report(), stall.check(bus)))
                    report()
                    break
                except LearnerFailed:  # counted as a restart of the rank that died
                    supervisor.stop(bus)
                    trainer_state = resume_from_latest(config, run_dir, saved_before)
                    restarted = True
                finally:
                    part.unclean = supervisor.stop(bus)  # the learner saves a checkpoint when it is told to stop
        except RoleFailed as e:
            raise RoleFailed(f"{e}; {last_checkpoint_note(run_dir)}") from None
        except (KeyboardInterrupt, SystemExit) as e:
            if why := stop_signal(e):
                write_stopped_summary(bus, config, run_dir, supervisor, ledger, part, why)
            raise
        for name, why in part.unclean.items():
            log.warning("%s %s as the run stopped; its output: %s", name, why, Path(config.logging_dir) / f"{name}.log")
        summary = run_summary(bus, config, run_dir, supervisor, ledger, part)
        bus.close()
    write_summary(summary, run_dir)
    finish_observability(config, run_dir)
    return summary

