"""The errors raised in every layer: a wrong setting, an episode that failed, a run that cannot go on. They live at
the bottom, so that no module has to import the command line, a worker or the supervisor (or anything above
itself) to raise or catch one."""


class ConfigError(ValueError):
    """The command line or a config file is wrong; the message says which key and why."""


class RoleFailed(RuntimeError):
    """A role process died and could not be restarted, or the run stood still; the run cannot go on."""


class RunCannotGoOn(RuntimeError):
    """Raised in a role that found the run cannot go on; the message says why and what to fix."""


class LearnerFailed(RoleFailed):
    """The learner died: the run can only go on from its last checkpoint."""


class EpisodeFailed(Exception):
    """An episode that produced nothing trainable; `reason` is one of rlsys.prompt_ledger.FAILURE_REASONS. Environments'
    calls raise it through rlsys.workers.episode_failure's guard, and agents may raise it themselves."""

    def __init__(self, reason: str, detail: str):
        super().__init__(f"{reason}: {detail}")
        self.reason, self.detail = reason, detail
