"""Trajectory delivery from rollout workers to the learner: at least once, and consumed exactly once.

A rollout worker appends one message per prompt, `{"group_id", "trajectories"}`, to the TRAJECTORIES
stream, labelled with its group id (Bus.stream_add's label, stored beside the payload); it checks the message first
(`group_message`), so it never sends what the learner would refuse.
The learner reads the stream through the LEARNERS consumer group (`TrajectoryInbox`). An entry stays
pending, and in the stream, until the learner acknowledges it, which deletes it:
  * a group it trained: after the step that trained it, once the optimizer update is done, the new
    weights are published, the group is counted as trained, and the step's checkpoint (if it saves one)
    is written;
  * a group it filtered, a duplicate, or a message it set aside: as soon as it has decided.
Nothing else ever removes an entry, so the stream is never trimmed below what is unacknowledged. A
learner that dies leaves its entries pending; a learner claims every pending entry when it starts (a run has one
learner, so at that moment every pending entry belongs to a dead one) and gets them again. Under the launcher it
finds none: a learner's death restarts every role from the last checkpoint, and the launcher deletes the stream
first (rlsys/run_start.py, initialize_bus_state). An entry
handed to the learner by a bus server that then died before its reply went out is pending but never
arrived: after a server restart the learner claims every pending entry under a new consumer name, and
takes again those it does not hold. So it does when, with nothing to read, more entries are pending than it holds:
a connection that dropped while a read's reply was on its way (the client reads again) loses entries the same way.

Duplicates (a group delivered again, e.g. after a claim, or resent) are dropped by group id, against a
bounded window of recent ids. The window starts from the checkpoint's consumed prompts, so a resumed learner
still drops groups it trained before. A new group holding a trajectory id delivered before (an agent that
reuses ids) is no duplicate: it is set aside as below, and its prompt counted as failed.

A message the learner cannot use goes to the DEAD_LETTERS stream with its reason, and is acknowledged:
  * one over the size limit, undecodable, of the wrong shape, or with trajectories the learner cannot
    train on: at its first delivery, since checking the same bytes again gives the same answer;
  * one delivered MAX_DELIVERIES times without an acknowledgement: every consumer that took it died
    (say it crashes the learner), so it is set aside rather than taking the next one down. Taking entries back after
    a bus-server restart or a lost reply is no such delivery and leaves the count as it was. Under the launcher a
    learner's death deletes the stream (above), so a message that crashes the learner is never delivered again there,
    and the group made again for its prompt, if it crashes the learner too, stops the run once the learner has used up
    cluster.max_role_restarts. So MAX_DELIVERIES need not follow that setting.
If its group id is a prompt in flight, that prompt is counted as failed (rejected) and gives its
staleness-gate slot back, so the run neither stalls nor loses count. The group id is the payload's, or, where that
cannot be read (too large, undecodable), the entry's label: so a message set aside unread still names its prompt. A
label that is not the payload's group id is refused too (it would settle the wrong prompt when unread).
"""

import dataclasses
import logging
import operator
from collections.abc import Iterable

from rlsys import protocol
from rlsys.api import NOT_GENERATED, Trajectory
from rlsys.api.messages import INT32_MAX, InvalidMessage, boolean, integer, integers, items, logprobs, number, reward, \
    string, versions
from rlsys.bus import BusDecodeError, BusEncodeError, ServerRestarts, StreamEntry
from rlsys.bus.base import encode
from rlsys.prompt_ledger import failed

log = logging.getLogger(__name__)

MAX_DELIVERIES = 3
DEDUP_WINDOW = 100_000  # recent group and trajectory ids: thousands of steps of groups, a few MB
DEAD_LETTER_PAYLOAD_BYTES = 64 * 1024  # a dead letter keeps the start of the payload, for inspection
CLAIM_PAGE = 1000


def agent_output(trajectories) -> list[Trajectory]:
    """What an agent's collect_trajectory returned, if it is a non-empty list of Trajectory (an episode with none has
    no reward, nothing to train on or score); else InvalidMessage."""
    if not isinstance(trajectories, list) or not all(isinstance(t, Trajectory) for t in trajectories):
        raise InvalidMessage(f"collect_trajectory must return a list of Trajectory, got {_type_names(trajectories)}")
    if not trajectories:
        raise InvalidMessage("collect_trajectory must return a non-empty list of Trajectory, got an empty list")
    return trajectories


