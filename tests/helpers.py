"""Small builders shared by tests: a tiny randomly initialised model saved in HF format, a message with one
field replaced, the math experiment with a test's agent."""

import asyncio
import contextlib
import dataclasses
import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import msgpack
import psutil
import pytest

from experiments import AsyncPPOMATHConfig
from experiments.common import ModelConfig
from rlsys.api import AgentAbstraction, EnvServiceAbstraction
from rlsys.assets import warm_start_key
from rlsys.model.tiny import build_tiny_model
from rlsys.model.tokenizer import build_char_tokenizer
from rlsys.protocol import role_name


ENTRY = Path(__file__).resolve().parents[1] / "training" / "main_async_ppo.py"


@contextlib.contextmanager
def command_line_run(tmp_path: Path, args: list[str]):
    """The training command run as a user runs it, in `tmp_path`, its output in run.log (`proc.output()` reads it);
    killed if the test ends before it does."""
    log_path = tmp_path / "run.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, str(ENTRY), *args], stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    proc.output = log_path.read_text
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()


def role_process(proc: subprocess.Popen, name: str) -> psutil.Process:
    """The one role process called `name` (inference0, learner0, redis-server ...) under the run `proc`."""
    (found,) = [p for p in psutil.Process(proc.pid).children(recursive=True) if p.name() == name]
    return found


def save_random_tiny_model(directory: Path, tie_word_embeddings: bool = True, seed: int = 0) -> Path:
    tokenizer = build_char_tokenizer()
    cfg = ModelConfig(hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                      tie_word_embeddings=tie_word_embeddings)
    model = build_tiny_model(cfg, tokenizer, seed)
    model.save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


def small_run_overrides(cache_dir: Path, output_dir: Path) -> list[str]:
    """A run small enough for CI: a 0.4M-parameter model warm-started to 20% (greedy accuracy alone: the model the
    learning tests' margins were measured on), 200 held-out problems, evaluated before and after only (a test that
    wants evaluations between asks for them)."""
    return [
        f"model.cache_dir={cache_dir}", f"output_dir={output_dir}",
        "model.hidden_size=128", "model.num_layers=2", "model.num_heads=2", "model.num_kv_heads=1",
        "model.warm_start_accuracy=0.2", "model.warm_start_reach=0", "dataset.num_eval=200", "eval_steps=0",
        "ppo.lr=1e-4", "logging_steps=5",
    ]


def warm_start_identity(config) -> str:
    """Everything that makes an experiment's dataset and tiny model what they are: two experiments with the same
    identity generate the same files and warm-start the same model from the same examples, so a cold start of one
    is the cold start of the other."""
    kind = type(config)
    fields = {"model": {k: v for k, v in vars(config.model).items() if k != "cache_dir"}, "seed": config.seed,
              "dataset": vars(config.dataset), "warm_start": warm_start_key(config),
              "code": [f"{getattr(kind, m).__module__}.{getattr(kind, m).__qualname__}"
                       for m in ("generate_dataset", "warm_start_examples")],
              "schedule": [config.warm_start_batch_size, config.warm_start_eval_every, config.warm_start_max_steps]}
    return json.dumps(fields, sort_keys=True, default=str)


def final_books(run_dir: Path) -> dict:
    """The prompts of the run's newest checkpoint as its summary counts them once the run ended: those it held in
    flight as run_ended."""
    from rlsys.checkpoint import latest_checkpoint, read_trainer_state
    from rlsys.prompt_ledger import as_ended

    return as_ended(read_trainer_state(latest_checkpoint(run_dir / "checkpoints"))["accounting"])


def child_pids() -> set[int]:
    """This process's live descendants now: what a test started before its run is not the run's."""
    return {p.pid for p in psutil.Process().children(recursive=True)}


EXIT_GRACE_SECONDS = 5


def left_behind(tmp_path: Path, existing: set[int]) -> list[str]:
    """Live processes a run in `tmp_path` could leave: our descendants not among `existing`, and any
    process working in `tmp_path` (an embedded redis-server runs in its data directory); not the servers
    of tests running beside us, nor pools an earlier test of the session keeps."""
    found = [p for p in psutil.Process().children(recursive=True)
             if p.pid not in existing and p.status() != psutil.STATUS_ZOMBIE
             and "resource_tracker" not in " ".join(p.cmdline())]
    for p in psutil.process_iter(["status"]):
        with contextlib.suppress(psutil.Error):
            if p.info["status"] != psutil.STATUS_ZOMBIE and p.cwd().startswith(str(tmp_path)):
                found.append(p)
    # A process on its way out is not left behind: a launcher's resource tracker exits a moment after it.
    _, alive = psutil.wait_procs(found, timeout=EXIT_GRACE_SECONDS)
    names = []
    for p in alive:
        with contextlib.suppress(psutil.Error):
            if p.status() != psutil.STATUS_ZOMBIE:
                names.append(" ".join(p.cmdline()))
    return names


