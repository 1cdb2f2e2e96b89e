"""Typed configuration sections <-> Megatron-style flag values.

Each concern (model, parallel, precision, SNIP, data, training, checkpoint, logging, safety) has a
frozen dataclass whose fields are named after the command-line flags that set them (``--num-layers``
-> ``num_layers``), unless a field's metadata names another flag (``metadata={"flag": ...}``).
``arguments.py`` validates the flags once and builds every section with :func:`from_flags`; a
checkpoint saves the flat values (:func:`to_flags`), so old checkpoints' saved arguments keep loading.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import fields
from typing import Any, TypeVar

T = TypeVar("T")


def _flag(f) -> str:
    return f.metadata.get("flag", f.name)


def from_flags(cls: type[T], flags: Mapping[str, Any]) -> T:
    """An instance of the dataclass ``cls`` from flat flag values (lists become tuples: sections are frozen).
    KeyError names a flag the mapping lacks."""
    values = {}
    for f in fields(cls):
        value = flags[_flag(f)]
        values[f.name] = tuple(value) if isinstance(value, list) else value
    return cls(**values)


def to_flags(section) -> dict[str, Any]:
    """The flat flag values of a section (tuples as lists, as argparse gives them)."""
    return {_flag(f): list(v) if isinstance(v := getattr(section, f.name), tuple) else v for f in fields(section)}
