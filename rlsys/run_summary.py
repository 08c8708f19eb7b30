"""A run's summary.json: its held-out figures, steps, prompts' ends, restarts and counters, written once every role
stopped; for a run stopped by a signal, also where it stands against its newest checkpoint (what a resume loses)."""

import dataclasses
import json
import logging
import sys
import time
from pathlib import Path

from rlsys import evaluations, protocol, run_counters
from rlsys.checkpoint import CHECKPOINTS_DIR, latest_checkpoint, read_trainer_state, restore_replaced
from rlsys.prompt_ledger import ADMITTED, NO_PROMPTS, PromptLedger, accounted, as_ended, describe
from rlsys.run_files import SUMMARY_FILE, continue_arguments
from rlsys.run_privacy import write_private
from rlsys.stop_signals import stop_signals_deferred
from rlsys.supervisor import Supervisor

log = logging.getLogger("rlsys")


# an evaluation's figures the summary gives, before and after (rlsys/evaluations.py names them)
SUMMARY_FIGURES = (evaluations.ACCURACY, evaluations.REWARD_OF_ENDED, evaluations.FAILED)


def held_out_summary(bus, started_from: dict, logging_dir: Path) -> dict:
    """The summary's held-out figures. The evaluation on the bus as "initial" is the one at the launch's start: a
    fresh run's first, before any step; a resumed run's, of its checkpoint's weights. Resumed, the "initial" figures
    are the run's first, which its checkpoints keep (from before they were kept: that evaluation at the resumed step,
    as before), and the one at the resumed step is `resumed` ({"step", "accuracy", "reward_of_ended"}).
    `held_out_curve`: every evaluation of the run, its launches before a resume included, oldest first."""
    start, final = (evaluations.result(bus, tag) or {} for tag in (evaluations.INITIAL, evaluations.FINAL))
    initial = evaluations.named_now(started_from.get("initial_eval") or start) if started_from else start
    figures = {
        # initial_accuracy, final_accuracy (None where the run did not evaluate, or its episodes have no success to
        # count), initial_reward_of_ended, ... (there whenever it evaluated), and initial_failed, final_failed: the
        # held-out episodes that failed (their environment or agent raised or hung), in the accuracy as unsolved
        **{f"{tag}_{figure}": evaluation.get(figure) for figure in SUMMARY_FIGURES
           for tag, evaluation in (("initial", initial), ("final", final))},
        "held_out_curve": evaluations.curve(logging_dir),
    }
    if started_from:
        resumed_at = (evaluations.ACCURACY, evaluations.REWARD_OF_ENDED)
        figures["resumed"] = {"step": started_from["step"], **{figure: start.get(figure) for figure in resumed_at}}
    return figures


@dataclasses.dataclass
class Part:
    """What the summary needs of the launch: when it started, its warm start's seconds, the checkpoint it started
    from, and how the roles of its last part ended (None until they are stopped)."""
    started: float
    warm_start_seconds: float
    started_from: dict
    unclean: dict[str, str] | None = None


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
    checkpoint's, where a resume goes on, and `stopped_steps`' steps trained and whether a resume loses any), where
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
    then, and the summary says so. A checkpoint the learner was replacing as it died (its old copy renamed away, and
    the stop came before a restart put it back, or the learner was killed at the stop) is put back first, as the next
    start would (`restore_replaced`: no role runs, so no save is under way), so that the summary names it where that
    start finds it. Written with further stop signals held back: it takes a moment, and is the run's last word."""
    with stop_signals_deferred():
        if part.unclean is None:
            part.unclean = supervisor.kill()
        restore_replaced(run_dir / CHECKPOINTS_DIR)
        summary = run_summary(bus, config, run_dir, supervisor, ledger, part, why)
        write_summary(summary, run_dir)
        if not summary["resume_loses_nothing"]:
            print(unsaved_stop_note(summary), file=sys.stderr, flush=True)
        print(f"summary of the stopped run: {run_dir / SUMMARY_FILE}; continue it with {continue_arguments(run_dir)}",
              file=sys.stderr, flush=True)