def group_message(group_id: str, trajectories: list[Trajectory], max_bytes: int) -> dict:
    """The message for one prompt's trajectories, checked as the learner will check it."""
    agent_output(trajectories)
    message = {"group_id": group_id, "trajectories": [t.to_dict() for t in trajectories]}
    try:
        size = len(encode(message, f"stream {protocol.TRAJECTORIES}"))
    except BusEncodeError as e:  # e.g. a numpy number for a reward or among an agent's metrics
        raise InvalidMessage(str(e)) from None
    if size > max_bytes:
        raise InvalidMessage(_too_large(size, max_bytes))
    read_group_message(message)
    return message


def read_group_message(message, vocab_size: int | None = None) -> tuple[str, list[Trajectory]]:
    """(group id, trajectories) of a decoded message; InvalidMessage says what is wrong with it."""
    group_id = message.get("group_id") if isinstance(message, dict) else None
    if not isinstance(group_id, str) or not group_id:
        shape = f"group_id {group_id!r:.80}" if isinstance(message, dict) else type(message).__name__
        raise InvalidMessage(f"expected a map with a non-empty string group_id, got {shape}")
    if set(message) != {"group_id", "trajectories"}:
        raise InvalidMessage(f"group {group_id}: expected keys ['group_id', 'trajectories'], "
                             f"got {sorted(map(str, message))}", group_id)
    trajectories = message["trajectories"]
    if not isinstance(trajectories, list) or not trajectories:
        raise InvalidMessage(f"group {group_id}: trajectories must be a non-empty list, got {trajectories!r:.80}",
                             group_id)
    checked = [_trajectory(d, group_id, i, vocab_size) for i, d in enumerate(trajectories)]
    if len({t.traj_id for t in checked}) < len(checked):
        raise InvalidMessage(f"group {group_id}: the same trajectory id appears twice", group_id)
    return group_id, checked


def _trajectory(d, group_id: str, index: int, vocab_size: int | None) -> Trajectory:
    where = f"group {group_id} trajectory {index}"
    if not isinstance(d, dict):
        raise InvalidMessage(f"{where}: expected a map, got {type(d).__name__}", group_id)
    try:
        t = Trajectory.from_dict(d)
    except (TypeError, ValueError) as e:
        raise InvalidMessage(f"{where}: {e}", group_id) from None
    try:
        _check_trajectory(t, vocab_size)
    except InvalidMessage as e:
        raise InvalidMessage(f"{where}: {e}", group_id) from None
    if t.group_id != group_id:  # the learner's advantages pool trajectories by their own group_id
        raise InvalidMessage(f"{where}: group_id {t.group_id!r:.80} is not its prompt's id {group_id!r}: each "
                             "trajectory carries the id of the prompt it answers (prompt.qid)", group_id)
    return t


def _check_trajectory(t: Trajectory, vocab_size: int | None) -> None:
    """Refuses what would make the learner fail or train on garbage: wrong types, NaN, numbers that overflow
    the batch's int64/float32 tensors, impossible log-probabilities and rewards, tokens outside the vocabulary."""
    vocabulary = f" (vocabulary of {vocab_size})" if vocab_size else ""
    max_token = (vocab_size or INT32_MAX + 1) - 1
    integers(t.token_ids, "token_ids", high=max_token, note=vocabulary)
    integers(t.loss_mask, "loss_mask", high=1)
    logprobs(t.logprobs, "logprobs")
    versions(t.versions, "versions")
    # a turn's reward sits on its last token, which is predicted from the one before: ends from 2 on
    items(t.turn_ends, "turn_ends", lambda x, where: integer(x, where, low=2, high=len(t.token_ids)))
    items(t.turn_rewards, "turn_rewards", reward)
    items(t.turn_obs_keys, "turn_obs_keys", lambda x, where: string(x, where, empty=True))
    if not any(t.loss_mask[1:]):  # the first token is never predicted, so never trained
        raise InvalidMessage("has no generated token after the first: nothing to train on")
    # A trained token the model did not generate (no version) has no staleness: the age bound would pass it unseen,
    # and a batch of only such tokens would fail the learner's statistics, again at each redelivery.
    unversioned = list(map(operator.and_, t.loss_mask, map(NOT_GENERATED.__eq__, t.versions)))
    if any(unversioned):
        raise InvalidMessage(f"token {unversioned.index(True)} is trained (loss_mask 1) but has no version "
                             f"({NOT_GENERATED}): a trained token carries the weight version that generated it")
    t.reward = reward(t.reward, "reward")
    boolean(t.void, "void")
    for name in ("group_id", "stop_reason", "traj_id"):
        string(getattr(t, name), name, empty=True)
    if not isinstance(t.metrics, dict):
        raise InvalidMessage(f"metrics must map names to finite numbers, got {type(t.metrics).__name__}")
    for name, value in t.metrics.items():
        number(value, f"metrics[{string(name, 'a metric name')!r}]")


