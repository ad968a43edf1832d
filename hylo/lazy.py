"""A package's names loaded on first use (PEP 562), so that importing the package for one light name (a config,
a parser) does not import torch and the rest of what its other modules need.

    __getattr__, __dir__, __all__ = lazy_exports(__name__, {"config": ("ConvertConfig",), "model": ("convert",)})
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, exports: dict[str, tuple[str, ...]]
                 ) -> tuple[Callable[[str], Any], Callable[[], list[str]], list[str]]:
    """`package`'s `__getattr__`, `__dir__` and `__all__`: each name of `exports` ({module: names}) is imported
    from `package.module` when first asked for, then kept in the package's namespace."""
    where = {name: module for module, names in exports.items() for name in names}

    def __getattr__(name: str) -> Any:
        module = where.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f"{package}.{module}"), name)
        setattr(sys.modules[package], name, value)
        return value

    def __dir__() -> list[str]:
        return sorted(set(vars(sys.modules[package])) | set(where))

    return __getattr__, __dir__, sorted(where)
