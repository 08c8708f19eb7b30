"""How a role's end shares the stop's grace (`cluster.stop_grace_seconds`).

A stop kills every role still running `grace` s after it told them to stop, and counts it an unclean exit
(rlsys/supervisor.py). A rollout worker's end waits, each a while at most, for what a plugin left: the episodes it
cancels (rlsys/workers/rollout_worker.py), the tasks still there as its event loop ends, once cancelled and once
closed (rlsys/cancellation.py, run_to_the_end), and the threads its process's exit would join
(rlsys/placement/process_end.py). Fixed waits of 2 s and 5 s after half the grace outlasted a grace under 14 s: the
stop killed a worker that had ended its part. As shares they fit any grace, and leave the rest (15%) for its records
and its process's exit. At the default 20 s: 10 s, 1 s twice, 5 s.
"""

CANCEL_SHARE = 0.5  # the episodes cancelled at the end of training
LOOP_END_SHARE = 0.05  # each of the event loop's two waits for the tasks left as it ends
THREADS_END_SHARE = 0.25  # the process's wait for its threads
