"""A run stopped by a signal during a learner's restart (as the restart stops the roles, finds the newest checkpoint,
puts back a checkpoint the dead learner was replacing, or resets the books), or as its learner saves at the stop: its
summary, from the launcher's own loop over a real embedded Redis, with a supervisor that starts no process (a whole
run, with its learner killed and the signal timed to the restart, would take minutes and could not choose its
moment)."""

import collections
import json
import os
import signal
from pathlib import Path

import pytest

from rlsys import launcher, protocol
from rlsys.checkpoint import SHARDED_STATE, TRAINER_STATE
from rlsys.cli import parse_config
from rlsys.errors import LearnerFailed
from rlsys.prompt_ledger import PromptLedger

BOOKS = {"admitted": 8, "trained": 4, "filtered": {"uniform_reward": 2}, "failed": {"env_error": 1}, "in_flight": 1,
         "in_flight_prompts": ["p8"], "failed_prompts": {"p7": "env_error"}}  # step 4's checkpoint's


class LearnerDiesOnce:
    """A supervisor whose first part's learner dies once it trained past the checkpoint: published version 6, and
    admitted prompts the checkpoint does not hold; or, `resaving`, as it saved the checkpoint it resumed from again
    (trained nothing since), killed between its save's renames (rlsys/checkpoint.py, save_checkpoint): step_4 renamed
    away to step_4.old, the new copy half written in step_4.tmp. Its stop reports that learner's death, as the real
    one's does; the launcher gets `signum` during its first stop (the restart's), as a real stop waits for the roles,
    where `signum` is not None."""

    def __init__(self, config, signum: int | None, resaving: bool = False):
        self.config, self.restarts, self.signum, self.stops = config, collections.Counter(), signum, 0
        self.resaving = resaving

    def start(self) -> None:
        pass

    def watch(self, bus, report) -> None:
        if self.resaving:
            self.killed_between_the_renames()
        else:
            bus.set(protocol.WEIGHTS, {"version": 6})
            ledger = PromptLedger.of(bus, self.config)
            for prompt in ("p9", "p10", "p11"):
                ledger.admit(prompt, 6)
        self.restarts["learner0"] += 1
        raise LearnerFailed("learner0 exited with code -9 (SIGKILL)")

    def stop(self, bus) -> dict[str, str]:
        self.stops += 1
        if self.stops == 1 and self.signum is not None:
            os.kill(os.getpid(), self.signum)
        return {"learner0": "exited with code -9 (SIGKILL)"}

    def kill(self) -> dict[str, str]:
        return self.stop(None)

    def killed_between_the_renames(self) -> None:
        checkpoint = Path(self.config.resume_from_checkpoint)
        checkpoint.rename(checkpoint.with_name(checkpoint.name + ".old"))
        (checkpoint.with_name(checkpoint.name + ".tmp") / SHARDED_STATE).mkdir(parents=True)


class KilledAsItSavesAtTheStop(LearnerDiesOnce):
    """A supervisor whose learner, resumed and stopped before it trained a step, saves the checkpoint it resumed from
    again at the stop, and is killed past the grace between its save's renames."""

    def watch(self, bus, report) -> None:
        os.kill(os.getpid(), self.signum)

    def stop(self, bus) -> dict[str, str]:
        self.killed_between_the_renames()
        return {"learner0": "was still running 1 s after the stop, and was killed"}


class RunsToItsEnd(LearnerDiesOnce):
    """A supervisor whose roles finish the run, each cleanly."""

    def watch(self, bus, report) -> None:
        pass

    def stop(self, bus) -> dict[str, str]:
        return {}


def launch_config(tmp_path: Path):
    return parse_config([f"output_dir={tmp_path / 'runs'}", f"model.cache_dir={tmp_path / 'cache'}", "trial_name=t",
                         "resume_from_checkpoint=auto", "cluster.redis_port=0", "model.path=/nonexistent/model"])


def saved_at_step_4(run_dir: Path) -> None:
    """The run's checkpoint of step 4, its books BOOKS; its sharded state stands for one by its index's text."""
    state = {"step": 4, "version": 4, "saved_at": 1.0, "consumed_prompts": ["p1", "p2"], "accounting": BOOKS}
    (run_dir / "checkpoints" / "step_4" / SHARDED_STATE).mkdir(parents=True)
    (run_dir / "checkpoints" / "step_4" / SHARDED_STATE / ".metadata").write_text("step 4's index")
    (run_dir / "checkpoints" / "step_4" / TRAINER_STATE).write_text(json.dumps(state))


