"""Precision plans: which precision every linear module of the model runs in.

A plan maps *global* module names to :class:`Precision`, with a default for
modules it does not list. Names are megatron-core's module paths inside
``GPTModel`` with the 0-based global layer index (the same on every pipeline
stage): ``decoder.layers.{i}.self_attention.linear_qkv``, ``...linear_proj``,
``decoder.layers.{i}.mlp.linear_fc1``, ``...linear_fc2``.

JSON form (``version`` 1), as saved in checkpoints and given as a plan file::

    {"version": 1, "default": "bf16",
     "modules": {"decoder.layers.0.mlp.linear_fc1": "nvfp4",
                 "decoder.layers.0.self_attention.linear_qkv": "fp8/bf16"}}

Precisions are written as ``str(Precision)``: "nvfp4", or "fwd/bwd".
"""

from __future__ import annotations

import json
import os
import re
import types
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

from megatron_snip.fileio import write_text_atomic
from megatron_snip.numerics.recipes import BF16, Precision

PLAN_VERSION = 1
# The linear modules of one transformer layer, in execution order, relative to the layer.
LINEAR_MODULES = (
    "self_attention.linear_qkv",
    "self_attention.linear_proj",
    "mlp.linear_fc1",
    "mlp.linear_fc2",
)
_NAME = re.compile(r"decoder\.layers\.(0|[1-9]\d*)\.(" + "|".join(re.escape(m) for m in LINEAR_MODULES) + r")")


class PlanError(ValueError):
    """A plan that cannot be read or does not fit the model; the message names the source."""


def module_name(layer: int, module: str) -> str:
    """Global name of linear ``module`` (one of ``LINEAR_MODULES``) in 0-based global ``layer``."""
    if module not in LINEAR_MODULES:
        raise ValueError(f"unknown linear module {module!r}; valid: {', '.join(LINEAR_MODULES)}")
    return f"decoder.layers.{layer}.{module}"


def module_names(num_layers: int) -> list[str]:
    """All linear modules of a ``num_layers``-layer model, layer by layer, in execution order."""
    return [module_name(layer, m) for layer in range(num_layers) for m in LINEAR_MODULES]


def parse_module_name(name: str) -> tuple[int, str]:
    """``"decoder.layers.3.mlp.linear_fc1"`` -> ``(3, "mlp.linear_fc1")``; ValueError otherwise."""
    match = _NAME.fullmatch(name)
    if match is None:
        raise ValueError(
            f"{name!r} is not a linear module name; expected decoder.layers.<i>.<module> "
            f"with <module> one of {', '.join(LINEAR_MODULES)}"
        )
    return int(match.group(1)), match.group(2)


def end_layers(num_layers: int, first_n: int, last_n: int) -> list[int]:
    """The first ``first_n`` and last ``last_n`` of ``num_layers`` layers (0-based, ascending, each once):
    the layers Megatron's ``--first-last-layers-bf16`` keeps in bf16."""
    for flag, n in (("first_n", first_n), ("last_n", last_n)):
        if not 0 <= n <= num_layers:
            raise ValueError(f"{flag} must be in [0, {num_layers}] for a {num_layers}-layer model, got {n}")
    return sorted({*range(first_n), *range(num_layers - last_n, num_layers)})


def _sort_key(name: str) -> tuple[int, int]:
    layer, module = parse_module_name(name)
    return layer, LINEAR_MODULES.index(module)


