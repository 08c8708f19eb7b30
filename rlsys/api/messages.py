"""What crosses the bus between roles, typed and checked: every reader validates a message before using it.

A message is a msgpack value another process wrote: an older version, a buggy plugin or a hostile local
user may have written it. `parse_*` returns a typed value or raises InvalidMessage with the field and what
is wrong, so the reader can set the message aside (a dead letter) and go on. The same checks run on the
writer's side where it builds a message, so a role never sends what its peer would refuse.

Bounds keep the numbers usable downstream: integers fit in int32 (token ids, versions, counts: the batch
code stores them in int64 tensors and adds them), floats are finite and within float32's range (1e300 is a
finite Python float but inf in a float32 tensor). Some numbers have a range of their own: a log-probability
is never above 0, and a reward is bounded, since one impossible value in a group turns the step's loss NaN.
The sampling settings' bounds (`generation_setting`) are the one definition every path to the model uses:
the endpoint's requests, `Model`, the router and the inference worker.
"""

import dataclasses
import math

from rlsys.api.generation import GenerationConfig, GenerationOutput

INT32_MAX = 2**31 - 1
FLOAT32_MAX = 3.4028234663852886e38
MAX_ID_CHARS = 256  # request, trajectory, group ids and queue names
MAX_PATH_CHARS = 4096
MAX_REASON_CHARS = 4096  # why a worker refused a request, in its engine's words
MAX_SAMPLES = 1024  # samples per generation request
MAX_SEQUENCE_TOKENS = 1_000_000
MAX_STOP_TOKEN_IDS = 4096  # extra stop tokens per request
MAX_TEMPERATURE = 1e6
MAX_SEED = 2**63 - 1  # seeds go to the engines' int64 generators; msgpack carries no integer of 2**64 or more
LOGPROB_TOLERANCE = 1e-3  # a log-probability is at most 0; an engine's float rounding may put it a hair above
MAX_REWARD = 1e6  # |reward|: far past any sensible scale, and a batch's sum of squares stays finite in float32


class InvalidMessage(ValueError):
    """A bus message a role cannot use; the text says why, `group_id` whose it is if known."""

    def __init__(self, reason: str, group_id: str | None = None):
        super().__init__(reason)
        self.group_id = group_id


def integer(value, where: str, low: int = 0, high: int = INT32_MAX) -> int:
    if type(value) is not int or not low <= value <= high:
        raise InvalidMessage(f"{where} must be an integer in [{low}, {high}], got {_short(value)}")
    return value


def number(value, where: str, low: float = -FLOAT32_MAX, high: float = FLOAT32_MAX) -> float:
    """A finite int or float in [low, high] (within float32's range by default)."""
    if type(value) not in (int, float) or not math.isfinite(value) or not low <= value <= high:
        raise InvalidMessage(f"{where} must be a finite number in [{low:g}, {high:g}], got {_short(value)}")
    return value


def boolean(value, where: str) -> bool:
    if type(value) is not bool:
        raise InvalidMessage(f"{where} must be true or false, got {_short(value)}")
    return value


def string(value, where: str, max_chars: int = MAX_ID_CHARS, empty: bool = False) -> str:
    if not isinstance(value, str) or len(value) > max_chars or (not empty and not value):
        raise InvalidMessage(f"{where} must be a {'' if empty else 'non-empty '}string of at most {max_chars} "
                             f"characters, got {_short(value)}")
    return value


def items(value, where: str, check, max_items: int = MAX_SEQUENCE_TOKENS) -> list:
    """A list of at most `max_items`, each passed through `check(item, where_of_item)`."""
    if not isinstance(value, list) or len(value) > max_items:
        raise InvalidMessage(f"{where} must be a list of at most {max_items} items, got {_short(value)}")
    return [check(x, f"{where}[{i}]") for i, x in enumerate(value)]


