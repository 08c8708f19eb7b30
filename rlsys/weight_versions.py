"""Where transport=disk publishes each weight version: <run dir>/weights/v<N> (written as v<N>.tmp, then renamed:
rlsys/engine/weights.py). Kept apart from rlsys/weight_transport.py, which imports torch, so that the launcher, which
removes the versions a resumed run published past its checkpoint, runs without it."""

import shutil
from pathlib import Path

WEIGHTS_DIR = "weights"  # under the run directory


def version_directory(weights_dir: Path, version: int) -> Path:
    return Path(weights_dir) / f"v{version}"


def remove_versions_after(weights_dir: Path, version: int) -> list[str]:
    """Deletes the versions published under `weights_dir` above `version` (and their temporary directories); returns
    their names. Only while no learner publishes there."""
    doomed = [d for d in Path(weights_dir).glob("v*")
              if (number := d.name.removeprefix("v").removesuffix(".tmp")).isdigit() and int(number) > version]
    for directory in doomed:
        shutil.rmtree(directory, ignore_errors=True)
    return sorted(d.name for d in doomed)
