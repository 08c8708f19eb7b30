"""Checks that stop a run before anything starts, with a message that says what to do.

They run before the (possibly long) dataset and model preparation, so a missing redis-server, a taken
port, an unreachable Redis or MLflow server is reported in seconds, not after a warm start (or at the run's end).
"""

import importlib.util
import os
import socket
import urllib.parse
from pathlib import Path

import redis

from rlsys.bus.redis_bus import without_namespace
from rlsys.bus.redis_server import MIN_VERSION, EmbeddedRedisError, check_port_free, find_redis_server
from rlsys.run_privacy import REDACTED, redact_url

CONNECT_TIMEOUT = 5.0
REACH_TIMEOUT = 10.0  # seconds to wait for a server the config names (a Ray head, MLflow) to accept a connection


class StartupError(RuntimeError):
    """The run cannot start; the message says what to fix. Nothing was started."""


def check_message_bus(cluster) -> None:
    """The Redis the run will use can be had: the configured one answers, or a private one can start."""
    try:
        if cluster.redis_url:
            check_redis_url(cluster.redis_url)
            return
        find_redis_server()
        if cluster.redis_port:
            check_port_free(cluster.redis_port)
    except EmbeddedRedisError as e:
        raise StartupError(str(e)) from None


def check_redis_url(url: str) -> None:
    where = redact_url(url)
    client = redis.Redis.from_url(without_namespace(url)[0], socket_connect_timeout=CONNECT_TIMEOUT,
                                  socket_timeout=CONNECT_TIMEOUT, retry=None)
    try:
        version = client.info("server")["redis_version"]
    except redis.AuthenticationError as e:
        raise StartupError(f"Redis at {where} (cluster.redis_url) refused the credentials in the URL ({e}); "
                           "fix the password in cluster.redis_url") from None
    except (redis.ConnectionError, redis.TimeoutError) as e:
        raise StartupError(f"nobody answers at {where} (cluster.redis_url): {e}; start that Redis, fix the URL, "
                           "or leave cluster.redis_url empty to start a private server") from None
    except redis.ResponseError as e:
        raise StartupError(f"Redis at {where} (cluster.redis_url) refused to answer: {e}") from None
    finally:
        client.close()
    major, minor = (int(part) for part in version.split(".")[:2])
    if (major, minor) < MIN_VERSION:
        raise StartupError(f"Redis at {where} (cluster.redis_url) is version {version}; rlsys needs "
                           f"{MIN_VERSION[0]}.{MIN_VERSION[1]} or newer (stream consumer groups with claims)")


def check_reachable(address: str) -> None:
    """ConnectionError if nothing listens at a HOST:PORT address (auto, ray://... and the like are left to ray.init).
    ray.init retries a GCS it cannot reach 20 times, about 40 s each: a wrong port or a stopped head made the launcher
    sit silent for some 14 minutes before it said so."""
    host, _, port = address.rpartition(":")
    if "://" in address or not host or not port.isdigit():
        return
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=REACH_TIMEOUT).close()
    except OSError as e:
        raise ConnectionError(f"nothing answered at {address}: {e.strerror or e}") from None


# Where MLflow's database stores listen unless the URI names a port (SQLAlchemy's dialects, `postgresql+psycopg2`'s
# driver after the +)
DATABASE_PORTS = {"postgresql": 5432, "mysql": 3306, "mssql": 1433}


