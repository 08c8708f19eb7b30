"""`python3 scripts/uv_install.py ARGS...`: `uv pip install ARGS` into this Python, from where pip would install.

uv downloads and unpacks in parallel (the default tier in 28 s where pip took 2m20s: BENCHMARKS.md, "A first result
in minutes") but reads none of pip's configuration. This hands it what pip's says about where packages come from: the
local wheel folders, the constraints file, the indexes (a local index that does not exist is skipped, as pip skips
it; uv would stop on it), the CA file, and pip's rule of taking the best version from any index. Exits with uv's
status: scripts/install.sh installs with pip where this fails.
"""

import os
import subprocess
import sys

_SOURCES = ("find-links", "constraint", "index-url", "extra-index-url")  # pip options uv takes under the same name


def uv_arguments(pip_config: str) -> tuple[list[str], dict[str, str]]:
    """From `pip config list`'s output (lines such as `global.find-links='/opt/wheels'`): uv's arguments and the
    environment variables it needs."""
    args, env = ["--index-strategy", "unsafe-best-match"], {}
    for line in pip_config.splitlines():
        name, _, value = line.partition("=")
        key, value = name.rpartition(".")[2], value.strip().strip("'\"")
        if key in _SOURCES:
            for v in value.split():
                if v.startswith("file://") and not os.path.exists(v.removeprefix("file://")):
                    continue
                if not _given(args, key, v):  # pip lists a setting once per place it is set
                    args += ["--" + key, v]
        elif key == "cert":
            env["SSL_CERT_FILE"] = value
    return args, env


def _given(args: list[str], key: str, value: str) -> bool:
    return any(a == "--" + key and b == value for a, b in zip(args, args[1:]))


def main() -> int:
    pip_config = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    args, env = uv_arguments(pip_config)
    command = [sys.executable, "-m", "uv", "pip", "install", "-q", "--python", sys.executable, *args, *sys.argv[1:]]
    return subprocess.run(command, env={**os.environ, **env}).returncode


if __name__ == "__main__":
    sys.exit(main())
