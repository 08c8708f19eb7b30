"""A quiet console: a role process's own output (and its libraries': vLLM's per-reload progress bars and
warnings, transformers' notices, anything a C extension or child process writes) goes to its log file in
the run directory; only rlsys warnings and errors, which may need the user, still reach the console."""

import logging
import os
import sys
from pathlib import Path

from rlsys.run_privacy import append_private


def role_output_to_file(log_file: Path, role: str) -> None:
    """File descriptors 1 and 2 point at `log_file` from now on, so the process's children inherit it too;
    rlsys' loggers still write WARNING and above to the console the process was started with."""
    console = os.fdopen(os.dup(2), "w", buffering=1)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    fd = append_private(log_file)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {role} %(levelname)s %(name)s: %(message)s",
                        stream=sys.stderr, force=True)
    to_console = logging.StreamHandler(console)
    to_console.setLevel(logging.WARNING)
    to_console.setFormatter(logging.Formatter(f"{role} %(levelname)s %(message)s"))
    logging.getLogger("rlsys").addHandler(to_console)