def check_mlflow_server(trace) -> None:
    """The store trace.mlflow will export to at the run's end can be had now: an MLflow tracking server (http:// or
    https://) or a database server accepts a connection (MLflow's client retries a server it cannot reach for about
    250 s, after the whole run), and a sqlite file can be written. Whether a database takes the credentials needs its
    driver, which is MLflow's to load. Other stores (files, databricks) are MLflow's to open."""
    if not trace.mlflow or not trace.mlflow_tracking_uri:
        return  # the default: sqlite:///<run dir>/mlflow.db, in the run directory the launcher made
    uri = trace.mlflow_tracking_uri
    key = f"trace.mlflow_tracking_uri={redact_url(uri)}"
    parts = urllib.parse.urlsplit(uri)
    scheme = parts.scheme.split("+")[0]
    if parts.password == REDACTED or REDACTED in parts.query:
        raise StartupError(f"{key}: its password is REDACTED, as the saved config.yaml keeps it; pass "
                           "trace.mlflow_tracking_uri=... with the password again")
    if scheme == "sqlite":
        check_sqlite_file(uri, key)
        return
    if scheme not in ("http", "https", *DATABASE_PORTS):
        return
    try:
        port = parts.port or DATABASE_PORTS.get(scheme) or (443 if scheme == "https" else 80)
    except ValueError as e:  # a port that is no number
        raise StartupError(f"trace.mlflow_tracking_uri: {e}") from None
    if not parts.hostname:
        if scheme in DATABASE_PORTS:
            return  # the database's local socket, which only its driver opens
        raise StartupError(f"{key} names no host")
    try:
        check_reachable(f"{parts.hostname}:{port}")
    except ConnectionError as e:
        server, start = ("database", "start it") if scheme in DATABASE_PORTS else \
            ("MLflow", "start it (`mlflow server`)")
        raise StartupError(f"{key}: no {server} server answered ({e}); {start}, fix the URI, or leave "
                           "trace.mlflow_tracking_uri empty to export to sqlite:///<run dir>/mlflow.db") from None


def check_sqlite_file(uri: str, key: str) -> None:
    """StartupError if the sqlite file of `uri` (SQLAlchemy's sqlite:///relative or sqlite:////absolute) cannot be
    written: MLflow makes the directories it lacks, but not below a file or where it may not write."""
    database = uri.split("://", 1)[1].split("?", 1)[0]
    if not database.startswith("/") or database[1:] in ("", ":memory:"):
        return  # in memory: nothing to check
    path = Path(database[1:]).absolute()
    existing = next(p for p in (path, *path.parents) if p.exists())
    if existing == path:
        problem = None if path.is_file() and os.access(path, os.W_OK) and os.access(path.parent, os.W_OK | os.X_OK) \
            else f"{path} is no file this user may write (with its directory)"
    elif not existing.is_dir():
        problem = f"{existing} is not a directory"
    else:
        problem = None if os.access(existing, os.W_OK | os.X_OK) else f"this user may not write in {existing}"
    if problem:
        raise StartupError(f"{key}: {problem}; fix the path, or leave trace.mlflow_tracking_uri empty to export to "
                           "sqlite:///<run dir>/mlflow.db")


def check_extras(config) -> None:
    """The packages the chosen features need are installed. `bash scripts/install.sh` installs only what the default
    run needs; each optional feature's packages come with an extra of setup.py (all of them with `--tests`)."""
    needed = [("cluster.backend=ray", ["ray"], "'.[ray]'")] if config.cluster.backend == "ray" else []
    if getattr(getattr(config, "trace", None), "mlflow", False):
        needed.append(("trace.mlflow=true", ["mlflow"], "'.[mlflow]'"))
    if getattr(config.inference, "engine", "") == "vllm":
        needed.append(("inference.engine=vllm", ["vllm"], "'.[cpu]' on a CPU machine, '.[gpu]' on a GPU one"))
    agent = getattr(config, "agent", None)
    if agent is not None and agent.name == "openai-agent":
        needed.append((f"the {agent.name} agent (its endpoint and clients)", ["fastapi", "uvicorn", "httpx", "openai"],
                       "'.[agents]'"))
        if str(agent.args.get("run", "")).startswith("rlsys.impl.agent.langgraph_example:"):
            needed.append(("the LangGraph example agent", ["langgraph", "langchain_openai"], "'.[agents]'"))
    for feature, modules, extra in needed:
        missing = [m for m in modules if importlib.util.find_spec(m) is None]
        if missing:
            raise StartupError(f"{feature} needs {', '.join(missing)}, which `bash scripts/install.sh` leaves out: "
                               f"pip install -e {extra} (`bash scripts/install.sh --tests` installs every extra)")
