"""Checks that stop a run before anything starts, with a message that says what to do.

They run before the (possibly long) dataset and model preparation, so a missing redis-server, a taken
port or an unreachable Redis is reported in a second, not after a warm start.
"""

import urllib.parse

import redis

from rlsys.bus.redis_server import MIN_VERSION, EmbeddedRedisError, check_port_free, find_redis_server

CONNECT_TIMEOUT = 5.0


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
    where = redacted(url)
    client = redis.Redis.from_url(url, socket_connect_timeout=CONNECT_TIMEOUT, socket_timeout=CONNECT_TIMEOUT,
                                  retry=None)
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


def redacted(url: str) -> str:
    """The URL without its password, for messages."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or ""
    port = f":{parts.port}" if parts.port else ""
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{host}{port}", query=""))
