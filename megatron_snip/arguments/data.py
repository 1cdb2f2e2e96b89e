"""The training data's flags: one data source (also read from Megatron-LM's --data-args-path and
--per-split-data-args-path files), --split, and the data files against the tokenizer and the vocabulary."""

from __future__ import annotations

import argparse

from megatron_snip.data.config import NULL_TOKENIZER, REFUSED_TOKENIZER_TYPES

from .errors import ArgumentError, require

_PER_SPLIT = ("train_data_path", "valid_data_path", "test_data_path")


def _read_data_args(args: argparse.Namespace) -> None:
    """--data-args-path and --per-split-data-args-path as Megatron-LM reads them: the file's text, split at
    whitespace, is --data-path; the JSON file's train, valid and test entries (a list, or a string split at
    whitespace) are the per-split paths."""
    import json

    if args.data_args_path is not None:
        require(args.data_path is None, "--data-path and --data-args-path: give one (the file holds --data-path's "
                                        "value)")
        try:
            with open(args.data_args_path) as f:
                args.data_path = tuple(f.read().split()) or None
        except OSError as e:
            raise ArgumentError(f"--data-args-path {args.data_args_path}: cannot be read ({e.strerror})") from e
        require(args.data_path is not None, f"--data-args-path {args.data_args_path} is empty: it should hold "
                                            f"--data-path's value (PREFIX, or W1 PREFIX1 W2 PREFIX2 ...)")
    if args.per_split_data_args_path is None:
        return
    given = [f"--{key.replace('_', '-')}" for key in _PER_SPLIT if getattr(args, key) is not None]
    require(not given, f"{given[0] if given else ''} and --per-split-data-args-path: give one (the file holds "
                       f"the per-split paths)")
    path = args.per_split_data_args_path
    try:
        with open(path) as f:
            splits = json.load(f)
        for split, key in zip(("train", "valid", "test"), _PER_SPLIT):
            value = splits[split]
            value = value.split() if isinstance(value, str) else [str(v) for v in value]
            setattr(args, key, tuple(value) or None)
    except OSError as e:
        raise ArgumentError(f"--per-split-data-args-path {path}: cannot be read ({e.strerror})") from e
    except (ValueError, KeyError, TypeError) as e:
        raise ArgumentError(f"--per-split-data-args-path {path}: expected a JSON object with the keys train, valid "
                            f"and test, each a list of paths (and weights) or one string of them "
                            f"({type(e).__name__}: {e})") from e


def validate_data_source(args: argparse.Namespace) -> None:
    """One data source (--data-path, the per-split paths or --mock-data, as in Megatron-LM, also from the files
    that hold them), a tokenizer type read here, and NullTokenizer's size."""
    _read_data_args(args)
    refused = REFUSED_TOKENIZER_TYPES.get(args.tokenizer_type)
    require(refused is None, f"--tokenizer-type {args.tokenizer_type} is not supported: {refused}")
    per_split = [f"--{key.replace('_', '-')}" for key in _PER_SPLIT if getattr(args, key) is not None]
    sources = ["--mock-data"] * args.mock_data + ["--data-path"] * (args.data_path is not None) + per_split[:1]
    require(len(sources) <= 1, f"{' and '.join(sources)}: give one data source (--data-path, the per-split "
            f"--train-data-path / --valid-data-path / --test-data-path, or --mock-data)")
    if per_split:
        require(args.split is None, f"--split {args.split} divides --data-path's documents; with {per_split[0]} "
                "each split has its own data: drop --split (as Megatron-LM requires)")
        require(args.train_data_path is not None or args.skip_train or args.train_iters == 0,
                f"{per_split[0]} without --train-data-path: give the training data too")
        if args.valid_data_path is None:
            args.eval_iters = 0  # as in Megatron-LM: no validation dataset, no evaluation
    if args.tokenizer_type == NULL_TOKENIZER:
        require(args.vocab_size is not None and args.vocab_size >= 1,
                f"--tokenizer-type NullTokenizer needs --vocab-size N >= 1 (ids 0..N-1, then the end-of-document id N, "
                f"as in Megatron-LM), not {args.vocab_size}")