def fields(message, where: str, required: set[str], optional: set[str] = frozenset()) -> dict:
    """`message` as a map with exactly the `required` keys and perhaps some `optional` ones."""
    if not isinstance(message, dict):
        raise InvalidMessage(f"{where} must be a map, got {type(message).__name__}")
    keys = set(message)
    if not required <= keys <= required | optional:
        raise InvalidMessage(f"{where}: expected keys {sorted(required)} (optional {sorted(optional)}), "
                             f"got {sorted(map(str, keys))[:20]}")
    return message


def _short(value) -> str:
    return f"{value!r:.60}" if isinstance(value, (int, float, str, bool, type(None))) else type(value).__name__


def integers(value, where: str, low: int = 0, high: int = INT32_MAX, max_items: int = MAX_SEQUENCE_TOKENS,
             note: str = "") -> list[int]:
    """A list of integers in [low, high], checked in one pass over the list (every token of every sequence is
    checked on the learner's side: per-item calls cost a quarter of its time on long answers); `items` finds the
    first bad one to say which, `note` added to its place."""
    if (isinstance(value, list) and len(value) <= max_items and all(type(x) is int for x in value)
            and (not value or (min(value) >= low and max(value) <= high))):
        return value
    return items(value, where, lambda x, at: integer(x, at + note, low, high), max_items)


def token_ids(value, where: str, max_items: int = MAX_SEQUENCE_TOKENS) -> list[int]:
    """A list of token ids (a prompt of thousands of tokens is checked on every request)."""
    return integers(value, where, max_items=max_items)


def logprobs(value, where: str) -> list[float]:
    """A list of log-probabilities, checked in one pass like `integers` (all floats, their sum finite, so each is)."""
    if (isinstance(value, list) and len(value) <= MAX_SEQUENCE_TOKENS and all(type(x) is float for x in value)
            and (not value or (math.isfinite(sum(value)) and max(value) <= LOGPROB_TOLERANCE
                               and min(value) >= -FLOAT32_MAX))):
        return value
    return items(value, where, logprob)


def logprob(x, where: str) -> float:
    """A log-probability: finite and at most 0 (LOGPROB_TOLERANCE above 0 for rounding)."""
    return number(x, where, high=LOGPROB_TOLERANCE)


def reward(x, where: str) -> float:
    """A reward: finite and at most MAX_REWARD either side of 0, as a float (a group whose rewards are all ints
    would otherwise make an integer tensor of them)."""
    return float(number(x, where, -MAX_REWARD, MAX_REWARD))


def versions(value, where: str) -> list[int]:
    """A list of weight versions, one a token; -1 tags tokens the model did not produce."""
    return integers(value, where, low=-1)


# ---- generation requests (router -> inference worker) and replies (inference worker -> router)

def _top_p(x, where: str) -> float:
    if type(x) not in (int, float) or not 0 < x <= 1:  # NaN fails the comparison too
        raise InvalidMessage(f"{where} must be a number in (0, 1], got {_short(x)}")
    return x


def _seed(x, where: str) -> int | None:
    return None if x is None else integer(x, where, 0, MAX_SEED)


_GENERATION_SETTINGS = {  # GenerationConfig field -> check(value, where)
    "n": lambda x, where: integer(x, where, 1, MAX_SAMPLES),
    "max_new_tokens": lambda x, where: integer(x, where, 1, MAX_SEQUENCE_TOKENS),
    "temperature": lambda x, where: number(x, where, 0.0, MAX_TEMPERATURE),
    "top_p": _top_p,
    "top_k": lambda x, where: integer(x, where, -1),
    "stop_token_ids": lambda x, where: token_ids(x, where, MAX_STOP_TOKEN_IDS),
    "seed": _seed,
}


def generation_setting(name: str, value, where: str):
    """`value` for GenerationConfig's field `name`, within the bounds every request to the model is held to."""
    return _GENERATION_SETTINGS[name](value, where)