@contextlib.contextmanager
def held_port(host: str = "127.0.0.1"):
    """A port on `host` that this process holds bound, not listening, while the block runs. A port picked free and
    closed again can be taken before it is used: the processes of the test file running beside this one (pytest-xdist)
    take theirs from the same range, for their servers and for their connections' own ends. One held is given to
    none of them (neither a bind to port 0 nor a connection takes a bound port), nobody else can bind it, and a
    connection to it is refused; only a server that sets SO_REUSEADDR, as this socket does (redis-server, uvicorn,
    socket.create_server), binds and listens on it: the one the test starts there."""
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        holder.bind((host, 0))
        yield holder.getsockname()[1]


def alive(pid: int) -> bool:
    """Running, not a zombie waiting for a (possibly non-reaping) init to collect it."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


def redis_server_pids(under: Path) -> set[int]:
    """Live redis-servers whose data directory (redis chdirs there) is under `under`: the tests' own, not those
    of whatever else runs on the machine. An orphan SIGKILLed by a test is reaped by init, maybe slowly: a
    zombie has exited."""
    found = set()
    for process in psutil.process_iter(["name", "cwd", "status"]):
        info = process.info
        if (info["name"] == "redis-server" and info["status"] != psutil.STATUS_ZOMBIE and info["cwd"]
                and under in Path(info["cwd"]).parents):
            found.add(process.pid)
    return found


@pytest.fixture(scope="module")
def no_leaked_servers(tmp_path_factory):
    """Fails the module if a redis-server one of its tests started is still running after it."""
    base = tmp_path_factory.getbasetemp().resolve()
    before = redis_server_pids(base)
    yield
    assert redis_server_pids(base) <= before, "a redis-server started by these tests is still running"


def with_field(message: dict, path: tuple, value) -> dict:
    """A copy of `message` with the item at `path` (keys and list indices) replaced by `value`."""
    copy = msgpack.unpackb(msgpack.packb(message), strict_map_key=False)
    target = copy
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    return copy


class ReplayEagerly:
    """A CPU stand-in for rlsys.cuda_graphs.CudaGraphCapture: replaying runs the captured function again, with the
    host values it was captured with (a graph replays those too)."""

    def __call__(self, fn):
        return fn


def summing_rank(role: str, index: int, out: str, env: dict) -> int:
    """A learner rank placed as the launcher places it: joins the ranks, writes the sum of every rank's index + 1."""
    import torch

    from rlsys.distributed import join_ranks, leave_ranks

    os.environ.update(env)
    ranks = join_ranks(index, 2)
    Path(out, role_name(role, index)).write_text(str(ranks.summed(torch.tensor([index + 1.0])).item()))
    leave_ranks(ranks)
    return 0


def config_of(agent: str, tmp_path, env: str | None = None):
    """The math experiment with `agent` (and `env`, where given) by registered name, a random tiny model and its logs
    under `tmp_path`. Shared here, not imported from a test module: a test module imported by another is imported
    twice (by pytest and by name), and the agents it registers are refused the second time."""
    @dataclasses.dataclass
    class Experiment(AsyncPPOMATHConfig):
        @property
        def agent(self):
            return AgentAbstraction(agent, {})

        @property
        def env(self):
            return EnvServiceAbstraction(env) if env else super().env

    config = Experiment()
    config.model.path = str(save_random_tiny_model(tmp_path / "model"))
    config.logging_dir = str(tmp_path / "logs")
    return config


class LoopTicks:
    """How often the running event loop woke a task that sleeps 10 ms at a time while the block ran: a loop that a
    call blocks wakes it not at all meanwhile."""

    def __init__(self):
        self.count = 0

    async def __aenter__(self) -> "LoopTicks":
        self.task = asyncio.create_task(self.tick())
        return self

    async def __aexit__(self, *exc) -> None:
        self.task.cancel()

    async def tick(self) -> None:
        while True:
            await asyncio.sleep(0.01)
            self.count += 1
