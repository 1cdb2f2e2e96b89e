"""Configuration fields that are command-line flags, defined once on the dataclass that holds them.

Every concern of a run (model, parallel layout, training, precision, SNIP, data, checkpoint,
logging, safety) has a frozen dataclass. A field made with :func:`flag` *is* a command-line flag:
its name is the flag's (``num_layers`` <-> ``--num-layers``) unless ``dest``/``option`` say
otherwise, its annotation gives the argparse type, and its default, help and choices are the
flag's. A field made with :func:`derived` is filled by validation (``arguments.py``), never by a
flag. From these :func:`add_flags` builds the command line (as Megatron-LM's
``ArgumentGroupFactory`` builds its own from megatron-core's config dataclasses), :func:`flag_rows`
the README's flag table, and :func:`from_flags` / :func:`to_flags` convert between a section and
the flat values a checkpoint saves and ``--yaml-cfg`` reads (keyed by the argparse ``dest``).

Light on purpose: ``--help`` and flag errors are answered without importing torch.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Mapping
from dataclasses import MISSING, fields
from typing import Any, TypeVar

T = TypeVar("T")


def flag(default: Any = None, help: str = "", *, choices: typing.Sequence | None = None, dest: str | None = None,
         option: str | None = None, aliases: tuple[str, ...] = (), metavar: str | None = None, negatable: bool = False,
         ours: bool = False) -> Any:
    """A dataclass field that is a command-line flag.

    Args:
        default: the flag's default (``None``: filled by validation, a preset or a checkpoint).
        help: the help text (argparse's ``%`` escaping applies).
        choices: the values the flag accepts.
        dest: the key in flat flag values when it differs from the field name (``snip`` for ``enabled``).
        option: the option string when it is not ``--`` + dest with dashes (``--no-mmap-bin-files``).
        aliases: more option strings of the same flag (Megatron-LM's ``--disable-...`` spellings).
        metavar: argparse's metavar.
        negatable: a bool flag with a ``--no-`` form (argparse's ``BooleanOptionalAction``).
        ours: not a Megatron-LM flag (this program's own; marked in the flag table).
    """
    meta = {"flag": True, "help": help, "choices": tuple(choices) if choices is not None else None, "dest": dest,
            "option": option, "aliases": tuple(aliases), "metavar": metavar, "negatable": negatable, "ours": ours}
    if isinstance(default, list):
        raise TypeError("flag defaults must be immutable (a tuple, not a list)")
    return dataclasses.field(default=default, metadata=meta)


def derived(default: Any = None) -> Any:
    """A field that validation fills in (``data_parallel_size``, ``num_microbatches``, ...): no flag."""
    return dataclasses.field(default=default, metadata={"flag": False})


def dest_of(f: dataclasses.Field) -> str:
    """The key of field ``f`` in flat flag values (the argparse ``dest``)."""
    return f.metadata.get("dest") or f.name


def option_of(f: dataclasses.Field) -> str:
    """The option string of flag field ``f`` (``--num-layers``)."""
    return f.metadata.get("option") or "--" + dest_of(f).replace("_", "-")


def is_flag(f: dataclasses.Field) -> bool:
    return bool(f.metadata.get("flag"))


def flag_fields(cls: type) -> list[dataclasses.Field]:
    """The fields of section ``cls`` that are command-line flags, in declaration order."""
    return [f for f in fields(cls) if is_flag(f)]


def _base_type(annotation: Any) -> tuple[type, bool]:
    """(element type, is a sequence) of a field annotation: ``int | None`` -> (int, False),
    ``tuple[str, ...] | None`` -> (str, True)."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        if len(rest) != 1:
            raise TypeError(f"a flag field takes one type (or it and None), not {annotation}")
        return _base_type(rest[0])
    if typing.get_origin(annotation) is tuple:
        return args[0], True
    return annotation, False


def argparse_kwargs(f: dataclasses.Field, annotation: Any) -> dict[str, Any]:
    """What ``add_argument`` takes for flag field ``f`` with type ``annotation``."""
    meta = f.metadata
    base, many = _base_type(annotation)
    kwargs: dict[str, Any] = {"dest": dest_of(f), "default": f.default, "help": meta["help"] or None}
    if base is bool:
        if meta["negatable"]:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif f.default is True:
            if not option_of(f).startswith("--no-"):
                raise TypeError(f"{f.name}: a bool flag that defaults to True needs a --no-... option or negatable")
            kwargs["action"] = "store_false"
        else:
            kwargs["action"] = "store_true"
        return kwargs
    kwargs["type"] = base
    if many:
        kwargs["nargs"] = "+"
    if meta["choices"] is not None:
        kwargs["choices"] = list(meta["choices"])
    if meta["metavar"] is not None:
        kwargs["metavar"] = meta["metavar"]
    return kwargs


def add_flags(parser: argparse.ArgumentParser, cls: type, title: str) -> None:
    """An argument group ``title`` with every flag field of section ``cls``."""
    group = parser.add_argument_group(title)
    hints = typing.get_type_hints(cls)
    for f in flag_fields(cls):
        group.add_argument(option_of(f), *f.metadata["aliases"], **argparse_kwargs(f, hints[f.name]))


def defaults(cls: type) -> dict[str, Any]:
    """The flag defaults of section ``cls`` by dest (what an empty command line gives)."""
    return {dest_of(f): f.default for f in flag_fields(cls)}


def from_flags(cls: type[T], flags: Mapping[str, Any]) -> T:
    """An instance of section ``cls`` from flat flag values (lists become tuples: sections are frozen).
    A field missing from ``flags`` keeps its default (a checkpoint saved before the flag existed);
    KeyError names a required field that is missing."""
    values = {}
    for f in fields(cls):
        key = dest_of(f)
        if key not in flags:
            if f.default is MISSING:
                raise KeyError(key)
            continue
        value = flags[key]
        values[f.name] = tuple(value) if isinstance(value, list) else value
    return cls(**values)


def to_flags(section) -> dict[str, Any]:
    """The flat values of a section by dest (tuples as lists, as argparse gives them)."""
    return {dest_of(f): list(v) if isinstance(v := getattr(section, f.name), tuple) else v for f in fields(section)}


def flag_rows(cls: type) -> list[tuple[str, str, str, bool]]:
    """(option, default as text, help text, Megatron-LM's flag) for every flag of ``cls``, for the
    generated flag documentation."""
    rows = []
    for f in flag_fields(cls):
        default = f.default
        if isinstance(default, bool) or default is None:
            shown = "" if default in (None, False) else "on"
        elif isinstance(default, tuple):
            shown = " ".join(map(str, default))
        else:
            shown = str(default)
        text = (f.metadata["help"] or "").replace("%%", "%")
        if f.metadata["aliases"]:
            text += f" Also spelled {', '.join(f.metadata['aliases'])}."
        rows.append((option_of(f), shown, text, not f.metadata["ours"]))
    return rows


def flag_values(section) -> dict[str, Any]:
    """The flag values of ``section`` by dest, as a config file states them (tuples as lists); a value
    its flag's choices do not accept (a loaded checkpoint's shape label in ``model_preset``) is left out."""
    out = {}
    for f in flag_fields(type(section)):
        value = getattr(section, f.name)
        choices = f.metadata["choices"]
        values = set(value if isinstance(value, tuple) else [value])
        if value is not None and choices is not None and not values <= set(choices):
            continue
        out[dest_of(f)] = list(value) if isinstance(value, tuple) else value
    return out


def sections_to_yaml(sections: Mapping[str, Any], header: str = "") -> str:
    """YAML with one mapping of flag values per section (what ``--yaml-cfg`` reads back); ``header``
    becomes leading comment lines. A section whose flags imply each other says what to write in a
    ``file_values()`` method (default: :func:`flag_values`)."""
    import yaml

    comments = "".join(f"# {line}\n".replace("# \n", "#\n") for line in header.splitlines())
    values = {name: section.file_values() if hasattr(section, "file_values") else flag_values(section)
              for name, section in sections.items()}
    body = yaml.safe_dump(values, sort_keys=False, default_flow_style=False, width=120)
    return comments + body
