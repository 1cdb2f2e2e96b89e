"""The precision flags: the quantization recipe (given, else the resumed checkpoint's, else the default),
Megatron-LM's FP8 / FP4 switches, and the fused kernels' requirements."""

from __future__ import annotations

import argparse
import importlib.util
import os
from typing import TYPE_CHECKING

from megatron_snip.numerics.registry import FP4_NAMES
from megatron_snip.precision.config import RECIPE_DEFAULTS

from .errors import require

if TYPE_CHECKING:
    from megatron_snip.training.checkpoint_record import CheckpointRecord


def validate_precision(args: argparse.Namespace, cuda: bool, resumed: CheckpointRecord | None) -> None:
    """Fill the recipe flags (given > the resumed checkpoint's > defaults), noting for the start-up
    log where a given flag replaces the checkpoint's value (``args.precision_notes``)."""
    require(args.fp4_format is None or args.fp8_format is None,
            "--fp4-format and --fp8-format cannot be used together (as in Megatron-LM): choose one")
    if args.precision is None and args.fp8_format is not None:
        args.precision = "fp8"  # as in Megatron: --fp8-format alone turns fp8 on
    if args.fp4_format is not None:  # Megatron-LM's switch for NVFP4 (with --fp4-recipe)
        require(args.precision in (None, "fp4", *FP4_NAMES),
                f"--fp4-format {args.fp4_format} turns FP4 on but --precision is {args.precision}; drop one of them")
        args.precision = args.precision or "fp4"
    saved = resumed.args if resumed is not None else {}
    args.precision_notes = []
    given = {key: getattr(args, key) for key in RECIPE_DEFAULTS}
    for key, default in RECIPE_DEFAULTS.items():
        kept = saved.get(key)
        if given[key] is None:
            setattr(args, key, kept if kept is not None else default)
        elif kept is not None and kept != given[key]:
            args.precision_notes.append(f"--{key.replace('_', '-')} {given[key]} replaces the checkpoint's {kept}")
    notice = _fp8_recipe_notice(args, given, saved.get("fp8_recipe"))
    if notice:
        args.notices.append(notice)
    for flag in ("num_layers_at_start_in_bf16", "num_layers_at_end_in_bf16"):
        require(0 <= getattr(args, flag) <= args.num_layers,
                f"--{flag.replace('_', '-')} must lie in [0, --num-layers {args.num_layers}]")
    require(args.fp8_amax_history_len >= 1, "--fp8-amax-history-len must be >= 1")
    if args.quant_kernels == "triton":
        require(importlib.util.find_spec("triton") is not None,
                "--quant-kernels triton needs the triton package (pip install triton); use --quant-kernels torch")
        require(cuda or os.environ.get("TRITON_INTERPRET") == "1",
                "--quant-kernels triton needs CUDA (or TRITON_INTERPRET=1 to run the kernels in Triton's "
                "slow CPU interpreter); use --quant-kernels torch or auto")


# What each FP8 recipe scales by (for the notice below).
_FP8_SCALING = {"tensorwise": "each tensor scaled by its own current amax, no history",
                "blockwise": "scaled per 1x128 / 128x128 block", "mxfp8": "scaled per 32-element block"}

_DELAYED_ONLY = ("fp8_amax_history_len", "fp8_amax_compute_algo", "fp8_margin")


def _fp8_recipe_notice(args: argparse.Namespace, given: dict, kept_recipe: str | None) -> str | None:
    """One line where Megatron-LM's FP8 flags would mean delayed scaling there but do not here: delayed-scaling
    settings given for another recipe, or --fp8-format (Megatron-LM's FP8 switch) without --fp8-recipe, whose
    default differs (delayed there, tensorwise here). None where nothing differs."""
    if args.fp8_recipe == "delayed":
        return None
    unused = [f"--{key.replace('_', '-')} {given[key]}" for key in _DELAYED_ONLY
              if given[key] is not None and given[key] != RECIPE_DEFAULTS[key]]
    defaulted = given["fp8_recipe"] is None and kept_recipe is None
    default = " (this program's default)" if defaulted else ""
    runs = f"FP8 runs --fp8-recipe {args.fp8_recipe}{default}: {_FP8_SCALING[args.fp8_recipe]}"
    if unused:
        return (f"{' '.join(unused)}: delayed-scaling settings that do nothing here; {runs}; add --fp8-recipe delayed "
                f"for Megatron-LM's delayed scaling with them (its default recipe)")
    if defaulted and given["fp8_format"] is not None:  # wherever FP8 runs: --precision fp8, a plan, SNIP
        return (f"--fp8-format {given['fp8_format']} without --fp8-recipe: {runs} (stateless, so a module a plan "
                f"switches to FP8 is scaled right from its first step); Megatron-LM's default is delayed scaling: "
                f"add --fp8-recipe delayed for it")
    return None
