"""EmbeddedRedis: a private redis-server for a single-machine run, that never outlives its owner.

Security: binds 127.0.0.1 only (or the one address given, for other nodes), protected mode on, a random password
that is written to a 0600 config file (never on the command line, where `ps` would show it), and the commands that
would let the password's holder write files, load code or replicate from elsewhere removed (DISABLED_COMMANDS).
Durability: append-only file in the run directory, so restarting on the same run_dir keeps the data (every write
it acknowledged, even killed).
Cleanup on every way the owning process can end:
  * normal end / exception / KeyboardInterrupt: the `with` block (or atexit) calls stop();
  * SIGTERM: Python's default is to die without running cleanup, so use `raise_on_sigterm()` to turn
    it into SystemExit; the same path as above then applies;
  * SIGKILL (or any other death): the server is started with PR_SET_PDEATHSIG (Linux), so the kernel
    sends it SIGTERM when the owner dies, and redis-server shuts down cleanly on SIGTERM.
Note that PDEATHSIG fires when the *thread* that started the server exits: call start() from a thread
that lives as long as the server should (normally the main thread).
The server runs in its own session, so a Ctrl-C on the terminal reaches only the owner, which can
still use the bus (e.g. to tell its roles to stop) before it stops the server.
"""

import atexit
import contextlib
import ctypes
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import redis

from rlsys.run_privacy import PRIVATE_UMASK, append_private, make_private, write_private

START_TIMEOUT = 10.0
STOP_TIMEOUT = 10.0
PORT_ATTEMPTS = 5
MIN_VERSION = (6, 2)  # XPENDING IDLE and XAUTOCLAIM-era stream commands
_PR_SET_PDEATHSIG = 1
CONFIG_NAME, LOG_NAME = "redis.conf", "redis.log"  # in the server's directory, beside its append-only file
# Commands the bus never sends that would let whoever holds the password (sent in clear to other nodes) reach
# beyond the run's data: CONFIG SET dir/dbfilename writes a file of their choosing as this user (Redis 6.2 has no
# protected configs), REPLICAOF/SLAVEOF loads a server of theirs, MODULE loads code, DEBUG crashes or stalls it,
# MIGRATE sends keys to any host. Removed from the server's command table, so no ACL change brings them back.
DISABLED_COMMANDS = ("CONFIG", "REPLICAOF", "SLAVEOF", "MODULE", "DEBUG", "MIGRATE")


class EmbeddedRedisError(RuntimeError):
    """The private redis-server could not be started (missing binary, bad config, no free port)."""


def find_redis_server() -> str:
    """The redis-server binary on PATH, checked to be recent enough for the bus's stream commands."""
    binary = shutil.which("redis-server")
    if binary is None:
        raise EmbeddedRedisError("redis-server is not on PATH; install it (Debian/Ubuntu: "
                                 "`sudo apt-get install redis-server`; conda: `conda install -c "
                                 "conda-forge redis`) or set cluster.redis_url to an existing server")
    output = subprocess.run([binary, "--version"], capture_output=True, text=True, timeout=30).stdout
    found = re.search(r"v=(\d+)\.(\d+)", output)
    if found and tuple(map(int, found.groups())) < MIN_VERSION:
        raise EmbeddedRedisError(f"{binary} is Redis {found[1]}.{found[2]}; rlsys needs "
                                 f"{MIN_VERSION[0]}.{MIN_VERSION[1]} or newer (stream consumer groups with claims); "
                                 "install a newer redis-server")
    return binary