@dataclass(frozen=True)
class PrecisionPlan:
    """Global module name -> precision; ``default`` for modules not listed.

    Canonical form: entries equal to the default are dropped, so two plans that
    give every module the same precision and have the same default compare equal.
    ``modules`` is read-only and ordered layer by layer.
    """

    modules: Mapping[str, Precision] = field(default_factory=dict)
    default: Precision = BF16

    def __post_init__(self):
        for name, precision in self.modules.items():
            parse_module_name(name)
            if not isinstance(precision, Precision):
                raise TypeError(f"{name}: expected a Precision, got {precision!r}")
        kept = {n: self.modules[n] for n in sorted(self.modules, key=_sort_key) if self.modules[n] != self.default}
        object.__setattr__(self, "modules", types.MappingProxyType(kept))

    @classmethod
    def uniform(cls, name: str | Precision) -> PrecisionPlan:
        """Every module in one precision (``"nvfp4"``, ``"fp8/bf16"`` or a Precision)."""
        return cls(default=name if isinstance(name, Precision) else Precision.parse(name))

    def __reduce__(self):
        # Pickled by torch.distributed's object collectives (a SNIP cycle's plan, broadcast from rank 0);
        # the read-only view of ``modules`` cannot be pickled, its plain copy can.
        return type(self), (dict(self.modules), self.default)

    def __getitem__(self, name: str) -> Precision:
        """Precision of module ``name`` (the default when not listed)."""
        return self.modules.get(name, self.default)

    def with_ends_bf16(self, num_layers: int, first_n: int = 1, last_n: int = 1) -> PrecisionPlan:
        """This plan with the first ``first_n`` and last ``last_n`` layers in bf16
        (Megatron's ``--first-last-layers-bf16``, ``--num-layers-at-start-in-bf16``,
        ``--num-layers-at-end-in-bf16``)."""
        ends = end_layers(num_layers, first_n, last_n)
        return PrecisionPlan({**self.modules, **{module_name(i, m): BF16 for i in ends for m in LINEAR_MODULES}},
                             self.default)

    def validate(self, num_layers: int, source: str = "plan") -> None:
        """Raise :class:`PlanError` if the plan names a layer a ``num_layers``-layer model lacks."""
        beyond = [n for n in self.modules if parse_module_name(n)[0] >= num_layers]
        if beyond:
            raise PlanError(f"{source}: the model has {num_layers} layers (0..{num_layers - 1}) but the plan "
                            f"names {len(beyond)} module(s) beyond them, e.g. {beyond[0]}")

    def diff(self, other: PrecisionPlan, num_layers: int) -> dict[str, tuple[Precision, Precision]]:
        """Modules of a ``num_layers``-layer model whose precision differs: name -> (self's, other's)."""
        return {n: (self[n], other[n]) for n in module_names(num_layers) if self[n] != other[n]}

    def to_dict(self) -> dict:
        """The JSON-ready form (see the module docstring)."""
        return {"version": PLAN_VERSION, "default": str(self.default),
                "modules": {n: str(p) for n, p in self.modules.items()}}

    @classmethod
    def from_dict(cls, data: object, source: str = "plan") -> PrecisionPlan:
        """Inverse of :meth:`to_dict`; :class:`PlanError` naming ``source`` and the problem."""
        if not isinstance(data, dict):
            raise PlanError(f"{source}: expected a JSON object, got {type(data).__name__}")
        unknown = sorted(set(data) - {"version", "default", "modules"})
        if unknown:
            raise PlanError(f"{source}: unknown key(s) {', '.join(map(repr, unknown))}; "
                            "a plan has 'version', 'default' and 'modules'")
        if data.get("version") != PLAN_VERSION:
            raise PlanError(f"{source}: unsupported plan version {data.get('version')!r} "
                            f"(this program reads version {PLAN_VERSION})")
        modules = data.get("modules", {})
        if not isinstance(modules, dict):
            raise PlanError(f"{source}: 'modules' must be an object of module name -> precision")
        default = _parse_precision(data.get("default", str(BF16)), source, "default")
        parsed = {}
        for name, text in modules.items():
            try:
                parse_module_name(name)
            except ValueError as e:
                raise PlanError(f"{source}: {e}") from None
            parsed[name] = _parse_precision(text, source, f"module {name}")
        return cls(parsed, default)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2) + "\n"

    @classmethod
    def from_json(cls, text: str, source: str = "<string>") -> PrecisionPlan:
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            raise PlanError(f"{source}: not valid JSON ({e})") from None
        return cls.from_dict(data, source)

    def save(self, path: str | os.PathLike) -> None:
        """Write the JSON form atomically (a reader never sees a partial file)."""
        write_text_atomic(path, self.to_json())

    @classmethod
    def load(cls, path: str | os.PathLike) -> PrecisionPlan:
        return cls.from_json(Path(path).read_text(), source=str(path))


def _parse_precision(text: object, source: str, where: str) -> Precision:
    if not isinstance(text, str):
        raise PlanError(f"{source}: {where}: precision must be a string, got {text!r}")
    try:
        return Precision.parse(text)
    except ValueError as e:
        raise PlanError(f"{source}: {where}: {e}") from None

