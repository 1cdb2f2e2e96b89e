"""The checkpoint a run resumes from or starts with, read once at validation: its record, and the model shape
it fills into the flags (a disagreeing flag or ``--model-preset`` refused, naming both values)."""

from __future__ import annotations

import argparse
import os
from typing import TYPE_CHECKING

from megatron_snip.data.config import NULL_TOKENIZER
from megatron_snip.model import checkpoint_shape
from megatron_snip.model.presets import PRESETS

from .errors import ArgumentError, require

if TYPE_CHECKING:  # imported where used: --help and flag errors need no megatron-core (seconds of imports)
    from megatron_snip.training.checkpoint_record import CheckpointRecord


def read_checkpoint(args: argparse.Namespace) -> CheckpointRecord | None:
    """The record of the checkpoint in ``--load`` (None: no --load, or a resume-or-start
    directory without a checkpoint yet), read once: this program's, or Megatron-LM's translated (a model it
    describes that cannot be built here is refused, one problem per field); its model shape fills the shape
    flags, and flags or a ``--model-preset`` that disagree are refused. Where --load holds none (or is not
    given), that of ``--pretrained-checkpoint``, whose weights the run starts from (``args.from_pretrained``), as
    Megatron-LM's load_checkpoint does."""
    if args.load is None and args.pretrained_checkpoint is None:
        return None
    from megatron_snip.training.checkpointing import (
        CheckpointError,
        choose_checkpoint,
        newer_non_persistent,
        read_record,
    )
    from megatron_snip.training.megatron_lm_checkpoint import CannotLoad

    option, source = "--load", args.load
    try:
        if args.load is not None:
            args.load_iteration, notice = choose_checkpoint(args.load, args.ckpt_fallback)
        if args.pretrained_checkpoint is not None and args.load_iteration is None:
            option, source, args.from_pretrained = "--pretrained-checkpoint", args.pretrained_checkpoint, True
            args.load_iteration, notice = choose_checkpoint(source, args.ckpt_fallback)
            if args.load_iteration is None:
                _refuse_hf_directory(source, option)
            require(args.load_iteration is not None,
                    f"--pretrained-checkpoint {source!r} holds no checkpoint (no latest_checkpointed_iteration.txt)"
                    f"{'' if args.load is None else f', nor does --load {args.load!r}'}; fix the path")
        if notice:
            same = os.path.abspath(source) == os.path.abspath(args.save or "")
            args.notices.append(notice + ("; the damaged one is set aside as iter_N.damaged and the tracker names "
                                          "the one loaded" if same else ""))
        newer = newer_non_persistent(source, args.load_iteration) if args.load_iteration is not None else None
        if newer:
            args.notices.append(newer)
        record = read_record(source, args.load_iteration) if args.load_iteration is not None else None
        if record is not None:
            fill_from_checkpoint(args, record.args, source, counted_eod=record.legacy)
        else:
            _refuse_hf_directory(source, option)
    except CannotLoad as e:
        raise ArgumentError(*[f"{option} {source}: {line}" for line in e.problems]) from e
    except (CheckpointError, ValueError) as e:
        raise ArgumentError(str(e)) from e
    return record


def fill_from_checkpoint(args: argparse.Namespace, saved: dict, where: str, *, counted_eod: bool = False) -> None:
    """Fill the shape flags from ``saved`` (a checkpoint's arguments, :mod:`checkpoint_shape`);
    ValueError on a disagreement, naming both values. ``counted_eod``: saved by a megatron-snip whose
    NullTokenizer --vocab-size counted the end-of-document id (``saved`` holds it converted)."""
    preset = PRESETS[args.model_preset].as_args() if args.model_preset else {}
    saved = {**checkpoint_shape.ABSENT, **{k: v for k, v in saved.items() if v is not None}}
    for key in checkpoint_shape.FIXED:
        if saved.get(key) is None:
            continue
        flag = "--" + key.replace("_", "-")
        given = getattr(args, key)
        if (key == "vocab_size" and counted_eod and given == saved[key] + 1
                and saved.get("tokenizer_type") == NULL_TOKENIZER):
            raise ValueError(f"--vocab-size {given}: the checkpoint in {where} was saved by an earlier megatron-snip, "
                             f"whose --vocab-size counted NullTokenizer's end-of-document id ({given} ids); "
                             f"Megatron-LM's --vocab-size, which this program follows, does not: pass --vocab-size "
                             f"{saved[key]} for the same {given} ids, or drop it (the checkpoint gives it)")
        if given is not None and given != saved[key]:
            raise ValueError(f"{flag} {given} disagrees with the checkpoint in {where}, which has {saved[key]}; "
                             f"drop {flag} (the checkpoint defines the model's shape)")
        if given is None and key in preset and preset[key] != saved[key]:
            raise ValueError(f"--model-preset {args.model_preset} sets {flag} {preset[key]} but the checkpoint in "
                             f"{where} has {saved[key]}; drop --model-preset (the checkpoint defines the shape)")
        setattr(args, key, saved[key])
    for key in checkpoint_shape.DEFAULTS:
        if getattr(args, key) is None and saved.get(key) is not None:
            setattr(args, key, saved[key])
    for key in checkpoint_shape.CARRIED:
        if saved.get(key) is not None:
            setattr(args, key, saved[key])
    if args.model_preset is None:
        args.model_preset = saved.get("model_preset") or "checkpoint"


def _refuse_hf_directory(path: str, option: str = "--load") -> None:
    """A Hugging Face model directory given to --load or --pretrained-checkpoint (``option``; a common mistake) is
    named as such, with the converter."""
    import glob

    if os.path.isfile(os.path.join(path, "config.json")) or glob.glob(os.path.join(path, "*.safetensors")):
        raise ArgumentError(
            f"{option} {path!r} is a Hugging Face model directory (config.json / *.safetensors), not a checkpoint; "
            f"convert it once with python tools/convert_hf_llama.py import --load-dir {path} --save-dir CKPT_DIR "
            f"and pass {option} CKPT_DIR")
