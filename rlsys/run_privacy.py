"""A run's files are its user's alone, and no secret is written into them.

Trajectories, checkpoints, logs and the private Redis's append-only file can hold the dataset with its
reference answers and everything the model said: the run directory is 0700, files in it 0600 (role
processes and redis-server run under umask 077; what was made before, by an older run, is tightened when
the run starts again). The passwords in `cluster.redis_url` and `trace.mlflow_tracking_uri` are replaced by REDACTED
in the saved config.yaml, and in what the run prints; a rerun from that file passes the URL again
(`cluster.redis_url=...`), and one that does not is refused at its start.

What rlsys writes by name in a run directory (config.yaml, summary.json, logs, traces, the report, frames,
the private Redis's config and log) is never written through a symbolic link: someone may have planted one
while the directory was open, at config.yaml say, pointing at a file of the user's, which a write would
overwrite and a chmod would make 0600. A whole file is written beside its path and moved over it (`write_private`), an
appended log is opened only if it is no link (`append_private`), and `make_private` leaves links alone.
"""

import errno
import os
import re
import secrets
import urllib.parse
from pathlib import Path

PRIVATE_UMASK = 0o077
REDACTED = "REDACTED"


def make_private(directory: Path) -> None:
    """Creates `directory` (and parents) if needed; it and everything in it become owner-only.

    `directory` itself may be a link (a run directory on scratch space is the user's choice). Links inside it
    are skipped, never followed: chmod changes a link's target (and os.chmod's follow_symlinks=False is not
    implemented on Linux). The directory is tightened first, so no one else reaches in while the rest is
    walked.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True, mode=0o700)
    directory.chmod(0o700)
    for root, dirs, files in os.walk(directory):  # lists links to directories in dirs, but never enters them
        for names, mode in ((dirs, 0o700), (files, 0o600)):
            for name in names:
                path = os.path.join(root, name)
                if not os.path.islink(path):
                    os.chmod(path, mode)


def write_private(path: Path, text: str | bytes) -> None:
    """Writes `text` (or bytes: an image) to `path` as a file only its owner can read, never through a link at `path`.

    The text goes to a new file beside `path`, created with O_EXCL | O_NOFOLLOW (so it is no link and no one
    else's file), which os.replace then moves onto `path`. A link planted there is replaced itself, its target
    untouched; a file left with wider permissions is replaced by a 0600 one; and a reader sees the old file or
    the new one, never half of one. Replacing rather than refusing: the link is debris in the user's own run
    directory, and a run that refused would not start until someone removed it by hand.
    """
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(8)}.tmp")
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        with os.fdopen(fd, "wb" if isinstance(text, bytes) else "w") as f:
            os.fchmod(fd, 0o600)  # whatever the umask
            f.write(text)
        os.replace(temporary, path)
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise


def append_private(path: Path) -> int:
    """A file descriptor appending to `path`, created owner-only if new. A link at `path` is refused: a log
    keeps what earlier processes wrote, so it cannot be swapped for a new file as `write_private` does."""
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW, 0o600)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise OSError(errno.ELOOP, f"{path} is a symbolic link; rlsys appends only to a file of its own "
                                       f"there (remove the link)") from None
        raise


# A password in a URL's query, as redis-py (redis://host?password=) and libpq (postgresql://host/db?password=) take it
QUERY_PASSWORD_KEY = r"[?&](?i:password|passwd|pwd)="
QUERY_PASSWORD = re.compile(rf"({QUERY_PASSWORD_KEY})[^&#]*")


def redact_url(url: str) -> str:
    """`url` with its password (redis://user:PASSWORD@host, or ?password=PASSWORD) replaced by REDACTED, the rest
    as written: a URL rebuilt from its parts lost a slash of sqlite:////abs/path and an IPv6 host's brackets."""
    parts = urllib.parse.urlsplit(url)
    if parts.password is not None:
        scheme = f"{parts.scheme}://"
        host = parts.netloc.rsplit("@", 1)[1]
        url = f"{scheme}{parts.username or ''}:{REDACTED}@{host}{url[len(scheme) + len(parts.netloc):]}"
    return QUERY_PASSWORD.sub(rf"\g<1>{REDACTED}", url)


def redact_passwords(text: str, url: str) -> str:
    """`text` with each password of `url` (as redact_url finds them), as written and percent-decoded, replaced by
    REDACTED where it stands as a password: between a URL's user and host (`user:PASSWORD@`) or after a query's
    password key (`?password=PASSWORD`). The errors of a client given `url` quote it so (MLflow's "API request to
    http://user:PASSWORD@host/... failed", its API path run on after the URI's query). Elsewhere the same characters
    are other words: a short password ("a", "12") replaced everywhere garbled the text around it (port 5412)."""
    written = [urllib.parse.urlsplit(url).password or ""] + \
        [m.group(0)[len(m.group(1)):] for m in QUERY_PASSWORD.finditer(url)]
    forms = sorted({p for w in written for p in (w, urllib.parse.unquote(w))} - {""}, key=len, reverse=True)
    if not forms:
        return text
    password = "|".join(map(re.escape, forms))  # the longest first: a form that holds another is replaced whole
    text = re.sub(rf"(?<=:)(?:{password})(?=@)", REDACTED, text)
    return re.sub(rf"({QUERY_PASSWORD_KEY})(?:{password})", lambda m: m.group(1) + REDACTED, text)