def parse_generation_config(d, where: str = "gconfig") -> GenerationConfig:
    d = fields(d, where, set(), set(_GENERATION_SETTINGS))
    return GenerationConfig(**{name: generation_setting(name, value, f"{where}.{name}") for name, value in d.items()})


@dataclasses.dataclass(frozen=True)
class GenerationRequest:
    """One request for `gconfig.n` samples continuing `token_ids`; the reply goes to queue `reply_to`."""

    rid: str
    token_ids: list[int]
    gconfig: GenerationConfig
    reply_to: str

    def to_message(self) -> dict:
        return {"rid": self.rid, "token_ids": self.token_ids, "gconfig": self.gconfig.to_dict(),
                "reply_to": self.reply_to}


def parse_generation_request(message) -> GenerationRequest:
    d = fields(message, "generation request", {"rid", "token_ids", "gconfig", "reply_to"})
    request = GenerationRequest(string(d["rid"], "rid"), token_ids(d["token_ids"], "token_ids"),
                                parse_generation_config(d["gconfig"]), string(d["reply_to"], "reply_to"))
    if not request.token_ids:
        raise InvalidMessage(f"request {request.rid}: token_ids is empty")
    return request


@dataclasses.dataclass(frozen=True)
class GenerationAbort:
    """Sent after a request whose episode ended without its reply (failed or cancelled): nobody would take the reply,
    so the worker stops generating it. On the same queue as the request, so it never arrives first."""

    rid: str

    def to_message(self) -> dict:
        return {"abort": self.rid}


def parse_worker_request(message) -> GenerationRequest | GenerationAbort:
    """What a router puts on an inference worker's queue: a GenerationRequest, or a GenerationAbort."""
    if isinstance(message, dict) and "abort" in message:
        return GenerationAbort(string(fields(message, "generation abort", {"abort"})["abort"], "abort"))
    return parse_generation_request(message)


@dataclasses.dataclass
class GenerationReply:
    """An inference worker's answer to one GenerationRequest, under that request's id. The router hands it to the
    episode that asked as a GenerationOutput under the episode's own id (`output`): a request id (`rid`, unique
    across the run) never reaches an agent, an agent's id (`qid`, which agents may reuse) never crosses the bus."""

    rid: str
    prompt_ids: list[int]
    output_ids: list[list[int]]  # [sample][token], exactly the tokens the engine produced
    logprobs: list[list[float]]
    versions: list[list[int]]
    stop_reasons: list[str]

    def to_message(self) -> dict:
        return dataclasses.asdict(self)

    def output(self, qid: str) -> GenerationOutput:
        return GenerationOutput(qid, self.prompt_ids, self.output_ids, self.logprobs, self.versions,
                                self.stop_reasons)


def parse_generation_reply(message) -> GenerationReply:
    """A GenerationReply whose per-sample lists agree in length."""
    names = {f.name for f in dataclasses.fields(GenerationReply)}
    reply = GenerationReply(**fields(message, "generation reply", names))
    string(reply.rid, "rid")
    token_ids(reply.prompt_ids, "prompt_ids")
    samples = [items(getattr(reply, name), name, lambda x, w: x, MAX_SAMPLES)
               for name in ("output_ids", "logprobs", "versions", "stop_reasons")]
    if len({len(s) for s in samples}) != 1:
        raise InvalidMessage(f"reply {reply.rid}: output_ids, logprobs, versions and stop_reasons must have one "
                             f"entry per sample, got {[len(s) for s in samples]}")
    for i in range(len(reply.output_ids)):
        tokens = token_ids(reply.output_ids[i], f"output_ids[{i}]")
        for name, values in (("logprobs", logprobs(reply.logprobs[i], f"logprobs[{i}]")),
                             ("versions", versions(reply.versions[i], f"versions[{i}]"))):
            if len(values) != len(tokens):
                raise InvalidMessage(f"reply {reply.rid}: {name}[{i}] has {len(values)} entries for "
                                     f"{len(tokens)} tokens")
        string(reply.stop_reasons[i], f"stop_reasons[{i}]")
    return reply