def stopped_during_the_restart(tmp_path: Path, monkeypatch, checkpoint: bool, moment: str = "reset",
                               signum: int = signal.SIGINT, resaving: bool = False) -> tuple[dict, int]:
    """The launcher's summary of a run whose learner died (`resaving`: see LearnerDiesOnce), and which got `signum`
    during the restart: as it stopped the roles ("stop"), found the newest checkpoint ("resume"), put back the
    checkpoint the learner was replacing, just before its rename ("restoring") or just after ("restored"), or set the
    books ("reset"); and how many times it stopped the roles."""
    run_dir = tmp_path / "runs" / "async-ppo-math" / "t"
    if checkpoint:
        saved_at_step_4(run_dir)
    real_initialize, real_resume, real_rename = launcher.initialize_bus_state, launcher.resume_from_latest, Path.rename
    signalled = []

    def signalled_amid_the_reset(bus, config, trainer_state, keep_initial_eval=False):
        if keep_initial_eval and moment == "reset":  # the restart's
            os.kill(os.getpid(), signum)
        real_initialize(bus, config, trainer_state, keep_initial_eval)

    def signalled_amid_the_resume(config, run_dir, saved_before):
        if moment == "resume":
            os.kill(os.getpid(), signum)
        return real_resume(config, run_dir, saved_before)

    def signalled_amid_the_restore(path: Path, target):  # the renames of restore_replaced, the first only
        if path.suffix == ".old" and moment in ("restoring", "restored") and not signalled:
            signalled.append(path)
            if moment == "restored":
                real_rename(path, target)
            os.kill(os.getpid(), signum)  # its handler raises at once, before restore_replaced goes on
            raise AssertionError(f"the {signal.Signals(signum).name} sent during the restore was not handled at once")
        return real_rename(path, target)

    monkeypatch.setattr("rlsys.launcher.prepare", lambda config: 0.0)  # no assets: no role runs
    made = []
    monkeypatch.setattr("rlsys.launcher.Supervisor", lambda config, start_role, server=None: made.append(
        LearnerDiesOnce(config, signum if moment == "stop" else None, resaving)) or made[-1])
    monkeypatch.setattr("rlsys.launcher.initialize_bus_state", signalled_amid_the_reset)
    monkeypatch.setattr("rlsys.launcher.resume_from_latest", signalled_amid_the_resume)
    monkeypatch.setattr(Path, "rename", signalled_amid_the_restore)
    with pytest.raises((KeyboardInterrupt, SystemExit)):
        launcher.launch(launch_config(tmp_path))
    assert bool(signalled) == (moment in ("restoring", "restored"))
    return json.loads((run_dir / "summary.json").read_text()), made[0].stops


@pytest.mark.parametrize("checkpoint", [True, False])
def test_a_stop_as_a_restart_resets_the_books_leaves_the_checkpoints_run(tmp_path, monkeypatch, capsys, checkpoint):
    """The stop waits until the books are the checkpoint's (or a fresh run's), and the summary counts them so: a
    resume from that checkpoint loses nothing, though the learner saved nothing at the stop. The summary named the
    dead learner's exit, from the restart's stop, as how it ended at the user's, when no role ran; a restart from no
    checkpoint, which loses nothing either, was said to lose what it had trained."""
    summary, stops = stopped_during_the_restart(tmp_path, monkeypatch, checkpoint)
    assert summary["stopped"] == "SIGINT"
    assert summary["steps"] == summary["steps_trained"] == (4 if checkpoint else 0)
    assert summary["resume_loses_nothing"] is True and "saved_at_stop" not in summary
    checkpoints = tmp_path / "runs" / "async-ppo-math" / "t" / "checkpoints"
    assert summary["resume_from"] == (str(checkpoints / "step_4") if checkpoint else None)
    if checkpoint:
        assert summary["prompts"] == {"admitted": 8, "trained": 4, "in_flight": 0, "failed": {"env_error": 1},
                                      "filtered": {"uniform_reward": 2, "run_ended": 1}}
    else:
        assert summary["prompts"] == {"admitted": 0, "trained": 0, "in_flight": 0, "failed": {}, "filtered": {}}
    assert summary["unclean_exits"] == {}  # no role ran at the stop
    assert summary["restarts"] == {"learner0": 1}
    assert stops == 2  # the restart's, and its part's end: none as the books were set
    err = capsys.readouterr().err
    assert "did not save at the stop" not in err
    # the console says how to go on, as a failed run's does
    assert f"continue it with --config {checkpoints.parent / 'config.yaml'} resume_from_checkpoint=auto" in err


