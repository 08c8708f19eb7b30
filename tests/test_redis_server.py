"""EmbeddedRedis: locked down, durable, and gone (process exited, port closed) on every way its owner ends."""

import contextlib
import itertools
import os
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import redis

from rlsys.bus import EmbeddedRedis, EmbeddedRedisError, RedisBus, ServerRestarts, connect
from rlsys.bus import redis_server as redis_server_module
from tests.helpers import alive, held_port, no_leaked_servers  # noqa: F401  (a fixture)

ROOT = Path(__file__).resolve().parents[1]
OWNER_SCRIPT = textwrap.dedent("""
    import signal, sys, time
    from rlsys.bus.redis_server import EmbeddedRedis, raise_on_sigterm
    if sys.argv[2:] == ["blocked"]:  # started while the owner holds its stop signals back
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM})
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C raises, even under a shell that ignores it
    with raise_on_sigterm(), EmbeddedRedis(sys.argv[1]) as server:
        print(server.pid, server.port, flush=True)
        time.sleep(60)
""")


pytestmark = pytest.mark.usefixtures("no_leaked_servers")


def port_open(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def assert_gone(pid: int, port: int, within: float = 5.0) -> None:
    deadline = time.monotonic() + within
    while (alive(pid) or port_open(port)) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not alive(pid), f"redis-server {pid} still running"
    assert not port_open(port), f"port {port} still accepting connections"


def test_with_block_starts_and_stops(tmp_path):
    with EmbeddedRedis(tmp_path) as server:
        pid, port = server.pid, server.port
        assert alive(pid) and port_open(port)
        assert server.url.startswith(f"redis://:{server.password}@127.0.0.1:{port}/")
        bus = connect(server.url)
        bus.put("q", "ping")
        assert bus.get_many("q", 1, timeout=1) == ["ping"]
        bus.close()
    assert_gone(pid, port)
    server.stop()  # idempotent


def test_exception_inside_with_block_stops_server(tmp_path):
    with pytest.raises(RuntimeError, match="boom"):
        with EmbeddedRedis(tmp_path) as server:
            pid, port = server.pid, server.port
            raise RuntimeError("boom")
    assert_gone(pid, port)


@pytest.mark.parametrize("sig,started", [(signal.SIGINT, ""), (signal.SIGTERM, ""), (signal.SIGKILL, ""),
                                         (signal.SIGKILL, "blocked")],
                         ids=["SIGINT", "SIGTERM", "SIGKILL", "SIGKILL-signals-blocked-at-its-start"])
def test_server_dies_with_signalled_owner(tmp_path, sig, started):
    owner = subprocess.Popen([sys.executable, "-c", OWNER_SCRIPT, str(tmp_path), *filter(None, [started])], cwd=ROOT,
                             env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.PIPE, text=True)
    try:
        pid, port = map(int, owner.stdout.readline().split())
        assert alive(pid) and port_open(port)
        owner.send_signal(sig)
        owner.wait(timeout=10)
        assert_gone(pid, port)  # SIGKILL: the kernel's parent-death signal stops it
    finally:
        if owner.poll() is None:
            owner.kill()
            owner.wait()
    if sig == signal.SIGTERM:
        assert owner.returncode == 128 + signal.SIGTERM  # the SystemExit of raise_on_sigterm


def test_atexit_stops_a_server_left_running_at_normal_exit(tmp_path):
    script = ("import sys; from rlsys.bus import EmbeddedRedis\n"
              "server = EmbeddedRedis(sys.argv[1]).start()\nprint(server.pid, server.port)")
    out = subprocess.run([sys.executable, "-c", script, str(tmp_path / "dir with spaces é")], cwd=ROOT, check=True,
                         env={**os.environ, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True).stdout
    assert_gone(*map(int, out.split()))


def test_password_required_and_not_on_command_line(tmp_path):
    with EmbeddedRedis(tmp_path) as server:
        anonymous = redis.Redis(port=server.port, retry=None, socket_timeout=2)
        with pytest.raises((redis.AuthenticationError, redis.ResponseError)):
            anonymous.ping()
        wrong = redis.Redis(port=server.port, password="wrong", retry=None, socket_timeout=2)
        with pytest.raises((redis.AuthenticationError, redis.ResponseError)):
            wrong.ping()
        assert server.password.encode() not in Path(f"/proc/{server.pid}/cmdline").read_bytes()
        assert (tmp_path / "redis.conf").stat().st_mode & 0o777 == 0o600


def test_bound_to_loopback_in_protected_mode_and_the_commands_that_reach_beyond_the_data_refused(tmp_path):
    """The password travels in clear to other nodes: whoever holds it may read and write the run's keys, but not
    make the server write a file of their choosing (CONFIG SET dir), replicate from their server or load a module."""
    with EmbeddedRedis(tmp_path) as server:
        client = redis.Redis.from_url(server.url, decode_responses=True)
        config = (tmp_path / "redis.conf").read_text().splitlines()
        assert {"bind 127.0.0.1", "protected-mode yes", "appendonly yes"} <= set(config)
        listening = {line.split()[1] for line in Path("/proc/net/tcp").read_text().splitlines()[1:]
                     if line.split()[3] == "0A"}  # state LISTEN
        assert f"0100007F:{server.port:04X}" in listening and f"00000000:{server.port:04X}" not in listening
        for command in (("CONFIG", "SET", "dir", "/tmp"), ("CONFIG", "GET", "dir"), ("REPLICAOF", "10.0.0.1", "6379"),
                        ("SLAVEOF", "10.0.0.1", "6379"), ("MODULE", "LOAD", "/tmp/x.so"), ("DEBUG", "SLEEP", "0"),
                        ("MIGRATE", "10.0.0.1", "6379", "k", "0", "100")):
            with pytest.raises(redis.ResponseError, match="unknown command"):
                client.execute_command(*command)
        assert client.ping() and client.set("k", "v") and client.get("k") == "v"
        client.close()


def test_data_survives_restart_on_same_run_dir(tmp_path):
    with EmbeddedRedis(tmp_path) as server:
        bus = connect(server.url)
        bus.set("weights:latest", {"version": 7, "path": "/ckpt/7"})
        bus.incr("admitted", 42)
        bus.put_many("trajectories", [b"a", b"b"])
        bus.close()
        first_password = server.password
    with EmbeddedRedis(tmp_path) as server:
        assert server.password != first_password  # a fresh secret per start; the data is what persists
        bus = connect(server.url)
        assert bus.get("weights:latest") == {"version": 7, "path": "/ckpt/7"}
        assert bus.get("admitted") == 42
        assert bus.get_many("trajectories", 10, timeout=1) == [b"a", b"b"]
        bus.close()


@contextlib.contextmanager
def taken_port(host: str = "127.0.0.1"):
    """A port on `host` that a socket listens on while the block runs."""
    with socket.socket() as squatter:
        squatter.bind((host, 0))
        squatter.listen()
        yield squatter.getsockname()[1]


def test_retries_when_the_chosen_port_is_taken(tmp_path, monkeypatch):
    with taken_port() as taken:
        # the taken port first, then free ones picked as the server does: one picked here, before the start, could be
        # taken too by the time the server binds it, and the retry then had no port left to try
        ports = itertools.chain([taken], iter(redis_server_module.free_port, None))
        monkeypatch.setattr(redis_server_module, "free_port", lambda host="127.0.0.1": next(ports))
        with EmbeddedRedis(tmp_path) as server:
            assert server.port != taken
            assert connect(server.url).get("x", default=1) == 1


def test_a_port_taken_on_the_address_it_listens_on_is_named_with_that_address(tmp_path):
    """A head node's server listens on the node's address, not loopback: the refusal named 127.0.0.1, where the port
    was free, sending the user to look in the wrong place."""
    with taken_port("127.0.0.2") as taken:
        with pytest.raises(EmbeddedRedisError, match=rf"cluster.redis_port {taken} is in use on 127.0.0.2;"):
            EmbeddedRedis(tmp_path, taken, host="127.0.0.2").start()


def test_a_failed_start_removes_the_directory_it_made_and_keeps_one_it_found(tmp_path):
    """A start that failed left the directory it made in the run directory: a config holding the password of a
    server that never ran, and a log whose tail the error quotes. A directory that was there holds an earlier
    server's data, which a continued run reads: kept."""
    with EmbeddedRedis(tmp_path / "earlier") as server:
        bus = connect(server.url)
        bus.set("admitted", 42)
        bus.close()
    with taken_port() as taken:
        for directory in ("redis", "earlier"):
            with pytest.raises(EmbeddedRedisError, match=f"cluster.redis_port {taken} is in use"):
                EmbeddedRedis(tmp_path / directory, taken).start()
    assert not (tmp_path / "redis").exists()
    with EmbeddedRedis(tmp_path / "earlier") as server:
        bus = connect(server.url)
        assert bus.get("admitted") == 42
        bus.close()


def break_the_config(monkeypatch) -> None:
    """Every config EmbeddedRedis writes ends with a directive redis-server refuses: it exits at its start."""
    original = EmbeddedRedis._write_config

    def broken_config(self):
        path = original(self)
        with open(path, "a") as f:
            f.write("no-such-directive yes\n")
        return path

    monkeypatch.setattr(EmbeddedRedis, "_write_config", broken_config)


def files_of(directory: Path) -> dict[str, bytes]:
    return {str(path.relative_to(directory)): path.read_bytes() for path in sorted(directory.rglob("*"))
            if path.is_file()}


@pytest.mark.parametrize("fails", ["port-taken", "exits-at-start"])
def test_a_failed_start_leaves_a_directory_it_found_as_it_was(tmp_path, monkeypatch, fails):
    """A start that failed in a directory that was there rewrote its redis.conf (the password of a server that never
    ran, in place of the one an earlier server ran with) and appended its failure to redis.log: a user inspecting
    the directory, or a retry, found the failed start's files, not the earlier server's."""
    with EmbeddedRedis(tmp_path) as server:
        bus = connect(server.url)
        bus.set("admitted", 42)
        bus.close()
    before = files_of(tmp_path)
    assert {"redis.conf", "redis.log"} <= before.keys()
    with taken_port() as taken:
        if fails == "exits-at-start":
            break_the_config(monkeypatch)
        with pytest.raises(EmbeddedRedisError, match=("is in use" if fails == "port-taken" else "no-such-directive")):
            EmbeddedRedis(tmp_path, taken if fails == "port-taken" else 0).start()
    assert files_of(tmp_path) == before


def test_missing_binary_says_how_to_install(tmp_path, monkeypatch):
    monkeypatch.setattr(redis_server_module.shutil, "which", lambda name: None)
    with pytest.raises(EmbeddedRedisError, match="apt-get install redis-server"):
        EmbeddedRedis(tmp_path).start()


def test_startup_failure_reports_log_tail(tmp_path, monkeypatch):
    break_the_config(monkeypatch)
    with pytest.raises(EmbeddedRedisError, match="no-such-directive"):
        EmbeddedRedis(tmp_path).start()


def test_clients_ride_out_a_restart_and_find_their_data(tmp_path):
    """A server that goes down mid-run comes back on the same URL: a client's blocked and later commands
    wait for it instead of failing, and what was queued before survives in the append-only file."""
    from concurrent.futures import ThreadPoolExecutor

    with EmbeddedRedis(tmp_path) as server, ThreadPoolExecutor(1) as client_thread:
        bus = connect(server.url)
        bus.put_many("q", [1, 2])
        bus.stream_add("s", {"n": 1})
        server.process.terminate()  # a clean shutdown: the AOF is flushed
        server.process.wait(10)
        assert server.exited()
        waiting = client_thread.submit(bus.get_many, "q", 10, 5)  # issued while the server is down
        time.sleep(1.0)
        assert not waiting.done()
        server.restart()  # from the thread that owns the server, as the launcher does
        assert waiting.result(timeout=30) == [1, 2]
        assert not server.exited() and bus.stream_length("s") == 1
        bus.close()


def test_a_command_the_server_does_not_answer_fails_after_one_socket_timeout(tmp_path, monkeypatch):
    """A server that stops answering (stopped, swapping, cut off) is not a restart: the timed-out command was retried
    as if it were, RECONNECT_SECONDS / RECONNECT_BACKOFF_CAP + 5 times a socket timeout of 30 s, half an hour."""
    from rlsys.bus import redis_bus

    monkeypatch.setattr(redis_bus, "SOCKET_TIMEOUT", 0.5)
    with EmbeddedRedis(tmp_path) as server:
        bus = RedisBus.from_url(server.url)
        bus.set("x", 1)
        raised = []
        caller = threading.Thread(target=lambda: raised.append(pytest.raises(redis.TimeoutError, bus.get, "x")))
        os.kill(server.pid, signal.SIGSTOP)
        try:
            caller.start()
            caller.join(10)
            assert not caller.is_alive() and raised  # one timeout, not 65
        finally:
            os.kill(server.pid, signal.SIGCONT)
            caller.join()
        assert bus.get("x") == 1  # the server answering again, the next command goes through
        bus.close()


def test_a_restarted_server_shows_a_new_server_id(tmp_path):
    with EmbeddedRedis(tmp_path) as server:
        bus = connect(server.url)
        restarts = ServerRestarts(bus)
        assert not restarts.happened()
        server.process.terminate()
        server.process.wait(10)
        server.restart()
        assert restarts.happened()
        assert not restarts.happened()  # once per restart
        bus.close()


@contextlib.contextmanager
def slow_fsyncs(pid: int, seconds: float):
    """Every fsync of the process `pid` held for `seconds` (strace's fault injection), as on a disk busy with other
    writes: CI's, running two test files at a time, showed what that does to a server writing `appendfsync
    everysec`."""
    tracer = subprocess.Popen(["strace", "-f", "-o", "/dev/null", "-p", str(pid), "-e", "trace=fsync,fdatasync",
                               "-e", f"inject=fsync,fdatasync:delay_enter={int(seconds * 1e6)}"],
                              stderr=subprocess.PIPE, text=True)
    attached = tracer.stderr.readline()  # "strace: Process N attached with M threads", or why it could not
    assert "attached" in attached, attached
    try:
        yield
    finally:
        tracer.kill()
        tracer.wait(10)


def test_every_acknowledged_write_survives_a_sigkill_even_while_an_fsync_is_slow(tmp_path):
    """The server writes its append-only file before it answers, so a killed one (not a crashed machine) loses
    nothing it acknowledged. With `appendfsync everysec` it held its writes back, answering, while a background
    fsync ran (up to 2 s): killed then, it lost them (CI saw 494 of 500 counts kept, on a busy disk)."""
    with EmbeddedRedis(tmp_path) as server:
        bus = connect(server.url)
        written, until = 0, time.monotonic() + 1.5  # everysec's first fsync begins within the first second
        with slow_fsyncs(server.pid, 3):
            while time.monotonic() < until:
                bus.put("q", written)
                bus.stream_add("s", {"n": written})
                bus.incr("count")
                written += 1
            server.process.kill()
            server.process.wait(10)
        server.restart()
        assert bus.get("count") == written
        assert bus.stream_length("s") == written
        assert bus.get_many("q", written + 1, timeout=1) == list(range(written))
        bus.close()


def test_the_supervisor_restarts_its_server_when_a_command_finds_it_down(tmp_path):
    """The server dies right after the supervisor checked that it runs: the command that finds it down fails at
    once (the supervisor restarts it, so it must not wait for it), and the next turn restarts it."""
    from types import SimpleNamespace

    from rlsys import protocol
    from rlsys.supervisor import Supervisor

    class DiesAfterTheCheck(EmbeddedRedis):
        checks = 0

        def exited(self) -> bool:
            self.checks += 1
            return self.checks > 1 and super().exited()

    config = SimpleNamespace(cluster=SimpleNamespace(n_rollout_workers=1, max_role_restarts=1))
    with DiesAfterTheCheck(tmp_path) as server:
        bus = connect(server.url, wait_out_restarts=False)
        bus.set(protocol.rollout_done(0), 1)
        server.process.terminate()  # SIGTERM: redis writes its append-only file and exits
        server.process.wait()
        supervisor = Supervisor(config, start_role=None, server=server)
        supervisor.watch(bus, report=lambda: None)  # returns once the restarted server says the run is done
        assert supervisor.restarts == {"redis-server": 1} and server.checks == 2
        bus.close()


def test_a_server_that_cannot_be_started_again_stops_the_run_with_the_reason(tmp_path):
    """A dead server whose restart failed (its port taken meanwhile, its append-only file unreadable) ended the run
    with the server's own error as a traceback, which left out the run's checkpoint note and, for a taken port, told
    the user to choose another cluster.redis_port, when the roles' URL holds that one."""
    from types import SimpleNamespace

    from rlsys.errors import RoleFailed
    from rlsys.supervisor import Supervisor

    config = SimpleNamespace(cluster=SimpleNamespace(n_rollout_workers=1, max_role_restarts=1))
    with EmbeddedRedis(tmp_path) as server, socket.socket() as squatter:
        server.process.kill()
        server.process.wait(10)
        squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        squatter.bind((server.host, server.port))
        squatter.listen()
        supervisor = Supervisor(config, start_role=None, server=server)
        with pytest.raises(RoleFailed, match=rf"^redis-server exited with code -9 \(SIGKILL\), and could not be "
                                             rf"started again: another process took its port {server.port} on "):
            supervisor.restart_dead_server()
        assert supervisor.restarts == {"redis-server": 1}


def test_the_port_of_a_server_stopped_with_clients_connected_counts_as_free(tmp_path):
    """A server stopped with clients connected closes their connections first, which leaves them in TIME_WAIT on
    its port for a minute. redis-server binds such a port again (SO_REUSEADDR), but the check before a run's start
    found it "in use": the same command with a fixed cluster.redis_port, rerun after a Ctrl-C to resume, was
    refused for a minute."""
    from rlsys.bus.redis_server import check_port_free

    with held_port() as port:  # no other process takes it before either start or between them
        with EmbeddedRedis(tmp_path, port) as server:
            bus = connect(server.url)
            bus.set("x", 1)
        bus.close()
        check_port_free(port)
        with EmbeddedRedis(tmp_path, port) as server:
            again = connect(server.url)
            assert server.port == port and again.get("x") == 1
            again.close()
