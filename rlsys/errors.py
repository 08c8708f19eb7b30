"""The errors that end a run, raised in every layer and caught by the launcher: at the bottom, so that no module
has to import the supervisor (or anything above itself) to raise one."""


class RoleFailed(RuntimeError):
    """A role process died and could not be restarted, or the run stood still; the run cannot go on."""


class RunCannotGoOn(RuntimeError):
    """Raised in a role that found the run cannot go on; the message says why and what to fix."""


class LearnerFailed(RoleFailed):
    """The learner died: the run can only go on from its last checkpoint."""
