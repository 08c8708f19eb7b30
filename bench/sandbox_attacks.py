"""Hostile programs against the code sandbox in every mode: how many were contained?

    python3 bench/sandbox_attacks.py [--out bench/results/sandbox_attacks.json]

Runs every attack of `tests/sandbox_attacks.py` in each mode this machine can run: its own best
mode, bubblewrap without a cgroup, unconfined (limits only), and, when run as root, the whole suite
again as `nobody` (the system's Python; an ordinary user's path) and as root without CAP_SYS_ADMIN (a
container's root). Prints one row per attack and one column per mode (yes: contained, NO: not,
"-": not run in that mode because it would harm the host), writes the results as JSON, and ends with
the headline `contained:` line, per mode. Also times a trivial run (`print(1)`) in each in-process mode.
"""

import argparse
import asyncio
import json
import os
import secrets
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rlsys.tools.sandbox import run_python  # noqa: E402
from tests.sandbox_attacks import LIMITS, confinements, prepare, run_as, run_attacks  # noqa: E402


def in_process(mode: str, confinement) -> dict:
    with tempfile.TemporaryDirectory(prefix="rlsys-attack-") as directory:
        secret = secrets.token_hex(16)
        prepare(Path(directory) / "attack", secret)
        return {"mode": mode, "notes": list(confinement.notes), "uid": os.getuid(),
                "results": asyncio.run(run_attacks(confinement, Path(directory) / "attack", secret)),
                "seconds_per_run": asyncio.run(seconds_per_run(confinement))}


async def seconds_per_run(confinement, runs: int = 7) -> float:
    """Median wall time of `print(1)`, one run at a time: the cost of the confinement itself."""
    times = sorted([(await run_python("print(1)", LIMITS, confinement)).seconds for _ in range(runs)])
    return times[runs // 2]


def other_process(prefix: list[str], python: str, user: str) -> dict:
    directory = Path(tempfile.mkdtemp(prefix="rlsys-attack-"))
    try:
        return run_as(prefix, python, directory, user)
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default=str(ROOT / "bench" / "results" / "sandbox_attacks.json"))
    args = parser.parse_args()
    columns = {name: in_process(name, confinement) for name, confinement in confinements().items()}
    if os.geteuid() == 0 and shutil.which("setpriv"):
        if os.access("/usr/bin/python3", os.X_OK):
            result = other_process(["setpriv", "--reuid=nobody", "--regid=nogroup", "--clear-groups", "--inh-caps=-all",
                                    "--bounding-set=-all"], "/usr/bin/python3", "nobody")
            columns[f"nobody: {result['mode']}"] = result
        result = other_process(["setpriv", "--bounding-set=-sys_admin", "--inh-caps=-sys_admin"],
                               sys.executable, "root")
        columns[f"root without CAP_SYS_ADMIN: {result['mode']}"] = result
    attacks = list(next(iter(columns.values()))["results"])
    width = max(map(len, attacks)) + 2
    print("attack".ljust(width) + " | ".join(columns))
    for attack in attacks:
        cells = []
        for name, column in columns.items():
            outcome = column["results"][attack]
            mark = "-" if outcome["status"] == "not run" else "yes" if outcome["contained"] else "NO"
            cells.append(mark.ljust(len(name)))
        print(attack.ljust(width) + " | ".join(cells))
    counts = {name: sum(o["contained"] for o in column["results"].values()) for name, column in columns.items()}
    for name, column in columns.items():
        startup = f", {column['seconds_per_run']:.2f} s per print(1)" if "seconds_per_run" in column else ""
        print(f"{name}: {'; '.join(column['notes']) or 'nothing missing'}{startup}")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"columns": columns, "contained": counts, "attacks": len(attacks)}, indent=1))
    print("contained: " + ", ".join(f"{name} {count}/{len(attacks)}" for name, count in counts.items()))


if __name__ == "__main__":
    main()