@dataclasses.dataclass(frozen=True)
class GenerationRefusal:
    """An inference worker's answer to a request its engine would not take (a prompt longer than the model's
    context, a token outside its vocabulary): the episode that asked fails with `reason` instead of waiting."""

    rid: str
    refused: str  # why, in the engine's words

    def to_message(self) -> dict:
        return dataclasses.asdict(self)


def parse_reply(message) -> GenerationReply | GenerationRefusal:
    """What an inference worker sends to a reply queue: a GenerationReply, or a GenerationRefusal."""
    if isinstance(message, dict) and "refused" in message:
        d = fields(message, "generation refusal", {"rid", "refused"})
        return GenerationRefusal(string(d["rid"], "rid"), string(d["refused"], "refused", max_chars=MAX_REASON_CHARS))
    return parse_generation_reply(message)


# ---- inference and rollout workers' status (their heartbeats) and published weights

@dataclasses.dataclass(frozen=True)
class WorkerStatus:
    """What an inference worker publishes while it lives. `dead`: the launcher saw this epoch's process exit."""

    epoch: int  # incremented each time a process takes this index (a restart)
    beat: int  # a counter that keeps moving while the worker is alive
    version: int  # the weights it serves
    load: int  # requests in its engine
    dead: bool = False
    weights_streamed: int = 0  # versions this process fetched from the learner's weight server

    def to_message(self) -> dict:
        return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class RolloutRunning:
    """What a rollout worker publishes once a protocol.ROLLOUT_BEAT_INTERVAL for the stall watch (rlsys/stall.py): how
    many episodes (training and evaluation) its tasks run now, a beat new at each publication (so a count a blocked
    event loop left behind is told from one it keeps publishing), and whether it is still starting (until it trains)."""

    running: int
    beat: float
    starting: bool = False

    def to_message(self) -> dict:
        return {"running": self.running, "beat": self.beat, **({"starting": True} if self.starting else {})}


def parse_rollout_running(message) -> RolloutRunning:
    d = fields(message, "rollout worker's running count", {"running", "beat"}, {"starting"})
    return RolloutRunning(integer(d["running"], "running"), number(d["beat"], "beat"),
                          boolean(d.get("starting", False), "starting"))


WEIGHT_DTYPES = {"float32", "bfloat16", "float16"}  # what an engine may hold the weights in


def parse_worker_status(message) -> WorkerStatus:
    d = fields(message, "inference status", {"epoch", "beat", "version", "load"}, {"dead", "weights_streamed"})
    return WorkerStatus(integer(d["epoch"], "epoch"), integer(d["beat"], "beat"), integer(d["version"], "version"),
                        integer(d["load"], "load"), boolean(d.get("dead", False), "dead"),
                        integer(d.get("weights_streamed", 0), "weights_streamed"))


MAX_PROBE_SEQUENCES = 8  # sequences the learner sends with a version for the engine to score
MAX_PROBE_TOKENS = 4096  # tokens in each


@dataclasses.dataclass(frozen=True)
class PublishedWeights:
    """The newest policy the learner published: its version and where to get it, either the learner's weight
    server and the token it wants (weights_transport=stream: the server's reply carries the checksum) or the
    directory that holds it (disk) with the checksum of the weights an engine holding them in `dtype` must have
    (rlsys/weight_checksum.py); and the probe: sequences with the learner's own logprobs of each token after the
    first under an older version, `probe_version`, for an engine that holds that one to score before it loads this
    (rlsys/alarms.py)."""

    version: int
    path: str = ""
    address: str = ""
    token: str = ""
    checksum: str = ""
    dtype: str = ""
    probe_version: int = -1
    probe_ids: tuple[tuple[int, ...], ...] = ()
    probe_logprobs: tuple[tuple[float, ...], ...] = ()

    def to_message(self) -> dict:
        where = {"path": self.path} if self.path else {"address": self.address, "token": self.token}
        check = {"checksum": self.checksum, "dtype": self.dtype} if self.checksum else {}
        probe = ({"probe": {"version": self.probe_version, "token_ids": [list(ids) for ids in self.probe_ids],
                            "logprobs": [list(lps) for lps in self.probe_logprobs]}} if self.probe_ids else {})
        return {"version": self.version, **where, **check, **probe}


