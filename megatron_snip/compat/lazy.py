"""Package faces that import their names on first use (PEP 562), so importing a package stays cheap."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from importlib import import_module


def lazy_getattr(package: str, exports: Mapping[str, str]) -> Callable[[str], object]:
    """A module ``__getattr__`` for ``package``: ``name`` is imported from the submodule
    ``exports[name]`` when it is first asked for; any other name is an AttributeError."""

    def __getattr__(name: str):
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        return getattr(import_module(f".{exports[name]}", package), name)

    return __getattr__
