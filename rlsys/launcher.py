"""The run's plan, on one page: `launch` makes the run's directories; `run_launched` runs the start-up checks and
makes the dataset and model ready (`prepare`), places the roles as processes joined by the bus (each runs
rlsys/roles.py) and hands them to `supervise`, which starts and watches them, part by part, until they finish; then the
summary and the report. Every way out stops the roles and the bus, and a start refused (StartupError) leaves no
directory it made.

Where each part lives: the start-up checks in rlsys/preflight.py (what the run needs outside itself: the bus, its
packages, an MLflow server) and rlsys/config_checks.py (what its config asks of this machine and of its plugins); where
the run starts (its directory, a resume, what a restart takes back) in rlsys/run_start.py; the roles' processes in
rlsys/placement/ and rlsys/supervisor.py; the summary in rlsys/run_summary.py; Ctrl-C and SIGTERM in
rlsys/stop_signals.py."""

import contextlib
import copy
import logging
import time
from pathlib import Path

from rlsys import evaluations
from rlsys.bus import EmbeddedRedis, EmbeddedRedisError, connect, raise_on_sigterm
from rlsys.cli import config_to_dict
from rlsys.config_checks import check_devices, check_plugin_names, check_plugins
from rlsys.console import ProgressReporter
from rlsys.metrics import LEARNER_RECORDS, records_file
from rlsys.placement import PlacementError, open_placement
from rlsys.preflight import StartupError, check_extras, check_message_bus, check_mlflow_server
from rlsys.prompt_ledger import PromptLedger
from rlsys.run_files import role_log, with_absolute_paths
from rlsys.run_privacy import redact_url
from rlsys.run_start import (FROM_THE_START, begin_trial, initialize_bus_state, last_checkpoint_note,
                             make_run_directories, refuse_a_second_start, remove_directories, resolve_resume,
                             resume_from_latest, resumed_trainer_state, saved_checkpoints,
                             take_back_abandoned_steps)
from rlsys.run_summary import Part, run_summary, write_stopped_summary, write_summary
from rlsys.roles import run_role
from rlsys.stall import StallWatch
from rlsys.stop_signals import stop_signal, stop_signals_deferred
from rlsys.errors import LearnerFailed, RoleFailed
from rlsys.supervisor import Supervisor

log = logging.getLogger("rlsys")


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
    """launch's part once the run's directories are made: the checks and the assets, then the roles placed and the
    bus started, supervised to their end and summarised."""
    if not config.resume_from_checkpoint:
        refuse_a_second_start(run_dir, logging_dir)
    # Before the logs' directory, the checkpoint `auto` names, and the generated dataset's and tiny model's paths are
    # filled in: the file is what was asked for, so `--config` continues it (resume_from_checkpoint=auto) or reruns it
    # (trial_name=) from the same caches, without paths of this trial that would send a rerun's logs into it. Saved
    # by begin_trial: a start that fails leaves the trial's config.yaml as its own run wrote it.
    requested = with_absolute_paths(copy.deepcopy(config))
    config.logging_dir = str(logging_dir)
    from_the_beginning = resolve_resume(config, run_dir)
    warm_start_seconds = prepare(config)
    print(f"run directory: {run_dir} (each role's full output: {config.logging_dir}/<role>.log)", flush=True)
    trainer_state = resumed_trainer_state(config)
    with raise_on_sigterm(), placed_roles(config) as placement, \
            message_bus(config, run_dir, placement.bus_host) as (bus_url, server):
        bus = connect(bus_url, wait_out_restarts=server is None)  # it restarts the server it owns: never waits for it
        begin_trial(config, requested, run_dir, from_the_beginning)
        supervisor = Supervisor(config, lambda role, index: placement.start(
            role, index, (config_to_dict(config), bus_url, str(run_dir))), server)
        ledger = PromptLedger.of(bus, config)
        report = ProgressReporter(records_file(config.logging_dir, LEARNER_RECORDS), config.logging_steps,
                                  config.max_steps, bus, ledger,
                                  evaluations_file=evaluations.records_path(config.logging_dir),
                                  resumed=(trainer_state.get("step", 0), trainer_state.get("version", 0)))
        stall = StallWatch(config, ledger)
        part = Part(started, warm_start_seconds, trainer_state)
        try:
            supervise(bus, config, run_dir, supervisor, part, report, stall)
        except RoleFailed as e:
            raise RoleFailed(f"{e}; {last_checkpoint_note(run_dir)}") from None
        except (KeyboardInterrupt, SystemExit) as e:
            if why := stop_signal(e):
                write_stopped_summary(bus, config, run_dir, supervisor, ledger, part, why)
            raise
        for name, why in part.unclean.items():
            log.warning("%s %s as the run stopped; its output: %s", name, why, role_log(config.logging_dir, name))
        summary = run_summary(bus, config, run_dir, supervisor, ledger, part)
        bus.close()
    write_summary(summary, run_dir)
    finish_observability(config, run_dir)
    return summary


def supervise(bus, config, run_dir: Path, supervisor: Supervisor, part: Part, report: ProgressReporter,
              stall: StallWatch) -> None:
    """The run's parts, until its roles finish: each sets the books (the checkpoint's where it goes on from one) and
    starts every role, watched with the progress lines and the stall check each poll; a learner that dies ends the
    part, and the next goes on from the newest checkpoint. Every way out stops the roles, and `part.unclean` says how
    each ended."""
    trainer_state, restarted = part.started_from, False
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
            return
        except LearnerFailed:  # counted as a restart of the rank that died
            # Every role stopped before the newest checkpoint is read: no save under way. The `finally` stops them
            # again (at once, or within what is left of this stop's grace where a Ctrl-C cut it short) and says how
            # they ended; with its stop alone, one cut short would leave them to be killed at once, as by a second
            supervisor.stop(bus)
            trainer_state = resume_from_latest(config, run_dir, saved_before)
            restarted = True
        finally:
            part.unclean = supervisor.stop(bus)  # the learner saves a checkpoint when it is told to stop


def prepare(config) -> float:
    """The start-up checks passed and the dataset and model ready, or a StartupError that names what is wrong;
    returns the seconds a warm start of the tiny model took (0.0 if none ran). The plugins are checked last: the
    agents load the model's tokenizer, whose path preparing the assets fills in (their names and arguments
    are checked before)."""
    from rlsys.assets import AssetError, prepare_assets
    from rlsys.data.dataset import DatasetError

    check_message_bus(config.cluster)  # first: it takes a second, preparing the assets may take minutes
    check_extras(config)
    check_mlflow_server(config.trace)
    check_devices(config)
    check_plugin_names(config)  # a typo in a name or an argument is said before minutes of warm start
    try:
        warm_start_seconds = prepare_assets(config)
    except (AssetError, DatasetError) as e:
        raise StartupError(str(e)) from None
    check_plugins(config)
    return warm_start_seconds


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
