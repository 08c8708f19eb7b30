"""rlsys supports Python 3.10+ (setup.py, README): no 3.11-only API outside rlsys/compat.py, and, where a python3.10
is on the machine (pyenv's, Debian's), the package compiles under it and the episode guard runs under it.

`asyncio.timeout` (3.11) once sat in the episode guard, so on 3.10 every episode failed with AttributeError."""

import ast
import glob
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("rlsys", "experiments", "training")
ALLOWED = {ROOT / "rlsys" / "compat.py"}  # the one place that may name them, behind a version check

NEWER_ATTRIBUTES = {  # module -> names it gained in 3.11 or later
    "asyncio": {"timeout", "timeout_at", "Timeout", "TaskGroup", "Runner", "Barrier", "BrokenBarrierError"},
    "typing": {"Self", "LiteralString", "Never", "assert_never", "assert_type", "reveal_type", "Required",
               "NotRequired", "TypeVarTuple", "Unpack", "dataclass_transform", "override", "get_overloads",
               "clear_overloads", "TypeAliasType"},
    "datetime": {"UTC"},
    "enum": {"StrEnum", "ReprEnum", "verify", "EnumCheck", "FlagBoundary", "member", "nonmember", "global_enum"},
    "hashlib": {"file_digest"},
    "contextlib": {"chdir"},
    "logging": {"getLevelNamesMapping"},
    "operator": {"call"},
    "math": {"exp2", "cbrt"},
    "itertools": {"batched"},
    "inspect": {"markcoroutinefunction", "getasyncgenstate", "getasyncgenlocals"},
}
NEWER_MODULES = {"tomllib", "wsgiref.types"}
NEWER_BUILTINS = {"ExceptionGroup", "BaseExceptionGroup"}
NEWER_METHODS = {"add_note"}  # BaseException.add_note


def newer_api_uses(source: str, filename: str = "<source>") -> list[str]:
    """`line: what` for each use of a Python 3.11+ API in `source`, read with `ast` (nothing is imported)."""
    found = []
    aliases = {}  # local name -> module, for `import asyncio as aio`
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                aliases[alias.asname or alias.name] = alias.name
                if alias.name in NEWER_MODULES:
                    found.append(f"{node.lineno}: import {alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module in NEWER_MODULES:
                found.append(f"{node.lineno}: from {node.module} import ...")
            for alias in node.names:
                if alias.name in NEWER_ATTRIBUTES.get(node.module, ()):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name):
                module = aliases.get(node.value.id, node.value.id)
                if node.attr in NEWER_ATTRIBUTES.get(module, ()):
                    found.append(f"{node.lineno}: {module}.{node.attr}")
            if node.attr in NEWER_METHODS:
                found.append(f"{node.lineno}: .{node.attr}")
        elif isinstance(node, ast.Name) and node.id in NEWER_BUILTINS:
            found.append(f"{node.lineno}: {node.id}")
        elif type(node).__name__ == "TryStar":
            found.append(f"{node.lineno}: except*")
    return found


def package_files() -> list[Path]:
    return sorted(p for package in PACKAGES for p in (ROOT / package).rglob("*.py"))


def test_the_checker_finds_each_kind_of_3_11_api():
    source = textwrap.dedent("""
        import asyncio as aio, tomllib
        from typing import Self
        from datetime import UTC
        async def f():
            async with aio.timeout(1):
                pass
            try:
                pass
            except* ValueError as e:
                e.add_note("x")
                raise ExceptionGroup("g", [e])
    """)
    found = "\n".join(newer_api_uses(source))
    for what in ("import tomllib", "from typing import Self", "from datetime import UTC", "asyncio.timeout",
                 "except*", ".add_note", "ExceptionGroup"):
        assert what in found, (what, found)
    assert newer_api_uses("import asyncio\nasyncio.wait_for(x, 1)\nfrom typing import Optional\n") == []


def test_no_module_uses_a_python_3_11_api_outside_compat():
    uses = {str(p.relative_to(ROOT)): newer_api_uses(p.read_text(), str(p)) for p in package_files() if p not in ALLOWED}
    uses = {path: found for path, found in uses.items() if found}
    assert not uses, f"Python 3.11+ APIs (rlsys supports 3.10; use rlsys/compat.py): {uses}"


def python_3_10() -> str | None:
    """A working python3.10: on PATH, or one of pyenv's versions."""
    root = os.environ.get("PYENV_ROOT", os.path.expanduser("~/.pyenv"))
    candidates = [shutil.which("python3.10"), *sorted(glob.glob(f"{root}/versions/3.10*/bin/python3.10"))]
    for candidate in filter(None, candidates):
        try:
            out = subprocess.run([candidate, "-c", "import sys; print(sys.version_info[:2])"], capture_output=True,
                                 text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            continue
        if out.returncode == 0 and out.stdout.strip() == "(3, 10)":
            return candidate
    return None


PYTHON_3_10 = python_3_10()
needs_3_10 = pytest.mark.skipif(PYTHON_3_10 is None, reason="no python3.10 on this machine (pyenv or Debian)")


def run_3_10(script: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([PYTHON_3_10, "-c", textwrap.dedent(script)], capture_output=True, text=True, env=env,
                          cwd=ROOT, timeout=120)


@needs_3_10
def test_every_module_compiles_under_python_3_10():
    """Syntax a newer parser accepts (except*, 3.12's f-strings and `type` aliases) fails here."""
    out = run_3_10(f"""
        import sys
        from pathlib import Path
        bad = []
        for path in {[str(p) for p in package_files()]!r}:
            try:
                compile(Path(path).read_text(), path, "exec")
            except SyntaxError as e:
                bad.append(f"{{path}}:{{e.lineno}}: {{e.msg}}")
        print("\\n".join(bad))
        sys.exit(1 if bad else 0)
    """)
    assert out.returncode == 0, out.stdout + out.stderr


@needs_3_10
def test_the_episode_guard_and_timeouts_work_under_python_3_10():
    """The guard's three outcomes under 3.10: a result, env_timeout past the deadline, env_error for what the env
    raises (its own TimeoutError included); and a timeout the caller suppresses, as the rollout worker's wait does."""
    out = run_3_10("""
        import asyncio, contextlib, sys
        assert sys.version_info[:2] == (3, 10)
        from rlsys import compat
        from rlsys.workers.episode_failure import EpisodeFailed, guard_env

        class Env:
            async def reset(self, seed=None, options=None):
                return "obs", {}
            async def step(self, action):
                if action == "slow":
                    await asyncio.sleep(10)
                if action == "own-timeout":
                    raise TimeoutError("the env's own")
                if action == "bad":
                    raise ValueError("bad action")
                return None, 1.0, True, False, {}
            async def close(self):
                pass
            async def fork(self):
                return Env()

        async def reason(env, action):
            try:
                await env.step(action)
            except EpisodeFailed as e:
                return e.reason
            return "ok"

        async def main():
            env = guard_env(Env(), 0.2)
            assert await env.reset() == ("obs", {})
            outcomes = [await reason(env, a) for a in ("fine", "slow", "own-timeout", "bad")]
            assert outcomes == ["ok", "env_timeout", "env_error", "env_error"], outcomes
            assert await reason(guard_env(Env(), 0), "fine") == "ok"  # 0: no limit
            with contextlib.suppress(TimeoutError):
                async with compat.timeout(0.05):
                    await asyncio.Event().wait()
            async with compat.timeout(None) as deadline:
                await asyncio.sleep(0.01)
            assert not deadline.expired()
            print("ok")

        asyncio.run(main())
    """)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stdout + out.stderr
