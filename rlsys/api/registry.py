"""A name -> class registry whose errors say what is registered and what is accepted."""

import difflib
import inspect
from typing import Any, Generic, TypeVar

from rlsys.errors import ConfigError

T = TypeVar("T")


def close_matches(word: str, candidates) -> list[str]:
    """The candidates that look like `word`, best first (for 'did you mean' messages)."""
    return difflib.get_close_matches(word, list(candidates), n=3, cutoff=0.6)


class Registry(Generic[T]):
    """Maps plugin names to classes; `kind` ("agent", "environment") names them in errors, and a class registered
    must subclass `base`, if one is given."""

    def __init__(self, kind: str, base: type | None = None):
        self.kind, self.base = kind, base
        self._classes: dict[str, type[T]] = {}

    def register(self, name: str, cls: type[T]) -> None:
        if not isinstance(name, str) or not name:
            raise ConfigError(f"register_{self.kind}(name, cls) takes the name first, a non-empty string; got {name!r}")
        if not isinstance(cls, type) or not issubclass(cls, self.base or object):
            wanted = f"a subclass of {self.base.__name__} (rlsys.api)" if self.base else "a class"
            raise ConfigError(f"register_{self.kind}({name!r}, cls) takes {wanted} as cls, got {cls!r}")
        if name in self._classes:
            raise ConfigError(f"{self.kind} {name!r} is already registered (by {self._classes[name].__module__}."
                              f"{self._classes[name].__qualname__}): register yours under another name; registered "
                              f"{self.kind}s: {self.names()}")
        self._classes[name] = cls

    def names(self) -> list[str]:
        return sorted(self._classes)

    def lookup(self, name: str) -> type[T]:
        if name not in self._classes:
            hint = close_matches(name, self._classes)
            did_you_mean = f" Did you mean {hint}?" if hint else ""
            raise KeyError(f"unknown {self.kind} {name!r}.{did_you_mean} Registered {self.kind}s: {self.names()}")
        return self._classes[name]

    def check(self, name: str, args: dict[str, Any]) -> type[T]:
        """The class registered as `name`, if its constructor takes `args` (KeyError, TypeError otherwise); nothing
        is built."""
        cls = self.lookup(name)
        signature = inspect.signature(cls.__init__)
        try:
            signature.bind(None, **args)
        except TypeError as e:
            accepted = [p for p in signature.parameters if p != "self"]
            # bind names one fault, a missing arg before an unknown one, and a typo of a required arg is both
            takes_any = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
            said = "".join(f"; unknown: {a!r}" + "".join(f" (did you mean {m!r}?)"
                                                    for m in close_matches(a, accepted)[:1])
                           for a in args if not takes_any and a not in accepted)
            raise TypeError(f"{self.kind} {name!r} ({cls.__qualname__}) cannot take args {sorted(args)}: {e}{said}. "
                            f"It accepts: {accepted}") from None
        return cls

    def make(self, name: str, args: dict[str, Any]) -> T:
        return self.check(name, args)(**args)
