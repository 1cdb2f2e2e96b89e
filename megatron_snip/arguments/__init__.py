"""The command line's edge: flags generated from the configuration sections, ``--yaml-cfg``, and
validation into the run's typed :class:`~megatron_snip.training.config.RunConfig`."""

from .errors import ArgumentError
from .parser import build_parser, parse_args
from .validation import checkpoint_config, parse_config, resolve

__all__ = ["ArgumentError", "build_parser", "checkpoint_config", "parse_args", "parse_config",
           "resolve"]