@pytest.mark.parametrize("checkpoint", [True, False])
@pytest.mark.parametrize("moment", ["stop", "resume"])
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_as_a_restart_stops_the_roles_or_finds_the_checkpoint_counts_the_dead_parts_books(
        tmp_path, monkeypatch, capsys, checkpoint, moment, signum):
    """Before the books are reset, they are the dead part's: prompts admitted past the checkpoint, and weights the
    learner published after it, which it did not save at the stop. The summary counts them so, says a resume loses
    them, and names the dead learner's exit, which the stop reported. The roles are stopped twice (the restart's stop,
    then the part's end); the supervisor's second stop waits only what is left of the first's grace
    (tests/test_supervisor_stop.py)."""
    summary, stops = stopped_during_the_restart(tmp_path, monkeypatch, checkpoint, moment, signum)
    assert summary["stopped"] == signal.Signals(signum).name
    assert (summary["steps"], summary["steps_trained"]) == ((4, 6) if checkpoint else (0, 6))
    assert summary["resume_loses_nothing"] is False and "saved_at_stop" not in summary
    checkpoints = tmp_path / "runs" / "async-ppo-math" / "t" / "checkpoints"
    assert summary["resume_from"] == (str(checkpoints / "step_4") if checkpoint else None)
    if checkpoint:  # p8 from the checkpoint's books, p9 to p11 the dead part's, in flight: ended with the run
        assert summary["prompts"] == {"admitted": 11, "trained": 4, "in_flight": 0, "failed": {"env_error": 1},
                                      "filtered": {"uniform_reward": 2, "run_ended": 4}}
    else:
        assert summary["prompts"] == {"admitted": 3, "trained": 0, "in_flight": 0, "failed": {},
                                      "filtered": {"run_ended": 3}}
    assert summary["prompts_accounted"] is True
    assert summary["unclean_exits"] == {"learner0": "exited with code -9 (SIGKILL)"}
    assert summary["restarts"] == {"learner0": 1}
    assert stops == 2
    err = capsys.readouterr().err
    assert "the learner did not save at the stop" in err
    lost = "from " + (f"{checkpoints / 'step_4'} (step 4), 2 steps" if checkpoint else
                      "the beginning (no checkpoint was saved), 6 steps")
    assert f"a resume goes on {lost} trained after it are lost" in err


@pytest.mark.parametrize("moment", ["stop", "resume", "restoring", "restored"])
@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_stop_before_or_amid_a_restarts_restore_names_the_checkpoint_the_next_start_resumes_whole(
        tmp_path, monkeypatch, capsys, moment, signum):
    """The learner died between its save's renames as it saved the checkpoint it resumed from again, and the signal
    came before the restart put the old copy back (restore_replaced), or amid it: just before its rename, or just
    after. The summary names the checkpoint the next start resumes from, whole, and says a resume loses nothing (the
    learner trained nothing past it). It read the checkpoints as they were: with the copy not yet back, it named none,
    and said a resume goes on from the beginning and loses 4 steps, while the next start resumed from that copy."""
    summary, stops = stopped_during_the_restart(tmp_path, monkeypatch, True, moment, signum, resaving=True)
    checkpoint = tmp_path / "runs" / "async-ppo-math" / "t" / "checkpoints" / "step_4"
    assert summary["stopped"] == signal.Signals(signum).name
    assert summary["resume_from"] == str(checkpoint)
    assert (checkpoint / SHARDED_STATE / ".metadata").read_text() == "step 4's index"  # the old copy, whole
    assert summary["steps"] == summary["steps_trained"] == 4
    assert summary["resume_loses_nothing"] is True
    assert summary["prompts"] == {"admitted": 8, "trained": 4, "in_flight": 0, "failed": {"env_error": 1},
                                  "filtered": {"uniform_reward": 2, "run_ended": 1}}
    assert stops == 2
    assert "did not save at the stop" not in capsys.readouterr().err

    monkeypatch.setattr("rlsys.launcher.Supervisor", lambda config, start_role, server=None: RunsToItsEnd(config, None))
    config = launch_config(tmp_path)
    resumed = launcher.launch(config)
    assert config.resume_from_checkpoint == summary["resume_from"]
    assert resumed["resumed"]["step"] == 4 and resumed["steps"] == config.max_steps


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_learner_killed_as_it_saves_again_at_the_stop_leaves_the_summary_naming_the_old_copy_put_back(
        tmp_path, monkeypatch, capsys, signum):
    """The learner was killed at the stop between the renames of its save of the checkpoint it resumed from: the old
    copy, whole, is where the next start goes on, and a resume from it loses nothing. The summary named no checkpoint
    (the copy was step_4.old), and said a resume goes on from the beginning."""
    run_dir = tmp_path / "runs" / "async-ppo-math" / "t"
    saved_at_step_4(run_dir)
    monkeypatch.setattr("rlsys.launcher.prepare", lambda config: 0.0)  # no assets: no role runs
    monkeypatch.setattr("rlsys.launcher.Supervisor", lambda config, start_role, server=None: KilledAsItSavesAtTheStop(
        config, signum))
    with pytest.raises((KeyboardInterrupt, SystemExit)):
        launcher.launch(launch_config(tmp_path))
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["stopped"] == signal.Signals(signum).name
    assert summary["resume_from"] == str(run_dir / "checkpoints" / "step_4")
    assert (run_dir / "checkpoints" / "step_4" / SHARDED_STATE / ".metadata").read_text() == "step 4's index"
    assert summary["steps"] == summary["steps_trained"] == 4 and summary["resume_loses_nothing"] is True
    assert summary["unclean_exits"] == {"learner0": "was still running 1 s after the stop, and was killed"}
