"""Names a package exports without importing them until first use (PEP 562), so that ``import vitscope`` and
the command line's listings do not pay for torch, timm or matplotlib when they need none of them."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, str]) -> tuple[Callable[[str], Any], Callable[[], list[str]]]:
    """``__getattr__`` and ``__dir__`` for ``package``: ``exports`` maps each name to the module that defines it
    (a name mapped to its own module path is that submodule). The value is imported on first access and kept in
    the package's namespace, so later lookups (and ``monkeypatch.setattr``) see an ordinary attribute."""

    def __getattr__(name: str) -> Any:  # noqa: N807 - the module-level hook's name
        where = exports.get(name)
        if where is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        module = importlib.import_module(where)
        value = module if where == f"{package}.{name}" else getattr(module, name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:  # noqa: N807
        return sorted(set(sys.modules[package].__dict__) | set(exports))

    return __getattr__, __dir__
