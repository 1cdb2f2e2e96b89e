"""``--yaml-cfg FILE``: flag values from a YAML file, under the flags given on the command line.

Keys are flag names, underscored or dashed (``num_layers``, ``num-layers``), at the top level or one
level down in sections: the ``run_config.yaml`` each checkpoint holds (``RunConfig.to_yaml``) has
one section per concern, Megatron-LM's YAML configs have ``language_model`` and ``model_parallel``.
``null`` means "the flag's default", as in Megatron-LM's files. Values are checked as the command
line checks them (type, choices); a key of Megatron-LM's other options is answered as on the command line
(:mod:`.megatron_lm_families`); a key that is no flag is refused, with the nearest flag names.
"""

from __future__ import annotations

import argparse
import difflib
from collections.abc import Mapping
from typing import Any

from .errors import ArgumentError, require
from .megatron_lm_families import GIVEN, Given

# Megatron-LM's YAML names (megatron-core TransformerConfig fields) that differ from the flags'.
_ALIASES = {"layernorm_epsilon": "norm_epsilon", "fp8": "fp8_format", "fp4": "fp4_format"}
_BOOL_ACTIONS = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse.BooleanOptionalAction)


def _flatten(doc: Mapping, path: str) -> dict[str, Any]:
    """{flag dest: value} from the top level and one level of sections; nulls dropped."""
    out: dict[str, Any] = {}
    for key, value in doc.items():
        if isinstance(value, Mapping):
            nested = {k: v for k, v in value.items()}
            require(not any(isinstance(v, Mapping) for v in nested.values()),
                    f"--yaml-cfg {path}: section {key!r} nests another section; flags go at most one level down")
            items = nested.items()
        else:
            items = [(key, value)]
        for k, v in items:
            dest = str(k).replace("-", "_")
            dest = _ALIASES.get(dest, dest)
            require(dest not in out or out[dest] == v, f"--yaml-cfg {path}: {k} is given twice with different values")
            if v is not None:
                out[dest] = v
    return out


def _convert(action: argparse.Action, value: Any, where: str) -> Any:
    """``value`` as the command line would have parsed it for ``action``; ArgumentError if it cannot be."""
    if isinstance(action, _BOOL_ACTIONS):
        require(isinstance(value, bool), f"{where}: expected true or false, not {value!r}")
        return value
    if action.nargs == "+":
        values = value if isinstance(value, list) else [value]
        require(len(values) > 0, f"{where}: expected at least one value")
        return [_one(action, v, where) for v in values]
    require(not isinstance(value, list), f"{where}: expected one value, not a list")
    return _one(action, value, where)


def _one(action: argparse.Action, value: Any, where: str) -> Any:
    require(not isinstance(value, bool), f"{where}: {value!r} is not a {action.type.__name__}")
    try:
        converted = action.type(value if action.type is not str else str(value))
    except (TypeError, ValueError):
        raise ArgumentError(f"{where}: {value!r} is not a {action.type.__name__}") from None
    if action.choices is not None and converted not in action.choices:
        raise ArgumentError(f"{where}: {converted!r} is not one of {', '.join(map(str, action.choices))}")
    return converted


def read_yaml_cfg(path: str, parser: argparse.ArgumentParser) -> dict[str, Any]:
    """The flag values (by dest) that ``path`` sets, checked against ``parser``'s flags."""
    import yaml

    try:
        with open(path) as f:
            doc = yaml.safe_load(f)
    except FileNotFoundError:
        raise ArgumentError(f"--yaml-cfg {path}: no such file") from None
    except yaml.YAMLError as e:
        raise ArgumentError(f"--yaml-cfg {path} is not valid YAML: {' '.join(str(e).split())}") from None
    require(isinstance(doc, Mapping), f"--yaml-cfg {path}: expected a mapping of flag names to values at the top")
    actions = {a.dest: a for a in parser._actions if a.option_strings and a.dest not in ("help", "yaml_cfg", GIVEN)}
    answered = {a.option.dest: a.option for a in parser._actions if isinstance(a, Given)}  # Megatron-LM's others
    values = _flatten(doc, path)
    unknown = sorted(set(values) - set(actions) - set(answered))
    if unknown:
        hints = [f"{k} (did you mean {close[0]}?)" if (close := difflib.get_close_matches(k, actions, 1)) else k
                 for k in unknown]
        verb = "is not a flag" if len(unknown) == 1 else "are not flags"
        raise ArgumentError(f"--yaml-cfg {path}: {', '.join(hints)} {verb} of pretrain_llama.py (keys are flag names "
                            "such as num_layers; see --help)")
    out = {dest: _convert(actions[dest], value, f"--yaml-cfg {path}: {dest}") for dest, value in values.items()
           if dest in actions}
    out[GIVEN] = {dest: (answered[dest], answered[dest].shown(value), value) for dest, value in values.items()
                  if dest in answered}
    return out
