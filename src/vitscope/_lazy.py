"""Names a package exports without importing them until first use (PEP 562), so that ``import vitscope`` and
the command line's listings do not pay for torch, timm or matplotlib when they need none of them."""

from __future__ import annotations

import importlib
import sys
import types
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str], submodules: tuple[str, ...] = ()
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: ``exports`` maps each name to the module that defines it,
    ``submodules`` are exported as themselves (``vitscope.metrics``). The value is imported on first access and
    kept in the package's namespace, so later lookups (and ``monkeypatch.setattr``) see an ordinary attribute.

    A name that is also a submodule's (``vitscope.zoo.train``, the function, in ``vitscope/zoo/train.py``) stays
    the exported object: importing a submodule binds it as its package's attribute, which an eager
    ``from .train import train`` used to overwrite; the package's module class does that here."""

    def __getattr__(name: str) -> Any:  # noqa: N807 - the module-level hook's name
        if name in submodules:
            return importlib.import_module(f"{package}.{name}")  # the import binds it as our attribute
        where = exports.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(where), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:  # noqa: N807
        return sorted(set(sys.modules[package].__dict__) | set(exports) | set(submodules))

    class LazyPackage(types.ModuleType):
        def __setattr__(self, name: str, value: Any) -> None:
            if isinstance(value, types.ModuleType) and value.__name__ == f"{package}.{name}" and name in exports:
                value = getattr(value, name)  # the submodule was just imported: its export, not itself
            super().__setattr__(name, value)

    sys.modules[package].__class__ = LazyPackage
    return __getattr__, __dir__