def _type_names(value) -> str:
    if isinstance(value, list):
        return f"a list of {sorted({type(v).__name__ for v in value})}"
    return type(value).__name__


def _too_large(size: int, max_bytes: int) -> str:
    return (f"message of {size / 2**20:.1f} MiB exceeds the limit of {max_bytes / 2**20:.1f} MiB "
            f"(cluster.max_message_mb)")


@dataclasses.dataclass
class Delivery:
    """One prompt's group, taken from the stream and not yet acknowledged."""

    entry_id: str
    group_id: str
    trajectories: list[Trajectory]


class RecentIds:
    """The last `capacity` ids seen, oldest forgotten first."""

    def __init__(self, capacity: int, ids: Iterable[str] = ()):
        self.capacity = capacity
        self._ids: dict[str, None] = {}  # insertion-ordered: the first key is the oldest
        for i in ids:
            self.add(i)

    def __contains__(self, item: str) -> bool:
        return item in self._ids

    def add(self, item: str) -> None:
        self._ids[item] = None
        if len(self._ids) > self.capacity:
            del self._ids[next(iter(self._ids))]


class TrajectoryInbox:
    """The learner's end of the trajectory stream: valid, new groups only; the rest dropped or set aside."""

    def __init__(self, bus, ledger, consumer: str, max_message_bytes: int, vocab_size: int | None = None,
                 consumed: Iterable[str] = ()):
        self.bus, self.ledger, self.name, self.consumer = bus, ledger, consumer, consumer
        self.max_message_bytes, self.vocab_size = max_message_bytes, vocab_size
        self.seen = RecentIds(DEDUP_WINDOW, list(consumed)[-DEDUP_WINDOW:])
        self.duplicates = self.dead_letters = 0
        self.held: set[str] = set()  # entry ids handed out and not yet acknowledged
        self.server_restarts = ServerRestarts(bus)
        self.takebacks = 0  # consumer names taken to take lost entries back: each must be new
        self.orphans = self._claim_pending()
        if self.orphans:
            log.info("took over %d trajectory messages a previous learner left unacknowledged", len(self.orphans))

    def _claim_pending(self, counted: bool = True) -> list[StreamEntry]:
        """Every entry pending for another consumer name, now this one's; `counted` as in Bus.stream_claim."""
        claimed = []
        while page := self.bus.stream_claim(protocol.TRAJECTORIES, protocol.LEARNERS, self.consumer, 0, CLAIM_PAGE,
                                            self.max_message_bytes, counted):
            claimed += page
        return claimed

    def _take_back_lost_entries(self, why: str) -> None:
        self.takebacks += 1  # a claim takes only what other consumer names hold
        self.consumer = f"{self.name}@{self.server_restarts.server}.{self.takebacks}"
        # not counted: a restart or a lost reply kept them from this learner, which did not fail on them
        lost = [entry for entry in self._claim_pending(counted=False) if entry.id not in self.held]
        if lost:
            log.warning("%s; %d trajectory messages the bus server had handed out never arrived: taking them again",
                        why, len(lost))
        # every pending entry not held, so the orphans not taken yet too: added to them, those would come twice
        self.orphans = lost

    def receive(self, max_count: int, timeout: float, unless: str | None = None) -> list[Delivery] | None:
        """Up to `max_count` new groups (waiting up to `timeout` s for the first entry); each must be acked. None, and
        nothing read, when the key `unless` (the learner's STOP) holds a true value: that key is read with the server's
        id, which the inbox asks before each read (a restart may have lost entries it handed out), in one round trip."""
        restarted, stop = self.server_restarts.happened_reading([unless] if unless else [])
        if restarted:  # taken back even when stopping: each restart is seen once, and must be acted on
            self._take_back_lost_entries("the bus server restarted")
        if any(stop):
            return None
        if self.orphans:
            entries, self.orphans = self.orphans[:max_count], self.orphans[max_count:]
        else:
            entries = self.bus.stream_read(protocol.TRAJECTORIES, protocol.LEARNERS, self.consumer, max_count, timeout,
                                           self.max_message_bytes)
            # checked when idle, where a round trip costs nothing: every pending entry is held or queued otherwise
            if not entries and self.bus.stream_pending(protocol.TRAJECTORIES, protocol.LEARNERS) > len(self.held):
                self._take_back_lost_entries("a read's reply never arrived")
        return [d for d in map(self._accept, entries) if d is not None]

    def ack(self, entry_ids: list[str]) -> None:
        self.bus.stream_ack(protocol.TRAJECTORIES, protocol.LEARNERS, entry_ids)
        self.held.difference_update(entry_ids)

    def _accept(self, entry: StreamEntry) -> Delivery | None:
        try:
            group_id, trajectories = self._parse(entry)
        except InvalidMessage as e:
            self._dead_letter(entry, str(e), e.group_id or entry.label or None)
            return None
        if entry.deliveries > MAX_DELIVERIES:
            self._dead_letter(entry, f"delivered {entry.deliveries} times without an acknowledgement", group_id)
            return None
        if group_id in self.seen:
            self.duplicates += 1
            log.warning("dropped a duplicate of group %s (stream entry %s)", group_id, entry.id)
            self.ack([entry.id])
            return None
        reused = next((t.traj_id for t in trajectories if t.traj_id in self.seen), None)
        if reused is not None:  # another prompt's trajectory (an agent that reuses ids): its own prompt fails
            self._dead_letter(entry, f"trajectory id {reused!r:.80} was delivered before, in another group; "
                                     "trajectory ids must be unique across the run", group_id)
            return None
        for i in [group_id, *(t.traj_id for t in trajectories)]:
            self.seen.add(i)
        self.held.add(entry.id)
        return Delivery(entry.id, group_id, trajectories)

    def _parse(self, entry: StreamEntry) -> tuple[str, list[Trajectory]]:
        if entry.size > self.max_message_bytes:  # a stream over the limit was measured, not fetched
            raise InvalidMessage(_too_large(entry.size, self.max_message_bytes))
        try:
            message = entry.decode(protocol.TRAJECTORIES)
        except BusDecodeError as e:
            raise InvalidMessage(str(e)) from None
        group_id, trajectories = read_group_message(message, self.vocab_size)
        if entry.label and entry.label != group_id:
            raise InvalidMessage(f"group {group_id}: the entry is labelled {entry.label!r:.80}, not with its group id",
                                 group_id)
        return group_id, trajectories

    def _dead_letter(self, entry: StreamEntry, reason: str, group_id: str | None) -> None:
        """Keeps the reason and the payload's start in DEAD_LETTERS, acks the entry, settles its prompt."""
        self.bus.stream_add(protocol.DEAD_LETTERS, {
            "reason": reason, "entry_id": entry.id, "deliveries": entry.deliveries, "group_id": group_id,
            "size": entry.size, "payload": entry.payload[:DEAD_LETTER_PAYLOAD_BYTES]})
        self.ack([entry.id])
        self.dead_letters += 1
        if group_id is not None:
            self.seen.add(group_id)  # a copy arriving later is a duplicate of a prompt that has its outcome
            self.ledger.untrained(group_id, failed("rejected"))
        log.warning("trajectory message %s%s set aside in %s: %s", entry.id,
                    f" (group {group_id})" if group_id else "", protocol.DEAD_LETTERS, reason)
