"""Plugins by name: a dotted module or a `.py` file, imported once per process so that what it registers
(experiments, agents, environments, tools) exists. `plugins=[...]` on the command line and an agent's
`module:function` setting are both read here, so both name code the same way."""

import asyncio
import hashlib
import importlib
import importlib.util
import re
import sys
import types
from pathlib import Path

from rlsys.errors import ConfigError


def plugin_entries(value) -> list[str]:
    """`plugins` as a list of strings; a single bare entry (`plugins=my_plugin`) is accepted as well."""
    if value is None or value == "":
        return []
    if isinstance(value, (str, int, float)):
        return [str(value)]
    if isinstance(value, (list, tuple)):
        return [str(entry) for entry in value]
    raise ConfigError(f"plugins must be a list of modules or .py files (plugins=[a,b]), got {value!r}")


def import_plugins(entries: list[str]) -> None:
    """Imports each dotted module name or `.py` file once per process, so what it registers exists."""
    for entry in entries:
        import_plugin(entry)


def import_plugin(entry: str) -> types.ModuleType:
    """The module `entry` names (a dotted name, or a path to a `.py` file), imported once per process."""
    if is_plugin_file(entry):
        import_plugin_file(Path(entry))
        return sys.modules[plugin_module_name(Path(entry))]
    import_plugin_module(entry)
    return sys.modules[entry]


def is_plugin_file(entry: str) -> bool:
    return entry.endswith(".py") or "/" in entry or "\\" in entry


def import_plugin_module(name: str) -> None:
    """A setting the plugin gets wrong as it runs (a name registered twice) is a ConfigError that names it."""
    try:
        importlib.import_module(name)
    except ConfigError as e:
        raise ConfigError(f"plugin {name}: {e}") from None
    except ModuleNotFoundError as e:
        if e.name is None or not (name == e.name or name.startswith(e.name + ".")):
            raise  # the plugin itself imports something missing: its traceback says what
        raise ConfigError(f"cannot import plugin {name!r}: no module named {e.name!r} "
                          f"({file_here_hint(name)})") from None


def file_here_hint(name: str) -> str:
    """What to do when a module named on the command line is not found: a file of that name beside the user is not
    searched (sys.path starts at the script's directory, training/)."""
    file = Path(*name.split(".")).with_suffix(".py")
    if file.is_file():
        return f"{file} is in the current directory, where imports do not look: plugins=[{file}], or PYTHONPATH=."
    return "is it on PYTHONPATH? a file is given by its path, ending in .py"


def plugin_module_name(path: Path) -> str:
    """Stable across processes (workers import the same file), distinct for same-named files elsewhere."""
    resolved = path.resolve()
    stem = re.sub(r"\W", "_", resolved.stem)
    digest = hashlib.sha1(str(resolved).encode()).hexdigest()[:8]
    return f"rlsys_plugin_{stem}_{digest}"


def import_plugin_file(path: Path) -> None:
    if not path.is_file():
        where = "" if path.is_absolute() else f" (relative to the current directory {Path.cwd()}: run where it is, " \
                                              "or give its full path)"
        raise ConfigError(f"plugin file not found: {path}{where}")
    name = plugin_module_name(path)
    if name in sys.modules:
        return  # executing it again would register its classes twice, which the registries refuse
    spec = importlib.util.spec_from_file_location(name, path.resolve())
    module = importlib.util.module_from_spec(spec)
    # Registered before it runs: dataclasses and inspect.getsource look classes' modules up by name.
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except BaseException as e:
        del sys.modules[name]
        if isinstance(e, ConfigError):  # a name registered twice, say
            raise ConfigError(f"plugin {path}: {e}") from None
        raise


def load_function(entry: str, what: str, coroutine: bool):
    """`package.module:function` or `path/to/file.py:function`, imported the way `plugins=[...]` entries are;
    `what` names it in errors, `coroutine` says whether it must be an async function."""
    where, _, name = entry.rpartition(":")
    if not where or not name:
        raise ConfigError(f"{what} {entry!r}: expected module:function or path/to/file.py:function")
    module = import_plugin(where)
    kind = asyncio.iscoroutinefunction if coroutine else (lambda v: callable(v) and not asyncio.iscoroutinefunction(v))
    function = getattr(module, name, None)
    if not kind(function):
        found = sorted(n for n, v in vars(module).items() if kind(v) and not n.startswith("_")
                       and getattr(v, "__module__", None) == module.__name__)
        adjective = "async function" if coroutine else "(plain, not async) function"
        raise ConfigError(f"{what} {entry!r}: {where} has no {adjective} {name!r}; there: {', '.join(found) or 'none'}")
    return function
