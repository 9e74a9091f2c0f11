"""`py:<module>:<name>` references: user code a swarm spec names, loaded and pinned by digest.

A spec may name code of its members' own: a model factory (`model = "py:mypkg.models:make"`) or
an outer optimizer class (`optimizer = "py:outer/mine.py:MyOuter"`). Every peer must run the same
code, so the spec also pins a digest of its source, and a peer whose copy differs refuses to
join with a one-line message.

    <module>  a dotted module name importable on every peer (`mypkg.models`), or the path of a
              .py file (any <module> ending in .py or holding a "/": `outer/mine.py`)
    <name>    an attribute of that module (a function or a class)

`source_digest` hashes the module's source file and the attribute's name (its own imports are
not followed: pin a package by its version elsewhere). `load` imports a path under a private
module name derived from the absolute path, once per process. Every failure — a missing file, a
module that does not import, an attribute that is not there — is a one-line `ConfigError` that
starts with `what` (e.g. "model py:x.py:make").

Not here: what the loaded object must be (a model factory: models/sources.py; an outer
optimizer: node/trainer.py).
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

import blake3

from meshtrain.errors import ConfigError

PREFIX = "py:"
_DOMAIN = b"meshtrain/py-source/v1\n"


@dataclass(frozen=True)
class PyRef:
    """A parsed `py:<module>:<name>`; `value` is the text as written."""

    value: str
    module: str
    name: str

    @property
    def is_path(self) -> bool:
        return self.module.endswith(".py") or "/" in self.module

    @classmethod
    def parse(cls, value: str) -> PyRef:
        """ValueError (for pydantic validators) when `value` is not `py:<module>:<identifier>`."""
        if value.startswith(PREFIX):
            module, _, name = value[len(PREFIX) :].rpartition(":")
            if module and name.isidentifier():
                return cls(value, module, name)
        raise ValueError("must be py:<module or file.py>:<name>")

    def source_file(self) -> Path:
        """The module's source file on this machine."""
        if self.is_path:
            path = Path(self.module).expanduser().resolve()
            if not path.is_file():
                raise ConfigError(f"{self.value}: {path} does not exist on this machine")
            return path
        try:
            spec = importlib.util.find_spec(self.module)
        except (ImportError, ValueError) as e:
            raise ConfigError(f"{self.value}: cannot find module {self.module} ({e})") from None
        if spec is None or not spec.origin or not Path(spec.origin).is_file():
            raise ConfigError(f"{self.value}: module {self.module} is not importable here (or has no source file)")
        return Path(spec.origin)

    def source_digest(self) -> str:
        """blake3 of the attribute's name and its module's source file (32 hex)."""
        path = self.source_file()
        try:
            source = path.read_bytes()
        except OSError as e:
            raise ConfigError(f"{self.value}: cannot read {path}: {e.strerror or e}") from None
        h = blake3.blake3(_DOMAIN)
        for part in (self.name.encode(), source):
            h.update(len(part).to_bytes(8, "little") + part)
        return h.hexdigest()[:32]

    def load(self) -> object:
        """The attribute, its module imported (a path: once per process)."""
        module = self._import()
        if not hasattr(module, self.name):
            raise ConfigError(f"{self.value}: {self.module} has no attribute {self.name}")
        return getattr(module, self.name)

    def _import(self) -> ModuleType:
        if not self.is_path:
            try:
                return importlib.import_module(self.module)
            except ImportError as e:
                raise ConfigError(f"{self.value}: cannot import {self.module} ({e})") from None
            except Exception as e:  # noqa: BLE001 - the user's module failed while importing
                raise ConfigError(f"{self.value}: importing {self.module} failed: {type(e).__name__}: {e}") from None
        path = self.source_file()
        name = "meshtrain_user_" + hashlib.blake2b(str(path).encode(), digest_size=6).hexdigest()
        module = sys.modules.get(name)
        if module is not None:
            return module
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None:
            raise ConfigError(f"{self.value}: {path} is not a Python source file")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except Exception as e:  # noqa: BLE001 - the user's file failed while importing
            del sys.modules[name]
            raise ConfigError(f"{self.value}: importing {path} failed: {type(e).__name__}: {e}") from None
        return module
