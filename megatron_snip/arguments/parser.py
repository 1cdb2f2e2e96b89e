"""``pretrain_llama.py``'s command line, generated from the configuration sections' flag fields.

Each section of :class:`~megatron_snip.training.config.RunConfig` (and the Megatron-LM script flags
of :mod:`.megatron_lm`) defines its flags once; this module only assembles them, with ``--yaml-cfg``
(Megatron-LM's flag: flag values from a file, command-line flags on top) and Megatron-LM's other options
(:mod:`.megatron_lm_families`, hidden from ``--help``). A flag error (an unknown flag, a bad or missing value)
is an :class:`ArgumentError` of one line naming the flag and what would be right, never argparse's usage.
"""

from __future__ import annotations

import argparse
import difflib
import re

from megatron_snip.flags import add_flags
from megatron_snip.training.config import SECTIONS

from .config_file import read_yaml_cfg
from .errors import ArgumentError
from .megatron_lm import MegatronLMFlags
from .megatron_lm_families import MEGATRON_LM_OPTIONS, add_megatron_lm_options

# Help-group titles of the sections, in SECTIONS' order.
TITLES = {
    "model": "model (defaults: --model-preset, the checkpoint in --load, else Megatron-LM's)",
    "parallel": "parallelism",
    "training": "training",
    "precision": "precision of the linear layers (docs/numerics.md)",
    "snip": "SNIP adaptive precision (docs/snip.md)",
    "data": "data",
    "checkpoint": "checkpointing",
    "logging": "evaluation and logging",
    "safety": "faults and numerical safety (docs/faults.md)",
}
SCRIPT_FLAGS_TITLE = "Megatron-LM script flags (converted, fixed by Llama, or refused with the reason)"
EPILOG = ("Every other option of Megatron-LM 0.16.1 is accepted as well and answered at start-up: accepted, accepted "
          "with a one-line notice of what runs here instead, or refused with the reason (docs/megatron_compat.md).")
_KINDS = {"int": "a whole number", "float": "a number"}


class _Parser(argparse.ArgumentParser):
    """argparse, its errors raised as one :class:`ArgumentError` line instead of the usage and exit 2."""

    def error(self, message: str):
        raise ArgumentError(_one_line(message))


def _one_line(message: str) -> str:
    """argparse's error ``message`` as a line that names the flag and what would be right."""
    flag = re.match(r"argument (\S+?)(?:/\S+)?: (.*)", message)
    if flag is None:
        return message
    name, what = flag.groups()
    if bad := re.fullmatch(r"invalid (\w+) value: (.*)", what):
        kind, value = bad.groups()
        return f"{name} {value}: expected {_KINDS.get(kind, kind)}"
    if bad := re.fullmatch(r"invalid choice: (.*?) \(choose from (.*)\)", what):
        return f"{name} {bad.group(1)}: expected one of {bad.group(2)}"
    if re.fullmatch(r"expected one argument", what):
        return f"{name} needs a value: {name} VALUE"
    if re.fullmatch(r"expected at least one argument", what):
        return f"{name} needs one or more values: {name} VALUE [VALUE ...]"
    if count := re.fullmatch(r"expected (\d+) arguments", what):
        return f"{name} needs {count.group(1)} values"
    if value := re.fullmatch(r"ignored explicit argument (.*)", what):
        return f"{name} takes no value (a switch); drop ={value.group(1).strip(chr(39))}"
    return f"{name}: {what}"


def _unknown(extras: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """A problem for each flag in ``extras`` (what argparse did not recognize), with the closest spelling of this
    program's or Megatron-LM's flags; values that followed an unknown flag are left out."""
    known = sorted(set(parser._option_string_actions) | {s for o in MEGATRON_LM_OPTIONS for s in o.spellings})
    problems, after_flag = [], False
    for item in extras:
        if not item.startswith("-"):
            if not after_flag:
                problems.append(f"{item!r}: a value without a flag (flags start with --)")
            continue
        after_flag = True
        name = item.split("=", 1)[0]
        close = difflib.get_close_matches(name, known, n=1, cutoff=0.7)
        hint = f"; did you mean {close[0]}?" if close else " (python pretrain_llama.py --help lists them)"
        problems.append(f"{name}: no such flag of pretrain_llama.py or Megatron-LM{hint}")
    return problems


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="pretrain_llama.py",
        description="Pretrain a Llama-family model with megatron-core (TP x PP x DP).",
        epilog=EPILOG,
        allow_abbrev=False,
    )
    p.add_argument("--yaml-cfg", default=None, metavar="FILE.yaml",
                   help="Flag values from a YAML file (Megatron-LM's flag): keys are flag names (num_layers or "
                        "num-layers), at the top level or one level down in sections (as in the run_config.yaml "
                        "every checkpoint holds, or Megatron-LM's language_model/model_parallel); flags given on "
                        "the command line override the file.")
    for name, cls in SECTIONS.items():
        add_flags(p, cls, TITLES[name])
    add_flags(p, MegatronLMFlags, SCRIPT_FLAGS_TITLE)
    add_megatron_lm_options(p)
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` (default: the command line) over the values of ``--yaml-cfg``, if given.
    argparse exits on --help; a flag error or a bad YAML file raises ArgumentError (every unknown flag at once)."""
    parser = build_parser()
    given, _ = parser.parse_known_args(argv)
    if given.yaml_cfg is not None:
        parser.set_defaults(**read_yaml_cfg(given.yaml_cfg, parser))
    args, extras = parser.parse_known_args(argv)
    if extras:
        raise ArgumentError(*_unknown(extras, parser))
    return args
