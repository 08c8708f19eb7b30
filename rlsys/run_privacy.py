"""A run's files are its user's alone, and no secret is written into them.

Trajectories, checkpoints, logs and the private Redis's append-only file can hold the dataset with its
reference answers and everything the model said: the run directory is 0700, files in it 0600 (role
processes and redis-server run under umask 077; what was made before, by an older run, is tightened when
the run starts again). The Redis password in `cluster.redis_url` is replaced by REDACTED in the saved
config.yaml; a rerun from that file passes the URL again (`cluster.redis_url=...`).
"""

import os
import urllib.parse
from pathlib import Path

PRIVATE_UMASK = 0o077
REDACTED = "REDACTED"


def make_private(directory: Path) -> None:
    """Creates `directory` (and parents) if needed; it and everything in it become owner-only."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    directory.chmod(0o700)
    for root, dirs, files in os.walk(directory):
        for name in dirs:
            os.chmod(os.path.join(root, name), 0o700, follow_symlinks=False)
        for name in files:
            path = os.path.join(root, name)
            if not os.path.islink(path):
                os.chmod(path, 0o600)


def write_private(path: Path, text: str) -> None:
    """Writes `text` to a file only its owner can read, even if it existed before with wider permissions."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        os.fchmod(fd, 0o600)
        f.write(text)


def redact_url(url: str) -> str:
    """`url` with its password (redis://user:PASSWORD@host) replaced by REDACTED; other URLs unchanged."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.netloc.rsplit("@", 1)[1]
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:{REDACTED}@{host}"))
