"""A run stopped by a signal as a learner's restart resets the books: its summary, from the launcher's own loop over
a real embedded Redis, with a supervisor that starts no process (a whole run, with its learner killed and the
signal timed to the reset, would take minutes and could not choose its moment)."""

import collections
import json
import os
import signal
from pathlib import Path

import pytest

from rlsys import launcher, protocol
from rlsys.checkpoint import TRAINER_STATE
from rlsys.cli import parse_config
from rlsys.errors import LearnerFailed
from rlsys.prompt_ledger import PromptLedger

BOOKS = {"admitted": 8, "trained": 4, "filtered": {"uniform_reward": 2}, "failed": {"env_error": 1}, "in_flight": 1,
         "in_flight_prompts": ["p8"], "failed_prompts": {"p7": "env_error"}}  # step 4's checkpoint's


class LearnerDiesOnce:
    """A supervisor whose first part's learner dies once it trained past the checkpoint: published version 6, and
    admitted prompts the checkpoint does not hold. Its stop reports that learner's death, as the real one's does."""

    def __init__(self, config, start_role, server=None):
        self.config, self.restarts = config, collections.Counter()

    def start(self) -> None:
        pass

    def watch(self, bus, report) -> None:
        bus.set(protocol.WEIGHTS, {"version": 6})
        ledger = PromptLedger.of(bus, self.config)
        for prompt in ("p9", "p10", "p11"):
            ledger.admit(prompt, 6)
        self.restarts["learner0"] += 1
        raise LearnerFailed("learner0 exited with code -9 (SIGKILL)")

    def stop(self, bus) -> dict[str, str]:
        return {"learner0": "exited with code -9 (SIGKILL)"}

    def kill(self) -> dict[str, str]:
        return self.stop(None)


def stopped_during_the_restarts_reset(tmp_path: Path, monkeypatch, checkpoint: bool) -> dict:
    """The launcher's summary of a run whose learner died, and which got a Ctrl-C as the restart set the books."""
    run_dir = tmp_path / "runs" / "async-ppo-math" / "t"
    if checkpoint:
        state = {"step": 4, "version": 4, "saved_at": 1.0, "consumed_prompts": ["p1", "p2"], "accounting": BOOKS}
        (run_dir / "checkpoints" / "step_4").mkdir(parents=True)
        (run_dir / "checkpoints" / "step_4" / TRAINER_STATE).write_text(json.dumps(state))
    real_initialize = launcher.initialize_bus_state

    def signalled_amid_the_reset(bus, config, trainer_state, keep_initial_eval=False):
        if keep_initial_eval:  # the restart's
            os.kill(os.getpid(), signal.SIGINT)
        real_initialize(bus, config, trainer_state, keep_initial_eval)

    monkeypatch.setattr("rlsys.launcher.prepare", lambda config: 0.0)  # no assets: no role runs
    monkeypatch.setattr("rlsys.launcher.Supervisor", LearnerDiesOnce)
    monkeypatch.setattr("rlsys.launcher.initialize_bus_state", signalled_amid_the_reset)
    config = parse_config([f"output_dir={tmp_path / 'runs'}", f"model.cache_dir={tmp_path / 'cache'}", "trial_name=t",
                           "resume_from_checkpoint=auto", "cluster.redis_port=0", "model.path=/nonexistent/model"])
    with pytest.raises(KeyboardInterrupt):
        launcher.launch(config)
    return json.loads((run_dir / "summary.json").read_text())


@pytest.mark.parametrize("checkpoint", [True, False])
def test_a_stop_as_a_restart_resets_the_books_leaves_the_checkpoints_run(tmp_path, monkeypatch, capsys, checkpoint):
    """The stop waits until the books are the checkpoint's (or a fresh run's), and the summary counts them so: a
    resume from that checkpoint loses nothing, though the learner saved nothing at the stop. The summary named the
    dead learner's exit, from the restart's stop, as how it ended at the user's, when no role ran; a restart from no
    checkpoint, which loses nothing either, was said to lose what it had trained."""
    summary = stopped_during_the_restarts_reset(tmp_path, monkeypatch, checkpoint)
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
    assert "did not save at the stop" not in capsys.readouterr().err