def validate_split(args: argparse.Namespace) -> None:
    """``--split`` parsed as megatron-core parses it; as in Megatron-LM, no validation share means no
    evaluation (``--eval-iters`` becomes 0). Mock data ignores it (megatron-core splits it 1,1,1)."""
    if args.mock_data or any(getattr(args, key) is not None for key in _PER_SPLIT):
        return
    if args.split is None:
        args.split = "969,30,1"  # Megatron-LM's default (its 'legacy' one) with --data-path
    from megatron.core.datasets.blended_megatron_dataset_config import parse_and_normalize_split

    try:
        train, valid, _ = parse_and_normalize_split(args.split)
    except (AssertionError, ValueError, ZeroDivisionError) as e:
        raise ArgumentError(f"--split {args.split!r}: expected up to three shares >= 0, not all 0, "
                            f"train,valid,test (e.g. 969,30,1)") from e
    require(train > 0 or args.skip_train or args.train_iters == 0,
            f"--split {args.split} gives training no documents; give its first field a share")
    if valid == 0:
        args.eval_iters = 0


def check_data_and_tokenizer(args: argparse.Namespace, from_checkpoint: bool, loaded_from: str) -> None:
    """The data files and the tokenizer exist and agree, and the tokenizer fits the vocabulary: a checkpoint's
    (``from_checkpoint``; ``loaded_from`` names where it came from) or --vocab-size."""
    require(args.data_path is not None or args.mock_data or args.train_data_path is not None,
            "--data-path is required: the prefix of a preprocessed dataset (tools/preprocess_data.py), or "
            "--train-data-path (with --valid-data-path, --test-data-path), or --mock-data for megatron-core's "
            "synthetic data")
    no_tokenizer = args.tokenizer_model is None and args.tokenizer_type != NULL_TOKENIZER
    require(not no_tokenizer,
            "--tokenizer-model is required: a sentencepiece .model file (tools/train_tokenizer.py) or, with "
            "--tokenizer-type HuggingFaceTokenizer, a tokenizer.json or the model directory holding it")
    if no_tokenizer:
        return  # nothing to check the data against (and the tokenizer's loader would say the same again)
    try:
        tokens = _data_files_tokens(args)
    except (FileNotFoundError, ValueError) as e:
        raise ArgumentError(str(e)) from e
    if args.tokenizer_type == NULL_TOKENIZER:
        return  # --vocab-size defines this tokenizer
    if from_checkpoint:
        require(args.vocab_size is None or tokens <= args.vocab_size,
                f"--tokenizer-model {args.tokenizer_model} has {tokens} ids but the model in {loaded_from} "
                f"has a vocabulary of {args.vocab_size}; use the model's own tokenizer")
    else:
        require(args.vocab_size in (None, tokens),
                f"--vocab-size {args.vocab_size} differs from the {tokens} ids of --tokenizer-model "
                f"{args.tokenizer_model}, which define the vocabulary here (Megatron-LM ignores --vocab-size for "
                f"this tokenizer type); drop --vocab-size or pass {tokens}")


def _data_files_tokens(args: argparse.Namespace) -> int:
    """Check the tokenizer and the data against each other; returns the tokenizer's size."""
    from megatron_snip.data.datasets import (
        check_data_prefixes,
        check_splits_have_documents,
        check_vocab_covers_data,
        parse_data_path,
    )
    from megatron_snip.data.tokenizer import build_tokenizer

    paths = [args.data_path] if args.data_path is not None else [getattr(args, key) for key in _PER_SPLIT]
    prefixes = [prefix for path in paths if path is not None for prefix in parse_data_path(path)[0]]
    try:
        check_data_prefixes(prefixes)
        if args.data_path is not None:  # mock data ignores --split; per-split data has none
            check_splits_have_documents(prefixes, args.split)
    except (FileNotFoundError, ValueError) as e:
        require(False, str(e))  # a problem of its own: the tokenizer is still checked, and named with it
        prefixes = []
    tokens = build_tokenizer(args.tokenizer_type, args.tokenizer_model, args.vocab_size).vocab_size
    if not prefixes:
        return tokens
    if args.tokenizer_type == NULL_TOKENIZER:
        check_vocab_covers_data(prefixes, tokens, f"--tokenizer-type {NULL_TOKENIZER} --vocab-size {args.vocab_size}",
                                "give --vocab-size the size of the tokenizer the data was preprocessed with, less its "
                                "end-of-document id (N: ids 0..N-1, then the end-of-document id N, as in Megatron-LM)")
    else:
        check_vocab_covers_data(prefixes, tokens, f"--tokenizer-model {args.tokenizer_model}",
                                "rerun tools/preprocess_data.py with this --tokenizer-model")
    return tokens
