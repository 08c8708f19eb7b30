"""What an episode waits on, for telling an agent that waits on the model or its environment from one stuck on
something of its own.

A queue agent that awaits `act_queue.get()` with no request put (a second get after one reply, a plugin author's
slip) waits for ever, and before this its episode held a held-out evaluation or a gate slot until the run was
stopped by hand. An episode is idle while no request of its agent is outstanding (waiting in its obs_queue, in the
router's hands or unanswered by the model, or a reply unread in its act_queue) and no environment call of it runs
(those have their own limit, env_timeout). Idle for `agent_stuck_after` seconds, it fails as `agent_stuck`, with
where its agent waits; idle while the episode's own task awaits `act_queue.get()`, nothing can ever answer, and it
fails after DEADLOCK_GRACE seconds.
"""

import asyncio
import time

DEADLOCK_GRACE = 2.0  # seconds an agent may await a reply it never asked for (its own task may yet put one)
WATCH_INTERVAL = 1.0  # most seconds between looks at an episode (a worker runs hundreds: each look costs its core)


class ActQueue(asyncio.Queue):
    """An episode's act_queue, which knows the tasks awaiting its `get`: the episode's own task awaiting it while
    nothing is outstanding is the deadlock (a task the agent started to read replies, rlsys/api/model.py's, awaits
    it all the time, and is not)."""

    def __init__(self):
        super().__init__()
        self.getters: set[asyncio.Task] = set()

    async def get(self):
        task = asyncio.current_task()
        self.getters.add(task)
        try:
            return await super().get()
        finally:
            self.getters.discard(task)


class EpisodeActivity:
    """One episode's requests in the router's hands and environment calls running; the router and the guarded
    environment (rlsys/workers/episode_failure.py) count them. `moves` counts every change, so a watcher that looks
    now and then sees an episode that asked and was answered between two looks as busy."""

    def __init__(self):
        self.requests = 0  # taken from the obs_queue and not yet answered into the act_queue
        self.env_calls = 0
        self.moves = 0

    def count_request(self, change: int) -> None:
        self.requests += change
        self.moves += 1

    def count_env_call(self, change: int) -> None:
        self.env_calls += change
        self.moves += 1

    def idle(self, obs_queue: asyncio.Queue, act_queue: asyncio.Queue) -> bool:
        return not (self.requests or self.env_calls or obs_queue.qsize() or act_queue.qsize())


async def stuck_for(playing: asyncio.Task, activity: EpisodeActivity, obs_queue: asyncio.Queue,
                    act_queue: asyncio.Queue, limit: float) -> str:
    """Returns (with what the episode was stuck on) once it has been idle for `limit` seconds, or for DEADLOCK_GRACE
    while its task (`playing`) awaits `act_queue.get()`."""
    idle_since, moves = None, activity.moves
    while True:
        await asyncio.sleep(min(WATCH_INTERVAL, limit / 4))
        if activity.moves != moves or not activity.idle(obs_queue, act_queue):
            idle_since, moves = None, activity.moves
            continue
        now = time.monotonic()
        idle_since = now if idle_since is None else idle_since
        if playing in getattr(act_queue, "getters", ()) and now - idle_since >= min(limit, DEADLOCK_GRACE):
            return "awaits act_queue.get() with no request put to obs_queue and no reply to come"
        if now - idle_since >= limit:
            return (f"ran {limit:g}s (agent_stuck_after) with no model request outstanding and no environment call "
                    f"running")


def awaiting_at(task: asyncio.Task) -> list[str]:
    """Where `task` waits: each coroutine of the chain it awaits through, outermost first, as `file:line in name`
    (a task's own stack shows only its outermost frame while it is suspended), down to a future or another task."""
    where, awaited = [], task.get_coro()
    while (frame := getattr(awaited, "cr_frame", None) or getattr(awaited, "gi_frame", None)) is not None:
        where.append(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        awaited = getattr(awaited, "cr_await", None) or getattr(awaited, "gi_yieldfrom", None)
    return where