def _hex(x, where: str, digits: int) -> str:
    value = string(x, where, digits)
    if len(value) != digits or any(c not in "0123456789abcdef" for c in value):
        raise InvalidMessage(f"{where} must be {digits} hex digits, got {value!r}")
    return value


def parse_published_weights(message) -> PublishedWeights:
    d = fields(message, "published weights", {"version"}, {"path", "address", "token", "checksum", "dtype", "probe"})
    version = integer(d["version"], "version")
    check = {}
    if "checksum" in d or "dtype" in d:
        if not {"checksum", "dtype"} <= d.keys():
            raise InvalidMessage("published weights carry a checksum and its dtype together")
        dtype = string(d["dtype"], "dtype", 16)
        if dtype not in WEIGHT_DTYPES:
            raise InvalidMessage(f"dtype must be one of {sorted(WEIGHT_DTYPES)}, got {dtype!r}")
        check = {"checksum": _hex(d["checksum"], "checksum", 32), "dtype": dtype}
    if "probe" in d:
        check["probe_version"], check["probe_ids"], check["probe_logprobs"] = _probe(d["probe"], version)
    where = d.keys() - {"version", "checksum", "dtype", "probe"}
    if where == {"path"}:
        return PublishedWeights(version, path=string(d["path"], "path", MAX_PATH_CHARS), **check)
    if where == {"address", "token"}:
        return PublishedWeights(version, address=string(d["address"], "address", MAX_PATH_CHARS),
                                token=_hex(d["token"], "token", 32), **check)
    raise InvalidMessage("published weights need a path, or an address and a token, and not both")


def _probe(value, version: int) -> tuple[int, tuple, tuple]:
    d = fields(value, "probe", {"version", "token_ids", "logprobs"})
    probe_version = integer(d["version"], "probe version")
    if not 0 <= probe_version < version:
        raise InvalidMessage(f"a probe is of a version before the one published ({version}), got {probe_version}")
    ids = items(d["token_ids"], "probe token_ids", lambda x, where: tuple(token_ids(x, where, MAX_PROBE_TOKENS)),
                MAX_PROBE_SEQUENCES)
    lps = items(d["logprobs"], "probe logprobs", lambda x, where: tuple(items(x, where, logprob, MAX_PROBE_TOKENS)),
                MAX_PROBE_SEQUENCES)
    if [len(x) - 1 for x in ids] != [len(x) for x in lps]:
        raise InvalidMessage("probe logprobs must have one value for each token after the first of their sequence")
    return probe_version, tuple(ids), tuple(lps)


@dataclasses.dataclass(frozen=True)
class ProbeReport:
    """An inference worker's logprobs of a version's probe against the learner's (rlsys/alarms.py `probe_totals`):
    [tokens, sum |diff|, max |diff|, sum of KL terms]."""

    worker: int
    version: int
    totals: list[float]


def parse_probe_report(message) -> ProbeReport:
    d = fields(message, "probe report", {"worker", "version", "totals"})
    totals = items(d["totals"], "totals", lambda x, where: number(x, where, 0.0), 4)
    if len(totals) != 4:
        raise InvalidMessage(f"totals must have 4 numbers, got {len(totals)}")
    return ProbeReport(integer(d["worker"], "worker"), integer(d["version"], "version"), totals)
