"""``pretrain_llama.py``'s command line, generated from the configuration sections' flag fields.

Each section of :class:`~megatron_snip.training.config.RunConfig` (and the Megatron-LM script flags
of :mod:`.megatron_lm`) defines its flags once; this module only assembles them, with ``--yaml-cfg``
(Megatron-LM's flag: flag values from a file, command-line flags on top).
"""

from __future__ import annotations

import argparse

from megatron_snip.flags import add_flags
from megatron_snip.training.config import SECTIONS

from .config_file import read_yaml_cfg
from .megatron_lm import MegatronLMFlags

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


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pretrain_llama.py",
        description="Pretrain a Llama-family model with megatron-core (TP x PP x DP).",
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
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Parse ``argv`` (default: the command line) over the values of ``--yaml-cfg``, if given.
    argparse exits on --help and syntax errors; a bad YAML file raises ArgumentError."""
    parser = build_parser()
    given, _ = parser.parse_known_args(argv)
    if given.yaml_cfg is not None:
        parser.set_defaults(**read_yaml_cfg(given.yaml_cfg, parser))
    return parser.parse_args(argv)