def check_port_free(port: int) -> None:
    """EmbeddedRedisError unless `port` can be bound on the loopback interface right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        # As redis-server binds: a port whose only sockets are closed connections in TIME_WAIT (a server stopped
        # with clients connected, for a minute after: a resume right after a Ctrl-C) is free to it; one that a
        # socket listens on or holds is not
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            raise _port_in_use(port, "127.0.0.1") from None


def _port_in_use(port: int, host: str) -> EmbeddedRedisError:
    return EmbeddedRedisError(f"cluster.redis_port {port} is in use on {host}; choose another port, "
                              "or set cluster.redis_port=0 to pick a free one")


def free_port(host: str = "127.0.0.1") -> int:
    """A port free on `host` right now; another process may take it before it is bound (callers retry)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def _die_with_parent_hook():
    """A preexec_fn that makes the kernel SIGTERM the child when its parent dies (Linux; else no-op)."""
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl  # resolved here, in the parent, not after fork
    except (OSError, AttributeError):
        return None
    parent = os.getpid()

    def hook():
        # A signal mask outlives exec: a server started while its owner's thread held SIGTERM back (as multiprocessing
        # and rlsys.placement do for a moment around a spawn) would ignore the parent-death signal, and outlive it
        signal.pthread_sigmask(signal.SIG_SETMASK, ())
        prctl(_PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os._exit(1)

    return hook


@contextlib.contextmanager
def raise_on_sigterm():
    """Within the block, SIGTERM raises SystemExit(143), so `with`/`finally`/atexit cleanup runs.

    Main thread only (a Python signal-handler rule); the previous handler is restored on exit.
    """
    def handler(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


class _DirectoryAsFound:
    """What a start changes in a server's directory that was there, as it was before: its config, its log's length
    and which entries it held (a server that failed after binding may have begun an append-only file)."""

    def __init__(self, directory: Path):
        self.directory = directory
        self.entries = set(os.listdir(directory))
        config, log = directory / CONFIG_NAME, directory / LOG_NAME
        self.config = config.read_bytes() if config.is_file() else None
        self.log_size = log.stat().st_size if log.is_file() else None

    def restore(self) -> None:
        for name in set(os.listdir(self.directory)) - self.entries:
            path = self.directory / name
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        if self.config is not None:
            write_private(self.directory / CONFIG_NAME, self.config)
        if self.log_size is not None:
            os.truncate(self.directory / LOG_NAME, self.log_size)


class EmbeddedRedis:
    """A redis-server owned by this process, with its data, config and log in `run_dir`.

    Usage: `with EmbeddedRedis(run_dir) as server: bus = connect(server.url)`. `port` 0 picks a free one.
    """

    def __init__(self, run_dir, port: int = 0, host: str = "127.0.0.1"):
        self.run_dir = Path(run_dir).resolve()
        self.host = host  # where it listens: loopback, or the head node's address when other nodes need it
        self.password = ""
        self.requested_port = port
        self.port = 0
        self.process: subprocess.Popen | None = None
        self._owner = 0

    @property
    def url(self) -> str:
        if self.process is None:
            raise EmbeddedRedisError("EmbeddedRedis is not started")
        return f"redis://:{self.password}@{self.host}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    @property
    def log_file(self) -> Path:
        return self.run_dir / LOG_NAME

    def start(self) -> "EmbeddedRedis":
        """Start the server and wait until it answers PING as an authenticated client."""
        if self.process is not None:
            return self
        binary = find_redis_server()
        found = _DirectoryAsFound(self.run_dir) if self.run_dir.exists() else None
        make_private(self.run_dir)  # the AOF of an older server here may be world-readable
        self.password = secrets.token_hex(24)
        try:
            for _ in range(PORT_ATTEMPTS if not self.requested_port else 1):
                self.port = self.requested_port or free_port(self.host)
                if self._launch(binary):
                    self._owner = os.getpid()
                    atexit.register(self.stop)
                    return self
            if self.requested_port:
                raise _port_in_use(self.port, self.host)
            raise EmbeddedRedisError(f"redis-server found no free port in {PORT_ATTEMPTS} attempts; "
                                     f"log tail:\n{self._log_tail()}")
        except BaseException:
            # A directory this start made holds only its config (the password of a server that never ran) and its
            # log, whose tail the error quotes: it goes. One that was there keeps an earlier server's data, and gets
            # back the config and log that server left, which a user inspecting it, or a retry, then finds.
            if found is None:
                shutil.rmtree(self.run_dir, ignore_errors=True)
            else:
                found.restore()
            raise

    def exited(self) -> bool:
        """Whether a started server has died (killed, crashed, shut down by someone else)."""
        return self.process is not None and self.process.poll() is not None

    def restart(self) -> None:
        """A dead server started again on the same port, password and data directory: clients reconnect
        to the same URL and find what the append-only file kept."""
        self.process = None
        if not self._launch(find_redis_server()):  # the roles hold the URL: no other port would do
            raise EmbeddedRedisError(f"another process took its port {self.port} on {self.host} while it was down")

    def _write_config(self) -> Path:
        def quote(text: str) -> str:  # redis config takes double-quoted strings with \\ and \" escapes
            return json.dumps(text, ensure_ascii=False)

        lines = [
            f"bind {self.host}",
            f"port {self.port}",
            "protected-mode yes",
            f"requirepass {quote(self.password)}",
            f"dir {quote(str(self.run_dir))}",
            "appendonly yes",
            # Written to the file before every answer, so a killed server loses nothing it acknowledged: `everysec`
            # holds writes back, answering, while its background fsync runs (up to 2 s on a busy disk). A machine
            # crash, which ends the run, loses what the OS had not flushed (about 30 s; everysec's 2 s then).
            "appendfsync no",
            'save ""',  # the AOF is the durability; no RDB snapshots
            "hz 100",  # blocking-pop timeouts are checked at this rate: 10 ms, not the default 100 ms
            "daemonize no",
            'logfile ""',  # stdout, which goes to redis.log
        ] + [f'rename-command {command} ""' for command in DISABLED_COMMANDS]
        path = self.run_dir / CONFIG_NAME
        write_private(path, "\n".join(lines) + "\n")
        return path

    def _launch(self, binary: str) -> bool:
        """True once the server answers; False if it lost the race for the port; raises otherwise."""
        config = self._write_config()
        log_start = self.log_file.stat().st_size if self.log_file.exists() else 0
        with os.fdopen(append_private(self.log_file), "ab") as log:
            self.process = subprocess.Popen([binary, str(config)], stdin=subprocess.DEVNULL, stdout=log,
                                            stderr=subprocess.STDOUT, start_new_session=True,
                                            preexec_fn=_die_with_parent_hook(), close_fds=True,
                                            umask=PRIVATE_UMASK)  # its AOF holds every message: owner-only
        client = redis.Redis(host=self.host, port=self.port, password=self.password,
                             socket_timeout=0.25, socket_connect_timeout=0.25, retry=None)  # re-polled
        deadline = time.monotonic() + START_TIMEOUT
        try:
            while time.monotonic() < deadline:
                if self.process.poll() is not None:
                    self.process = None
                    if "Address already in use" in self._log_tail(since=log_start):
                        return False
                    raise EmbeddedRedisError(f"redis-server exited at start; log tail:\n{self._log_tail()}")
                with contextlib.suppress(redis.ConnectionError, redis.TimeoutError):
                    if client.ping():
                        return True
                time.sleep(0.02)
        except BaseException:  # e.g. Ctrl-C while waiting: the caller never gets an object to stop
            self._terminate()
            raise
        finally:
            client.close()
        self._terminate()
        raise EmbeddedRedisError(f"redis-server did not answer PING within {START_TIMEOUT}s; "
                                 f"log tail:\n{self._log_tail()}")

    def _log_tail(self, lines: int = 20, since: int = 0) -> str:
        try:
            with open(self.log_file, "rb") as f:
                f.seek(since)
                return b"\n".join(f.read().splitlines()[-lines:]).decode(errors="replace")
        except OSError:
            return "(no log)"

    def _terminate(self) -> None:
        """SIGTERM (redis flushes the AOF and exits), then SIGKILL if it hangs; always reaps the process."""
        process, self.process = self.process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(STOP_TIMEOUT)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()

    def stop(self) -> None:
        """Shut the server down and wait for it to exit. Idempotent; a no-op in forked children."""
        if self.process is None or os.getpid() != self._owner:
            return
        atexit.unregister(self.stop)
        self._terminate()

    def __enter__(self) -> "EmbeddedRedis":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
