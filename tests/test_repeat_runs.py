"""bench/repeat_runs.py's reading of a run with one role killed: the kill's own reports are not crashes."""

from bench.repeat_runs import CRASH, planned_kill, without_reports_of

RAY_REPORT = ("(raylet) A worker died or was killed while executing a task by an unexpected system error. ... (3) the "
              "worker crashed unexpectedly due to SIGSEGV or another unexpected error.")


def test_the_killed_roles_reports_are_left_out_and_any_other_death_still_counts():
    console = "\n".join([RAY_REPORT, "learner0 died: The actor died unexpectedly before finishing this task.",
                         "restarting every role from the start (no checkpoint was saved yet)"])
    assert CRASH.findall(console)  # as it was read before: a killed role looked like a crash
    assert CRASH.findall(without_reports_of("learner0", console)) == []
    second = console + "\n" + RAY_REPORT + "\nrollout0 died: The actor died unexpectedly before finishing this task."
    assert set(CRASH.findall(without_reports_of("learner0", second))) == {"SIGSEGV", "died unexpectedly"}


def test_the_kill_is_drawn_from_the_seed_among_every_role_and_step():
    settings = ["cluster.backend=ray", "cluster.n_learner_ranks=2", "max_steps=20"]
    kills = [planned_kill(seed, run, settings) for seed in range(20) for run in range(1, 6)]
    assert {k.role for k in kills} == {"inference0", "rollout0", "learner0", "learner1"}
    assert all(2 <= k.step <= 18 for k in kills)
    assert kills == [planned_kill(seed, run, settings) for seed in range(20) for run in range(1, 6)]  # the same again
